"""The mixture-of-experts MLP of LLaDA2's network (Ling's MoE): a router, group-limited top-k
over the experts, routed SwiGLU experts and shared experts.

`MoEConfig` is the static part of `PublishedConfig.moe`; `param_shapes` the MoE leaves of a
stacked `params["moe_layers"]`; `mlp` the layer's MLP output (routed plus shared), before
the residual.

Routing (LLaDA2MoeGate): router logits in float32, scores sigmoid(logits) (or a softmax),
an expert bias added for the choice only; the experts split into n_group equal groups, a
group's score the sum of its two best biased scores, the topk_group best groups kept and
the experts_per_token best experts chosen among theirs; each chosen expert is weighted by
its unbiased score, normalised over the chosen ones (norm_topk_prob, more than one chosen),
times routed_scaling_factor. The weighted sum is taken in float32 and cast back.

Dispatch: the T tokens' T * k (token, expert) assignments are sorted by expert and each
expert's SwiGLU runs on its contiguous run of rows with `jax.lax.ragged_dot` (a grouped
matmul: XLA's on GPU and TPU), so the largest intermediate is [T * k, expert_hidden]; no
[tokens, experts, hidden] tensor is formed. Everything is jit-safe (static shapes; the
group sizes are traced) and differentiable.

Sharding: under the FSDP rule of `mdjax.mesh` the expert leaves [N, E, D, F] / [N, E, F, D]
are split along their largest dimension that the mesh axis divides (LLaDA2.0-mini's
[20, 256, 2048, 512] splits D) and gathered by the compiler where the grouped matmul needs
them. On a mesh with 'expert' / 'tensor' axes (`mdjax.models.parallel`) the experts are
split over 'expert' (E / n a device) and their hidden columns over 'tensor', and the
dispatch runs in `jax.shard_map` (`_routed_on`): every device sorts its tokens' assignments
(all the tokens, or its share of them along 'data'), runs its own experts' run of rows, and
one psum of the A x D outputs over the model axes joins them. A row is computed whole on one device and the others add zeros, so with the
experts split the sum is exact: the tokens are one device's, bit for bit (the hidden
columns over 'tensor' sum partial products: equal to rounding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import custom_batching

from jax.sharding import PartitionSpec

from mdjax.models import checks, parallel

Array = jax.Array

SCORE_FUNCTIONS = ("sigmoid", "softmax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
  """The experts of every layer from `first_dense_layers` on (frozen: static under jit).

  num_experts routed experts of hidden size expert_hidden, experts_per_token chosen per
  token among the topk_group best of n_group groups (a group's score is the sum of its two
  best experts' biased scores; one expert's score when a group has one); score_function
  turns router logits into scores (the expert bias is added for the choice only); the chosen
  scores, normalised when norm_topk_prob and more than one is chosen, times
  routed_scaling_factor, weight the experts' outputs. num_shared_experts (0: none) always-on
  experts form one SwiGLU of expert_hidden * num_shared_experts. first_dense_layers: the
  layers before it have a dense MLP.
  """

  num_experts: int
  experts_per_token: int
  expert_hidden: int
  num_shared_experts: int = 0
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  score_function: str = "sigmoid"
  norm_topk_prob: bool = True
  first_dense_layers: int = 0

  def __post_init__(self):
    for name in ("num_experts", "experts_per_token", "expert_hidden", "n_group", "topk_group"):
      checks.check_count(name, getattr(self, name))
    for name in ("num_shared_experts", "first_dense_layers"):
      checks.check_count(name, getattr(self, name), 0)
    if self.num_experts % self.n_group:
      raise ValueError(f"num_experts={self.num_experts} must be a multiple of n_group="
                       f"{self.n_group} (the experts split into equal groups).")
    if self.topk_group > self.n_group:
      raise ValueError(f"topk_group={self.topk_group} must be at most n_group={self.n_group}.")
    if self.experts_per_token > self.topk_group * (self.num_experts // self.n_group):
      raise ValueError(f"experts_per_token={self.experts_per_token} exceeds the "
                       f"{self.topk_group * (self.num_experts // self.n_group)} experts of "
                       f"topk_group={self.topk_group} groups of "
                       f"{self.num_experts // self.n_group}.")
    if self.score_function not in SCORE_FUNCTIONS:
      raise ValueError(f"score_function={self.score_function!r} must be one of "
                       f"{SCORE_FUNCTIONS}.")
    if self.norm_topk_prob not in (True, False) or not isinstance(self.norm_topk_prob, bool):
      raise ValueError(f"norm_topk_prob={self.norm_topk_prob!r} must be True or False.")
    if not (checks.is_number(self.routed_scaling_factor) and 0 < self.routed_scaling_factor
            < float("inf")):
      raise ValueError(f"routed_scaling_factor={self.routed_scaling_factor!r} must be a "
                       "finite number > 0.")

  @property
  def shared_hidden(self) -> int:
    """The shared experts' one SwiGLU width (0: none)."""
    return self.expert_hidden * self.num_shared_experts


