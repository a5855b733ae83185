"""DiffusionGemma against the fixtures gemma's own code wrote (tests/reference/diffusion_gemma.py):
gemma's params checkpoint loaded (the architecture read from its shapes), the decoder's
logits with and without self-conditioning, without a cache and with the prompt (then a
finished canvas) in it, `encode_condition` against gemma's `encode_logits`, save -> load bit
for bit, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import formats
from mdjax import noise as noise_lib
from mdjax.denoiser import Denoiser
from mdjax.io import gemma_params
from mdjax.models import diffusion_gemma as network
from tests.formats import family_fixtures

FOLDER = family_fixtures.folder("diffusion_gemma")
PARAMS = FOLDER / "params"
# What the tree does not say: the writer's sliding window and experts a token (the layer
# kinds are read from the shapes: the global layers store k_einsum).
GIVEN = {"sliding_window": 4, "experts_per_token": 2, "max_len": 64}
PROMPT = 9


@functools.cache
def model():
  return mdjax.load(PARAMS, config=GIVEN)


def reference() -> dict:
  return family_fixtures.reference("diffusion_gemma")


def _tolerance(expected: np.ndarray) -> float:
  # float32 (eps 1.2e-7) through 6 layers of d_model 32 sums, a 2-of-8 expert mix and a
  # 128-way tied head: a few hundred roundings of values of the logits' size, well under
  # 1e-4 of the largest logit (the bound). Every routing choice the fixture took
  # clears a 1e-4 relative margin, so none flips on rounding (a flip moves logits by O(1)).
  return family_fixtures.tolerance(expected, 1e-4)


def test_loads_gemmas_params_checkpoint():
  m = model()
  c = m.config
  assert m.family == "diffusion_gemma" and mdjax.loader.kind_of(str(PARAMS)) == "published"
  assert c.layer_types == ("local", "local", "global") * 2  # global: k_einsum present
  assert (c.vocab_size, c.d_model, c.num_heads, c.head_dim, c.num_kv_heads) == (128, 32, 4, 8, 2)
  assert (c.global_head_dim, c.num_global_kv_heads, c.k_eq_v_global) == (16, 1, True)
  assert (c.num_experts, c.expert_hidden, c.mlp_hidden, c.condition_hidden) == (8, 16, 48, 48)
  assert (c.sliding_window, c.experts_per_token, c.dtype) == (4, 2, "float32")
  # The published model's constants where the tree is silent.
  assert (c.global_rope_proportion, c.global_rope_theta, c.final_logit_softcap) == (
      0.25, 1e6, 30.0)
  assert isinstance(m.noise, noise_lib.Uniform) and m.noise.vocab_size == 128
  assert (m.mask_id, m.eos_id, m.eot_id, m.pad_id) == (128, 1, 106, 0)  # V: no mask token
  assert m.params["local"]["experts_gating"].shape == (4, 8, 2, 16, 32)
  assert m.params["global"]["k"].shape == (2, 1, 32, 16)
  assert m.denoiser.self_conditions and m.tokenizer is None


# The passes compiled once per config (the config static), as the samplers run them. The
# condition is always given (zeros: gemma's first step, whose signal is exactly zero), so
# each pass compiles once.
forward = jax.jit(network.forward, static_argnums=0, static_argnames="prompt_length")
encode = jax.jit(network.encode, static_argnums=0)
decode = jax.jit(network.decode, static_argnums=0)


def _check(got, ref, name):
  np.testing.assert_allclose(np.asarray(got), ref[name], rtol=0, atol=_tolerance(ref[name]),
                             err_msg=name)


def _with_and_without(ref, prompt=0):
  """The canvas's conditions, zeros then the fixture's, over [prompt; canvas] (2B rows)."""
  sc = np.concatenate([np.zeros_like(ref["sc_BxWxD"]), ref["sc_BxWxD"]])
  return np.concatenate([np.zeros((4, prompt, sc.shape[-1]), np.float32), sc], axis=1)


def test_decoder_logits_match_gemma_without_a_cache():
  """gemma's `sample_next_canvas` with no cache: the canvas alone, bidirectional (local
  layers within the window), with zero and with self-conditioning embeddings."""
  m, ref = model(), reference()
  got = forward(m.config, m.params, np.tile(ref["canvas_BxW"], (2, 1)), None,
                _with_and_without(ref))
  _check(got[:2], ref, "logits_nocache")
  _check(got[2:], ref, "logits_nocache_sc")


@pytest.mark.slow
def test_decoder_logits_match_gemma_with_the_prompt_cached():
  """gemma's `prefill` of the prompt (the causal encoder pass, written into the cache), the
  decoder pass over the canvas reading it, with zero and with self-conditioning embeddings;
  then the canvas appended (`append_tokens_to_cache`) and the pass over the next canvas."""
  m, ref = model(), reference()
  c, p = m.config, m.params
  cache = encode(c, p, network.init_cache(c, 2, 32), ref["prompt_BxP"])
  zeros = np.zeros_like(ref["sc_BxWxD"])
  _check(decode(c, p, cache, ref["canvas_BxW"], zeros), ref, "logits_prompt")
  _check(decode(c, p, cache, ref["canvas_BxW"], ref["sc_BxWxD"]), ref, "logits_prompt_sc")
  appended = encode(c, p, cache, ref["canvas_BxW"])
  _check(decode(c, p, appended, ref["next_BxW"], zeros), ref, "logits_second")


@pytest.mark.slow
def test_one_pass_over_prompt_and_canvas_is_the_cached_passes():
  """`forward` with prompt_length (what the model's denoiser runs on [prompt; canvas]) gives
  the canvas the logits of gemma's prefill + decoder pass, with and without
  self-conditioning."""
  m, ref = model(), reference()
  tokens = np.tile(np.concatenate([ref["prompt_BxP"], ref["canvas_BxW"]], axis=1), (2, 1))
  got = forward(m.config, m.params, tokens, None, _with_and_without(ref, PROMPT),
                prompt_length=PROMPT)[:, PROMPT:]
  _check(got[:2], ref, "logits_prompt")
  _check(got[2:], ref, "logits_prompt_sc")


def test_encode_condition_is_gemmas_encode_logits():
  """The self-conditioning input from the first step's shaped logits (temperature 0.8)."""
  m, ref = model(), reference()
  got = m.denoiser.encode_condition(m.params, jnp.asarray(ref["logits_nocache"]) / 0.8)
  np.testing.assert_allclose(np.asarray(got), ref["sc_raw_BxWxD"], rtol=0,
                             atol=1e-4 * np.abs(ref["sc_raw_BxWxD"]).max())


def test_save_load_round_trip(tmp_path):
  m = model()
  out = gemma_params.save(m, tmp_path / "params")
  back = mdjax.load(out, config=GIVEN)
  assert back.config == m.config
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back.params, m.params)
  # gemma's tree, leaf for leaf (the same names, shapes and values as the fixture's).
  assert gemma_params.leaf_shapes(out) == gemma_params.leaf_shapes(str(PARAMS))


