"""Learn2PD's learned commit filter (Bao et al. 2025, "Learning to Parallel", the code of
ims-kdks/Learning-to-Parallel-Decoding: `generate_learn2parallel`, `generate_l2p_eot`).

Each step proposes a value for every masked position (the spec's temperature; 0: argmax)
and reads the probability of each proposal (the reference's `x0_p`). The W probabilities
of the block in progress (all W positions, written ones included, as the reference feeds
them) go through the filter (`sampling.commit_filter.CommitFilter`, a two-layer MLP of ~2K
parameters trained by `mdjax.accelerators.learn2pd` to imitate the "commit when the
proposal already equals the final token" oracle); the masked positions whose sigmoid exceeds
`accept_threshold` are committed, and besides them the block's most probable proposals in
LLaDA's even count (`get_num_transfer_tokens`: the N positions masked when the block
started, N // S a step over its S = K / num_blocks steps, the remainder on the first steps).
The count alone finishes a block in S steps, so every run ends within its K steps; the
filter only ends blocks sooner, and the next block starts at the next step.

`eot_exit` is the reference's End-of-Text Prediction (needs `eos_id`): when the filter
commits an EOS, the first such position p; else, when some masked position proposes EOS,
the one proposing it with the highest probability; every masked position after p becomes EOS.

Where mdjax differs from the reference, and why:
- K is fixed before tracing (one compiled program) where the reference loops while a block
  has masks; the count above bounds the reference's loop by the same K, so nothing is lost.
- The block in progress is per row (the first block with a masked position), so rows of one
  batch move through their blocks independently, as each would alone.
- The denoiser's time is 1 - i / K at step i (mdjax's models take one; LLaDA's takes none).
- The reference truncates the sequence after p, dropping tokens already written there; here
  masked positions after p become EOS and written ones stay until the row's end (mdjax's EOS
  rule, `sampling.end_of_row`, then overwrites every token after the row's first EOS), so a
  written token survives only where it precedes every EOS (a step never rewrites a token).
- The reference runs one row (batch 1); here a batch, each row with its own key and block.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import scores, semi_autoregressive, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_block_length,
                                 check_steps, knob, register)
from mdjax.sampling.commit_filter import CommitFilter

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnedCommitSpec(SamplerSpec):
  """Learn2PD: a learned filter commits the positions it judges final, at least LLaDA's even
  count of the most probable each step (module docstring)."""

  steps: int = knob(help="K, the bound: each block gets K / num_blocks steps and commits at "
                    "least LLaDA's even count of them each step, so it ends within them.",
                    minimum=1)
  # Required (None only so that the knobs' own checks run first); set in Python or by
  # sample.py's --filter_file, never by a request field (the server reads no files).
  commit_filter: CommitFilter | None = dataclasses.field(
      default=None, metadata={"help": "The trained filter (sampling.commit_filter.load_filter)."})
  accept_threshold: float = knob(
      0.96, help="Commit a masked position of the block where the filter's sigmoid exceeds "
      "it (Learn2PD's accept_thres; 0.96 in its scripts).", minimum=0.0, maximum=1.0)
  block_length: int | None = knob(None, help="Decode semi-autoregressively in blocks of this "
                                  "many positions (the filter's width); None: one block of "
                                  "every generated position.", minimum=1)
  eot_exit: bool = knob(False, help="End-of-Text Prediction (needs eos_id): once the filter "
                        "commits an EOS, or a masked position proposes one, the masked "
                        "positions after it become EOS.")

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check_block_length(self.block_length)
    check(isinstance(self.commit_filter, CommitFilter), "commit_filter",
          self.commit_filter, "must be a CommitFilter: the learned_commit sampler needs its "
          "trained filter (sampling.commit_filter.load_filter reads the file `python -m "
          "mdjax.accelerators.learn2pd` writes; sample.py: --filter_file)")
    value = self.accept_threshold
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and 0.0 <= value <= 1.0, "accept_threshold", value, "must lie in [0, 1]")
    object.__setattr__(self, "accept_threshold", float(value))
    check(isinstance(self.eot_exit, bool), "eot_exit", self.eot_exit, "must be True or False")
    if self.block_length is not None:
      check(self.block_length == self.commit_filter.width, "block_length", self.block_length,
            f"must be the filter's width {self.commit_filter.width} (it reads one block)")


@struct.dataclass
class LearnedCommitPlan(StepPlan):
  block_steps: Array  # S = K / num_blocks, the steps each block has at most


@struct.dataclass
class LearnedCommitCarry:
  block_B: Array  # the block each row worked on at the last step (-1 before the first)
  block_step_B: Array  # steps the row has spent in that block
  block_count_B: Array  # its masked positions when the row started it


def generation_length(canvas) -> int | None:
  """The editable positions every row generates (one number), or None inside a trace."""
  if canvas.fixed is None:
    return None
  lengths = np.unique((~canvas.fixed).sum(-1))
  if len(lengths) != 1:
    raise ValueError(f"the learned_commit sampler needs one generation length in every row "
                     f"(its filter reads a block of fixed width); rows have {lengths.tolist()}.")
  return int(lengths[0])


def example_filter(width: int, hidden: int = 4, seed: int = 0) -> CommitFilter:
  """A small untrained filter of this width (tests, examples): random weights, a bias that
  commits about half the positions."""
  rng = np.random.default_rng(seed)
  return CommitFilter.from_arrays(rng.normal(0, 1, (width, hidden)), rng.normal(0, 1, hidden),
                                  rng.normal(0, 1, (hidden, width)), np.zeros(width))


@register
class LearnedCommit(Family):
  name = "learned_commit"
  spec_type = LearnedCommitSpec

  def bench_spec(self, steps, length):
    return LearnedCommitSpec(steps=steps, commit_filter=example_filter(length))

  def examples(self, generated):
    n = len(generated)
    return [LearnedCommitSpec(steps=n, commit_filter=example_filter(n), accept_threshold=0.5),
            LearnedCommitSpec(steps=4, commit_filter=example_filter(n // 2, seed=1),
                              block_length=n // 2, temperature=0.0),
            LearnedCommitSpec(steps=2, commit_filter=example_filter(n, seed=2), top_k=2)]

  def validate(self, spec: LearnedCommitSpec, canvas) -> None:
    # Checked here, not when the spec is built: sample.py and generation add eos_id after.
    check(not spec.eot_exit or spec.eos_id is not None, "eot_exit", spec.eot_exit,
          "needs eos_id (the end-of-text id) to be set")
    semi_autoregressive.count(spec.block_length, spec.steps, canvas)  # raises where it must
    if spec.block_length is None:
      n = generation_length(canvas)
      if n is not None and n != spec.commit_filter.width:
        raise ValueError(f"commit_filter: its width {spec.commit_filter.width} must be the "
                         f"generation length {n} (one block of every generated position); "
                         "train a filter of this width, or set block_length to its width.")

  def plan(self, spec: LearnedCommitSpec, canvas) -> LearnedCommitPlan:
    num_blocks = semi_autoregressive.count(spec.block_length, spec.steps, canvas)
    i = np.arange(spec.steps)
    return LearnedCommitPlan(t=1.0 - i / spec.steps,
                             block_steps=np.full(spec.steps, spec.steps // num_blocks, np.int32))

  def init(self, spec, core, ctx) -> LearnedCommitCarry:
    zeros_B = jnp.zeros(core.tokens_BxL.shape[:1], jnp.int32)
    return LearnedCommitCarry(block_B=zeros_B - 1, block_step_B=zeros_B, block_count_B=zeros_B)

  def update(self, spec: LearnedCommitSpec, core, aux: LearnedCommitCarry, ctx, step,
             logits_BxLxV, denoise):
    """Commits the filter's choices and the block's count of most probable proposals."""
    width = spec.commit_filter.width
    length = core.tokens_BxL.shape[1]
    masked_BxL = ctx.masked(core.tokens_BxL)
    view = block_view(ctx.editable_BxL, masked_BxL, width, spec.block_length is not None)
    new_block_B = view.block_B != aux.block_B
    block_step_B = jnp.where(new_block_B, 0, aux.block_step_B)
    cand_BxL = masked_BxL & view.in_block_BxL
    num_cand_B = cand_BxL.sum(-1, dtype=jnp.int32)
    block_count_B = jnp.where(new_block_B, num_cand_B, aux.block_count_B)
    per_block = step.plan.block_steps
    k_B = jnp.minimum(block_count_B // per_block
                      + (block_step_B < block_count_B % per_block).astype(jnp.int32), num_cand_B)

    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    accept_BxL = cand_BxL & view.scatter(
        jax.nn.sigmoid(spec.commit_filter.logits(view.gather(conf_BxL)))
        > spec.accept_threshold)
    top_BxL = scores.select_top_k(scores.eos_last(conf_BxL, values_BxL, spec), cand_BxL, k_B)
    core = core.commit(accept_BxL | top_BxL, values_BxL, conf_BxL, step.index)
    if spec.eot_exit:
      core = end_of_text(core, ctx, step.index, spec.eos_id, accept_BxL, masked_BxL, values_BxL,
                         conf_BxL, length)
    return core, LearnedCommitCarry(block_B=view.block_B, block_step_B=block_step_B + 1,
                                    block_count_B=block_count_B)


@struct.dataclass
class BlockView:
  """The block each row works on, as a window of W slots over its editable positions."""

  block_B: Array  # the first block of the row with a masked position
  in_block_BxL: Array  # editable positions of that block (its first W)
  slot_BxLxW: Array  # position l holds slot w of the window

  def gather(self, x_BxL: Array) -> Array:
    """The window's W values of a per-position array (0 where a slot is empty)."""
    return jnp.einsum("blw,bl->bw", self.slot_BxLxW.astype(x_BxL.dtype), x_BxL)

  def scatter(self, x_BxW: Array) -> Array:
    """A per-slot bool array back on the canvas (False outside the window)."""
    return (self.slot_BxLxW & x_BxW[:, None, :]).any(-1)


