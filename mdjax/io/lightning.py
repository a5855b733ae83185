"""A restricted reader of torch `.ckpt` / `.pt` files (PyTorch Lightning checkpoints): no torch.

torch.save writes a zip archive: `<root>/data.pkl` (a pickle whose tensors are calls of
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and whose storages are
persistent ids `("storage", torch.FloatStorage, key, location, numel)`) and one file
`<root>/data/<key>` of raw little-endian bytes per storage, stored uncompressed. A pickle can
name any callable, so `find_class` resolves a global only to one of this module's stand-ins
(nothing from the file's modules is imported or run):

- tensors: torch's rebuild functions, storage types, `torch.Size`, dtypes and devices ->
  stand-ins that build a lazy `StoredTensor` (a memory map of its storage, read when asked for);
- plain values: `collections.OrderedDict` / `defaultdict`, the builtin types (dict, list,
  tuple, set, frozenset, int, float, complex, str, bytes, bool, slice, object) and
  `_codecs.encode` (protocol 2's bytes; latin-1 only);
- metadata Lightning keeps beside the weights: classes of omegaconf, transformers, tokenizers,
  lightning / pytorch_lightning / lightning_fabric, torchmetrics, typing, pathlib and numpy ->
  inert `Opaque` placeholders that record their name and arguments (never constructed);
- anything else (`os.system`, `builtins.eval`, any other class) is refused, naming it.

Pickle's other opcodes act on whatever they are given, so the unpickler is pickle's pure-Python
one with its own dispatch table (the C one's is fixed; a data.pkl is small: milliseconds).
BUILD is allowed only on `Opaque` placeholders (and an OrderedDict's `_metadata`, where
torch's state_dict keeps module versions), never on a storage, tensor, stand-in or value. A
storage's offset and size come from the member table of the archive (a regular file), never
from the pickle; a tensor must lie inside its storage and hold no more elements than it (a
stride-0 view of 4 bytes is not a 4 GB tensor). Calls are of stand-ins, placeholders and
builtin types only, with arguments that cannot amplify (`bytes` of bytes or text, never of a
count; containers of containers, their items counted); items go only into dicts, lists, sets
and placeholders, keyed by what hashes in bounded time (values, frozensets, placeholders,
small tuples), at most MAX_SAME_HASH keys of one dict sharing a hash (colliding keys make
insertion quadratic). data.pkl is at most MAX_PICKLE_BYTES, deflated at most MAX_RATIO times
(refused by its declared sizes, then read in chunks), unpickled in at most MAX_STEPS steps
(opcodes, copied items, STEP_BYTES of copied or hashed bytes), naming at most MAX_CLASSES
metadata classes: seconds and a few hundred MB whatever the file (a Lightning checkpoint's
data.pkl is KBs to MBs, thousands of steps).
Every malformed input is a one-line ValueError naming the file.
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

from mdjax import files as files_lib
from mdjax.io import tensors as tensors_lib

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
                "'mdjax[reference]' and run python -m mdjax.io.convert_ckpt IN.ckpt OUT_DIR "
                "--config=CONFIG.json")
# Caps (module docstring): far above what checkpoints need, far below what hurts.
MAX_PICKLE_BYTES = 64 << 20
MAX_RATIO = 100  # inflated / compressed, for a deflated member over 1 MiB
MAX_STEPS = 2_000_000  # opcodes run, items copied into new containers, and:
STEP_BYTES = 16  # a step per this many bytes a call copies or converts, or a hash reads
MAX_CLASSES = 1000  # distinct metadata classes (a checkpoint names tens)
MAX_SAME_HASH = 8  # keys of one dict or set sharing a hash
MAX_KEY_ITEMS = 64  # values in a tuple used as a dict key or set item
MAX_DIMS, MAX_DIM = 64, 1 << 48  # a tensor's dimensions, and their product (zeros aside)


class _Refused(ValueError):  # a refusal whose message lacks the file's name (read_ckpt adds it)
  pass


def _show(value) -> str:
  """A short description of an unpickled value for a message, never its whole repr."""
  if type(value) in (str, bytes):
    return repr(value[:60])
  if type(value) in (type(None), bool, float) or (type(value) is int and abs(value) < 1 << 64):
    return repr(value)
  return f"a {type(value).__name__}"


def _nbytes(value) -> int:
  """What converting or hashing a value reads: a str's or bytes' length, an int's bytes."""
  if type(value) in (str, bytes, bytearray):
    return len(value)
  return value.bit_length() // 8 if type(value) is int else 0


