"""Write orders over fields: step k writes counts[k][f] positions of field f.

Write orders written as fields: "[VOA][v×9]o×10[ht1]".

Grammar (whitespace is ignored):

  order := (group | item)+        group := "[" item+ "]"
  item  := FIELD count?           count := ("×" | "*") DIGITS | DIGITS

A FIELD is one character naming a set of positions (the caller's `fields`). `x×n`
means n positions of field x, and the short form `xn` is accepted for fields of more
than one position (after a one-position field a digit is read as the next field's
name, so the ScanAndAdd answer `ht1` is hundreds, tens, ones). A group is one step
that writes all its items together; an item outside brackets is written one position
per step, n steps for `x×n`. Which positions of a field a step writes is decided by
confidence at that step (`FieldOrderSpec`): the field's most confident masked ones.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import scores
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, internal, knob,
                                 register)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldOrderSpec(SamplerSpec):
  """A write order over fields: step k writes `counts[k][f]` positions of field f.

  `fields[f]` lists the positions of field f (fields are disjoint). Within a step,
  field f's positions are its `counts[k][f]` highest-scoring masked positions (ties go
  to the lower position); values written in one step are drawn independently. Every
  field's counts sum to its size. `parse_write_order` builds one from notation such as
  "[VOA][v×9]o×10[ht1]".
  """

  fields: tuple[tuple[int, ...], ...]
  counts: tuple[tuple[int, ...], ...]
  score: str = knob("max_prob", help="The score that picks a field's positions "
                    "(scores.SCORES), read from the untransformed softmax. The default "
                    "max_prob reads only the canvas, never this step's draws, so a step that "
                    "writes one position is an exact chain-rule step.", choices=scores.SCORES)
  notation: str | None = internal(None, help="The write order notation it was parsed from, "
                                  "kept for display.")

  def __post_init__(self):
    super().__post_init__()
    fields = tuple(tuple(int(p) for p in f) for f in self.fields)
    counts = tuple(tuple(int(c) for c in row) for row in self.counts)
    object.__setattr__(self, "fields", fields)
    object.__setattr__(self, "counts", counts)
    check(self.score in scores.SCORES, "score", self.score, f"must be one of {scores.SCORES}")
    check(len(fields) >= 1 and all(len(f) >= 1 for f in fields), "fields", fields,
          "need at least one field, each with a position")
    flat = [p for f in fields for p in f]
    check(min(flat) >= 0, "fields", min(flat), "positions must be >= 0")
    repeated = sorted({p for p in flat if flat.count(p) > 1})
    check(not repeated, "fields", repeated, "a position may belong to one field only")
    check(len(counts) >= 1, "counts", counts, "need at least one step")
    for k, row in enumerate(counts):
      check(len(row) == len(fields) and min(row) >= 0 and sum(row) >= 1, f"counts[{k}]", row,
            f"must hold {len(fields)} counts >= 0 (one per field), at least one positive")
    totals = np.sum(counts, axis=0)
    for f, field in enumerate(fields):
      check(totals[f] == len(field), f"counts (field {f})", int(totals[f]),
            f"must sum to the field's {len(field)} positions")

  @property
  def steps(self) -> int:
    return len(self.counts)


@struct.dataclass
class FieldOrderPlan(StepPlan):
  counts_F: Array  # positions of each field written at this step


@register
class FieldOrder(Family):
  name = "field_order"
  spec_type = FieldOrderSpec
  refills = False  # its fields are fixed in advance

  def bench_spec(self, steps, length):
    # Two fields, the halves; L writes spread evenly over K steps, the first half's first.
    half = length // 2
    written_K1 = (np.arange(steps + 1) * length) // steps
    first_K = np.diff(np.minimum(written_K1, half))
    counts_Kx2 = np.stack([first_K, np.diff(written_K1) - first_K], -1)
    return FieldOrderSpec(fields=(tuple(range(half)), tuple(range(half, length))),
                          counts=tuple(tuple(int(c) for c in row) for row in counts_Kx2))

  def examples(self, generated):
    half = len(generated) // 2
    first, second = tuple(generated[:half]), tuple(generated[half:])
    return [FieldOrderSpec(fields=(first, second),
                           counts=((1, 0), (half - 1, 0), (0, len(second))), score="margin")]

  def validate(self, spec: FieldOrderSpec, canvas):
    canvas.check_covers("fields", spec.fields)

  def plan(self, spec: FieldOrderSpec, canvas) -> FieldOrderPlan:
    return FieldOrderPlan(t=1.0 - np.arange(spec.steps) / spec.steps,
                          counts_F=np.asarray(spec.counts, np.int32))

  def update(self, spec: FieldOrderSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    """Each field's scheduled count of its most confident masked positions."""
    values_BxL, _, conf_BxL, score_BxL = scores.propose(spec, step, logits_BxLxV)
    cand_BxL = ctx.masked(core.tokens_BxL)
    batch, length = cand_BxL.shape
    write_BxL = jnp.zeros((batch, length), bool)
    for f, positions in enumerate(spec.fields):  # static: a handful of fields
      in_field_L = np.zeros(length, bool)
      in_field_L[list(positions)] = True
      k_B = jnp.broadcast_to(step.plan.counts_F[f], (batch,))
      write_BxL |= scores.select_top_k(score_BxL, cand_BxL & in_field_L, k_B)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), None


