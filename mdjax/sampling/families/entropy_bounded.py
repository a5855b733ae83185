"""The entropy-bounded sampler (EB-sampler, arXiv 2505.24857), optionally in blocks.

Each step ranks the masked positions of the block by the entropy H_i of their predictive
distributions, lowest first, and commits the longest prefix S of that order with

    sum_{i in S} H_i - max_{i in S} H_i <= gamma,

an upper bound on the error of writing S at once that the sum of entropies carries over
the joint (its total correlation is at most the sum of the entropies but the largest).
The first position always qualifies, so each step writes at least one; the last step of
a block writes whatever is left, so `steps` bounds the run. Rows finish at their own
pace: `SampleResult.rounds_B` is each row's number of denoiser calls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import semi_autoregressive, scores, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_block_length,
                                 check_steps, knob, register)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class EntropyBoundedSpec(SamplerSpec):
  """Commit the lowest-entropy prefix whose entropy beyond its largest is at most `gamma`.

  Entropies are read from the untransformed softmax (as confidence scores are); values are
  drawn with the spec's transform.
  """

  steps: int = knob(help="The steps' bound (with block_length: over all blocks); the last "
                    "step of a block writes the rest.", minimum=1)
  gamma: float = knob(0.5, help="The entropy bound in nats: the committed prefix's entropy "
                      "beyond its largest is at most it.", minimum=0.0)
  block_length: int | None = knob(None, help="Decode semi-autoregressively in blocks of this "
                                  "many positions.", minimum=1)
  final_temperature: float | None = knob(
      None, help="Anneal the draw temperature linearly from temperature at the first step of "
      "a block to it at the last (> 0, with temperature > 0).", minimum=0.0)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check_block_length(self.block_length)
    check(self.gamma >= 0.0, "gamma", self.gamma, "must be >= 0 (nats)")
    if self.final_temperature is not None:
      check(self.final_temperature > 0.0 and self.temperature > 0.0, "final_temperature",
            self.final_temperature,
            "must be > 0, with temperature > 0 (a schedule has no argmax branch)")


@struct.dataclass
class EntropyBoundedPlan(StepPlan):
  block: Array  # the block this step works on
  last_in_block: Array  # the last step of its block writes the rest
  temperature: Array  # draw temperature at this step (with final_temperature)


def entropy_prefix_counts(entropy_BxL: Array, cand_BxL: Array, gamma: float) -> Array:
  """Length of the longest lowest-entropy prefix whose sum minus its largest is <= gamma."""
  order_BxL = jnp.argsort(jnp.where(cand_BxL, entropy_BxL, jnp.inf), axis=-1, stable=True)
  sorted_BxL = jnp.take_along_axis(jnp.where(cand_BxL, entropy_BxL, 0.0), order_BxL, axis=-1)
  # Ascending order: the prefix's largest entropy is its last, so the test reads the sum
  # of the entropies before each position.
  before_BxL = jnp.cumsum(sorted_BxL, axis=-1) - sorted_BxL
  in_prefix_BxL = (before_BxL <= gamma) & (jnp.arange(cand_BxL.shape[1]) < cand_BxL.sum(-1,
                                                                                     keepdims=True))
  return in_prefix_BxL.sum(-1)


@register
class EntropyBounded(Family):
  name = "entropy_bounded"
  spec_type = EntropyBoundedSpec
  decodes_blocks = True

  def block_length(self, spec) -> int | None:
    return spec.block_length

  def examples(self, generated):
    return [EntropyBoundedSpec(steps=6, gamma=0.5),
            EntropyBoundedSpec(steps=4, gamma=2.0, block_length=len(generated) // 2,
                               temperature=1.2, final_temperature=0.5)]

  def plan(self, spec: EntropyBoundedSpec, canvas) -> EntropyBoundedPlan:
    num_blocks = semi_autoregressive.count(spec.block_length, spec.steps, canvas)
    per_block = spec.steps // num_blocks
    j = np.arange(per_block)
    final = spec.temperature if spec.final_temperature is None else spec.final_temperature
    ramp = j / max(per_block - 1, 1)
    tile = lambda x: np.tile(x, num_blocks)
    return EntropyBoundedPlan(
        t=tile(1.0 - j / per_block), block=semi_autoregressive.step_blocks(num_blocks, per_block),
        last_in_block=tile(j == per_block - 1),
        temperature=tile(spec.temperature + (final - spec.temperature) * ramp))

  def init(self, spec: EntropyBoundedSpec, core, ctx) -> Array:
    return semi_autoregressive.block_ids(ctx.editable_BxL, spec.block_length)

  def needs_call(self, spec, core, block_id_BxL, ctx, plan) -> Array:
    return jnp.any(semi_autoregressive.candidates(core.tokens_BxL, ctx, block_id_BxL, plan.block))

  def update(self, spec: EntropyBoundedSpec, core, block_id_BxL, ctx, step, logits_BxLxV,
             denoise):
    """Commits the entropy-bounded prefix of the block's masked positions."""
    plan = step.plan
    cand_BxL = semi_autoregressive.candidates(core.tokens_BxL, ctx, block_id_BxL, plan.block)
    if spec.final_temperature is None:
      values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                          **spec.transform)
    else:
      tempered_BxLxV = logits_BxLxV.astype(jnp.float32) / plan.temperature
      values_BxL = transforms.draw_values(step.keys_B, tempered_BxLxV, shift_B=step.shift_B,
                                          **{**spec.transform, "temperature": 1.0})
    probs_BxLxV, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    neg_entropy_BxL = scores.eos_last(
        scores.confidence_score("neg_entropy", probs_BxLxV, values_BxL, step.keys_B,
                                step.shift_B),
        values_BxL, spec)
    k_B = entropy_prefix_counts(-neg_entropy_BxL, cand_BxL, spec.gamma)
    k_B = jnp.where(plan.last_in_block, cand_BxL.sum(-1), k_B)
    write_BxL = scores.select_top_k(neg_entropy_BxL, cand_BxL, k_B)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), block_id_BxL
