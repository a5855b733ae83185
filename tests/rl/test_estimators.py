"""The estimators after d1 (`mdjax.rl`): coupled-GRPO's complementary masks (DiffuCoder).

A stub denoiser whose logits are a known function of the canvas lets every pass be recomputed
in numpy: its logit at a position depends on whether that position is masked, on how many
positions of the row are masked, and on the time the pass reads, so a pass that masked the
wrong positions, or a weight on the wrong pass, changes the value.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import rl
from mdjax.rl import logps as logps_lib

V, MASK = 3, 3  # three real ids; the mask id is V (mdjax's models: logits over V ids)


def _stub(params, tokens_BxL, t_B):
  """logits[b, i] = masked_i or visible_i (by whether position i is masked) + count_b * w +
  t_b * u: each pass of a row is told apart."""
  is_mask_BxL = tokens_BxL == MASK
  base = jnp.where(is_mask_BxL[..., None], params["masked"][None], params["visible"][None])
  count_B = is_mask_BxL.sum(-1).astype(jnp.float32)
  return base + count_B[:, None, None] * params["w"] + t_B[:, None, None] * params["u"]


def _params(length, seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=shape), jnp.float32)
          for k, shape in (("masked", (length, V)), ("visible", (length, V)), ("w", (V,)),
                           ("u", (V,)))}


def _numpy_stub_logp(params, noisy_BxL, targets_BxC, prompt_length):
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  is_mask = noisy_BxL == MASK
  t = is_mask[:, prompt_length:].mean(-1)
  logits = (np.where(is_mask[..., None], p["masked"][None], p["visible"][None])
            + is_mask.sum(-1)[:, None, None] * p["w"] + t[:, None, None] * p["u"])
  logits = logits[:, prompt_length:]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return np.take_along_axis(logp, targets_BxC[..., None], -1)[..., 0]


def test_complementary_masks_cover_each_completion_token_exactly_once_per_pair():
  """The canvases the estimator feeds the denoiser: pass 1 masks the whole completion, passes
  2 and 3 mask each completion position exactly once between them, and none masks the
  prompt. The pair's masked fraction is t ~ U[0.2, 0.8] up to sampling error: over B x C =
  4096 positions a binomial fraction has s.e. sqrt(t (1 - t) / 4096) <= 0.0079; 5 s.e. =
  0.04."""
  batch, prompt_length, completion = 64, 2, 64
  seen = []

  def recording(params, tokens_BxL, t_B):
    seen.append(np.asarray(tokens_BxL))
    return _stub(params, tokens_BxL, t_B)

  ids = np.random.default_rng(0).integers(0, V, (batch, prompt_length + completion)).astype(
      np.int32)
  for seed in range(10):
    seen.clear()
    rl.coupled_logps_fn(recording, _params(prompt_length + completion), ids, prompt_length,
                        jax.random.key(seed), mask_id=MASK)
    (canvas,) = seen  # one denoiser call of 3 B rows
    hidden = (canvas == MASK).reshape(3, batch, -1)
    assert not hidden[:, :, :prompt_length].any()
    assert hidden[0, :, prompt_length:].all()
    pair = hidden[1:, :, prompt_length:].astype(int)
    np.testing.assert_array_equal(pair.sum(0), 1)
    _, t = logps_lib.complementary_masks(jax.random.key(seed), batch, completion)
    assert 0.2 <= float(t) <= 0.8
    assert abs(pair[0].mean() - float(t)) < 0.04, (pair[0].mean(), float(t))


def test_coupled_logps_against_a_numpy_transcription_of_diffucoder():
  """DiffuCoder's `selective_log_softmax`: (p0 + where(M, p1 / t, p2 / (1 - t))) / 2, with p0
  the fully masked pass, p1 the pass masking M, p2 the pass masking its complement; the
  prompt never masked. Recomputed from the same key's masks in numpy (float64)."""
  batch, prompt_length, completion = 4, 3, 6
  length = prompt_length + completion
  rng = np.random.default_rng(1)
  ids = rng.integers(0, V, size=(batch, length)).astype(np.int32)
  params = _params(length)
  key = jax.random.key(7)
  got = np.asarray(rl.coupled_logps_fn(_stub, params, ids, prompt_length, key, mask_id=MASK))
  first_BxC, t = logps_lib.complementary_masks(key, batch, completion)
  first, t = np.asarray(first_BxC), float(t)
  assert first.any() and (~first).any()  # both passes mask something here
  targets = ids[:, prompt_length:]
  passes = []
  for hidden in (np.ones_like(first), first, ~first):
    noisy = ids.copy()
    noisy[:, prompt_length:][hidden] = MASK
    passes.append(_numpy_stub_logp(params, noisy, targets, prompt_length))
  want = (passes[0] + np.where(first, passes[1] / t, passes[2] / (1 - t))) / 2
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Not the one-step estimate: the pair's passes count.
  assert np.abs(got - passes[0]).max() > 0.1


