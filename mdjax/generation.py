"""Language-model generation: prompts of different lengths in one batch, end of sequence, a mesh.

A batch of prompts is left-padded to its longest prompt and followed by the same generation
span in every row; `valid_BxL` marks the padding, which the denoiser neither reads nor counts
in positions (`models.Transformer`), so each row gives the tokens it gives sampled alone
(tests/test_generation.py). With the task's EOS id in the spec (`eos_id`) rows end early and
`SampleResult.generated_length_B` counts each row's tokens before its EOS.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import sampling


def read_prompts(path: str) -> list[str]:
  """The prompts of a JSONL file, one `{"prompt": TEXT}` a line; a ValueError names the line."""
  prompts = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as error:
        raise ValueError(f"prompts={path!r} line {number} is not JSON ({error.msg}).") from None
      if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"prompts={path!r} line {number} has no \"prompt\" string: "
                         f"{line.strip()[:80]!r}; each line must be {{\"prompt\": TEXT}}.")
      prompts.append(row["prompt"])
  if not prompts:
    raise ValueError(f"prompts={path!r} holds no prompt; give one {{\"prompt\": TEXT}} a line.")
  return prompts


def encode_prompts(task, prompts: Sequence[str], where: str = "prompt") -> list[np.ndarray]:
  """Each prompt's ids; a prompt the tokenizer cannot encode, or one that leaves no position
  of the canvas to generate, is a ValueError naming its line (1-based)."""
  encoded = []
  for number, text in enumerate(prompts, 1):
    try:
      ids = np.asarray(task.encode(text), np.int32)
    except ValueError as error:
      raise ValueError(f"{where} line {number}: {error}") from None
    if len(ids) >= task.length:
      raise ValueError(f"{where} line {number} encodes to {len(ids)} tokens; the canvas holds "
                       f"{task.length}, so a prompt may have at most {task.length - 1}.")
    encoded.append(ids)
  return encoded


def left_padded(prompts_ids: Sequence[np.ndarray], length: int, mask_id: int,
                pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
  """(tokens_BxL, valid_BxL, start): prompts right-aligned at `start` (the longest prompt's
  length), padding (`pad_id`, not valid) before them, masks from `start` to the end."""
  start = max(len(p) for p in prompts_ids)
  tokens = np.full((len(prompts_ids), length), mask_id, np.int32)
  valid = np.ones((len(prompts_ids), length), bool)
  for row, ids in enumerate(prompts_ids):
    pad = start - len(ids)
    tokens[row, :pad], valid[row, :pad] = pad_id, False
    tokens[row, pad:start] = ids
  return tokens, valid, start


def completion_ids(row_L: np.ndarray, start: int, generated_length: int) -> np.ndarray:
  """The generated ids of a row: from `start`, its generated length (EOS excluded)."""
  return np.asarray(row_L)[start:start + int(generated_length)]


def with_eos(spec, eos_id: int | None, **knobs):
  """`spec` with the end-of-sequence id and knobs (eos_penalty, eos_never, eos_rank_last)."""
  import dataclasses
  if eos_id is None:
    return spec
  return dataclasses.replace(spec, eos_id=int(eos_id), **knobs)


# ----------------------------------------------------------------------------
# A mesh.
# ----------------------------------------------------------------------------


def shard_params(mesh: Mesh, params, fsdp: bool = True):
  """Parameters on the mesh: each split on its first axis divisible by the `data` axis (FSDP,
  the layout training uses with train.fsdp=True), or replicated."""
  from mdjax import train
  return jax.device_put(params, train.param_sharding(mesh, params, fsdp))


_GATHERED: dict[tuple, Any] = {}


def gathered(apply_fn, mesh: Mesh):
  """`apply_fn` (and its cached contract) computing with its parameters all-gathered.

  Stored sharded (FSDP), the weights are gathered where they are used, so every device
  runs one device's arithmetic and the tokens are one device's, bit for bit. Left to
  partition the matmuls over sharded weights instead, XLA sums in another order: logits
  move by ~1e-5 and near-ties in a sample flip. One wrapper per (apply_fn, mesh), so
  repeated calls reuse the compiled program.
  """
  wrapper = _GATHERED.get((apply_fn, mesh))
  if wrapper is not None:
    return wrapper
  replicate = lambda params: jax.lax.with_sharding_constraint(
      params, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params))

  def wrapper(params, *args, **kwargs):
    return apply_fn(replicate(params), *args, **kwargs)

  for name in ("prefill", "decode", "block_pair"):
    method = getattr(apply_fn, name, None)
    if callable(method):
      setattr(wrapper, name, lambda params, *a, _m=method, **kw: _m(replicate(params), *a, **kw))
  wrapper.block_size = getattr(apply_fn, "block_size", None)
  _GATHERED[apply_fn, mesh] = wrapper
  return wrapper


def sample_on_mesh(apply_fn, params: Any, key: jax.Array, tokens_BxL, spec, mesh: Mesh, *,
                   fixed_BxL=None, valid_BxL=None, mask_id: int | None = None,
                   fsdp: bool = True) -> sampling.SampleResult:
  """`sampling.sample` with the batch split on the mesh's `data` axis and the parameters
  stored sharded (FSDP) over it, gathered where used (`gathered`): one program over every
  device, the same tokens as on one device (the rows keep their keys: `split(key, B)`)."""
  if "data" not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}; sampling splits the batch on 'data'.")
  batch, size = np.shape(tokens_BxL)[0], mesh.shape["data"]
  if batch % size:
    raise ValueError(f"mesh data axis of {size} devices does not divide the batch B={batch}; "
                     f"use a batch that is a multiple of {size}.")
  rows = NamedSharding(mesh, PartitionSpec("data"))
  put = lambda x: None if x is None else jax.device_put(np.asarray(x), rows)
  keys_B = sampling.row_keys(key, batch)
  return sampling.sample(gathered(apply_fn, mesh), shard_params(mesh, params, fsdp),
                         jax.device_put(keys_B, rows),
                         put(tokens_BxL), spec, put(fixed_BxL), mask_id=mask_id,
                         valid_BxL=put(valid_BxL))
