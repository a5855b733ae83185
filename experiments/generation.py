"""Generation as researchers run it: BPE against characters, held-out prompts, EOS, a mesh.

  python experiments/generation.py --char_workdir=/tmp/models/char \
      --bpe_workdir=/tmp/models/bpe --causal_workdir=/tmp/models/causal
  # -> results/generation.{json,md}

Trains (or reuses) the three models with a fixed seed: the character denoiser
(configs/shakespeare_char.py cut to 3,000 steps), the BPE denoiser (configs/shakespeare_bpe.py,
3,000 steps: the same budget, batch and model) and the causal character reference. Then:

- bits per character of both denoisers on the held-out plays: the NELBO summed over fixed
  held-out windows, in bits, over the characters those windows code (an EOS codes the blank
  line it replaced: `tokenizers.characters_of`);
- generation from held-out prompts (prefixes of held-out speeches, several lengths in one
  left-padded batch): generated length, generative bits per character of the completion under
  the causal reference (re-encoded in characters), output tokens per second counted up to EOS,
  with and without ending rows at EOS;
- token-for-token checks: the batch equals its rows sampled alone (no padding, each row's own
  key; greedy and random draws, the dual KV cache), and the batch split over 4 simulated CPU
  devices (parameters FSDP-sharded) equals one device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import jax
import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import shakespeare_bpe, shakespeare_causal, shakespeare_char  # noqa: E402
from mdjax import generation, sampling, tokenizers, train  # noqa: E402
from mdjax.evaluate import elbo  # noqa: E402

_CHAR = flags.DEFINE_string("char_workdir", "/tmp/models/char", "Character denoiser workdir.")
_BPE = flags.DEFINE_string("bpe_workdir", "/tmp/models/bpe", "BPE denoiser workdir.")
_CAUSAL = flags.DEFINE_string("causal_workdir", "/tmp/models/causal", "Causal reference.")
_OUT = flags.DEFINE_string("out", os.path.join(ROOT, "results"), "Output directory.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_STEP = flags.DEFINE_integer("step", None, "Compare both denoisers at this checkpoint step "
                             "(the same budget) instead of training them to STEPS.")

STEPS = 3000  # both denoisers' training budget
NELBO_WINDOWS = 256
PROMPT_TOKENS = (4, 8, 12, 16, 24, 32, 40, 48)  # one batch of 8 prompts of these lengths
SAMPLERS = {
    "confidence K=64": sampling.ConfidenceSpec(steps=64),
    "confidence K=64, EOS ranked last": sampling.ConfidenceSpec(steps=64),
    "blocks of 8, K=64": sampling.ConfidenceSpec(steps=64, block_length=8),
    "ancestral K=64": sampling.AncestralSpec(steps=64),
}


def models():
  char = shakespeare_char.get_config()
  char.train.num_steps = STEPS
  bpe = shakespeare_bpe.get_config()
  bpe.train.num_steps = STEPS
  out = {}
  import mdjax
  for name, config, workdir in (("char", char, _CHAR.value), ("bpe", bpe, _BPE.value),
                                ("causal", shakespeare_causal.get_config(), _CAUSAL.value)):
    if _STEP.value is None:
      train.ensure_trained(config, workdir)
    # --step: both denoisers at that step; the reference at its newest checkpoint.
    out[name] = mdjax.load(workdir, None if name == "causal" else _STEP.value)
  return out


def bits_per_char(model) -> float:
  windows = model.task.validation_windows(NELBO_WINDOWS)
  est = elbo.nelbo_estimate(model.denoiser, model.params, windows,
                                  schedule=train.masking_schedule(model.config),
                                  mask_id=model.task.mask_id, seed=_SEED.value)
  total_bits = est["bits_per_token"] * windows.size
  chars = sum(tokenizers.characters_of(model.task.tokenizer, w) for w in windows)
  return total_bits / chars


def held_out_prompts(task) -> list[np.ndarray]:
  """Prefixes of held-out speeches longer than 64 tokens, of the lengths PROMPT_TOKENS."""
  speeches = [s for s in task.corpus.validation_text.split(tokenizers.DOCUMENT_SEPARATOR)
              if len(s) > 400]
  picks = np.linspace(0, len(speeches) - 1, len(PROMPT_TOKENS)).astype(int)
  return [task.encode(speeches[i])[:n] for i, n in zip(picks, PROMPT_TOKENS)]


def gen_bits(causal, completions: list[str]) -> float:
  """Mean generative bits per character of completions under the causal character model
  (each cut to its window; empty ones skipped)."""
  bits, chars = 0.0, 0
  length = causal.task.length
  for t in completions:
    t = "".join(c for c in t if c in causal.task.tokenizer.vocab)[:length]
    if not t:
      continue
    x = np.full((1, length), 0, np.int32)
    ids = causal.task.encode(t)
    x[0, :len(ids)] = ids
    # The causal model reads left to right: the first len(t) tokens' bits ignore the padding.
    bits += float(_per_token_bits(causal, x)[0, :len(ids)].sum())
    chars += len(ids)
  return bits / max(chars, 1)


def _per_token_bits(causal, x_NxL):
  import jax.numpy as jnp
  inputs = jnp.concatenate([jnp.full((x_NxL.shape[0], 1), causal.task.mask_id, jnp.int32),
                            jnp.asarray(x_NxL)[:, :-1]], 1)
  logits = causal.denoiser(causal.params, inputs, jnp.zeros(x_NxL.shape[0]))
  logp = jax.nn.log_softmax(logits, -1)
  return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(x_NxL)[..., None], -1)[..., 0]
                     ) / math.log(2.0)


def generate(model, causal, name, spec, eos: bool) -> dict:
  task = model.task
  prompts = held_out_prompts(task)
  if eos:
    spec = generation.with_eos(spec, task.eos_id, eos_rank_last="ranked last" in name)
  tokens, valid, start = generation.left_padded(prompts, task.length, task.mask_id)
  key = jax.random.key(_SEED.value)
  call = lambda: sampling.sample(model.denoiser, model.params, key, tokens, spec,
                                 mask_id=task.mask_id, valid_BxL=valid)
  jax.block_until_ready(call().tokens_BxL)  # compile
  begin = time.perf_counter()
  out = call()
  jax.block_until_ready(out.tokens_BxL)
  seconds = time.perf_counter() - begin
  final, lengths = np.asarray(out.tokens_BxL), np.asarray(out.generated_length_B)
  texts = [task.decode(generation.completion_ids(final[j], start, lengths[j]))
           for j in range(len(prompts))]
  return {"sampler": name, "batch": len(prompts), "prompt_lengths": [len(p) for p in prompts],
          "eos_early_stop": eos, "mean_generated_length": float(lengths.mean()),
          "gen_bits_per_char": gen_bits(causal, texts),
          "output_tokens_per_s": float(lengths.sum() / seconds), "nfe": int(out.nfe),
          "example": task.decode(final[0][start - len(prompts[0]):start]) + " | " + texts[0]}


BATCH_CHECK_SPECS = (sampling.ConfidenceSpec(steps=32, temperature=0.0),
                     sampling.ConfidenceSpec(steps=32), sampling.AncestralSpec(steps=32),
                     sampling.ConfidenceSpec(steps=32, block_length=8, kv_cache="dual"))


def batch_equals_rows(model) -> bool:
  """Whether the left-padded batch gives, row for row, the tokens of each row alone (its own
  row key, no padding), for greedy and random draws and the dual KV cache."""
  task = model.task
  prompts = held_out_prompts(task)
  tokens, valid, start = generation.left_padded(prompts, task.length, task.mask_id)
  keys_B = sampling.row_keys(jax.random.key(0), len(prompts))  # each row alone: its own key
  gen = task.length - start
  for spec in BATCH_CHECK_SPECS:
    spec = generation.with_eos(spec, task.eos_id)
    out = np.asarray(sampling.sample(model.denoiser, model.params, keys_B, tokens, spec,
                                     mask_id=task.mask_id, valid_BxL=valid).tokens_BxL)
    for row, p in enumerate(prompts):
      alone = np.concatenate([p, np.full(gen, task.mask_id, np.int32)])[None]
      single = np.asarray(sampling.sample(model.denoiser, model.params, keys_B[row:row + 1],
                                          alone, spec, mask_id=task.mask_id).tokens_BxL)
      if not (single[0, len(p):] == out[row, start:]).all():
        print(f"batch != rows: {spec}, row {row}", flush=True)
        return False
  return True


MESH_CHECK = """
import jax, numpy as np, mdjax
from mdjax import generation, mesh as mesh_lib, sampling
from mdjax.train import make_mesh
model = mdjax.load({workdir!r})
task = model.task
canvas = np.asarray(task.empty_canvas(8))
spec = generation.with_eos(sampling.ConfidenceSpec(steps=32), task.eos_id)
one = sampling.sample(model.denoiser, model.params, jax.random.key(0), canvas, spec,
                      mask_id=task.mask_id)
