"""Trained methods against the training-free frontier of the same teacher: equal calls, equal
accuracy, AUP. The points are results/parallelism.json's records (`accuracy`,
`accuracy_se`, `tpf`, `mean_forwards`, ...) plus `method`, `trained`, `teacher` (which
denoiser the sampler or the student derives from) and `temperature`.

Mixing two samplers at random per row reaches any point of the segment between them in
(mean calls, accuracy), so what the training-free samplers reach is the upper concave hull
of their points (`hull`); a trained point is compared with it at its own mean calls
(`at_calls`) and at its own accuracy (`calls_at`).
"""

from __future__ import annotations

import math

from mdjax import parallelism


def label(p: dict) -> str:
  """method(knob=value, ...) of a point."""
  knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items())
  return f"{p['method']}({knobs})"


def hull(points: list[dict]) -> list[dict]:
  """The upper concave hull in (mean calls, accuracy), fewest calls first: what mixing two
  points reaches (each row sampled by one of them at random, the calls and the accuracy
  averaging linearly)."""
  pts = sorted(points, key=lambda p: (p["mean_forwards"], -p["accuracy"]))
  frontier = []
  for p in pts:
    if frontier and p["accuracy"] <= frontier[-1]["accuracy"]:
      continue  # more calls, no more accuracy
    while len(frontier) >= 2:
      a, b = frontier[-2], frontier[-1]
      cross = ((b["mean_forwards"] - a["mean_forwards"]) * (p["accuracy"] - a["accuracy"])
               - (b["accuracy"] - a["accuracy"]) * (p["mean_forwards"] - a["mean_forwards"]))
      if cross < 0:
        break
      frontier.pop()  # b lies on or below the chord a-p
    frontier.append(p)
  return frontier


def at_calls(frontier: list[dict], calls: float) -> dict | None:
  """The frontier's accuracy at `calls` mean calls (linear between its points) with its
  standard error (the two points' binomial errors, weighted); None below its fewest calls."""
  if not frontier or calls < frontier[0]["mean_forwards"]:
    return None
  for a, b in zip(frontier, frontier[1:]):
    if a["mean_forwards"] <= calls <= b["mean_forwards"]:
      f = (calls - a["mean_forwards"]) / (b["mean_forwards"] - a["mean_forwards"])
      return {"accuracy": (1 - f) * a["accuracy"] + f * b["accuracy"],
              "accuracy_se": math.hypot((1 - f) * a["accuracy_se"], f * b["accuracy_se"]),
              "between": [label(a), label(b)], "weight": f}
  last = frontier[-1]  # more calls than the costliest: it stays the best
  return {"accuracy": last["accuracy"], "accuracy_se": last["accuracy_se"],
          "between": [label(last)], "weight": 0.0}


def calls_at(frontier: list[dict], accuracy: float) -> float | None:
  """The fewest mean calls at which the frontier reaches `accuracy` (linear between its
  points); None above its best accuracy."""
  if not frontier or accuracy > frontier[-1]["accuracy"]:
    return None
  if accuracy <= frontier[0]["accuracy"]:
    return frontier[0]["mean_forwards"]
  for a, b in zip(frontier, frontier[1:]):
    if a["accuracy"] <= accuracy <= b["accuracy"]:
      f = (accuracy - a["accuracy"]) / (b["accuracy"] - a["accuracy"])
      return (1 - f) * a["mean_forwards"] + f * b["mean_forwards"]
  return None


def _z(difference: float, se: float) -> float:
  if se > 0:
    return difference / se
  return 0.0 if difference == 0 else math.copysign(math.inf, difference)


def groups(points: list[dict]) -> list[tuple]:
  """The (task, teacher, temperature) groups of the points, sorted."""
  return sorted({(p["task"], p["teacher"], p["temperature"]) for p in points})


def equal_calls(points: list[dict], exact_teacher: str = "oracle") -> list[dict]:
  """Each trained point against the training-free frontier of its own teacher at its mean
  calls (`difference`, `z`) and at its accuracy (`speedup`: the frontier's calls over the
  point's; None where no training-free point is that accurate), and against the exact
  denoiser's frontier (`exact_teacher`'s points at the same temperature, the sampler that
  reads the answer included: the ceiling) at its mean calls (`to_exact`)."""
  out = []
  for task, teacher, temperature in groups(points):
    here = [p for p in points if (p["task"], p["teacher"], p["temperature"])
            == (task, teacher, temperature)]
    frontier = hull([p for p in here if not p["trained"] and not p.get("uses_answer")])
    exact = hull([p for p in points if (p["task"], p["teacher"], p["temperature"])
                  == (task, exact_teacher, temperature) and not p["trained"]])
    for p in (p for p in here if p["trained"]):
      free = at_calls(frontier, p["mean_forwards"])
      row = {"task": task, "teacher": teacher, "temperature": temperature,
             "learned": label(p), "mean_forwards": p["mean_forwards"], "tpf": p["tpf"],
             "accuracy": p["accuracy"], "accuracy_se": p["accuracy_se"],
             "training_free": free}
      if free is not None:
        row["difference"] = p["accuracy"] - free["accuracy"]
        row["z"] = _z(row["difference"], math.hypot(p["accuracy_se"], free["accuracy_se"]))
      free_calls = calls_at(frontier, p["accuracy"])
      row["training_free_calls"] = free_calls
      row["speedup"] = None if free_calls is None else free_calls / p["mean_forwards"]
      best = at_calls(exact, p["mean_forwards"])
      if best is not None:
        row["to_exact"] = {"accuracy": best["accuracy"], "between": best["between"],
                           "difference": p["accuracy"] - best["accuracy"],
                           "z": _z(p["accuracy"] - best["accuracy"],
                                   math.hypot(p["accuracy_se"], best["accuracy_se"]))}
      out.append(row)
  return out


def aup_by_method(points: list[dict]) -> dict:
  """AUP per task, teacher, temperature and method ({task: {teacher: {T: {method: AUP}}}});
  y_max the best accuracy of the group's samplers (the answer-reading oracle left out)."""
  table = {}
  for task, teacher, temperature in groups(points):
    here = [p for p in points if (p["task"], p["teacher"], p["temperature"])
            == (task, teacher, temperature) and not p.get("uses_answer")]
    y_max = 100.0 * max(p["accuracy"] for p in here)
    per = {}
    for method in sorted({p["method"] for p in here}):
      pts = [p for p in here if p["method"] == method]
      per[method] = (parallelism.aup([p["tpf"] for p in pts],
                                     [100.0 * p["accuracy"] for p in pts], y_max)
                     if y_max > 0 else 0.0)
    table.setdefault(task, {}).setdefault(teacher, {})[str(temperature)] = per
  return table
