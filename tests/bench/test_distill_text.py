"""`python -m mdjax.bench.distill_text`'s pieces: the students' configs, the differences to the
teacher's best sampler, and a sampled row on the session's tiny text model."""

import math

import jax
import numpy as np
import pytest

import mdjax
from mdjax import evaluate, sampling
from mdjax.accelerators import distill
from mdjax.bench import distill_text, duo, noise_text


@pytest.mark.parametrize("name", sorted(distill_text.STUDENTS))
def test_student_config_is_the_distill_config_moved_to_prompt_less_text(name):
  config = distill_text.student_config(name, "/tmp/teacher", steps=7, num_prompts=128)
  assert config.objective == name and config.task == "text"
  assert config.task_kwargs.corpus == "shakespeare" and config.task_kwargs.length == 64
  assert config.train.init_from == config.distill.teacher == "/tmp/teacher"
  assert config.train.num_steps == config.checkpoint.every == 7
  opts = distill.options(config)  # the objective's own checks accept it
  assert (opts["prompt_length"], opts["temperature"], opts["num_prompts"]) == (0, 1.0, 128)
  assert opts["teacher_sampler"] == "ancestral" and opts["entropy_weight"] == 2.0
  # The workdir's own sampler: text at temperature 1 (not one greedy row), 64 characters.
  assert (config.sampler.temperature, config.sampler.steps, config.eval_at_end) == (1.0, 64, True)
  side = distill_text.student_config(name, "/tmp/teacher", 7, 128, {"entropy_weight": 0.0})
  assert distill.options(side)["entropy_weight"] == 0.0
  side.distill.entropy_weight = 2.0
  assert side.to_dict() == config.to_dict()  # the override is its one change


def _row(process, sampler, steps, gen_ppl, se, entropy=2.0, calls=None, adaptive=False):
  return {"process": process, "sampler": sampler, "knobs": {}, "steps": steps,
          "gen_ppl": gen_ppl, "gen_ppl_se": se, "entropy": entropy, "entropy_se": 0.1,
          "calls": steps if calls is None else calls, "adaptive": adaptive}


def test_differences_are_to_the_teachers_lowest_gen_ppl_within_the_budget():
  rows = [_row("teacher", "a", 4, 10.0, 1.0), _row("teacher", "b", 4, 8.0, 2.0, entropy=1.5),
          _row("teacher", "a", 8, 6.0, 1.0), _row("teacher", "b", 8, 7.0, 1.0),
          _row("teacher", "e", 64, 5.0, 1.0, calls=9.0, adaptive=True),
          _row("teacher", "pool", 64, 1.0, 1.0), _row("teacher", "reference_pool", 64, 1.0, 1.0),
          dict(_row("teacher", "a_t0.8", 4, 0.5, 1.0), knobs={"temperature": 0.8}),
          _row("dparallel", "a", 4, 7.0, 1.0), _row("d3llm", "b", 8, 9.0, 2.0),
          _row("d3llm", "e", 64, 4.0, 1.0, calls=3.5, adaptive=True),
          _row("dparallel", "e", 64, 4.0, 1.0, calls=9.5, adaptive=True)]
  first, second, third, fourth = distill_text.differences(rows)
  # K = 4: the teacher's best within 4 calls is b (8 < 10): 7 - 8 = -1 ± sqrt(1 + 4); the
  # same sampler a: 7 - 10 = -3 ± sqrt(2).
  assert (first["student"], first["teacher_sampler"], first["budget"]) == ("dparallel", "b", 4)
  assert first["gen_ppl_diff"] == pytest.approx(-1.0)
  assert first["gen_ppl_diff_se"] == pytest.approx(math.sqrt(5.0))
  assert first["gen_ppl_z"] == pytest.approx(-1.0 / math.sqrt(5.0))
  assert first["entropy_diff"] == pytest.approx(0.5)
  assert first["entropy_diff_se"] == pytest.approx(math.sqrt(0.02))
  assert first["same_sampler_gen_ppl_diff"] == pytest.approx(-3.0)
  assert first["same_sampler_gen_ppl_diff_se"] == pytest.approx(math.sqrt(2.0))
  # K = 8: within 8 calls the best is a at K = 8 (6); the adaptive e takes 9 calls.
  assert (second["teacher_sampler"], second["teacher_steps"]) == ("a", 8)
  assert second["gen_ppl_diff"] == pytest.approx(3.0)
  # An adaptive student row at 3.5 calls: no teacher row within it.
  assert third["budget"] == 3.5 and third["teacher_sampler"] is None
  assert "gen_ppl_diff" not in third and third["same_sampler_gen_ppl_diff"] == -1.0
  # At 9.5 calls the teacher's adaptive row (9 calls) is the best; its pools and its cooler
  # rows are no candidates.
  assert (fourth["teacher_sampler"], fourth["teacher_calls"]) == ("e", 9.0)
  assert fourth["gen_ppl_diff"] == pytest.approx(-1.0)


