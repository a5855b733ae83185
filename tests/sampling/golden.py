"""Recorded samples that a refactor of the samplers must reproduce token for token.

Every case is a denoiser, a canvas and a spec; `record()` runs them all with fixed keys.
`python -m tests.sampling.golden` rewrites `golden.npz` (only when sampling is meant to
change); `tests/sampling/test_golden.py` checks the recording.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import diffusion, models, sampling
from mdjax.tasks import scan_and_add as sa
from mdjax.tasks import two_color
from tests import stubs

PATH = pathlib.Path(__file__).with_name("golden.npz")
VOCAB, LENGTH, PROMPT = 6, 12, 4
GEN = tuple(range(PROMPT, LENGTH))


def _stub_case():
  """The contract tests' canvas (tests/sampling/test_contract.py), so the two share programs."""
  rng = np.random.default_rng(1)
  tokens = np.full((4, LENGTH), VOCAB, np.int32)
  tokens[:, :PROMPT] = rng.integers(0, VOCAB, (4, PROMPT))
  return stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH), jnp.asarray(tokens)


def _model_case():
  cfg = models.TransformerConfig(vocab_size=sa.VOCAB_SIZE, max_len=sa.LENGTH, d_model=32,
                                 num_layers=2, num_heads=2, d_ff=64)
  _, params, apply_fn = models.init(cfg, seed=3)
  return apply_fn, params, sa.empty_canvas(3)


def _recorded(spec):
  return dataclasses.replace(spec, record_trajectory=True)


# Families registered after the recording: the contract suite alone covers them.
NEWER_FAMILIES = ("entropy_bounded", "dream", "mdlm", "bd3lm", "fast_dllm_v2", "uniform_ancestral",
                  "diffusion_gemma", "llada21", "learned_commit", "order_policy",
                  "diffusion_gemma_canvases")

# The contract tests' examples of every other family, as those tests run them (trajectories
# on). The oracle and model cases below are fewer: each compiles a large denoiser.
HALF = len(GEN) // 2
CONTRACT_SPECS = {
    "ancestral": _recorded(sampling.AncestralSpec(steps=5, min_p=0.1)),
    "ancestral_cache": _recorded(sampling.AncestralSpec(steps=6, grid="cosine", cache=True)),
    "ancestral_blocks": _recorded(sampling.AncestralSpec(steps=4, block_length=HALF,
                                                         schedule=diffusion.CosineSchedule())),
    "confidence_prob": _recorded(sampling.ConfidenceSpec(steps=5, score="prob", temperature=0.7,
                                                         top_k=3)),
    "confidence_margin_blocks": _recorded(sampling.ConfidenceSpec(
        steps=4, score="margin", block_length=HALF, count_schedule=diffusion.CosineSchedule())),
    "confidence_gumbel": _recorded(sampling.ConfidenceSpec(steps=8, score="neg_entropy",
                                                           gumbel_temperature=2.0, top_p=0.8)),
    "confidence_threshold_argmax": _recorded(sampling.ConfidenceSpec(steps=5, threshold=0.5,
                                                                     temperature=0.0)),
    "defer": _recorded(sampling.DeferSpec(steps=4, threshold=0.1, temperature=0.8)),
    "field_order": _recorded(sampling.FieldOrderSpec(
        fields=(GEN[:HALF], GEN[HALF:]), counts=((1, 0), (HALF - 1, 0), (0, len(GEN) - HALF)),
        score="margin")),
    "local_remask": sampling.LocalRemaskSpec(
        base=sampling.ConfidenceSpec(steps=4), refill=sampling.AncestralSpec(steps=3), rounds=2,
        window=1, context_fraction=0.3, score_groups=3),
    "ordered": _recorded(sampling.OrderedSpec(groups=(GEN[:HALF], GEN[HALF:]))),
    "left_to_right": _recorded(sampling.OrderedSpec(groups=tuple((p,) for p in GEN),
                                                    temperature=0.5)),
    "random_order": _recorded(sampling.RandomOrderSpec(top_p=0.5)),
    "remask_cap": _recorded(sampling.RemaskSpec(steps=10, eta=0.2)),
    "remask_conf": _recorded(sampling.RemaskSpec(steps=10, sigma="conf", eta=1.0)),
    "remask_loop": _recorded(sampling.RemaskSpec(steps=12, eta=0.3, loop_t_on=0.6,
                                                 loop_t_off=0.2)),
    "revision": _recorded(sampling.RevisionSpec(steps=5, score="margin")),
    "revision_groups": _recorded(sampling.RevisionSpec(steps=4, score_groups=2, top_k=3)),
    "speculative_max_prob": _recorded(sampling.SpeculativeSpec(k=3)),
    "speculative_lowest": _recorded(sampling.SpeculativeSpec(k=2, order="lowest_index",
                                                             temperature=0.8)),
    "speculative_fixed": _recorded(sampling.SpeculativeSpec(k=4, order="fixed",
                                                            positions=tuple(reversed(GEN)))),
}


