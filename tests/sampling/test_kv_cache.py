"""KV-cached block decoding: the cached contract, where it is exact, its refresh plan, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, models, sampling
from mdjax.denoiser import Denoiser
from mdjax.tasks import scan_and_add, two_color
from tests.stubs import stub_denoiser, stub_params

V, L, PROMPT = 9, 16, 4  # 12 generated positions: blocks of 4 (3 blocks) or 6
BLOCK_FAMILIES = [
    sampling.ConfidenceSpec(steps=6, block_length=4),
    sampling.ConfidenceSpec(steps=6, block_length=4, threshold=0.3, score="margin"),
    sampling.AncestralSpec(steps=6, block_length=6, temperature=0.8),
    sampling.EntropyBoundedSpec(steps=6, block_length=4, gamma=0.5),
]
# Float32 rounding: a window pass sums the same products as the full pass in another order
# (a split softmax over cached and fresh keys); with O(1) activations at d_model 32 the
# observed differences are ~2e-6, so 2e-5 is 10x rounding and far below a real mismatch
# (a wrong position or a stale key moves logits by O(0.1)).
ROUNDING = 2e-5


def _cfg(**kw):
  return models.TransformerConfig(**{**dict(vocab_size=V, max_len=L, d_model=32, num_layers=2,
                                            num_heads=4, d_ff=64), **kw})


@pytest.fixture(scope="module")
def transformer():
  _, params, apply_fn = models.init(_cfg(), seed=1)
  return apply_fn, params


def _canvas(batch=5, prompt=PROMPT):
  rng = np.random.default_rng(0)
  tokens = np.full((batch, L), V, np.int32)
  tokens[:, :prompt] = rng.integers(0, V, (batch, prompt))
  return tokens


@pytest.mark.parametrize("kw", [{}, {"positions": "sinusoidal", "causal": True}, {"block_size": 4},
                                {"time_conditioning": True, "norm": "layer", "mlp": "gelu"}])
@pytest.mark.slow
def test_window_pass_equals_prefill(kw):
  """Prefill's logits are the plain pass's; a window pass over the same tokens gives the
  prefill's logits and keys/values on its positions, and leaves the rest of the cache."""
  _, params, apply_fn = models.init(_cfg(**kw), seed=2)
  tokens = jax.random.randint(jax.random.key(0), (3, L), 0, V + 1)
  t_B = jnp.array([0.2, 0.5, 0.9])
  logits, cache = jax.jit(apply_fn.prefill)(params, tokens, t_B)
  assert [x.keys_BxHxLxK.shape for x in cache.layers] == [(3, 4, L, 8)] * 2
  np.testing.assert_allclose(logits, apply_fn(params, tokens, t_B), atol=ROUNDING)
  decode = jax.jit(apply_fn.decode)
  for start in (0, 5, L - 4):
    window_logits, window_cache = decode(params, cache, tokens[:, start:start + 4], start, t_B)
    np.testing.assert_allclose(window_logits, logits[:, start:start + 4], atol=ROUNDING)
    for new, old in zip(jax.tree.leaves(window_cache), jax.tree.leaves(cache)):
      np.testing.assert_allclose(new, old, atol=ROUNDING)
  # A changed window is seen: its logits move, and so do its cached keys.
  changed = tokens.at[:, 5:9].set((tokens[:, 5:9] + 1) % V)
  window_logits, window_cache = decode(params, cache, changed[:, 5:9], 5, t_B)
  assert np.abs(window_logits - logits[:, 5:9]).max() > 100 * ROUNDING
  for new, old in zip(window_cache.layers, cache.layers):
    delta = np.abs(new.keys_BxHxLxK - old.keys_BxHxLxK)
    assert delta[..., 5:9, :].max() > 100 * ROUNDING
    assert delta[..., :5, :].max() == delta[..., 9:, :].max() == 0.0


@pytest.mark.parametrize("spec", BLOCK_FAMILIES, ids=lambda s: type(s).__name__)
@pytest.mark.slow
def test_refresh_every_step_is_the_uncached_sampler(transformer, spec):
  apply_fn, params = transformer
  key, tokens = jax.random.key(3), _canvas()
  plain = sampling.sample(apply_fn, params, key, tokens, spec)
  cached = sampling.sample(apply_fn, params, key, tokens,
                           dataclasses.replace(spec, kv_cache="dual", refresh_every=1))
  np.testing.assert_array_equal(cached.tokens_BxL, plain.tokens_BxL)
  np.testing.assert_array_equal(cached.write_step_BxL, plain.write_step_BxL)
  assert int(cached.nfe) == int(plain.nfe)


