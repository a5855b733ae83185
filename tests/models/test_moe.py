"""Tests of the mixture-of-experts MLP (`mdjax.models.moe`) against a numpy transcription of
LLaDA2's LLaDA2MoeSparseMoeBlock (modeling_llada2_moe.py of inclusionAI/LLaDA2.0-mini:
LLaDA2MoeGate's group-limited routing and `moe_infer`, a loop over the chosen experts)."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.models import moe

D = 16


def _config(**kw):
  return moe.MoEConfig(**{"num_experts": 8, "experts_per_token": 2, "expert_hidden": 12,
                          "num_shared_experts": 1, "n_group": 4, "topk_group": 2,
                          "routed_scaling_factor": 2.5, **kw})


def _layer(config, seed=0, bias_scale=0.3):
  """One layer's MoE leaves (param_shapes' without the layer axis), random float32; the
  expert bias large enough to change the choice."""
  rng = np.random.default_rng(seed)
  shapes = moe.param_shapes(config, D, 1)
  out = {name: (0.3 * rng.standard_normal(shape[1:])).astype(np.float32)
         for name, shape in shapes.items()}
  out["expert_bias"] = (bias_scale * rng.standard_normal(shapes["expert_bias"][1:])
                        ).astype(np.float32)
  return out


# --- the numpy transcription of the published block ----------------------------------------


def _np_swiglu(x, gate, up, down):
  h = x @ gate
  return ((h / (1 + np.exp(-h))) * (x @ up)) @ down


def _np_moe(config, layer, x_TxD):
  """LLaDA2MoeSparseMoeBlock.forward (eval) in numpy float32: LLaDA2MoeGate (sigmoid, or the
  softmax of score_function), group_limited_topk, moe_infer, shared experts."""
  x = x_TxD.astype(np.float32)
  logits = x @ layer["router"]
  if config.score_function == "sigmoid":
    scores = 1 / (1 + np.exp(-logits))
  else:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    scores = e / e.sum(-1, keepdims=True)
  biased = scores + layer["expert_bias"]
  tokens, experts = biased.shape
  per_group = experts // config.n_group
  grouped = biased.reshape(tokens, config.n_group, per_group)
  group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)
  out = np.zeros_like(x)
  for t in range(tokens):
    groups = np.argsort(-group_scores[t], kind="stable")[:config.topk_group]
    masked = np.full(experts, -np.inf, np.float32)
    for g in groups:
      masked[g * per_group:(g + 1) * per_group] = biased[t, g * per_group:(g + 1) * per_group]
    chosen = np.argsort(-masked, kind="stable")[:config.experts_per_token]
    weights = scores[t, chosen]
    if config.norm_topk_prob and config.experts_per_token > 1:
      weights = weights / (weights.sum() + 1e-20)
    weights = weights * config.routed_scaling_factor
    for e, w in zip(chosen, weights):
      out[t] += w * _np_swiglu(x[t], layer["experts_gate"][e], layer["experts_up"][e],
                               layer["experts_down"][e])
  if config.num_shared_experts:
    out = out + _np_swiglu(x, layer["shared_gate"], layer["shared_up"], layer["shared_down"])
  return out


def _np_route(config, layer, x_TxD):
  """The transcription's chosen expert sets, one frozenset per token."""
  logits = x_TxD @ layer["router"]
  scores = 1 / (1 + np.exp(-logits))
  biased = scores + layer["expert_bias"]
  per_group = config.num_experts // config.n_group
  sets = []
  for row in biased:
    group_scores = -np.sort(-row.reshape(config.n_group, per_group), axis=-1)[:, :2].sum(-1)
    groups = np.argsort(-group_scores)[:config.topk_group]
    masked = np.full_like(row, -np.inf)
    for g in groups:
      masked[g * per_group:(g + 1) * per_group] = row[g * per_group:(g + 1) * per_group]
    sets.append(frozenset(np.argsort(-masked)[:config.experts_per_token].tolist()))
  return sets


@functools.partial(jax.jit, static_argnums=0)
def _mlp(config, layer, x_BxQxD):
  return moe.mlp(config, layer, x_BxQxD)


def _x(seed=1, batch=3, width=5):
  return np.random.default_rng(seed).standard_normal((batch, width, D)).astype(np.float32)


# Float32 sums of a few dozen products of O(1) terms: a relative 1e-5 is ~100 ulps; any
# wrong expert or weight moves the output by O(0.1).
RTOL, ATOL = 1e-5, 1e-5


