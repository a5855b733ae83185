"""A request's fields: the pydantic models FastAPI validates a body against (unknown fields
refused, `extra="forbid"`), the sampler knobs among them (from the knob registry), OpenAI's
error body, and `Call` (one validated request prepared into the engine's job). Field by
field see `mdjax.serve.app`.

A field's type and range are checked here, once, as the body is read (`read_call`, on a
worker thread: the JSON's nesting bounded before it is parsed); what depends on the model or
the server's limits (a prompt's length, whether a knob applies to the sampler, the bounds of
`mdjax.serve.limits`) is checked once by `Engine.prepare`, whose `ArgumentError` names the
argument. Either way the answer is a 400 whose `param` is the field, and its message names
the served model, never the model's folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
from typing import Annotated, Any, Literal

import numpy as np
import pydantic
from fastapi.responses import JSONResponse
from pydantic import BeforeValidator, ConfigDict

from mdjax.errors import ArgumentError
from mdjax.knob_registry import every_knob
from mdjax.sampling.knobs import Knob
from mdjax.serve import limits
from mdjax.serve.jobs import MAX_SEED

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_TOKEN_ID = 2**31 - 1  # past int32 no vocabulary reaches (the engine checks the model's)
ROLES = ("system", "user", "assistant", "developer", "tool")

# OpenAI fields the server accepts only at their neutral value, or of a type it ignores
# (anything else is a 400: "... is not supported").
NEUTRAL = {"user": None, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False,
           "logit_bias": {}, "echo": False, "suffix": "", "best_of": 1, "top_logprobs": 0,
           "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
           "parallel_tool_calls": None, "metadata": None, "store": False,
           "service_tier": None}
IGNORED_TYPES = {"user": str, "metadata": dict}  # any value of the type is accepted

# The request's own scalar fields: their JSON types are checked here (null: the default,
# which `Call` applies); their ranges, which the engine's limits set, by `Engine.prepare`.
FIELDS = {knob.name: knob for knob in (
    Knob("model", str, None, optional=True,
         help="The served model's id (GET /v1/models); absent: the one model served."),
    Knob("max_tokens", int, None, optional=True,
         help=f"Tokens generated after the prompt (default {DEFAULT_MAX_TOKENS})."),
    Knob("seed", int, None, optional=True,
         help="The request's PRNG seed (default: a fresh random one, returned)."),
    Knob("n", int, None, optional=True, help="Completions of the prompt (default 1)."),
    Knob("stream", bool, None, optional=True, help="Server-sent events."),
    Knob("mdjax_canvas", bool, None, optional=True,
         help="Streaming: an `event: canvas` each step."),
    Knob("sampler", str, None, optional=True,
         help="A sampler family (sample.py's --sampler; default: the model's)."),
)}
@functools.cache
def request_knobs() -> dict[str, Knob]:
  """The sampler knobs a request (or the server's CLI default) may give, by name: the knob
  registry (`mdjax.knob_registry.every_knob`)."""
  return every_knob()


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


def model_not_found(name: str, served: str) -> APIError:
  """OpenAI's 404 for a model the server does not serve (`code` model_not_found)."""
  return APIError(404, f"model {name[:80]!r} is not served here; this server serves "
                  f"{served!r}.", "model", code="model_not_found")


# ----------------------------------------------------------------------------
# The request models.
# ----------------------------------------------------------------------------


def _parsed(knob: Knob):
  """A field checked by `knob.parse` (null: absent, the default applies)."""
  return Annotated[Any, BeforeValidator(lambda value: None if value is None
                                        else knob.parse(value))]


def _neutral(name: str):
  """An OpenAI field accepted only at its neutral value (or of a type the server ignores)."""
  def check(value):
    neutral = NEUTRAL[name]
    if value is None or value == neutral or isinstance(value, IGNORED_TYPES.get(name, ())):
      return value
    raise ArgumentError(name, f"{name}={json.dumps(value)[:60]} is not supported by this "
                        "server.")
  return Annotated[Any, BeforeValidator(check)]


def _stop(value):
  if value is None:
    return []
  stop = [value] if isinstance(value, str) else value
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
    raise ArgumentError("stop", f"stop={json.dumps(value)[:80]} is invalid: it must be a "
                        "string or a list of strings.")
  if len(stop) > MAX_STOP_STRINGS:
    raise ArgumentError("stop", f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}.")
  if any(not s for s in stop):
    raise ArgumentError("stop", "stop holds an empty string; each stop string needs a "
                        "character.")
  return stop


def _one_prompt(prompt, given):
  """A text or token ids (an array), checked."""
  if isinstance(prompt, str):
    return prompt
  if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                      for t in prompt):
    outside = [t for t in prompt if not 0 <= t <= MAX_TOKEN_ID]
    if outside:
      raise ArgumentError("prompt", f"prompt holds the id {str(outside[0])[:40]}; token ids "
                          "are integers >= 0 below the model's vocabulary size.")
    return np.asarray(prompt, np.int64)
  raise ArgumentError("prompt", f"prompt={json.dumps(given)[:80]} is invalid: it must be a "
                      "string, token ids, or a list of strings or of token-id lists.")


