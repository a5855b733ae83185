"""From an autoregressive LM to a diffusion LM: a Llama, Qwen2 or Qwen3 causal folder
(transformers' layout) written as a published diffusion folder that `mdjax.load` reads and
training starts from (`train.init_from="pretrained:OUT"`, objectives 'a2d', 'nelbo', 'sft').

What changes, and nothing else (every weight of the causal network is kept):

  attention   bidirectional (to="masked") or block-causal in blocks of `block_size`
              (to="block"); training anneals it from the causal pattern (objective 'a2d',
              `layers.anneal_visible`), or switches at once.
  the shift   kept (Dream's, Fast-dLLM v2's: the output at i - 1 predicts token i, so the
              causal head keeps predicting the next token) or dropped (LLaDA's, SDAR's).
  mask id     mask_id=None appends a new id V (the embedding and head grow by one row: the
              embedding's row is the mean of the rows of the tokenizer's ids, the head's column
              zeros, since the
              mdjax network sets the mask id's logit to -inf and a zero column keeps it inert in
              other code too). A reused id (`mask_id`) must lie in [0, V) with no token of the
              tokenizer there (or a mask token already); its embedding row is reset to the
              mean and its head column to zeros alike. Dream and SDAR reused rows of Qwen's
              padded vocabulary (151666, 151669); a folder without spare rows appends.
  biases      a Llama input written in a layout with q/k/v biases (Dream, Fast-dLLM v2) gets
              zero biases (the same network).
  tokenizer   copied; the mask token ("<|mask|>") added at the mask id (ids between the
              tokenizer's last and the mask id get placeholders "<|unused_i|>", since a
              tokenizer.json holds no gaps: at most `max_vocab_gap` of them, 1,024 or 1% of
              the rows, else the input is refused). The tokenizer and side files are copied
              as regular files only: a symbolic link among them is refused, as `save` does.

The layouts (`layout=None` picks by `to`, the shift and the input):

  to      shift    input                      layout
  masked  kept     Llama, Qwen2               dream          (Dream-7B's code reads it)
  masked  dropped  Llama, Qwen2               llada          (LLaDA's OLMo layout)
  block   kept     Llama, Qwen2               fast_dllm_v2   (bd_size = block_size)
  block   dropped  Qwen3 (q/k norm)           sdar           (block_size)

Anything else has no published layout and is refused by name: Qwen3's q/k norm in a
masked, or shifted, layout (Dream, LLaDA and Fast-dLLM v2 have none); a Llama or Qwen2 input
without the shift in blocks (SDAR's code always applies q/k norm); and whatever the chosen
layout cannot express (Llama 3.1's RoPE scaling outside SDAR, a head_dim other than hidden /
heads outside SDAR), with the family's own message.

Bad input is a ValueError naming the argument before anything is written; the folder is
written under OUT.partial and renamed to OUT at the end, so OUT is whole or absent. An
OUT.partial that exists already is refused (never deleted: it may not be this run's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from mdjax import formats
from mdjax import files as files_lib
from mdjax.io import tensors as tensors_lib
from mdjax.models import checks
from mdjax.models.published import PublishedConfig

TARGETS = ("masked", "block")
LAYOUTS = ("dream", "llada", "fast_dllm_v2", "sdar")
# The causal model_types read, and the mdjax family that reads each one's tensors.
SOURCES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "sdar"}
MASK_TOKEN = "<|mask|>"
# The published mask tokens: a reused id that holds one of these is free for the mask.
MASK_TOKENS = (MASK_TOKEN, "<|mdm_mask|>", "<|MASK|>", "|<MASK>|")
DEFAULT_BLOCK = {"fast_dllm_v2": 32, "sdar": 4}  # the published configs' block sizes
# The files copied beside the weights (the tokenizer's two edited when a mask token is added).
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
SIDE_FILES = ("special_tokens_map.json", "chat_template.jinja", "generation_config.json")
# The most ids between the tokenizer's last and the mask id, each written as a placeholder
# token (some 300 bytes in the two tokenizer files): 1,024, or 1% of the embedding rows for a
# larger vocabulary. A padded vocabulary rounds its rows up to a multiple (of 64 to 2,048:
# Qwen2.5's 151,936 or 152,064 rows for 151,665 ids leave 271 or 399), well inside; a
# vocab_size far past the tokenizer's is no padding, and its placeholders grew without bound
# (an 8 MB input wrote 394 MB). At the bound the tokenizer files grow by a few bytes a row,
# where a row of the embedding alone holds 2 * d_model bytes or more.
MIN_VOCAB_GAP = 1024


def max_vocab_gap(vocab_size: int) -> int:
  """The most placeholder ids `convert` writes for an input of `vocab_size` embedding rows."""
  return max(MIN_VOCAB_GAP, vocab_size // 100)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `convert` writes, decided from config.json and tokenizer.json alone.

  causal: the input's network (family "llama" or "qwen2", causal; Qwen3 as "qwen2" with
  qk_norm). config: the converted network (the layout's family). layout: the family written.
  mask_id: the mask id; appended: whether it is a new row (V). tokenizer_size: the input
  tokenizer's ids (None without tokenizer.json).
  """

  causal: PublishedConfig
  config: PublishedConfig
  layout: str
  mask_id: int
  appended: bool
  tokenizer_size: int | None


