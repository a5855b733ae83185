"""What one request may cost the server: the bounds on its fields, checked before any work is
done for it (docs/security.md, "The server").

`Engine.prepare` checks a request against them before its prompt is encoded, each an
`ArgumentError` naming the field and the bound (the server's 400):

- the knobs that count denoiser steps or rounds (`STEP_KNOBS`: `steps`, ...) are at most
  `max_steps` (`python -m mdjax.serve --max_steps`; default `STEPS_PER_POSITION` times the
  positions a row holds), and so are the steps the sampler will run, checked before its plan
  (an entry a step) is built: every step is a denoiser pass over the row;
- the knobs that count canvas positions (`POSITION_KNOBS`: `block_length`, `window`, ...)
  are at most the positions a row holds: past them they mean nothing;
- `score_groups` (a denoiser pass a group, at every step) is at most `MAX_SCORE_GROUPS`;
- the knobs that are a period in steps (`PERIOD_KNOBS`: `refresh_every`) are at most
  `max_steps`: a longer period than a request runs means the same;
- every integer knob (those of `FREE_KNOBS` too) is at most `MAX_KNOB_INT`;
- the knobs the model sizes (`MODEL_KNOBS`: `condition_width`, an allocation of its width at
  every canvas position) are refused in a request: the model's own sampler sets them;
- a text prompt, or a chat's messages (their contents together), has at most `room` times
  `longest_token_bytes(model)` UTF-8 bytes: a text that could not fit however it tokenized;
  a chat at most `room` messages, token ids at most `room` ids.

`FREE_KNOBS` lists the integer knobs left unbounded, with why. Every integer knob of the
registry is in exactly one of these tables (tests/serve/test_limits.py), so a new knob is
classified where it is added. The body's own bounds: its JSON nesting (`json_depth`, the file
readers' `mdjax.jsonl.json_depth`, checked by `mdjax.serve.fields.read_call` before it is
parsed), its bytes and its reading time (`mdjax.serve.gate`).
"""

from __future__ import annotations

import numpy as np

from mdjax.errors import ArgumentError
from mdjax.jsonl import json_depth  # noqa: F401  (the body's nesting, counted as a file's is)


