"""Fast-dLLM v2's decoder (NVlabs/Fast-dLLM v2, `batch_sample`): threshold commits in
sub-blocks, the first token of each model block decoded autoregressively.

A row's positions count from its first valid one and are cut into model blocks of
`block_size` and, inside them, sub-blocks of `sub_block_length`. Each step works on the
sub-block of the row's first masked position:

  * when that position starts a model block (everything before it is written), the step
    commits it alone, by argmax (whatever the temperature): Fast-dLLM v2's next token
    after a finished block, read from the block's last output (with a shifted, block-causal
    network that is the logit at the new block's first position);
  * else it proposes a value for each masked position of the sub-block (the spec's
    transform: temperature, then top-p) and commits every proposal whose probability under
    that distribution (the plain softmax at temperature 0) exceeds `threshold`, and always
    the most probable one (ties to the lower position).

Sub-blocks are decoded in order, so rows move at their own pace; `steps` bounds the run (the
last step commits whatever is left). One block of L positions needs at most L + 1 steps.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps, knob,
                                 register)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class FastDllmV2Spec(SamplerSpec):
  """Fast-dLLM v2's threshold decoding (module docstring)."""

  steps: int = knob(help="The steps' bound.", minimum=1)
  threshold: float = knob(0.9, help="A proposal is committed when its probability is strictly "
                          "above it.", minimum=0.0, maximum=1.0)
  block_size: int | None = knob(None, help="The model's block (None: one block, the whole "
                                "canvas); its first position is decoded alone by argmax once "
                                "the block before it is written.", minimum=1)
  sub_block_length: int | None = knob(None, help="The sub-blocks decoded in order inside a "
                                      "block (None: the block); divides block_size.", minimum=1)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool)
          and math.isfinite(self.threshold) and 0.0 <= self.threshold <= 1.0, "threshold",
          self.threshold, "must lie in [0, 1]")
    for name in ("block_size", "sub_block_length"):
      value = getattr(self, name)
      check(value is None or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                              and value >= 1), name, value, "must be None or an integer >= 1")
    if self.block_size is not None and self.sub_block_length is not None:
      check(self.block_size % self.sub_block_length == 0, "sub_block_length",
            self.sub_block_length, f"must divide block_size={self.block_size}")


@struct.dataclass
class FastDllmV2Plan(StepPlan):
  last: Array  # the last step commits whatever is left


def _row_positions(ctx, length: int) -> Array:
  """Each position counted from its row's first valid one (B x L or 1 x L)."""
  pos_1xL = jnp.arange(length, dtype=jnp.int32)[None]
  return pos_1xL if ctx.shift_B is None else pos_1xL - ctx.shift_B[:, None]


@register
class FastDllmV2(Family):
  name = "fast_dllm_v2"
  spec_type = FastDllmV2Spec

  def examples(self, generated):
    n = len(generated)
    return [FastDllmV2Spec(steps=n + 1, threshold=0.5, temperature=0.0),
            FastDllmV2Spec(steps=n + 1, threshold=0.3, block_size=n // 2,
                           sub_block_length=max(n // 4, 1), temperature=0.0),
            FastDllmV2Spec(steps=4, threshold=0.9, sub_block_length=2, temperature=0.8,
                           top_p=0.9)]

  def plan(self, spec: FastDllmV2Spec, canvas) -> FastDllmV2Plan:
    j = np.arange(spec.steps)
    return FastDllmV2Plan(t=(1.0 - j / spec.steps).astype(np.float32),
                          last=j == spec.steps - 1)

  def update(self, spec: FastDllmV2Spec, core, aux, ctx, step, logits_BxLxV, denoise):
    """One step of the row's current sub-block (module docstring)."""
    length = core.tokens_BxL.shape[1]
    masked_BxL = ctx.masked(core.tokens_BxL)
    pos_BxL = jnp.broadcast_to(_row_positions(ctx, length), masked_BxL.shape)
    first_B = jnp.min(jnp.where(masked_BxL, pos_BxL, length), axis=-1)
    block = spec.block_size or length
    sub = spec.sub_block_length or block
    # The first masked position starts a model block: it is decoded alone, by argmax.
    first_token_B = (first_B < length) & (first_B % block == 0)
    first_BxL = masked_BxL & (pos_BxL == first_B[:, None])
    argmax_BxL = transforms.argmax_last(logits_BxLxV)

    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    probs_BxLxV = transforms.proposal_probs(logits_BxLxV, spec)
    conf_BxL = jnp.take_along_axis(probs_BxLxV, values_BxL[..., None], axis=-1)[..., 0]
    cand_BxL = masked_BxL & (pos_BxL // sub == (first_B // sub)[:, None])
    score_BxL = jnp.where(cand_BxL, conf_BxL, -jnp.inf)
    best_BxL = (jnp.arange(length)[None] == jnp.argmax(score_BxL, axis=-1)[:, None]) & cand_BxL
    threshold_BxL = (cand_BxL & (conf_BxL > spec.threshold)) | best_BxL
    write_BxL = jnp.where(first_token_B[:, None], first_BxL, threshold_BxL)
    write_BxL = jnp.where(step.plan.last, masked_BxL, write_BxL)
    values_BxL = jnp.where(first_token_B[:, None], argmax_BxL, values_BxL)
    plain_BxLxV = jax.nn.softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    conf_BxL = jnp.where(first_token_B[:, None], jnp.take_along_axis(
        plain_BxLxV, argmax_BxL[..., None], axis=-1)[..., 0], conf_BxL)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), aux
