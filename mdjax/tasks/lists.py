"""List tasks in ParallelBench's spirit: copy, replace and shuffle a prompt list.

Layout (L = 2n): positions 0..n-1 the prompt, n distinct items drawn uniformly (ordered)
from m; positions n..2n-1 the output. Ids 0..m-1 items, MARKER = m (the replacement
item), mask m + 1.

- `copy` (`list_copy`): the output is the prompt. Given the prompt it is determined: no
  dependence is left between output positions, and every sampler is exact.
- `replace` (`list_replace`): one uniformly chosen position of the prompt is replaced by
  MARKER. Valid: exactly one MARKER and the other positions copied.
- `shuffle` (`list_shuffle`): the output is a uniformly random ordering of the prompt's
  items. Valid: a permutation of the prompt.

The exact denoisers hold for any partial state (masked prompt positions too), in closed
form: copy ties each index's two positions; shuffle's item set is uniform on the n-subsets
holding the visible items, with independent uniform orderings for prompt and output;
replace mixes over the replaced index j, each j weighted by the orderings of the unknown
items it leaves, (m - k_j)! / (m - n)!. At an impossible state the masked positions get
the all-masked marginals. `list_probs(kind_code, ...)` takes the kind as a traced value,
so one compiled sampler serves the three kinds.

Closed forms for ancestral decoding of the output with K equal steps, the prompt given
(docs/parallelism.md): copy 1; shuffle that of `permutation` with n items; replace
`ancestral_valid_probability("replace", n, K)`. In one step: n!/n^n and ((n-1)/n)^(n-1).
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
from mdjax.tasks import permutation
from mdjax.tasks.base import Task

KINDS = ("copy", "replace", "shuffle")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
  """Task parameters (hashable: static under jit)."""

  kind: str = "shuffle"
  n: int = 4  # list length
  m: int = 8  # items to draw from

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"kind={self.kind!r} must be one of {KINDS}.")
    if not (isinstance(self.n, int) and not isinstance(self.n, bool) and 2 <= self.n <= 16):
      raise ValueError(f"n={self.n!r} must be an integer in [2, 16].")
    if not (isinstance(self.m, int) and not isinstance(self.m, bool)
            and self.n + (self.kind == "replace") <= self.m <= 64):
      raise ValueError(f"m={self.m!r} must be an integer in [n, 64] (n={self.n}).")

  @property
  def length(self) -> int:
    return 2 * self.n

  @property
  def marker(self) -> int:
    return self.m

  @property
  def vocab_size(self) -> int:
    return self.m + 1

  @property
  def mask_id(self) -> int:
    return self.m + 1

  @property
  def prompt_length(self) -> int:
    return self.n

  @property
  def kind_code(self) -> int:
    return KINDS.index(self.kind)


@functools.partial(jax.jit, static_argnames=("batch", "params"))
def sample_data(key: jax.Array, batch: int, params: Params = Params()) -> jax.Array:
  """Draws `batch` (prompt, output) rows (tokens_BxL)."""
  n, m = params.n, params.m
  k_items, k_order, k_index = jax.random.split(key, 3)
  prompt_BxN = jax.vmap(lambda k: jax.random.permutation(k, m)[:n])(
      jax.random.split(k_items, batch))
  if params.kind == "copy":
    out_BxN = prompt_BxN
  elif params.kind == "shuffle":
    order_BxN = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(k_order, batch))
    out_BxN = jnp.take_along_axis(prompt_BxN, order_BxN, 1)
  else:
    j_B = jax.random.randint(k_index, (batch,), 0, n)
    out_BxN = jnp.where(jnp.arange(n)[None] == j_B[:, None], params.marker, prompt_BxN)
  return jnp.concatenate([prompt_BxN, out_BxN], 1).astype(jnp.int32)


def _items_onehot(x, m):
  return jax.nn.one_hot(x, m, dtype=jnp.float32)  # the marker and mask ids drop out


def _copy(a, o, n, m, mask):
  """Per-index law (B x n x m) of copy, and possible_B."""
  a_vis, o_vis = a != mask, o != mask
  known = a_vis | o_vis
  value = jnp.where(a_vis, a, o)
  conflict = jnp.any(a_vis & o_vis & (a != o), -1)
  counts = (_items_onehot(value, m) * known[..., None]).sum(1)
  marker = jnp.any((a_vis & (a >= m)) | (o_vis & (o >= m)), -1)
  possible = ~conflict & ~marker & jnp.all(counts <= 1, -1)
  unused = jnp.maximum(1.0 - counts, 0.0)
  uniform = unused / jnp.maximum(unused.sum(-1, keepdims=True), 1.0)
  law = jnp.where(known[..., None], _items_onehot(value, m), uniform[:, None])
  return law, law, possible


def _shuffle(a, o, n, m, mask):
  """Laws of masked prompt and output positions (B x m each), and possible_B."""
  a_vis, o_vis = a != mask, o != mask
  a_cnt = (_items_onehot(a, m) * a_vis[..., None]).sum(1)
  o_cnt = (_items_onehot(o, m) * o_vis[..., None]).sum(1)
  in_u = (a_cnt + o_cnt) > 0
  u = in_u.sum(-1, keepdims=True).astype(jnp.float32)
  marker = jnp.any((a_vis & (a >= m)) | (o_vis & (o >= m)), -1)
  possible = ~marker & jnp.all(a_cnt <= 1, -1) & jnp.all(o_cnt <= 1, -1) & (u[:, 0] <= n)

  def law(cnt, k):
    free = jnp.maximum(n - k, 1.0)  # masked positions of this side (>= 1 where a law is read)
    outside = jnp.where(m - u > 0, (n - u) / jnp.maximum(m - u, 1.0), 0.0) / free
    return jnp.where(cnt > 0, 0.0, jnp.where(in_u, 1.0 / free, outside))

  k_a = a_vis.sum(-1, keepdims=True).astype(jnp.float32)
  k_o = o_vis.sum(-1, keepdims=True).astype(jnp.float32)
  a_law, o_law = law(a_cnt, k_a), law(o_cnt, k_o)
  return (jnp.broadcast_to(a_law[:, None], a.shape + (m,)),
          jnp.broadcast_to(o_law[:, None], o.shape + (m,)), possible)


def _replace(a, o, n, m, mask):
  """Laws (B x n x (m+1)) of prompt and output positions, a mixture over the replaced
  index j (a J axis), and possible_B."""
  a_vis, o_vis = a != mask, o != mask
  idx = jnp.arange(n)
  other_JxN = idx[None] != idx[:, None]
  a_items_ok = jnp.all(~a_vis | (a < m), -1)
  # Index j: o_j is MARKER, every other visible output an item.
  o_ok_BxJ = jnp.all(~o_vis[:, None] | jnp.where(other_JxN[None], o[:, None] < m,
                                                   o[:, None] == m), -1)
  known_BxJxN = a_vis[:, None] | (other_JxN[None] & o_vis[:, None])
  value_BxNxM = _items_onehot(jnp.where(a_vis, a, o), m)
  conflict_BxJ = jnp.any(other_JxN[None] & (a_vis & o_vis & (a != o))[:, None], -1)
  counts_BxJxM = jnp.einsum("bjn,bnm->bjm", known_BxJxN.astype(jnp.float32), value_BxNxM)
  k_BxJ = known_BxJxN.sum(-1).astype(jnp.float32)
  ok_BxJ = a_items_ok[:, None] & o_ok_BxJ & ~conflict_BxJ & jnp.all(counts_BxJxM <= 1, -1)
  # Orderings of the unknown items: (m - k)! / (m - n)!, in logs.
  logw_BxJ = jnp.where(ok_BxJ, jax.lax.lgamma(m - k_BxJ + 1.0) - math.lgamma(m - n + 1.0),
                       -jnp.inf)
  possible = ok_BxJ.any(-1)
  post_BxJ = jax.nn.softmax(jnp.where(possible[:, None], logw_BxJ, 0.0), -1)
  unused_BxJxM = jnp.maximum(1.0 - counts_BxJxM, 0.0)
  uniform_BxJxM = unused_BxJxM / jnp.maximum(unused_BxJxM.sum(-1, keepdims=True), 1.0)
  law_BxJxNxM = jnp.where(known_BxJxN[..., None], value_BxNxM[:, None],
                          uniform_BxJxM[:, :, None])
  a_law = jnp.einsum("bj,bjnm->bnm", post_BxJ, law_BxJxNxM)
  o_items = jnp.einsum("bj,bjnm->bnm", post_BxJ, law_BxJxNxM * other_JxN[None, :, :, None])
  return (jnp.concatenate([a_law, jnp.zeros(a_law.shape[:2] + (1,))], -1),
          jnp.concatenate([o_items, post_BxJ[..., None]], -1), possible)


def list_probs(kind_code, tokens_BxL: jax.Array, n: int, m: int) -> tuple[jax.Array, jax.Array]:
  """Exact conditionals (B x L x (m+1)) and possible_B of the kind `KINDS[kind_code]`;
  `kind_code` may be traced (every kind is computed, one is kept)."""
  mask = m + 1
  tokens_BxL = jnp.asarray(tokens_BxL)
  a, o = tokens_BxL[:, :n], tokens_BxL[:, n:]
  pad = lambda x: jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,))], -1)
  ids_ok = jnp.all((tokens_BxL >= 0) & (tokens_BxL <= mask), -1)
  laws = []
  for fn in (_copy, _replace, _shuffle):
    a_law, o_law, possible = fn(a, o, n, m, mask)
    if a_law.shape[-1] == m:
      a_law, o_law = pad(a_law), pad(o_law)
    laws.append((jnp.concatenate([a_law, o_law], 1), possible & ids_ok))
  code = jnp.asarray(kind_code)
  return (jnp.stack([p for p, _ in laws])[code], jnp.stack([q for _, q in laws])[code])


@functools.lru_cache(maxsize=32)
def _priors(n: int, m: int) -> np.ndarray:
  """The all-masked marginals of the three kinds (3 x L x V), computed once (call it
  outside any trace: the denoisers below take it as a constant)."""
  probs = jax.jit(jax.vmap(list_probs, (0, None, None, None)), static_argnums=(2, 3))
  empty = jnp.full((1, 2 * n), m + 1, jnp.int32)
  return np.asarray(probs(jnp.arange(3), empty, n, m)[0][:, 0])


@functools.partial(jax.jit, static_argnames=("n", "m"))
def _exact_probs(kind_code, tokens_BxL, priors_3xLxV, n: int, m: int):
  probs, possible_B = list_probs(kind_code, tokens_BxL, n, m)
  probs = jnp.where(possible_B[:, None, None], probs, priors_3xLxV[kind_code][None])
  visible = tokens_BxL != m + 1
  onehot = jax.nn.one_hot(jnp.minimum(tokens_BxL, m), m + 1)
  return jnp.where(visible[..., None], onehot, probs), possible_B


def exact_probs(tokens_BxL, params: Params = Params()) -> tuple[jax.Array, jax.Array]:
  """Exact conditionals (B x L x V) and possible_B: visible positions get a one-hot of
  their token, masked ones of an impossible row the all-masked marginals."""
  return _exact_probs(params.kind_code, jnp.asarray(tokens_BxL), _priors(params.n, params.m),
                      params.n, params.m)


def shared_denoiser(n: int, m: int):
  """The exact denoiser of every kind at (n, m), the kind code as its (traced) params: one
  compiled sampler per spec serves copy, replace and shuffle."""
  priors = _priors(n, m)

  def denoiser(kind_code, tokens_BxL, t_B):
    del t_B
    return jnp.log(_exact_probs(kind_code, jnp.asarray(tokens_BxL), priors, n, m)[0])

  return denoiser


def make_exact_denoiser(params: Params = Params()):
  """The denoiser contract for these parameters (its params and t_B are unused)."""
  shared = shared_denoiser(params.n, params.m)

  def exact_denoiser(unused_params, tokens_BxL, t_B):
    del unused_params
    return shared(params.kind_code, tokens_BxL, t_B)

  return exact_denoiser


@functools.lru_cache(maxsize=4)
def support(params: Params = Params()) -> exact.Support:
  """The law enumerated: every ordered prompt of n distinct items from m, with each output of
  the kind (copy: 1, replace: n, shuffle: n!), uniform."""
  n, m = params.n, params.m
  outputs = {"copy": 1, "replace": n, "shuffle": math.factorial(n)}[params.kind]
  count = math.perm(m, n) * outputs
  exact.check_enumerable(f"list_{params.kind}", count, params.length, params.vocab_size)
  prompts_PxN = np.array(list(itertools.permutations(range(m), n)), np.int32)
  if params.kind == "copy":
    out_PxKxN = prompts_PxN[:, None]
  elif params.kind == "shuffle":
    orders_KxN = np.array(list(itertools.permutations(range(n))))
    out_PxKxN = prompts_PxN[:, orders_KxN]
  else:
    at_KxN = np.eye(n, dtype=bool)
    out_PxKxN = np.where(at_KxN[None], params.marker, prompts_PxN[:, None])
  rows = np.concatenate([np.broadcast_to(prompts_PxN[:, None], out_PxKxN.shape), out_PxKxN], -1)
  return exact.Support.of_sequences(rows.reshape(count, params.length), np.full(count, 1.0 / count),
                                    params.vocab_size)


def is_impossible(tokens_BxL, params: Params = Params()):
  return ~exact_probs(tokens_BxL, params)[1]


def checks(tokens_BxL, params: Params = Params()) -> dict[str, np.ndarray]:
  """valid: the prompt is n distinct items and the output is the kind's function of it
  (numpy bool_B)."""
  x = np.asarray(tokens_BxL)
  n, m = params.n, params.m
  a, o = x[:, :n], x[:, n:]
  sorted_a = np.sort(a, 1)
  prompt_ok = np.all((a >= 0) & (a < m), 1) & np.all(sorted_a[:, 1:] != sorted_a[:, :-1], 1)
  if params.kind == "copy":
    out_ok = np.all(o == a, 1)
  elif params.kind == "shuffle":
    out_ok = np.all(np.sort(o, 1) == sorted_a, 1)
  else:
    is_marker = o == params.marker
    out_ok = (is_marker.sum(1) == 1) & np.all(is_marker | (o == a), 1)
  return {"valid": prompt_ok & out_ok}


def sample_metrics(tokens_BxL, params: Params = Params()) -> dict[str, float]:
  return {"valid": float(checks(tokens_BxL, params)["valid"].mean())}


def decode(tokens_L, params: Params = Params()) -> str:
  name = lambda t: "?" if t == params.mask_id else "X" if t == params.marker else str(t)
  cells = [name(int(t)) for t in tokens_L]
  return f"{' '.join(cells[:params.n])} -> {' '.join(cells[params.n:])}"


def ancestral_valid_probability(kind: str, n: int, steps: int) -> Fraction:
  """Exact P(valid) of ancestral decoding of the output (prompt given) with `steps` equal
  steps on an exact denoiser (docs/parallelism.md)."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r} must be one of {KINDS}.")
  if not (isinstance(steps, int) and steps >= 1):
    raise ValueError(f"steps={steps!r} must be a positive integer.")
  if kind == "copy":
    return Fraction(1)
  if kind == "shuffle":
    return permutation.ancestral_valid_probability(n, steps)
  # replace: with r positions masked and no MARKER written yet, each is MARKER w.p. 1/r
  # (else its prompt item); a step writing g of them must write at most one MARKER, and
  # once it is written the rest is determined. V(r) after the last step is 0 (no MARKER).
  value = {r: Fraction(0) for r in range(n + 1)}
  for k in reversed(range(steps)):
    p = Fraction(1, steps - k)
    new = {0: Fraction(0)}
    for r in range(1, n + 1):
      q = Fraction(1, r)
      new[r] = sum((math.comb(r, g) * p**g * (1 - p)**(r - g)
                    * ((1 - q)**g * value[r - g] + g * q * (1 - q)**(g - 1) if g else value[r])
                    for g in range(r + 1)), Fraction(0))
    value = new
  return value[n]


