"""MDLM's and BD3-LM's sampler loops in torch, transcribed, for `python -m mdjax.bench.dit`.

The loops run on bd3lms' Hugging Face BD3LM network (MDLM is the same class with cross_attn
False, as tests/reference/dit.py builds it), its weights copied from mdjax's DiT params:
  mdlm `Diffusion._sample` with predictor ddpm_cache (`_ddpm_caching_update`: p_x0 reused
    while x is unchanged) and noise removal;
  bd3lms `Diffusion._semi_ar_sampler` with first_hitting and nucleus_p, with its KV cache
    (`sampling.kv_cache`: the block-only pass, one store_kv pass per finished block). Its
    `reset_kv_cache` allocates a bfloat16 CUDA buffer; here the same buffer is float32 on the
    CPU. The reference's first hitting needs batch 1 (`.item()`).
"""

from __future__ import annotations

import numpy as np

try:
  import torch
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

from tests.reference import dit as dit_reference


def setup(threads: int) -> str:
  """Seeds torch and sets its threads; what ran, for the results' device line."""
  torch.manual_seed(0)
  torch.set_num_threads(threads)
  return f"torch {torch.__version__} ({torch.get_num_threads()} thread)"


def torch_state(params: dict, n_blocks: int, head_dim: int, var_min: bool
                ) -> dict[str, np.ndarray]:
  """mdjax's DiT params as the reference's state dict (torch Linear weights are [out, in])."""
  p = _flat(params)
  b = "backbone"
  out = {f"{b}.vocab_embed.embedding": p["embed"],
         f"{b}.sigma_map.mlp.0.weight": p["sigma_map.w1"].T,
         f"{b}.sigma_map.mlp.0.bias": p["sigma_map.b1"],
         f"{b}.sigma_map.mlp.2.weight": p["sigma_map.w2"].T,
         f"{b}.sigma_map.mlp.2.bias": p["sigma_map.b2"],
         f"{b}.rotary_emb.inv_freq": dit_reference.inv_freq(head_dim)}
  names = {"norm1": ("norm1.weight", False), "qkv": ("attn_qkv.weight", True),
           "attn_out": ("attn_out.weight", True), "norm2": ("norm2.weight", False),
           "mlp_in": ("mlp.0.weight", True), "mlp_in_bias": ("mlp.0.bias", False),
           "mlp_out": ("mlp.2.weight", True), "mlp_out_bias": ("mlp.2.bias", False),
           "ada": ("adaLN_modulation.weight", True), "ada_bias": ("adaLN_modulation.bias", False)}
  for i in range(n_blocks):
    for ours, (theirs, transpose) in names.items():
      x = p[f"blocks.{ours}"][i]
      out[f"{b}.blocks.{i}.{theirs}"] = x.T if transpose else x
  o = f"{b}.output_layer"
  out.update({f"{o}.norm_final.weight": p["final.norm"],
              f"{o}.linear.weight": p["final.linear"].T, f"{o}.linear.bias": p["final.linear_bias"],
              f"{o}.adaLN_modulation.weight": p["final.ada"].T,
              f"{o}.adaLN_modulation.bias": p["final.ada_bias"]})
  if var_min:  # BD3LM's registered buffers
    out.update(sampling_eps_min=np.float32(1e-3), sampling_eps_max=np.float32(0.999))
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = np.asarray(v, np.float32)
  return out


def raw_config(config) -> dict:
  """The reference's config.json for an mdjax `DiTConfig`."""
  raw = {"model_type": config.family, "vocab_size": config.vocab_size + 1,
         "model_length": config.model_length, "hidden_dim": config.hidden_dim,
         "cond_dim": config.cond_dim, "n_blocks": config.n_blocks, "n_heads": config.n_heads,
         "dropout": 0.0, "time_conditioning": False, "return_dict": False}
  if config.family == "bd3lm":
    raw.update(block_size=config.block_size, cross_attn=True, adaln=True, causal=False,
               var_min=True, sampling_eps_min=1e-3, sampling_eps_max=0.999)
  return raw


Bd3lms = dit_reference.Bd3lms  # bd3lms' files, imported by path from a checkout


def reference_net(bd3: Bd3lms, config, params):
  """bd3lms' network holding mdjax's DiT params (`config` a `DiTConfig`)."""
  state = torch_state(params, config.n_blocks, config.hidden_dim // config.n_heads,
                      var_min=config.family == "bd3lm")
  return bd3.model(raw_config(config), state)


@torch.no_grad()
def forward(net, tokens_BxL: np.ndarray, sample_mode: bool) -> np.ndarray:
  """The network's logits at sigma 0."""
  batch = tokens_BxL.shape[0]
  return net(torch.from_numpy(tokens_BxL), torch.zeros(batch), sample_mode=sample_mode).numpy()


def subs(logits: torch.Tensor, x: torch.Tensor, mask_index: int) -> torch.Tensor:
  """`Diffusion._subs_parameterization` (both repos)."""
  logits = logits.clone()
  logits[:, :, mask_index] += -1000000.0
  logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
  unmasked = x != mask_index
  logits[unmasked] = -1000000.0
  logits[unmasked, x[unmasked]] = 0
  return logits