_StorageType = collections.namedtuple("_StorageType", "name")  # torch.FloatStorage, ...


@dataclasses.dataclass(frozen=True)
class _Storage:
  """Where a storage's bytes lie in the archive (its member table), their dtype, the file's id."""

  path: str
  key: str
  begin: int  # absolute offset of the bytes in the .ckpt file
  nbytes: int
  dtype: np.dtype
  file_id: tuple[int, int]


def _layout_error(storage: _Storage, offset, shape, stride) -> str | None:
  """Why a tensor's offset, shape and strides (in elements) do not fit its storage, or None."""
  if len(shape) != len(stride) or len(shape) > MAX_DIMS or not all(
      type(v) is int and 0 <= v < MAX_DIM for v in (offset, *shape, *stride)) or math.prod(
          d for d in shape if d) >= MAX_DIM:  # (bounded ints: the arithmetic below is cheap)
    return f"has {len(shape)} dimensions or values outside [0, 2**48): not a tensor layout"
  count, numel = storage.nbytes // storage.dtype.itemsize, math.prod(shape)
  where = f"(offset {offset}, shape {list(shape)}, stride {list(stride)})"
  if numel and offset + sum((d - 1) * st for d, st in zip(shape, stride)) >= count:
    return f"{where} lies outside its storage of {count} elements"
  if numel > count - offset:  # only an overlapping (e.g. stride-0) view holds more
    return f"{where} holds {numel} elements over the {count - offset} of its storage"
  return None


@dataclasses.dataclass(frozen=True)
class StoredTensor:
  """A tensor of a .ckpt: its storage, offset, shape and strides (in elements). The fields of
  a safetensors `TensorInfo` the loader reads, and `read()`: a read-only view of the file."""

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
    """A view of the storage, checked to lie inside it before anything is mapped or copied."""
    s, item = self.storage, self.storage.dtype.itemsize
    error = _layout_error(s, self.offset, self.shape, self.stride)
    if error:
      raise ValueError(f"{s.path}: tensor {self.name or '?'} {error}")
    count = s.nbytes // item
    if not math.prod(self.shape) or not count:
      return np.zeros(self.shape, s.dtype)
    changed = ValueError(f"{s.path}: changed since it was read (storage data/{s.key})")
    try:
      f = files_lib.open_regular(s.path)
    except ValueError:  # gone, or swapped for a FIFO
      raise changed from None
    with f:
      st = os.fstat(f.fileno())
      if (st.st_dev, st.st_ino) != s.file_id or st.st_size < s.begin + s.nbytes:
        raise changed
      flat = np.memmap(f, dtype=s.dtype, mode="r", offset=s.begin, shape=(count,))
    # torch gives a dimension of size 1 any stride: 0 keeps numpy's arithmetic small.
    strides = tuple(st * item if d > 1 else 0 for d, st in zip(self.shape, self.stride))
    return np.lib.stride_tricks.as_strided(flat[self.offset:], shape=self.shape,
                                           strides=strides, writeable=False)

  def named(self, name: str) -> "StoredTensor":
    return dataclasses.replace(self, name=name)


