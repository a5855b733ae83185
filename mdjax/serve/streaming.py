"""A prepared request run on the engine: its rows' text as it becomes final (the committed
prefix, held back before a possible stop string), the JSON response or the server-sent
events (OpenAI's chunks, the `event: canvas` extension), and cancellation when the client
goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mdjax.serve.fields import APIError, Call


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
  """The text before its first stop string, and whether one was found."""
  first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
  return (text[:first], True) if first >= 0 else (text, False)


def held_back(text: str, stops: list[str]) -> str:
  """The text without a tail that could begin a stop string (it may yet be cut)."""
  hold = 0
  for stop in stops:
    for size in range(min(len(stop) - 1, len(text)), hold, -1):
      if text.endswith(stop[:size]):
        hold = size
        break
  return text[:len(text) - hold] if hold else text


class Row:
  """One choice: the text sent so far, and once finished its finish_reason and ids."""

  def __init__(self, call: Call):
    self.call, self.sent, self.finished = call, "", False
    self.token_ids: list[int] = []
    self.finish_reason: str | None = None

  def committed_text(self, update) -> str | None:
    """The text of the committed prefix that may be sent now (None: nothing new)."""
    model = self.call.state.model
    if model.decode is None or update.committed <= 0:
      return None
    ids = np.asarray(update.canvas_ids)[:update.committed]
    stops = np.asarray(model.stop_ids, np.int64)
    if stops.size:
      ends = np.flatnonzero(np.isin(ids, stops))
      if len(ends):
        ids = ids[:ends[0]]
    text = model.decode([int(t) for t in ids])
    text, hit = cut_at_stop(text, self.call.stop)
    if not hit:
      text = held_back(text, self.call.stop)
    if not text.startswith(self.sent) or text.endswith("\ufffd") or len(text) <= len(self.sent):
      return None
    delta = text[len(self.sent):]
    self.sent = text
    return delta

  def final(self, completion) -> str:
    """The rest of the completion's text (after `stop` strings); sets finish_reason."""
    text, hit = cut_at_stop(completion.text or "", self.call.stop)
    self.finish_reason = "stop" if hit else completion.finish_reason
    self.token_ids = [int(t) for t in completion.token_ids]
    self.finished = True
    delta = text[len(self.sent):] if text.startswith(self.sent) else ""
    self.sent = text
    return delta


class Pieces:
  """Each position's text for the canvas event, one decode a token id (cached)."""

  def __init__(self, model):
    self.model = model
    self._text: dict[int, str] = {}

  def __call__(self, token: int) -> str:
    text = self._text.get(token)
    if text is None:
      text = self._text[token] = (str(token) if self.model.decode is None
                                  else self.model.decode([token]))
    return text

  def canvas(self, update) -> dict:
    """The `event: canvas` data: every position's text (None where masked), which of them
    are final (the rest are provisional: a rewriting sampler may still change them), and
    the committed prefix's length (the positions the text stream has covered)."""
    return {"choice": int(update.choice), "step": int(update.step),
            "num_steps": int(update.num_steps),
            "tokens": [None if m else self(int(t)) for t, m in
                       zip(np.asarray(update.canvas_ids).tolist(),
                           np.asarray(update.masked).tolist())],
            "final": np.asarray(update.final).tolist(), "committed": int(update.committed)}


def engine_error(message: str) -> APIError:
  return APIError(500, f"the engine failed: {message}", type_="server_error")


