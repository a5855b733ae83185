"""Language-model generation: prompts of different lengths in one batch, end of sequence, a mesh.

A batch of prompts is left-padded to its longest prompt and followed by the same generation
span in every row; `valid_BxL` marks the padding, which the denoiser neither reads nor counts
in positions (`models.Transformer`), so each row gives the tokens it gives sampled alone
(tests/test_generation.py). With the task's EOS id in the spec (`eos_id`) rows end early and
`SampleResult.generated_length_B` counts each row's tokens before its EOS.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import jsonl, sampling
from mdjax.denoiser import Denoiser


def _is_chat(messages) -> bool:
  return isinstance(messages, list) and bool(messages) and all(
      isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)


def read_prompts(path: str, messages: bool = False) -> list:
  """The prompts of a JSONL file, one `{"prompt": TEXT}` a line (with messages=True also
  `{"messages": [{"role": ..., "content": ...}, ...]}`, a chat, read as its list); a
  ValueError names the line."""
  shape = "{\"prompt\": TEXT}" + (" or {\"messages\": [{\"role\": ..., \"content\": ...}]}"
                                  if messages else "")
  prompts = []
  for number, row in jsonl.read_rows(path, "prompts"):
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if messages and prompt is None and isinstance(row, dict):
      prompt = row.get("messages") if _is_chat(row.get("messages")) else None
    if prompt is None or not isinstance(prompt, (str, list)):
      raise ValueError(f"prompts={path!r} line {number} has no \"prompt\" string: "
                       f"{json.dumps(row)[:80]!r}; each line must be {shape}.")
    prompts.append(prompt)
  if not prompts:
    raise ValueError(f"prompts={path!r} holds no prompt; give one {shape} a line.")
  return prompts


def left_padded(prompts_ids: Sequence[np.ndarray], length: int, mask_id: int,
                pad_id: int = 0, start: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, int]:
  """Three values, (tokens_BxL, valid_BxL, start): the prompts right-aligned at `start`
  (default: the longest prompt's length), padding (`pad_id`, not valid) before them, masks
  from `start` to the end (`length` - `start` positions to generate)."""
  longest = max(len(p) for p in prompts_ids)
  if start is None:
    start = longest
  elif not longest <= start <= length:
    raise ValueError(f"start={start} is invalid: the prompts end there, so it must lie in "
                     f"[{longest} (the longest prompt), {length}].")
  tokens = np.full((len(prompts_ids), length), mask_id, np.int32)
  valid = np.ones((len(prompts_ids), length), bool)
  for row, ids in enumerate(prompts_ids):
    pad = start - len(ids)
    tokens[row, :pad], valid[row, :pad] = pad_id, False
    tokens[row, pad:start] = ids
  return tokens, valid, start


def completion_ids(row_L: np.ndarray, start: int, generated_length: int) -> np.ndarray:
  """The generated ids of a row: from `start`, its generated length (EOS excluded)."""
  return np.asarray(row_L)[start:start + int(generated_length)]


# ----------------------------------------------------------------------------
# Prompts to completions: `generate`.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
  """How `generate` lays out prompts and `max_new_tokens` for a model of `max_len` positions.

  canvas: every row on one canvas of `canvas_length` = longest prompt + max_new_tokens
    positions, `sampling.sample` over it (the prompts left-padded).
  blocks: past the model's length (a block-causal model) or with `blocks_of`:
    `sampling.sample_blocks`, `blocks_of` positions a block after a `window` of context,
    `length` = max_new_tokens rounded up to whole blocks (the rest is cut off); the spec's
    steps count per block.
  """

  max_new_tokens: int
  longest_prompt: int
  max_len: int
  layout: str  # "canvas" or "blocks"
  canvas_length: int | None = None
  blocks_of: int | None = None
  window: int | None = None
  length: int | None = None

  def describe(self) -> str:
    if self.layout == "canvas":
      return (f"{self.max_new_tokens} new tokens a prompt on a canvas of {self.canvas_length} "
              f"(longest prompt {self.longest_prompt} + {self.max_new_tokens})")
    return (f"{self.max_new_tokens} new tokens a prompt, block by block: blocks of "
            f"{self.blocks_of} after a window of {self.window} ({self.length // self.blocks_of} "
            f"blocks; the sampler's steps count per block)")


def plan_generation(prompt_lengths: Sequence[int], max_new_tokens: int, *, max_len: int,
                    model_block: int | None = None, blocks_of: int | None = None,
                    window: int | None = None, block_length: int | None = None
                    ) -> GenerationPlan:
  """The layout of `generate`, checked on the host: a ValueError names the argument.

  model_block: the denoiser's block size when it is block-causal (it can then generate past
  `max_len`); block_length: the spec's semi-autoregressive blocks, if any."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: it must be an integer "
                     ">= 1 (tokens generated after each prompt).")
  if not len(prompt_lengths):
    raise ValueError("prompts is empty: give at least one prompt (an empty prompt is fine).")
  longest, new = int(max(prompt_lengths)), int(max_new_tokens)
  if blocks_of is None and window is not None:
    raise ValueError(f"window={window} applies only with blocks_of (block by block).")
  if blocks_of is None and longest + new <= max_len:
    if block_length and new % block_length:
      raise ValueError(f"spec.block_length={block_length} must divide max_new_tokens={new}: "
                       "the semi-autoregressive blocks cut each row's new tokens; use a "
                       f"block_length that divides {new}, or max_new_tokens a multiple of "
                       f"{block_length}.")
    return GenerationPlan(new, longest, max_len, "canvas", canvas_length=longest + new)
  if blocks_of is None:
    if model_block is None:
      room = (f"so at most {max_len - longest} new tokens" if longest < max_len else
              f"so prompts must be shorter than {max_len} tokens")
      raise ValueError(
          f"max_new_tokens={new} is too many: the longest prompt (line "
          f"{int(np.argmax(prompt_lengths)) + 1}) has {longest} tokens and the model holds "
          f"{max_len} positions, {room} (a block-causal model, trained with block_size, "
          "generates past its length block by block).")
    blocks_of = model_block
  if not isinstance(blocks_of, (int, np.integer)) or not 1 <= blocks_of < max_len:
    raise ValueError(f"blocks_of={blocks_of!r} is invalid: it must be an integer in [1, "
                     f"{max_len - 1}] (a block and its window fit the model's {max_len}).")
  window = max_len - blocks_of if window is None else window
  length = -(-new // blocks_of) * blocks_of
  return GenerationPlan(new, longest, max_len, "blocks", blocks_of=int(blocks_of),
                        window=int(window), length=length)


@dataclasses.dataclass(frozen=True)
class Completions:
  """What `generate` returns, a row per prompt in the order given.

  token_ids: each row's new ids, up to its first EOS (excluded) and at most max_new_tokens.
  texts: the decoded `token_ids` (None for a task without text).
  nfe: denoiser passes, summed over the batches.
  """

  token_ids: list
  texts: list | None
  plan: GenerationPlan
  nfe: int

  @property
  def generated_length_B(self) -> np.ndarray:
    return np.array([len(ids) for ids in self.token_ids], np.int32)


def prompt_ids(task, prompts: Sequence, where: str = "prompts") -> list[np.ndarray]:
  """Texts (encoded by the task's tokenizer) or id sequences, as int32 arrays; a ValueError
  names the 1-based line of a prompt that cannot be encoded or holds an id outside
  0..mask_id - 1."""
  encoded = []
  for number, prompt in enumerate(prompts, 1):
    if isinstance(prompt, str):
      if task.encode is None:
        raise ValueError(f"{where} line {number} is text; task {task.name!r} has no text "
                         "encoding: give token ids.")
      try:
        ids = np.asarray(task.encode(prompt), np.int32).reshape(-1)
      except ValueError as error:
        raise ValueError(f"{where} line {number}: {error}") from None
    else:
      ids = np.asarray(prompt).reshape(-1)
      if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0
                       or ids.max() >= task.mask_id):
        raise ValueError(f"{where} line {number} holds {ids.tolist()[:8]}...; prompt ids are "
                         f"integers in [0, {task.mask_id - 1}].")
      ids = ids.astype(np.int32)
    encoded.append(ids)
  return encoded


