"""Exact denoisers under any noise process, by enumerating a task's law.

A task whose law is enumerable gives it as a `Support`: a mixture over S components, each a
product law over the L positions,

    p(x0) = sum_s probs_S[s] prod_i laws_SxLxV[s, i, x0_i]

(a list of sequences is the one-hot case; sudoku4's prompt cells, given or blank
independently per grid, are one component per grid). Under a process with per-position
likelihoods e_i(v) = q_t(z_i | x0_i = v) the posterior marginal is, exactly,

    p(x0_i = v | z) oc sum_s probs_S[s] prod_{j != i} (laws[s, j] . e_j) laws[s, i, v] e_i(v),

which `exact_posterior` computes in one pass per row (the leave-one-out products done in
logs, with zeros counted so absorbing noise's hard evidence is exact). At a state the law
cannot produce (every component ruled out) position i gets its prior marginal times its own
evidence, normalised (for absorbing noise: one-hot at a visible token, the all-masked
marginal at a mask, as the tasks' own exact denoisers do).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import errors
from mdjax.noise.process import NoiseProcess

Array = jax.Array

MAX_ENTRIES = 2**24  # S x L x V above this is "too large to enumerate" (64 MiB of float32)
ROW_ENTRIES = 2**22  # S x L entries per chunk of rows evaluated at once


@dataclasses.dataclass(frozen=True, eq=False)
class Support:
  """A task's law as a mixture of product laws (module docstring): `laws_SxLxV` (float32,
  each [s, i] a law over the V tokens) and `probs_S` (summing to 1)."""

  laws_SxLxV: np.ndarray
  probs_S: np.ndarray

  @classmethod
  def of_sequences(cls, tokens_SxL, probs_S, vocab_size: int) -> "Support":
    """The law of a list of sequences with their probabilities (one-hot components)."""
    tokens_SxL = np.asarray(tokens_SxL)
    laws = np.zeros(tokens_SxL.shape + (vocab_size,), np.float32)
    np.put_along_axis(laws, tokens_SxL[..., None], 1.0, -1)
    return cls(laws, np.asarray(probs_S, np.float32))

  @property
  def arrays(self) -> tuple[Array, Array]:
    """(laws_SxLxV, log_probs_S) as jax arrays: the exact denoiser's params."""
    with np.errstate(divide="ignore"):
      return jnp.asarray(self.laws_SxLxV), jnp.asarray(np.log(self.probs_S))


def check_enumerable(task: str, components: int, length: int, vocab_size: int) -> None:
  """An ArgumentError when a law of `components` components is too large to enumerate."""
  entries = components * length * vocab_size
  if entries > MAX_ENTRIES:
    raise errors.ArgumentError(
        "noise", f"the law of task {task!r} is too large to enumerate: {components} components "
        f"of {length} x {vocab_size}, {entries} entries, more than the {MAX_ENTRIES} an exact "
        "denoiser under uniform or hybrid noise enumerates; choose smaller task parameters "
        "(task_kwargs) or absorbing noise.")


def _row_posterior(laws_SxLxV, log_probs_S, prior_LxV, evidence_LxV):
  """p(x0_i | z) (L x V) of one row from its evidence e_i(v)."""
  comp_SxL = jnp.einsum("slv,lv->sl", laws_SxLxV, evidence_LxV)
  zero_SxL = comp_SxL <= 0
  log_comp_SxL = jnp.log(jnp.where(zero_SxL, 1.0, comp_SxL))
  zeros_S = zero_SxL.sum(-1)
  log_rest_S = log_probs_S + log_comp_SxL.sum(-1)  # over the nonzero factors
  # Component s's weight for position i: the product over j != i, zero if another j is zero.
  loo_SxL = jnp.where(zero_SxL, jnp.where(zeros_S == 1, log_rest_S, -jnp.inf)[:, None],
                      jnp.where(zeros_S == 0, log_rest_S, -jnp.inf)[:, None] - log_comp_SxL)
  top_L = loo_SxL.max(0)
  top_L = jnp.where(jnp.isfinite(top_L), top_L, 0.0)
  weight_SxL = jnp.exp(loo_SxL - top_L)
  unnorm_LxV = jnp.einsum("sl,slv->lv", weight_SxL, laws_SxLxV) * evidence_LxV
  total_L = unnorm_LxV.sum(-1, keepdims=True)
  # A state the law cannot produce: the prior marginal times the position's own evidence.
  fallback = prior_LxV * evidence_LxV
  fallback_total = fallback.sum(-1, keepdims=True)
  evidence_only = evidence_LxV / jnp.maximum(evidence_LxV.sum(-1, keepdims=True), 1e-30)
  fallback = jnp.where(fallback_total > 0, fallback / jnp.where(fallback_total > 0,
                                                                 fallback_total, 1.0),
                       evidence_only)
  return jnp.where(total_L > 0, unnorm_LxV / jnp.where(total_L > 0, total_L, 1.0), fallback)


@functools.partial(jax.jit, static_argnames="process")
def exact_posterior(process: NoiseProcess, laws_SxLxV: Array, log_probs_S: Array,
                    tokens_BxL: Array, t_B: Array) -> Array:
  """The exact posterior marginals p(x0_i | x_t = tokens) (B x L x V) of the law
  (laws_SxLxV, log_probs_S) under `process` at times t_B (module docstring).

  Rows are vmapped in chunks of at most ROW_ENTRIES / (S x L) rows, so memory stays bounded.
  """
  tokens_BxL = jnp.asarray(tokens_BxL)
  t_B = jnp.broadcast_to(jnp.asarray(t_B, jnp.result_type(float)), tokens_BxL.shape[:1])
  evidence_BxLxV = process.likelihood(tokens_BxL, t_B)
  prior_LxV = jnp.einsum("s,slv->lv", jnp.exp(log_probs_S), laws_SxLxV)
  num_s, length = laws_SxLxV.shape[:2]
  chunk = max(1, ROW_ENTRIES // (num_s * length))
  row = functools.partial(_row_posterior, laws_SxLxV, log_probs_S, prior_LxV)
  return jax.lax.map(row, evidence_BxLxV, batch_size=min(chunk, tokens_BxL.shape[0]))


@functools.lru_cache(maxsize=64)
def exact_denoiser(process: NoiseProcess):
  """The denoiser contract under `process`: (support.arrays, tokens_BxL, t_B) -> log p(x0_i |
  x_t) (B x L x V); its params are `Support.arrays`, so one compiled program serves every law
  of a shape (one function per process: its programs compile once)."""

  def denoiser(support_arrays, tokens_BxL, t_B):
    laws_SxLxV, log_probs_S = support_arrays
    probs = exact_posterior(process, laws_SxLxV, log_probs_S, tokens_BxL, t_B)
    return jnp.log(probs)

  return denoiser
