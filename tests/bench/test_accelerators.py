"""mdjax.bench.accelerators: a tiny run's schema (results/parallelism.json's points plus
method, trained, teacher, temperature), the oracle's part and the trained teacher's (its
students, the combined ratio). The frontier's arithmetic: tests/accelerators/test_frontier.py."""

import json

import jax
import numpy as np
import pytest

import mdjax
from mdjax import sampling
from mdjax.bench import accelerator_models, accelerator_points, accelerators, parallelism

SCHEMA = {"task", "accuracy", "accuracy_se", "tpf", "tpf_se", "method", "trained", "teacher",
          "temperature", "family", "knobs", "rows", "generated", "mean_forwards"}


@pytest.mark.slow
def test_a_tiny_run_writes_the_schema(tmp_path):
  out = tmp_path / "acc.json"
  results = accelerators.main(["--task", "sudoku4", "--sizes", "tiny", "--rows", "16", "--train_rows", "12",
                               "--epochs", "20", "--temperatures", "0", "--teacher_steps", "2",
                               "--student_steps", "2", "--student_prompts", "64",
                               "--workdir", str(tmp_path / "runs"),
                               "--out", str(out)], log=lambda *a: None)
  written = json.loads(out.read_text())
  assert written["config"]["task"] == "sudoku4" and written["config"]["rows"] == 16
  by_teacher = {}
  for p in written["points"]:
    assert SCHEMA <= set(p), sorted(SCHEMA - set(p))
    assert 0 <= p["accuracy"] <= 1 and p["tpf"] >= 1 and p["rows"] == 16
    by_teacher.setdefault(p["teacher"], set()).add((p["method"], p["trained"]))
  free = {("confidence_threshold", False), ("ancestral", False), ("egp_oracle", False),
          ("learned_commit", True)}
  # UPO's learned order and its untrained start: on sudoku4's oracle at temperature 0.
  assert by_teacher["oracle"] == free | {("order_policy", True), ("order_policy_untrained", False)}
  assert by_teacher["trained"] == free | {("dparallel", True), ("d3llm", True), ("cdlm", True),
                                          ("order_policy", True), ("order_policy_untrained", False)}
  assert set(written["models"]) == {"teacher", "dparallel", "d3llm", "cdlm"}
  cdlm_points = [p for p in written["points"] if p["method"] == "cdlm"]
  assert all(p["knobs"]["block_length"] == 8 and p["knobs"]["kv_cache"] == "exact"
             for p in cdlm_points)
  assert written["models"]["dparallel"]["steps"] == 2
  assert {written["models"][s]["num_prompts"] for s in ("dparallel", "d3llm", "cdlm")} == {64}
  assert written["filters"]["oracle 0.0"]["params"] == 2 * 16 * 32 + 32 + 16
  assert set(written["aup"]["sudoku4"]) == {"oracle", "trained"}
  trained_rows = [r for r in written["equal_calls"] if r["teacher"] == "trained"]
  # the filter's 2 points, each student's 2, the learned order's 2 (tiny: K = 2; tau 1, 0)
  assert len(trained_rows) == 2 + 3 * 2 + 2
  assert all("to_exact" in r or r["training_free"] is None for r in trained_rows)
  combined = written["combined"]
  assert combined["student"] in ("dparallel", "d3llm")
  for kv, variant in combined["variants"].items():
    assert kv in ("none", "dual", "teacher_threshold", "exact", "blocks")
    assert variant["point"]["accuracy"] >= 0
    assert variant["calls_ratio"] == pytest.approx(
        combined["baseline"]["mean_forwards"] / variant["point"]["mean_forwards"])
  if set(combined["variants"]) & {"none", "dual", "exact", "blocks"}:
    assert written["combined_ratio"] == combined["wall_ratio_batch1"] > 0
    assert written["combined_calls_ratio"] == combined["calls_ratio"]
  assert results["points"] == written["points"]
  assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # --only=cdlm,order_policy: the same student loaded again and the policy trained again on
  # the same teacher give the same points (their timings aside; the policy's replaced ones
  # now after the student's), the rest kept.
  again = accelerators.main(["--only", "cdlm,order_policy", "--student_steps", "2",
                             "--workdir", str(tmp_path / "runs"), "--out", str(out)],
                            log=lambda *a: None)
  untimed = lambda points: sorted(json.dumps({k: v for k, v in p.items() if k != "seconds"},
                                             sort_keys=True) for p in points)
  assert untimed(again["points"]) == untimed(written["points"])
  assert again["updated"]["only"] == ["cdlm", "order_policy"] and "exact_cache" in again["combined"]
  assert again["models"]["teacher"] == written["models"]["teacher"]
  with pytest.raises(ValueError, match="not what it computes again"):
    accelerators.main(["--only", "d3llm", "--out", str(out)], log=lambda *a: None)


