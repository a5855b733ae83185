"""d3LLM's pseudo-trajectory distillation loss (hao-ai-lab/d3LLM,
d3llm/d3llm_LLaDA/distill_2_training/d3llm_llada_train.py: `forward_process_with_trajectory`,
`select_trajectory_by_ratio`, `DLMTrainer.compute_loss` and its two curricula), as a pure
function.

The teacher decodes one position a step (LLaDA's low-confidence remasking, steps = the
generation length), and its trajectory is the canvas after each step; here it is read from
the teacher's write steps (`SampleResult.write_step_BxL`: the canvas after step k shows
the positions written at steps <= k). For each row one block of the generation is chosen;
the blocks before it are clean, every position after it masked, and inside it the
trajectory's own mask at step k = block start + int((1 - r) * block length) (clipped to the
last step): the positions the teacher had not yet written then. The complementary copy
masks the block's other positions (use_complementary_loss: true in the reference config).
The loss is

  (ce + ce_rev + 2 * entropy) / 4

with ce, ce_rev the cross-entropies of the teacher's final tokens at the two copies' masked
block positions and entropy dParallel's certainty term (softmax at temperature 0.5, the
first copy's correctly predicted positions; `dparallel`).

The curricula, over training progress p = step / num_steps:
- noise: the mask ratio r is drawn uniformly in [min + p (max - min), max] once a batch
  (min 0.0, max 0.8 in the reference config);
- window: the block length moves through `block_lengths` (the reference's
  progressive_block_sizes, one per epoch: 16, 16, 24, 24, 32, 32 for 32-token blocks),
  linearly within each stage: int(size[e] + (p E - e) (size[e + 1] - size[e])) in stage e
  of E.

Where it differs from the reference, and why:
- The targets are the teacher's own final tokens, the end of the same trajectory. The
  reference reads its targets from dParallel's dataset (the same teacher's answers to the
  same questions, produced by another run) and its masks from the trajectory file.
- A stage is num_steps / E optimizer steps, as the reference's epochs when the run reads
  its pool E times (`mdjax.accelerators.distill`: 300 steps of 64 rows over 3,200 prompts
  are 6 epochs).
- The block is drawn among the blocks that hold a generated position (as in `dparallel`),
  and each row draws its own.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from mdjax.accelerators import dparallel

MIN_MASK_RATIO = 0.0
MAX_MASK_RATIO = 0.8
ENTROPY_TEMPERATURE = 0.5
ENTROPY_WEIGHT = 2.0
# The reference's progressive_block_sizes for 32-token teacher blocks; `scaled_block_lengths`
# maps them onto another final block.
REFERENCE_BLOCK_LENGTHS = (16, 16, 24, 24, 32, 32)


def scaled_block_lengths(final: int) -> tuple[int, ...]:
  """The reference's window curriculum ending at `final` instead of 32 (each size scaled
  by final / 32, at least 1)."""
  return tuple(max(1, round(size * final / 32)) for size in REFERENCE_BLOCK_LENGTHS)


def curriculum(progress, block_lengths: tuple[int, ...], min_ratio: float, max_ratio: float):
  """(block length, lowest mask ratio) at training progress in [0, 1] (may be traced)."""
  progress = jnp.clip(jnp.asarray(progress, jnp.float32), 0.0, 1.0)
  stages = len(block_lengths)
  sizes = jnp.asarray(block_lengths + block_lengths[-1:], jnp.float32)
  epoch = progress * stages
  stage = jnp.minimum(jnp.floor(epoch).astype(jnp.int32), stages - 1)
  within = jnp.where(stage >= stages - 1, 0.0, epoch - stage)
  block = (sizes[stage] + within * (sizes[stage + 1] - sizes[stage])).astype(jnp.int32)
  return block, min_ratio + progress * (max_ratio - min_ratio)


def trajectory_mask(write_step_BxL, in_block_BxL, mask_ratio, prompt_length: int,
                    num_teacher_steps: int):
  """The teacher trajectory's mask inside each row's block at the step the mask ratio
  selects (`select_trajectory_by_ratio`): index = block start + int((1 - r) * block length),
  relative to the generation, clipped to the last step; masked = written after it."""
  length = write_step_BxL.shape[1]
  pos_L = jnp.arange(length)
  start_B = jnp.min(jnp.where(in_block_BxL, pos_L, length), -1) - prompt_length
  block_B = in_block_BxL.sum(-1)
  unmasked_B = jnp.floor((1.0 - mask_ratio) * block_B).astype(jnp.int32)
  index_B = jnp.minimum(start_B + unmasked_B, num_teacher_steps - 1)
  return in_block_BxL & (write_step_BxL > index_B[:, None])


def pseudo_trajectory_terms(logits_BxLxV, logits_rev_BxLxV, target_BxL, masked_BxL,
                            masked_rev_BxL, *, temperature: float = ENTROPY_TEMPERATURE,
                            entropy_weight: float = ENTROPY_WEIGHT):
  """(ce + ce_rev + entropy_weight * entropy) / 4 (`logits_rev` None: no complementary
  copy, ce_rev 0): (loss, aux)."""
  ce = dparallel.cross_entropy(logits_BxLxV, target_BxL, masked_BxL)
  ce_rev = (jnp.zeros((), jnp.float32) if logits_rev_BxLxV is None else
            dparallel.cross_entropy(logits_rev_BxLxV, target_BxL, masked_rev_BxL))
  ent, correct = dparallel.certainty_entropy(logits_BxLxV, target_BxL, masked_BxL, temperature)
  loss = (ce + ce_rev + entropy_weight * ent) / 4.0
  return loss, {"ce": ce + ce_rev, "entropy": ent,
                "correct_fraction": correct / jnp.maximum(masked_BxL.sum(), 1)}


def pseudo_trajectory_loss(apply_fn: Callable, params, key, target_BxL, write_step_BxL, *,
                           prompt_length: int, mask_id: int, num_teacher_steps: int,
                           block_length, mask_ratio, complementary: bool = True,
                           temperature: float = ENTROPY_TEMPERATURE,
                           entropy_weight: float = ENTROPY_WEIGHT):
  """d3LLM's loss of the student on the teacher's trajectories (its final tokens
  `target_BxL` and write steps), at one block length and mask ratio (either may be
  traced): (loss, aux)."""
  batch, length = target_BxL.shape
  in_block, after = dparallel.segments(key, batch, length, prompt_length, block_length)
  masked = trajectory_mask(write_step_BxL, in_block, mask_ratio, prompt_length,
                           num_teacher_steps)
  masked_rev = in_block & ~masked
  z = jnp.where(masked | after, mask_id, target_BxL)
  logits_rev = None
  if complementary:
    z_rev = jnp.where(masked_rev | after, mask_id, target_BxL)
    t_2B = jnp.concatenate([dparallel.student_time(masked | after, prompt_length),
                            dparallel.student_time(masked_rev | after, prompt_length)])
    logits = apply_fn(params, jnp.concatenate([z, z_rev]), t_2B)
    logits, logits_rev = logits[:batch], logits[batch:]
  else:
    logits = apply_fn(params, z, dparallel.student_time(masked | after, prompt_length))
  loss, aux = pseudo_trajectory_terms(logits, logits_rev, target_BxL, masked, masked_rev,
                                      temperature=temperature, entropy_weight=entropy_weight)
  aux.update(masked_fraction=masked.sum() / jnp.maximum(in_block.sum(), 1),
             block_length=jnp.asarray(block_length, jnp.float32),
             mask_ratio=jnp.asarray(mask_ratio, jnp.float32))
  return loss, aux
