"""mdjax.parallelism (exact TC and per-step KL, AUP) and a tiny run of the parallelism bench."""

import json
import math

import jax
import numpy as np
import pytest

from mdjax import parallelism, sampling
from mdjax.bench import parallelism as bench
from mdjax.tasks import permutation

N = 3
PARAMS = permutation.Params(n=N)


def conditionals(tokens_NxL):
  probs, possible = permutation.exact_probs(np.asarray(tokens_NxL, np.int32), PARAMS)
  return np.asarray(probs, np.float64), np.asarray(possible)


def test_group_joint_total_correlation_and_kl_on_permutation():
  empty = np.full(N, N, np.int32)
  assignments, probs = parallelism.group_joint(conditionals, empty, [0, 1, 2])
  assert len(probs) == math.factorial(N)  # the uniform law on 3! orderings
  np.testing.assert_allclose(probs, 1 / 6)
  tc = parallelism.total_correlation(assignments, probs, N)
  assert tc == pytest.approx(permutation.group_total_correlation(N, N))
  # Drawing from the exact marginals attains the bound; any other product law is above
  # it by exactly the sum of the per-position KLs.
  q_exact = np.full((N, N), 1 / N)
  assert parallelism.product_kl(assignments, probs, q_exact) == pytest.approx(tc)
  q = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [1 / 3, 1 / 3, 1 / 3]])
  per_position = sum((1 / N * np.log((1 / N) / q[i])).sum() for i in range(N))
  assert parallelism.product_kl(assignments, probs, q) == pytest.approx(tc + per_position)
  assert parallelism.product_kl(assignments, probs, np.array([[1.0, 0, 0]] * N)) == math.inf
  assert parallelism.group_joint(conditionals, empty, [0, 1, 2], max_leaves=5) is None


def test_kl_is_at_least_tc_on_every_step_of_a_small_case():
  # Ancestral decoding with 2 steps on permutation(3), 64 rows: every step that wrote two or
  # more positions at a possible state, against the exact laws (KL = TC) and against
  # perturbed laws (KL > TC by the per-position KLs).
  out = sampling.sample(permutation.make_exact_denoiser(PARAMS), None, jax.random.key(0),
                        np.full((64, N), N, np.int32), sampling.AncestralSpec(steps=2))
  tokens, steps = np.asarray(out.tokens_BxL), np.asarray(out.write_step_BxL)

  def tilted(tokens_NxL):
    probs, possible = conditionals(tokens_NxL)
    q = probs * np.linspace(1.0, 2.0, N)  # reweight the items, keep the support
    return q / q.sum(-1, keepdims=True), possible

  for laws, tight in ((None, True), (tilted, False)):
    records = parallelism.step_bounds(conditionals, tokens, steps, mask_id=N, vocab_size=N,
                                      sampler_laws=laws)
    measured = [r for r in records if "tc" in r]
    assert len(measured) >= 10
    for r in measured:
      assert r["kl"] >= r["tc"] - 1e-6
      assert r["tc"] > 0  # a permutation's positions always depend on each other
      assert (abs(r["gap"]) < 1e-6) == tight
    summary = parallelism.summarize(records)
    assert summary["violations"] == 0 and summary["steps_measured"] == len(measured)


def test_written_groups_and_states_before_each_step():
  write_step = np.array([1, -1, 0, 1])
  fixed = np.array([False, True, False, False])
  groups = parallelism.written_groups(write_step, fixed)
  assert [(k, g.tolist()) for k, g in groups] == [(0, [2]), (1, [0, 3])]
  state = parallelism.state_before(np.array([5, 6, 7, 8]), write_step, 1, 9, fixed)
  assert state.tolist() == [9, 6, 7, 9]


def test_aup_follows_d3llm_definition():
  # One point: rho_1 y_1. Flat accuracy at the best: the plain area (W = 1).
  assert parallelism.aup([2.0], [80.0], 80.0) == pytest.approx(160.0)
  assert parallelism.aup([1.0, 3.0], [90.0, 90.0], 90.0) == pytest.approx(90 + 2 * 90)
  # A drop: the lower point is weighted by exp(-3 (1 - y / y_max)); a point more than 5
  # below the first is left out.
  w = math.exp(-3 * (1 - 88 / 90))
  assert parallelism.aup([1.0, 2.0, 4.0], [90.0, 88.0, 50.0], 90.0) == pytest.approx(
      90 + 0.5 * (88 * w + 90))
  with pytest.raises(ValueError, match="y_max"):
    parallelism.aup([1.0], [1.0], 0.0)


@pytest.mark.slow
def test_forwards_per_row_is_what_a_row_alone_costs():
  # A batch of one row: its forward count must be the program's denoiser calls.
  denoiser = permutation.make_exact_denoiser(PARAMS)
  # The two families whose calls are not their rounds.
  for spec in (sampling.SpeculativeSpec(k=2), sampling.DeferSpec(steps=N, threshold=0.02)):
    for seed in range(2):
      out = sampling.sample(denoiser, None, jax.random.key(seed), np.full((1, N), N, np.int32),
                            spec)
      assert bench.forwards_per_row(spec, out.counters.rounds_B)[0] == int(out.nfe), spec


def tiny_results(tmp):
  out = f"{tmp}/parallelism.json"
  results = bench.main(["--sizes=tiny", "--rows=128", "--bound_rows=4", "--train_steps=0",
                        "--tasks=permutation", f"--out={out}"], log=lambda *a: None)
  with open(out) as f:
    return results, json.load(f)


@pytest.mark.slow
def test_tiny_bench_schema_bound_and_closed_forms(tmp_path_factory):
  results, written = tiny_results(str(tmp_path_factory.mktemp("parallelism")))
  assert {"config", "oracle", "aup", "adaptivity", "permutation_trajectory", "trained",
          "seconds"} <= set(written)
  assert written["trained"] is None
  points = written["oracle"]["points"]
  assert {p["family"] for p in points} == {"ancestral", "entropy_bounded", "speculative"}
  for p in points:
    assert {"task", "family", "knobs", "accuracy", "accuracy_se", "tpf", "tpf_se",
            "tv_lower"} <= set(p)
    assert 0 <= p["accuracy"] <= 1 and p["tpf"] >= 1 - 1e-9
    assert p["accuracy_se"] == pytest.approx(math.sqrt(p["accuracy"] * (1 - p["accuracy"])
                                                       / p["rows"]))
  exact = [p for p in points if p["family"] in ("entropy_bounded", "speculative")]
  assert all(p["accuracy"] == 1.0 for p in exact)  # one position a step; exact verification
  one_step = next(p for p in points if p["knobs"] == {"steps": 1})
  assert one_step["tpf"] == N and one_step["tpf_se"] == 0.0
  # Closed forms, 4 binomial standard errors (two checks on 128 rows).
  for c in written["oracle"]["closed_forms"]:
    assert c["within_4_se"], c
  # The bound on the oracle: measured steps, none below TC, tight (KL = TC).
  bounds = written["oracle"]["bound"]
  assert sum(b["steps_measured"] for b in bounds) > 0
  for b in bounds:
    assert b["violations"] == 0
    if b["steps_measured"]:
      assert b["kl_mean"] == pytest.approx(b["tc_mean"], abs=1e-5)
  for row in written["permutation_trajectory"]:
    assert row["expected_summed_tc"] >= row["output_kl"] - 1e-12
  assert written["aup"]["permutation"]["speculative"] > written["aup"]["permutation"]["ancestral"]
  assert all(p.endswith(".png") for p in results["plots"])
