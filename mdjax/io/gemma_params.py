"""gemma's params checkpoints (google-deepmind/gemma `gm.ckpts.save_params` / `load_params`:
an orbax PyTree checkpoint of the nested params tree), the layout DiffusionGemma is published
in: `is_checkpoint`, `load` -> `mdjax.model.Model`, `save` back.

`load` reads the tree's metadata first (every leaf's shape and dtype; nothing else is read),
takes the architecture from it (`formats.diffusion_gemma.config_from_shapes`, a given config
checked against it) and checks every leaf mdjax reads against that config before it reads a
weight. Then it streams: the top-level leaves, then one layer at a time (orbax's partial
restore), each layer's leaves cast on the host and written into its kind's stacked device
array in place (a donated update), so the host holds about one layer, never the model.
Subtrees mdjax does not read (the vision encoder) are never restored. A tokenizer.json and
chat_template.jinja beside the params (the folder or its parent) are read when present.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

from mdjax import mesh as mesh_lib
from mdjax.formats import diffusion_gemma as layout
from mdjax.io.folder import read_chat_template
from mdjax.io.record import published_model
from mdjax.model import Model
from mdjax.models import diffusion_gemma as network
from mdjax.tokenizers import TOKENIZER_FILE
from mdjax.tokenizers import load_hf_tokenizer

METADATA_FILE = "_METADATA"  # orbax's tree metadata: a PyTree checkpoint's mark


def is_checkpoint(path: str) -> bool:
  """Whether `path` is an orbax params checkpoint (a folder with orbax's tree metadata)."""
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def _checkpointer() -> ocp.PyTreeCheckpointer:
  return ocp.PyTreeCheckpointer()


def _tree_metadata(path: str) -> dict:
  try:
    return _checkpointer().metadata(path).item_metadata.tree
  except Exception as e:  # orbax's own errors, of many types
    raise ValueError(f"{path}: not a readable orbax params checkpoint ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None


def leaf_shapes(path: str) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
  """{tree path: (shape, dtype)} of every stored leaf, from the metadata alone."""
  flat = jax.tree_util.tree_flatten_with_path(_tree_metadata(path))[0]
  return {tuple(str(k.key) for k in keys): (tuple(meta.shape), str(np.dtype(meta.dtype)))
          for keys, meta in flat}


def _restore(path: str, metadata: dict, top: list[str]) -> dict:
  """The subtrees `top` of the checkpoint, as host numpy arrays."""
  item = {name: metadata[name] for name in top}
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  return _checkpointer().restore(path, args=ocp.args.PyTreeRestore(
      item=item, restore_args=args, partial_restore=True))


def _get(tree: dict, key: tuple[str, ...]):
  for part in key:
    tree = tree[part]
  return tree


@functools.lru_cache(maxsize=None)
def _set_layer():
  # Donating the stacked array updates it in place: no second copy of the leaf on the device.
  return jax.jit(lambda stacked, layer, i: lax.dynamic_update_index_in_dim(stacked, layer, i, 0),
                 donate_argnums=0)


def load(path: str, *, dtype: str | None = None, mesh=None, config: Any = None) -> Model:
  """The DiffusionGemma params checkpoint at `path` as a `Model` (module docstring). dtype:
  None keeps the checkpoint's ("float32", "bfloat16" cast as read). config: a
  `DiffusionGemmaConfig` or a dict of its fields for what the tree does not say (the attention
  pattern, the sliding window, ...; default the published model's), checked against the
  shapes. mesh: the params sharded over it (`mdjax.mesh`'s FSDP rule). Every bad input is a
  ValueError raised before any weight is read."""
  src = os.path.abspath(os.fspath(path))  # orbax reads no metadata through a relative path
  if dtype is not None and dtype not in network.DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r} (supported: None, "
                     f"{', '.join(network.DTYPES)})")
  if not is_checkpoint(src):
    raise ValueError(f"{src}: not an orbax params checkpoint (no {METADATA_FILE})")
  metadata = _tree_metadata(src)
  shapes = leaf_shapes(src)
  cfg = layout.config_from_shapes(shapes, src, config)
  if dtype is not None:
    cfg = network.DiffusionGemmaConfig(**{**cfg.__dict__, "dtype": dtype})
  wanted = layout.expected_shapes(cfg)
  stored = {}
  for tree_path, shape in wanted.items():
    key = layout.find(shapes, tree_path)
    if key is None:
      raise ValueError(f"{src}: missing leaf {'/'.join(tree_path)}")
    if shapes[key][0] != shape:
      raise ValueError(f"{src}: leaf {'/'.join(key)} has shape {list(shapes[key][0])}, "
                       f"expected {list(shape)} for this config")
    if not np.issubdtype(np.dtype(shapes[key][1]), np.floating):
      raise ValueError(f"{src}: leaf {'/'.join(key)} is {shapes[key][1]}, not a float dtype")
    stored[tree_path] = key
  read_keys = set(stored.values())
  extra = sorted("/".join(k) for k in shapes
                 if k not in read_keys and k[0] not in layout.UNREAD)
  if extra:
    raise ValueError(f"{src}: unexpected leaf(s) {', '.join(extra[:5])}"
                     f"{f' and {len(extra) - 5} more' if len(extra) > 5 else ''} (not in the "
                     "DiffusionGemma layout of this config)")

  np_dtype = np.dtype(cfg.jnp_dtype)
  shapes_out = network.param_shapes(cfg)
  paths = layout.tree_paths(cfg)
  params: dict[str, Any] = {kind: {} for kind in network.KINDS if cfg.kind_count(kind)}
  params["self_condition"] = {}
  bytes_read = 0
  top = sorted({key[0] for key in read_keys if not key[0].startswith("layer_")})
  part = _restore(src, metadata, top)
  for mdjax_path, tree_path in paths.items():
    if len(mdjax_path) == 3:
      continue
    value = np.asarray(_get(part, stored[tree_path])).astype(np_dtype)
    bytes_read += value.nbytes
    holder = params
    for name in mdjax_path[:-1]:
      holder = holder[name]
    holder[mdjax_path[-1]] = jnp.asarray(value)
  for kind in params:
    if kind in network.KINDS:
      params[kind] = {leaf: jnp.zeros(shape, np_dtype)
                      for leaf, shape in shapes_out[kind].items()}
  seen = {kind: 0 for kind in network.KINDS}
  for i, kind in enumerate(cfg.layer_types):
    layer = _restore(src, metadata, [f"layer_{i}"])
    index = seen[kind]
    seen[kind] += 1
    for leaf in layout.layer_leaves(cfg, kind):
      value = np.asarray(_get(layer, stored[paths[(kind, leaf, str(index))]])).astype(np_dtype)
      bytes_read += value.nbytes
      params[kind][leaf] = _set_layer()(params[kind][leaf], jnp.asarray(value), index)
    del layer
  if mesh is not None:
    params = mesh_lib.shard_params(mesh, params)
  folder = next((f for f in (src, os.path.dirname(os.path.abspath(src)))
                 if os.path.isfile(os.path.join(f, TOKENIZER_FILE))), None)
  tokenizer = None if folder is None else load_hf_tokenizer(folder)
  chat_template = None if folder is None else read_chat_template(folder)
  model = published_model(params=params, config=cfg, family=layout.FAMILY, tokenizer=tokenizer,
                          chat_template=chat_template, source=os.path.abspath(src),
                          bytes_read=bytes_read)
  return model.replace(noise=layout.noise_of(cfg))


def tree_of(params: dict, config) -> dict:
  """gemma's nested params tree (host numpy) of mdjax's params: the inverse of `load`'s
  mapping (the self-conditioner's post_norm has no weight, as gemma's)."""
  tree: dict = {}
  for mdjax_path, tree_path in layout.tree_paths(config).items():
    value = _get(params, mdjax_path[:2])
    value = value[int(mdjax_path[2])] if len(mdjax_path) == 3 else value
    holder = tree
    for name in tree_path[:-1]:
      holder = holder.setdefault(name, {})
    holder[tree_path[-1]] = np.asarray(value)
  return tree


def save(model: Model, path: str) -> str:
  """Writes `model`'s params as gemma's params checkpoint at `path` (a new folder), the layout
  `load` reads back bit for bit. Returns the path."""
  if model.family != layout.FAMILY:
    raise ValueError(f"model.family={model.family!r} cannot be written as a DiffusionGemma "
                     "params checkpoint")
  dst = os.path.abspath(os.fspath(path))
  if os.path.exists(dst):
    raise ValueError(f"{dst} exists; give a new folder")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(dst, tree_of(jax.device_get(model.params), model.config))
  checkpointer.wait_until_finished()
  return dst
