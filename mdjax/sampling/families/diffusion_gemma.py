"""DiffusionGemma's sampling rule (google-deepmind/gemma, `gemma/diffusion/_sampler.py`:
`DiffusionSampler`, `SampleFromPredictions`, `AnnealingTemperatureShaper`; `_early_stopping.py`:
`TokenStabilityEarlyStop`), for models under uniform noise.

The canvas starts as uniform random tokens. Step j of K reads the canvas at the noise
proportion t_j = 1 - j/K, shapes the logits by the temperature

    T(t) = min_temperature + (max_temperature - min_temperature) (1 - (1 - t)^exponent),

draws a token at every position from the shaped logits, keeps the draws at the positions of
lowest shaped entropy whose entropies before them (ascending) sum to at most
`entropy_bound` (at least one), and re-noises every other position with a uniform token.

Where this differs from the reference by default, and why:
- the last step keeps every draw (`final_renoise=False`): the reference re-noises there too,
  leaving random tokens wherever its entropy budget ran out; `final_renoise=True` does that;
- with `early_stop`, a row whose shaped argmax equals its canvas at every generated position
  keeps that canvas and stops (the reference writes that step's draws, re-noised positions
  included, before freezing the row);
- draws come from mdjax's named per-step streams (a row's draws do not depend on its
  neighbours or on the canvas's width).

`reference_draws=True` does what the reference does instead, key for key: each row's key is
the `rng` of gemma's `DiffusionSampler.sample_next_canvas` for that row alone (a batch of
one), split as it splits it (the initial canvas, then per step a categorical draw and the
re-noising tokens of the canvas's shape, `reference_length`: the last positions of the row), the
temperature computed in float32 as its shaper does, the stopping step's draws written before
the row freezes, and its entropy early stop (`entropy_stop`; with `early_stop` too, both must
hold, as its ChainedEarlyStop). With `self_condition` (each step's shaped logits fed back as
the next call's input through the denoiser's `encode_condition`, carried in bfloat16 as the
reference carries it) and `final_renoise=True`, the canvas is the reference's token for token
wherever the logits' float32 differences flip no draw.
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
  entropy_stop: float | None = knob(
      None, help="Stop a row once the mean shaped entropy of its generated positions is at "
      "most this (nats; the reference's EntropyEarlyStop); with early_stop, both must hold.",
      minimum=0.0)
  self_condition: bool = knob(False, help="Feed each step's shaped logits back as the next "
                              "call's self-conditioning input (the denoiser's "
                              "encode_condition, carried in bfloat16), as the reference does; "
                              "needs condition_width.")
  condition_width: int | None = knob(None, help="The width of the self-conditioning input "
                                     "(DiffusionGemma's d_model).", minimum=1)
  reference_draws: bool = knob(False, help="Draw as google-deepmind/gemma's DiffusionSampler "
                               "does with the row's key (module docstring); needs "
                               "reference_length.")
  reference_length: int | None = knob(None, help="With reference_draws: the canvas's "
                                      "width, its last positions (gemma's canvas_length).",
                                      minimum=1)

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
    for name in ("early_stop", "final_renoise", "self_condition", "reference_draws"):
      check(isinstance(getattr(self, name), bool), name, getattr(self, name),
            "must be True or False")
    check(self.entropy_stop is None or self.entropy_stop >= 0.0, "entropy_stop",
          self.entropy_stop, "must be None or >= 0")
    check(not self.self_condition or self.condition_width is not None, "condition_width",
          self.condition_width, "must be given with self_condition (the denoiser's "
          "encode_condition width)")
    check(not self.reference_draws or self.reference_length is not None, "reference_length",
          self.reference_length, "must be given with reference_draws (the reference draws in the "
          "canvas's shape)")

  @property
  def stops(self) -> bool:
    return self.early_stop or self.entropy_stop is not None


@struct.dataclass
class DiffusionGemmaPlan(StepPlan):
  temperature: Array  # the shaping temperature at this step's noise proportion t
  last: Array  # the last step


@struct.dataclass
class GemmaCarry:
  changes_KxB: Array  # generated positions whose token changed, per step and row
  stop_step_B: Array  # the step at which the row stopped (K: never)
  condition: Array | None = None  # B x L x condition_width, bfloat16 (self_condition)
  rng_B: Array | None = None  # each row's reference key chain (reference_draws)


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

  def validate(self, spec, canvas):
    if spec.reference_draws:
      check(spec.reference_length <= canvas.length, "reference_length", spec.reference_length,
            f"must be at most the canvas's length L={canvas.length}")
      generated = canvas.generated()
      if generated is not None:
        last = np.arange(canvas.length) >= canvas.length - spec.reference_length
        check(bool((generated == last).all()), "reference_length", spec.reference_length,
              "with reference_draws the generated positions must be the canvas's last "
              "reference_length")

  def idle_steps(self, spec, canvas, plan):
    # Rows that stop early leave steps no one can count before the run.
    return None if spec.stops else 0.0

  def start(self, spec, core, ctx):
    if spec.reference_draws:  # get_initial_sample from the row's initial_canvas_rng
      width = spec.reference_length
      first_B = jax.vmap(lambda k: jax.random.split(k)[0])(ctx.keys_B)
      canvas_BxW = jax.vmap(lambda k: jax.random.randint(k, (1, width), 0, ctx.vocab)[0])(
          first_B)
      tokens_BxL = core.tokens_BxL.at[:, -width:].set(canvas_BxW.astype(jnp.int32))
      return core.replace(tokens_BxL=jnp.where(ctx.editable_BxL, tokens_BxL, core.tokens_BxL))
    # The reference's get_initial_sample: uniform tokens.
    return revising.start_from_prior(noise_lib.Uniform(vocab_size=ctx.vocab), core, ctx)

  def init(self, spec, core, ctx) -> GemmaCarry:
    batch, length = core.tokens_BxL.shape
    condition = rng_B = None
    if spec.self_condition:  # the first step's input: zeros
      condition = jnp.zeros((batch, length, spec.condition_width), jnp.bfloat16)
    if spec.reference_draws:  # sample_next_canvas's step_rng
      rng_B = jax.vmap(lambda k: jax.random.split(k)[1])(ctx.keys_B)
    return GemmaCarry(changes_KxB=jnp.zeros((spec.steps, batch), jnp.int32),
                      stop_step_B=jnp.full((batch,), spec.steps, jnp.int32),
                      condition=condition, rng_B=rng_B)

  def condition(self, spec, aux: GemmaCarry):
    return aux.condition

  def active_rows(self, spec, core, carry: GemmaCarry, ctx) -> Array:
    return carry.stop_step_B == spec.steps

  def needs_call(self, spec, core, carry, ctx, plan) -> Array:
    return jnp.any(self.active_rows(spec, core, carry, ctx))

  def extras(self, spec, carry: GemmaCarry):
    return {"changes_KxB": carry.changes_KxB, "stop_step_B": carry.stop_step_B}

  def update(self, spec, core, carry, ctx, step, logits_BxLxV, denoise):
    """Draw everywhere, keep the low-entropy draws, re-noise the rest (module docstring)."""
    if spec.reference_draws:
      return reference_update(spec, core, carry, ctx, step, logits_BxLxV, denoise)
    plan, z_BxL = step.plan, core.tokens_BxL
    shaped_BxLxV = logits_BxLxV.astype(jnp.float32) / plan.temperature
    values_BxL = transforms.draw_values(step.keys_B, shaped_BxLxV, shift_B=step.shift_B,
                                        **{**spec.transform, "temperature": 1.0})
    _, conf_BxL = transforms.value_probs(shaped_BxLxV, values_BxL)
    entropy_BxL = revising.entropy(shaped_BxLxV)
    active_B = carry.stop_step_B == spec.steps
    stopping_B = active_B & stops(spec, shaped_BxLxV, entropy_BxL, z_BxL, ctx.editable_BxL)
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
                       stop_step_B=jnp.where(stopping_B, step.index, carry.stop_step_B),
                       condition=next_condition(spec, shaped_BxLxV, denoise), rng_B=carry.rng_B)
    return core, carry


def stops(spec: DiffusionGemmaSpec, shaped_BxLxV: Array, entropy_BxL: Array, canvas_BxL: Array,
          generated_BxL: Array) -> Array:
  """Per row: the early stop holds (the reference's TokenStabilityEarlyStop: the shaped
  argmax is the canvas at every generated position; EntropyEarlyStop: their mean entropy is
  at most entropy_stop; both when both are asked, as its ChainedEarlyStop)."""
  holds_B = jnp.ones(canvas_BxL.shape[:1], bool)
  if not spec.stops:
    return ~holds_B
  if spec.early_stop:
    same_BxL = transforms.argmax_last(shaped_BxLxV) == canvas_BxL
    holds_B &= jnp.all(same_BxL | ~generated_BxL, -1)
  if spec.entropy_stop is not None:
    count_B = jnp.maximum(generated_BxL.sum(-1), 1)
    holds_B &= (jnp.where(generated_BxL, entropy_BxL, 0.0).sum(-1) / count_B
                <= spec.entropy_stop)
  return holds_B


def next_condition(spec: DiffusionGemmaSpec, shaped_BxLxV: Array, denoise) -> Array | None:
  """The next call's self-conditioning input (the reference's sc_embeddings: encode_logits
  of the shaped logits, carried in bfloat16); None without self_condition."""
  if not spec.self_condition:
    return None
  condition = denoise.encode_condition(shaped_BxLxV)
  check(condition.shape[-1] == spec.condition_width, "condition_width", spec.condition_width,
        f"must be the denoiser's encode_condition width, {condition.shape[-1]}")
  return condition.astype(jnp.bfloat16)



def reference_temperature(spec: DiffusionGemmaSpec, index: Array) -> Array:
  """The reference shaper's temperature at step `index`, in float32 as it computes it
  (noise proportion 1 - index / steps)."""
  noise_K1 = 1.0 - jnp.arange(spec.steps + 1) / spec.steps
  fraction = 1.0 - (1.0 - noise_K1[index].astype(jnp.float32)) ** spec.exponent
  temperature = (fraction * (spec.max_temperature - spec.min_temperature)) + spec.min_temperature
  return temperature.astype(jnp.float32)


def reference_entropy(shaped_BxWxV: Array) -> Array:
  """The reference's per-token entropy (SampleFromPredictions, EntropyEarlyStop)."""
  log_probs = jax.nn.log_softmax(shaped_BxWxV.astype(jnp.float32))
  probs = jnp.exp(log_probs)
  return -jnp.sum(jnp.where(probs == 0, 0.0, log_probs) * probs, axis=-1)