four = mesh_lib.sample_on_mesh(model.denoiser, model.params, jax.random.key(0), canvas, spec,
                               make_mesh(4), mask_id=task.mask_id)
print("EQUAL", bool((np.asarray(one.tokens_BxL) == np.asarray(four.tokens_BxL)).all()))
"""


def mesh_equals_single_device(workdir: str) -> bool:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", MESH_CHECK.format(workdir=workdir)], env=env,
                        capture_output=True, text=True, timeout=1200)
  return "EQUAL True" in proc.stdout


def main(argv):
  del argv
  m = models()
  results = {"char_bits_per_char": bits_per_char(m["char"]),
             "bpe_bits_per_char": bits_per_char(m["bpe"]), "rows": [],
             "train_steps": {name: int(model.step) for name, model in m.items()}}
  for name, spec in SAMPLERS.items():
    for eos in (False, True):
      if "ranked last" in name and not eos:
        continue
      results["rows"].append(generate(m["bpe"], m["causal"], name, spec, eos))
      print(results["rows"][-1])
  results["batch_equals_rows"] = batch_equals_rows(m["bpe"])
  results["mesh_equals_single_device"] = mesh_equals_single_device(_BPE.value)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "generation.json"), "w") as f:
    json.dump(results, f, indent=2)
  lines = ["# Generation", "",
           f"Bits per character on the held-out plays: character model "
           f"{results['char_bits_per_char']:.3f}, BPE model {results['bpe_bits_per_char']:.3f} "
           f"(training steps: {results['train_steps']}).",
           "", "| sampler | EOS early stop | prompt lengths | mean generated length | "
           "gen. bits/char | output tokens/s | calls |", "|---|---|---|---|---|---|---|"]
  for r in results["rows"]:
    lines.append(f"| {r['sampler']} | {r['eos_early_stop']} | {r['prompt_lengths']} | "
                 f"{r['mean_generated_length']:.1f} | {r['gen_bits_per_char']:.2f} | "
                 f"{r['output_tokens_per_s']:.0f} | {r['nfe']} |")
  lines += ["", f"batch equals rows: {results['batch_equals_rows']}; mesh equals one device: "
            f"{results['mesh_equals_single_device']}", "", "Examples (prompt | completion):", ""]
  lines += [f"- {r['sampler']}, EOS {r['eos_early_stop']}: `{r['example']!r}`"
            for r in results["rows"]]
  with open(os.path.join(_OUT.value, "generation.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
