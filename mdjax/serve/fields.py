"""A request's fields: their checks, the sampler knobs, OpenAI's error body, and `Call` (one
request checked and prepared into the engine's job). Field by field see `mdjax.serve.app`.
Every check is a 400 whose `param` and message name the field.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from mdjax import generation

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 2**32 - 1  # the engine's seeds: jax.random.key's 32 bits (without x64)

# Sampler knobs a request may give, under sample.py's names, with their JSON types. Which
# apply is the engine's call (`Engine.prepare`: "alg= does not apply to ...").
INT_KNOBS = ("steps", "top_k", "block_length", "k", "score_groups", "rounds", "seeds",
             "window", "refresh_every", "refill_steps")
FLOAT_KNOBS = ("temperature", "top_p", "min_p", "eta", "gamma", "threshold",
               "context_fraction", "factor", "alg_temp", "eps", "cfg_scale", "eos_penalty")
STR_KNOBS = ("score", "kv_cache", "remasking", "alg", "base", "refill", "order", "groups")
BOOL_KNOBS = ("logits_eos_inf", "confidence_eos_eot_inf", "eos_never", "eos_rank_last")
KNOBS = INT_KNOBS + FLOAT_KNOBS + STR_KNOBS + BOOL_KNOBS
# The few ranges every sampler shares (the engine checks the rest against the sampler).
INT_MINIMUM = {"steps": 1, "block_length": 1, "k": 1, "top_k": 0}
UNIT_INTERVAL = ("top_p", "min_p")  # (0, 1]

# OpenAI fields the server takes: what each route reads, and fields accepted only at their
# neutral value or of a type it ignores (anything else is a 400: "... is not supported").
COMMON_FIELDS = ("model", "max_tokens", "seed", "stop", "n", "stream", "stream_options",
                 "sampler", "mdjax_canvas")
ROUTE_FIELDS = {"completions": ("prompt",), "chat": ("messages", "max_completion_tokens")}
NEUTRAL = {"user": None, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False,
           "logit_bias": {}, "echo": False, "suffix": "", "best_of": 1, "top_logprobs": 0,
           "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
           "parallel_tool_calls": None, "metadata": None, "store": False,
           "service_tier": None}
IGNORED_TYPES = {"user": str, "metadata": dict}  # any value of the type is accepted
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_STOP_STRINGS = 16


class APIError(Exception):
  """An answer in OpenAI's error body, {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: str | None = None,
               type_: str = "invalid_request_error", code: str | None = None,
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.type, self.code, self.headers = type_, code, headers

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad(param: str | None, message: str) -> APIError:
  """A 400 about the field `param`."""
  return APIError(400, message, param)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _as_int(name: str, value, minimum: int | None = None) -> int:
  """An integer field's value (2.0 reads as 2), at least `minimum`."""
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if not _is_int(value):
    raise bad(name, f"{name}={json.dumps(value)} is invalid: it must be an integer.")
  if minimum is not None and value < minimum:
    raise bad(name, f"{name}={value} is invalid: it must be >= {minimum}.")
  return value


def _as_bool(name: str, value, default: bool = False) -> bool:
  """A boolean field's value (null: the default)."""
  if value is None:
    return default
  if not isinstance(value, bool):
    raise bad(name, f"{name}={json.dumps(value)[:40]} is invalid: it must be true or false.")
  return value


def _int_field(body: dict, name: str, default=None, minimum: int | None = None):
  value = body.get(name)
  return default if value is None else _as_int(name, value, minimum)


def knob(name: str, value):
  """A knob's value with its JSON type checked (and the ranges every sampler shares)."""
  if name in INT_KNOBS:
    return _as_int(name, value, INT_MINIMUM.get(name))
  if name in FLOAT_KNOBS:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
      raise bad(name, f"{name}={json.dumps(value)} is invalid: it must be a finite number.")
    value = float(value)
    if name == "temperature" and value < 0:
      raise bad(name, f"temperature={value} is invalid: it must be >= 0 (0: argmax).")
    if name in UNIT_INTERVAL and not 0 < value <= 1:
      raise bad(name, f"{name}={value} is invalid: it must lie in (0, 1].")
    return value
  if name in STR_KNOBS:
    if not isinstance(value, str):
      raise bad(name, f"{name}={json.dumps(value)} is invalid: it must be a string.")
    return value
  return _as_bool(name, value)


