"""Sampler knobs, declared once: on the spec dataclasses' fields.

A spec field declared with `knob(default, help=..., choices=..., minimum=...)` carries its
help and allowed values in its metadata; its name, type and default are the field's own. A
`Knob` record is read from there, and everything that lists knobs is generated from the
records: sample.py's flags, the server's request fields and CLI defaults, each family's knob
list. `Knob.parse` checks a value given from outside (a flag, a JSON field) by its type and
range; the spec's own `__post_init__` checks the rest where the spec is built.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from mdjax import diffusion
from mdjax.errors import ArgumentError
# knob() lives with SamplerSpec (whose fields use it) and is handed on here.
from mdjax.sampling.base import SamplerSpec, families, knob  # noqa: F401

# The value types a knob may have: what a flag or a JSON field can say. Other fields of a spec
# (tuples of positions, a nested spec) are set in Python or by their own notation flags.
KINDS = (bool, int, float, str)
# Fields typed by a value class that is given by name (a schedule "cosine", a grid "cosine").
NAMED = {"diffusion.Schedule": str, "reveal.Grid": str, "Schedule": str, "Grid": str}


@dataclasses.dataclass(frozen=True)
class Knob:
  """One knob: its name, value type, default, help and allowed values."""

  name: str
  kind: type  # bool, int, float or str
  default: Any  # dataclasses.MISSING: required
  optional: bool = False  # None is a value (the default decides)
  help: str = ""
  choices: tuple | None = None
  minimum: float | None = None
  maximum: float | None = None

  @property
  def required(self) -> bool:
    return self.default is dataclasses.MISSING

  def union(self, other: "Knob") -> "Knob":
    """One record for a name two samplers take: every value either takes (the choices
    joined, the wider range, None where either allows it), this one's help and default. A
    name of two types is a bug, raised here."""
    if other.kind is not self.kind:
      raise TypeError(f"knob {self.name!r} is a {self.kind.__name__} in one sampler and a "
                      f"{other.kind.__name__} in another: one name, one type.")
    wider = lambda pick, a, b: None if a is None or b is None else pick(a, b)
    choices = wider(lambda a, b: a + tuple(c for c in b if c not in a), self.choices,
                    other.choices)
    return dataclasses.replace(self, optional=self.optional or other.optional, choices=choices,
                               minimum=wider(min, self.minimum, other.minimum),
                               maximum=wider(max, self.maximum, other.maximum))

  def allowed(self) -> str:
    """What values it takes, in words."""
    kind = {bool: "true or false", int: "an integer", float: "a finite number",
            str: "a string"}[self.kind]
    if self.choices is not None:
      kind = "one of " + ", ".join(map(str, self.choices))
    elif self.minimum is not None and self.maximum is not None:
      kind += f" in [{self.minimum}, {self.maximum}]"
    elif self.minimum is not None:
      kind += f" >= {self.minimum}"
    elif self.maximum is not None:
      kind += f" <= {self.maximum}"
    return kind + (" or null" if self.optional else "")

  def parse(self, value):
    """`value` (from a flag or JSON) as the knob's type, checked against its type and range;
    an `ArgumentError` naming the knob otherwise."""
    if value is None and self.optional:
      return None
    if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if self.kind is int and isinstance(value, float) and value.is_integer():
      value = int(value)
    ok = isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
    if ok and self.kind is float:
      ok = math.isfinite(value)
    if ok and self.choices is not None:
      ok = value in self.choices
    if ok and self.minimum is not None:
      ok = value >= self.minimum
    if ok and self.maximum is not None:
      ok = value <= self.maximum
    if not ok:
      raise ArgumentError.invalid(self.name, value, f"it must be {self.allowed()}")
    return value


def _kind(annotation: str) -> tuple[type | None, bool]:
  """(value type, whether None is allowed) of a field's annotation string; None for a field
  that is not a knob."""
  parts = [part.strip() for part in annotation.split("|")]
  optional = "None" in parts
  parts = [part for part in parts if part != "None"]
  if len(parts) != 1:
    return None, optional
  name = NAMED.get(parts[0], parts[0])
  if isinstance(name, type):
    return name, optional
  kind = {kind.__name__: kind for kind in KINDS}.get(name)
  return kind, optional


def _annotation(field: dataclasses.Field) -> str:
  kind = field.type
  if isinstance(kind, str):
    return kind
  if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
    return " | ".join("None" if arg is type(None) else arg.__name__
                      for arg in typing.get_args(kind))
  return getattr(kind, "__name__", str(kind))


def spec_knobs(spec_type: type[SamplerSpec]) -> dict[str, Knob]:
  """The knobs of one spec class, by name, in field order."""
  out = {}
  for field in dataclasses.fields(spec_type):
    kind, optional = _kind(_annotation(field))
    if kind is None or not field.init or field.metadata.get("internal"):
      continue
    meta = field.metadata
    default = field.default
    if isinstance(default, diffusion.Schedule):  # given by name: the default's name
      default = next((name for name, schedule in diffusion.SCHEDULES.items()
                      if schedule() == default), str(default))
    out[field.name] = Knob(name=field.name, kind=kind, default=default, optional=optional,
                           help=meta.get("help", ""), choices=meta.get("choices"),
                           minimum=meta.get("minimum"), maximum=meta.get("maximum"))
  return out


def family_knobs(family: str) -> dict[str, Knob]:
  """The knobs of a registered family's spec."""
  return spec_knobs(families()[family].spec_type)


def all_knobs() -> dict[str, Knob]:
  """Every registered family's knobs, one record a name: its type is the same in every
  family that has it; its help, allowed values and default are those of the shared spec
  (`SamplerSpec`) or, for a family's own knob, of the first family (by name) declaring it.
  A name whose type differs between families is a bug, raised here."""
  out = dict(spec_knobs(SamplerSpec))
  for name in sorted(families()):
    for knob_ in family_knobs(name).values():
      seen = out.get(knob_.name)
      if seen is None:
        out[knob_.name] = knob_
      elif seen.kind is not knob_.kind:
        raise TypeError(f"knob {knob_.name!r} is a {knob_.kind.__name__} in family {name!r} "
                        f"but a {seen.kind.__name__} elsewhere: one name, one type.")
  return out
