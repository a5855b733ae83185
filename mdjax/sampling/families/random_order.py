"""The exact chain rule in a uniformly random order: one position per step."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mdjax.sampling import scores, transforms
from mdjax.sampling.base import Family, SamplerSpec, StepPlan, register
from mdjax.streams import RowStream, StepStream

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomOrderSpec(SamplerSpec):
  """One position per step in a uniformly random order drawn per row.

  The exact chain-rule sampler (exact for an exact denoiser): it takes as
  many steps as the sequence is long, skipping the denoiser once a row set
  has nothing left to write.
  """


def random_order_rank(keys_B: Array, editable_BxL: Array, shift_B: Array | None = None) -> Array:
  """A uniformly random rank 0..n-1 over each row's editable positions."""
  init_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, RowStream.INIT)
  noise_BxL = transforms.row_uniform(init_keys_B, StepStream.ORDER, editable_BxL.shape[1:],
                                     shift_B)
  return scores.rank_descending(noise_BxL, editable_BxL)


@register
class RandomOrder(Family):
  name = "random_order"
  spec_type = RandomOrderSpec

  def bench_spec(self, steps, length):
    return RandomOrderSpec()  # one position per step: K = L whatever `steps` says

  def examples(self, generated):
    return [RandomOrderSpec(top_p=0.5)]

  def num_steps(self, spec, length: int) -> int:
    return length

  def plan(self, spec, canvas) -> StepPlan:
    return StepPlan(t=1.0 - np.arange(canvas.length) / canvas.length)

  def idle_steps(self, spec, canvas, plan) -> float | None:
    """Where every editable position is masked, exactly the steps after the longest row."""
    if canvas.tokens is None or ((canvas.tokens != canvas.mask_id) & ~canvas.fixed).any():
      return None
    return float(canvas.length - (~canvas.fixed).sum(-1).max())

  def init(self, spec, core, ctx) -> Array:
    return random_order_rank(ctx.keys_B, ctx.editable_BxL, ctx.shift_B)

  def update(self, spec, core, order_rank_BxL, ctx, step, logits_BxLxV, denoise):
    """Writes the position of rank `step` with a draw from its conditional."""
    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    write_BxL = (order_rank_BxL == step.index) & ctx.masked(core.tokens_BxL)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), order_rank_BxL