def _cases():
  stub = _stub_case()
  oracle = (sa.exact_denoiser, None, sa.empty_canvas(6))
  pair = (two_color.exact_denoiser, None, two_color.empty_canvas(64))
  model = _model_case()
  stub_specs = {
      **CONTRACT_SPECS,
      "ancestral_argmax_noskip": sampling.AncestralSpec(steps=6, temperature=0.0,
                                                        skip_idle_steps=False),
      "ancestral_grid": sampling.AncestralSpec(steps=3, grid=(1.0, 0.7, 0.2, 0.0), top_k=2),
      "confidence_random_argmax": sampling.ConfidenceSpec(steps=6, score="random",
                                                          temperature=0.0),
      "confidence_threshold_blocks": sampling.ConfidenceSpec(steps=8, block_length=4,
                                                             threshold=0.3),
      "confidence_noskip": sampling.ConfidenceSpec(steps=12, skip_idle_steps=False),
      "remask_rescale": sampling.RemaskSpec(steps=10, sigma="rescale", eta=0.5),
      "ordered_idle": sampling.OrderedSpec(groups=((4, 5), (6, 7, 8), (9, 10, 11), (0,))),
      "defer_entropy": sampling.DeferSpec(steps=3, threshold=0.02, score="neg_entropy"),
      "revision_keep": sampling.RevisionSpec(steps=4, keep_visible=True, score="prob"),
      "local_remask_defer": sampling.LocalRemaskSpec(
          base=sampling.AncestralSpec(steps=4, block_length=4),
          refill=sampling.DeferSpec(steps=2), rounds=1, seeds=2, window=0),
  }
  for name, spec in stub_specs.items():
    yield "stub/" + name, stub, spec
  oracle_specs = {
      "ancestral": sampling.AncestralSpec(steps=8),
      "field_order": sampling.parse_write_order("[VOA][v×9]o×10[ht1]", sa.write_order_fields()),
      "speculative": sampling.SpeculativeSpec(k=4),
      "defer": sampling.DeferSpec(steps=3, threshold=0.2),
      "local_remask": sampling.LocalRemaskSpec(
          base=sampling.AncestralSpec(steps=4), refill=sampling.ConfidenceSpec(steps=2),
          rounds=1, seeds=2, window=2, context_fraction=0.1),
  }
  for name, spec in oracle_specs.items():
    yield "oracle/" + name, oracle, spec
  yield "two_color/ancestral", pair, sampling.AncestralSpec(steps=2)
  yield "two_color/ordered", pair, sampling.OrderedSpec(groups=((0, 1),))
  model_specs = {
      "confidence_threshold": sampling.ConfidenceSpec(steps=6, threshold=0.2),
      "speculative_fixed": sampling.SpeculativeSpec(
          k=5, order="fixed", positions=tuple(range(sa.LENGTH))),
  }
  for name, spec in model_specs.items():
    yield "model/" + name, model, spec


CASES = {name: (denoiser, spec) for name, denoiser, spec in _cases()}


def counters(result) -> dict[str, np.ndarray]:
  """The recorded arrays of one result."""
  return {name: np.asarray(getattr(result, name)) for name in
          ("tokens_BxL", "write_step_BxL", "nfe", "saved_calls", "reopened_B", "contexts_B",
           "rounds_B") if getattr(result, name, None) is not None}


def run(name: str):
  (apply_fn, params, tokens), spec = CASES[name]
  key = jax.random.fold_in(jax.random.key(2024), sum(map(ord, name)))
  return sampling.sample(apply_fn, params, key, tokens, spec)


def record() -> dict[str, np.ndarray]:
  out = {}
  for name in CASES:
    for field, value in counters(run(name)).items():
      out[f"{name}/{field}"] = value
  return out


if __name__ == "__main__":
  np.savez_compressed(PATH, **record())
  print(f"wrote {PATH} ({len(CASES)} cases)")
