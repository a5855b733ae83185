"""DiffusionGemma's mixture of experts under `jax.vmap` (a served lane vmaps the network over
its rows): `jax.lax.ragged_dot` has no batching rule, so a vmap over rows folds them into the
tokens (`moe.over_tokens`), one call over every row's tokens, bit for bit the unbatched call
on those tokens; gradients pass (fine-tuning differentiates through it)."""

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.models import gemma_blocks

EXPERTS, HIDDEN, D, K = 4, 3, 5, 2


def _layer():
  keys = jax.random.split(jax.random.key(0), 3)
  return {"experts_gating": jax.random.normal(keys[0], (EXPERTS, 2, HIDDEN, D)),
          "experts_linear": jax.random.normal(keys[1], (EXPERTS, HIDDEN, D)),
          "per_expert_scale": jax.random.uniform(keys[2], (EXPERTS,)) + 0.5}


def _inputs(rows: int, tokens: int):
  x = jax.random.normal(jax.random.key(1), (rows, tokens, D))
  chosen = jax.random.randint(jax.random.key(2), (rows, tokens, K), 0, EXPERTS)
  weights = jax.random.uniform(jax.random.key(3), (rows, tokens, K))
  return x, chosen, weights


def test_experts_under_vmap_are_the_folded_call():
  layer, (x, chosen, weights) = _layer(), _inputs(3, 4)
  vmapped = jax.jit(jax.vmap(lambda *a: gemma_blocks.experts(layer, *a)))(x, chosen, weights)
  folded = jax.jit(lambda *a: gemma_blocks.experts(layer, *a))(
      x.reshape(-1, D), chosen.reshape(-1, K), weights.reshape(-1, K))
  np.testing.assert_array_equal(vmapped, folded.reshape(3, 4, D))


def test_experts_differentiate():
  layer, (x, chosen, weights) = _layer(), _inputs(1, 4)
  loss = lambda layer, x: gemma_blocks.experts(layer, x, chosen[0], weights[0]).sum()
  grads = jax.grad(loss, argnums=(0, 1))(layer, x[0])
  assert all(bool(jnp.isfinite(g).all()) and bool((g != 0).any())
             for g in jax.tree.leaves(grads))
