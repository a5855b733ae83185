"""Learn2PD's commit filter as a value: a two-layer MLP from a block's W proposal
probabilities to W "commit now" logits (`sampling.families.learned_commit` reads it).

    logits_BxW = relu(conf_BxW @ w1_WxH + b1_H) @ w2_HxW + b2_W

The weights are tuples of float32-exact Python floats, so the filter is a frozen, hashable
value that sits in a sampler spec (static under jit: its ~2K numbers are constants of the
compiled program, never a traced input). Its size is bounded (`MAX_PARAMS`) because a spec
is hashed at every call and its constants are compiled in. On disk it is one small JSON
file, written atomically (`save_filter`) and read back with every field checked
(`load_filter`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import files
from mdjax.errors import ArgumentError

Array = jax.Array

FORMAT = "mdjax.commit_filter"
VERSION = 1
# Learn2PD's filter has 2,112 (W = H = 32); 64K keeps a spec cheap to hash and compile.
MAX_PARAMS = 1 << 16
# A file of MAX_PARAMS floats in JSON with its info stays well below this.
MAX_FILE_BYTES = 4 << 20
_ARRAYS = ("w1", "b1", "w2", "b2")


def _floats(values) -> tuple[float, ...]:
  """`values` as a tuple of float32-exact Python floats (what survives a JSON round trip)."""
  return tuple(float(v) for v in np.asarray(values, np.float32).reshape(-1))


@dataclasses.dataclass(frozen=True, repr=False)
class CommitFilter:
  """The filter's shape (W inputs and outputs, H hidden units) and its weights, row-major:
  w1 is W x H, w2 is H x W."""

  width: int
  hidden: int
  w1: tuple[float, ...]
  b1: tuple[float, ...]
  w2: tuple[float, ...]
  b2: tuple[float, ...]

  def __post_init__(self):
    for name in ("width", "hidden"):
      value = getattr(self, name)
      if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
        raise ArgumentError.invalid(f"filter.{name}", value, "it must be an integer >= 1")
      object.__setattr__(self, name, int(value))
    count = self.param_count(self.width, self.hidden)
    if count > MAX_PARAMS:
      raise ArgumentError("filter", f"a commit filter of width {self.width} and {self.hidden} "
                          f"hidden units has {count:,} parameters; at most {MAX_PARAMS:,} are "
                          "taken (its weights are constants of the compiled program).")
    shapes = {"w1": self.width * self.hidden, "b1": self.hidden,
              "w2": self.hidden * self.width, "b2": self.width}
    for name, size in shapes.items():
      value = getattr(self, name)
      if not isinstance(value, tuple):
        value = _floats(value) if isinstance(value, (list, np.ndarray)) else value
      if not (isinstance(value, tuple) and len(value) == size
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        got = len(value) if isinstance(value, (tuple, list)) else type(value).__name__
        raise ArgumentError("filter", f"filter.{name} must be {size} numbers (width "
                            f"{self.width}, hidden {self.hidden}); got {got}.")
      value = _floats(value)
      if not all(math.isfinite(v) for v in value):
        raise ArgumentError("filter", f"filter.{name} holds a number that is not finite.")
      object.__setattr__(self, name, value)

  @staticmethod
  def param_count(width: int, hidden: int) -> int:
    return 2 * width * hidden + hidden + width

  @property
  def num_params(self) -> int:
    return self.param_count(self.width, self.hidden)

  @classmethod
  def from_arrays(cls, w1_WxH, b1_H, w2_HxW, b2_W) -> "CommitFilter":
    w1 = np.asarray(w1_WxH)
    if w1.ndim != 2:
      raise ArgumentError("filter", f"w1 must be W x H; got shape {w1.shape}.")
    return cls(width=w1.shape[0], hidden=w1.shape[1], w1=_floats(w1), b1=_floats(b1_H),
               w2=_floats(w2_HxW), b2=_floats(b2_W))

  def arrays(self) -> dict[str, np.ndarray]:
    """The weights as float32 arrays: w1 (W x H), b1 (H), w2 (H x W), b2 (W)."""
    w, h = self.width, self.hidden
    return {"w1": np.asarray(self.w1, np.float32).reshape(w, h),
            "b1": np.asarray(self.b1, np.float32),
            "w2": np.asarray(self.w2, np.float32).reshape(h, w),
            "b2": np.asarray(self.b2, np.float32)}

  def logits(self, conf_BxW: Array) -> Array:
    """The commit logits of each of a block's W positions from their proposals' probabilities."""
    return apply_arrays({k: jnp.asarray(v) for k, v in self.arrays().items()}, conf_BxW)

  @property
  def digest(self) -> str:
    """sha256 of the shape and float32 weights (first 12 hex digits): names the filter."""
    h = hashlib.sha256(f"{self.width}x{self.hidden}".encode())
    for array in self.arrays().values():
      h.update(array.tobytes())
    return h.hexdigest()[:12]

  def __repr__(self):
    return (f"CommitFilter(width={self.width}, hidden={self.hidden}, params={self.num_params}, "
            f"sha256={self.digest})")

  def to_json(self, info: dict | None = None) -> dict[str, Any]:
    """The file's object: format, version, shape, the four weight lists and `info`."""
    out = {"format": FORMAT, "version": VERSION, "width": self.width, "hidden": self.hidden}
    out.update({name: list(getattr(self, name)) for name in _ARRAYS})
    out["info"] = dict(info or {})
    return out

  @classmethod
  def from_json(cls, raw: Any, where: str) -> "CommitFilter":
    """A filter from a file's object; an ArgumentError naming `where` for anything else."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
      raise ArgumentError("filter_file", f"{where}: not a commit filter (its \"format\" must be "
                          f"{FORMAT!r}).")
    if raw.get("version") != VERSION:
      raise ArgumentError("filter_file", f"{where}: commit filter version "
                          f"{raw.get('version')!r}; this mdjax reads version {VERSION}.")
    missing = [k for k in ("width", "hidden", *_ARRAYS) if k not in raw]
    if missing:
      raise ArgumentError("filter_file", f"{where}: the filter lacks {', '.join(missing)}.")
    for name in _ARRAYS:
      if not isinstance(raw[name], list):
        raise ArgumentError("filter_file", f"{where}: {name} must be a list of numbers.")
    try:
      return cls(width=raw["width"], hidden=raw["hidden"],
                 **{name: tuple(raw[name]) for name in _ARRAYS})
    except ArgumentError as error:
      raise ArgumentError("filter_file", f"{where}: {error}") from None


def apply_arrays(weights: dict[str, Array], conf_BxW: Array) -> Array:
  """The filter's forward pass on weights given as arrays (training differentiates this)."""
  hidden_BxH = jax.nn.relu(conf_BxW @ weights["w1"] + weights["b1"])
  return hidden_BxH @ weights["w2"] + weights["b2"]


