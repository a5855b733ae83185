"""RL with verifiable rewards: the objectives 'grpo' (d1's diffu-GRPO; with `rl.igpo`, IGPO's
hints), 'wd1', 'spg', 'mdpo' and 'rft' (SFT on the successful rollouts).

`train.py --config=configs/grpo.py --workdir=W` runs, per step (`train.num_steps` of them):

  1. prompts: `batch_size / rl.num_generations` of them, a function of (seed, step) (a
     resumed run sees what an uninterrupted one would): an id task's prompt cells
     (`sources.IdTaskSource`: none for two_color, the puzzle for Sudoku 4x4, ...), or, for
     a published chat model (task 'sft'), lines of a JSONL
     (`sources.JsonlSource`: its tokenizer and chat template, left padded to
     `rl.max_prompt_length`);
  2. rollouts: G = `rl.num_generations` completions of each prompt by `config.sampler` (any
     mdjax sampler spec; d1's: LLaDA's semi-autoregressive low-confidence decoding), one
     compiled call per batch, the parameters its traced arguments;
  3. rewards on the host (`rl.rewards`: names in `mdjax.rl.rewards`, by default an id task's
     exact check (`rewards.TASK_CHECKS`), or e.g. 'sudoku' (d1's rule)), their weighted
     sum, group advantages;
  4. the log-probabilities of the policy before the updates ("old") and of the reference
     (the start point, frozen; with LoRA the base with the adapters off) for
     `rl.num_iterations` mask keys, one per inner iteration;
  5. `rl.num_iterations` updates (d1's inner loop; update i reads mask key i) of the loss of
     `config.objective`: 'grpo' (`losses.grpo_loss`: clipped ratio, `rl.kl_estimator`), 'wd1'
     (`losses.wd1_loss`) or 'spg' (`spg.spg_loss` on its own block-wise ELBO / EUBO, `rl.spg_*`;
     it reads no `rl.estimator`), the log-probabilities by `rl.estimator`: "one_step" (d1's
     `forward_process`: the completion masked, prompt tokens with `p_mask_prompt`) or
     "elbo" (the completion's MC-ELBO, one log-probability per row), "trajectory" or
     "coupled" (coupled-GRPO's complementary mask pair, `logps.coupled_logps_fn`); 'mdpo'
     (`mdpo.mdpo_loss` on each selected sampler step's canvas, `rl.mdpo_train_steps`) or
     'rft' (`losses.rft_loss`: the rows at or above `rl.rft_min_reward`). `rl.igpo` draws
     hinted rollouts for groups that all fail between 2 and 3 (`inpaint_failed_groups`);
     `rl.sync_ref_model` moves the reference toward the policy every
     `rl.ref_model_sync_steps` updates (`ref_sync`).

The start is `train.init_from`: an mdjax workdir or "pretrained:DIR", its float32 parameters;
with `train.lora.rank` > 0 only adapters train. Checkpoints are the supervised loop's
(`TrainState`, saved every `checkpoint.every` steps, at the end and on SIGTERM; the same
command resumes). A reward function that raises or returns NaN stops the run naming it and
the row; the last checkpoint stays. The result loads with `mdjax.load(W)` (the objective's
`start_model` builds the model, the checkpoint fills its parameters).

The pieces: `options` (config.rl, its defaults and checks), `start` (the config resolved
against the start point, the start's model), `programs` (the compiled log-probabilities,
losses and update), `sources` (prompts), `rewards`; this module runs the loop.
"""

from __future__ import annotations

import enum
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from mdjax import lora, models, sampling, tasks
from mdjax.rl import igpo as igpo_lib
from mdjax.rl import losses
from mdjax.rl import mdpo as mdpo_lib
from mdjax.rl import ref_sync
from mdjax.rl import rewards as rewards_lib
from mdjax.rl import sources
from mdjax.rl.options import DEFAULTS, ESTIMATORS, OBJECTIVE_NAMES, rl_options
from mdjax.rl.programs import Programs, build_programs, needs_old, needs_reference, sampler_spec
from mdjax.rl.start import no_supervised_loss, resolve_config, start_model
from mdjax.train import objectives, state_io
from mdjax.train.config_checks import ConfigError
from mdjax.train.state import TrainState, init_state, make_mesh
from mdjax.train.workdir import MetricsLog, TrainClock, keep_metrics_through, run_summary

__all__ = ["DEFAULTS", "ESTIMATORS", "OBJECTIVE_NAMES", "Programs", "Stream", "build_programs",
           "inpaint_failed_groups", "needs_old", "needs_reference", "resolve_config",
           "rl_options", "rollout", "run", "sampler_spec", "score", "start_model", "step_key"]


