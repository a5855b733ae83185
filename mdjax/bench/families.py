"""SDAR, Fast-dLLM v2 and LLaDA2: parity with the published code, the cached decoders against
the uncached ones and the published loops, and the memory each published size needs;
DiffusionGemma against gemma's own sampler and LLaDA2.1's editing decoder
(`mdjax.bench.families_gemma`: the "diffusion_gemma" and "llada21" sections).

  python -m mdjax.bench.families [--out=results] [--repeats=3]   # from the repository root
  python experiments/families_bench.py                           # the same
  python -m mdjax.bench.families --gpu [--repeats=3]             # one 80 GB GPU, below
  python -m mdjax.bench.families --only=diffusion_gemma,llada21   # those sections again

Run it with the reference extra's Python (torch, transformers) to include the published
loops; without torch it runs the rest and says so.

Parity: from the committed fixtures (tests/fixtures/<family>/, written by the published
modeling code: tests/reference/<family>.py), through `parity_figures()` of
tests/formats/test_<family>.py (no torch): the largest |mdjax - reference| of the finite
logits of a full pass and of the cached passes (a block against the cache of the blocks
before it), absolute and relative to the largest reference logit, and per generations.json
case whether mdjax's tokens equal the reference's.

Decoders: each family's default sampler, greedy (SDAR's at temperature 0: its default
samples), on a small random model of its network (SMALL; weights spread as the fixture
writers spread them, so that masked positions predict from their context) saved in the
published layout and loaded by `mdjax.load`, at batch 1 and 8 of random prompts:
`sample_blocks` with the exact block cache, the same recomputing the canvas at every call,
and, with torch, the published loop on the same folder (`bench_loop` of
tests/reference/<family>.py, with the knobs of mdjax's default plan). SDAR's and LLaDA2's
loops take one row at a time: at batch 8 their rows run one by one ("rows_one_by_one").
Times: medians of --repeats runs, mdjax's after a warm-up run (its compiles). Tokens are
compared row by row up to each row's first EOS (where every decoder ends the row).
`denoiser_calls` counts the sequential network passes: mdjax's the sampler's calls plus,
cached, one pass per block that appends it to the cache; the published loops' every
forward (SDAR and Fast-dLLM v2: their prompt prefill and a pass storing each finished
block, which in Fast-dLLM v2 also gives the next block's first token, a step of mdjax's
spec; LLaDA2's loop has no cache and recomputes the canvas). TPF (tokens per forward): new
tokens per row over the passes one row went through (a one-by-one loop's calls over the
batch).

Samplers: every registered sampler family's examples through `mdjax.generate` on each
small model (the rows record any refusal and its reason).

Memory: each published size's parameters, computed from its config.json through the
family's own loader (checked against the safetensors index's total_size where one is
published), its bfloat16 bytes, the key/value cache per token, and the number of 80 GB
devices an FSDP mesh (`mdjax.io.load(..., mesh=...)`) needs to hold the weights and a
batch-1 cache of 32k tokens with a fifth of the memory left for activations.

--gpu: the decoders (mdjax's, cached and uncached) on the published shapes of GPU_SHAPES
(SDAR-1.7B, LLaDA2.0-mini: 3.4 GB and 32.5 GB of bfloat16 weights) with random weights, 128
prompt and 256 new tokens, batch 1 and 8, and DiffusionGemma 26B-A4B's shape (47 GiB; a
canvas of 256 after 128, 48 steps) -> families_gpu.json. Not run on a CPU.

Writes results/families.json; fixed seeds.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import statistics
import subprocess
import tempfile
import time

import jax
import numpy as np

import mdjax
from mdjax import formats, generation, io, sampling
from mdjax.bench import families_gemma, timing
from mdjax.io import record
from mdjax.models import moe, published

FAMILIES = ("sdar", "fast_dllm_v2", "llada2")
DEVICE_BYTES = 80e9
CONTEXT_TOKENS = 32768
HEADROOM = 0.8  # of a device's memory for weights and cache

# --- the published sizes ------------------------------------------------------------------
#
# config.json's architecture keys of each published checkpoint. `source` says where each
# came from; `index_total_size` is the published model.safetensors.index.json's total_size
# (bytes of bfloat16 weights) where it was read, which the computed count must match.

_SDAR = {"model_type": "sdar", "architectures": ["SDARForCausalLM"], "head_dim": 128,
         "hidden_act": "silu", "max_position_embeddings": 32768, "mask_token_id": 151669,
         "eos_token_id": 151643, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
         "rope_scaling": None, "attention_bias": False, "use_sliding_window": False,
         "vocab_size": 151936, "block_size": 4, "torch_dtype": "bfloat16"}
_FAST_DLLM_V2 = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"],
                 "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "rope_scaling": None, "use_sliding_window": False,
                 "bd_size": 32, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
_LLADA2 = {"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "head_dim": 128,
           "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "rope_theta": 600000, "partial_rotary_factor": 0.5, "use_qk_norm": True,
           "use_qkv_bias": False, "use_bias": False, "num_experts": 256,
           "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "num_shared_experts": 1,
           "routed_scaling_factor": 2.5, "score_function": "sigmoid", "norm_topk_prob": True,
           "first_k_dense_replace": 1, "vocab_size": 157184, "tie_word_embeddings": False,
           "mask_token_id": 156895, "eos_token_id": 156892, "torch_dtype": "bfloat16"}

PUBLISHED = {
    "SDAR-1.7B-Chat": {"family": "sdar", "raw": {
        **_SDAR, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
        "source": "Qwen3-1.7B's dimensions, which SDAR-1.7B converts (config not read here)"},
    "SDAR-4B-Chat": {"family": "sdar", "raw": {
        **_SDAR, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
        "source": "JetAstra/SDAR@c2041a8 training/model/SDAR-4B-Chat/config.json",
        "index_total_size": 8822848512},
    "SDAR-8B-Chat": {"family": "sdar", "raw": {
        **_SDAR, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
        "source": "JetAstra/SDAR@c2041a8 training/model/SDAR-8B-Chat/config.json",
        "index_total_size": 16381470720},
    "Fast_dLLM_v2_1.5B": {"family": "fast_dllm_v2", "raw": {
        **_FAST_DLLM_V2, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True},
        "source": "Qwen2.5-1.5B-Instruct's dimensions, which it converts (config not read here)"},
    "Fast_dLLM_v2_7B": {"family": "fast_dllm_v2", "raw": {
        **_FAST_DLLM_V2, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "tie_word_embeddings": False},
        "source": "Efficient-Large-Model/Fast_dLLM_v2_7B config.json (the hub folder as "
                  "copied in Satgoy152/DualDiffusion@189fa7a)"},
    "LLaDA2.0-mini": {"family": "llada2", "raw": {
        **_LLADA2, "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
        "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4},
        "source": "Ling-mini-2.0's config, which LLaDA2.0-mini converts (a copy in the "
                  "code index)", "card": "16B total, 1.4B active"},
    "LLaDA2.0-flash": {"family": "llada2", "raw": {
        **_LLADA2, "hidden_size": 4096, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 4},
        "source": "32 layers, width 4096, 256 experts of 1024 (a published run's record of "
                  "the checkpoint); dense width and heads as Ling-flash-2.0's",
        "card": "100B total, 6.1B active"},
}


def memory_rows() -> list[dict]:
  """Each published size's parameters, bytes and the FSDP mesh it needs (module docstring)."""
  rows = []
  for name, entry in PUBLISHED.items():
    family = formats.get(entry["family"])
    config = family.config_from_hf(dict(entry["raw"]), "bfloat16")
    tied = family.tied(entry["raw"])
    params = published.num_params(config) - (config.vocab_size * config.d_model if tied else 0)
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    need = 2 * params + kv_per_token * CONTEXT_TOKENS
    devices = max(1, math.ceil(need / (HEADROOM * DEVICE_BYTES)))
    devices = 1 << (devices - 1).bit_length()  # a mesh of a power of two
    row = {"model": name, "family": entry["family"], "params": int(params),
           "params_bytes_bf16": int(2 * params), "kv_bytes_per_token": int(kv_per_token),
           "devices_80gb": devices, "mesh": f"jax.make_mesh(({devices},), ('fsdp',))",
           "source": entry["source"]}
    if config.moe is not None:
      m = config.moe
      active = params - (config.num_layers - m.first_dense_layers) * (
          m.num_experts - m.experts_per_token) * 3 * config.d_model * m.expert_hidden
      row["active_params"] = int(active)
    if "card" in entry:  # the model card's figures, to compare with the computed ones
      row["card"] = entry["card"]
    if "index_total_size" in entry:
      row["index_total_size"] = entry["index_total_size"]
      row["matches_index"] = 2 * params == entry["index_total_size"]
    rows.append(row)
    print(row, flush=True)
  return rows


