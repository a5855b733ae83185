"""Localized remasking (PURE-style): fill, re-score, remask around the worst drops, refill."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import contexts, scores, stepping, transforms
from mdjax.sampling.base import (Canvas, Context, Core, Family, SamplerSpec, check,
                                 family_of, knob, make_spec, register)
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.streams import RowStream, StepStream

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalRemaskSpec(SamplerSpec):
  """Localized remasking (PURE-style): fill the canvas, then repair it locally.

  `base` fills the canvas. Each round re-scores every committed token in its current
  context (the probability of its own value with its group of positions i mod
  `score_groups` masked: one batched call), picks the `seeds` positions whose probability
  dropped most since they were written, remasks a `window` around each and a random
  `context_fraction` of the editable positions before the windows, and refills them with
  `refill`. Fixed positions are never touched. The spec's own temperature / top-k / top-p / min-p are
  unused: `base` and `refill` carry theirs. Not exact: the refill resamples a subset
  given the rest, chosen by a score of the sample itself.
  """

  base: SamplerSpec
  refill: SamplerSpec
  rounds: int = knob(2, help="Repair rounds after the base fills the canvas.", minimum=1)
  seeds: int = knob(1, help="Positions per round whose probability dropped most since they "
                    "were written: the windows' centres.", minimum=1)
  window: int = knob(2, help="Positions remasked either side of each seed.", minimum=0)
  context_fraction: float = knob(0.0, help="A random fraction of the editable positions "
                                 "before the windows remasked too.", minimum=0.0, maximum=1.0)
  score_groups: int = knob(4, help="Leave-group-out contexts that re-score the committed "
                           "tokens (positions i mod score_groups masked together).", minimum=1)

  def __post_init__(self):
    super().__post_init__()
    base_family = family_of(self.base)
    check(not base_family.composite, "base", type(self.base).__name__,
          "must be a step-wise family (not a composite one)")
    refill_family = family_of(self.refill)
    check(refill_family.refills and not refill_family.composite, "refill",
          type(self.refill).__name__, "must be a family that can fill any set of positions")
    block_length = refill_family.block_length(self.refill)
    check(block_length is None, "refill.block_length", block_length,
          "blocks need a known generation length")
    for name in ("rounds", "seeds", "score_groups"):
      value = getattr(self, name)
      check(isinstance(value, (int, np.integer)) and value >= 1, name, value,
            "must be an integer >= 1")
    check(isinstance(self.window, (int, np.integer)) and self.window >= 0, "window",
          self.window, "must be an integer >= 0")
    check(0.0 <= self.context_fraction <= 1.0, "context_fraction", self.context_fraction,
          "must lie in [0, 1]")


@struct.dataclass
class LocalRemaskPlan:
  base: Any  # the base family's plan
  refill: Any  # the refill family's plan


def windows_around(seed_BxL: Array, window: int) -> Array:
  """Positions within `window` of a seed (a running count over a 2w+1 window)."""
  length = seed_BxL.shape[1]
  padded = jnp.pad(seed_BxL.astype(jnp.int32), ((0, 0), (window + 1, window)))
  csum = jnp.cumsum(padded, axis=-1)
  i = jnp.arange(length)
  # Seeds in [i - w, i + w]: csum at padded index i + 2w + 1 minus csum at index i.
  return (csum[:, i + 2 * window + 1] - csum[:, i]) > 0


def choose_remask(spec: LocalRemaskSpec, keys_B: Array, editable_BxL: Array,
                  write_conf_BxL: Array, conf_now_BxL: Array,
                  shift_B: Array | None = None) -> Array:
  """Seeds (largest confidence drop), their windows, and a random part of what precedes."""
  batch, length = editable_BxL.shape
  drop_BxL = write_conf_BxL - conf_now_BxL
  seed_BxL = scores.select_top_k(drop_BxL, editable_BxL,
                                 jnp.full((batch,), spec.seeds, jnp.int32))
  near_BxL = windows_around(seed_BxL, spec.window)
  first_window_B = jnp.where(near_BxL, jnp.arange(length), length).min(-1)
  before_BxL = jnp.arange(length)[None] < first_window_B[:, None]
  pick_BxL = transforms.row_uniform(keys_B, StepStream.REMASK, (length,),
                                    shift_B) < spec.context_fraction
  return editable_BxL & (near_BxL | (before_BxL & pick_BxL))


@register
class LocalRemask(Family):
  """The base fill, then `rounds` of re-score / remask / refill, in one program."""

  name = "local_remask"
  spec_type = LocalRemaskSpec
  composite = True
  refills = False
  python_loop = False

  def bench_spec(self, steps, length):
    # A confidence run of K / 2 steps refined by one round of K / 4 ancestral refill steps.
    return LocalRemaskSpec(base=make_spec("confidence", steps=steps // 2),
                           refill=make_spec("ancestral", steps=max(steps // 4, 1)), rounds=1)

  def examples(self, generated):
    return [LocalRemaskSpec(base=make_spec("confidence", steps=4),
                            refill=make_spec("ancestral", steps=3), rounds=2,
                            window=1, context_fraction=0.3, score_groups=3)]

  def num_steps(self, spec: LocalRemaskSpec, length: int) -> int:
    return (family_of(spec.base).num_steps(spec.base, length)
            + spec.rounds * family_of(spec.refill).num_steps(spec.refill, length))

  def validate(self, spec: LocalRemaskSpec, canvas: Canvas):
    for name, inner in (("base", spec.base), ("refill", spec.refill)):
      check(inner.kv_cache == "none", f"{name}.kv_cache", inner.kv_cache,
            "local remasking runs its samplers uncached: use 'none'")
    family_of(spec.base).validate(spec.base, canvas)

  def plan(self, spec: LocalRemaskSpec, canvas: Canvas) -> LocalRemaskPlan:
    # The refill's positions are chosen at run time: its plan may read only the length.
    unknown = dataclasses.replace(canvas, tokens=None, fixed=None)
    return LocalRemaskPlan(base=family_of(spec.base).plan(spec.base, canvas),
                           refill=family_of(spec.refill).plan(spec.refill, unknown))

  def run(self, spec: LocalRemaskSpec, denoiser, core: Core, ctx: Context,
          plan: LocalRemaskPlan):
    batch, length = core.tokens_BxL.shape
    # The end of sequence is the outer spec's: base and refill end rows by it too.
    eos = dict(eos_id=spec.eos_id, eos_penalty=spec.eos_penalty, eos_never=spec.eos_never,
               eos_rank_last=spec.eos_rank_last)
    base_spec, refill_spec = (dataclasses.replace(s, **eos) for s in (spec.base, spec.refill))
    end = EndOfRow.of(spec)
    core, _, _ = stepping.run(base_spec, denoiser, core, ctx, plan.base)
    base_steps = family_of(spec.base).num_steps(spec.base, length)
    refill_steps = family_of(spec.refill).num_steps(spec.refill, length)
    evaluate = lambda tokens_NxL: denoiser(tokens_NxL, 1.0 / spec.score_groups)

    def one_round(core: Core, r):
      round_keys_B = jax.vmap(jax.random.fold_in, (0, None))(ctx.keys_B,
                                                              RowStream.LOCAL_ROUND - r)
      logits_BxLxV = contexts.leave_group_out_logits(evaluate, core.tokens_BxL,
                                                     ctx.editable_BxL, spec.score_groups,
                                                     ctx.mask_id)
      logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
      conf_now_BxL = jnp.exp(jnp.take_along_axis(
          logp_BxLxV, jnp.minimum(core.tokens_BxL, logp_BxLxV.shape[-1] - 1)[..., None],
          axis=-1)[..., 0])
      choice_keys_B = jax.vmap(jax.random.fold_in, (0, None))(round_keys_B,
                                                               RowStream.LOCAL_CHOICE)
      open_BxL = end.open(ctx, core.tokens_BxL).editable_BxL  # finished: frozen
      remask_BxL = choose_remask(spec, choice_keys_B, open_BxL, core.write_conf_BxL,
                                 conf_now_BxL, ctx.shift_B)
      refill_ctx = ctx.replace(editable_BxL=remask_BxL, keys_B=round_keys_B)
      refill, _, _ = stepping.run(
          refill_spec, denoiser,
          Core.start(jnp.where(remask_BxL, ctx.mask_id, core.tokens_BxL)), refill_ctx,
          plan.refill)
      # The round's own scoring call (G contexts) and remasked positions, and the refill.
      core = core.absorb(refill, remask_BxL, base_steps + r * refill_steps)
      return core.count(nfe=1, contexts_B=spec.score_groups,
                        reopened_B=remask_BxL.sum(-1)), None

    core, _ = jax.lax.scan(one_round, core, jnp.arange(spec.rounds))
    return core, None, None
