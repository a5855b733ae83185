"""CDLM's consistency distillation (Kim et al. 2025, "CDLM: Consistency Diffusion Language
Models for Faster Sampling", code: SqueezeAILab/CDLM) as the objective 'cdlm' (importing
this module registers it; train.py does).

A bidirectional teacher (any `mdjax.load` path: a workdir, or a task's exact oracle)
decodes distill.num_prompts prompts once, when the run starts, in blocks of the student's
block size B, one position a step (LLaDA's low-confidence remasking, greedy at
distill.temperature 0): its trajectory is its final tokens and write steps, and for each
position the teacher's distribution at the step it was written (the reference stores the
teacher's last hidden state there and rebuilds the logits with its lm_head; here the
canvas before that step is replayed through the teacher, one call per step, and the
probabilities kept). The student has the teacher's weights (`train.init_from`) under
block-causal attention (`model.block_size` = B), so its finished blocks' keys and values
are exact to cache. For each row a trajectory state y is drawn (step k uniform over the
teacher's G steps: the canvas before step k) and its block completion y* (the canvas once
the block of step k's position is written). With the student q:

  distillation  over U = masked in y, written in y*: KL(p_teacher_i || q(.|y)_i), the mean
                over U (the reference's forward KL to the rebuilt teacher logits);
  consistency   over S = still masked in y*: KL(sg q(.|y*)_i || q(.|y)_i), the mean over S
                (stop-gradient target, Song et al.'s consistency models);
  dlm           the masked-denoising loss on the ground truth (the task's rows for the same
                prompts): t ~ U(eps, 1), each generated position masked with probability t,
                -sum over the masked of log q / (t G);

  loss = w_distill distillation + w_cons consistency + w_dlm dlm,

with the reference's LLaDA weights (1.0, 0.5, 0.1) by default (its Dream ones: 0.01 for
dlm). The per-row means are averaged over the rows that have such positions (a state in
the last block has no S). The student's time input is the masked fraction of the
generation (a block-causal Transformer takes none).

Decoding (the reference's rule): block by block, B positions a block, the exact KV cache of
the prompt and the finished blocks, and inside a block every masked position whose
confidence reaches a threshold (0.9 in the reference) committed at each step, at least
one: `sampling.ConfidenceSpec(steps=G, block_length=B, threshold=0.9, kv_cache="exact")`.

config.distill (configs/distill_cdlm.py):
  teacher          the teacher's path (required)
  prompt_length    positions of each row the teacher is given (a multiple of B)
  num_prompts      the pool's size (the teacher's decodings; an epoch)
  temperature      the teacher's sampling temperature
  distill_weight, consistency_weight, dlm_weight  the three terms' weights
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import sampling
from mdjax.accelerators import distill, dparallel
from mdjax.train import objectives, sft
from mdjax.train.config_checks import ConfigError

NAME = "cdlm"
# The reference's weights for LLaDA-8B-Instruct (Dream-7B-Instruct: dlm 0.01).
DISTILL_WEIGHT, CONSISTENCY_WEIGHT, DLM_WEIGHT = 1.0, 0.5, 0.1
DLM_EPS = 1e-3  # t = (1 - eps) u + eps: LLaDA's masked-denoising draw
THRESHOLD = 0.9  # the reference's decoding threshold (tau_conf)
DEFAULTS = dict(teacher=None, prompt_length=0, num_prompts=3200, temperature=0.0,
                distill_weight=DISTILL_WEIGHT, consistency_weight=CONSISTENCY_WEIGHT,
                dlm_weight=DLM_WEIGHT)
# The teacher's probabilities are kept in memory (num_prompts x length x vocabulary
# float32); past this the pool is refused (the reference keeps hidden states on disk).
MAX_POOL_BYTES = 1 << 30


# ----------------------------------------------------------------------------
# The loss, as pure functions.
# ----------------------------------------------------------------------------


def trajectory_masks(write_step_BxL, step_B, prompt_length: int, block_size: int):
  """(masked_y, masked_star), each BxL: the teacher's canvas before step k (its generated
  positions written at step k or later) and at the completion of the block of the
  position written at step k (blocks of `block_size` from `prompt_length`): the positions
  written after the last write of that block."""
  length = write_step_BxL.shape[1]
  generated_L = jnp.arange(length) >= prompt_length
  masked_y = generated_L & (write_step_BxL >= step_B[:, None])
  block_L = (jnp.arange(length) - prompt_length) // block_size
  at_k = generated_L & (write_step_BxL == step_B[:, None])
  block_B = jnp.max(jnp.where(at_k, block_L, -1), -1)
  in_block = generated_L & (block_L == block_B[:, None])
  end_B = jnp.max(jnp.where(in_block, write_step_BxL, -1), -1)
  return masked_y, generated_L & (write_step_BxL > end_B[:, None])


def forward_kl(target_probs_BxLxV, logits_BxLxV):
  """KL(target || softmax(logits)) per position (0 log 0 = 0)."""
  logq = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  p = target_probs_BxLxV.astype(jnp.float32)
  logp = jnp.log(jnp.where(p > 0, p, 1.0))
  return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), -1)


def row_mean(value_BxL, where_BxL):
  """The mean over rows that have a selected position of each row's mean over `where` (0
  when no row has one)."""
  count_B = where_BxL.sum(-1)
  per_row = jnp.where(where_BxL, value_BxL, 0.0).sum(-1) / jnp.maximum(count_B, 1)
  rows = (count_B > 0).sum()
  return jnp.where(rows > 0, jnp.where(count_B > 0, per_row, 0.0).sum() / jnp.maximum(rows, 1),
                   0.0)


def dlm_term(logits_BxLxV, truth_BxL, masked_BxL, t_B, generated: int):
  """The masked-denoising loss: the mean over rows of -sum over the masked positions of
  log q(truth) / (t G)."""
  logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  nll_BxL = -jnp.take_along_axis(logp, truth_BxL[..., None], axis=-1)[..., 0]
  return jnp.mean(jnp.where(masked_BxL, nll_BxL, 0.0).sum(-1) / (t_B * generated))


def cdlm_terms(logits_y_BxLxV, logits_star_BxLxV, logits_dlm_BxLxV, teacher_probs_BxLxV,
               truth_BxL, masked_y_BxL, masked_star_BxL, dlm_masked_BxL, dlm_t_B, *,
               generated: int, distill_weight: float = DISTILL_WEIGHT,
               consistency_weight: float = CONSISTENCY_WEIGHT, dlm_weight: float = DLM_WEIGHT):
  """The weighted sum of the three terms from the student's logits at y, y* (its target:
  gradients stopped here) and the masked ground truth: (loss, aux)."""
  unmasked_BxL = masked_y_BxL & ~masked_star_BxL
  distillation = row_mean(forward_kl(teacher_probs_BxLxV, logits_y_BxLxV), unmasked_BxL)
  target_BxLxV = jax.nn.softmax(jax.lax.stop_gradient(logits_star_BxLxV).astype(jnp.float32), -1)
  consistency = row_mean(forward_kl(target_BxLxV, logits_y_BxLxV), masked_star_BxL)
  dlm = dlm_term(logits_dlm_BxLxV, truth_BxL, dlm_masked_BxL, dlm_t_B, generated)
  loss = distill_weight * distillation + consistency_weight * consistency + dlm_weight * dlm
  return loss, {"distillation": distillation, "consistency": consistency, "dlm": dlm,
                "unmasked_per_row": unmasked_BxL.sum(-1).mean(),
                "still_masked_per_row": masked_star_BxL.sum(-1).mean()}


def cdlm_loss(apply_fn, params, key, tokens_BxL, write_step_BxL, teacher_probs_BxLxV,
              truth_BxL, *, prompt_length: int, block_size: int, mask_id: int,
              num_teacher_steps: int, **weights):
  """CDLM's loss of the student `apply_fn(params, ...)` on the teacher's trajectories (final
  tokens, write steps, its probabilities at each position's write, BxLxV; the prompt's
  rows unread) and the ground truth rows: (loss, aux)."""
  batch, length = tokens_BxL.shape
  generated = length - prompt_length
  step_key, t_key, mask_key = jax.random.split(key, 3)
  step_B = jax.random.randint(step_key, (batch,), 0, num_teacher_steps)
  masked_y, masked_star = trajectory_masks(write_step_BxL, step_B, prompt_length, block_size)
  t_B = (1.0 - DLM_EPS) * jax.random.uniform(t_key, (batch,)) + DLM_EPS
  generated_L = jnp.arange(length) >= prompt_length
  dlm_masked = generated_L & (jax.random.uniform(mask_key, (batch, length)) < t_B[:, None])
  z_y = jnp.where(masked_y, mask_id, tokens_BxL)
  z_dlm = jnp.where(dlm_masked, mask_id, truth_BxL)
  time = lambda masked: dparallel.student_time(masked, prompt_length)
  logits = apply_fn(params, jnp.concatenate([z_y, z_dlm]),
                    jnp.concatenate([time(masked_y), time(dlm_masked)]))
  logits_star = apply_fn(jax.lax.stop_gradient(params),
                         jnp.where(masked_star, mask_id, tokens_BxL), time(masked_star))
  loss, aux = cdlm_terms(logits[:batch], logits_star, logits[batch:], teacher_probs_BxLxV,
                         truth_BxL, masked_y, masked_star, dlm_masked, t_B,
                         generated=generated, **weights)
  aux["trajectory_step"] = step_B.astype(jnp.float32).mean()
  return loss, aux


# ----------------------------------------------------------------------------
# The teacher's trajectories.
# ----------------------------------------------------------------------------


def teacher_probs(teacher, spec, tokens_NxL, writes_NxL, prompt_length: int,
                  chunk: int = 1024) -> np.ndarray:
  """The teacher's probabilities at each generated position on the canvas it was written
  from (N x G x V, float32): its canvas before each step replayed, at the time the sampler
  told it then (`sampling.prepare(...).plan.t`)."""
  num, length = tokens_NxL.shape
  fixed = np.zeros((1, length), bool)
  fixed[:, :prompt_length] = True
  canvas = np.where(fixed, tokens_NxL[:1], teacher.mask_id).astype(np.int32)
  time_K = np.asarray(sampling.prepare(teacher.denoiser, teacher.params, jax.random.key(0),
                                       canvas, spec, fixed, mask_id=teacher.mask_id).plan.t,
                      np.float32)
  denoiser = sampling.Denoiser.of(teacher.denoiser)

  @jax.jit
  def replay(params, tokens_BxL, writes_BxL):
    def body(probs_BxGxV, step):
      visible_BxL = (jnp.arange(length) < prompt_length) | (writes_BxL < step)
      z_BxL = jnp.where(visible_BxL, tokens_BxL, teacher.mask_id)
      t_B = jnp.full((tokens_BxL.shape[0],), jnp.asarray(time_K)[step])
      p_BxGxV = jax.nn.softmax(denoiser(params, z_BxL, t_B).astype(jnp.float32),
                               -1)[:, prompt_length:]
      written_BxG = writes_BxL[:, prompt_length:] == step
      return jnp.where(written_BxG[..., None], p_BxGxV, probs_BxGxV), None
    start = jnp.zeros(tokens_BxL[:, prompt_length:].shape + (teacher.vocab_size,), jnp.float32)
    return jax.lax.scan(body, start, jnp.arange(len(time_K)))[0]

  out = [np.asarray(replay(teacher.params, tokens_NxL[i:i + chunk], writes_NxL[i:i + chunk]))
         for i in range(0, num, chunk)]
  return np.concatenate(out)


# ----------------------------------------------------------------------------
# The objective.
# ----------------------------------------------------------------------------


def options(config) -> dict:
  """config.distill's knobs with the defaults; a ConfigError naming a field that is unknown
  or out of range, or a student without blocks."""
  opts = distill.given_knobs(config, NAME, DEFAULTS)
  for name in ("temperature", "distill_weight", "consistency_weight", "dlm_weight"):
    if not (distill.is_number(opts[name]) and opts[name] >= 0):
      distill.refuse(opts, name, "must be a finite number >= 0")
  block = config.get("model", {}).get("block_size")
  if not distill.is_integer(block, 1):
    raise ConfigError(f"config field model.block_size={block!r}: the CDLM student is "
                      "block-causal; set its block (an integer >= 1; configs/distill_cdlm.py: 4).")
  return opts


def _refuse_causal_start(init_from, fields: dict) -> None:
  """A block-causal student cannot start from a causal or time-conditioned model."""
  if fields.get("causal") or fields.get("time_conditioning"):
    raise ConfigError(f"config field train.init_from={init_from!r}: its model is causal or "
                      "time-conditioned; a block-causal student needs neither.")


def resolve_config(config):
  """A 'cdlm' config checked, its model fields the start's (a copy) when it starts from a
  workdir, except `block_size`, the student's own attention; any other config unchanged."""
  if config.get("objective") != NAME:
    return config
  options(config)
  return distill.resolve_student(config, "a CDLM student",
                                 free=sft.COMPUTE_FIELDS + ("block_size",),
                                 check_start=_refuse_causal_start)


