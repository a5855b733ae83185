"""sample.py: one-line usage errors, --out checked first, exact counts, every family."""

import os
import subprocess
import sys

import pytest

from mdjax import sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_usage_errors_are_one_line_with_status_2():
  # One real process: absl alone prints the whole flag list before the message.
  for flags, expected in (
      (["--steps=abc"], "--steps"),
      (["--sampler=confidence", "--gamma=0.3"], "--gamma does not apply to --sampler=confidence"),
  ):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--task=two_color",
                           "--oracle", *flags], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sample.py: error: "), proc.stderr[-2000:]
    assert expected in lines[0], lines


@pytest.mark.parametrize("flags,expected", [
    (["--sampler=confidence", "--gamma=0.3"], "--gamma does not apply to --sampler=confidence"),
    (["--sampler=random_order", "--steps=4"], "--steps does not apply"),
    (["--sampler=ancestral", "--k=3"], "--k does not apply"),
    (["--sampler=ancestral", "--order=[VOA]"], "--order does not apply"),
    (["--sampler=ancestral", "--block_length=7", "--task=scan_and_add"], "block_length"),
    (["--sampler=ancestral", "--block_length=0"], "block_length"),
    (["--sampler=field_order"], "needs a task with named fields"),
    (["--sampler=field_order", "--task=scan_and_add"], "needs --order"),
    (["--sampler=field_order", "--order=[VOA]", "--task=scan_and_add"], "unwritten"),
    (["--sampler=ordered", "--groups=0;x"], "--groups"),
    (["--sampler=local_remask", "--base=nope"], "--base=nope"),
    (["--sampler=speculative", "--order=position"], "--order='position' is invalid"),
    (["--sampler=confidence", "--steps=0"], "--steps=0"),
    (["--cfg_scale=1.5"], "--cfg_scale applies only with --pretrained"),
    (["--sampler=remask", "--kv_cache=dual"], "the remask family decodes no blocks"),
    (["--sampler=confidence", "--kv_cache=dual"], "needs blocks: set block_length"),
    (["--sampler=confidence", "--refresh_every=2"], "applies only with a KV cache"),
    (["--sampler=confidence", "--kv_cache=prefix"], "--kv_cache"),
])
def test_bad_sampler_flags_are_usage_errors(sample_cli, flags, expected):
  proc = sample_cli("--task=two_color", "--oracle", *flags)
  assert proc.returncode == 1 and expected in proc.stderr, proc.stderr[-2000:]
  assert "batch 1/" not in proc.stdout


