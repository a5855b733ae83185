"""Write orders over fields: step k writes counts[k][f] positions of field f."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import scores, transforms
from mdjax.sampling.base import Family, SamplerSpec, StepPlan, check, register

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldOrderSpec(SamplerSpec):
  """A write order over fields: step k writes `counts[k][f]` positions of field f.

  `fields[f]` lists the positions of field f (fields are disjoint). Within a step,
  field f's positions are its `counts[k][f]` highest-scoring masked positions
  (`score` from scores.SCORES, read from the untransformed softmax; ties go to the
  lower position). The default `max_prob` reads only the canvas, never this step's
  draws, so a step that writes one position is an exact chain-rule step; values
  written in one step are drawn independently. Every field's counts sum to its size.
  `parse_write_order` builds one from notation such as "[VOA][v×9]o×10[ht1]", which
  `notation` keeps for display.
  """

  fields: tuple[tuple[int, ...], ...]
  counts: tuple[tuple[int, ...], ...]
  score: str = "max_prob"
  notation: str | None = None

  def __post_init__(self):
    super().__post_init__()
    fields = tuple(tuple(int(p) for p in f) for f in self.fields)
    counts = tuple(tuple(int(c) for c in row) for row in self.counts)
    object.__setattr__(self, "fields", fields)
    object.__setattr__(self, "counts", counts)
    check(self.score in scores.SCORES, "score", self.score, f"must be one of {scores.SCORES}")
    check(len(fields) >= 1 and all(len(f) >= 1 for f in fields), "fields", fields,
          "need at least one field, each with a position")
    flat = [p for f in fields for p in f]
    check(min(flat) >= 0, "fields", min(flat), "positions must be >= 0")
    repeated = sorted({p for p in flat if flat.count(p) > 1})
    check(not repeated, "fields", repeated, "a position may belong to one field only")
    check(len(counts) >= 1, "counts", counts, "need at least one step")
    for k, row in enumerate(counts):
      check(len(row) == len(fields) and min(row) >= 0 and sum(row) >= 1, f"counts[{k}]", row,
            f"must hold {len(fields)} counts >= 0 (one per field), at least one positive")
    totals = np.sum(counts, axis=0)
    for f, field in enumerate(fields):
      check(totals[f] == len(field), f"counts (field {f})", int(totals[f]),
            f"must sum to the field's {len(field)} positions")

  @property
  def steps(self) -> int:
    return len(self.counts)


@struct.dataclass
class FieldOrderPlan(StepPlan):
  counts_F: Array  # positions of each field written at this step


@register
class FieldOrder(Family):
  name = "field_order"
  spec_type = FieldOrderSpec
  refills = False  # its fields are fixed in advance

  def examples(self, generated):
    half = len(generated) // 2
    first, second = tuple(generated[:half]), tuple(generated[half:])
    return [FieldOrderSpec(fields=(first, second),
                           counts=((1, 0), (half - 1, 0), (0, len(second))), score="margin")]

  def validate(self, spec: FieldOrderSpec, canvas):
    canvas.check_covers("fields", spec.fields)

  def plan(self, spec: FieldOrderSpec, canvas) -> FieldOrderPlan:
    return FieldOrderPlan(t=1.0 - np.arange(spec.steps) / spec.steps,
                          counts_F=np.asarray(spec.counts, np.int32))

  def update(self, spec: FieldOrderSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    """Each field's scheduled count of its most confident masked positions."""
    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    probs_BxLxV, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    score_BxL = scores.eos_last(
        scores.confidence_score(spec.score, probs_BxLxV, values_BxL, step.keys_B,
                                step.shift_B), values_BxL,
        spec)
    cand_BxL = ctx.masked(core.tokens_BxL)
    batch, length = cand_BxL.shape
    write_BxL = jnp.zeros((batch, length), bool)
    for f, positions in enumerate(spec.fields):  # static: a handful of fields
      in_field_L = np.zeros(length, bool)
      in_field_L[list(positions)] = True
      k_B = jnp.broadcast_to(step.plan.counts_F[f], (batch,))
      write_BxL |= scores.select_top_k(score_BxL, cand_BxL & in_field_L, k_B)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), None
