"""What ending rows at EOS saves: denoiser calls and output tokens per second, per sampler.

`measure(apply_fn, params, sampler, eos_id=, mask_id=)` generates rows from an empty canvas
with one family, with and without the EOS early stop (`spec.eos_id` set or None; the same
row keys), and returns the two rows of results/eos_long.json (experiments/eos_long.py trains
the model it measures):

- mean generated length: tokens before the row's first EOS (the canvas without one);
- nfe: the denoiser calls of the batch's program (`SampleResult.nfe`, `BlocksResult.nfe`),
  and of each row sampled alone with its own row key (`nfe_alone`; the batch's tokens up to
  near-ties flipped by rounding: `batch_equals_rows`);
- output tokens per second: generated tokens over the median wall time of `repeats` timed
  runs after the compiling one (both modes interleaved);
- per row alone, the calls early stop saved (1 - calls with / calls without) against the
  fraction of the canvas after its EOS (`saved_fraction`, `tail_fraction`; `saved_over_tail`
  their ratio), and what the batch's program saved (`batch_saved_fraction`: it calls the
  denoiser until its last row has ended).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from mdjax import generation, sampling

CANVAS = 256
BATCH = 8
SEED = 0
BLOCK = 32  # semi-autoregressive blocks and block-by-block generation (LLaDA's length)
STEPS_PER_CANVAS = 128  # two positions a step


@dataclasses.dataclass(frozen=True)
class Sampler:
  """A family's spec on the canvas; `blocks_of`: generated block by block (sample_blocks)."""

  name: str
  spec: sampling.SamplerSpec
  eos_knobs: tuple = ()  # (name, value) pairs set with the EOS id
  blocks_of: int | None = None


def samplers(canvas: int = CANVAS, block: int = BLOCK, steps: int = STEPS_PER_CANVAS
             ) -> tuple[Sampler, ...]:
  """The samplers, each making `steps` steps over the canvas (block generation: steps * block
  / canvas a block): every family that ends rows at EOS, the block families with LLaDA's
  confidence and with the ancestral kernel inside a block."""
  per_block = steps * block // canvas
  return (
      Sampler("ancestral", sampling.AncestralSpec(steps=steps)),
      Sampler("confidence top-k", sampling.ConfidenceSpec(steps=steps)),
      Sampler("confidence top-k, EOS ranked last", sampling.ConfidenceSpec(steps=steps),
              eos_knobs=(("eos_rank_last", True),)),
      Sampler(f"semi-autoregressive blocks of {block}, confidence",
              sampling.ConfidenceSpec(steps=steps, block_length=block)),
      Sampler(f"semi-autoregressive blocks of {block}, ancestral",
              sampling.AncestralSpec(steps=steps, block_length=block)),
      Sampler(f"block generation, blocks of {block}, ancestral",
              sampling.AncestralSpec(steps=per_block), blocks_of=block),
      Sampler("remdm", sampling.RemaskSpec(steps=steps, eta=0.05)),
  )


def first_eos(tokens_BxL, eos_id: int) -> np.ndarray:
  """Positions before each row's first EOS (L when it has none)."""
  eos_BxL = np.asarray(tokens_BxL) == eos_id
  return np.where(eos_BxL.any(-1), eos_BxL.argmax(-1), eos_BxL.shape[1])


def same_trajectory(sampler: Sampler) -> bool:
  """Whether stopping leaves each row's tokens up to its first EOS as they are without it, by
  construction: a family that never reopens a written token (a finished row has written every
  position before its EOS) and no EOS knob (the run without the stop cannot have one, so it
  draws differently)."""
  return not sampler.eos_knobs and not isinstance(sampler.spec, sampling.RemaskSpec)


