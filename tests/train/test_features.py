"""Training at scale: gradient accumulation, remat, FLOPs and MFU, bf16 with float32 master
weights, the periodic validation NELBO."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import shakespeare_char, two_color
from mdjax import diffusion, models, tasks, train
from mdjax.train import flops
from mdjax.train import state as train_state


def _tiny(**changes):
  config = two_color.get_config()
  config.batch_size = 8
  config.update_from_flattened_dict(changes)  # dotted paths: "model.remat"
  return config


def _setup(config):
  task = tasks.from_config(config)
  state, _, apply_fn, _ = train_state.init_state(config, train_state.make_mesh(1), task)
  return task, state, apply_fn, train_state.make_loss_fn(config, apply_fn, task)


@pytest.fixture(scope="module")
def tiny_model():
  """The tiny two-color model at its initial state: (config, task, state, apply_fn, NELBO)."""
  config = _tiny()
  return (config, *_setup(config))


def _step(loss_fn, optimizer, grad_accum_steps):
  return jax.jit(functools.partial(train_state.train_step, loss_fn=loss_fn, optimizer=optimizer,
                                   ema_decay=0.0, seed=0, grad_accum_steps=grad_accum_steps))


def _close(a, b, rtol=1e-5, atol=1e-6):
  """Float32 sums in another order: relative error ~1e-6 per leaf; atol for leaves near 0."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# Gradient accumulation.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_accumulation_of_a_mean_loss_equals_the_one_batch_step(tiny_model):
  # The next-token loss draws no noise: the mean over 4 equal micro-batches of their mean
  # losses is the batch's mean loss, and so are the gradients; one SGD update each. (Any
  # model will do for this identity: the bidirectional one is shared with other tests.)
  config, task, state, apply_fn, _ = tiny_model
  loss_fn = functools.partial(diffusion.causal_lm_loss, apply_fn, start_id=task.mask_id)
  x_BxL = train.batch_for_step(config, 0, task)
  sgd = optax.sgd(0.5)
  one, one_metrics = _step(loss_fn, sgd, 1)(state, x_BxL)
  four, four_metrics = _step(loss_fn, sgd, 4)(state, x_BxL)
  assert int(four.step) == 1
  for name in ("loss", "grad_norm", "bits_per_token"):
    np.testing.assert_allclose(four_metrics[name], one_metrics[name], rtol=1e-5)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), one.params, state.params)
  assert max(jax.tree.leaves(moved)) > 1e-3  # the update happened
  _close(four.params, one.params)


@pytest.mark.slow
def test_accumulated_nelbo_is_the_mean_over_micro_batches_with_folded_keys(tiny_model):
  # The NELBO draws noise: micro-batch i (rows i, i+k, ...) uses fold_in(step key, i), so
  # the step equals this explicit reference, and is deterministic.
  config, task, state, _, loss_fn = tiny_model
  x_BxL = train.batch_for_step(config, 3, task)
  key = jax.random.key(7)
  (loss, aux), grads = jax.jit(functools.partial(
      train_state.accumulated_value_and_grad, loss_fn, steps=2))(state.params, key, x_BxL)
  parts = jax.jit(lambda params, key, x_BxL: [jax.value_and_grad(loss_fn, has_aux=True)(
      params, jax.random.fold_in(key, i), x_BxL[i::2]) for i in range(2)])(
          state.params, key, x_BxL)
  np.testing.assert_allclose(loss, np.mean([p[0][0] for p in parts]), rtol=1e-6)
  np.testing.assert_allclose(aux["bits_per_token"],
                             np.mean([p[0][1]["bits_per_token"] for p in parts]), rtol=1e-6)
  assert "nelbo_nats_B" not in aux  # scalars only
  _close(grads, jax.tree.map(lambda *g: sum(g) / 2, *[p[1] for p in parts]))
  with pytest.raises(ValueError, match="grad_accum_steps=3 must divide the batch of 8"):
    train_state.accumulated_value_and_grad(loss_fn, state.params, key, x_BxL, 3)


