"""ScanAndAdd: a read head sweeps once over n values while following commands.

`add` adds the value under the head to an accumulator; `right` moves the head
one place right. There are n values uniform on {0..9}, A add commands and
n - 1 right commands, every arrangement of the commands equally likely. A
command's token id is drawn uniformly among the ids {0..M} of its kind (even
ids add, odd ids move right): M = 1 gives one id per kind, M = 9 five
synonyms each. Values are added mod m; the accumulator is the sum, written as
three base-10 digits (hundreds, tens, ones).

Layout (defaults n = 9, A = 2, L = 2n + A + 5 = 25): 0 VALS, 1..n values,
n+1 ANS, three answer digits, OPS, then the n + A - 1 commands. Vocabulary:
0-9 digits and command ids, VALS 10, OPS 11, ANS 12, PAD 13, MASK 14.

The exact denoiser enumerates the C(n + A - 1, A) command arrangements for
A = 2 (the read heads h1 <= h2 of the two adds) jointly with the two values
they read, so every conditional is exact. At a state the data can never
produce, it returns the all-masked marginals at the masked positions (see
`is_impossible` to flag such rows).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.noise import exact
from mdjax.tasks.base import Task

VALS, OPS, ANS, PAD, MASK_ID = 10, 11, 12, 13, 14
VOCAB_SIZE = 14  # real ids; the mask id is 14
NUM_DIGITS = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
  """Task parameters (hashable: static under jit)."""

  n: int = 9  # number of values
  num_adds: int = 2  # A
  max_command_id: int = 1  # M
  modulus: int = 10  # m: each value is added mod m

  def __post_init__(self):
    if self.num_adds != 2:
      raise ValueError(f"num_adds={self.num_adds!r}: the exact denoiser supports A = 2.")
    if not 1 <= self.n <= 9:
      raise ValueError(f"n={self.n!r} must lie in [1, 9] (value ids are digits).")
    if not 1 <= self.max_command_id <= 9:
      raise ValueError(f"max_command_id={self.max_command_id!r} must lie in [1, 9].")
    if not 1 <= self.modulus <= 10:
      raise ValueError(f"modulus={self.modulus!r} must lie in [1, 10].")

  @property
  def num_commands(self) -> int:
    return self.n + self.num_adds - 1

  @property
  def length(self) -> int:
    return 2 * self.n + self.num_adds + 5

  @property
  def value_pos(self) -> np.ndarray:
    return np.arange(1, self.n + 1)

  @property
  def ans_marker_pos(self) -> int:
    return self.n + 1

  @property
  def answer_pos(self) -> np.ndarray:
    return np.arange(self.n + 2, self.n + 5)

  @property
  def ops_marker_pos(self) -> int:
    return self.n + 5

  @property
  def command_pos(self) -> np.ndarray:
    return np.arange(self.n + 6, self.length)

  @property
  def add_ids(self) -> np.ndarray:
    return np.arange(0, self.max_command_id + 1, 2)

  @property
  def right_ids(self) -> np.ndarray:
    return np.arange(1, self.max_command_id + 1, 2)

  @property
  def max_answer(self) -> int:
    return self.num_adds * (self.modulus - 1)


DEFAULT = Params()
LENGTH = DEFAULT.length


def arrangements(params: Params) -> np.ndarray:
  """Every arrangement as the (c1, c2) command indices of the two adds."""
  return np.array(list(itertools.combinations(range(params.num_commands), 2)), np.int32)


def answer_digits(total):
  """Hundreds, tens and ones of a non-negative integer (numpy or jax)."""
  return total // 100 % 10, total // 10 % 10, total % 10


@functools.partial(jax.jit, static_argnames=("batch", "params"))
def sample_data(key: jax.Array, batch: int, params: Params = DEFAULT) -> jax.Array:
  """Draws `batch` sequences from the data law."""
  k_val, k_arr, k_id = jax.random.split(key, 3)
  values_BxN = jax.random.randint(k_val, (batch, params.n), 0, NUM_DIGITS)
  arr = jnp.asarray(arrangements(params))
  c_B2 = arr[jax.random.randint(k_arr, (batch,), 0, len(arr))]
  cmd = jnp.arange(params.num_commands)
  is_add_BxC = (cmd[None] == c_B2[:, :1]) | (cmd[None] == c_B2[:, 1:])
  add_ids, right_ids = jnp.asarray(params.add_ids), jnp.asarray(params.right_ids)
  u = jax.random.uniform(k_id, (batch, params.num_commands))
  ids_BxC = jnp.where(is_add_BxC, add_ids[(u * len(add_ids)).astype(jnp.int32)],
                      right_ids[(u * len(right_ids)).astype(jnp.int32)])
  heads_B2 = c_B2 - jnp.arange(2)[None]  # rights before each add
  read_B2 = jnp.take_along_axis(values_BxN, heads_B2, axis=1) % params.modulus
  total_B = read_B2.sum(-1)
  digits = jnp.stack(answer_digits(total_B), -1)
  col = lambda v: jnp.full((batch, 1), v, jnp.int32)
  return jnp.concatenate([col(VALS), values_BxN, col(ANS), digits, col(OPS), ids_BxC],
                         axis=1).astype(jnp.int32)


def empty_canvas(batch: int, params: Params = DEFAULT) -> jax.Array:
  return jnp.full((batch, params.length), MASK_ID, jnp.int32)


def write_order_fields(params: Params = DEFAULT) -> dict[str, tuple[int, ...]]:
  """The fields of the write-order notation: markers V O A, values v, commands o,
  answer digits h t 1 (hundreds, tens, ones).

  A sampler spec from notation: `sampling.parse_write_order("[VOA][v×9]o×10[ht1]",
  write_order_fields(params), **spec_kwargs)`.
  """
  h, t, ones = (int(i) for i in params.answer_pos)
  return {"V": (0,), "O": (params.ops_marker_pos,), "A": (params.ans_marker_pos,),
          "v": tuple(int(i) for i in params.value_pos),
          "o": tuple(int(i) for i in params.command_pos), "h": (h,), "t": (t,), "1": (ones,)}


def bind(**params_kwargs) -> Task:
  """This task with other parameters (`Params(**params_kwargs)`) as a Task value."""
  fields = {f.name for f in dataclasses.fields(Params)}
  unknown = sorted(set(params_kwargs) - fields)
  if unknown:
    raise ValueError(f"task_kwargs={params_kwargs!r}: unknown {unknown}; scan_and_add takes "
                     f"{sorted(fields)}.")
  return make_task(Params(**params_kwargs))


@functools.lru_cache(maxsize=16)
def make_task(params: Params = DEFAULT) -> Task:
  """The Task value of these parameters (one per parameters: its functions compile once)."""
  bound = lambda fn: functools.partial(fn, params=params)
  denoiser = exact_denoiser if params == DEFAULT else make_exact_denoiser(params)
  return Task(name="scan_and_add", length=params.length, vocab_size=VOCAB_SIZE, mask_id=MASK_ID,
              sample_data=bound(sample_data), decode=bound(decode),
              sample_metrics=bound(sample_metrics), checks=bound(checks),
              is_impossible=bound(is_impossible), exact_denoiser=denoiser, support=bound(support),
              params=params)


# ----------------------------------------------------------------------------
# The exact denoiser.
# ----------------------------------------------------------------------------


def _posterior(tokens_BxL: jax.Array, params: Params):
  """Unnormalised joint over (arrangement a, value x read first, value y second).

  Returns (P_BxAxXxY, prior_val_BxNxX, consistent_B), where prior_val is each
  value position's law given its own visibility (one-hot or uniform) and
  consistent_B says whether the visible markers and ids are possible at all.
  """
  p = params
  arr = jnp.asarray(arrangements(p))  # A x 2
  vals = tokens_BxL[:, p.value_pos]
  digits_vis = tokens_BxL[:, p.answer_pos]
  cmds = tokens_BxL[:, p.command_pos]
  x = jnp.arange(NUM_DIGITS)
  val_visible = vals != MASK_ID
  prior_val = jnp.where(val_visible[..., None], (vals[..., None] == x).astype(jnp.float32),
                        1.0 / NUM_DIGITS)
  # Visible markers must be in place; visible fields must hold allowed ids.
  markers_ok = jnp.ones(tokens_BxL.shape[:1], bool)
  for pos, marker in ((0, VALS), (p.ans_marker_pos, ANS), (p.ops_marker_pos, OPS)):
    markers_ok &= (tokens_BxL[:, pos] == MASK_ID) | (tokens_BxL[:, pos] == marker)
  vals_ok = jnp.all(~val_visible | (vals < NUM_DIGITS), -1)
  cmd_visible = cmds != MASK_ID
  cmd_ok = jnp.all(~cmd_visible | (cmds <= p.max_command_id), -1)
  # Arrangement consistency: a visible id fixes that command's kind.
  c = jnp.arange(p.num_commands)
  is_add_AxC = (c[None] == arr[:, :1]) | (c[None] == arr[:, 1:])
  visible_add_BxC = cmds % 2 == 0
  arr_ok_BxA = jnp.all(~cmd_visible[:, None, :] | (is_add_AxC[None] == visible_add_BxC[:, None, :]),
                       -1)
  # Answer consistency for every total 0..max_answer.
  totals = jnp.arange(p.max_answer + 1)
  total_digits = jnp.stack(answer_digits(totals), -1)  # S x 3
  digit_visible = digits_vis != MASK_ID
  total_ok_BxS = jnp.all(~digit_visible[:, None, :] | (total_digits[None] == digits_vis[:, None, :]),
                         -1)
  # Joint over (a, x, y): the heads read values x (head h1) and y (head h2).
  heads = arr - jnp.arange(2)[None]  # A x 2, h1 <= h2
  prior1_BxAxX = prior_val[:, heads[:, 0]]
  prior2_BxAxX = prior_val[:, heads[:, 1]]
  same_A = heads[:, 0] == heads[:, 1]
  eye = jnp.eye(NUM_DIGITS)
  pair_BxAxXxY = jnp.where(same_A[None, :, None, None],
                           prior1_BxAxX[..., None] * eye[None, None],
                           prior1_BxAxX[..., None] * prior2_BxAxX[:, :, None, :])
  total_XxY = x[:, None] % p.modulus + x[None, :] % p.modulus
  total_weight_BxXxY = total_ok_BxS[:, total_XxY].astype(jnp.float32)
  joint = pair_BxAxXxY * total_weight_BxXxY[:, None] * arr_ok_BxA[..., None, None]
  consistent_B = markers_ok & vals_ok & cmd_ok
  return joint, prior_val, consistent_B, is_add_AxC, heads, total_XxY


def _marginals(tokens_BxL: jax.Array, params: Params) -> tuple[jax.Array, jax.Array]:
  """Exact p(x_i | visible) at every position (B x L x V) and a possible flag."""
  p = params
  joint, prior_val, consistent_B, is_add_AxC, heads, total_XxY = _posterior(tokens_BxL, p)
  z_B = joint.sum((1, 2, 3))
  possible_B = consistent_B & (z_B > 0)
  post = joint / jnp.where(z_B > 0, z_B, 1.0)[:, None, None, None]
  batch = tokens_BxL.shape[0]
  probs = jnp.zeros((batch, p.length, VOCAB_SIZE), jnp.float32)
  # Markers.
  for pos, marker in ((0, VALS), (p.ans_marker_pos, ANS), (p.ops_marker_pos, OPS)):
    probs = probs.at[:, pos, marker].set(1.0)
  # Answer digits: the law of the total.
  p_total_BxS = jnp.zeros((batch, p.max_answer + 1)).at[:, total_XxY.reshape(-1)].add(
      post.sum(1).reshape(batch, -1))
  for k, digit_S in enumerate(answer_digits(jnp.arange(p.max_answer + 1))):
    p_digit = jnp.zeros((batch, NUM_DIGITS)).at[:, digit_S].add(p_total_BxS)
    probs = probs.at[:, p.answer_pos[k], :NUM_DIGITS].set(p_digit)
  # Commands: P(add at c), spread uniformly over the synonyms of each kind.
  p_arr_BxA = post.sum((2, 3))
  p_add_BxC = p_arr_BxA @ is_add_AxC.astype(jnp.float32)
  add_ids, right_ids = p.add_ids, p.right_ids
  cmd_probs = jnp.zeros((batch, p.num_commands, VOCAB_SIZE))
  cmd_probs = cmd_probs.at[:, :, add_ids].set(p_add_BxC[..., None] / len(add_ids))
  cmd_probs = cmd_probs.at[:, :, right_ids].set((1 - p_add_BxC[..., None]) / len(right_ids))
  probs = probs.at[:, p.command_pos].set(cmd_probs)
  # Values: read by head 1, by head 2 (h2 != h1), or by no head (its prior).
  n = p.n
  onehot1_AxN = jax.nn.one_hot(heads[:, 0], n)
  onehot2_AxN = jax.nn.one_hot(heads[:, 1], n) * (heads[:, 1] != heads[:, 0])[:, None]
  read1 = jnp.einsum("baxy,an->bnx", post, onehot1_AxN)
  read2 = jnp.einsum("baxy,an->bny", post, onehot2_AxN)
  p_unread_BxN = 1.0 - p_arr_BxA @ jnp.clip(onehot1_AxN + onehot2_AxN, 0, 1)
  val_probs = read1 + read2 + p_unread_BxN[..., None] * prior_val
  probs = probs.at[:, p.value_pos, :NUM_DIGITS].set(val_probs)
  # Sums of float32 terms can land a hair below 0 where the truth is 0.
  return jnp.clip(probs, 0.0, 1.0), possible_B


@functools.partial(jax.jit, static_argnames="params")
def exact_probs(tokens_BxL: jax.Array, params: Params = DEFAULT) -> tuple[jax.Array, jax.Array]:
  """Exact conditionals at masked positions (B x L x V) and `possible_B`.

  Visible positions get a one-hot of their token. Where the state is
  impossible (possible_B False) the masked positions get the all-masked
  marginals.
  """
  probs, possible_B = _marginals(tokens_BxL, params)
  prior, _ = _marginals(jnp.full((1, params.length), MASK_ID, tokens_BxL.dtype), params)
  probs = jnp.where(possible_B[:, None, None], probs, prior)
  visible = tokens_BxL != MASK_ID
  onehot = jax.nn.one_hot(jnp.minimum(tokens_BxL, VOCAB_SIZE - 1), VOCAB_SIZE)
  return jnp.where(visible[..., None], onehot, probs), possible_B


def make_exact_denoiser(params: Params = DEFAULT):
  """The denoiser contract for these task parameters (params arg unused)."""

  def exact_denoiser(unused_params, tokens_BxL, t_B):
    del unused_params, t_B
    probs, _ = exact_probs(tokens_BxL, params)
    return jnp.log(probs)

  return exact_denoiser


exact_denoiser = make_exact_denoiser(DEFAULT)


@functools.lru_cache(maxsize=4)
def support(params: Params = DEFAULT) -> exact.Support:
  """The law enumerated as a mixture of product laws: one component per (arrangement, value x
  read by the first add, value y by the second; x = y where both adds read one head), with
  the answer its digits, the other values uniform digits and each command uniform over its
  kind's ids."""
  p = params
  arr_Ax2 = arrangements(p)
  heads_Ax2 = arr_Ax2 - np.arange(2)[None]
  x_K, y_K = np.divmod(np.arange(NUM_DIGITS**2), NUM_DIGITS)
  a_S, k_S = np.divmod(np.arange(len(arr_Ax2) * NUM_DIGITS**2), NUM_DIGITS**2)
  h1_S, h2_S = heads_Ax2[a_S, 0], heads_Ax2[a_S, 1]
  keep_S = (h1_S != h2_S) | (x_K[k_S] == y_K[k_S])
  a_S, x_S, y_S = a_S[keep_S], x_K[k_S][keep_S], y_K[k_S][keep_S]
  h1_S, h2_S = h1_S[keep_S], h2_S[keep_S]
  count = len(a_S)
  exact.check_enumerable("scan_and_add", count, p.length, VOCAB_SIZE)
  eye = np.eye(VOCAB_SIZE, dtype=np.float32)
  laws = np.zeros((count, p.length, VOCAB_SIZE), np.float32)
  for pos, marker in ((0, VALS), (p.ans_marker_pos, ANS), (p.ops_marker_pos, OPS)):
    laws[:, pos] = eye[marker]
  uniform_digit_V = np.pad(np.full(NUM_DIGITS, 1.0 / NUM_DIGITS, np.float32),
                           (0, VOCAB_SIZE - NUM_DIGITS))
  values_SxNxV = np.broadcast_to(uniform_digit_V, (count, p.n, VOCAB_SIZE)).copy()
  rows = np.arange(count)
  values_SxNxV[rows, h1_S] = eye[x_S]
  values_SxNxV[rows, h2_S] = eye[y_S]
  laws[:, p.value_pos] = values_SxNxV
  for pos, digit_S in zip(p.answer_pos, answer_digits(x_S % p.modulus + y_S % p.modulus)):
    laws[:, pos] = eye[digit_S]
  add_V = eye[p.add_ids].mean(0)
  right_V = eye[p.right_ids].mean(0)
  is_add_SxC = np.zeros((count, p.num_commands), bool)
  is_add_SxC[rows, arr_Ax2[a_S, 0]] = True
  is_add_SxC[rows, arr_Ax2[a_S, 1]] = True
  laws[:, p.command_pos] = np.where(is_add_SxC[..., None], add_V, right_V)
  probs_S = np.where(h1_S == h2_S, 1.0 / NUM_DIGITS, 1.0 / NUM_DIGITS**2) / len(arr_Ax2)
  return exact.Support(laws, probs_S.astype(np.float32))


