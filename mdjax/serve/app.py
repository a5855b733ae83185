"""The OpenAI-compatible HTTP API over the serving engine (`mdjax.serve.engine.Engine`).

  app = create_app(engine, model, model_name="llada")   # then uvicorn.run(app, ...)

Routes: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true`: server-sent
events in OpenAI's chunk format, ending `data: [DONE]`), GET /v1/models (OpenAI's list, with
`max_model_len` and an "mdjax" object: what the live page reads), GET /health,
GET /metrics (Prometheus text) and GET / (the live page, mdjax/serve/page.html).

Request fields: `model` (the served id, `GET /v1/models`; absent: the one model served;
another id is a 404, model_not_found), `prompt` (a text or token ids, `[10, 1, 2]` is one
prompt; or a list of texts or of id lists, several prompts: prompt i runs with seed + i, its
choices at i * n + j) or `messages` (through the model's chat template), `max_tokens`
(default 16, as OpenAI's), `temperature`, `top_p`, `top_k`, `seed` (default a fresh random
one, returned), `stop` (a string or a list: the text is cut before the first one,
finish_reason "stop"), `n`, `stream`, `stream_options` ({"include_usage": true}); mdjax's
extensions under sample.py's names: `sampler` (a family of `mdjax.sampling.families()`;
absent: the model's default sampler), `steps`, `block_length`, `threshold`, ... and
`mdjax_canvas` (streaming: an `event: canvas` each step with every position's text, null
where masked). A field the server does not know is a 400 naming it.
The server's defaults (`defaults`: `python -m mdjax.serve --steps=...`) are knobs a request
overrides one by one; without them a knob is `mdjax.generate`'s default for the model.

The exactness rule: a request with `seed=s` gets, token for token, what

    job = engine.prepare(prompt_ids, max_new_tokens=max_tokens, seed=s, n=n, ...)
    mdjax.generate(model, [prompt_ids] * n, max_new_tokens=max_tokens,
                   key=jax.random.key(s), spec=job.spec)[i]

gives for choice i, whatever else is served at the same time. Every response names what
reproduces it: `"mdjax": {"seed": s, "spec": repr(job.spec), "steps": job.num_steps}` at the
top and `"mdjax": {"token_ids": [...]}` in each choice (the completion's ids, before `stop`
strings cut its text).

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400
(invalid_request_error, `param` naming the field) for malformed JSON, wrong types, bad values,
unknown fields or knobs, values past the server's bounds (`steps` past --max_steps, a prompt
past the canvas, ...: `mdjax.serve.limits`), a Host the server does not answer to, two
Authorization headers; 404 (code model_not_found, `param` "model") for a `model` not served;
401 without `Authorization: Bearer KEY` when the server has a key (GET /health and GET / stay
open); 408 for a body that does not arrive in time, 413 for one over --max_body_bytes, 415 for
a POST that is not `application/json` (`mdjax.serve.gate`); 429 with Retry-After when the
engine's queue is full. A client that disconnects cancels its job (its rows are freed at the
engine's next tick). Shutdown (SIGTERM: uvicorn stops accepting and waits for the requests in
flight) ends with `engine.stop(drain=True)`.

Here: the routes and `create_app`. What reaches a route (the Host allowlist, the API key,
the body's type, size and time): `mdjax.serve.gate`; a request's fields and their checks,
read on a worker thread: `mdjax.serve.fields`; running it and its responses (JSON,
server-sent events): `mdjax.serve.streaming`; a server on a thread of this process:
`mdjax.serve.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mdjax.errors import ArgumentError
from mdjax.serve import gate
from mdjax.serve import metrics as metrics_lib
from mdjax.serve import streaming
from mdjax.serve.fields import (APIError, check_defaults, model_not_found, model_paths,
                                read_call, validation_error)

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")


class State:
  """What the routes share: the engine and its limits, the model, the server's defaults and
  bounds, the metrics, the canvas event's token texts."""

  def __init__(self, engine, model, model_name: str, api_key: str | None, defaults: dict,
               allowed_hosts, max_body_bytes: int):
    self.engine, self.model, self.model_name = engine, model, model_name
    self.api_key, self.defaults = api_key, check_defaults(defaults)
    self.allowed_hosts = gate.allowed_hosts(hosts=allowed_hosts)
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
        or max_body_bytes < 1:
      raise ArgumentError.invalid("max_body_bytes", max_body_bytes, "it must be an integer "
                                  ">= 1")
    self.max_body_bytes = max_body_bytes
    self.model_paths = model_paths(model)  # replaced by model_name in error messages
    self.metrics = metrics_lib.Metrics()
    self.pieces = streaming.Pieces(model)
    self.created = int(time.time())
    self.max_batch, self.canvas_length = engine.max_batch, engine.canvas_length


