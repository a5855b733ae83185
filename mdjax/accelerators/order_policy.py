"""UPO's objective: GRPO on a learned unmasking order over a frozen denoiser
(`python -m mdjax.accelerators.order_policy`, writes the policy file the `order_policy`
sampler reads).

What the reference does (chunsanHong/UPO: upo_trainer.py, upo_config.py,
slurm_scripts/sudoku.slurm and train_sudoku.yaml), and what this module does the same way:

1. Rollouts: each prompt is decoded `group` times (num_generations 6) by the sampler itself
   (`sampling.OrderPolicySpec`, values at temperature 0 as UPO's argmax), the policy drawing
   which positions each step commits; the whole trajectory is recorded.
2. Reward: the task's exact check (`mdjax.rl.rewards.TASK_CHECKS`, through the RL prompt
   source's texts), one number per row; the advantage is the reward minus its group's mean
   (UPO's default `norm_advantage=False`: no division by the group's deviation).
3. The log-probability of a step is that of its choice under the policy (Plackett-Luce,
   `sampling.order_policy.order_log_prob`), replayed from the recorded canvases; the loss of
   a row is -sum over steps of min(r A, clip(r, 1 - eps, 1 + eps) A), r the step's ratio to
   the rollout's policy (clamped log-ratio in [-10, 10]), eps 0.5; plus beta times UPO's "CE"
   term (the cross-entropy of the policy's softmax over the candidates against the
   max-confidence choice, ties shared; beta 1e-4); the mean over rows. `iterations` updates
   (UPO's num_iterations, 16) reuse each batch of rollouts; AdamW (b2 0.99, weight decay 0.1,
   gradients clipped at norm 0.2, as train_sudoku.yaml).

Where it differs, and why:
- The policy network is tiny and reads F = 9 features (`sampling.order_policy`), not LLaDA's
  hidden states: mdjax's exact oracles have none. UPO starts from a head pretrained to
  imitate max-confidence (or a random one: its "Random" runs); here from a random one.
- k positions a step (Plackett-Luce) where UPO commits one (its Sudoku runs); one
  policy temperature for rollouts and ratios (UPO: 0.8 and 1).
- The learning rate is 3e-3 (UPO: 3e-6 for a ~200M-parameter head on an 8B model) and the
  runs are short (`batches`), on mdjax's sudoku4 instead of LLaDA's 4x4 Sudoku prompts.
- One policy is trained on every K of `steps` in turn (its features carry the step's
  fraction and the masked fraction), where UPO trains one K.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mdjax import loader
from mdjax.denoiser import Denoiser
from mdjax.errors import ArgumentError, check
from mdjax.rl import rewards, sources
from mdjax.sampling import base, order_policy, scores, stepping, threefry, transforms
from mdjax.sampling.families.order_policy import choice_scores, step_counts

SEED = 0
STREAMS = ("init", "prompts", "rollouts")  # the seed's key split in this order


def stream_keys(seed: int) -> dict:
  """The run's random streams by name: split(key(seed), 3) in `STREAMS` order."""
  return dict(zip(STREAMS, jax.random.split(jax.random.key(seed), len(STREAMS))))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig:
  """The GRPO run (UPO's values where they carry over; module docstring)."""

  steps: tuple[int, ...] = (2, 4, 8)  # the K trained on, one batch each in turn
  batches: int = 60
  prompts: int = 16  # prompts a batch
  group: int = 6  # rollouts a prompt (UPO: num_generations 6)
  iterations: int = 16  # updates a batch (UPO: num_iterations 16)
  epsilon: float = 0.5  # the ratio's clip (UPO's yaml)
  beta: float = 1e-4  # weight of the max-confidence cross-entropy (UPO's "CE" runs)
  lr: float = 3e-3
  weight_decay: float = 0.1
  max_grad_norm: float = 0.2
  dim: int = 16
  hidden: int = 16
  policy_temperature: float = 1.0
  temperature: float = 0.0  # of the values (UPO: argmax)
  seed: int = SEED

  def __post_init__(self):
    object.__setattr__(self, "steps", tuple(self.steps))
    check(len(self.steps) >= 1 and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                                       for k in self.steps),
          "steps", self.steps, "must be integers >= 1")
    for name in ("batches", "prompts", "iterations", "dim", "hidden"):
      value = getattr(self, name)
      check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
            "must be an integer >= 1")
    check(isinstance(self.group, int) and self.group >= 2, "group", self.group,
          "must be an integer >= 2 (advantages are relative to the group)")
    for name in ("epsilon", "lr", "max_grad_norm", "policy_temperature"):
      value = getattr(self, name)
      check(math.isfinite(value) and value > 0, name, value, "must be a finite number > 0")
    for name in ("beta", "weight_decay", "temperature"):
      value = getattr(self, name)
      check(math.isfinite(value) and value >= 0, name, value, "must be a finite number >= 0")


