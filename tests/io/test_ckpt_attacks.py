"""Attacks on the restricted .ckpt reader (mdjax.io.lightning): pickles written opcode
by opcode in hand-built zips, each refused with a one-line ValueError naming the file, within
a memory and time cap measured here; and a checkpoint written as torch writes one, read as
before."""

import collections
import copyreg
import dataclasses
from io import BytesIO
import os
import pickle as P
import re
import struct
import threading
import time
import types
import zipfile

import numpy as np
import pytest

from mdjax import io
from mdjax.io import lightning, tensors
from tests import attacks
from tests.io.test_dit_load import FIXTURES, Call, G, Storage, TorchLikePickler
from tests.io.test_load import assert_same

MEMORY_CAP = 32 << 20  # bytes a refused file may make the reader allocate (tracemalloc peak)
COLLIDING = (1 << 61) - 1  # hash(k * COLLIDING) == 0 for every int k


# --- pickles by opcode, archives by hand -------------------------------------------------


def u(text):
  data = text.encode()
  return P.BINUNICODE + struct.pack("<I", len(data)) + data


def n(value):
  if -2**31 <= value < 2**31:
    return P.BININT + struct.pack("<i", value)
  data = P.encode_long(value)
  return P.LONG4 + struct.pack("<i", len(data)) + data


def g(module, name):
  return P.GLOBAL + f"{module}\n{name}\n".encode()


def _memo(i):  # memo[i] = the value on top, which is dropped
  return P.BINPUT + bytes([i]) + P.POP


def _get(i):
  return P.BINGET + bytes([i])


def ints(values):
  return P.MARK + b"".join(n(v) for v in values) + P.TUPLE


def storage(key="0", numel=1, kind="FloatStorage"):
  return (P.MARK + u("storage") + g("torch", kind) + u(key) + u("cpu") + n(numel) + P.TUPLE
          + P.BINPERSID)


def tensor(stored, shape, stride, offset=0):
  return (g("torch._utils", "_rebuild_tensor_v2") + P.MARK + stored + n(offset) + ints(shape)
          + ints(stride) + P.TUPLE + P.REDUCE)


def state_dict(value, key=None):
  """{"state_dict": {key: value}} with the opcodes of `value` (and of `key`, "w" if None)."""
  return (P.EMPTY_DICT + u("state_dict") + P.EMPTY_DICT + (key or u("w")) + value + P.SETITEM
          + P.SETITEM)


def entry(value):
  return P.EMPTY_DICT + u("x") + value + P.SETITEM  # {"x": value}


def dict_state(**items):
  return P.EMPTY_DICT + b"".join(u(k) + v + P.SETITEM for k, v in items.items())


def pkl(body, proto=2):
  return P.PROTO + bytes([proto]) + body + P.STOP


def archive(path, data_pkl, storages=None, compress=zipfile.ZIP_STORED):
  storages = {"0": np.arange(4, dtype=np.float32).tobytes()} if storages is None else storages
  with zipfile.ZipFile(path, "w", compresslevel=1) as zf:
    zf.writestr("archive/data.pkl", data_pkl, compress_type=compress)
    zf.writestr("archive/byteorder", "little")
    for key, data in storages.items():
      zf.writestr(f"archive/data/{key}", data)
  return str(path)


def refused(path, match=""):
  """The ValueError read_ckpt raises: one line, naming the file first."""
  with pytest.raises(ValueError) as info:
    lightning.state_tensors(lightning.read_ckpt(path), path)
  text = str(info.value)
  assert text.startswith(f"{path}: ") and "\n" not in text, text
  assert re.search(match, text), text
  return text


def finishes(fn, fifo=None, timeout=10.0):
  """fn's result or exception, run in a thread; a reader blocked on `fifo` is let go (a writer
  opens and closes it) and the test fails as hung."""
  out = {}

  def run():
    try:
      out["value"] = fn()
    except BaseException as e:  # the thread reports what it raised
      out["error"] = e
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(timeout)
  if thread.is_alive():
    if fifo:
      os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    pytest.fail(f"hung for {timeout} s")
  return out


