"""A learned unmasking order (UPO, Hong et al. 2025, chunsanHong/UPO) as a value: a tiny
network that scores every position from the denoiser's output, and the Plackett-Luce choice
of which masked positions a step commits (`sampling.families.order_policy` samples with it;
`mdjax.accelerators.order_policy` trains it by GRPO on a frozen denoiser).

Per position l the network reads F = 9 features (`features`): the denoiser's four largest
probabilities there (sorted; UPO's `topk`), its entropy over log V, whether l is masked
(UPO's mask flag), whether it is editable (UPO's "in the block" flag: here, not a prompt
position), the step's fraction i / K and the fraction of the row's editable positions still
masked. Then

    h0 = tanh(x @ w_in + b_in + pos[l])               (D units; pos a learned table over L)
    h1 = h0 + softmax(h0 wq (h0 wk)^T / sqrt(D)) h0 wv  (one attention head over all L)
    score_l = relu(h1 @ w1 + b1) @ w2 + b2            (H hidden units, one logit)

UPO's head is a copy of LLaDA's last transformer block over its hidden states, a LayerNorm
and a 3-layer SiLU MLP over [state, the 10 features]; mdjax's denoisers include exact
oracles with no hidden states, so here one attention layer over the features (and a table
of positions) stands for it: positions see each other, as UPO's head's do.

The weights are tuples of float32-exact Python floats, so the policy is a frozen, hashable
value in a sampler spec (static under jit, its numbers constants of the program), capped at
`MAX_PARAMS`; on disk one small JSON file, written atomically (`save_policy`) and read back
with every field checked (`load_policy`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import files
from mdjax.errors import ArgumentError

Array = jax.Array

FORMAT = "mdjax.order_policy"
VERSION = 1
NUM_FEATURES = 9
TOP = 4  # the largest probabilities read per position
MAX_PARAMS = 1 << 16  # a spec is hashed at every call; its constants are compiled in
MAX_FILE_BYTES = 4 << 20


def shapes(length: int, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
  """Each weight's shape, in the file's order."""
  f = NUM_FEATURES
  return {"w_in": (f, dim), "b_in": (dim,), "pos": (length, dim), "wq": (dim, dim),
          "wk": (dim, dim), "wv": (dim, dim), "w1": (dim, hidden), "b1": (hidden,),
          "w2": (hidden,), "b2": (1,)}


def _floats(values) -> tuple[float, ...]:
  return tuple(float(v) for v in np.asarray(values, np.float32).reshape(-1))


def _positive_int(name: str, value) -> int:
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
    raise ArgumentError.invalid(f"policy.{name}", value, "it must be an integer >= 1")
  return int(value)


@dataclasses.dataclass(frozen=True, repr=False)
class OrderPolicy:
  """The network's sizes (L positions, D units, H hidden) and its weights by name
  (`shapes`), each a flat tuple of floats, row-major."""

  length: int
  dim: int
  hidden: int
  weights: tuple[tuple[str, tuple[float, ...]], ...]

  def __post_init__(self):
    for name in ("length", "dim", "hidden"):
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
    want = shapes(self.length, self.dim, self.hidden)
    count = sum(math.prod(s) for s in want.values())
    if count > MAX_PARAMS:
      raise ArgumentError("policy", f"an order policy of length {self.length}, dim {self.dim} "
                          f"and hidden {self.hidden} has {count:,} parameters; at most "
                          f"{MAX_PARAMS:,} are taken (its weights are constants of the "
                          "compiled program).")
    given = dict(self.weights) if isinstance(self.weights, (tuple, list, dict)) else None
    if not isinstance(given, dict) or set(given) != set(want):
      raise ArgumentError("policy", f"policy weights must be named {sorted(want)}.")
    out = []
    for name, shape in want.items():
      value = given[name]
      if not (isinstance(value, (tuple, list, np.ndarray)) and np.size(value) == math.prod(shape)
              and all(isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)
                      for v in np.asarray(value, object).reshape(-1))):
        raise ArgumentError("policy", f"policy.{name} must be {math.prod(shape)} numbers "
                            f"(shape {shape}).")
      value = _floats(value)
      if not all(math.isfinite(v) for v in value):
        raise ArgumentError("policy", f"policy.{name} holds a number that is not finite.")
      out.append((name, value))
    object.__setattr__(self, "weights", tuple(out))

  @classmethod
  def from_arrays(cls, arrays: dict) -> "OrderPolicy":
    length, dim = np.shape(arrays["pos"])
    return cls(length=length, dim=dim, hidden=np.shape(arrays["w1"])[1],
               weights=tuple((k, _floats(arrays[k])) for k in shapes(length, dim, 1)))

  @property
  def num_params(self) -> int:
    return sum(len(v) for _, v in self.weights)

  def arrays(self) -> dict[str, np.ndarray]:
    """The weights as float32 arrays of their shapes."""
    want = shapes(self.length, self.dim, self.hidden)
    return {k: np.asarray(v, np.float32).reshape(want[k]) for k, v in self.weights}

  def scores(self, features_BxLxF: Array) -> Array:
    return apply_arrays({k: jnp.asarray(v) for k, v in self.arrays().items()}, features_BxLxF)

  @property
  def digest(self) -> str:
    """sha256 of the sizes and float32 weights (first 12 hex digits): names the policy."""
    h = hashlib.sha256(f"{self.length}x{self.dim}x{self.hidden}".encode())
    for array in self.arrays().values():
      h.update(array.tobytes())
    return h.hexdigest()[:12]

  def __repr__(self):
    return (f"OrderPolicy(length={self.length}, dim={self.dim}, hidden={self.hidden}, "
            f"params={self.num_params}, sha256={self.digest})")

  def to_json(self, info: dict | None = None) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "length": self.length, "dim": self.dim,
            "hidden": self.hidden, "weights": {k: list(v) for k, v in self.weights},
            "info": dict(info or {})}

  @classmethod
  def from_json(cls, raw: Any, where: str) -> "OrderPolicy":
    """A policy from a file's object; an ArgumentError naming `where` for anything else."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
      raise ArgumentError("policy_file", f"{where}: not an order policy (its \"format\" must "
                          f"be {FORMAT!r}).")
    if raw.get("version") != VERSION:
      raise ArgumentError("policy_file", f"{where}: order policy version "
                          f"{raw.get('version')!r}; this mdjax reads version {VERSION}.")
    missing = [k for k in ("length", "dim", "hidden", "weights") if k not in raw]
    if missing or not isinstance(raw["weights"], dict):
      raise ArgumentError("policy_file", f"{where}: the policy lacks "
                          f"{', '.join(missing) or 'a weights object'}.")
    try:
      return cls(length=raw["length"], dim=raw["dim"], hidden=raw["hidden"],
                 weights=tuple((k, tuple(v) if isinstance(v, list) else v)
                               for k, v in raw["weights"].items()))
    except ArgumentError as error:
      raise ArgumentError("policy_file", f"{where}: {error}") from None


