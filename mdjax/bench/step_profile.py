"""Where a sampler step's own time goes: its parts timed side by side, at batch 1 and 128.

  python -m mdjax.bench.step_profile [--repeats=9]

Each part runs K = 25 times in one compiled `lax.scan` (L = 25 positions, V = 15 values,
ScanAndAdd's size; the sizes of `mdjax.bench`'s step-cost table), its result folded into
the carry so XLA cannot drop it; times are medians of interleaved rounds, over K. The
parts: a step key and the Gumbel noise of every position and value, drawn by
`jax.random` (whose Threefry hash the CPU runs as a rolled loop) and by
`mdjax.sampling.threefry` (the same bits, unrolled); the draw given the noise (softmax,
argmax); the rank of the masked positions by confidence; and the whole step of the
ancestral and confidence samplers with an embedding-lookup denoiser. Prints a table.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from mdjax import sampling
from mdjax.bench import overhead, timing
from mdjax.sampling import scores, threefry, transforms

LENGTH = STEPS = 25
VOCAB = overhead.STEP_VOCAB


def _scanned(part):
  """`part(key, step, logits_BxLxV) -> array`, K times in one program; the time over K."""

  @jax.jit
  def run(key, logits_BxLxV):
    def body(total, step):
      return total + part(key, step, logits_BxLxV).astype(jnp.float32).sum(), None

    return jax.lax.scan(body, jnp.float32(0), jnp.arange(STEPS))[0]

  return run


def _noise_jax(keys_B, step, logits_BxLxV):
  step_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, step)
  return jax.vmap(lambda k: jax.random.gumbel(k, logits_BxLxV.shape[1:]))(step_keys_B)


def _noise_unrolled(keys_B, step, logits_BxLxV):
  return threefry.gumbel(threefry.fold_in(keys_B, step), logits_BxLxV.shape[1:])


def _draw_given_noise(keys_B, step, logits_BxLxV):
  noise_BxLxV = jnp.roll(logits_BxLxV, 1, -1) + step  # stands in for the noise, undrawn
  return transforms.argmax_last(jax.nn.log_softmax(logits_BxLxV) + noise_BxLxV)


def _rank(keys_B, step, logits_BxLxV):
  confidence_BxL = jax.nn.softmax(logits_BxLxV + step).max(-1)
  return scores.rank_descending(confidence_BxL, confidence_BxL > 0.1)


PARTS = {"key + Gumbel noise, jax.random": _noise_jax,
         "key + Gumbel noise, unrolled": _noise_unrolled,
         "draw given the noise (softmax, argmax)": _draw_given_noise,
         "rank by confidence": _rank}


def profile(batch: int, repeats: int) -> dict[str, float]:
  """Microseconds per step of each part and of the two whole steps at this batch."""
  logits_BxLxV = jax.random.normal(jax.random.key(1), (batch, LENGTH, VOCAB))
  keys_B = jax.random.split(jax.random.key(0), batch)
  calls = {name: functools.partial(_scanned(part), keys_B, logits_BxLxV)
           for name, part in PARTS.items()}
  table = jax.random.normal(jax.random.key(0), (VOCAB + 1, VOCAB))
  canvas_BxL = jnp.full((batch, LENGTH), VOCAB, jnp.int32)
  for family in ("ancestral", "confidence"):
    spec = sampling.families()[family].bench_spec(STEPS, LENGTH)
    lowered, args = sampling.lower(overhead.embedding_denoiser, table, jax.random.key(0),
                                   canvas_BxL, spec)
    calls[f"whole {family} step"] = functools.partial(lowered.compile(), *args)
  medians = timing.interleaved_medians(calls, repeats)
  return {name: 1e6 * seconds / STEPS for name, seconds in medians.items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=9)
  args = parser.parse_args(argv)
  by_batch = {batch: profile(batch, args.repeats) for batch in (1, 128)}
  print("| part of a step | µs, B=1 | µs, B=128 |\n|---|---|---|")
  for name in by_batch[1]:
    print(f"| {name} | {by_batch[1][name]:.1f} | {by_batch[128][name]:.1f} |")


if __name__ == "__main__":
  main()