class Opaque:
  """An object the reader does not build: its class name, arguments, state and items. A class
  the pickle names is one too; calling it makes another."""

  __slots__ = ("qualname", "args", "state", "items", "list")

  def __init__(self, qualname: str, args=(), state=None):
    self.qualname, self.args, self.state = qualname, args, state
    self.items: dict = {}
    self.list: list = []

  def __repr__(self):
    return f"<Opaque {self.qualname}>"


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
  if not isinstance(storage, _Storage):
    raise _Refused(f"a tensor's storage is {_show(storage)}, not a storage of the archive")
  shape, strides = (tuple(v) if type(v) in (tuple, list) and len(v) <= MAX_DIMS else (None,)
                     for v in (size, stride))
  error = _layout_error(storage, storage_offset, shape, strides)
  if error:
    raise _Refused(f"a tensor of storage data/{storage.key} {error}")
  return StoredTensor(storage, storage_offset, shape, strides)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
  return data  # a Parameter is its tensor here


def _rebuild_from_type_v2(func, new_type, args, state):
  if func is not _rebuild_tensor_v2 and func is not _rebuild_parameter:
    raise _Refused(f"refused to rebuild a tensor subclass with {_show(func)}")
  return func(*args)


def _codecs_encode(value, encoding="utf-8"):
  # Protocol 2 pickles bytes as _codecs.encode(text, "latin1"): only that form is read.
  if type(value) is not str or encoding not in ("latin1", "latin-1"):
    raise _Refused(f"refused to unpickle _codecs.encode with encoding {_show(encoding)}")
  return value.encode("latin1")


def _device(*args):
  if len(args) > 2 or any(type(a) not in (str, int) or _nbytes(a) > 64 for a in args):
    raise _Refused("a torch.device of other than a type and an index")
  return ":".join(str(a) for a in args)


_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor_v2,  # its first four arguments
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

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)
_ENCODINGS = ("latin1", "latin-1", "utf-8", "utf8", "ascii")
# What REDUCE / NEWOBJ / INST / OBJ may call, by kind (the stand-ins check their arguments).
_CALLABLES = {id(f): (f, kind) for kind, group in (
    ("stand-in", (_rebuild_tensor_v2, _rebuild_parameter, _rebuild_from_type_v2,
                  _codecs_encode, _device)),
    ("value", (bool, int, float, complex, str, slice, object)), ("bytes", (bytes,)),
    ("container", (tuple, list, set, frozenset, dict, collections.OrderedDict)),
    ("defaultdict", (collections.defaultdict,))) for f in group}


def _kind(func) -> str | None:
  known, kind = _CALLABLES.get(id(func), (None, None))
  return kind if known is func else None


def _check_key(key):
  """A dict key or set item must hash in bounded time: a value, a frozenset (its items checked
  when built), a placeholder or a small tuple of these (a deep tuple's hash crashes Python).
  Returns the bytes hashing reads (an int's hash is not cached)."""
  todo, seen, size = [key], 0, 0
  while todo:
    k = todo.pop()
    seen, size = seen + 1, size + _nbytes(k)
    if seen > MAX_KEY_ITEMS:
      raise _Refused(f"a dict key or set item holds over {MAX_KEY_ITEMS} values")
    if type(k) is tuple:
      todo.extend(k)
    elif type(k) not in _ATOMS + (frozenset, Opaque):
      raise _Refused(f"a dict key or set item is {_show(k)}, not a value or small tuple")
  return size


