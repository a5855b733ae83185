"""mdjax.io on MDLM and BD3-LM folders: both layouts' round trips, config.json mapping, bad
input, the restricted .ckpt reader (archives built by hand, without torch; a real torch.save
file where torch is importable) and the conversion command."""

import collections
import dataclasses
from io import BytesIO
import json
import os
import pathlib
import pickle
import tempfile
import typing
import warnings
import zipfile

import jax
import ml_dtypes
import numpy as np
import pytest

from mdjax import formats, io
from mdjax.formats.dit import ATTN_BACKENDS
from mdjax.io import lightning, tensors
from mdjax.models import dit
from tests.io.test_load import assert_same, tensor_bytes

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dit")


def tiny(family="mdlm", dtype="float32", **kw):
  base = dict(vocab_size=30, hidden_dim=16, cond_dim=8, n_blocks=2, n_heads=2, model_length=16,
              block_size=4 if family == "bd3lm" else None)
  return dit.DiTConfig(family=family, dtype=dtype, **{**base, **kw})


def random_params(config, seed=0):
  """Random values in every leaf (norms, biases, adaLN terms too), so a swapped or
  untransposed tensor shows."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda shape: rng.normal(size=shape).astype(config.jnp_dtype),
                      dit.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def write_folder(folder, raw, named):
  os.makedirs(folder, exist_ok=True)
  tensors.write_checkpoint(str(folder), named)
  tensors.write_json(os.path.join(folder, "config.json"), raw)
  return str(folder)


def hf_tensors(config, params):
  """The published names of a params pytree (written by save: one source of truth)."""
  with tempfile.TemporaryDirectory() as folder:
    io.save(params, folder, config=config)
    return {n: np.array(tensors.read_tensor(i))
            for n, i in tensors.read_checkpoint(folder).items()}


@pytest.fixture
def saved(tmp_path):
  """A saved tiny checkpoint's folder and its config.json."""
  def make(config, seed=0):
    folder = str(tmp_path / f"saved-{seed}")
    io.save(random_params(config, seed), folder, config=config)
    return folder, json.load(open(os.path.join(folder, "config.json")))
  return make


# --- layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("family,dtype,shard", [("mdlm", "float32", None),
                                                ("bd3lm", "bfloat16", None),
                                                ("bd3lm", "float32", 4000)])
@pytest.mark.slow
def test_round_trip(tmp_path, family, dtype, shard):
  config = tiny(family, dtype)
  params = random_params(config, 0)
  io.save(params, tmp_path / "a", config=config, max_shard_bytes=shard)
  model = io.load(tmp_path / "a")
  assert model.family == family and model.config == config
  assert_same(model.params, params)
  assert (model.mask_id, model.vocab_size, model.eos_id) == (30, 30, None)
  io.save(model, tmp_path / "b", max_shard_bytes=shard)
  assert tensor_bytes(tmp_path / "a") == tensor_bytes(tmp_path / "b")
  assert_same(io.load(tmp_path / "b").params, params)
  assert model.denoiser == dit.denoiser(config)


def test_published_names_and_config(tmp_path):
  config = tiny("bd3lm")
  params = random_params(config, 1)
  io.save(params, tmp_path, config=config)
  raw = json.load(open(tmp_path / "config.json"))
  assert raw["model_type"] == "bd3lm" and raw["architectures"] == ["BD3LM"]
  assert (raw["vocab_size"], raw["block_size"], raw["cross_attn"], raw["adaln"]) == (31, 4, True,
                                                                                  True)
  assert (raw["hidden_dim"], raw["cond_dim"], raw["n_blocks"], raw["n_heads"],
          raw["model_length"]) == (16, 8, 2, 2, 16)
  infos = tensors.read_checkpoint(str(tmp_path))
  assert infos["backbone.vocab_embed.embedding"].shape == (31, 16)
  assert infos["backbone.blocks.1.attn_qkv.weight"].shape == (48, 16)  # torch [out, in]
  assert infos["backbone.blocks.0.adaLN_modulation.weight"].shape == (96, 8)
  assert infos["backbone.sigma_map.mlp.0.weight"].shape == (8, 256)
  assert infos["backbone.output_layer.linear.weight"].shape == (31, 16)
  assert infos["backbone.output_layer.adaLN_modulation.bias"].shape == (32,)
  assert infos["backbone.rotary_emb.inv_freq"].shape == (4,)
  assert infos["sampling_eps_min"].shape == ()
  got = np.asarray(tensors.read_tensor(infos["backbone.blocks.1.attn_qkv.weight"]))
  np.testing.assert_array_equal(got, np.asarray(params["blocks"]["qkv"][1]).T)
  np.testing.assert_array_equal(np.asarray(tensors.read_tensor(
      infos["backbone.rotary_emb.inv_freq"])),
      (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32))


