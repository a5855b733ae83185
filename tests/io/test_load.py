"""mdjax.io: the safetensors reader/writer, both layouts, load/save round trips, and
every bad input as a ValueError naming it."""

import dataclasses
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import formats, io
from mdjax.io import folder, tensors
from mdjax.mesh import partition_spec
from mdjax.models import published
from mdjax.models.dit import DiTConfig
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")

TINY = dict(vocab_size=64, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
            mlp_hidden=24, rope_theta=10000.0, max_len=128)


def tiny_config(family, dtype="float32", **kw):
  extra = (dict(norm_eps=1e-5, qkv_bias=False, logit_shift=False, mask_id=63, eos_id=1)
           if family == "llada" else
           dict(norm_eps=1e-6, qkv_bias=True, logit_shift=True, mask_id=62, eos_id=2))
  return published.PublishedConfig(family=family, dtype=dtype, **{**TINY, **extra, **kw})


def random_params(config, seed=0):
  """Random values in every leaf (norms and biases too), so a swapped or untransposed tensor
  shows."""
  rng = np.random.default_rng(seed)
  shapes = published.param_shapes(config)
  return jax.tree.map(lambda s: rng.normal(size=s).astype(config.jnp_dtype), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def assert_same(a, b):
  """The same tree, leaf for leaf the same dtype, shape and bytes."""
  fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in fa] == [p for p, _ in fb]
  for (path, x), (_, y) in zip(fa, fb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, path
    assert x.tobytes() == y.tobytes(), path


def tensor_bytes(folder):
  return {n: np.asarray(tensors.read_tensor(i)).tobytes()
          for n, i in tensors.read_checkpoint(folder).items()}


@pytest.fixture
def saved(tmp_path):
  """A saved tiny checkpoint: (folder, config, params)."""
  def make(family="llada", dtype="float32", **kw):
    config = tiny_config(family, dtype)
    params = random_params(config)
    folder = tmp_path / f"{family}-{dtype}"
    io.save(params, folder, config=config, **kw)
    return str(folder), config, params
  return make


# --- the safetensors format ----------------------------------------------------------------


def test_write_read_every_dtype(tmp_path):
  arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3),
            "bf16": np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16),
            "f16": np.ones((2, 2), np.float16), "i64": np.arange(3, dtype=np.int64),
            "empty": np.zeros((0, 4), np.float32)}
  path = str(tmp_path / "x.safetensors")
  tensors.write_file(path, arrays, {"format": "pt"})
  infos, metadata = tensors.read_header(path)
  assert metadata == {"format": "pt"}
  assert (8 + int.from_bytes(open(path, "rb").read(8), "little")) % 8 == 0  # aligned data
  for name, x in arrays.items():
    y = np.asarray(tensors.read_tensor(infos[name]))
    assert y.dtype == x.dtype and y.shape == x.shape and y.tobytes() == x.tobytes()
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]  # no temporary left


def test_interoperates_with_the_safetensors_package(tmp_path):
  st = pytest.importorskip("safetensors.numpy")
  x = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(3, dtype=np.int64)}
  tensors.write_file(str(tmp_path / "ours.safetensors"), x, {"format": "pt"})
  theirs = st.load_file(str(tmp_path / "ours.safetensors"))
  assert all(np.array_equal(theirs[k], x[k]) for k in x)
  st.save_file(x, str(tmp_path / "theirs.safetensors"))
  infos, _ = tensors.read_header(str(tmp_path / "theirs.safetensors"))
  assert all(np.array_equal(tensors.read_tensor(infos[k]), x[k]) for k in x)


def write_raw(path, header, data):
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("header, data, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12),
     "'b'.*overlaps tensor 'a'"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8),
     "'a'.*out of range"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
     "'a'.*8 bytes for shape \\[3\\]"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
     "'a'.*unknown dtype 'Q4'"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "'a'.*shape"),
    ([1, 2], b"", "not an object"),
])
def test_corrupt_headers(tmp_path, header, data, match):
  path = str(tmp_path / "bad.safetensors")
  write_raw(path, header, data)
  with pytest.raises(ValueError, match=f"bad.safetensors.*{match}"):
    tensors.read_header(path)