class Stream(enum.IntEnum):
  """Draws within one RL step (folded into the step's key)."""

  PROMPTS = 0  # which prompts the step reads
  ROLLOUT = 1  # the sampler's key
  MASKS = 2  # the inner iterations' mask keys (fold_in(this key, i))
  HINTS = 3  # igpo: the hinted rollouts' sampler key; folded again (`HintStream`) for the rest
  PREDICTIONS = 4  # mdpo: each step's draws of the positions it left masked


class HintStream(enum.IntEnum):
  """IGPO's draws within a step (folded into the step's `Stream.HINTS` key)."""

  REVEAL = 0  # the hinted positions and their ratios (`igpo.hint_masks`)
  CHOICE = 1  # which correct hinted rows replace a failed group's rows


def rollout(apply_fn, params, key, prompts: sources.Prompts, group: int,
            completion_length: int, spec, mask_id: int, hint_BxC=None):
  """G completions of each prompt (rows p0 x G, p1 x G, ...): (ids_BxL, the step that wrote
  each position (-1: the prompt), seconds); numpy. hint_BxC: completion positions fixed to
  the prompt's true completion (`Prompts.truths_PxC`; igpo), never written (-1)."""
  ids = np.repeat(prompts.ids_PxLp, group, axis=0)
  canvas = np.concatenate([ids, np.full((len(ids), completion_length), mask_id, np.int32)], 1)
  valid = None
  if prompts.valid_PxLp is not None:
    valid = np.concatenate([np.repeat(prompts.valid_PxLp, group, axis=0),
                            np.ones((len(ids), completion_length), bool)], 1)
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :ids.shape[1]] = True
  if hint_BxC is not None:
    truths_BxC = np.repeat(prompts.truths_PxC, group, axis=0)
    canvas[:, ids.shape[1]:] = np.where(hint_BxC, truths_BxC, mask_id)
    fixed[:, ids.shape[1]:] = hint_BxC
  start = time.perf_counter()
  out = sampling.sample(apply_fn, params, key, canvas, spec, fixed, mask_id=mask_id,
                        **({} if valid is None else {"valid_BxL": valid}))
  tokens = np.asarray(out.tokens_BxL)  # waits for the program
  return tokens, np.asarray(out.write_step_BxL), time.perf_counter() - start


def score(source, names, weights, prompts: sources.Prompts, group: int, ids_BxL, mask_BxC):
  """(rewards_B, {reward_NAME: mean}) of the rows (`rewards.compute`: the weighted sum of
  each function's); a function that raises or returns NaN raises `rewards.RewardError`
  naming it and the row."""
  texts = [t for t in prompts.texts for _ in range(group)]
  targets = [t for t in prompts.targets for _ in range(group)]
  completions = source.completion_texts(ids_BxL, mask_BxC)
  rewards_B, per_fn_BxR = rewards_lib.compute(names, texts, completions, targets, weights)
  return rewards_B, {f"reward_{n}": float(per_fn_BxR[:, i].mean()) for i, n in enumerate(names)}


def _completion_mask(source, ids_BxL) -> np.ndarray:
  """d1's completion mask (up to and including the first EOS), float32 [B, C]."""
  return np.asarray(losses.completion_mask(
      ids_BxL[:, source.prompt_length:], () if source.eos_id is None else source.eos_id),
      np.float32)


def inpaint_failed_groups(opts, source, prompts, group, ids_BxL, write_BxL, mask_BxC,
                           hinted_rollout, key):
  """IGPO (`mdjax.rl.igpo`): where every rollout of a group fails the task's exact check,
  draw the batch again with hints and put correct hinted rollouts in the group's first rows.
  Returns (ids_BxL, write_BxL, hinted_BxC, metrics, seconds)."""
  check = (rewards_lib.TASK_CHECKS[source.task.name],)
  correct_B = score(source, check, None, prompts, group, ids_BxL, mask_BxC)[0] >= 1.0
  failed = float((~correct_B.reshape(-1, group).any(1)).mean())
  metrics = {"igpo_failed_groups": failed, "igpo_replaced": 0.0}
  hinted_BxC = np.zeros(mask_BxC.shape, bool)
  if not failed:
    return ids_BxL, write_BxL, hinted_BxC, metrics, 0.0
  reveal_BxC, _ = igpo_lib.hint_masks(
      jax.random.fold_in(key, HintStream.REVEAL), len(ids_BxL), source.completion_length, group,
      ratio_low=opts["igpo_ratio_low"], ratio_high=opts["igpo_ratio_high"])
  hint_ids, hint_write, seconds = hinted_rollout(reveal_BxC)
  hint_correct_B = score(source, check, None, prompts, group, hint_ids,
                         _completion_mask(source, hint_ids))[0] >= 1.0
  seed = int(jax.random.randint(jax.random.fold_in(key, HintStream.CHOICE), (), 0,
                                 2**31 - 1))
  source_B, replaced_B = igpo_lib.replace_failed_groups(
      seed, correct_B, hint_correct_B, group, opts["igpo_max_replacements"])
  ids_BxL, write_BxL = ids_BxL.copy(), write_BxL.copy()
  ids_BxL[replaced_B] = hint_ids[source_B[replaced_B]]
  write_BxL[replaced_B] = hint_write[source_B[replaced_B]]
  hinted_BxC[replaced_B] = reveal_BxC[source_B[replaced_B]]
  metrics.update(igpo_replaced=float(replaced_B.mean()), rollouts=float(2 * len(ids_BxL)),
                 igpo_hinted_correct=float(hint_correct_B.mean()))
  return ids_BxL, write_BxL, hinted_BxC, metrics, seconds


