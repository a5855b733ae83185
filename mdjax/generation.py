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
from typing import Callable, Sequence

import jax
import numpy as np

from mdjax import jsonl, sampling
from mdjax.errors import ArgumentError
from mdjax.model import Model, SamplerPlan


def _is_chat(messages) -> bool:
  return isinstance(messages, list) and bool(messages) and all(
      isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)


def read_prompts(path: str, messages: bool = False) -> list:
  """The prompts of a JSONL file, one `{"prompt": TEXT}` or `{"prompt": [ID, ...]}` (token
  ids) a line (with messages=True also `{"messages": [{"role": ..., "content": ...}, ...]}`,
  a chat, read as its list); a ValueError names the line."""
  shape = "{\"prompt\": TEXT} or {\"prompt\": [ID, ...]}" + (
      " or {\"messages\": [{\"role\": ..., \"content\": ...}]}" if messages else "")
  prompts = []
  for number, row in jsonl.read_rows(path, "prompts"):
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if messages and prompt is None and isinstance(row, dict):
      prompt = row.get("messages") if _is_chat(row.get("messages")) else None
    if prompt is None or not isinstance(prompt, (str, list)):
      raise ArgumentError("prompts", f"prompts={path!r} line {number} has no \"prompt\" "
                          f"text or ids: {json.dumps(row)[:80]!r}; each line must be {shape}.")
    prompts.append(prompt)
  if not prompts:
    raise ArgumentError("prompts", f"prompts={path!r} holds no prompt; give one {shape} a line.")
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


MAX_KEY_SEED = 2**32 - 1  # an int key is jax.random.key's seed: 32 bits without x64


def check_key(key) -> jax.Array:
  """`generate`'s key: a `jax.random.key(seed)` (or a legacy `jax.random.PRNGKey(seed)`), or
  an int seed in [0, 2**32 - 1], read as `jax.random.key(seed)` (what the server does with a
  request's `seed`). Anything else is an `ArgumentError` naming `key`."""
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    if not 0 <= key <= MAX_KEY_SEED:
      raise ArgumentError.invalid("key", key, f"an int key is jax.random.key's seed, in "
                                  f"[0, {MAX_KEY_SEED}]")
    return jax.random.key(int(key))
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  if (typed and shape == ()) or (not typed and dtype == np.uint32 and shape == (2,)):
    return key
  given = (f"an array of shape {tuple(shape)} and dtype {dtype}" if shape is not None
           else repr(key)[:60])
  raise ArgumentError("key", f"key={given} is invalid: it must be one jax.random.key(seed) "
                      f"(shape ()), a jax.random.PRNGKey(seed), or an int seed in "
                      f"[0, {MAX_KEY_SEED}] (key=s is jax.random.key(s)).")


def check_max_new_tokens(max_new_tokens) -> None:
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ArgumentError.invalid("max_new_tokens", max_new_tokens, "it must be an integer >= 1 "
                                "(tokens generated after each prompt)")