# --- the decoders on small random models --------------------------------------------------

SMALL = {"vocab_size": 2048, "d_model": 256, "num_layers": 4, "num_heads": 4,
         "num_kv_heads": 2, "head_dim": 64, "mlp_hidden": 512, "rope_theta": 10000.0,
         "norm_eps": 1e-6, "mask_id": 2047, "eos_id": 2046, "max_len": 512, "dtype": "float32"}
SMALL_NETWORKS = {
    "sdar": {"qk_norm": True, "qkv_bias": False, "logit_shift": False, "block_size": 4},
    "fast_dllm_v2": {"qkv_bias": True, "logit_shift": True, "block_size": 8},
    "llada2": {"qk_norm": True, "qkv_bias": False, "logit_shift": False, "block_size": 8,
               "rotary_dim": 32, "moe": moe.MoEConfig(
                   num_experts=16, experts_per_token=4, expert_hidden=128,
                   num_shared_experts=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, first_dense_layers=1)},
}
SETTINGS = {"prompt_len": 16, "max_new_tokens": 32, "batches": (1, 8)}
# Each family's default sampler greedy: SDAR's samples at temperature 1 by default (its
# published loop's default), the others are greedy by default.
GREEDY = {"sdar": {"temperature": 0.0}, "fast_dllm_v2": {}, "llada2": {}}
# Scales of init_params' std-0.02 weights, after the fixture writers (tests/reference/): a
# unit embedding with a small mask row (masked positions predict from their context), a
# head of std 0.35 (spread logits), every matrix ~1/sqrt(fan-in) with sharper queries and keys
# (or q/k norm weights) and larger values: std-0.02 weights give near-uniform attention and
# logits, and every masked position of a block then predicts the same token.
SPREAD = {"embed": 50.0, "head": 17.5, "q": 7.5, "k": 7.5, "v": 4.5, "o": 4.5,
          "q_norm": 3.0, "k_norm": 3.0}