@functools.partial(jax.jit, static_argnames=("steps", "mask_id", "temperature",
                                             "policy_temperature"))
def rollout(bound, arrays, canvas_BxL, editable_BxL, row_keys_B, *, steps: int, mask_id: int,
            temperature: float, policy_temperature: float) -> dict:
  """The `order_policy` sampler's K steps with the policy's weights traced (one program per
  K, where the sampler compiles one per policy), recording what GRPO replays: each step's
  features, candidates, the chosen positions' order (rank; L for the rest) and UPO's
  max-confidence target. tests/accelerators/test_order_policy.py checks that its tokens are
  the sampler's."""

  def step(carry, index):
    tokens_BxL, count_B = carry
    logits_BxLxV = bound(tokens_BxL, 1.0 - index / steps)
    masked_BxL = (tokens_BxL == mask_id) & editable_BxL
    count_B = jnp.where(index == 0, masked_BxL.sum(-1, dtype=jnp.int32), count_B)
    k_B = jnp.minimum(step_counts(count_B, index, steps), masked_BxL.sum(-1))
    keys_B = threefry.fold_in(row_keys_B, index)
    values_BxL = transforms.draw_values(keys_B, logits_BxLxV, temperature=temperature,
                                        top_k=None, top_p=1.0)
    feats_BxLxF = order_policy.features(logits_BxLxV, masked_BxL, editable_BxL, index / steps)
    choice_BxL = choice_scores(policy_temperature, keys_B,
                               order_policy.apply_arrays(arrays, feats_BxLxF))
    chosen_BxL = scores.select_top_k(choice_BxL, masked_BxL, k_B)
    rank_BxL = scores.rank_descending(choice_BxL, chosen_BxL)  # the draw's order; L elsewhere
    top_BxL = jnp.where(masked_BxL, feats_BxLxF[..., 0], -jnp.inf)
    target_BxL = (top_BxL == top_BxL.max(-1, keepdims=True)) & masked_BxL
    target_BxL = target_BxL / jnp.maximum(target_BxL.sum(-1, keepdims=True), 1)
    tokens_BxL = jnp.where(chosen_BxL, values_BxL, tokens_BxL)
    return (tokens_BxL, count_B), dict(features=feats_BxLxF, candidates=masked_BxL,
                                       rank=rank_BxL, target=target_BxL)

  zeros_B = jnp.zeros(canvas_BxL.shape[:1], jnp.int32)
  (tokens_BxL, _), record = jax.lax.scan(step, (canvas_BxL, zeros_B),
                                         jnp.arange(steps, dtype=jnp.int32))
  return dict(tokens=tokens_BxL, **record)


def step_log_probs(arrays, record: dict, policy_temperature: float) -> jax.Array:
  """Each step's log-probability of its choice, K x B (0 where a step chose nothing)."""
  scores_KxBxL = order_policy.apply_arrays(arrays, record["features"])
  return jax.vmap(order_policy.order_log_prob, (0, 0, 0, None))(
      scores_KxBxL, record["candidates"], record["rank"], policy_temperature)


