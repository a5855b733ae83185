"""DUO's distilled student against its uniform-noise teacher on Shakespeare (characters):
generative perplexity and entropy against sampling steps.

  python -m mdjax.bench.duo [--workdir=/tmp/duo_bench --out=results/duo.json --samples=128]

Trains (or reuses) in WORKDIR: `teacher`, configs/shakespeare_uniform.py at a small size
(SMALL_MODEL, TEACHER_STEPS steps: UDLM's NELBO under uniform noise); three
students (STUDENTS), configs/distill_duo.py on it (DUO's consistency distillation: ROUNDS
rounds of ROUND_STEPS steps, T = TEACHER_T): the KL of the posteriors, the objective's
default; of the plug-in weights, the reference's x_theta; and of the plug-in weights from
alpha 0.95 on; `judge`, configs/shakespeare_causal.py at the same size (JUDGE_STEPS
steps), the causal model that scores the samples. Then for K in SAMPLE_STEPS the four models
draw `samples` prompt-less 64-character samples with the exact reverse kernel
(uniform_ancestral, K steps; row i from fold_in(key(SEED), i)), scored as
`mdjax.bench.noise_text` scores them: gen-ppl per character with its standard error over
the samples, and each sample's unigram entropy (nats). Also the validation NELBO (bits/char)
of each under uniform noise (distillation trades likelihood for few-step samples), the
held-out text's own row, and per student and K its gen-ppl minus the teacher's with its
standard error (the two sets of samples independent). Written to `out` (JSON), seeds fixed.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import mdjax
from mdjax import evaluate, report, train
from mdjax.accelerators import duo as duo_objective  # registers the objective 'duo'
from mdjax.bench import noise_text, timing

SEED = 0
SMALL_MODEL = dict(d_model=96, num_layers=3, num_heads=4, d_ff=384)
TEACHER_STEPS, JUDGE_STEPS = 400, 400
ROUNDS, ROUND_STEPS, TEACHER_T = 5, 80, 64
SAMPLE_STEPS = (4, 8, 16, 32)
NUM_SAMPLES = 128
SAMPLER = (("uniform_ancestral", "uniform_ancestral", {}),)
# The students: {name: (distill.match, the keep probability at gamma_min or None)}.
# 'student' the objective's defaults; 'student_plugin' the KL of the reference's x_theta, the
# plug-in weights, over the default range; 'student_plugin95' the same with the range cut
# at alpha 0.95 (t = 0.05), where the teacher's plug-in weights are still sane
# (docs/accelerators.md, "DUO").
STUDENTS = {"student": ("posterior", None), "student_plugin": ("plugin", None),
            "student_plugin95": ("plugin", 0.95)}
MODELS = ("teacher",) + tuple(STUDENTS)


def short_config(config, steps: int):
  config.seed = SEED
  config.model.update(SMALL_MODEL)
  config.train.update(num_steps=steps, warmup_steps=min(config.train.warmup_steps, steps // 8))
  config.update(num_eval_samples=0, eval_every=0, log_every=50)
  config.checkpoint.every = steps
  return config


def teacher_config(steps: int = TEACHER_STEPS):
  """configs/shakespeare_uniform.py at SMALL_MODEL for `steps` steps."""
  from configs import shakespeare_uniform  # repo root
  return short_config(shakespeare_uniform.get_config(), steps)


def judge_config(steps: int = JUDGE_STEPS):
  """configs/shakespeare_causal.py at SMALL_MODEL for `steps` steps: the judge."""
  from configs import shakespeare_causal  # repo root
  return short_config(shakespeare_causal.get_config(), steps)


def student_config(teacher: str, rounds: int = ROUNDS, round_steps: int = ROUND_STEPS,
                   match: str = "posterior", gamma_min: float | None = None):
  """configs/distill_duo.py on `teacher`: `rounds` rounds of `round_steps` steps, the KL
  between the two models' `match` ('posterior', the default, or 'plugin'), from
  `gamma_min` (None: the objective's default)."""
  from configs import distill_duo  # repo root
  config = distill_duo.get_config()
  config.seed = SEED
  config.distill.update(teacher=teacher, teacher_steps=TEACHER_T,
                        update_teacher_every=round_steps, match=match, gamma_min=gamma_min)
  config.train.num_steps = rounds * round_steps
  config.checkpoint.every = config.train.num_steps
  return config


def differences(rows: list[dict]) -> list[dict]:
  """Per steps K: the student's gen-ppl and entropy minus the teacher's, the standard error
  of each difference sqrt(se_s^2 + se_t^2) (independent samples) and the difference in
  standard errors (z)."""
  by = {(r["process"], r["steps"]): r for r in rows}
  out = []
  for name, k in sorted({(r["process"], r["steps"]) for r in rows if r["process"] in STUDENTS}):
    s, t = by[(name, k)], by[("teacher", k)]
    row = {"student": name, "steps": k}
    for key in ("gen_ppl", "entropy"):
      diff, se = s[key] - t[key], math.hypot(s[key + "_se"], t[key + "_se"])
      row.update({f"{key}_diff": diff, f"{key}_diff_se": se, f"{key}_z": diff / se})
    out.append(row)
  return out


def judged(models: dict, judge_path: str, judge_config, log=print, what: str = "NELBO"):
  """(nelbo, judge, judge_row, reference): each model's validation NELBO on
  noise_text.WINDOWS held-out windows, the judge trained by `judge_config` in `judge_path`
  (loaded, and its summary), and the held-out text's row, each logged (`what` names the
  NELBO)."""
  task = next(iter(models.values())).task
  windows = task.validation_windows(noise_text.WINDOWS)
  nelbo = {}
  for name, model in models.items():
    nelbo[name] = noise_text.validation_nelbo(model, windows)
    log(f"{name:9s} {nelbo[name]['bits_per_char']:.4f} ± {nelbo[name]['stderr']:.4f} "
        f"bits/char ({what})")
  judge = evaluate.load_judge(judge_path)
  steps = judge_config.train.num_steps
  judge_row = noise_text.judge_summary(judge_path, steps, judge_config.batch_size * task.length)
  log(f"judge: {judge_row['val_bits_per_char']:.4f} bits/char held out after {steps} steps")
  log(noise_text.TABLE_HEADER)
  reference = noise_text.reference_row(task, judge, windows)
  log(noise_text.table_line(reference))
  return nelbo, judge, judge_row, reference


def run(workdir: str, num_samples: int = NUM_SAMPLES, teacher_steps: int = TEACHER_STEPS,
        judge_steps: int = JUDGE_STEPS, rounds: int = ROUNDS,
        round_steps: int = ROUND_STEPS, sample_steps=SAMPLE_STEPS, log=print) -> dict:
  paths = {name: os.path.join(workdir, name) for name in MODELS + ("judge",)}
  configs = {"teacher": teacher_config(teacher_steps), "judge": judge_config(judge_steps)}
  train.ensure_trained(configs["teacher"], paths["teacher"])  # the students need it
  vocab = mdjax.load(paths["teacher"]).vocab_size
  gammas = {}
  for name, (match, alpha) in STUDENTS.items():
    gammas[name] = None if alpha is None else duo_objective.gamma_for_alpha(alpha, vocab)
    configs[name] = student_config(paths["teacher"], rounds, round_steps, match, gammas[name])
  for name in MODELS[1:] + ("judge",):
    train.ensure_trained(configs[name], paths[name])
  models = {name: mdjax.load(paths[name]) for name in MODELS}
  task = models["teacher"].task
  nelbo, judge, judge_row, reference = judged(models, paths["judge"], configs["judge"], log,
                                              "uniform-noise NELBO")
  rows = noise_text.gen_ppl_rows(models, judge, steps=sample_steps, num_samples=num_samples,
                                 length=task.length,
                                 samplers={name: SAMPLER for name in models}, log=log)
  diffs = differences(rows)
  for d in diffs:
    log(f"{d['student']} K={d['steps']:>3}: minus teacher gen-ppl {d['gen_ppl_diff']:+.2f} ± "
        f"{d['gen_ppl_diff_se']:.2f} ({d['gen_ppl_z']:+.1f} s.e.), entropy "
        f"{d['entropy_diff']:+.3f} ± {d['entropy_diff_se']:.3f}")
  return {
      "seed": SEED, "machine": timing.machine_info(), "model": SMALL_MODEL,
      "teacher": {"config": "configs/shakespeare_uniform.py", "steps": teacher_steps,
                  "train_seconds": train.read_train_seconds(paths["teacher"]),
                  **nelbo["teacher"]},
      "students": {name: {"config": "configs/distill_duo.py", "match": match,
                          "alpha_at_gamma_min": alpha, "gamma_min": gammas[name],
                          "rounds": rounds, "round_steps": round_steps,
                          "teacher_steps_T": TEACHER_T, "steps": rounds * round_steps,
                          "train_seconds": train.read_train_seconds(paths[name]),
                          **nelbo[name]} for name, (match, alpha) in STUDENTS.items()},
      "judge": judge_row, "gen_ppl": [reference] + rows, "differences": diffs,
      "units": "gen_ppl: per character under the judge; entropy: nats, each sample's "
               "unigram entropy over its characters, averaged; _se: standard errors over "
               "the samples (judge fixed); process: the model ('teacher' or a student of "
               "`students`); differences: a student minus the teacher at the same steps, "
               "se sqrt(se_s^2 + se_t^2), z the difference in standard errors"}


def bench_main(run_fn, doc: str, workdir: str, out: str, argv=None) -> None:
  """The command line of a Shakespeare student bench (this one's, distill_text's):
  `run_fn(workdir, samples, log=...)`'s result, timed, written to --out."""
  parser = argparse.ArgumentParser(description=doc.split("\n")[0])
  parser.add_argument("--workdir", default=workdir)
  parser.add_argument("--out", default=out)
  parser.add_argument("--samples", type=int, default=NUM_SAMPLES, help="samples per point")
  args = parser.parse_args(argv)
  if args.samples < 2:
    parser.error(f"--samples={args.samples} must be >= 2 (a standard error needs two)")
  start, cpu = time.perf_counter(), time.process_time()
  result = run_fn(args.workdir, args.samples, log=lambda line: print(line, flush=True))
  result["seconds"] = round(time.perf_counter() - start, 1)
  result["cpu_seconds"] = round(time.process_time() - cpu, 1)
  report.write_json(args.out, result)
  print(f"wrote {args.out} in {result['seconds']:.0f} s ({result['cpu_seconds']:.0f} CPU s)")


def main(argv=None) -> None:
  bench_main(run, __doc__, "/tmp/duo_bench", "results/duo.json", argv)


if __name__ == "__main__":
  main()
