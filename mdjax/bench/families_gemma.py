"""DiffusionGemma's and LLaDA2.1's rows of `python -m mdjax.bench.families`.

DiffusionGemma: mdjax's default sampler (gemma's DiffusionSampler whole: the
`diffusion_gemma_canvases` family, canvases in turn against the cache) against gemma's own,
on the tiny model of the tests (tests/fixtures/diffusion_gemma) and a small random one
(SMALL), at batch 1 and 8 of one prompt, no early stop (a fixed step count on both sides),
entropy bound 0.1; mdjax's program compiled once (a warm-up call), the median of `repeats`.
gemma's figures are its compiled sampling loop's, timed by
tests/reference/diffusion_gemma_bench.py in gemma's environment (Python 3.12, outside CI)
and read from REFERENCE when it is there (the row says so when it is not). Both draw with
rng jax.random.key(0) for row 0 (gemma's batch draws its rows from that one key; mdjax's
rows from their own keys, row 0's that one), so on the tiny model row 0's tokens are compared.

LLaDA2.1: its editing decoder (the llada2 format's default plan with `editing_threshold`,
the `llada21` family block by block) on the small random LLaDA2 model of the families bench,
cached and recomputing, as `timed_decoders` times the others (the published generate needs
torch and a bench loop of tests/reference/llada21.py: none yet).

`gpu_command()`: the prepared command for the published shape (DiffusionGemma 26B-A4B with
random bfloat16 weights, a canvas of 256 after a 128-token prompt), run with --gpu.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import numpy as np

import mdjax
from mdjax import generation, sampling
from mdjax.bench import timing
from mdjax.formats import diffusion_gemma as layout
from mdjax.io import record
from mdjax.models import diffusion_gemma as network

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "diffusion_gemma")
REFERENCE = os.path.join(REPO, "results", "families_gemma_reference.json")
# The fixture's architecture where its tree is silent (tests/formats/test_diffusion_gemma.py).
TINY_GIVEN = {"sliding_window": 4, "experts_per_token": 2, "max_len": 64}
SMALL = network.DiffusionGemmaConfig(
    vocab_size=1024, d_model=128, layer_types=("local", "local", "global") * 2, num_heads=4,
    head_dim=32, num_kv_heads=2, global_head_dim=64, num_global_kv_heads=1,
    sliding_window=64, mlp_hidden=256, num_experts=8, experts_per_token=2, expert_hidden=128,
    condition_hidden=256, max_len=1024, dtype="float32")
# name -> (prompt length, canvas width, canvases, steps a canvas): the reference script's.
MODELS = {"tiny": (9, 8, 3, 8), "small": (32, 64, 2, 16)}
BATCHES = (1, 8)
KNOBS = dict(entropy_bound=0.1, early_stop=False, entropy_stop=None)
# The published shape on an accelerator (DiffusionGemmaConfig's defaults: 26B-A4B, bfloat16,
# random weights, 47 GiB): a canvas of 256 after a 128-token prompt, 48 steps.
GPU_CONFIG = network.DiffusionGemmaConfig()
GPU = {"prompt_len": 128, "canvas": 256, "canvases": 1, "steps": 48}


def tiny_model():
  return mdjax.load(os.path.join(FIXTURE, "params"), config=TINY_GIVEN)


def small_model(config: network.DiffusionGemmaConfig = SMALL, seed: int = 0):
  """A random model of `config`: init_params' weights, the embedding and matrices spread
  (std-0.02 weights give near-uniform logits: every canvas position would draw alike)."""
  params = network.init_params(config, jax.random.key(seed))
  spread = lambda path, x: x if ("norm" in jax.tree_util.keystr(path)
                                 or "scale" in jax.tree_util.keystr(path)) else x * 25.0
  params = jax.tree_util.tree_map_with_path(spread, params)
  return record.published_model(params=params, config=config, family=network.FAMILY).replace(
      noise=layout.noise_of(config))


def _run(run, model, keys_B, canvas_BxL):
  return jax.block_until_ready(sampling.sample(run.denoiser, model.params, keys_B, canvas_BxL,
                                               run.spec, mask_id=model.mask_id))


def mdjax_rows(model, name: str, settings: tuple, repeats: int, prompt_1xP) -> list[dict]:
  """mdjax's default sampler at each batch size: median seconds, denoiser calls, row 0."""
  prompt_len, width, count, steps = settings
  new = width * count
  run = generation.sampler_plan(model, prompt_len, new, None, steps=steps,
                                reference_length=width, **KNOBS)
  rows = []
  for batch in BATCHES:
    canvas = np.concatenate([np.tile(prompt_1xP, (batch, 1)),
                             np.full((batch, new), model.mask_id, np.int32)], 1)
    # Row 0 draws with key(0), gemma's rng; the others with their own.
    keys_B = jax.random.split(jax.random.key(1), batch).at[0].set(jax.random.key(0))
    seconds, out = timing.median_run(functools.partial(_run, run, model, keys_B, canvas),
                                     repeats)
    rows.append(dict(family="diffusion_gemma", model=name, decoder="mdjax", batch=batch,
                     prompt_len=prompt_len, canvas=width, canvases=count, steps=steps,
                     seconds=round(seconds, 4), denoiser_calls=int(out.nfe),
                     tokens_row0=np.asarray(out.tokens_BxL)[0, prompt_len:].tolist()))
  return rows