def check_layout(opts: dict, block: int, task) -> None:
  """The prompt and the generation in whole student blocks (the exact cache's condition);
  a ConfigError naming the field otherwise (before the teacher loads)."""
  prompt, length = opts["prompt_length"], task.length
  if length % block:
    raise ConfigError(f"config field model.block_size={block!r} must divide the task's length "
                      f"{length}.")
  if not 0 <= prompt < length or prompt % block:
    raise ConfigError(f"config field distill.prompt_length={prompt!r} must be a multiple of "
                      f"model.block_size={block} in [0, {length - 1}] (the generation starts "
                      "on a block boundary, so finished blocks cache exactly).")


def trajectories(config, task, opts: dict) -> dict:
  """The teacher's pool as arrays: its final tokens and write steps (N x L), its
  probabilities (N x L x V, zero on the prompt) and the ground truth rows (N x L: the task's
  rows whose prompts the teacher was given)."""
  block = config.model.block_size
  teacher = distill.load_teacher(opts, config, task)
  prompt, num = opts["prompt_length"], opts["num_prompts"]
  generated = task.length - prompt
  pool_bytes = 4 * num * task.length * teacher.vocab_size
  if pool_bytes > MAX_POOL_BYTES:
    raise ConfigError(f"config field distill.num_prompts={num!r}: the teacher's probabilities "
                      f"({num} x {task.length} x {teacher.vocab_size} float32, "
                      f"{pool_bytes / 2**30:.1f} GiB) exceed {MAX_POOL_BYTES / 2**30:.0f} GiB.")
  spec = distill.teacher_spec(generated, dict(opts, teacher_block_length=block))
  tokens, writes = distill.teacher_pool(teacher, spec, task, num, prompt, config.seed)
  probs = teacher_probs(teacher, spec, tokens, writes, prompt)
  # teacher_pool's prompts are these rows' (the same draw), the truth their task rows.
  truth = np.array(task.sample_data(distill.pool_keys(config.seed)["prompts"], num), np.int32)
  probs = np.concatenate([np.zeros((num, prompt, probs.shape[-1]), np.float32), probs], 1)
  return {"tokens": tokens, "writes": writes, "probs": probs, "truth": truth,
          "num_teacher_steps": sampling.num_steps(spec, task.length)}