def is_impossible(tokens_BxL: jax.Array, params: Params = DEFAULT) -> jax.Array:
  """True for rows the data can never produce (probability zero)."""
  return ~exact_probs(jnp.asarray(tokens_BxL), params)[1]


# ----------------------------------------------------------------------------
# Checks and exact analysis.
# ----------------------------------------------------------------------------


def decode(tokens_L, params: Params = DEFAULT) -> str:
  names = {VALS: "VALS", OPS: "OPS", ANS: "ANS", PAD: "PAD", MASK_ID: "?"}
  return " ".join(names.get(int(t), str(int(t))) for t in tokens_L)


def checks(tokens_BxL, params: Params = DEFAULT) -> dict[str, np.ndarray]:
  """Per-sample checks: well_formed, correct, add_count_valid (numpy bool_B)."""
  p = params
  x = np.asarray(tokens_BxL)
  markers = (x[:, 0] == VALS) & (x[:, p.ans_marker_pos] == ANS) & (x[:, p.ops_marker_pos] == OPS)
  values, digits, cmds = x[:, p.value_pos], x[:, p.answer_pos], x[:, p.command_pos]
  well_formed = (markers & np.all(values < NUM_DIGITS, 1) & np.all(digits < NUM_DIGITS, 1)
                 & np.all(cmds <= p.max_command_id, 1))
  is_add = (cmds % 2 == 0) & well_formed[:, None]
  # Replay the commands, whatever their number of adds (right moves mod n).
  rights_before = np.cumsum(~is_add, axis=1) - ~is_add
  heads = rights_before % p.n
  read = np.take_along_axis(values % p.modulus, heads, axis=1)
  total = np.where(is_add, read, 0).sum(1)
  decoded = digits[:, 0] * 100 + digits[:, 1] * 10 + digits[:, 2]
  return {
      "well_formed": well_formed,
      "correct": well_formed & (decoded == total),
      "add_count_valid": well_formed & (is_add.sum(1) == p.num_adds),
  }