def param_shapes(moe: MoEConfig, d_model: int, num_layers: int) -> dict:
  """The MoE leaves of params["moe_layers"], each with a leading [num_layers]: router
  [N, D, E] (a torch Linear's transpose), expert_bias [N, E] (the choice's bias; zeros when
  initialised), the experts' gate / up [N, E, D, F] and down [N, E, F, D], and the shared
  SwiGLU's shared_gate / shared_up [N, D, S], shared_down [N, S, D] (S = F *
  num_shared_experts; absent without shared experts)."""
  n, d, e, f = num_layers, d_model, moe.num_experts, moe.expert_hidden
  shapes = {"router": (n, d, e), "expert_bias": (n, e), "experts_gate": (n, e, d, f),
            "experts_up": (n, e, d, f), "experts_down": (n, e, f, d)}
  if moe.num_shared_experts:
    s = moe.shared_hidden
    shapes.update(shared_gate=(n, d, s), shared_up=(n, d, s), shared_down=(n, s, d))
  return shapes


def route(moe: MoEConfig, layer: dict, x_TxD: Array) -> tuple[Array, Array]:
  """The chosen experts (T x k int32) and their weights (T x k float32) of each token."""
  tokens = x_TxD.shape[0]
  logits_TxE = jnp.einsum("td,de->te", x_TxD.astype(jnp.float32),
                          layer["router"].astype(jnp.float32))
  scores_TxE = (jax.nn.sigmoid(logits_TxE) if moe.score_function == "sigmoid"
                else jax.nn.softmax(logits_TxE, axis=-1))
  biased_TxE = scores_TxE + layer["expert_bias"].astype(jnp.float32)
  per_group = moe.num_experts // moe.n_group
  biased_TxNxP = biased_TxE.reshape(tokens, moe.n_group, per_group)
  group_TxN = jax.lax.top_k(biased_TxNxP, min(2, per_group))[0].sum(-1)
  _, groups_Txg = jax.lax.top_k(group_TxN, moe.topk_group)
  kept_TxN = jnp.any(groups_Txg[:, :, None] == jnp.arange(moe.n_group), axis=1)
  kept_TxE = jnp.repeat(kept_TxN, per_group, axis=-1)
  _, experts_Txk = jax.lax.top_k(jnp.where(kept_TxE, biased_TxE, -jnp.inf),
                                 moe.experts_per_token)
  weights_Txk = jnp.take_along_axis(scores_TxE, experts_Txk, axis=-1)
  if moe.norm_topk_prob and moe.experts_per_token > 1:
    weights_Txk = weights_Txk / (weights_Txk.sum(-1, keepdims=True) + 1e-20)
  return experts_Txk.astype(jnp.int32), weights_Txk * moe.routed_scaling_factor


def _swiglu(x: Array, gate: Array, up: Array, down: Array) -> Array:
  dtype = x.dtype
  y = jax.nn.silu(x @ gate.astype(dtype)) * (x @ up.astype(dtype))
  return y @ down.astype(dtype)


def routed(moe: MoEConfig, layer: dict, x_TxD: Array, experts_Txk: Array,
           weights_Txk: Array) -> Array:
  """The routed experts' weighted output, T x D: the T * k assignments sorted by expert,
  each expert's SwiGLU over its run of rows (`jax.lax.ragged_dot`), unsorted, combined in
  float32. Safe under `jax.vmap` (`over_tokens`)."""
  dtype = x_TxD.dtype
  weights = tuple(layer[name].astype(dtype) for name in ("experts_gate", "experts_up",
                                                         "experts_down"))
  fn = functools.partial(_routed, moe.experts_per_token, moe.num_experts)
  return over_tokens(fn, 3)(x_TxD, experts_Txk, weights_Txk, *weights)


def _routed(k: int, num_experts: int, x_TxD: Array, experts_Txk: Array, weights_Txk: Array,
            *weights: Array) -> Array:
  """`routed` on one device, or on the mesh the expert weights are on (`_routed_on` in a
  `shard_map`: the tokens over 'data' where it divides them, the experts over 'expert',
  their hidden columns over 'tensor')."""
  mesh = parallel.mesh_of(weights[0])
  if mesh is None:
    return _routed_on(k, num_experts, (), x_TxD, experts_Txk, weights_Txk, *weights)
  split = lambda axis: axis if mesh.shape.get(axis, 1) > 1 else None
  expert, tensor, data = split(parallel.EXPERT), split(parallel.TENSOR), split(parallel.DATA)
  if data and x_TxD.shape[0] % mesh.shape[data]:
    data = None
  tokens, in_, out = (PartitionSpec(data), PartitionSpec(expert, None, tensor),
                      PartitionSpec(expert, tensor, None))
  fn = functools.partial(_routed_on, k, num_experts, tuple(a for a in (expert, tensor) if a))
  return jax.shard_map(fn, mesh=mesh, in_specs=(tokens, tokens, tokens, in_, in_, out),
                       out_specs=tokens)(x_TxD, experts_Txk, weights_Txk, *weights)


