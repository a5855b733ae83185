"""IGPO, inpainting-guided policy optimization (Zhao et al. 2025, arXiv 2509.10396; code
github.com/facebookresearch/igpo at e85eaea, `trainer_igpo.py`
`_generate_and_score_completions`, `utils/generate.py` `generate_inpainting`).

When every rollout of a group fails, the group carries no GRPO signal (zero advantages).
IGPO then draws the group's rollouts again with part of the ground truth fixed in the
completion (the hint: an inpainting the diffusion sampler completes around), and replaces the
first n rows of the group (n = min(correct hinted rows, `max_replacements`), chosen at random
among the correct ones) by correct hinted rollouts. Each hinted row reveals a fraction r of
the truth, r uniform in [ratio_low, ratio_high] (sorted within the group). In the loss the
hinted tokens, which the policy did not draw, count only where the policy is least sure: of a
replaced row's hinted positions, the `entropy_keep` fraction (at least one) of highest
entropy under the rollout policy with the completion masked (IGPO's d1 masking); the rest
leave the loss (its token mask and normaliser).

Where this deviates (an id task's completion has a fixed layout; IGPO's is reasoning text):
the truth is the task's own completion of the prompt (a draw of the task's law, so one of its
solutions), revealed position by position (IGPO: chunks of 5-10 tokens, the last one always
shown, spaced over the generation length); r counts positions (IGPO: chunks). "Fails" and
"correct" are the task's exact check (IGPO: its correctness reward at 0 / its maximum).
IGPO's other settings (GSPO's sequence ratio, asymmetric clipping, its own timestep schedule)
are not part of this knob.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.evaluate.loglikelihood import denoiser_logits

Array = jax.Array

# IGPO's run_igpo.sh: max_replacement=4, inpaint_chunk_ratio_low=0.2,
# inpaint_chunk_high_initial_ratio=0.6, entropy_clipping_ratio_inpaint=0.2.
DEFAULTS = dict(igpo_max_replacements=4, igpo_ratio_low=0.2, igpo_ratio_high=0.6,
                igpo_entropy_keep=0.2)


def hint_masks(key: Array, num_rows: int, completion_length: int, group: int, *,
               ratio_low: float, ratio_high: float) -> tuple[np.ndarray, np.ndarray]:
  """(reveal_BxC bool, ratio_B): row b reveals C - int(C (1 - r_b)) positions chosen
  uniformly, r_b uniform in [ratio_low, ratio_high], sorted within each group (IGPO's
  `group_ratios.sort()`; its count of masked chunks is int(total (1 - r)))."""
  ratio_key, order_key = jax.random.split(key)
  ratio_B = np.asarray(jax.random.uniform(ratio_key, (num_rows,), jnp.float32, ratio_low,
                                          ratio_high))
  ratio_B = np.sort(ratio_B.reshape(-1, group), axis=1).reshape(-1)
  hidden_B = (completion_length * (1.0 - ratio_B)).astype(np.int64)  # int(): toward zero
  shown_B = completion_length - hidden_B
  draw_BxC = np.asarray(jax.random.uniform(order_key, (num_rows, completion_length)))
  rank_BxC = np.argsort(np.argsort(draw_BxC, axis=1), axis=1)
  return rank_BxC < shown_B[:, None], ratio_B


def replace_failed_groups(seed: int, correct_B, hinted_correct_B, group: int,
                          max_replacements: int) -> tuple[np.ndarray, np.ndarray]:
  """IGPO's selective replacement: (source_B, replaced_B). source_B[b] is the hinted row that
  replaces row b (-1: b keeps its own rollout); only groups whose rollouts all failed are
  touched; in such a group the first n rows take n correct hinted rows of the same group,
  drawn without replacement (IGPO's `randperm`), n = min(correct hinted, max_replacements)."""
  correct_GxN = np.asarray(correct_B, bool).reshape(-1, group)
  hinted_GxN = np.asarray(hinted_correct_B, bool).reshape(-1, group)
  rng = np.random.default_rng(seed)
  source_B = np.full(correct_GxN.size, -1, np.int64)
  for g in np.flatnonzero(~correct_GxN.any(1)):
    good = np.flatnonzero(hinted_GxN[g])
    count = min(len(good), max_replacements)
    if count < len(good):
      good = good[rng.permutation(len(good))[:count]]
    source_B[g * group: g * group + count] = g * group + good
  return source_B, source_B >= 0


def entropy_keep(entropy_BxC, hinted_BxC, keep_fraction: float) -> Array:
  """IGPO's token filter (its `entropy_clipping_ratio_inpaint`): True where a token stays in
  the loss. Every position the policy drew stays; of a row's hinted positions, the
  max(1, int(n * keep_fraction)) of highest entropy stay (ties: the earlier position)."""
  entropy_BxC = jnp.asarray(entropy_BxC, jnp.float32)
  hinted_BxC = jnp.asarray(hinted_BxC, bool)
  count_B = hinted_BxC.sum(-1)
  keep_B = jnp.maximum(1, (count_B * keep_fraction).astype(jnp.int32))
  # Rank the hinted positions by entropy, highest first; the others sort last.
  score_BxC = jnp.where(hinted_BxC, entropy_BxC, -jnp.inf)
  order_BxC = jnp.argsort(-score_BxC, axis=-1, stable=True)
  rank_BxC = jnp.argsort(order_BxC, axis=-1, stable=True)
  return ~hinted_BxC | (rank_BxC < keep_B[:, None])


def masked_entropy(denoiser, params, ids_BxL, prompt_length: int, *, mask_id: int,
                   valid_BxL=None) -> Array:
  """The policy's entropy at every completion position with the whole completion masked
  and the prompt shown (IGPO with d1 masking), float32 [B, C]; the mask id excluded."""
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  batch, length = ids_BxL.shape
  hidden_L = jnp.arange(length) >= prompt_length
  noisy_BxL = jnp.where(hidden_L[None], mask_id, ids_BxL)
  valid = None if valid_BxL is None else jnp.asarray(valid_BxL, bool)
  logits = denoiser_logits(denoiser, params, noisy_BxL, jnp.ones((batch,), jnp.float32), valid,
                           prompt_length, mask_id, 0.0)[:, prompt_length:]
  if mask_id < logits.shape[-1]:
    logits = logits.at[..., mask_id].set(-jnp.inf)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  return -jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0).sum(-1)


def option_problem(opts: dict) -> tuple[str, str] | None:
  """The trainer's `rl.igpo_*` fields checked: (field, what it takes) of the first bad one."""
  def number(value):
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)

  low, high = opts["igpo_ratio_low"], opts["igpo_ratio_high"]
  replacements = opts["igpo_max_replacements"]
  for name, ok, allowed in (
      ("igpo", isinstance(opts["igpo"], bool), "must be True or False"),
      ("igpo_max_replacements", isinstance(replacements, (int, np.integer))
       and not isinstance(replacements, bool) and replacements >= 1,
       "must be an integer >= 1 (hinted rows that replace a failed group's rows)"),
      ("igpo_ratio_low", number(low) and 0 <= low <= 1, "must be a number in [0, 1]"),
      ("igpo_ratio_high", number(high) and number(low) and low <= high <= 1,
       f"must be a number in [rl.igpo_ratio_low={low!r}, 1]"),
      ("igpo_entropy_keep", number(opts["igpo_entropy_keep"])
       and 0 <= opts["igpo_entropy_keep"] <= 1, "must be a number in [0, 1]")):
    if not ok:
      return name, allowed
  return None