def test_corrupt_files(saved):
  folder, _, _ = saved()
  path = os.path.join(folder, "model.safetensors")
  good = open(path, "rb").read()
  n = int.from_bytes(good[:8], "little")
  cases = [
      (good[:-10], "out of range.*truncated"),  # truncated data
      (good[:5], "truncated"),  # not even a header length
      ((len(good) * 2).to_bytes(8, "little") + good[8:], "header length .* exceeds"),
      (good[:8] + b"{" * n + good[8 + n:], "not JSON"),
  ]
  for data, match in cases:
    with open(path, "wb") as f:
      f.write(data)
    with pytest.raises(ValueError, match=f"model.safetensors.*{match}"):
      io.load(folder)


# --- layouts ------------------------------------------------------------------------------


LLADA_8B_INSTRUCT = {  # the published config.json, less auto_map
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
    "block_group_size": 1, "block_type": "llama", "d_model": 4096, "embedding_dropout": 0.0,
    "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
    "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
    "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
    "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4, "model_type": "llada",
    "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32, "n_layers": 32,
    "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
    "scale_logits": False, "use_cache": False, "vocab_size": 126464, "weight_tying": False}

DREAM_7B = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "mask_token_id": 151666,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "Dream",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "pad_token_id": 151643, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": False, "use_sliding_window": False,
    "vocab_size": 152064}


def test_published_configs():
  llada = formats.detect(LLADA_8B_INSTRUCT, "x").config_from_hf(LLADA_8B_INSTRUCT, "bfloat16")
  assert (llada.family, llada.vocab_size, llada.d_model, llada.num_layers, llada.num_heads,
          llada.num_kv_heads, llada.head_dim, llada.mlp_hidden) == (
              "llada", 126464, 4096, 32, 32, 32, 128, 12288)
  assert (llada.mask_id, llada.eos_id, llada.eot_id, llada.rope_theta, llada.qkv_bias,
          llada.logit_shift, llada.max_len) == (126336, 126081, 126348, 5e5, False, False, 4096)
  dream = formats.detect(DREAM_7B, "x").config_from_hf(DREAM_7B, "bfloat16")
  assert (dream.family, dream.vocab_size, dream.num_kv_heads, dream.head_dim, dream.mask_id,
          dream.eos_id, dream.rope_theta, dream.norm_eps, dream.qkv_bias, dream.logit_shift) == (
              "dream", 152064, 4, 128, 151666, 151643, 1e6, 1e-6, True, True)
  # Written back, the architecture keys are the published ones; nothing is made up.
  for raw, cfg in ((LLADA_8B_INSTRUCT, llada), (DREAM_7B, dream)):
    back = formats.FORMATS[cfg.family].config_to_hf(cfg)
    shared = [k for k in back if k in raw]
    assert {k: back[k] for k in shared} == {k: raw[k] for k in shared}
    assert set(back) - set(raw) <= {"torch_dtype", "eot_token_id"}
    assert formats.FORMATS[cfg.family].config_from_hf(back, "bfloat16") == cfg


