"""`Lazy`: a tensor known by its shape and dtype whose values are computed when written (the
safetensors writer, `mdjax.io.tensors`, and a format's stored layout, `mdjax.formats`, both
make them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Lazy:
  """A tensor whose shape and dtype are known up front and whose bytes come from `fn()`.

  The writer builds the header from shapes and dtypes and then asks each tensor for its bytes
  in turn, so at most one tensor is on the host at a time.
  """

  shape: tuple[int, ...]
  dtype: Any
  fn: Callable[[], Any]

  def __array__(self, dtype=None, copy=None):
    x = np.asarray(self.fn())
    if x.shape != tuple(self.shape) or x.dtype != np.dtype(self.dtype):
      raise ValueError(f"a lazy tensor promised {tuple(self.shape)} {np.dtype(self.dtype)} "
                       f"and gave {x.shape} {x.dtype}")
    return x if dtype is None else x.astype(dtype)
