"""Kernels of the families whose steps may revise any written token (uniform or hybrid
noise): the process a spec samples, the prior canvas, the exact reverse step's draw, uniform
re-noising, and the end of a row once the run is over.

Under uniform noise the canvas holds a token at every position from the first step, so
nothing marks a position as "not yet written": every step redraws every generated position.
The process reaches a spec as its `noise` field (a `mdjax.noise` process, or its name over
the denoiser's V with the linear schedule); `with_noise` fills it from a model's
`Model.noise`, as `mdjax.generate` and sample.py do, and checks the family samples it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdjax import noise as noise_lib
from mdjax.errors import ArgumentError
from mdjax.sampling import threefry, transforms
from mdjax.sampling.base import Canvas, Context, Core, family_of
from mdjax.sampling.end_of_row import EndAtEos
from mdjax.streams import RowStream, StepStream

Array = jax.Array


def check_noise_field(noise) -> None:
  """A spec's `noise`: None (the model's, filled in by `with_noise`), a process name or a
  process value."""
  ok = (noise is None or isinstance(noise, noise_lib.NoiseProcess)
        or (isinstance(noise, str) and noise in noise_lib.PROCESSES))
  if not ok:
    raise ArgumentError.invalid("noise", noise, f"it must be None (the model's), one of "
                                f"{sorted(noise_lib.PROCESSES)} or a mdjax.noise process")


def process_of(noise, vocab_size: int) -> noise_lib.NoiseProcess:
  """The process of a spec's `noise` over V = `vocab_size` tokens (a name: the linear
  schedule)."""
  if noise is None:
    raise ArgumentError("noise", "noise=None: this sampler needs the model's noise process; "
                        "mdjax.generate and sample.py take it from the model (Model.noise), "
                        "sampling.sample needs it given (noise='uniform', or a mdjax.noise "
                        "process).")
  return noise_lib.as_process(noise, vocab_size)


def check_canvas(process: noise_lib.NoiseProcess, canvas: Canvas) -> None:
  """The process fits the canvas: over its V tokens, and a process with a mask state (V)
  needs the mask id outside the vocabulary."""
  if process.vocab_size != canvas.vocab_size:
    raise ArgumentError("noise", f"noise={process!r} is over {process.vocab_size} tokens; the "
                        f"denoiser returns V={canvas.vocab_size} logits per position.")
  if process.has_mask and canvas.mask_id != canvas.vocab_size:
    raise ArgumentError("mask_id", f"mask_id={canvas.mask_id}: the {process.name} process's "
                        f"mask state is id V={canvas.vocab_size}; a mask id inside the "
                        "vocabulary fits uniform noise only.")


def with_noise(spec, process: noise_lib.NoiseProcess | None):
  """`spec` with its `noise` taken from a model's process (None: absorbing) where unset; an
  `ArgumentError` when the family does not sample that process or the spec names another."""
  family = family_of(spec)
  kinds = family.noise_kinds or ("absorbing",)
  name = "absorbing" if process is None else process.name
  if name not in kinds:
    raise ArgumentError("spec", f"the {family.name} sampler samples models under "
                        f"{' or '.join(kinds)} noise; this model's noise is {name} "
                        "(uniform_ancestral samples every process; mdjax.load(..., noise=...) "
                        "picks an oracle's).")
  if not hasattr(spec, "noise"):
    return spec
  given = spec.noise
  if given is not None:
    given_name = given if isinstance(given, str) else given.name
    if given_name != name or (isinstance(given, noise_lib.NoiseProcess) and process is not None
                              and given != process):
      raise ArgumentError("spec.noise", f"spec.noise={given!r} is not the model's noise "
                          f"process ({name}: {process!r}); leave it None to take the model's.")
  # A name stands for the model's own process (its schedule and parameters).
  return dataclasses.replace(spec, noise=name if process is None else process)


def uniform_tokens(keys_B: Array, tag, length: int, vocab_size: int,
                   shift_B: Array | None = None) -> Array:
  """One uniform token id in [0, V) per position and row, from each row's own key."""
  u_BxL = transforms.row_uniform(keys_B, tag, (length,), shift_B)
  return jnp.minimum((u_BxL * vocab_size).astype(jnp.int32), vocab_size - 1)


