"""A learned unmasking order (UPO / SAS: Hong et al. 2025, chunsanHong/UPO's
`generate_sudoku` with `remasking="extra_head"`).

Each step proposes a value for every masked position (the spec's temperature; UPO: argmax),
the policy (`sampling.order_policy.OrderPolicy`, trained by `mdjax.accelerators.order_policy`)
scores every position from the denoiser's output, and the step commits k of the masked
positions drawn by Plackett-Luce on score / policy_temperature: the top k of
score / policy_temperature + Gumbel noise (the StepStream.SELECT draw of the step key), in
that order; policy_temperature 0 takes the k best scores. k is LLaDA's even count (the N
masked positions at the first step, N // K a step, one more on the first N % K steps), so
the run makes exactly K denoiser calls whatever the policy does.

Where mdjax differs from UPO, and why:
- UPO commits one position a step on Sudoku (`num_tokens = 1`, K = the masked count); here K
  is a knob and a step commits k positions, drawn without replacement (Plackett-Luce), which
  is UPO's softmax for k = 1.
- UPO's rollouts perturb the head's logits with Gumbel noise at temperature 0.8
  (`add_gumbel_noise`) while its GRPO ratio reads the softmax at temperature 1; here one
  `policy_temperature` serves both, so the log-probabilities trained are those sampled.
- The denoiser's time is 1 - i / K at step i (mdjax's models take one; LLaDA's takes none).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import order_policy, scores, transforms
from mdjax.sampling.base import Family, SamplerSpec, StepPlan, check, check_steps, knob, register
from mdjax.sampling.order_policy import OrderPolicy
from mdjax.streams import StepStream

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrderPolicySpec(SamplerSpec):
  """UPO: a learned policy picks which masked positions each of K steps commits (module
  docstring)."""

  steps: int = knob(help="K: denoiser calls; each step commits LLaDA's even count of the "
                    "masked positions, chosen by the policy.", minimum=1)
  # Required (None only so that the knobs' own checks run first); set in Python or by
  # sample.py's --policy_file, never by a request field (the server reads no files).
  policy: OrderPolicy | None = dataclasses.field(
      default=None, metadata={"help": "The trained policy (sampling.order_policy.load_policy)."})
  policy_temperature: float = knob(
      1.0, help="Plackett-Luce temperature of the policy's choice of positions (what it was "
      "trained at; 0: the k best scores).", minimum=0.0)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(isinstance(self.policy, OrderPolicy), "policy", self.policy,
          "must be an OrderPolicy: the order_policy sampler needs its trained policy "
          "(sampling.order_policy.load_policy reads the file `python -m "
          "mdjax.accelerators.order_policy` writes; sample.py: --policy_file)")
    value = self.policy_temperature
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and value >= 0.0, "policy_temperature", value, "must be a finite number >= 0")
    object.__setattr__(self, "policy_temperature", float(value))


def step_counts(count_B: Array, index, steps: int) -> Array:
  """LLaDA's even count at step `index` of `steps` for rows that start with count_B masked."""
  return count_B // steps + (index < count_B % steps).astype(jnp.int32)


def choice_scores(policy_temperature: float, keys_B: Array, scores_BxL: Array,
                  shift_B: Array | None = None) -> Array:
  """score / policy_temperature + Gumbel noise: its top k is a Plackett-Luce draw, in order."""
  if policy_temperature == 0.0:
    return scores_BxL
  gumbel_BxL = transforms.row_gumbel(keys_B, StepStream.SELECT, scores_BxL.shape[1:], shift_B)
  return scores_BxL / policy_temperature + gumbel_BxL.astype(scores_BxL.dtype)


@register
class OrderPolicyFamily(Family):
  name = "order_policy"
  spec_type = OrderPolicySpec

  def bench_spec(self, steps, length):
    return OrderPolicySpec(steps=steps, policy=order_policy.example_policy(length))

  def examples(self, generated):
    length = max(generated) + 1
    return [OrderPolicySpec(steps=len(generated), policy=order_policy.example_policy(length)),
            OrderPolicySpec(steps=3, policy=order_policy.example_policy(length, seed=1),
                            policy_temperature=0.0, temperature=0.0),
            OrderPolicySpec(steps=2, policy=order_policy.example_policy(length, seed=2),
                            top_k=2, policy_temperature=0.5)]

  def validate(self, spec: OrderPolicySpec, canvas) -> None:
    if canvas.length != spec.policy.length:
      raise ValueError(f"policy: its length {spec.policy.length} must be the canvas length "
                       f"{canvas.length} (it has a table of positions); train a policy on "
                       "this canvas.")

  def plan(self, spec: OrderPolicySpec, canvas) -> StepPlan:
    return StepPlan(t=1.0 - np.arange(spec.steps) / spec.steps)

  def init(self, spec, core, ctx) -> Array:
    return jnp.zeros(core.tokens_BxL.shape[:1], jnp.int32)  # masked count at the first step

  def update(self, spec: OrderPolicySpec, core, count_B, ctx, step, logits_BxLxV, denoise):
    """Commits the k positions the policy draws, each with its proposed value."""
    masked_BxL = ctx.masked(core.tokens_BxL)
    count_B = jnp.where(step.index == 0, masked_BxL.sum(-1, dtype=jnp.int32), count_B)
    k_B = jnp.minimum(step_counts(count_B, step.index, spec.steps), masked_BxL.sum(-1))
    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    feats_BxLxF = order_policy.features(logits_BxLxV, masked_BxL, ctx.editable_BxL,
                                        step.index / spec.steps)
    choice_BxL = choice_scores(spec.policy_temperature, step.keys_B,
                               spec.policy.scores(feats_BxLxF), step.shift_B)
    write_BxL = scores.select_top_k(choice_BxL, masked_BxL, k_B)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), count_B