def test_unwritable_out_fails_before_sampling(sample_cli, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  proc = sample_cli("--task=two_color", "--oracle", f"--out={blocker}")
  assert proc.returncode == 1 and f"--out={str(blocker)!r} is not a writable" in proc.stderr
  assert "batch 1/" not in proc.stdout


@pytest.mark.slow
def test_exactly_num_samples_are_drawn(sample_cli, tmp_path, monkeypatch):
  import sample
  shapes = []
  real = sampling.sample
  monkeypatch.setattr(sample.sampling, "sample",
                      lambda fn, p, k, canvas, *a, **kw: shapes.append(canvas.shape[0])
                      or real(fn, p, k, canvas, *a, **kw))
  proc = sample_cli("--task=two_color", "--oracle", "--num_samples=250", "--batch_size=100",
                    f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert shapes == [100, 100, 50]
  assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 250
  shapes.clear()
  assert sample_cli("--task=two_color", "--oracle", "--num_samples=7").returncode == 0
  assert shapes == [7]  # not a whole batch of 1000


FAMILY_FLAGS = {
    "ancestral": ["--steps=10", "--block_length=5"],
    "bd3lm": ["--steps=25", "--temperature=0.5"],
    "confidence": ["--steps=5", "--threshold=0.9"],
    "defer": ["--steps=5"],
    "diffusion_gemma": ["--noise=uniform", "--steps=8"],  # uniform-noise models only
    "diffusion_gemma_canvases": ["--noise=uniform", "--steps=4", "--reference_length=5",
                                 "--canvases=5"],  # five canvases of the 25 positions
    "dream": ["--steps=10", "--temperature=0"],
    "entropy_bounded": ["--steps=10", "--gamma=0.3", "--block_length=5", "--kv_cache=dual",
                        "--refresh_every=2"],
    "fast_dllm_v2": ["--steps=10", "--threshold=0.9"],
    "field_order": ["--order=[VOA][v×9]o×10[ht1]"],
    "learned_commit": ["--steps=10", "--block_length=5", "--filter_file=" + os.path.join(
        ROOT, "tests", "fixtures", "learned_commit", "width5.json")],  # example_filter(5)
    "llada21": ["--threshold=0.7", "--editing_threshold=0.5", "--max_post_steps=2",
                "--block_length=5"],
    "local_remask": ["--steps=5", "--refill_steps=3", "--rounds=1", "--window=1"],
    "mdlm": ["--steps=10", "--eps=0.01"],
    "order_policy": ["--steps=5", "--policy_file=" + os.path.join(
        ROOT, "tests", "fixtures", "order_policy", "length25.json")],  # example_policy(25)
    "ordered": ["--groups=0-4;5-14;15-24"],
    "random_order": [],
    "remask": ["--steps=6", "--eta=0.02"],
    "revision": ["--steps=5"],
    "speculative": ["--k=3"],
    "uniform_ancestral": ["--noise=hybrid", "--steps=8"],
    "left_to_right": [],
}


@pytest.mark.parametrize("family", sorted(FAMILY_FLAGS))
@pytest.mark.slow
def test_every_family_is_choosable(sample_cli, family):
  assert set(FAMILY_FLAGS) == set(sampling.families()) | {"left_to_right"}
  proc = sample_cli("--task=scan_and_add", "--oracle", f"--sampler={family}",
                    *FAMILY_FLAGS[family], "--num_samples=4", "--batch_size=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "well_formed" in proc.stdout or "correct" in proc.stdout, proc.stdout[-2000:]


def test_prompts_and_live_take_ids_on_an_id_only_workdir(sample_cli, id_workdir, tmp_path):
  """On a workdir without text (the quickstart's ScanAndAdd), --prompts with id lines was
  refused ("--prompts needs a text task; --task=scan_and_add has no text encoding", naming a
  --task never given, and the same for a missing file), and --live had no way to take ids.
  Now both take ids, completing them as `mdjax.generate(model, [[10, 1, 2]], ...)` does."""
  import json

  import jax

  import mdjax

  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": [10, 1, 2]}\n{"prompt": [10]}\n')
  proc = sample_cli(f"--workdir={id_workdir}", f"--prompts={prompts}", "--max_new_tokens=4",
                    "--steps=4", f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
  assert [row["prompt"] for row in rows] == [[10, 1, 2], [10]]
  model = mdjax.load(str(id_workdir))
  assert "sampler=ConfidenceSpec(" in proc.stdout, proc.stdout
  # Without --sampler, the workdir's own sampler (config.sampler), as mdjax.generate's default.
  assert model.sampler.family == "confidence"
  out = mdjax.generate(model, [[10, 1, 2], [10]], max_new_tokens=4, key=jax.random.key(0),
                       steps=4)
  assert [row["token_ids"] for row in rows] == [ids.tolist() for ids in out.token_ids]

  missing = tmp_path / "nowhere.jsonl"
  proc = sample_cli(f"--workdir={id_workdir}", f"--prompts={missing}", "--max_new_tokens=4")
  assert proc.returncode == 1 and f"--prompts={str(missing)!r}: no such file." in proc.stderr
  text = tmp_path / "text.jsonl"
  text.write_text('{"prompt": [10]}\n{"prompt": "VALS 1"}\n')
  proc = sample_cli(f"--workdir={id_workdir}", f"--prompts={text}", "--max_new_tokens=4")
  assert proc.returncode == 1 and "--task" not in proc.stderr, proc.stderr
  assert f"--prompts={str(text)!r} line 2 is text" in proc.stderr, proc.stderr
  assert "give token ids, a list of integers such as [10, 1, 2]" in proc.stderr

  proc = sample_cli(f"--workdir={id_workdir}", "--live=[10, 1, 2]", "--max_new_tokens=4",
                    "--steps=4", "--seed=3")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "--- [10, 1, 2] -> " in proc.stdout, proc.stdout[-2000:]
  proc = sample_cli(f"--workdir={id_workdir}", "--live=VALS 1", "--max_new_tokens=4")
  assert proc.returncode == 1 and "--live='VALS 1' is text" in proc.stderr, proc.stderr