def block_view(editable_BxL: Array, masked_BxL: Array, width: int, blocks: bool) -> BlockView:
  """The window of the block in progress. Without blocks the one block is every editable
  position (a row holding more than W, possible only inside a trace where the canvas cannot
  be checked, feeds the filter its first W and commits the rest by the count)."""
  rank_BxL = jnp.cumsum(editable_BxL, -1, dtype=jnp.int32) - 1
  block_of_BxL = jnp.where(editable_BxL, rank_BxL // width if blocks else 0, -1)
  past_end = jnp.iinfo(jnp.int32).max
  block_B = jnp.min(jnp.where(masked_BxL, block_of_BxL, past_end), -1)
  block_B = jnp.where(block_B == past_end, -1, block_B)  # a finished row: no block
  in_block_BxL = editable_BxL & (block_of_BxL == block_B[:, None])
  slot_BxL = rank_BxL - (block_B[:, None] * width if blocks else 0)
  slot_BxLxW = in_block_BxL[..., None] & (slot_BxL[..., None] == jnp.arange(width))
  return BlockView(block_B=block_B, in_block_BxL=in_block_BxL, slot_BxLxW=slot_BxLxW)


def end_of_text(core, ctx, index, eos_id: int, accept_BxL: Array, masked_BxL: Array,
                values_BxL: Array, conf_BxL: Array, length: int):
  """End-of-Text Prediction: the masked positions after p become EOS, p the first position
  where the filter committed EOS, else the masked position proposing EOS most probably."""
  by_filter_BxL = accept_BxL & (values_BxL == eos_id)
  proposed_BxL = masked_BxL & (values_BxL == eos_id)
  has_filter_B = by_filter_BxL.any(-1)
  p_B = jnp.where(has_filter_B, jnp.argmax(by_filter_BxL, -1),
                  jnp.argmax(jnp.where(proposed_BxL, conf_BxL, -jnp.inf), -1))
  found_B = has_filter_B | proposed_BxL.any(-1)
  fill_BxL = (found_B[:, None] & (jnp.arange(length)[None] > p_B[:, None])
              & ctx.masked(core.tokens_BxL))
  return core.commit(fill_BxL, jnp.full_like(core.tokens_BxL, eos_id),
                     jnp.ones(conf_BxL.shape, conf_BxL.dtype), index)
