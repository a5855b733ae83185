"""The RL trainer (`mdjax.rl.trainer`, objectives 'grpo' and 'wd1') through `train.train`: a
2-step run on a tiny Sudoku 4x4 model, its metrics, a resume after SIGTERM, the refusals,
a reward that raises, and `mdjax.load` of the result. Tiny shapes: every run of the module
shares one set of compiled programs (`trainer._programs`, the sampler's)."""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

import mdjax
from configs import grpo as grpo_config
from configs.base import base_config
from mdjax import lora, sampling, train
from mdjax.rl import rewards, sources, trainer
from mdjax.tasks import sudoku4
from mdjax.train import objectives
from mdjax.train.config_checks import ConfigError

pytestmark = pytest.mark.slow

RAISES = "test_trainer_raises_at_row_3"


def _raises(prompt, completion, target):
  """Raises at its 4th call: `rewards.compute` scores rows in order, so at row 3."""
  del prompt, completion, target
  _raises.calls += 1
  if _raises.calls == 4:
    raise ZeroDivisionError("row three")
  return 0.0


_raises.calls = 0
if RAISES not in rewards.names():
  rewards.register(RAISES)(_raises)


def _quiet(*args, **kwargs):
  del args, kwargs


@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """A sudoku4 workdir trained 2 steps by the existing loop (the NELBO)."""
  workdir = str(tmp_path_factory.mktemp("rl") / "start")
  c = base_config()
  c.task = "sudoku4"
  c.batch_size = 8
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  c.train.update(num_steps=2, warmup_steps=0)
  c.checkpoint.every = 2
  c.log_every = 2
  c.eval_batches = 1
  c.num_eval_samples = 0
  train.train(c, workdir, log=_quiet)
  return workdir


def _config(start, steps=2, **rl):
  c = grpo_config.get_config()
  c.train.update(init_from=start, num_steps=steps, lr=3e-2)
  c.batch_size = 4  # 2 prompts x G = 2
  c.checkpoint.every = 10
  # d1's Sudoku reward (the fraction of blank cells right): an untrained model's completions
  # differ in it, so the advantages, and the updates, are not zero.
  c.rl.update(num_generations=2, num_iterations=2, beta=0.04, rewards=["sudoku"])
  c.rl.update(**rl)
  c.sampler.update(steps=2)
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def runs(start, tmp_path_factory):
  """An uninterrupted 2-step run, and one stopped by SIGTERM during step 1, then resumed by
  the same command."""
  root = tmp_path_factory.mktemp("rl_runs")
  whole, resumed = str(root / "whole"), str(root / "resumed")
  final = train.train(_config(start), whole, log=_quiet)
  real_score = trainer.score
  calls = []

  def score_then_signal(*args, **kwargs):  # SIGTERM arrives while step 1 runs
    calls.append(1)
    if len(calls) == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real_score(*args, **kwargs)

  patch = pytest.MonkeyPatch()
  patch.setattr(trainer, "score", score_then_signal)
  stopped = train.train(_config(start), resumed, log=_quiet)
  patch.undo()
  stopped_rows = _rows(resumed)
  again = train.train(_config(start), resumed, log=_quiet)
  return dict(whole=whole, resumed=resumed, final=final, stopped=stopped,
              stopped_rows=stopped_rows, again=again)


def test_run_logs_the_metrics_of_every_step(runs):
  rows = _rows(runs["whole"])
  assert [r["step"] for r in rows] == [1, 2]
  for row in rows:
    for name in ("reward_mean", "reward_std", "kl", "clip_ratio", "completion_length",
                 "rollout_seconds", "update_seconds", "rollout_fraction", "loss"):
      assert np.isfinite(row[name]), (name, row)
    assert row["completion_length"] == 16  # no EOS in Sudoku: every cell counts
    assert 0 <= row["reward_mean"] <= 1 and 0 < row["rollout_fraction"] < 1
  # The reference is the start: the policy moved away from it by step 2 (lr 3e-2).
  assert rows[1]["kl"] > 0
  assert int(runs["final"].step) == 2


