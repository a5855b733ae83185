"""The mixture-of-experts MLP of LLaDA2's network (Ling's MoE): a router, group-limited top-k
over the experts, routed SwiGLU experts and shared experts.

`MoEConfig` is the static part of `PublishedConfig.moe`; `param_shapes` the MoE leaves of a
stacked `params["moe_layers"]`; `mlp` the layer's MLP output (routed plus shared), before
the residual.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdjax.models import checks

Array = jax.Array

SCORE_FUNCTIONS = ("sigmoid", "softmax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
  """The experts of every layer from `first_dense_layers` on (frozen: static under jit).

  num_experts routed experts of hidden size expert_hidden, experts_per_token chosen per
  token among the topk_group best of n_group groups (a group's score is the sum of its two
  best experts' scores); score_function turns router logits into scores (an expert bias is
  added for the choice only); the chosen scores, normalised when norm_topk_prob and more
  than one is chosen, times routed_scaling_factor, weight the experts' outputs.
  num_shared_experts (0: none) always-on experts form one SwiGLU of expert_hidden *
  num_shared_experts.
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
      raise ValueError(f"experts_per_token={self.experts_per_token} exceeds the experts of "
                       f"topk_group={self.topk_group} groups of "
                       f"{self.num_experts // self.n_group}.")
    if self.score_function not in SCORE_FUNCTIONS:
      raise ValueError(f"score_function={self.score_function!r} must be one of "
                       f"{SCORE_FUNCTIONS}.")
    if not (checks.is_number(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
      raise ValueError(f"routed_scaling_factor={self.routed_scaling_factor!r} must be > 0.")


def param_shapes(moe: MoEConfig, d_model: int, num_layers: int) -> dict:
  """The MoE leaves of params["moe_layers"] (each with a leading [num_layers])."""
  n, d, e, f = num_layers, d_model, moe.num_experts, moe.expert_hidden
  shapes = {"router": (n, d, e), "expert_bias": (n, e), "experts_gate": (n, e, d, f),
            "experts_up": (n, e, d, f), "experts_down": (n, e, f, d)}
  if moe.num_shared_experts:
    s = f * moe.num_shared_experts
    shapes.update(shared_gate=(n, d, s), shared_up=(n, d, s), shared_down=(n, s, d))
  return shapes


def route(moe: MoEConfig, layer: dict, x_TxD: Array) -> tuple[Array, Array]:
  """(chosen experts T x k, their weights T x k float32)."""
  logits_TxE = jnp.einsum("td,de->te", x_TxD.astype(jnp.float32),
                          layer["router"].astype(jnp.float32))
  scores_TxE = (jax.nn.sigmoid(logits_TxE) if moe.score_function == "sigmoid"
                else jax.nn.softmax(logits_TxE, axis=-1))
  biased_TxE = scores_TxE + layer["expert_bias"].astype(jnp.float32)
  tokens = x_TxD.shape[0]
  grouped = biased_TxE.reshape(tokens, moe.n_group, -1)
  group_TxN = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
  _, best_groups = jax.lax.top_k(group_TxN, moe.topk_group)
  keep_TxN = jnp.zeros_like(group_TxN, bool).at[jnp.arange(tokens)[:, None], best_groups].set(True)
  keep_TxE = jnp.repeat(keep_TxN, moe.num_experts // moe.n_group, axis=-1)
  _, experts_Txk = jax.lax.top_k(jnp.where(keep_TxE, biased_TxE, -jnp.inf),
                                 moe.experts_per_token)
  weights_Txk = jnp.take_along_axis(scores_TxE, experts_Txk, axis=-1)
  if moe.norm_topk_prob and moe.experts_per_token > 1:
    weights_Txk = weights_Txk / (weights_Txk.sum(-1, keepdims=True) + 1e-20)
  return experts_Txk, weights_Txk * moe.routed_scaling_factor


def _swiglu(x, gate, up, down):
  dtype = x.dtype
  y = jax.nn.silu(x @ gate.astype(dtype)) * (x @ up.astype(dtype))
  return y @ down.astype(dtype)


def mlp(moe: MoEConfig, layer: dict, x_BxQxD: Array) -> Array:
  """The MoE MLP's output (routed experts plus shared ones), B x Q x D."""
  batch, width, d = x_BxQxD.shape
  x_TxD = x_BxQxD.reshape(-1, d)
  experts_Txk, weights_Txk = route(moe, layer, x_TxD)
  dtype = x_TxD.dtype
  # Every expert on every token, then the chosen ones combined (a correct, simple dispatch).
  gate = jnp.einsum("td,edf->tef", x_TxD, layer["experts_gate"].astype(dtype))
  up = jnp.einsum("td,edf->tef", x_TxD, layer["experts_up"].astype(dtype))
  out_TxExD = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up,
                         layer["experts_down"].astype(dtype))
  combine_TxE = jnp.zeros((x_TxD.shape[0], moe.num_experts), jnp.float32).at[
      jnp.arange(x_TxD.shape[0])[:, None], experts_Txk].add(weights_Txk)
  y_TxD = jnp.einsum("ted,te->td", out_TxExD.astype(jnp.float32), combine_TxE).astype(dtype)
  if moe.num_shared_experts:
    y_TxD = y_TxD + _swiglu(x_TxD, layer["shared_gate"], layer["shared_up"],
                            layer["shared_down"])
  return y_TxD.reshape(batch, width, d)
