"""The live view in a terminal: one request through the serving `Engine`, its canvas redrawn
every denoising step (`sample.py --live`).

    model = mdjax.load("/tmp/shakespeare")
    completion = live(model, "ROMEO.", max_new_tokens=48, seed=0, knobs={"steps": 16})

Masked positions show as '░', written ones as their token's text (a space as '·', a newline
as '↵', any other control character as its picture, ESC as '␛': token text never moves the
cursor or restyles the terminal), under a `step k/K` line. On a terminal (out.isatty()) each frame is drawn over the
last with ANSI cursor moves; elsewhere (a pipe, a file, a test) every frame is printed after
the last, so the output is the whole film. The completion is exactly `mdjax.generate`'s for
the same seed and sampler settings (the engine's contract).
"""

from __future__ import annotations

import queue
import shutil
import sys
from typing import Any, TextIO

import numpy as np

from mdjax import generation

MASKED = "\u2591"  # ░
_SHOWN = {" ": "\u00b7", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}


def token_texts(model, canvas_ids: np.ndarray, masked: np.ndarray) -> list[str | None]:
  """Each position's text: the token decoded alone, None where masked (as the app's canvas
  event sends it)."""
  if model.decode is None:
    return [None if m else str(int(t)) for t, m in zip(canvas_ids, masked)]
  return [None if m else model.decode([int(t)]) for t, m in zip(canvas_ids, masked)]


def _visible(c: str) -> str:
  """A character as the terminal shows it: a control character (C0, DEL, C1: the escape
  sequences a terminal obeys, ESC and CSI among them) as its picture or its code, never
  itself."""
  shown_ = _SHOWN.get(c)
  if shown_ is not None:
    return shown_
  code = ord(c)
  if code < 0x20:
    return chr(0x2400 + code)  # ␛ for ESC, ␇ for BEL, ...
  if code == 0x7F:
    return "\u2421"  # ␡
  if 0x80 <= code < 0xA0:
    return f"<{code:02X}>"  # C1 (0x9B is CSI): no picture of its own
  return c


def shown(text: str | None) -> str:
  """A position as a cell of the terminal canvas: a token's text with its control
  characters made visible (a token's text is the model's: it may hold escape sequences)."""
  if text is None:
    return MASKED
  if text == "":
    return "\u2205"  # ∅: a token with no text of its own (a special token)
  return "".join(map(_visible, text))


def frame_lines(step: int, num_steps: int, texts: list[str | None], width: int) -> list[str]:
  """The lines of one frame: `step k/K  masked m/n` and the canvas wrapped to `width`."""
  masked = sum(t is None for t in texts)
  head = f"step {step}/{num_steps}  masked {masked}/{len(texts)}"
  cells = "".join(shown(t) for t in texts)
  width = max(width, 8)
  body = [cells[i:i + width] for i in range(0, len(cells), width)] or [""]
  return [head, *body]


class _Screen:
  """Draws frames on `out`: over the last one on a terminal, after it elsewhere."""

  def __init__(self, out: TextIO):
    self.out = out
    self.tty = bool(getattr(out, "isatty", lambda: False)())
    self.drawn = 0  # lines of the last frame (a tty redraws over them)
    self.width = shutil.get_terminal_size((100, 24)).columns - 1 if self.tty else 100

  def draw(self, lines: list[str]) -> None:
    if self.tty:
      up = f"\x1b[{self.drawn}F" if self.drawn else ""
      self.out.write(up + "\x1b[J" + "\n".join(lines) + "\n")
      self.drawn = len(lines)
    else:
      self.out.write("\n".join(lines) + "\n\n")
    self.out.flush()


def live(model, prompt: Any, *, max_new_tokens: int, seed: int, sampler: str | None = None,
         knobs: dict | None = None, out: TextIO | None = None, chat: bool = False,
         **engine_kwargs) -> generation.Completion:
  """Runs one prompt through an `Engine` of one row and draws its canvas each step on `out`;
  returns the `Completion` (what `mdjax.generate(model, [prompt], max_new_tokens=...,
  key=jax.random.key(seed), ...)[0]` gives).

  prompt: a text, a chat (messages) or ids, as `mdjax.generation.prompt_ids` reads them
  (chat=True: a text as one user message). sampler / knobs: as the server's request fields
  (a sample.py family name; sample.py-named knobs). A ValueError names a bad argument before
  anything compiles; a failed job raises RuntimeError with the engine's message. out:
  default sys.stdout (as it is at the call). engine_kwargs: the `Engine`'s (canvas_length
  defaults to the prompt's length + max_new_tokens)."""
  from mdjax.serve.engine import Engine  # the engine imports the device stack

  ids = generation.prompt_ids(model, [prompt], chat=chat, where="prompt")[0]
  generation.check_max_new_tokens(max_new_tokens)
  # One request: a canvas of just its prompt and new tokens (generate's layout), not the
  # model's whole length (4,096 positions a step for a published Dream).
  engine_kwargs.setdefault("canvas_length", min(model.max_len, len(ids) + max_new_tokens))
  # One's own run, as sample.py's: the steps a server bounds (--max_steps) are not bounded.
  engine_kwargs.setdefault("max_steps", sys.maxsize)
  engine = Engine(model, **{"max_batch": 1, "max_queue": 1, **engine_kwargs})
  job = engine.prepare(ids, max_new_tokens=max_new_tokens, seed=seed, n=1, sampler=sampler,
                       knobs=knobs)
  updates: queue.Queue = queue.Queue()
  screen = _Screen(sys.stdout if out is None else out)
  engine.start()
  handle, stopped = None, False
  try:
    handle = engine.submit(job, updates.put)
    last_step = None
    while True:
      update = updates.get()
      if update.error is not None:
        raise RuntimeError(f"the engine failed: {update.error}")
      if update.step != last_step or update.completion is None:
        screen.draw(frame_lines(update.step, update.num_steps,
                                token_texts(model, update.canvas_ids, update.masked),
                                screen.width))
        last_step = update.step
      if update.completion is not None:
        return update.completion
  except BaseException:
    if handle is not None:
      handle.cancel()
    engine.stop(drain=False)
    stopped = True
    raise
  finally:
    if not stopped:
      engine.stop(drain=True)
