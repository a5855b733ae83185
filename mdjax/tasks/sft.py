"""Supervised fine-tuning data: chat / instruction JSONL as fixed-length rows whose response
positions are the only ones the forward process may mask.

Each line of the file is one example:

  {"prompt": "What is 7 * 8?", "response": "56."}
  {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "7 * 8?"}, {"role": "assistant", "content": "56."}]}

For `messages` the last turn (an assistant's) is the response and the turns before it the
prompt. With `chat=True` and a start point that has a chat template (a published folder), the
prompt is rendered by it with the assistant's turn opened (`mdjax.io.render_chat`; a
plain prompt is one user turn); otherwise the prompt text is used as it is (and `messages`
need the template). A row is [prompt ids, response ids, EOS ... EOS] of `length` tokens:
LLaDA's SFT layout, where the EOS padding belongs to the response (the model learns to end
it) and only the prompt stays visible.

The tokenizer and the ids are the start point's (`start`: "pretrained:DIR" for a published
Hugging Face folder, or an mdjax workdir), so `start` is `train.init_from` in `configs/sft.py`.
They are read here without the trainer (`vocabulary`): a published folder's tokenizer.json,
config.json and chat template, or a workdir's saved config and task metadata
(`mdjax.saved_run`), whose text task is built again for its tokenizer. The start point's
model, and the export of the fine-tuned one, are training's (`mdjax.train.sft`).

A row carries which positions are prompt in the token array itself: a prompt token `i` is
stored as `-1 - i` (`pack_rows`; `unpack_rows` undoes it), so a batch stays one int32 array
[B, L] that the training loop shards, slices by process and checkpoints like any other task's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import jsonl
from mdjax.errors import ArgumentError
from mdjax.saved_run import saved_config
from mdjax.tasks import corpus, text
from mdjax.tasks.base import Task
from mdjax.tokenizers import load_hf_tokenizer

PRETRAINED_PREFIX = "pretrained:"
# A published start point's files that decide an SFT run's ids (its weights are not hashed:
# a run resumes from its own fine-tuned weights).
START_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# ----------------------------------------------------------------------------
# The file.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
  """One line of the file: `prompt` (a text, or a tuple of {"role", "content"} turns), the
  response text, `where` ("file:line") for messages about it, and the line's optional
  "answer" (what an RL reward checks, `mdjax.rl`; None: none given)."""

  prompt: Any
  response: str
  where: str
  answer: Any = None


LINE_FORM = ("a JSON object with 'prompt' and 'response' texts, or with 'messages' (turns "
             "ending with an 'assistant' one)")


def _turn(value, where: str, i: int) -> dict:
  if not (isinstance(value, dict) and isinstance(value.get("role"), str)
          and isinstance(value.get("content"), str)):
    raise ValueError(f"{where}: messages[{i}]={value!r} must be an object with string 'role' "
                     "and 'content'.")
  return {"role": value["role"], "content": value["content"]}


def parse_example(obj, where: str) -> Example:
  """An Example of one JSON object, or a ValueError naming `where` and what is wrong."""
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: a JSON {type(obj).__name__}; each line is {LINE_FORM}.")
  if "messages" in obj:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
      raise ValueError(f"{where}: 'messages' must be a non-empty list of turns.")
    turns = [_turn(m, where, i) for i, m in enumerate(messages)]
    if turns[-1]["role"] != "assistant":
      raise ValueError(f"{where}: no response: the last of the messages is a "
                       f"{turns[-1]['role']!r} turn; the response is the last turn, an "
                       "'assistant' one.")
    if len(turns) < 2:
      raise ValueError(f"{where}: the messages hold a response but no prompt turn before it.")
    prompt, response = tuple(turns[:-1]), turns[-1]["content"]
  else:
    prompt, response = obj.get("prompt"), obj.get("response")
    if not isinstance(prompt, str):
      raise ValueError(f"{where}: 'prompt'={prompt!r} must be a string (or give 'messages').")
    if response is None:
      raise ValueError(f"{where}: no response: the line has no 'response' field; each line "
                       f"is {LINE_FORM}.")
  if not isinstance(response, str) or not response.strip():
    raise ValueError(f"{where}: no response: the response {response!r} is not a non-empty "
                     "string.")
  return Example(prompt=prompt, response=response, where=where, answer=obj.get("answer"))


def read_jsonl(path: str) -> list[Example]:
  """The examples of a JSONL file (blank lines skipped); a bad line is a ValueError naming
  file:line."""
  if not os.path.isfile(path):
    raise ValueError(f"path={path!r} is not a file (a JSONL of prompts and responses).")
  examples = []
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      where = f"{path}:{number}"
      try:
        text = line.decode("utf-8")
      except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not UTF-8 text (byte {error.start + 1} of the line)."
                         ) from None
      if not text.strip():
        continue
      try:
        obj = jsonl.loads(text.rstrip("\r\n"), where, "path")
      except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg}, column {error.colno}); each line "
                         f"is {LINE_FORM}.") from None
      examples.append(parse_example(obj, where))
  if not examples:
    raise ValueError(f"path={path!r} holds no example.")
  return examples


# ----------------------------------------------------------------------------
# The start point's vocabulary.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Vocabulary:
  """What the rows need of a start point's tokenizer.

  vocab_size: the model's ids (a published model's embedding rows); the mdjax mask id is
  vocab_size. eos_id: the padding. reserved: ids no row may hold (a published model's own
  mask id, which lies inside its vocabulary). chat: renders a list of turns with the
  assistant's turn opened (None without a chat template).
  """

  encode: Callable[[str], Sequence[int]]
  decode: Callable[[Any], str]
  vocab_size: int
  eos_id: int
  reserved: tuple[int, ...] = ()
  chat: Callable[[Sequence[dict]], str] | None = None
  tokenizer: Any = None
  description: str = ""


def split_start(start: str) -> tuple[str, str]:
  """("pretrained", DIR) or ("workdir", WORKDIR) of a start point; ValueError if it names
  neither a folder with config.json nor a workdir with checkpoints."""
  if not isinstance(start, str) or not start:
    raise ValueError(f"start={start!r} must be 'pretrained:DIR' (a published Hugging Face "
                     "folder) or an mdjax workdir; set train.init_from.")
  if start.startswith(PRETRAINED_PREFIX):
    folder = start[len(PRETRAINED_PREFIX):]
    # gemma's params checkpoints (DiffusionGemma) hold no config.json: imported here only.
    from mdjax.io import gemma_params
    if not (os.path.isfile(os.path.join(folder, "config.json"))
            or gemma_params.is_checkpoint(folder)):
      raise ValueError(f"start={start!r}: {folder!r} is not a folder with config.json (a "
                       "published diffusion LM checkpoint) or gemma's params checkpoint.")
    return "pretrained", folder
  if not os.path.isdir(os.path.join(start, "checkpoints")):
    raise ValueError(f"start={start!r} is not an mdjax workdir (it has no checkpoints/); a "
                     "published folder is named 'pretrained:DIR'.")
  return "workdir", start


def resolve_start(start):
  """`start` with its folder absolute and normalised ('pretrained:' kept), so that a saved
  config names the same start point from any working directory; anything else unchanged."""
  if not isinstance(start, str) or start in ("", PRETRAINED_PREFIX):
    return start
  if start.startswith(PRETRAINED_PREFIX):
    return PRETRAINED_PREFIX + os.path.abspath(start[len(PRETRAINED_PREFIX):])
  return os.path.abspath(start)


def published_config(folder: str):
  """(PublishedConfig, config.json as read) of a published folder, no weight read."""
  # The published formats hold their reference samplers: imported by a published start
  # point only, so that the tasks do not import the samplers.
  from mdjax import formats
  from mdjax.models.published import PublishedConfig
  path = os.path.join(folder, "config.json")
  with open(path, "rb") as f:
    data = f.read()
  try:
    raw = jsonl.loads(data, path, "train.init_from")
  except ArgumentError:  # nested too deep: named already
    raise
  except ValueError as error:  # not UTF-8, not JSON
    raise ArgumentError("train.init_from", f"{path}: not a JSON config ({error}).") from None
  if not isinstance(raw, dict):
    raise ArgumentError("train.init_from", f"{path}: not a JSON object (a JSON "
                        f"{type(raw).__name__}).")
  config = formats.detect(raw, path).config_from_hf(raw, "float32")
  if not isinstance(config, PublishedConfig):
    raise ValueError(f"{path}: a {config.family} checkpoint; fine-tuning starts from LLaDA or "
                     "Dream folders (or an mdjax workdir).")
  return config, raw


def _published_vocabulary(folder: str) -> Vocabulary:
  from mdjax.io.chat_template import render_chat  # as in `published_config`
  from mdjax.io.folder import read_chat_template
  config, _ = published_config(folder)
  tokenizer = load_hf_tokenizer(folder)
  if tokenizer is None:
    raise ValueError(f"{folder}: no tokenizer.json; fine-tuning on text needs the tokenizer.")
  if config.eos_id is None:
    raise ValueError(f"{folder}: config.json names no eos_token_id; the rows are padded with "
                     "EOS.")
  template = read_chat_template(folder)
  view = types.SimpleNamespace(chat_template=template, source=os.path.abspath(folder))
  chat = None if template is None else functools.partial(render_chat, view)
  return Vocabulary(
      encode=lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
      decode=lambda ids: tokenizer.decode([int(i) for i in ids]),
      vocab_size=config.vocab_size, eos_id=config.eos_id, reserved=(config.mask_id,),
      chat=chat, tokenizer=tokenizer, description=f"{config.family} {folder}")


def _start_task(workdir: str) -> Task:
  """The task of a workdir start point, built again from its saved config and task metadata
  (a text task's vocabulary): one of the tasks with a tokenizer."""
  config, metadata = saved_config(workdir)
  name = config.get("task")
  builders = {"text": text.bind, "corpus": corpus.bind, "sft": bind}  # the text tasks
  if name not in builders:
    raise ValueError(f"start={workdir!r}: its task {name!r} has no tokenizer; fine-tuning "
                     "on text starts from a text model.")
  kwargs = {k: v for k, v in (config.get("task_kwargs") or {}).items() if v is not None}
  return builders[name](**{**kwargs, **metadata})


def _workdir_vocabulary(workdir: str) -> Vocabulary:
  task = _start_task(workdir)
  if task.eos_id is None:
    raise ValueError(f"start={workdir!r}: its task has no EOS id (text with documents='none'); "
                     "the rows are padded with EOS: start from a model trained with "
                     "task_kwargs.documents='packed' or 'padded'.")
  return Vocabulary(encode=task.encode, decode=task.decode, vocab_size=task.vocab_size,
                    eos_id=task.eos_id, tokenizer=task.tokenizer,
                    description=f"workdir {workdir}")


def vocabulary(start: str) -> Vocabulary:
  """The Vocabulary of a start point ("pretrained:DIR" or a workdir)."""
  kind, where = split_start(start)
  return _published_vocabulary(where) if kind == "pretrained" else _workdir_vocabulary(where)


# ----------------------------------------------------------------------------
# Rows.
# ----------------------------------------------------------------------------


def pack_rows(tokens_NxL, prompt_lengths_N) -> np.ndarray:
  """int32 rows with each prompt token i stored as -1 - i (the positions left visible)."""
  tokens_NxL = np.asarray(tokens_NxL, np.int32)
  prompt_NxL = np.arange(tokens_NxL.shape[1])[None] < np.asarray(prompt_lengths_N)[:, None]
  return np.where(prompt_NxL, -1 - tokens_NxL, tokens_NxL).astype(np.int32)


def unpack_rows(rows_BxL):
  """(tokens_BxL, maskable_BxL) of packed rows: the ids, and True on the response."""
  xp = np if isinstance(rows_BxL, np.ndarray) else jnp
  maskable_BxL = rows_BxL >= 0
  return xp.where(maskable_BxL, rows_BxL, -1 - rows_BxL), maskable_BxL


def prompt_text(example: Example, vocab: Vocabulary, chat: bool) -> str:
  """The prompt as the model reads it: through the start's chat template when `chat` and it
  has one, else the prompt text itself."""
  if chat and vocab.chat is not None:
    turns = ([{"role": "user", "content": example.prompt}] if isinstance(example.prompt, str)
             else list(example.prompt))
    try:
      return vocab.chat(turns)
    except ValueError as error:
      raise ValueError(f"{example.where}: {error}") from None
  if not isinstance(example.prompt, str):
    raise ValueError(f"{example.where}: 'messages' need the start point's chat template "
                     f"({'chat=False' if not chat else 'it has none'}); give 'prompt' and "
                     "'response' texts instead.")
  return example.prompt


def _ids(vocab: Vocabulary, text: str, where: str, what: str) -> np.ndarray:
  try:
    ids = np.asarray(vocab.encode(text), np.int64).reshape(-1)
  except ValueError as error:
    raise ValueError(f"{where}: the {what} does not encode: {error}") from None
  bad = [int(i) for i in ids if not 0 <= i < vocab.vocab_size or i in vocab.reserved]
  if bad:
    raise ValueError(f"{where}: the {what} encodes to id {bad[0]}, outside [0, "
                     f"{vocab.vocab_size}) or reserved (the model's mask id {vocab.reserved}).")
  return ids


def encode_examples(examples: Sequence[Example], vocab: Vocabulary, length: int, *,
                    truncate: bool = False, chat: bool = True
                    ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens_NxL, prompt_lengths_N): each row [prompt, response, EOS ... EOS].

  A row must hold its prompt, its response and at least one EOS. With `truncate` a response
  too long is cut to fit (the row then ends without EOS); a prompt of `length` tokens or more
  is a ValueError either way (no response position would be left).
  """
  tokens_NxL = np.full((len(examples), length), vocab.eos_id, np.int32)
  prompt_lengths_N = np.zeros(len(examples), np.int32)
  for n, example in enumerate(examples):
    prompt = _ids(vocab, prompt_text(example, vocab, chat), example.where, "prompt")
    response = _ids(vocab, example.response, example.where, "response")
    if len(prompt) >= length:
      raise ValueError(f"{example.where}: the prompt is {len(prompt)} tokens, which leaves no "
                       f"room for a response in length={length}; raise task_kwargs.length.")
    room = length - len(prompt)
    if len(response) + 1 > room:
      if not truncate:
        raise ValueError(f"{example.where}: prompt ({len(prompt)} tokens) + response "
                         f"({len(response)}) + EOS do not fit length={length}; raise "
                         "task_kwargs.length, or set task_kwargs.truncate=True to cut the "
                         "response.")
      response = response[:room]
    tokens_NxL[n, :len(prompt)] = prompt
    tokens_NxL[n, len(prompt):len(prompt) + len(response)] = response
    prompt_lengths_N[n] = len(prompt)
  return tokens_NxL, prompt_lengths_N


# ----------------------------------------------------------------------------
# The task.
# ----------------------------------------------------------------------------


def check(path: str | None = None, start: str | None = None, length: int = 128,
          truncate: bool = False, chat: bool = True, validation_path: str | None = None
          ) -> None:
  """`bind`'s errors, found before anything is trained: the arguments, then every line of the
  files against the start point's tokenizer (no weight is read); `bind` reuses the rows."""
  if not (isinstance(length, int) and not isinstance(length, bool) and length >= 2):
    raise ValueError(f"length={length!r} must be an integer >= 2.")
  for name, value in (("truncate", truncate), ("chat", chat)):
    if not isinstance(value, bool):
      raise ValueError(f"{name}={value!r} must be True or False.")
  for name, value in (("path", path), ("validation_path", validation_path)):
    if value is None and name == "validation_path":
      continue
    if not (isinstance(value, str) and os.path.isfile(value)):
      raise ValueError(f"{name}={value!r} must be a JSONL file of prompts and responses.")
  split_start(start)
  _encoded(path, start, length, truncate, chat, validation_path,
           tuple(_stamp(p) for p in (path, validation_path) if p is not None))


def _stamp(path: str) -> tuple[int, int]:
  """A file's size and modification time: a file edited since is read again."""
  status = os.stat(path)
  return status.st_size, status.st_mtime_ns


def _rows_of(name: str, path: str, vocab: Vocabulary, length: int, truncate: bool,
             chat: bool) -> np.ndarray:
  """The packed rows of one file; a bad line is a ValueError naming the argument and FILE:LINE."""
  try:
    return pack_rows(*encode_examples(read_jsonl(path), vocab, length, truncate=truncate,
                                      chat=chat))
  except ValueError as error:
    raise ValueError(f"{name}: {error}") from None


@functools.lru_cache(maxsize=1)
def _encoded(path, start, length, truncate, chat, validation_path, stamps):
  """(Vocabulary, training rows, held-out rows or None): built by `check`, reused by `bind`
  (the files' `stamps` in the key)."""
  del stamps
  vocab = vocabulary(start)
  rows = _rows_of("path", path, vocab, length, truncate, chat)
  held = None if validation_path is None else _rows_of(
      "validation_path", validation_path, vocab, length, truncate, chat)
  return vocab, rows, held


def _draw(rows, key: jax.Array, batch: int) -> jax.Array:
  """`batch` rows drawn uniformly with replacement: a function of the key."""
  return rows[jax.random.randint(key, (batch,), 0, rows.shape[0])]


def inputs_sha256(path: str, start: str, validation_path: str | None = None) -> str | None:
  """SHA-256 of an SFT run's inputs by content: the example files and a published start
  point's config.json and tokenizer files (None for a workdir start point, matched by path)."""
  kind, folder = split_start(start)
  if kind != "pretrained":
    return None
  digest = hashlib.sha256()
  files = [path, validation_path] + [os.path.join(folder, name) for name in START_FILES]
  for file in files:
    digest.update(b"\0" if file is None or not os.path.isfile(file) else b"\1")
    if file is not None and os.path.isfile(file):
      with open(file, "rb") as f:
        digest.update(hashlib.sha256(f.read()).digest())
  return digest.hexdigest()


def make_task(rows_NxL: np.ndarray, vocab: Vocabulary, *, validation_NxL=None,
              description: str = "", inputs_sha256: str | None = None) -> Task:
  """The Task of packed rows: `sample_data` draws rows by the key; no sampling metrics."""
  length = rows_NxL.shape[1]
  with jax.ensure_compile_time_eval():
    train = jnp.asarray(rows_NxL)
    held = train if validation_NxL is None else jnp.asarray(validation_NxL)

  def decode(row_L) -> str:
    return vocab.decode(unpack_rows(np.asarray(row_L))[0])

  return Task(name="sft", length=length, vocab_size=vocab.vocab_size,
              mask_id=vocab.vocab_size, eos_id=vocab.eos_id,
              sample_data=functools.partial(_draw, train),
              validation_data=functools.partial(_draw, held), decode=decode,
              sample_metrics=lambda tokens_BxL: {}, encode=vocab.encode,
              tokenizer=vocab.tokenizer, description=description, inputs_sha256=inputs_sha256)


def bind(path: str | None = None, start: str | None = None, length: int = 128,
         truncate: bool = False, chat: bool = True, validation_path: str | None = None
         ) -> Task:
  """The SFT task: the examples of `path` as rows of `length` tokens in the ids of `start`.

  Held-out rows come from `validation_path` (the same layout), else from the training rows.
  """
  check(path, start, length, truncate, chat, validation_path)
  vocab, rows, held = _encoded(path, start, length, truncate, chat, validation_path,
                               tuple(_stamp(p) for p in (path, validation_path) if p is not None))
  return make_task(rows, vocab, validation_NxL=held, description=(
      f"SftTask({path}: {rows.shape[0]} rows of {length} tokens, {vocab.description})"),
      inputs_sha256=inputs_sha256(path, start, validation_path))
