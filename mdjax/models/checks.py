"""Checks shared by the architecture configs: a ValueError naming the field, its value and
the rule."""

from __future__ import annotations

import numpy as np

from mdjax.errors import ArgumentError


def is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
  return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def check_count(name: str, value, least: int = 1, why: str = "") -> None:
  """An `ArgumentError` naming `name` unless `value` is an integer (not a bool) >= `least`;
  `why` ends the message (" (the vocabulary size V)")."""
  if not (is_int(value) and value >= least):
    raise ArgumentError(name, f"{name}={value!r} must be an integer >= {least}{why}.")


def check_common(config, families: tuple[str, ...], dtypes: tuple[str, ...],
                 counts: tuple[str, ...], positive: tuple[str, ...]) -> None:
  """`family` and `dtype` among the allowed; the `counts` fields integers >= 1; the
  `positive` fields numbers > 0."""
  if config.family not in families:
    raise ValueError(f"family={config.family!r} must be one of {families}.")
  if config.dtype not in dtypes:
    raise ValueError(f"dtype={config.dtype!r} must be one of {dtypes}.")
  for name in counts:
    check_count(name, getattr(config, name))
  for name in positive:
    value = getattr(config, name)
    if not (is_number(value) and value > 0):
      raise ValueError(f"{name}={value!r} must be a number > 0.")
