"""Text quality of masked-diffusion samplers on character-level Shakespeare, against step count.

  python experiments/text_quality.py [--workdir=/tmp/text_quality] [--n=500] [--out=results]
      [--smoke]

Trains (or resumes, or reuses when done) the denoiser of configs/shakespeare_char.py in
WORKDIR/char and the causal reference model of configs/shakespeare_causal.py in
WORKDIR/causal. Reports the denoiser's validation NELBO in bits per character (held-out
plays, Monte Carlo standard error), then draws N unconditional 64-character samples with
each sampler at each step count K and scores them with measures that need no known joint:
generative bits per character under the causal reference model, the fraction of whole
words found in the training text's word list, distinct word n-grams and the character
unigram entropy. The same measures on N held-out windows and on N samples of the causal
model itself are the references. Writes results/text_quality.{json,md,png}; fixed seeds.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: configs/ and experiments/ live in the repo root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time

import jax
import numpy as np

from configs import shakespeare_causal, shakespeare_char
from experiments import smoke as smoke_run
from mdjax import report, sampling, tasks, train
from mdjax.evaluate import elbo

STEPS = (4, 8, 16, 32, 64)
BLOCK_LENGTH = 16  # "blocks": confidence decoding inside 4 left-to-right blocks of 16
SAMPLERS = {
    "ancestral": lambda k: sampling.AncestralSpec(steps=k),
    "confidence": lambda k: sampling.ConfidenceSpec(steps=k),
    "remask": lambda k: sampling.RemaskSpec(steps=k, eta=0.05),
    "blocks": lambda k: sampling.ConfidenceSpec(steps=k, block_length=BLOCK_LENGTH),
}
NELBO_WINDOWS, NELBO_TIME_SAMPLES = 2048, 8
SHOWN_STEPS = (8, 64)  # decoded samples shown in the markdown at these K
CONFIGS = {"char": shakespeare_char.get_config, "causal": shakespeare_causal.get_config}
METRIC_KEYS = ("gen_bits_per_char", "gen_bits_per_char_se", "word_validity", "distinct_1",
               "distinct_2", "unigram_entropy_bits")


def scores(task, texts_tokens: np.ndarray, reference) -> dict:
  """The text measures of a sample set; gen bits per char under the causal reference."""
  ref_apply, ref_params = reference
  bits_N = elbo.causal_bits(ref_apply, ref_params, texts_tokens, start_id=task.mask_id)
  per_char_N = bits_N / task.length
  measures = task.sample_metrics(texts_tokens)
  return {"gen_bits_per_char": float(per_char_N.mean()),
          "gen_bits_per_char_se": float(per_char_N.std(ddof=1) / np.sqrt(len(per_char_N))),
          **{k: measures[k] for k in ("word_validity", "distinct_1", "distinct_2",
                                      "unigram_entropy_bits")}}


def infill_examples(task, apply_fn, params, seed: int, count: int = 3) -> list[dict]:
  """Held-out windows with their middle 32 characters regenerated (confidence, K = 32)."""
  windows = task.validation_windows(97)[[10, 50, 90][:count]]
  canvas = np.array(windows)
  canvas[:, 16:48] = task.mask_id
  out = sampling.sample(apply_fn, params, jax.random.key(seed), canvas,
                        sampling.ConfidenceSpec(steps=32), mask_id=task.mask_id)
  return [{"original": task.decode(w), "context": task.decode(c), "infilled": task.decode(o)}
          for w, c, o in zip(windows, canvas, np.asarray(out.tokens_BxL))]


def trained_models(workdir: str):
  """(task, {"char": (apply_fn, params), "causal": ...}), trained first where missing."""
  models = {}
  for name, get_config in CONFIGS.items():
    path = os.path.join(workdir, name)
    models[name] = train.ensure_trained(get_config(), path)
    print(f"{name}: trained in {train.read_train_seconds(path)} s", flush=True)
  return tasks.from_config(CONFIGS["char"]()), models


def run(n: int, workdir: str = "/tmp/text_quality", seed: int = 0) -> dict:
  char_config = CONFIGS["char"]()
  task, models = trained_models(workdir)
  apply_fn, params = models["char"]
  held_out = task.validation_windows(NELBO_WINDOWS)
  nelbo = elbo.nelbo_estimate(
      apply_fn, params, held_out, schedule=train.masking_schedule(char_config),
      mask_id=task.mask_id, time_samples=NELBO_TIME_SAMPLES, seed=seed)
  reference_bits = elbo.causal_bits(*models["causal"], held_out, start_id=task.mask_id)
  print(f"validation NELBO {nelbo['bits_per_token']:.4f} ± {nelbo['se']:.4f} bits/char; "
        f"causal reference {reference_bits.mean() / task.length:.4f} bits/char", flush=True)

  data_tokens = task.validation_windows(n)
  causal_tokens = np.asarray(elbo.causal_sample(
      models["causal"][0], models["causal"][1], jax.random.key(seed + 1), batch=n,
      length=task.length, start_id=task.mask_id))
  references = [{"sampler": "held-out text", "n": n, **scores(task, data_tokens, models["causal"])},
                {"sampler": "causal reference samples", "K": task.length, "n": n,
                 **scores(task, causal_tokens, models["causal"])}]
  examples = {"held-out text": [task.decode(r) for r in data_tokens[:3]],
              "causal reference samples": [task.decode(r) for r in causal_tokens[:3]]}

  rows = []
  for sampler, make in SAMPLERS.items():
    for k in STEPS:
      spec = make(k)
      start = time.perf_counter()
      out = sampling.sample(apply_fn, params, jax.random.key(seed + 2), task.empty_canvas(n),
                            spec, mask_id=task.mask_id)
      tokens = np.asarray(out.tokens_BxL)
      seconds = time.perf_counter() - start
      row = {"sampler": sampler, "K": k, "n": n, "calls": int(out.nfe),
             "seconds": round(seconds, 2), **scores(task, tokens, models["causal"])}
      rows.append(row)
      if k in SHOWN_STEPS:
        examples[f"{sampler}, K = {k}"] = [task.decode(r) for r in tokens[:3]]
      print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                     for key, value in row.items()), flush=True)
  return {
      "bits_per_char": nelbo["bits_per_token"], "bits_per_char_se": nelbo["se"],
      "nelbo": nelbo,
      "train_minutes": _minutes(os.path.join(workdir, "char")),
      "reference_bits_per_char": float(reference_bits.mean() / task.length),
      "reference_train_minutes": _minutes(os.path.join(workdir, "causal")),
      "task": repr(task), "n": n, "seed": seed, "steps": list(STEPS),
      "rows": rows, "references": references, "examples": examples,
      "infilling": infill_examples(task, apply_fn, params, seed + 3),
  }


def _minutes(path: str) -> float | None:
  seconds = train.read_train_seconds(path)
  return None if seconds is None else round(seconds / 60.0, 2)


def _quoted(text: str) -> str:
  return "`" + text.replace("\n", "⏎") + "`"


def write(results: dict, out: str) -> None:
  report.write_json(os.path.join(out, "text_quality.json"), results)
  columns = ("sampler", "K", "calls", "seconds") + METRIC_KEYS
  lines = [
      "# Text quality against step count (character-level Shakespeare)\n",
      f"{results['task']}; {results['n']} unconditional samples per row, temperature 1.\n",
      f"Denoiser: validation NELBO {results['bits_per_char']:.4f} ± "
      f"{results['bits_per_char_se']:.4f} bits/char ({results['nelbo']['time_samples']} time "
      f"samples over {results['nelbo']['sequences']} held-out windows; ± is the Monte Carlo "
      f"s.e.), trained in {results['train_minutes']} min. Causal reference: "
      f"{results['reference_bits_per_char']:.4f} bits/char on the same windows, trained in "
      f"{results['reference_train_minutes']} min.\n",
      "## References\n", report.markdown_table(results["references"], columns),
      "## Samplers\n", report.markdown_table(results["rows"], columns),
      "## Samples (⏎ = newline)\n"]
  for name, texts in results["examples"].items():
    lines.append(f"**{name}**\n")
    lines.extend(f"- {_quoted(t)}" for t in texts)
    lines.append("")
  lines.append("## Infilling (middle 32 characters regenerated, confidence K = 32)\n")
  for e in results["infilling"]:
    lines.append(f"- context  {_quoted(e['context'])}\n- infilled {_quoted(e['infilled'])}\n"
                 f"- original {_quoted(e['original'])}\n")
  report.write_text(os.path.join(out, "text_quality.md"), "\n".join(lines) + "\n")
  plot(results, os.path.join(out, "text_quality.png"))


def plot(results: dict, path: str) -> None:
  panels = (("gen_bits_per_char", "generative bits/char (causal ref.)"),
            ("word_validity", "word validity"), ("distinct_2", "distinct word bigrams"),
            ("unigram_entropy_bits", "char unigram entropy (bits)"))
  fig, axes = report.new_figure(ncols=len(panels), figsize=(4.2 * len(panels), 3.6))
  refs = {r["sampler"]: r for r in results["references"]}
  for ax, (key, label) in zip(axes, panels):
    for sampler in SAMPLERS:
      rows = [r for r in results["rows"] if r["sampler"] == sampler]
      ax.plot([r["K"] for r in rows], [r[key] for r in rows], "o-", label=sampler)
    ax.axhline(refs["held-out text"][key], color="k", ls="--", label="held-out text")
    ax.axhline(refs["causal reference samples"][key], color="gray", ls=":",
               label="causal model samples")
    ax.set(xscale="log", xlabel="steps K (denoiser calls)", ylabel=label)
    ax.minorticks_off()
    ax.set_xticks(results["steps"], [str(k) for k in results["steps"]])
  axes[0].legend(fontsize=7)
  report.save_figure(fig, path)


def use_tiny_models(workdir: str) -> None:
  """The tiny denoiser and reference of experiments/smoke.py, trained in WORKDIR where missing."""
  CONFIGS.update(char=lambda: smoke_run.text_config(workdir),
                 causal=lambda: smoke_run.text_config(workdir, causal=True))


def smoke(workdir: str) -> dict:
  """The tiny models, K = 4 only, blocks of 8, 8 held-out windows for the NELBO."""
  global STEPS, SHOWN_STEPS, BLOCK_LENGTH, NELBO_WINDOWS
  use_tiny_models(workdir)
  STEPS, SHOWN_STEPS, BLOCK_LENGTH, NELBO_WINDOWS = (4,), (4,), 8, 8
  return {"workdir": workdir}


def main():
  smoke_run.experiment_main(__doc__, run, write, "text_quality.md", default_n=500,
                            options={"workdir": ("/tmp/text_quality",
                                                 "where the denoiser and the reference are "
                                                 "trained")},
                            smoke=smoke, smoke_n=8)


if __name__ == "__main__":
  main()
