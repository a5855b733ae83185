"""Tests of the sampler suite, with exact or stub denoisers (no learning error)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, sampling
from mdjax.sampling import scores, transforms
from mdjax.tasks import two_color
from tests import stubs

N_TWO_COLOR = 20_000
VOCAB, LENGTH = 6, 12
PROMPT = 4  # 8 generated positions: blocks of 2 and 4 divide them


def _two_color_invalid(spec, n=N_TWO_COLOR, seed=0):
  tokens = jnp.full((n, 2), two_color.MASK_ID, jnp.int32)
  result = sampling.sample(two_color.exact_denoiser, None, jax.random.key(seed), tokens, spec)
  assert not np.any(np.asarray(result.tokens_BxL) == two_color.MASK_ID)
  return float(two_color.invalid_fraction(result.tokens_BxL))


def _binomial_tol(p, n):
  """4 standard errors of a binomial proportion."""
  return 4.0 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("steps", [1, 8, 32])
def test_two_color_ancestral_uniform_grid_invalid_fraction(steps):
  # Both positions revealed in one interval (prob 1/K under the linear
  # schedule) are drawn independently: invalid half the time.
  theory = 1.0 / (2 * steps)
  frac = _two_color_invalid(sampling.AncestralSpec(steps=steps))
  assert abs(frac - theory) < _binomial_tol(theory, N_TWO_COLOR), (frac, theory)


def test_two_color_ancestral_unequal_grid_invalid_fraction():
  grid = (1.0, 0.7, 0.2, 0.0)
  widths = -np.diff(grid)
  theory = 0.5 * float(np.sum(widths**2))
  frac = _two_color_invalid(sampling.AncestralSpec(steps=3, grid=grid))
  assert abs(frac - theory) < _binomial_tol(theory, N_TWO_COLOR), (frac, theory)


@pytest.mark.parametrize("spec", [
    sampling.OrderedSpec(groups=((1,), (0,))),
    sampling.RandomOrderSpec(),
    sampling.ConfidenceSpec(steps=2),
], ids=lambda s: type(s).__name__)
def test_two_color_one_position_per_step_is_exact(spec):
  assert _two_color_invalid(spec) == 0.0


def test_two_color_parallel_group_is_wrong_half_the_time():
  theory = 0.5
  frac = _two_color_invalid(sampling.OrderedSpec(groups=((0, 1),)))
  assert abs(frac - theory) < _binomial_tol(theory, N_TWO_COLOR)


def _prompted_canvas(batch=16, prompt=PROMPT):
  rng = np.random.default_rng(1)
  tokens = np.full((batch, LENGTH), VOCAB, np.int32)
  tokens[:, :prompt] = rng.integers(0, VOCAB, (batch, prompt))
  return jnp.asarray(tokens)


def test_remask_eta_zero_equals_ancestral_token_for_token():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas(64)
  key = jax.random.key(7)
  for schedule in (diffusion.LinearSchedule(), diffusion.CosineSchedule()):
    a = sampling.sample(stubs.stub_denoiser, params, key, tokens,
                        sampling.AncestralSpec(steps=9, schedule=schedule))
    r = sampling.sample(stubs.stub_denoiser, params, key, tokens,
                        sampling.RemaskSpec(steps=9, schedule=schedule, eta=0.0))
    np.testing.assert_array_equal(a.tokens_BxL, r.tokens_BxL)
    np.testing.assert_array_equal(a.write_step_BxL, r.write_step_BxL)
    assert int(r.reopened_B.sum()) == 0


def test_remask_reopens_and_keeps_the_marginal_schedule():
  # Per-step masked fraction must follow 1 - alpha(s) whatever sigma does.
  batch, length, steps = 2000, 16, 10
  params = stubs.stub_params(VOCAB, length)
  tokens = jnp.full((batch, length), VOCAB, jnp.int32)
  spec = sampling.RemaskSpec(steps=steps, eta=0.3, record_trajectory=True)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  assert int(result.reopened_B.sum()) > 0
  masked_K = (np.asarray(result.trajectory_KxBxL) == VOCAB).mean(axis=(1, 2))
  expected_K = 1.0 - np.arange(1, steps + 1) / steps
  # Positions are dependent only through the per-row reveal probability;
  # 4 binomial standard errors over B*L draws, doubled for that dependence.
  for got, p in zip(masked_K, expected_K):
    assert abs(got - p) < 2 * _binomial_tol(p, batch * length) + 1e-9, (masked_K, expected_K)


def test_confidence_commits_scheduled_top_k_each_step():
  batch, prompt = 32, 3
  params = stubs.stub_params(VOCAB, LENGTH, seed=3)
  tokens = _prompted_canvas(batch, prompt)
  steps = 4
  for score in ("max_prob", "margin", "neg_entropy"):
    spec = sampling.ConfidenceSpec(steps=steps, score=score, record_trajectory=True,
                                   count_schedule=diffusion.CosineSchedule())
    result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
    traj = np.asarray(result.trajectory_KxBxL)
    before = np.concatenate([np.asarray(tokens)[None], traj[:-1]])
    n = LENGTH - prompt
    remaining = np.asarray(diffusion.CosineSchedule().one_minus_alpha(
        1.0 - np.arange(1, steps + 1) / steps))
    remaining[-1] = 0.0
    target = np.floor(n * remaining + 1e-4).astype(int)
    k_expected = np.concatenate([[n], target[:-1]]) - target
    for i in range(steps):
      new = (before[i] == VOCAB) & (traj[i] != VOCAB)
      np.testing.assert_array_equal(new.sum(1), k_expected[i])
      probs = _softmax(stubs.stub_logits_np(params, before[i]))
      score_np = _np_score(score, probs)
      expected = _np_top_k(score_np, before[i] == VOCAB, k_expected[i])
      np.testing.assert_array_equal(new, expected, err_msg=f"{score} step {i}")


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_score(name, probs):
  if name == "max_prob":
    return probs.max(-1)
  if name == "margin":
    s = np.sort(probs, -1)
    return s[..., -1] - s[..., -2]
  return (probs * np.log(probs)).sum(-1)


def _np_top_k(score, cand, k):
  """Reference: sort by (-score, position), take the first k candidates."""
  out = np.zeros_like(cand)
  for b in range(score.shape[0]):
    idx = [i for i in np.lexsort((np.arange(score.shape[1]), -score[b])) if cand[b, i]]
    out[b, idx[:int(np.broadcast_to(k, (score.shape[0],))[b])]] = True
  return out


def test_select_top_k_matches_numpy_with_ties():
  rng = np.random.default_rng(0)
  score = np.round(rng.normal(size=(64, 20)) * 2) / 2  # many exact ties
  cand = rng.random((64, 20)) < 0.7
  k = rng.integers(0, 21, 64)
  got = np.asarray(scores.select_top_k(jnp.asarray(score), jnp.asarray(cand), jnp.asarray(k)))
  np.testing.assert_array_equal(got, _np_top_k(score, cand, k))


def test_confidence_commit_counts_per_row():
  k = scores.commit_counts(jnp.array([10, 7, 3]), jnp.array([10, 5, 3]), 0.3)
  np.testing.assert_array_equal(k, [7, 3, 3])  # floor(10*.3)=3, floor(7*.3)=2, 0


def test_confidence_threshold_mode():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas()
  spec = sampling.ConfidenceSpec(steps=6, threshold=0.99, record_trajectory=True)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  traj = np.asarray(result.trajectory_KxBxL)
  before = np.concatenate([np.asarray(tokens)[None], traj[:-1]])
  new_per_step = ((before == VOCAB) & (traj != VOCAB)).sum(-1)
  still_masked = (before == VOCAB).any(-1)
  assert np.all(new_per_step[still_masked] >= 1)
  assert not np.any(traj[-1] == VOCAB)


def test_blocks_decode_left_to_right():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas(prompt=4)  # 8 generated positions, blocks of 2
  for spec in (sampling.AncestralSpec(steps=8, block_length=2, record_trajectory=True),
               sampling.ConfidenceSpec(steps=4, block_length=2, record_trajectory=True)):
    result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
    traj = np.asarray(result.trajectory_KxBxL)
    per_block = spec.steps // 4
    for i in range(spec.steps):
      done_blocks = (i + 1) // per_block
      gen = traj[i][:, 4:].reshape(-1, 4, 2)
      assert not np.any(gen[:, :done_blocks] == VOCAB)  # finished blocks complete
      assert np.all(gen[:, (i // per_block) + 1:] == VOCAB)  # later blocks untouched


def test_cache_skips_calls_and_changes_nothing():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas(batch=1)
  plain = sampling.sample(stubs.stub_denoiser, params, jax.random.key(2), tokens,
                          sampling.AncestralSpec(steps=64))
  cached = sampling.sample(stubs.stub_denoiser, params, jax.random.key(2), tokens,
                           sampling.AncestralSpec(steps=64, cache=True))
  np.testing.assert_array_equal(plain.tokens_BxL, cached.tokens_BxL)
  # 9 positions revealed over 64 steps: at most 10 distinct canvases are seen.
  assert int(cached.nfe) <= 10 and int(cached.nfe) + int(cached.saved_calls) == 64


@pytest.mark.parametrize("make", [
    # The first interval reveals each position with probability 0.999: later steps idle.
    lambda **kw: sampling.AncestralSpec(steps=3, grid=(1.0, 1e-3, 5e-4, 0.0), **kw),
    # Threshold 0 commits every proposal at the first step of each block.
    lambda **kw: sampling.ConfidenceSpec(steps=8, block_length=4, threshold=0.0, **kw),
    # The last group holds only a prompt position: nothing is left to write by then.
    lambda **kw: sampling.OrderedSpec(groups=((4, 5), (6, 7, 8), (9, 10, 11), (0,)), **kw),
], ids=["ancestral", "confidence_blocks", "ordered"])
def test_skip_idle_steps_off_calls_every_step_and_changes_nothing(make):
  # An idle step writes nothing whatever the logits, so dropping the skip changes only
  # the call count.
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas(batch=1)
  skipping = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens, make())
  calling = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens,
                            make(skip_idle_steps=False))
  np.testing.assert_array_equal(skipping.tokens_BxL, calling.tokens_BxL)
  np.testing.assert_array_equal(skipping.write_step_BxL, calling.write_step_BxL)
  steps = int(skipping.nfe) + int(skipping.saved_calls)
  assert int(skipping.saved_calls) > 0, "the case must have idle steps to mean anything"
  assert int(calling.nfe) == steps and int(calling.saved_calls) == 0


def test_lowered_program_is_the_sampler():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas(batch=4)
  spec = sampling.ConfidenceSpec(steps=4)
  lowered, args = sampling.lower(stubs.stub_denoiser, params, jax.random.key(2), tokens, spec)
  direct = sampling.sample(stubs.stub_denoiser, params, jax.random.key(2), tokens, spec)
  np.testing.assert_array_equal(lowered.compile()(*args).tokens_BxL, direct.tokens_BxL)


def test_draws_follow_the_transformed_categorical():
  # One position, V = 4, n draws: each frequency within 4 binomial s.e.
  n = 40_000
  logits = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1]))
  logits_BxLxV = jnp.broadcast_to(logits, (n, 1, 4))
  keys = jax.random.split(jax.random.key(0), n)
  cases = {  # (temperature, top_k, top_p, min_p): expected law
      (1.0, None, 1.0, 0.0): np.array([0.5, 0.25, 0.15, 0.1]),
      (1.0, 2, 1.0, 0.0): np.array([2 / 3, 1 / 3, 0, 0]),
      (1.0, None, 0.7, 0.0): np.array([2 / 3, 1 / 3, 0, 0]),  # 0.5 < 0.7 <= 0.75
      (0.5, None, 1.0, 0.0): np.array([0.25, 0.0625, 0.0225, 0.01]) / 0.345,
      (1.0, None, 1.0, 0.25): np.array([0.5, 0.25, 0.15, 0]) / 0.9,  # keep p >= 0.125
      (1.0, None, 1.0, 1.0): np.array([1.0, 0, 0, 0]),  # min-p always keeps the argmax
  }
  for (temperature, top_k, top_p, min_p), expected in cases.items():
    draws = np.asarray(transforms.draw_values(
        keys, logits_BxLxV, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p))[:, 0]
    freq = np.bincount(draws, minlength=4) / n
    for f, p in zip(freq, expected):
      assert abs(f - p) <= _binomial_tol(p, n) + 1e-12, (temperature, top_k, top_p, min_p, freq)
  argmax = transforms.draw_values(keys, logits_BxLxV, temperature=0.0, top_k=None, top_p=1.0)
  assert np.all(np.asarray(argmax) == 0)


def test_temperature_zero_sampler_is_deterministic_across_keys():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas()
  spec = sampling.OrderedSpec.left_to_right(LENGTH, temperature=0.0)
  spec = sampling.OrderedSpec(groups=spec.groups[PROMPT:], temperature=0.0)
  a = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  b = sampling.sample(stubs.stub_denoiser, params, jax.random.key(1), tokens, spec)
  np.testing.assert_array_equal(a.tokens_BxL, b.tokens_BxL)


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.AncestralSpec(steps=0), "steps=0"),
    (lambda: sampling.ConfidenceSpec(steps=4, temperature=-1.0), "temperature=-1.0"),
    (lambda: sampling.AncestralSpec(steps=4, top_p=0.0), "top_p=0.0"),
    (lambda: sampling.AncestralSpec(steps=4, top_p=1.5), "top_p=1.5"),
    (lambda: sampling.AncestralSpec(steps=4, top_k=0), "top_k=0"),
    (lambda: sampling.ConfidenceSpec(steps=4, min_p=1.5), "min_p=1.5"),
    (lambda: sampling.AncestralSpec(steps=2, grid=(1.0, 0.6, 0.7, 0.0)), "grid="),
    (lambda: sampling.AncestralSpec(steps=2, grid=(0.9, 0.5, 0.0)), "decrease strictly"),
    (lambda: sampling.AncestralSpec(steps=2, grid="log"), "grid='log'"),
    (lambda: sampling.OrderedSpec(groups=((0, 1), (1, 2))), "one group only"),
    (lambda: sampling.ConfidenceSpec(steps=2, score="entropy"), "score='entropy'"),
    (lambda: sampling.RemaskSpec(steps=2, sigma="max"), "sigma='max'"),
    (lambda: sampling.RemaskSpec(steps=2, loop_t_on=0.5), "together"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_data_raises_before_tracing():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas(prompt=3)  # 9 generated positions
  run = lambda tok, spec, fixed=None: sampling.sample(
      stubs.stub_denoiser, params, jax.random.key(0), tok, spec, fixed)
  with pytest.raises(ValueError, match="tokens_BxL holds 7"):
    run(tokens.at[0, 0].set(VOCAB + 1), sampling.AncestralSpec(steps=2))
  with pytest.raises(ValueError, match="tokens_BxL holds -1"):
    run(tokens.at[0, 0].set(-1), sampling.AncestralSpec(steps=2))
  fixed = np.zeros((16, LENGTH), bool)
  fixed[:, :4] = True  # position 3 is a mask
  with pytest.raises(ValueError, match="fixed_BxL marks position 3"):
    run(tokens, sampling.AncestralSpec(steps=2), fixed)
  with pytest.raises(ValueError, match="block_length=4 must divide the generation length 9"):
    run(tokens, sampling.AncestralSpec(steps=3, block_length=4))
  with pytest.raises(ValueError, match="steps=4 must be divisible by the number of blocks 3"):
    run(tokens, sampling.ConfidenceSpec(steps=4, block_length=3))
  with pytest.raises(ValueError, match=r"groups miss masked positions \[11\]"):
    run(tokens, sampling.OrderedSpec(groups=tuple((i,) for i in range(3, 11))))
  with pytest.raises(ValueError, match="groups name position 12"):
    run(tokens, sampling.OrderedSpec(groups=tuple((i,) for i in range(3, 13))))
  with pytest.raises(ValueError, match="2-D integer"):
    run(tokens.astype(jnp.float32), sampling.AncestralSpec(steps=2))
