"""Sampler specs: frozen, hashable dataclasses, static under jit.

A spec names a sampler family and all its knobs. Everything a spec implies
(step count, time grid, per-step counts) is fixed before tracing; bad values
raise a `ValueError` naming the field, its value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

from mdjax import diffusion
from mdjax.sampling import transforms

Grid = Union[str, tuple[float, ...]]
GRIDS = ("uniform", "cosine")
SIGMAS = ("cap", "rescale", "conf")


def _check(condition: bool, field: str, value, allowed: str):
  if not condition:
    raise ValueError(f"{field}={value!r} is invalid: {allowed}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerSpec:
  """Knobs shared by every family: the value transform and recording.

  temperature: softmax(logits / T); T = 0 takes the argmax (no division).
  top_k: keep the k most likely values (None: all). top_p: nucleus mass.
  min_p: keep values with probability >= min_p times the row's largest (0: all).
  record_trajectory: also return the canvas after every step (K x B x L).
  skip_idle_steps: skip the denoiser (a lax.cond) at steps with nothing to write in
    any row; False calls it at every step, which is faster when steps are seldom idle
    (K <= L): the cond costs a few percent per step on CPU. Tokens are the same.
    Remasking never skips.
  """

  temperature: float = 1.0
  top_k: int | None = None
  top_p: float = 1.0
  min_p: float = 0.0
  record_trajectory: bool = False
  skip_idle_steps: bool = True

  def __post_init__(self):
    _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
    _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
           "top_k", self.top_k, "must be None or an integer >= 1")
    _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must lie in (0, 1]")
    _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must lie in [0, 1]")

  @property
  def transform(self) -> dict:
    return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p)


def _check_steps(steps):
  _check(isinstance(steps, (int, np.integer)) and steps >= 1, "steps", steps,
         "must be an integer >= 1")


def _check_block_length(block_length):
  if block_length is None:
    return
  _check(isinstance(block_length, (int, np.integer)) and block_length >= 1,
         "block_length", block_length, "must be None or an integer >= 1")


def time_grid(grid: Grid, steps: int) -> np.ndarray:
  """The decreasing grid 1 = t_0 > t_1 > ... > t_K = 0 as float64."""
  if isinstance(grid, str):
    _check(grid in GRIDS, "grid", grid, f"must be one of {GRIDS} or a tuple of times")
    i = np.arange(steps + 1) / steps
    times = 1.0 - i if grid == "uniform" else np.cos(0.5 * np.pi * i)
    times[0], times[-1] = 1.0, 0.0
    return times
  times = np.asarray(grid, np.float64)
  _check(times.ndim == 1 and len(times) == steps + 1, "grid", grid,
         f"must hold steps + 1 = {steps + 1} times")
  _check(times[0] == 1.0 and times[-1] == 0.0 and np.all(np.diff(times) < 0), "grid",
         grid, "must decrease strictly from 1 to 0")
  return times


@dataclasses.dataclass(frozen=True, kw_only=True)
class AncestralSpec(SamplerSpec):
  """The exact reverse kernel of MD4 / MDLM on a time grid.

  Each masked position is revealed with probability
  (alpha(s) - alpha(t)) / (1 - alpha(t)) and its value drawn from the
  denoiser's categorical at the current state. `cache` skips the denoiser
  when nothing changed since its last call (valid for denoisers that ignore
  t). `block_length` decodes semi-autoregressively, each block on its own
  grid with steps / num_blocks steps.
  """

  steps: int
  schedule: diffusion.Schedule = diffusion.LinearSchedule()
  grid: Grid = "uniform"
  cache: bool = False
  block_length: int | None = None

  def __post_init__(self):
    super().__post_init__()
    _check_steps(self.steps)
    _check_block_length(self.block_length)
    if not isinstance(self.grid, str):
      object.__setattr__(self, "grid", tuple(float(t) for t in self.grid))
    time_grid(self.grid, self.steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfidenceSpec(SamplerSpec):
  """Confidence-ordered decoding (MaskGIT / LLaDA).

  Each step proposes a value for every masked position, scores the proposals
  (`score` in transforms.SCORES, read from the untransformed softmax) and
  commits the k_i best; the rest stay masked. After step i of K a fraction
  1 - alpha(1 - (i+1)/K) of the row's (block's) masked positions remains, for
  `count_schedule` alpha (linear; cosine is MaskGIT's). Ties go to the lower
  position. `gumbel_temperature` > 0 ranks by log(score) + c_i * Gumbel with
  c_i annealed linearly to 0 (MaskGIT's choice temperature). `threshold`
  instead commits every proposal scoring at least it (always at least one,
  everything at the last step), with `steps` as the bound.
  """

  steps: int
  score: str = "max_prob"
  count_schedule: diffusion.Schedule = diffusion.LinearSchedule()
  gumbel_temperature: float = 0.0
  threshold: float | None = None
  block_length: int | None = None

  def __post_init__(self):
    super().__post_init__()
    _check_steps(self.steps)
    _check_block_length(self.block_length)
    _check(self.score in transforms.SCORES, "score", self.score,
           f"must be one of {transforms.SCORES}")
    _check(self.gumbel_temperature >= 0.0, "gumbel_temperature",
           self.gumbel_temperature, "must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemaskSpec(SamplerSpec):
  """ReMDM: committed tokens may return to the mask with probability sigma_t.

  Masked positions are revealed with probability
  (alpha(s) - (1 - sigma) alpha(t)) / (1 - alpha(t)), which keeps the
  marginal schedule. sigma schedules with sigma_max = min(1, (1-alpha_s)/alpha_t):
  `cap` min(eta, sigma_max); `rescale` eta * sigma_max; `conf` sigma_max
  spread over committed tokens by softmax(-confidence when written).
  With `loop_t_on` > `loop_t_off`, sigma is 0 outside [loop_t_off, loop_t_on]
  and alpha is held at alpha(loop_t_on) inside it (ReMDM-loop); below
  loop_t_off the schedule resumes, compressed onto [0, loop_t_off].
  eta = 0 reproduces AncestralSpec token for token.
  """

  steps: int
  schedule: diffusion.Schedule = diffusion.LinearSchedule()
  grid: Grid = "uniform"
  sigma: str = "cap"
  eta: float = 0.05
  loop_t_on: float | None = None
  loop_t_off: float | None = None

  def __post_init__(self):
    super().__post_init__()
    _check_steps(self.steps)
    _check(self.sigma in SIGMAS, "sigma", self.sigma, f"must be one of {SIGMAS}")
    _check(0.0 <= self.eta <= 1.0, "eta", self.eta, "must lie in [0, 1]")
    if not isinstance(self.grid, str):
      object.__setattr__(self, "grid", tuple(float(t) for t in self.grid))
    time_grid(self.grid, self.steps)
    if (self.loop_t_on is None) != (self.loop_t_off is None):
      raise ValueError(
          f"loop_t_on={self.loop_t_on!r} and loop_t_off={self.loop_t_off!r} must be "
          "given together.")
    if self.loop_t_on is not None:
      _check(0.0 < self.loop_t_off < self.loop_t_on < 1.0, "loop_t_on",
             (self.loop_t_on, self.loop_t_off), "need 0 < loop_t_off < loop_t_on < 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrderedSpec(SamplerSpec):
  """A fixed write order: `groups[i]` is the set of positions written at step i.

  Values within a group are drawn independently from the current
  conditionals. One position per group is the exact chain-rule sampler.
  The groups must cover every generated position exactly once.
  """

  groups: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    super().__post_init__()
    groups = tuple(tuple(int(p) for p in g) for g in self.groups)
    object.__setattr__(self, "groups", groups)
    _check(len(groups) >= 1, "steps", len(groups), "must be an integer >= 1 (one group a step)")
    flat = [p for g in groups for p in g]
    _check(all(len(g) >= 1 for g in groups), "groups", groups, "every group needs a position")
    _check(min(flat) >= 0, "groups", min(flat), "positions must be >= 0")
    repeated = sorted({p for p in flat if flat.count(p) > 1})
    _check(not repeated, "groups", repeated, "a position may appear in one group only")

  @classmethod
  def left_to_right(cls, length: int, **kwargs) -> "OrderedSpec":
    """One position per step, left to right: the autoregressive chain rule."""
    return cls(groups=tuple((i,) for i in range(length)), **kwargs)

  @property
  def steps(self) -> int:
    return len(self.groups)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldOrderSpec(SamplerSpec):
  """A write order over fields: step k writes `counts[k][f]` positions of field f.

  `fields[f]` lists the positions of field f (fields are disjoint). Within a step,
  field f's positions are its `counts[k][f]` highest-scoring masked positions
  (`score` from transforms.SCORES, read from the untransformed softmax; ties go to the
  lower position). The default `max_prob` reads only the canvas, never this step's
  draws, so a step that writes one position is an exact chain-rule step; values
  written in one step are drawn independently. Every field's counts sum to its size.
  `parse_write_order` builds one from notation such as "[VOA][v×9]o×10[ht1]", which
  `notation` keeps for display.
  """

  fields: tuple[tuple[int, ...], ...]
  counts: tuple[tuple[int, ...], ...]
  score: str = "max_prob"
  notation: str | None = None

  def __post_init__(self):
    super().__post_init__()
    fields = tuple(tuple(int(p) for p in f) for f in self.fields)
    counts = tuple(tuple(int(c) for c in row) for row in self.counts)
    object.__setattr__(self, "fields", fields)
    object.__setattr__(self, "counts", counts)
    _check(self.score in transforms.SCORES, "score", self.score,
           f"must be one of {transforms.SCORES}")
    _check(len(fields) >= 1 and all(len(f) >= 1 for f in fields), "fields", fields,
           "need at least one field, each with a position")
    flat = [p for f in fields for p in f]
    _check(min(flat) >= 0, "fields", min(flat), "positions must be >= 0")
    repeated = sorted({p for p in flat if flat.count(p) > 1})
    _check(not repeated, "fields", repeated, "a position may belong to one field only")
    _check(len(counts) >= 1, "counts", counts, "need at least one step")
    for k, row in enumerate(counts):
      _check(len(row) == len(fields) and min(row) >= 0 and sum(row) >= 1, f"counts[{k}]", row,
             f"must hold {len(fields)} counts >= 0 (one per field), at least one positive")
    totals = np.sum(counts, axis=0)
    for f, field in enumerate(fields):
      _check(totals[f] == len(field), f"counts (field {f})", int(totals[f]),
             f"must sum to the field's {len(field)} positions")

  @property
  def steps(self) -> int:
    return len(self.counts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomOrderSpec(SamplerSpec):
  """One position per step in a uniformly random order drawn per row.

  The exact chain-rule sampler (exact for an exact denoiser): it takes as
  many steps as the sequence is long, skipping the denoiser once a row set
  has nothing left to write.
  """


SPECULATIVE_ORDERS = ("max_prob", "lowest_index", "fixed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeSpec(SamplerSpec):
  """Exact parallel sampling by speculative verification (see sampling.speculative).

  Each round drafts up to `k` masked positions, verifies them with one batched call on
  k contexts and commits the accepted prefix plus, after a rejection, one residual
  draw: the output follows the chain-rule law of the transformed conditionals (exact
  with an exact denoiser at temperature 1; temperature, top-k and top-p apply to the
  drafts and the verifier alike, so the target is the transformed conditionals).
  `order` chooses the positions from what is known before the round: `max_prob`
  (most confident predictions first), `lowest_index` (left to right) or `fixed`
  (the order of `positions`). At most L rounds (one lax.scan); k = 1 is the chain rule.
  """

  k: int
  order: str = "max_prob"
  positions: tuple[int, ...] | None = None

  def __post_init__(self):
    super().__post_init__()
    _check(isinstance(self.k, (int, np.integer)) and self.k >= 1, "k", self.k,
           "must be an integer >= 1")
    _check(self.order in SPECULATIVE_ORDERS, "order", self.order,
           f"must be one of {SPECULATIVE_ORDERS}: a rule that reads only the canvas and the "
           "predictions made before the round (a score of this round's draws would bias it)")
    if self.order == "fixed":
      _check(self.positions is not None and len(self.positions) >= 1, "positions",
             self.positions, "order='fixed' needs the write order as a tuple of positions")
      positions = tuple(int(p) for p in self.positions)
      object.__setattr__(self, "positions", positions)
      _check(min(positions) >= 0 and len(set(positions)) == len(positions), "positions",
             positions, "must be distinct positions >= 0")
    else:
      _check(self.positions is None, "positions", self.positions,
             f"is only used with order='fixed' (order={self.order!r})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeferSpec(SamplerSpec):
  """Test-and-defer (PUNT-style): commit only proposals that the others do not move.

  Each step proposes a value for every masked position and ranks the proposals by
  `score`. The best is an anchor and always commits. The others are tested in dyadic
  groups: the proposals of rank r in [2^j, 2^(j+1)) are re-evaluated in context j, the
  canvas with the proposals of rank < 2^j written in, and a proposal whose distribution
  moved by more than `threshold` in total variation (plus 1e-6 of float rounding) is deferred (left masked). All J =
  ceil(log2 L) test contexts go in one batched call, so a step costs 2 calls and 1 + J
  contexts. Proposals commit up to and including the first group with a deferral
  (those of it that did not move); later groups wait, since their test context held a
  deferred value. The last of the `steps` steps commits everything left. Not exact in
  general: members of one group are not tested against each other.
  """

  steps: int
  threshold: float = 0.1
  score: str = "max_prob"

  def __post_init__(self):
    super().__post_init__()
    _check_steps(self.steps)
    _check(0.0 <= self.threshold <= 1.0, "threshold", self.threshold,
           "must lie in [0, 1] (a total variation distance)")
    _check(self.score in transforms.SCORES, "score", self.score,
           f"must be one of {transforms.SCORES}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RevisionSpec(SamplerSpec):
  """Direct revision (D3IM-style): every step rebuilds the editable canvas.

  Each step draws a value for every editable position, masked or not, keeps the
  n_i best by `score` (n_i of N editable positions after step i of K follows
  `count_schedule`, as ConfidenceSpec's counts) and masks the rest, so a visible
  token can change value, or return to the mask, without being remasked first.
  `SampleResult.changes_KxB` counts the visible tokens that changed value at each step.
  Predictions at visible positions come from the denoiser's output there when
  `score_groups` = 0 (meaningful for models trained to predict every position, e.g.
  with MLM random-token corruption; the exact oracles copy visible tokens), or, with
  `score_groups` = G > 0, from G leave-group-out contexts (positions i mod G = g
  masked) in one more batched call. `keep_visible` keeps every visible token as it is,
  and is then confidence decoding token for token.
  """

  steps: int
  score: str = "max_prob"
  count_schedule: diffusion.Schedule = diffusion.LinearSchedule()
  keep_visible: bool = False
  score_groups: int = 0

  def __post_init__(self):
    super().__post_init__()
    _check_steps(self.steps)
    _check(self.score in transforms.SCORES, "score", self.score,
           f"must be one of {transforms.SCORES}")
    _check(isinstance(self.score_groups, (int, np.integer)) and self.score_groups >= 0,
           "score_groups", self.score_groups, "must be an integer >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalRemaskSpec(SamplerSpec):
  """Localized remasking (PURE-style): fill the canvas, then repair it locally.

  `base` fills the canvas. Each of `rounds` rounds re-scores every committed token in
  its current context (the probability of its own value with its group of positions
  i mod `score_groups` masked: one batched call of `score_groups` contexts), picks the
  `seeds` positions whose probability dropped most since they were written, remasks a
  window of `window` positions either side of each seed and a random `context_fraction`
  of the editable positions before the windows, and refills them with `refill`. Fixed
  positions are never touched. The spec's own temperature / top-k / top-p / min-p are
  unused: `base` and `refill` carry theirs. Not exact: the refill resamples a subset
  given the rest, chosen by a score of the sample itself.
  """

  base: SamplerSpec
  refill: SamplerSpec
  rounds: int = 2
  seeds: int = 1
  window: int = 2
  context_fraction: float = 0.0
  score_groups: int = 4

  def __post_init__(self):
    super().__post_init__()
    allowed = (AncestralSpec, ConfidenceSpec, RemaskSpec, OrderedSpec, FieldOrderSpec,
               RandomOrderSpec, DeferSpec, RevisionSpec)
    _check(isinstance(self.base, allowed), "base", type(self.base).__name__,
           "must be one of " + ", ".join(c.__name__ for c in allowed))
    refills = (AncestralSpec, ConfidenceSpec, RemaskSpec, RandomOrderSpec, DeferSpec,
               RevisionSpec)
    _check(isinstance(self.refill, refills), "refill", type(self.refill).__name__,
           "must be one of " + ", ".join(c.__name__ for c in refills))
    _check(getattr(self.refill, "block_length", None) is None, "refill.block_length",
           getattr(self.refill, "block_length", None), "blocks need a known generation length")
    for name in ("rounds", "seeds", "score_groups"):
      value = getattr(self, name)
      _check(isinstance(value, (int, np.integer)) and value >= 1, name, value,
             "must be an integer >= 1")
    _check(isinstance(self.window, (int, np.integer)) and self.window >= 0, "window",
           self.window, "must be an integer >= 0")
    _check(0.0 <= self.context_fraction <= 1.0, "context_fraction", self.context_fraction,
           "must lie in [0, 1]")


FAMILIES = {
    "ancestral": AncestralSpec,
    "confidence": ConfidenceSpec,
    "remask": RemaskSpec,
    "random_order": RandomOrderSpec,
    "speculative": SpeculativeSpec,
    "defer": DeferSpec,
    "revision": RevisionSpec,
}


def make_spec(family: str, length: int | None = None, **knobs) -> SamplerSpec:
  """A spec by family name, for configs and command lines.

  `left_to_right` (one position per step, needs `length`) is the ordered
  family's chain rule; knobs that are None are left at their defaults.
  """
  knobs = {k: v for k, v in knobs.items() if v is not None}
  if family == "left_to_right":
    _check(length is not None, "length", length, "left_to_right needs the canvas length")
    knobs.pop("steps", None)
    return OrderedSpec.left_to_right(length, **knobs)
  _check(family in FAMILIES, "sampler", family,
         f"must be one of {sorted(FAMILIES) + ['left_to_right']}")
  cls = FAMILIES[family]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(knobs) - fields)
  _check(not unknown, "knobs", unknown, f"{family} takes {sorted(fields)}")
  return cls(**knobs)