def init_keys(ctx: Context) -> Array:
  """Each row's key for the draws made once before the loop."""
  return threefry.fold_in(ctx.keys_B, RowStream.INIT)


def start_from_prior(process: noise_lib.NoiseProcess, core: Core, ctx: Context) -> Core:
  """The canvas with its generated positions drawn from the process at t = 1 (uniform
  tokens; the mask under absorbing noise, and under GIDD's hybrid, all mask at t = 1), from
  each row's INIT key, so a row's start does not depend on the batch."""
  length = core.tokens_BxL.shape[1]
  with jax.ensure_compile_time_eval():  # static: the process's masses at t = 1
    _, mask_1, uniform_1 = (float(x[0]) for x in process.coefficients(jnp.ones((1,))))
  keys_B = init_keys(ctx)
  tokens_BxL = uniform_tokens(keys_B, StepStream.VALUES, length, process.vocab_size, ctx.shift_B)
  if process.has_mask and mask_1 > 0.0:
    kind_u_BxL = transforms.row_uniform(keys_B, StepStream.REVEAL, (length,), ctx.shift_B)
    to_mask_BxL = kind_u_BxL < mask_1 / (mask_1 + uniform_1)
    tokens_BxL = jnp.where(to_mask_BxL, ctx.mask_id, tokens_BxL)
  return core.replace(tokens_BxL=jnp.where(ctx.editable_BxL, tokens_BxL, core.tokens_BxL))


def reverse_draw(process: noise_lib.NoiseProcess, posterior_BxLxV: Array, z_BxL: Array,
                 s: Array, t: Array, keys_B: Array,
                 shift_B: Array | None = None) -> tuple[Array, Array]:
  """x_s drawn per position from the exact reverse step (`NoiseProcess.reverse_step`: the
  mixture over the posterior marginals), and each draw's probability. States are the V
  tokens and, for a process with a mask, the mask id V."""
  batch = z_BxL.shape[0]
  s_B, t_B = jnp.full((batch,), s, jnp.float32), jnp.full((batch,), t, jnp.float32)
  step_BxLxS = process.reverse_step(posterior_BxLxV.astype(jnp.float32), z_BxL, s_B, t_B)
  x_s_BxL = transforms.gumbel_max(keys_B, StepStream.VALUES, jnp.log(step_BxLxS), shift_B)
  prob_BxL = jnp.take_along_axis(step_BxLxS, x_s_BxL[..., None], -1)[..., 0]
  return x_s_BxL, prob_BxL


def entropy(logits_BxLxV: Array) -> Array:
  """H of softmax(logits) per position, in nats (0 log 0 = 0: -inf logits are fine)."""
  log_p = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), -1)
  p = jnp.exp(log_p)
  return -jnp.sum(jnp.where(p > 0, p * log_p, 0.0), -1)


def end_rows(spec, core: Core, ctx: Context, rows_B: Array, step: Array) -> Core:
  """With an EOS id: in `rows_B`, EOS written at the editable positions after the row's first
  EOS (the end of a run whose canvas held no mask: `end_of_row.EndAfterRun`)."""
  if spec.eos_id is None:
    return core
  first_B, _ = EndAtEos(spec.eos_id).state(core.tokens_BxL, ctx.editable_BxL, ctx.mask_id)
  after_BxL = jnp.arange(core.tokens_BxL.shape[1])[None] > first_B[:, None]
  fill_BxL = (rows_B[:, None] & after_BxL & ctx.editable_BxL
              & (core.tokens_BxL != spec.eos_id))
  return core.commit(fill_BxL, jnp.full_like(core.tokens_BxL, spec.eos_id),
                     jnp.ones(core.write_conf_BxL.shape, core.write_conf_BxL.dtype), step)
