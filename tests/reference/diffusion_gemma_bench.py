"""Times google-deepmind/gemma's own `DiffusionSampler` (its compiled sampling loop) for
`python -m mdjax.bench.families`, which reads the figures from the JSON this writes (mdjax
does not import gemma).

Runs where tests/reference/diffusion_gemma.py runs (its docstring: gemma 7691fd4e from source,
Python 3.12, mdjax not imported):

  PYTHONPATH=SRC:. /work/venv312/bin/python -m tests.reference.diffusion_gemma_bench \\
      [--out=results/families_gemma_reference.json] [--repeats=3]

Models (the shapes must be `mdjax.bench.families_gemma`'s: MODELS there and here):
  tiny: the committed fixture (tests/fixtures/diffusion_gemma/params), its prompt row 0;
  small: a random DiffusionGemma of SMALL below (gemma's `model.init`, every leaf redrawn as
    the fixture writer draws them, seed 0), a random prompt.
For each, batch 1 and 8 (the prompt repeated), `SamplerLoop._sample_loop` over
`DiffusionSampler._sample_step` (gemma's `Sampler.sample` after its prefill, jitted once),
no early stop (a fixed step count on both sides), entropy bound 0.1, canvases of the
settings' width: the median of --repeats calls after a warm-up call (its compile), and, for
the tiny model, the tokens of row 0 with rng jax.random.key(0) (mdjax's bench checks its own
against them where the run is robust: it writes no margins, so a mismatch there is a
rounding flip or a bug, said as "tokens_equal": false).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from gemma.diffusion import _models
from gemma.gm.ckpts import _checkpoint
from gemma.gm.nn.gemma4 import _config, _modules

from tests.reference import diffusion_gemma as base
from tests.reference import diffusion_gemma_canvases as canvases

OUT = pathlib.Path(__file__).resolve().parents[2] / "results" / "families_gemma_reference.json"
LOCAL, GLOBAL = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL

SMALL = _config.TransformerConfig(
    num_embed=1024, embed_dim=128, hidden_dim=256, num_heads=4, head_dim=32, num_kv_heads=2,
    final_logit_softcap=30.0, use_post_attn_norm=True, use_post_ffw_norm=True,
    attention_types=(LOCAL, LOCAL, GLOBAL) * 2, qk_norm_with_scale=True, num_global_kv_heads=1,
    global_key_size=64, k_eq_v_global=True, global_rope_proportion=0.25,
    local_rope_proportion=1.0, attn_logits_soft_cap=None, sliding_window_size=64,
    local_base_frequency=10_000, global_base_frequency=1_000_000, per_layer_input_dim=0,
    enable_moe=True, num_experts=8, expert_dim=128, top_k_experts=2, moe_dense_hidden_dim=256,
    vision_encoder=None)
# name -> (prompt length, canvas width, canvases, steps a canvas); mdjax.bench.families_gemma
# times the same.
MODELS = {"tiny": (9, 8, 3, 8), "small": (32, 64, 2, 16)}
BATCHES = (1, 8)


def small_model_and_params():
  model = _models.DiffusionGemma_26B_A4B(config=SMALL, dtype=jnp.float32, text_only=True)
  saved = base.D_MODEL
  try:  # random_params draws the self-conditioning input at the tiny model's width
    base.D_MODEL = SMALL.embed_dim
    params = base.random_params(model, 0)
  finally:
    base.D_MODEL = saved
  return model, params


def sampler_of(model, width: int, steps: int, vocab: int, cache: int):
  from gemma.diffusion import _early_stopping, _sampler  # pylint: disable=g-import-not-at-top
  return _sampler.DiffusionSampler(
      model=model, end_tokens=canvases.END_TOKENS, forbidden_tokens=None, sampling=None,
      cache_length=cache, special_tokens=None, canvas_length=width, max_denoising_steps=steps,
      text_vocab_size=vocab, sliding_window_size=model.config.sliding_window_size,
      early_stop_fn=_early_stopping.NoEarlyStop(),
      sample_from_predictions=_sampler.SampleFromPredictions(entropy_bound=0.1,
                                                             text_vocab_size=vocab))


def timed(model, params, prompt_BxP, settings, repeats: int) -> tuple[float, np.ndarray]:
  """(median seconds after a warm-up call, the predicted tokens) of gemma's compiled loop."""
  from gemma.gm.text import _prefill  # pylint: disable=g-import-not-at-top
  from gemma.gm.utils import _types  # pylint: disable=g-import-not-at-top
  _, width, count, steps = settings
  new = width * count
  cache = prompt_BxP.shape[1] + new + 2
  sampler = sampler_of(model, width, steps, model.config.num_embed, cache)

  def run():
    state = _prefill.prefill(
        model=model, params=params,
        input=_types.Input(text=jnp.asarray(prompt_BxP), images=None,
                           config=model.config.input_config),
        last_state=None, cache_length=cache, max_out_length=new, rng=jax.random.key(0),
        sharding=None)
    out = sampler.sample(params=params, init_state=state, max_new_tokens=jnp.asarray(new))
    return np.asarray(jax.block_until_ready(out.predicted_tokens))

  out = run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = run()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  fixture = base.OUT
  tiny = (base.build_model(), _checkpoint.load_params(str((fixture / "params").resolve())))
  prompts = {"tiny": np.load(fixture / "reference.npz")["prompt_BxP"][:1]}
  small = small_model_and_params()
  prompts["small"] = np.random.default_rng(0).integers(3, SMALL.num_embed, (1, MODELS["small"][0]))
  rows = []
  for name, (model, params) in (("tiny", tiny), ("small", small)):
    for batch in BATCHES:
      prompt = np.tile(prompts[name], (batch, 1)).astype(np.int32)
      seconds, tokens = timed(model, params, prompt, MODELS[name], args.repeats)
      row = dict(model=name, batch=batch, prompt_len=MODELS[name][0],
                 canvas=MODELS[name][1], canvases=MODELS[name][2], steps=MODELS[name][3],
                 seconds=round(seconds, 4), tokens_row0=tokens[0].tolist())
      rows.append(row)
      print({k: v for k, v in row.items() if k != "tokens_row0"}, flush=True)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(dict(
      rows=rows, device=jax.devices()[0].device_kind, jax=jax.__version__,
      gemma="7691fd4e", repeats=args.repeats, machine=platform.processor() or platform.machine(),
      rng="jax.random.key(0) for the batch (gemma draws a batch's rows from one key)"),
      indent=1) + "\n")


if __name__ == "__main__":
  main()
