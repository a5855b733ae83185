"""dParallel's certainty-forcing distillation loss (czg1225/dParallel, LLaDA/llada_train.py,
`DLMTrainer.compute_loss` and `forward_process_semi_ar`), as a pure function.

The student reads the teacher's own output (the target) under a semi-autoregressive mask:
one block of the generation is chosen uniformly, the blocks before it stay clean, its
positions are masked with probability (1 - eps) t + eps at t = 0.5, every position after it
is masked. A second copy masks the block's complement (the positions the first copy left
visible). For each copy:

  ce       the cross-entropy of the target at the block's masked positions, their mean;
  entropy  the entropy of softmax(logits / 0.5) at the block's masked positions the student
           already predicts right (argmax == target), their mean (0 where there is none);

and the loss is ce + ce_rev + 2 (entropy + entropy_rev): the student is pushed to be right
where the teacher was (cross-entropy) and certain where it is right (entropy), so that more
positions pass a confidence threshold at each step.

Where it differs from the reference, and why:
- The block is drawn from the blocks that hold a generated position: the reference draws
  from floor(N / block) + 1 choices, the last of them the remainder after the whole blocks
  (on LLaDA the EOS padding up to 384 tokens); on a task whose generation is a multiple of
  the block that choice is an empty segment and a zero loss, so it is left out.
- The reference marks the chosen block of every row of the batch from one row's draw (its
  loop writes `masked_indices[:, start:end]`; it trains with one row per device); here each
  row has its own block and mask.
- The entropy is -sum p log(p + 1e-12) as there; the means are over the batch's positions
  (the reference's per-device batch is one row).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# The reference's constants (DLMTrainer.__init__ and forward_process_semi_ar).
MASK_RATIO = 0.5  # t: forward_process_semi_ar's fixed 50% mask ratio
EPS = 1e-3
ENTROPY_TEMPERATURE = 0.5
ENTROPY_WEIGHT = 2.0


def segments(key, batch: int, length: int, prompt_length: int, block_length):
  """(in_block_BxL, after_block_BxL): each row's chosen block of the generated positions
  [prompt_length, length) (blocks of `block_length`, the last one shorter when it does not
  divide; drawn uniformly) and the positions after it. `block_length` may be traced."""
  generated = length - prompt_length
  block = jnp.asarray(block_length, jnp.int32)
  num_blocks = (generated + block - 1) // block
  index_B = jnp.floor(jax.random.uniform(key, (batch,)) * num_blocks).astype(jnp.int32)
  start_B = prompt_length + jnp.minimum(index_B, num_blocks - 1) * block
  end_B = jnp.minimum(start_B + block, length)
  pos_L = jnp.arange(length)
  in_block = (pos_L >= start_B[:, None]) & (pos_L < end_B[:, None])
  return in_block, pos_L >= end_B[:, None]


def masked_mean(value_BxL, where_BxL):
  """The mean of `value` over `where` (0 where nothing is selected)."""
  count = where_BxL.sum()
  return jnp.where(count > 0, jnp.where(where_BxL, value_BxL, 0.0).sum() / jnp.maximum(count, 1),
                   0.0)


def cross_entropy(logits_BxLxV, target_BxL, where_BxL):
  """F.cross_entropy of the target at `where`, their mean."""
  logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  nll_BxL = -jnp.take_along_axis(logp, target_BxL[..., None], axis=-1)[..., 0]
  return masked_mean(nll_BxL, where_BxL)


def certainty_entropy(logits_BxLxV, target_BxL, where_BxL, temperature: float):
  """The mean entropy of softmax(logits / temperature) over the positions of `where` whose
  argmax is the target (the reference's 'correctly predicted' tokens), and their count."""
  logits = logits_BxLxV.astype(jnp.float32)
  probs = jax.nn.softmax(logits / temperature, axis=-1)
  entropy_BxL = -(probs * jnp.log(probs + 1e-12)).sum(-1)
  correct_BxL = (jnp.argmax(logits, -1) == target_BxL) & where_BxL
  return masked_mean(entropy_BxL, correct_BxL), correct_BxL.sum()


def student_time(masked_BxL, prompt_length: int):
  """The time a sampler passes at this canvas: the masked fraction of the generated
  positions (a time-free student ignores it)."""
  generated = masked_BxL.shape[1] - prompt_length
  return masked_BxL[:, prompt_length:].sum(-1).astype(jnp.float32) / generated


def semi_ar_masks(key, batch: int, length: int, prompt_length: int, block_length,
                  p_mask: float):
  """(masked, masked_rev, after), each BxL: `forward_process_semi_ar`'s masks. One block of
  each row's generation (`segments`) masked with probability p_mask, its complement, and
  the positions after the block (masked in both copies, outside the loss)."""
  block_key, mask_key = jax.random.split(key)
  in_block, after = segments(block_key, batch, length, prompt_length, block_length)
  drawn = jax.random.uniform(mask_key, (batch, length)) < p_mask
  return in_block & drawn, in_block & ~drawn, after


def certainty_forcing_terms(logits_BxLxV, logits_rev_BxLxV, target_BxL, masked_BxL,
                            masked_rev_BxL, *, temperature: float = ENTROPY_TEMPERATURE,
                            entropy_weight: float = ENTROPY_WEIGHT):
  """ce + ce_rev + entropy_weight (entropy + entropy_rev) of the two copies' logits:
  (loss, aux)."""
  ce = cross_entropy(logits_BxLxV, target_BxL, masked_BxL)
  ce_rev = cross_entropy(logits_rev_BxLxV, target_BxL, masked_rev_BxL)
  ent, correct = certainty_entropy(logits_BxLxV, target_BxL, masked_BxL, temperature)
  ent_rev, correct_rev = certainty_entropy(logits_rev_BxLxV, target_BxL, masked_rev_BxL,
                                           temperature)
  loss = ce + ce_rev + entropy_weight * (ent + ent_rev)
  masked_count = masked_BxL.sum() + masked_rev_BxL.sum()
  return loss, {"ce": ce + ce_rev, "entropy": ent + ent_rev,
                "correct_fraction": (correct + correct_rev) / jnp.maximum(masked_count, 1)}


def certainty_forcing_loss(apply_fn: Callable, params, key, target_BxL, *, prompt_length: int,
                           mask_id: int, block_length, mask_ratio: float = MASK_RATIO,
                           eps: float = EPS, temperature: float = ENTROPY_TEMPERATURE,
                           entropy_weight: float = ENTROPY_WEIGHT):
  """dParallel's loss of the student `apply_fn(params, ...)` on the teacher's outputs
  `target_BxL` (prompt in [0, prompt_length)): (loss, aux)."""
  batch, length = target_BxL.shape
  masked, masked_rev, after = semi_ar_masks(key, batch, length, prompt_length, block_length,
                                            (1.0 - eps) * mask_ratio + eps)
  z = jnp.where(masked | after, mask_id, target_BxL)
  z_rev = jnp.where(masked_rev | after, mask_id, target_BxL)
  t_2B = jnp.concatenate([student_time(masked | after, prompt_length),
                          student_time(masked_rev | after, prompt_length)])
  logits = apply_fn(params, jnp.concatenate([z, z_rev]), t_2B)
  return certainty_forcing_terms(logits[:batch], logits[batch:], target_BxL, masked,
                                 masked_rev, temperature=temperature,
                                 entropy_weight=entropy_weight)
