"""`python -m mdjax.bench.noise_text`'s generative-perplexity part at a tiny size: the rows'
schema and ranges, and the standard error of a ratio of sums."""

import math

import numpy as np
import pytest

import mdjax
from mdjax import evaluate, train
from mdjax.bench import noise_text

KEYS = {"process", "sampler", "knobs", "steps", "gen_ppl", "gen_ppl_se", "bits_per_char",
        "entropy", "entropy_se", "samples", "judge", "example"}
SAMPLED_KEYS = KEYS | {"nfe", "seconds"}


def test_ratio_se_is_the_delta_method_standard_error():
  # Equal denominators: the standard error of the mean of a_i / b_i.
  a_N, b_N = np.array([1.0, 2.0, 3.0]), np.ones(3)
  assert noise_text.ratio_se(a_N, b_N) == pytest.approx(np.std(a_N, ddof=1) / math.sqrt(3))
  # Unequal ones, by hand: r = 6/4, residuals a - r b = (-0.5, 2, -1.5): their squares sum to
  # 6.5; sqrt(6.5 / (3 * 2)) / mean(b) = sqrt(13/12) * 3/4.
  assert noise_text.ratio_se(np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 3.0])) == (
      pytest.approx(math.sqrt(13 / 12) * 3 / 4))


def _tiny(text_path, noise=None, causal=False):
  from experiments.tiny_text import tiny_config
  c = tiny_config(text_path, causal=causal)
  c.train.update(num_steps=4, warmup_steps=1)
  c.update(num_eval_samples=0, log_every=4, eval_at_end=False)
  c.checkpoint.every = 4
  if noise is not None:
    c.noise = noise
    c.model.time_conditioning = True
  return c


@pytest.mark.slow
def test_tiny_gen_ppl_rows_have_the_schema_and_numbers_in_range(tmp_path):
  from experiments.tiny_text import write_corpus
  text_path = write_corpus(tmp_path / "corpus.txt")
  models = {}
  for process in noise_text.PROCESSES:
    path = str(tmp_path / process)
    train.ensure_trained(_tiny(text_path, noise=process), path)
    models[process] = mdjax.load(path)
  train.ensure_trained(_tiny(text_path, causal=True), str(tmp_path / "judge"))
  judge = evaluate.load_judge(str(tmp_path / "judge"))
  task = models["absorbing"].task
  length, samples = task.length, 4

  reference = noise_text.reference_row(task, judge, task.validation_windows(samples))
  rows = noise_text.gen_ppl_rows(models, judge, steps=(2,), num_samples=samples,
                                 length=length, log=lambda *_: None)
  assert set(reference) == KEYS and all(set(r) == SAMPLED_KEYS for r in rows)
  assert [(r["process"], r["sampler"]) for r in rows] == [
      (p, label) for p in noise_text.PROCESSES for label, _, _ in noise_text.SAMPLERS[p]]
  for r in [reference] + rows:
    assert r["samples"] == samples and r["judge"] == "mdjax:judge"
    assert math.isfinite(r["gen_ppl"]) and r["gen_ppl"] >= 1.0, r
    assert r["bits_per_char"] == pytest.approx(math.log2(r["gen_ppl"]))
    assert math.isfinite(r["gen_ppl_se"]) and r["gen_ppl_se"] >= 0.0, r
    # A sample's unigram entropy over `length` characters lies in [0, log(length)].
    assert 0.0 <= r["entropy"] <= math.log(length) + 1e-9, r
    assert math.isfinite(r["entropy_se"]) and r["entropy_se"] >= 0.0, r
  for r in rows:
    assert r["steps"] == 2 and len(r["example"]) == length
  png = noise_text.plot([reference] + rows, str(tmp_path / "noise_text.png"))
  assert (tmp_path / "noise_text.png").stat().st_size > 0 and png.endswith(".png")
  # Samples differ from one another: the standard errors are not all zero.
  assert any(r["gen_ppl_se"] > 0 for r in rows) and any(r["entropy_se"] > 0 for r in rows)
