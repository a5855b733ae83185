"""Exact total correlation and per-step KL of the positions a sampler writes together.

A parallel step at state z writes a group S of masked positions, each drawn from its own
law q_i(. | z). Against the exact conditional joint p(x_S | z), the step's KL is

    KL(p(x_S | z) || prod_i q_i) = TC(x_S | z) + sum_i KL(p_i || q_i)  >=  TC(x_S | z),

where TC = sum_i H(x_i | z) - H(x_S | z) is the conditional total correlation (ParallelBench's
bound): no per-position law, however good, does better, and the exact marginals
(q_i = p_i) attain it. The functions here compute both from an exact oracle, by the chain
rule through it (`group_joint`), for the groups a run actually wrote (`written_groups`,
from `SampleResult.write_step_BxL`). Everything is numpy in nats.

`conditionals(tokens_NxL) -> (probs_NxLxV, possible_N)` is the oracle: exact p(x_i | visible)
and whether the state is possible at all (an impossible state has no conditional law).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Conditionals = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def group_joint(conditionals: Conditionals, tokens_L, positions, *,
                max_leaves: int = 1 << 16) -> tuple[np.ndarray, np.ndarray] | None:
  """The exact joint of the masked `positions` at the state `tokens_L`.

  Enumerated by the chain rule through the oracle, one position at a time, dropping
  zero-probability prefixes. Returns (assignments_NxG, probs_N), or None when more than
  `max_leaves` prefixes would be needed.
  """
  canvases = np.asarray(tokens_L, np.int32)[None].copy()
  probs = np.ones(1)
  for pos in positions:
    # Pad the batch to a power of two so that a jitted oracle compiles few shapes.
    padded = np.resize(canvases, (1 << (len(canvases) - 1).bit_length(), canvases.shape[1]))
    cond = np.asarray(conditionals(padded)[0], np.float64)[:len(canvases), pos]
    rows, vals = np.nonzero(cond > 0)
    if len(rows) > max_leaves:
      return None
    probs = probs[rows] * cond[rows, vals]
    canvases = canvases[rows]
    canvases[:, pos] = vals
  probs = probs / probs.sum()  # float32 oracles sum to 1 within rounding
  return canvases[:, list(positions)], probs


def entropy(probs) -> float:
  """Entropy in nats of one distribution."""
  q = np.asarray(probs, np.float64)
  q = q[q > 0]
  return float(-(q * np.log(q)).sum())


def marginals(assignments_NxG: np.ndarray, probs_N: np.ndarray, vocab_size: int) -> np.ndarray:
  """The group's per-position marginals (G x V)."""
  return np.stack([np.bincount(assignments_NxG[:, g], weights=probs_N, minlength=vocab_size)
                   for g in range(assignments_NxG.shape[1])])


def total_correlation(assignments_NxG: np.ndarray, probs_N: np.ndarray, vocab_size: int) -> float:
  """TC = sum_i H(x_i) - H(x_S) in nats."""
  marg_GxV = marginals(assignments_NxG, probs_N, vocab_size)
  return float(sum(entropy(m) for m in marg_GxV) - entropy(probs_N))


def product_kl(assignments_NxG: np.ndarray, probs_N: np.ndarray, q_GxV) -> float:
  """KL(p(x_S) || prod_i q_i(x_i)) in nats; inf where a q_i rules out a value p has."""
  q_GxV = np.asarray(q_GxV, np.float64)
  keep = probs_N > 0
  a, p = assignments_NxG[keep], probs_N[keep]
  q_NxG = q_GxV[np.arange(a.shape[1])[None], a]
  if np.any(q_NxG <= 0):
    return float("inf")
  return float((p * (np.log(p) - np.log(q_NxG).sum(1))).sum())


def written_groups(write_step_L, fixed_L=None) -> list[tuple[int, np.ndarray]]:
  """(step, positions) of each step that wrote something, in step order. Valid for
  families that never reopen a written position (write_step is then the only write)."""
  write_step_L = np.asarray(write_step_L)
  editable = np.ones_like(write_step_L, bool) if fixed_L is None else ~np.asarray(fixed_L)
  steps = np.unique(write_step_L[editable & (write_step_L >= 0)])
  return [(int(k), np.nonzero(editable & (write_step_L == k))[0]) for k in steps]


def state_before(tokens_L, write_step_L, step: int, mask_id: int, fixed_L=None) -> np.ndarray:
  """The canvas before `step`: positions written at `step` or later masked again."""
  tokens_L, write_step_L = np.asarray(tokens_L), np.asarray(write_step_L)
  editable = np.ones_like(write_step_L, bool) if fixed_L is None else ~np.asarray(fixed_L)
  return np.where(editable & (write_step_L >= step), mask_id, tokens_L).astype(np.int32)


