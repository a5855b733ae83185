"""DiffusionGemma's sampling rule (google-deepmind/gemma, `gemma/diffusion/_sampler.py`:
`DiffusionSampler`, `SampleFromPredictions`, `AnnealingTemperatureShaper`; `_early_stopping.py`:
`TokenStabilityEarlyStop`), for models under uniform noise.

The canvas starts as uniform random tokens. Step j of K reads the canvas at the noise
proportion t_j = 1 - j/K, shapes the logits by the temperature

    T(t) = min_temperature + (max_temperature - min_temperature) (1 - (1 - t)^exponent),

draws a token at every position from the shaped logits, keeps the draws at the positions of
lowest shaped entropy whose entropies before them (ascending) sum to at most
`entropy_bound` (at least one), and re-noises every other position with a uniform token.

Where this differs from the reference, and why:
- the last step keeps every draw (`final_renoise=False`): the reference re-noises there too,
  leaving random tokens wherever its entropy budget ran out; `final_renoise=True` does that;
- with `early_stop`, a row whose shaped argmax equals its canvas at every generated position
  keeps that canvas and stops (the reference writes that step's draws, re-noised positions
  included, before freezing the row);
- self-conditioning (the previous step's shaped logits fed back as embeddings) is left out:
  the denoiser contract has no input for it, and the exact oracles need none.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import noise as noise_lib
from mdjax.sampling import revising, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps, knob,
                                 register)
from mdjax.streams import StepStream

Array = jax.Array

MIN_TEMPERATURE = 1e-12  # the reference's _MIN_TEMP
EOS_LAST = 1e6  # nats added to an EOS draw's sort key with eos_rank_last (ranks it last)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffusionGemmaSpec(SamplerSpec):
  """DiffusionGemma's rule (module docstring); its defaults are the reference's.

  The shared `temperature` stays 1: the rule anneals its own. `top_k`, `top_p` and `min_p`
  apply to the draws after the shaping. `SampleResult.extras["changes_KxB"]` counts the
  generated positions whose token changed at each step, `extras["stop_step_B"]` the step at
  which each row stopped (K when it never did).
  """

  steps: int = knob(help="Denoising steps (the reference's max_denoising_steps): the noise "
                    "proportion falls from 1 by 1/steps a step.", minimum=1)
  entropy_bound: float = knob(
      0.1, help="Keep the draws of lowest shaped entropy whose entropies before them sum to "
      "at most this (nats; at least one a step); re-noise the rest.", minimum=0.0)
  max_temperature: float = knob(0.8, help="The shaping temperature at noise proportion 1.",
                                minimum=MIN_TEMPERATURE)
  min_temperature: float = knob(0.4, help="The shaping temperature at noise proportion 0.",
                                minimum=MIN_TEMPERATURE)
  exponent: float = knob(1.0, help="The shape of the anneal: T = min + (max - min) (1 - (1 - "
                         "t)^exponent) at noise proportion t (1: linear).", minimum=0.0)
  early_stop: bool = knob(False, help="Stop a row once the argmax of its shaped logits equals "
                          "its canvas at every generated position (the reference's "
                          "TokenStabilityEarlyStop); the row keeps that canvas.")
  final_renoise: bool = knob(False, help="Re-noise at the last step too, as the reference "
                             "does (False: the last step keeps every draw).")

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(self.temperature == 1.0, "temperature", self.temperature,
          "DiffusionGemma's rule anneals its own temperature: leave temperature at 1 and set "
          "max_temperature and min_temperature")
    check(self.entropy_bound >= 0.0, "entropy_bound", self.entropy_bound, "must be >= 0")
    check(self.min_temperature >= MIN_TEMPERATURE, "min_temperature", self.min_temperature,
          f"must be >= {MIN_TEMPERATURE}")
    check(self.max_temperature >= self.min_temperature, "max_temperature",
          self.max_temperature, "must be >= min_temperature")
    check(self.exponent >= 0.0, "exponent", self.exponent, "must be >= 0")
    for name in ("early_stop", "final_renoise"):
      check(isinstance(getattr(self, name), bool), name, getattr(self, name),
            "must be True or False")


@struct.dataclass
class DiffusionGemmaPlan(StepPlan):
  temperature: Array  # the shaping temperature at this step's noise proportion t
  last: Array  # the last step


@struct.dataclass
class GemmaCarry:
  changes_KxB: Array  # generated positions whose token changed, per step and row
  stop_step_B: Array  # the step at which the row stopped (K: never)


def anneal(spec: DiffusionGemmaSpec, t_K: np.ndarray) -> np.ndarray:
  """The reference's `AnnealingTemperatureShaper` temperature at noise proportions t."""
  fraction = 1.0 - (1.0 - t_K) ** spec.exponent
  return spec.min_temperature + fraction * (spec.max_temperature - spec.min_temperature)


