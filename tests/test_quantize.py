"""Weight-only quantization (`mdjax.quantize`, `mdjax.load(quantize=...)`): each weight moves
by at most half its scale, the logits of every published family's fixture and of a workdir
stay within the bound those moves allow, the float weights kept float are untouched, and a
bad value or a model without matrices is refused naming quantize."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import generation, quantize
from mdjax.errors import ArgumentError
from mdjax.serve import __main__ as serve_main
from tests.paths import REPO

FIXTURES = {name: os.path.join(REPO, "tests/fixtures", path) for name, path in {
    "llada": "pretrained/llada", "dream": "pretrained/dream", "llada2": "llada2",
    "sdar": "sdar", "fast_dllm_v2": "fast_dllm_v2", "mdlm": "dit/mdlm",
    "mdlm_time": "dit/mdlm_time", "bd3lm": "dit/bd3lm", "llama": "judge/llama",
    "qwen2": "judge/qwen2", "diffusion_gemma": "diffusion_gemma/params"}.items()}
is_quantized_leaf = lambda x: isinstance(x, quantize.QuantizedWeight)


@pytest.mark.parametrize("mode,top", [("int8", 127), ("int4", 7)])
def test_each_weight_moves_by_at_most_half_its_scale(mode, top):
  w = jax.random.normal(jax.random.key(0), (3, 64, 48)) * jnp.arange(1, 49) / 8  # [N, I, O]
  w = w.at[0, :, 5].set(0.0)  # an all-zero column stays zero
  q = quantize.quantize_weight(w, mode)
  group = 64 if mode == "int8" else quantize.INT4_GROUP
  assert q.values.dtype == (jnp.int8 if mode == "int8" else jnp.int4)
  assert q.values.shape == w.shape and q.scale.shape == (3, 64 // group, 48)
  values = np.asarray(q.values, np.int32)
  grouped = np.abs(np.asarray(w)).reshape(3, 64 // group, group, 48).max(axis=2)
  # The scale is each group's max |w| / top, and the max itself is stored as +-top.
  np.testing.assert_allclose(np.asarray(q.scale)[grouped > 0], grouped[grouped > 0] / top,
                             rtol=1e-6)
  assert np.abs(values).max() == top
  assert np.all(np.abs(values).reshape(3, 64 // group, group, 48).max(axis=2)[grouped > 0]
                == top)
  half_step = np.repeat(np.asarray(q.scale), group, axis=1) / 2
  error = np.abs(np.asarray(q.astype(jnp.float32)) - np.asarray(w))
  # Round to nearest: at most half a step, plus float32's rounding of w / scale and back.
  assert np.all(error <= half_step * (1 + 1e-5) + 1e-7)
  assert np.all(np.asarray(q.astype(jnp.float32))[0, :, 5] == 0)
  # What nnx.Linear reads (jnp.asarray) is the same dense matrix, in the weight's dtype.
  assert jnp.array_equal(jnp.asarray(q), q.astype(jnp.float32))
  assert q[...] is q


def _first_order_bound(apply, float_params, quantized_params, picked):
  """For each picked logit l, sum over quantized weights w of |dl/dw| * scale_w / 2: how far
  l can move, to first order, when every weight moves by at most half its scale (the
  second-order terms are smaller by another factor of the relative weight error, 1/254 for
  int8: measured |error| / bound stays below 0.04 on these fixtures)."""
  half_steps = jax.tree.map(
      lambda q: (jnp.repeat(q.scale, q.shape[-2] // q.scale.shape[-2], axis=-2) / 2
                 if is_quantized_leaf(q) else 0.0), quantized_params, is_leaf=is_quantized_leaf)

  @jax.jit  # one program, run for each logit (op by op, each op was compiled on its own)
  def bound(params, half_steps, cotangent):
    _, pullback = jax.vjp(lambda p: apply(p)[picked], params)
    terms = jax.tree.map(lambda s, g: jnp.sum(jnp.abs(g) * s), half_steps,
                         pullback(cotangent)[0])
    return sum(jax.tree.leaves(terms))

  count = len(picked[0])
  return np.asarray([float(bound(float_params, half_steps, jnp.zeros(count).at[i].set(1.0)))
                     for i in range(count)])


def _canvas(model, key=0, batch=2, length=16):
  """Prompt tokens, then masks (a causal judge, a uniform-noise model: tokens only)."""
  tokens = jax.random.randint(jax.random.key(key), (batch, length), 0, model.vocab_size)
  if model.mask_id_or_none is None or model.noise is not None:
    return tokens
  tokens = jnp.where(tokens == model.mask_id, 0, tokens)
  return tokens.at[:, length // 2:].set(model.mask_id)


def _check_round_trip(path_or_model, **load):
  model = mdjax.load(path_or_model, **load) if isinstance(path_or_model, str) else path_or_model
  quantized = (mdjax.load(path_or_model, quantize="int8", **load)
               if isinstance(path_or_model, str) else quantize.quantize_model(model, "int8"))
  leaves = jax.tree.leaves(quantized.params, is_leaf=is_quantized_leaf)
  matrices = [x for x in leaves if is_quantized_leaf(x)]
  assert matrices and all(x.values.dtype == jnp.int8 for x in matrices)
  assert quantize.param_bytes(quantized.params) < 0.5 * quantize.param_bytes(model.params)
  # The float model in the quantized model's layout (a time-free DiT is folded) and its
  # denoiser, so the two differ by the weights' rounding alone.
  float_params = quantize.float_layout(model)[1]
  tokens, t = _canvas(model), jnp.full((2,), 0.5)
  apply = jax.jit(lambda p: quantized.denoiser.apply(p, tokens, t))  # one program a layout
  float_logits, quantized_logits = np.asarray(apply(float_params)), np.asarray(apply(
      quantized.params))
  np.testing.assert_array_equal(np.isfinite(float_logits), np.isfinite(quantized_logits))
  finite = np.isfinite(float_logits)
  error = np.where(finite, np.abs(float_logits - np.where(finite, quantized_logits, 0)), 0)
  assert error.max() > 0  # the quantized weights are the ones used
  picked = np.unravel_index(np.argsort(error, axis=None)[-3:], error.shape)  # the worst 3
  bound = _first_order_bound(apply, float_params, quantized.params, picked)
  assert np.all(error[picked] <= bound), (error[picked], bound)
  return model, quantized


@pytest.mark.slow  # 5-10 s each: two loads, three programs compiled
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_load_round_trip_within_the_rounding_bound(name):
  model, quantized = _check_round_trip(FIXTURES[name])
  if model.causal:
    return
  # The default (reference, often cached) sampler runs on the quantized weights.
  ids, lengths, _, _ = generation.generate_ids(quantized, [np.array([5, 6, 7], np.int32)],
                                               max_new_tokens=8, key=0)
  assert 0 < lengths[0] <= 8 and np.all((ids[0] >= 0) & (ids[0] < model.vocab_size))


@pytest.mark.slow
def test_a_workdir_round_trip(id_workdir):
  model, quantized = _check_round_trip(str(id_workdir))
  assert quantized.family == "mdjax"
  # prefill and decode (nnx.Linear reading a QuantizedWeight through jnp.asarray) too
  tokens, t = _canvas(model, length=model.max_len), jnp.full((2,), 0.5)
  logits, cache = quantized.denoiser.prefill(quantized.params, tokens, t)
  window, _ = quantized.denoiser.decode(quantized.params, cache, tokens[:, 4:8], 4, t)
  np.testing.assert_allclose(window, logits[:, 4:8], rtol=1e-5, atol=1e-5)


def test_what_stays_float_is_untouched():
  model = mdjax.load(FIXTURES["llada2"])
  quantized = quantize.quantize_model(model, "int8")
  assert quantize.quantize_model(model, None) is model
  kept = {"embed", "final_norm", "attn_norm", "mlp_norm", "q_norm", "k_norm", "router",
          "expert_bias"}
  flat = dict(jax.tree_util.tree_leaves_with_path(model.params))
  seen = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(quantized.params,
                                                        is_leaf=is_quantized_leaf):
    name = path[-1].key
    assert is_quantized_leaf(leaf) == (name in quantize.QUANTIZED["published"]), name
    if name in kept:
      assert leaf is flat[path], name  # the very array: its arithmetic is unchanged
      seen.add(name)
  assert seen == kept


@pytest.mark.parametrize("value", ["int3", 8, "INT8", ""])
def test_a_bad_value_is_an_error_naming_quantize(value):
  with pytest.raises(ArgumentError, match="quantize=") as error:
    mdjax.load(FIXTURES["llama"], quantize=value)
  assert error.value.param == "quantize" and "'int8'" in str(error.value)


def test_a_quantized_model_is_not_saved(tmp_path):
  model = quantize.quantize_model(mdjax.load(FIXTURES["llama"]), "int8")
  with pytest.raises(ValueError, match="save: the params are quantized"):
    mdjax.io.save(model, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_a_model_without_matrices_is_refused_naming_quantize():
  with pytest.raises(ValueError, match="quantize='int8' does not apply"):
    mdjax.load("two_color", quantize="int8")


def test_the_flags_parse(sample_cli, capsys):
  args = serve_main._parser().parse_args(["--model=m", "--quantize=int4"])
  assert args.quantize == "int4"
  assert serve_main._parser().parse_args(["--model=m"]).quantize is None
  with pytest.raises(SystemExit) as exit_:
    serve_main._parser().parse_args(["--model=m", "--quantize=int3"])
  err = capsys.readouterr().err.strip()
  assert exit_.value.code == 2 and "--quantize" in err and len(err.splitlines()) == 1
  run = sample_cli("--quantize=int3", "--oracle")
  assert run.returncode == 1 and "quantize" in run.stderr
  run = sample_cli("--quantize=int8", "--oracle")
  assert run.returncode == 1 and "--quantize does not apply with --oracle" in run.stderr
