"""The Task value: everything training, sampling and research code use of a task.

A task is built once (`mdjax.tasks.get(name, task_kwargs)` or `mdjax.tasks.from_config`)
and passed down. Capabilities a task lacks are None (`exact_denoiser`, `encode`, ...),
so callers test fields, never probe attributes.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Task:
  """A task as a value. Ids 0..vocab_size-1 are real tokens; the mask id is vocab_size.

  Required: the shape (`length`, `vocab_size`, `mask_id`), the data (`sample_data(key,
  batch) -> tokens_BxL`), `decode(tokens_L) -> str` and `sample_metrics(tokens_BxL) ->
  {name: float}`. Optional (None when the task has none): `validation_data` (held-out draws;
  defaults to `sample_data`), `checks(tokens_BxL) -> {name: bool_B}`, `exact_denoiser` (the
  denoiser contract, exact), `is_impossible(tokens_BxL) -> bool_B`, `encode(text) -> ids`,
  `tokenizer`, `eos_id` (text of documents: the end-of-sequence id), `support() ->
  mdjax.noise.Support` (the law enumerated, for exact denoisers under any noise process; an
  ArgumentError where it is too large to enumerate), `params` (the bound task parameters), `corpus` and `validation_windows(n)` (text). `metadata` is what a checkpoint keeps to rebuild the task with the same ids.
  `inputs_sha256`: a hash of what the task was built from (a prepared corpus's data; an SFT
  run's examples and published start point), which a resumed run matches in place of the
  paths that name them, so a workdir and its inputs may move.
  """

  name: str
  length: int
  vocab_size: int
  mask_id: int
  eos_id: int | None = None
  sample_data: Callable[[jax.Array, int], jax.Array]
  decode: Callable[[Any], str]
  sample_metrics: Callable[[Any], dict[str, float]]
  validation_data: Callable[[jax.Array, int], jax.Array] | None = None
  checks: Callable[[Any], dict] | None = None
  exact_denoiser: Callable | None = None
  support: Callable[[], Any] | None = None
  is_impossible: Callable[[Any], Any] | None = None
  encode: Callable[[str], Any] | None = None
  tokenizer: Any = None
  params: Any = None
  corpus: Any = None
  validation_windows: Callable[[int], Any] | None = None
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  description: str = ""
  inputs_sha256: str | None = None

  def __post_init__(self):
    if not (isinstance(self.length, int) and self.length >= 1):
      raise ValueError(f"length={self.length!r} must be a positive integer.")
    if self.mask_id != self.vocab_size:
      raise ValueError(f"mask_id={self.mask_id!r} must equal vocab_size={self.vocab_size!r} "
                       "(the mask id follows the real ids).")
    if self.eos_id is not None and not 0 <= self.eos_id < self.vocab_size:
      raise ValueError(f"eos_id={self.eos_id!r} must be a real id in [0, {self.vocab_size}).")
    if self.validation_data is None:
      object.__setattr__(self, "validation_data", self.sample_data)
    object.__setattr__(self, "metadata", types.MappingProxyType(dict(self.metadata)))

  def __repr__(self):
    return self.description or (
        f"Task({self.name}, length={self.length}, vocab_size={self.vocab_size})")

  def empty_canvas(self, batch: int) -> jax.Array:
    """An all-masked canvas of `batch` rows (tokens_BxL)."""
    return jnp.full((batch, self.length), self.mask_id, jnp.int32)

  def checkpoint_metadata(self) -> dict:
    """What a checkpoint saves of this task besides the config ({} for synthetic tasks)."""
    return dict(self.metadata)