def init_arrays(key, length: int, dim: int, hidden: int, scale: float = 1.0) -> dict:
  """PyTorch's nn.Linear start (uniform in +-1/sqrt(fan in)) for every matrix, zero
  biases, the position table N(0, 0.1)."""
  out = {}
  for (name, shape), k in zip(shapes(length, dim, hidden).items(),
                              jax.random.split(key, len(shapes(length, dim, hidden)))):
    if name.startswith("b"):
      out[name] = jnp.zeros(shape, jnp.float32)
    elif name == "pos":
      out[name] = 0.1 * jax.random.normal(k, shape, jnp.float32)
    else:
      bound = scale / math.sqrt(shape[0])
      out[name] = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
  return out


def example_policy(length: int, dim: int = 4, hidden: int = 4, seed: int = 0) -> OrderPolicy:
  """A small untrained policy (tests, examples)."""
  arrays = init_arrays(jax.random.key(seed), length, dim, hidden)
  return OrderPolicy.from_arrays({k: np.asarray(v) for k, v in arrays.items()})


def features(logits_BxLxV: Array, masked_BxL: Array, editable_BxL: Array, step_fraction) -> Array:
  """The F = 9 features of every position (module docstring), float32 B x L x F."""
  probs_BxLxV = jax.nn.softmax(logits_BxLxV.astype(jnp.float32), -1)
  vocab = probs_BxLxV.shape[-1]
  top_BxLxT = jax.lax.top_k(probs_BxLxV, min(TOP, vocab))[0]
  if vocab < TOP:
    top_BxLxT = jnp.pad(top_BxLxT, ((0, 0), (0, 0), (0, TOP - vocab)))
  entropy_BxL = -jnp.sum(jnp.where(probs_BxLxV > 0, probs_BxLxV * jnp.log(probs_BxLxV), 0.0),
                         -1) / math.log(max(vocab, 2))
  left_B = masked_BxL.sum(-1) / jnp.maximum(editable_BxL.sum(-1), 1)
  shape = masked_BxL.shape
  step_BxL = jnp.broadcast_to(jnp.asarray(step_fraction, jnp.float32), shape)
  return jnp.concatenate([top_BxLxT, entropy_BxL[..., None], masked_BxL[..., None],
                          editable_BxL[..., None], step_BxL[..., None],
                          jnp.broadcast_to(left_B[:, None], shape)[..., None]],
                         -1).astype(jnp.float32)