# ----------------------------------------------------------------------------
# Reading the causal folder.
# ----------------------------------------------------------------------------


def _raw(input_dir: str) -> dict:
  if not isinstance(input_dir, (str, os.PathLike)) or not os.path.isdir(input_dir):
    raise ValueError(f"input={input_dir!r} is not a folder (a Llama, Qwen2 or Qwen3 causal "
                     "checkpoint in transformers' layout).")
  path = os.path.join(input_dir, "config.json")
  if not files_lib.regular_file(path):
    raise ValueError(f"input={input_dir!r} has no config.json.")
  raw = files_lib.read_json(path, "config.json")
  model_type = raw.get("model_type")
  if model_type not in SOURCES:
    raise ValueError(f"input={input_dir!r}: model_type={model_type!r} is not supported "
                     f"(supported: {', '.join(SOURCES)}: a causal LM converted to diffusion).")
  return raw


def _reading_raw(raw: dict) -> dict:
  """config.json as the mdjax family that reads the input's tensors sees it: Qwen3's through
  SDAR's mapping (the same tensor names, q/k norm), a mask id the reader needs but never
  uses (the EOS, a token every tokenizer check finds)."""
  if raw["model_type"] != "qwen3":
    return raw
  eos = formats.base.config_token_id(raw, "eos_token_id", "qwen3")
  return {**raw, "model_type": "sdar", "architectures": ["SDARForCausalLM"], "block_size": 1,
          "mask_token_id": 0 if eos is None else eos}


def causal_config(raw: dict, dtype: str = "float32") -> PublishedConfig:
  """The causal network of a Llama / Qwen2 / Qwen3 config.json (Qwen3: family "qwen2" with
  qk_norm and no biases)."""
  family = formats.get(SOURCES[raw["model_type"]])
  config = family.config_from_hf(_reading_raw(raw), dtype)
  if raw["model_type"] == "qwen3":
    config = dataclasses.replace(config, family="qwen2", causal=True, block_size=None,
                                 mask_id=None, logit_shift=False, eot_id=None)
  return config


def _tokenizer(input_dir: str):
  from mdjax.tokenizers import load_hf_tokenizer
  return load_hf_tokenizer(input_dir)


def load_causal(input_dir: str, dtype: str | None = None):
  """(causal PublishedConfig, params, config.json) of a causal folder: its weights read by
  `mdjax.load` (Qwen3's through SDAR's tensor names)."""
  from mdjax import io
  raw = _raw(input_dir)
  model = io.load(input_dir, dtype=dtype, config=_reading_raw(raw))
  config = causal_config(raw, model.config.dtype)
  return config, model.params, raw


# ----------------------------------------------------------------------------
# The plan.
# ----------------------------------------------------------------------------


