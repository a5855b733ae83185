"""Writes tests/fixtures/diffusion_gemma/canvases.npz and canvases.json with google-deepmind/
gemma's own code: its whole `DiffusionSampler` (several canvases in turn) on the committed tiny
model (tests/fixtures/diffusion_gemma/params, read back with `gm.ckpts.load_params`; the
other fixture files are left as they are).

Runs where tests/reference/diffusion_gemma.py runs (its docstring: gemma 7691fd4e from source,
Python 3.12, mdjax not imported):

  PYTHONPATH=SRC:. /work/venv312/bin/python -m tests.reference.diffusion_gemma_canvases

What it records, for CASES x SEEDS x PROMPTS (batch 1 each, canvases of 8, max_new_tokens 24:
three canvases, end tokens (1, 106, 50): gemma's `Sampler` with the Gemma 4 tokenizer's EOS,
end of turn and begin of tool response):

  each run's `rng` (jax.random.fold_in(jax.random.key(seed), row): what `mdjax.generate(...,
  key=seed)` gives row `row`, so the prompt "p1" runs as the second row of a batch) and the
  tokens gemma's compiled loop wrote (`SamplerLoop._sample_loop` over `_sample_step`:
  `sample_next_canvas`, `_truncate_canvas_at_stop_tokens`, `append_tokens_to_cache`, the key
  split between canvases, the end when a canvas holds an end token; predicted_tokens after
  `_mask_tokens_after_end_tokens`). Prompts: none (the sampler starts from an empty cache),
  the fixture's prompt rows 0 ("p0") and 1 ("p1"), prefilled by gemma's `prefill`.

  Each run again, transcribed canvas by canvas (`diffusion_gemma.run_transcribed`: gemma's
  `sample_step` and `early_stop_fn` jitted a step, then its truncation and cache append):
  `replays` when its tokens are the compiled loop's; `robust` when they stay the same with
  the self-conditioning embeddings perturbed before their bfloat16 rounding by noise of the
  size of mdjax's float32 differences (JITTER; JITTER_TRIALS draws); `flips_tried` and
  `flips_changing`: every rounding of an embedding a later step reads that lies within
  FLIP_MARGIN of its midpoint, rounded the other way alone (`rounding_flips`), and how many
  of those change the run's tokens; `rounding_margin` (`_at`: canvas, step, position, dim):
  the nearest of those to its midpoint, over the step's largest |embedding| (None: none
  within FLIP_MARGIN changes the tokens); every other decision's margin (the draws, the
  argmax gaps, the entropy bound's cut, the entropy stop's threshold, the routing); `stable`
  when it replays, is robust, no flip changes it and every margin clears 1e-4; each canvas's
  steps run (`canvas_steps`: fewer than max_denoising_steps where the entropy stop ended it).
  For the seed in STEP_RECORDS, each canvas's steps (canvas, key, raw logits): the decoder's
  logits read the cache after the canvases before it were appended.

  With --records FILE RUN...: those runs' every step record (the embeddings before their
  rounding among them) to FILE and their entries to FILE's .json, the fixture left alone:
  what docs/pretrained.md's per-run table of the runs mdjax missed was read from.

  `batch`: gemma's sampler on both prompt rows at once (batch 2, rng key(BATCH_SEED)) against
  each row alone with that rng: gemma draws a batch's rows from one key in the batch's shape,
  so a row of a batch is not the row run alone (`rows_equal_alone`).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from gemma.diffusion import _early_stopping, _sampler
from gemma.gm.ckpts import _checkpoint
from gemma.gm.text import _prefill, _sampler_loop
from gemma.gm.utils import _types

from tests.reference import diffusion_gemma as base

OUT = base.OUT
WIDTH, CANVASES = base.CANVAS, 3
NEW = WIDTH * CANVASES
CACHE = 48  # room for the prompt and three canvases (gemma stops when its cache is full)
END_TOKENS = (1, 106, 50)
# A run's robustness to the bfloat16 rounding of its self-conditioning embeddings (JITTER,
# JITTER_TRIALS, FLIP_MARGIN: the sizes and why, beside them in diffusion_gemma.py).
JITTER, JITTER_TRIALS, FLIP_MARGIN = base.JITTER, base.JITTER_TRIALS, base.FLIP_MARGIN
SEEDS = tuple(range(8))
STEP_RECORDS = (0,)
STEP_FIELDS = ("canvas", "key", "logits", "sampled", "sc")  # what the fixture keeps a step
# --records: every field run_transcribed records (the embeddings before their rounding,
# `sc_out`, among them)
ALL_STEP_FIELDS = STEP_FIELDS + ("t", "draws", "written", "sc_out", "done")
BATCH_SEED = 0
PROMPTS = ("none", "p0", "p1")
CASES = (  # name, max_denoising_steps, entropy_bound, early stop
    dict(name="k4_b2", steps=4, entropy_bound=2.0),
    dict(name="k8_b4_entropy_stop", steps=8, entropy_bound=4.0, entropy_stop=True),
    # Fewer steps a canvas, fewer embeddings read (one step's, two): runs that keep their
    # tokens under every flip FLIP_MARGIN allows, across canvases and with the entropy stop.
    dict(name="k2_b2", steps=2, entropy_bound=2.0),
    dict(name="k3_b4_entropy_stop", steps=3, entropy_bound=4.0, entropy_stop=True),
)


def sampler_of(model, case: dict, threshold: float | None) -> _sampler.DiffusionSampler:
  """gemma's `DiffusionSampler` as its `Sampler` makes it, with the case's settings; with
  `entropy_stop`, its `EntropyEarlyStop` at `threshold` (the token-stability half of its
  ChatSampler's default never fires on this random model, so it would stop nothing)."""
  stop = _early_stopping.NoEarlyStop()
  if case.get("entropy_stop"):
    stop = _early_stopping.EntropyEarlyStop(entropy_threshold=threshold)
  return _sampler.DiffusionSampler(
      model=model, end_tokens=END_TOKENS, forbidden_tokens=None, sampling=None,
      cache_length=CACHE, special_tokens=None, canvas_length=WIDTH,
      max_denoising_steps=case["steps"], text_vocab_size=base.VOCAB,
      sliding_window_size=base.WINDOW, early_stop_fn=stop,
      sample_from_predictions=_sampler.SampleFromPredictions(
          entropy_bound=case["entropy_bound"], text_vocab_size=base.VOCAB))


def initial_state(model, params, prompt, rng) -> _sampler_loop.SamplingState:
  """The sampling loop's state before the first canvas: gemma's `prefill` of the prompt
  (B x P), or for None an empty cache (no prompt: the first canvas sees only itself)."""
  if prompt is not None:
    return _prefill.prefill(
        model=model, params=params,
        input=_types.Input(text=jnp.asarray(prompt), images=None,
                           config=model.config.input_config),
        last_state=None, cache_length=CACHE, max_out_length=NEW, rng=rng, sharding=None)
  zeros = jnp.zeros((1,), jnp.int32)
  return _sampler_loop.SamplingState(
      step=jnp.asarray(0), done=jnp.zeros((1,), bool), last_token=zeros,
      last_token_pos=zeros, predicted_tokens=jnp.zeros((1, NEW), jnp.int32),
      cache=model.init_cache(batch_size=1, dtype=jnp.float32, cache_length=CACHE), rng=rng,
      init_cache_length=jnp.asarray(0), full_attention_mask=jnp.ones((1, CACHE), bool))


def compiled_run(model, params, sampler, prompt, rng) -> np.ndarray:
  """gemma's compiled sampling loop: the predicted tokens (B x NEW)."""
  state = initial_state(model, params, prompt, rng)
  out = sampler.sample(params=params, init_state=state, max_new_tokens=jnp.asarray(NEW))
  return np.asarray(out.predicted_tokens)


def truncated(canvas) -> tuple[np.ndarray, bool]:
  """gemma's `_truncate_canvas_at_stop_tokens` of one canvas (1 x W): PAD after its first
  end token; whether it holds one."""
  out, stopped = _sampler._truncate_canvas_at_stop_tokens(  # pylint: disable=protected-access
      jnp.asarray(canvas), end_tokens=END_TOKENS, canvas_length=WIDTH,
      done=jnp.zeros((1,), bool))
  return np.asarray(out), bool(stopped[0])


def transcribed_run(model, params, sampler, prompt, rng, jitter: float = 0.0,
                    jitter_seed: int = 0, record: bool = True):
  """The loop canvas by canvas: `run_transcribed` per canvas (`jitter`: its perturbed
  embeddings, canvas c's noise seeded jitter_seed + c), then gemma's truncation and append.
  Returns (tokens NEW, canvases run, the margins, each canvas's step records, each canvas's
  start: its key and the cache before it)."""
  state = initial_state(model, params, prompt, rng)
  cache, full_mask, rng = state.cache, state.full_attention_mask, state.rng
  canvases, records, starts, margins = [], [], [], {}
  for c in range(CANVASES):
    rng, sample_rng = jax.random.split(rng)
    starts.append((jax.random.key_data(sample_rng), cache, full_mask))
    canvas, steps, canvas_margins = base.run_transcribed(
        model, params, sampler, starts[-1][0], cache, full_mask, jitter, jitter_seed + c,
        record=record)
    for key, value in canvas_margins.items():
      margins[key] = min(margins.get(key, np.inf), value)
    canvas, stopped = truncated(canvas)
    cache = sampler.append_tokens_to_cache(tokens=jnp.asarray(canvas), cache=cache,
                                           params=params)
    canvases.append(canvas[0])
    records.append(steps)
    if stopped:
      break
  tokens = np.zeros(NEW, np.int32)
  tokens[:WIDTH * len(canvases)] = np.concatenate(canvases)
  tokens = np.asarray(_sampler_loop._mask_tokens_after_end_tokens(  # pylint: disable=protected-access
      jnp.asarray(tokens)[None], end_tokens=END_TOKENS))[0]
  return tokens, len(canvases), margins, records, starts


def rounding_flips(model, params, sampler, tokens, records, starts) -> tuple[int, list]:
  """`diffusion_gemma.canvas_flips` of each canvas, rerun from its start (its key, the cache
  before it) and truncated as gemma does: (the flips tried, those that change the canvas's
  tokens: (canvas, step, position, dim, the distance to the midpoint over the largest
  |embedding|)). The other canvases do not move: a canvas's tokens alone reach the cache,
  and its key does not depend on them."""
  tried, changing = 0, []
  for c, steps in enumerate(records):
    key, cache, full_mask = starts[c]
    canvas_tried, canvas_changing = base.canvas_flips(
        model, params, sampler, key, cache, full_mask, steps,
        lambda canvas: truncated(canvas)[0][0], tokens[c * WIDTH:(c + 1) * WIDTH])
    tried += canvas_tried
    changing += [(c, *flip) for flip in canvas_changing]
  return tried, changing


def threshold_of(model, params, case: dict, prompt) -> float | None:
  """The entropy-stop case's threshold: the one `diffusion_gemma.entropy_threshold` finds for
  the first seed's first canvas (crossed half-way), so rows stop early in most canvases."""
  if not case.get("entropy_stop"):
    return None
  state = initial_state(model, params, prompt, jax.random.fold_in(jax.random.key(SEEDS[0]), 0))
  _, sample_rng = jax.random.split(state.rng)
  probe = dict(case, name=case["name"])
  return base.entropy_threshold(model, params, probe, jax.random.key_data(sample_rng),
                                state.cache, state.full_attention_mask)


def write_runs(model, params, prompts_BxP: np.ndarray, only=None,
               fields=STEP_FIELDS) -> tuple[dict, list]:
  """Every run of CASES x PROMPTS x SEEDS (`only`: those named), its tokens, rng, margins
  and stability; the step records (`fields`) of the runs in STEP_RECORDS (with `only`: of
  each run named)."""
  arrays, runs = {}, []
  for case in CASES:
    # One threshold a case (probed with the first prompt row), as one sampler runs a batch.
    threshold = threshold_of(model, params, case, prompts_BxP[:1])
    sampler = sampler_of(model, case, threshold)
    for which in PROMPTS:
      row = 1 if which == "p1" else 0
      prompt = None if which == "none" else prompts_BxP[row:row + 1]
      for seed in SEEDS:
        name = f"{case['name']}_{which}_{seed}"
        if only is not None and name not in only:
          continue
        rng = jax.random.fold_in(jax.random.key(seed), row)
        compiled = compiled_run(model, params, sampler, prompt, rng)[0]
        tokens, canvases, margins, records, starts = transcribed_run(model, params, sampler,
                                                                     prompt, rng)
        replays = bool((tokens == compiled).all())
        robust = all(bool((transcribed_run(model, params, sampler, prompt, rng, JITTER,
                                           100 * trial, record=False)[0] == compiled).all())
                     for trial in range(1, JITTER_TRIALS + 1))
        tried, changing = rounding_flips(model, params, sampler, tokens, records, starts)
        stable = replays and robust and not changing and base.decisions_clear(margins)
        stopped = bool(np.isin(compiled, END_TOKENS).any())
        print(name, "replays" if replays else "DOES NOT REPLAY",
              "robust" if robust else "NOT ROBUST", f"canvases {canvases}",
              f"flips {len(changing)} of {tried} change it",
              "stopped" if stopped else "", {k: f"{v:.1e}" for k, v in margins.items()})
        runs.append(dict(name=name, case=case["name"], steps=case["steps"],
                         entropy_bound=case["entropy_bound"],
                         threshold=threshold, prompt=which, seed=seed, row=row,
                         canvases_run=canvases, canvas_steps=[len(r) for r in records],
                         stopped=stopped, replays=replays, robust=robust,
                         flips_tried=tried, **base.flip_fields(changing),
                         stable=bool(stable),
                         margins={k: (None if v == np.inf else float(v))
                                  for k, v in margins.items()}))
        arrays[f"{name}/tokens"] = compiled
        arrays[f"{name}/rng"] = np.asarray(jax.random.key_data(rng))
        if (seed not in STEP_RECORDS) if only is None else False:
          continue
        for c, steps in enumerate(records):
          for field in fields:
            arrays[f"{name}/c{c}/steps_{field}"] = np.stack([r[field] for r in steps])
  return arrays, runs


def write_batch(model, params, prompts_BxP: np.ndarray) -> tuple[dict, dict]:
  """gemma's sampler on the two prompt rows at once, and each alone, with one rng."""
  case = CASES[0]
  sampler = sampler_of(model, case, None)
  rng = jax.random.key(BATCH_SEED)
  together = compiled_run(model, params, sampler, prompts_BxP, rng)
  alone = np.concatenate([compiled_run(model, params, sampler, prompts_BxP[r:r + 1], rng)
                          for r in range(len(prompts_BxP))])
  equal = [bool((together[r] == alone[r]).all()) for r in range(len(prompts_BxP))]
  print("batch of two, rows equal to the rows alone:", equal)
  return ({"batch/together": together, "batch/alone": alone},
          dict(case=case["name"], seed=BATCH_SEED, rows_equal_alone=equal))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  parser.add_argument("--records", type=pathlib.Path, default=None,
                      help="write the named runs' every step record to this .npz (and their "
                      "stability to the .json beside it), not the fixture")
  parser.add_argument("runs", nargs="*", help="with --records: the runs (names as in "
                      "canvases.json)")
  args = parser.parse_args(argv)
  params = _checkpoint.load_params(str((args.out / "params").resolve()))
  prompts = np.load(args.out / "reference.npz")["prompt_BxP"]
  model = base.build_model()
  if args.records is not None:
    arrays, runs = write_runs(model, params, prompts, only=set(args.runs),
                              fields=ALL_STEP_FIELDS)
    np.savez_compressed(args.records, **arrays)
    args.records.with_suffix(".json").write_text(json.dumps(dict(runs=runs), indent=1) + "\n")
    return
  arrays, runs = write_runs(model, params, prompts)
  batch_arrays, batch = write_batch(model, params, prompts)
  np.savez_compressed(args.out / "canvases.npz", **arrays, **batch_arrays)
  (args.out / "canvases.json").write_text(json.dumps(dict(
      width=WIDTH, canvases=CANVASES, max_new_tokens=NEW, end_tokens=list(END_TOKENS),
      vocab=base.VOCAB, seeds=list(SEEDS), runs=runs, batch=batch), indent=1) + "\n")
  print(f"canvases: {sum(r['stable'] for r in runs)} of {len(runs)} runs stable, "
        f"{sum(r['stopped'] for r in runs)} stopped at an end token")


if __name__ == "__main__":
  main()
