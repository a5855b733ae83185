"""MDLM's and BD3-LM's samplers in mdjax against the reference PyTorch sampler loops, on CPU.

  pip install -e '.[reference]'
  python experiments/dit_bench.py --bd3lms PATH [--out results/dit.json] [--repeats 3]

PATH: a checkout or git directory of github.com/kuleshov-group/bd3lms (its Hugging Face BD3LM
network runs the torch side; MDLM is the same class with cross_attn False, as
experiments/dit_reference.py builds it). Writes {"parity": [...], "rows": [...]}:

  parity: max |logit difference| of mdjax's DiT against the reference network: the fixtures'
    recorded logits (tests/fixtures/dit/reference_logits.npz, MDLM, MDLM time-conditioned,
    BD3-LM's sampling pass, BD3-LM's [x_t; x_0] training pass), and the benchmark models.
  rows: one per (model, sampler): wall time of one sampling run (median of --repeats, after
    a warm-up run that compiles), nfe (network passes) and saved_calls (steps whose pass was
    skipped or reused). The torch loops are transcriptions of the references, kept here:
      mdlm `Diffusion._sample` with predictor ddpm_cache (`_ddpm_caching_update`: p_x0
        reused while x is unchanged) and noise removal;
      bd3lms `Diffusion._semi_ar_sampler` with first_hitting and nucleus_p, with its KV cache
        (`sampling.kv_cache`: the block-only pass, one store_kv pass per finished block). Its
        `reset_kv_cache` allocates a bfloat16 CUDA buffer; here the same buffer is float32 on
        the CPU. The reference's first hitting needs batch 1 (`.item()`), so its rows are
        batch 1; mdjax's are batch 1 and 8.
  Both sides sample a tiny random DiT (float32, 4 blocks of width 128, 2048 ids, 128
  positions; BD3-LM block 4) built once by `mdjax.models.dit.init_params` and copied into the
  reference's state dict. Nothing under mdjax/ imports torch; this script does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mdjax.models import dit  # noqa: E402
from mdjax.pretrained import dit_samplers  # noqa: E402

try:
  import torch
  from experiments import dit_reference
except ImportError as e:
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

FIXTURES = ROOT / "tests" / "fixtures" / "dit"
V, HIDDEN, COND, BLOCKS, HEADS, LENGTH, BLOCK = 2048, 128, 64, 4, 4, 128, 4
BOS = 0


@dataclasses.dataclass(frozen=True)
class Model:
  params: dict
  config: dit.DiTConfig
  apply_fn: object = None


def torch_state(params: dict, n_blocks: int, var_min: bool) -> dict[str, np.ndarray]:
  """mdjax's DiT params as the reference's state dict (torch Linear weights are [out, in])."""
  p = _flat(params)
  b = "backbone"
  out = {f"{b}.vocab_embed.embedding": p["embed"],
         f"{b}.sigma_map.mlp.0.weight": p["sigma_map.w1"].T,
         f"{b}.sigma_map.mlp.0.bias": p["sigma_map.b1"],
         f"{b}.sigma_map.mlp.2.weight": p["sigma_map.w2"].T,
         f"{b}.sigma_map.mlp.2.bias": p["sigma_map.b2"],
         f"{b}.rotary_emb.inv_freq": dit_reference.inv_freq(HIDDEN // HEADS)}
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


def raw_config(config: dit.DiTConfig) -> dict:
  raw = {"model_type": config.family, "vocab_size": config.vocab_size + 1,
         "model_length": config.model_length, "hidden_dim": config.hidden_dim,
         "cond_dim": config.cond_dim, "n_blocks": config.n_blocks, "n_heads": config.n_heads,
         "dropout": 0.0, "time_conditioning": False, "return_dict": False}
  if config.family == "bd3lm":
    raw.update(block_size=config.block_size, cross_attn=True, adaln=True, causal=False,
               var_min=True, sampling_eps_min=1e-3, sampling_eps_max=0.999)
  return raw


# --- the reference loops, transcribed ------------------------------------------------------


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


def mdlm_reference(net, *, batch: int, steps: int, eps: float = 1e-5):
  """mdlm `_sample` (ddpm_cache, noise_removal, time_conditioning False): (x, nfe)."""
  mask_index = V
  x = torch.full((batch, LENGTH), mask_index, dtype=torch.long)
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


def bd3lm_reference(net, *, seqlen: int, nucleus_p: float, num_steps: int = 5000,
                    kv_cache: bool = True, rng=None):
  """bd3lms `_semi_ar_sampler` (first_hitting, batch 1, BOS first): (x, nfe)."""
  mask_index, block_size, context_size = V, BLOCK, LENGTH
  ones = torch.ones((1, 1))
  if kv_cache:
    reset_kv_cache(net, 1)
  else:
    for layer in net.backbone.blocks:
      layer.kv_cache = None
  nfe = 0
  for stride_num in range(seqlen // block_size):
    if stride_num == 0:
      x_accum = torch.full((1, block_size), mask_index, dtype=torch.long)
      x_accum[:, 0] = BOS
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


# --- measuring ------------------------------------------------------------------------------


def timed(fn, repeats: int):
  """(median seconds of `repeats` runs after one warm-up run, the last output)."""
  out = fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def block(x):
  return jax.block_until_ready(x)


def parity_rows(bd3) -> list[dict]:
  from mdjax import pretrained
  ref = np.load(FIXTURES / "reference_logits.npz")
  rows = []
  for name in ("mdlm", "mdlm_time", "bd3lm"):
    model = pretrained.load(str(FIXTURES / name))
    cfg = model.config
    ours = dit.forward(cfg, model.params, ref[f"{name}_tokens"], ref[f"{name}_sigma"])
    setting = "sampling pass (block-causal)" if cfg.block_size else "forward"
    rows.append({"model": f"fixture {name}", "setting": setting,
                 "max_abs_logit_diff": float(np.abs(np.asarray(ours) - ref[f"{name}_logits"]).max())})
    if cfg.block_size:
      subs_ours = np.asarray(model.apply_fn.block_pair(model.params, ref["bd3lm_pair_xt"],
                                                        ref["bd3lm_pair_x0"], ref["bd3lm_pair_t"]))
      theirs = ref["bd3lm_pair_subs"][..., :cfg.vocab_size]
      finite = np.isfinite(subs_ours) & (theirs > -1e5)
      rows.append({"model": "fixture bd3lm", "setting": "[x_t; x_0] training pass, SUBS log-probs",
                   "max_abs_logit_diff": float(np.abs(subs_ours - theirs)[finite].max())})
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--bd3lms", type=pathlib.Path, required=True)
  parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "dit.json")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--mdlm_steps", type=int, default=128)
  parser.add_argument("--bd3lm_length", type=int, default=2 * LENGTH)
  # As many torch threads as XLA's pool uses (every core) on a quiet machine; on a shared
  # one, torch's threads suffer far more from contention (single passes up to 40x slower):
  # pass --torch_threads=1 there and say so.
  parser.add_argument("--torch_threads", type=int, default=os.cpu_count() or 1)
  args = parser.parse_args(argv)
  torch.manual_seed(0)
  torch.set_num_threads(args.torch_threads)
  bd3 = dit_reference.Bd3lms(args.bd3lms)
  parity = parity_rows(bd3)
  rows = []
  with torch.no_grad():
    for family in ("mdlm", "bd3lm"):
      cfg = dit.DiTConfig(family=family, vocab_size=V, hidden_dim=HIDDEN, cond_dim=COND,
                          n_blocks=BLOCKS, n_heads=HEADS, model_length=LENGTH,
                          block_size=BLOCK if family == "bd3lm" else None)
      model = Model(params=dit.init_params(cfg, jax.random.key(0)), config=cfg)
      net = bd3.model(raw_config(cfg), torch_state(model.params, BLOCKS, family == "bd3lm"))
      tokens = np.random.default_rng(0).integers(0, V + 1, (2, LENGTH))
      theirs = net(torch.from_numpy(tokens), torch.zeros(2), sample_mode=family == "bd3lm")
      ours = dit.forward(cfg, model.params, tokens, np.zeros(2))
      parity.append({"model": f"bench {family}", "setting": "forward on 2 x 128 tokens",
                     "max_abs_logit_diff": float(np.abs(np.asarray(ours) - theirs.numpy()).max())})
      if family == "mdlm":
        for batch in (1, 8):
          steps = args.mdlm_steps
          seconds, out = timed(lambda: block(dit_samplers.mdlm_sample(
              model, num_samples=batch, steps=steps, key=jax.random.key(1))), args.repeats)
          rows.append({"model": "mdlm", "sampler": "mdjax mdlm_sample (MDLMSpec, ddpm_cache)",
                       "steps": steps, "batch": batch, "length": LENGTH,
                       "time_s": seconds, "nfe": int(out.nfe), "saved_calls": int(out.saved_calls)})
          seconds, (_, nfe) = timed(lambda: mdlm_reference(net, batch=batch, steps=steps),
                                    args.repeats)
          rows.append({"model": "mdlm", "sampler": "torch reference _sample (ddpm_cache)",
                       "steps": steps, "batch": batch, "length": LENGTH, "time_s": seconds,
                       "nfe": nfe, "saved_calls": steps + 1 - nfe})
      else:
        length = args.bd3lm_length
        for batch in (1, 8):
          seconds, out = timed(lambda: block(dit_samplers.bd3lm_sample(
              model, num_samples=batch, length=length, bos_id=BOS, nucleus_p=0.9,
              key=jax.random.key(1))), args.repeats)
          rows.append({"model": "bd3lm", "sampler": "mdjax bd3lm_sample (first hitting, "
                       "nucleus 0.9, exact KV cache)", "steps": "first hitting",
                       "batch": batch, "length": length, "time_s": seconds,
                       "nfe": int(out.nfe), "saved_calls": int(out.saved_calls)})
        rng = np.random.default_rng(0)
        for kv in (True, False):
          seconds, (_, nfe) = timed(lambda: bd3lm_reference(
              net, seqlen=length, nucleus_p=0.9, kv_cache=kv, rng=rng), args.repeats)
          rows.append({"model": "bd3lm", "sampler": "torch reference _semi_ar_sampler "
                       f"(first hitting, nucleus 0.9, kv_cache={kv})", "steps": "first hitting",
                       "batch": 1, "length": length, "time_s": seconds, "nfe": nfe,
                       "saved_calls": 0})
  result = {"device": f"CPU, {os.cpu_count()} cores, shared; jax {jax.__version__}, torch "
                      f"{torch.__version__} ({torch.get_num_threads()} thread)",
            "parity": parity, "rows": rows}
  args.out.write_text(json.dumps(result, indent=1) + "\n")
  for row in parity + rows:
    print(row)


if __name__ == "__main__":
  main()