class RestrictedUnpickler(pickle._Unpickler):
  """Unpickles data.pkl with this module's stand-ins and opcode handlers (module docstring)."""

  def __init__(self, file, storages: dict[str, _Storage]):
    super().__init__(file)
    self._storages, self._steps = storages, MAX_STEPS
    self._classes: dict[str, Opaque] = {}
    self._hash_counts: dict[int, tuple[Any, dict[int, int]]] = {}

  def find_class(self, module: str, name: str):
    self._charge((len(module) + len(name)) // STEP_BYTES)  # STACK_GLOBAL may repeat names
    # Protocol 2 names Python 2's modules (__builtin__, copy_reg): map them as pickle does.
    if (module, name) in _compat_pickle.NAME_MAPPING:
      module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    if (module, name) in _TENSOR_GLOBALS:
      return _TENSOR_GLOBALS[(module, name)]
    if module == "torch" and name in STORAGE_DTYPES:
      return _StorageType(name)
    if module == "torch" and name in _DTYPE_NAMES:
      return f"torch.{name}"
    if module.split(".")[0] in OPAQUE_MODULES:
      qualname = f"{module}.{name}"
      if qualname not in self._classes and len(self._classes) >= MAX_CLASSES:
        raise _Refused(f"data.pkl names over {MAX_CLASSES} metadata classes")
      return self._classes.setdefault(qualname, Opaque(qualname))
    raise _Refused(f"refused to unpickle {module}.{name}: a checkpoint may hold only tensors, "
                   "plain containers and known metadata classes (mdjax.io.lightning); "
                   f"if you trust this file, {CONVERT_HINT}")

  def persistent_load(self, pid):
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
      raise _Refused(f"unknown persistent id {_show(pid)} (not a torch storage)")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
      raise _Refused(f"storage {_show(key)} has type {_show(storage_type)}, not a typed storage")
    storage = self._storages.get(key) if type(key) is str else None
    if storage is None:
      raise _Refused(f"storage {_show(key)} has no data/<key> file in the archive")
    storage = dataclasses.replace(storage, dtype=STORAGE_DTYPES[storage_type.name])
    if type(numel) is not int or not 0 <= numel <= storage.nbytes // storage.dtype.itemsize:
      raise _Refused(f"storage data/{key} holds {storage.nbytes} bytes, not the {_show(numel)} "
                     f"{storage_type.name} elements it declares")
    return storage

  def _charge(self, steps: int):
    self._steps -= steps
    if self._steps < 0:
      raise _Refused(f"data.pkl takes over {MAX_STEPS} steps to unpickle")

  def _admit(self, keys, into=None):
    """Checks keys entering `into` (or a new dict or set): bounded hashing, few collisions."""
    counts = {} if into is None else self._hash_counts.setdefault(id(into), (into, {}))[1]
    for key in keys:
      self._charge(_check_key(key) // STEP_BYTES)
      h = hash(key)
      counts[h] = counts.get(h, 0) + 1
      if counts[h] > MAX_SAME_HASH:
        raise _Refused(f"over {MAX_SAME_HASH} keys of one dict or set share a hash")

  def _call(self, func, args, new: bool = False):
    """func(*args) (REDUCE, INST, OBJ) or func.__new__(func, *args) (NEWOBJ), if allowed."""
    if type(args) is not tuple:
      raise _Refused(f"a call's arguments are {_show(args)}, not a tuple")
    if type(func) is Opaque:
      return Opaque(func.qualname, args)
    kind, size = _kind(func), sum(_nbytes(a) for a in args)
    if kind is None or (new and kind == "stand-in"):
      raise _Refused(f"refused to call {_show(func)}")
    self._charge(size // STEP_BYTES)
    one = args[0] if len(args) == 1 else None
    if kind == "value":  # small: int <-> str conversions are quadratic
      ok = len(args) <= 3 and all(type(a) in _ATOMS for a in args) and size <= 256
    elif kind == "bytes":  # of bytes or text, never of a count (bytes(10**9))
      ok = (not args or type(one) in (bytes, bytearray)
            or (len(args) == 2 and type(args[0]) is str and args[1] in _ENCODINGS))
    elif kind == "defaultdict":  # of a builtin factory
      ok = not args or one is None or _kind(one) in ("value", "bytes", "container")
    elif kind == "container":  # of a container, its items counted (and checked as keys)
      ok = not args or type(one) in (tuple, list, set, frozenset) + _DICTS
      if ok and args:
        self._charge(len(one))
        if func in (dict, collections.OrderedDict) and type(one) not in _DICTS:
          if not all(type(p) in (tuple, list) and len(p) == 2 for p in one):
            raise _Refused(f"{func.__name__} of other than (key, value) pairs")
          one = [p[0] for p in one]
        if func in (set, frozenset, dict, collections.OrderedDict):
          self._admit(one)
    else:
      ok = True
    if not ok:
      raise _Refused(f"refused to call {func.__name__} with "
                     f"({', '.join(_show(a) for a in args[:3])})")
    return func.__new__(func, *args) if new else func(*args)

  def _build(self):
    state = self.stack.pop()
    inst = self.stack[-1]
    if type(inst) is Opaque:
      inst.state = state
    elif (type(inst) is collections.OrderedDict and type(state) is dict and len(state) == 1
          and "_metadata" in state):
      inst._metadata = state["_metadata"]  # torch's state_dict: its modules' versions
    else:
      raise _Refused(f"refused to BUILD {_show(inst)}: only placeholders take a state")

  def _setitems(self, items: list, new: bool = False):
    if new:  # DICT (protocol 0): the items of a new dict
      self.append({})
    target = self.stack[-1]
    if type(target) not in _DICTS + (Opaque,) or len(items) % 2:
      raise _Refused(f"refused to set {len(items)} keys and values in {_show(target)}")
    self._admit(items[0::2], into=target)
    (target.items if type(target) is Opaque else target).update(zip(items[0::2], items[1::2]))

  def _extend(self, items: list):
    target = self.stack[-1]
    if type(target) not in (list, Opaque):
      raise _Refused(f"refused to append to {_show(target)}")
    (target.list if type(target) is Opaque else target).extend(items)

  def _additems(self):
    items = self.pop_mark()
    if type(self.stack[-1]) is not set:
      raise _Refused(f"refused to add items to {_show(self.stack[-1])}")
    self._admit(items, into=self.stack[-1])
    self.stack[-1].update(items)

  def _frozenset(self):
    items = self.pop_mark()  # before self.append, which it rebinds
    self.append(self._call(frozenset, (items,)))

  def _put(self):
    i = int(self.readline()[:-1])
    if not 0 <= i < 1 << 32:
      raise _Refused(f"memo index {_show(i)} out of range")
    self.memo[i] = self.stack[-1]

  def _instantiate(self, klass, args):  # INST and OBJ
    self.append(self._call(klass, tuple(args)))

  def _reduce(self):
    args = self.stack.pop()
    self.stack[-1] = self._call(self.stack[-1], args)

  def _newobj(self, kwargs=None):
    args, cls = self.stack.pop(), self.stack.pop()
    if kwargs is not None and (type(kwargs) is not dict or kwargs):
      raise _Refused("refused NEWOBJ_EX with keyword arguments")
    self.append(self._call(cls, args, new=True))

  def _refuse_extension(self):
    raise _Refused("refused the extension registry's opcodes (EXT1, EXT2, EXT4)")


def _counted(handler):
  def step(self):
    self._charge(1)
    handler(self)
  return step


_U = RestrictedUnpickler
_OPCODES = {
    pickle.BUILD: _U._build, pickle.REDUCE: _U._reduce, pickle.NEWOBJ: _U._newobj,
    pickle.NEWOBJ_EX: lambda self: self._newobj(kwargs=self.stack.pop()),
    # SETITEM: [key, value] off the stack (the key is under the value).
    pickle.SETITEM: lambda self: self._setitems([self.stack.pop(-2), self.stack.pop()]),
    pickle.SETITEMS: lambda self: self._setitems(self.pop_mark()),
    pickle.APPEND: lambda self: self._extend([self.stack.pop()]),
    pickle.APPENDS: lambda self: self._extend(self.pop_mark()),
    pickle.DICT: lambda self: self._setitems(self.pop_mark(), new=True),
    pickle.ADDITEMS: _U._additems, pickle.PUT: _U._put,
    pickle.FROZENSET: _U._frozenset,
    **dict.fromkeys((pickle.EXT1, pickle.EXT2, pickle.EXT4), _U._refuse_extension),
}
RestrictedUnpickler.dispatch = {op: _counted(_OPCODES.get(bytes([op]), handler))
                                for op, handler in pickle._Unpickler.dispatch.items()}


def _data_offset(f, info: zipfile.ZipInfo) -> int:
  # A stored member's bytes begin after its local header: 30 bytes, the name, the extra field.
  f.seek(info.header_offset)
  local = f.read(30)
  if len(local) < 30 or local[:4] != b"PK\x03\x04":
    raise _Refused(f"corrupt zip local header of {info.filename}")
  name_len = int.from_bytes(local[26:28], "little")
  extra_len = int.from_bytes(local[28:30], "little")
  return info.header_offset + 30 + name_len + extra_len


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> io.BytesIO:
  """A member's bytes, refused by its declared sizes before any inflating (over `limit`, or over
  MAX_RATIO times deflated), read in chunks (zipfile stops at the declared size)."""
  if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
    raise _Refused(f"{info.filename} is compressed with method {info.compress_type}")
  if info.file_size > limit or (info.compress_type == zipfile.ZIP_DEFLATED and info.file_size
                                > max(1 << 20, MAX_RATIO * info.compress_size)):
    raise _Refused(f"{info.filename} inflates to {info.file_size} bytes from "
                   f"{info.compress_size}: over the {limit} bytes (or {MAX_RATIO}x) allowed")
  out = io.BytesIO()
  with zf.open(info) as member:
    while chunk := member.read(1 << 20):
      if out.tell() + len(chunk) > limit:
        raise _Refused(f"{info.filename} inflates past the {limit} bytes allowed")
      out.write(chunk)
  out.seek(0)
  return out


def read_ckpt(path: str) -> Any:
  """The object a torch .ckpt / .pt file holds, with every tensor a lazy `StoredTensor`,
  metadata objects `Opaque`, and anything else refused (module docstring)."""
  path = os.fspath(path)
  f = files_lib.open_regular(path)  # a ValueError naming it: missing, a link loop, a FIFO
  try:
    with f:
      data, storages = _read_archive(f, path)
    return RestrictedUnpickler(data, storages).load()
  except _Refused as e:
    raise ValueError(f"{path}: {e}") from None
  except Exception as e:  # the OS's, zipfile's, zlib's and pickle's own exception types
    cause = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # one line
    raise ValueError(f"{path}: unreadable torch archive ({cause})") from e


def _read_archive(f, path: str) -> tuple[io.BytesIO, dict[str, _Storage]]:
  """data.pkl's bytes and the storages of an open archive (a regular file)."""
  st = os.fstat(f.fileno())
  if not zipfile.is_zipfile(f):
    raise _Refused("not a zip archive (a torch file saved before torch 1.6 or with "
                   f"_use_new_zipfile_serialization=False); {CONVERT_HINT}")
  with zipfile.ZipFile(f) as zf:
    infos = zf.infolist()
    pkls = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
    if len(pkls) != 1:
      raise _Refused("not a torch archive (no <root>/data.pkl)")
    root = pkls[0].filename.split("/")[0]
    order = next((i for i in infos if i.filename == f"{root}/byteorder"), None)
    if order is not None and _read_member(zf, order, 64).read().strip() != b"little":
      raise _Refused("big-endian tensors are not supported")
    storages = {}
    prefix = f"{root}/data/"
    for info in infos:
      key = info.filename[len(prefix):]
      if info.filename.startswith(prefix) and "/" not in key:
        if info.compress_type != zipfile.ZIP_STORED:
          raise _Refused(f"storage {info.filename} is compressed (torch stores it as is)")
        begin = _data_offset(f, info)
        if begin + info.file_size > st.st_size:
          raise _Refused(f"storage {info.filename} runs past the end of the file")
        storages[key] = _Storage(path, key, begin, info.file_size, np.dtype("u1"),
                                 (st.st_dev, st.st_ino))
    return _read_member(zf, pkls[0], MAX_PICKLE_BYTES), storages


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
    if type(name) is not str or not is_tensor(value):
      raise ValueError(f"{path}: state_dict entry {_show(name)} is {_show(value)}: entries "
                       "are tensors named by a str")
    out[_strip(name)] = value
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