def reference_rows() -> dict | None:
  """gemma's figures (tests/reference/diffusion_gemma_bench.py's JSON), or None."""
  if not os.path.isfile(REFERENCE):
    return None
  with open(REFERENCE) as f:
    return json.load(f)


def until_stop(tokens: list[int], stops=(1, 106, 50)) -> list[int]:
  """Tokens up to and including the first end token (gemma writes 0 after it, mdjax EOS)."""
  for i, t in enumerate(tokens):
    if t in stops:
      return tokens[:i + 1]
  return tokens


def diffusion_gemma_rows(repeats: int) -> dict:
  """mdjax's and gemma's rows side by side (module docstring)."""
  reference = reference_rows()
  theirs = {(r["model"], r["batch"]): r for r in (reference or {}).get("rows", [])}
  rows = []
  prompt_tiny = np.asarray(np.load(os.path.join(FIXTURE, "reference.npz"))["prompt_BxP"][:1])
  prompt_small = np.random.default_rng(0).integers(3, SMALL.vocab_size,
                                                   (1, MODELS["small"][0])).astype(np.int32)
  for name, model, prompt in (("tiny", tiny_model(), prompt_tiny),
                              ("small", small_model(), prompt_small)):
    for row in mdjax_rows(model, name, MODELS[name], repeats, prompt):
      ref = theirs.get((name, row["batch"]))
      if ref is not None:
        row["gemma_seconds"] = ref["seconds"]
        row["speedup_vs_gemma"] = round(ref["seconds"] / row["seconds"], 2)
        if name == "tiny":  # the same weights: row 0's tokens
          row["tokens_equal_gemma"] = (until_stop(row["tokens_row0"])
                                       == until_stop(ref["tokens_row0"]))
      rows.append(row)
      print({k: v for k, v in row.items() if k != "tokens_row0"}, flush=True)
  return {"rows": rows, "knobs": KNOBS, "models": MODELS,
          "small": dataclasses.asdict(SMALL),
          "reference": ({k: v for k, v in reference.items() if k != "rows"} if reference
                        else "none: run tests/reference/diffusion_gemma_bench.py in gemma's "
                             "environment (Python 3.12, gemma from source), then this bench"),
          "gpu_command": gpu_command()}


def llada21_rows(small_llada2, timed_decoders, repeats: int, settings: dict) -> list[dict]:
  """LLaDA2.1's editing decoder on the families bench's small LLaDA2 model."""
  rows = timed_decoders(small_llada2, None, repeats, settings,
                        {"editing_threshold": 0.9, "max_post_steps": 4})
  return [{**row, "decoder_mode": "llada21 (editing_threshold 0.9, max_post_steps 4)"}
          for row in rows]


def gpu_command() -> str:
  """The command that times the published shape (not run without an accelerator)."""
  return ("python -m mdjax.bench.families --gpu --repeats=3  # one 80 GB GPU: also "
          "DiffusionGemma 26B-A4B's shape (random bfloat16 weights, prompt 128, a canvas of "
          "256, 48 steps, batch 1 and 8) -> results/families_gpu.json['diffusion_gemma']")


def gpu_rows(repeats: int) -> list[dict]:
  """The published shape (GPU_CONFIG, random weights): the default sampler at GPU's
  settings, batch 1 and 8. About 50 GB of accelerator memory."""
  config = GPU_CONFIG
  params = jax.jit(network.init_params, static_argnums=0)(config, jax.random.key(0))
  model = record.published_model(params=params, config=config, family=network.FAMILY).replace(
      noise=layout.noise_of(config))
  prompt = np.random.default_rng(0).integers(3, min(1000, config.vocab_size),
                                             (1, GPU["prompt_len"])).astype(np.int32)
  rows = []
  settings = (GPU["prompt_len"], GPU["canvas"], GPU["canvases"], GPU["steps"])
  for row in mdjax_rows(model, "DiffusionGemma-26B-A4B shape", settings, repeats, prompt):
    rows.append({k: v for k, v in row.items() if k != "tokens_row0"})
  return rows
