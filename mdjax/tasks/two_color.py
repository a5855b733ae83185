"""The two-color corpus: L = 2, data "red red" or "blue blue", each w.p. 1/2.

Its entropy is ln 2 nats per sequence. The exact denoiser copies the visible
position when there is one and predicts 1/2 each otherwise, so any sampler
that writes both positions in one step from independent per-position draws
produces an invalid pair ("red blue" or "blue red") half of the time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from mdjax.noise import exact
from mdjax.tasks.base import Task

RED, BLUE = 0, 1
VOCAB_SIZE = 2
MASK_ID = 2
LENGTH = 2
ENTROPY_NATS = math.log(2.0)


@functools.partial(jax.jit, static_argnames="batch")
def sample_data(key: jax.Array, batch: int) -> jax.Array:
  """Draws `batch` sequences from the data law."""
  color_B = jax.random.bernoulli(key, 0.5, (batch,)).astype(jnp.int32)
  return jnp.stack([color_B, color_B], axis=-1)


def exact_denoiser(params, tokens_BxL: jax.Array, t_B: jax.Array) -> jax.Array:
  """Exact p(x_i | visible tokens) as logits; `params` and `t_B` are unused."""
  del params, t_B
  other_BxL = tokens_BxL[:, ::-1]
  copy_BxLxV = jnp.where(
      jax.nn.one_hot(other_BxL, VOCAB_SIZE, dtype=bool), 0.0, -jnp.inf
  )
  uniform_BxLxV = jnp.zeros(tokens_BxL.shape + (VOCAB_SIZE,))
  other_visible_BxL = other_BxL != MASK_ID
  return jnp.where(other_visible_BxL[..., None], copy_BxLxV, uniform_BxLxV)


def uniform_denoiser(params, tokens_BxL: jax.Array, t_B: jax.Array) -> jax.Array:
  """Predicts 1/2 each everywhere: a strictly worse model, for comparison."""
  del params, t_B
  return jnp.zeros(tokens_BxL.shape + (VOCAB_SIZE,))


def invalid_fraction(tokens_BxL: jax.Array) -> jax.Array:
  """Fraction of rows whose two colors differ (or that hold a mask)."""
  invalid_B = (tokens_BxL[:, 0] != tokens_BxL[:, 1]) | (tokens_BxL == MASK_ID).any(-1)
  return invalid_B.mean()


def empty_canvas(batch: int) -> jax.Array:
  """An all-masked canvas of `batch` rows."""
  return jnp.full((batch, LENGTH), MASK_ID, jnp.int32)


def decode(tokens_L) -> str:
  return " ".join({RED: "red", BLUE: "blue", MASK_ID: "?"}[int(t)] for t in tokens_L)


def sample_metrics(tokens_BxL: jax.Array) -> dict[str, float]:
  """Per-set metrics: the invalid fraction (exact samplers give 0)."""
  return {"invalid_fraction": float(invalid_fraction(tokens_BxL))}


def support() -> exact.Support:
  """The law enumerated: "red red" and "blue blue", 1/2 each."""
  return exact.Support.of_sequences([[RED, RED], [BLUE, BLUE]], [0.5, 0.5], VOCAB_SIZE)


TASK = Task(name="two_color", length=LENGTH, vocab_size=VOCAB_SIZE, mask_id=MASK_ID,
            sample_data=sample_data, decode=decode, sample_metrics=sample_metrics,
            exact_denoiser=exact_denoiser, support=support)


def bind(**task_kwargs) -> Task:
  """The task value (two_color takes no parameters)."""
  if task_kwargs:
    raise ValueError(f"task_kwargs={task_kwargs!r}: task 'two_color' takes no parameters.")
  return TASK
