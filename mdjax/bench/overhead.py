"""What a sampler adds to its denoiser calls: (i) every family against its forward passes,
(ii) the call path of `sample()` against its compiled program, (iii) the step's own work."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mdjax import models, sampling
from mdjax.bench.throughput import forward_only_program
from mdjax.bench.timing import interleaved_medians, timed_compile

# The vocabulary of the step-cost measure's trivial denoiser (ScanAndAdd's size).
STEP_VOCAB = 15


def evaluated_per_row(apply_fn, params, key, canvas_BxL, spec) -> float:
  """The sequences a sampler passes to the denoiser, over the canvas rows: an untimed run
  whose denoiser reports each call's batch to the host. It counts what `contexts_B` leaves
  out: rows evaluated after they finished, and the padded contexts of a round that had
  fewer positions left than contexts (speculative verification)."""
  sizes = []

  def counted(params, tokens_NxL, *args, **kwargs):
    jax.debug.callback(lambda: sizes.append(tokens_NxL.shape[0]))
    return apply_fn(params, tokens_NxL, *args, **kwargs)

  jax.block_until_ready(sampling.sample(counted, params, key, canvas_BxL, spec).tokens_BxL)
  jax.effects_barrier()
  return sum(sizes) / canvas_BxL.shape[0]


def chosen_families(names=None) -> dict:
  """The registered families by name, sorted: all of them, or those `names` lists."""
  registered = sampling.families()
  return {name: registered[name] for name in sorted(registered if names is None else names)}


def family_overheads(apply_fn, params, canvas_BxL, steps: int, repeats: int, key,
                     families=None) -> list[dict]:
  """(i) Every registered family at its `bench_spec` against the bare forward passes it makes.

  The floor is the time of one forward pass at this batch (K passes in one program, over
  K) times the sequences the program passes to the denoiser per row (`evaluated`), so 1.0
  means the sampler adds nothing to its denoiser calls. `overhead_vs_forward` divides by
  the sequences the family counts as evaluated instead (`contexts_B`: one per call, J for a
  call of J contexts, only the useful ones), so it also charges the calls' padding.
  """
  length = canvas_BxL.shape[1]
  forward = forward_only_program(apply_fn, steps)
  calls = {"forward": functools.partial(forward, params, canvas_BxL)}
  made = {}
  for name, family in chosen_families(families).items():
    spec = family.bench_spec(steps, length)
    compiled, args, _ = timed_compile(
        lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
    result = compiled(*args)
    made[name] = (int(result.nfe), float(jnp.mean(result.contexts_B)),
                  evaluated_per_row(apply_fn, params, key, canvas_BxL, spec))
    calls[name] = functools.partial(compiled, *args)
  medians = interleaved_medians(calls, repeats)
  per_pass = medians["forward"] / steps
  return [dict(sampler=name, K=steps, nfe=nfe, contexts=contexts, evaluated=evaluated,
               time_s=medians[name],
               overhead_vs_forward=medians[name] / (per_pass * contexts),
               overhead_vs_evaluated=medians[name] / (per_pass * evaluated))
          for name, (nfe, contexts, evaluated) in made.items()]


# The models of the call-overhead measure beside the bench model: the host's work per call
# weighs most on the tiny one; the 6-layer d256 one is a small real model.
CALL_MODELS = {"tiny": dict(d_model=64, num_layers=2, num_heads=2, d_ff=256),
               "d256x6": dict(d_model=256, num_layers=6, num_heads=4, d_ff=1024)}


def call_overheads(config, key, repeats: int, names=("bench", "tiny")) -> list[dict]:
  """(ii) Per call, `sample()` against the compiled program from `sampling.lower`, batch 1.

  The difference is the host's work per call (`sampling.prepare`'s checks and plan, and the
  dispatch): on the bench model and the models of `CALL_MODELS` named in `names`.
  """
  out = []
  for name in names:
    model = config.model.to_dict() | CALL_MODELS.get(name, {})
    model_cfg = models.TransformerConfig(vocab_size=config.vocab_size, max_len=config.seq_len,
                                         **model)
    _, params, apply_fn = models.init(model_cfg, seed=0)
    params = nnx.to_pure_dict(params)
    canvas_BxL = jnp.full((1, config.seq_len), config.vocab_size, jnp.int32)
    spec = sampling.ConfidenceSpec(steps=config.call_steps)
    compiled, args, _ = timed_compile(
        lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
    medians = interleaved_medians({
        "sample": lambda: sampling.sample(apply_fn, params, key, canvas_BxL, spec).tokens_BxL,
        "program": lambda: compiled(*args).tokens_BxL}, repeats)
    out.append(dict(model=name, params=models.count_params(params), batch=1,
                    K=config.call_steps, sample_s=medians["sample"],
                    program_s=medians["program"],
                    ratio=medians["sample"] / medians["program"]))
  return out


def embedding_denoiser(table, tokens_BxL, t_B):
  """A denoiser that costs next to nothing: logits = table[token]."""
  del t_B
  return table[tokens_BxL]


def step_costs(batches, length: int, repeats: int, key, families=None) -> list[dict]:
  """(iii) The sampler's own time per step: each family's compiled program with a denoiser
  that is an embedding lookup (logits = table[token], V = 15), K = L steps, over K."""
  table = jax.random.normal(jax.random.key(0), (STEP_VOCAB + 1, STEP_VOCAB))
  out = []
  for batch in batches:
    canvas_BxL = jnp.full((batch, length), STEP_VOCAB, jnp.int32)
    calls, steps = {}, {}
    for name, family in chosen_families(families).items():
      spec = family.bench_spec(length, length)
      compiled, args, _ = timed_compile(
          lambda: sampling.lower(embedding_denoiser, table, key, canvas_BxL, spec))
      calls[name] = functools.partial(compiled, *args)
      steps[name] = sampling.num_steps(spec, length)
    medians = interleaved_medians(calls, repeats)
    out += [dict(sampler=name, batch=batch, K=steps[name],
                 us_per_step=1e6 * medians[name] / steps[name]) for name in calls]
  return out


def main(argv=None) -> None:
  """`python -m mdjax.bench.overhead [--config=configs/bench_cpu.py] [--repeats=N]`: (ii) on
  the tiny and the 6-layer d256 models (the config's vocabulary, length and K),
  `sample()` and its compiled program interleaved in one run; prints the medians."""
  import argparse
  import importlib.util

  parser = argparse.ArgumentParser(prog="python -m mdjax.bench.overhead")
  parser.add_argument("--config", default="configs/bench_cpu.py", help="A bench config file.")
  parser.add_argument("--repeats", type=int, default=41, help="Interleaved rounds (>= 5).")
  args = parser.parse_args(argv)
  spec = importlib.util.spec_from_file_location("bench_config", args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for row in call_overheads(config, jax.random.key(config.seed), args.repeats,
                            names=tuple(CALL_MODELS)):
    print(f"{row['model']:>7s}  {row['params']:>9,d} params  K={row['K']}  "
          f"sample {1e6 * row['sample_s']:8.0f} us  program {1e6 * row['program_s']:8.0f} us  "
          f"host +{1e6 * (row['sample_s'] - row['program_s']):5.0f} us  "
          f"ratio {row['ratio']:.3f}")


if __name__ == "__main__":
  main()