def test_config_mapping(tmp_path, saved):
  folder, raw = saved(tiny("mdlm"), 2)
  assert raw["model_type"] == "mdlm" and "block_size" not in raw and raw["vocab_size"] == 31
  # GPT-2's end of text, where config.json names it; the source's soft keys stand on save.
  raw.update(eos_token_id=29, dropout=0.0, auto_map={"AutoConfig": "x/y--c.C"})
  tensors.write_json(os.path.join(folder, "config.json"), raw)
  model = io.load(folder)
  assert model.eos_id == 29 and model.mask_id == 30
  io.save(model, tmp_path)
  out = json.load(open(tmp_path / "config.json"))
  assert (out["eos_token_id"], out["dropout"], out["auto_map"]) == (
      29, 0.0, {"AutoConfig": "x/y--c.C"})
  # BD3-LM without cross_attn attends bidirectionally: block_size unused.
  folder, raw = saved(tiny("bd3lm"), 3)
  tensors.write_json(os.path.join(folder, "config.json"), {**raw, "cross_attn": False})
  assert io.load(folder).config.block_size is None


def test_every_known_attn_backend_loads_without_a_warning(saved):
  config = tiny("bd3lm")
  folder, raw = saved(config, 4)
  for backend in ATTN_BACKENDS:
    tensors.write_json(os.path.join(folder, "config.json"), {**raw, "attn_backend": backend})
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert io.load(folder).config == config


def test_adaln_false_loads_as_constant_modulation(tmp_path):
  config = tiny("mdlm")
  params = random_params(config, 5)
  named = {n: v for n, v in hf_tensors(config, params).items()
           if "adaLN" not in n and "sigma_map" not in n}
  raw = {**formats.FORMATS["mdlm"].config_to_hf(config), "adaln": False}
  model = io.load(write_folder(tmp_path, raw, named))
  b = model.params["blocks"]
  assert not np.asarray(b["ada"]).any() and not np.asarray(model.params["final"]["ada_bias"]).any()
  np.testing.assert_array_equal(np.asarray(b["ada_bias"][0]).reshape(6, 16)[:, 0], [0, 0, 1, 0, 0, 1])
  # Whatever c is, ada(c) is the bias: shift 0, scale 0, gate 1 (the plain residual).
  c = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
  mods = c @ np.asarray(b["ada"][1]) + np.asarray(b["ada_bias"][1])
  np.testing.assert_array_equal(mods.reshape(3, 6, 16), np.broadcast_to(
      np.array([0, 0, 1, 0, 0, 1], np.float32)[None, :, None], (3, 6, 16)))
  assert_same({k: v for k, v in model.params["blocks"].items() if "ada" not in k},
              {k: v for k, v in params["blocks"].items() if "ada" not in k})


@pytest.mark.parametrize("change,match", [
    (dict(hidden_dim=15), "hidden_dim=15 is not divisible by n_heads=2"),
    (dict(block_size=3), "block_size=3 does not divide model_length=16"),
    (dict(model_type="sedd"), "'llada'.*'Dream'.*'mdlm'.*'bd3lm'"),
    (dict(causal=True), "causal=True"),
    (dict(adaln="yes"), "adaln='yes' is not a bool"),
    (dict(attn_backend="triton"), "attn_backend='triton'"),
    (dict(vocab_size=None), "missing 'vocab_size'"),
])
def test_bad_config(saved, change, match):
  folder, raw = saved(tiny("bd3lm"), 6)
  tensors.write_json(os.path.join(folder, "config.json"), {**raw, **change})
  with pytest.raises(ValueError, match=match):
    io.load(folder)