def _layout(to: str, keep_shift: bool, qk_norm: bool, layout: str | None) -> str:
  """The family written for a conversion; a combination with none is a ValueError."""
  if layout is None:
    if to == "masked":
      if qk_norm:
        raise ValueError("to='masked': the input has q/k norm (Qwen3) and no published "
                         "bidirectional layout has it (Dream, LLaDA); convert it "
                         "to='block' with keep_shift=False (SDAR's layout).")
      return "dream" if keep_shift else "llada"
    if qk_norm:
      if keep_shift:
        raise ValueError("keep_shift=True: the input has q/k norm (Qwen3), whose block layout "
                         "is SDAR's, which has no shift; pass keep_shift=False (--no_shift).")
      return "sdar"
    if not keep_shift:
      raise ValueError("keep_shift=False with to='block': the only unshifted block layout is "
                       "SDAR's, whose code always applies q/k norm and the input has none; "
                       "keep the shift (Fast-dLLM v2's layout).")
    return "fast_dllm_v2"
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be None or one of {LAYOUTS}.")
  wanted = {"dream": ("masked", True), "llada": ("masked", False),
            "fast_dllm_v2": ("block", True), "sdar": ("block", False)}[layout]
  if wanted != (to, keep_shift):
    raise ValueError(f"layout={layout!r} writes to={wanted[0]!r} with keep_shift={wanted[1]}, "
                     f"not to={to!r} with keep_shift={keep_shift}.")
  if qk_norm != (layout == "sdar"):
    raise ValueError(f"layout={layout!r}: the input {'has' if qk_norm else 'has no'} q/k norm "
                     f"and the {layout} network {'has' if layout == 'sdar' else 'has no'} "
                     "(sdar is for Qwen3 inputs, the others for Llama and Qwen2).")
  return layout


def _token_at(tokenizer, token_id: int) -> str | None:
  return None if tokenizer is None else tokenizer.id_to_token(token_id)


def _input_file(input_dir: str, name: str) -> str | None:
  """The path of the input's side file `name` (None when there is none), refused when it is a
  symbolic link, as `mdjax.io.save` refuses one: the link could carry any file of the machine
  (any JSON a tokenizer_config.json link points at) into a folder meant to be shared."""
  path = os.path.join(input_dir, name)
  if os.path.islink(path):
    raise files_lib.UnsafeFile(path, f"{files_lib.link_problem(path)}; convert copies only "
                               "regular files of the input folder (put the file itself there)")
  return path if files_lib.regular_file(path) else None