SPREAD_MATRIX, MASK_ROW = 3.0, 0.2


def spread(params: dict, mask_id: int) -> dict:
  """init_params' weights rescaled by SPREAD (other matrices by SPREAD_MATRIX; norm weights
  and biases kept), the mask's embedding row by MASK_ROW."""
  def one(path, x):
    name = path[-1].key
    if name in SPREAD:
      return x * SPREAD[name]
    if "norm" in name or "bias" in name:
      return x
    return x * SPREAD_MATRIX
  params = jax.tree_util.tree_map_with_path(one, params)
  return {**params, "embed": params["embed"].at[mask_id].multiply(MASK_ROW)}


def small_model(family: str, folder: str):
  """A random model of the family's network (SMALL), weights spread, saved in its published
  layout and loaded."""
  config = published.PublishedConfig(family=family, **SMALL, **SMALL_NETWORKS[family])
  params = spread(published.init_params(config, jax.random.key(0)), config.mask_id)
  io.save(params, folder, family=family, config=config)
  return mdjax.load(folder)


def decoder_rows(repeats: int) -> tuple[list[dict], list[dict], list[dict]]:
  """(the timed decoders at SETTINGS, every sampler family's run, LLaDA2.1's editing decoder)
  on the small model of each family of FAMILIES; the published loops where torch imports."""
  rows, samplers, llada21 = [], [], []
  for family in FAMILIES:
    with tempfile.TemporaryDirectory() as folder:
      model = small_model(family, folder)
      loop = _reference_loop(family, folder)
    rows += timed_decoders(model, loop, repeats, SETTINGS, GREEDY[family])
    samplers += sampler_rows(model)
    if family == "llada2":
      llada21 = families_gemma.llada21_rows(model, timed_decoders, repeats, SETTINGS)
  return rows, samplers, llada21