def check_defaults(defaults: dict | None) -> dict:
  """The server's default knobs (and `sampler`) checked as a request's would be; a bad one
  is a ValueError naming it."""
  out = {}
  for name, value in (defaults or {}).items():
    if value is None:
      continue
    if name == "sampler":
      if not isinstance(value, str):
        raise ValueError(f"sampler={value!r} is invalid: it must be a family name.")
      out[name] = value
      continue
    if name not in KNOBS:
      raise ValueError(f"{name}= is not a sampler knob; knobs: {', '.join(KNOBS)}.")
    try:
      out[name] = knob(name, value)
    except APIError as error:
      raise ValueError(error.message) from None
  return out


def _check_known(body: dict, route: str) -> None:
  """Every field is one the route reads, a knob, or an OpenAI field at its neutral value."""
  known = set(COMMON_FIELDS) | set(KNOBS) | set(ROUTE_FIELDS[route]) | set(NEUTRAL)
  for name in body:
    if name not in known:
      other = "prompt" if route == "chat" else "messages"
      hint = (f" (a field of the {'completions' if route == 'chat' else 'chat'} route)"
              if name == other else "")
      raise bad(name, f"{name} is not a field this server knows{hint}; sampler knobs: "
                f"{', '.join(KNOBS)}.")
  for name, neutral in NEUTRAL.items():
    value = body.get(name)
    if value is None or value == neutral or isinstance(value, IGNORED_TYPES.get(name, ())):
      continue
    raise bad(name, f"{name}={json.dumps(value)[:60]} is not supported by this server.")


