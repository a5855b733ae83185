"""lm-eval-harness on two local ScanAndAdd tasks, with the exact denoiser as the model.

  python experiments/lm_eval_local.py [--out=results] [--write_data]

The tasks (tests/fixtures/lm_eval: YAML over a JSONL file, no hub, no network) ask for the
last three commands of a ScanAndAdd sequence given everything before them, as words
("VALS 3 1 ... ANS 0 1 2 OPS 0 1 ..." -> "1 0 1"). Every document has exactly one answer
the law allows (the add count and the written sum decide it) and at least two candidates
with the right add count, so the sum must be read:

  mdjax_scan_and_add_mc   multiple choice over the 8 strings of three commands (acc: the
                          highest estimated log-likelihood is the answer);
  mdjax_scan_and_add_gen  generate_until, three tokens, exact_match against the answer;
  mdjax_scan_and_add_greedy  loglikelihood of the answer (perplexity) and acc = is_greedy,
                          LLaDA's greedy check (as lambada's acc).

With the exact denoiser both should score 1: the answer is unique, so the denoiser's
marginals over the three masked commands are point masses on it; a draw that masks all three
tokens (the stratified counts cover 1..3 at 64 draws) scores every other candidate -inf and
the answer 0, and greedy decoding writes it (perplexity 1, is_greedy true). Writes results/lm_eval_local.json (lm-eval's
results dict, its is_greedy check on); fixed seeds. About 30 s on a 2-core CPU.
`--write_data` rewrites the JSONL fixture from its seed instead.
"""

import argparse
import itertools
import json
import os
import time

import jax
import numpy as np

from mdjax.tasks import scan_and_add

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(ROOT, "tests", "fixtures", "lm_eval")
DATA = os.path.join(TASK_DIR, "scan_and_add.jsonl")
TASKS = ["mdjax_scan_and_add_mc", "mdjax_scan_and_add_gen", "mdjax_scan_and_add_greedy"]
DATA_SEED = 0
NUM_DOCS = 16
TAIL = 3  # commands asked for
CHOICES = [" ".join(map(str, c)) for c in itertools.product((0, 1), repeat=TAIL)]
MODEL_ARGS = ("task=scan_and_add,oracle=true,num_samples=64,mc_batch_size=16,check_greedy=true,"
              "seed=0")


def rows(seed: int = DATA_SEED, count: int = NUM_DOCS) -> list[dict]:
  """The documents: ScanAndAdd draws whose last TAIL commands the law determines, with at
  least two candidates of the right add count."""
  out, draw = [], 0
  candidates_Kx3 = np.array([c.split() for c in CHOICES], int)
  commands_before = scan_and_add.DEFAULT.num_commands - TAIL
  while len(out) < count:
    x_NxL = np.asarray(scan_and_add.sample_data(jax.random.key(seed + draw), 256))
    draw += 1
    # Every candidate tail on every draw, scored by the law at once: [N, K].
    full_NxKxL = np.concatenate([np.repeat(x_NxL[:, None, :-TAIL], len(CHOICES), 1),
                                 np.broadcast_to(candidates_Kx3, (len(x_NxL),) +
                                                 candidates_Kx3.shape)], -1)
    allowed_NxK = np.isfinite(scan_and_add.log_prob(
        full_NxKxL.reshape(-1, x_NxL.shape[1]))).reshape(len(x_NxL), len(CHOICES))
    for x, allowed in zip(x_NxL, allowed_NxK):
      head = x[:-TAIL]
      adds_left = scan_and_add.DEFAULT.num_adds - int((head[-commands_before:] % 2 == 0).sum())
      right_count = int(((candidates_Kx3 == 0).sum(1) == adds_left).sum())
      if allowed.sum() != 1 or right_count < 2:
        continue
      answer = CHOICES[int(np.flatnonzero(allowed)[0])]
      out.append({"context": scan_and_add.decode(head), "choices": CHOICES,
                  "gold": CHOICES.index(answer), "answer": answer})
      if len(out) == count:
        break
  return out


def write_data(path: str = DATA) -> None:
  with open(path, "w") as f:
    for row in rows():
      f.write(json.dumps(row) + "\n")


def evaluate(model_args: str, limit: int | None = None, tasks=TASKS) -> dict:
  """lm-eval's output for the local tasks under `model_args` (the model registered by
  importing mdjax.evaluate.harness)."""
  os.environ["HF_DATASETS_OFFLINE"] = "1"
  os.chdir(ROOT)  # the YAML files name their data relative to the repository root
  import lm_eval
  from lm_eval.tasks import TaskManager

  import mdjax.evaluate.harness  # noqa: F401  registers "mdjax"
  return lm_eval.simple_evaluate(
      model="mdjax", model_args=model_args, tasks=list(tasks), batch_size=8, limit=limit,
      task_manager=TaskManager(include_path=TASK_DIR, include_defaults=False), random_seed=0, numpy_random_seed=0,
      torch_random_seed=0, fewshot_random_seed=0, log_samples=False)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results", help="output directory")
  parser.add_argument("--write_data", action="store_true",
                      help="rewrite tests/fixtures/lm_eval/scan_and_add.jsonl and stop")
  args = parser.parse_args()
  if args.write_data:
    write_data()
    print(f"wrote {DATA}")
    return
  start = time.perf_counter()
  output = evaluate(MODEL_ARGS)
  report = {"tasks": TASKS, "num_docs": NUM_DOCS, "model_args": MODEL_ARGS,
            "lm_eval_version": output.get("lm_eval_version"), "results": output["results"]}
  for task in TASKS:
    print(task, {k: v for k, v in output["results"][task].items() if k != "alias"})
  print(f"{time.perf_counter() - start:.1f} s")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "lm_eval_local.json"), "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")


if __name__ == "__main__":
  main()
