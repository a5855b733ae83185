"""Loading and saving Hugging Face folders of the published checkpoints (LLaDA, Dream, MDLM,
BD3-LM, the Llama / Qwen2 judges), and reading torch / Lightning `.ckpt` files of MDLM and
BD3-LM. What each family's folder holds is its file of `mdjax.formats`; `load` returns
the one `mdjax.model.Model`.

`load` checks everything it can before it reads a weight: the folder, config.json, the
family, every safetensors header against its file, the set of tensors and each one's shape and
dtype against the config, and (with a mesh) that each sharded dimension divides. Then it
streams: one tensor at a time is mapped from its file, transposed and cast on the host, and put
on the device(s); a stacked "layers" leaf is allocated on the device and filled layer by layer
in place (a donated update), so the host holds about one tensor at a time, never the model.

Sharding with a mesh (FSDP style): `mdjax.mesh`'s rule over the mesh's first axis, the one
training uses: every matrix (of one layer, for stacked leaves) is split along its largest
dimension that the axis size divides, the layer axis is not split, vectors (norms, biases)
are replicated; other mesh axes replicate everything. A matrix that no dimension divides is
a ValueError naming the tensor, its shape and the axis size. A mesh with 'tensor' or
'expert' axes splits heads, hidden columns and experts instead (`mdjax.mesh.load_spec`,
docs/devices.md). The mesh may have Explicit axes (`jax.make_mesh`'s default): the
parameters are placed on its Auto-axes twin.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import files as files_lib
from mdjax import formats, quantize
from mdjax.formats import base as format_base
from mdjax.io import lightning
from mdjax.io import tensors as tensors_lib
from mdjax.io.chat_template import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from mdjax.io.record import published_model
from mdjax.lazy import Lazy
from mdjax.mesh import auto_axes, load_spec
from mdjax.model import Model
from mdjax.models.dit import DiTConfig
from mdjax.models.published import DTYPES, PublishedConfig
from mdjax.tokenizers import TOKENIZER_FILE
from mdjax.tokenizers import load_hf_tokenizer as _load_tokenizer

CONFIG_FILE = "config.json"
# Files beside the weights that `save` copies from the folder a model was loaded from.
SIDE_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
              CHAT_TEMPLATE_FILE, "generation_config.json")
# Checkpoint dtype codes that load as they are when no dtype is asked for.
_NATIVE = {"F32": "float32", "BF16": "bfloat16"}
_FLOATS = ("F64", "F32", "F16", "BF16")


# ----------------------------------------------------------------------------
# Sharding.
# ----------------------------------------------------------------------------


# The FSDP rule, `partition_spec` included, is `mdjax.mesh`'s.


@functools.lru_cache(maxsize=None)
def _zeros(shape, dtype, sharding):
  return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _set_layer(sharding):
  # Donating the stacked array updates it in place: no second copy of the leaf on the device.
  return jax.jit(lambda stacked, layer, i: lax.dynamic_update_index_in_dim(stacked, layer, i, 0),
                 donate_argnums=0, out_shardings=sharding)


# ----------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------


def _check_dtype(dtype):
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r} (supported: None, {', '.join(DTYPES)})")


def _read_json(path: str) -> dict:
  return files_lib.read_json(path, "JSON")


_read_text = files_lib.read_text


def _checkpoint_dtype(infos, needed: list[str], embed: str, folder: str) -> str:
  """The dtype a checkpoint loads in when none is asked for: its tensors' (or, when they
  differ, its embedding's)."""
  codes = {infos[n].dtype for n in needed}
  code = codes.pop() if len(codes) == 1 else infos[embed].dtype
  if code not in _NATIVE:
    raise ValueError(f"{folder}: the checkpoint's tensors are {code}, which loads only when "
                     f"cast: pass dtype='bfloat16' or 'float32'")
  return _NATIVE[code]


def _host(info: tensors_lib.TensorInfo, transpose: bool, dtype: np.dtype) -> np.ndarray:
  """One tensor on the host in the params' order and dtype (a copy: the file's map is closed
  when this returns)."""
  mapped = _read(info)
  out = np.array(mapped.T if transpose else mapped, dtype=dtype, order="C")
  del mapped
  return out