def test_hf_tensor_names_and_orientation(saved):
  folder, config, params = saved("llada")
  infos = tensors.read_checkpoint(folder)
  d, f, v = config.d_model, config.mlp_hidden, config.vocab_size
  assert infos["model.transformer.blocks.1.ff_proj.weight"].shape == (f, d)  # torch [out, in]
  assert infos["model.transformer.blocks.1.ff_out.weight"].shape == (d, f)
  assert infos["model.transformer.ff_out.weight"].shape == (v, d)
  gate = np.asarray(tensors.read_tensor(infos["model.transformer.blocks.1.ff_proj.weight"]))
  np.testing.assert_array_equal(gate.T, params["layers"]["gate"][1])
  assert len(infos) == 3 + 2 * 9  # embed, final_norm, head; 9 per layer
  folder, config, params = saved("dream")
  infos = tensors.read_checkpoint(folder)
  k = np.asarray(tensors.read_tensor(infos["model.layers.0.self_attn.k_proj.weight"]))
  np.testing.assert_array_equal(k.T, params["layers"]["k"][0])
  kb = np.asarray(tensors.read_tensor(infos["model.layers.1.self_attn.k_proj.bias"]))
  np.testing.assert_array_equal(kb, params["layers"]["k_bias"][1])
  assert infos["lm_head.weight"].shape == (v, d)
  assert len(infos) == 3 + 2 * 12