def _loss_fn(config, apply_fn, task):
  opts = options(config)
  block = config.model.block_size
  check_layout(opts, block, task)
  num = opts["num_prompts"]
  if num < config.batch_size:
    raise ConfigError(f"config field distill.num_prompts={num!r} must be at least the batch "
                      f"({config.batch_size}).")
  pool = trajectories(config, task, opts)
  arrays = {name: jnp.asarray(pool[name]) for name in ("tokens", "writes", "probs", "truth")}
  order_key = distill.pool_keys(config.seed)["order"]
  weights = {name: float(opts[name])
             for name in ("distill_weight", "consistency_weight", "dlm_weight")}

  def loss(params, key, x_BxL, step=None):
    row_key, key = jax.random.split(key)
    rows_B = distill.pool_rows(step, row_key, x_BxL.shape[0], num, order_key)
    return cdlm_loss(apply_fn, params, key, arrays["tokens"][rows_B], arrays["writes"][rows_B],
                     arrays["probs"][rows_B], arrays["truth"][rows_B],
                     prompt_length=opts["prompt_length"], block_size=block,
                     mask_id=task.mask_id, num_teacher_steps=pool["num_teacher_steps"],
                     **weights)

  loss.takes_step = True  # the train step passes step=state.step (the pool's order)
  return loss


objectives.register(objectives.Objective(
    NAME, _loss_fn, held_out_loss_fn=objectives.held_out_nelbo_fn,
    resolve_config=resolve_config, start_model=distill.start_model))