@pytest.mark.parametrize("kw", [
    {},                                                        # LLaDA2's shape of routing
    {"num_shared_experts": 0, "n_group": 1, "topk_group": 1},  # no groups, no shared experts
    {"experts_per_token": 1},                                  # one expert: not normalised
    {"score_function": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    {"num_experts": 16, "n_group": 8, "topk_group": 3, "experts_per_token": 4,
     "num_shared_experts": 2},
])
@pytest.mark.slow
def test_matches_the_published_block(kw):
  config = _config(**kw)
  layer, x = _layer(config), _x()
  want = _np_moe(config, layer, x.reshape(-1, D)).reshape(x.shape)
  got = np.asarray(_mlp(config, layer, x))
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_routing_matches_and_the_bias_and_groups_matter():
  config = _config()
  layer, x = _layer(config, bias_scale=0.5), _x(batch=4, width=8).reshape(-1, D)
  experts_Txk, _ = jax.jit(moe.route, static_argnums=0)(config, layer, x)
  got = [frozenset(row.tolist()) for row in np.asarray(experts_Txk)]
  assert got == _np_route(config, layer, x)
  # The bias changes some token's choice, and so does the group limit (else the test
  # would not see them).
  unbiased = dict(layer, expert_bias=np.zeros_like(layer["expert_bias"]))
  assert _np_route(config, unbiased, x) != got
  ungrouped = dataclasses.replace(config, n_group=1, topk_group=1)
  assert _np_route(ungrouped, layer, x) != got


def test_bfloat16_close_to_float32():
  config = _config()
  layer, x = _layer(config), _x()
  want = np.asarray(_mlp(config, layer, x))
  layer16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), layer)
  got = _mlp(config, layer16, jnp.asarray(x, jnp.bfloat16))
  assert got.dtype == jnp.bfloat16
  # bfloat16 keeps 8 bits: a few roundings of O(1) values each within 2^-8 relative.
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)


def test_no_tokens_by_experts_by_hidden_intermediate():
  """The dispatch never forms a [tokens, experts, hidden] array: every intermediate of the
  traced program is at most the assignments' [T * k, max(D, F)] or the router's [T, E]."""
  config = _config(num_experts=32, n_group=4, topk_group=2, expert_hidden=24)
  layer, x = _layer(config), _x(batch=2, width=16)
  tokens = x.shape[0] * x.shape[1]
  bound = max(tokens * config.experts_per_token * max(D, config.expert_hidden),
              tokens * config.num_experts, max(np.size(v) for v in layer.values()))
  jaxpr = jax.make_jaxpr(functools.partial(moe.mlp, config))(layer, x)

  def sizes(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        yield int(np.prod(var.aval.shape)), eqn.primitive.name
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from sizes(sub)

  largest = max(sizes(jaxpr.jaxpr))
  assert largest[0] <= bound, largest
  assert tokens * config.num_experts * config.expert_hidden > bound  # the dense one is larger


def test_gradients_flow_to_every_leaf():
  config = _config()
  layer, x = _layer(config), _x()
  grads = jax.jit(jax.grad(lambda p: jnp.sum(moe.mlp(config, p, x) ** 2)))(layer)
  for name, g in grads.items():
    if name == "expert_bias":  # it only chooses: no gradient
      continue
    assert np.all(np.isfinite(g)) and np.abs(np.asarray(g)).max() > 0, name


@pytest.mark.parametrize("field,value,word", [
    ("num_experts", 10, "n_group"),
    ("n_group", 3, "n_group"),
    ("topk_group", 5, "topk_group"),
    ("experts_per_token", 5, "experts_per_token"),
    ("score_function", "relu", "score_function"),
    ("routed_scaling_factor", 0.0, "routed_scaling_factor"),
    ("expert_hidden", 0, "expert_hidden"),
    ("num_shared_experts", -1, "num_shared_experts"),
    ("norm_topk_prob", 1, "norm_topk_prob"),
])
def test_bad_config_names_the_field(field, value, word):
  with pytest.raises(ValueError, match=word):
    _config(**{field: value})


def test_param_shapes():
  shapes = moe.param_shapes(_config(), D, 3)
  assert shapes == {"router": (3, D, 8), "expert_bias": (3, 8), "experts_gate": (3, 8, D, 12),
                    "experts_up": (3, 8, D, 12), "experts_down": (3, 8, 12, D),
                    "shared_gate": (3, D, 12), "shared_up": (3, D, 12),
                    "shared_down": (3, 12, D)}
  assert "shared_gate" not in moe.param_shapes(_config(num_shared_experts=0), D, 3)