def plan_for(apply_fn, task, prompts_ids: Sequence[np.ndarray], spec, *, max_new_tokens: int,
             blocks_of: int | None = None, window: int | None = None) -> GenerationPlan:
  """`plan_generation` for this denoiser, task and spec: what `generate` will run."""
  return plan_generation([len(p) for p in prompts_ids], max_new_tokens, max_len=task.length,
                         model_block=Denoiser.of(apply_fn).block_size, blocks_of=blocks_of,
                         window=window, block_length=sampling.family_of(spec).block_length(spec))


def generate(apply_fn, params, task, prompts: Sequence, spec, *, max_new_tokens: int,
             key: jax.Array, batch_size: int | None = None, blocks_of: int | None = None,
             window: int | None = None,
             on_batch: Callable[[int, int], None] | None = None) -> Completions:
  """`max_new_tokens` new tokens after each prompt (texts or token ids), whatever the batch.

  Prompts are left-padded to the longest prompt of all (exact: each row gives what it gives
  alone), and row i draws with `fold_in(key, i)`, so completions do not depend on
  `batch_size` (up to the rounding of programs compiled for other batch sizes, which can
  flip exact near-ties). Up to the
  model's length (`task.length`) every row is generated on one canvas; past it a
  block-causal denoiser (`Denoiser.block_size`) generates block by block
  (`sampling.sample_blocks`, the exact cache), any other is a ValueError giving the limit.
  `blocks_of`/`window` ask for block-by-block generation explicitly. With `spec.eos_id` a
  row stops at its EOS. `on_batch(done, total)` is called after each batch (a progress bar).

    model = mdjax.load("/tmp/models/bpe")
    out = generation.generate(model.apply_fn, model.params, model.task, ["HAMLET."],
                              sampling.ConfidenceSpec(steps=32, eos_id=model.task.eos_id),
                              max_new_tokens=32, key=jax.random.key(0))
    out.texts[0]
  """
  ids = prompt_ids(task, prompts)
  denoiser = Denoiser.of(apply_fn)
  model_block = denoiser.block_size
  plan = plan_for(denoiser, task, ids, spec, max_new_tokens=max_new_tokens,
                  blocks_of=blocks_of, window=window)
  batch_size = len(ids) if batch_size is None else batch_size
  if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
      or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r} is invalid: it must be an integer >= 1.")
  keys_N = jax.vmap(jax.random.fold_in, (None, 0))(key, np.arange(len(ids)))
  token_ids, nfe = [], 0
  for first in range(0, len(ids), batch_size):
    part, keys_B = ids[first:first + batch_size], keys_N[first:first + batch_size]
    # Every batch padded to the longest prompt of all: one shape, one compiled program.
    start = plan.longest_prompt
    if plan.layout == "canvas":
      tokens, valid, _ = left_padded(part, plan.canvas_length, task.mask_id, start=start)
      out = sampling.sample(denoiser, params, keys_B, tokens, spec, mask_id=task.mask_id,
                            valid_BxL=valid)
      final_BxL = np.asarray(out.tokens_BxL)
    else:
      tokens, valid, _ = left_padded(part, start, task.mask_id, start=start)
      out = sampling.sample_blocks(denoiser, params, keys_B, tokens, spec, length=plan.length,
                                   blocks_of=plan.blocks_of, window=plan.window,
                                   mask_id=task.mask_id, valid_BxP=valid,
                                   cached=model_block is not None)
      final_BxL = np.asarray(out.tokens_BxT)
    lengths_B = np.minimum(np.asarray(out.generated_length_B), plan.max_new_tokens)
    token_ids += [completion_ids(row, start, n) for row, n in zip(final_BxL, lengths_B)]
    nfe += int(out.nfe)
    if on_batch is not None:
      on_batch(min(first + batch_size, len(ids)), len(ids))
  texts = None if task.encode is None else [task.decode(row) for row in token_ids]
  return Completions(token_ids=token_ids, texts=texts, plan=plan, nfe=nfe)