def check_tokenizer(tokenizer, config, raw: dict, path: str) -> None:
  """Refuses a tokenizer.json that does not fit the checkpoint (another model's, which would
  decode garbage): more ids than the logits have, or no token at an id the config names (mask,
  EOS, EoT). MDLM / BD3-LM's mask id V lies outside their tokenizer (GPT-2's) by design."""
  if tokenizer is None:
    return
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  if isinstance(config, DiTConfig):  # logits over V ids and the mask id V
    rows = config.vocab_size + 1
    named = {"EOS": format_base.config_token_id(raw, "eos_token_id", config.family)}
  else:  # LLaDA's tokenizer is smaller than its embedding and holds the mask id
    rows = config.vocab_size
    named = {"mask": config.mask_id, "EOS": config.eos_id, "EoT": config.eot_id}
  if size > rows:
    raise ValueError(f"{path}: the tokenizer has {size} ids, more than the checkpoint's "
                     f"vocabulary of {rows} (its logits): another model's tokenizer?")
  for name, token_id in named.items():
    if token_id is not None and tokenizer.id_to_token(token_id) is None:
      raise ValueError(f"{path}: the tokenizer ({size} ids) has no token at the {name} id "
                       f"{token_id} that config.json names: another model's tokenizer?")


def read_chat_template(folder: str) -> str | None:
  """The folder's chat template (chat_template.jinja, else tokenizer_config.json's); None."""
  path = os.path.join(folder, CHAT_TEMPLATE_FILE)
  if files_lib.regular_file(path):
    return _read_text(path)
  path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
  if not files_lib.regular_file(path):
    return None
  template = _read_json(path).get("chat_template")
  if isinstance(template, list):  # named templates ([{"name", "template"}]): the default one
    if not all(isinstance(t, dict) for t in template):
      raise ValueError(f"{path}: chat_template is a list whose items are not all "
                       "{\"name\", \"template\"} objects")
    template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  if template is not None and not isinstance(template, str):
    raise ValueError(f"{path}: chat_template is a {type(template).__name__}, not a string (or "
                     "a list of named templates)")
  return template


CKPT_SUFFIXES = (".ckpt", ".pt", ".pth")


def _ckpt_file(src: str) -> str | None:
  """The torch checkpoint `load` reads: `src` itself, or the one .ckpt of a folder without
  safetensors weights; None for a Hugging Face folder."""
  if not os.path.isdir(src):
    if not os.path.exists(src):
      raise ValueError(f"{src}: not a folder")
    files_lib.regular_file(src)  # a FIFO or device is refused, never opened
    if src.endswith(CKPT_SUFFIXES):
      return src
    raise ValueError(f"{src}: not a folder, nor a torch checkpoint ({', '.join(CKPT_SUFFIXES)})")
  if any(files_lib.regular_file(os.path.join(src, n))
         for n in (tensors_lib.SINGLE_FILE, tensors_lib.INDEX_FILE)):
    return None
  found = sorted(n for n in os.listdir(src) if n.endswith(".ckpt"))
  if len(found) > 1:
    raise ValueError(f"{src}: several checkpoints ({', '.join(found)}): pass the file")
  if found and not files_lib.regular_file(os.path.join(src, found[0])):
    raise ValueError(f"{os.path.join(src, found[0])}: missing (a dangling link)")
  return os.path.join(src, found[0]) if found else None


def read_config_json(config, folder: str, where: str) -> dict:
  """config.json's object: from `config` (a PublishedConfig or DiTConfig, a dict, or a path
  to a JSON file) or else the folder's config.json."""
  if config is None:
    path = os.path.join(folder, CONFIG_FILE)
    if not files_lib.regular_file(path):
      raise ValueError(f"{where}: no {CONFIG_FILE}" + (
          "" if where == folder else " beside it: pass config= (a DiTConfig, a config.json "
          "dict or path)"))
    return _read_json(path)
  if isinstance(config, dict):
    return dict(config)
  if isinstance(config, (str, os.PathLike)):
    return _read_json(os.fspath(config))
  if isinstance(config, (PublishedConfig, DiTConfig)):
    return formats.get(config.family).config_to_hf(config)
  raise ValueError(f"config= is a {type(config).__name__}: pass a PublishedConfig or DiTConfig, "
                   "a config.json dict or its path")