def test_missing_and_wrong_tensors(tmp_path):
  config = tiny("mdlm")
  named = hf_tensors(config, random_params(config, 7))
  raw = formats.FORMATS["mdlm"].config_to_hf(config)
  gone = {n: v for n, v in named.items() if n != "backbone.blocks.1.mlp.2.bias"}
  with pytest.raises(ValueError, match=r"missing tensor\(s\) backbone.blocks.1.mlp.2.bias"):
    io.load(write_folder(tmp_path / "a", raw, gone))
  bad = {**named, "backbone.rotary_emb.inv_freq": named["backbone.rotary_emb.inv_freq"] * 2}
  with pytest.raises(ValueError, match="rotary table"):
    io.load(write_folder(tmp_path / "b", raw, bad))
  # The embedding counts the mask id: V + 1 rows.
  with pytest.raises(ValueError, match=r"embedding' has shape \[31, 16\], expected \[30, 16\]"):
    io.load(write_folder(tmp_path / "c", {**raw, "vocab_size": 30}, named))


def test_save_refuses_what_the_layout_cannot_hold(tmp_path):
  config = tiny("bd3lm")
  params = random_params(config, 8)
  with pytest.raises(ValueError, match="block_size=4 cannot be written as mdlm"):
    io.save(params, tmp_path, config=dataclasses.replace(config, family="mdlm"))
  with pytest.raises(ValueError, match="rope_base=500.0"):
    io.save(params, tmp_path, config=dataclasses.replace(config, rope_base=500.0))


# --- the restricted .ckpt reader --------------------------------------------------------


class G:
  """A global as torch's pickles name it (written as a GLOBAL opcode, never imported)."""

  def __init__(self, module, name):
    self.module, self.name = module, name

  def __call__(self, *args):  # pickle's save_reduce asks for a callable
    raise AssertionError


class Call:
  def __init__(self, fn, *args):
    self.fn, self.args = fn, args


class Storage:
  def __init__(self, key, kind, numel):
    self.key, self.kind, self.numel = key, kind, numel


class TorchLikePickler(pickle._Pickler):
  """Writes the opcodes torch.save writes (protocol 2) without torch."""

  dispatch = dict(pickle._Pickler.dispatch)

  def save_g(self, obj):
    self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())

  dispatch[G] = save_g

  def reducer_override(self, obj):
    return (obj.fn, obj.args) if isinstance(obj, Call) else NotImplemented

  def persistent_id(self, obj):
    if isinstance(obj, Storage):
      return ("storage", G("torch", obj.kind), obj.key, "cpu", obj.numel)
    return None


KINDS = {np.dtype("float32"): "FloatStorage", np.dtype(ml_dtypes.bfloat16): "BFloat16Storage"}


