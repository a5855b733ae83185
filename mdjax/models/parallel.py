"""The published Transformer (`mdjax.models.published`: LLaDA, Dream, SDAR, Fast-dLLM v2,
LLaDA2 and the judges) split over a mesh's 'tensor' and 'expert' axes: one table.

`RULES` gives each leaf the role of each of its dimensions (after the layer axis of a
stacked leaf); a role is split over one mesh axis (`AXIS_OF`). A mesh names the axes it
has, with their sizes; an axis it does not have, or of size 1, splits nothing, so the one
table serves every mode:

  tensor   ('tensor': N)   attention heads, the dense and shared MLPs' hidden columns, each
                           expert's hidden columns and the vocabulary (Megatron's split:
                           column-parallel in, row-parallel out, one all-reduce each)
  expert   ('expert': N)   LLaDA2's routed experts, whole, N/E a device; the rest replicated
  both     ('expert': a, 'tensor': b)   experts over a, everything above over b

Counts that must divide (`HARD`): the heads, the MLP widths, the experts; a mesh that does
not is an ArgumentError naming `mesh`, the axis and the sizes allowed. The key/value heads
and the vocabulary are replicated where the axis does not divide them (a GQA model with 4
key/value heads on 8 devices reads each whole; a vocabulary of 151936 is not 3 parts).
Every other leaf (norms, biases of replicated projections, the router and its expert bias:
the routing must be computed whole, identically on every device) is replicated.

How the computation follows: the dense layers are left to XLA's sharding propagation (the
weights' placement decides it); the routed experts run in `jax.shard_map` (`moe.routed`),
which reads the weights' mesh from their type, so the networks take no mesh argument and
run unchanged on one device.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
from jax.sharding import PartitionSpec

from mdjax.errors import ArgumentError

DATA = "data"  # the batch's rows (mdjax.mesh)
TENSOR = "tensor"  # heads and hidden columns
EXPERT = "expert"  # LLaDA2's routed experts
MODEL_AXES = (TENSOR, EXPERT)
STACKS = ("layers", "moe_layers")  # params whose leaves have a leading layer axis

# leaf name -> the role of each dimension after the layer axis (None: never split).
RULES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", None), "head": (None, "vocab"),
    "q": (None, "heads"), "q_bias": ("heads",), "o": ("heads", None),
    "k": (None, "kv_heads"), "v": (None, "kv_heads"),
    "k_bias": ("kv_heads",), "v_bias": ("kv_heads",),
    "gate": (None, "mlp"), "up": (None, "mlp"), "down": ("mlp", None),
    "shared_gate": (None, "shared_mlp"), "shared_up": (None, "shared_mlp"),
    "shared_down": ("shared_mlp", None),
    "experts_gate": ("experts", None, "expert_mlp"), "experts_up": ("experts", None, "expert_mlp"),
    "experts_down": ("experts", "expert_mlp", None),
}
AXIS_OF = {"vocab": TENSOR, "heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR,
           "shared_mlp": TENSOR, "expert_mlp": TENSOR, "experts": EXPERT}
# The roles a mesh axis must divide (the others are replicated where it does not).
HARD = ("heads", "mlp", "shared_mlp", "experts", "expert_mlp")


def counts(config) -> dict[str, int]:
  """Each role's count in a `PublishedConfig` (a role it lacks is absent)."""
  out = {"vocab": config.vocab_size, "heads": config.num_heads,
         "kv_heads": config.num_kv_heads}
  if config.dense_layers:
    out["mlp"] = config.mlp_hidden
  if config.moe is not None:
    out.update(experts=config.moe.num_experts, expert_mlp=config.moe.expert_hidden)
    if config.moe.num_shared_experts:
      out["shared_mlp"] = config.moe.shared_hidden
  return out


_NAMES = {"heads": "num_heads", "mlp": "mlp_hidden", "shared_mlp": "the shared experts' width",
          "experts": "num_experts", "expert_mlp": "expert_hidden"}


def check(config, sizes: Mapping[str, int]) -> None:
  """An ArgumentError (param `mesh`) unless each model axis of `sizes` ({axis: devices})
  divides every count of the roles it splits (`HARD`); raised before anything is read."""
  role_counts = counts(config)
  for axis in MODEL_AXES:
    size = int(sizes.get(axis, 1))
    if size == 1:
      continue
    hard = {role: n for role, n in role_counts.items() if AXIS_OF[role] == axis and role in HARD}
    if not hard:
      raise ArgumentError("mesh", f"mesh={dict(sizes)} is invalid for this {config.family} "
                          f"network: it has no routed experts to split over {axis!r} (a dense "
                          f"network splits over {TENSOR!r} only); give {axis!r} size 1.")
    bad = {role: n for role, n in hard.items() if n % size}
    if bad:
      common = math.gcd(*hard.values())
      allowed = [d for d in range(1, common + 1) if common % d == 0]
      said = ", ".join(f"{_NAMES[role]}={n}" for role, n in bad.items())
      raise ArgumentError("mesh", f"mesh={dict(sizes)} is invalid for this {config.family} "
                          f"network: its {axis!r} axis of {size} devices must divide {said}; "
                          f"allowed {axis!r} sizes: {', '.join(map(str, allowed))}.")


def leaf_spec(config, key: str, shape: tuple[int, ...], stacked: bool,
              sizes: Mapping[str, int]) -> PartitionSpec:
  """The PartitionSpec of the leaf `key` ("layers/q", "embed") of `shape` on a mesh of
  `sizes` ({axis: devices}): `RULES`' roles over their axes where the mesh has them (size
  > 1) and they divide; every other dimension whole. Call `check` first."""
  roles = RULES.get(key.split("/")[-1])
  if roles is None:
    return PartitionSpec()
  role_counts = counts(config)
  dims: list[str | None] = [None] * len(shape)
  for j, role in enumerate(roles):
    if role is None:
      continue
    axis = AXIS_OF[role]
    size = int(sizes.get(axis, 1))
    dim = j + bool(stacked)
    if size > 1 and role_counts.get(role, 0) % size == 0 and shape[dim] % size == 0:
      dims[dim] = axis
  return PartitionSpec(*dims)


def mesh_of(x) -> jax.sharding.AbstractMesh | None:
  """The (abstract) mesh `x` is placed on, read from its type inside jit or out; None when
  it is on one device or has no mesh axis of `MODEL_AXES` larger than 1."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not any(mesh.shape.get(axis, 1) > 1 for axis in MODEL_AXES):
    return None
  return mesh