def create_app(engine, model, *, model_name: str, api_key: str | None = None,
               defaults: dict | None = None, allowed_hosts=None,
               max_body_bytes: int = gate.DEFAULT_MAX_BODY_BYTES) -> FastAPI:
  """The OpenAI-compatible app over a started `Engine` (module docstring).

  engine: an `mdjax.serve.engine.Engine` whose thread runs (`engine.start()`); the app's
  shutdown stops it with drain=True. model: the `Model` it serves (the codec, the chat
  template, the length). model_name: the id clients name (`GET /v1/models`). api_key: with
  one, every route but GET /health and GET / needs `Authorization: Bearer KEY`. defaults:
  server-wide sampler knobs (and `sampler`) under sample.py's names; a request's fields
  override them knob by knob. allowed_hosts: the Host headers answered (names, or a string
  of them separated by commas; "*": any; default 127.0.0.1, localhost and [::1]: add the
  address the server binds, as `mdjax.serve.server` does). max_body_bytes: the largest
  request body read (413 past it). The bounds a request's fields meet are the engine's
  (`Engine(max_steps=...)`, `mdjax.serve.limits`). A bad default or bound is a ValueError
  naming it.
  """
  state = State(engine, model, model_name, api_key, defaults or {}, allowed_hosts,
                max_body_bytes)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    await asyncio.to_thread(engine.stop, drain=True)

  app = FastAPI(title="mdjax", lifespan=lifespan, docs_url=None, redoc_url=None,
                openapi_url=None)
  app.state.mdjax = state

  @app.exception_handler(APIError)
  async def api_error(request, error: APIError):
    return error.response()

  @app.exception_handler(RequestValidationError)
  async def invalid_body(request, error: RequestValidationError):
    route = "chat" if request.url.path.endswith("/chat/completions") else "completions"
    return validation_error(list(error.errors()), route).response()

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request, error: StarletteHTTPException):
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return APIError(error.status_code, str(error.detail), None, kind).response()

  async def serve(request: Request, route: str):
    raw = await request.body()  # read whole by the gate, within its bounds
    # Parsing, validation, the chat template, tokenization and the engine's checks run on a
    # worker thread: the event loop serves every other request (and /health) meanwhile.
    call = await asyncio.to_thread(read_call, state, raw, route)
    if call.stream:
      return streaming.stream(call, request)
    return await streaming.complete(call, request)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await serve(request, "completions")

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await serve(request, "chat")

  def model_card() -> dict:
    # Extra fields (OpenAI clients ignore them): max_model_len is vLLM's name for what a
    # request's prompt and max_tokens share; "mdjax" says what the live page needs.
    chat = None not in (model.chat_template, model.chat_renderer, model.encode)
    return {"id": model_name, "object": "model", "created": state.created, "owned_by": "mdjax",
            "max_model_len": int(engine.room),
            "mdjax": {"family": model.family, "max_len": int(model.max_len),
                      "canvas_length": state.canvas_length, "max_batch": state.max_batch,
                      "max_steps": engine.max_steps, "text_prompts": model.encode is not None,
                      "chat_template": chat,
                      "vocab_size": int(model.vocab_size), "mask_id": int(model.mask_id)}}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{name:path}")
  async def one_model(name: str):
    if name != model_name:
      raise model_not_found(name, model_name)
    return model_card()

  @app.get("/health")
  async def health():
    stats = engine.stats()
    return {"status": "ok", "model": model_name, "queue_rows": stats.queue_rows,
            "active_rows": stats.active_rows, "slots": stats.slots}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(state.metrics.render(engine.stats()),
                             media_type=metrics_lib.CONTENT_TYPE)

  @app.get("/")
  async def page():
    try:
      with open(PAGE, encoding="utf-8") as f:
        return HTMLResponse(f.read())
    except FileNotFoundError:
      return PlainTextResponse("the live page (mdjax/serve/page.html) is not installed\n",
                               status_code=404)

  app.add_middleware(gate.Gate, state=state)
  return app