def check_int(value, name: str, low: int, high: int | None = None, why: str = "") -> int:
  """`value` as an int in [low, high] (high None: no bound), else an ArgumentError naming
  `name` (the engine's settings and a request's n and seed)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low \
      or (high is not None and value > high):
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise ArgumentError.invalid(name, value, f"it must be {allowed}{why}")
  return int(value)

# The default --max_steps: this many steps a position of the canvas. A step-wise sampler
# writes at least one position a step in the usual settings (steps <= max_tokens); the
# continuous-time ones (ancestral, mdlm, remask) may take more, and the literature samples
# with up to 4 steps a position (ReMDM's 4,096 steps for 1,024 tokens).
STEPS_PER_POSITION = 4
# score_groups: a denoiser pass over the row a group, at every step (revision's
# leave-group-out contexts); the published settings use 2 to 8.
MAX_SCORE_GROUPS = 16
# A token's bytes when the tokenizer's vocabulary cannot be read (no text codec mdjax knows).
UNKNOWN_TOKEN_BYTES = 256
# A request body's deepest nesting of JSON arrays and objects: an OpenAI request needs 5
# (the body, messages, a message, its content parts, a part); Python's parser and pydantic
# recurse, and near 1,000 levels they fail with a RecursionError.
MAX_JSON_DEPTH = 64
# Any integer knob: no count of steps, positions or tokens reaches int32's range, and numpy
# (a plan's int64 arrays) cannot hold one past 2**63 (refresh_every=10**30 was a 500).
MAX_KNOB_INT = 2**31 - 1

STEP_KNOBS = {  # each sizes the plan and the denoiser passes of a request
    "steps": "denoiser steps",
    "denoising_steps": "SDAR's steps a block",
    "steps_per_block": "BD3-LM's steps a block",
    "rounds": "local_remask's repair rounds",
    "max_post_steps": "LLaDA2.1's edit-only steps a block",
}
POSITION_KNOBS = {  # a count of canvas positions: past the canvas it means nothing
    "block_length", "block_size", "sub_block_length", "seeds", "window", "k", "minimal_topk",
    "num_to_transfer", "reference_length",
    "canvases",  # DiffusionGemma's canvases in turn: each holds at least one position
}
GROUP_KNOBS = {"score_groups"}
PERIOD_KNOBS = {  # a period in steps: past the steps a request may run it means nothing more
    "refresh_every": "kv_cache's steps between full passes",
}
MODEL_KNOBS = {  # sized by the model, not by a request: refused as request fields
    "condition_width": "the width of the denoiser's self-conditioning input (its "
                       "encode_condition); the model's own sampler sets it",
}
FREE_KNOBS = {  # integer knobs without a server bound, and why
    "top_k": "past the vocabulary it keeps every value: nothing grows with it",
}


def check_knobs(knobs: dict, *, max_steps: int, room: int) -> None:
  """The request's knobs against the server's bounds (module docstring)."""
  for name, value in knobs.items():
    if name in MODEL_KNOBS and value is not None:
      raise ArgumentError.invalid(name, value, f"it is not a request's: {MODEL_KNOBS[name]}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      continue  # a knob of another type, or None: the spec checks it
    if abs(value) > MAX_KNOB_INT:
      raise ArgumentError.invalid(name, value, f"it must be at most {MAX_KNOB_INT} in size "
                                  "on this server")
    if name in STEP_KNOBS and value > max_steps:
      raise ArgumentError.invalid(name, value, f"it must be at most {max_steps}, this "
                                  f"server's max_steps ({STEP_KNOBS[name]}: each is a "
                                  "denoiser pass)")
    if name in POSITION_KNOBS and value > room:
      raise ArgumentError.invalid(name, value, f"it must be at most {room}, the positions "
                                  "the server's canvas holds")
    if name in PERIOD_KNOBS and value > max_steps:
      raise ArgumentError.invalid(name, value, f"it must be at most {max_steps}, this "
                                  f"server's max_steps ({PERIOD_KNOBS[name]}: a longer "
                                  "period than a request runs means the same)")
    if name in GROUP_KNOBS and value > MAX_SCORE_GROUPS:
      raise ArgumentError.invalid(name, value, f"it must be at most {MAX_SCORE_GROUPS} on "
                                  "this server (each group is a denoiser pass at every step)")


def check_num_steps(num_steps: int, max_steps: int) -> None:
  """The steps the sampler will run (its settings together), before its plan is built."""
  if num_steps > max_steps:
    raise ArgumentError("steps", f"the sampler would run {num_steps} steps; this server runs "
                        f"at most {max_steps} a request (max_steps): give fewer steps.")


def longest_token_bytes(model) -> int:
  """An upper bound of the UTF-8 bytes of text one token stands for: the longest of the
  vocabulary's token strings (the added tokens among them: `<|im_start|>` typed in a prompt
  is one token), at least 4 (a character); `UNKNOWN_TOKEN_BYTES` for a codec whose
  vocabulary cannot be read. A byte-level BPE writes a byte as a character of one or two
  bytes, a SentencePiece vocabulary a space as '▁' (three): no string is shorter than its
  text. (A tokenizer's normalizer may shorten a text, composing accents, say: the bound is
  on the text as sent.)"""
  tokenizer = getattr(model, "tokenizer", None)
  for codec in (tokenizer, getattr(tokenizer, "_tok", None)):  # BpeTokenizer wraps one
    get_vocab = getattr(codec, "get_vocab", None)
    if callable(get_vocab):
      try:
        pieces = get_vocab(with_added_tokens=True)
      except TypeError:
        pieces = get_vocab()
      return max(4, max((_utf8_size(str(p)) for p in pieces), default=0))
  if isinstance(getattr(tokenizer, "vocab", None), str):  # a character codec
    return 4
  return UNKNOWN_TOKEN_BYTES


def _utf8_size(text: str) -> int:
  return len(text.encode("utf-8", "surrogatepass"))  # a lone surrogate is 3 bytes


def check_prompt_size(prompt, *, where: str, room: int, max_bytes: int) -> None:
  """A prompt's size before it is encoded or rendered (module docstring): a text, a chat
  (a list of {"role", "content"} messages) or token ids."""
  if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
    if len(prompt) > room:
      raise ArgumentError(where, f"{where} holds {len(prompt)} messages; the server's canvas "
                          f"holds {room} positions, so at most {room} messages.")
    size = sum(_utf8_size(str(m.get("content", ""))) for m in prompt)
    what = f"{where}' contents hold"
  elif isinstance(prompt, str):
    size, what = _utf8_size(prompt), f"the {where} has"
  else:
    length = len(prompt) if hasattr(prompt, "__len__") else 0
    if length > room:
      raise ArgumentError(where, f"the {where} has {length} token ids; the server's canvas "
                          f"holds {room} positions: shorten it.")
    return
  if size > max_bytes:
    raise ArgumentError(where, f"{what} {size:,} bytes of text; the server's canvas holds "
                        f"{room} positions of at most {max_bytes // room} bytes (the "
                        f"tokenizer's longest token), so at most {max_bytes:,} bytes: "
                        "shorten it.")
