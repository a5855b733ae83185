"""The safetensors format in numpy: a validating, memory-mapped reader and an atomic writer.

A file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data (offsets count from the end of the header). Tensors are read one at a time through
`np.memmap`, so a reader holds one tensor in host memory, never the file. A sharded
checkpoint lists its tensors' files in `model.safetensors.index.json` (`weight_map`).

Every defect a file can have (truncation, a header length past the end, bad JSON, a key listed
twice, offsets out of range or overlapping, a byte count that is not prod(shape) * itemsize, an
unknown dtype; in a sharded checkpoint a tensor stored in two shards) is a ValueError naming the
file and, where there is one, the tensor. Only regular files are opened (a FIFO or a device
named like a checkpoint file would block or never end), and every file is written by a rename
of a new temporary file, so a symbolic link planted at its name is replaced, never written
through; a save then removes the earlier save's weight files that it does not name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np

from mdjax import files as files_lib
from mdjax import jsonl

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype codes -> numpy dtypes (little-endian, as the format stores them).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
# The format caps the header at 100 MB; a larger length is a corrupt first word, not a header.
_MAX_HEADER_BYTES = 100_000_000


def dtype_code(dtype) -> str:
  """The safetensors code ("F32", "BF16", ...) of a numpy or jax dtype."""
  d = np.dtype(dtype)
  code = _CODES.get(d.newbyteorder("<") if d.byteorder == ">" else d)
  if code is None:
    raise ValueError(f"dtype {d} has no safetensors code "
                     f"(supported: {', '.join(str(d) for d in _CODES)})")
  return code


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lies: its file, dtype code, shape and absolute byte range."""

  name: str
  path: str
  dtype: str
  shape: tuple[int, ...]
  begin: int  # absolute offsets in the file (header included)
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.begin

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]


# ----------------------------------------------------------------------------
# Files.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Reading.
# ----------------------------------------------------------------------------


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """Validates one file's header against its size: ({name: TensorInfo}, metadata)."""
  with files_lib.open_regular(path) as f:
    try:
      size = os.fstat(f.fileno()).st_size
      first = f.read(8)
      if len(first) < 8:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, under the "
                         "8-byte header length)")
      n = int.from_bytes(first, "little")
      if n > size - 8 or n > _MAX_HEADER_BYTES:
        raise ValueError(f"{path}: corrupt safetensors file: header length {n} exceeds the "
                         f"file's {size - 8} bytes after the length word")
      raw = f.read(n)
    except OSError as e:
      raise ValueError(f"{path}: cannot read safetensors file ({e})") from e
  try:
    # The format refuses a key listed twice (the Rust reader does); json would keep the last.
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=files_lib.unique_keys_hook)
  except files_lib.DuplicateKey as e:
    raise ValueError(f"{path}: corrupt safetensors header: key {e.args[0]!r} is listed "
                     "twice") from None
  except RecursionError:
    raise ValueError(f"{path}: corrupt safetensors header (nested too deeply)") from None
  except ValueError as e:  # bad UTF-8 or bad JSON
    raise ValueError(f"{path}: corrupt safetensors header (not JSON: {e})") from e
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                     "not an object)")
  metadata = header.pop("__metadata__", None) or {}
  if not isinstance(metadata, dict):
    raise ValueError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
  data_start, data_size = 8 + n, size - 8 - n
  infos: dict[str, TensorInfo] = {}
  for name, entry in header.items():
    infos[name] = _tensor_info(path, name, entry, data_start, data_size)
  # Tensors may not share bytes: sorted by start, each must begin at or after the last end.
  ordered = sorted(infos.values(), key=lambda t: (t.begin, t.end))
  for prev, cur in zip(ordered, ordered[1:]):
    if cur.begin < prev.end and cur.nbytes and prev.nbytes:
      raise ValueError(f"{path}: corrupt safetensors file: tensor {cur.name!r} (bytes "
                       f"{cur.begin - data_start}..{cur.end - data_start}) overlaps tensor "
                       f"{prev.name!r} (bytes {prev.begin - data_start}..{prev.end - data_start})")
  return infos, metadata


