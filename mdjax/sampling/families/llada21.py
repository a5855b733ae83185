"""LLaDA2.1's joint threshold decoder: mask-to-token commits by confidence and token-to-token
edits of the tokens already written (inclusionAI LLaDA2.1-mini / -flash, the `generate` of
their modeling_llada2_moe.py; SGLang's `JointThreshold` is the same rule), on absorbing models.

The canvas is decoded in blocks (`block_length` editable positions, in order; one block, the
whole canvas, without it: what `sample_blocks` and `mdjax.generate(..., blocks_of=...)` hand
a family), each block by a loop of steps. At the top of each step a block without a mask
counts one post step, and after `max_post_steps` of them the block is over (no call). Then,
from one denoiser call, every position of the block gets the proposal x (argmax at
temperature 0, else a draw of the transformed distribution) and its probability p under the
distribution it came from, and

  * mask to token (M2T): the masked positions with p > `threshold` (strictly) are written;
    when fewer than `num_to_transfer` pass, the `num_to_transfer` most confident masked
    positions instead (top-1 by default; ties to the lower position);
  * token to token (T2T): every written position of the block (generated, never the prompt
    or another fixed position; not masked at the top of the step) whose proposal differs from
    its token and has p > `editing_threshold` takes the proposal;

both from the same call, in one write. A step without a mask at its top that edits nothing
ends the block. With an EOS id, a row whose tokens hold an EOS once a block is over (every
position before it written) has ended: EOS is written after its first EOS and it stops (the
reference's `eos_early_stop`; the reference cuts its output there either way).

The number of steps is fixed before tracing: at most `block_length` + `max_post_steps` per
block (each M2T step writes at least one mask), so the default bound is never reached and
the tokens are the reference's. Rows move at their own pace, from block to block, and the
program jumps over the steps after every row has finished.

Where mdjax differs from the reference, and why:
- `steps` (a bound on the steps per block; None: the exact bound above) cuts a block short:
  its last step writes every mask left. The reference's loop has no bound (its `steps` and
  `minimal_topk` are computed and unused).
- the rows of a batch are decoded together, each at its own pace (the reference takes one
  row at a time); a row equals that row decoded alone.
- with `max_post_steps=0` a block that holds no mask when it starts (an editable written
  token given on the canvas, never the reference's case) costs one call in which the row
  writes nothing.
- `eos_rank_last` ranks EOS proposals last in the top-k fallback only; the threshold set
  takes them as the reference does.
- at temperature > 0 the draws are mdjax's (`transforms.draw_values`), not torch's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import revising, scores, semi_autoregressive, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_block_length,
                                 knob, register)
from mdjax.sampling.end_of_row import EndAtEos

Array = jax.Array

# The published generate's defaults (LLaDA2.1-mini's modeling_llada2_moe.py).
THRESHOLD, EDITING_THRESHOLD, MAX_POST_STEPS = 0.95, 0.9, 16
# The model card's modes (the paper's S Mode and Q Mode): (threshold, editing_threshold).
MODES = {"speedy": (0.5, 0.0), "quality": (0.7, 0.5)}


def _probability(value) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and 0.0 <= value <= 1.0)


def _count(value, low: int) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDA21Spec(SamplerSpec):
  """LLaDA2.1's joint threshold decoder (module docstring); its defaults are the published
  `generate`'s (greedy). `LLaDA21Spec.mode("speedy" | "quality")` gives the model card's
  modes. `SampleResult.extras["changes_KxB"]` counts the written tokens edited (T2T) at each
  step."""

  temperature: float = knob(0.0, help="softmax(logits / T); T = 0 takes the argmax (the "
                            "reference's default, greedy).", minimum=0.0)
  threshold: float = knob(THRESHOLD, help="M2T: a masked position whose proposal's "
                          "probability is strictly above it is written.", minimum=0.0,
                          maximum=1.0)
  editing_threshold: float = knob(
      EDITING_THRESHOLD, help="T2T: a written (generated) position whose proposal differs "
      "from its token, with probability strictly above it, takes the proposal (1: no edits).",
      minimum=0.0, maximum=1.0)
  max_post_steps: int = knob(MAX_POST_STEPS, help="Edit-only steps a block may run once it "
                             "holds no mask (it ends earlier at a step that edits nothing).",
                             minimum=0)
  num_to_transfer: int = knob(1, help="M2T: when fewer masked proposals pass the threshold, "
                              "the this many most confident are written.", minimum=1)
  block_length: int | None = knob(None, help="Decode the editable positions in blocks of this "
                                  "many, in order (None: one block).", minimum=1)
  steps: int | None = knob(None, help="At most this many steps a block, the last writing "
                           "every mask left (None: block_length + max_post_steps, which no "
                           "block reaches: the reference's loop).", minimum=1)

  def __post_init__(self):
    super().__post_init__()
    check(_probability(self.threshold), "threshold", self.threshold, "must lie in [0, 1]")
    check(_probability(self.editing_threshold), "editing_threshold", self.editing_threshold,
          "must lie in [0, 1] (1: no edits)")
    check(_count(self.max_post_steps, 0), "max_post_steps", self.max_post_steps,
          "must be an integer >= 0")
    check(_count(self.num_to_transfer, 1), "num_to_transfer", self.num_to_transfer,
          "must be an integer >= 1")
    check_block_length(self.block_length)
    check(self.steps is None or _count(self.steps, 1), "steps", self.steps,
          "must be None (the reference's bound) or an integer >= 1")
    check(self.kv_cache == "none", "kv_cache", self.kv_cache,
          "must be 'none': the llada21 decoder runs on the canvas it is given (sample_blocks "
          "keeps the exact cache of a block-causal model)")

  @classmethod
  def mode(cls, name: str, **knobs) -> "LLaDA21Spec":
    """The model card's Speedy ("speedy": threshold 0.5, editing_threshold 0) or Quality
    ("quality": 0.7, 0.5) mode, with `knobs` over it."""
    check(name in MODES, "mode", name, f"must be one of {sorted(MODES)}")
    threshold, editing_threshold = MODES[name]
    return cls(**{"threshold": threshold, "editing_threshold": editing_threshold, **knobs})


@struct.dataclass
class LLaDA21Carry:
  block_id_BxL: Array  # block of each editable position (-1 elsewhere)
  block_B: Array  # each row's current block (past its last: finished)
  post_B: Array  # post steps (no mask at the top) the row has run in its current block
  block_steps_B: Array  # steps the row has run in its current block
  changes_KxB: Array  # written tokens edited (T2T), per step and row


def _per_block(spec: LLaDA21Spec, length: int) -> int:
  """The steps a block may take: `steps`, or the bound no block reaches."""
  return spec.steps or (spec.block_length or length) + spec.max_post_steps


def _block(carry: LLaDA21Carry, ctx) -> Array:
  """Each row's current block (B x L): empty once the row has finished."""
  return ctx.editable_BxL & (carry.block_id_BxL == carry.block_B[:, None])