def _mdpo_batch(opts, programs, params, batch, key, source, prompts, group):
  """MDPO's per-step fields of the batch (`mdjax.rl.mdpo`): every step's predictions under
  the rollout policy, their rewards, the step advantages and the selected steps."""
  x0_SxBxC, conf_SxBxC, masked_SxBxC = programs.step_predictions(
      params, batch["ids_BxL"], batch["write_BxL"], batch["valid_BxL"], key)
  x0 = np.asarray(x0_SxBxC)
  prompt_BxP = np.asarray(batch["ids_BxL"])[:, :source.prompt_length]
  rewards_BxS = np.stack([
      score(source, opts["rewards"], opts["reward_weights"], prompts, group,
            np.concatenate([prompt_BxP, x0[s]], 1),
            _completion_mask(source, np.concatenate([prompt_BxP, x0[s]], 1)))[0]
      for s in range(len(x0))], 1)
  advantages_BxS = mdpo_lib.step_advantages(rewards_BxS, group)
  steps_K = mdpo_lib.select_steps(advantages_BxS, opts["mdpo_train_steps"])
  final_B = rewards_BxS[:, -1]
  metrics = {"mdpo_first_step_reward": float(rewards_BxS[:, 0].mean()),
             "mdpo_backslide": float((rewards_BxS[:, :-1].max(1, initial=-np.inf)
                                      > final_B).mean())}
  return dict(steps_K=jnp.asarray(steps_K), x0_KxBxC=x0_SxBxC[steps_K],
              conf_KxBxC=conf_SxBxC[steps_K], masked_KxBxC=masked_SxBxC[steps_K],
              advantages_KxB=jnp.asarray(advantages_BxS[:, steps_K].T)), metrics


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


def step_key(config, step: int) -> jax.Array:
  """The key of RL step `step`: every draw of the step folds it (`Stream`)."""
  from mdjax import streams
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed),
                                               streams.RowStream.TRAIN_NOISE), step)


def _lora_parts(config, apply_fn):
  """With LoRA on (`train.lora.rank` > 0): (reference apply_fn, params -> reference params),
  the base with the adapters off; None without LoRA."""
  if lora.config_of(config) is None:
    return None
  return lora.unadapted(apply_fn), lambda params: params["base"]