def with_eos(spec, eos_id: int | None, **knobs):
  """`spec` with the end-of-sequence id and knobs (eos_penalty, eos_never, eos_rank_last)."""
  if eos_id is None:
    return spec
  return dataclasses.replace(spec, eos_id=int(eos_id), **knobs)


# ----------------------------------------------------------------------------
# A mesh.
# ----------------------------------------------------------------------------


def shard_params(mesh: Mesh, params, fsdp: bool = True):
  """Parameters on the mesh: each split on its first axis divisible by the `data` axis (FSDP,
  the layout training uses with train.fsdp=True), or replicated."""
  from mdjax import train
  return jax.device_put(params, train.param_sharding(mesh, params, fsdp))


_GATHERED: dict[tuple, Denoiser] = {}


def gathered(apply_fn, mesh: Mesh) -> Denoiser:
  """The denoiser (and every pass it offers) computing with its parameters all-gathered.

  Stored sharded (FSDP), the weights are gathered where they are used, so every device
  runs one device's arithmetic and the tokens are one device's, bit for bit. Left to
  partition the matmuls over sharded weights instead, XLA sums in another order: logits
  move by ~1e-5 and near-ties in a sample flip. One wrapper per (denoiser, mesh), so
  repeated calls reuse the compiled program.
  """
  denoiser = Denoiser.of(apply_fn)
  wrapper = _GATHERED.get((denoiser, mesh))
  if wrapper is not None:
    return wrapper
  replicate = lambda params: jax.lax.with_sharding_constraint(
      params, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params))

  def on_gathered(method):
    if method is None:
      return None
    return lambda params, *args, **kwargs: method(replicate(params), *args, **kwargs)

  wrapper = Denoiser(on_gathered(denoiser.apply), prefill=on_gathered(denoiser.prefill),
                     decode=on_gathered(denoiser.decode), block_size=denoiser.block_size,
                     block_pair=on_gathered(denoiser.block_pair))
  _GATHERED[denoiser, mesh] = wrapper
  return wrapper


