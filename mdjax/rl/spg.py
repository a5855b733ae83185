"""SPG, the sandwiched policy gradient (Wang et al. 2025, arXiv 2510.09541; code
github.com/facebookresearch/SPG at a1c7120, `spg/spg_trainer.py`).

The objective is the advantage-weighted log-likelihood, mean over rows of A log pi(x | c),
with log pi replaced by a lower bound (the ELBO) where A > 0 and by an upper bound (the EUBO,
or a mixture of the two) where A < 0, so the surrogate lies below the true objective whatever
the advantages' signs. Both bounds are estimated from the same `num_draws` block-wise masked
copies of each row (`block_masks`): a block of the completion drawn uniformly, the blocks
before it clean, the blocks after it masked, a uniform number (1 .. its length) of its own
positions masked; the prompt and the clean blocks lightly masked with `p_mask_prompt` (d1's
prompt masking, as SPG's code does it).

With logp_ji the log-probability of token i in draw j, M_j draw j's masked completion tokens,
L the completion's length (up to and including its first EOS) and t_j = |M_j| / L:

  ELBO = L * mean_j mean_{i in M_j} logp_ji                       (SPG: per_seq_logps)
  EUBO = L * mean_{i: a_i > 0} (1 / beta) log a_i,
         a_i = mean_j 1[i in M_j] exp(beta logp_ji) / t_j          (SPG: per_token_avg_ps)

loss = -sum_b A_b v_b / sum_b L_b, v_b the row's ELBO when A_b > 0, else its EUBO ('eubo'),
w EUBO + (1 - w) ELBO ('mix', SPG's best), or its ELBO ('elbo'). No ratio, no clipping, no
KL (SPG's code refuses beta != 0). For an exact denoiser and one block the ELBO's expectation
is log pi(x | c) and the EUBO's limit over draws is >= it (Jensen, per token, over the
any-order chain rule); tests/rl/test_estimators.py checks both by enumeration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.evaluate.loglikelihood import denoiser_logits

Array = jax.Array

NEGATIVES = ("mix", "eubo", "elbo")


def block_masks(key: Array, completion_mask_BxC, prompt_length: int, *, block_length: int,
                num_draws: int, p_mask_prompt: float) -> Array:
  """SPG's block-wise masking (`forward_type="block_random"`, min_t 0, max_t 1): bool
  [N, B, L], True where draw n masks row b. A row's blocks are those its completion (the
  mask's 1s) reaches; the chosen block's masked count is uniform in 1 .. its length there;
  positions after the completion (past its EOS) are always masked. SPG draws the block by a
  permutation modulo the row's block count (uniform only when that count divides the number
  of blocks); here it is uniform."""
  completion_mask_BxC = jnp.asarray(completion_mask_BxC, bool)
  batch, completion = completion_mask_BxC.shape
  length_B = jnp.maximum(completion_mask_BxC.sum(-1), 1)
  k_block, k_count, k_order, k_prompt = jax.random.split(key, 4)
  shape = (num_draws, batch)
  num_blocks_NxB = jnp.broadcast_to((length_B + block_length - 1) // block_length, shape)
  block_NxB = jnp.minimum(jnp.floor(jax.random.uniform(k_block, shape) * num_blocks_NxB),
                          num_blocks_NxB - 1).astype(jnp.int32)
  start_NxB = block_NxB * block_length
  in_block_NxB = jnp.minimum(block_length, length_B[None] - start_NxB)  # >= 1
  count_NxB = 1 + jnp.minimum(jnp.floor(jax.random.uniform(k_count, shape) * in_block_NxB),
                              in_block_NxB - 1).astype(jnp.int32)
  pos_C = jnp.arange(completion)
  is_block_NxBxC = ((pos_C >= start_NxB[..., None])
                    & (pos_C < (start_NxB + in_block_NxB)[..., None]))
  # A uniform subset of `count` block positions: those whose draws rank lowest in the block.
  draw_NxBxC = jnp.where(is_block_NxBxC, jax.random.uniform(k_order, shape + (completion,)), 2.)
  rank_NxBxC = jnp.argsort(jnp.argsort(draw_NxBxC, -1), -1)
  later_NxBxC = pos_C >= (start_NxB + block_length)[..., None]
  hidden_NxBxC = ((is_block_NxBxC & (rank_NxBxC < count_NxB[..., None])) | later_NxBxC
                  | ~completion_mask_BxC[None])
  # d1's light masking of the prompt and of the clean blocks before the chosen one.
  before_NxBxL = jnp.concatenate([jnp.ones(shape + (prompt_length,), bool),
                                  pos_C < start_NxB[..., None]], -1)
  noise_NxBxL = jax.random.uniform(k_prompt, before_NxBxL.shape) < p_mask_prompt
  hidden_NxBxL = jnp.concatenate([jnp.zeros(shape + (prompt_length,), bool), hidden_NxBxC], -1)
  return hidden_NxBxL | (before_NxBxL & noise_NxBxL)


def masked_logps(denoiser, params, ids_BxL, hidden_NxBxL, prompt_length: int, *, mask_id: int,
                 valid_BxL=None) -> Array:
  """log p(token | the canvas with `hidden` masked) of every completion position, float32
  [N, B, C]: one denoiser call of N B rows, the time each reads its completion's masked
  fraction; the mask id's logit ruled out where it lies inside the vocabulary."""
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  num, batch, length = hidden_NxBxL.shape
  noisy = jnp.where(hidden_NxBxL, mask_id, ids_BxL[None]).reshape(num * batch, length)
  t = hidden_NxBxL[..., prompt_length:].mean(-1).reshape(-1).astype(jnp.float32)
  valid = None if valid_BxL is None else jnp.tile(jnp.asarray(valid_BxL, bool), (num, 1))
  logits = denoiser_logits(denoiser, params, noisy, t, valid, prompt_length, mask_id, 0.0)
  logits = logits[:, prompt_length:]
  if mask_id < logits.shape[-1]:
    logits = logits.at[..., mask_id].set(-jnp.inf)
  logp = jax.nn.log_softmax(logits, -1)
  target = jnp.tile(ids_BxL[:, prompt_length:], (num, 1))
  return jnp.take_along_axis(logp, target[..., None], -1)[..., 0].reshape(num, batch, -1)


