"""Why Sudoku's RL gains are small at this scale (experiments/rl.py's `diagnostics` in
results/rl.json; docs/rl.md): the start's per-cell against whole-puzzle errors, the reward
variance within groups, the solve rate along the large-batch policy gradient, and each
update's gradient signal-to-noise ratio."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.rl_tasks import (EVAL_KEY, EVAL_PROMPTS, RL, SAMPLER, TASKS, eval_canvas,
                                  rate, solved)
from mdjax import sampling
from mdjax.rl import logps as logps_lib
from mdjax.rl import losses
from mdjax.tasks import sudoku4


def diagnostics(start_model, name: str) -> dict:
  """The start's diagnostics on Sudoku (this module's docstring)."""
  canvas, fixed, task, _ = eval_canvas(name)
  truth = np.asarray(task.sample_data(jax.random.key(EVAL_KEY), EVAL_PROMPTS))[:, 16:]
  blank = canvas[:, :16] == sudoku4.BLANK
  out = {}
  for steps in (TASKS[name]["steps"], TASKS[name]["sequential_steps"]):
    spec = sampling.make_spec(SAMPLER["family"], steps=steps,
                              **{k: v for k, v in SAMPLER.items() if k != "family"})
    tokens = np.asarray(sampling.sample(start_model.denoiser, start_model.params,
                                        jax.random.key(EVAL_KEY + 1), canvas, spec, fixed,
                                        mask_id=task.mask_id).tokens_BxL)
    wrong = tokens[:, 16:] != truth  # against the drawn solution (a few puzzles have two)
    blank_accuracy = float(1 - wrong[blank].mean())
    out[f"steps_{steps}"] = {
        "blank_cell_accuracy": blank_accuracy,
        "given_cell_accuracy": float(1 - wrong[~blank].mean()),
        "mean_blanks": float(blank.sum(1).mean()),
        "all_cells_right": float((~wrong).all(1).mean()),
        "independent_cells_prediction": float(np.mean(blank_accuracy ** blank.sum(1))),
        "wrong_cells_histogram": np.bincount(wrong.sum(1), minlength=5)[:5].tolist()}
  # Reward variance within groups: G = 8 rollouts of 256 fresh puzzles by the start.
  group, count = RL["num_generations"], 256
  rows = np.asarray(task.sample_data(jax.random.key(EVAL_KEY + 2), count))
  ids = np.repeat(rows, group, 0)
  cv = ids.copy()
  cv[:, 16:] = task.mask_id
  fx = np.zeros(cv.shape, bool)
  fx[:, :16] = True
  spec = sampling.make_spec(SAMPLER["family"], steps=TASKS[name]["steps"],
                            **{k: v for k, v in SAMPLER.items() if k != "family"})
  res = sampling.sample(start_model.denoiser, start_model.params, jax.random.key(EVAL_KEY + 3),
                        cv, spec, fx, mask_id=task.mask_id)
  toks, write = np.asarray(res.tokens_BxL), np.asarray(res.write_step_BxL)
  ok = sudoku4.checks(toks, task.params)["solved"].astype(np.float32)
  p_G = ok.reshape(-1, group).mean(1)
  out["groups"] = {"rollouts": int(ok.size), "solve_rate": float(ok.mean()),
                   "mixed_groups": float(((p_G > 0) & (p_G < 1)).mean()),
                   "all_fail_groups": float((p_G == 0).mean()),
                   "all_pass_groups": float((p_G == 1).mean()),
                   "mean_within_group_variance": float((p_G * (1 - p_G)).mean()),
                   "total_variance": float(ok.var())}
  # The solve rate along the mean diffu-GRPO gradient (trajectory estimator, beta 0) of these
  # 2048 rollouts, a step of length eta in parameter norm: the first-order gain, and where
  # the curvature takes it back.
  advantages = losses.group_advantages(jnp.asarray(ok), group)

  def loss(params):
    lp = logps_lib.trajectory_logps_fn(start_model.denoiser, params, toks, write, 16,
                                       mask_id=task.mask_id, num_steps=TASKS[name]["steps"])
    return -(advantages[:, None] * lp).sum() / lp.size

  grad = jax.jit(jax.grad(loss))(start_model.params)
  norm = float(jnp.sqrt(sum((g ** 2).sum() for g in jax.tree.leaves(grad))))
  param_norm = float(jnp.sqrt(sum((p.astype(jnp.float32) ** 2).sum()
                                  for p in jax.tree.leaves(start_model.params))))
  along = {}
  for eta in (0.0, 0.01, 0.03, 0.1, 0.3):
    moved = jax.tree.map(lambda p, g: p - eta * g / norm, start_model.params, grad)
    along[str(eta)] = rate(solved(start_model.denoiser, moved, name, TASKS[name]["steps"]))
  out["along_gradient"] = {"param_norm": param_norm, "solve_rate_at_step_length": along}
  out["gradient_snr"] = gradient_snr(start_model, task, name)
  return out


# The updates compared by `gradient_snr`: RFT (the table's, on the MC-ELBO, and on the
# trajectory) and diffu-GRPO on the trajectory (d1's mean baseline, and TRL's std scaling).
SNR_LOSSES = ("rft_elbo", "rft_trajectory", "grpo_trajectory", "grpo_trajectory_std")
SNR_BATCHES = 40  # independent 64-rollout batches; two halves of 20 for the cross terms


def gradient_snr(start_model, task, name: str) -> dict:
  """Each update's gradient at the start over SNR_BATCHES batches of the table's shape (8
  fresh puzzles x G rollouts): the signal-to-noise ratio of one batch's gradient,
  |E g|^2 / E|g - E g|^2 (|E g|^2 less the mean's own noise), the cosine between the
  expected gradients of two updates (from independent halves, a1.b2 / sqrt(a1.a2 b1.b2), so
  the batches' noise cancels), and the solve rate after a step of norm 0.03 along each mean."""
  group, steps, mask_id = RL["num_generations"], TASKS[name]["steps"], task.mask_id
  spec = sampling.make_spec(SAMPLER["family"], steps=steps,
                            **{k: v for k, v in SAMPLER.items() if k != "family"})

  def loss(kind, params, toks, write, ok, key):
    if kind == "rft_elbo":
      lp = logps_lib.elbo_logps_fn(start_model.denoiser, params, toks, 16, key,
                                   mask_id=mask_id, num_samples=RL["elbo_samples"])[:, None]
      return losses.rft_loss(lp, jnp.ones_like(lp), ok,
                             length_B=jnp.full(ok.shape, toks.shape[1] - 16.0))[0]
    lp = logps_lib.trajectory_logps_fn(start_model.denoiser, params, toks, write, 16,
                                       mask_id=mask_id, num_steps=steps)
    if kind == "rft_trajectory":
      return losses.rft_loss(lp, jnp.ones_like(lp), ok)[0]
    advantages = losses.group_advantages(ok, group, scale_by_std=kind.endswith("_std"))
    return losses.grpo_loss(lp, None, None, advantages, jnp.ones_like(lp), epsilon=RL["epsilon"],
                            beta=0.0)[0]

  grad_fns = {kind: jax.jit(jax.grad(lambda *a, kind=kind: loss(kind, *a)))
              for kind in SNR_LOSSES}
  grads = {kind: [] for kind in SNR_LOSSES}
  for i in range(SNR_BATCHES):
    rows = np.asarray(task.sample_data(jax.random.fold_in(jax.random.key(EVAL_KEY + 4), i), 8))
    canvas = np.repeat(rows, group, 0)
    canvas[:, 16:] = mask_id
    fixed = np.zeros(canvas.shape, bool)
    fixed[:, :16] = True
    res = sampling.sample(start_model.denoiser, start_model.params,
                          jax.random.fold_in(jax.random.key(EVAL_KEY + 5), i), canvas, spec,
                          fixed, mask_id=mask_id)
    ok = jnp.asarray(sudoku4.checks(np.asarray(res.tokens_BxL), task.params)["solved"],
                     jnp.float32)
    for kind in SNR_LOSSES:
      g = grad_fns[kind](start_model.params, res.tokens_BxL, res.write_step_BxL, ok,
                         jax.random.fold_in(jax.random.key(EVAL_KEY + 6), i))
      grads[kind].append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]))
  out, halves, leaves = {}, {}, jax.tree.leaves(start_model.params)
  for kind in SNR_LOSSES:
    g = np.stack(grads[kind])
    mean, noise = g.mean(0), float(((g - g.mean(0)) ** 2).sum(1).sum() / (SNR_BATCHES - 1))
    halves[kind] = g[:SNR_BATCHES // 2].mean(0), g[SNR_BATCHES // 2:].mean(0)
    step = np.split(0.03 * mean / np.linalg.norm(mean),
                    np.cumsum([x.size for x in leaves])[:-1])
    moved = jax.tree.unflatten(jax.tree.structure(start_model.params),
                               [x - d.reshape(x.shape).astype(x.dtype)
                                for x, d in zip(leaves, step)])
    out[kind] = {"signal_to_noise_per_batch": max(float((mean ** 2).sum()) - noise
                                                  / SNR_BATCHES, 0.0) / noise,
                 "solve_rate_after_step_0.03": rate(solved(start_model.denoiser, moved, name,
                                                           steps))}
  out["cos_of_expected_gradients"] = {}
  for i, a in enumerate(SNR_LOSSES):
    for b in SNR_LOSSES[i + 1:]:
      (a1, a2), (b1, b2) = halves[a], halves[b]
      out["cos_of_expected_gradients"][f"{a}|{b}"] = float(
          (a1 @ b2 + a2 @ b1) / 2 / np.sqrt(max(a1 @ a2, 1e-30) * max(b1 @ b2, 1e-30)))
  return out

