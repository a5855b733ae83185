"""A restricted reader of torch `.ckpt` / `.pt` files (PyTorch Lightning checkpoints): no torch.

torch.save writes a zip archive: `<root>/data.pkl` (a pickle whose tensors are calls of
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and whose storages are
persistent ids `("storage", torch.FloatStorage, key, location, numel)`) and one file
`<root>/data/<key>` of raw little-endian bytes per storage, stored uncompressed. A pickle can
name any callable, so this reader never unpickles freely: `find_class` resolves a global only
to one of this module's own stand-ins, and nothing from the file's modules is imported or run.

The policy, by the global's name:

- tensors: torch's rebuild functions, the storage types, `torch.Size`, dtypes and devices ->
  stand-ins that build a lazy `StoredTensor` (a memory map of its storage file, read when
  asked for);
- plain containers and values: `collections.OrderedDict` / `defaultdict`, the builtin value
  types (dict, list, tuple, set, frozenset, int, float, complex, str, bytes, bool, slice,
  object) and `_codecs.encode` (protocol 2's bytes; latin-1 only);
- metadata that Lightning stores beside the weights (`hyper_parameters`, callbacks): classes of
  omegaconf, transformers, tokenizers, lightning / pytorch_lightning / lightning_fabric,
  torchmetrics, typing, pathlib and numpy -> inert `Opaque` placeholders that only record their
  name and arguments (never constructed, their module never imported);
- anything else (`os.system`, `builtins.eval`, `subprocess.Popen`, any other class) is a
  ValueError naming it: the file is refused before any of it is built.

So a checkpoint of the MDLM / BD3-LM reference code reads whole, weights as tensors and its
configs as placeholders, and a file that names code to run is refused.
"""

from __future__ import annotations

import _compat_pickle
import collections
import dataclasses
import io
import math
import os
import pickle
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

from mdjax.pretrained import tensors as tensors_lib

# torch's legacy typed storage classes (the second item of a storage's persistent id).
STORAGE_DTYPES: dict[str, np.dtype] = {
    "FloatStorage": np.dtype("<f4"), "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype("<i8"), "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"), "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"), "BoolStorage": np.dtype("?"),
}
# Module prefixes whose objects are metadata, read as inert placeholders.
OPAQUE_MODULES = ("omegaconf", "transformers", "tokenizers", "lightning", "pytorch_lightning",
                  "lightning_fabric", "torchmetrics", "typing", "pathlib", "numpy")
CONVERT_HINT = ("convert it with torch's own restricted loader instead: pip install "
                "'mdjax[reference]' and run python -m mdjax.pretrained.convert_ckpt IN.ckpt OUT_DIR "
                "--config=CONFIG.json")


@dataclasses.dataclass(frozen=True)
class _StorageType:
  name: str

  @property
  def dtype(self) -> np.dtype:
    return STORAGE_DTYPES[self.name]


@dataclasses.dataclass(frozen=True)
class _Storage:
  """One storage file of the archive: where its bytes lie and their dtype."""

  path: str
  begin: int  # absolute offset of the bytes in the .ckpt file
  nbytes: int
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class StoredTensor:
  """A tensor of a .ckpt: its storage, offset, shape and strides (in elements).

  The same fields as a safetensors `TensorInfo` where the loader reads them (name, path,
  dtype code, shape, nbytes), plus `read()`: a read-only array over a memory map of the file.
  """

  storage: _Storage
  offset: int
  shape: tuple[int, ...]
  stride: tuple[int, ...]
  name: str = ""

  @property
  def path(self) -> str:
    return self.storage.path

  @property
  def dtype(self) -> str:
    return tensors_lib.dtype_code(self.storage.dtype)

  @property
  def np_dtype(self) -> np.dtype:
    return self.storage.dtype

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.storage.dtype.itemsize

  def read(self) -> np.ndarray:
    s, item = self.storage, self.storage.dtype.itemsize
    count = s.nbytes // item
    last = self.offset + sum((d - 1) * st for d, st in zip(self.shape, self.stride))
    if math.prod(self.shape) and (self.offset < 0 or last >= count
                                  or any(st < 0 for st in self.stride)):
      raise ValueError(f"{s.path}: tensor {self.name or '?'} (offset {self.offset}, shape "
                       f"{list(self.shape)}, stride {list(self.stride)}) lies outside its "
                       f"storage of {count} elements")
    if not math.prod(self.shape) or not count:
      return np.zeros(self.shape, s.dtype)
    flat = np.memmap(s.path, dtype=s.dtype, mode="r", offset=s.begin, shape=(count,))
    return np.lib.stride_tricks.as_strided(
        flat[self.offset:], shape=self.shape, strides=tuple(st * item for st in self.stride),
        writeable=False)

  def named(self, name: str) -> "StoredTensor":
    return dataclasses.replace(self, name=name)