def _prompt(prompt) -> list:
  """The completions route's prompts: a text or token ids is one prompt; a list of texts or
  of token-id lists is several (OpenAI's batch), each a text or an id array."""
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    return [_one_prompt(p, prompt) for p in prompt]
  return [_one_prompt(prompt, prompt)]


class TextPart(pydantic.BaseModel):
  """A message content part: only text is supported."""

  model_config = ConfigDict(extra="ignore")
  type: Literal["text"]
  text: pydantic.StrictStr


class Message(pydantic.BaseModel):
  """A chat message; other OpenAI message fields (`name`, ...) are ignored."""

  model_config = ConfigDict(extra="ignore")
  role: Literal[ROLES]
  content: pydantic.StrictStr | list[TextPart]

  def as_dict(self) -> dict:
    text = (self.content if isinstance(self.content, str)
            else "".join(part.text for part in self.content))
    return {"role": self.role, "content": text}


class StreamOptions(pydantic.BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: pydantic.StrictBool = False


def _request_model(name: str, **route_fields):
  """A route's body model: the route's fields, the common ones and every knob."""
  fields = {knob.name: (_parsed(knob), None) for knob in (*FIELDS.values(),
                                                           *request_knobs().values())}
  fields.update({name: (_neutral(name), None) for name in NEUTRAL})
  fields.update(stop=(Annotated[Any, BeforeValidator(_stop)], None),
                stream_options=(StreamOptions | None, None), **route_fields)
  return pydantic.create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


CompletionRequest = _request_model(
    "CompletionRequest", prompt=(Annotated[Any, BeforeValidator(_prompt)], ...))
ChatRequest = _request_model(
    "ChatRequest", messages=(Annotated[list[Message], pydantic.Field(min_length=1)], ...),
    max_completion_tokens=(_parsed(dataclasses.replace(FIELDS["max_tokens"],
                                                       name="max_completion_tokens")), None))


def validation_error(errors: list[dict], route: str | None = None) -> APIError:
  """The 400 for pydantic's first error about a body (an unknown field before any other: a
  misnamed field is the likelier mistake than the field it leaves missing); `param` is the
  top-level field, the message names the whole path."""
  unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
  first = (unknown or errors or [{}])[0]
  kind = first.get("type", "")
  # The path below "body", without pydantic's union tags (`str`, `list[TextPart]`).
  loc = [str(p) for p in first.get("loc", ()) if p != "body"
         and not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
  if kind == "json_invalid":
    reason = first.get("ctx", {}).get("error", first.get("msg", ""))
    return bad(None, f"the request body is not valid JSON: {reason}")
  if not loc:
    if isinstance(first.get("input"), (bytes, str)):
      return bad(None, "the request body was not read as JSON: send it with the header "
                 "'Content-Type: application/json'.")
    return bad(None, "the request body must be a JSON object.")
  param, where = loc[0], ".".join(loc)
  if kind == "extra_forbidden":
    if len(loc) > 1:
      return bad(param, f"{where} is not a field this server knows.")
    other = {"chat": "prompt", "completions": "messages"}.get(route or "")
    hint = (f" (a field of the {'completions' if route == 'chat' else 'chat'} route)"
            if param == other else "")
    return bad(param, f"{param} is not a field this server knows{hint}; sampler knobs: "
               f"{', '.join(request_knobs())}.")
  if kind == "missing":
    return bad(param, f"{where} is required.")
  error = first.get("ctx", {}).get("error")
  if isinstance(error, ArgumentError):
    return bad(param, str(error))
  if param == "messages" and "content" in loc:
    return bad(param, f"{where}={json.dumps(first.get('input'), default=str)[:60]} is "
               "invalid: a message's content is a string or a list of text parts "
               "({\"type\": \"text\", \"text\": ...}); only text is supported.")
  return bad(param, f"{where}={json.dumps(first.get('input'), default=str)[:60]} is invalid: "
             f"{first.get('msg', 'invalid value')}.")


def parse_body(raw: bytes):
  """A request body's JSON: UTF-8, nested at most `limits.MAX_JSON_DEPTH` deep (checked on
  its bytes before it is parsed); a 400 otherwise."""
  try:
    text = raw.decode("utf-8-sig")  # a byte order mark (PowerShell sends one) is no text
  except UnicodeDecodeError as error:
    raise bad(None, f"the request body is not UTF-8 (byte {error.start}).") from None
  depth = limits.json_depth(raw)
  if depth > limits.MAX_JSON_DEPTH:
    raise bad(None, f"the request body nests {depth} levels of arrays and objects; at most "
              f"{limits.MAX_JSON_DEPTH}.")
  try:
    return json.loads(text)
  except json.JSONDecodeError as error:
    raise bad(None, f"the request body is not valid JSON: {error.msg} (at character "
              f"{error.pos}).") from None
  except (ValueError, RecursionError) as error:  # a number of over 4,300 digits, say
    reason = str(error)[:200] or "nested too deeply"
    raise bad(None, f"the request body is not valid JSON: {reason}.") from None


def read_call(state, raw: bytes, route: str) -> "Call":
  """A route's body (bytes) read, validated and prepared: the `Call`, or an `APIError`.
  All of a request's work before the engine runs it (parsing, validation, the chat
  template, tokenization, `Engine.prepare`): the app runs it on a worker thread."""
  data = parse_body(raw)
  if not isinstance(data, dict):
    raise bad(None, "the request body must be a JSON object.")
  model = ChatRequest if route == "chat" else CompletionRequest
  try:
    body = model.model_validate(data)
  except pydantic.ValidationError as error:
    raise validation_error(list(error.errors()), route) from None
  # One model a server: its id, or none (curl's shortest request); another id is OpenAI's
  # 404, before any work, rather than an answer from a model the client did not ask for.
  if body.model is not None and body.model != state.model_name:
    raise model_not_found(body.model, state.model_name)
  return Call(state, body, route)


def model_paths(model) -> list[str]:
  """The spellings of the model's folder an error message may hold, longest first."""
  source = getattr(model, "source", None)
  if not source:
    return []
  source = str(source)
  paths = {source, os.path.normpath(source), os.path.abspath(source),
           os.path.realpath(source)}
  return sorted((p for p in paths if os.sep in p and p != os.sep), key=len, reverse=True)


def public(state, message: str) -> str:
  """An error message for the client: the model's folder named by the served model's id."""
  for path in state.model_paths:
    message = message.replace(path, state.model_name)
  return message


def check_defaults(defaults: dict | None) -> dict:
  """The server's default knobs (and `sampler`) checked as a request's would be; a bad one
  is an `ArgumentError` naming it."""
  out = {}
  knobs = {**request_knobs(), "sampler": FIELDS["sampler"]}
  for name, value in (defaults or {}).items():
    if value is None:
      continue
    if name not in knobs:
      raise ArgumentError(name, f"{name}= is not a sampler knob; knobs: "
                          f"{', '.join(request_knobs())}.")
    out[name] = knobs[name].parse(value)
  return out


# ----------------------------------------------------------------------------
# A call.
# ----------------------------------------------------------------------------


class Call:
  """One validated request, its rows' seed, and the engine's job (`engine.prepare`); the
  engine's `ArgumentError` is a 400 naming the field."""

  def __init__(self, state, body: pydantic.BaseModel, route: str):  # state: the app's State
    self.state, self.route = state, route
    self.chat = route == "chat"
    self.prompt_field = "messages" if self.chat else "prompt"
    max_tokens = body.max_tokens
    self.max_tokens_field = "max_tokens"
    if self.chat and max_tokens is None and body.max_completion_tokens is not None:
      self.max_tokens_field, max_tokens = "max_completion_tokens", body.max_completion_tokens
    self.max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    self.n = 1 if body.n is None else body.n
    self.seed = secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed
    self.stop = body.stop if body.stop is not None else []
    self.stream = bool(body.stream)
    self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    self.canvas = bool(body.mdjax_canvas)
    self.sampler = body.sampler if body.sampler is not None else state.defaults.get("sampler")
    self.knobs = {k: v for k, v in state.defaults.items() if k != "sampler"}
    self.knobs.update({name: getattr(body, name) for name in request_knobs()
                       if getattr(body, name) is not None})
    prompts = [[m.as_dict() for m in body.messages]] if self.chat else body.prompt
    rows, room = len(prompts) * self.n, state.engine.max_n
    if len(prompts) > 1 and rows > room:  # bounded before any prompt is tokenized
      raise bad("prompt", f"{len(prompts)} prompts x n={self.n} is {rows} rows; one request "
                f"may ask for at most {room} (max_batch {state.engine.max_batch}, max_queue "
                f"{state.engine.max_queue}).")
    if self.seed + len(prompts) - 1 > MAX_SEED:
      raise bad("seed", f"seed={self.seed} with {len(prompts)} prompts passes {MAX_SEED} "
                "(prompt i runs with seed + i).")
    try:  # checked once, by the engine: its param is the field
      self.jobs = [state.engine.prepare(prompt, max_new_tokens=self.max_tokens,
                                        seed=self.seed + i, n=self.n, sampler=self.sampler,
                                        knobs=dict(self.knobs) or None,
                                        where=self.prompt_field,
                                        new_tokens=self.max_tokens_field)
                   for i, prompt in enumerate(prompts)]
    except ArgumentError as error:
      raise bad((error.param or "").removeprefix("spec.") or None,
                public(state, str(error))) from None
    except ValueError as error:  # a model's own refusal that names no argument
      raise bad(None, public(state, str(error))) from None
    self.job = self.jobs[0]

  @property
  def rows(self) -> int:
    """The response's choices: n for each prompt, prompt by prompt."""
    return len(self.jobs) * self.n

  def seed_of(self, choice: int) -> int:
    """The seed choice `choice` ran with: prompt i's rows run with seed + i."""
    return self.seed + choice // self.n

  def extension(self) -> dict:
    """What reproduces the response: the response's top-level "mdjax" field."""
    extension = {"seed": self.seed, "spec": repr(self.job.spec), "steps": self.job.num_steps}
    if self.job.cache is not None:  # what the spec does not say: the cache decoded against
      extension["cache"] = self.job.cache
    return extension
