"""DiffusionGemma's Hugging Face folders (transformers' `DiffusionGemmaForBlockDiffusion`,
which vLLM serves): `is_folder`, `load` -> `mdjax.model.Model`, `save` back. What the folder's
files mean is `mdjax.formats.diffusion_gemma_hf`; the network and params are those gemma's
params checkpoint loads into (`mdjax.io.gemma_params`), bit for bit.

`load` checks everything before it reads a weight: config.json against the network,
generation_config.json against the sampler's rules, every safetensors header (a sharded index
too), the set of tensors (each weight under the decoder's names, the encoder's or both; the
vision tower's left unread; nothing else) and each one's shape and dtype. Then it streams: one
weight at a time is mapped from its file, reshaped into gemma's einsum layout and cast on the
host, and written into its layer kind's stacked device array in place (a donated update), so
the host holds about one weight, never the model. A weight stored twice (the encoder's and the
decoder's copies, the head beside the embedding, each layer's two layer_scalar buffers) is
read twice and must be equal. The tokenizer.json and chat template beside the weights are
read; generation_config.json's settings become the default sampler's (`Model.sampler`), as
does config.json's canvas_length.

`save` writes what transformers' `save_pretrained` writes: the decoder's copies, both
layer_scalar buffers, the source folder's vision tower copied tensor by tensor (a model from
gemma's params checkpoint has none: config.json then has no vision_config), config.json and
generation_config.json, and the source's tokenizer and processor files (regular files only).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mdjax import files as files_lib
from mdjax import mesh as mesh_lib
from mdjax import quantize
from mdjax.formats import diffusion_gemma as orbax_layout
from mdjax.formats import diffusion_gemma_hf as layout
from mdjax.io import tensors as tensors_lib
from mdjax.io.chat_template import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from mdjax.io.folder import read_chat_template, side_files
from mdjax.io.record import published_model
from mdjax.lazy import Lazy
from mdjax.model import Model
from mdjax.models import diffusion_gemma as network
from mdjax.tokenizers import TOKENIZER_FILE, load_hf_tokenizer

FAMILY = orbax_layout.FAMILY
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
# The tokenizer and processor files transformers' conversion saves beside the weights, which
# `save` copies from the source folder.
SIDE_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json",
              CHAT_TEMPLATE_FILE, "chat_template.json", "processor_config.json",
              "preprocessor_config.json")
_NATIVE = {"F32": "float32", "BF16": "bfloat16"}
_FLOATS = ("F64", "F32", "F16", "BF16")


def is_folder(path) -> bool:
  """Whether `path` is a folder whose config.json is DiffusionGemma's (model_type
  "diffusion_gemma", or its architecture without a model_type)."""
  src = os.fspath(path)
  config = os.path.join(src, CONFIG_FILE)
  if not (os.path.isdir(src) and files_lib.regular_file(config)):
    return False
  try:
    raw = files_lib.read_json(config, "config.json")
  except ValueError:
    return False  # the generic loader names what is wrong with it
  if not isinstance(raw, dict):
    return False
  if raw.get("model_type") is not None:
    return raw["model_type"] == layout.MODEL_TYPE
  architectures = raw.get("architectures")
  return isinstance(architectures, list) and layout.ARCHITECTURE in architectures


@functools.lru_cache(maxsize=None)
def _set_layer():
  # Donating the stacked array updates it in place: no second copy of the leaf on the device.
  return jax.jit(lambda stacked, layer, i: lax.dynamic_update_index_in_dim(stacked, layer, i, 0),
                 donate_argnums=0)


def _copies(weight: layout.Weight, infos: dict, folder: str) -> list[tuple]:
  """The stored copies of a weight (each a tuple of its parts' TensorInfo), the decoder's
  first; a copy with some parts but not all, or none at all, is a ValueError naming them."""
  found = []
  for names in weight.names():
    present = [n in infos for n in names]
    if all(present):
      found.append(tuple(infos[n] for n in names))
    elif any(present):
      missing = [n for n, p in zip(names, present) if not p]
      raise ValueError(f"{folder}: missing tensor(s) {', '.join(missing)} (beside "
                       f"{', '.join(n for n in names if n in infos)})")
  if not found:
    raise ValueError(f"{folder}: missing tensor(s) {', '.join(weight.names()[0])} (or "
                     f"{' / '.join(', '.join(n) for n in weight.names()[1:])})")
  return found


def check_tensors(config, infos: dict, folder: str) -> list[tuple[layout.Weight, list[tuple]]]:
  """[(weight, its stored copies)] of every params leaf, every tensor checked (presence,
  shape, float dtype; nothing unexpected) before any is read."""
  plan, used = [], set()
  for weight in layout.weights(config):
    copies = _copies(weight, infos, folder)
    want = weight.stored_shape()
    for copy in copies:
      for info in copy:
        used.add(info.name)
        if tuple(info.shape) != want:
          raise ValueError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}, "
                           f"expected {list(want)} for config.json")
        if info.dtype not in _FLOATS:
          raise ValueError(f"{info.path}: tensor {info.name!r} is {info.dtype}, not a float "
                           "dtype")
    plan.append((weight, copies))
  extra = sorted(n for n in infos if n not in used and not n.startswith(layout.UNREAD))
  if extra:
    raise ValueError(f"{folder}: unexpected tensor(s) {', '.join(extra[:5])}"
                     f"{f' and {len(extra) - 5} more' if len(extra) > 5 else ''} (not in the "
                     "DiffusionGemma layout of config.json)")
  return plan


def _read(info) -> np.ndarray:
  return tensors_lib.read_tensor(info)


def _same(a: tuple, b: tuple) -> bool:
  return all(np.array_equal(np.asarray(_read(x), np.float32), np.asarray(_read(y), np.float32),
                            equal_nan=True) for x, y in zip(a, b))


def _check_tokenizer(tokenizer, config, path: str) -> None:
  """Refuses another model's tokenizer.json: more ids than the logits, or no token at the
  EOS id."""
  if tokenizer is None:
    return
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  if size > config.vocab_size:
    raise ValueError(f"{path}: the tokenizer has {size} ids, more than the checkpoint's "
                     f"vocabulary of {config.vocab_size}: another model's tokenizer?")
  if config.eos_id is not None and tokenizer.id_to_token(config.eos_id) is None:
    raise ValueError(f"{path}: the tokenizer has no token at the EOS id {config.eos_id}: "
                     "another model's tokenizer?")


def read_generation_config(folder: str) -> tuple[dict | None, dict]:
  """(generation_config.json as read or None, the default sampler's knobs it sets)."""
  path = os.path.join(folder, GENERATION_FILE)
  if not files_lib.regular_file(path):
    return None, {}
  raw = files_lib.read_json(path, "generation_config.json")
  if not isinstance(raw, dict):
    raise ValueError(f"{path}: not a JSON object")
  return raw, layout.sampler_defaults(raw, path)


def load(path, *, dtype: str | None = None, mesh=None, config: Any = None,
         ema: Any = None) -> Model:
  """The DiffusionGemma folder at `path` as a `Model` (module docstring). dtype: None keeps
  the checkpoint's (F32 -> "float32", BF16 -> "bfloat16"), else "float32" / "bfloat16" cast as
  read. mesh: the params sharded over it (`mdjax.mesh`'s FSDP rule). Every bad input is a
  ValueError raised before any weight is read, but copies of a weight that differ, which
  are found as they are read."""
  for name, value in (("config", config), ("ema", ema)):
    if value is not None:
      raise ValueError(f"{name}={value!r} does not apply to a Hugging Face DiffusionGemma "
                       "folder (its config.json gives the architecture; it holds one set of "
                       "weights)")
  if dtype is not None and dtype not in network.DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r} (supported: None, "
                     f"{', '.join(network.DTYPES)})")
  folder = os.path.abspath(os.fspath(path))
  mesh_lib.refuse_model_axes(mesh, f"{folder!r}, a DiffusionGemma checkpoint,")
  where = os.path.join(folder, CONFIG_FILE)
  raw = files_lib.read_json(where, "config.json")
  cfg = layout.config_from_hf(raw, where)
  canvas = layout.canvas_of(raw, where)
  _, knobs = read_generation_config(folder)
  plan = check_tensors(cfg, tensors_lib.read_checkpoint(folder), folder)
  if dtype is None:
    codes = {info.dtype for _, copies in plan for info in copies[0]}
    code = codes.pop() if len(codes) == 1 else plan[0][1][0][0].dtype  # else the embedding's
    if code not in _NATIVE:
      raise ValueError(f"{folder}: the checkpoint's tensors are {code}, which loads only when "
                       "cast: pass dtype='bfloat16' or 'float32'")
    dtype = _NATIVE[code]
  cfg = dataclasses.replace(cfg, dtype=dtype)
  tokenizer = load_hf_tokenizer(folder)
  _check_tokenizer(tokenizer, cfg, os.path.join(folder, TOKENIZER_FILE))
  chat_template = read_chat_template(folder)

  np_dtype = np.dtype(cfg.jnp_dtype)
  shapes = network.param_shapes(cfg)
  params: dict[str, Any] = {kind: {leaf: jnp.zeros(shape, np_dtype)
                                   for leaf, shape in shapes[kind].items()}
                            for kind in network.KINDS if kind in shapes}
  params["self_condition"] = {}
  bytes_read = 0
  for weight, copies in plan:
    for other in copies[1:]:
      if not _same(copies[0], other):
        raise ValueError(f"{folder}: tensor(s) {', '.join(i.name for i in other)} differ from "
                         f"{', '.join(i.name for i in copies[0])}: mdjax's DiffusionGemma has "
                         "one set of weights (transformers ties the encoder's copies to the "
                         "decoder's and the head to the embedding)")
    bytes_read += sum(info.nbytes for copy in copies for info in copy)
    value = layout.to_params(weight, [_read(info) for info in copies[0]])
    value = jnp.asarray(np.array(value, dtype=np_dtype, order="C"))
    if len(weight.path) == 3:
      kind, leaf, index = weight.path
      params[kind][leaf] = _set_layer()(params[kind][leaf], value, int(index))
    else:
      holder = params
      for name in weight.path[:-1]:
        holder = holder[name]
      holder[weight.path[-1]] = value
  if mesh is not None:
    params = mesh_lib.shard_params(mesh, params)
  model = published_model(params=params, config=cfg, family=orbax_layout.FAMILY,
                          tokenizer=tokenizer, chat_template=chat_template, source=folder,
                          hf_config=raw, bytes_read=bytes_read)
  defaults = {"reference_length": canvas, **knobs}
  return model.replace(noise=orbax_layout.noise_of(cfg),
                       sampler=layout.Sampler(defaults=tuple(sorted(defaults.items()))))


# --- save ------------------------------------------------------------------------------------


def _copy(src: str, dst: str) -> None:
  if os.path.isfile(dst) and not os.path.islink(dst) and os.path.samefile(src, dst):
    return
  with files_lib.open_regular(src, follow_links=False) as f, files_lib.atomic_write(dst) as out:
    out.write(f.read())


def _host(value, index: int | None, dtype: np.dtype) -> np.ndarray:
  value = value if index is None else value[index]
  return np.asarray(value).astype(dtype, copy=False)


def stored_tensors(params: dict, config, dtype: np.dtype) -> dict[str, Lazy]:
  """{name: Lazy} of the text weights as transformers' save_pretrained stores them: the
  decoder's copies, and each layer's layer_scalar under the encoder's name too."""
  out = {}
  for weight in layout.weights(config):
    holder = params
    for name in weight.path[:2] if len(weight.path) == 3 else weight.path:
      holder = holder[name]
    index = int(weight.path[2]) if len(weight.path) == 3 else None
    names = weight.names()
    if len(weight.path) == 3 and weight.path[1] == "skip_scale":
      written = names[:2]  # a buffer, not tied: transformers stores both
    else:
      written = names[:1]
    for copy in written:
      for j, name in enumerate(copy):
        def part(value=holder, index=index, weight=weight, j=j):
          return layout.to_stored(weight, _host(value, index, dtype))[j]
        out[name] = Lazy(weight.stored_shape(), dtype, part)
  return out


def save(model: Model, path, *, dtype: str | None = None,
         max_shard_bytes: int | None = None) -> list[str]:
  """Writes `model` (a DiffusionGemma model: from either published layout) as the Hugging
  Face folder transformers and vLLM read (module docstring); returns the files written.
  dtype: None keeps the params' ("float32" / "bfloat16" casts). max_shard_bytes: shards
  (model-0000i-of-0000n.safetensors and its index). Every refusal (another family,
  quantized params, what the layout cannot express, a symbolic link among the source's side
  files) is a ValueError raised before anything is written."""
  if not isinstance(model, Model) or model.family != orbax_layout.FAMILY:
    raise ValueError(f"save: a {getattr(model, 'family', type(model).__name__)!r} model is not "
                     "a DiffusionGemma model")
  if quantize.is_quantized(model.params):
    raise ValueError("save: the params are quantized (mdjax.load(..., quantize=...)); a "
                     "published folder holds float weights: save the model loaded without "
                     "quantize")
  if dtype is not None and dtype not in network.DTYPES:
    raise ValueError(f"save: unsupported dtype {dtype!r} (supported: None, "
                     f"{', '.join(network.DTYPES)})")
  params = jax.device_get(model.params)
  written_dtype = dtype or str(np.dtype(params["embed"].dtype))
  if written_dtype not in network.DTYPES:
    raise ValueError(f"save: params are {written_dtype}: pass dtype='bfloat16' or 'float32'")
  config = dataclasses.replace(model.config, dtype=written_dtype)
  layout.check_writable(config)
  want = network.param_shapes(config)
  got = jax.tree.map(lambda x: tuple(x.shape), params)
  if got != want:
    raise ValueError("save: the params do not have the shapes of model.config (a "
                     "DiffusionGemma model's params, unchanged in structure)")

  source = model.source if model.source and is_folder(model.source) else None
  folder = os.fspath(path)
  if source and os.path.isdir(folder) and os.path.samefile(folder, source):
    raise ValueError(f"save: {folder} is the folder the model was loaded from (its vision "
                     "tower is copied from there as it is written); give another folder")
  side = side_files(source, SIDE_FILES) if source is not None else []
  source_infos = tensors_lib.read_checkpoint(source) if source else {}
  tensors: dict[str, Any] = stored_tensors(params, config, np.dtype(jnp.dtype(written_dtype)))
  for name, info in source_infos.items():  # the vision tower, copied as stored
    if name.startswith(layout.UNREAD):
      tensors[name] = Lazy(tuple(info.shape), info.np_dtype,
                           functools.partial(lambda i: np.array(_read(i)), info))
  base = dict(model.hf_config or {}) if source else {}
  if not any(n.startswith(layout.UNREAD) for n in source_infos):
    base.pop("vision_config", None)
  hf = layout.config_to_hf(config, base)
  source_generation = read_generation_config(source)[0] if source else None
  knobs = (dict(model.sampler.defaults) if isinstance(model.sampler, layout.Sampler)
           else dict(layout.PUBLISHED_KNOBS))
  if "reference_length" in knobs:
    hf["canvas_length"] = knobs.pop("reference_length")
  generation = layout.generation_config(knobs, source_generation)

  os.makedirs(folder, exist_ok=True)
  files = tensors_lib.write_checkpoint(folder, tensors, max_shard_bytes=max_shard_bytes,
                                       metadata={"format": "pt"})
  for name in side:
    _copy(os.path.join(source, name), os.path.join(folder, name))
    files.append(os.path.join(folder, name))
  if model.tokenizer is not None and TOKENIZER_FILE not in side:
    with files_lib.atomic_write(os.path.join(folder, TOKENIZER_FILE), "w") as f:
      f.write(model.tokenizer.to_str())
    files.append(os.path.join(folder, TOKENIZER_FILE))
  if (model.chat_template is not None and CHAT_TEMPLATE_FILE not in side
      and TOKENIZER_CONFIG_FILE not in side):
    with files_lib.atomic_write(os.path.join(folder, CHAT_TEMPLATE_FILE), "w") as f:
      f.write(model.chat_template)
    files.append(os.path.join(folder, CHAT_TEMPLATE_FILE))
  for name, obj in ((CONFIG_FILE, hf), (GENERATION_FILE, generation)):
    tensors_lib.write_json(os.path.join(folder, name), obj)
    files.append(os.path.join(folder, name))
  return files
