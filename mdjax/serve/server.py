"""A server in this process: `create_app` over an `Engine`, run by uvicorn on a thread.

  with running(mdjax.load(path), max_batch=16) as server:
    client = openai.OpenAI(base_url=server.base_url, api_key="-")

What the tests and `python -m mdjax.bench.serve` run; `python -m mdjax.serve` runs the same
app in the foreground (with its signal handling) through `build`, `uvicorn_config` and
`bound_port`.

Slow clients time out (`uvicorn_config`): a connection that has not sent a whole request
head `HEAD_TIMEOUT_S` after it opened (or after its last answer) is closed, an idle
keep-alive connection after `KEEP_ALIVE_S`, and a body must arrive within
`mdjax.serve.gate.BODY_TIMEOUT_S`. A request head is at most h11's 16 KiB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Iterator

START_TIMEOUT_S = 30
KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive: an idle connection between requests
HEAD_TIMEOUT_S = 10  # a request's head (its line and headers), from the connection's start


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
          model_name: str | None = None, allowed_hosts=None, max_body_bytes: int | None = None,
          **engine_kwargs):
  """(engine, app): a new `Engine` over `model` (not started) and the app over it
  (`create_app`'s arguments; max_body_bytes None: its default). A bad default, bound or
  engine setting is a ValueError naming it."""
  from mdjax.serve.app import create_app
  from mdjax.serve.engine import Engine
  from mdjax.serve.gate import DEFAULT_MAX_BODY_BYTES

  engine = Engine(model, **engine_kwargs)
  app = create_app(engine, model, model_name=model_name or served_name(model),
                   api_key=api_key, defaults=defaults, allowed_hosts=allowed_hosts,
                   max_body_bytes=(DEFAULT_MAX_BODY_BYTES if max_body_bytes is None
                                   else max_body_bytes))
  return engine, app


def _timed_h11():
  """uvicorn's h11 protocol with a deadline on each request's head (module docstring); None
  where this uvicorn's protocol is not the one it was written for."""
  try:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol
  except ImportError:  # pragma: no cover - uvicorn's own protocol then, without the deadline
    return None
  if not all(hasattr(H11Protocol, name) for name in ("connection_made", "data_received",
                                                      "on_response_complete",
                                                      "connection_lost")):
    return None  # pragma: no cover

  class TimedH11Protocol(H11Protocol):
    _head_timer = None

    def _arm(self):
      self._disarm()
      self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def _disarm(self):
      if self._head_timer is not None:
        self._head_timer.cancel()
        self._head_timer = None

    def _head_timeout(self):
      self._head_timer = None
      if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
        self.transport.close()  # still no whole request head: a slow or idle client

    def connection_made(self, transport):
      super().connection_made(transport)
      self._arm()

    def data_received(self, data):
      super().data_received(data)
      if self.conn.their_state is not h11.IDLE:
        self._disarm()  # the head arrived; the body has the gate's deadline

    def on_response_complete(self):
      super().on_response_complete()
      if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
        self._arm()  # the next request's head (uvicorn's keep-alive timer runs too)

    def connection_lost(self, exc):
      self._disarm()
      super().connection_lost(exc)

  return TimedH11Protocol


def uvicorn_config(app, *, host: str, port: int, **kwargs):
  """uvicorn's Config for the app, with the timeouts of the module docstring."""
  import uvicorn
  protocol = _timed_h11()
  return uvicorn.Config(app, host=host, port=port, timeout_keep_alive=KEEP_ALIVE_S,
                        **({"http": protocol} if protocol else {}), **kwargs)


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
            start_engine: bool = True, log_level: str = "warning", allowed_hosts=None,
            max_body_bytes: int | None = None, **engine_kwargs) -> Iterator[Running]:
  """A uvicorn server over `create_app` and a new `Engine(model, **engine_kwargs)` on a
  thread of this process, on `port` (0: a free one). allowed_hosts: default `host` and the
  local names (`mdjax.serve.gate.allowed_hosts`). start_engine=False leaves the engine's
  thread unstarted (requests queue; a test starts it). On exit the server shuts down as on
  SIGTERM: it stops accepting, waits for the requests in flight, and the app's shutdown
  stops the engine (drain=True)."""
  import uvicorn

  from mdjax.serve.gate import allowed_hosts as hosts_of

  engine, app = build(model, api_key=api_key, defaults=defaults, model_name=model_name,
                      allowed_hosts=hosts_of(host, allowed_hosts),
                      max_body_bytes=max_body_bytes, **engine_kwargs)
  if start_engine:
    engine.start()
  config = uvicorn_config(app, host=host, port=port, log_level=log_level,
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