def save_filter(filt: CommitFilter, path: str, info: dict | None = None) -> str:
  """Writes the filter (and `info`: how it was trained) to `path` atomically; returns path."""
  with files.atomic_write(path, "w") as f:
    json.dump(filt.to_json(info), f, allow_nan=False)
    f.write("\n")
  return path


def _read(path: str) -> Any:
  """A filter file's JSON value; an ArgumentError naming `filter_file` when it is missing, too
  large or not JSON."""
  try:
    with files.open_regular(path) as f:
      data = f.read(MAX_FILE_BYTES + 1)
  except ValueError as error:
    raise ArgumentError("filter_file", str(error)) from None
  if len(data) > MAX_FILE_BYTES:
    raise ArgumentError("filter_file", f"{path}: larger than {MAX_FILE_BYTES:,} bytes; a commit "
                        f"filter of at most {MAX_PARAMS:,} parameters is smaller.")
  try:
    return json.loads(data.decode("utf-8"))
  except (ValueError, RecursionError) as error:
    raise ArgumentError("filter_file", f"{path}: not a JSON commit filter ({error})") from None


def load_filter(path: str) -> CommitFilter:
  """The filter a file written by `save_filter` holds; an ArgumentError (a ValueError) naming
  `filter_file` when the file is missing, too large, not JSON or not a valid filter."""
  return CommitFilter.from_json(_read(path), path)


def read_info(path: str) -> dict:
  """The `info` a filter file records (how it was trained), after checking the filter."""
  raw = _read(path)
  CommitFilter.from_json(raw, path)
  return dict(raw.get("info") or {})
