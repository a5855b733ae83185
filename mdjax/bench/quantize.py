"""Weight-only int8 / int4 against float weights: memory, logit error, token agreement, NELBO
and speed, on the published fixtures and on a trained model.

  python -m mdjax.bench.quantize [--steps=400 --workdir=/tmp/noise_text
                                  --out=results/quantize.json --repeats=20]

Models: every published family's test fixture (tests/fixtures: tiny random-weight networks of
the real layouts) and character-level Shakespeare trained by `mdjax.bench.noise_text`'s
absorbing config (time-conditioned, `steps` steps, seed 0; WORKDIR/absorbing is reused when
it holds that run, else trained from scratch). For each model and mode (`mdjax.load(path,
quantize=mode)`):

  param_bytes: the params' bytes, float and quantized (int4 counted at 4 bits), and the
    bytes left in float (embeddings, norms, biases, router).
  logit error on a fixed canvas (prompt tokens, then masks; the trained model: held-out
    windows with half their positions masked): max and mean |logit - float logit| over the
    finite logits, divided by the largest |float logit|; argmax agreement at masked positions.
  token agreement: the model's default sampler (temperature 0 where it has one, the same
    key) on PROMPTS prompts of MAX_NEW_TOKENS new tokens (fewer where the model's window is
    shorter): the fraction of generated
    positions equal to float's, and of rows equal whole.
  NELBO (trained model): bits per character of held-out windows under its process, float and
    quantized on the same windows and noise draws, and their paired difference with the
    standard error across draws.
  speed: median seconds of the jitted denoiser call (float, int8 and int4 interleaved round
    by round, `timing.interleaved_medians`) on a batch of SPEED_BATCH canvases.

Seeds fixed; written atomically to `out`.
"""

from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

import mdjax
from mdjax import generation, quantize, report, train
from mdjax.bench import noise_text, timing

FIXTURES = {"llada": "pretrained/llada", "dream": "pretrained/dream", "llada2": "llada2",
            "sdar": "sdar", "fast_dllm_v2": "fast_dllm_v2", "mdlm": "dit/mdlm",
            "bd3lm": "dit/bd3lm", "llama (judge)": "judge/llama",
            "qwen2 (judge)": "judge/qwen2"}
MODES = ("int8", "int4")
SEED = 0
PROMPTS, PROMPT_LENGTH, MAX_NEW_TOKENS = 4, 6, 16
CANVAS_BATCH, CANVAS_LENGTH = 4, 32
SPEED_BATCH = 16
TRAINED_PROMPTS = ("ROMEO.\n", "To be, or not", "KING HENRY", "Good morrow, ")


def fixture_root() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), "tests", "fixtures")


def param_bytes(model) -> dict:
  """The params' bytes, and those of leaves that are not QuantizedWeights."""
  is_q = lambda x: isinstance(x, quantize.QuantizedWeight)
  kept = [x for x in jax.tree.leaves(model.params, is_leaf=is_q) if not is_q(x)]
  return {"bytes": quantize.param_bytes(model.params),
          "float_bytes": quantize.param_bytes(kept)}