class Opaque:
  """An object the reader does not build: its class name and what it was given."""

  def __init__(self, qualname: str, args=(), state=None):
    self.qualname, self.args, self.state = qualname, args, state
    self.items: dict = {}
    self.list: list = []

  def __setstate__(self, state):
    self.state = state

  def __setitem__(self, key, value):
    self.items[key] = value

  def append(self, value):
    self.list.append(value)

  def extend(self, values):
    self.list.extend(values)

  def __repr__(self):
    return f"<Opaque {self.qualname}>"


def _opaque_class(qualname: str):
  """A class standing in for a metadata class: building it (REDUCE, NEWOBJ) records the
  arguments; pickle's BUILD calls Opaque.__setstate__."""

  class _Placeholder(Opaque):
    # NEWOBJ calls only __new__, REDUCE calls both: __new__ records, __init__ does nothing.
    def __new__(cls, *args, **kwargs):
      obj = Opaque.__new__(cls)
      Opaque.__init__(obj, qualname, args)
      return obj

    def __init__(self, *args, **kwargs):
      pass

  _Placeholder.__qualname__ = _Placeholder.__name__ = f"Opaque[{qualname}]"
  return _Placeholder


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
  if not isinstance(storage, _Storage):
    raise ValueError(f"a tensor's storage is a {type(storage).__name__}, not a storage of "
                     "the archive")
  return StoredTensor(storage, int(storage_offset), tuple(int(d) for d in size),
                      tuple(int(s) for s in stride))


def _rebuild_tensor(storage, storage_offset, size, stride):
  return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
  return data  # a Parameter is its tensor here


def _rebuild_from_type_v2(func, new_type, args, state):
  if func not in (_rebuild_tensor_v2, _rebuild_tensor, _rebuild_parameter):
    raise ValueError(f"refused to rebuild a tensor subclass with {func!r}")
  return func(*args)


def _codecs_encode(value, encoding="utf-8"):
  # Protocol 2 pickles bytes as _codecs.encode(text, "latin1"): only that form is read.
  if not isinstance(value, str) or encoding not in ("latin1", "latin-1"):
    raise ValueError(f"refused to unpickle _codecs.encode with encoding {encoding!r}")
  return value.encode("latin1")


def _device(*args):
  return ":".join(str(a) for a in args)


_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): "torch.Tensor",
    ("torch.nn.parameter", "Parameter"): "torch.nn.Parameter",
    ("torch", "Size"): tuple,
    ("torch", "device"): _device,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    **{("builtins", t.__name__): t for t in (dict, list, tuple, set, frozenset, int, float,
                                             complex, str, bytes, bool, slice, object)},
    ("_codecs", "encode"): _codecs_encode,
}
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool", "float", "double", "half", "long", "int")


class RestrictedUnpickler(pickle.Unpickler):
  """Unpickles a torch archive's data.pkl with this module's stand-ins (module docstring)."""

  def __init__(self, file, storages: dict[str, _Storage], where: str):
    super().__init__(file)
    self._storages = storages
    self._where = where

  def find_class(self, module: str, name: str):
    # Protocol 2 names Python 2's modules (__builtin__, copy_reg): map them as pickle does.
    if (module, name) in _compat_pickle.NAME_MAPPING:
      module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    key = (module, name)
    if key in _TENSOR_GLOBALS:
      return _TENSOR_GLOBALS[key]
    if module == "torch" and name in STORAGE_DTYPES:
      return _StorageType(name)
    if module == "torch" and name in _DTYPE_NAMES:
      return f"torch.{name}"
    if module.split(".")[0] in OPAQUE_MODULES:
      return _opaque_class(f"{module}.{name}")
    raise ValueError(f"{self._where}: refused to unpickle {module}.{name}: a checkpoint may "
                     "hold only tensors, plain containers and known metadata classes "
                     f"(mdjax.pretrained.lightning); if you trust this file, {CONVERT_HINT}")

  def persistent_load(self, pid):
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
      raise ValueError(f"{self._where}: unknown persistent id {str(pid)[:80]!r} (not a torch "
                       "storage)")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
      raise ValueError(f"{self._where}: storage {key!r} has type {storage_type!r}, not one "
                       f"of torch's typed storages ({', '.join(STORAGE_DTYPES)})")
    storage = self._storages.get(str(key))
    if storage is None:
      raise ValueError(f"{self._where}: storage {key!r} has no data/{key} file in the archive")
    storage = dataclasses.replace(storage, dtype=storage_type.dtype)
    if storage.nbytes < int(numel) * storage.dtype.itemsize:
      raise ValueError(f"{self._where}: storage data/{key} holds {storage.nbytes} bytes, "
                       f"under the {numel} {storage_type.name} elements it declares")
    return storage


def _data_offset(f, info: zipfile.ZipInfo) -> int:
  """Where an uncompressed member's bytes begin: after its local header (30 bytes, the name,
  the extra field)."""
  f.seek(info.header_offset)
  local = f.read(30)
  if len(local) < 30 or local[:4] != b"PK\x03\x04":
    raise ValueError("corrupt zip local header")
  name_len = int.from_bytes(local[26:28], "little")
  extra_len = int.from_bytes(local[28:30], "little")
  return info.header_offset + 30 + name_len + extra_len