# --- load and save -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_round_trip(saved, tmp_path, family, dtype):
  folder, config, params = saved(family, dtype)
  model = io.load(folder)
  assert model.config == config and model.family == family
  assert (model.mask_id, model.eos_id, model.vocab_size) == (
      config.mask_id, config.eos_id, config.vocab_size)
  assert model.tokenizer is None and model.chat_template is None
  assert model.bytes_read == sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
  assert callable(model.denoiser.apply)
  assert_same(params, model.params)
  with open(os.path.join(folder, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == dtype
  # load -> save -> load: the same tensor bytes, the same params.
  again = str(tmp_path / "again")
  io.save(model, again)
  assert tensor_bytes(again) == tensor_bytes(folder)
  assert_same(model.params, io.load(again).params)


def test_cast_on_load_and_save(saved, tmp_path):
  folder, config, params = saved("dream", "float32")
  model = io.load(folder, dtype="bfloat16")
  assert model.config.dtype == "bfloat16"
  assert_same(jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params), model.params)
  io.save(io.load(folder), tmp_path / "bf16", dtype="bfloat16")
  assert {i.dtype for i in tensors.read_checkpoint(str(tmp_path / "bf16")).values()} == {"BF16"}
  assert_same(model.params, io.load(tmp_path / "bf16").params)


def test_sharded_round_trip(saved, tmp_path):
  folder, config, params = saved("llada", max_shard_bytes=4096)
  files = sorted(os.listdir(folder))
  shards = [f for f in files if f.startswith("model-0")]
  assert len(shards) > 2 and "model.safetensors" not in files
  assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  with open(os.path.join(folder, "model.safetensors.index.json")) as f:
    index = json.load(f)
  assert set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(
      np.asarray(x).nbytes for x in jax.tree.leaves(params))
  assert all(os.path.getsize(os.path.join(folder, s)) < 4096 + 2048 for s in shards)
  model = io.load(folder)
  assert_same(params, model.params)
  # Saved again in one file (into the same folder): the stale index goes, the data stay.
  io.save(model, folder)
  assert not os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
  assert_same(params, io.load(folder).params)


def test_tied_head(saved):
  folder, config, params = saved("dream")
  raw = json.load(open(os.path.join(folder, "config.json")))
  raw["tie_word_embeddings"] = True
  json.dump(raw, open(os.path.join(folder, "config.json"), "w"))
  infos = tensors.read_checkpoint(folder)
  tensors.write_file(os.path.join(folder, "model.safetensors"),
                     {n: np.asarray(tensors.read_tensor(i)) for n, i in infos.items()
                      if n != "lm_head.weight"})
  model = io.load(folder)
  np.testing.assert_array_equal(model.params["head"], params["embed"].T)


def test_tokenizer_and_chat_template(saved, tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  folder, _, _ = saved("llada")
  # 64 ids, as many as the tiny config's vocabulary: it holds the mask (63) and EOS (1) ids.
  vocab = {"a": 0, "b": 1, "[UNK]": 2, **{f"<{i}>": i for i in range(3, 64)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(os.path.join(folder, "tokenizer.json"))
  template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": template}, f)
  model = io.load(folder)
  assert model.tokenizer.encode("a b").ids == [0, 1]
  assert model.chat_template == template
  io.save(model, tmp_path / "copy")
  copy = io.load(tmp_path / "copy")
  assert copy.tokenizer.encode("b a").ids == [1, 0] and copy.chat_template == template
  # Without a source folder the tokenizer is serialized and the template gets its own file.
  io.save(dataclasses.replace(model, source=None), tmp_path / "fresh")
  fresh = io.load(tmp_path / "fresh")
  assert fresh.tokenizer.encode("a").ids == [0] and fresh.chat_template == template


def test_save_keeps_the_source_config_keys(saved, tmp_path):
  folder, _, _ = saved("dream")
  auto_map = {"AutoConfig": "configuration_dream.DreamConfig",
              "AutoModel": "modeling_dream.DreamModel"}
  edit_config(folder, pad_token_id=7, bos_token_id=3, auto_map=auto_map, num_hidden_layers=2)
  for name in ("configuration_dream.py", "modeling_dream.py"):
    with open(os.path.join(folder, name), "w") as f:
      f.write("# the published modeling code\n")
  io.save(io.load(folder), tmp_path / "a")
  raw = json.load(open(tmp_path / "a" / "config.json"))
  assert (raw["pad_token_id"], raw["bos_token_id"], raw["auto_map"]) == (7, 3, auto_map)
  assert os.path.isfile(tmp_path / "a" / "modeling_dream.py")
  # Without the files it names, auto_map would point at nothing: it is dropped.
  os.remove(os.path.join(folder, "modeling_dream.py"))
  io.save(io.load(folder), tmp_path / "b")
  assert "auto_map" not in json.load(open(tmp_path / "b" / "config.json"))


def test_mesh_sharding(saved):
  folder, config, params = saved("dream")
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  model = io.load(folder, mesh=mesh)
  spec = lambda x: x.sharding.spec  # noqa: E731
  assert isinstance(model.params["embed"].sharding, NamedSharding)
  assert spec(model.params["embed"]) == PartitionSpec("fsdp", None)  # [V, D]: V is larger
  assert spec(model.params["head"]) == PartitionSpec(None, "fsdp")  # [D, V]
  assert spec(model.params["layers"]["gate"]) == PartitionSpec(None, None, "fsdp")  # [N, D, F]
  assert spec(model.params["layers"]["down"]) == PartitionSpec(None, "fsdp", None)  # [N, F, D]
  assert spec(model.params["layers"]["k"]) == PartitionSpec(None, "fsdp", None)  # [N, D, G*K]
  assert spec(model.params["final_norm"]) == PartitionSpec()
  assert_same(params, model.params)


def test_mesh_axis_must_divide():
  assert partition_spec("t", (16, 64), "fsdp", 8) == PartitionSpec(None, "fsdp")
  assert partition_spec("t", (2, 24, 16), "fsdp", 3, stacked=True) == PartitionSpec(
      None, "fsdp", None)
  assert partition_spec("t", (2, 24), "fsdp", 5, stacked=True) == PartitionSpec()
  with pytest.raises(ValueError, match=r"tensor layers/gate \(2, 16, 24\): dim 2 of size 24 .*"
                                       r"not divisible by mesh axis 'fsdp' of size 5"):
    partition_spec("layers/gate", (2, 16, 24), "fsdp", 5, stacked=True)


# --- bad input -----------------------------------------------------------------------------


def edit_config(folder, **changes):
  path = os.path.join(folder, "config.json")
  raw = json.load(open(path))
  raw.update(changes)
  json.dump(raw, open(path, "w"))


def rewrite(folder, drop=(), add=None, replace=None):
  """Rewrites model.safetensors without `drop`, with `add` and with `replace` tensors."""
  infos = tensors.read_checkpoint(folder)
  arrays = {n: np.array(tensors.read_tensor(i)) for n, i in infos.items() if n not in drop}
  arrays.update(add or {})
  arrays.update(replace or {})
  tensors.write_file(os.path.join(folder, "model.safetensors"), arrays)


def test_bad_folders(tmp_path, saved):
  with pytest.raises(ValueError, match="not a folder"):
    io.load(tmp_path / "nowhere")
  with pytest.raises(ValueError, match="no config.json"):
    io.load(tmp_path)
  folder, _, _ = saved("llada")
  with pytest.raises(ValueError, match="unsupported dtype 'float16'"):
    io.load(folder, dtype="float16")
  os.remove(os.path.join(folder, "model.safetensors"))
  with pytest.raises(ValueError, match="no weights"):
    io.load(folder)


def test_unknown_family(saved):
  folder, _, _ = saved("llada")
  edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(ValueError, match="unsupported model_type='gpt2'.*supported.*'llada'.*"
                                       "'LLaDAModelLM'.*'Dream'.*'DreamModel'"):
    io.load(folder)


def test_unsupported_architecture_keys(saved):
  folder, _, _ = saved("llada")
  edit_config(folder, block_type="sequential")
  with pytest.raises(ValueError, match="block_type='sequential' is not supported"):
    io.load(folder)
  edit_config(folder, block_type="llama", include_bias=True)
  with pytest.raises(ValueError, match="include_bias=True is not supported"):
    io.load(folder)


def test_missing_extra_and_misshapen_tensors(saved):
  folder, config, _ = saved("dream")
  rewrite(folder, drop=["model.layers.1.mlp.up_proj.weight"])
  with pytest.raises(ValueError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
    io.load(folder)
  folder, config, _ = saved("llada")
  rewrite(folder, add={"model.transformer.blocks.0.attn_out.bias": np.zeros(16, np.float32)})
  with pytest.raises(ValueError, match="unexpected tensor.*blocks.0.attn_out.bias"):
    io.load(folder)
  rewrite(folder, drop=["model.transformer.blocks.0.attn_out.bias"],
          replace={"model.transformer.blocks.1.q_proj.weight": np.zeros((16, 12), np.float32)})
  with pytest.raises(ValueError, match=r"'model.transformer.blocks.1.q_proj.weight' has shape "
                                       r"\[16, 12\], expected \[16, 16\]"):
    io.load(folder)
  rewrite(folder, replace={"model.transformer.blocks.1.q_proj.weight":
                           np.zeros((16, 16), np.int32)})
  with pytest.raises(ValueError, match="q_proj.weight' is I32, not a float"):
    io.load(folder)
  # A config that disagrees with the tensors names the tensor it disagrees on.
  rewrite(folder, replace={"model.transformer.blocks.1.q_proj.weight":
                           np.zeros((16, 16), np.float32)})
  edit_config(folder, mlp_hidden_size=32)
  with pytest.raises(ValueError, match=r"blocks.0.ff_proj.weight' has shape \[24, 16\], "
                                       r"expected \[32, 16\]"):
    io.load(folder)


def test_bad_sharded_index(saved):
  folder, _, _ = saved("llada", max_shard_bytes=4096)
  second = sorted(f for f in os.listdir(folder) if f.startswith("model-0"))[1]
  os.remove(os.path.join(folder, second))
  with pytest.raises(ValueError, match="shard file 'model-00002-of-.*' is missing"):
    io.load(folder)
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(ValueError, match="index.json: unreadable"):
    io.load(folder)


def test_bad_save_inputs(tmp_path):
  config = tiny_config("llada")
  params = random_params(config)
  with pytest.raises(ValueError, match="needs config="):
    io.save(params, tmp_path)
  with pytest.raises(ValueError, match="family='dream' but config.family='llada'"):
    io.save(params, tmp_path, config=config, family="dream")
  with pytest.raises(ValueError, match=r"layers/up has shape \[2, 16, 8\], expected \[2, 16, 24\]"):
    io.save({**params, "layers": {**params["layers"], "up": np.zeros((2, 16, 8))}},
                    tmp_path, config=config)
  with pytest.raises(ValueError, match="missing \\['head'\\]"):
    io.save({k: v for k, v in params.items() if k != "head"}, tmp_path, config=config)
  with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
    io.save(params, tmp_path, config=config, dtype="int8")
  assert not os.listdir(tmp_path)


# --- a tokenizer.json that does not fit the checkpoint -------------------------------------


class SizedTokenizer:
  """What the check asks of a tokenizer: its size and which ids hold a token."""

  def __init__(self, size, holes=()):
    self.size, self.holes = size, set(holes)

  def get_vocab_size(self, with_added_tokens=True):
    return self.size

  def id_to_token(self, token_id):
    return None if token_id >= self.size or token_id in self.holes else f"<{token_id}>"


def test_published_tokenizers_fit_their_checkpoints():
  """The rule holds for every published layout: LLaDA's tokenizer (126349 ids) is smaller
  than its embedding and holds the mask id; Dream's holds 151666; MDLM / BD3-LM's GPT-2
  tokenizer has 50257 ids and the mask id V = 50257 lies outside it."""
  check = folder.check_tokenizer
  llada = formats.detect(LLADA_8B_INSTRUCT, "x").config_from_hf(LLADA_8B_INSTRUCT, "bfloat16")
  dream = formats.detect(DREAM_7B, "x").config_from_hf(DREAM_7B, "bfloat16")
  check(SizedTokenizer(126349), llada, LLADA_8B_INSTRUCT, "llada/tokenizer.json")
  check(SizedTokenizer(151667), dream, DREAM_7B, "dream/tokenizer.json")
  for family, block_size in (("mdlm", None), ("bd3lm", 16)):
    owt = DiTConfig(family=family, vocab_size=50257, hidden_dim=768, cond_dim=128, n_blocks=12,
                    n_heads=12, model_length=1024, block_size=block_size)
    check(SizedTokenizer(50257), owt, {"eos_token_id": 50256}, "owt/tokenizer.json")
    with pytest.raises(ValueError, match=r"owt/tokenizer.json: the tokenizer has 50259 ids, "
                                         r"more than the checkpoint's vocabulary of 50258"):
      check(SizedTokenizer(50259), owt, {}, "owt/tokenizer.json")
  with pytest.raises(ValueError, match=r"\(126336 ids\) has no token at the mask id 126336"):
    check(SizedTokenizer(126336), llada, LLADA_8B_INSTRUCT, "llada/tokenizer.json")
  with pytest.raises(ValueError, match=r"has no token at the EOS id 151643"):
    check(SizedTokenizer(151667, holes=[151643]), dream, DREAM_7B, "dream/tokenizer.json")


def word_tokenizer(ids):
  tokenizers = pytest.importorskip("tokenizers")
  ids = list(ids)
  return tokenizers.Tokenizer(tokenizers.models.WordLevel({f"<{i}>": i for i in ids},
                                                          unk_token=f"<{ids[0]}>"))


@pytest.mark.parametrize("tokenizer, match", [
    pytest.param("qwen2", r"the tokenizer \(300 ids\) has no token at the mask id 300",
                 id="another-models"),
    pytest.param(range(400), r"the tokenizer has 400 ids, more than the checkpoint's "
                 r"vocabulary of 320", id="too-large"),
    pytest.param([i for i in range(320) if i != 290],
                 r"the tokenizer \(319 ids\) has no token at the EOS id 290", id="no-eos"),
    pytest.param([i for i in range(320) if i != 310],
                 r"the tokenizer \(319 ids\) has no token at the EoT id 310", id="no-eot"),
])
def test_a_tokenizer_that_does_not_fit_is_refused(tmp_path, monkeypatch, tokenizer, match):
  """Another model's tokenizer.json (the Qwen2 judge's 300 ids for LLaDA's 320) would decode
  garbage: refused before any weight is read."""
  folder = shutil.copytree(os.path.join(FIXTURES, "pretrained", "llada"), tmp_path / "llada")
  if tokenizer == "qwen2":
    shutil.copy(os.path.join(FIXTURES, "judge", "qwen2", "tokenizer.json"), folder)
  else:
    word_tokenizer(tokenizer).save(str(folder / "tokenizer.json"))

  def no_weight(info):
    raise AssertionError(f"tensor {info.name} was read")
  monkeypatch.setattr(tensors, "read_tensor", no_weight)
  with pytest.raises(ValueError, match=r"llada/tokenizer\.json: " + match):
    io.load(folder)


def test_mdlm_mask_id_lies_outside_its_tokenizer(tmp_path):
  folder = shutil.copytree(os.path.join(FIXTURES, "dit", "mdlm"), tmp_path / "mdlm")
  word_tokenizer(range(40)).save(str(folder / "tokenizer.json"))  # V = 40 ids, mask id 40
  model = io.load(folder)
  assert model.mask_id == 40 and model.tokenizer.id_to_token(40) is None
  word_tokenizer(range(42)).save(str(folder / "tokenizer.json"))
  with pytest.raises(ValueError, match=r"mdlm/tokenizer\.json: the tokenizer has 42 ids, more "
                                       r"than the checkpoint's vocabulary of 41"):
    io.load(folder)


# --- save into a folder that held a save --------------------------------------------------


def weight_files(folder):
  return sorted(f for f in os.listdir(folder) if f.startswith("model"))


def test_save_removes_the_previous_saves_weight_files(saved):
  folder, config, params = saved("llada", max_shard_bytes=4096)
  sharded = weight_files(folder)
  assert len(sharded) > 3 and "model.safetensors.index.json" in sharded
  keep = ["notes.txt", "model-00001-of-00002.safetensors.bak", "model-1-of-2.safetensors"]
  for name in keep:
    with open(os.path.join(folder, name), "w") as f:
      f.write("mine")
  io.save(params, folder, config=config)  # one file: the shards and index go
  assert weight_files(folder) == sorted(["model.safetensors"] + keep[1:])
  assert_same(params, io.load(folder).params)
  io.save(params, folder, config=config, max_shard_bytes=4096)  # and back
  assert weight_files(folder) == sorted(sharded + keep[1:])
  assert_same(params, io.load(folder).params)
  io.save(params, folder, config=config, max_shard_bytes=8192)  # fewer shards
  shards = [f for f in os.listdir(folder) if tensors.SHARD_NAME.fullmatch(f)]
  assert 1 < len(shards) < len(sharded) - 1
  assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
  assert_same(params, io.load(folder).params)
  assert set(keep) <= set(os.listdir(folder))


def test_save_unlinks_a_link_named_like_a_shard_and_never_follows_it(saved, tmp_path):
  folder, config, params = saved("llada", max_shard_bytes=4096)
  victim = tmp_path / "victim.safetensors"
  victim.write_bytes(b"victim")
  for name in ("model-00001-of-00099.safetensors", "model.safetensors"):
    os.symlink(victim, os.path.join(folder, name))
  os.symlink(tmp_path / "gone", os.path.join(folder, "model-00002-of-00099.safetensors"))
  os.mkdir(os.path.join(folder, "model-00003-of-00099.safetensors"))  # not a file: not ours
  os.mkfifo(os.path.join(folder, "model-00004-of-00099.safetensors"))
  io.save(params, folder, config=config, max_shard_bytes=4096)
  assert victim.read_bytes() == b"victim"
  left = [f for f in weight_files(folder) if "-of-00099" in f]
  assert left == ["model-00003-of-00099.safetensors", "model-00004-of-00099.safetensors"]
  assert not any(os.path.islink(os.path.join(folder, f)) for f in os.listdir(folder))
  assert_same(params, io.load(folder).params)