def test_grad_accum_config_refusals():
  with pytest.raises(train.ConfigError, match=r"train.grad_accum_steps=3: must divide "
                                              r"batch_size=8"):
    train.check_config(_tiny(**{"train.grad_accum_steps": 3}))
  with pytest.raises(train.ConfigError, match=r"train.grad_accum_steps=0: must be an integer"):
    train.check_config(_tiny(**{"train.grad_accum_steps": 0}))
  with pytest.raises(ValueError, match=r"remat=1 must be True or False"):
    models.TransformerConfig(vocab_size=2, max_len=2, remat=1)
  with pytest.raises(train.ConfigError, match=r"train.peak_flops=-1.0: must be None"):
    train.check_config(_tiny(**{"train.peak_flops": -1.0}))


# ----------------------------------------------------------------------------
# Remat.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [
    dict(time_conditioning=True, num_layers=2),
    dict(block_size=1, num_layers=2),  # the block NELBO's pass over [noisy; clean]
], ids=["time_conditioned", "block_pair"])
@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients(changes):
  losses, grads = [], []
  for remat in (False, True):
    config = _tiny(**{f"model.{k}": v for k, v in changes.items()}, **{"model.remat": remat})
    task, state, _, loss_fn = _setup(config)
    x_BxL = train.batch_for_step(config, 0, task)
    (loss, _), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        state.params, jax.random.key(1), x_BxL)
    losses.append(loss)
    grads.append(g)
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
  _close(grads[1], grads[0])


# ----------------------------------------------------------------------------
# FLOPs and MFU.
# ----------------------------------------------------------------------------


def test_matmul_params_are_the_model_parameters_less_embedding_norms_and_time_layers():
  config = _tiny(**{"model.time_conditioning": True, "model.mlp": "gelu"})
  task = tasks.from_config(config)
  cfg = train_state.model_config(config, task)
  params = nnx.to_pure_dict(models.init(cfg)[1])
  per_token = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                  if not any(str(getattr(k, "key", "")) in ("embed", "norm1", "norm2",
                                                            "final_norm", "ada", "time_mlp")
                             for k in path))
  assert flops.matmul_params(cfg) == per_token
  d, layers, length = cfg.d_model, cfg.num_layers, task.length
  assert flops.model_flops_per_token(config, task) == 6 * per_token + 12 * layers * d * length
  # BD3-LM's pass over [noisy; clean]: blocks and attention twice, over 2 L positions.
  head = d * task.vocab_size
  assert flops.flops_per_token(cfg, length, block_pair=True) == (
      6 * (2 * (per_token - head) + head) + 2 * 12 * layers * d * 2 * length)


def test_peaks_and_mfu():
  assert flops.known_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert flops.known_peak_flops("NVIDIA H100 PCIe") == 756e12
  assert flops.known_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
  assert flops.known_peak_flops("TPU v5 lite") == 197e12
  assert flops.known_peak_flops("TPU v5") == 459e12
  assert flops.known_peak_flops("cpu") is None
  config, task = _tiny(), tasks.get("two_color")
  if flops.known_peak_flops(jax.devices()[0].device_kind) is None:  # CPU: no figure
    assert flops.peak_flops_per_device(config) is None
    assert flops.mfu(config, task, 1e4, 1) is None
  config.train.peak_flops = 2e9
  expected = 1e4 * flops.model_flops_per_token(config, task) / (4 * 2e9)
  assert flops.mfu(config, task, 1e4, 4) == pytest.approx(expected, rel=1e-12)
  with pytest.raises(ValueError, match="num_devices=0 must be an integer >= 1"):
    flops.mfu(config, task, 1e4, 0)
  # A measured peak: 2 n^3 FLOPs over the best time, so positive and finite.
  measured = flops.measure_peak_flops(size=128, repeats=2)
  assert 0 < measured < float("inf")


