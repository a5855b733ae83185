"""What reaches a route: the ASGI middleware in front of every request of `mdjax.serve.app`
(docs/security.md, "The server"). In order, before any route runs:

1. **Host.** The Host header names an allowed host (`allowed_hosts`; default the bound
   address, 127.0.0.1, localhost and [::1]; "*" any), else 400: a web page whose own name
   resolves to this machine (DNS rebinding) is not served, nor can it read the answers.
2. **One Authorization header**: two are a 400 (which one counts would be the reader's
   choice), and so are two Host or Content-Type headers.
3. **The API key**, with one: 401 without `Authorization: Bearer KEY` (compared in constant
   time), except GET /health and GET /.
4. **A POST is JSON**: Content-Type application/json, else 415, before its body is read. A
   cross-site page may send text/plain, a form or no type at all without asking the
   server; JSON needs a CORS preflight, which this server never grants (it sends no
   Access-Control header).
5. **A POST's body** has at most `max_body_bytes` bytes (413: from Content-Length before a
   byte is read, else counted as it arrives) and arrives within `BODY_TIMEOUT_S` (408);
   the route gets it whole. A refusal closes the connection (the rest of the body is never
   read).

It also counts the requests of the /v1/ routes and their latency (/metrics).
"""

from __future__ import annotations

import asyncio
import hmac
import time

from mdjax.serve.fields import APIError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a canvas of 4,096 ids is ~30 KB of JSON
BODY_TIMEOUT_S = 30.0  # the whole body, from the request's head: 1 MiB at 35 KB/s


def host_name(value: str) -> str:
  """The host of a Host header or an allowlist entry, in lower case, without a port; an
  IPv6 address in brackets ("::1" -> "[::1]")."""
  value = value.strip().lower()
  if value.startswith("["):
    end = value.find("]")
    return value[:end + 1] if end > 0 else value
  if value.count(":") > 1:  # a bare IPv6 address
    return f"[{value}]"
  return value.partition(":")[0]


def allowed_hosts(bound: str | None = None, hosts=None) -> tuple[str, ...]:
  """The hosts a server answers to: `hosts` as given (an iterable of names, or a string of
  them separated by commas; "*": any), else the bound address and LOCAL_HOSTS."""
  if isinstance(hosts, str):
    hosts = hosts.split(",")
  if hosts is None:
    hosts = ([bound] if bound else []) + list(LOCAL_HOSTS)
  names = tuple(dict.fromkeys(host_name(h) if h.strip() != "*" else "*" for h in hosts
                              if h.strip()))
  if not names:
    raise ValueError("allowed_hosts is empty: name at least one host (or '*' for any).")
  return names


def _headers(scope, name: bytes) -> list[str]:
  return [value.decode("latin-1") for key, value in scope.get("headers") or ()
          if key.lower() == name]


class Gate:
  """The ASGI middleware (module docstring) over the app's `State` (its api_key,
  allowed_hosts, max_body_bytes and metrics)."""

  OPEN = ("/health", "/", "/favicon.ico")

  def __init__(self, app, state):
    self.app, self.state = app, state

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    path = scope.get("path", "")
    counted = path.startswith("/v1/")
    started, status = time.perf_counter(), [500]

    async def sending(message):
      if message["type"] == "http.response.start":
        status[0] = message["status"]
      await send(message)

    try:
      post = scope.get("method") == "POST"
      try:
        self._check_head(scope, path, post)
        if post:
          body = await self._read_body(scope, receive)
          if body is None:  # the client went away
            return
          receive = _replay(body, receive)
      except APIError as error:
        if post:  # the body (or its rest) is never read: the connection ends with the answer
          error.headers = {**(error.headers or {}), "Connection": "close"}
        return await error.response()(scope, receive, sending)
      return await self.app(scope, receive, sending)
    finally:
      if counted:
        self.state.metrics.record(status[0], time.perf_counter() - started)

  def _check_head(self, scope, path: str, post: bool) -> None:
    """Steps 1 to 4 of the module docstring, on the request's head; an APIError."""
    hosts = _headers(scope, b"host")
    if len(hosts) > 1:
      raise APIError(400, f"the request has {len(hosts)} Host headers; send one.",
                     code="invalid_host")
    allowed = self.state.allowed_hosts
    if hosts and "*" not in allowed and host_name(hosts[0]) not in allowed:
      raise APIError(400, f"Host {hosts[0][:80]!r} is not served here: this server answers "
                     "to the hosts of its --allowed_hosts.", code="invalid_host")
    given = _headers(scope, b"authorization")
    if len(given) > 1:
      raise APIError(400, f"the request has {len(given)} Authorization headers; send one.",
                     code="invalid_api_key")
    key = self.state.api_key
    if key and path not in self.OPEN:
      scheme, _, token = (given or [""])[0].partition(" ")
      if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                key.encode()):
        raise APIError(401, "a valid API key is required: send the header "
                       "'Authorization: Bearer KEY'.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if post:
      types = _headers(scope, b"content-type")
      media = types[0].split(";")[0].strip().lower() if len(types) == 1 else None
      if media != "application/json":
        shown = " and ".join(repr(t[:60]) for t in types) or "none"
        raise APIError(415, f"a POST's body must be JSON, sent with the header 'Content-Type: "
                       f"application/json' (this request's Content-Type: {shown}).",
                       code="unsupported_media_type")

  async def _read_body(self, scope, receive) -> bytes | None:
    """The whole body, within its bounds (step 5); None when the client went away."""
    limit = self.state.max_body_bytes
    too_large = APIError(413, f"the request body is over {limit:,} bytes, the most this "
                         "server reads (--max_body_bytes).", code="request_too_large")
    lengths = _headers(scope, b"content-length")
    if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > limit:
      raise too_large
    chunks, size = [], 0
    try:
      async with asyncio.timeout(BODY_TIMEOUT_S):
        while True:
          message = await receive()
          if message["type"] == "http.disconnect":
            return None
          chunk = message.get("body", b"")
          size += len(chunk)
          if size > limit:
            raise too_large
          chunks.append(chunk)
          if not message.get("more_body", False):
            return b"".join(chunks)
    except TimeoutError:
      raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s.",
                     code="request_timeout") from None


def _replay(body: bytes, receive):
  """A `receive` that gives the body read, whole, then what the client sends (its
  disconnect)."""
  given = False

  async def replay():
    nonlocal given
    if not given:
      given = True
      return {"type": "http.request", "body": body, "more_body": False}
    return await receive()
  return replay