def reference_selection(entropy_BxW: Array, bound: float) -> Array:
  """SampleFromPredictions' kept positions: ascending entropy, kept while the entropies
  before sum to at most `bound`."""
  order_BxW = jnp.argsort(entropy_BxW, axis=-1)
  sorted_BxW = jnp.take_along_axis(entropy_BxW, order_BxW, axis=-1)
  kept_BxW = (jnp.cumsum(sorted_BxW, axis=-1) - sorted_BxW) <= bound
  rows_B = jnp.arange(entropy_BxW.shape[0])[:, None]
  return jnp.zeros_like(order_BxW, dtype=bool).at[rows_B, order_BxW].set(kept_BxW)


def reference_draws(spec: DiffusionGemmaSpec, shaped_BxWxV: Array, keys_B: Array, vocab: int,
                    last) -> tuple[Array, Array]:
  """One step's tokens as the reference's `SampleFromPredictions` writes them from the
  step's key of each row (`sample_rng`): a categorical draw everywhere, the entropy-bounded
  ones kept (all at the last step without final_renoise), uniform tokens elsewhere. Returns
  (tokens B x W, entropies B x W)."""
  width = shaped_BxWxV.shape[1]
  draw_keys_Bx2 = jax.vmap(jax.random.split)(keys_B)
  draws_BxW = jax.vmap(lambda k, x: jax.random.categorical(k, x[None])[0])(
      draw_keys_Bx2[:, 0], shaped_BxWxV)
  noise_BxW = jax.vmap(lambda k: jax.random.randint(k, (1, width), 0, vocab)[0])(
      draw_keys_Bx2[:, 1])
  entropy_BxW = reference_entropy(shaped_BxWxV)
  kept_BxW = reference_selection(entropy_BxW, spec.entropy_bound)
  if not spec.final_renoise:
    kept_BxW |= last
  return jnp.where(kept_BxW, draws_BxW, noise_BxW).astype(jnp.int32), entropy_BxW


