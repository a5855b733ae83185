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
`--write_data` rewrites the JSONL fixture from its seed instead (tests/lm_eval_tasks.py
holds the tasks' documents and the evaluation call).
"""

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: experiments/ lives in the repo root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.lm_eval_tasks import DATA, NUM_DOCS, TASKS, evaluate, write_data  # noqa: E402

MODEL_ARGS = ("task=scan_and_add,oracle=true,num_samples=64,mc_batch_size=16,check_greedy=true,"
              "seed=0")

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
