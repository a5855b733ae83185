"""What MDLM and BD3-LM share: the DiT of kuleshov-group/mdlm models/dit.py and bd3lms
models/hf (`mdjax.models.dit`): every tensor under `backbone.`, config keys hidden_dim,
cond_dim, n_blocks, n_heads, model_length, vocab_size (V + 1: the mask id V included),
time_conditioning; the rotary table stored as a buffer; GPT-2's EOS from config.json.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from mdjax.formats.base import (TORCH_DTYPES, Format, Leaf, config_bool, config_token_id,
                                config_value, leaf_shape, refuse_value)
from mdjax.denoiser import Denoiser
from mdjax.models import dit
from mdjax.models.dit import DiTConfig

# The reference DiT's fixed choices, which config.json has no key for.
DIT_FIXED = {"mlp_ratio": 4, "rope_base": 10000.0, "norm_eps": 1e-5}
# attn_backend values: each names a torch kernel of the same attention, so each is read and
# ignored without a word (the reference's own configs carry one).
ATTN_BACKENDS = ("sdpa", "flex", "flash_attn", "flash", "flash_attn_2")
INV_FREQ = "backbone.rotary_emb.inv_freq"


def inv_freq(config: DiTConfig) -> np.ndarray:
  """The reference's rotary buffer, 1 / base^(arange(0, K, 2) / K) in float32 (the power in
  float64: within one float32 ulp of torch's, which `save` keeps when the model has it)."""
  k = config.head_dim
  exponent = (np.arange(0, k, 2, dtype=np.float32) / np.float32(k)).astype(np.float64)
  return np.float32(1.0) / np.power(np.float64(config.rope_base), exponent).astype(np.float32)


_fold = jax.jit(dit.fold, static_argnums=0)


def sampled_config(model) -> DiTConfig:
  """`model.config`, checked to be a DiT's."""
  config = getattr(model, "config", None)
  if not isinstance(config, DiTConfig):
    raise ValueError(f"model.config={config!r} must be a mdjax.models.dit.DiTConfig (a MDLM "
                     "or BD3-LM checkpoint).")
  return config


def sampled_parts(model) -> tuple[Any, Any, DiTConfig]:
  """(denoiser, params, config) a DiT model is sampled with: `model.denoiser` (None:
  `dit.denoiser(config)`), its params and config; the default denoiser of a model without
  time conditioning is swapped for the folded one and params folded once."""
  config = sampled_config(model)
  apply_fn = getattr(model, "denoiser", None) or dit.denoiser(config)
  params = model.params
  if not config.time_conditioning and apply_fn == dit.denoiser(config):
    # Fold the adaLN terms once: the default denoiser folds them at every call, which a
    # call skipped by a branch (the cache) keeps XLA from hoisting out of the loop.
    apply_fn, params = dit.denoiser(config, folded=True), _fold(config, params)
  return apply_fn, params, config