def check_new_tokens(max_new_tokens, max_len: int, *, model_block: int | None = None,
                     new_tokens: str = "max_new_tokens", room: str = "the model") -> None:
  """What needs no prompt: max_new_tokens an integer >= 1 that leaves room for a prompt of
  at least one position in `max_len`, unless a block-causal model (`model_block`) generates
  past its length. Checked before any prompt is encoded."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ArgumentError.invalid(new_tokens, max_new_tokens, "it must be an integer >= 1 "
                                "(tokens generated after each prompt)")
  if model_block is None and max_new_tokens > max_len:
    raise ArgumentError(new_tokens, f"{new_tokens}={max_new_tokens} is too many: {room} holds "
                        f"{max_len} positions, the prompt's and the new tokens together, so at "
                        f"most {max_len} less the prompt's tokens.")


def plan_generation(prompt_lengths: Sequence[int], max_new_tokens: int, *, max_len: int,
                    model_block: int | None = None, blocks_of: int | None = None,
                    window: int | None = None, block_length: int | None = None,
                    prompts: str = "prompts", new_tokens: str = "max_new_tokens",
                    room: str = "the model") -> GenerationPlan:
  """The layout of `generate`, checked on the host: an `ArgumentError` names the argument.
  The one length rule for a prompt and its new tokens, wherever they come from (`generate`,
  sample.py, the server's requests).

  model_block: the denoiser's block size when it is block-causal (it can then generate past
  `max_len`); block_length: the spec's semi-autoregressive blocks, if any. prompts,
  new_tokens, room: how an error names the prompts' argument, the new tokens' argument and
  what holds the `max_len` positions."""
  check_new_tokens(max_new_tokens, max_len, model_block=model_block if blocks_of is None
                   else blocks_of, new_tokens=new_tokens, room=room)
  if not len(prompt_lengths):
    raise ArgumentError(prompts, f"{prompts} is empty: give at least one prompt (an empty "
                        "prompt is fine).")
  longest, new = int(max(prompt_lengths)), int(max_new_tokens)
  if blocks_of is None and window is not None:
    raise ArgumentError("window", f"window={window} applies only with blocks_of (block by "
                        "block).")
  if blocks_of is None and longest + new <= max_len:
    if block_length and new % block_length:
      raise ArgumentError("spec.block_length", f"spec.block_length={block_length} must divide "
                          f"{new_tokens}={new}: the semi-autoregressive blocks cut each row's "
                          f"new tokens; use a block_length that divides {new}, or "
                          f"{new_tokens} a multiple of {block_length}.")
    return GenerationPlan(new, longest, max_len, "canvas", canvas_length=longest + new)
  if blocks_of is None:
    if model_block is None:
      many = len(prompt_lengths) > 1 or prompts == "prompts"
      line = int(np.argmax(prompt_lengths)) + 1
      which = f"{prompts} line {line}" if many else f"the {prompts}"
      if longest >= max_len:
        raise ArgumentError(
            prompts, f"{which} has {longest} tokens; {room} holds {max_len} positions, so a "
            f"prompt may have at most {max_len - new} tokens to leave room for "
            f"{new_tokens}={new}: shorten it.")
      raise ArgumentError(
          new_tokens, f"{new_tokens}={new} is too many: {which} has {longest} tokens and "
          f"{room} holds {max_len} positions, so at most {max_len - longest} new tokens.")
    blocks_of = model_block
  if not isinstance(blocks_of, (int, np.integer)) or not 1 <= blocks_of < max_len:
    raise ArgumentError.invalid("blocks_of", blocks_of, f"it must be an integer in [1, "
                                f"{max_len - 1}] (a block and its window fit the model's "
                                f"{max_len})")
  window = max_len - blocks_of if window is None else window
  length = -(-new // blocks_of) * blocks_of
  return GenerationPlan(new, longest, max_len, "blocks", blocks_of=int(blocks_of),
                        window=int(window), length=length)


@dataclasses.dataclass(frozen=True)
class Completion:
  """One prompt's completion.

  token_ids: the new ids, up to the first stop id (EOS, end of turn; excluded) and at most
  max_new_tokens. text: their decoded text (None for a model without a text codec).
  finish_reason: "stop" (a stop id ended it) or "length" (max_new_tokens did).
  prompt_ids: the prompt as the model read it (the chat template applied).
  """

  token_ids: np.ndarray
  text: str | None
  finish_reason: str
  prompt_ids: np.ndarray


class Completions(list):
  """What `generate` returns: a `Completion` per prompt, in the order given, with the
  call's `plan` (the layout run) and `nfe` (denoiser passes summed over the batches);
  `texts` and `token_ids` are the columns (`texts` None for a model without text)."""

  def __init__(self, items, plan: "GenerationPlan", nfe: int):
    super().__init__(items)
    self.plan, self.nfe = plan, nfe

  @property
  def token_ids(self) -> list[np.ndarray]:
    return [c.token_ids for c in self]

  @property
  def texts(self) -> list[str] | None:
    return None if any(c.text is None for c in self) else [c.text for c in self]

  @property
  def generated_length_B(self) -> np.ndarray:
    return np.array([len(c.token_ids) for c in self], np.int32)


def _is_id(prompt) -> bool:
  """A bare integer: a token id where a prompt belongs."""
  return isinstance(prompt, (int, np.integer)) and not isinstance(prompt, bool)


def _is_messages(prompt) -> bool:
  return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_ids(model: Model, prompts: Sequence, *, chat: bool = False,
               where: str = "prompts") -> list[np.ndarray]:
  """Each prompt as int32 ids: a text (encoded by the model's codec, no special tokens),
  a chat (a list of {"role", "content"} messages, or a text with chat=True: one user
  message) through the model's chat template, or a sequence of ids. An `ArgumentError`
  (param `where`) names the 1-based line of a prompt that cannot be encoded or holds an id
  outside [0, vocab) or the mask id (a single prompt named other than "prompts": by its name),
  and refuses a bare id where a prompt belongs: a flat [10, 1, 2] is no list of prompts."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
    raise ArgumentError(where, f"{where} is a {type(prompts).__name__}: give a list of prompts "
                        "(texts, chats or id sequences).")
  if not len(prompts):
    raise ArgumentError(where, f"{where} is empty: give at least one prompt (an empty prompt "
                        "is fine).")
  if all(_is_id(prompt) for prompt in prompts):
    # The server's rule: `"prompt": [10, 1, 2]` is one prompt of ids, never three.
    ids = [int(p) for p in prompts[:8]]
    more = ", ..." if len(prompts) > 8 else ""
    flat = ", ".join(map(str, ids)) + more
    raise ArgumentError(where, f"{where}=[{flat}] is a flat list of ids; {where} is a list of "
                        f"prompts: give [[{flat}]] for one prompt of these ids (as the server "
                        f"reads \"prompt\": [{flat}]), or "
                        f"[{', '.join(f'[{i}]' for i in ids)}{more}] for one-id prompts.")
  limit = model.vocab_size
  encoded = []
  for number, prompt in enumerate(prompts, 1):
    line = f"{where} line {number}" if len(prompts) > 1 or where == "prompts" else where
    if _is_id(prompt):
      raise ArgumentError(where, f"{line} is the id {int(prompt)}; a prompt is a text, a chat "
                          f"or a list of ids ([{int(prompt)}] for that one id).")
    if chat or _is_messages(prompt):
      if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise ArgumentError(where, f"{line} is ids; chat=True needs texts or messages.")
      messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
      try:
        prompt = model.render_chat(list(messages))
      except ValueError as error:
        raise ArgumentError(where, f"{line}: {error}") from None
    if isinstance(prompt, str):
      if model.encode is None:
        raise ArgumentError(where, f"{line} is text; the {model.family!r} model has no text "
                            "codec: give token ids, a list of integers such as [10, 1, 2].")
      try:
        ids = np.asarray(model.encode(prompt), np.int64).reshape(-1)
      except ValueError as error:
        raise ArgumentError(where, f"{line}: {error}") from None
    else:
      ids = np.asarray(prompt).reshape(-1)
      if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ArgumentError(where, f"{line} holds {ids.tolist()[:8]}; prompt ids are integers "
                            f"in [0, {limit - 1}].")
    if ids.size and (ids.min() < 0 or ids.max() >= limit or (ids == model.mask_id).any()):
      raise ArgumentError(where, f"{line} holds {ids.tolist()[:8]}...; prompt ids are "
                          f"integers in [0, {limit - 1}] other than the mask id "
                          f"{model.mask_id}.")
    encoded.append(ids.astype(np.int32))
  return encoded


def _check_batch_size(batch_size, default: int) -> int:
  if batch_size is None:
    return default
  if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
      or batch_size < 1:
    raise ArgumentError.invalid("batch_size", batch_size, "it must be an integer >= 1")
  return int(batch_size)


def sampler_plan(model: Model, prompt_length: int, max_new_tokens: int, spec=None,
                 **knobs) -> SamplerPlan:
  """What a call runs: `spec` (any family's) on the model's denoiser, or with spec=None the
  model's default sampler (`model.sampler`) with `knobs` over its defaults."""
  if spec is not None:
    if knobs:
      raise ArgumentError(sorted(knobs)[0], f"{sorted(knobs)} are knobs of the model's default "
                          "sampler; with spec= the spec carries the sampler's settings.")
    return SamplerPlan(model.denoiser, spec)
  if model.sampler is None:
    raise ArgumentError("spec", f"the {model.family!r} model has no default sampler; give "
                        "spec=.")
  unknown = sorted(set(knobs) - set(model.sampler.knobs))
  if unknown:
    raise ArgumentError(unknown[0], f"{unknown[0]}= does not apply to the {model.family} "
                        f"model's default sampler; its knobs: {', '.join(model.sampler.knobs)}.")
  return model.sampler.plan(model, prompt_length=prompt_length,
                            max_new_tokens=max_new_tokens, **knobs)


def generate_ids(model: Model, prompts_ids: Sequence[np.ndarray], *, max_new_tokens: int,
                 key: jax.Array | int, spec=None, batch_size: int | None = None,
                 blocks_of: int | None = None, window: int | None = None,
                 on_batch: Callable[[int, int], None] | None = None,
                 **knobs) -> tuple[list[np.ndarray], np.ndarray, GenerationPlan, int]:
  """Token ids in, token ids out: (each row's new ids up to the sampler's end, at most
  max_new_tokens; generated lengths; the plan; nfe). The layer under `generate`, with the
  same rules: every batch left-padded to the longest prompt of all (one shape, one compiled
  program), row i drawing with `fold_in(key, i)`."""
  if not len(prompts_ids):
    raise ArgumentError("prompts", "prompts is empty: give at least one prompt (an empty "
                        "prompt is fine).")
  check_max_new_tokens(max_new_tokens)
  key = check_key(key)
  longest = max(len(p) for p in prompts_ids)
  run = sampler_plan(model, longest, max_new_tokens, spec, **knobs)
  # A family over a noise process takes the model's (as the mask id comes from the model).
  run = dataclasses.replace(run, spec=sampling.with_noise(run.spec, model.noise))
  if blocks_of is None and run.blocks_of is not None:
    blocks_of, window = run.blocks_of, run.window if window is None else window
  plan = plan_generation([len(p) for p in prompts_ids], max_new_tokens, max_len=model.max_len,
                         model_block=run.denoiser.block_size, blocks_of=blocks_of,
                         window=window,
                         block_length=sampling.family_of(run.spec).block_length(run.spec))
  batch_size = _check_batch_size(batch_size, len(prompts_ids))
  if not model.takes_padding and len({len(p) for p in prompts_ids}) > 1:
    raise ArgumentError("prompts", f"the {model.family!r} model takes no padding (an exact "
                        f"denoiser: its positions are fixed), and the prompts have lengths "
                        f"{sorted({len(p) for p in prompts_ids})}: give prompts of one length.")
  params = model.params if run.params is None else run.params
  mask_id = model.mask_id
  keys_N = jax.vmap(jax.random.fold_in, (None, 0))(key, np.arange(len(prompts_ids)))
  token_ids, lengths, nfe = [], [], 0
  start = plan.longest_prompt
  for first in range(0, len(prompts_ids), batch_size):
    part, keys_B = prompts_ids[first:first + batch_size], keys_N[first:first + batch_size]
    valid_given = model.takes_padding
    if plan.layout == "canvas":
      tokens, valid, _ = left_padded(part, plan.canvas_length, mask_id, pad_id=model.pad_id,
                                     start=start)
      out = sampling.sample(run.denoiser, params, keys_B, tokens, run.spec, mask_id=mask_id,
                            valid_BxL=valid if valid_given else None)
      final_BxL = np.asarray(out.tokens_BxL)
    else:
      tokens, valid, _ = left_padded(part, start, mask_id, pad_id=model.pad_id, start=start)
      out = sampling.sample_blocks(run.denoiser, params, keys_B, tokens, run.spec,
                                   length=plan.length, blocks_of=plan.blocks_of,
                                   window=plan.window, mask_id=mask_id,
                                   valid_BxP=valid if valid_given else None,
                                   cached=run.denoiser.block_size is not None)
      final_BxL = np.asarray(out.tokens_BxT)
    lengths_B = np.minimum(np.asarray(out.generated_length_B), plan.max_new_tokens)
    token_ids += [completion_ids(row, start, n) for row, n in zip(final_BxL, lengths_B)]
    lengths += lengths_B.tolist()
    nfe += int(out.nfe)
    if on_batch is not None:
      on_batch(min(first + batch_size, len(prompts_ids)), len(prompts_ids))
  return token_ids, np.asarray(lengths, np.int32), plan, nfe


def generate(model: Model, prompts: Sequence, *, max_new_tokens: int, key: jax.Array | int,
             spec=None, batch_size: int | None = None, chat: bool = False,
             stop_at_eos: bool = True, blocks_of: int | None = None,
             window: int | None = None, on_batch: Callable[[int, int], None] | None = None,
             **knobs) -> Completions:
  """`max_new_tokens` new tokens after each prompt, for any `Model` (`mdjax.load`).

  prompts: a list of prompts, each a text, a chat (a list of {"role", "content"} messages;
  with chat=True a text is one user message) through the model's chat template, or a list of
  ids (`prompt_ids`): [[10, 1, 2]] is one prompt of ids; a flat [10, 1, 2] is refused.
  spec: any sampler family's spec; None runs the model's default sampler (a published
  checkpoint's reference sampler, a workdir's configured one) with `knobs` (`temperature`,
  `steps`, ...: `model.sampler.knobs`) over its defaults.
  key: a `jax.random.key(seed)` or an int seed (key=s is `jax.random.key(s)`: `check_key`);
  row i draws with `fold_in(key, i)`, and every batch is left-padded to the longest
  prompt of all, so a completion does not depend on `batch_size` (up to the rounding of
  programs compiled for other batch sizes, which can flip exact near-ties). A model whose
  positions count from each row's first real token (mdjax's, Dream's) gives a prompt the
  same completion beside any other prompts; LLaDA's positions are absolute, as in its
  reference code, so its completion also depends on the padding before the prompt.
  Up to the model's length every row is generated on one canvas; past it a block-causal
  denoiser generates block by block (`blocks_of`/`window` ask for that explicitly).
  stop_at_eos: a completion ends before its first stop id (`model.stop_ids`).
  on_batch(done, total) is called after each batch (a progress bar).

    model = mdjax.load("/tmp/models/bpe")
    out = mdjax.generate(model, ["HAMLET."], max_new_tokens=32, key=jax.random.key(0))
    out[0].text
  """
  key = check_key(key)
  ids = prompt_ids(model, prompts, chat=chat)
  token_ids, lengths, plan, nfe = generate_ids(
      model, ids, max_new_tokens=max_new_tokens, key=key, spec=spec, batch_size=batch_size,
      blocks_of=blocks_of, window=window, on_batch=on_batch, **knobs)
  items = [completion_of(model, prompt, row, length, plan.max_new_tokens, stop_at_eos)
           for prompt, row, length in zip(ids, token_ids, lengths)]
  return Completions(items, plan, nfe)


def completion_of(model: Model, prompt: np.ndarray, row: np.ndarray, length: int,
                  max_new_tokens: int, stop_at_eos: bool = True) -> Completion:
  """A row's `Completion`: its new ids cut before the first stop id (with stop_at_eos);
  "stop" when a stop id or the sampler's end came before `max_new_tokens`."""
  stops = np.asarray(model.stop_ids if stop_at_eos else (), np.int64)
  ends = np.flatnonzero(np.isin(row, stops)) if stops.size else []
  stopped = bool(len(ends)) or length < max_new_tokens
  row = np.asarray(row[:ends[0]] if len(ends) else row)
  text = None if model.decode is None else model.decode([int(t) for t in row])
  return Completion(row, text, "stop" if stopped else "length", prompt)


def with_eos(spec, eos_id: int | None, **knobs):
  """`spec` with the end-of-sequence id and knobs (eos_penalty, eos_never, eos_rank_last)."""
  if eos_id is None:
    return spec
  return dataclasses.replace(spec, eos_id=int(eos_id), **knobs)

