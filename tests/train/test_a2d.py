"""The 'a2d' objective (continued training of a converted causal LM): a block run from the
converted tiny Qwen2 fixture trains, resumes, exports and the export loads; the annealed loss
at fraction 0 is the causal network's NELBO; complementary masks; 'nelbo' and 'sft' from a
converted start; bad configs refused by field."""

import importlib
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mdjax import diffusion, io, train
from mdjax.denoiser import Denoiser
from mdjax.models import published
from mdjax.train import a2d, objectives, sft
from mdjax.train.config_checks import ConfigError
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")
A2D = os.path.join(FIXTURES, "a2d")


def _config(name, **overrides):
  config = importlib.import_module(f"configs.{name}").get_config()
  config.task_kwargs.length = 16
  config.batch_size = 2
  config.train.update(num_steps=2, lr=1e-3, warmup_steps=0)
  config.update(log_every=1, eval_batches=1)
  config.checkpoint.update(every=1)
  config.data.update(threads=1, prefetch=1)
  config.update_from_flattened_dict(overrides)  # dotted paths: "a2d.anneal_steps"
  return config


# ----------------------------------------------------------------------------
# Through the loop: train, resume, export, load.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a2d_block_run_trains_resumes_exports_and_the_export_loads(tmp_path):
  config = _config("a2d_block", **{"a2d.anneal_steps": 2, "a2d.block_size_schedule": "0:2,1:4"})
  assert config.a2d.complementary
  workdir = str(tmp_path / "a2d")
  state = train.train(config, workdir, log=lambda *a: None)
  assert int(state.step) == 2
  start = io.load(os.path.join(A2D, "block"))
  out = os.path.join(workdir, sft.EXPORT_DIR)
  loaded = io.load(out)
  assert loaded.family == "fast_dllm_v2" and loaded.config == start.config
  for path, a in jax.tree_util.tree_leaves_with_path(loaded.params):
    b = state.params
    for key in path:
      b = b[key.key]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(loaded.params["head"]), np.asarray(start.params["head"]))
  # Resume from step 1: the second step again, the same parameters (its draws are the step's).
  shutil.rmtree(os.path.join(workdir, "checkpoints", "2"))
  shutil.rmtree(out)
  resumed = train.train(config, workdir, log=lambda *a: None)
  assert int(resumed.step) == 2
  for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert os.path.isdir(out)


# ----------------------------------------------------------------------------
# The loss.
# ----------------------------------------------------------------------------


TINY = published.PublishedConfig(
    family="dream", vocab_size=12, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
    head_dim=8, mlp_hidden=32, rope_theta=10000.0, norm_eps=1e-6, qkv_bias=True,
    logit_shift=True, mask_id=11)


@pytest.mark.slow
def test_annealed_loss_starts_at_the_causal_network_and_ends_at_its_own():
  view = sft.PublishedView(TINY)
  params = published.init_params(TINY, jax.random.key(0))
  task = ml_collections.ConfigDict(dict(mask_id=12))
  config = ml_collections.ConfigDict(dict(schedule="linear",
                                          a2d=dict(anneal_steps=10 ** 9)))
  loss = a2d.a2d_loss_fn(config, view.denoiser(), task)
  assert loss.takes_step
  x = jax.random.randint(jax.random.key(1), (4, 8), 0, 11)
  key = jax.random.key(2)
  _, inner_key = jax.random.split(key)  # the loss's draw after its annealing key

  def losses(p):
    return (loss(p, key, x, step=0)[0],
            diffusion.nelbo_loss(view.annealed(0.0, None), p, inner_key, x,
                                 schedule=diffusion.get_schedule("linear"), mask_id=12)[0],
            loss(p, key, x)[0])  # evaluation: no step, the network's own attention

  annealed, causal, own = map(float, jax.jit(losses)(params))
  # Fraction 1e-9: no later key is drawn visible (P < 28 * 1e-9): the causal network.
  assert annealed == pytest.approx(causal, rel=1e-6)
  assert abs(own - causal) > 1e-3 * abs(causal)


