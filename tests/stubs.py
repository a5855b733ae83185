"""Small denoisers for tests: cheap, deterministic, dependent on the canvas."""

import jax
import jax.numpy as jnp
import numpy as np


def stub_params(vocab: int, length: int, seed: int = 0, quantum: float | None = None):
  """Random per-position logits and a token-mixing table.

  `quantum` rounds the tables so that logits tie often (for tie-break tests).
  """
  rng = np.random.default_rng(seed)
  pos = rng.normal(size=(length, vocab)).astype(np.float32)
  mix = (0.5 * rng.normal(size=(vocab + 1, vocab))).astype(np.float32)
  if quantum is not None:
    pos, mix = np.round(pos / quantum) * quantum, np.round(mix / quantum) * quantum
  return {"pos": jnp.asarray(pos), "mix": jnp.asarray(mix)}


def stub_logits_np(params, tokens_BxL: np.ndarray) -> np.ndarray:
  """The stub in numpy (the reference the tests compare against)."""
  pos, mix = np.asarray(params["pos"]), np.asarray(params["mix"])
  return pos[None] + mix[tokens_BxL].sum(1, keepdims=True)


@jax.jit
def stub_denoiser_inner(params, tokens_BxL):
  return params["pos"][None] + params["mix"][tokens_BxL].sum(1, keepdims=True)


def stub_denoiser(params, tokens_BxL, t_B):
  """Logits = per-position table + the sum of the canvas's token embeddings."""
  del t_B
  return stub_denoiser_inner(params, tokens_BxL)
