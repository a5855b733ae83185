"""Write orders written as fields: "[VOA][v×9]o×10[ht1]".

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

from typing import Mapping, Sequence

from mdjax.sampling.field_order import FieldOrderSpec

TIMES = ("×", "*")


class _Reader:
  """The notation with a cursor; errors point at the offending character."""

  def __init__(self, notation: str, fields: Mapping[str, Sequence[int]]):
    self.text, self.fields, self.i = notation, fields, 0

  def error(self, what: str, at: int | None = None) -> ValueError:
    at = self.i if at is None else at
    names = " ".join(self.fields)
    return ValueError(f"order={self.text!r}: {what} at character {at} (fields: {names}; "
                      f"see mdjax.sampling.orders)\n  {self.text}\n  {' ' * at}^")

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
