"""Exact parallel sampling by speculative verification.

One round, per row, with canvas z and masked set M:

1. Choose an ordered list of up to k masked positions i_1..i_k by a rule that reads
   the canvas and the predictions made before this round, never this round's draws.
2. Drafts d_j ~ q_j, the (transformed) predictions at i_j carried from the last call.
3. One batched denoiser call on k contexts: context j is z with d_1..d_{j-1} written in,
   and p_j is the (transformed) distribution at i_j in context j.
4. Accept d_1, d_2, ... in turn, each with probability min(1, p_j(d_j) / q_j(d_j)); at the
   first rejection j, commit a draw from the normalised residual max(0, p_j - q_j) and
   leave the later positions masked.

Each committed value is then an exact draw from p_j, the conditional given everything
committed before it, whatever q was (the speculative-sampling identity), so the output
follows the chain-rule law of the (transformed) conditionals: exact with an exact
denoiser at temperature 1. Positions the rule accepts with probability 1 (independent of
the drafts before them) still go in parallel. The drafts of a round come from the
context of the previous round closest to the new canvas (the one where the rejection
happened, or the last one), so a round costs one call; one extra call at the start
gives the first drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import specs as specs_lib
from mdjax.sampling import transforms

Array = jax.Array

# Random streams of one round (beyond those in transforms).
DRAFT, ACCEPT, RESIDUAL = 10, 11, 12


@struct.dataclass
class Carry:
  tokens_BxL: Array
  draft_logits_BxLxV: Array  # predictions the next drafts are drawn from
  write_step_BxL: Array
  rounds_B: Array  # rounds in which the row still had masked positions
  evals_B: Array  # contexts evaluated for the row (k_eff per round, 1 at the start)
  nfe: Array  # batched denoiser calls made
  saved_calls: Array  # rounds skipped because every row was finished


def transformed_probs(logits: Array, spec: specs_lib.SamplerSpec) -> Array:
  """The distribution values are drawn from: temperature, top-k, top-p; T = 0 is one-hot."""
  if spec.temperature == 0.0:
    return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(transforms.transform_logits(logits, **spec.transform), -1)


def residual_probs(p_xV: Array, q_xV: Array) -> Array:
  """norm(max(0, p - q)); p itself where p == q (then no rejection can happen)."""
  r = jnp.maximum(p_xV - q_xV, 0.0)
  total = r.sum(-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_xV)


def verify(p_BxKxV: Array, q_BxKxV: Array, drafts_BxK: Array, valid_BxK: Array, u_BxK: Array,
           gumbel_BxKxV: Array) -> tuple[Array, Array]:
  """The speculative acceptance rule along each row's ordered drafts.

  Draft j is accepted when u_j q_j(d_j) < p_j(d_j) (probability min(1, p/q)); the
  accepted prefix stops at the first rejection or invalid slot. Returns
  (num_accepted_B, replacement_BxK): a residual draw per slot (Gumbel-max), used only
  at the first rejection.
  """
  pick = lambda probs: jnp.take_along_axis(probs, drafts_BxK[..., None], -1)[..., 0]
  accept_BxK = (u_BxK * pick(q_BxKxV) < pick(p_BxKxV)) & valid_BxK
  num_accepted_B = jnp.cumprod(accept_BxK, axis=-1).sum(-1).astype(jnp.int32)
  residual = residual_probs(p_BxKxV, q_BxKxV)
  log_residual = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf)
  replacement_BxK = jnp.argmax(log_residual + gumbel_BxKxV, -1).astype(jnp.int32)
  return num_accepted_B, replacement_BxK


def selection_score(spec: specs_lib.SpeculativeSpec, draft_logits_BxLxV: Array,
                    order_rank_L: Array) -> Array:
  """Higher goes first; reads only the canvas's predictions from before the round."""
  length = draft_logits_BxLxV.shape[1]
  if spec.order == "max_prob":
    return jax.nn.softmax(draft_logits_BxLxV.astype(jnp.float32), -1).max(-1)
  if spec.order == "lowest_index":
    return jnp.broadcast_to(-jnp.arange(length, dtype=jnp.float32), draft_logits_BxLxV.shape[:2])
  return jnp.broadcast_to(-order_rank_L.astype(jnp.float32), draft_logits_BxLxV.shape[:2])


def fixed_order_rank(spec: specs_lib.SpeculativeSpec, length: int) -> np.ndarray:
  """Rank of each position in `spec.positions` (unlisted positions last)."""
  rank = np.full(length, length, np.int32)
  if spec.positions is not None:
    rank[list(spec.positions)] = np.arange(len(spec.positions))
  return rank