def test_coupled_gradient_raises_the_tokens_of_a_positive_advantage():
  """One GRPO step on the coupled estimate with a positive advantage raises every masked
  pass's log-probability of the completion's tokens (the weights 1 / t, 1 / (1 - t) and 1/2
  are positive), a negative advantage lowers it."""
  batch, prompt_length, completion = 2, 2, 4
  length = prompt_length + completion
  ids = np.random.default_rng(2).integers(0, V, size=(batch, length)).astype(np.int32)
  params = _params(length, seed=3)
  key = jax.random.key(4)
  mask = jnp.ones((batch, completion))

  def loss(p, advantages):
    logps = rl.coupled_logps_fn(_stub, p, ids, prompt_length, key, mask_id=MASK)
    return rl.grpo_loss(logps, None, None, advantages, mask, epsilon=0.2, beta=0.0)[0]

  def value(p):
    return float(rl.coupled_logps_fn(_stub, p, ids, prompt_length, key, mask_id=MASK).sum())

  for sign in (1.0, -1.0):
    advantages = jnp.full((batch,), sign)
    grads = jax.grad(loss)(params, advantages)
    stepped = jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)
    assert np.sign(value(stepped) - value(params)) == sign


def test_coupled_bad_range_is_refused():
  ids = np.zeros((2, 5), np.int32)
  with pytest.raises(ValueError, match=r"\(t_min, t_max\)=\(0.0, 0.8\)"):
    rl.coupled_logps_fn(_stub, _params(5), ids, 2, jax.random.key(0), mask_id=MASK, t_min=0.0)


# --- SPG: the sandwiched bounds and block-wise masks ------------------------------------------

from itertools import combinations, product  # noqa: E402
from math import comb  # noqa: E402

from mdjax.rl import spg  # noqa: E402

N_POS = 3  # a joint law over V^3, no prompt


def _joint(seed):
  """A strictly positive joint law over V^N_POS with strong dependence between positions."""
  rng = np.random.default_rng(seed)
  table = rng.dirichlet(np.full(V ** N_POS, 0.3))
  return np.maximum(table, 1e-3) / np.maximum(table, 1e-3).sum()


def _exact_denoiser(params, tokens_BxL, t_B):
  """The law's exact posterior marginals given the visible positions (the oracle contract)."""
  del t_B
  all_KxN = jnp.asarray(list(product(range(V), repeat=N_POS)), jnp.int32)
  agree_BxK = jnp.all((tokens_BxL[:, None, :] == MASK) | (tokens_BxL[:, None, :] == all_KxN[None]),
                      -1)
  weight_BxK = params["p"][None] * agree_BxK
  onehot_KxNxV = jax.nn.one_hot(all_KxN, V)
  post_BxNxV = jnp.einsum("bk,knv->bnv", weight_BxK, onehot_KxNxV)
  return jnp.log(post_BxNxV / post_BxNxV.sum(-1, keepdims=True))


def _one_block_law():
  """Every mask of SPG's masking with one block and no prompt noise: m ~ U{1..n}, a uniform
  m-subset; (hidden_NxC, probability_N)."""
  masks, probs = [], []
  for m in range(1, N_POS + 1):
    for subset in combinations(range(N_POS), m):
      hidden = np.zeros(N_POS, bool)
      hidden[list(subset)] = True
      masks.append(hidden)
      probs.append(1.0 / (N_POS * comb(N_POS, m)))
  return np.array(masks), np.array(probs)