def test_sigterm_saves_and_the_same_command_resumes_bitwise(runs):
  assert int(runs["stopped"].step) == 1
  assert [r["step"] for r in runs["stopped_rows"]] == [1]
  assert [r["step"] for r in _rows(runs["resumed"])] == [1, 2]
  # Every draw of a step is a function of (seed, step) and the programs are the same:
  # the resumed run's parameters equal the uninterrupted run's bit for bit.
  for a, b in zip(jax.tree.leaves(runs["final"].params), jax.tree.leaves(runs["again"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  whole, resumed = _rows(runs["whole"]), _rows(runs["resumed"])
  assert whole[1]["reward_mean"] == resumed[1]["reward_mean"]
  assert whole[1]["loss"] == resumed[1]["loss"]


def test_load_of_the_result_samples(runs):
  model = mdjax.load(runs["whole"], log=_quiet)
  assert model.step == 2
  for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(runs["final"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows = np.asarray(sudoku4.sample_data(jax.random.key(1), 4))
  canvas = rows.copy()
  canvas[:, 16:] = sudoku4.MASK_ID
  spec = trainer.sampler_spec(model.config, sudoku4.LENGTH)  # the rollouts' program
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :16] = True
  out = np.asarray(sampling.sample(model.denoiser, model.params, jax.random.key(2), canvas,
                                   spec, fixed, mask_id=sudoku4.MASK_ID).tokens_BxL)
  np.testing.assert_array_equal(out[:, :16], rows[:, :16])
  assert ((out[:, 16:] >= 0) & (out[:, 16:] < sudoku4.MASK_ID)).all()  # every cell written


def test_one_generation_is_refused(start, tmp_path):
  with pytest.raises(ConfigError, match="rl.num_generations=1"):
    train.train(_config(start, num_generations=1), str(tmp_path / "g1"), log=_quiet)
  assert not os.path.exists(tmp_path / "g1")


def test_a_raising_reward_names_it_and_the_row_and_keeps_the_checkpoint(start, runs, tmp_path):
  workdir = str(tmp_path / "raises")
  shutil.copytree(runs["whole"], workdir)
  _raises.calls = 0
  with pytest.raises(rewards.RewardError, match=f"{RAISES}.*row 3"):
    train.train(_config(start, steps=3, rewards=[RAISES]), workdir, log=_quiet)
  model = mdjax.load(workdir, log=_quiet)
  assert model.step == 2
  assert [r["step"] for r in _rows(workdir)] == [1, 2]


LLADA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "pretrained", "llada")


def test_text_prompts_for_a_published_chat_model(tmp_path):
  """One step on the tiny LLaDA fixture: JSONL prompts through its chat template, left
  padded, d1's GSM8K rewards; the result loads."""
  path = tmp_path / "gsm.jsonl"
  with open(path, "w", encoding="utf-8") as f:
    for question, answer in (("What is 2+3?", "5"), ("What is 7-4?", "3")):
      f.write(json.dumps({"prompt": question, "response": f"<answer>{answer}</answer>",
                          "answer": answer}) + "\n")
  c = grpo_config.get_config()
  c.task = "sft"
  c.task_kwargs = dict(path=str(path))
  c.train.update(init_from=f"pretrained:{LLADA}", num_steps=1)
  c.batch_size = 4
  c.rl.update(num_generations=2, num_iterations=1, beta=0.0, max_prompt_length=40,
              max_completion_length=8, rewards=["gsm8k_xmlcount", "gsm8k_correctness"])
  c.sampler.update(steps=4, block_length=4)
  workdir = str(tmp_path / "w")
  train.train(c, workdir, log=_quiet)
  (row,) = _rows(workdir)
  assert 1 <= row["completion_length"] <= 8  # up to and including the first EOS
  assert np.isfinite(row["loss"]) and "reward_gsm8k_correctness" in row
  model = mdjax.load(workdir, log=_quiet)  # its sampling: test_load_of_the_result_samples
  assert model.step == 1 and model.tokenizer is not None


def test_the_gpu_config_resolves_on_a_published_start(tmp_path):
  """configs/grpo_gsm8k_gpu.py (d1's LLaDA-8B settings) passes the config checks on the tiny
  LLaDA fixture standing in for LLaDA-8B-Instruct: its knobs, LoRA and text prompts fit."""
  from configs import grpo_gsm8k_gpu
  path = tmp_path / "gsm.jsonl"
  path.write_text(json.dumps({"prompt": "What is 2+3?", "response": "5", "answer": "5"}) + "\n")
  c = grpo_gsm8k_gpu.get_config()
  c.train.init_from = f"pretrained:{LLADA}"
  c.task_kwargs.path = str(path)
  resolved = objectives.resolve_config(c)
  train.check_config(resolved)
  assert resolved.train.lora.rank > 0 and resolved.rl.num_generations >= 2
  assert resolved.task_kwargs.length == (resolved.rl.max_prompt_length
                                         + resolved.rl.max_completion_length)


def test_the_trajectory_estimator_scores_the_rollouts_own_steps(start, tmp_path):
  """rl.estimator='trajectory': one pass per sampler step (mdjax.rl.trajectory_logps_fn,
  checked on the oracle in test_losses.py) inside the same loop; a sampler whose steps are
  not set is refused by name."""
  workdir = str(tmp_path / "w")
  train.train(_config(start, steps=1, estimator="trajectory"), workdir, log=_quiet)
  (row,) = _rows(workdir)
  assert np.isfinite(row["loss"]) and np.isfinite(row["kl"]) and row["kl"] >= 0
  bad = _config(start, steps=1, estimator="trajectory")
  bad.sampler.steps = None
  with pytest.raises(ConfigError, match=r"rl.estimator='trajectory'.*sampler.steps=None"):
    train.train(bad, str(tmp_path / "bad"), log=_quiet)


def test_the_spg_objective_runs_its_block_wise_bounds(start, tmp_path):
  """objective 'spg': one step in blocks of 4 of the 16 cells; its metrics are the bounds
  (the ELBO of a completion is below 0; the EUBO of the same draws above the ELBO)."""
  c = _config(start, steps=1, spg_block_length=4, spg_num_draws=2)
  c.objective = "spg"
  workdir = str(tmp_path / "w")
  train.train(c, workdir, log=_quiet)
  (row,) = _rows(workdir)
  assert np.isfinite(row["loss"]) and row["elbo"] < 0 and row["eubo"] > row["elbo"]
  bad = _config(start, steps=1, spg_eubo_beta=0.5)
  bad.objective = "spg"
  with pytest.raises(ConfigError, match=r"rl.spg_eubo_beta=0.5: must be a number >= 1"):
    train.train(bad, str(tmp_path / "bad"), log=_quiet)


def test_a_lora_run_trains_the_adapters_and_rolls_out_on_merged_weights(start, tmp_path):
  """With LoRA the base stays the start's, the adapters move, and a rollout on the weights
  merged once per step draws the tokens the adapted denoiser draws (the same weights, W +
  scale A B, computed by the same code)."""
  c = _config(start, steps=1)
  c.train.lora.rank = 2
  final = train.train(c, str(tmp_path / "w"), log=_quiet)
  begin = mdjax.load(start, log=_quiet)
  for a, b in zip(jax.tree.leaves(begin.params), jax.tree.leaves(final.params["base"])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
  assert any(np.abs(np.asarray(b)).max() > 0
             for path, b in jax.tree_util.tree_leaves_with_path(final.params["lora"])
             if jax.tree_util.keystr(path).endswith("['b']"))
  lora_config = lora.config_of(c)
  prompts = sources.IdTaskSource(begin.task).draw(jax.random.key(5), 2)
  spec = trainer.sampler_spec(c, sudoku4.LENGTH)
  key = jax.random.key(6)
  adapted, *_ = trainer.rollout(lora.adapt(begin.denoiser, lora_config), final.params, key,
                                prompts, 2, 16, spec, sudoku4.MASK_ID)
  merged, *_ = trainer.rollout(begin.denoiser, lora.merge(final.params, lora_config), key,
                               prompts, 2, 16, spec, sudoku4.MASK_ID)
  np.testing.assert_array_equal(adapted, merged)


# ----------------------------------------------------------------------------
# The command line: every rl field from train.py's flags; the documented start config.
# ----------------------------------------------------------------------------


def _train_py(*flags):
  import subprocess
  import sys
  from tests.paths import REPO
  return subprocess.run([sys.executable, "train.py", "--config=configs/grpo.py", *flags],
                        cwd=REPO, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=REPO))


# A value of each rl field other than its default, as a command line gives it.
RL_FLAGS = {"num_generations": "4", "num_iterations": "2", "epsilon": "0.2", "beta": "0.01",
            "kl_estimator": "k2",
            "p_mask_prompt": "0.5", "cfg_scale": "0.5", "estimator": "elbo", "elbo_samples": "2",
            "coupled_t_min": "0.3", "coupled_t_max": "0.7", "spg_negative": "eubo",
            "spg_mix_weight": "0.25", "spg_eubo_beta": "2.0", "spg_num_draws": "3",
            "spg_block_length": "4",
            "scale_by_std": "True", "rewards": "sudoku,sudoku4_solved",
            "reward_weights": "1.0,0.5", "prompts": "prompts.jsonl", "max_prompt_length": "40",
            "max_completion_length": "8", "chat": "False",
            "sync_ref_model": "True", "ref_model_sync_steps": "64", "ref_model_mixup_alpha": "0.5",
            # igpo=True needs an id task's own prompts (rl.prompts is set here) and a per-token
            # estimator: its flag is given its default (tests/rl/test_igpo_mdpo_sync.py sets it).
            "igpo": "False", "igpo_max_replacements": "2", "igpo_ratio_low": "0.1",
            "igpo_ratio_high": "0.5", "igpo_entropy_keep": "0.3", "mdpo_train_steps": "2",
            "rft_min_reward": "0.5"}


def test_every_rl_field_is_set_by_train_py_flags(tmp_path):
  # ml_collections refused a list or None field (rl.rewards, rl.reward_weights); every field
  # is now in configs/grpo.py with a type a flag sets, and the checks accept the values.
  assert sorted(grpo_config.get_config().rl) == sorted(RL_FLAGS) == sorted(trainer.DEFAULTS)
  proc = _train_py(f"--workdir={tmp_path / 'w'}",
                   *(f"--config.rl.{name}={value}" for name, value in RL_FLAGS.items()))
  # Past every rl check, to the start point the run needs (none given).
  assert proc.returncode == 2 and proc.stderr == (
      "train.py: error: config field train.init_from='': objective 'grpo' fine-tunes a trained "
      "model: an mdjax workdir or 'pretrained:DIR'.\n"), proc.stderr[-3000:]


def test_rl_flags_reach_the_checks_as_values(tmp_path):
  proc = _train_py(f"--workdir={tmp_path / 'w'}", "--config.rl.rewards=sudoku,sudoku4_solved",
                   "--config.rl.reward_weights=(1.0,)")
  assert proc.returncode == 2 and proc.stderr == (
      "train.py: error: config field rl.reward_weights=(1.0,): must be None or 2 finite "
      "numbers (one per reward).\n"), proc.stderr[-3000:]


def test_the_sudoku4_config_makes_a_start_grpo_fine_tunes(tmp_path):
  """configs/sudoku4.py (docs/rl.md's start), shrunk by fields as flags would:
  it trains, and configs/grpo.py runs a step from it with two weighted rewards."""
  from configs import sudoku4 as sudoku4_config
  c = sudoku4_config.get_config()
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)  # the module's shapes
  c.train.update(num_steps=2, warmup_steps=0)
  c.batch_size, c.log_every = 8, 2
  c.checkpoint.every = 2
  start = str(tmp_path / "start")
  assert int(train.train(c, start, log=_quiet).step) == 2
  rl = _config(start, steps=1)
  rl.rl.update(rewards=("sudoku", "sudoku4_solved"), reward_weights=(1.0, 0.5))
  train.train(rl, str(tmp_path / "grpo"), log=_quiet)
  (row,) = _rows(str(tmp_path / "grpo"))
  assert np.isfinite(row["loss"]) and {"reward_sudoku", "reward_sudoku4_solved"} <= set(row)


# ----------------------------------------------------------------------------
# After d1: the reference sync, RFT, MDPO and IGPO inside the loop (their pieces:
# tests/rl/test_igpo_mdpo_sync.py).
# ----------------------------------------------------------------------------


def test_the_reference_sync_is_the_policy_at_alpha_one_and_resumes_from_the_checkpoint(
    start, tmp_path):
  """rl.sync_ref_model with one inner update a step: at alpha 1 and a sync after every update
  the reference is the policy that drew the step, so d1's KL is 0 (within float error of two
  programs: < 1e-6) where the unsynced reference (alpha 0, the start) gives > 1e-4 by step 2
  (lr 3e-2). At alpha 0.5 a run stopped after step 1 and resumed ends where an uninterrupted
  one does, bit for bit: the synced reference is in the checkpoint (re-initialised from the
  restored policy, it would differ)."""
  def config(steps, alpha):
    return _config(start, steps=steps, num_iterations=1, sync_ref_model=True,
                   ref_model_sync_steps=1, ref_model_mixup_alpha=alpha)

  train.train(config(2, 1.0), str(tmp_path / "a1"), log=_quiet)
  assert all(row["kl"] < 1e-6 for row in _rows(str(tmp_path / "a1")))
  train.train(config(2, 0.0), str(tmp_path / "a0"), log=_quiet)
  assert _rows(str(tmp_path / "a0"))[1]["kl"] > 1e-4
  whole = train.train(config(2, 0.5), str(tmp_path / "whole"), log=_quiet)
  resumed = str(tmp_path / "resumed")
  train.train(config(1, 0.5), resumed, log=_quiet)
  again = train.train(config(2, 0.5), resumed, log=_quiet)
  assert _rows(resumed)[1]["kl"] == _rows(str(tmp_path / "whole"))[1]["kl"]
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The checkpoint holds the optimizer's own state (the reference beside it): it loads.
  assert mdjax.load(resumed, log=_quiet).step == 2
  assert sorted(os.listdir(os.path.join(resumed, "ref_sync"))) == ["1.npz", "2.npz"]


def test_rft_mdpo_and_igpo_run_a_step(start, tmp_path):
  """objective 'rft' keeps the rows at or above rl.rft_min_reward (none at 2.0: no loss, no
  gradient); 'mdpo' scores each of the 2 sampler steps; rl.igpo on an untrained model whose
  rollouts all fail the exact check draws the batch again with hints (2 B rollouts)."""
  c = _config(start, steps=1, rft_min_reward=2.0)
  c.objective = "rft"
  train.train(c, str(tmp_path / "rft"), log=_quiet)
  (row,) = _rows(str(tmp_path / "rft"))
  assert row["kept_fraction"] == 0 and row["loss"] == 0 and row["grad_norm"] == 0
  c = _config(start, steps=1)
  c.objective = "mdpo"
  train.train(c, str(tmp_path / "mdpo"), log=_quiet)
  (row,) = _rows(str(tmp_path / "mdpo"))
  assert np.isfinite(row["loss"]) and 0 <= row["mdpo_backslide"] <= 1
  train.train(_config(start, steps=1, igpo=True, rewards=["sudoku4_solved"]),
              str(tmp_path / "igpo"), log=_quiet)
  (row,) = _rows(str(tmp_path / "igpo"))
  assert row["igpo_failed_groups"] == 1.0 and row["rollouts"] == 8
  for name in ("rft", "mdpo", "igpo"):
    assert mdjax.load(str(tmp_path / name), log=_quiet).step == 1
