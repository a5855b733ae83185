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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import scores, skipping, threefry, transforms
from mdjax.sampling.base import Core, Family, SamplerSpec, check, knob, register
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.streams import StepStream

Array = jax.Array

ORDERS = ("max_prob", "lowest_index", "fixed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeSpec(SamplerSpec):
  """Exact parallel sampling by speculative verification (see the module docstring).

  Each round drafts up to `k` masked positions, verifies them with one batched call on
  k contexts and commits the accepted prefix plus, after a rejection, one residual
  draw: the output follows the chain-rule law of the transformed conditionals (exact
  with an exact denoiser at temperature 1; temperature, top-k and top-p apply to the
  drafts and the verifier alike, so the target is the transformed conditionals).
  `order` chooses the drafted positions. At most L rounds (one loop); k = 1 is the chain
  rule. `positions`: the write order of order='fixed'.
  """

  k: int = knob(help="Drafts per round (1: the chain rule).", minimum=1)
  order: str = knob("max_prob", help="The drafted positions, from what is known before the "
                    "round: max_prob (most confident predictions first), lowest_index (left "
                    "to right) or fixed (the order of positions).", choices=ORDERS)
  positions: tuple[int, ...] | None = None

  def __post_init__(self):
    super().__post_init__()
    check(isinstance(self.k, (int, np.integer)) and self.k >= 1, "k", self.k,
          "must be an integer >= 1")
    check(self.order in ORDERS, "order", self.order,
          f"must be one of {ORDERS}: a rule that reads only the canvas and the "
          "predictions made before the round (a score of this round's draws would bias it)")
    if self.order == "fixed":
      check(self.positions is not None and len(self.positions) >= 1, "positions",
            self.positions, "order='fixed' needs the write order as a tuple of positions")
      positions = tuple(int(p) for p in self.positions)
      object.__setattr__(self, "positions", positions)
      check(min(positions) >= 0 and len(set(positions)) == len(positions), "positions",
            positions, "must be distinct positions >= 0")
    else:
      check(self.positions is None, "positions", self.positions,
            f"is only used with order='fixed' (order={self.order!r})")


def residual_probs(p_xV: Array, q_xV: Array) -> Array:
  """norm(max(0, p - q)); p itself where p == q (then no rejection can happen)."""
  r = jnp.maximum(p_xV - q_xV, 0.0)
  total = r.sum(-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p_xV)


def _log(probs: Array) -> Array:
  """log p, with -inf (never drawn) where p = 0."""
  return jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)


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
  replacement_BxK = transforms.argmax_last(_log(residual) + gumbel_BxKxV)
  return num_accepted_B, replacement_BxK


def selection_score(spec: SpeculativeSpec, draft_logits_BxLxV: Array,
                    order_rank_L: Array) -> Array:
  """Higher goes first; reads only the canvas's predictions from before the round."""
  length = draft_logits_BxLxV.shape[1]
  if spec.order == "max_prob":
    return jax.nn.softmax(draft_logits_BxLxV.astype(jnp.float32), -1).max(-1)
  if spec.order == "lowest_index":
    return jnp.broadcast_to(-jnp.arange(length, dtype=jnp.float32), draft_logits_BxLxV.shape[:2])
  return jnp.broadcast_to(-order_rank_L.astype(jnp.float32), draft_logits_BxLxV.shape[:2])


def fixed_order_rank(spec: SpeculativeSpec, length: int) -> np.ndarray:
  """Rank of each position in `spec.positions` (unlisted positions last)."""
  rank = np.full(length, length, np.int32)
  if spec.positions is not None:
    rank[list(spec.positions)] = np.arange(len(spec.positions))
  return rank


@struct.dataclass
class SpeculativePlan:
  order_rank_L: Array  # rank of each position in `positions` (order='fixed')


