"""Curves of a training run: WORKDIR/curves.png, drawn from WORKDIR/metrics.jsonl.

train.py redraws it at its checkpoints (`Curves`); `python -m mdjax.plot WORKDIR [--out=FILE]` redraws
it from the file at any time. matplotlib is optional (`pip install 'mdjax[plot]'`) and is
imported only when a plot is drawn.
"""

from __future__ import annotations

import os
import time
import uuid

from mdjax import cli, jsonl

CURVES = "curves.png"
METRICS = "metrics.jsonl"
INSTALL = "pip install 'mdjax[plot]'"


class NoMetrics(ValueError):
  """A workdir without metrics rows to draw (the message names it)."""


def read_metrics(workdir: str) -> list[dict]:
  """The rows of WORKDIR/metrics.jsonl (a line cut short by a kill, nested too deep or not an
  object is skipped)."""
  path = os.path.join(workdir, METRICS)
  if not os.path.isdir(workdir):
    raise NoMetrics(f"workdir={workdir!r} is not a directory.")
  if not os.path.exists(path):
    raise NoMetrics(f"workdir={workdir!r} holds no {METRICS} (train.py writes it).")
  with open(path) as f:
    rows = list(jsonl.log_rows(f, path))
  if not rows:
    raise NoMetrics(f"workdir={workdir!r}: {METRICS} holds no rows yet.")
  return rows


def _series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
  pairs = [(r["step"], r[name]) for r in rows
           if isinstance(r.get(name), (int, float)) and isinstance(r.get("step"), (int, float))]
  return [s for s, _ in pairs], [v for _, v in pairs]


def draw(rows: list[dict], out: str) -> str:
  """Writes the four panels of `rows` to the png `out` (atomically); returns `out`.

  Panels, x = step: training loss; bits per token (training, and the validation NELBO
  when logged: of the EMA parameters and of the raw ones when both are); learning rate;
  training tokens/s. Raises ImportError without matplotlib.
  """
  # The Agg canvas directly: no pyplot, no GUI backend, no global state changed.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(10, 6.5), dpi=90)
  FigureCanvasAgg(fig)
  # Fixed margins: a layout engine would double the time of a write.
  fig.subplots_adjust(left=0.08, right=0.98, bottom=0.08, top=0.95, wspace=0.22, hspace=0.2)
  loss_ax, bits_ax, lr_ax, speed_ax = fig.subplots(2, 2, sharex=True).ravel()
  # With an EMA, val_bits_per_token is the EMA's (what sampling reads) and the raw
  # parameters' is val_bits_per_token_raw; files written before either kept only
  # eval_bits_per_token.
  ema = any("val_bits_per_token_raw" in r for r in rows)
  validation = "val_bits_per_token" if any("val_bits_per_token" in r for r in rows) else \
      "eval_bits_per_token"
  panels = (
      (loss_ax, "training loss", (("loss", "train", "-"),)),
      (bits_ax, "bits per token", (("bits_per_token", "train (raw weights)" if ema else "train",
                                    "-"),
                                   (validation, "validation NELBO" + (", EMA weights" if ema
                                                                      else ""), "o-"),
                                   ("val_bits_per_token_raw", "validation NELBO, raw weights",
                                    "s--"))),
      (lr_ax, "learning rate", (("lr", None, "-"),)),
      (speed_ax, "training tokens/s", (("tokens_per_s", None, "-"),)),
  )
  for ax, title, lines in panels:
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    drawn = 0
    for name, label, style in lines:
      steps, values = _series(rows, name)
      if steps:
        ax.plot(steps, values, style, label=label, markersize=3, linewidth=1.2)
        drawn += 1
    if not drawn:
      ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
              color="gray")
    elif sum(label is not None for _, label, _ in lines) > 1:
      ax.legend(fontsize=8)
  lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
  for ax in (lr_ax, speed_ax):  # rates read against zero
    if ax.has_data():
      ax.set_ylim(bottom=0)
  for ax in (lr_ax, speed_ax):
    ax.set_xlabel("step")
  # A unique temporary name beside `out` (created with the usual permissions), then a rename.
  tmp = os.path.join(os.path.dirname(os.path.abspath(out)),
                     f".{os.path.basename(out)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
  try:
    with open(tmp, "xb") as f:
      fig.savefig(f, format="png")
    os.replace(tmp, out)  # atomic: a crash never leaves a half-written png
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return out


def redraw(workdir: str, out: str | None = None) -> str:
  """Draws WORKDIR/metrics.jsonl to `out` (default WORKDIR/curves.png); returns the path."""
  return draw(read_metrics(workdir), out or os.path.join(workdir, CURVES))


def _is_matplotlib(error: ModuleNotFoundError) -> bool:
  return (error.name or "").split(".")[0] == "matplotlib"


class Curves:
  """Redraws WORKDIR/curves.png at the checkpoints of a training run.

  A draw takes about 0.2 s on a CPU core, so checkpoints less than `every_s` seconds after
  the run's start or its previous draw skip it; the run's last checkpoint (the final step,
  an interruption) always draws. Without matplotlib it says so once, in one line, and draws
  nothing; a png that cannot be written is reported once too. Training goes on either way.
  """

  def __init__(self, workdir: str, log, every_s: float = 30.0, draws: bool = True):
    self.workdir, self.log, self.every_s, self.off = workdir, log, every_s, not draws
    self.last = time.perf_counter()

  def draw(self, last: bool = False) -> None:
    if self.off or not (last or time.perf_counter() - self.last >= self.every_s):
      return
    try:
      redraw(self.workdir)
      self.last = time.perf_counter()
    except ModuleNotFoundError as error:
      if not _is_matplotlib(error):
        raise
      self.off = True
      self.log(f"{CURVES} not drawn: matplotlib is not installed ({INSTALL}).")
    except (OSError, NoMetrics) as error:
      self.off = True
      self.log(f"{CURVES} not drawn ({type(error).__name__}: {error})"
               + ("." if last else "; training goes on."))


def main(argv: list[str] | None = None) -> None:
  parser = cli.Parser(
      "plot", prog="python -m mdjax.plot",
      description="Redraws a training run's curves (loss, validation NELBO, learning rate, "
      "tokens/s) from WORKDIR/metrics.jsonl.")
  parser.add_argument("workdir", help="a train.py workdir")
  parser.add_argument("--out", default=None, help=f"the png to write (default WORKDIR/{CURVES})")
  args = parser.parse_args(argv)
  try:
    path = redraw(args.workdir, args.out)
  except NoMetrics as error:
    cli.fail("plot", error, cli.USAGE)
  except ModuleNotFoundError as error:
    if not _is_matplotlib(error):
      raise
    cli.fail("plot", f"matplotlib is not installed ({INSTALL}).", cli.RUNTIME)
  except OSError as error:
    cli.fail("plot", f"cannot write {args.out or CURVES}: {error}", cli.RUNTIME)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
