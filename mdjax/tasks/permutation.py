"""Permutation: a uniformly random ordering of n distinct items, one per position.

L = V = n (ids 0..n-1, mask n). The law is uniform on the n! permutations; a sample is
valid when its items are all distinct. At a state whose visible items are distinct, the
masked positions hold a uniform ordering of the r unused items, so each one's exact
conditional is uniform on them (1/r each), and any g of them written independently from
those marginals are distinct with probability r (r-1) ... (r-g+1) / r^g: the total
correlation of the group is log r^g / (r (r-1) ... (r-g+1)) nats. A state with a repeated
item is impossible (`is_impossible`); its masked positions get the all-masked marginals.

`ancestral_valid_probability(n, steps)` is the exact validity of ancestral decoding with
K equal steps of the linear schedule (docs/parallelism.md derives it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.noise import exact
from mdjax.tasks.base import Task


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
  """Task parameters (hashable: static under jit)."""

  n: int = 6  # items, positions and real ids

  def __post_init__(self):
    if not (isinstance(self.n, int) and not isinstance(self.n, bool) and 2 <= self.n <= 64):
      raise ValueError(f"n={self.n!r} must be an integer in [2, 64].")

  @property
  def length(self) -> int:
    return self.n

  @property
  def vocab_size(self) -> int:
    return self.n

  @property
  def mask_id(self) -> int:
    return self.n


DEFAULT = Params()


@functools.partial(jax.jit, static_argnames=("batch", "params"))
def sample_data(key: jax.Array, batch: int, params: Params = DEFAULT) -> jax.Array:
  """Draws `batch` uniform permutations (tokens_BxL)."""
  keys_B = jax.random.split(key, batch)
  return jax.vmap(lambda k: jax.random.permutation(k, params.n))(keys_B).astype(jnp.int32)


def _counts_BxV(tokens_BxL: jax.Array, params: Params) -> jax.Array:
  """How many visible positions hold each item."""
  return jax.nn.one_hot(tokens_BxL, params.n, dtype=jnp.int32).sum(1)  # the mask id drops out


@functools.partial(jax.jit, static_argnames="params")
def exact_probs(tokens_BxL: jax.Array, params: Params = DEFAULT) -> tuple[jax.Array, jax.Array]:
  """Exact p(x_i | visible) (B x L x V) and `possible_B`.

  Masked positions: uniform on the unused items (on all items where the state is
  impossible: the all-masked marginals); visible positions: a one-hot of their item.
  """
  counts_BxV = _counts_BxV(tokens_BxL, params)
  possible_B = jnp.all(counts_BxV <= 1, -1) & jnp.all(
      (tokens_BxL >= 0) & (tokens_BxL <= params.mask_id), -1)
  unused_BxV = jnp.where(possible_B[:, None], counts_BxV == 0, True).astype(jnp.float32)
  uniform_BxV = unused_BxV / unused_BxV.sum(-1, keepdims=True)
  visible_BxL = tokens_BxL != params.mask_id
  onehot_BxLxV = jax.nn.one_hot(tokens_BxL, params.n)
  probs = jnp.where(visible_BxL[..., None], onehot_BxLxV, uniform_BxV[:, None, :])
  return probs, possible_B


def make_exact_denoiser(params: Params = DEFAULT):
  """The denoiser contract for these parameters (its params and t_B are unused)."""

  def exact_denoiser(unused_params, tokens_BxL, t_B):
    del unused_params, t_B
    return jnp.log(exact_probs(jnp.asarray(tokens_BxL), params)[0])

  return exact_denoiser


def is_impossible(tokens_BxL, params: Params = DEFAULT):
  """True for rows the law can never produce (a repeated item)."""
  return ~exact_probs(jnp.asarray(tokens_BxL), params)[1]


def checks(tokens_BxL, params: Params = DEFAULT) -> dict[str, np.ndarray]:
  """valid: every position holds an item and no item repeats (numpy bool_B)."""
  x = np.asarray(tokens_BxL)
  in_range = np.all((x >= 0) & (x < params.n), 1)
  sorted_x = np.sort(x, 1)
  distinct = np.all(sorted_x[:, 1:] != sorted_x[:, :-1], 1)
  return {"valid": in_range & distinct}


def sample_metrics(tokens_BxL, params: Params = DEFAULT) -> dict[str, float]:
  """The valid fraction and the fraction of rows unique in the set."""
  x = np.asarray(tokens_BxL)
  return {"valid": float(checks(x, params)["valid"].mean()),
          "unique": len({row.tobytes() for row in x}) / max(len(x), 1)}


def decode(tokens_L, params: Params = DEFAULT) -> str:
  return " ".join("?" if int(t) == params.mask_id else str(int(t)) for t in tokens_L)


def log_prob(tokens_BxL, params: Params = DEFAULT) -> np.ndarray:
  """Exact log p(x) in nats (-log n! on permutations, -inf elsewhere)."""
  valid = checks(tokens_BxL, params)["valid"]
  return np.where(valid, -math.lgamma(params.n + 1), -np.inf)


def group_total_correlation(remaining: int, group: int) -> float:
  """TC in nats of `group` masked positions written together from `remaining` unused items:
  log(r^g / (r (r-1) ... (r-g+1)))."""
  r, g = remaining, group
  if not 0 <= g <= r:
    raise ValueError(f"group={g!r} must lie in [0, remaining={r!r}].")
  return g * math.log(r) - (math.lgamma(r + 1) - math.lgamma(r - g + 1)) if g else 0.0


def _step_laws(n: int, steps: int):
  """Per step k of K, the law of the group size g given r positions still masked: each
  masked position is revealed at step k with probability 1 / (K - k) (the linear schedule
  on a uniform grid), so g ~ Binomial(r, 1 / (K - k)); exact Fractions."""
  for k in range(steps):
    p = Fraction(1, steps - k)
    yield lambda r, g, p=p: math.comb(r, g) * p**g * (1 - p)**(r - g)


def ancestral_valid_probability(n: int, steps: int) -> Fraction:
  """Exact P(valid) of ancestral decoding with `steps` equal steps on an exact denoiser.

  W_K(0) = 1 and W_k(r) = sum_g Binom(g; r, 1/(K-k)) r!/((r-g)! r^g) W_{k+1}(r-g): a step
  that writes g of the r masked positions draws each uniformly from the r unused items,
  and they are distinct with probability r!/((r-g)! r^g); a repeat never goes away.
  """
  _check_sizes(n, steps)
  value = {r: Fraction(int(r == 0)) for r in range(n + 1)}  # after the last step
  for law in reversed(list(_step_laws(n, steps))):
    value = {r: sum((law(r, g) * Fraction(math.perm(r, g), r**g if g else 1) * value[r - g]
                     for g in range(r + 1)), Fraction(0)) for r in range(n + 1)}
  return value[n]


def ancestral_expected_total_correlation(n: int, steps: int) -> float:
  """E[sum over steps of the written group's TC] in nats, along the ideal trajectory
  (every step's state valid): E[-log P(valid | group sizes)] >= -log P(valid)."""
  _check_sizes(n, steps)
  value = {r: 0.0 for r in range(n + 1)}
  for law in reversed(list(_step_laws(n, steps))):
    value = {r: sum(float(law(r, g)) * (group_total_correlation(r, g) + value[r - g])
                    for g in range(r + 1)) for r in range(n + 1)}
  return value[n]


def _check_sizes(n: int, steps: int) -> None:
  if not (isinstance(n, int) and n >= 1):
    raise ValueError(f"n={n!r} must be a positive integer.")
  if not (isinstance(steps, int) and steps >= 1):
    raise ValueError(f"steps={steps!r} must be a positive integer.")


@functools.lru_cache(maxsize=4)
def support(params: Params = DEFAULT) -> exact.Support:
  """The law enumerated: the n! permutations, uniform (n <= 8 fits)."""
  count = math.factorial(params.n)
  exact.check_enumerable("permutation", count, params.n, params.n)
  perms = np.array(list(itertools.permutations(range(params.n))), np.int32)
  return exact.Support.of_sequences(perms, np.full(count, 1.0 / count), params.n)


def bind(**params_kwargs) -> Task:
  """This task with other parameters (`Params(**params_kwargs)`) as a Task value."""
  fields = {f.name for f in dataclasses.fields(Params)}
  unknown = sorted(set(params_kwargs) - fields)
  if unknown:
    raise ValueError(f"task_kwargs={params_kwargs!r}: unknown {unknown}; permutation takes "
                     f"{sorted(fields)}.")
  return make_task(Params(**params_kwargs))


@functools.lru_cache(maxsize=16)
def make_task(params: Params = DEFAULT) -> Task:
  """The Task value of these parameters (one per parameters: its functions compile once)."""
  bound = lambda fn: functools.partial(fn, params=params)
  return Task(name="permutation", length=params.length, vocab_size=params.vocab_size,
              mask_id=params.mask_id, sample_data=bound(sample_data), decode=bound(decode),
              sample_metrics=bound(sample_metrics), checks=bound(checks),
              is_impossible=bound(is_impossible), exact_denoiser=make_exact_denoiser(params),
              support=bound(support), params=params)