def write_archive(path, obj_fn, arrays):
  """A torch zip archive: `obj_fn(tensor)` builds the pickled object, `tensor(i)` the i-th
  array's tensor."""
  def tensor(i):
    a = arrays[i]
    stride = tuple(s // a.itemsize for s in a.strides)
    return Call(G("torch._utils", "_rebuild_tensor_v2"), Storage(str(i), KINDS[a.dtype], a.size),
                0, tuple(a.shape), stride, False, Call(G("collections", "OrderedDict")))
  buf = BytesIO()
  TorchLikePickler(buf, protocol=2).dump(obj_fn(tensor))
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
    zf.writestr("archive/data.pkl", buf.getvalue())
    zf.writestr("archive/byteorder", "little")
    for i, a in enumerate(arrays):
      zf.writestr(f"archive/data/{i}", np.ascontiguousarray(a).tobytes())
    zf.writestr("archive/version", "3\n")
  return str(path)


def lightning_like(config, params, ema_params=None):
  """(arrays, obj_fn) of a Lightning checkpoint of the reference code: state_dict,
  optimizer state, OmegaConf hyper_parameters, EMA shadow params."""
  named = hf_tensors(config, params)
  names = list(named)
  arrays = [named[n] for n in names]
  shadow = []
  if ema_params is not None:
    ema_named = hf_tensors(config, ema_params)
    shadow = [n for n in names if n.startswith("backbone.") and not n.endswith("inv_freq")]
    arrays += [ema_named[n] for n in shadow]

  def obj_fn(tensor):
    state = Call(G("collections", "OrderedDict"),
                 [[f"_orig_mod.{n}" if n.startswith("backbone.") else n, tensor(i)]
                  for i, n in enumerate(names)])
    hp = Call(G("omegaconf.dictconfig", "DictConfig"), {"model": {"length": 16}})
    out = {"epoch": 3, "global_step": 1000, "pytorch-lightning_version": "2.2.1",
           "state_dict": state, "hyper_parameters": {"config": hp},
           "optimizer_states": [{"state": {0: {"step": 1.0}}, "param_groups": [
               {"lr": 3e-4, "betas": (0.9, 0.999), "params": [0]}]}],
           "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
           "callbacks": {"ModelCheckpoint{'monitor': 'val/nll'}": {"dirpath": "/x", "s": {1}}}}
    if shadow:
      out["ema"] = {"decay": 0.9999, "num_updates": 7,
                    "shadow_params": [tensor(len(names) + j) for j in range(len(shadow))]}
    return out
  return arrays, obj_fn


def test_ckpt_reader_by_hand(tmp_path):
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  b = np.arange(5).astype(ml_dtypes.bfloat16)
  path = write_archive(tmp_path / "x.ckpt", lambda t: {
      "state_dict": Call(G("collections", "OrderedDict"), [["a", t(0)], ["b", t(1)]]),
      "meta": {"k": (1, 2.5, "s", None, True), "raw": b"\x00\xff", "set": {3}}}, [a, b])
  obj = io.read_ckpt(path)
  assert obj["meta"] == {"k": (1, 2.5, "s", None, True), "raw": b"\x00\xff", "set": {3}}
  state = lightning.state_tensors(obj, path)
  np.testing.assert_array_equal(state["a"].read(), a)
  assert state["b"].read().dtype == ml_dtypes.bfloat16 and state["b"].dtype == "BF16"
  np.testing.assert_array_equal(state["b"].read().astype(np.float32), np.arange(5))


@pytest.mark.parametrize("module,name", [("os", "system"), ("posix", "system"),
                                         ("builtins", "eval"), ("__builtin__", "getattr"),
                                         ("subprocess", "Popen"),
                                         ("lightning_hack_not", "x")])
def test_ckpt_reader_refuses_code(tmp_path, module, name):
  path = write_archive(tmp_path / "evil.ckpt",
                       lambda t: {"state_dict": {"a": t(0)},
                                  "x": Call(G(module, name), "touch /tmp/pwned")},
                       [np.zeros(2, np.float32)])
  shown = "builtins" if module == "__builtin__" else module
  with pytest.raises(ValueError, match=f"refused to unpickle {shown}.{name}"):
    io.read_ckpt(path)
  with pytest.raises(ValueError, match=f"refused to unpickle {shown}.{name}"):
    io.load(path, config=tiny())


def test_ckpt_reader_bad_files(tmp_path):
  (tmp_path / "legacy.ckpt").write_bytes(pickle.dumps({"a": 1}))
  with pytest.raises(ValueError, match="not a zip archive.*convert_ckpt"):
    io.read_ckpt(tmp_path / "legacy.ckpt")
  path = write_archive(tmp_path / "short.ckpt", lambda t: {"a": t(0)}, [np.zeros(4, np.float32)])
  bad = dataclasses.replace(io.read_ckpt(path)["a"], shape=(8,), stride=(1,))
  with pytest.raises(ValueError, match="outside its storage"):
    bad.read()
  with pytest.raises(ValueError, match="missing tensor"):  # a bare state dict of other names
    io.load(path, config=tiny())
  path = write_archive(tmp_path / "none.ckpt", lambda t: {"epoch": 1}, [])
  with pytest.raises(ValueError, match="no state_dict of tensors"):
    io.load(path, config=tiny())


@pytest.mark.parametrize("family", ["mdlm", "bd3lm"])
def test_load_lightning_ckpt(tmp_path, family):
  config = tiny(family)
  params = random_params(config, 9)
  ema = random_params(config, 10)
  arrays, obj_fn = lightning_like(config, params, ema)
  path = write_archive(tmp_path / "last.ckpt", obj_fn, arrays)
  assert_same(io.load(path, config=config).params, ema)  # the EMA's by default
  assert_same(io.load(path, config=config, ema=False).params, params)
  # A folder holding the .ckpt and config.json: found beside it.
  tensors.write_json(str(tmp_path / "config.json"),
                     formats.FORMATS[family].config_to_hf(config))
  model = io.load(tmp_path)
  assert_same(model.params, ema)
  io.save(model, tmp_path / "hf")
  assert_same(io.load(tmp_path / "hf").params, ema)
  with pytest.raises(ValueError, match="no config.json beside it"):
    os.remove(tmp_path / "config.json")
    io.load(path)


def test_real_torch_save(tmp_path):
  torch = pytest.importorskip("torch")
  config = tiny("bd3lm", "bfloat16")
  params = random_params(config, 11)
  named = hf_tensors(config, params)

  def to_torch(a):
    if a.dtype == ml_dtypes.bfloat16:
      return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())
  state = collections.OrderedDict((n, to_torch(a)) for n, a in named.items())
  state["backbone.blocks.0.attn_qkv.weight"] = (  # a non-contiguous view, as torch may save
      state["backbone.blocks.0.attn_qkv.weight"].t().contiguous().t())
  torch.save({"state_dict": state, "epoch": 1,
              "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3)}}}]},
             tmp_path / "t.ckpt")
  model = io.load(tmp_path / "t.ckpt", config=config)
  assert_same(model.params, params)
  # The conversion command (torch.load(weights_only=True)) writes the same folder.
  from mdjax.io import convert_ckpt
  cfg = tmp_path / "config.json"
  tensors.write_json(str(cfg), formats.FORMATS["bd3lm"].config_to_hf(config))
  convert_ckpt.main([str(tmp_path / "t.ckpt"), str(tmp_path / "hf"), f"--config={cfg}"])
  assert_same(io.load(tmp_path / "hf").params, params)
  # Metadata torch's weights_only loader refuses: mdjax's reader skips it, never running it.
  torch.save({"state_dict": state, "hyper_parameters": {
      "any": typing.Any, "type": dict, "dtype": torch.bfloat16, "device": torch.device("cuda", 0),
      "path": pathlib.PurePosixPath("/data")}}, tmp_path / "meta.ckpt")
  hp = io.read_ckpt(tmp_path / "meta.ckpt")["hyper_parameters"]
  assert (hp["type"], hp["dtype"], hp["device"]) == (dict, "torch.bfloat16", "cuda:0")
  assert isinstance(hp["path"], lightning.Opaque)
  convert_ckpt.main([str(tmp_path / "meta.ckpt"), str(tmp_path / "hf2"), f"--config={cfg}"])
  assert_same(io.load(tmp_path / "hf2").params, params)


def test_convert_without_torch_reader(tmp_path):
  from mdjax.io import convert_ckpt
  config = tiny("mdlm")
  ema = random_params(config, 12)
  arrays, obj_fn = lightning_like(config, random_params(config, 13), ema)
  path = write_archive(tmp_path / "m.ckpt", obj_fn, arrays)
  cfg = tmp_path / "cfg.json"
  tensors.write_json(str(cfg), formats.FORMATS["mdlm"].config_to_hf(config))
  convert_ckpt.main([path, str(tmp_path / "hf"), f"--config={cfg}", "--reader=mdjax"])
  assert_same(io.load(tmp_path / "hf").params, ema)


# --- the reference fixtures -------------------------------------------------------------


def _fixture_folders():
  if not os.path.isdir(FIXTURES):
    return []
  return sorted(os.path.join(FIXTURES, d) for d in os.listdir(FIXTURES)
                if os.path.isfile(os.path.join(FIXTURES, d, "config.json")))


@pytest.mark.parametrize("folder", _fixture_folders() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no fixture folders in tests/fixtures/dit yet"))])
@pytest.mark.slow
def test_fixture_folders_load_and_round_trip(tmp_path, folder):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # a fixture may name a flash attention backend
    model = io.load(folder)
  assert model.family in ("mdlm", "bd3lm") and model.mask_id == model.config.vocab_size
  io.save(model, tmp_path)
  assert tensor_bytes(tmp_path) == tensor_bytes(folder)
