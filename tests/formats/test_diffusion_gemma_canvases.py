"""DiffusionGemma's whole sampler, several canvases in turn, against gemma's `DiffusionSampler`
(tests/reference/diffusion_gemma_canvases.py wrote canvases.npz / canvases.json): the decoder's
logits after finished canvases were appended to the cache, and `mdjax.generate` of the tiny
checkpoint (its default sampler: the `diffusion_gemma_canvases` family) with key k equal to
the tokens gemma's sampler wrote with rng fold_in(key(k), row), for every run the writer found
stable: replayed by gemma's own code, every decision clear of 1e-4, and its tokens kept when
any bfloat16 rounding of the self-conditioning embeddings that a float32 difference of
mdjax's size could move goes the other way (the writer's docstring and FLIP_MARGIN)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.models import diffusion_gemma as network
from tests.formats import family_fixtures
from tests.formats.test_diffusion_gemma import decode, encode, model

FOLDER = family_fixtures.folder("diffusion_gemma")
WIDTH, NEW, PROMPT = 8, 24, 9
END = (1, 106, 50)  # gemma's Sampler: EOS, end of turn, begin of tool response
# no early stop, the entropy stop; each again with fewer steps a canvas
CASES = ("k4_b2", "k8_b4_entropy_stop", "k2_b2", "k3_b4_entropy_stop")


@functools.cache
def fixture() -> dict:
  return json.loads((FOLDER / "canvases.json").read_text())


@functools.cache
def runs() -> dict:
  return {run["name"]: run for run in fixture()["runs"]}


@functools.cache
def arrays() -> dict:
  with np.load(FOLDER / "canvases.npz") as z:
    return dict(z)


def prompts() -> np.ndarray:
  return family_fixtures.reference("diffusion_gemma")["prompt_BxP"]


def knobs(run: dict) -> dict:
  """The default sampler's knobs for a case (gemma's temperatures, canvases of 8)."""
  return dict(steps=run["steps"], entropy_bound=run["entropy_bound"], early_stop=False,
              entropy_stop=run["threshold"], reference_length=WIDTH)


def completion(tokens: np.ndarray) -> np.ndarray:
  """gemma's tokens as an mdjax completion: up to its first end token, EOS and end of turn
  left out (`Model.stop_ids`), begin of tool response kept."""
  for i, token in enumerate(tokens):
    if token in END:
      return tokens[:i + (token == 50)]
  return tokens


# Stable runs a case, under the writer's criterion. A run is stable when gemma's compiled
# loop and its step-by-step replay agree; every decision (draws, argmax gaps, the entropy
# bound's cut and order, the entropy stop, the MoE routing) clears 1e-4 of its scale; its
# tokens survive JITTER_TRIALS replays with the self-conditioning embeddings jittered by
# 1e-6 of the step's largest (root mean square) before their bfloat16 rounding; and every
# rounding a later step reads that lies within FLIP_MARGIN = 1e-5 of the step's largest
# |embedding| of its midpoint, rounded the other way alone, leaves its canvas's tokens as
# they are. The sizes: where mdjax's step had gemma's exact inputs (43 steps of the 5 runs
# that the first criterion called stable and mdjax missed), its float32 embeddings differed
# from gemma's by at most 5.7e-6 of the step's largest |embedding| (3.6e-6 under the suite's
# XLA flags, 5.7e-6 under XLA's defaults; root mean square at most 9.4e-7), and each of
# those runs began to differ at a rounding 4e-8 to 1.2e-6 from its midpoint (bfloat16 moves
# it by 2^-8 of itself; the routings and draws of the next steps follow). With 4 or 8 steps
# a canvas few runs keep their tokens under every such flip (310 of the 2635 flips tried
# change a 4-step run, 1854 of 4767 an 8-step one); with 2 or 3 steps a canvas (one or two
# steps read the embeddings) most do.
STABLE = {"k4_b2": 3, "k8_b4_entropy_stop": 0, "k2_b2": 16, "k3_b4_entropy_stop": 12}


def test_the_fixture_records_stops_between_canvases_and_gemmas_batch_coupling():
  """Runs that end at an end token before their last canvas and runs that fill all three;
  canvases the entropy stop ends early; which runs are stable (STABLE), each flip's record
  consistent with it. gemma's batch of two rows with one rng: its first row is that prompt
  alone with the rng (its draws in the batch's shape begin with the row's own), its second
  row is not."""
  every = list(runs().values())
  assert {r["canvases_run"] for r in every} == {1, 2, 3}
  assert any(r["stopped"] and r["canvases_run"] < 3 for r in every)
  assert any(not r["stopped"] for r in every)
  for r in every:
    assert len(r["canvas_steps"]) == r["canvases_run"]
    assert r["threshold"] is not None or set(r["canvas_steps"]) == {r["steps"]}, r["name"]
  early = {case: sum(n < r["steps"] for r in every if r["case"] == case
                     for n in r["canvas_steps"]) for case in CASES}
  assert early == {"k4_b2": 0, "k8_b4_entropy_stop": 65, "k2_b2": 0, "k3_b4_entropy_stop": 49}
  for r in every:
    clear = all(m is None or m > 1e-4 for k, m in r["margins"].items() if k != "sc_midpoint")
    assert r["flips_tried"] > 0, r["name"]  # every case reads some step's embeddings
    assert (r["flips_changing"] == 0) == (r["rounding_margin"] is None), r["name"]
    assert r["rounding_margin"] is None or r["rounding_margin"] < 1e-5, r["name"]
    assert r["stable"] == (r["replays"] and r["robust"] and r["flips_changing"] == 0
                           and clear), r["name"]
  assert all(r["replays"] for r in every)
  assert {case: sum(r["stable"] for r in every if r["case"] == case) for case in CASES} == STABLE
  assert fixture()["batch"]["rows_equal_alone"] == [True, False]


def _cache_after(c: int, run: dict, config, params):
  """The cache gemma's sampler had before canvas c: the prompt (if any) and canvases 0..c-1
  of the run, each appended by the encoder pass."""
  tokens = arrays()[f"{run['name']}/tokens"]
  cache = network.init_cache(config, 1, PROMPT + NEW)
  if run["prompt"] != "none":
    cache = encode(config, params, cache, prompts()[run["row"]][None])
  for k in range(c):
    cache = encode(config, params, cache, tokens[None, k * WIDTH:(k + 1) * WIDTH])
  return cache


@pytest.mark.slow
@pytest.mark.parametrize("name", ["k4_b2_p0_0", "k8_b4_entropy_stop_none_0"])
def test_each_canvas_reads_the_canvases_appended_before_it(name):
  """Every recorded step of every canvas: mdjax's decoder logits from the step's canvas and
  self-conditioning embeddings, after the earlier canvases were appended to the cache, within
  1e-4 of the largest of gemma's."""
  run, z, m = runs()[name], arrays(), model()
  checked = 0
  for c in range(run["canvases_run"]):
    cache = _cache_after(c, run, m.config, m.params)
    steps_canvas, steps_sc = z[f"{name}/c{c}/steps_canvas"], z[f"{name}/c{c}/steps_sc"]
    for i, expected in enumerate(z[f"{name}/c{c}/steps_logits"]):
      got = decode(m.config, m.params, cache, steps_canvas[i], steps_sc[i])
      np.testing.assert_allclose(np.asarray(got), expected, rtol=0,
                                 atol=family_fixtures.tolerance(expected, 1e-4),
                                 err_msg=f"canvas {c} step {i}")
      checked += 1
  assert checked >= run["canvases_run"]