def plan(input_dir: str, *, to: str = "masked", block_size: int | None = None,
         mask_id: int | None = None, keep_shift: bool = True, layout: str | None = None,
         dtype: str = "float32", written: bool = True) -> Plan:
  """The conversion's Plan from config.json and tokenizer.json (no weight read); every bad
  argument a ValueError naming it. written=False skips the checks of what would be written:
  that the layout's config.json expresses the network (an in-memory network, e.g. a
  RoPE-scaled Llama's) and that the tokenizer's placeholders stay within `max_vocab_gap`."""
  if to not in TARGETS:
    raise ValueError(f"to={to!r} must be one of {TARGETS}.")
  if not isinstance(keep_shift, bool):
    raise ValueError(f"keep_shift={keep_shift!r} must be True or False.")
  raw = _raw(input_dir)
  causal = causal_config(raw, dtype)
  name = _layout(to, keep_shift, causal.qk_norm, layout)
  if to == "masked" and block_size is not None:
    raise ValueError(f"block_size={block_size!r}: only to='block' has blocks (leave it unset).")
  if to == "block":
    block_size = DEFAULT_BLOCK[name] if block_size is None else block_size
    checks.check_count("block_size", block_size)
    if causal.max_len % block_size or causal.max_len < 2 * block_size:
      raise ValueError(f"block_size={block_size} must divide the input's "
                       f"max_position_embeddings={causal.max_len} into at least two blocks.")
  for side in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, *SIDE_FILES):
    _input_file(input_dir, side)  # a link refused before anything is read or written
  tokenizer = _tokenizer(input_dir)
  size = None if tokenizer is None else tokenizer.get_vocab_size(with_added_tokens=True)
  vocab = causal.vocab_size
  if mask_id is None:
    mask_id, appended = vocab, True
  else:
    appended = False
    if not checks.is_int(mask_id) or not 0 <= mask_id < vocab:
      raise ValueError(f"mask_id={mask_id!r} is out of range: a reused id lies in [0, "
                       f"vocab_size={vocab}) (leave it unset to append the new id {vocab}).")
    token = _token_at(tokenizer, mask_id)
    if token is not None and token not in MASK_TOKENS:
      raise ValueError(f"mask_id={mask_id} is the tokenizer's token {token!r}: no room for a "
                       f"mask there (the tokenizer has {size} ids of the {vocab} rows); leave "
                       f"mask_id unset to append the new id {vocab}.")
    if mask_id in (causal.eos_id, formats.base.config_token_id(raw, "bos_token_id", "input"),
                   formats.base.config_token_id(raw, "pad_token_id", "input")):
      raise ValueError(f"mask_id={mask_id} is the input's EOS, BOS or pad id.")
  gap = 0 if size is None else mask_id - size  # the placeholders tokenizer.json would get
  if written and gap > max_vocab_gap(vocab):
    raise ValueError(
        f"mask_id={mask_id}: the tokenizer has {size:,} ids, so the {gap:,} ids between would "
        f"each be written as a placeholder token; at most {max_vocab_gap(vocab):,} are (1,024 "
        f"or 1% of the {vocab:,} rows of config.json's vocab_size, a padded vocabulary's "
        "spare rows). Check the input's vocab_size against its tokenizer"
        + ("." if appended else ", or reuse an id nearer the tokenizer's last."))
  fields = dict(family=name, vocab_size=vocab + appended, mask_id=mask_id, causal=False,
                logit_shift=keep_shift, block_size=block_size if to == "block" else None,
                qkv_bias=causal.qkv_bias or name in ("dream", "fast_dllm_v2"))
  config = PublishedConfig(**{**dataclasses.asdict(causal), **fields})
  family = formats.get(name)
  try:
    hf = family.config_to_hf(config)  # what the layout cannot express, by its own message
    back = family.config_from_hf(hf, dtype)
  except ValueError as error:
    if written:
      raise ValueError(f"layout={name!r}: the input cannot be written in it: {error}") from None
    back = config
  if back.eot_id != config.eot_id and config.eot_id is None:  # an end of turn the layout
    config = dataclasses.replace(config, eot_id=back.eot_id)  # infers (SDAR: <|im_end|>)
  lost = [f.name for f in dataclasses.fields(config)
          if getattr(back, f.name) != getattr(config, f.name)]
  if lost and written:  # a field the layout's config.json drops (Llama 3.1's RoPE scaling)
    raise ValueError(f"layout={name!r}: the input cannot be written in it: its config.json "
                     "does not keep " + ", ".join(
                         f"{n}={getattr(config, n)!r} (read back as {getattr(back, n)!r})"
                         for n in lost) + ".")
  return Plan(causal=causal, config=config, layout=name, mask_id=mask_id, appended=appended,
              tokenizer_size=size)


# ----------------------------------------------------------------------------
# The weights.
# ----------------------------------------------------------------------------


def convert_params(plan_: Plan, params: dict) -> dict:
  """The causal params as the converted network's: the embedding and head grown by the new
  row (mean embedding, zero head column) or the reused row reset alike, zero q/k/v biases
  where the layout has them and the input not. Host arrays in the params' dtype."""
  params = jax.tree.map(np.asarray, params)
  dtype = params["embed"].dtype
  embed = params["embed"].astype(np.float32)
  head = params["head"].astype(np.float32)
  # The mean of the rows of the tokenizer's ids (a padded vocabulary's spare rows never
  # trained), all rows without a tokenizer.
  rows = min(plan_.tokenizer_size or embed.shape[0], plan_.causal.vocab_size)
  mean_D = embed[:rows].mean(axis=0)
  if plan_.appended:
    embed = np.concatenate([embed, mean_D[None]], axis=0)
    head = np.concatenate([head, np.zeros((head.shape[0], 1), np.float32)], axis=1)
  else:
    embed[plan_.mask_id] = mean_D
    head[:, plan_.mask_id] = 0.0
  out = {**params, "embed": embed.astype(dtype), "head": head.astype(dtype),
         "layers": dict(params["layers"])}
  config = plan_.config
  if config.qkv_bias and not plan_.causal.qkv_bias:
    n = config.num_layers
    out["layers"].update(
        q_bias=np.zeros((n, config.num_heads * config.head_dim), dtype),
        k_bias=np.zeros((n, config.num_kv_heads * config.head_dim), dtype),
        v_bias=np.zeros((n, config.num_kv_heads * config.head_dim), dtype))
  return out