def sample_on_mesh(apply_fn, params: Any, key: jax.Array, tokens_BxL, spec, mesh: Mesh, *,
                   fixed_BxL=None, valid_BxL=None, mask_id: int | None = None,
                   fsdp: bool = True) -> sampling.SampleResult:
  """`sampling.sample` with the batch split on the mesh's `data` axis and the parameters
  stored sharded (FSDP) over it, gathered where used (`gathered`): one program over every
  device, the same tokens as on one device (the rows keep their keys: `split(key, B)`)."""
  if "data" not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}; sampling splits the batch on 'data'.")
  batch, size = np.shape(tokens_BxL)[0], mesh.shape["data"]
  if batch % size:
    raise ValueError(f"mesh data axis of {size} devices does not divide the batch B={batch}; "
                     f"use a batch that is a multiple of {size}.")
  rows = NamedSharding(mesh, PartitionSpec("data"))
  put = lambda x: None if x is None else jax.device_put(np.asarray(x), rows)
  keys_B = sampling.row_keys(key, batch)
  return sampling.sample(gathered(apply_fn, mesh), shard_params(mesh, params, fsdp),
                         jax.device_put(keys_B, rows),
                         put(tokens_BxL), spec, put(fixed_BxL), mask_id=mask_id,
                         valid_BxL=put(valid_BxL))
