"""The sampler family protocol, the shared carry and the registry.

A family is one module: its frozen spec, its typed per-step plan, and a `Family`
subclass registered with `@register`. The driver (`sampling.driver`) knows families
only through the methods below, so a new family is one file and one import line in
`sampling/__init__.py`, and joins the contract tests by being registered.

What the driver does with a family, for `sample(apply_fn, params, key, tokens, spec)`:

  family = family_of(spec)
  family.validate(spec, canvas)            # host, before tracing
  plan = family.plan(spec, canvas)         # numpy pytree, leading axis K = num_steps
  aux = family.init(spec, core, ctx)       # the family's own carry
  for each step i (one lax.scan; or, where the plan leaves idle steps, a while loop
  that jumps over the steps where `needs_call` says nothing can be written):
    call the denoiser on the canvas
    core, aux = family.update(spec, core, aux, ctx, StepInfo(i, keys, plan[i]), logits,
                              denoise)

Composite families (whole rounds of their own, such as speculative verification or
base-then-refill) set `composite = True` and provide `run` instead of the step methods.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import diffusion, errors
from mdjax.denoiser import Denoiser

Array = jax.Array


def check(condition: bool, field: str, value, allowed: str):
  """Raises `ArgumentError('{field}={value!r} is invalid: {allowed}.')` (a ValueError whose
  `param` is `field`) unless condition."""
  errors.check(condition, field, value, allowed)


def check_steps(steps, field: str = "steps"):
  check(isinstance(steps, (int, np.integer)) and steps >= 1, field, steps,
        "must be an integer >= 1")


def check_block_length(block_length):
  if block_length is not None:
    check(isinstance(block_length, (int, np.integer)) and block_length >= 1,
          "block_length", block_length, "must be None or an integer >= 1")


KV_CACHES = ("none", "dual", "exact")


def knob(default: Any = dataclasses.MISSING, *, help: str, choices=None, minimum=None,
         maximum=None):
  """A spec field that is a knob: its default, one line of help, and what values it takes
  (`choices`, or the closed range [minimum, maximum]) beyond its type (`sampling.knobs`
  reads it; the spec's own checks enforce it)."""
  metadata = {"help": help, "choices": None if choices is None else tuple(choices),
              "minimum": minimum, "maximum": maximum}
  return dataclasses.field(default=default, metadata=metadata)


def internal(default: Any = dataclasses.MISSING, *, help: str):
  """A scalar spec field that is not a knob: set by the library (the model's EOS id, a
  notation kept for display) or by a caller that reads what it changes (the trajectory),
  never by a flag or a request field."""
  return dataclasses.field(default=default, metadata={"help": help, "internal": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerSpec:
  """Knobs shared by every family: the value transform, the end of sequence, idle steps
  and the KV cache (each field's help: `sampling.knobs`, or its `knob(help=...)` below)."""

  temperature: float = knob(1.0, help="softmax(logits / T); T = 0 takes the argmax (no "
                            "division).", minimum=0.0)
  top_k: int | None = knob(None, help="Keep the k most likely values (None: all).", minimum=1)
  top_p: float = knob(1.0, help="Nucleus mass in (0, 1]: keep the most likely values whose "
                      "mass reaches it.", maximum=1.0)
  min_p: float = knob(0.0, help="Keep values with probability >= min_p times the row's "
                      "largest (0: all).", minimum=0.0, maximum=1.0)
  record_trajectory: bool = internal(False, help="Also return the canvas after every step "
                                     "(K x B x L).")
  skip_idle_steps: bool | None = knob(
      None, help="Jump over steps with nothing to write in any row, calling the denoiser "
      "only at steps that write (the program is a while loop instead of a scan). None decides "
      "from the plan before tracing: the loop jumps where at least IDLE_FRACTION_TO_SKIP of "
      "the steps are idle (counted exactly, or expected, by Family.idle_steps), or where that "
      "cannot be told before the run (threshold and entropy-bounded decoding, which finish "
      "early by design). True always uses it, False never. Tokens are the same either way. "
      "Families whose steps always change the canvas (remasking, revision) never skip.")
  eos_id: int | None = internal(
      None, help="The end-of-sequence id (None: no end of sequence). A row that has written "
      "EOS at an editable position i, with every position before i written, is finished: its "
      "editable positions after i become EOS and it stops changing (SampleResult."
      "generated_length_B counts the positions before i).")
  eos_penalty: float = knob(0.0, help="Subtracted from the EOS logit where values are "
                            "proposed.", minimum=0.0)
  eos_never: bool = knob(False, help="EOS is never proposed (its logit is -inf): the canvas "
                         "is filled to the end.")
  eos_rank_last: bool = knob(
      False, help="EOS proposals rank below every other proposal wherever a family ranks "
      "proposals by a score (confidence, entropy-bounded, write orders, test-and-defer, "
      "revision, speculative drafts), so a row's end is committed last (LLaDA's knob).")
  kv_cache: str = knob("none", help="KV-cached block decoding (with block_length): 'dual' "
                       "runs one full pass per block, then passes over the block only; "
                       "'exact' the cache of a block-causal model.", choices=KV_CACHES)
  refresh_every: int | None = knob(
      None, help="With kv_cache='dual': also refresh the cache every N steps of a block (1: "
      "every step, the uncached tokens; None: at each block's first step only).", minimum=1)

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        # Specs are static (hashed into the program): a concrete scalar becomes a number.
        if np.ndim(value) != 0 or isinstance(value, jax.core.Tracer):
          raise ValueError(f"{f.name}={value!r} must be a Python number: specs are static, "
                           "so a knob cannot be an array or a traced value.")
        object.__setattr__(self, f.name, value.item())
      elif f.name.endswith("schedule") and not isinstance(value, diffusion.Schedule):
        object.__setattr__(self, f.name, diffusion.as_schedule(value, f.name))
    for name in ("temperature", "top_p", "min_p"):
      value = getattr(self, name)
      check(isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value), name, value, "must be a finite number")
    check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
    check(self.top_k is None or (isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                                 and self.top_k >= 1),
          "top_k", self.top_k, "must be None or an integer >= 1")
    check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must lie in (0, 1]")
    check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must lie in [0, 1]")
    check(self.skip_idle_steps in (None, True, False), "skip_idle_steps",
          self.skip_idle_steps, "must be None (decide from the plan), True or False")
    check(self.eos_id is None or (isinstance(self.eos_id, int) and not isinstance(self.eos_id, bool)
                                  and self.eos_id >= 0),
          "eos_id", self.eos_id, "must be None or an integer id >= 0 (below the mask id V)")
    check(isinstance(self.eos_penalty, (int, float)) and not isinstance(self.eos_penalty, bool)
          and math.isfinite(self.eos_penalty) and self.eos_penalty >= 0.0,
          "eos_penalty", self.eos_penalty, "must be a finite number >= 0")
    for name in ("eos_never", "eos_rank_last"):
      check(isinstance(getattr(self, name), bool), name, getattr(self, name),
            "must be True or False")
    if self.eos_id is None:
      for name, off in (("eos_penalty", 0.0), ("eos_never", False), ("eos_rank_last", False)):
        check(getattr(self, name) == off, name, getattr(self, name),
              "needs eos_id (the end-of-sequence id) to be set")
    check(self.kv_cache in KV_CACHES, "kv_cache", self.kv_cache, f"must be one of {KV_CACHES}")
    check(self.refresh_every is None or (isinstance(self.refresh_every, int)
                                         and not isinstance(self.refresh_every, bool)
                                         and self.refresh_every >= 1),
          "refresh_every", self.refresh_every,
          "must be None (refresh at each block's first step) or an integer >= 1")
    check(self.refresh_every is None or self.kv_cache != "none", "refresh_every",
          self.refresh_every, "applies only with a KV cache: set kv_cache='dual'")
    check(self.refresh_every is None or self.kv_cache != "exact", "refresh_every",
          self.refresh_every, "applies only to the dual KV cache (the exact cache of a "
          "block-causal model never needs a refresh)")

  @property
  def transform(self) -> dict:
    return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p, eos_id=self.eos_id, eos_penalty=self.eos_penalty,
                eos_never=self.eos_never)


# ----------------------------------------------------------------------------
# What a family sees.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Canvas:
  """The host's view of a call, for validation and plans made before tracing.

  tokens and fixed are numpy arrays, or None when `sample` runs inside a trace (fixed is
  still known there when the caller passes a concrete fixed_BxL). vocab_size is V, the
  denoiser's logits per position (None: V = mask_id, the mask outside the vocabulary).
  """

  batch: int
  length: int
  mask_id: int
  tokens: np.ndarray | None
  fixed: np.ndarray | None
  vocab_size: int | None = None

  def __post_init__(self):
    if self.vocab_size is None:
      object.__setattr__(self, "vocab_size", self.mask_id)

  def generated(self) -> np.ndarray | None:
    """Positions some row generates (masked and not fixed), or None when traced."""
    if self.tokens is None:
      return None
    return ((self.tokens == self.mask_id) & ~self.fixed).any(0)

  def check_covers(self, name: str, sets) -> None:
    """Every generated position lies in one of `sets`, and every named one on the canvas."""
    flat = [p for s in sets for p in s]
    if max(flat) >= self.length:
      raise ValueError(f"{name} name position {max(flat)}; the canvas has L={self.length}.")
    generated = self.generated()
    if generated is None:
      return
    covered = np.zeros(self.length, bool)
    covered[flat] = True
    missed = np.flatnonzero(generated & ~covered)
    if missed.size:
      raise ValueError(f"{name} miss masked positions {missed.tolist()}; every generated "
                       f"position must be in exactly one of the {name}.")


@struct.dataclass
class Counters:
  """What a run counts: one set for every result (`SampleResult`, `BlocksResult`), summed
  over a composite family's sub-runs and over generated blocks."""

  nfe: Array  # sequential denoiser calls made (a batched call of many contexts counts 1)
  saved_calls: Array  # steps whose call was skipped (nothing to write, or reused logits)
  contexts_B: Array  # sequences evaluated for each row (a call of J contexts counts J)
  rounds_B: Array  # steps in which the row still had positions to write
  reopened_B: Array  # committed tokens returned to the mask
  nonfinite_B: Array  # positions written from non-finite logits (NaN or inf: a broken model)

  @classmethod
  def zeros(cls, batch: int) -> "Counters":
    zero, zeros_B = jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32)
    return cls(nfe=zero, saved_calls=zero, contexts_B=zeros_B, rounds_B=zeros_B,
               reopened_B=zeros_B, nonfinite_B=zeros_B)

  def __add__(self, other: "Counters") -> "Counters":
    return jax.tree.map(jnp.add, self, other)

  def add(self, **increments) -> "Counters":
    """These counters with `increments` (by counter name) added."""
    return self.replace(**{name: getattr(self, name) + value
                           for name, value in increments.items()})