def converted(input_dir: str, *, to: str = "masked", block_size: int | None = None,
              mask_id: int | None = None, keep_shift: bool = True, layout: str | None = None,
              dtype: str | None = None, written: bool = True) -> tuple[Plan, dict, dict]:
  """(Plan, converted params, causal params) in memory: the network `convert` writes
  (`written`: as `plan`'s)."""
  probe = plan(input_dir, to=to, block_size=block_size, mask_id=mask_id,
               keep_shift=keep_shift, layout=layout, written=written)
  causal, params, _ = load_causal(input_dir, dtype)
  chosen = dataclasses.replace(probe, causal=causal,
                               config=dataclasses.replace(probe.config, dtype=causal.dtype))
  return chosen, convert_params(chosen, params), params


# ----------------------------------------------------------------------------
# The tokenizer files.
# ----------------------------------------------------------------------------


def _added(content: str, token_id: int) -> dict:
  return {"id": token_id, "content": content, "single_word": False, "lstrip": False,
          "rstrip": False, "normalized": False, "special": True}


def _tokenizer_files(input_dir: str, out: str, plan_: Plan) -> list[str]:
  """tokenizer.json and tokenizer_config.json with the mask token at the mask id (unchanged
  where it is there already); the other side files copied. The names written."""
  written = []
  path = _input_file(input_dir, TOKENIZER_FILE)
  if path is not None:
    spec = files_lib.read_json(path, TOKENIZER_FILE)
    size = plan_.tokenizer_size
    tokens = list(spec.get("added_tokens") or [])
    new = []
    if plan_.mask_id >= size:  # tokenizer.json has no gaps: placeholders up to the mask id
      new = [_added(f"<|unused_{i}|>", i) for i in range(size, plan_.mask_id)]
      new.append(_added(MASK_TOKEN, plan_.mask_id))
    spec["added_tokens"] = tokens + new
    with files_lib.atomic_write(os.path.join(out, TOKENIZER_FILE), "w") as f:
      json.dump(spec, f, ensure_ascii=False, indent=2)
    written.append(TOKENIZER_FILE)
    config_path = _input_file(input_dir, TOKENIZER_CONFIG_FILE)
    if config_path is not None:
      tok_config = files_lib.read_json(config_path, TOKENIZER_CONFIG_FILE)
      decoder = dict(tok_config.get("added_tokens_decoder") or {})
      for token in new:
        decoder[str(token["id"])] = {k: v for k, v in token.items() if k != "id"}
      if decoder:
        tok_config["added_tokens_decoder"] = decoder
      tok_config["mask_token"] = _mask_content(spec, plan_.mask_id)
      with files_lib.atomic_write(os.path.join(out, TOKENIZER_CONFIG_FILE), "w") as f:
        json.dump(tok_config, f, ensure_ascii=False, indent=2)
      written.append(TOKENIZER_CONFIG_FILE)
  for name in SIDE_FILES:
    source = _input_file(input_dir, name)
    if source is not None:
      with files_lib.open_regular(source, follow_links=False) as f, \
           files_lib.atomic_write(os.path.join(out, name)) as copy:
        shutil.copyfileobj(f, copy)
      written.append(name)
  return written


def _mask_content(spec: dict, mask_id: int) -> str:
  for token in spec.get("added_tokens") or []:
    if token.get("id") == mask_id:
      return token["content"]
  return MASK_TOKEN


# ----------------------------------------------------------------------------
# The folder.
# ----------------------------------------------------------------------------