def sampler_rows(model) -> list[dict]:
  """Every registered sampler family's examples through `mdjax.generate` on the model: the
  prompt kept, no mask id left, the new tokens' count."""
  prompt_len, new = 8, 8
  prompt = np.arange(prompt_len, dtype=np.int32) + 3
  rows = []
  for name, family in sorted(sampling.families().items()):
    for i, spec in enumerate(family.examples(tuple(range(prompt_len, prompt_len + new)))):
      row = {"family": model.family, "sampler": name, "example": i}
      try:
        out = mdjax.generate(model, [prompt], max_new_tokens=new, key=jax.random.key(i),
                             spec=spec, stop_at_eos=False)
        ids = np.asarray(out[0].token_ids)
        row.update(ran=True, new_tokens=len(ids),
                   mask_left=bool((ids == model.mask_id).any()))
      except ValueError as error:  # refused before compiling, with its reason
        row.update(ran=False, refused=str(error).splitlines()[0][:200])
      rows.append(row)
  ran = sum(r["ran"] for r in rows)
  print(f"{model.family}: {ran} of {len(rows)} sampler examples ran", flush=True)
  return rows


def until_eos(tokens_BxN: np.ndarray, eos_id: int) -> list[list[int]]:
  """Each row up to and including its first EOS: where the decoders stop a row (what any of
  them writes after it is no output)."""
  rows = []
  for row in np.asarray(tokens_BxN).tolist():
    rows.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
  return rows


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
  """The first (row, position) where two decoders' rows differ, with both tokens."""
  for row, (x, y) in enumerate(zip(a, b)):
    for i in range(max(len(x), len(y))):
      if i >= len(x) or i >= len(y) or x[i] != y[i]:
        return {"row": row, "position": i, "tokens": [x[i] if i < len(x) else None,
                                                 y[i] if i < len(y) else None]}
  return None


# The published loops that take one row at a time (the others run the batch together).
ROWS_ONE_BY_ONE = {"sdar": True, "fast_dllm_v2": False, "llada2": True}


def timed_decoders(model, reference, repeats: int, settings: dict,
                   knobs: dict | None = None) -> list[dict]:
  """The model's default sampler (with `knobs`) by `sample_blocks`, cached and recomputing
  (and the published loop `reference`, if any) at each batch size of `settings`."""
  rows = []
  prompt_len, new = settings["prompt_len"], settings["max_new_tokens"]
  run = generation.sampler_plan(model, prompt_len, new, None, **(knobs or {}))
  for batch in settings["batches"]:
    prompt_BxP = np.random.default_rng(batch).integers(
        0, min(model.eos_id, model.mask_id), (batch, prompt_len)).astype(np.int32)
    seconds, tokens, calls = _one_batch(model, run, reference, repeats, prompt_BxP, new)
    for name, median in seconds.items():
      one_by_one = name == "reference_torch" and ROWS_ONE_BY_ONE[model.family]
      # TPF: new tokens per row over the sequential passes one row went through.
      per_row = calls[name] / batch if one_by_one else calls[name]
      row = {"family": model.family, "decoder": name, "batch": batch,
             "prompt_len": prompt_len, "max_new_tokens": new, "seconds": round(median, 4),
             "denoiser_calls": calls[name], "tpf": round(new / per_row, 3),
             "rows_one_by_one": one_by_one,
             "generated_lengths": [len(t) for t in tokens[name]],
             "tokens_equal_cached": tokens[name] == tokens["mdjax_cached"],
             "tokens_equal_reference": (tokens[name] == tokens["reference_torch"]
                                        if "reference_torch" in tokens else None)}
      if row["tokens_equal_reference"] is False:
        row["first_difference_from_reference"] = first_difference(
            tokens[name], tokens["reference_torch"])
      rows.append(row)
      print(row, flush=True)
  return rows


