"""A fixed write order by position: `groups[i]` is written at step i."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import transforms
from mdjax.sampling.base import Family, SamplerSpec, StepPlan, check, register

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrderedSpec(SamplerSpec):
  """A fixed write order: `groups[i]` is the set of positions written at step i.

  Values within a group are drawn independently from the current
  conditionals. One position per group is the exact chain-rule sampler.
  The groups must cover every generated position exactly once.
  """

  groups: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    super().__post_init__()
    check(isinstance(self.groups, (tuple, list)) and all(
        isinstance(g, (tuple, list)) and all(isinstance(p, (int, np.integer)) for p in g)
        for g in self.groups), "groups", self.groups,
          "must be a sequence of groups, each a sequence of positions (e.g. ((0,), (1, 2)))")
    groups = tuple(tuple(int(p) for p in g) for g in self.groups)
    object.__setattr__(self, "groups", groups)
    check(len(groups) >= 1, "steps", len(groups), "must be an integer >= 1 (one group a step)")
    flat = [p for g in groups for p in g]
    check(all(len(g) >= 1 for g in groups), "groups", groups, "every group needs a position")
    check(min(flat) >= 0, "groups", min(flat), "positions must be >= 0")
    repeated = sorted({p for p in flat if flat.count(p) > 1})
    check(not repeated, "groups", repeated, "a position may appear in one group only")

  @classmethod
  def left_to_right(cls, length: int, **kwargs) -> "OrderedSpec":
    """One position per step, left to right: the autoregressive chain rule."""
    return cls(groups=tuple((i,) for i in range(length)), **kwargs)

  @property
  def steps(self) -> int:
    return len(self.groups)


@struct.dataclass
class OrderedPlan(StepPlan):
  write_L: Array  # the positions this step writes


@register
class Ordered(Family):
  name = "ordered"
  spec_type = OrderedSpec
  refills = False  # its positions are fixed in advance

  def bench_spec(self, steps, length):
    # K equal groups, left to right.
    return OrderedSpec(groups=tuple(tuple(int(p) for p in group)
                                    for group in np.array_split(np.arange(length), steps)))

  def examples(self, generated):
    half = len(generated) // 2
    return [OrderedSpec(groups=(tuple(generated[:half]), tuple(generated[half:]))),
            OrderedSpec(groups=tuple((p,) for p in generated), temperature=0.5)]

  def validate(self, spec: OrderedSpec, canvas):
    canvas.check_covers("groups", spec.groups)

  def plan(self, spec: OrderedSpec, canvas) -> OrderedPlan:
    write_KxL = np.zeros((spec.steps, canvas.length), bool)
    for i, group in enumerate(spec.groups):
      write_KxL[i, list(group)] = True
    return OrderedPlan(t=1.0 - np.arange(spec.steps) / spec.steps, write_L=write_KxL)

  def idle_steps(self, spec: OrderedSpec, canvas, plan: OrderedPlan) -> float | None:
    """Exactly the steps whose group holds no generated position."""
    generated_L = canvas.generated()
    if generated_L is None:
      return None
    return float((~(plan.write_L & generated_L).any(-1)).sum())

  def needs_call(self, spec, core, aux, ctx, plan: OrderedPlan) -> Array:
    return jnp.any(plan.write_L[None, :] & ctx.masked(core.tokens_BxL))

  def update(self, spec: OrderedSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    """Writes this step's group with independent draws from the conditionals."""
    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    write_BxL = step.plan.write_L[None, :] & ctx.masked(core.tokens_BxL)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), None


def parse_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """`OrderedSpec.groups` from notation: "0,1;2-4;5" -> ((0, 1), (2, 3, 4), (5,)) (groups
  ';'-separated, positions ','-separated, a-b a range); a ValueError names the bad part."""
  groups = []
  for group in text.split(";"):
    positions = []
    for part in group.split(","):
      low, _, high = part.strip().partition("-")
      try:
        positions.extend(range(int(low), int(high or low) + 1))
      except ValueError:
        raise ValueError(f"groups={text!r}: {part!r} is not a position or a range a-b (groups "
                         "';'-separated, positions ','-separated).") from None
    groups.append(tuple(positions))
  return tuple(groups)