@pytest.mark.slow
def test_calls_of_a_blocked_spec_are_the_calls_of_a_batch_of_one():
  # Blocks of 4 with a threshold on sudoku4's oracle: a block finished early leaves its row
  # idle until the next block, steps a batch of one skips (and `rounds_B` counts); each row
  # alone makes as many calls as it has distinct write steps. (With the exact cache of a
  # block-causal model the calls are the same: the finished block's append rides on the
  # next block's first call.)
  oracle = mdjax.load("sudoku4")
  canvas = np.array(oracle.task.sample_data(jax.random.key(1), 6))
  canvas[:, 16:] = oracle.mask_id
  spec = sampling.ConfidenceSpec(steps=16, threshold=0.99, block_length=4, temperature=0.0)
  out = sampling.sample(oracle.denoiser, oracle.params, jax.random.key(0), canvas, spec,
                        mask_id=oracle.mask_id)
  calls = accelerator_points.block_calls(spec, out.write_step_BxL, 16)
  alone = [int(sampling.sample(oracle.denoiser, oracle.params, jax.random.key(0),
                               canvas[i:i + 1], spec, mask_id=oracle.mask_id).nfe)
           for i in range(6)]
  np.testing.assert_array_equal(calls, alone)
  assert calls.max() < 16 and (np.asarray(out.rounds_B) > calls).any()
  assert accelerator_points.block_calls(sampling.ConfidenceSpec(steps=16), out.write_step_BxL,
                                  16) is None


def _task_run(task: str, ratio: float, points: int) -> dict:
  """One task's bench result, reduced to what merging reads."""
  return {"config": {"task": task}, "models": {task: points}, "filters": {}, "seconds": 1.0,
          "points": [{"task": task, "row": i} for i in range(points)],
          "equal_calls": [{"task": task}], "aup": {task: {"oracle": {}}},
          "combined": {"wall_ratio_batch1": ratio, "calls_ratio": 2 * ratio},
          "combined_ratio": ratio, "combined_calls_ratio": 2 * ratio}


def test_a_task_run_is_merged_into_the_file_its_other_tasks_kept():
  first = accelerators.merged(None, _task_run("sudoku4", 3.0, 2))
  both = accelerators.merged(first, _task_run("scan_and_add", 5.0, 3))
  assert both["config"]["task"] == "sudoku4" and both["models"] == {"sudoku4": 2}
  assert both["tasks"]["scan_and_add"]["models"] == {"scan_and_add": 3}
  assert [p["task"] for p in both["points"]] == ["sudoku4"] * 2 + ["scan_and_add"] * 3
  assert [r["task"] for r in both["equal_calls"]] == ["sudoku4", "scan_and_add"]
  assert set(both["aup"]) == {"sudoku4", "scan_and_add"}
  # combined_ratio: the largest over the tasks, its task named
  assert (both["combined_ratio"], both["combined_calls_ratio"], both["combined_task"]) == (
      5.0, 10.0, "scan_and_add")
  again = accelerators.merged(both, _task_run("scan_and_add", 1.0, 1))  # its rows replaced
  assert [p["task"] for p in again["points"]] == ["sudoku4"] * 2 + ["scan_and_add"]
  assert (again["combined_ratio"], again["combined_task"]) == (3.0, "sudoku4")
  top = accelerators.merged(again, _task_run("sudoku4", 0.5, 1))  # the first task's again
  assert top["tasks"] == again["tasks"] and top["models"] == {"sudoku4": 1}
  assert [p["task"] for p in top["points"]] == ["scan_and_add", "sudoku4"]
  assert (top["combined_ratio"], top["combined_task"]) == (1.0, "scan_and_add")