def _one_batch(model, run, reference, repeats: int, prompt_BxP: np.ndarray, new: int):
  """({decoder: median seconds}, {decoder: rows up to EOS}, {decoder: denoiser calls})."""
  batch, prompt_len = prompt_BxP.shape
  plan = generation.plan_generation(
      [prompt_len] * batch, new, max_len=model.max_len, model_block=run.denoiser.block_size,
      blocks_of=run.blocks_of, window=run.window,
      block_length=sampling.family_of(run.spec).block_length(run.spec))
  keys_B = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(0), np.arange(batch))
  seconds, tokens, calls = {}, {}, {}
  for name, cached in (("mdjax_cached", True), ("mdjax_uncached", False)):
    seconds[name], out = timing.median_run(functools.partial(
        _sample_blocks, run, model, keys_B, prompt_BxP, plan, cached), repeats)
    tokens[name] = until_eos(np.asarray(out.tokens_BxT)[:, prompt_len:prompt_len + new],
                             model.eos_id)
    calls[name] = int(out.nfe)
  if reference is not None:
    # torch compiles nothing: no warm-up call, the median of `repeats` runs.
    seconds["reference_torch"], (out, calls["reference_torch"]) = _median_cold(
        functools.partial(reference, prompt_BxP, new), repeats)
    tokens["reference_torch"] = until_eos(out, model.eos_id)
  return seconds, tokens, calls


def _sample_blocks(run, model, keys_B, prompt_BxP, plan, cached: bool):
  return jax.block_until_ready(sampling.sample_blocks(
      run.denoiser, model.params, keys_B, prompt_BxP, run.spec, length=plan.length,
      blocks_of=plan.blocks_of, window=plan.window, mask_id=model.mask_id, cached=cached))


def _median_cold(fn, repeats: int):
  """(median seconds of `repeats` calls, the last output), without a warm-up call."""
  times, out = [], None
  for _ in range(max(1, repeats)):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


GPU_SHAPES = ("SDAR-1.7B-Chat", "LLaDA2.0-mini")
GPU_SETTINGS = {"prompt_len": 128, "max_new_tokens": 256, "batches": (1, 8)}


def gpu_rows(repeats: int) -> list[dict]:
  """The published shapes GPU_SHAPES (names of PUBLISHED) with random bfloat16 weights (no
  download; spread as the small models'): the default samplers, greedy, as `timed_decoders`
  runs them at GPU_SETTINGS."""
  rows = []
  for name in GPU_SHAPES:
    entry = PUBLISHED[name]
    family = formats.get(entry["family"])
    config = family.config_from_hf(dict(entry["raw"]), "bfloat16")
    params = jax.jit(published.init_params, static_argnums=0)(config, jax.random.key(0))
    # Donated: LLaDA2.0-mini's 32.5 GB of weights must not be held twice.
    params = jax.jit(spread, static_argnums=1, donate_argnums=0)(params, config.mask_id)
    model = record.published_model(params=params, config=config, family=family.family,
                                   hf_config=dict(entry["raw"]))
    for row in timed_decoders(model, None, repeats, GPU_SETTINGS, GREEDY[entry["family"]]):
      rows.append({"model": name, **row})
  return rows


