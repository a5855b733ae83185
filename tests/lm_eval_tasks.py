"""The local lm-eval tasks of tests/fixtures/lm_eval: their documents and one evaluation.

Three tasks (YAML over a JSONL file, no hub, no network) ask for the last three commands of
a ScanAndAdd sequence given everything before them, as words ("VALS 3 1 ... ANS 0 1 2 OPS
0 1 ..." -> "1 0 1"). Every document has exactly one answer the law allows and at least two
candidates with the right add count, so the sum must be read. `rows` draws the documents
(`write_data` rewrites tests/fixtures/lm_eval/scan_and_add.jsonl from its seed); `evaluate`
runs lm-eval's simple_evaluate over the tasks with the model `mdjax`. Used by
tests/evaluate/test_harness.py and experiments/lm_eval_local.py (results/lm_eval_local.json).
"""

import itertools
import json
import os

import jax
import numpy as np

from mdjax.tasks import scan_and_add

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TASK_DIR = os.path.join(ROOT, "tests", "fixtures", "lm_eval")
DATA = os.path.join(TASK_DIR, "scan_and_add.jsonl")
TASKS = ["mdjax_scan_and_add_mc", "mdjax_scan_and_add_gen", "mdjax_scan_and_add_greedy"]
DATA_SEED = 0
NUM_DOCS = 16
TAIL = 3  # commands asked for
CHOICES = [" ".join(map(str, c)) for c in itertools.product((0, 1), repeat=TAIL)]


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