class CountedView:
  """The counters of `self.counters` read by name (`result.nfe`, `core.rounds_B`)."""

  nfe = property(lambda self: self.counters.nfe)
  saved_calls = property(lambda self: self.counters.saved_calls)
  contexts_B = property(lambda self: self.counters.contexts_B)
  rounds_B = property(lambda self: self.counters.rounds_B)
  reopened_B = property(lambda self: self.counters.reopened_B)
  nonfinite_B = property(lambda self: self.counters.nonfinite_B)


@struct.dataclass
class Core(CountedView):
  """The carry every family shares: the canvas and the counters."""

  tokens_BxL: Array
  write_step_BxL: Array  # step at which a position last received its value (-1: never)
  write_conf_BxL: Array  # probability of the value when it was written
  counters: Counters

  @classmethod
  def start(cls, tokens_BxL: Array) -> "Core":
    batch, length = tokens_BxL.shape
    return cls(tokens_BxL=tokens_BxL,
               write_step_BxL=jnp.full((batch, length), -1, jnp.int32),
               write_conf_BxL=jnp.ones((batch, length), jnp.float32),
               counters=Counters.zeros(batch))

  def count(self, **increments) -> "Core":
    """The core with `increments` added to its counters (`Counters.add`)."""
    return self.replace(counters=self.counters.add(**increments))

  def commit(self, write_BxL: Array, values_BxL: Array, conf_BxL: Array,
             step: Array) -> "Core":
    """Writes `values` where `write`, recording the step and the confidence (the value's
    probability, NaN when the position's logits were not finite: counted)."""
    return self.replace(
        tokens_BxL=jnp.where(write_BxL, values_BxL, self.tokens_BxL),
        write_step_BxL=jnp.where(write_BxL, step, self.write_step_BxL),
        write_conf_BxL=jnp.where(write_BxL, conf_BxL, self.write_conf_BxL),
    ).count(nonfinite_B=(write_BxL & ~jnp.isfinite(conf_BxL)).sum(-1))

  def count_call(self, called: Array, contexts: int = 1) -> "Core":
    """One more sequential call (if `called`) of `contexts` sequences per row."""
    return self.count(nfe=called, contexts_B=called * contexts)

  def absorb(self, inner: "Core", where_BxL: Array, step_offset) -> "Core":
    """A composite family's sub-run folded in: `inner`'s canvas, its writes at `where_BxL`
    (their steps shifted by `step_offset`), and its counters added to these."""
    return self.replace(
        tokens_BxL=inner.tokens_BxL,
        write_step_BxL=jnp.where(where_BxL, inner.write_step_BxL + step_offset,
                                 self.write_step_BxL),
        write_conf_BxL=jnp.where(where_BxL, inner.write_conf_BxL, self.write_conf_BxL),
        counters=self.counters + inner.counters)