def runner(apply_fn, params, sampler: Sampler, keys_B, *, eos_id: int | None, mask_id: int,
           canvas: int):
  """A call generating `canvas` positions for the rows of `keys_B`: -> (tokens_BxL, nfe)."""
  spec = sampler.spec
  if eos_id is not None:
    spec = generation.with_eos(spec, eos_id, **dict(sampler.eos_knobs))
  batch = keys_B.shape[0]
  if sampler.blocks_of:
    prompt = np.zeros((batch, 0), np.int32)

    def call():
      out = sampling.sample_blocks(apply_fn, params, keys_B, prompt, spec, length=canvas,
                                   blocks_of=sampler.blocks_of,
                                   window=canvas - sampler.blocks_of, mask_id=mask_id,
                                   cached=False)
      return out.tokens_BxT, out.nfe
  else:
    empty = np.full((batch, canvas), mask_id, np.int32)

    def call():
      out = sampling.sample(apply_fn, params, keys_B, empty, spec, mask_id=mask_id)
      return out.tokens_BxL, out.nfe
  return call


def measure(apply_fn, params, sampler: Sampler, *, eos_id: int, mask_id: int,
            canvas: int = CANVAS, batch: int = BATCH, repeats: int = 3,
            seed: int = SEED) -> list[dict]:
  """The two rows (without, with EOS early stop) of one sampler."""
  keys_B = sampling.row_keys(jax.random.key(seed), batch)
  modes = {stop: runner(apply_fn, params, sampler, keys_B, eos_id=eos_id if stop else None,
                        mask_id=mask_id, canvas=canvas) for stop in (False, True)}
  # The first (compiling) run of each mode gives the tokens; then `repeats` timed rounds,
  # the two modes interleaved so that the machine's load falls on both alike.
  first = {stop: jax.block_until_ready(call()) for stop, call in modes.items()}
  times = {stop: [] for stop in modes}
  for _ in range(repeats):
    for stop, call in modes.items():
      begin = time.perf_counter()
      jax.block_until_ready(call())
      times[stop].append(time.perf_counter() - begin)
  seconds = {stop: statistics.median(t) for stop, t in times.items() if t}
  out = {}
  for stop in modes:
    tokens, nfe = first[stop]
    alone = [(tokens, nfe)] if batch == 1 else [
        runner(apply_fn, params, sampler, keys_B[r:r + 1], eos_id=eos_id if stop else None,
               mask_id=mask_id, canvas=canvas)() for r in range(batch)]
    out[stop] = {"tokens": np.asarray(tokens), "nfe": int(nfe),
                 "alone_tokens": np.concatenate([np.asarray(t) for t, _ in alone]),
                 "nfe_alone_R": np.array([int(n) for _, n in alone])}
  lengths = {stop: first_eos(o["tokens"], eos_id) for stop, o in out.items()}
  # Per row, from its runs alone: the calls the stop saved and the canvas after its EOS.
  alone_lengths = {stop: first_eos(o["alone_tokens"], eos_id) for stop, o in out.items()}
  saved_R = 1.0 - out[True]["nfe_alone_R"] / out[False]["nfe_alone_R"]
  tail_R = 1.0 - alone_lengths[True] / canvas
  rows = []
  for stop in (False, True):
    o = out[stop]
    row = {"sampler": sampler.name, "canvas": canvas, "eos_early_stop": stop,
           "mean_generated_length": float(lengths[stop].mean()), "nfe": o["nfe"],
           "output_tokens_per_s": (float(lengths[stop].sum() / seconds[stop]) if repeats
                                   else None),
           "batch": batch, "seconds_median": seconds.get(stop),
           "generated_lengths": lengths[stop].tolist(),
           "nfe_alone": o["nfe_alone_R"].tolist(),
           "nfe_alone_mean": float(o["nfe_alone_R"].mean()),
           # Whether each row sampled alone (its own key) gave its batch tokens; programs of
           # other batch sizes round differently, which can flip near-ties.
           "batch_equals_rows": bool((o["alone_tokens"] == o["tokens"]).all())}
    if stop:
      row.update({
          "lengths_agree": bool((lengths[True] == lengths[False]).all()
                                and (alone_lengths[True] == alone_lengths[False]).all()),
          "generated_lengths_alone": alone_lengths[True].tolist(),
          "same_trajectory": same_trajectory(sampler),
          "saved_fraction": float(saved_R.mean()), "tail_fraction": float(tail_R.mean()),
          "saved_over_tail": float(saved_R.mean() / tail_R.mean()) if tail_R.mean() else None,
          "batch_saved_fraction": 1.0 - o["nfe"] / out[False]["nfe"]})
    rows.append(row)
  return rows
