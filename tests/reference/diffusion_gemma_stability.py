"""Records the single-canvas sampler fixture's stability (tests/fixtures/diffusion_gemma/
sampler.json) as the canvases fixture records its own: each run of the committed sampler.json
measured again with gemma's own code against the canvas it recorded, every array file
(params/, reference.npz, sampler.npz) and every recorded field left as written.

Why not a regeneration: gemma's float32 arithmetic differs between hosts in the last bits
(on a Sapphire Rapids host, jax 0.10.2, under XLA's defaults and every --xla_cpu_max_isa
tried, 1948 to 1993 of reference.npz's 2048 logits of a pass differ from the committed ones,
by up to 2.6e-6 of the largest, and 17 of sampler.npz's 32 final canvases, two of them runs
the first criterion called stable), so a run that gemma replays where it was written may not
replay on another host: `replays_here` records it.

Runs where tests/reference/diffusion_gemma.py runs (its docstring: gemma 7691fd4e from source,
Python 3.12, mdjax not imported):

  PYTHONPATH=SRC:. /work/venv312/bin/python -m tests.reference.diffusion_gemma_stability \
      [--out tests/fixtures/diffusion_gemma]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from gemma.gm.ckpts import _checkpoint as checkpoint

from tests.reference import diffusion_gemma as base


def record_stability(folder: pathlib.Path) -> None:
  """Each run of the committed sampler.json measured again with gemma's code on
  this host against the committed canvas (sampler.npz's `final`), every array file and
  every recorded field left as written; adds `replays_here` (gemma's compiled loop and its
  step-by-step replay here both write that canvas), the robustness (`run_stability`) and
  sets `stable` (`stable_of`)."""
  params = checkpoint.load_params(str((folder / "params").resolve()))
  prompt = jnp.asarray(np.load(folder / "reference.npz")["prompt_BxP"])
  fixture = json.loads((folder / "sampler.json").read_text())
  with np.load(folder / "sampler.npz") as z:
    recorded = {k: z[k] for k in z.files if k.endswith(("/final", "/key"))}
  model = base.build_model()
  cache, full_mask = base.prefilled(model, params, prompt[:1])
  for run in fixture["runs"]:
    name = run["name"]
    case = next(c for c in base.CASES if name.startswith(c["name"] + "_"))
    rng = jax.random.PRNGKey(run["seed"])
    assert (np.asarray(rng) == recorded[f"{name}/key"]).all(), name
    c, m = (cache, full_mask) if run["prompt"] else (None, None)
    sampler = base.diffusion_sampler(model, case, run["threshold"])
    expected = recorded[f"{name}/final"]
    compiled = np.asarray(sampler.sample_next_canvas(
        canvas_length=base.CANVAS, max_denoising_steps=case["steps"], batch_size=1, cache=c,
        params=params, rng=rng, full_attention_mask=m))
    transcribed, _, _, robustness = base.run_stability(model, params, sampler, rng, c, m,
                                                       expected)
    replays_here = bool((compiled == expected).all() and (transcribed == expected).all())
    run.update(replays_here=replays_here, **robustness)
    run["stable"] = base.stable_of(run["replays"], replays_here, robustness, run["margins"])
    print(name, "replays here" if replays_here else "DOES NOT REPLAY HERE", robustness,
          "stable" if run["stable"] else "")
  fixture.update(jitter=base.JITTER, jitter_trials=base.JITTER_TRIALS,
                 flip_margin=base.FLIP_MARGIN)
  (folder / "sampler.json").write_text(json.dumps(fixture, indent=1) + "\n")
  print(f"sampler: {sum(r['stable'] for r in fixture['runs'])} of "
        f"{len(fixture['runs'])} runs stable")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=base.OUT)
  record_stability(parser.parse_args(argv).out)


if __name__ == "__main__":
  main()