def _read(info) -> np.ndarray:
  # A family's TensorView reads its stored parts with this reader; a .ckpt's StoredTensor
  # reads itself; a safetensors TensorInfo is memory-mapped here.
  if isinstance(info, format_base.TensorView):
    return info.read(_read)
  return info.read() if hasattr(info, "read") else tensors_lib.read_tensor(info)


def _layers_held(leaves, names) -> int:
  """How many distinct layer indices the stacked leaves' tensor names carry."""
  patterns = [re.compile(re.escape(leaf.hf).replace(re.escape("{i}"), r"(\d+)"))
              for leaf in leaves if leaf.stacked]
  return len({m.group(1) for name in names for p in patterns if (m := p.fullmatch(name))})


def _put(tree: dict, path: tuple[str, ...], value):
  for part in path[:-1]:
    tree = tree.setdefault(part, {})
  tree[path[-1]] = value


def load(path: str, *, dtype: str | None = None, mesh: Mesh | None = None, config=None,
         ema: bool = True) -> Model:
  """Loads a Hugging Face folder of a published checkpoint (`mdjax.formats.supported()`),
  or a torch / PyTorch Lightning `.ckpt` (a file, or a folder holding one and no
  safetensors), as a `mdjax.model.Model` (its family's denoiser, ids and reference sampler).

  dtype: None keeps the checkpoint's (BF16 -> "bfloat16", F32 -> "float32"); "float32" or
  "bfloat16" casts each tensor as it streams. mesh: shard the params over it (module
  docstring); None puts them on the default device. config: the architecture when the
  checkpoint has no config.json beside it (a DiTConfig or PublishedConfig, a config.json
  dict or path; it replaces config.json when given). ema: a Lightning checkpoint's EMA
  weights (the ones its code evaluates and publishes) rather than its raw state_dict. A .ckpt
  is read by `mdjax.io.lightning` (never unpickled freely). Every bad input is a
  ValueError raised before any weight is read.
  """
  _check_dtype(dtype)
  mesh = None if mesh is None else auto_axes(mesh)  # the models' gathers refuse Explicit axes
  src = os.fspath(path)
  ckpt = _ckpt_file(src)
  folder = src if ckpt is None else os.path.dirname(os.path.abspath(ckpt))
  raw = read_config_json(config, folder, ckpt or folder)
  where = os.path.join(folder, CONFIG_FILE) if config is None else ckpt or folder
  layout = formats.detect(raw, where)
  if ckpt is None:
    infos = tensors_lib.read_checkpoint(folder)
  else:
    infos = lightning.state_tensors(lightning.read_ckpt(ckpt), ckpt, ema=ema)
  # A family that stores a leaf otherwise (a fused projection, per-expert matrices) maps its
  # stored tensors to the leaves' names here, before anything is read.
  infos = layout.tensor_view(infos, raw, ckpt or folder)
  tied = layout.tied(raw)

  # The tensor names come from the config alone, so a first config (any dtype) finds them.
  probe = layout.config_from_hf(raw, dtype or "float32")
  leaves = layout.leaves(probe, tied, **layout.leaf_options(raw))
  n_layers = format_base.depth(probe)
  # The depth is bounded by the tensors present before any per-layer name is built.
  held = _layers_held(leaves, infos)
  if n_layers > held:
    raise ValueError(f"{where}: {layout.depth_key}={n_layers} but the checkpoint holds tensors "
                     f"for {held} layers (missing tensor(s) of the others)")
  needed = list(dict.fromkeys(n for leaf in leaves for n in leaf.hf_names(n_layers)))
  buffers = [n for n in layout.optional_buffers if n in infos]
  missing = [n for n in needed if n not in infos]
  extra = sorted(set(infos) - set(needed) - set(buffers))
  if missing:
    raise ValueError(f"{ckpt or folder}: missing tensor(s) {', '.join(missing[:5])}"
                     f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
  if extra:
    raise ValueError(f"{ckpt or folder}: unexpected tensor(s) {', '.join(extra[:5])}"
                     f"{f' and {len(extra) - 5} more' if len(extra) > 5 else ''} "
                     f"(not in the {layout.family} layout of this config)")
  for n in needed:
    if infos[n].dtype not in _FLOATS:
      raise ValueError(f"{infos[n].path}: tensor {n!r} is {infos[n].dtype}, not a float dtype")
  config = dataclasses.replace(
      probe, dtype=dtype or _checkpoint_dtype(infos, needed, leaves[0].hf, ckpt or folder))
  for leaf in leaves:
    want = format_base.hf_shape(config, leaf)
    for n in leaf.hf_names(n_layers):
      if infos[n].shape != want:
        raise ValueError(f"{infos[n].path}: tensor {n!r} has shape {list(infos[n].shape)}, "
                         f"expected {list(want)} for this config")
  read_buffers = {n: np.array(_read(infos[n])) for n in buffers}
  for n, value in read_buffers.items():
    layout.check_buffer(config, n, value, infos[n].path)
  synthesized = layout.synthesized(config, raw)

  shardings = {}
  for key, stacked, shape, name in (
      [(leaf.key, leaf.stacked, format_base.leaf_shape(config, leaf), f"{leaf.key} ({leaf.hf})")
       for leaf in leaves]
      + [(k, k.startswith("blocks/"), v.shape, k) for k, v in synthesized.items()]):
    if mesh is None:
      shardings[key] = (None, None)
    else:
      spec = load_spec(mesh, config, key, shape, stacked, name)
      layer_spec = PartitionSpec(*spec[1:]) if stacked else spec
      shardings[key] = (NamedSharding(mesh, spec), NamedSharding(mesh, layer_spec))
  tokenizer = _load_tokenizer(folder)
  check_tokenizer(tokenizer, config, raw, os.path.join(folder, TOKENIZER_FILE))
  chat_template = read_chat_template(folder)

  np_dtype = np.dtype(config.jnp_dtype)
  params: dict[str, Any] = {}
  bytes_read = 0
  for leaf in leaves:
    sharding, layer_sharding = shardings[leaf.key]
    names = leaf.hf_names(n_layers)
    if not leaf.stacked:
      value = jax.device_put(_host(infos[names[0]], leaf.transpose, np_dtype), sharding)
    else:
      shape = format_base.leaf_shape(config, leaf)
      if sharding is None:
        value = jnp.zeros(shape, np_dtype)
        update = _set_layer(None)
      else:
        value = _zeros(shape, np_dtype, sharding)()
        update = _set_layer(sharding)
      for i, n in enumerate(names):
        layer = jax.device_put(_host(infos[n], leaf.transpose, np_dtype), layer_sharding)
        value = update(value, layer, i)
        del layer
    bytes_read += sum(infos[n].nbytes for n in names)
    _put(params, leaf.path, value)
  for key, value in synthesized.items():
    _put(params, tuple(key.split("/")), jax.device_put(value.astype(np_dtype), shardings[key][0]))
  return published_model(params=params, config=config, family=layout.family,
                         tokenizer=tokenizer, chat_template=chat_template,
                         source=os.path.abspath(folder), hf_config=raw, bytes_read=bytes_read,
                         buffers=read_buffers or None)


# ----------------------------------------------------------------------------
# Saving.
# ----------------------------------------------------------------------------


def _flat(params, where="params") -> dict[str, Any]:
  """{"embed": ..., "layers/q": ...} of a params pytree."""
  if not isinstance(params, dict):
    raise ValueError(f"{where} is a {type(params).__name__}, not a dict of params")
  out = {}
  for k, v in params.items():
    if isinstance(v, dict):
      out.update({f"{k}/{kk}": vv for kk, vv in _flat(v, f"{where}[{k!r}]").items()})
    else:
      out[k] = v
  return out


def _to_host(x, index: int | None, transpose: bool, dtype: np.dtype) -> np.ndarray:
  x = x if index is None else x[index]
  x = np.asarray(x)
  return np.ascontiguousarray((x.T if transpose else x).astype(dtype, copy=False))


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _auto_map_files(raw: dict, where: str) -> list[str]:
  """The modeling files config.json's auto_map names ("module.Class" -> module.py); a module
  that is not a plain name (a path, "..") is a ValueError naming `where` and the entry."""
  auto_map = raw.get("auto_map")
  if not isinstance(auto_map, dict):
    return []
  refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v])]
  files = set()
  for ref in refs:
    if not isinstance(ref, str) or "--" in ref or "." not in ref:
      continue  # "repo--module.Class" names another repository's file: nothing to copy
    module = ref.rsplit(".", 1)[0]
    if not _MODULE_NAME.fullmatch(module):
      raise ValueError(f"{where}: auto_map entry {ref!r} does not name a module file of the "
                       "folder (module.Class, the module letters, digits and _)")
    files.add(module + ".py")
  return sorted(files)


