"""The masked (absorbing) distillation students, dParallel's and d3LLM's, against their teacher on
Shakespeare (characters): generative perplexity and entropy against sampling steps.

  python -m mdjax.bench.distill_text [--workdir=/tmp/distill_text --out=results/distill_text.json
                                      --samples=128]

Trains (or reuses) in WORKDIR: `teacher`, configs/shakespeare_char.py at duo.py's SMALL_MODEL
for TEACHER_STEPS steps (MD4's NELBO); `dparallel` and `d3llm`, configs/distill_dparallel.py
and configs/distill_d3llm.py moved to Shakespeare (`student_config`: STUDENT_STEPS steps from
the teacher, its NUM_PROMPTS prompt-less decodings as their data, by its own law:
POOL_SAMPLER at temperature 1; greedy decoding would write one text, the references'
low-confidence remasking mostly spaces); `judge`, duo.py's causal judge. Then each model
draws `samples` prompt-less 64-character samples per point of `points` (row i from
fold_in(key(SEED), i)): K steps of the fixed-step samplers (FIXED) for K in SAMPLE_STEPS, and
sweeps of the adaptive ones' knobs (ADAPTIVE), the teacher also with FIXED at the COOLER
temperatures, its pool sampler (POOL, what the students learn from) and the references'
(REFERENCE_POOL), scored as `mdjax.bench.noise_text` scores them: gen-ppl per character
and each sample's unigram entropy (nats), ± standard errors over the samples, and the mean
denoiser calls per sample. Also each model's validation NELBO, the held-out text's row, and
per student row its gen-ppl minus the teacher's best (lowest gen-ppl) training-free row
within its budget (K, or an adaptive row's mean calls), with its standard error. Written to
`out` (JSON), seeds fixed.
"""

from __future__ import annotations

import math
import os
import time

import jax
import numpy as np

import mdjax
import mdjax.accelerators.distill  # registers the objectives 'dparallel' and 'd3llm'
from mdjax import sampling, train
from mdjax.bench import accelerator_models, duo, noise_text, timing

SEED = 0
TEACHER_STEPS, STUDENT_STEPS = duo.TEACHER_STEPS, 300
NUM_PROMPTS = 1024  # the teacher's decodings a student learns from (64 rows a step: ~19 epochs)
SAMPLE_STEPS = duo.SAMPLE_STEPS
NUM_SAMPLES = duo.NUM_SAMPLES
STUDENTS = {"dparallel": "distill_dparallel", "d3llm": "distill_d3llm"}  # name: configs module
MODELS = ("teacher",) + tuple(STUDENTS)
# All at temperature 1. (label, family, knobs): K steps (SAMPLE_STEPS) of the ancestral
# sampler and of confidence-ordered decoding.
FIXED = (("ancestral", "ancestral", {}), ("confidence", "confidence", {}))
# (label, family, knob, values): the adaptive ones, bounded only by the canvas (one position a
# step at worst), a sweep of the knob whose mean calls span the fixed ones' K: the
# EB-sampler's gamma (nats) and a confidence threshold (the distillation configs' is 0.9).
# With K as their bound they would write most of the canvas at the last step.
ADAPTIVE = (("entropy_bounded", "entropy_bounded", "gamma", (1.0, 4.0, 16.0, 64.0)),
            ("threshold", "confidence", "threshold", (0.9, 0.8, 0.7, 0.3, 0.2)))
# The teacher's fixed-step samplers also at these temperatures: what sharpening alone buys
# it (the students' samples are sharper than the text). No candidates for its best: a lower
# temperature lowers gen-ppl down to a degenerate text.
COOLER = (0.9, 0.8)
# The teacher's sampler of the students' data (distill.teacher_spec at temperature 1, as many
# steps as positions): its own law, MD4's ancestral sampler. The references' LLaDA
# low-confidence remasking (the drawn token's probability, one position a step) writes the
# most probable character, a space, first: its pool is mostly spaces. Both sampled and
# scored beside the others but no candidate for the teacher's best.
POOL_SAMPLER = "ancestral"  # distill.teacher_sampler
POOL = ("pool", "ancestral", {})
REFERENCE_POOL = ("reference_pool", "confidence", {"score": "prob", "count_rule": "even"})
POOLS = (POOL, REFERENCE_POOL)
# The students' setting: unconditional text at temperature 1 (accelerator_models' form; the
# CDLM block is unused here: no CDLM student).
SETTING = accelerator_models.TaskSetting("shakespeare_char", temperature=1.0, cdlm_block=8,
                                         oracle_temperatures=(1.0,))


