"""Test-and-defer, direct revision, localized remasking and min-p."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling import defer, local_remask, transforms
from mdjax.tasks import scan_and_add as sa
from mdjax.tasks import two_color
from tests import stubs

VOCAB, LENGTH, PROMPT = 6, 12, 4
N = 20_000


def _binomial_tol(p: float, n: int) -> float:
  """4 standard errors of a binomial frequency."""
  return 4.0 * math.sqrt(p * (1 - p) / n)


def _prompted_canvas(batch=8):
  rng = np.random.default_rng(1)
  tokens = np.full((batch, LENGTH), VOCAB, np.int32)
  tokens[:, :PROMPT] = rng.integers(0, VOCAB, (batch, PROMPT))
  return jnp.asarray(tokens)


def _product_denoiser(params, tokens_BxL, t_B):
  """The exact denoiser of a product law: per-position logits that ignore the canvas."""
  del t_B
  return jnp.broadcast_to(params["pos"][None], tokens_BxL.shape + (VOCAB,))


# ----------------------------------------------------------------------------
# Test-and-defer.
# ----------------------------------------------------------------------------


def test_defer_threshold_zero_defers_nothing_on_a_product_law():
  params = stubs.stub_params(VOCAB, LENGTH)
  out = sampling.sample(_product_denoiser, params, jax.random.key(0), _prompted_canvas(),
                        sampling.DeferSpec(steps=4, threshold=0.0))
  write_step = np.asarray(out.write_step_BxL)
  assert np.all(write_step[:, PROMPT:] == 0), "every proposal commits at the first step"
  assert np.all(write_step[:, :PROMPT] == -1)


def test_defer_on_two_color_defers_the_dependent_position():
  # Anchoring one position moves the other's distribution from (1/2, 1/2) to a point mass:
  # total variation 1/2. Below 1/2 it is deferred, then copied: never a mismatched pair.
  below = sampling.sample(two_color.exact_denoiser, None, jax.random.key(0),
                          two_color.empty_canvas(N), sampling.DeferSpec(steps=2, threshold=0.4))
  assert float(two_color.invalid_fraction(below.tokens_BxL)) == 0.0
  # Above 1/2 both proposals commit at once: independent draws, mismatched half the time.
  above = sampling.sample(two_color.exact_denoiser, None, jax.random.key(0),
                          two_color.empty_canvas(N), sampling.DeferSpec(steps=2, threshold=0.6))
  frac = float(two_color.invalid_fraction(above.tokens_BxL))
  assert abs(frac - 0.5) < _binomial_tol(0.5, N), frac
  # Calls: the first step evaluates the canvas and one batched test context (J = 1 for
  # L = 2); the last step only the canvas.
  assert int(below.nfe) == 3 and int(below.contexts_B[0]) == 3
  assert int(above.nfe) == 2  # the row is full after step 1; step 2's call is skipped


def test_defer_levels_and_batched_test_call():
  np.testing.assert_array_equal(defer.levels(jnp.array([0, 1, 2, 3, 4, 7, 8, 15, 16])),
                                [-1, 0, 1, 1, 2, 2, 3, 3, 4])
  assert [defer.num_levels(n) for n in (1, 2, 3, 4, 5, 25, 64)] == [1, 1, 2, 2, 3, 5, 6]
  params = stubs.stub_params(VOCAB, LENGTH)
  spec = sampling.DeferSpec(steps=5, threshold=0.05)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(1), _prompted_canvas(), spec)
  assert not np.any(np.asarray(out.tokens_BxL) == VOCAB)
  calls_per_step = 1 + defer.num_levels(LENGTH)
  assert int(out.contexts_B.max()) <= spec.steps * calls_per_step
  assert int(out.nfe) <= 2 * spec.steps - 1


# ----------------------------------------------------------------------------
# Direct revision.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["max_prob", "prob", "margin", "random"])
def test_revision_keeping_visible_tokens_is_confidence_decoding(score):
  params = stubs.stub_params(VOCAB, LENGTH, quantum=0.5)  # ties included
  tokens = _prompted_canvas(16)
  for steps in (3, 8):
    conf = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens,
                           sampling.ConfidenceSpec(steps=steps, score=score))
    rev = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens,
                          sampling.RevisionSpec(steps=steps, score=score, keep_visible=True))
    np.testing.assert_array_equal(rev.tokens_BxL, conf.tokens_BxL)
    np.testing.assert_array_equal(rev.write_step_BxL, conf.write_step_BxL)
    assert int(np.asarray(rev.extras["changes_KxB"]).sum()) == 0


def test_revision_keeping_visible_tokens_on_the_scan_and_add_oracle():
  canvas = sa.empty_canvas(500)
  for steps in (10, 25):
    conf = sampling.sample(sa.exact_denoiser, None, jax.random.key(2), canvas,
                           sampling.ConfidenceSpec(steps=steps))
    rev = sampling.sample(sa.exact_denoiser, None, jax.random.key(2), canvas,
                          sampling.RevisionSpec(steps=steps, keep_visible=True))
    np.testing.assert_array_equal(rev.tokens_BxL, conf.tokens_BxL)


def test_revision_changes_visible_tokens_and_records_it():
  # Two-color, 2 steps: step 2 redraws the visible position from the oracle (uniform, as
  # the other is masked) while the masked one copies the old value: a change and a
  # mismatch each with probability 1/2.
  out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(3),
                        two_color.empty_canvas(N), sampling.RevisionSpec(steps=2))
  changes = np.asarray(out.extras["changes_KxB"])
  assert changes.shape == (2, N) and np.all(changes[0] == 0)
  assert abs(changes[1].mean() - 0.5) < _binomial_tol(0.5, N)
  frac = float(two_color.invalid_fraction(out.tokens_BxL))
  assert abs(frac - 0.5) < _binomial_tol(0.5, N)
  # Changed tokens get the step of their new value.
  assert np.all(np.asarray(out.write_step_BxL)[changes[1] == 1].max(-1) == 1)


def test_revision_with_leave_group_out_scores_fills_the_canvas():
  params = stubs.stub_params(VOCAB, LENGTH)
  spec = sampling.RevisionSpec(steps=6, score_groups=3)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(1), _prompted_canvas(), spec)
  final = np.asarray(out.tokens_BxL)
  assert not np.any(final == VOCAB)
  np.testing.assert_array_equal(final[:, :PROMPT], np.asarray(_prompted_canvas())[:, :PROMPT])
  # Steps after the first evaluate the canvas and 3 leave-group-out contexts.
  assert int(out.contexts_B[0]) == 6 + 5 * 3 and int(out.nfe) == 6 + 5


# ----------------------------------------------------------------------------
# Localized remasking.
# ----------------------------------------------------------------------------


def test_windows_around_seeds():
  seeds = np.zeros((2, 10), bool)
  seeds[0, [0, 6]] = True
  seeds[1, 9] = True
  got = np.asarray(local_remask.windows_around(jnp.asarray(seeds), 1))
  want = np.zeros((2, 10), bool)
  want[0, [0, 1, 5, 6, 7]] = True
  want[1, [8, 9]] = True
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(local_remask.windows_around(jnp.asarray(seeds), 0), seeds)


@pytest.mark.parametrize("refill", [sampling.ConfidenceSpec(steps=3), sampling.AncestralSpec(
    steps=4), sampling.RemaskSpec(steps=4, eta=0.3), sampling.DeferSpec(steps=3)],
                         ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("window,context_fraction", [(0, 0.0), (2, 0.5)])
def test_local_remask_keeps_fixed_positions_and_fills_the_canvas(refill, window,
                                                                  context_fraction):
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = _prompted_canvas()
  spec = sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=4), refill=refill,
                                  rounds=3, seeds=2, window=window,
                                  context_fraction=context_fraction, score_groups=3)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(7), tokens, spec)
  final = np.asarray(out.tokens_BxL)
  assert not np.any(final == VOCAB), "no mask remains"
  np.testing.assert_array_equal(final[:, :PROMPT], np.asarray(tokens)[:, :PROMPT])
  assert np.all(np.asarray(out.write_step_BxL)[:, :PROMPT] == -1)
  # Each round remasks at least the seeds, all editable.
  assert np.all(np.asarray(out.reopened_B) >= 3 * 2)


def test_local_remask_repairs_scan_and_add():
  # From a confidence fill at T = 10 (correct about 0.1 with the exact denoiser), rounds
  # of remasking and refilling raise correctness. 1000 samples: the binomial s.e. is at
  # most 0.016, and the gain asserted is at least 0.2.
  canvas = sa.empty_canvas(1000)
  base = sampling.ConfidenceSpec(steps=10)
  plain = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), canvas, base)
  spec = sampling.LocalRemaskSpec(base=base, refill=sampling.ConfidenceSpec(steps=3), rounds=3)
  repaired = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), canvas, spec)
  before = sa.sample_metrics(np.asarray(plain.tokens_BxL))["correct"]
  after = sa.sample_metrics(np.asarray(repaired.tokens_BxL))["correct"]
  assert after > before + 0.2, (before, after)
  assert int(repaired.nfe) == 10 + 3 * (1 + 3)


# ----------------------------------------------------------------------------
# min-p and errors (batch = single rows and the Python loop: tests/test_sampling.py).
# ----------------------------------------------------------------------------


def test_min_p_keeps_the_argmax_and_everything_at_zero():
  logits = jax.random.normal(jax.random.key(0), (64, 5, 11)) * 3.0
  argmax = np.asarray(jnp.argmax(logits, -1))
  for min_p in (0.01, 0.3, 0.9, 1.0):
    kept = np.isfinite(np.asarray(transforms.transform_logits(logits, 1.0, None, 1.0, min_p)))
    assert np.all(np.take_along_axis(kept, argmax[..., None], -1))
  everything = transforms.transform_logits(logits, 1.0, None, 1.0, 0.0)
  np.testing.assert_array_equal(everything, logits)


@pytest.mark.parametrize("make,match", [
    (lambda: sampling.DeferSpec(steps=4, threshold=1.5), "threshold=1.5"),
    (lambda: sampling.DeferSpec(steps=0), "steps=0"),
    (lambda: sampling.RevisionSpec(steps=4, score_groups=-1), "score_groups=-1"),
    (lambda: sampling.RevisionSpec(steps=4, score="best"), "score='best'"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.SpeculativeSpec(k=2),
                                      refill=sampling.ConfidenceSpec(steps=2)),
     "base='SpeculativeSpec'"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=2),
                                      refill=sampling.ConfidenceSpec(steps=2, block_length=2)),
     "refill.block_length=2"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=2),
                                      refill=sampling.ConfidenceSpec(steps=2), window=-1),
     "window=-1"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=2),
                                      refill=sampling.ConfidenceSpec(steps=2),
                                      context_fraction=2.0), "context_fraction=2.0"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_literature_experiment_schema(trained, tmp_path, monkeypatch):
  import json
  from experiments import literature_samplers as ls
  from mdjax import tasks, train
  root, _ = trained
  _, char_apply, char_params, _ = train.load_for_sampling(str(root / "char"))
  config, causal_apply, causal_params, _ = train.load_for_sampling(str(root / "causal"))
  text_models = (tasks.from_config(config), {"char": (char_apply, char_params),
                                             "causal": (causal_apply, causal_params)})
  monkeypatch.setattr(ls, "BUDGETS", {"scan_and_add": (8,), "shakespeare": (8,)})
  monkeypatch.setattr(ls, "SPECULATIVE_KS", (4,))
  monkeypatch.setattr(ls, "ADAPTIVE_DEFER_THRESHOLDS", (0.1,))
  results = ls.run(64, repeats=5, sa_model=(sa.exact_denoiser, None), text_models=text_models)
  ls.write(results, str(tmp_path))
  data = json.loads((tmp_path / "literature_samplers.json").read_text())
  assert (tmp_path / "literature_samplers.png").stat().st_size > 0
  families = {r["sampler"] for r in data["rows"]}
  assert families == set(ls.FAMILY_ORDER)
  for row in data["rows"]:
    assert set(ls.ROW_KEYS) <= set(row)
    assert row["denoiser"] in ("oracle", "model") and row["calls_per_sample"] > 0
    if row["task"] == "scan_and_add":
      assert row["gen_bits_per_char"] is None and 0 <= row["correct"] <= 1
      if row["budget"] is not None:
        assert row["calls_per_sample"] <= 1.25 * row["budget"], row  # matched budgets
    else:
      assert row["correct"] is None and row["gen_bits_per_char"] > 0
  # The exact sampler is exact with the exact denoiser: every sample correct.
  exact = [r for r in data["rows"] if r["sampler"] == "speculative" and r["denoiser"] == "oracle"]
  assert exact and all(r["correct"] == 1.0 for r in exact)