def side_files(source: str, names) -> list[str]:
  """The names among `names` that are files of the source folder, checked to be regular
  files and not symbolic links (a link could carry any file of the machine into the copy)."""
  present = []
  for name in names:
    path = os.path.join(source, name)
    if os.path.islink(path):
      raise ValueError(f"{path}: a symbolic link; save copies only regular files of the source "
                       "folder (put the file itself there)")
    if files_lib.regular_file(path):
      present.append(name)
  return present


def _copy(src: str, dst: str):
  """Copies a regular file, following no symbolic link at either end (one planted at dst is
  replaced)."""
  if os.path.isfile(dst) and not os.path.islink(dst) and os.path.samefile(src, dst):
    return
  with files_lib.open_regular(src, follow_links=False) as f, \
       files_lib.atomic_write(dst) as out:
    shutil.copyfileobj(f, out)


def save(model_or_params, path: str, *, family: str | None = None,
         config: PublishedConfig | None = None, dtype: str | None = None,
         max_shard_bytes: int | None = None) -> list[str]:
  """Writes a Hugging Face folder (config.json, safetensors) that `load` and the published
  modeling code read; returns the files written.

  model_or_params: a published `Model` (`load`'s; its tokenizer and chat template files
  come along), or a params pytree with `config` (a PublishedConfig, or a DiTConfig for
  "mdlm" / "bd3lm": their config.json and `backbone.*` tensors, the rotary buffer
  included). family: the family written (default the model's, else config.family).
  dtype: None keeps each leaf's dtype, else casts. With
  max_shard_bytes the weights are sharded (model-0000i-of-0000n.safetensors and
  model.safetensors.index.json). The head is always written as its own tensor (weight_tying /
  tie_word_embeddings false). Side files are copied only as regular files of the source
  folder (a symbolic link there, or an auto_map module that is not a plain name, is a
  ValueError raised before anything is written), and every file is written under a new
  temporary name and renamed, so a link planted in `path` is replaced, never written through.
  """
  _check_dtype(dtype)
  model = model_or_params if isinstance(model_or_params, Model) else None
  if model is not None and model.family not in formats.FORMATS:
    raise ValueError(f"save: a {model.family!r} model is not a published checkpoint (families: "
                     f"{', '.join(formats.FORMATS)})")
  params = model.params if model else model_or_params
  if quantize.is_quantized(params):
    raise ValueError("save: the params are quantized (mdjax.load(..., quantize=...)); a "
                     "published folder holds float weights: save the model loaded without "
                     "quantize")
  config = config or (model.config if model else None)
  if config is None:
    raise ValueError("save: a params pytree needs config= (a PublishedConfig or DiTConfig)")
  family = family or (model.family if model else config.family)
  if family not in formats.FORMATS:
    raise ValueError(f"save: unknown family {family!r} (supported: "
                     f"{', '.join(formats.FORMATS)})")
  layout = formats.FORMATS[family]
  if layout.network != getattr(config, "family", None):
    raise ValueError(f"save: family={family!r} but config.family={config.family!r}")
  if not isinstance(config, layout.config_type):
    raise ValueError(f"save: family {family!r} needs a {layout.config_type.__name__}, got a "
                     f"{type(config).__name__}")

  # The source's side files, checked before anything is written.
  source = model.source if model and model.source and os.path.isdir(model.source) else None
  source_config = os.path.join(model.source if model and model.source else "", CONFIG_FILE)
  modeling = _auto_map_files(model.hf_config or {}, source_config) if model else []
  side = side_files(source, SIDE_FILES + tuple(modeling)) if source else []

  flat = _flat(params)
  leaves = layout.leaves(config)
  keys = [leaf.key for leaf in leaves]
  missing = [k for k in keys if k not in flat]
  extra = sorted(set(flat) - set(keys))
  if missing or extra:
    raise ValueError(f"save: params do not match the {family} layout of the config: "
                     f"missing {missing}, extra {extra}")
  for leaf in leaves:
    want, got = format_base.leaf_shape(config, leaf), tuple(flat[leaf.key].shape)
    if got != want:
      raise ValueError(f"save: params leaf {leaf.key} has shape {list(got)}, expected "
                       f"{list(want)} for the config")
  written_dtype = dtype or str(np.dtype(flat["embed"].dtype))
  if written_dtype not in DTYPES:
    raise ValueError(f"save: params are {written_dtype}: pass dtype='bfloat16' or 'float32'")
  hf = layout.config_to_hf(dataclasses.replace(config, dtype=written_dtype))

  tensors = {}
  for leaf in leaves:
    x = flat[leaf.key]
    out_dtype = np.dtype(jnp.dtype(dtype)) if dtype else np.dtype(x.dtype)
    shape = format_base.hf_shape(config, leaf)
    for i, n in enumerate(leaf.hf_names(format_base.depth(config))):
      fn = functools.partial(_to_host, x, i if leaf.stacked else None, leaf.transpose, out_dtype)
      tensors[n] = Lazy(shape, out_dtype, fn)
  # The buffers the reference code reads strictly (MDLM / BD3-LM: the rotary table).
  source_raw = dict(model.hf_config) if model and model.hf_config else {}
  for name, value in layout.buffers(config, source_raw).items():
    kept = (model.buffers or {}).get(name) if model else None
    tensors[name] = kept if kept is not None and kept.shape == value.shape else value
  tensors = layout.stored_tensors(tensors, config)
  folder = os.fspath(path)
  os.makedirs(folder, exist_ok=True)
  written = tensors_lib.write_checkpoint(folder, tensors, max_shard_bytes=max_shard_bytes,
                                         metadata={"format": "pt"})

  copied = []
  for name in side:
    _copy(os.path.join(source, name), os.path.join(folder, name))
    copied.append(name)
  if model and model.tokenizer is not None and TOKENIZER_FILE not in copied:
    with files_lib.atomic_write(os.path.join(folder, TOKENIZER_FILE), "w") as f:
      f.write(model.tokenizer.to_str())
    copied.append(TOKENIZER_FILE)
  if (model and model.chat_template is not None and CHAT_TEMPLATE_FILE not in copied
      and TOKENIZER_CONFIG_FILE not in copied):
    with files_lib.atomic_write(os.path.join(folder, CHAT_TEMPLATE_FILE), "w") as f:
      f.write(model.chat_template)
    copied.append(CHAT_TEMPLATE_FILE)

  # The source's own config.json keys (auto_map, ids the params do not carry) are kept where
  # they do not describe the architecture; the architecture keys are always ours.
  base = dict(model.hf_config) if model and model.hf_config else {}
  if "auto_map" in base and not all(f in copied for f in modeling):
    del base["auto_map"]
  hf = layout.saved_config(hf, base, config)  # the family's rules for the source's keys
  if "pad_token_id" in base:  # the params do not carry a pad id: the source's stands
    hf.pop("pad_token_id", None)
  base.update(hf)
  for key in layout.soft_keys:  # knobs outside the architecture: the source's values stand
    if key in source_raw:
      base[key] = source_raw[key]
  tensors_lib.write_json(os.path.join(folder, CONFIG_FILE), base)
  return written + [os.path.join(folder, CONFIG_FILE)] + [os.path.join(folder, c) for c in copied]