def mask_inside(mask_id: int, vocab_size: int | None) -> int | None:
  """The mask id when it lies inside the vocabulary (mask_id < V), else None (V = mask_id:
  the denoiser has no logit for it)."""
  return None if vocab_size is None or mask_id >= vocab_size else mask_id


@struct.dataclass
class Context:
  """Per-call constants: fixed for the whole trajectory.

  vocab_size is V, the logits per position: token ids are 0..V-1 and the mask id, which is
  V (outside the vocabulary) or an id inside it (a published checkpoint's own mask id).
  None: V = mask_id.
  """

  mask_id: int = struct.field(pytree_node=False)
  editable_BxL: Array  # positions a sampler may write (not fixed)
  keys_B: Array  # the row keys; step i uses fold_in(row key, i)
  shift_B: Array | None = None  # each row's first valid position (see StepInfo)
  vocab_size: int | None = struct.field(pytree_node=False, default=None)

  def masked(self, tokens_BxL: Array) -> Array:
    """Masked editable positions."""
    return (tokens_BxL == self.mask_id) & self.editable_BxL

  @property
  def vocab(self) -> int:
    """V: the logits per position."""
    return self.mask_id if self.vocab_size is None else self.vocab_size

  @property
  def mask_in_vocab(self) -> int | None:
    """The mask id when it is an id inside the vocabulary, else None."""
    return mask_inside(self.mask_id, self.vocab_size)


