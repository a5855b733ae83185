"""The committed fixtures of a block diffusion family (tests/fixtures/<family>/, written by
tests/reference/<family>.py): the loaded model, the reference arrays, the recorded
generations, and the logit tolerance relative to the largest logit. Each loaded once."""

import functools
import json
import pathlib

import numpy as np

import mdjax
from tests.paths import REPO


def folder(family: str) -> pathlib.Path:
  return pathlib.Path(REPO) / "tests" / "fixtures" / family


@functools.cache
def model(family: str):
  return mdjax.load(folder(family))


@functools.cache
def reference(family: str) -> dict:
  with np.load(folder(family) / "reference.npz") as z:
    return dict(z)


def cases(family: str):
  return json.loads((folder(family) / "generations.json").read_text())


def tolerance(expected: np.ndarray, relative: float) -> float:
  """`relative` of the largest finite logit (at least `relative` itself)."""
  return relative * max(1.0, float(np.abs(expected[np.isfinite(expected)]).max()))