def test_hand_built_archive_reads(tmp_path):
  # The builders write a readable checkpoint: each attack below differs from it only in the
  # opcodes it adds.
  path = archive(tmp_path / "ok.ckpt", pkl(state_dict(tensor(storage(numel=4), (2, 2), (1, 2)))))
  t = lightning.state_tensors(lightning.read_ckpt(path), path)["w"]
  np.testing.assert_array_equal(t.read(), np.arange(4, dtype=np.float32).reshape(2, 2).T)


# --- 1: BUILD on the stand-ins -------------------------------------------------------------


def test_build_on_storage_cannot_read_another_file(tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_bytes(b"TOP-SECRET-0123456789")
  redirect = dict_state(path=u(str(secret)), begin=n(0), nbytes=n(16)) + P.BUILD
  path = archive(tmp_path / "x.ckpt",
                 pkl(state_dict(tensor(storage(numel=1) + redirect, (4,), (1,)))))
  with pytest.raises(ValueError, match=re.escape(f"{path}: refused to BUILD a _Storage")):
    leaked = lightning.state_tensors(lightning.read_ckpt(path), path)["w"].read().tobytes()
    pytest.fail(f"read {leaked!r} from {secret}")


def _function_stand_ins():
  return {f: (dict(vars(f)), f.__defaults__) for f in lightning._TENSOR_GLOBALS.values()
          if isinstance(f, types.FunctionType)}


@pytest.mark.parametrize("target,state,shown", [
    (g("torch._utils", "_rebuild_tensor_v2"), dict_state(x=n(1)), "function"),
    (g("torch._utils", "_rebuild_tensor_v2"),  # (state, slotstate): setattr(f, "__defaults__")
     P.NONE + dict_state(__defaults__=P.NEWTRUE + P.TUPLE1) + P.TUPLE2, "function"),
    (g("torch", "device"), dict_state(__kwdefaults__=P.EMPTY_DICT), "function"),
    (g("torch", "FloatStorage"), dict_state(name=u("DoubleStorage")), "_StorageType"),
    (tensor(storage(numel=4), (4,), (1,)),
     dict_state(shape=ints([10**9]), stride=ints([0])), "StoredTensor"),
    (g("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE,  # shadows OrderedDict.items
     dict_state(items=g("torch", "device")), "OrderedDict"),
], ids=["function", "function-defaults", "device-kwdefaults", "storage-type", "tensor",
        "ordereddict"])
def test_build_on_stand_ins_refused(tmp_path, target, state, shown):
  path = archive(tmp_path / "x.ckpt", pkl(entry(target + state + P.BUILD)))
  before = _function_stand_ins()
  try:
    refused(path, f"refused to BUILD a {shown}")
  finally:
    after = _function_stand_ins()
    for f, (attrs, defaults) in before.items():  # undo what an unchecked BUILD did
      f.__dict__.clear()
      f.__dict__.update(attrs)
      f.__defaults__ = defaults
  assert after == before


@pytest.mark.parametrize("target", [P.EMPTY_DICT, P.EMPTY_LIST, P.EMPTY_TUPLE, n(1), u("s"),
                                    g("builtins", "object") + P.EMPTY_TUPLE + P.REDUCE,
                                    g("builtins", "dict")],
                         ids=["dict", "list", "tuple", "int", "str", "object", "class"])
def test_build_on_plain_values_refused(tmp_path, target):
  path = archive(tmp_path / "x.ckpt", pkl(entry(target + dict_state(x=n(1)) + P.BUILD)))
  refused(path)


# --- FIFOs and swapped files --------------------------------------------------------------


def test_fifo_as_checkpoint_refused_without_hanging(tmp_path):
  fifo = str(tmp_path / "x.ckpt")
  os.mkfifo(fifo)
  out = finishes(lambda: lightning.read_ckpt(fifo), fifo)
  assert isinstance(out.get("error"), ValueError), out
  assert str(out["error"]).startswith(f"{fifo}: not a regular file")


def test_storage_maps_only_the_file_it_was_read_from(tmp_path):
  path = archive(tmp_path / "x.ckpt", pkl(state_dict(tensor(storage(numel=4), (4,), (1,)))))
  t = lightning.state_tensors(lightning.read_ckpt(path), path)["w"]
  os.mkfifo(tmp_path / "fifo")
  os.replace(tmp_path / "fifo", path)  # the path now names a FIFO
  out = finishes(t.read, path)
  assert isinstance(out.get("error"), ValueError), out
  assert re.match(re.escape(path) + ": changed since it was read", str(out["error"]))


# --- 3: small files, large allocations ----------------------------------------------------


@pytest.mark.parametrize("body,is_refused", [
    (g("builtins", "tuple") + g("builtins", "bytes") + n(2 * 10**7) + P.TUPLE1 + P.REDUCE
     + P.TUPLE1 + P.REDUCE, True),  # tuple(bytes(N)): ~180 MB unchecked
    (g("builtins", "bytes") + n(10**8) + P.TUPLE1 + P.REDUCE, True),
    (g("builtins", "bytes") + n(10**8) + P.TUPLE1 + P.NEWOBJ, True),
    (g("torch", "Size") + g("builtins", "bytes") + n(2 * 10**7) + P.TUPLE1 + P.REDUCE
     + P.TUPLE1 + P.REDUCE, True),
    # A memo index of 10**7: the C unpickler's memo is an array of that many pointers.
    (P.EMPTY_DICT + P.LONG_BINPUT + struct.pack("<I", 10**7), False),
], ids=["tuple-bytes", "bytes", "newobj-bytes", "size-bytes", "memo-index"])
def test_amplification_stays_under_memory_cap(tmp_path, body, is_refused):
  path = archive(tmp_path / "x.ckpt", pkl(entry(body)))
  out, peak = attacks.peak_bytes(lambda: lightning.read_ckpt(path))
  assert peak < MEMORY_CAP, f"{peak / 2**20:.0f} MiB"
  assert isinstance(out, ValueError) == is_refused, out
  if is_refused:
    assert str(out).startswith(f"{path}: refused to "), out


@pytest.mark.parametrize("member", ["data.pkl", "byteorder"])
def test_zip_bomb_refused_before_inflating(tmp_path, member):
  path = str(tmp_path / "bomb.ckpt")
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
    if member != "data.pkl":
      zf.writestr("archive/data.pkl", pkl(P.EMPTY_DICT))
    with zf.open(f"archive/{member}", "w", force_zip64=True) as bomb:
      for _ in range(128):  # 128 MiB of zeros in ~0.6 MB
        bomb.write(bytes(1 << 20))
  out, peak = attacks.peak_bytes(lambda: lightning.read_ckpt(path))
  assert peak < MEMORY_CAP, f"{peak / 2**20:.0f} MiB"
  assert isinstance(out, ValueError), out
  assert str(out).startswith(f"{path}: archive/{member} inflates to 134217728 bytes"), out


def test_deflated_pickle_capped_by_ratio_and_size(tmp_path, monkeypatch):
  zeros = pkl(entry(P.BINBYTES + struct.pack("<I", 2 << 20) + bytes(2 << 20)))
  path = archive(tmp_path / "ratio.ckpt", zeros, compress=zipfile.ZIP_DEFLATED)
  refused(path, r"archive/data.pkl inflates to \d+ bytes from \d+: over the \d+ bytes \(or "
          r"100x\)")
  monkeypatch.setattr(lightning, "MAX_PICKLE_BYTES", 1 << 20, raising=False)
  refused(archive(tmp_path / "big.ckpt", zeros), "archive/data.pkl inflates to")


def test_overlapping_tensor_refused_before_any_copy(tmp_path):
  # A stride-0 view of 10**9 elements over one 4-byte float: 4 GB once copied.
  path = archive(tmp_path / "x.ckpt", pkl(state_dict(tensor(storage(numel=1), (10**9,), (0,)))),
                 {"0": bytes(4)})
  refused(path, r"\(offset 0, shape \[1000000000\], stride \[0\]\) holds 1000000000 elements "
          "over the 1 of its storage")
  # And a StoredTensor given such a layout afterwards is refused when read.
  path = archive(tmp_path / "ok.ckpt", pkl(state_dict(tensor(storage(numel=4), (4,), (1,)))))
  t = lightning.state_tensors(lightning.read_ckpt(path), path)["w"]
  with pytest.raises(ValueError, match="holds 1000000000 elements over the 4"):
    dataclasses.replace(t, shape=(10**9,), stride=(0,)).read()
  # A legitimate expand() view (stride 0, no more elements than its storage) still reads.
  np.testing.assert_array_equal(dataclasses.replace(t, shape=(2, 2), stride=(0, 1)).read(),
                                [[0, 1], [0, 1]])


def _colliding(count):
  return b"".join(n(k * COLLIDING) for k in range(1, count + 1))


@pytest.mark.parametrize("body", [
    P.EMPTY_DICT + P.MARK + b"".join(n(k * COLLIDING) + P.NONE for k in range(1, 20001))
    + P.SETITEMS,
    g("builtins", "set") + P.EMPTY_LIST + P.MARK + _colliding(20000) + P.APPENDS + P.TUPLE1
    + P.REDUCE,
    P.MARK + _colliding(20000) + P.FROZENSET,
    P.EMPTY_SET + P.MARK + _colliding(20000) + P.ADDITEMS,
], ids=["dict", "set", "frozenset", "additems"])
def test_colliding_hash_keys_refused_fast(tmp_path, body):
  # 20,000 ints of one hash cost ~3 s unchecked (quadratic; 60,000 cost 23 s).
  path = archive(tmp_path / "x.ckpt", pkl(entry(body), proto=4))
  start = time.perf_counter()
  refused(path, "over 8 keys of one dict or set share a hash")
  assert time.perf_counter() - start < 1.0


def _repeat(setup, each, times):
  """A list of `times` results of `each` after `setup` (which memoizes what `each` gets)."""
  return setup + P.EMPTY_LIST + P.MARK + each * times + P.APPENDS


@pytest.mark.parametrize("body,match", [
    # str() of a 4,000-digit int, 3,000 times: int <-> str conversion is quadratic (~1 s).
    (_repeat(g("builtins", "str") + _memo(0) + n(10**3999) + P.TUPLE1 + _memo(1),
             _get(0) + _get(1) + P.REDUCE, 3000), "refused to call str"),
    # One 1 MB int as the key of 3,000 dicts: an int's hash is not cached (~2.5 s).
    (_repeat(P.LONG4 + struct.pack("<i", 1 << 20) + b"\1" * (1 << 20) + _memo(0),
             P.EMPTY_DICT + _get(0) + P.NONE + P.SETITEM, 3000), "steps to unpickle"),
    # 100 copies of a 1 MB string (_codecs.encode): 100 MB.
    (_repeat(g("_codecs", "encode") + _memo(0) + u("x" * (1 << 20)) + u("latin1") + P.TUPLE2
             + _memo(1), _get(0) + _get(1) + P.REDUCE, 100), "steps to unpickle"),
], ids=["int-str", "int-key", "copies"])
def test_repeated_work_on_memoized_values_is_charged(tmp_path, body, match):
  path = archive(tmp_path / "x.ckpt", pkl(entry(body)))
  start = time.perf_counter()
  out, peak = attacks.peak_bytes(lambda: lightning.read_ckpt(path))
  assert time.perf_counter() - start < 1.5
  # What MAX_STEPS allows copied (2M steps of 16 bytes) and the pickle: under 48 MB.
  assert peak < 48 << 20, f"{peak / 2**20:.0f} MiB"
  assert isinstance(out, ValueError) and re.search(match, str(out)), out


def test_steps_and_metadata_classes_capped(tmp_path, monkeypatch):
  monkeypatch.setattr(lightning, "MAX_STEPS", 1000, raising=False)
  refused(archive(tmp_path / "long.ckpt", pkl(P.NONE + (P.NONE + P.POP) * 1000)),
          "data.pkl takes over 1000 steps to unpickle")
  monkeypatch.undo()
  names = b"".join(g("omegaconf", f"C{i}") for i in range(1001))
  refused(archive(tmp_path / "classes.ckpt", pkl(P.MARK + names + P.LIST)),
          "data.pkl names over 1000 metadata classes")


# --- 6: deep nesting and malformed input: one ValueError naming the file ------------------


def test_deep_tuple_key_refused(tmp_path):
  # Unchecked, hashing a key 300,000 tuples deep overflows the C stack: the process crashes.
  deep = P.EMPTY_TUPLE + P.TUPLE1 * 300_000
  refused(archive(tmp_path / "x.ckpt", pkl(P.EMPTY_DICT + deep + P.NONE + P.SETITEM)),
          "a dict key or set item holds over 64 values")


def test_deep_frozenset_as_tensor_name_refused(tmp_path):
  # A name 5,000 frozensets deep: its repr (str(name)) raised RecursionError.
  deep = P.MARK + P.FROZENSET + (_memo(0) + P.MARK + _get(0) + P.FROZENSET) * 5000
  path = archive(tmp_path / "x.ckpt",
                 pkl(state_dict(tensor(storage(numel=4), (4,), (1,)), key=deep), proto=4))
  refused(path, "state_dict entry a frozenset is a StoredTensor: entries are tensors named by a "
          "str")


def _bad_local_header(path):
  with zipfile.ZipFile(path) as zf:
    offset = zf.getinfo("archive/data/0").header_offset
  with open(path, "r+b") as f:
    f.seek(offset)
    f.write(b"XX")


@pytest.mark.parametrize("data,fix,match", [
    (P.PROTO + b"\x09" + P.NONE + P.STOP, None, "unsupported pickle protocol"),
    (P.PROTO + b"\x02" + P.INT + b"12x\n" + P.STOP, None, "invalid literal"),
    (pkl(state_dict(tensor(n(5), (1,), (1,)))), None, "a tensor's storage is 5"),
    (pkl(entry(g("_codecs", "encode") + u("x") + u("rot13") + P.TUPLE2 + P.REDUCE)), None,
     "encoding 'rot13'"),
    (pkl(entry(g("torch._tensor", "_rebuild_from_type_v2") + P.MARK + g("torch", "device")
               + P.NONE + P.EMPTY_TUPLE + P.NONE + P.TUPLE + P.REDUCE)), None,
     "rebuild a tensor subclass"),
    (pkl(state_dict(tensor(storage(numel=4), (4,), (1,)))), _bad_local_header,
     "corrupt zip local header of archive/data/0"),
], ids=["protocol", "int", "storage", "codecs", "subclass", "local-header"])
def test_malformed_input_names_the_file(tmp_path, data, fix, match):
  path = archive(tmp_path / "x.ckpt", data)
  if fix:
    fix(path)
  refused(path, match)


# --- a checkpoint as torch writes it ------------------------------------------------------


class New:
  """An object torch's pickler writes as NEWOBJ (copyreg.__newobj__) then BUILD."""

  def __init__(self, cls, state, *args):
    self.cls, self.state, self.args = cls, state, args


class LightningPickler(TorchLikePickler):
  dispatch = dict(TorchLikePickler.dispatch)

  def save_new(self, obj):
    self.save_reduce(copyreg.__newobj__, (obj.cls,) + obj.args, obj.state, obj=None)

  dispatch[New] = save_new

  def reducer_override(self, obj):
    return NotImplemented if isinstance(obj, New) else super().reducer_override(obj)


@pytest.mark.parametrize("protocol", [2, 4])  # torch's default, and pickle_protocol=4's opcodes
def test_lightning_checkpoint_reads_as_before(tmp_path, protocol):
  fixture = os.path.join(FIXTURES, "mdlm")
  named = {n: np.asarray(tensors.read_tensor(i))
           for n, i in tensors.read_checkpoint(fixture).items()}
  names = list(named)

  def t(i):
    a = named[names[i]]
    return Call(G("torch._utils", "_rebuild_tensor_v2"), Storage(str(i), "FloatStorage", a.size),
                0, Call(G("torch", "Size"), a.shape), tuple(s // a.itemsize for s in a.strides),
                False, collections.OrderedDict())

  state = collections.OrderedDict((n, t(i)) for i, n in enumerate(names))
  state._metadata = collections.OrderedDict([("", {"version": 1})])  # what torch's has
  config = New(G("omegaconf.dictconfig", "DictConfig"), {
      "_metadata": New(G("omegaconf.base", "ContainerMetadata"), {"ref_type": G("typing", "Any"),
                                                                  "key_type": G("typing", "Any")}),
      "_content": {"model": {"length": 16}}})
  tokenizer = New(G("tokenizers", "Tokenizer"), b'{"version": "1.0"}', G("tokenizers.models",
                                                                         "BPE"))
  obj = {"epoch": 3, "global_step": 1000, "state_dict": state,
         "hyper_parameters": {"config": config, "tokenizer": tokenizer},
         "optimizer_states": [{"state": {0: {"step": Call(G("torch._utils", "_rebuild_tensor_v2"),
                                                             Storage("0", "FloatStorage", 4), 0,
                                                             (), (), False,
                                                             collections.OrderedDict())}},
                               "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.999),
                                                 "params": list(range(len(names)))}]}],
         "callbacks": {"ModelCheckpoint": {"best_k_models": collections.defaultdict(list),
                                           "dirpath": "/x", "s": {1, 2},
                                           "f": frozenset({("a", "b")}),
                                           "device": Call(G("torch", "device"), "cuda", 0),
                                           "raw": b"\x00\xff" * 100}}}
  buf = BytesIO()
  LightningPickler(buf, protocol=protocol).dump(obj)
  path = archive(tmp_path / "last.ckpt", buf.getvalue(),
                 {str(i): named[n].tobytes() for i, n in enumerate(names)})

  got = lightning.read_ckpt(path)
  read = lightning.state_tensors(got, path)
  assert list(read) == names
  for name in names:
    assert read[name].read().dtype == named[name].dtype
    assert read[name].read().tobytes() == named[name].tobytes(), name
  assert got["state_dict"]._metadata == {"": {"version": 1}}
  hp = got["hyper_parameters"]
  assert hp["config"].qualname == "omegaconf.dictconfig.DictConfig"
  assert hp["config"].state["_content"] == {"model": {"length": 16}}
  assert hp["tokenizer"].state == b'{"version": "1.0"}'
  assert got["optimizer_states"][0]["state"][0]["step"].read().shape == ()
  cb = got["callbacks"]["ModelCheckpoint"]
  assert (cb["s"], cb["f"], cb["device"], cb["raw"]) == ({1, 2}, frozenset({("a", "b")}),
                                                          "cuda:0", b"\x00\xff" * 100)
  assert type(cb["best_k_models"]) is collections.defaultdict
  # The loader takes it as it takes the fixture's folder.
  model = io.load(path, config=os.path.join(fixture, "config.json"))
  assert_same(model.params, io.load(fixture).params)