def test_sampled_rows_are_generates_samples_with_their_calls(trained):
  root, _ = trained
  model = mdjax.load(str(root / "char"))
  judge = evaluate.load_judge(str(root / "causal"))
  n, length = 6, model.task.length
  points = distill_text.points((4,), length)
  # Each fixed sampler at K = 4; the first adaptive point (the EB-sampler's smallest gamma)
  # and the last (the lowest threshold), bounded by the canvas.
  adaptive = [p for p in points if p[4]]
  points = [p for p in points if not p[4]] + [adaptive[0], adaptive[-1]]
  assert [p[3] for p in points] == [4, 4, length, length]
  for label, family, knobs, steps, adaptive in points:
    row = distill_text.sampled_row("teacher", model, judge, label, family, knobs, steps, n,
                                   length, adaptive)
    out = mdjax.generate(model, [""] * n, max_new_tokens=length, key=jax.random.key(0),
                         spec=sampling.make_spec(family, steps=steps, **knobs))
    # The draws are generate's, row for row: the judge scores the same texts.
    assert row["example"] == out.texts[0] and row["samples"] == n, label
    assert row["gen_ppl"] == pytest.approx(noise_text.scored(out.texts, judge)["gen_ppl"])
    assert 0.0 <= row["entropy"] <= math.log(length) + 1e-9, row
    # Every sample takes between 1 and `steps` calls (ancestral's row stops when it is
    # written); confidence's K steps each write their scheduled count: K calls.
    assert 1.0 <= row["calls"] <= steps and row["adaptive"] == adaptive, row
    if label == "confidence":
      assert (row["calls"], row["calls_se"]) == (steps, 0.0), row
    assert np.isfinite(row["calls_se"])


def test_the_pool_rows_sample_as_the_students_teacher_and_the_references_decode():
  opts = distill.options(distill_text.student_config("d3llm", "/tmp/teacher"))
  _, family, knobs = distill_text.POOL
  assert sampling.make_spec(family, steps=64, **knobs) == distill.teacher_spec(64, opts)
  _, family, knobs = distill_text.REFERENCE_POOL
  references = dict(opts, teacher_sampler=distill.TEACHER_SAMPLERS[0])  # the default
  assert sampling.make_spec(family, steps=64, **knobs) == distill.teacher_spec(64, references)


def test_judged_gives_each_models_nelbo_the_judge_and_the_held_out_row(trained):
  from experiments.tiny_text import tiny_config
  root, corpus = trained
  model = mdjax.load(str(root / "char"))
  lines = []
  nelbo, judge, judge_row, reference = duo.judged({"a": model}, str(root / "causal"),
                                                  tiny_config(corpus, causal=True),
                                                  lines.append)
  windows = model.task.validation_windows(noise_text.WINDOWS)
  assert nelbo["a"] == noise_text.validation_nelbo(model, windows)
  assert judge_row["steps"] == 30 and judge_row["workdir"] == str(root / "causal")
  assert reference == noise_text.reference_row(model.task, judge, windows)
  assert lines[0].startswith("a ") and lines[-2] == noise_text.TABLE_HEADER


def test_the_cooler_rows_are_the_teachers_fixed_samplers_at_lower_temperatures():
  points = distill_text.cooler_points((4, 8))
  assert len(points) == len(distill_text.COOLER) * len(distill_text.FIXED) * 2
  label, family, knobs, steps, adaptive = points[0]
  assert (label, family, knobs, steps, adaptive) == (
      f"ancestral_t{distill_text.COOLER[0]}", "ancestral",
      {"temperature": distill_text.COOLER[0]}, 4, False)
  assert {p[2]["temperature"] for p in points} == set(distill_text.COOLER)