@register
class LLaDA21(Family):
  name = "llada21"
  spec_type = LLaDA21Spec
  rewrites = True  # T2T edits change written tokens
  stops_early = True  # each row stops when its last block is over
  # An EOS written mid-block may be edited away: rows end only once a block is over.
  ends_rows_at_the_end = True

  def bench_spec(self, steps, length):
    return LLaDA21Spec(steps=steps)

  def examples(self, generated):
    n = len(generated)
    return [LLaDA21Spec.mode("quality", max_post_steps=3),
            LLaDA21Spec(threshold=0.3, editing_threshold=0.2, block_length=n // 2,
                        num_to_transfer=2, max_post_steps=2),
            LLaDA21Spec(threshold=0.9, editing_threshold=0.0, steps=3, temperature=0.8,
                        top_k=3),
            LLaDA21Spec.mode("speedy", max_post_steps=0, block_length=3)]

  def num_steps(self, spec, length):
    # Blocks of editable positions: at most ceil(L / block_length) of them.
    blocks = -(-length // spec.block_length) if spec.block_length else 1
    return blocks * _per_block(spec, length)

  def plan(self, spec, canvas) -> StepPlan:
    num_steps = self.num_steps(spec, canvas.length)
    return StepPlan(t=(1.0 - np.arange(num_steps) / num_steps).astype(np.float32))

  def init(self, spec, core, ctx) -> LLaDA21Carry:
    batch, length = core.tokens_BxL.shape
    zeros_B = jnp.zeros((batch,), jnp.int32)
    return LLaDA21Carry(
        block_id_BxL=semi_autoregressive.block_ids(ctx.editable_BxL, spec.block_length),
        block_B=zeros_B, post_B=zeros_B, block_steps_B=zeros_B,
        changes_KxB=jnp.zeros((self.num_steps(spec, length), batch), jnp.int32))

  def active_rows(self, spec, core, carry, ctx) -> Array:
    return _block(carry, ctx).any(-1)

  def needs_call(self, spec, core, carry, ctx, plan) -> Array:
    return jnp.any(self.active_rows(spec, core, carry, ctx))

  def extras(self, spec, carry: LLaDA21Carry):
    return {"changes_KxB": carry.changes_KxB}

  def update(self, spec, core, carry, ctx, step, logits_BxLxV, denoise):
    """M2T and T2T from one call, then each row's block bookkeeping (module docstring)."""
    tokens_BxL = core.tokens_BxL
    block_BxL = _block(carry, ctx)
    masked_BxL = block_BxL & (tokens_BxL == ctx.mask_id)
    has_mask_B = masked_BxL.any(-1)
    # The loop top: a block without a mask runs a post step while its budget lasts.
    running_B = block_BxL.any(-1)
    active_B = running_B & (has_mask_B | (carry.post_B < spec.max_post_steps))
    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    probs_BxLxV = transforms.proposal_probs(logits_BxLxV, spec)
    conf_BxL = jnp.take_along_axis(probs_BxLxV, values_BxL[..., None], axis=-1)[..., 0]
    # M2T: above the threshold, else the num_to_transfer most confident.
    above_BxL = masked_BxL & (conf_BxL > spec.threshold)
    k_B = jnp.minimum(spec.num_to_transfer, masked_BxL.sum(-1))
    top_BxL = scores.select_top_k(scores.eos_last(conf_BxL, values_BxL, spec), masked_BxL, k_B)
    m2t_BxL = jnp.where((above_BxL.sum(-1) >= spec.num_to_transfer)[:, None], above_BxL,
                        top_BxL)
    last_B = jnp.zeros_like(active_B)
    if spec.steps is not None:  # the bound: the block's last step writes every mask left
      last_B = carry.block_steps_B + 1 >= spec.steps
      m2t_BxL = jnp.where(last_B[:, None], masked_BxL, m2t_BxL)
    # T2T: written positions of the block whose proposal differs and passes the threshold.
    edit_BxL = (block_BxL & ~masked_BxL & (values_BxL != tokens_BxL)
                & (conf_BxL > spec.editing_threshold))
    write_BxL = (m2t_BxL | edit_BxL) & active_B[:, None]
    edit_BxL &= active_B[:, None]
    core = core.commit(write_BxL, values_BxL, conf_BxL, step.index)
    # The block is over when a step without a mask edits nothing, when the next loop top
    # would find no mask and the post budget spent, at the bound, or (a stalled row) now.
    post_B = carry.post_B + (active_B & ~has_mask_B)
    masks_left_B = (masked_BxL & ~write_BxL).any(-1)
    over_B = running_B & (~active_B | last_B | (~has_mask_B & ~edit_BxL.any(-1))
                          | (~masks_left_B & (post_B >= spec.max_post_steps)))
    block_B = carry.block_B + over_B
    if spec.eos_id is not None:  # a row with an EOS once its block is over has ended
      _, ended_B = EndAtEos(spec.eos_id).state(core.tokens_BxL, ctx.editable_BxL, ctx.mask_id)
      ended_B &= over_B
      core = revising.end_rows(spec, core, ctx, ended_B, step.index)
      block_B = jnp.where(ended_B, jnp.iinfo(jnp.int32).max, block_B)
    carry = carry.replace(
        block_B=block_B, post_B=jnp.where(over_B, 0, post_B),
        block_steps_B=jnp.where(over_B, 0, carry.block_steps_B + active_B),
        changes_KxB=carry.changes_KxB.at[step.index].set(edit_BxL.sum(-1)))
    return core, carry