# ----------------------------------------------------------------------------
# bf16 compute, float32 master weights, at seq_len 1024 through the loop.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_remat_accumulation_at_1024_keeps_float32_weights_and_logs_mfu(tmp_path):
  config = shakespeare_char.get_config()
  config.task_kwargs.length = 1024
  config.batch_size = 4
  config.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64, dtype="bfloat16",
                      remat=True)
  config.train.update(num_steps=2, warmup_steps=1, grad_accum_steps=2, ema_decay=0.9,
                      peak_flops=1e12)
  config.update(log_every=1, eval_every=0, eval_batches=1, num_eval_samples=0)
  config.checkpoint.every = 2
  state = train.train(config, str(tmp_path), log=lambda *_: None)
  # Master weights, Adam's moments and the EMA stay float32.
  floats = [x for x in jax.tree.leaves((state.params, state.opt_state, state.ema_params))
            if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and {x.dtype for x in floats} == {jnp.dtype("float32")}
  # What sample.py and mdjax.load read from the workdir: the EMA parameters.
  model = train.load(str(tmp_path), log=lambda *_: None)
  loaded = model.params
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.device_get(state.ema_params))
  assert jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), loaded,
                                      jax.device_get(state.params))).count(True) > 0
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "val_bits_per_token" in r]
  assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [2]
  assert all(np.isfinite(r["loss"]) for r in steps)
  task, apply_fn = model.task, model.denoiser
  last = steps[-1]  # the first step compiles: its row has no rate
  assert last["mfu"] == pytest.approx(
      last["tokens_per_s"] * flops.model_flops_per_token(config, task) / 1e12, rel=1e-9)
  for r in evals:  # the held-out NELBO of the EMA and of the raw parameters, each once
    assert "eval_bits_per_token" not in r and 0 < r["val_bits_per_token"]
    assert 0 < r["val_bits_per_token_raw"] != r["val_bits_per_token"]
  # The matmuls run in bfloat16; the attention softmax, the logits and the loss in float32.
  loss_fn = train_state.make_loss_fn(config, apply_fn, task)
  x_BxL = train.batch_for_step(config, 0, task)[:2]
  t_B = jnp.full((2,), 0.5)
  assert jax.eval_shape(apply_fn, state.params, x_BxL, t_B).dtype == jnp.float32
  assert jax.eval_shape(loss_fn, state.params, jax.random.key(0), x_BxL)[0].dtype == jnp.float32
  text = jax.jit(loss_fn).lower(state.params, jax.random.key(0), x_BxL).as_text()
  assert "tensor<2x1024x32xbf16>, tensor<32x96xbf16>" in text  # the qkv projection
  assert re.search(r"exponential %\w+ : tensor<2x2x1024x1024xf32>", text)  # the softmax
  assert "tensor<32x84xbf16>) -> tensor<2x1024x84xf32>" in text  # the head, into float32


@pytest.mark.slow
def test_the_end_of_run_evaluation_is_announced_and_eval_at_end_false_skips_it(tmp_path):
  # configs/corpus.py's 40 steps spent 3 of 8 minutes in it, with eval_every=0 too.
  config = _tiny(**{"train.num_steps": 2, "train.warmup_steps": 0, "checkpoint.every": 2,
                    "log_every": 1, "eval_batches": 1, "num_eval_samples": 4})
  for eval_at_end in (True, False):
    config.eval_at_end = eval_at_end
    workdir, lines = tmp_path / str(eval_at_end), []
    train.train(config, str(workdir), log=lines.append)
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    evals = [r["step"] for r in rows if "val_bits_per_token" in r]
    notice = [line for line in lines if line.startswith("end-of-run evaluation: ")]
    if eval_at_end:
      assert evals == [2] and notice == [
          "end-of-run evaluation: 1 held-out batch(es), 4 samples by sampler 'random_order' "
          "(--config.eval_at_end=False skips it)"], lines
    else:
      assert evals == [] and notice == [], lines