def test_view_of_fewer_ids_than_rows_reads_and_predicts_the_task_ids():
  # A tokenizer of 10 ids on a 12-row network (mask id 11): the task's mask id 10 is read as
  # the network's 11, and the logits are those of ids 0..9.
  params = published.init_params(TINY, jax.random.key(0))
  tokens = jnp.asarray([[1, 10, 3, 10, 9, 0]])

  def both(p):
    ours = sft.PublishedView(TINY, vocab=10)(p, tokens, None)
    theirs = published.forward(TINY, p, jnp.where(tokens == 10, 11, tokens))
    return ours, theirs

  ours, theirs = jax.jit(both)(params)
  assert ours.shape == (1, 6, 10)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs)[..., :10])


def _table(params, tokens_BxL, t_B):
  """Logits = a row of `params` per input id plus a per-position bias: cheap, exact."""
  del t_B
  return params["table"][tokens_BxL] + params["position"][None, :tokens_BxL.shape[1]]


@pytest.mark.slow
def test_complementary_masks_cover_every_token_once_and_estimate_the_nelbo():
  vocab, length, batch = 6, 10, 4
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"table": jax.random.normal(k1, (vocab + 1, vocab)),
            "position": jax.random.normal(k2, (length, vocab))}
  x = jax.random.randint(k3, (batch, length), 0, vocab)
  task = ml_collections.ConfigDict(dict(mask_id=vocab))
  config = ml_collections.ConfigDict(dict(schedule="linear", a2d=dict(complementary=True)))
  draws = 2048
  comp = a2d.a2d_loss_fn(config, _table, task)

  def run(key):
    seen = {}

    def spy(p, z, t):
      seen["z"] = z
      return _table(p, z, t)

    a2d.a2d_loss_fn(config, spy, task)(params, key, x, step=0)
    ours = jax.vmap(lambda k: comp(params, k, x, step=0)[0])(jax.random.split(key, draws))
    plain = jax.vmap(lambda k: diffusion.nelbo_loss(
        _table, params, k, x, schedule=diffusion.get_schedule("linear"), mask_id=vocab)[0])(
            jax.random.split(jax.random.fold_in(key, 1), draws))
    return seen["z"], ours, plain

  z, ours, plain = map(np.asarray, jax.jit(run)(jax.random.key(5)))
  first, second = np.split(z, 2)
  assert ((first == vocab) ^ (second == vocab)).all()  # each token masked in one copy
  np.testing.assert_array_equal(np.where(first == vocab, second, first), np.asarray(x))
  # Unbiased: the mean over draws is the NELBO's mean (the plain estimator's) within sampling
  # error: |difference| < 5 standard errors of the difference of two independent means.
  se = np.sqrt(ours.var() / draws + plain.var() / draws)
  assert abs(ours.mean() - plain.mean()) < 5 * se, (ours.mean(), plain.mean(), se)
  assert ours.std() < plain.std()  # every token predicted once per row: less variance


# ----------------------------------------------------------------------------
# Other objectives from a converted start, and bad configs.
# ----------------------------------------------------------------------------


def test_nelbo_and_sft_start_from_a_converted_folder(tmp_path):
  config = _config("a2d_block", objective="nelbo")
  resolved = objectives.resolve_config(config)
  assert resolved.model.block_size == 4 and resolved.model.d_model == 64
  train.check_config(resolved)
  task = train.tasks.from_config(resolved)
  graphdef, params, apply_fn = objectives.start_model(resolved, task)
  assert graphdef is None and Denoiser.of(apply_fn).block_size == 4
  assert task.vocab_size == 301 and params["embed"].dtype == jnp.float32
  # A task of another tokenizer is refused before any step.
  text = tmp_path / "t.txt"
  text.write_text("to be or not to be " * 50)
  other = _config("a2d_masked")
  other.task = "text"
  other.task_kwargs = ml_collections.ConfigDict(dict(text_path=str(text), length=16,
                                                     validation_fraction=0.25))
  other = objectives.resolve_config(other)
  with pytest.raises(ConfigError, match="config field task_kwargs.text_path=.*: the task's "
                     "tokenizer .* is not the start's"):
    objectives.start_model(other, train.tasks.from_config(other))
  # SFT on top: configs/sft.py from the converted folder (its tokenizer, its 301 ids).
  rows = tmp_path / "chat.jsonl"  # the fixture has no chat template: plain prompts
  rows.write_text('{"prompt": "To be, or not", "response": " to be."}\n')
  chat = importlib.import_module("configs.sft").get_config()
  chat.train.init_from = "pretrained:" + os.path.join(A2D, "masked")
  chat.task_kwargs.update(length=32, path=str(rows))
  chat = objectives.resolve_config(chat)
  chat_task = train.tasks.from_config(chat)
  assert chat_task.vocab_size == 301
  _, _, chat_fn = objectives.start_model(chat, chat_task)
  assert Denoiser.of(chat_fn).block_size is None