def grpo_loss(arrays, record: dict, old_KxB, advantages_B, *, epsilon: float, beta: float,
              policy_temperature: float):
  """UPO's loss (module docstring): the clipped surrogate summed over steps, plus beta times
  the max-confidence cross-entropy, averaged over rows; and the clipped fraction."""
  length = record["rank"].shape[-1]
  active_KxB = (record["rank"] < length).any(-1)
  logp_KxB = step_log_probs(arrays, record, policy_temperature)
  ratio_KxB = jnp.exp(jnp.clip(logp_KxB - old_KxB, -10.0, 10.0))
  a_B = advantages_B[None, :]
  surrogate_KxB = jnp.minimum(ratio_KxB * a_B,
                              jnp.clip(ratio_KxB, 1 - epsilon, 1 + epsilon) * a_B)
  loss_B = -jnp.sum(jnp.where(active_KxB, surrogate_KxB, 0.0), 0)
  s_KxBxL = order_policy.apply_arrays(arrays, record["features"]) / policy_temperature
  cand_KxBxL = record["candidates"]
  log_q = s_KxBxL - jax.nn.logsumexp(jnp.where(cand_KxBxL, s_KxBxL, -jnp.inf), -1,
                                     keepdims=True)
  ce_KxB = -jnp.sum(jnp.where(cand_KxBxL, record["target"] * log_q, 0.0), -1)
  loss_B = loss_B + beta * jnp.sum(jnp.where(active_KxB, ce_KxB, 0.0), 0)
  clipped = jnp.sum(active_KxB & (ratio_KxB * a_B > jnp.clip(ratio_KxB, 1 - epsilon,
                                                            1 + epsilon) * a_B))
  return loss_B.mean(), clipped / jnp.maximum(active_KxB.sum(), 1)


def optimizer(cfg: PolicyConfig):
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                     optax.adamw(cfg.lr, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay))


@functools.partial(jax.jit, static_argnames=("cfg",))
def update(arrays, opt_state, record: dict, advantages_B, *, cfg: PolicyConfig):
  """UPO's `iterations` updates on one batch of rollouts (the ratio's reference: the policy
  that made them)."""
  old_KxB = jax.lax.stop_gradient(step_log_probs(arrays, record, cfg.policy_temperature))
  loss = functools.partial(grpo_loss, record=record, old_KxB=old_KxB, advantages_B=advantages_B,
                           epsilon=cfg.epsilon, beta=cfg.beta,
                           policy_temperature=cfg.policy_temperature)
  opt = optimizer(cfg)

  def one(state, _):
    w, o = state
    (value, clipped), grads = jax.value_and_grad(loss, has_aux=True)(w)
    updates, o = opt.update(grads, o, w)
    return (optax.apply_updates(w, updates), o), (value, clipped)

  (arrays, opt_state), (loss_I, clipped_I) = jax.lax.scan(one, (arrays, opt_state), None,
                                                          length=cfg.iterations)
  return arrays, opt_state, loss_I, clipped_I


def group_advantages(rewards_B: np.ndarray, group: int) -> np.ndarray:
  """Reward minus its group's mean (rows p * group .. p * group + group - 1 share a prompt)."""
  r = np.asarray(rewards_B, np.float32).reshape(-1, group)
  return (r - r.mean(1, keepdims=True)).reshape(-1)