@struct.dataclass
class StepPlan:
  """The fields every per-step plan has; families add their own in a subclass."""

  t: Array  # the time the denoiser is told at this step


@struct.dataclass
class StepInfo:
  """What one step is given: its index, its per-row keys and its slice of the plan."""

  index: Array
  keys_B: Array  # fold_in(row key, index)
  plan: Any
  # Each row's first valid position (left padding; None without a validity mask): draws
  # indexed by position pass it on (`transforms.row_uniform`).
  shift_B: Array | None = None


@struct.dataclass
class BoundDenoiser:
  """A `Denoiser` bound to its parameters: `denoiser(tokens_NxL, t)` -> logits_NxLxV.

  Per-row inputs beside the canvas reach every call, passed by name only when given:
  `valid_BxL` (the caller's validity mask: False on padding) and `context` (any pytree of
  per-row arrays: `sample_blocks` passes each row's window canvas, or its cache). N = J x B
  contexts get them tiled context-major (J blocks of B rows), or repeated row-major when
  the caller says so, so they follow the rows of every context a family builds.

  mask_in_vocab: a mask id inside the vocabulary (`Context.mask_in_vocab`); every pass
  returns its logit as -inf, so no family ever draws, scores or proposes the mask, even
  from a denoiser that forgets to rule it out. None (the mask id is V): logits as given.
  A pytree (the parameters and per-row inputs are its leaves), so it crosses jit and vmap.
  """

  model: Denoiser = struct.field(pytree_node=False)
  params: Any
  valid_BxL: Array | None = None
  context: Any = None
  mask_in_vocab: int | None = struct.field(pytree_node=False, default=None)

  def _no_mask(self, logits_NxLxV: Array) -> Array:
    """The logits with the mask id's ruled out (-inf), where it lies inside the vocabulary."""
    if self.mask_in_vocab is None:
      return logits_NxLxV
    return logits_NxLxV.at[..., self.mask_in_vocab].set(-jnp.inf)

  @classmethod
  def of(cls, denoiser) -> "BoundDenoiser":
    """`denoiser` as bound: itself, or a denoiser (value or function) with no parameters
    (exact oracles, stubs)."""
    return denoiser if isinstance(denoiser, BoundDenoiser) else cls(Denoiser.of(denoiser), None)

  def rows_for(self, num: int, row_major: bool = False) -> dict[str, Any]:
    """The per-row inputs, by name, for N = J x B contexts (empty without any)."""
    given = {name: value for name, value in (("valid_BxL", self.valid_BxL),
                                             ("context", self.context)) if value is not None}
    if not given:
      return given
    # The rows' count from the validity mask: a cache's leaves may lead with its layers.
    batch = (self.valid_BxL if self.valid_BxL is not None
             else jax.tree.leaves(self.context)[0]).shape[0]
    repeats = num // batch
    if repeats == 1:
      return given

    def rows(x):
      if row_major:
        return jnp.repeat(x, repeats, axis=0)
      return jnp.tile(x, (repeats,) + (1,) * (x.ndim - 1))

    return jax.tree.map(rows, given)

  def __call__(self, tokens_NxL: Array, t, row_major: bool = False,
               condition: Array | None = None) -> Array:
    t_N = jnp.full((tokens_NxL.shape[0],), t, jnp.float32)
    rows = self.rows_for(tokens_NxL.shape[0], row_major)
    if condition is not None:  # self-conditioning: only a denoiser that makes one takes it
      self._check_conditions()
      rows = {**rows, "condition": condition}
    return self._no_mask(self.model.apply(self.params, tokens_NxL, t_N, **rows))

  def encode_condition(self, shaped_NxLxV: Array) -> Array:
    """The next call's self-conditioning input from a step's shaped logits
    (`Denoiser.encode_condition`); a ValueError for a denoiser without one."""
    self._check_conditions()
    return self.model.encode_condition(self.params, shaped_NxLxV)

  def _check_conditions(self):
    if self.model.encode_condition is None:
      raise ValueError("self-conditioning needs a denoiser that makes its input "
                       "(Denoiser.encode_condition); this one has none.")

  def prefill(self, tokens_BxL: Array, t_B: Array):
    """The model's full pass that returns its cache: (logits_BxLxV, cache)."""
    logits_BxLxV, cache = self.model.prefill(self.params, tokens_BxL, t_B,
                                             **self.rows_for(len(tokens_BxL)))
    return self._no_mask(logits_BxLxV), cache

  def decode(self, cache, tokens_BxW: Array, start, t_B: Array):
    """The model's pass over W positions from `start` against `cache`: (logits, cache)."""
    logits_BxWxV, cache = self.model.decode(self.params, cache, tokens_BxW, start, t_B,
                                            **self.rows_for(len(tokens_BxW)))
    return self._no_mask(logits_BxWxV), cache