def test_students_take_their_teachers_task_and_sudoku4s_configs_are_unchanged():
  modules = accelerator_models.config_modules(
      dict(sudoku4="sudoku4_teacher", scan_and_add="scan_and_add_cpu",
           **accelerator_models.STUDENT_CONFIGS))
  sudoku4, scan = (modules[t].get_config() for t in ("sudoku4", "scan_and_add"))
  for name in accelerator_models.STUDENTS:
    as_written = modules[name].get_config()
    as_written.update(seed=0, eval_at_end=False)
    as_written.train.init_from = as_written.distill.teacher = "/runs/teacher"
    given = accelerator_models.student_config(
        modules[name], sudoku4, "/runs/teacher", accelerator_models.setting("sudoku4"),
        seed=0, prompt_length=16, generated=16)
    assert given.to_dict() == as_written.to_dict(), name
    on_scan = accelerator_models.student_config(
        modules[name], scan, "/runs/teacher", accelerator_models.setting("scan_and_add"),
        seed=0, prompt_length=0, generated=25)
    assert (on_scan.task, on_scan.task_kwargs.to_dict()) == ("scan_and_add", {"max_command_id": 1})
    assert on_scan.distill.prompt_length == 0 and on_scan.distill.temperature == 1.0
    assert (on_scan.sampler.steps, on_scan.sampler.temperature) == (25, 1.0)
  assert on_scan.model.block_size == on_scan.sampler.block_length == 5  # cdlm: 25 = 5 x 5
  with pytest.raises(ValueError, match="two_color.*trained teacher exists for"):
    accelerator_models.setting("two_color")


def test_every_setting_trains_its_teacher_on_the_oracle_tasks_sizes():
  oracle = {t.name: t for t in parallelism.oracle_tasks("full")}
  for task, setting in accelerator_models.SETTINGS.items():
    config = accelerator_models.teacher_config_of(setting)
    assert config.task == task
    accelerator_models.check_sizes(setting, oracle[task].task)  # raises on a mismatch
    # CDLM's blocks tile the sequence, the prompt (if any) whole in its first blocks
    length, prompt = oracle[task].task.length, oracle[task].prompt_length
    assert length % setting.cdlm_block == 0 and prompt % setting.cdlm_block == 0, task
  tiny = {t.name: t for t in parallelism.oracle_tasks("tiny")}
  with pytest.raises(ValueError, match="permutation.*length 6.*has 3"):
    accelerator_models.check_sizes(accelerator_models.SETTINGS["permutation"],
                                   tiny["permutation"].task)
  with pytest.raises(ValueError, match="task='sudoku4' must be one of"):
    accelerator_models.config_modules({"t": "oracle_task_teacher"})["t"].get_config("sudoku4")


def test_only_refuses_what_it_cannot_compute_before_any_work(tmp_path):
  path = tmp_path / "acc.json"
  path.write_text(json.dumps({"config": {"task": "scan_and_add"}}))
  with pytest.raises(ValueError, match=r"--only=d3llm: not what it computes again"):
    accelerators.update(str(path), ["d3llm"], workdir=None)
  # the learned order is sudoku4's (greedy); a file led by ScanAndAdd (temperature 1) is refused
  with pytest.raises(ValueError, match=r"order_policy.*sudoku4 at temperature 0.*'scan_and_add'"):
    accelerators.update(str(path), ["order_policy"], workdir=None)