def run(config, workdir: str, log, interrupts):
  """The RL loop (module docstring); returns the final `TrainState`. One process."""
  opts = rl_options(config)
  if jax.process_count() > 1:
    raise ConfigError(f"objective={config.objective!r} runs in one process (this run has "
                      f"{jax.process_count()}); the rollouts and rewards are not split.")
  mesh = make_mesh(config.get("num_devices") or None)
  task = tasks.from_config(config)
  state, _, apply_fn, shardings = init_state(config, mesh, task)
  log(f"model: {models.count_params(state.params):,} parameters ({config.objective}, "
      f"G={opts['num_generations']}, {opts['num_iterations']} inner updates)")
  lora_parts = _lora_parts(config, apply_fn)
  if lora_parts is None:  # the start point, frozen (a copy: the updates donate the state)
    ref_apply, ref_params = apply_fn, jax.tree.map(jnp.copy, state.params)
    ref_of = lambda params: ref_params  # noqa: E731
    sample_apply, sampled = apply_fn, lambda params: params  # noqa: E731
  else:
    ref_apply, ref_of = lora_parts
    # Rollouts read the adapters merged once per step, not at every sampler step.
    sample_apply = ref_apply
    sampled = jax.jit(functools.partial(lora.merge, lora_config=lora.config_of(config)))
  manager = state_io.checkpoint_manager(workdir, config)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = state_io.restore_latest(manager, abstract, config, task, log)
  if restored is not None:
    state = jax.device_put(restored, shardings)
    log(f"resumed from step {int(state.step)}")
  num_steps = config.train.num_steps
  source = sources.make_source(config, task, opts)
  group = opts["num_generations"]
  num_prompts = config.batch_size // group
  spec = sampler_spec(config, source.prompt_length + source.completion_length)
  # The learning-rate schedule counts updates: num_iterations of them per step.
  train_cfg = ml_collections.ConfigDict(config.train.to_dict())
  train_cfg.num_steps = num_steps * opts["num_iterations"]
  programs = build_programs(config, opts, apply_fn, ref_apply, train_cfg, source.prompt_length,
                            source.mask_id)
  clock = TrainClock(workdir, int(state.step))
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  keep_metrics_through(metrics_path, int(state.step))
  metrics = MetricsLog(workdir, bool(config.get("log_tensorboard", False)))
  step = start_step = int(state.step)
  saved_step = step if restored is not None else None
  params, opt_state = state.params, state.opt_state
  if opts["sync_ref_model"]:  # the update's optimizer state also holds the synced reference
    opt_state = (opt_state, ref_sync.load(workdir, step, params) if restored is not None
                 else programs.optimizer.init(params)[-1])
  try:
    while step < num_steps and interrupts.signal_name is None:
      key = step_key(config, step)
      prompts = source.draw(jax.random.fold_in(key, Stream.PROMPTS), num_prompts)
      ids_BxL, write_BxL, rollout_seconds = rollout(
          sample_apply, sampled(params), jax.random.fold_in(key, Stream.ROLLOUT), prompts, group,
          source.completion_length, spec, source.mask_id)
      mask_BxC = _completion_mask(source, ids_BxL)
      if (opts["estimator"] == "trajectory" or config.objective == "mdpo") and (
          write_BxL.max() >= opts["sampler_steps"]):
        raise ValueError(f"rl.estimator='trajectory' and objective 'mdpo' read each sampler "
                         f"step: the sampler wrote at step {int(write_BxL.max())}, past "
                         f"sampler.steps={opts['sampler_steps']} (its steps count per "
                         "block?); set sampler.steps to the total.")
      extra, hinted_BxC = {"rollouts": float(len(ids_BxL))}, None
      try:
        if opts["igpo"]:
          ids_BxL, write_BxL, hinted_BxC, extra, seconds = inpaint_failed_groups(
              opts, source, prompts, group, ids_BxL, write_BxL, mask_BxC,
              lambda hint_BxC: rollout(sample_apply, sampled(params),
                                       jax.random.fold_in(key, Stream.HINTS), prompts, group,
                                       source.completion_length, spec, source.mask_id,
                                       hint_BxC=hint_BxC),
              jax.random.fold_in(key, Stream.HINTS))
          rollout_seconds += seconds
          mask_BxC = _completion_mask(source, ids_BxL)
        rewards_B, reward_means = score(source, opts["rewards"], opts["reward_weights"],
                                        prompts, group, ids_BxL, mask_BxC)
      except rewards_lib.RewardError as error:
        log(f"step {step + 1}: {error}; stopping. The last checkpoint (step "
            f"{saved_step}) is kept in {workdir}/checkpoints.")
        raise
      start = time.perf_counter()
      mask_keys = jax.vmap(lambda i: jax.random.fold_in(
          jax.random.fold_in(key, Stream.MASKS), i))(jnp.arange(opts["num_iterations"]))
      valid = None if prompts.valid_PxLp is None else jnp.asarray(np.concatenate(
          [np.repeat(prompts.valid_PxLp, group, axis=0),
           np.ones((len(ids_BxL), source.completion_length), bool)], 1))
      row_mask = opts["estimator"] == "elbo" and config.objective in ("grpo", "wd1", "rft")
      batch = dict(
          ids_BxL=jnp.asarray(ids_BxL), valid_BxL=valid, write_BxL=jnp.asarray(write_BxL),
          mask=jnp.asarray(np.ones((len(ids_BxL), 1), np.float32) if row_mask else mask_BxC),
          completion_BxC=jnp.asarray(mask_BxC),
          advantages_B=losses.group_advantages(jnp.asarray(rewards_B), group,
                                               scale_by_std=opts["scale_by_std"]))
      if hinted_BxC is not None and hinted_BxC.any():
        # IGPO: of a replaced row's hinted tokens only the most uncertain stay in the loss.
        keep_BxC = igpo_lib.entropy_keep(programs.entropy(params, batch["ids_BxL"], valid),
                                         hinted_BxC, opts["igpo_entropy_keep"])
        batch["mask"] = batch["mask"] * keep_BxC.astype(jnp.float32)
      if config.objective == "rft":
        batch["success_B"] = jnp.asarray(rewards_B >= opts["rft_min_reward"], jnp.float32)
      if config.objective == "mdpo":
        step_batch, step_metrics = _mdpo_batch(
            opts, programs, params, batch, jax.random.fold_in(key, Stream.PREDICTIONS),
            source, prompts, group)
        batch.update(step_batch)
        extra.update(step_metrics)
      old_all = (programs.all_logps["policy"](params, batch, mask_keys)
                 if needs_old(config, opts) else None)
      ref_params = (ref_sync.reference_of(opt_state) if opts["sync_ref_model"]
                    else ref_of(params) if needs_reference(config, opts) else None)
      ref_all = (programs.all_logps["reference"](ref_params, batch, mask_keys)
                 if needs_reference(config, opts) else None)
      inner = []
      for i in range(opts["num_iterations"]):
        params, opt_state, m = programs.update(
            params, opt_state, batch, mask_keys[i], None if old_all is None else old_all[i],
            None if ref_all is None else ref_all[i])
        inner.append(m)
      host = [{k: float(v) for k, v in jax.device_get(m).items()} for m in inner]
      update_seconds = time.perf_counter() - start
      step += 1
      row = {k: float(np.mean([h[k] for h in host])) for k in host[0]}
      if not all(math.isfinite(v) for v in row.values()):
        raise FloatingPointError(f"non-finite loss at step {step}: {row}; stopping. The last "
                                 f"checkpoint (step {saved_step}) is kept in "
                                 f"{workdir}/checkpoints.")
      groups = rewards_B.reshape(-1, group)
      row.update(step=step, reward_mean=float(rewards_B.mean()),
                 reward_std=float(groups.std(axis=1, ddof=1).mean()),
                 zero_std_ratio=float((groups.std(axis=1) < 1e-6).mean()),
                 completion_length=float(mask_BxC.sum(1).mean()),
                 rollout_seconds=rollout_seconds, update_seconds=update_seconds,
                 rollout_fraction=rollout_seconds / max(rollout_seconds + update_seconds, 1e-9),
                 **reward_means, **extra)
      row.setdefault("kl", 0.0)
      row.setdefault("clip_ratio", 0.0)
      metrics.write({"step": step, **{k: v for k, v in row.items() if k != "step"}})
      log(f"step {step}/{num_steps} reward {row['reward_mean']:.3f} kl {row['kl']:.4g} "
          f"clip {row['clip_ratio']:.3f} rollout {rollout_seconds:.2f}s update "
          f"{update_seconds:.2f}s")
      state = _train_state(step, params, opt_state, opts)
      if step % config.checkpoint.every == 0 or step == num_steps:
        _save(manager, state, config, task, workdir, opt_state, opts)
        clock.save(step)
        saved_step = step
    if step < num_steps and step != start_step and saved_step != step:
      _save(manager, state, config, task, workdir, opt_state, opts)
      clock.save(step)
      log(f"{interrupts.signal_name}: checkpoint saved at step {step} of {num_steps} in "
          f"{workdir}/checkpoints; the same command resumes.")
    elif step < num_steps and step == start_step:
      log(f"{interrupts.signal_name} before the first step: stopped, nothing trained.")
  finally:
    metrics.close()
  if step == num_steps:
    log(run_summary(workdir, step, num_steps))
  return _train_state(step, params, opt_state, opts)


def _train_state(step: int, params, opt_state, opts) -> TrainState:
  """The checkpointed state: with rl.sync_ref_model the optimizer's own state (the synced
  reference is saved beside it, `ref_sync.save`), so the workdir loads as any other."""
  return TrainState(step=jnp.asarray(step, jnp.int32), params=params,
                    opt_state=opt_state[0] if opts["sync_ref_model"] else opt_state,
                    ema_params=None)


def _save(manager, state, config, task, workdir, opt_state, opts) -> None:
  if opts["sync_ref_model"]:
    ref_sync.save(workdir, int(state.step), opt_state[-1])
  state_io.save(manager, state, config, task)  # waits for orbax (and its pruning)
  if opts["sync_ref_model"]:
    ref_sync.prune(workdir, manager.all_steps())


for _name in OBJECTIVE_NAMES:
  objectives.register(objectives.Objective(
      _name, no_supervised_loss, resolve_config=resolve_config, start_model=start_model,
      samples=False, run=run, workdir_folders=(ref_sync.FOLDER,)))