def kept_within_bound(entropy_BxL: Array, candidates_BxL: Array, bound: float,
                      demoted_BxL: Array | None = None) -> Array:
  """The candidates of lowest entropy whose entropies before them (ascending, ties to the
  lower position; `demoted` ranked after every other) sum to at most `bound`."""
  length = entropy_BxL.shape[1]
  key_BxL = entropy_BxL if demoted_BxL is None else entropy_BxL + EOS_LAST * demoted_BxL
  order_BxL = jnp.argsort(jnp.where(candidates_BxL, key_BxL, jnp.inf), axis=-1, stable=True)
  sorted_BxL = jnp.take_along_axis(jnp.where(candidates_BxL, entropy_BxL, 0.0), order_BxL, -1)
  before_BxL = jnp.cumsum(sorted_BxL, -1) - sorted_BxL
  rank_L = jnp.arange(length)
  kept_sorted_BxL = (before_BxL <= bound) & (rank_L < candidates_BxL.sum(-1, keepdims=True))
  rows_B = jnp.arange(entropy_BxL.shape[0])[:, None]
  return jnp.zeros_like(candidates_BxL).at[rows_B, order_BxL].set(kept_sorted_BxL)


@register
class DiffusionGemma(Family):
  name = "diffusion_gemma"
  spec_type = DiffusionGemmaSpec
  rewrites = True
  stops_early = True
  noise_kinds = ("uniform",)
  ends_rows_at_the_end = True

  def examples(self, generated):
    return [DiffusionGemmaSpec(steps=5),
            DiffusionGemmaSpec(steps=6, entropy_bound=1.0, max_temperature=1.0, exponent=2.0,
                               early_stop=True, top_k=3),
            DiffusionGemmaSpec(steps=3, entropy_bound=0.5, final_renoise=True)]

  def plan(self, spec, canvas) -> DiffusionGemmaPlan:
    j = np.arange(spec.steps)
    t = 1.0 - j / spec.steps
    return DiffusionGemmaPlan(t=t, temperature=anneal(spec, t), last=j == spec.steps - 1)

  def idle_steps(self, spec, canvas, plan):
    # Rows that stop early leave steps no one can count before the run.
    return None if spec.early_stop else 0.0

  def start(self, spec, core, ctx):
    # The reference's get_initial_sample: uniform tokens.
    return revising.start_from_prior(noise_lib.Uniform(vocab_size=ctx.vocab), core, ctx)

  def init(self, spec, core, ctx) -> GemmaCarry:
    batch = core.tokens_BxL.shape[0]
    return GemmaCarry(changes_KxB=jnp.zeros((spec.steps, batch), jnp.int32),
                      stop_step_B=jnp.full((batch,), spec.steps, jnp.int32))

  def active_rows(self, spec, core, carry: GemmaCarry, ctx) -> Array:
    return carry.stop_step_B == spec.steps

  def needs_call(self, spec, core, carry, ctx, plan) -> Array:
    return jnp.any(self.active_rows(spec, core, carry, ctx))

  def extras(self, spec, carry: GemmaCarry):
    return {"changes_KxB": carry.changes_KxB, "stop_step_B": carry.stop_step_B}

  def update(self, spec, core, carry, ctx, step, logits_BxLxV, denoise):
    """Draw everywhere, keep the low-entropy draws, re-noise the rest (module docstring)."""
    plan, z_BxL = step.plan, core.tokens_BxL
    shaped_BxLxV = logits_BxLxV.astype(jnp.float32) / plan.temperature
    values_BxL = transforms.draw_values(step.keys_B, shaped_BxLxV, shift_B=step.shift_B,
                                        **{**spec.transform, "temperature": 1.0})
    _, conf_BxL = transforms.value_probs(shaped_BxLxV, values_BxL)
    entropy_BxL = revising.entropy(shaped_BxLxV)
    active_B = carry.stop_step_B == spec.steps
    stable_B = jnp.all((transforms.argmax_last(shaped_BxLxV) == z_BxL) | ~ctx.editable_BxL, -1)
    stopping_B = active_B & stable_B if spec.early_stop else jnp.zeros_like(active_B)
    moving_BxL = ctx.editable_BxL & (active_B & ~stopping_B)[:, None]
    demoted = (values_BxL == spec.eos_id) if spec.eos_rank_last else None
    kept_BxL = kept_within_bound(entropy_BxL, moving_BxL, spec.entropy_bound, demoted)
    if not spec.final_renoise:
      kept_BxL |= moving_BxL & plan.last
    noise_BxL = revising.uniform_tokens(step.keys_B, StepStream.RENOISE, z_BxL.shape[1],
                                        ctx.vocab, step.shift_B)
    new_BxL = jnp.where(kept_BxL, values_BxL, noise_BxL)
    core = core.commit(moving_BxL, new_BxL, jnp.where(kept_BxL, conf_BxL, 1.0 / ctx.vocab),
                       step.index)
    changed_BxL = moving_BxL & (new_BxL != z_BxL)
    ended_B = stopping_B | (active_B & plan.last)
    core = revising.end_rows(spec, core, ctx, ended_B, step.index)
    carry = GemmaCarry(changes_KxB=carry.changes_KxB.at[step.index].set(changed_BxL.sum(-1)),
                       stop_step_B=jnp.where(stopping_B, step.index, carry.stop_step_B))
    return core, carry

