"""`ArgumentError`: the one error type for a bad argument, raised where the argument enters.

It is a `ValueError` (callers that catch ValueError keep working) that names the argument:
`param` is the name a caller gave it by (`steps`, `max_new_tokens`, `spec.block_length`), so a
command line turns it into `--steps` and the server into OpenAI's `"param": "steps"` without
reading the message.
"""

from __future__ import annotations


class ArgumentError(ValueError):
  """A bad argument: `param` names it, the message says its value and what is allowed."""

  def __init__(self, param: str | None, message: str):
    super().__init__(message)
    self.param = param

  @classmethod
  def invalid(cls, param: str, value, allowed: str) -> "ArgumentError":
    """`{param}={value!r} is invalid: {allowed}.`"""
    return cls(param, f"{param}={value!r} is invalid: {allowed}.")


def check(condition: bool, param: str, value, allowed: str) -> None:
  """Raises `ArgumentError.invalid(param, value, allowed)` unless `condition`."""
  if not condition:
    raise ArgumentError.invalid(param, value, allowed)