def _routed_on(k: int, num_experts: int, axes: tuple[str, ...], x_TxD: Array,
               experts_Txk: Array, weights_Txk: Array, gate_ExDxF: Array, up_ExDxF: Array,
               down_ExFxD: Array) -> Array:
  """The tokens' assignments sorted by expert, the experts held here (all of them, or this
  device's run along the 'expert' axis) over their runs of rows, a psum over `axes` (the
  mesh axes the experts and their columns are split over; none on one device), unsorted
  and combined in float32."""
  tokens, d = x_TxD.shape
  expert_A = experts_Txk.reshape(-1)  # A = T * k assignments, token-major
  order_A = jnp.argsort(expert_A, stable=True)
  rows_AxD = x_TxD[order_A // k]
  sizes_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  count = gate_ExDxF.shape[0]  # the experts held here: [first, first + count)
  if count == num_experts:
    out_AxD = _experts(rows_AxD, sizes_E, gate_ExDxF, up_ExDxF, down_ExFxD)
  else:
    first = jax.lax.axis_index(parallel.EXPERT) * count
    ends_E = jnp.cumsum(sizes_E)
    start = jnp.where(first > 0, ends_E[jnp.maximum(first - 1, 0)], 0)
    # Roll this device's run of rows to the front, run its experts, roll back; rows of
    # other devices' experts are zeros here, whatever the backend leaves past the runs.
    index_A = jnp.arange(rows_AxD.shape[0])
    out_AxD = _experts(rows_AxD[(index_A + start) % rows_AxD.shape[0]],
                       jax.lax.dynamic_slice_in_dim(sizes_E, first, count), gate_ExDxF,
                       up_ExDxF, down_ExFxD)[(index_A - start) % rows_AxD.shape[0]]
    mine_A = (index_A >= start) & (index_A < ends_E[first + count - 1])
    out_AxD = jnp.where(mine_A[:, None], out_AxD, 0)
  if axes:
    out_AxD = jax.lax.psum(out_AxD, axes)
  unsorted_AxD = jnp.zeros_like(out_AxD).at[order_A].set(out_AxD)
  y_TxD = jnp.einsum("tkd,tk->td", unsorted_AxD.reshape(tokens, k, d).astype(jnp.float32),
                     weights_Txk.astype(jnp.float32))
  return y_TxD.astype(x_TxD.dtype)


def over_tokens(fn, num_token_args: int):
  """`fn(*args) -> out_TxD`, whose first `num_token_args` args have a leading token axis and
  whose tokens are independent, made safe under `jax.vmap` and still differentiable.

  jax's `ragged_dot` has no batching rule for an unbatched right-hand side, so a vmap over
  rows (the server's lanes step each row alone) cannot pass through it. Under a vmap the
  rows are folded into the tokens instead (`custom_vmap`): one call over every row's
  tokens, as a batch is run; with batched weights, one call a row (`lax.map`). A
  `custom_vmap` has no reverse-mode rule, so the gradient is `fn`'s own (`custom_vjp`).
  """

  @custom_batching.custom_vmap
  def folded(*args):
    return fn(*args)

  @folded.def_vmap
  def _(axis_size, in_batched, *args):
    if any(in_batched[num_token_args:]):
      def one(sliced):
        it = iter(sliced)
        return folded(*(next(it) if b else a for a, b in zip(args, in_batched)))
      return jax.lax.map(one, [a for a, b in zip(args, in_batched) if b]), True
    tokens = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
              for a, b in zip(args[:num_token_args], in_batched)]
    out = folded(*(a.reshape((-1,) + a.shape[2:]) for a in tokens), *args[num_token_args:])
    return out.reshape((axis_size, -1) + out.shape[1:]), True

  @jax.custom_vjp
  def differentiable(*args):
    return folded(*args)

  differentiable.defvjp(lambda *args: (folded(*args), args),
                        lambda args, ct: jax.vjp(fn, *args)[1](ct))
  return differentiable


def _experts(rows_AxD: Array, sizes_E: Array, gate_ExDxF: Array, up_ExDxF: Array,
             down_ExFxD: Array) -> Array:
  """Each expert's SwiGLU over its run of the sorted rows (rows past the runs: zeros)."""
  gate_AxF = jax.lax.ragged_dot(rows_AxD, gate_ExDxF, sizes_E)
  up_AxF = jax.lax.ragged_dot(rows_AxD, up_ExDxF, sizes_E)
  return jax.lax.ragged_dot(jax.nn.silu(gate_AxF) * up_AxF, down_ExFxD, sizes_E)


def mlp(moe: MoEConfig, layer: dict, x_BxQxD: Array) -> Array:
  """The MoE MLP's output (routed experts plus shared ones), B x Q x D."""
  batch, width, d = x_BxQxD.shape
  x_TxD = jnp.asarray(x_BxQxD).reshape(-1, d)
  experts_Txk, weights_Txk = route(moe, layer, x_TxD)
  y_TxD = routed(moe, layer, x_TxD, experts_Txk, weights_Txk)
  if moe.num_shared_experts:
    y_TxD = y_TxD + _swiglu(x_TxD, layer["shared_gate"], layer["shared_up"],
                            layer["shared_down"])
  return y_TxD.reshape(batch, width, d)