# ----------------------------------------------------------------------------
# The protocol.
# ----------------------------------------------------------------------------


class Family:
  """What a sampler family provides. Subclass, set the class attributes, register."""

  name: ClassVar[str]  # for make_spec and command lines
  spec_type: ClassVar[type]
  composite: ClassVar[bool] = False  # runs its own rounds (`run`) instead of steps
  refills: ClassVar[bool] = True  # can fill any subset of positions (localized remasking)
  python_loop: ClassVar[bool] = True  # `sample_python_loop` can run it step by step
  rewrites: ClassVar[bool] = False  # visible tokens may change or return to the mask (never idle)
  # decodes semi-autoregressive blocks (`block_length`): a KV cache can serve its window
  decodes_blocks: ClassVar[bool] = False
  # A rewriting family whose rows may stop before the last step (`active_rows` says which
  # still run): the program may then jump over the steps after every row stopped.
  stops_early: ClassVar[bool] = False
  # The noise processes (`mdjax.noise` names) whose models it samples; None: any, read as
  # absorbing (every family before uniform noise). `mdjax.generate` checks `Model.noise`.
  noise_kinds: ClassVar[tuple[str, ...] | None] = None
  # Its canvas holds no mask during the run (uniform noise), so "every position before the
  # EOS is written" says nothing: the family ends rows at EOS itself, once its run is over.
  ends_rows_at_the_end: ClassVar[bool] = False

  def bench_spec(self, steps: int, length: int) -> SamplerSpec:
    """The spec `mdjax.bench` times: the family at its defaults with K = `steps` on a
    length-L canvas, all of it generated. A family whose knobs have no default overrides it."""
    return self.spec_type(steps=steps)

  def examples(self, generated: tuple[int, ...]) -> list:
    """Small specs covering the family's knobs, for a canvas that generates `generated`
    (the contract tests run every registered family on them)."""
    raise NotImplementedError

  def validate(self, spec, canvas: Canvas) -> None:
    """Checks the spec against the canvas on the host; raises ValueError."""

  def block_length(self, spec) -> int | None:
    """Semi-autoregressive block length (None: no blocks)."""
    return None

  def num_steps(self, spec, length: int) -> int:
    """The static number of steps (the scan length) on a length-L canvas."""
    return spec.steps

  def plan(self, spec, canvas: Canvas):
    """The per-step plan: a StepPlan pytree of numpy arrays with leading axis K."""
    raise NotImplementedError

  def start(self, spec, core: Core, ctx: Context) -> Core:
    """The core the first step reads: the canvas as given (a family over a noise process
    without a mask draws the process's prior at the generated positions)."""
    return core

  def init(self, spec, core: Core, ctx: Context):
    """The family's own carry beside the core (None when it has none)."""
    return None

  def active_rows(self, spec, core: Core, aux, ctx: Context) -> Array:
    """Per row: still sampling at this step (`rounds_B` counts these steps): by default a
    row with a masked editable position."""
    return ctx.masked(core.tokens_BxL).any(-1)

  def idle_steps(self, spec, canvas: Canvas, plan) -> float | None:
    """How many steps will have nothing to write in any row (host, before tracing):
    exact, or an expectation for random reveals; None when it cannot be told before the
    run (an adaptive family, or a canvas only known inside a trace)."""
    return None

  def reuses_logits(self, spec) -> bool:
    """Whether an unchanged canvas reuses the last logits (a t-free denoiser)."""
    return False

  def needs_call(self, spec, core: Core, aux, ctx: Context, plan) -> Array:
    """False when this step can write nothing in any row."""
    return jnp.any(ctx.masked(core.tokens_BxL))

  def condition(self, spec, aux) -> Array | None:
    """The self-conditioning input of this step's call, from the family's carry (None: the
    call takes none); a family that feeds its prediction back makes the next one with
    `denoise.encode_condition` (`stepping.StepDenoiser`)."""
    return None

  def update(self, spec, core: Core, aux, ctx: Context, step: StepInfo, logits_BxLxV: Array,
             denoise: Callable[[Array], Array]) -> tuple[Core, Any]:
    """One step. `denoise(tokens_NxL)` evaluates further contexts at the step's time
    (a `stepping.StepDenoiser`)."""
    raise NotImplementedError

  def extras(self, spec, aux) -> dict[str, Array]:
    """Family-specific outputs for `SampleResult.extras`."""
    return {}

  def run(self, spec, denoiser: BoundDenoiser, core: Core, ctx: Context, plan):
    """A composite family's whole program: (core, aux, trajectory or None)."""
    raise NotImplementedError


