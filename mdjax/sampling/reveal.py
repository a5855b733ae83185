"""The ancestral reverse kernel shared by the ancestral and remasking families.

Time grids, the reveal probability of each interval, and the reveal step itself: one
kernel, so remasking with sigma = 0 is the ancestral sampler token for token (the
reveal draws, the value draws and the reveal probabilities are the same arrays).
"""

from __future__ import annotations

from typing import Union

import jax
import numpy as np

from mdjax.sampling import transforms
from mdjax.sampling.base import Core, StepInfo, check
from mdjax.streams import StepStream

Array = jax.Array

Grid = Union[str, tuple[float, ...]]
GRIDS = ("uniform", "cosine")


def time_grid(grid: Grid, steps: int) -> np.ndarray:
  """The decreasing grid 1 = t_0 > t_1 > ... > t_K = 0 as float64."""
  if isinstance(grid, str):
    check(grid in GRIDS, "grid", grid, f"must be one of {GRIDS} or a tuple of times")
    i = np.arange(steps + 1) / steps
    times = 1.0 - i if grid == "uniform" else np.cos(0.5 * np.pi * i)
    times[0], times[-1] = 1.0, 0.0
    return times
  times = np.asarray(grid, np.float64)
  check(times.ndim == 1 and len(times) == steps + 1, "grid", grid,
        f"must hold steps + 1 = {steps + 1} times")
  check(times[0] == 1.0 and times[-1] == 0.0 and np.all(np.diff(times) < 0), "grid",
        grid, "must decrease strictly from 1 to 0")
  return times


def freeze_grid(spec) -> None:
  """Stores a spec's grid as a tuple of floats (hashable) and checks it."""
  if not isinstance(spec.grid, str):
    object.__setattr__(spec, "grid", tuple(float(t) for t in spec.grid))
  time_grid(spec.grid, spec.steps)


def intervals(schedule, t_K: np.ndarray, s_K: np.ndarray) -> dict[str, np.ndarray]:
  """1 - alpha at both ends of each interval t -> s, and the reveal probability
  1 - (1 - alpha_s) / (1 - alpha_t) of a masked position."""
  oma_t = np.asarray(schedule.one_minus_alpha(t_K), np.float64)
  oma_s = np.asarray(schedule.one_minus_alpha(s_K), np.float64)
  oma_s = np.where(s_K == 0.0, 0.0, oma_s)
  return {"oma_t": oma_t, "oma_s": oma_s, "reveal_p": 1.0 - oma_s / oma_t}


def reveal(spec, core: Core, step: StepInfo, masked_BxL: Array, logits_BxLxV: Array,
           reveal_p_B: Array) -> Core:
  """Reveals each masked position with probability reveal_p_B, its value drawn from the
  (transformed) categorical."""
  length = core.tokens_BxL.shape[1]
  values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                      **spec.transform)
  _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
  reveal_u_BxL = transforms.row_uniform(step.keys_B, StepStream.REVEAL, (length,),
                                        step.shift_B)
  reveal_BxL = masked_BxL & (reveal_u_BxL < reveal_p_B[:, None])
  return core.commit(reveal_BxL, values_BxL, conf_BxL, step.index)