def _compare(rows: list[str]) -> list[str]:
  """`mdjax.generate` of the default sampler, a case and seed at a time, the prompts `rows`
  as one batch (row r draws with fold_in(key, r)), wherever one of the rows' runs is stable;
  each stable row's completion against gemma's tokens. Returns the runs compared."""
  m = model()
  compared = []
  for case in CASES:
    for seed in fixture()["seeds"]:
      names = [f"{case}_{row}_{seed}" for row in rows]
      if not any(runs()[n]["stable"] for n in names):
        continue
      batch = [[] if row == "none" else prompts()[runs()[n]["row"]].tolist()
               for row, n in zip(rows, names)]
      out = mdjax.generate(m, batch, max_new_tokens=NEW, key=seed, **knobs(runs()[names[0]]))
      for name, got in zip(names, out):
        if not runs()[name]["stable"]:
          continue
        tokens = arrays()[f"{name}/tokens"]
        np.testing.assert_array_equal(got.token_ids, completion(tokens), err_msg=name)
        assert got.finish_reason == ("stop" if runs()[name]["stopped"] else "length"), name
        compared.append(name)
  return compared


def _stable(prompt) -> list[str]:
  return [n for n, r in runs().items() if r["stable"] and r["prompt"] in prompt]


@pytest.mark.slow
def test_generate_without_a_prompt_equals_gemma():
  """Three canvases from an empty cache: every stable run, among them runs that fill all
  three canvases and runs the entropy stop ends early."""
  compared = _compare(["none"])
  assert sorted(compared) == sorted(_stable({"none"}))
  every = [runs()[n] for n in compared]
  assert any(r["canvases_run"] == 3 for r in every)
  assert any(r["threshold"] is not None and min(r["canvas_steps"]) < r["steps"] for r in every)