def apply_arrays(w: dict, features_BxLxF: Array) -> Array:
  """The network's scores, B x L, on weights given as arrays (training differentiates it)."""
  h0 = jnp.tanh(features_BxLxF @ w["w_in"] + w["b_in"] + w["pos"])
  q, k, v = h0 @ w["wq"], h0 @ w["wk"], h0 @ w["wv"]
  attention_BxLxL = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / math.sqrt(h0.shape[-1]), -1)
  h1 = h0 + attention_BxLxL @ v
  return jax.nn.relu(h1 @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"][0]


def order_log_prob(scores_BxL: Array, candidates_BxL: Array, rank_BxL: Array,
                   temperature: float) -> Array:
  """log P of committing the positions of rank < L in that order under Plackett-Luce on
  scores / temperature over the candidates: sum over chosen l of
  s_l - logsumexp{s_c : c a candidate not chosen before l}. rank_BxL: each chosen
  position's place in the order (0, 1, ...), any larger value for the rest. Per row, B."""
  length = scores_BxL.shape[-1]
  s_BxL = scores_BxL.astype(jnp.float32) / temperature
  chosen_BxL = candidates_BxL & (rank_BxL < length)
  # Candidate c is still there when l is drawn: its rank is not below l's.
  left_BxLxL = candidates_BxL[:, None, :] & (rank_BxL[:, None, :] >= rank_BxL[:, :, None])
  norm_BxL = jax.nn.logsumexp(jnp.where(left_BxLxL, s_BxL[:, None, :], -jnp.inf), -1)
  return jnp.sum(jnp.where(chosen_BxL, s_BxL - norm_BxL, 0.0), -1)


def save_policy(policy: OrderPolicy, path: str, info: dict | None = None) -> str:
  """Writes the policy (and `info`: how it was trained) to `path` atomically."""
  with files.atomic_write(path, "w") as f:
    json.dump(policy.to_json(info), f, allow_nan=False)
    f.write("\n")
  return path


def read_raw(path: str) -> Any:
  """A policy file's JSON value; an ArgumentError naming `policy_file` when it is missing,
  too large or not JSON."""
  try:
    with files.open_regular(path) as f:
      data = f.read(MAX_FILE_BYTES + 1)
  except ValueError as error:
    raise ArgumentError("policy_file", str(error)) from None
  if len(data) > MAX_FILE_BYTES:
    raise ArgumentError("policy_file", f"{path}: larger than {MAX_FILE_BYTES:,} bytes.")
  try:
    return json.loads(data.decode("utf-8"))
  except (ValueError, RecursionError) as error:
    raise ArgumentError("policy_file", f"{path}: not a JSON order policy ({error})") from None


def load_policy(path: str) -> OrderPolicy:
  """The policy a file written by `save_policy` holds; an ArgumentError (a ValueError)
  naming `policy_file` when it is missing, too large, not JSON or not a valid policy."""
  return OrderPolicy.from_json(read_raw(path), path)


def read_info(path: str) -> dict:
  """The `info` a policy file records (how it was trained), after checking the policy."""
  raw = read_raw(path)
  OrderPolicy.from_json(raw, path)
  return dict(raw.get("info") or {})
