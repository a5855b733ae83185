"""One error style for the evaluation command lines (`NAME: error: ...` on one line, exit 2
for usage), lm-eval values refused in one line before any setup, BD3-LM's clipped
perplexity, gen_ppl's per-sample rows. (Bad SFT data in one line: tests/tasks/test_sft.py.)"""

import json
import os
import runpy
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mdjax import evaluate, io
from mdjax.evaluate import gen_ppl, perplexity
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")
BD3LM = os.path.join(FIXTURES, "dit", "bd3lm")
QWEN2 = os.path.join(FIXTURES, "judge", "qwen2")


def _strict_json(text: str):
  """json.loads that refuses NaN and Infinity (strict JSON)."""
  def refuse(name):
    raise AssertionError(f"not strict JSON: {name}")
  return json.loads(text, parse_constant=refuse)


def _error_line(capsys, name: str) -> str:
  """The only line on stderr, which must be `NAME: error: ...`."""
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), lines
  return lines[0]


@pytest.mark.slow
def test_clipped_perplexity_of_a_bd3lm_folder(tmp_path, capsys):
  """The reference stores sampling_eps_min / _max with shape (1,): read as scalars."""
  model = io.load(BD3LM)
  assert model.buffers["sampling_eps_min"].shape == (1,)
  assert perplexity.eps_range(model, True) == (float(np.float32(1e-3)),
                                               float(np.float32(0.999)))
  tokens = tmp_path / "val.npy"
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 2 * 16)
  np.save(tokens, ids.astype(np.int32))
  result = perplexity.main([f"--pretrained={BD3LM}", f"--tokens={tokens}", "--batch_size=2",
                            "--clipped"])
  printed = _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
  assert (printed["t_min"], printed["t_max"]) == perplexity.eps_range(model, True)
  assert printed["stderr"] is None and np.isnan(result["stderr"])  # one batch: no spread
  assert np.isfinite(printed["nelbo_nats_per_token"]) and printed["windows"] == 2


def test_perplexity_errors_are_one_line(tmp_path, capsys, monkeypatch):
  with pytest.raises(SystemExit) as exit_:
    perplexity.main([f"--pretrained={BD3LM}"])
  assert exit_.value.code == 2
  assert "--tokens" in _error_line(capsys, "perplexity")
  # A bad value (here the token file) through the module's own entry: one line, exit 2.
  monkeypatch.setattr(sys, "argv", ["perplexity", f"--pretrained={BD3LM}",
                                    f"--tokens={tmp_path / 'none.npy'}"])
  with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_:
    warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
    runpy.run_module("mdjax.evaluate.perplexity", run_name="__main__")
  assert exit_.value.code == 2
  assert "none.npy' is not a file" in _error_line(capsys, "perplexity")


@pytest.mark.slow
def test_gen_ppl_command_warns_nothing_and_errors_in_one_line(tmp_path):
  """`python -m mdjax.evaluate.gen_ppl`: the package does not import the module first (runpy's
  RuntimeWarning), and a bad --samples is one line with exit status 2."""
  proc = subprocess.run(
      [sys.executable, "-m", "mdjax.evaluate.gen_ppl", f"--judge={QWEN2}",
       f"--samples={tmp_path / 'none.jsonl'}"], cwd=REPO, capture_output=True, text=True,
      timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and lines[0].startswith("gen_ppl: error: samples="), proc.stderr
  assert evaluate.GenPPL is gen_ppl.GenPPL  # the package's names still resolve


def test_gen_ppl_out_rows_hold_the_sample_index(tmp_path, capsys):
  samples = tmp_path / "samples.jsonl"
  samples.write_text("".join(json.dumps({"text": t}) + "\n"
                             for t in ["To be, or not to be", "Hello, world!", "Hi"]))
  out = tmp_path / "rows.jsonl"
  gen_ppl.main([f"--judge={QWEN2}", f"--samples={samples}", "--batch_size=2", f"--out={out}"])
  _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
  rows = [_strict_json(line) for line in out.read_text().splitlines()]
  assert [row["index"] for row in rows] == [0, 1, 2]
  with pytest.raises(SystemExit) as exit_:
    gen_ppl.main([f"--judge={QWEN2}"])
  assert exit_.value.code == 2 and "--samples" in _error_line(capsys, "gen_ppl")


BAD_MODEL_ARGS = [
    ("checkpoint=/nonexistent", "checkpoint='/nonexistent' is not a folder"),
    ("task=two_color,oracle=true,sampler=foo", "sampler='foo' is unknown; known: "),
    ("task=two_color,oracle=true,estimator=foo", "estimator='foo' is unknown; known: "),
    ("task=two_color,oracle=true,num_samples=10,mc_batch_size=4",
     "num_samples=10 must be a multiple of mc_batch_size=4"),
    ("num_samples=8", "give exactly one of checkpoint=DIR"),
    ("task=foo,oracle=true", "task='foo' is unknown; known: "),
    ("task=two_color", "task='two_color' needs oracle=true"),
]


def test_lm_eval_values_are_refused_before_its_setup(capsys):
  pytest.importorskip("lm_eval")
  from mdjax.evaluate import lm_eval as entry
  for model_args, message in BAD_MODEL_ARGS:
    problem = entry.check(["--model_args", model_args, "--tasks", "x"])
    assert problem is not None and message in problem, (model_args, problem)
  assert entry.check(["--model_args", "task=two_color,oracle=true,num_samples=8",
                      "--tasks", "x"]) is None
  with pytest.raises(SystemExit) as exit_:
    entry.main(["--model_args", "checkpoint=/nonexistent", "--tasks", "x"])
  assert exit_.value.code == 2
  assert "checkpoint='/nonexistent'" in _error_line(capsys, "lm_eval")


def test_gen_ppl_deep_samples_line_is_one_line(tmp_path, capsys):
  """A samples line nested 100,000 deep: a RecursionError traceback before; now one line
  naming the file, the line and the bound, exit status 2, before the judge is loaded."""
  samples = tmp_path / "samples.jsonl"
  samples.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
  with pytest.raises(SystemExit) as exit_:
    from mdjax import cli
    cli.run("gen_ppl", lambda: gen_ppl.main([f"--judge={tmp_path / 'no judge'}",
                                             f"--samples={samples}"]))
  assert exit_.value.code == 2
  assert _error_line(capsys, "gen_ppl") == (
      f"gen_ppl: error: samples='{samples}' line 2: nests 100,000 levels of JSON arrays and "
      "objects; at most 256 are read.")