def _stop_strings(body: dict) -> list[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise bad("stop", f"stop={json.dumps(stop)[:80]} is invalid: it must be a string or a "
              "list of strings.")
  if len(stop) > MAX_STOP_STRINGS:
    raise bad("stop", f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}.")
  if any(not s for s in stop):
    raise bad("stop", "stop holds an empty string; each stop string needs a character.")
  return stop


def _message_text(content, index: int) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise bad("messages", f"messages[{index}].content holds {json.dumps(part)[:60]}; "
                  "only text parts ({\"type\": \"text\", \"text\": ...}) are supported.")
      parts.append(part["text"])
    return "".join(parts)
  raise bad("messages", f"messages[{index}].content is invalid: it must be a string or a "
            "list of text parts.")


def _messages(body: dict) -> list[dict]:
  """The chat route's messages, each {"role", "content": text}."""
  messages = body.get("messages")
  if messages is None:
    raise bad("messages", "messages is required: a list of {\"role\", \"content\"} messages.")
  if not isinstance(messages, list) or not messages:
    raise bad("messages", "messages is invalid: it must be a non-empty list of "
              "{\"role\", \"content\"} messages.")
  out = []
  for index, message in enumerate(messages):
    if not isinstance(message, dict) or "role" not in message:
      raise bad("messages", f"messages[{index}] is invalid: each message is an object with "
                "\"role\" and \"content\".")
    role = message["role"]
    if role not in ROLES:
      raise bad("messages", f"messages[{index}].role={json.dumps(role)[:40]} is invalid: "
                f"one of {', '.join(ROLES)}.")
    out.append({"role": role, "content": _message_text(message.get("content"), index)})
  return out


def _prompt(body: dict):
  """The completions route's prompt: a text or token ids (one prompt a request)."""
  prompt = body.get("prompt")
  if prompt is None:
    raise bad("prompt", "prompt is required: a string, or a list of token ids.")
  if isinstance(prompt, str):
    return prompt
  if isinstance(prompt, list):
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # a batch of one
      if isinstance(prompt, str):
        return prompt
    if all(_is_int(t) for t in prompt):
      return np.asarray(prompt, np.int64)
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
      raise bad("prompt", f"prompt holds {len(prompt)} prompts; give one a request (n= for "
                "several completions of it).")
  raise bad("prompt", f"prompt={json.dumps(prompt)[:80]} is invalid: it must be a string, "
            "a list of one string, or a list of token ids.")


def _param_of(message: str, prompt_field: str, max_tokens_field: str,
              names) -> str | None:
  """The request field an engine or library error is about (None: none it names)."""
  aliases = {"max_new_tokens": max_tokens_field, "prompts": prompt_field,
             "prompt_ids": prompt_field}
  if message.startswith(("prompts", "prompt")):
    return prompt_field
  first = re.match(r"(?:spec\.)?([A-Za-z_]+)", message)
  if first and first.group(1) in names:
    return first.group(1)
  if first and first.group(1) == "max_new_tokens":
    return max_tokens_field
  for match in re.finditer(r"(?:spec\.)?([A-Za-z_]+)=", message):
    name = match.group(1)
    if name in aliases:
      return aliases[name]
    if name in names:
      return name
  return None


class Call:
  """One request: its fields checked (a 400 `APIError` naming the first bad one), its prompt
  ids, and the engine's job (`engine.prepare`)."""

  def __init__(self, state, body: Any, route: str):  # state: the app's `State`
    self.state, self.route = state, route
    self.chat = route == "chat"
    if not isinstance(body, dict):
      raise bad(None, "the request body must be a JSON object.")
    _check_known(body, route)
    model_field = body.get("model")
    if model_field is not None and not isinstance(model_field, str):
      raise bad("model", f"model={json.dumps(model_field)[:40]} is invalid: it must be a "
                "string.")
    self.prompt_field = "messages" if self.chat else "prompt"
    self.max_tokens_field = ("max_completion_tokens"
                             if self.chat and body.get("max_tokens") is None else "max_tokens")
    self.max_tokens = _int_field(body, self.max_tokens_field, DEFAULT_MAX_TOKENS, 1)
    limit = state.canvas_length
    if self.max_tokens > limit:
      raise bad(self.max_tokens_field, f"{self.max_tokens_field}={self.max_tokens} is past "
                f"the server's canvas: it holds {limit} positions, prompt included (the model "
                f"{state.model.max_len}).")
    self.n = _int_field(body, "n", 1, 1)
    if self.n > state.max_n:
      raise bad("n", f"n={self.n} is too large: the server runs at most {state.max_n} "
                f"rows for one request (max_batch={state.max_batch}"
                + (f", max_queue={state.max_queue}" if state.max_queue else "") + ").")
    seed = _int_field(body, "seed", None, 0)
    if seed is not None and seed > MAX_SEED:
      raise bad("seed", f"seed={seed} is invalid: it must lie in [0, {MAX_SEED}].")
    self.seed = secrets.randbelow(MAX_SEED + 1) if seed is None else seed
    self.stop = _stop_strings(body)
    self.stream = _as_bool("stream", body.get("stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
      raise bad("stream_options", f"stream_options={json.dumps(options)[:60]} is invalid: it "
                "must be {\"include_usage\": true or false}.")
    self.include_usage = bool(options.get("include_usage"))
    self.canvas = _as_bool("mdjax_canvas", body.get("mdjax_canvas"))
    sampler = body.get("sampler", state.defaults.get("sampler"))
    if sampler is not None and not isinstance(sampler, str):
      raise bad("sampler", f"sampler={json.dumps(sampler)[:40]} is invalid: it must be a "
                "sampler family's name (sample.py's --sampler).")
    self.sampler = sampler
    self.knobs = {k: v for k, v in state.defaults.items() if k != "sampler"}
    self.knobs.update({name: knob(name, body[name]) for name in KNOBS
                       if body.get(name) is not None})
    self.prompt_ids = self._prompt_ids(body)
    self.job = self._prepare()

  def _prompt_ids(self, body: dict) -> np.ndarray:
    """The prompt's ids (the chat template applied), checked against the canvas."""
    field, limit, max_tokens = self.prompt_field, self.state.canvas_length, self.max_tokens
    try:
      prompt = _messages(body) if self.chat else _prompt(body)
      ids = generation.prompt_ids(self.state.model, [prompt], where=field)[0]
    except ValueError as error:
      raise bad(field, str(error).replace(" line 1", "")) from None
    if len(ids) >= limit:
      templated = " (the chat template applied)" if self.chat else ""
      raise bad(field, f"the prompt has {len(ids)} tokens{templated}; the context holds {limit} "
                f"positions, so a prompt may have at most {limit - max_tokens} tokens with "
                f"{self.max_tokens_field}={max_tokens}: shorten it.")
    if len(ids) + max_tokens > limit:
      raise bad(self.max_tokens_field, f"{self.max_tokens_field}={max_tokens} is too many: "
                f"the prompt has {len(ids)} tokens and the context holds {limit} positions, "
                f"so at most {limit - len(ids)} new tokens.")
    return ids

  def _prepare(self):
    """The engine's job; its ValueError (a knob that does not apply, ...) is a 400."""
    try:
      return self.state.engine.prepare(self.prompt_ids, max_new_tokens=self.max_tokens,
                                       seed=self.seed, n=self.n, sampler=self.sampler,
                                       knobs=dict(self.knobs) or None)
    except (ValueError, TypeError) as error:
      message = str(error).replace("max_new_tokens=", f"{self.max_tokens_field}=")
      names = set(KNOBS) | {"sampler", "n", "seed", "stop"}
      raise bad(_param_of(str(error), self.prompt_field, self.max_tokens_field, names),
                message) from None

  def extension(self) -> dict:
    """What reproduces the response: the response's top-level "mdjax" field."""
    return {"seed": self.seed, "spec": repr(self.job.spec), "steps": self.job.num_steps}