def points(sample_steps=SAMPLE_STEPS, length: int = 64) -> list[tuple]:
  """(label, family, knobs, steps, adaptive) of every sampled row a model gets."""
  out = [(label, family, knobs, k, False) for label, family, knobs in FIXED
         for k in sample_steps]
  return out + [(label, family, {knob: value}, length, True)
                for label, family, knob, values in ADAPTIVE for value in values]


def cooler_points(sample_steps=SAMPLE_STEPS) -> list[tuple]:
  """`points`' form of the teacher's FIXED samplers at the COOLER temperatures (labels
  '<label>_t<temperature>')."""
  return [(f"{label}_t{t}", family, {**knobs, "temperature": t}, k, False)
          for t in COOLER for label, family, knobs in FIXED for k in sample_steps]


def teacher_config(steps: int = TEACHER_STEPS):
  """configs/shakespeare_char.py at duo's SMALL_MODEL for `steps` steps."""
  from configs import shakespeare_char  # repo root
  return duo.short_config(shakespeare_char.get_config(), steps)


def student_config(name: str, teacher: str, steps: int = STUDENT_STEPS,
                   num_prompts: int = NUM_PROMPTS, distill_overrides: dict | None = None):
  """configs/distill_<name>.py on configs/shakespeare_char.py's task
  (`accelerator_models.student_config` at SETTING, no prompt): started from `teacher` and
  learning its `num_prompts` decodings by POOL_SAMPLER at temperature 1, `steps` steps;
  `distill_overrides` (e.g. entropy_weight=0) over its distill fields."""
  module = accelerator_models.config_modules({name: STUDENTS[name]})[name]
  text = teacher_config()
  config = accelerator_models.student_config(
      module, text, teacher, SETTING, seed=SEED, prompt_length=0,
      generated=text.task_kwargs.length, eval_at_end=True)
  config.train.num_steps = config.checkpoint.every = steps
  config.distill.num_prompts = num_prompts
  config.distill.teacher_sampler = POOL_SAMPLER
  config.distill.update(distill_overrides or {})
  return config


def ensure(config, workdir: str, log=print) -> dict:
  """Trains `config` in `workdir` unless it holds the finished run (which is only read, so a
  student's teacher pool is not decoded again); its cost: the run's own training clock, and
  this call's wall and CPU seconds."""
  start, cpu = time.perf_counter(), time.process_time()
  if not accelerator_models.finished(workdir, config.train.num_steps):
    train.ensure_trained(config, workdir)
  cost = {"steps": config.train.num_steps, "train_seconds": train.read_train_seconds(workdir),
          "this_run_seconds": round(time.perf_counter() - start, 1),
          "this_run_cpu_seconds": round(time.process_time() - cpu, 1)}
  log(f"{workdir}: {cost}")
  return cost