def run_round(denoiser, core: Core, draft_logits_BxLxV: Array, ctx, round_index: Array, *,
              spec: SpeculativeSpec, order_rank_L: Array) -> tuple[Core, Array]:
  """One round for every row: select, draft, one call on k contexts, verify, commit.

  Returns the core and the logits the next round drafts from.
  """
  z_BxL = core.tokens_BxL
  batch, length = z_BxL.shape
  k = spec.k
  keys_B = threefry.fold_in(ctx.keys_B, round_index)
  masked_BxL = ctx.masked(z_BxL)
  active_B = masked_BxL.any(-1)
  q_BxLxV = transforms.transformed_probs(draft_logits_BxLxV, spec)
  draft_BxL = transforms.gumbel_max(keys_B, StepStream.DRAFT, _log(q_BxLxV), ctx.shift_B)
  rank_BxL = scores.rank_descending(scores.eos_last(
      selection_score(spec, draft_logits_BxLxV, order_rank_L), draft_BxL, spec), masked_BxL)
  slot_BxKxL = rank_BxL[:, None, :] == jnp.arange(k)[None, :, None]
  valid_BxK = slot_BxKxL.any(-1)
  pos_BxK = jnp.argmax(slot_BxKxL, -1)
  # Context j: z with the drafts of slots < j written in.
  in_context_BxKxL = masked_BxL[:, None] & (rank_BxL[:, None, :] < jnp.arange(k)[None, :, None])
  contexts_BxKxL = jnp.where(in_context_BxKxL, draft_BxL[:, None], z_BxL[:, None])
  logits_BxKxLxV = denoiser(contexts_BxKxL.reshape(batch * k, length),
                            1.0 - round_index / length, row_major=True)
  logits_BxKxLxV = logits_BxKxLxV.reshape(batch, k, length, -1)
  at_slot = lambda x_BxKxLxV: jnp.take_along_axis(
      x_BxKxLxV, pos_BxK[:, :, None, None], axis=2)[:, :, 0]
  p_BxKxV = transforms.transformed_probs(at_slot(logits_BxKxLxV), spec)
  q_BxKxV = jnp.take_along_axis(q_BxLxV, pos_BxK[..., None], axis=1)
  drafts_BxK = jnp.take_along_axis(draft_BxL, pos_BxK, axis=1)
  u_BxK = transforms.row_uniform(keys_B, StepStream.ACCEPT, (k,))
  num_accepted_B, replacement_BxK = verify(
      p_BxKxV, q_BxKxV, drafts_BxK, valid_BxK, u_BxK,
      transforms.row_gumbel(keys_B, StepStream.RESIDUAL, p_BxKxV.shape[1:]))
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
  core = core.replace(
      tokens_BxL=tokens_BxL,
      write_step_BxL=jnp.where(written_BxL, round_index, core.write_step_BxL),
  ).count(rounds_B=active_B, contexts_B=jnp.where(active_B, num_valid_B, 0), nfe=1)
  return core, jnp.where(active_B[:, None, None], next_logits, draft_logits_BxLxV)


@register
class Speculative(Family):
  """Rounds of draft, verify and commit: one start-up call, then at most L rounds."""

  name = "speculative"
  spec_type = SpeculativeSpec
  composite = True
  refills = False
  python_loop = False

  def bench_spec(self, steps, length):
    # L / K drafts a round: about K rounds.
    return SpeculativeSpec(k=max(length // steps, 1))

  def examples(self, generated):
    return [SpeculativeSpec(k=3), SpeculativeSpec(k=2, order="lowest_index", temperature=0.8),
            SpeculativeSpec(k=4, order="fixed", positions=tuple(reversed(generated)))]

  def num_steps(self, spec, length: int) -> int:
    return length

  def validate(self, spec: SpeculativeSpec, canvas):
    if spec.positions is not None:
      canvas.check_covers("positions", (spec.positions,))

  def plan(self, spec: SpeculativeSpec, canvas) -> SpeculativePlan:
    return SpeculativePlan(order_rank_L=fixed_order_rank(spec, canvas.length))

  def run(self, spec: SpeculativeSpec, denoiser, core: Core, ctx, plan: SpeculativePlan):
    length = core.tokens_BxL.shape[1]
    first_logits = denoiser(core.tokens_BxL, 1.0)
    has_masked_B = ctx.masked(core.tokens_BxL).any(-1)
    core = core.count(contexts_B=has_masked_B.astype(jnp.int32), nfe=1)
    end = EndOfRow.of(spec)

    def round_(carry, round_index):
      core, draft_logits_BxLxV = carry
      round_ctx = end.open(ctx, core.tokens_BxL)  # finished rows freeze
      core, logits = run_round(denoiser, core, draft_logits_BxLxV, round_ctx, round_index,
                               spec=spec, order_rank_L=plan.order_rank_L)
      return end.finish(core, ctx, round_index), logits

    carry = (core, first_logits.astype(jnp.float32))
    record = (lambda carry: carry[0].tokens_BxL) if spec.record_trajectory else None
    if spec.skip_idle_steps is not False:  # rounds end early by design: jump over idle ones
      busy = lambda carry, _: end.open(ctx, carry[0].tokens_BxL).masked(
          carry[0].tokens_BxL).any()
      count_saved = lambda carry, lo, hi: (carry[0].count(saved_calls=hi - lo), carry[1])
      (core, _), trajectory = skipping.loop(round_, busy, length, carry,
                                            skip_range=count_saved, record=record)
    else:
      def body(carry, round_index):
        carry = round_(carry, round_index)
        return carry, (None if record is None else record(carry))

      (core, _), trajectory = jax.lax.scan(body, carry, jnp.arange(length, dtype=jnp.int32))
    return core, None, trajectory