def step_bounds(conditionals: Conditionals, tokens_BxL, write_step_BxL, *, mask_id: int,
                vocab_size: int, sampler_laws: Conditionals | None = None, fixed_BxL=None,
                max_leaves: int = 1 << 16) -> list[dict]:
  """For every step of every row that wrote two or more positions at a possible state:
  the group's exact TC and the step's exact KL against the laws it drew from.

  `sampler_laws(states_NxL) -> (q_NxLxV, _)` is what the sampler drew each position from
  (default: the oracle, so KL = TC). Steps at impossible states (an earlier step wrote an
  inconsistent group) have no conditional law and are counted, not measured; groups
  whose joint needs more than `max_leaves` prefixes likewise. Returns one dict per
  measured step: row, step, size, tc, kl, gap (kl - tc).
  """
  laws = sampler_laws or conditionals
  tokens_BxL, write_step_BxL = np.asarray(tokens_BxL), np.asarray(write_step_BxL)
  out = []
  for b in range(tokens_BxL.shape[0]):
    fixed_L = None if fixed_BxL is None else np.asarray(fixed_BxL)[b]
    for step, group in written_groups(write_step_BxL[b], fixed_L):
      if len(group) < 2:
        continue
      state = state_before(tokens_BxL[b], write_step_BxL[b], step, mask_id, fixed_L)
      _, possible = conditionals(state[None])
      if not bool(np.asarray(possible)[0]):
        out.append({"row": b, "step": step, "size": len(group), "impossible": True})
        continue
      joint = group_joint(conditionals, state, group, max_leaves=max_leaves)
      if joint is None:
        out.append({"row": b, "step": step, "size": len(group), "too_large": True})
        continue
      assignments, probs = joint
      q_GxV = np.asarray(laws(state[None])[0], np.float64)[0, group]
      tc = total_correlation(assignments, probs, vocab_size)
      kl = product_kl(assignments, probs, q_GxV)
      out.append({"row": b, "step": step, "size": len(group), "tc": tc, "kl": kl,
                  "gap": kl - tc})
  return out


def summarize(records: list[dict], tolerance: float = 1e-4) -> dict:
  """Counts and means of `step_bounds` records; `violations`: steps with KL < TC -
  tolerance (float32 oracles round at about 1e-6 per term). Means are over the steps with
  a finite KL; `kl_infinite` counts the others (a law q_i that is 0 where p has mass: a
  float32 marginal rounded to 0 on an exact oracle)."""
  measured = [r for r in records if "tc" in r]
  tc = np.array([r["tc"] for r in measured])
  kl = np.array([r["kl"] for r in measured])
  finite = np.isfinite(kl)
  mean = lambda x: float(x[finite].mean()) if finite.any() else None
  return {
      "steps_measured": len(measured),
      "steps_impossible": sum(1 for r in records if r.get("impossible")),
      "steps_too_large": sum(1 for r in records if r.get("too_large")),
      "violations": int(np.sum(kl < tc - tolerance)),
      "kl_infinite": int((~finite).sum()),
      "tc_mean": mean(tc),
      "kl_mean": mean(kl),
      "gap_mean": mean(kl - tc),
      "gap_min": float((kl - tc)[finite].min()) if finite.any() else None,
      "tc_over_kl": (float(tc[finite].sum() / kl[finite].sum())
                     if finite.any() and kl[finite].sum() > 0 else None),
  }


def aup(tpf, accuracy, y_max: float, alpha: float = 3.0) -> float:
  """Accuracy under parallelism (d3LLM): with the points sorted by TPF rho_1 < ... and
  accuracies y_i in percent, only points with y_i >= y_1 - 5 count, and

      AUP = rho_1 y_1 + 1/2 sum_i (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1})),

  W(y) = min(exp(-alpha (1 - y / y_max)), 1), y_max the best accuracy on the task (over
  every method compared). Points of equal TPF keep the best accuracy."""
  tpf, accuracy = np.asarray(tpf, np.float64), np.asarray(accuracy, np.float64)
  if tpf.shape != accuracy.shape or tpf.ndim != 1 or not len(tpf):
    raise ValueError(f"tpf and accuracy must be 1-D of one length; got {tpf.shape} and "
                     f"{accuracy.shape}.")
  if not y_max > 0:
    raise ValueError(f"y_max={y_max!r} must be > 0 (percent).")
  best = {}
  for rho, y in zip(tpf, accuracy):
    best[rho] = max(best.get(rho, -np.inf), y)
  rho = np.array(sorted(best))
  y = np.array([best[r] for r in rho])
  keep = y >= y[0] - 5.0
  rho, y = rho[keep], y[keep]
  w = np.minimum(np.exp(-alpha * (1.0 - y / y_max)), 1.0)
  return float(rho[0] * y[0] + 0.5 * np.sum(np.diff(rho) * (y[1:] * w[1:] + y[:-1] * w[:-1])))