def sampled_row(name: str, model, judge, label: str, family: str, knobs: dict, steps: int,
                num_samples: int, length: int, adaptive: bool = False) -> dict:
  """`num_samples` prompt-less samples of `length` characters (row i from
  fold_in(key(SEED), i), as `mdjax.generate` draws them), scored (`noise_text.scored`), with
  the denoiser calls each sample took (its mean and standard error)."""
  start = time.perf_counter()
  spec = sampling.make_spec(family, steps=steps, **knobs)
  keys_N = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(SEED),
                                                   np.arange(num_samples))
  canvas_NxL = np.full((num_samples, length), model.mask_id, np.int32)
  out = sampling.sample(model.denoiser, model.params, keys_N, canvas_NxL, spec,
                        mask_id=model.mask_id)
  tokens_NxL = np.asarray(out.tokens_BxL)
  calls_N = np.asarray(out.rounds_B, np.float64)
  texts = [model.task.decode(row) for row in tokens_NxL]
  return {"process": name, "sampler": label, "family": family, "knobs": knobs, "steps": steps,
          "adaptive": adaptive, **noise_text.scored(texts, judge, tokens_NxL.tolist()),
          "calls": float(calls_N.mean()),
          "calls_se": float(calls_N.std(ddof=1) / math.sqrt(num_samples)),
          "seconds": round(time.perf_counter() - start, 2), "example": texts[0]}


def budget(row: dict) -> float:
  """The calls a row is compared at: K for a fixed-step sampler, the mean calls for an
  adaptive one."""
  return row["calls"] if row["adaptive"] else row["steps"]


def differences(rows: list[dict]) -> list[dict]:
  """Per student row: its gen-ppl minus the teacher's best training-free row within its
  budget (the lowest gen-ppl among the teacher's rows whose `budget` is at most the
  student's, POOLS and the COOLER rows left out; None where there is none), se sqrt(se_s^2 + se_t^2)
  (independent samples), z the difference in standard errors; beside it the difference to
  the teacher with the same sampler and knobs."""
  pools = {label for label, _, _ in POOLS}
  teacher = [r for r in rows if r["process"] == "teacher" and r["sampler"] not in pools
             and "temperature" not in r["knobs"]]
  out = []
  for s in rows:
    if s["process"] not in STUDENTS:
      continue
    within = [t for t in teacher if budget(t) <= budget(s)]
    same = next(t for t in teacher if (t["sampler"], t["knobs"], t["steps"]) == (
        s["sampler"], s["knobs"], s["steps"]))
    row = {"student": s["process"], "sampler": s["sampler"], "knobs": s["knobs"],
           "steps": s["steps"], "calls": s["calls"], "budget": budget(s),
           "same_sampler_gen_ppl_diff": s["gen_ppl"] - same["gen_ppl"],
           "same_sampler_gen_ppl_diff_se": math.hypot(s["gen_ppl_se"], same["gen_ppl_se"]),
           "teacher_sampler": None}
    if within:
      t = min(within, key=lambda r: r["gen_ppl"])
      diff, se = s["gen_ppl"] - t["gen_ppl"], math.hypot(s["gen_ppl_se"], t["gen_ppl_se"])
      row.update({"teacher_sampler": t["sampler"], "teacher_knobs": t["knobs"],
                  "teacher_steps": t["steps"], "teacher_calls": t["calls"],
                  "gen_ppl_diff": diff, "gen_ppl_diff_se": se, "gen_ppl_z": diff / se,
                  "entropy_diff": s["entropy"] - t["entropy"],
                  "entropy_diff_se": math.hypot(s["entropy_se"], t["entropy_se"])})
    out.append(row)
  return out


def table_line(row: dict) -> str:
  """noise_text's line with the mean calls."""
  calls = "" if row.get("calls") is None else f" {row['calls']:6.2f} calls"
  return noise_text.table_line(row) + calls