class DiTFormat(Format):
  """The MDLM / BD3-LM DiT layout (module docstring)."""

  config_type = DiTConfig
  depth_key = "n_blocks"
  soft_keys = ("dropout", "return_dict", "attn_backend", "var_min", "sampling_eps_min",
               "sampling_eps_max")
  # The rotary table, and the variance-minimizing eps range BD3-LM's code (and a Lightning
  # module of either) registers: checked where they can be, never params.
  optional_buffers = (INV_FREQ, "sampling_eps_min", "sampling_eps_max")

  def tied(self, raw: dict) -> bool:
    return False

  def leaf_options(self, raw: dict) -> dict:
    return {"adaln": config_bool(raw, "adaln", self.family, True)}

  def _block_size(self, raw: dict, model_length: int) -> int | None:
    return None

  def config_from_hf(self, raw: dict, dtype: str) -> DiTConfig:
    f = self.family
    refuse_value(raw, f, "causal", (False, None), "the DiT's attention is bidirectional or "
                 "block-causal; causal is the autoregressive baseline")
    refuse_value(raw, f, "mlp_ratio", (4, None), "the reference's MLP is 4 x hidden_dim")
    backend = raw.get("attn_backend")
    if backend is not None and backend not in ATTN_BACKENDS:
      raise ValueError(f"{f} config.json: attn_backend={backend!r} is not one of the "
                       f"reference's ({', '.join(map(repr, ATTN_BACKENDS))})")
    vocab = config_value(raw, "vocab_size", int, f)
    if vocab < 2:
      raise ValueError(f"{f} config.json: vocab_size={vocab} must count the V real ids and "
                       "the mask id (>= 2)")
    hidden = config_value(raw, "hidden_dim", int, f)
    heads = config_value(raw, "n_heads", int, f)
    if heads < 1 or hidden % heads:
      raise ValueError(f"{f} config.json: hidden_dim={hidden} is not divisible by "
                       f"n_heads={heads}")
    length = config_value(raw, "model_length", int, f)
    block_size = self._block_size(raw, length)
    try:
      return DiTConfig(
          family=self.network, vocab_size=vocab - 1, hidden_dim=hidden,
          cond_dim=config_value(raw, "cond_dim", int, f),
          n_blocks=config_value(raw, "n_blocks", int, f),
          n_heads=heads, model_length=length, block_size=block_size,
          time_conditioning=config_bool(raw, "time_conditioning", f, False), dtype=dtype)
    except ValueError as e:
      raise ValueError(f"{f} config.json: {e}") from e

  def _check_writable(self, config):
    if not isinstance(config, DiTConfig) or config.family != self.network:
      given = f"{type(config).__name__}(family={getattr(config, 'family', None)!r})"
      raise ValueError(f"config {given} cannot be written as {self.family} (a DiTConfig of "
                       "that family)")
    for name, value in DIT_FIXED.items():
      if getattr(config, name) != value:
        raise ValueError(f"config.{name}={getattr(config, name)!r} cannot be written as "
                         f"{self.family}: the reference code fixes it at {value!r} (no "
                         "config.json key)")

  def _common_hf(self, config: DiTConfig) -> dict:
    return {"vocab_size": config.vocab_size + 1, "model_length": config.model_length,
            "hidden_dim": config.hidden_dim, "cond_dim": config.cond_dim,
            "n_blocks": config.n_blocks, "n_heads": config.n_heads, "dropout": 0.1,
            "time_conditioning": bool(config.time_conditioning), "return_dict": False,
            "torch_dtype": TORCH_DTYPES[config.dtype]}

  def leaves(self, config: DiTConfig, tied: bool = False, adaln: bool = True) -> list[Leaf]:
    g, b, o = "backbone", "backbone.blocks.{i}", "backbone.output_layer"
    out = [Leaf(("embed",), f"{g}.vocab_embed.embedding")]
    if adaln:
      out += [Leaf(("sigma_map", "w1"), f"{g}.sigma_map.mlp.0.weight", True),
              Leaf(("sigma_map", "b1"), f"{g}.sigma_map.mlp.0.bias"),
              Leaf(("sigma_map", "w2"), f"{g}.sigma_map.mlp.2.weight", True),
              Leaf(("sigma_map", "b2"), f"{g}.sigma_map.mlp.2.bias")]
    out += [Leaf(("blocks", "norm1"), f"{b}.norm1.weight"),
            Leaf(("blocks", "qkv"), f"{b}.attn_qkv.weight", True),
            Leaf(("blocks", "attn_out"), f"{b}.attn_out.weight", True),
            Leaf(("blocks", "norm2"), f"{b}.norm2.weight"),
            Leaf(("blocks", "mlp_in"), f"{b}.mlp.0.weight", True),
            Leaf(("blocks", "mlp_in_bias"), f"{b}.mlp.0.bias"),
            Leaf(("blocks", "mlp_out"), f"{b}.mlp.2.weight", True),
            Leaf(("blocks", "mlp_out_bias"), f"{b}.mlp.2.bias")]
    if adaln:
      out += [Leaf(("blocks", "ada"), f"{b}.adaLN_modulation.weight", True),
              Leaf(("blocks", "ada_bias"), f"{b}.adaLN_modulation.bias")]
    out += [Leaf(("final", "norm"), f"{o}.norm_final.weight")]
    if adaln:
      out += [Leaf(("final", "ada"), f"{o}.adaLN_modulation.weight", True),
              Leaf(("final", "ada_bias"), f"{o}.adaLN_modulation.bias")]
    out += [Leaf(("final", "linear"), f"{o}.linear.weight", True),
            Leaf(("final", "linear_bias"), f"{o}.linear.bias")]
    return out

  def synthesized(self, config: DiTConfig, raw: dict) -> dict[str, np.ndarray]:
    """adaln=False (no sigma_map, no adaLN tensors: plain norms, gates 1) as the params'
    adaLN terms: zero weights, so ada(c) is its bias exactly, with shift 0, scale 0, gate 1
    (the reference's adaln=False forward, bit for bit)."""
    if self.leaf_options(raw)["adaln"]:
      return {}
    dtype = np.dtype(config.jnp_dtype)
    shapes = dit.param_shapes(config)
    # Only cond_dim sizes them and no tensor bounds it: no more values than the stored weights.
    built = sum(math.prod(s) for s in (*shapes["sigma_map"].values(), shapes["blocks"]["ada"],
                                     shapes["final"]["ada"]))
    stored = sum(math.prod(leaf_shape(config, leaf)) for leaf in self.leaves(config, adaln=False))
    if built > max(stored, 2**24):
      raise ValueError(f"{self.family} config.json: cond_dim={config.cond_dim} with adaln false "
                       f"builds {built:,} zero adaLN values, more than the checkpoint's "
                       f"{stored:,} weights")
    zeros = lambda shape: np.zeros(shape, dtype)
    d = config.hidden_dim
    gates = np.zeros((6, d), dtype)
    gates[[2, 5]] = 1  # (shift, scale, gate) for attention, then for the MLP
    out = {f"sigma_map/{k}": zeros(v) for k, v in shapes["sigma_map"].items()}
    out["blocks/ada"] = zeros(shapes["blocks"]["ada"])
    out["blocks/ada_bias"] = np.broadcast_to(gates.reshape(-1),
                                             shapes["blocks"]["ada_bias"]).copy()
    out["final/ada"] = zeros(shapes["final"]["ada"])
    out["final/ada_bias"] = zeros(shapes["final"]["ada_bias"])
    return out

  def buffers(self, config: DiTConfig, raw: dict) -> dict[str, np.ndarray]:
    return {INV_FREQ: inv_freq(config)}

  def check_buffer(self, config: DiTConfig, name: str, value: np.ndarray, where: str):
    if name == INV_FREQ:
      want = inv_freq(config)
      if value.shape != want.shape or not np.allclose(value.astype(np.float32), want,
                                                      rtol=1e-5, atol=0):
        raise ValueError(f"{where}: tensor {name!r} is not the rotary table of base "
                         f"{config.rope_base} and head_dim {config.head_dim} (the reference's "
                         "fixed RoPE)")

  def denoiser(self, config: DiTConfig) -> Denoiser:
    return dit.denoiser(config)

  def special_ids(self, config: DiTConfig, hf_config: dict | None):
    """The mask id V; EOS where config.json names it (GPT-2's 50256); no end of turn."""
    eos = config_token_id(hf_config or {}, "eos_token_id", self.family)
    return config.mask_id, eos, None, 0 if eos is None else eos

  def max_len(self, config: DiTConfig) -> int:
    return config.model_length
