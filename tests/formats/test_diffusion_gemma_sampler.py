"""DiffusionGemma's sampler against gemma's `DiffusionSampler.sample_next_canvas`
(tests/reference/diffusion_gemma.py wrote sampler.npz / sampler.json): step by step (each
step's recorded inputs: canvas, self-conditioning embeddings, key, noise proportion), mdjax's
logits within 1e-4 of the largest and its step's tokens exactly; end to end, the
`diffusion_gemma` family with reference_draws writes the reference's canvas for every run the
writer found stable, each alone (a batch of one, as the writer ran them).

Stable is the canvases fixture's criterion (tests/formats/test_diffusion_gemma_canvases.py,
STABLE): gemma's own code replays the run, its decisions clear 1e-4, and its canvas survives
jittered and flipped bfloat16 roundings of the self-conditioning embeddings of the size of
mdjax's float32 differences (tests/reference/diffusion_gemma_stability.py measured it against
the committed canvases, the arrays left as written)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.models import diffusion_gemma as network
from mdjax.sampling.families import diffusion_gemma as family
from tests.formats import family_fixtures
from tests.formats.test_diffusion_gemma import model

FOLDER = family_fixtures.folder("diffusion_gemma")
PROMPT, WIDTH, D = 9, 8, 32


@functools.cache
def runs() -> dict:
  return {run["name"]: run for run in json.loads((FOLDER / "sampler.json").read_text())["runs"]}


@functools.cache
def arrays() -> dict:
  with np.load(FOLDER / "sampler.npz") as z:
    return dict(z)


def spec_of(run: dict) -> sampling.DiffusionGemmaSpec:
  return sampling.DiffusionGemmaSpec(
      steps=run["steps"], entropy_bound=run["entropy_bound"],
      max_temperature=run.get("max_temperature", 0.8),
      min_temperature=run.get("min_temperature", 0.4), exponent=run.get("exponent", 1.0),
      entropy_stop=run["threshold"], final_renoise=True, self_condition=True,
      condition_width=D, reference_draws=True, reference_length=WIDTH)


def prompt_row() -> np.ndarray:
  return family_fixtures.reference("diffusion_gemma")["prompt_BxP"][:1]


def _tolerance(expected: np.ndarray) -> float:
  # As tests/formats/test_diffusion_gemma.py: float32 through the tiny network, well under
  # 1e-4 of the largest logit.
  return family_fixtures.tolerance(expected, 1e-4)


# The runs stable by the writer's criterion (the module docstring). The writer's first,
# weaker criterion (gemma replays the run where it was written and its decisions clear 1e-4)
# called 13 of the 32 stable; of those, 11 change their canvas under some bfloat16 rounding
# flip within FLIP_MARGIN of its midpoint (5 also under the jitter), and gemma's own code on
# the host that measured it (Sapphire Rapids, jax 0.10.2) does not write the recorded canvas
# of 2 (`replays_here`; it replays 15 of the 32): k8_b8_hot_alone_1 and k6_b2_prompt_2, the
# run whose canvas mdjax missed there at 5 of 8 positions (not robust either; along gemma's
# trajectory there 28 of its 79 flips change the canvas, the nearest 1.6e-7 of the step's
# largest |embedding| from its midpoint).
STABLE = {"k4_b0.1_prompt_3", "k8_b4_entropy_stop_prompt_0"}


def _clear(run: dict) -> bool:
  return all(m is None or m > 1e-4 for k, m in run["margins"].items() if k != "sc_midpoint")


def test_the_fixture_says_which_runs_are_stable():
  """STABLE is what the writer found; every run's record consistent with its stability
  (the first criterion's 13 among the 32, the flip-based one's within them)."""
  fixture = json.loads((FOLDER / "sampler.json").read_text())
  assert (fixture["jitter"], fixture["jitter_trials"], fixture["flip_margin"]) == (1e-6, 2, 1e-5)
  for r in runs().values():
    assert r["flips_tried"] > 0, r["name"]  # every case reads some step's embeddings
    assert (r["flips_changing"] == 0) == (r["rounding_margin"] is None), r["name"]
    assert r["rounding_margin"] is None or r["rounding_margin"] < 1e-5, r["name"]
    assert r["stable"] == (r["replays"] and r["replays_here"] and r["robust"]
                           and r["flips_changing"] == 0 and _clear(r)), r["name"]
  first = {n for n, r in runs().items() if r["replays"] and _clear(r)}
  assert len(first) == 13 and STABLE <= first
  assert {n for n, r in runs().items() if r["stable"]} == STABLE


@functools.cache
def _logits_fn(prompt: bool):
  config = model().config
  if not prompt:
    return jax.jit(lambda p, canvas, sc: network.forward(config, p, canvas, None, sc))
  full = lambda p, canvas, sc: network.forward(
      config, p, jnp.concatenate([jnp.asarray(prompt_row()), canvas], 1), None,
      jnp.concatenate([jnp.zeros((1, PROMPT, D), sc.dtype), sc], 1),
      prompt_length=PROMPT)[:, PROMPT:]
  return jax.jit(full)


def _step_tokens(spec, logits_1xWxV, key, index, last):
  shaped = jnp.asarray(logits_1xWxV, jnp.float32) / family.reference_temperature(spec, index)
  sampled, _ = family.reference_draws(spec, shaped, jnp.asarray(key)[None], 128, last)
  return np.asarray(sampled), np.asarray(shaped)


@pytest.mark.parametrize("name", ["k6_b2_prompt_0", "k8_b8_hot_alone_0"])
def test_each_step_given_the_references_inputs(name):
  """Each recorded step: mdjax's logits from the step's canvas and self-conditioning
  embeddings, and the tokens its step writes from the reference's logits and key."""
  run, z, m = runs()[name], arrays(), model()
  spec = spec_of(run)
  logits_fn = _logits_fn(run["prompt"])
  for i in range(run["steps_run"]):
    expected = z[f"{name}/steps_logits"][i]
    got = logits_fn(m.params, z[f"{name}/steps_canvas"][i], z[f"{name}/steps_sc"][i])
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=_tolerance(expected))
    sampled, shaped = _step_tokens(spec, expected, z[f"{name}/steps_key"][i], i,
                                   i == run["steps"] - 1)
    np.testing.assert_array_equal(sampled, z[f"{name}/steps_sampled"][i], err_msg=f"step {i}")
    condition = m.denoiser.encode_condition(m.params, jnp.asarray(shaped))
    np.testing.assert_allclose(np.asarray(condition), z[f"{name}/steps_sc_out"][i], rtol=0,
                               atol=1e-4 * np.abs(z[f"{name}/steps_sc_out"][i]).max())


