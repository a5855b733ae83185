"""Regenerates the LLaDA2.1 decoder's parity fixture, tests/fixtures/llada21/generations.json.

  pip install -e '.[reference]'
  python -m tests.reference.llada21 --source SOURCE --source21 SOURCE21 [--out DIR]

LLaDA2.1 (inclusionAI/LLaDA2.1-mini, -flash) is LLaDA2.0's network (`tests.reference.llada2`)
with another `generate`: mask-to-token commits above `threshold` (the `num_to_transfer` most
confident when fewer pass) and token-to-token edits of the block's written tokens above
`editing_threshold`, in a loop per block that ends when a step without a mask edits nothing
or after `max_post_steps` steps without a mask. The fixture runs that loop on the tiny random
LLaDA2MoeModelLM of tests/fixtures/llada2/ (its safetensors, loaded into the published class
of SOURCE, as tests/reference/llada2.py does; SOURCE as there).

SOURCE21 holds LLaDA2.1's published modeling_llada2_moe.py (the hub's file is not reachable
here; the fixtures were written from its copy in github.com/lingjiechen2/dllm,
  SOURCE21=<git dir>@41cdda71d41bc678a285bd501ad79c688084cf12:dllm/pipelines/llada21/models
file modeling_llada21_moe.py, whose `generate` and `_sample_with_temperature_topk_topp` are
the hub's; SGLang's `JointThreshold` (sgl-project/sglang, python/sglang/srt/dllm/algorithm/
joint_threshold.py) is the same rule with top-1 fallback). Only those two methods are taken
from it, by `ast`, and run as published on a stand-in `self` whose `forward` is the LLaDA2.0
class's: the 2.1 file's own forward reads its 0/1 block mask through a transformers helper
that transformers 5 changed, and the network is the same. The stand-in turns the 0/1 mask
into the additive float32 one (0 / -inf) and sets the [MASK] logit to -inf, as
tests/reference/llada2.py's forward does (trained checkpoints never predict it; mdjax's
contract excludes it).

Each row is written by `llada21_generate` below, a transcription of that `generate` (greedy,
eos_early_stop=True as the model card runs it) that also records every decision's margin and
what each step did, and is then run through the published `generate` itself (the stand-in
above): the tokens must be the same, and the forward calls too. Every decision clears a 1e-4
relative margin: the argmax gap of each position whose proposal is written or may be (a
masked position written, a written position whose probability passes editing_threshold), each
threshold and editing_threshold comparison, the top-k cut, and the MoE routing choices of every
forward (tests/reference/llada2.py's hooks). A row whose prompt seed fails is rerun with the
next seed.

What generations.json holds: for each case its knobs (the published generate's arguments)
and rows, each a prompt run alone with its seed, smallest margin, what its steps did (M2T
steps above the threshold, top-k fallbacks, steps with edits, post steps, blocks ended by the
post budget), its forward calls and the generated ids (up to and including the first EOS, as
the published generate returns them).

Self-checks it printed when the fixture was written (float32, 1 thread): each row's smallest
margin, forward calls, M2T steps by the threshold and by the top-k fallback, edits (and the
steps that made them), post steps, and blocks ended by the post budget:

  case         seed    margin  calls  threshold  top-k  edits (steps)   post  budget
  quality       101   0.00044     26          2     16     21 in 12      8       0
  quality      1111    0.0031     14          2      9      8 in  7      3       0
  speedy        200   0.00073     45          6      3    235 in 40     36       2
  speedy       1201   0.00032     64          5     11    380 in 61     48       3
  post_budget   304    0.0019      9          2      1     26 in  6      6       3
  post_budget  1302   0.00066     16          3      7     61 in 13      6       3
  defaults      400    0.0002     59          0     57      0 in  0      2       0
  defaults     1402   0.00012     53          0     51      0 in  0      2       0

and for every row the published generate gave the same tokens in as many forward calls.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import subprocess
import types

import numpy as np

from tests.reference import llada2 as l2
from tests.reference import pretrained as common

try:
  import safetensors.torch
  import torch
  import torch.nn.functional as F
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "llada21"
CHECKPOINT = ROOT / "tests" / "fixtures" / "llada2"
EOS_ID, MASK_ID, BLOCK, MARGIN = l2.EOS_ID, l2.MASK_ID, l2.BLOCK, l2.MARGIN
FILE21 = "modeling_llada21_moe.py"


# --- LLaDA2.1's generate, transcribed --------------------------------------------------------


def llada21_generate(model, inputs, *, block_length=32, gen_length=2048, threshold=0.95,
                     editing_threshold=0.9, max_post_steps=16, num_to_transfer=1,
                     eos_id=EOS_ID, mask_id=MASK_ID, margins=None, did=None):
  """LLaDA2.1's `generate` at temperature 0 with eos_early_stop=True (the module docstring);
  returns (the generated ids, 1 x T up to and including the first EOS; forward calls)."""
  prompt_length = inputs.shape[1]
  num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
  total_length = num_blocks * block_length
  block_mask = torch.tril(torch.ones(num_blocks, num_blocks))
  attention = (block_mask.repeat_interleave(block_length, dim=0)
               .repeat_interleave(block_length, dim=1).unsqueeze(0).unsqueeze(0)).log()
  position_ids = torch.arange(total_length).unsqueeze(0)
  x = torch.full((1, total_length), mask_id, dtype=torch.long)
  x[:, :prompt_length] = inputs.clone()
  did = {} if did is None else did
  count = lambda what: did.__setitem__(what, did.get(what, 0) + 1)
  calls = 0
  for num_block in range(prompt_length // block_length, num_blocks):
    end = (num_block + 1) * block_length
    cur_x = x[:, :end]
    block_start = num_block * block_length
    prompt_in_block = torch.zeros(block_length, dtype=torch.bool)
    if block_start < prompt_length:
      prompt_in_block[:min(prompt_length - block_start, block_length)] = True
    post_steps = 0
    while True:
      old = cur_x[:, -block_length:].clone()
      active = cur_x[:, -block_length:] == mask_id
      if not torch.any(active):
        post_steps += 1
      if post_steps > max_post_steps:
        count("blocks ended by the post budget")
        break
      logits, _ = l2.forward(model, cur_x, attention[:, :, :end, :end], position_ids[:, :end])
      calls += 1
      block_logits = logits[:, -block_length:, :]
      probs = F.softmax(block_logits, dim=-1)
      x0 = block_logits.argmax(dim=-1)
      x0_p = torch.gather(probs, -1, x0[..., None])[..., 0]
      m2t = torch.zeros_like(x0, dtype=torch.bool)
      if active.sum() > 0:
        confidence = torch.where(active, x0_p, -torch.inf)
        high = (confidence[0] > threshold) & active[0]
        if margins is not None:
          for c in x0_p[0][active[0]].tolist():
            margins.compare(c, threshold, "threshold")
        if high.sum().item() >= num_to_transfer:
          m2t[0] = high
          count("M2T above the threshold")
        else:
          k = min(num_to_transfer, active.sum().item())
          _, idx = torch.topk(confidence[0], k=k)
          m2t[0, idx] = True
          count("M2T top-k")
          if margins is not None:
            margins.cut(confidence[0], k, "top-k cut")
      else:
        count("post steps")
      editable = ~active & ~prompt_in_block[None, :]
      passes = (torch.where(editable, x0_p, -torch.inf)[0] > editing_threshold) & editable[0]
      if margins is not None:
        for c in x0_p[0][editable[0]].tolist():
          margins.compare(c, editing_threshold, "editing_threshold")
        margins.argmax(block_logits[0][m2t[0] | passes], "argmax")
      edit = torch.zeros_like(x0, dtype=torch.bool)
      edit[0] = passes & (x0[0] != old[0])
      if edit.any():
        count("steps with edits")
        did["edits"] = did.get("edits", 0) + int(edit.sum())
      transfer = m2t | edit
      if transfer.any():
        cur_x[:, -block_length:][transfer] = x0[transfer]
      if active.sum() == 0 and not edit.any():
        break
    x[:, :end] = cur_x
    generated = x[0, prompt_length:end]
    if (generated == mask_id).sum() == 0 and (generated == eos_id).any():
      break  # eos_early_stop
  out = x[:, :prompt_length + gen_length]
  eos_at = (out[0][prompt_length:] == eos_id).nonzero(as_tuple=True)[0]
  first = eos_at[0].item() if len(eos_at) else gen_length
  return out[:, prompt_length:prompt_length + first + 1], calls


# --- the published generate, run as published ----------------------------------------------


def _read(source: str, name: str) -> str:
  if "@" in source:
    gitdir, rest = source.split("@", 1)
    rev, sub = rest.split(":", 1)
    return subprocess.run(["git", f"--git-dir={l2._git_dir(gitdir)}", "show",
                           f"{rev}:{sub}/{name}"], check=True, capture_output=True,
                          text=True).stdout
  return (pathlib.Path(source) / name).read_text()


def published_generate(source21: str):
  """LLaDA2MoeModelLM.generate of LLaDA2.1's file, on a stand-in `self` (module docstring):
  (model, inputs, **knobs) -> (generated ids, forward calls)."""
  tree = ast.parse(_read(source21, FILE21))
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLaDA2MoeModelLM")
  wanted = ("generate", "_sample_with_temperature_topk_topp", "_top_k_logits", "_top_p_logits")
  methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
  assert sorted(m.name for m in methods) == sorted(wanted), [m.name for m in methods]
  holder = ast.parse("class Published:\n  pass\n")
  holder.body[0].body = methods
  namespace = {"torch": torch, "F": F, "Optional": __import__("typing").Optional}
  exec(compile(holder, FILE21, "exec"), namespace)
  published = namespace["Published"]

  def run(model, inputs, **knobs):
    calls = [0]

    def forward(cur_x, attention_mask, position_ids):
      calls[0] += 1
      additive = torch.where(attention_mask > 0, 0.0, -torch.inf).to(torch.float32)
      logits, _ = l2.forward(model, cur_x, additive, position_ids)
      return types.SimpleNamespace(logits=logits)

    stand_in = published()
    stand_in.device = torch.device("cpu")
    stand_in.forward = forward
    out = stand_in.generate(inputs=inputs, temperature=0.0, eos_early_stop=True,
                            eos_id=EOS_ID, mask_id=MASK_ID, **knobs)
    return out, calls[0]

  return run


# --- cases ----------------------------------------------------------------------------------

# name: (the generate arguments (mdjax's LLaDA21Spec knobs, with gen_length and block_length),
# one (prompt length, requirement) per row). Blocks of 8 (the llada2 fixture's), prompts ending
# inside a block. The published loop runs one row at a time.
CASES = {
    # the model card's Quality mode
    "quality": ({"gen_length": 16, "block_length": BLOCK, "threshold": 0.7,
                 "editing_threshold": 0.5, "max_post_steps": 16},
                [(6, "edits"), (5, "eos")]),
    # the model card's Speedy mode: every changed argmax of a written token is an edit
    "speedy": ({"gen_length": 16, "block_length": BLOCK, "threshold": 0.5,
                "editing_threshold": 0.0, "max_post_steps": 16},
               [(6, "edits"), (11, "edits")]),
    # a post budget of 2 that ends a block, two commits a fallback step
    "post_budget": ({"gen_length": 16, "block_length": BLOCK, "threshold": 0.3,
                     "editing_threshold": 0.0, "max_post_steps": 2, "num_to_transfer": 2},
                    [(6, "budget"), (3, "budget")]),
    # the published defaults: blocks of 32, threshold 0.95, editing_threshold 0.9, 16 post steps
    "defaults": ({"gen_length": 40, "block_length": 32, "threshold": 0.95,
                  "editing_threshold": 0.9, "max_post_steps": 16},
                 [(7, ""), (13, "")]),
}


def _meets(must: str, did: dict, out: list) -> bool:
  if (EOS_ID in out) != (must == "eos"):
    return False  # an EOS where asked for, full-length outputs elsewhere
  if must in ("edits", "eos") and not did.get("edits"):
    return False
  return must != "budget" or did.get("blocks ended by the post budget", 0) >= 1


def make_row(kwargs: dict, prompt_len: int, must: str, model, base_seed: int,
             tries: int = 400) -> dict:
  for seed in range(base_seed, base_seed + tries):
    rng = np.random.default_rng(seed)
    prompt = torch.from_numpy(rng.integers(0, len(common.CHARS), (1, prompt_len)))
    did = {}
    with l2.checking(common.Margins()) as margins:
      out, calls = llada21_generate(model, prompt, margins=margins, did=did, **kwargs)
    if margins.min <= MARGIN or not _meets(must, did, out[0].tolist()):
      continue
    return {"seed": seed, "min_margin": float(f"{margins.min:.3g}"),
            "did": dict(sorted(did.items())), "calls": calls, "prompt": prompt[0].tolist(),
            "generated": out[0].tolist()}
  raise RuntimeError(f"no seed in [{base_seed}, {base_seed + tries}) gives a row of {kwargs} "
                     f"with {must!r}")


def load_model(modules):
  """The LLaDA2MoeModelLM of tests/fixtures/llada2/ in the published 2.0 class (strictly),
  with its routing margins recorded; the committed tensors are l2.weights(0)'s."""
  tensors = {}
  for file in sorted(CHECKPOINT.glob("*.safetensors")):
    tensors.update({k: v.numpy() for k, v in safetensors.torch.load_file(str(file)).items()})
  expected = l2.weights(0)
  assert set(tensors) == set(expected)
  assert all(np.array_equal(tensors[k], expected[k]) for k in expected)
  model, modeling = l2.published_model(modules, tensors)
  l2.add_routing_hooks(model, modeling)
  return model


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--source", default=l2.BENCH_SOURCE,
                      help="LLaDA2.0's modeling files (the network): a folder or "
                      "GITDIR@REV:SUBDIR, as tests/reference/llada2.py takes")
  parser.add_argument("--source21", required=True,
                      help=f"a folder or GITDIR@REV:SUBDIR holding LLaDA2.1's {FILE21}")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  out = common.fresh_output(args.out)
  run_published = published_generate(args.source21)
  cases = []
  with l2.published_modules(args.source) as modules, torch.no_grad():
    model = load_model(modules)
    for index, (name, (kwargs, rows)) in enumerate(CASES.items()):
      case = {"name": name, "kwargs": dict(kwargs, temperature=0.0), "rows": []}
      for r, (prompt_len, must) in enumerate(rows):
        row = make_row(kwargs, prompt_len, must, model, base_seed=100 * (index + 1) + 1000 * r)
        again, calls = run_published(model, torch.tensor([row["prompt"]]), **kwargs)
        assert again[0].tolist() == row["generated"], (name, again, row["generated"])
        assert calls == row["calls"], (name, calls, row["calls"])
        case["rows"].append(row)
        print(f"{name}: seed {row['seed']}, min margin {row['min_margin']:.3g}, "
              f"{row['calls']} calls, {row['did']}, the published generate agrees")
      cases.append(case)
  text = json.dumps(cases, indent=1)
  text = re.sub(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]",
                lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
  (out / "generations.json").write_text(text + "\n")


if __name__ == "__main__":
  main()