def sample_metrics(tokens_BxL, params: Params = DEFAULT) -> dict[str, float]:
  """Fractions well-formed, correct, add-count valid and unique."""
  out = {name: float(v.mean()) for name, v in checks(tokens_BxL, params).items()}
  x = np.asarray(tokens_BxL)
  out["unique"] = len({row.tobytes() for row in x}) / len(x)
  return out


def log_prob(tokens_BxL, params: Params = DEFAULT) -> np.ndarray:
  """Exact log p(x) in nats of full sequences (-inf where impossible)."""
  p = params
  x = np.asarray(tokens_BxL)
  ok = checks(x, p)
  valid = ok["correct"] & ok["add_count_valid"]
  logp = -entropy_bits(p) * math.log(2.0)  # the law is uniform on its support
  return np.where(valid, logp, -np.inf)


def entropy_bits(params: Params = DEFAULT) -> float:
  """Exact entropy H(p) of the data law in bits per sequence."""
  return float(math.log2(math.comb(params.num_commands, 2)) + params.n * math.log2(NUM_DIGITS)
               + params.num_adds * math.log2(len(params.add_ids))
               + (params.n - 1) * math.log2(len(params.right_ids)))


def entropy_of(probs_V) -> float:
  """Entropy in bits of one distribution."""
  q = np.asarray(probs_V, np.float64)
  q = q[q > 0]
  return float(-(q * np.log2(q)).sum())