def _check_partial(partial: str) -> None:
  """A ValueError when `partial` (OUT.partial) exists: a conversion that stopped, or a
  folder of someone else's that happens to bear the name; never deleted for the user."""
  if os.path.lexists(partial):
    raise ValueError(f"{partial} exists (an earlier run that did not finish, or another "
                     "folder of that name); the folder is written there, and only what this "
                     "run made is deleted: remove it, or choose another out.")


def make_partial(out: str) -> str:
  """OUT.partial, made by this run (so that a failure may remove it): a ValueError
  (`_check_partial`'s) when something is there already, made meanwhile too."""
  partial = out + ".partial"
  try:
    os.mkdir(partial)
  except FileExistsError:
    _check_partial(partial)
    raise
  return partial


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.unlink(path)


def convert(input_dir: str, out_dir: str, *, to: str = "masked", block_size: int | None = None,
            mask_id: int | None = None, keep_shift: bool = True, layout: str | None = None,
            log=print) -> str:
  """Writes the diffusion folder of the causal folder `input_dir` to `out_dir` (module
  docstring) and returns its path. `out_dir` must not exist (or be an empty folder); the
  folder is written as OUT.partial and renamed at the end."""
  from mdjax import io
  if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir):
    raise ValueError(f"out={out_dir!r} must be a folder path.")
  out = os.path.abspath(os.fspath(out_dir))
  if os.path.lexists(out) and not (os.path.isdir(out) and not os.path.islink(out)
                                   and not os.listdir(out)):
    raise ValueError(f"out={out_dir!r} exists; the conversion writes a new folder.")
  if os.path.abspath(os.fspath(input_dir)) == out:
    raise ValueError(f"out={out_dir!r} is the input folder.")
  partial = out + ".partial"
  _check_partial(partial)
  chosen, params, _ = converted(input_dir, to=to, block_size=block_size, mask_id=mask_id,
                                keep_shift=keep_shift, layout=layout)
  make_partial(out)  # this run's own from here: one made meanwhile is refused, not removed
  try:
    io.save(params, partial, family=chosen.layout, config=chosen.config)
    _tokenizer_files(input_dir, partial, chosen)
    _add_source_ids(partial, input_dir)
    _check_written(partial, chosen)
    if os.path.isdir(out):
      os.rmdir(out)
    os.rename(partial, out)
  except BaseException:
    _remove(partial)
    raise
  log(f"converted {input_dir} ({chosen.causal.family}{', q/k norm' if chosen.causal.qk_norm else ''}) "
      f"-> {out}: {chosen.layout} layout, {'block-causal in blocks of ' + str(chosen.config.block_size) if chosen.config.block_size else 'bidirectional'}, "
      f"shift {'kept' if chosen.config.logit_shift else 'dropped'}, mask id {chosen.mask_id}"
      f"{' (appended)' if chosen.appended else ' (reused)'}")
  return out


def _check_written(folder: str, chosen: Plan) -> None:
  """The written folder reads back as the plan's network (config.json through the family's
  reader) and its tokenizer fits the ids (`mdjax.load`'s check), no weight read again."""
  from mdjax.io.folder import check_tokenizer
  from mdjax.tokenizers import load_hf_tokenizer
  path = os.path.join(folder, "config.json")
  raw = files_lib.read_json(path, "config.json")
  family = formats.detect(raw, path)
  config = family.config_from_hf(raw, chosen.config.dtype)
  if family.family != chosen.layout or config != chosen.config:
    raise ValueError(f"{path} reads back as {config}, not {chosen.config}.")
  check_tokenizer(load_hf_tokenizer(folder), config, raw, os.path.join(folder, TOKENIZER_FILE))


def _add_source_ids(folder: str, input_dir: str) -> None:
  """The input's BOS id (which the params do not carry) kept in config.json."""
  path = os.path.join(folder, "config.json")
  hf: dict[str, Any] = files_lib.read_json(path, "config.json")
  source = files_lib.read_json(os.path.join(input_dir, "config.json"), "config.json")
  if "bos_token_id" in source and "bos_token_id" not in hf:
    hf["bos_token_id"] = source["bos_token_id"]
  tensors_lib.write_json(path, hf)