@pytest.mark.parametrize("name,overrides,message", [
    ("a2d_block", {"task_kwargs.length": 30}, r"task_kwargs.length=30: the start point is "
                                              "block-causal with blocks of 4"),
    ("a2d_block", {"a2d.block_size_schedule": "0:3,5:4"},
     r"block size 3 does not divide task_kwargs.length=16"),
    ("a2d_block", {"a2d.block_size_schedule": "0:2,5:8"}, r"must end at the start's block size 4"),
    ("a2d_block", {"a2d.block_size_schedule": "5:4"}, r"its steps must start at 0"),
    ("a2d_masked", {"a2d.block_size_schedule": "0:4"}, r"the start is not block-causal"),
    ("a2d_masked", {"a2d.anneal_steps": -1}, r"a2d.anneal_steps=-1 must be an integer >= 0"),
    ("a2d_block", {"schedule": "cosine"}, r"a2d.complementary=True needs schedule='linear'"),
    ("a2d_masked", {"train.init_from": None}, r"objective 'a2d' starts from a converted folder"),
    ("a2d_masked", {"task": "sft"}, r"task='sft', objective='a2d'"),
])
def test_bad_a2d_config_is_refused_by_field(name, overrides, message):
  config = _config(name, **overrides)
  with pytest.raises(ConfigError, match=message):
    train.check_config(objectives.resolve_config(config))


@pytest.mark.parametrize("name", ["a2d_masked", "a2d_block"])
def test_a_start_folder_with_deep_config_json_is_refused_by_field(tmp_path, name):
  """config.json nested 100,000 deep: a RecursionError before, now one line naming it."""
  (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
  config = _config(name, **{"train.init_from": f"pretrained:{tmp_path}"})
  with pytest.raises(ConfigError, match=rf"^config field train.init_from: {tmp_path}/config.json"
                     r": nests 100,000 levels of JSON arrays and objects; at most 256 are read"):
    train.check_config(objectives.resolve_config(config))


@pytest.mark.slow
def test_a_corpus_of_another_tokenizer_is_one_line_from_train_py(tmp_path):
  # configs/a2d_block.py on a corpus prepared with --tokenizer=char: refused naming the
  # corpus field and the tokenizer to prepare with (was a 27-line traceback), before any step.
  import subprocess
  import sys
  from mdjax.prepare_data import prepare
  (tmp_path / "t.txt").write_text("to be or not to be\n" * 100, encoding="utf-8")
  prepare([str(tmp_path / "t.txt")], "char", str(tmp_path / "corpus"), validation_fraction=0.3)
  proc = subprocess.run(
      [sys.executable, "train.py", "--config=configs/a2d_block.py",
       f"--workdir={tmp_path / 'run'}", f"--config.task_kwargs.data_dir={tmp_path / 'corpus'}"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
  block = os.path.join(A2D, "block")
  assert proc.stderr.startswith(
      f"train.py: error: config field task_kwargs.data_dir='{tmp_path / 'corpus'}': the task's "
      "tokenizer (CorpusTask("), proc.stderr
  assert proc.stderr.endswith(f"is not the start's ({block}); prepare the corpus with "
                              f"--tokenizer={block}/tokenizer.json.\n"), proc.stderr
  assert not os.path.exists(tmp_path / "run")