def canvas(model, key: int, batch: int, length: int) -> jnp.ndarray:
  """Random prompt tokens, then masks from the middle on (a causal judge: tokens only)."""
  tokens = jax.random.randint(jax.random.key(key), (batch, length), 0, model.vocab_size)
  if model.mask_id_or_none is None:
    return tokens
  tokens = jnp.where(tokens == model.mask_id, 0, tokens)
  return tokens.at[:, length // 2:].set(model.mask_id)


def logit_error(float_model, quantized, tokens_BxL, scored_BxL) -> dict:
  """Max and mean |quantized - float logit| over finite logits, relative to the largest
  |float logit|, and the argmax agreement at the `scored_BxL` positions."""
  t_B = jnp.full((tokens_BxL.shape[0],), 0.5)
  a = np.asarray(jax.jit(float_model.denoiser.apply)(float_model.params, tokens_BxL, t_B))
  b = np.asarray(jax.jit(quantized.denoiser.apply)(quantized.params, tokens_BxL, t_B))
  finite = np.isfinite(a) & np.isfinite(b)
  top = float(np.abs(a[finite]).max())
  error = np.abs(a[finite] - b[finite])
  scored = np.asarray(scored_BxL, bool)
  return {"max_logit": top, "max_rel_error": float(error.max() / top),
          "mean_rel_error": float(error.mean() / top),
          "argmax_agreement": float((a.argmax(-1) == b.argmax(-1))[scored].mean())}


def _generate(model, prompts, knobs):
  new = MAX_NEW_TOKENS  # a block-causal model generates past its window, block by block
  if model.denoiser.block_size is None:
    new = min(new, model.max_len - max(len(p) for p in prompts))
  try:
    ids, _, _, _ = generation.generate_ids(model, prompts, max_new_tokens=new,
                                           key=jax.random.key(SEED), **knobs)
  except ValueError as error:  # a knob the sampler lacks
    if knobs:
      return _generate(model, prompts, {})
    raise error
  return ids


def token_agreement(float_model, quantized, prompts) -> dict:
  """The default sampler (temperature 0 where it takes one) from the same key: the fraction
  of generated positions equal to float's, and of rows equal whole."""
  knobs = {"temperature": 0.0} if "temperature" in float_model.sampler.knobs else {}
  a, b = _generate(float_model, prompts, knobs), _generate(quantized, prompts, knobs)
  # Positions past the shorter row (one ended at EOS sooner) count as disagreements.
  same = [np.sum(x[:len(y)] == y[:len(x)]) / max(len(x), len(y), 1) for x, y in zip(a, b)]
  return {"token_agreement": float(np.mean(same)),
          "rows_equal": float(np.mean([np.array_equal(x, y) for x, y in zip(a, b)])),
          "greedy": bool(knobs)}


def speed(models: dict, tokens_BxL, repeats: int) -> dict:
  """Median seconds of each model's jitted denoiser call on `tokens_BxL`, interleaved."""
  t_B = jnp.full((tokens_BxL.shape[0],), 0.5)
  calls = {}
  for name, model in models.items():
    apply = jax.jit(model.denoiser.apply)
    calls[name] = lambda apply=apply, params=model.params: apply(params, tokens_BxL, t_B)
  return timing.interleaved_medians(calls, repeats)


def rows_for(name: str, float_model, load_quantized, tokens_BxL, scored_BxL, prompts,
             speed_tokens, repeats: int, extra=None) -> list[dict]:
  models = {"float": float_model, **{mode: load_quantized(mode) for mode in MODES}}
  seconds = speed(models, speed_tokens, repeats)
  base = param_bytes(float_model)
  rows = []
  for mode in MODES:
    quantized = models[mode]
    row = {"model": name, "family": float_model.family, "mode": mode,
           "float_bytes": base["bytes"], **{f"quantized_{k}": v
                                           for k, v in param_bytes(quantized).items()},
           **logit_error(float_model, quantized, tokens_BxL, scored_BxL),
           "seconds_float": seconds["float"], "seconds_quantized": seconds[mode],
           "speed_ratio": seconds["float"] / seconds[mode],
           "speed_shape": list(speed_tokens.shape)}
    row["bytes_ratio"] = row["quantized_bytes"] / row["float_bytes"]
    if prompts is not None:
      row.update(token_agreement(float_model, quantized, prompts))
    if extra is not None:
      row.update(extra(quantized))
    rows.append(row)
    print(f"{name:14s} {mode}  bytes {row['bytes_ratio']:.3f}  max rel err "
          f"{row['max_rel_error']:.4f}  mean {row['mean_rel_error']:.5f}  argmax "
          f"{row['argmax_agreement']:.3f}  tokens {row.get('token_agreement', float('nan')):.3f}"
          f"  speed x{row['speed_ratio']:.2f}", flush=True)
  return rows


def fixture_rows(repeats: int) -> list[dict]:
  rows = []
  for name, path in FIXTURES.items():
    path = os.path.join(fixture_root(), path)
    model = mdjax.load(path)
    length = min(CANVAS_LENGTH, model.max_len)
    tokens = canvas(model, SEED, CANVAS_BATCH, length)
    scored = (np.ones(tokens.shape, bool) if model.causal
              else np.asarray(tokens) == model.mask_id)
    prompts = None
    if not model.causal:
      rng = np.random.default_rng(SEED)
      prompts = [rng.integers(0, model.mask_id if model.mask_id < model.vocab_size
                              else model.vocab_size, PROMPT_LENGTH).astype(np.int32)
                 for _ in range(PROMPTS)]
      if model.family == "mdlm":  # one window from nothing: prompts fill its start
        prompts = [p[:2] for p in prompts]
    speed_tokens = canvas(model, SEED + 1, SPEED_BATCH, min(64, model.max_len))
    rows += rows_for(name, model, lambda mode, path=path: mdjax.load(path, quantize=mode),
                     tokens, scored, prompts, speed_tokens, repeats)
  return rows


def trained_rows(steps: int, workdir: str, repeats: int) -> list[dict]:
  """Shakespeare (noise_text's absorbing run): logit error on masked held-out windows, token
  agreement on TRAINED_PROMPTS, the NELBO change, speed."""
  config = noise_text.configs(steps)["absorbing"]
  path = os.path.join(workdir, "absorbing")
  train.ensure_trained(config, path)
  model = mdjax.load(path)
  windows = model.task.validation_windows(noise_text.WINDOWS)
  rng = np.random.default_rng(SEED)
  tokens = windows[:CANVAS_BATCH * 4]
  masked = rng.random(tokens.shape) < 0.5
  tokens = np.where(masked, model.mask_id, tokens)
  prompts = [np.asarray(model.encode(text), np.int32) for text in TRAINED_PROMPTS]
  float_nelbo = noise_text.validation_nelbo(model, windows)

  def nelbo(quantized) -> dict:
    q = noise_text.validation_nelbo(quantized, windows)
    diff = np.asarray(q["per_draw"]) - np.asarray(float_nelbo["per_draw"])
    return {"nelbo_float_bits_per_char": float_nelbo["bits_per_char"],
            "nelbo_quantized_bits_per_char": q["bits_per_char"],
            "nelbo_change_bits_per_char": float(diff.mean()),
            "nelbo_change_stderr": float(diff.std(ddof=1) / math.sqrt(len(diff)))}

  speed_tokens = jnp.asarray(np.where(masked[:1].repeat(noise_text.EVAL_BATCH, 0),
                                      model.mask_id, windows[:noise_text.EVAL_BATCH]))
  rows = rows_for("shakespeare", model, lambda mode: mdjax.load(path, quantize=mode),
                  jnp.asarray(tokens), masked, prompts, speed_tokens, repeats, extra=nelbo)
  for row in rows:
    row.update(workdir=path, steps=steps, params=int(sum(
        x.size for x in jax.tree.leaves(model.params))))
  return rows


def run(steps: int, workdir: str, repeats: int) -> dict:
  rows = fixture_rows(repeats) + trained_rows(steps, workdir, repeats)
  return {
      "rows": rows, "seed": SEED, "repeats": repeats, "machine": timing.machine_info(),
      "notes": [
          "Weight-only: matrices as int8 per output channel or int4 per group of "
          f"{quantize.INT4_GROUP} input rows, float32 scales, dequantized inside the jitted "
          "call where each is used (mdjax.quantize); embeddings, norms, biases and the MoE "
          "router stay float (quantized_float_bytes).",
          "The fixtures are tiny random-weight networks: their logits are nearly flat, so "
          "argmax and token agreement there understate what a trained model keeps; the "
          "Shakespeare row is the trained one.",
          "Speed on a CPU: the dequantization is extra work before each matmul and XLA's CPU "
          "backend has no int8-weight matmul, so no speedup is expected (speed_ratio = float "
          "seconds / quantized seconds; < 1 is slower). The gain a GPU or TPU gives "
          "(memory-bound decoding reading half or a quarter of the bytes) is not measured.",
          "int4 bytes count 4 bits a value (XLA packs int4 on GPU and TPU); the CPU backend "
          "stores one a byte."]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--workdir", default="/tmp/noise_text")
  parser.add_argument("--out", default="results/quantize.json")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  result = run(args.steps, args.workdir, args.repeats)
  report.write_json(args.out, result)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