def _compared(case: str, prompt: bool) -> list[str]:
  """The runs of a case compared end to end: the stable ones."""
  return [n for n, r in runs().items()
          if n.startswith(f"{case}_{'prompt' if prompt else 'alone'}_") and r["stable"]]


def _run_end_to_end(case: str, prompt: bool):
  """The family over [prompt; W generated] for each stable run of the case, alone (a batch
  of one, as gemma's writer ran each key: XLA's matmuls may round a row's last bits
  differently at another batch size, and a bfloat16 rounding of the self-conditioning
  embeddings can turn that into a later draw), one compiled program for all of them."""
  names = _compared(case, prompt)
  assert names, f"no stable run of {case}"
  z, m = arrays(), model()
  head = prompt_row() if prompt else np.zeros((1, 0), np.int32)
  canvas = np.concatenate([head, np.full((1, WIDTH), 128, np.int32)], 1)
  denoiser = network.denoiser(m.config, PROMPT if prompt else 0)
  for n in names:
    out = sampling.sample(denoiser, m.params, jnp.asarray(z[f"{n}/key"])[None], canvas,
                          spec_of(runs()[n]), mask_id=128)
    np.testing.assert_array_equal(np.asarray(out.tokens_BxL)[0, -WIDTH:], z[f"{n}/final"][0],
                                  err_msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("case, prompt", [
    (case, prompt) for case in ("k4_b0.1", "k6_b2", "k8_b8_hot", "k8_b4_entropy_stop")
    for prompt in (False, True) if _compared(case, prompt)])
def test_canvases_equal_the_references_key_for_key(case, prompt):
  _run_end_to_end(case, prompt)


def test_one_case_end_to_end():
  """The fast subset's end-to-end check: 8 steps, entropy bound 4, the entropy early stop,
  the prompt cached."""
  _run_end_to_end("k8_b4_entropy_stop", True)


def test_the_default_sampler_is_the_references():
  """`mdjax.generate`'s default for the family: gemma's draws, self-conditioning, final
  re-noising and its ChatSampler's early stop, over one canvas after the prompt."""
  m = model()
  run = m.sampler.plan(m, prompt_length=PROMPT, max_new_tokens=WIDTH)
  spec = run.spec
  assert isinstance(spec, sampling.DiffusionGemmaSpec)
  assert (spec.steps, spec.entropy_bound, spec.max_temperature, spec.min_temperature) == (
      48, 0.1, 0.8, 0.4)
  assert (spec.reference_draws, spec.self_condition, spec.final_renoise, spec.early_stop,
          spec.entropy_stop) == (True, True, True, True, 0.005)
  assert (spec.reference_length, spec.condition_width, spec.eos_id) == (WIDTH, D, 1)
  assert run.denoiser.self_conditions
  assert run.denoiser == network.denoiser(m.config, PROMPT)
