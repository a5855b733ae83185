"""The command lines' one error style: `NAME: error: MESSAGE` on one line, exit status 2 for
usage (a flag, a value or an input named wrong) and 1 for a runtime failure (a read, a write)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Callable, NoReturn

USAGE, RUNTIME = 2, 1


class Parser(argparse.ArgumentParser):
  """argparse whose usage errors are one line, `NAME: error: ...`, exit status 2."""

  def __init__(self, name: str, **kwargs):
    super().__init__(**kwargs)
    self.name = name

  def error(self, message: str) -> NoReturn:
    self.exit(USAGE, f"{self.name}: error: {message}\n")


def report(name: str, error, status: int) -> int:
  """Prints `NAME: error: ERROR` to stderr; returns `status` (a main's return value)."""
  print(f"{name}: error: {error}", file=sys.stderr)
  return status


def fail(name: str, error, status: int) -> NoReturn:
  sys.exit(report(name, error, status))


def run(name: str, main: Callable[[], object], usage=(ValueError,), runtime=(OSError,)):
  """main(), its `usage` exceptions reported with status 2 and `runtime` ones with 1."""
  try:
    return main()
  except usage as error:
    fail(name, error, USAGE)
  except runtime as error:
    fail(name, error, RUNTIME)


def writable_dir(path: str, flag: str = "--out") -> None:
  """A ValueError unless `path` is (or can be made) a writable folder: checked before any
  work, so a long run never fails at its last write."""
  try:
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
    os.close(fd)
    os.remove(probe)
  except OSError as error:
    raise ValueError(f"{flag}={path!r} is not a writable directory "
                     f"({error.strerror or error}).") from error