def run(workdir: str, num_samples: int = NUM_SAMPLES, teacher_steps: int = TEACHER_STEPS,
        judge_steps: int = duo.JUDGE_STEPS, student_steps: int = STUDENT_STEPS,
        num_prompts: int = NUM_PROMPTS, sample_steps=SAMPLE_STEPS,
        distill_overrides: dict | None = None, log=print) -> dict:
  paths = {name: os.path.join(workdir, name) for name in MODELS + ("judge",)}
  configs = {"teacher": teacher_config(teacher_steps), "judge": duo.judge_config(judge_steps)}
  costs = {"teacher": ensure(configs["teacher"], paths["teacher"], log)}
  for name in STUDENTS:
    configs[name] = student_config(name, paths["teacher"], student_steps, num_prompts,
                                   distill_overrides)
    costs[name] = ensure(configs[name], paths[name], log)
  costs["judge"] = ensure(configs["judge"], paths["judge"], log)
  models = {name: mdjax.load(paths[name]) for name in MODELS}
  task = models["teacher"].task
  nelbo, judge, judge_row, reference = duo.judged(models, paths["judge"], configs["judge"], log)
  rows = []
  for name, model in models.items():
    extra = (cooler_points(sample_steps) + [pool + (task.length, False) for pool in POOLS]
             if name == "teacher" else [])
    for label, family, knobs, steps, adaptive in points(sample_steps, task.length) + extra:
      rows.append(sampled_row(name, model, judge, label, family, knobs, steps, num_samples,
                              task.length, adaptive))
      log(table_line(rows[-1]))
  diffs = differences(rows)
  for d in diffs:
    if d["teacher_sampler"] is None:
      continue
    log(f"{d['student']:9s} {d['sampler']:15s} {d['knobs']} K={d['steps']:>3} "
        f"({d['calls']:5.2f} calls): minus the teacher's {d['teacher_sampler']} "
        f"{d['teacher_knobs']} {d['gen_ppl_diff']:+8.2f} ± {d['gen_ppl_diff_se']:.2f} "
        f"({d['gen_ppl_z']:+.1f} s.e.), entropy {d['entropy_diff']:+.3f}")
  return {
      "seed": SEED, "machine": timing.machine_info(), "model": duo.SMALL_MODEL,
      "samplers": {"fixed": [{"label": label, "family": family, "knobs": knobs}
                             for label, family, knobs in FIXED],
                   "adaptive": [{"label": label, "family": family, "knob": knob,
                                 "values": list(values)}
                                for label, family, knob, values in ADAPTIVE],
                   "cooler": {"temperatures": list(COOLER), "samplers": "fixed, teacher only",
                              "labels": "<label>_t<temperature>"},
                   "pool": {"label": POOL[0], "family": POOL[1], "knobs": POOL[2],
                            "teacher_sampler": POOL_SAMPLER, "steps": task.length},
                   "reference_pool": {"label": REFERENCE_POOL[0], "family": REFERENCE_POOL[1],
                                      "knobs": REFERENCE_POOL[2], "steps": task.length}},
      "teacher": {"config": "configs/shakespeare_char.py", **costs["teacher"],
                  **nelbo["teacher"]},
      "students": {name: {"config": f"configs/{module}.py", "num_prompts": num_prompts,
                          "teacher_temperature": 1.0, "prompt_length": 0,
                          "teacher_sampler": POOL_SAMPLER,
                          "distill_overrides": dict(distill_overrides or {}), **costs[name],
                          **nelbo[name]} for name, module in STUDENTS.items()},
      "judge": {**judge_row, **costs["judge"]}, "gen_ppl": [reference] + rows,
      "pools": {r["sampler"]: {k: r[k] for k in ("gen_ppl", "gen_ppl_se", "entropy",
                                                 "entropy_se", "calls")}
                for r in rows if r["process"] == "teacher" and r["sampler"] in
                {label for label, _, _ in POOLS}},
      "differences": diffs,
      "units": "gen_ppl: per character under the judge; entropy: nats, each sample's "
               "unigram entropy over its characters, averaged; calls: denoiser calls per "
               "sample, mean (about K for the fixed-step samplers; the adaptive ones, "
               "steps the canvas, stop by their knob); _se: standard errors over the "
               "samples (judge fixed); "
               "bits_per_char of a model: its validation NELBO; differences: a student's "
               "row minus the teacher's lowest gen-ppl row (pools and cooler rows left "
               "out) whose budget (K, or the mean calls of an adaptive row) is at most "
               "the student's, se sqrt(se_s^2 + se_t^2), z the difference in standard "
               "errors; train_seconds: the run's training clock, this_run_*: this call's "
               "(0 for a reused run)"}


def main(argv=None) -> None:
  duo.bench_main(run, __doc__, "/tmp/distill_text", "results/distill_text.json", argv)


if __name__ == "__main__":
  main()