def read_ckpt(path: str) -> Any:
  """The object a torch .ckpt / .pt file holds, with every tensor a lazy `StoredTensor`,
  metadata objects `Opaque`, and anything else refused (module docstring)."""
  path = os.fspath(path)
  if not zipfile.is_zipfile(path):
    raise ValueError(f"{path}: not a zip archive (a torch file saved before torch 1.6 or with "
                     f"_use_new_zipfile_serialization=False); {CONVERT_HINT}")
  try:
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
      infos = zf.infolist()
      pkls = [i for i in infos if i.filename.endswith("data.pkl")
              and i.filename.count("/") == 1]
      if len(pkls) != 1:
        raise ValueError(f"{path}: not a torch archive (no <root>/data.pkl)")
      root = pkls[0].filename.split("/")[0]
      names = {i.filename: i for i in infos}
      order = names.get(f"{root}/byteorder")
      if order is not None and zf.read(order).strip() != b"little":
        raise ValueError(f"{path}: big-endian tensors are not supported")
      storages = {}
      prefix = f"{root}/data/"
      for info in infos:
        if info.filename.startswith(prefix) and "/" not in info.filename[len(prefix):]:
          if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}: storage {info.filename} is compressed (torch stores "
                             "them uncompressed)")
          storages[info.filename[len(prefix):]] = _Storage(
              path, _data_offset(f, info), info.file_size, np.dtype("u1"))
      data = zf.read(pkls[0])
  except (OSError, zipfile.BadZipFile) as e:
    raise ValueError(f"{path}: unreadable torch archive ({e})") from e
  try:
    return RestrictedUnpickler(io.BytesIO(data), storages, path).load()
  except ValueError:
    raise
  except Exception as e:  # a malformed pickle: any of pickle's own exception types
    raise ValueError(f"{path}: corrupt data.pkl ({type(e).__name__}: {e})") from e


def _strip(name: str) -> str:
  # torch.compile wraps a module as `_orig_mod`; the reference code strips it the same way.
  return name.replace("_orig_mod.", "")


def select_weights(obj: Any, path: str, *, ema: bool = True, is_tensor=None) -> dict:
  """The named weights of a read checkpoint (`is_tensor` tells its tensors; StoredTensor by
  default): a Lightning checkpoint's `state_dict` (with `ema=True` and an `ema` entry, the EMA
  shadow params in its place: the weights the reference code evaluates and publishes), or a
  bare state dict. Names lose torch.compile's `_orig_mod.`."""
  is_tensor = is_tensor or (lambda v: isinstance(v, StoredTensor))
  if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
    state = obj["state_dict"]
  elif isinstance(obj, dict) and obj and all(is_tensor(v) for v in obj.values()):
    state = obj
  else:
    raise ValueError(f"{path}: holds no state_dict of tensors (a Lightning checkpoint's "
                     "'state_dict' or a bare {name: tensor} dict)")
  out = {}
  for name, value in state.items():
    if not is_tensor(value):
      raise ValueError(f"{path}: state_dict entry {name!r} is a {type(value).__name__}, not a "
                       "tensor")
    out[_strip(str(name))] = value
  shadow = obj.get("ema") if ema and isinstance(obj, dict) and "state_dict" in obj else None
  if isinstance(shadow, dict) and isinstance(shadow.get("shadow_params"), list):
    out = _with_ema(out, shadow["shadow_params"], path, is_tensor)
  return out


def state_tensors(obj: Any, path: str, *, ema: bool = True) -> dict[str, StoredTensor]:
  """`select_weights` of a `read_ckpt` result, each tensor named."""
  return {n: t.named(n) for n, t in select_weights(obj, path, ema=ema).items()}


def _with_ema(state: dict, shadow: list, path: str, is_tensor):
  """The EMA's shadow params are a list in `backbone.parameters()` order: the state dict's
  backbone entries less the buffers (rotary inv_freq), as the reference's push_to_hf pairs
  them."""
  names = [n for n in state if n.startswith("backbone.") and not n.endswith("inv_freq")]
  if len(shadow) < len(names) or not all(is_tensor(s) for s in shadow):
    raise ValueError(f"{path}: the EMA holds {len(shadow)} shadow params for the "
                     f"{len(names)} backbone parameters; pass ema=False to read the raw "
                     "state_dict")
  out = dict(state)
  for name, s in zip(names, shadow):
    if tuple(s.shape) != tuple(state[name].shape):
      raise ValueError(f"{path}: EMA shadow param for {name} has shape {list(s.shape)}, the "
                       f"state_dict's {list(state[name].shape)}; pass ema=False to read the "
                       "raw state_dict")
    out[name] = s
  return out