def reference_update(spec: DiffusionGemmaSpec, core, carry: GemmaCarry, ctx, step,
                     logits_BxLxV: Array, denoise):
  """One step as gemma's `sample_next_canvas` body does it, per row (module docstring)."""
  z_BxL = core.tokens_BxL
  width, last = spec.reference_length, step.plan.last
  shaped_BxLxV = logits_BxLxV.astype(jnp.float32) / reference_temperature(spec, step.index)
  shaped_BxWxV, canvas_BxW = shaped_BxLxV[:, -width:], z_BxL[:, -width:]
  keys_Bx2 = jax.vmap(jax.random.split)(carry.rng_B)
  sampled_BxW, entropy_BxW = reference_draws(spec, shaped_BxWxV, keys_Bx2[:, 1], ctx.vocab,
                                             last)
  next_B = keys_Bx2[:, 0]
  active_B = carry.stop_step_B == spec.steps
  generated_BxW = ctx.editable_BxL[:, -width:]
  stopping_B = active_B & stops(spec, shaped_BxWxV, entropy_BxW, canvas_BxW, generated_BxW)
  # The stopping step's draws are written (the reference freezes the row after them).
  moving_BxL = ctx.editable_BxL & active_B[:, None]
  new_BxL = z_BxL.at[:, -width:].set(sampled_BxW)
  _, conf_BxL = transforms.value_probs(shaped_BxLxV, new_BxL)
  core = core.commit(moving_BxL, new_BxL, conf_BxL, step.index)
  changed_BxL = moving_BxL & (new_BxL != z_BxL)
  core = revising.end_rows(spec, core, ctx, stopping_B | (active_B & last), step.index)
  carry = GemmaCarry(changes_KxB=carry.changes_KxB.at[step.index].set(changed_BxL.sum(-1)),
                     stop_step_B=jnp.where(stopping_B, step.index, carry.stop_step_B),
                     condition=next_condition(spec, shaped_BxLxV, denoise), rng_B=next_B)
  return core, carry