def _tensor_info(path, name, entry, data_start, data_size) -> TensorInfo:
  def bad(why):
    return ValueError(f"{path}: corrupt safetensors entry for tensor {name!r}: {why}")

  if not isinstance(entry, dict):
    raise bad(f"{entry!r} is not an object")
  dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
  if dtype not in DTYPES:
    raise bad(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
  if (not isinstance(shape, list)
      or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
    raise bad(f"shape {shape!r} is not a list of non-negative integers")
  if (not isinstance(offsets, list) or len(offsets) != 2
      or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
    raise bad(f"data_offsets {offsets!r} is not a [begin, end] pair of integers")
  begin, end = offsets
  if not 0 <= begin <= end <= data_size:
    raise bad(f"data_offsets [{begin}, {end}] out of range: the data section has "
              f"{data_size} bytes (truncated file?)")
  want = math.prod(shape) * DTYPES[dtype].itemsize
  if end - begin != want:
    raise bad(f"{end - begin} bytes for shape {shape} of {dtype}, which needs {want}")
  return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)


def read_tensor(info: TensorInfo) -> np.ndarray:
  """The tensor as a read-only memory map (nothing is read until it is touched)."""
  if info.nbytes == 0:  # an empty range cannot be mapped
    return np.zeros(info.shape, info.np_dtype)
  with files_lib.open_regular(info.path) as f:  # the map outlives the file object
    return np.memmap(f, dtype=info.np_dtype, mode="r", offset=info.begin, shape=info.shape)


def read_index(folder: str) -> dict[str, str]:
  """{tensor: shard path} of a sharded checkpoint's index; every shard named must exist."""
  path = os.path.join(folder, INDEX_FILE)
  index = files_lib.read_json(path, "safetensors index", unique_keys=True)
  weight_map = index.get("weight_map")
  if not isinstance(weight_map, dict):
    raise ValueError(f"{path}: the index has no weight_map object of {{tensor: file}}")
  files = {}
  for tensor, name in weight_map.items():
    if not isinstance(name, str):
      raise ValueError(f"{path}: weight_map[{tensor!r}] is a {type(name).__name__}, not a "
                       "file name")
    # A shard name is a plain file in the folder: never a path out of it.
    if os.path.basename(name) != name:
      raise ValueError(f"{path}: tensor {tensor!r} maps to {name!r}, not a file name")
    files[tensor] = os.path.join(folder, name)
  for shard in sorted(set(files.values())):
    if not files_lib.regular_file(shard):
      raise ValueError(f"{path}: shard file {os.path.basename(shard)!r} is missing "
                       f"(named for tensors of the index)")
  return files


def read_checkpoint(folder: str) -> dict[str, TensorInfo]:
  """Every tensor's TensorInfo of a folder's model.safetensors or sharded checkpoint.

  The index wins when both are present. Raises ValueError when there are no weights, when a
  shard is missing, or when a file is corrupt.
  """
  if files_lib.regular_file(os.path.join(folder, INDEX_FILE)):
    files = read_index(folder)
    headers = {shard: read_header(shard)[0] for shard in sorted(set(files.values()))}
    stored_in: dict[str, str] = {}
    for shard, header in headers.items():
      for tensor in header:
        if tensor in stored_in:
          raise ValueError(f"{os.path.join(folder, INDEX_FILE)}: tensor {tensor!r} is stored "
                           f"in two shards, {os.path.basename(stored_in[tensor])!r} and "
                           f"{os.path.basename(shard)!r}")
        stored_in[tensor] = shard
    infos = {}
    for tensor, shard in files.items():
      if tensor not in headers[shard]:
        raise ValueError(f"{os.path.join(folder, INDEX_FILE)}: tensor {tensor!r} is mapped "
                         f"to {os.path.basename(shard)!r}, which does not hold it")
      infos[tensor] = headers[shard][tensor]
    return infos
  single = os.path.join(folder, SINGLE_FILE)
  if files_lib.regular_file(single):
    return read_header(single)[0]
  raise ValueError(f"{folder}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE}")


# ----------------------------------------------------------------------------
# Writing.
# ----------------------------------------------------------------------------


def _nbytes(x) -> int:
  return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def write_file(path: str, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
               ) -> int:
  """Writes tensors (arrays, jax arrays or `mdjax.lazy.Lazy`) to one file atomically; returns
  its bytes.

  The data go to a temporary file in the same folder that replaces `path` once complete, so a
  reader never sees a half-written file. Tensors are laid out in name order.
  """
  names = sorted(tensors)
  header: dict[str, Any] = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  offset = 0
  for name in names:
    x = tensors[name]
    n = _nbytes(x)
    header[name] = {"dtype": dtype_code(x.dtype), "shape": [int(d) for d in x.shape],
                    "data_offsets": [offset, offset + n]}
    offset += n
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)  # pads the header so the data start 8-byte aligned
  with files_lib.atomic_write(path, sync=True) as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for name in names:
      x = tensors[name]
      want = np.dtype(x.dtype)
      host = np.asarray(np.asarray(x), order="C")  # (ascontiguousarray would make a scalar 1-d)
      if host.dtype != want or host.shape != tuple(x.shape):
        raise ValueError(f"{path}: tensor {name!r} gave {host.shape} {host.dtype}, "
                         f"not {tuple(x.shape)} {want}")
      f.write(host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes())
      del host  # one tensor on the host at a time
  return 8 + len(raw) + offset


def write_json(path: str, obj) -> None:
  """Writes JSON atomically (`atomic_write`)."""
  with files_lib.atomic_write(path, "w") as f:
    jsonl.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
  """Groups named tensors in order into shards of at most max_shard_bytes of data each.

  A tensor larger than the limit gets a shard of its own.
  """
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
  shards: list[list[str]] = []
  used = 0
  for name, n in sizes:
    if not shards or (used + n > max_shard_bytes and shards[-1]):
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += n
  return shards


# The names a save gives its weight files; `write_checkpoint` removes the previous save's.
SHARD_NAME = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")


def stale_weight_files(folder: str, keep: Iterable[str]) -> list[str]:
  """The weight files of an earlier save in `folder` that are not in `keep` (paths): regular
  files and symbolic links named model.safetensors, model.safetensors.index.json or
  model-XXXXX-of-YYYYY.safetensors; the index first. Nothing else of the folder is named."""
  kept = {os.path.basename(p) for p in keep}
  stale = []
  with os.scandir(folder) as entries:
    for entry in entries:
      name = entry.name
      if name in kept or not (name in (SINGLE_FILE, INDEX_FILE) or SHARD_NAME.fullmatch(name)):
        continue
      # A link is judged as a link (never followed); a folder or FIFO so named is not ours.
      if entry.is_symlink() or entry.is_file(follow_symlinks=False):
        stale.append(entry.path)
  return sorted(stale, key=lambda p: (os.path.basename(p) != INDEX_FILE, p))


def write_checkpoint(folder: str, tensors: Mapping[str, Any], *,
                     max_shard_bytes: int | None = None,
                     metadata: Mapping[str, str] | None = None) -> list[str]:
  """Writes model.safetensors, or shards plus model.safetensors.index.json; returns the files.

  Shards are named model-0000i-of-0000n.safetensors, as Hugging Face names them; a checkpoint
  that fits one shard is written as model.safetensors. The index is written last, so a folder
  whose index exists has all its shards. Once the new files are in place, the weight files of
  an earlier save that the new one does not name (`stale_weight_files`: its index first, then
  its shards or single file) are removed, so the folder holds one checkpoint; a symbolic link
  so named is unlinked, never followed.
  """
  os.makedirs(folder, exist_ok=True)
  names = sorted(tensors)
  shards = ([names] if max_shard_bytes is None
            else plan_shards(((n, _nbytes(tensors[n])) for n in names), max_shard_bytes))
  if len(shards) <= 1:
    paths = [os.path.join(folder, SINGLE_FILE)]
    write_file(paths[0], tensors, metadata)
  else:
    paths, weight_map = [], {}
    for i, group in enumerate(shards):
      name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      write_file(os.path.join(folder, name), {n: tensors[n] for n in group}, metadata)
      paths.append(os.path.join(folder, name))
      weight_map.update({n: name for n in group})
    total = sum(_nbytes(tensors[n]) for n in names)
    paths.append(os.path.join(folder, INDEX_FILE))
    write_json(paths[-1], {"metadata": {"total_size": total}, "weight_map": weight_map})
  for stale in stale_weight_files(folder, paths):
    os.remove(stale)  # on a link: the link itself
  return paths
