"""From autoregressive to diffusion on character-level Shakespeare: a causal model trained
here, converted to a masked (Dream layout) and a block (Fast-dLLM v2 layout) diffusion LM,
against the same diffusion models trained from scratch with the same token budget.

  python experiments/a2d.py            # -> results/a2d.{json,md,png}
  python experiments/a2d.py --workdir=/tmp/a2d
  python experiments/a2d.py --rows_from=results/a2d.json --out=/tmp/report  # no training

Every model is one tiny network (width 64, 2 layers, 4 heads, SwiGLU 256, RoPE; 64-character
windows, batch 32): about 45 minutes on the shared 2-core CPU (490 s the causal model, 2,020 s
the five diffusion runs, 200 s the evaluation); a rerun reuses the trained models in WORKDIR:

1. ar: mdjax's causal Transformer (configs/shakespeare_causal.py at this size), AR_STEPS
   steps, exported to a Llama folder (`mdjax.convert.causal_export`: the same network, equal
   logits). Its exact validation bits per character are the floor every diffusion bound sits
   above.
2. The conversions (`mdjax.convert.convert`): masked (the shift kept, bidirectional attention,
   Dream's layout) and block (blocks of BLOCK, the shift kept, Fast-dLLM v2's layout), each
   trained by its recipe (configs/a2d_masked.py: MD4's NELBO; configs/a2d_block.py: the block
   NELBO with complementary masks) for DIFF_STEPS steps from the AR weights ("ar"), and from a
   fresh init of the same causal network put through the same conversion ("scratch": the same
   architecture, layout and recipe; only the start differs). The masked conversion also with
   attention annealing (causal -> bidirectional over ANNEAL_STEPS) against the direct switch.
3. Every run's start (step 0: the converted folder) and its checkpoints at CURVE steps:
   validation NELBO in bits per character (the same NELBO_WINDOWS held-out windows, the masked
   runs' MD4 NELBO, the block runs' block NELBO, both full time range: upper bounds on the same
   -log2 p(x); NELBO_TIME_SAMPLES replicates, their standard error); at the last step, SAMPLES samples of 64 characters (ancestral,
   64 steps; block by block for the block models) scored by the AR model (generative
   perplexity per character, `mdjax.evaluate.gen_ppl`) with their character entropy.

Tokens are training tokens read: steps x batch x 64 (a complementary-mask step reads each row
twice but counts it once). --rows_from=FILE trains and evaluates nothing: it reads the goals
off the rows of a results file again and writes the report (what tests/test_experiments.py
runs, on rows it made up).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import a2d_block, a2d_masked, shakespeare_causal  # noqa: E402
from mdjax import convert, diffusion, prepare_data, report, sampling, tasks, train  # noqa: E402
from mdjax import jsonl  # noqa: E402
from mdjax.convert import causal_export  # noqa: E402
from mdjax.evaluate import elbo, gen_ppl  # noqa: E402

LENGTH, BLOCK, BATCH = 64, 16, 32
MODEL = dict(d_model=64, num_layers=2, num_heads=4, d_ff=256)
AR_STEPS = 1500
DIFF_STEPS = 450
CURVE = (75, 150, 300, 450)  # checkpoint steps evaluated (150: a third of DIFF_STEPS)
ANNEAL_STEPS = 200
LR = 2e-3
NELBO_WINDOWS, NELBO_TIME_SAMPLES = 256, 4
SAMPLES, SAMPLE_STEPS = 64, 64
TEXT_PATH = None  # None: the Shakespeare corpus (held-out plays); a UTF-8 file otherwise


def ar_config():
  """The causal model: configs/shakespeare_causal.py at the experiment's size."""
  c = shakespeare_causal.get_config()
  c.task_kwargs.update(length=LENGTH, text_path=TEXT_PATH)
  c.model.update(**MODEL)
  c.batch_size = BATCH
  c.train.update(num_steps=AR_STEPS, warmup_steps=min(100, AR_STEPS // 2), lr=LR)
  c.eval_every = 0
  c.eval_batches = 4
  c.log_every = 250
  c.checkpoint.update(every=AR_STEPS, keep=1)
  return c


# (name, conversion, start, a2d.anneal_steps): the diffusion runs, all DIFF_STEPS long.
RUNS = (("masked", "masked", "ar", 0), ("masked_anneal", "masked", "ar", ANNEAL_STEPS),
        ("masked", "masked", "scratch", 0), ("block", "block", "ar", 0),
        ("block", "block", "scratch", 0))
EOS_TOKEN = causal_export.START_TOKEN  # the corpus's document separator: one per input file


def diffusion_config(to: str, start_dir: str, corpus_dir: str, anneal_steps: int):
  """The recipe of a conversion (configs/a2d_masked.py or a2d_block.py) at the experiment's
  size: from `start_dir`, on the prepared corpus (the training plays in the start's ids)."""
  c = (a2d_masked if to == "masked" else a2d_block).get_config()
  c.task = "corpus"
  c.task_kwargs = type(c.task_kwargs)(dict(data_dir=corpus_dir, length=LENGTH,
                                           documents="packed"))
  c.train.init_from = "pretrained:" + start_dir
  c.batch_size = BATCH
  c.train.update(num_steps=DIFF_STEPS, warmup_steps=min(50, DIFF_STEPS // 2), lr=LR,
                 ema_decay=0.0)
  c.a2d.anneal_steps = anneal_steps
  c.eval_every = 0
  c.eval_batches = 2
  c.num_eval_samples = 0
  c.log_every = 150
  c.checkpoint.update(every=CURVE[0], keep=DIFF_STEPS // CURVE[0])
  return c


def _timed_train(config, workdir: str) -> float:
  """Trains (or reuses) `config` in `workdir`; its recorded training seconds."""
  begin = time.perf_counter()
  train.train(config, workdir)
  recorded = train.read_train_seconds(workdir)
  return recorded if recorded is not None else time.perf_counter() - begin


def prepare(workdir: str, seed: int) -> dict:
  """The AR model and its Llama folder, a fresh causal network's Llama folder, their
  conversions and the corpus in their ids: {name: path}, with the AR training seconds."""
  paths = {"ar": os.path.join(workdir, "ar")}
  seconds = _timed_train(ar_config(), paths["ar"])
  for start in ("ar", "scratch"):
    folder = os.path.join(workdir, f"{start}_llama")
    if not os.path.isdir(folder):
      if start == "ar":
        causal_export.export(paths["ar"], folder)
      else:  # the same network and init as the AR run's step 0, another seed
        causal_export.export_fresh(ar_config(), folder, seed=seed + 1)
    for to in ("masked", "block"):
      out = os.path.join(workdir, f"{start}_{to}")
      if not os.path.isdir(out):
        convert.convert(folder, out, to=to, block_size=BLOCK if to == "block" else None)
      paths[f"{start}_{to}"] = out
  corpus_dir = os.path.join(workdir, "corpus")
  if not os.path.isdir(corpus_dir):
    text_path = os.path.join(workdir, "train_text.txt")
    with open(text_path, "w", encoding="utf-8") as f:
      f.write(tasks.from_config(ar_config()).corpus.train_text)
    prepare_data.prepare([text_path], os.path.join(paths["ar_masked"], "tokenizer.json"),
                         corpus_dir, validation_fraction=0.01, eos_token=EOS_TOKEN)
  paths["corpus"] = corpus_dir
  return {"paths": paths, "ar_train_seconds": seconds}


def _start(folder: str):
  """(apply_fn, float32 params, mask id) of a converted folder under the denoiser contract
  training gives it (`train.sft.PublishedView`: the mask id is the vocabulary size)."""
  from mdjax import io
  from mdjax.train.sft import PublishedView
  model = io.load(folder)
  params = jax.tree.map(lambda p: np.asarray(p, np.float32), model.params)
  return PublishedView(model.config).denoiser(), params, model.config.vocab_size


def _samples(model, n: int, to: str, key) -> np.ndarray:
  """n x LENGTH samples from nothing: ancestral, SAMPLE_STEPS steps (block by block)."""
  mask_id = model.task.mask_id
  if to == "masked":
    canvas = np.full((n, LENGTH), mask_id, np.int32)
    out = sampling.sample(model.denoiser, model.params, key, canvas,
                          sampling.AncestralSpec(steps=SAMPLE_STEPS), mask_id=mask_id)
    return np.asarray(out.tokens_BxL)
  out = sampling.sample_blocks(
      model.denoiser, model.params, key, np.zeros((n, 0), np.int32),
      sampling.AncestralSpec(steps=SAMPLE_STEPS * BLOCK // LENGTH), length=LENGTH,
      blocks_of=BLOCK, window=LENGTH - BLOCK, mask_id=mask_id, cached=False)
  return np.asarray(out.tokens_BxT)


def sample_quality(texts: list[str], judge) -> dict:
  """Generative perplexity per character under the AR model, and the mean character
  entropy (nats) of the samples."""
  scored = gen_ppl.generative_perplexity(texts, judge)
  return {"gen_ppl": float(scored.gen_ppl), "entropy": float(np.mean(scored.entropy_N))}


def run(n: int, workdir: str = "/tmp/a2d", seed: str = "0", rows_from: str = "") -> dict:
  if rows_from:  # the report again, from the rows of a results file
    with open(rows_from, encoding="utf-8") as f:
      results = jsonl.loads(f.read(), f"rows_from={rows_from!r}", "rows_from")
    return {**results, "goals": goals(results["rows"])}
  seed = int(seed)
  prepared = prepare(workdir, seed)
  paths = prepared["paths"]
  trained = []
  for name, to, start, anneal in RUNS:
    run_dir = os.path.join(workdir, f"run_{name}_{start}")
    config = diffusion_config(to, paths[f"{start}_{to}"], paths["corpus"], anneal)
    print(f"== {name} from {start}: {run_dir}", flush=True)
    trained.append((name, to, start, anneal, run_dir, _timed_train(config, run_dir)))

  evaluation_begins = time.perf_counter()
  ar = train.load(paths["ar"])
  text_task = ar.task
  windows = text_task.validation_windows(NELBO_WINDOWS)
  floor = float(elbo.causal_bits(ar.denoiser, ar.params, windows,
                                 start_id=text_task.mask_id).mean() / LENGTH)
  judge = gen_ppl.load_judge(ar)
  key = jax.random.key(seed)
  rows, examples = [], {}
  for name, to, start, anneal, run_dir, seconds in trained:
    for step in (0,) + CURVE:
      if step == 0:  # the converted folder as training starts from it
        apply_fn, params, mask_id = _start(paths[f"{start}_{to}"])
      else:
        model = train.load(run_dir, step)
        apply_fn, params, mask_id = model.denoiser, model.params, model.task.mask_id
      est = elbo.nelbo_estimate(
          apply_fn, params, windows, schedule=diffusion.get_schedule("linear"),
          mask_id=mask_id, time_samples=NELBO_TIME_SAMPLES, seed=seed,
          block_size=BLOCK if to == "block" else None)
      row = {"method": name, "start": start, "tokens": step * BATCH * LENGTH, "steps": step,
             "val_nelbo_bits_per_token": est["bits_per_token"], "val_nelbo_se": est["se"],
             "anneal_steps": anneal}
      if step == CURVE[-1]:
        tokens = _samples(model, n, to, jax.random.fold_in(key, len(rows)))
        texts = [model.task.decode(row_ids) for row_ids in tokens]
        row["sample_quality"] = sample_quality(texts, judge)
        row["train_seconds"] = seconds
        examples[f"{name} from {start}"] = texts[0]
      rows.append(row)
      print(row, flush=True)

  ar_tokens = np.asarray(elbo.causal_sample(ar.denoiser, ar.params, key, batch=n,
                                            length=LENGTH, start_id=text_task.mask_id))
  reference = {
      "ar_samples": sample_quality([text_task.decode(r) for r in ar_tokens], judge),
      "held_out_text": sample_quality([text_task.decode(r) for r in windows[:n]], judge)}
  return {"rows": rows, "ar_bits_per_token": floor, "reference_quality": reference,
          "goals": goals(rows), "examples": examples,
          "setup": {"model": MODEL, "length": LENGTH, "batch": BATCH, "block_size": BLOCK,
                    "ar_steps": AR_STEPS, "diffusion_steps": DIFF_STEPS, "lr": LR,
                    "anneal_steps": ANNEAL_STEPS, "nelbo_windows": NELBO_WINDOWS,
                    "nelbo_time_samples": NELBO_TIME_SAMPLES, "samples": n,
                    "sample_steps": SAMPLE_STEPS, "seed": seed,
                    "recipes": {to: {k: v for k, v in diffusion_config(
                        to, paths[f"ar_{to}"], paths["corpus"], 0).a2d.to_dict().items()}
                                for to in ("masked", "block")}},
          "ar_train_seconds": prepared["ar_train_seconds"],
          "diffusion_train_seconds": sum(t[-1] for t in trained),
          # This invocation's seconds after the training (which a rerun reuses).
          "eval_seconds": time.perf_counter() - evaluation_begins}


def _curve(rows, method, start):
  return sorted((r for r in rows if r["method"] == method and r["start"] == start),
                key=lambda r: r["tokens"])


def goals(rows) -> dict:
  """The issue's goals, read off the curves: the first budget where each conversion's NELBO
  is at or below its scratch run's final NELBO (and whether that is within a third of the
  budget); block against masked at every budget; annealing against the direct switch."""
  out = {}
  for method in ("masked", "block"):
    scratch, ar = _curve(rows, method, "scratch"), _curve(rows, method, "ar")
    final = scratch[-1]
    reached = next((r["tokens"] for r in ar
                    if r["val_nelbo_bits_per_token"] <= final["val_nelbo_bits_per_token"]), None)
    out[f"{method}_tokens_to_scratch_final"] = {
        "scratch_final_nelbo": final["val_nelbo_bits_per_token"],
        "scratch_tokens": final["tokens"], "converted_tokens": reached,
        "fraction": None if reached is None else reached / final["tokens"],
        "within_a_third": reached is not None and 3 * reached <= final["tokens"]}
  masked, block = _curve(rows, "masked", "ar"), _curve(rows, "block", "ar")
  out["block_minus_masked_at_equal_tokens"] = [
      {"tokens": m["tokens"],
       "difference": b["val_nelbo_bits_per_token"] - m["val_nelbo_bits_per_token"],
       "se": float(np.hypot(b["val_nelbo_se"], m["val_nelbo_se"]))}
      for m, b in zip(masked, block)]
  out["block_beats_masked_at_every_budget"] = all(
      d["difference"] < 0 for d in out["block_minus_masked_at_equal_tokens"])
  anneal = _curve(rows, "masked_anneal", "ar")
  out["anneal_minus_direct"] = [
      {"tokens": d["tokens"],
       "difference": a["val_nelbo_bits_per_token"] - d["val_nelbo_bits_per_token"],
       "se": float(np.hypot(a["val_nelbo_se"], d["val_nelbo_se"]))}
      for d, a in zip(masked, anneal)]
  out["anneal_seconds_over_direct"] = anneal[-1]["train_seconds"] / masked[-1]["train_seconds"]
  return out


COLUMNS = ("method", "start", "tokens", "steps", "val_nelbo_bits_per_token", "val_nelbo_se")


def write(results: dict, out: str) -> None:
  report.write_json(os.path.join(out, "a2d.json"), results)
  final = [{**r, **r["sample_quality"]} for r in results["rows"] if "sample_quality" in r]
  g = results["goals"]
  lines = ["# From autoregressive to diffusion (character-level Shakespeare)", "",
           f"Causal model: {results['ar_bits_per_token']:.4f} bits per character on the held-out "
           "windows (the floor).", "",
           report.markdown_table(results["rows"], COLUMNS),
           "## Final models: samples (generative perplexity per character under the AR model, "
           "character entropy in nats)", "",
           report.markdown_table(final, ("method", "start", "tokens", "gen_ppl", "entropy",
                                         "train_seconds")),
           f"References: AR samples {results['reference_quality']['ar_samples']}, held-out text "
           f"{results['reference_quality']['held_out_text']}.", "", "## Goals", ""]
  for method in ("masked", "block"):
    goal = g[f"{method}_tokens_to_scratch_final"]
    lines.append(f"- {method}: converted reaches scratch's final NELBO "
                 f"({goal['scratch_final_nelbo']:.4f}) at {goal['converted_tokens']} of "
                 f"{goal['scratch_tokens']} tokens: within a third: {goal['within_a_third']}")
  lines.append(f"- block beats masked at every budget: {g['block_beats_masked_at_every_budget']}")
  lines.append(f"- annealing / direct training seconds: {g['anneal_seconds_over_direct']:.3f}")
  lines += ["", "Examples:", ""]
  lines += [f"- {name}: `{text!r}`" for name, text in results["examples"].items()]
  report.write_text(os.path.join(out, "a2d.md"), "\n".join(lines) + "\n")
  fig, ax = report.new_figure(figsize=(6, 4))
  for name, start in sorted({(r["method"], r["start"]) for r in results["rows"]}):
    curve = _curve(results["rows"], name, start)
    ax.errorbar([r["tokens"] for r in curve], [r["val_nelbo_bits_per_token"] for r in curve],
                yerr=[r["val_nelbo_se"] for r in curve], marker="o",
                ls="-" if start == "ar" else "--", label=f"{name} ({start})")
  ax.axhline(results["ar_bits_per_token"], color="gray", ls=":", label="causal model")
  ax.set_xlabel("training tokens")
  ax.set_ylabel("validation NELBO, bits / char")
  ax.legend(fontsize=7)
  report.save_figure(fig, os.path.join(out, "a2d.png"))


if __name__ == "__main__":
  report.experiment_main(__doc__, run, write, "a2d.md", default_n=SAMPLES,
                         options={"workdir": ("/tmp/a2d", "where the models are trained"),
                                  "seed": ("0", "PRNG seed"),
                                  "rows_from": ("", "a results file (results/a2d.json): the "
                                                "goals and the report from its rows, nothing "
                                                "trained")})