def sample_categorical(probs: torch.Tensor) -> torch.Tensor:
  gumbel_norm = 1e-10 - (torch.rand_like(probs) + 1e-10).log()
  return (probs / gumbel_norm).argmax(dim=-1)


@torch.no_grad()
def mdlm_reference(net, *, batch: int, steps: int, length: int, mask_index: int,
                   eps: float = 1e-5):
  """mdlm `_sample` (ddpm_cache, noise_removal, time_conditioning False): (x, nfe)."""
  x = torch.full((batch, length), mask_index, dtype=torch.long)
  timesteps = torch.linspace(1, eps, steps + 1)
  dt = (1 - eps) / steps
  p_x0_cache, nfe = None, 0
  zero = torch.zeros(batch)
  for i in range(steps):
    t = timesteps[i]
    if p_x0_cache is None:  # _ddpm_caching_update
      p_x0_cache = subs(net(x, zero), x, mask_index).exp()
      nfe += 1
    q_xs = p_x0_cache * (t - (t - dt))
    q_xs[:, :, mask_index] = t - dt
    x_next = sample_categorical(q_xs)
    copy_flag = (x != mask_index).to(x.dtype)
    x_next = copy_flag * x + (1 - copy_flag) * x_next
    if not torch.allclose(x_next, x):
      p_x0_cache = None
    x = x_next
  x = subs(net(x, zero), x, mask_index).argmax(dim=-1)  # noise_removal
  return x, nfe + 1


def nucleus(p_x0: torch.Tensor, p: float) -> torch.Tensor:
  """bd3lms `_nucleus_sample` (on the block's probabilities)."""
  if p == 1.0:
    return p_x0
  sorted_probs, sorted_indices = p_x0.sort(dim=-1, descending=True)
  nucleus_mask = sorted_probs.cumsum(dim=-1) <= p
  nucleus_mask[..., 0] = 1
  p_x0 = p_x0.clone().scatter_(-1, sorted_indices, sorted_probs * nucleus_mask)
  return p_x0 / p_x0.sum(-1, keepdim=True)


def reset_kv_cache(net, batch: int):
  """`BD3LM.reset_kv_cache` on the CPU in float32 (the original allocates bfloat16 on CUDA)."""
  for block in net.backbone.blocks:
    block.kv_cache = torch.zeros(batch, net.config.model_length, net.config.hidden_dim * 3)
    block.cache_idx = 0


@torch.no_grad()
def bd3lm_reference(net, *, seqlen: int, nucleus_p: float, mask_index: int, block_size: int,
                    context_size: int, bos_id: int, num_steps: int = 5000,
                    kv_cache: bool = True, rng=None):
  """bd3lms `_semi_ar_sampler` (first_hitting, batch 1, BOS first): (x, nfe)."""
  if kv_cache:
    reset_kv_cache(net, 1)
  else:
    for layer in net.backbone.blocks:
      layer.kv_cache = None
  nfe = 0
  for stride_num in range(seqlen // block_size):
    if stride_num == 0:
      x_accum = torch.full((1, block_size), mask_index, dtype=torch.long)
      x_accum[:, 0] = bos_id
    else:
      x_accum = torch.cat((x_accum, torch.full((1, block_size), mask_index,
                                               dtype=torch.long)), dim=1)
    end_idx = (stride_num + 1) * block_size
    fwd_idx = torch.arange(max(end_idx - context_size, 0), end_idx)
    t = 1.0
    for _ in range(num_steps):
      if mask_index not in x_accum:
        break
      u = rng.random()
      num_masked = (x_accum[:, fwd_idx] == mask_index).sum(-1).item()
      t *= u ** (1 / num_masked)
      x = x_accum[:, fwd_idx]
      # _ddpm_caching_update(first_hitting): the cache is never reused (x always changes)
      sigma_t = torch.zeros(1)  # time_conditioning False: the network zeroes sigma
      if kv_cache:
        logits = net(x[:, -block_size:], sigma_t, sample_mode=True)
      else:
        logits = net(x, sigma_t, sample_mode=True)
      nfe += 1
      x_blk = x[:, -block_size:]
      p_x0 = nucleus(subs(logits[:, -block_size:].to(torch.float64), x_blk, mask_index).exp(),
                     nucleus_p)
      x_block = sample_categorical(p_x0)
      masked = (x_blk == mask_index)
      ind = torch.randint(0, int(masked.sum()), (1,))
      ind = masked.nonzero()[ind, 1]
      hit = (torch.arange(block_size) == ind[:, None]).to(x_block.dtype)
      x_block = x_block * hit + x_blk * (1 - hit)
      copy_flag = (x_blk != mask_index).to(x.dtype)
      x_block = copy_flag * x_blk + (1 - copy_flag) * x_block
      if kv_cache and mask_index not in x_block:
        net(x_block, sigma_t, sample_mode=True, store_kv=True)
        nfe += 1
      x_accum[:, fwd_idx] = torch.cat((x[:, :-block_size], x_block), dim=-1)
  return x_accum, nfe