class Run:
  """A call's job submitted to the engine: its RowUpdates on an asyncio queue (None once the
  client went away), its rows. `async with` watches for the client's disconnect and cancels
  the job however the block ends, unless every row finished. A full queue is a 429."""

  def __init__(self, call: Call, request: Request):
    from mdjax.serve.engine import QueueFull  # the engine imports the device stack
    self.call, self.request = call, request
    self.rows = [Row(call) for _ in range(call.rows)]
    self.ident = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.updates: asyncio.Queue = asyncio.Queue()
    self._watcher: asyncio.Task | None = None
    self.gone = False  # the client went away
    loop = asyncio.get_running_loop()

    def on_update(first: int):  # prompt i's choices follow the n choices of each before it
      def put(update):  # the engine's thread
        update = dataclasses.replace(update, choice=first + update.choice)
        loop.call_soon_threadsafe(self.updates.put_nowait, update)
      return put

    self.handles = []
    try:
      for i, job in enumerate(call.jobs):
        # A whole response needs each row's completion only; a stream, every step.
        self.handles.append(call.state.engine.submit(job, on_update(i * call.n),
                                                     every_step=call.stream))
    except QueueFull as error:
      self.cancel()  # the prompts submitted before it
      retry = max(1, math.ceil(error.retry_after))
      raise APIError(429, f"the server's queue is full ({error}); retry after {retry} s.",
                     type_="rate_limit_error", code="queue_full",
                     headers={"Retry-After": str(retry)}) from None

  async def row_updates(self):
    """(row, update) for each update of a row not yet finished, until every row finished;
    it ends early, with `gone` set, when the client went away. An engine failure raises its
    500 APIError."""
    remaining = len(self.rows)
    while remaining:
      update = await self.updates.get()
      if update is None:
        self.gone = True
        return
      if update.error is not None:
        raise engine_error(update.error)
      row = self.rows[update.choice]
      if row.finished:
        continue
      if update.completion is not None:
        remaining -= 1
      yield row, update

  def cancel(self) -> None:
    for handle in self.handles:
      if not handle.done:
        handle.cancel()

  async def _watch(self) -> None:
    while (await self.request.receive())["type"] != "http.disconnect":
      pass
    self.cancel()
    self.updates.put_nowait(None)

  async def __aenter__(self) -> "Run":
    self._watcher = asyncio.create_task(self._watch())
    return self

  async def __aexit__(self, *exc) -> None:
    self._watcher.cancel()
    self.cancel()

  def usage(self) -> dict:
    prompt = sum(len(job.prompt_ids) for job in self.call.jobs)
    completion = sum(len(r.token_ids) for r in self.rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
    """A response's or a chunk's body around its choices."""
    kind = (("chat.completion.chunk" if chunk else "chat.completion") if self.call.chat
            else "text_completion")
    return {"id": self.ident, "object": kind, "created": self.created,
            "model": self.call.state.model_name, "choices": choices}


async def complete(call: Call, request: Request) -> Response:
  """The whole response once every row finished (499, nothing sent, if the client left)."""
  async with Run(call, request) as run:
    texts = [""] * call.rows
    async for row, update in run.row_updates():
      if update.completion is not None:
        texts[update.choice] = row.final(update.completion)
    if run.gone:
      return Response(status_code=499)  # nobody is listening
  choices = []
  for index, (row, text) in enumerate(zip(run.rows, texts)):
    choice = {"index": index, "finish_reason": row.finish_reason, "logprobs": None,
              "mdjax": {"token_ids": row.token_ids, "seed": call.seed_of(index)}}
    if call.chat:
      choice["message"] = {"role": "assistant", "content": text}
    else:
      choice["text"] = text
    choices.append(choice)
  return JSONResponse({**run.envelope(choices), "usage": run.usage(),
                       "mdjax": call.extension()})


def sse(data: dict, event: str | None = None) -> str:
  """One server-sent event."""
  text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
  return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def stream(call: Call, request: Request) -> StreamingResponse:
  """The response as server-sent events: a chunk whenever a row's committed text grows, a
  canvas event each step (with `mdjax_canvas`), the usage (with `include_usage`), [DONE]."""
  run = Run(call, request)

  def chunk(index: int, delta: str | None, finish: str | None = None, role: bool = False,
            extra: dict | None = None) -> dict:
    choice: dict = {"index": index, "finish_reason": finish, "logprobs": None}
    if call.chat:
      content = {} if delta is None else {"content": delta}
      choice["delta"] = {"role": "assistant", **content} if role else content
    else:
      choice["text"] = delta or ""
    if extra is not None:
      choice["mdjax"] = extra
    out = run.envelope([choice], chunk=True)
    if finish is not None:
      out["mdjax"] = call.extension()
    return out

  async def events():
    async with run:
      if call.chat:
        for index in range(call.rows):
          yield sse(chunk(index, "", role=True))
      try:
        async for row, update in run.row_updates():
          if call.canvas:
            yield sse(call.state.pieces.canvas(update), event="canvas")
          if update.completion is not None:
            delta = row.final(update.completion)
            yield sse(chunk(update.choice, delta, row.finish_reason,
                            extra={"token_ids": row.token_ids,
                                   "seed": call.seed_of(update.choice)}))
          elif delta := row.committed_text(update):
            yield sse(chunk(update.choice, delta))
      except APIError as error:  # the engine failed: the error as an event, then [DONE]
        yield sse(error.body())
      else:
        if run.gone:
          return
        if call.include_usage:
          yield sse({**run.envelope([], chunk=True), "usage": run.usage(),
                     "mdjax": call.extension()})
      yield "data: [DONE]\n\n"

  return _Stream(run, events(), media_type="text/event-stream",
                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Stream(StreamingResponse):
  """A stream that cancels its job however it ends (also when its body never started: the
  client left before the first byte)."""

  def __init__(self, run: Run, content, **kwargs):
    super().__init__(content, **kwargs)
    self.run = run

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.run.cancel()
