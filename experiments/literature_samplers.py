"""Dependency- and revision-aware samplers against the joint, at matched denoiser budgets.

  python experiments/literature_samplers.py [--sa_workdir=/tmp/scan_and_add_study]
      [--text_workdir=/tmp/text_quality] [--n=2000] [--out=results] [--smoke]

Every family of mdjax.sampling at budgets of about 8, 16 and 32 evaluated contexts per
sample (64 for text): ancestral (MD4), confidence (MaskGIT/LLaDA), remasking (ReMDM),
test-and-defer (PUNT-style, two thresholds), direct revision (D3IM-style, leave-group-out
predictions) and localized remasking (PURE-style), plus the exact speculative sampler at
k = 2, 4, 8 (its budget is what it uses). On ScanAndAdd M = 1, with the exact denoiser
and the trained model of the study (WORKDIR/M1, trained first if missing): correctness,
add-count violations, TVT against the data with its noise floor and p-value. On
character-level Shakespeare (the models of experiments/text_quality.py, trained first if
missing), N / 4 samples per row: generative bits per character under the causal
reference, word validity and distinct bigrams. Writes results/literature_samplers.
{json,md,png}; fixed seeds.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: configs/ and experiments/ live in the repo root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time

import jax
import numpy as np

from experiments import scan_and_add_study as study
from experiments import smoke as smoke_run
from experiments import text_quality
from mdjax import metrics, report, sampling
from mdjax.sampling.families import defer
from mdjax.tasks import scan_and_add as sa

BUDGETS = {"scan_and_add": (8, 16, 32), "shakespeare": (16, 32, 64)}
SPECULATIVE_KS = (2, 4, 8)
DEFER_THRESHOLDS = (0.02, 0.2)  # at a matched budget (steps bounded)
ADAPTIVE_DEFER_THRESHOLDS = (0.02, 0.1, 0.3)  # steps = L: calls follow the deferrals
SCORE_GROUPS = 4  # leave-group-out contexts of revision and localized remasking
FAMILY_ORDER = ("ancestral", "confidence", "remask", "defer", "revision", "local_remask",
                "speculative")
EXACT = {"speculative": "exact with an exact denoiser (chain-rule law, any k)"}
ROW_KEYS = ("task", "denoiser", "sampler", "knobs", "n", "calls_per_sample", "correct",
            "add_count_valid", "tvt", "tvt_floor", "p_value", "gen_bits_per_char",
            "word_validity")


def specs_at(budget: int, length: int) -> list[tuple[str, dict, sampling.SamplerSpec]]:
  """(family, knobs, spec) spending at most about `budget` contexts per sample."""
  levels = defer.num_levels(length)
  rounds = 1 if budget <= 16 else 2
  base_steps = budget // 2
  refill_steps = max(1, (budget - base_steps - rounds * SCORE_GROUPS) // rounds)
  # Revision: K canvas calls and K - 1 leave-group-out calls of G contexts each.
  revision_steps = max(2, (budget + SCORE_GROUPS) // (1 + SCORE_GROUPS))
  out = [("ancestral", {"steps": budget}, sampling.AncestralSpec(steps=budget)),
         ("confidence", {"steps": budget}, sampling.ConfidenceSpec(steps=budget)),
         ("remask", {"steps": budget, "eta": 0.05}, sampling.RemaskSpec(steps=budget, eta=0.05))]
  # Test-and-defer: a tested step costs 1 + J contexts, the last step 1.
  defer_steps = max(2, (budget - 1) // (1 + levels) + 1)
  for threshold in DEFER_THRESHOLDS:
    out.append(("defer", {"steps": defer_steps, "threshold": threshold},
                sampling.DeferSpec(steps=defer_steps, threshold=threshold)))
  out.append(("revision", {"steps": revision_steps, "score_groups": SCORE_GROUPS},
              sampling.RevisionSpec(steps=revision_steps, score_groups=SCORE_GROUPS)))
  local = sampling.LocalRemaskSpec(
      base=sampling.ConfidenceSpec(steps=base_steps),
      refill=sampling.ConfidenceSpec(steps=refill_steps), rounds=rounds, seeds=2, window=2,
      context_fraction=0.1, score_groups=SCORE_GROUPS)
  out.append(("local_remask", {"base_steps": base_steps, "refill_steps": refill_steps,
                               "rounds": rounds, "seeds": 2, "window": 2,
                               "context_fraction": 0.1}, local))
  return out


def adaptive_specs(length: int):
  """Samplers whose cost is what they need: speculative (exact) and test-and-defer run to the
  end (steps = L, so only the threshold decides how much is deferred)."""
  out = [("speculative", {"k": k, "order": "max_prob"}, sampling.SpeculativeSpec(k=k))
         for k in SPECULATIVE_KS]
  out += [("defer", {"steps": length, "threshold": threshold},
           sampling.DeferSpec(steps=length, threshold=threshold))
          for threshold in ADAPTIVE_DEFER_THRESHOLDS]
  return out


def timed_sample(apply_fn, params, canvas, spec, mask_id: int, seed: int):
  """(result, seconds): compiled first, then timed on its own."""
  lowered, args = sampling.lower(apply_fn, params, jax.random.key(seed), canvas, spec,
                                 mask_id=mask_id)
  compiled = lowered.compile()
  start = time.perf_counter()
  result = compiled(*args)
  result.tokens_BxL.block_until_ready()
  return result, time.perf_counter() - start


def calls_per_sample(result) -> float:
  """Contexts evaluated per sample (the compute budget)."""
  return float(np.mean(np.asarray(result.contexts_B)))


def _empty_row(task: str, denoiser: str, family: str, knobs: dict, n: int) -> dict:
  return {**{k: None for k in ROW_KEYS}, "task": task, "denoiser": denoiser, "sampler": family,
          "knobs": knobs, "n": n}


def family_rows(task_name: str, denoiser: str, apply_fn, params, canvas, mask_id: int,
                score, seed: int) -> list[dict]:
  """One row per sampler of the plan: its budget, calls, run time and `score(tokens)`."""
  length = canvas.shape[1]
  plan = [(b, s) for b in BUDGETS[task_name] for s in specs_at(b, length)]
  plan += [(None, s) for s in adaptive_specs(length)]
  rows = []
  for i, (budget, (family, knobs, spec)) in enumerate(plan):
    result, seconds = timed_sample(apply_fn, params, canvas, spec, mask_id, seed + i)
    row = _empty_row(task_name, denoiser, family, knobs, canvas.shape[0])
    row.update(budget=budget, calls_per_sample=calls_per_sample(result),
               sequential_calls=int(result.nfe), seconds=round(seconds, 3),
               **score(np.asarray(result.tokens_BxL)))
    rows.append(row)
    _print(row)
  return rows


def scan_and_add_score(reference, null_tvt):
  def score(tokens):
    checks = sa.sample_metrics(tokens)
    return {"correct": checks["correct"], "add_count_valid": checks["add_count_valid"],
            **metrics.compare_to_data(tokens, reference, null_tvt, sa.VOCAB_SIZE + 1)}
  return score


def _print(row: dict) -> None:
  shown = {k: v for k, v in row.items() if v is not None and k not in ("task", "n")}
  print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                 for k, v in shown.items()), flush=True)


def run(n: int, sa_workdir: str = "/tmp/scan_and_add_study",
        text_workdir: str = "/tmp/text_quality", seed: int = 0, repeats: int = 200,
        sa_model=None, text_models=None) -> dict:
  """`sa_model` = (apply_fn, params) and `text_models` = (task, models) skip training."""
  start = time.perf_counter()
  if sa_model is None:
    sa_model = study.trained_model(sa_workdir, 1)[:2]
  if text_models is None:
    text_models = text_quality.trained_models(text_workdir)
  draw = lambda i: np.asarray(sa.sample_data(jax.random.key(90_000 + i), n))
  null_tvt = metrics.noise_floor(draw, n, sa.VOCAB_SIZE + 1, repeats=repeats)
  reference = draw(2 * repeats)
  score = scan_and_add_score(reference, null_tvt)
  canvas = sa.empty_canvas(n)
  rows = family_rows("scan_and_add", "oracle", sa.exact_denoiser, None, canvas, sa.MASK_ID,
                     score, seed)
  rows += family_rows("scan_and_add", "model", *sa_model, canvas, sa.MASK_ID, score, seed + 1000)
  task, models = text_models
  rows += family_rows("shakespeare", "model", *models["char"], task.empty_canvas(max(n // 4, 2)),
                      task.mask_id, lambda tokens: text_quality.scores(task, tokens,
                                                                        models["causal"]),
                      seed + 2000)
  return {"rows": rows, "budgets": BUDGETS, "exact": EXACT,
          "seconds": round(time.perf_counter() - start, 1)}


def _knobs(knobs: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in knobs.items())


def write(results: dict, out: str) -> None:
  report.write_json(os.path.join(out, "literature_samplers.json"), results)
  rows = [{**r, "knobs": _knobs(r["knobs"])} for r in results["rows"]]
  sa_columns = ["sampler", "knobs", "calls_per_sample", "sequential_calls", "seconds", "correct",
                "add_count_valid", "tvt", "tvt_floor", "p_value"]
  text_columns = ["sampler", "knobs", "calls_per_sample", "sequential_calls", "seconds",
                  "gen_bits_per_char", "word_validity", "distinct_2"]
  text = ("# Literature samplers at matched denoiser budgets\n\n"
          "calls_per_sample: contexts evaluated per sample (a batched call of J contexts "
          "counts J); sequential_calls: denoiser calls in sequence; seconds: the compiled "
          "program's run time for the whole row on this machine.\n\n")
  for task, denoiser, columns in (("scan_and_add", "oracle", sa_columns),
                                  ("scan_and_add", "model", sa_columns),
                                  ("shakespeare", "model", text_columns)):
    mine = [r for r in rows if r["task"] == task and r["denoiser"] == denoiser]
    if mine:
      text += (f"## {task}, {'exact denoiser' if denoiser == 'oracle' else 'trained model'} "
               f"({mine[0]['n']} samples a row)\n\n" + report.markdown_table(mine, columns) + "\n")
  report.write_text(os.path.join(out, "literature_samplers.md"), text)
  plot(results, os.path.join(out, "literature_samplers.png"))


def plot(results: dict, path: str) -> None:
  panels = (("scan_and_add", "oracle", "correct", "ScanAndAdd M = 1, exact denoiser"),
            ("scan_and_add", "model", "correct", "ScanAndAdd M = 1, trained model"),
            ("shakespeare", "model", "word_validity", "Shakespeare, word validity"),
            ("shakespeare", "model", "gen_bits_per_char", "Shakespeare, gen. bits/char"))
  fig, axes = report.new_figure(ncols=len(panels), figsize=(4.4 * len(panels), 4.0))
  for ax, (task, denoiser, key, title) in zip(axes, panels):
    mine = [r for r in results["rows"] if r["task"] == task and r["denoiser"] == denoiser]
    for family in FAMILY_ORDER:
      variants = sorted({_knobs({k: v for k, v in r["knobs"].items() if k in ("threshold",)})
                         for r in mine if r["sampler"] == family})
      for variant in variants:
        pick = [r for r in mine if r["sampler"] == family and _knobs(
            {k: v for k, v in r["knobs"].items() if k == "threshold"}) == variant]
        pick.sort(key=lambda r: r["calls_per_sample"])
        label = family + (f" ({variant})" if variant else "")
        ax.plot([r["calls_per_sample"] for r in pick], [r[key] for r in pick], "o-",
                label=label, ms=4)
    ax.set(xscale="log", xlabel="denoiser contexts per sample", ylabel=key, title=title)
    ax.minorticks_off()
    ticks = [t for t in (4, 8, 16, 32, 64, 128, 256, 512)
             if any(r["calls_per_sample"] <= t * 1.5 for r in mine)
             and any(r["calls_per_sample"] >= t / 1.5 for r in mine)]
    ax.set_xticks(ticks, [str(t) for t in ticks])
  axes[0].legend(fontsize=7)
  report.save_figure(fig, path)


def smoke(sa_workdir: str, text_workdir: str) -> dict:
  """Every family once at a budget of 8 on ScanAndAdd with the exact denoiser as the model
  (speculative k = 4, defer at 0.2), the speculative sampler only on the tiny text models of
  experiments/smoke.py (trained in TEXT_WORKDIR where missing), 5 null draws."""
  global BUDGETS, SPECULATIVE_KS, DEFER_THRESHOLDS, ADAPTIVE_DEFER_THRESHOLDS
  BUDGETS = {"scan_and_add": (8,), "shakespeare": ()}
  SPECULATIVE_KS, DEFER_THRESHOLDS, ADAPTIVE_DEFER_THRESHOLDS = (4,), (0.2,), ()
  text_quality.use_tiny_models(text_workdir)
  # The exact denoiser stands in for the trained model: its rows run the oracle's programs.
  return {"sa_workdir": sa_workdir, "text_workdir": text_workdir, "repeats": 5,
          "sa_model": (sa.exact_denoiser, None)}


def main():
  smoke_run.experiment_main(__doc__, run, write, "literature_samplers.md", default_n=2000,
                            options={"sa_workdir": ("/tmp/scan_and_add_study",
                                                    "where the ScanAndAdd M = 1 model is found"),
                                     "text_workdir": ("/tmp/text_quality",
                                                      "where the Shakespeare models are found")},
                            smoke=smoke, smoke_n=64)


if __name__ == "__main__":
  main()