# ----------------------------------------------------------------------------
# The notation: "[VOA][v×9]o×10[ht1]" -> a FieldOrderSpec.
# ----------------------------------------------------------------------------

TIMES = ("×", "*")


class _Reader:
  """The notation with a cursor; errors point at the offending character."""

  def __init__(self, notation: str, fields: Mapping[str, Sequence[int]]):
    self.text, self.fields, self.i = notation, fields, 0

  def error(self, what: str, at: int | None = None) -> ValueError:
    at = self.i if at is None else at
    names = " ".join(self.fields)
    return ValueError(f"order={self.text!r}: {what} at character {at} (fields: {names}; "
                      f"see mdjax.sampling.families.field_order)\n  {self.text}\n  {' ' * at}^")

  def peek(self) -> str | None:
    while self.i < len(self.text) and self.text[self.i].isspace():
      self.i += 1
    return self.text[self.i] if self.i < len(self.text) else None

  def digits(self) -> str:
    start = self.i
    while self.i < len(self.text) and self.text[self.i].isdigit():
      self.i += 1
    return self.text[start:self.i]

  def item(self) -> tuple[str, int, int]:
    """(field, count, offset of the field character)."""
    name = self.peek()
    at = self.i
    if name not in self.fields:
      raise self.error(f"expected a field name, found {name!r}" if name else
                       "expected a field name, found the end", at)
    self.i += 1
    count = 1
    nxt = self.peek()
    if nxt in TIMES:
      self.i += 1
      self.peek()
      number = self.digits()
      if not number:
        raise self.error(f"expected a count after {nxt!r}")
      count = int(number)
    elif nxt is not None and nxt.isdigit() and len(self.fields[name]) > 1:
      count = int(self.digits())
    if count < 1:
      raise self.error(f"count {count} of field {name!r} must be >= 1", at)
    return name, count, at


def parse_write_order(notation: str, fields: Mapping[str, Sequence[int]],
                      **spec_kwargs) -> FieldOrderSpec:
  """A `FieldOrderSpec` from notation; bad notation is a ValueError with a caret.

  Args:
    notation: e.g. "[VOA][v×9]o×10[ht1]".
    fields: one-character field names -> their positions.
    **spec_kwargs: the spec's other knobs (temperature, top_k, top_p, score, ...).
  """
  if not isinstance(notation, str) or not notation.strip():
    raise ValueError(f"order={notation!r} must be a non-empty string.")
  bad = [name for name in fields if len(name) != 1 or name in "[]" + "".join(TIMES)
         or name.isspace()]
  if bad:
    raise ValueError(f"fields={list(fields)!r}: names must be single characters other "
                     f"than brackets, spaces and {TIMES}; bad: {bad}.")
  names = list(fields)
  reader = _Reader(notation, fields)
  used = dict.fromkeys(names, 0)
  counts: list[tuple[int, ...]] = []

  def add(name: str, count: int, at: int) -> None:
    used[name] += count
    if used[name] > len(fields[name]):
      raise reader.error(f"field {name!r} has {len(fields[name])} position(s); this writes "
                         f"{used[name]}", at)

  def step(per_field: dict[str, int]) -> tuple[int, ...]:
    return tuple(per_field.get(name, 0) for name in names)

  while reader.peek() is not None:
    if reader.peek() == "[":
      start = reader.i
      reader.i += 1
      group: dict[str, int] = {}
      while reader.peek() != "]":
        if reader.peek() is None:
          raise reader.error("this bracket is never closed", start)
        if reader.peek() == "[":
          raise reader.error("brackets do not nest")
        name, count, at = reader.item()
        add(name, count, at)
        group[name] = group.get(name, 0) + count
      if not group:
        raise reader.error("an empty group writes nothing", start)
      reader.i += 1
      counts.append(step(group))
    elif reader.peek() == "]":
      raise reader.error("a closing bracket without an opening one")
    else:
      name, count, at = reader.item()
      add(name, count, at)
      counts.extend(step({name: 1}) for _ in range(count))
  missing = {name: len(fields[name]) - used[name] for name in names
             if used[name] < len(fields[name])}
  if missing:
    raise reader.error(f"the order leaves positions unwritten: {missing} (field: count)",
                       len(notation))
  return FieldOrderSpec(fields=tuple(tuple(fields[name]) for name in names),
                        counts=tuple(counts), notation=notation, **spec_kwargs)