def train_policy(denoiser, params, task, cfg: PolicyConfig, *, mask_id: int,
                 vocab_size: int | None = None, log=print) -> tuple[order_policy.OrderPolicy, dict]:
  """GRPO on the order policy over a frozen denoiser, prompts from the task's RL source, the
  reward its exact check: (policy, info)."""
  source = sources.IdTaskSource(task)
  reward_name = rewards.TASK_CHECKS[task.name]
  length = task.length
  keys = stream_keys(cfg.seed)
  arrays = order_policy.init_arrays(keys["init"], length, cfg.dim, cfg.hidden)
  opt_state = optimizer(cfg).init(arrays)
  bound = base.BoundDenoiser(Denoiser.of(denoiser), params,
                             mask_in_vocab=base.mask_inside(mask_id, vocab_size))
  history, started = [], time.perf_counter()
  for batch in range(cfg.batches):
    steps = cfg.steps[batch % len(cfg.steps)]
    prompts = source.draw(jax.random.fold_in(keys["prompts"], batch), cfg.prompts)
    prompt_ids = np.repeat(np.asarray(prompts.ids_PxLp, np.int32), cfg.group, 0)
    canvas = np.full((len(prompt_ids), length), mask_id, np.int32)
    canvas[:, :source.prompt_length] = prompt_ids
    editable = np.zeros(canvas.shape, bool)
    editable[:, source.prompt_length:] = True
    row_keys = stepping.row_keys(jax.random.fold_in(keys["rollouts"], batch), len(canvas))
    record = rollout(bound, arrays, jnp.asarray(canvas), jnp.asarray(editable), row_keys,
                     steps=steps, mask_id=mask_id, temperature=cfg.temperature,
                     policy_temperature=cfg.policy_temperature)
    tokens = np.asarray(record.pop("tokens"))
    texts = [t for t in prompts.texts for _ in range(cfg.group)]
    targets = [t for t in prompts.targets for _ in range(cfg.group)]
    rewards_B, _ = rewards.compute([reward_name], texts, source.completion_texts(tokens, None),
                                   targets)
    advantages = group_advantages(rewards_B, cfg.group)
    arrays, opt_state, loss_I, clipped_I = update(arrays, opt_state, record,
                                                  jnp.asarray(advantages), cfg=cfg)
    history.append({"batch": batch, "steps": steps, "reward": float(rewards_B.mean()),
                    "loss": float(loss_I[-1]), "clipped": float(clipped_I.mean())})
    if batch % 10 == 0 or batch == cfg.batches - 1:
      recent = [h["reward"] for h in history[-len(cfg.steps) * 3:]]
      log(f"order_policy: batch {batch} K={steps} reward {rewards_B.mean():.3f} (recent "
          f"{np.mean(recent):.3f}) {time.perf_counter() - started:.0f} s")
  policy = order_policy.OrderPolicy.from_arrays({k: np.asarray(v) for k, v in arrays.items()})
  info = {"method": "upo_grpo", "config": dataclasses.asdict(cfg), "reward": reward_name,
          "task": task.name, "params": policy.num_params, "history": history,
          "seconds": time.perf_counter() - started}
  return policy, info


def train_model_policy(model, cfg: PolicyConfig, log=print):
  """`train_policy` on a loaded `mdjax.Model` (a workdir, or a task's exact oracle)."""
  if model.task is None or model.task.name not in rewards.TASK_CHECKS:
    raise ArgumentError("model", "the policy's prompts and reward come from the model's id "
                        f"task (one of {sorted(rewards.TASK_CHECKS)}); this model has "
                        f"{getattr(model.task, 'name', None)!r}")
  policy, info = train_policy(model.denoiser, model.params, model.task, cfg,
                              mask_id=model.mask_id, vocab_size=model.vocab_size, log=log)
  info.update(denoiser=model.source or model.family)
  return policy, info


def main(argv: Sequence[str] | None = None, log=print) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="sudoku4", help="the frozen denoiser: a workdir, or "
                      "a task's exact oracle (sudoku4, oracle:permutation)")
  parser.add_argument("--out", required=True, help="the policy file (JSON) to write")
  defaults = PolicyConfig()
  parser.add_argument("--steps", default=",".join(map(str, defaults.steps)),
                      help="the K trained on, comma-separated")
  for name in ("batches", "prompts", "group", "iterations", "dim", "hidden", "seed"):
    parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
  for name in ("epsilon", "beta", "lr", "weight_decay", "max_grad_norm", "policy_temperature",
               "temperature"):
    parser.add_argument(f"--{name}", type=float, default=getattr(defaults, name))
  args = parser.parse_args(argv)
  fields = {f.name for f in dataclasses.fields(PolicyConfig)} - {"steps"}
  cfg = PolicyConfig(steps=tuple(int(k) for k in args.steps.split(",")),
                     **{name: getattr(args, name) for name in fields})
  policy, info = train_model_policy(loader.load(args.model), cfg, log=log)
  order_policy.save_policy(policy, args.out, info)
  log(f"wrote {args.out} ({policy!r})")
  return info


if __name__ == "__main__":
  main()
