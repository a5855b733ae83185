"""Sampling benchmark on the CPU: a 4.2M-parameter denoiser, batch 4, L = 64 (about 20 min on 2 cores)."""

import ml_collections

from configs.base import base_config


def get_config():
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(dict(
      d_model=256, num_layers=4, num_heads=4, d_ff=1024, positions="rope", norm="rms",
      mlp="swiglu", time_conditioning=False, causal=False, dtype="float32"))
  c.vocab_size = 64
  c.seq_len = 64
  c.batch = 4
  c.steps = (8, 16, 32, 64, 128, 256)
  # *_no_skip: the same family with skip_idle_steps=False (a scan over every step).
  c.samplers = ("ancestral", "confidence", "remask", "blocks", "ancestral_no_skip",
                "confidence_no_skip")
  c.num_blocks = 4  # the blocks sampler: confidence decoding in 4 semi-AR blocks
  c.family_steps = 16  # (i) every family at its defaults against its forward passes
  c.families = None  # (i) and (iii) over these families; None: every registered one
  c.call_steps = 16  # (ii) sample() against the compiled program, batch 1
  c.step_batches = (1, 128)  # (iii) the step's own work with an embedding-lookup denoiser,
  c.step_length = 25  # at L = K = 25 (V = 15)
  c.repeats = 5
  # Rounds of the three overhead measures, whose differences are a few percent (i, ii) or
  # whose calls last well under a millisecond (iii, batch 1): more rounds, steadier medians.
  c.overhead_repeats = 21
  c.train_batch = 8
  c.matmul_size = 2048
  c.seed = 0
  c.train = base_config().train  # the optimizer of the training-throughput row
  c.out = "results/bench_cpu"
  return c