@pytest.mark.parametrize("eubo_beta", [1.0, 1.5, 2.0])
def test_spg_bounds_sandwich_the_exact_log_likelihood_by_enumeration(eubo_beta):
  """On an exact denoiser of a dependent law over 3 positions, with every mask of the
  one-block law enumerated (weights = their probabilities, no Monte Carlo): the ELBO equals
  log p(x) (the any-order chain rule averaged over orders), the EUBO is above it (Jensen per
  token: sum_i (1 / beta) log E[p(x_i | visible)^beta] >= sum_i E[log p(x_i | visible)]),
  strictly for a dependent law. Every x of the law is checked."""
  params = {"p": jnp.asarray(_joint(0), jnp.float32)}
  xs = np.asarray(list(product(range(V), repeat=N_POS)), np.int32)
  hidden_NxC, probs_N = _one_block_law()
  hidden_NxBxC = jnp.asarray(np.broadcast_to(hidden_NxC[:, None], (len(probs_N),) + xs.shape))
  logp = spg.masked_logps(_exact_denoiser, params, xs, hidden_NxBxC, 0, mask_id=MASK)
  elbo, eubo = spg.sandwich_bounds(logp, hidden_NxBxC, np.ones(xs.shape, bool),
                                   eubo_beta=eubo_beta, weights_N=probs_N)
  exact = np.log(_joint(0))  # the table's order is product()'s, as xs
  np.testing.assert_allclose(np.asarray(elbo), exact, atol=2e-5)
  gap = np.asarray(eubo) - exact
  assert (gap > 1e-3).all(), gap.min()
  # beta closer to 1 is tighter (the power mean grows with beta).
  if eubo_beta > 1.0:
    _, eubo_1 = spg.sandwich_bounds(logp, hidden_NxBxC, np.ones(xs.shape, bool), eubo_beta=1.0,
                                    weights_N=probs_N)
    assert (np.asarray(eubo) >= np.asarray(eubo_1) - 1e-5).all()


def test_spg_block_masks_follow_the_block_law():
  """Completion 6 in blocks of 2, EOS at position 3 in row 1 (its blocks: 0 and 1), no prompt
  noise: each draw is clean blocks, the chosen block with 1..its length masked, then masked;
  past the EOS always masked. The chosen block is uniform over the row's blocks: over 4000
  draws each of row 0's 3 blocks has frequency 1/3 +- 5 s.e. (s.e. sqrt(2/9 / 4000) =
  0.0075)."""
  comp = np.ones((2, 6), bool)
  comp[1, 4:] = False  # completion_mask: up to and including the EOS at 3
  hidden = np.asarray(spg.block_masks(jax.random.key(0), comp, 2, block_length=2,
                                      num_draws=4000, p_mask_prompt=0.0))
  assert hidden.shape == (4000, 2, 8) and not hidden[:, :, :2].any()
  chosen = {0: [], 1: []}
  for n in range(4000):
    for b in range(2):
      row = hidden[n, b, 2:]
      first = int(np.argmax(row))  # the chosen block holds the first masked position
      block = first // 2
      assert not row[:2 * block].any() and row[2 * block + 2:].all()
      assert row[2 * block:2 * block + 2].sum() >= 1
      chosen[b].append(block)
      if b == 1:
        assert row[4:].all() and block <= 1
  freq = np.bincount(chosen[0], minlength=3) / 4000
  assert np.abs(freq - 1 / 3).max() < 5 * np.sqrt(2 / 9 / 4000), freq
  assert set(chosen[1]) == {0, 1}
  # d1's light masking reaches the prompt and the clean blocks only.
  noisy = np.asarray(spg.block_masks(jax.random.key(1), comp, 2, block_length=2,
                                     num_draws=2000, p_mask_prompt=0.5))
  assert 0.45 < noisy[:, :, :2].mean() < 0.55


def test_spg_loss_picks_the_bound_by_the_advantage_sign_and_its_gradient_sign():
  """v = ELBO where A > 0, w EUBO + (1 - w) ELBO where A <= 0 ('mix'); loss = -sum A v / sum
  L (SPG's). A gradient step on the loss raises a positive row's ELBO and lowers a negative
  row's EUBO."""
  elbo = jnp.asarray([-3.0, -2.0, -5.0])
  eubo = jnp.asarray([-1.0, -0.5, -4.0])
  adv = jnp.asarray([1.0, -0.5, -0.5])
  comp = np.ones((3, 4))
  loss, metrics = spg.spg_loss(elbo, eubo, adv, comp, negative="mix", mix_weight=0.25)
  want = -(1.0 * -3.0 - 0.5 * (0.25 * -0.5 + 0.75 * -2.0) - 0.5 * (0.25 * -4.0 + 0.75 * -5.0))
  np.testing.assert_allclose(float(loss), want / 12, rtol=1e-6)
  assert float(metrics["positive_fraction"]) == pytest.approx(1 / 3)
  g_elbo, g_eubo = jax.grad(lambda a, b: spg.spg_loss(a, b, adv, comp, negative="eubo")[0],
                            argnums=(0, 1))(elbo, eubo)
  assert float(g_elbo[0]) < 0 and float(g_elbo[1]) == 0  # descent raises the positive's ELBO
  assert float(g_eubo[1]) > 0 and float(g_eubo[0]) == 0  # and lowers the negative's EUBO
  with pytest.raises(ValueError, match="negative='upper'"):
    spg.spg_loss(elbo, eubo, adv, comp, negative="upper")