def _reference_loop(family: str, folder: str):
  """The published decoder on the checkpoint in `folder`, as (prompt_BxP, new) ->
  (new tokens B x new, denoiser calls); None without torch or the reference writers."""
  try:
    writer = importlib.import_module(f"tests.reference.{family}")
    return writer.bench_loop(folder)
  # The writers exit without torch; a missing published source is an OSError or a failed
  # `git show`.
  except (ImportError, AttributeError, SystemExit, OSError,
          subprocess.CalledProcessError) as error:
    print(f"{family}: no reference loop ({type(error).__name__}: {error})", flush=True)
    return None


# --- parity from the committed fixtures ---------------------------------------------------


def parity_rows() -> list[dict]:
  """What the parity tests assert, as figures (`parity_figures()` of
  tests/formats/test_<family>.py, computed from the committed fixtures; no torch). A
  family whose test module does not import (pytest absent) gets a row with the error."""
  rows = []
  for family in FAMILIES:
    try:
      test = importlib.import_module(f"tests.formats.test_{family}")
    except ImportError as error:
      rows.append({"family": family, "error": f"{type(error).__name__}: {error}"})
    else:
      rows.append({"family": family, **test.parity_figures()})
    print(rows[-1], flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--gpu", action="store_true",
                      help="time the decoders on the published shapes of GPU_SHAPES instead "
                           "(random bfloat16 weights; one 80 GB GPU) -> families_gpu.json")
  parser.add_argument("--only", default=None,
                      help="comma-separated sections of families.json to compute again "
                           f"({', '.join(ONLY)}), the others kept as the file has them")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    raise ValueError(f"--repeats={args.repeats} must be >= 1")
  os.makedirs(args.out, exist_ok=True)
  if args.only is not None:
    _update_sections(args.out, args.only.split(","), args.repeats)
    return
  if args.gpu:
    result = {"decoders": gpu_rows(args.repeats),
              "diffusion_gemma": families_gemma.gpu_rows(args.repeats),
              "device": jax.devices()[0].device_kind,
              "settings": GPU_SETTINGS, "repeats": args.repeats,
              "machine": timing.machine_info()}
    name = "families_gpu.json"
  else:
    decoders, samplers, llada21 = decoder_rows(args.repeats)
    result = {"parity": parity_rows(), "decoders": decoders, "samplers": samplers,
              "llada21": llada21,
              "diffusion_gemma": families_gemma.diffusion_gemma_rows(args.repeats),
              "memory": memory_rows(), "device": jax.devices()[0].device_kind,
              "settings": {**SETTINGS, "small": SMALL, "spread": SPREAD,
                           "spread_matrix": SPREAD_MATRIX, "mask_row": MASK_ROW,
                           "greedy_knobs": GREEDY},
              "repeats": args.repeats, "machine": timing.machine_info(),
              "torch": _torch_version()}
    name = "families.json"
  with open(os.path.join(args.out, name), "w") as f:
    json.dump(result, f, indent=1, default=str)
    f.write("\n")


# The sections `--only` computes again: the ones that need no other section's models.
ONLY = {"diffusion_gemma": families_gemma.diffusion_gemma_rows,
        "llada21": lambda repeats: families_gemma.llada21_rows(
            _small_llada2(), timed_decoders, repeats, SETTINGS)}


def _small_llada2():
  with tempfile.TemporaryDirectory() as folder:
    return small_model("llada2", folder)


def _update_sections(out: str, names: list[str], repeats: int) -> None:
  """families.json with the sections `names` computed again, every other key as it was."""
  unknown = sorted(set(names) - set(ONLY))
  if unknown:
    raise ValueError(f"--only={','.join(names)}: {unknown} are not sections it computes; "
                     f"they are {sorted(ONLY)}")
  path = os.path.join(out, "families.json")
  with open(path) as f:
    result = json.load(f)
  for name in names:
    result[name] = ONLY[name](repeats)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=str)
    f.write("\n")


def _torch_version() -> str | None:
  try:
    import torch
  except ImportError:
    return None
  return f"{torch.__version__}, {torch.get_num_threads()} threads"


if __name__ == "__main__":
  main()