@pytest.mark.slow
def test_generate_of_two_prompts_equals_gemma_row_by_row():
  """Both prompt rows in one batch: row r is gemma's run with rng fold_in(key(seed), r). The
  runs compared include one that stops at an end token after its first or second canvas, one
  that fills all three, and one whose canvases the entropy stop ends early."""
  compared = _compare(["p0", "p1"])
  assert sorted(compared) == sorted(_stable({"p0", "p1"}))
  every = [runs()[n] for n in compared]
  assert any(r["stopped"] and r["canvases_run"] < 3 for r in every)
  assert any(r["canvases_run"] == 3 for r in every)
  assert any(r["threshold"] is not None and min(r["canvas_steps"]) < r["steps"] for r in every)


def test_the_default_sampler_lays_out_canvases():
  """gemma's Sampler: canvases of reference_length (256 by default), its end tokens, 48 steps
  a canvas; up to one canvas's width, one canvas of max_new_tokens; a length that does not
  fill whole canvases is refused by name."""
  m = model()
  spec = m.sampler.plan(m, prompt_length=PROMPT, max_new_tokens=NEW, reference_length=WIDTH).spec
  assert isinstance(spec, sampling.DiffusionGemmaCanvasesSpec)
  assert (spec.reference_length, spec.canvases, spec.steps) == (WIDTH, 3, 48)
  assert (spec.stop_ids, spec.eos_id) == (END, 1)
  assert (spec.self_condition, spec.final_renoise, spec.early_stop, spec.entropy_stop) == (
      True, True, True, 0.005)
  one = m.sampler.plan(m, prompt_length=PROMPT, max_new_tokens=40).spec
  assert (one.reference_length, one.canvases) == (40, 1)
  assert m.sampler.plan(m, prompt_length=0, max_new_tokens=512).spec.canvases == 2
  with pytest.raises(ArgumentError, match="max_new_tokens=20 spans canvases"):
    m.sampler.plan(m, prompt_length=PROMPT, max_new_tokens=20, reference_length=WIDTH)
  with pytest.raises(ArgumentError, match="reference_length"):
    m.sampler.plan(m, prompt_length=PROMPT, max_new_tokens=20, reference_length=0)
  with pytest.raises(ValueError, match="canvases"):
    sampling.DiffusionGemmaCanvasesSpec(steps=2, reference_length=4, canvases=0)
  with pytest.raises(ValueError, match="reference_draws"):
    sampling.DiffusionGemmaCanvasesSpec(steps=2, reference_length=4, reference_draws=False)


@pytest.mark.slow
def test_a_batch_row_is_its_prompt_alone_with_its_key():
  """The key rule `generate` documents: row r of a batch draws with fold_in(key, r), so a
  row equals its prompt run alone with the row key (gemma's batch rows do not: the fixture's
  `batch`). On the family directly, one compile: two canvases of 4 after the prompt."""
  m = model()
  spec = sampling.DiffusionGemmaCanvasesSpec(steps=2, entropy_bound=1.0, reference_length=4,
                                             canvases=2, self_condition=True,
                                             condition_width=32, final_renoise=True)
  canvas = np.concatenate([prompts(), np.full((2, 8), 128, np.int32)], 1)
  denoiser = network.denoiser(m.config, PROMPT)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(3), jnp.arange(2))
  both = np.asarray(sampling.sample(denoiser, m.params, keys, canvas, spec,
                                    mask_id=128).tokens_BxL)
  for r in range(2):
    alone = sampling.sample(denoiser, m.params, keys[r:r + 1], canvas[r:r + 1], spec,
                            mask_id=128)
    np.testing.assert_array_equal(np.asarray(alone.tokens_BxL)[0], both[r])