def sandwich_bounds(logp_NxBxC, masked_NxBxC, completion_mask_BxC, *, eubo_beta: float,
                    weights_N=None) -> tuple[Array, Array]:
  """(ELBO_B, EUBO_B) of the module docstring from N draws; `weights_N` (default 1 / N each)
  replaces each mean over draws by a weighted sum, so an exact enumeration of a masking law
  (its masks and their probabilities) gives the bounds' exact values. `masked` counts only
  inside the completion mask."""
  logp = jnp.asarray(logp_NxBxC, jnp.float32)
  comp_BxC = jnp.asarray(completion_mask_BxC, bool)
  masked = jnp.asarray(masked_NxBxC, bool) & comp_BxC[None]
  num = logp.shape[0]
  weights_N = (jnp.full((num,), 1.0 / num) if weights_N is None
               else jnp.asarray(weights_N, jnp.float32))
  length_B = jnp.maximum(comp_BxC.sum(-1), 1).astype(jnp.float32)
  count_NxB = jnp.maximum(masked.sum(-1), 1).astype(jnp.float32)
  per_draw_NxB = jnp.where(masked, logp, 0.0).sum(-1) / count_NxB
  elbo_B = length_B * (weights_N[:, None] * per_draw_NxB).sum(0)
  # log a_i = log sum_j w_j 1[i in M_j] exp(beta logp_ji) / t_j, stably; -1e30 (not -inf)
  # where a draw leaves i visible keeps the gradient finite.
  log_t_NxB = jnp.log(count_NxB / length_B[None])
  terms = jnp.where(masked, eubo_beta * logp - log_t_NxB[..., None]
                    + jnp.log(weights_N)[:, None, None], -1e30)
  log_a_BxC = jax.nn.logsumexp(terms, axis=0)
  seen_BxC = masked.any(0)
  seen_B = jnp.maximum(seen_BxC.sum(-1), 1)
  eubo_B = length_B * jnp.where(seen_BxC, log_a_BxC, 0.0).sum(-1) / seen_B / eubo_beta
  return elbo_B, eubo_B


