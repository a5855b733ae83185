"""A server in this process: `create_app` over an `Engine`, run by uvicorn on a thread.

  with running(mdjax.load(path), max_batch=16) as server:
    client = openai.OpenAI(base_url=server.base_url, api_key="-")

What the tests and `python -m mdjax.bench.serve` run; `python -m mdjax.serve` runs the same
app in the foreground (with its signal handling) through `build` and `bound_port`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Iterator

START_TIMEOUT_S = 30


def served_name(model, path: str | None = None) -> str:
  """The model id clients name: the last part of the path it was loaded from (else its
  family)."""
  path = path or getattr(model, "source", None)
  if path:
    name = os.path.basename(os.path.normpath(str(path)))
    if name:
      return name
  return str(path or model.family)


def build(model, *, api_key: str | None = None, defaults: dict | None = None,
          model_name: str | None = None, **engine_kwargs):
  """(engine, app): a new `Engine` over `model` (not started) and the app over it. A bad
  default or engine setting is a ValueError naming it."""
  from mdjax.serve.app import create_app
  from mdjax.serve.engine import Engine

  engine = Engine(model, **engine_kwargs)
  app = create_app(engine, model, model_name=model_name or served_name(model),
                   api_key=api_key, defaults=defaults)
  return engine, app


def bound_port(server) -> int | None:
  """The port a started `uvicorn.Server` listens on (port=0 binds a free one)."""
  for listener in getattr(server, "servers", None) or ():
    for sock in listener.sockets:
      return sock.getsockname()[1]
  return None


def url_of(host: str, port: int) -> str:
  return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@dataclasses.dataclass
class Running:
  """A server running in this process: `url` (http://HOST:PORT), `base_url` (url + "/v1", an
  OpenAI client's), `engine`, `model`, `port`, `server` (the uvicorn.Server)."""

  url: str
  engine: Any
  model: Any
  port: int
  server: Any

  @property
  def base_url(self) -> str:
    return self.url + "/v1"


@contextlib.contextmanager
def running(model, *, api_key: str | None = None, defaults: dict | None = None,
            model_name: str | None = None, host: str = "127.0.0.1", port: int = 0,
            start_engine: bool = True, log_level: str = "warning",
            **engine_kwargs) -> Iterator[Running]:
  """A uvicorn server over `create_app` and a new `Engine(model, **engine_kwargs)` on a
  thread of this process, on `port` (0: a free one). start_engine=False leaves the engine's
  thread unstarted (requests queue; a test starts it). On exit the server shuts down as on
  SIGTERM: it stops accepting, waits for the requests in flight, and the app's shutdown
  stops the engine (drain=True)."""
  import uvicorn

  engine, app = build(model, api_key=api_key, defaults=defaults, model_name=model_name,
                      **engine_kwargs)
  if start_engine:
    engine.start()
  config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=5)
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, name="mdjax-serve", daemon=True)
  thread.start()
  deadline = time.monotonic() + START_TIMEOUT_S
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      server.should_exit = True
      engine.stop(drain=False)
      raise RuntimeError(f"the server on {url_of(host, port)} did not start (see uvicorn's "
                         "log)")
    time.sleep(0.01)
  bound = bound_port(server) or port
  try:
    yield Running(url_of(host, bound), engine, model, bound, server)
  finally:
    server.should_exit = True
    thread.join(30)
    if not start_engine:
      engine.stop(drain=False)