_BY_SPEC: dict[type, Family] = {}
_BY_NAME: dict[str, Family] = {}


def register(cls: type[Family]) -> type[Family]:
  """Class decorator: makes a family known to the driver, make_spec and the tests."""
  family = cls()
  _BY_SPEC[cls.spec_type] = family
  _BY_NAME[cls.name] = family
  return cls


def family_of(spec) -> Family:
  """The family of a spec; a ValueError for anything else."""
  family = _BY_SPEC.get(type(spec))
  if family is None:
    raise ValueError(f"spec={spec!r} must be a sampler spec from mdjax.sampling "
                     f"(one of {sorted(c.__name__ for c in _BY_SPEC)}).")
  return family


def families() -> dict[str, Family]:
  """Every registered family by name."""
  return dict(_BY_NAME)


def make_spec(family: str, length: int | None = None, **knobs) -> SamplerSpec:
  """A spec by family name, for configs and command lines.

  `left_to_right` (one position per step, needs `length`) is the ordered
  family's chain rule; knobs that are None are left at their defaults.
  """
  knobs = {k: v for k, v in knobs.items() if v is not None}
  if family == "left_to_right":
    check(length is not None, "length", length, "left_to_right needs the canvas length")
    knobs.pop("steps", None)
    return _BY_NAME["ordered"].spec_type.left_to_right(length, **knobs)
  check(family in _BY_NAME, "sampler", family,
        f"must be one of {sorted(_BY_NAME) + ['left_to_right']}")
  cls = _BY_NAME[family].spec_type
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(knobs) - fields)
  check(not unknown, "knobs", unknown, f"{family} takes {sorted(fields)}")
  missing = [f.name for f in dataclasses.fields(cls) if f.name not in knobs
             and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  check(not missing, missing[0] if missing else "knobs", None,
        f"the {family} sampler needs {', '.join(missing)} (no default)")
  return cls(**knobs)
