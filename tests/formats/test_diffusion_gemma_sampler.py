"""DiffusionGemma's sampler against gemma's `DiffusionSampler.sample_next_canvas`
(tests/reference/diffusion_gemma.py wrote sampler.npz / sampler.json): step by step (each
step's recorded inputs: canvas, self-conditioning embeddings, key, noise proportion), mdjax's
logits within 1e-4 of the largest and its step's tokens exactly; end to end, the
`diffusion_gemma` family with reference_draws writes the reference's canvas for every run the
writer found replay-stable, each alone (a batch of one, as the writer ran them), except
MACHINE_DEPENDENT.

The end-to-end equality holds under the suite's XLA flags (tests/conftest.py); rounding
differences between compilations can flip a bfloat16 rounding of the self-conditioning
embeddings and so a later draw, as they do between two compilations of gemma's own code (under
XLA's default CPU flags, 11 of the 13 stable runs match). This fixture's "stable" is the
writer's first criterion (gemma's replay, decisions clear of 1e-4), which does not flip the
roundings near a midpoint as the canvases fixture's does (tests/formats/
test_diffusion_gemma_canvases.py), so a run whose closest rounding is nearest its midpoint can
still depend on the host's CPU."""

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


# (case, with the prompt) pairs none of whose runs gemma's own code replays: 8 steps, every
# draw kept, hot temperatures and the prompt let a bfloat16 rounding of the
# self-conditioning embeddings flip a later draw between two compilations of gemma's code.
UNSTABLE = {("k8_b8_hot", True)}
# Stable by the writer's criterion, but not on every host: its closest self-conditioning
# rounding is 1.5e-5 bfloat16 ulps from its midpoint (the least of the 13 stable runs; the
# next 4.6e-5), and on a Sapphire Rapids host (AVX-512, AMX; jax 0.10.2) its tokens differ from
# gemma's at 5 of 8 positions, under every --xla_cpu_max_isa tried (AVX2, AVX512,
# AVX512_BF16) and alone or in its case's batch; the CI hosts before it wrote gemma's tokens.
# Its steps are still checked one by one (test_each_step_writes_the_references_tokens).
MACHINE_DEPENDENT = {"k6_b2_prompt_2"}


def test_the_fixture_says_which_runs_are_stable():
  """Every other case has runs gemma's own code replays and whose decisions all clear their
  margins (those are compared end to end); UNSTABLE is what the writer found."""
  cases = {(n.rsplit("_", 2)[0], r["prompt"]) for n, r in runs().items()}
  stable = {(n.rsplit("_", 2)[0], r["prompt"]) for n, r in runs().items() if r["stable"]}
  assert cases - stable == UNSTABLE
  assert all(runs()[n]["stable"] for n in MACHINE_DEPENDENT)
  assert all(r["stable"] == (r["replays"] and all(
      m is None or m > 1e-4 for k, m in r["margins"].items() if k != "sc_midpoint"))
             for r in runs().values())


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
  """The runs of a case compared end to end: the stable ones, MACHINE_DEPENDENT aside."""
  return [n for n, r in runs().items()
          if n.startswith(f"{case}_{'prompt' if prompt else 'alone'}_") and r["stable"]
          and n not in MACHINE_DEPENDENT]


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