def group_joint(tokens_L, positions, params: Params = DEFAULT) -> tuple[np.ndarray, np.ndarray]:
  """The exact joint of a group of masked positions at one state.

  Enumerated by the chain rule through the exact denoiser, level by level,
  dropping zero-probability prefixes. Returns (assignments_NxG, probs_N).
  """
  canvases = np.asarray(tokens_L, np.int32)[None].copy()
  probs = np.ones(1)
  for pos in positions:
    # Pad the batch to a power of two so the jitted oracle compiles few shapes.
    padded = np.resize(canvases, (1 << (len(canvases) - 1).bit_length(), canvases.shape[1]))
    cond, _ = exact_probs(jnp.asarray(padded), params)
    cond = np.asarray(cond, np.float64)[:len(canvases), pos]
    rows, vals = np.nonzero(cond > 0)
    probs = probs[rows] * cond[rows, vals]
    canvases = canvases[rows]
    canvases[:, pos] = vals
  return canvases[:, list(positions)], probs


def total_correlation_bits(tokens_L, positions, params: Params = DEFAULT) -> float:
  """TC = sum_i H(X_i) - H(X_group), in bits, at the given state."""
  assignments, probs = group_joint(tokens_L, positions, params)
  joint_h = entropy_of(probs)
  marginal_h = 0.0
  for g in range(len(positions)):
    marg = np.bincount(assignments[:, g], weights=probs, minlength=VOCAB_SIZE)
    marginal_h += entropy_of(marg)
  return marginal_h - joint_h