@pytest.mark.parametrize("spec", BLOCK_FAMILIES, ids=lambda s: type(s).__name__)
@pytest.mark.slow
def test_dual_cache_is_a_compiled_loop_like_any_sampler(transformer, spec):
  """The dual cache's tokens: the same from the one program and from the Python loop, and
  (stale keys outside the block) not the uncached tokens on a random model."""
  apply_fn, params = transformer
  key, tokens = jax.random.key(4), _canvas()
  dual = dataclasses.replace(spec, kv_cache="dual")
  scan = sampling.sample(apply_fn, params, key, tokens, dual)
  loop = sampling.sample_python_loop(apply_fn, params, key, tokens, dual)
  np.testing.assert_array_equal(scan.tokens_BxL, loop.tokens_BxL)
  assert int(scan.unfilled_B.sum()) == 0 and int(scan.nonfinite_B.sum()) == 0


@pytest.mark.parametrize("make_spec", [
    lambda n: sampling.ConfidenceSpec(steps=2 * n, block_length=n // 5 * 5 or 1, temperature=0.7),
    lambda n: sampling.AncestralSpec(steps=2 * n, block_length=n // 5 * 5 or 1),
    lambda n: sampling.EntropyBoundedSpec(steps=2 * n, block_length=n // 5 * 5 or 1)],
    ids=["confidence", "ancestral", "entropy_bounded"])
@pytest.mark.slow
def test_recompute_adapter_is_exact_on_oracles(make_spec):
  """An exact oracle through the adapter: the dual-cache sampler is the uncached one."""
  cases = [(two_color.exact_denoiser, jnp.full((200, 2), two_color.MASK_ID, jnp.int32), 1),
           (scan_and_add.exact_denoiser, scan_and_add.empty_canvas(64), 5)]
  for denoiser, canvas, block in cases:
    steps = 2 * canvas.shape[1] // block
    spec = dataclasses.replace(make_spec(canvas.shape[1]), steps=steps, block_length=block)
    key = jax.random.key(5)
    plain = sampling.sample(denoiser, None, key, canvas, spec)
    cached = sampling.sample(sampling.recompute_cache(denoiser), None, key, canvas,
                             dataclasses.replace(spec, kv_cache="dual"))
    np.testing.assert_array_equal(cached.tokens_BxL, plain.tokens_BxL)
  assert sampling.recompute_cache(two_color.exact_denoiser) is sampling.recompute_cache(
      two_color.exact_denoiser)  # one adapter per denoiser: one compiled program
  _, _, apply_fn = models.init(_cfg())
  assert sampling.recompute_cache(apply_fn) is apply_fn  # already cached


def _pass_tagging_denoiser():
  """A cached denoiser whose full passes propose token 0 and window passes token 1, so the
  written tokens show which pass fed each step."""

  def logits_for(tokens, favoured):
    return jnp.zeros(tokens.shape + (V,)).at[..., favoured].set(5.0)

  def apply_fn(params, tokens_BxL, t_B):
    return logits_for(tokens_BxL, 0)

  return Denoiser(
      apply_fn, prefill=lambda params, tokens, t_B: (logits_for(tokens, 0), jnp.zeros(())),
      decode=lambda params, cache, tokens_BxW, start, t_B: (logits_for(tokens_BxW, 1), cache))


@pytest.mark.parametrize("refresh_every", [None, 1, 2, 3])
def test_refresh_plan(refresh_every):
  """Full passes at each block's first step and every `refresh_every` steps; a refresh
  skipped at an idle step is made at the next call of the block."""
  apply_fn = _pass_tagging_denoiser()
  tokens = _canvas(batch=2, prompt=PROMPT)
  # Three blocks of 4 masked positions, 8 steps each; the cosine count schedule commits
  # [1, 0, 0, 1, 0, 1, 1, 0] positions at the block's steps j = 0..7.
  spec = sampling.ConfidenceSpec(steps=24, block_length=4, temperature=0.0,
                                 count_schedule=diffusion.CosineSchedule(), kv_cache="dual",
                                 refresh_every=refresh_every, skip_idle_steps=True)
  result = sampling.sample(apply_fn, None, jax.random.key(0), tokens, spec)
  j = np.asarray(result.write_step_BxL)[:, PROMPT:] % 8
  assert sorted(set(j.ravel().tolist())) == [0, 3, 5, 6]
  # The steps that call: writes at 0, 3, 5, 6 (and the idle 1, 2, 4, 7 are skipped).
  refreshed = {None: {0}, 1: {0, 3, 5, 6}, 2: {0, 3, 5, 6}, 3: {0, 3, 6}}[refresh_every]
  # refresh_every=2 plans 0, 2, 4, 6; 2 and 4 are idle, so 3 and 5 refresh instead.
  # refresh_every=3 plans 0, 3, 6, all calling steps.
  expected = np.isin(j, list(refreshed))
  np.testing.assert_array_equal(np.asarray(result.tokens_BxL)[:, PROMPT:] == 0, expected)
  assert int(result.saved_calls) == 12


def test_a_caller_may_fix_the_pass():
  """KVPlan.window_only and full_only run one pass whatever the plan chooses (a served lane
  that knows its rows' passes); full_only refuses the exact cache, whose rows may append."""
  from mdjax.sampling import kv_cache

  denoiser, tokens = _pass_tagging_denoiser(), jnp.asarray(_canvas(batch=2))
  stale = kv_cache.init(denoiser, tokens)  # a new cache: the plan's choice is a refresh
  fresh = stale.replace(stale=jnp.array(False))  # here the plan's choice is the window
  plan = kv_cache.KVPlan(refresh=jnp.array(False), start=jnp.int32(PROMPT))
  favoured = lambda out: int(jnp.argmax(out[0][0, PROMPT]))  # 0: a full pass, 1: a window
  call = lambda state, plan: kv_cache.call(denoiser, state, tokens, 1.0, plan, 4)
  assert favoured(call(stale, plan)) == 0 and favoured(call(fresh, plan)) == 1
  assert favoured(call(stale, plan.replace(window_only=True))) == 1
  full = call(fresh, plan.replace(full_only=True))
  assert favoured(full) == 0 and not bool(full[1].stale)
  with pytest.raises(ValueError, match="full_only"):
    call(fresh, plan.replace(append=jnp.array(True), full_only=True))


def test_bad_input(transformer):
  apply_fn, params = transformer
  key, tokens = jax.random.key(0), _canvas()
  cases = [
      (lambda: sampling.ConfidenceSpec(steps=4, kv_cache="prefix"), "kv_cache='prefix'"),
      (lambda: sampling.ConfidenceSpec(steps=4, block_length=4, kv_cache="dual",
                                       refresh_every=0), "refresh_every=0"),
      (lambda: sampling.ConfidenceSpec(steps=4, refresh_every=2), "refresh_every=2"),
      (lambda: sampling.sample(apply_fn, params, key, tokens,
                               sampling.ConfidenceSpec(steps=6, kv_cache="dual")),
       "block_length=None"),
      (lambda: sampling.sample(apply_fn, params, key, tokens,
                               sampling.ConfidenceSpec(steps=6, block_length=5, kv_cache="dual")),
       "block_length=5 must divide"),
      (lambda: sampling.sample(apply_fn, params, key, tokens,
                               sampling.RemaskSpec(steps=6, kv_cache="dual")),
       "remask family decodes no blocks"),
      (lambda: sampling.sample(stub_denoiser, stub_params(V, L), key, tokens,
                               sampling.ConfidenceSpec(steps=6, block_length=4, kv_cache="dual")),
       "no cached contract"),
      (lambda: sampling.sample(apply_fn, params, key, np.where(np.arange(L) == 10, 3, tokens),
                               sampling.ConfidenceSpec(steps=2, block_length=11,
                                                       kv_cache="dual")),
       "one span shared by every row"),  # a fixed token inside the generated positions
      (lambda: sampling.LocalRemaskSpec(
          base=sampling.ConfidenceSpec(steps=6, block_length=4, kv_cache="dual"),
          refill=sampling.AncestralSpec(steps=2)), "base.kv_cache='dual'"),
  ]
  for make, message in cases:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
      result = make()
      if isinstance(result, sampling.LocalRemaskSpec):
        sampling.sample(apply_fn, params, key, tokens, result)