def test_bad_input(tmp_path):
  with pytest.raises(ValueError, match="num_heads=8 but the params tree has 4"):
    mdjax.load(PARAMS, config={**GIVEN, "num_heads": 8})
  with pytest.raises(ValueError, match="unknown field"):
    mdjax.load(PARAMS, config={"window": 4})
  with pytest.raises(ValueError, match="dtype"):
    mdjax.load(PARAMS, config=GIVEN, dtype="float16")
  with pytest.raises(ValueError, match="exists"):
    gemma_params.save(model(), PARAMS)
  # The Hugging Face conversion is detected; the generic folder reader refuses it by name and
  # names the reader that loads it (mdjax.io.diffusion_gemma_hf).
  raw = {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"]}
  fmt = formats.detect(raw, "config.json")
  assert fmt.family == "diffusion_gemma"
  with pytest.raises(ValueError, match="not read by mdjax.io.folder.load.*diffusion_gemma_hf"):
    fmt.config_from_hf(raw, "float32")


def test_condition_reaches_only_self_conditioning_denoisers():
  """The denoiser contract's optional input: absent by default, refused by a denoiser that
  makes none."""
  plain = Denoiser(lambda params, tokens, t, valid_BxL=None: tokens)
  assert not plain.self_conditions
  assert plain(None, 3, None) == 3
  with pytest.raises(ValueError, match="without self-conditioning"):
    plain(None, 3, None, condition=np.zeros(1))