def run_round(apply_fn, params, keys_B: Array, carry: Carry, round_index: Array, *,
              spec: specs_lib.SpeculativeSpec, editable_BxL: Array, order_rank_L: Array,
              mask_id: int) -> Carry:
  """One round for every row: select, draft, one call on k contexts, verify, commit."""
  z_BxL = carry.tokens_BxL
  batch, length = z_BxL.shape
  k = spec.k
  keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, round_index)
  masked_BxL = (z_BxL == mask_id) & editable_BxL
  active_B = masked_BxL.any(-1)
  rank_BxL = transforms.rank_descending(
      selection_score(spec, carry.draft_logits_BxLxV, order_rank_L), masked_BxL)
  slot_BxKxL = rank_BxL[:, None, :] == jnp.arange(k)[None, :, None]
  valid_BxK = slot_BxKxL.any(-1)
  pos_BxK = jnp.argmax(slot_BxKxL, -1)
  q_BxLxV = transformed_probs(carry.draft_logits_BxLxV, spec)
  gumbel_BxLxV = transforms.row_gumbel(keys_B, DRAFT, q_BxLxV.shape[1:])
  log_q = jnp.where(q_BxLxV > 0, jnp.log(jnp.maximum(q_BxLxV, 1e-38)), -jnp.inf)
  draft_BxL = jnp.argmax(log_q + gumbel_BxLxV, -1).astype(jnp.int32)
  # Context j: z with the drafts of slots < j written in.
  in_context_BxKxL = masked_BxL[:, None] & (rank_BxL[:, None, :] < jnp.arange(k)[None, :, None])
  contexts_BxKxL = jnp.where(in_context_BxKxL, draft_BxL[:, None], z_BxL[:, None])
  t = jnp.full((batch * k,), 1.0 - round_index / length, jnp.float32)
  logits_BxKxLxV = apply_fn(params, contexts_BxKxL.reshape(batch * k, length), t)
  logits_BxKxLxV = logits_BxKxLxV.reshape(batch, k, length, -1)
  at_slot = lambda x_BxKxLxV: jnp.take_along_axis(
      x_BxKxLxV, pos_BxK[:, :, None, None], axis=2)[:, :, 0]
  p_BxKxV = transformed_probs(at_slot(logits_BxKxLxV), spec)
  q_BxKxV = jnp.take_along_axis(q_BxLxV, pos_BxK[..., None], axis=1)
  drafts_BxK = jnp.take_along_axis(draft_BxL, pos_BxK, axis=1)
  u_BxK = transforms.row_uniform(keys_B, ACCEPT, (k,))
  num_accepted_B, replacement_BxK = verify(
      p_BxKxV, q_BxKxV, drafts_BxK, valid_BxK, u_BxK,
      transforms.row_gumbel(keys_B, RESIDUAL, p_BxKxV.shape[1:]))
  num_valid_B = valid_BxK.sum(-1)
  # Commit the accepted prefix of drafts and, after a rejection, the residual draw.
  accepted_BxL = masked_BxL & (rank_BxL < num_accepted_B[:, None])
  rejected_slot_B = jnp.minimum(num_accepted_B, k - 1)
  replacement_B = jnp.take_along_axis(replacement_BxK, rejected_slot_B[:, None], 1)[:, 0]
  replaced_BxL = masked_BxL & (rank_BxL == num_accepted_B[:, None]) & (
      num_accepted_B < num_valid_B)[:, None]
  tokens_BxL = jnp.where(accepted_BxL, draft_BxL, z_BxL)
  tokens_BxL = jnp.where(replaced_BxL, replacement_B[:, None], tokens_BxL)
  written_BxL = accepted_BxL | replaced_BxL
  # The next drafts come from the context closest to the new canvas.
  closest_B = jnp.minimum(num_accepted_B, jnp.maximum(num_valid_B - 1, 0))
  next_logits = jnp.take_along_axis(logits_BxKxLxV, closest_B[:, None, None, None], 1)[:, 0]
  return carry.replace(
      tokens_BxL=tokens_BxL,
      draft_logits_BxLxV=jnp.where(active_B[:, None, None], next_logits,
                                   carry.draft_logits_BxLxV),
      write_step_BxL=jnp.where(written_BxL, round_index, carry.write_step_BxL),
      rounds_B=carry.rounds_B + active_B,
      evals_B=carry.evals_B + jnp.where(active_B, num_valid_B, 0),
      nfe=carry.nfe + 1)


def sample_program(apply_fn, params, keys_B: Array, tokens_BxL: Array, fixed_BxL: Array, *,
                   spec: specs_lib.SpeculativeSpec, mask_id: int):
  """The whole loop: one start-up call, then at most L rounds in one lax.scan.

  Returns (carry, trajectory_RxBxL or None).
  """
  batch, length = tokens_BxL.shape
  editable_BxL = ~fixed_BxL
  order_rank_L = jnp.asarray(fixed_order_rank(spec, length))
  first_logits = apply_fn(params, tokens_BxL, jnp.ones((batch,), jnp.float32))
  zero = jnp.zeros((), jnp.int32)
  has_masked_B = ((tokens_BxL == mask_id) & editable_BxL).any(-1)
  carry = Carry(tokens_BxL=tokens_BxL, draft_logits_BxLxV=first_logits.astype(jnp.float32),
                write_step_BxL=jnp.full((batch, length), -1, jnp.int32),
                rounds_B=jnp.zeros((batch,), jnp.int32),
                evals_B=has_masked_B.astype(jnp.int32), nfe=zero + 1, saved_calls=zero)

  def body(carry: Carry, round_index):
    def go():
      return run_round(apply_fn, params, keys_B, carry, round_index, spec=spec,
                       editable_BxL=editable_BxL, order_rank_L=order_rank_L, mask_id=mask_id)

    if spec.skip_idle_steps:
      busy = ((carry.tokens_BxL == mask_id) & editable_BxL).any()
      carry = jax.lax.cond(busy, go, lambda: carry.replace(saved_calls=carry.saved_calls + 1))
    else:
      carry = go()
    return carry, (carry.tokens_BxL if spec.record_trajectory else None)

  return jax.lax.scan(body, carry, jnp.arange(length, dtype=jnp.int32))