class Kind:
  """One kind as a registry entry (`tasks.get("list_shuffle", {"n": 4})`)."""

  def __init__(self, kind: str):
    self.kind = kind

  def bind(self, **params_kwargs) -> Task:
    fields = {f.name for f in dataclasses.fields(Params)} - {"kind"}
    unknown = sorted(set(params_kwargs) - fields)
    if unknown:
      raise ValueError(f"task_kwargs={params_kwargs!r}: unknown {unknown}; list_{self.kind} "
                       f"takes {sorted(fields)}.")
    return make_task(Params(kind=self.kind, **params_kwargs))


copy_task, replace_task, shuffle_task = (Kind(k) for k in KINDS)


def bind(**params_kwargs) -> Task:
  """This task with other parameters (`Params(**params_kwargs)`) as a Task value."""
  return make_task(Params(**params_kwargs))


@functools.lru_cache(maxsize=32)
def make_task(params: Params = Params()) -> Task:
  """The Task value of these parameters (one per parameters: its functions compile once)."""
  bound = lambda fn: functools.partial(fn, params=params)
  return Task(name=f"list_{params.kind}", length=params.length, vocab_size=params.vocab_size,
              mask_id=params.mask_id, sample_data=bound(sample_data), decode=bound(decode),
              sample_metrics=bound(sample_metrics), checks=bound(checks),
              is_impossible=bound(is_impossible), exact_denoiser=make_exact_denoiser(params),
              support=bound(support), params=params)
