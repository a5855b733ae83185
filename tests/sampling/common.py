"""Canvases, tolerances and numpy references shared by the sampler tests."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import sampling
from mdjax.tasks import two_color

N_TWO_COLOR = 20_000
VOCAB, LENGTH = 6, 12
PROMPT = 4  # 8 generated positions: blocks of 2 and 4 divide them


def two_color_invalid(spec, n=N_TWO_COLOR, seed=0):
  tokens = jnp.full((n, 2), two_color.MASK_ID, jnp.int32)
  result = sampling.sample(two_color.exact_denoiser, None, jax.random.key(seed), tokens, spec)
  assert not np.any(np.asarray(result.tokens_BxL) == two_color.MASK_ID)
  return float(two_color.invalid_fraction(result.tokens_BxL))


def binomial_tol(p, n):
  """4 standard errors of a binomial proportion."""
  return 4.0 * math.sqrt(p * (1 - p) / n)


def prompted_canvas(batch=16, prompt=PROMPT):
  rng = np.random.default_rng(1)
  tokens = np.full((batch, LENGTH), VOCAB, np.int32)
  tokens[:, :prompt] = rng.integers(0, VOCAB, (batch, prompt))
  return jnp.asarray(tokens)


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def np_score(name, probs):
  if name == "max_prob":
    return probs.max(-1)
  if name == "margin":
    s = np.sort(probs, -1)
    return s[..., -1] - s[..., -2]
  return (probs * np.log(probs)).sum(-1)


def np_top_k(score, cand, k):
  """Reference: sort by (-score, position), take the first k candidates."""
  out = np.zeros_like(cand)
  for b in range(score.shape[0]):
    idx = [i for i in np.lexsort((np.arange(score.shape[1]), -score[b])) if cand[b, i]]
    out[b, idx[:int(np.broadcast_to(k, (score.shape[0],))[b])]] = True
  return out