def spg_bounds_fn(denoiser, params, ids_BxL, prompt_length: int, key: Array, *, mask_id: int,
                  completion_mask_BxC, block_length: int, num_draws: int, p_mask_prompt: float,
                  eubo_beta: float, valid_BxL=None) -> tuple[Array, Array]:
  """(ELBO_B, EUBO_B) of each row from `num_draws` block-wise masked copies drawn from `key`
  (`block_masks`, `masked_logps`, `sandwich_bounds`)."""
  hidden = block_masks(key, completion_mask_BxC, prompt_length, block_length=block_length,
                       num_draws=num_draws, p_mask_prompt=p_mask_prompt)
  logp = masked_logps(denoiser, params, ids_BxL, hidden, prompt_length, mask_id=mask_id,
                      valid_BxL=valid_BxL)
  return sandwich_bounds(logp, hidden[..., prompt_length:], completion_mask_BxC,
                         eubo_beta=eubo_beta)


def spg_loss(elbo_B, eubo_B, advantages_B, completion_mask_BxC, *, negative: str = "mix",
             mix_weight: float = 0.5) -> tuple[Array, dict[str, Array]]:
  """SPG's loss and metrics (module docstring): -sum A v / sum L, v the ELBO where A > 0,
  else by `negative`. metrics: elbo and eubo (their means over rows), positive_fraction."""
  if negative not in NEGATIVES:
    raise ValueError(f"negative={negative!r} must be one of {NEGATIVES}.")
  if not 0.0 <= mix_weight <= 1.0:
    raise ValueError(f"mix_weight={mix_weight!r} must be in [0, 1].")
  elbo_B = jnp.asarray(elbo_B, jnp.float32)
  eubo_B = jnp.asarray(eubo_B, jnp.float32)
  advantages_B = jnp.asarray(advantages_B, jnp.float32)
  length_B = jnp.asarray(completion_mask_BxC, jnp.float32).sum(-1)
  negative_B = {"mix": mix_weight * eubo_B + (1.0 - mix_weight) * elbo_B, "eubo": eubo_B,
                "elbo": elbo_B}[negative]
  positive = advantages_B > 0
  value_B = jnp.where(positive, elbo_B, negative_B)
  loss = -(advantages_B * value_B).sum() / jnp.maximum(length_B.sum(), 1.0)
  return loss, {"elbo": elbo_B.mean(), "eubo": eubo_B.mean(),
                "positive_fraction": positive.mean()}


def option_problem(opts: dict) -> tuple[str, str] | None:
  """The trainer's `rl.spg_*` fields checked: (field, what it takes) of the first bad one."""
  def number(value):
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)

  def integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

  block = opts["spg_block_length"]
  for name, ok, allowed in (
      ("spg_negative", opts["spg_negative"] in NEGATIVES, f"must be one of {NEGATIVES}"),
      ("spg_mix_weight", number(opts["spg_mix_weight"]) and 0 <= opts["spg_mix_weight"] <= 1,
       "must be a number in [0, 1]"),
      ("spg_eubo_beta", number(opts["spg_eubo_beta"]) and opts["spg_eubo_beta"] >= 1,
       "must be a number >= 1 (the Renyi bound's order)"),
      ("spg_num_draws", integer(opts["spg_num_draws"]) and opts["spg_num_draws"] >= 1,
       "must be an integer >= 1"),
      ("spg_block_length", block is None or (integer(block) and block >= 1),
       "must be None or an integer >= 1")):
    if not ok:
      return name, allowed
  return None


def trainer_bounds(denoiser, opts: dict, prompt_length: int, mask_id: int, params, ids_BxL,
                   valid_BxL, key, write_BxL, mask_BxC) -> Array:
  """The trainer's log-probabilities for objective 'spg': [B, 2], each row's ELBO and EUBO,
  in blocks of `rl.spg_block_length` (None: the sampler's block_length, else the whole
  completion)."""
  del write_BxL
  block = (opts["spg_block_length"] or opts["sampler_block_length"]
           or ids_BxL.shape[1] - prompt_length)
  elbo_B, eubo_B = spg_bounds_fn(
      denoiser, params, ids_BxL, prompt_length, key, mask_id=mask_id,
      completion_mask_BxC=mask_BxC, block_length=int(block), num_draws=opts["spg_num_draws"],
      p_mask_prompt=opts["p_mask_prompt"], eubo_beta=opts["spg_eubo_beta"],
      valid_BxL=valid_BxL)
  return jnp.stack([elbo_B, eubo_B], -1)
