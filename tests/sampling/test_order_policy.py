"""The order policy as a value (file, checks) and its Plackett-Luce choice: the
log-probability of an ordered choice by enumeration, and the sampler's draws against it."""

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.sampling import order_policy, scores
from mdjax.sampling.families.order_policy import choice_scores

SCORES = np.array([0.3, -1.0, 1.2, 0.5], np.float32)
CANDIDATES = np.array([True, True, True, False])


def plackett_luce(order, s, candidates):
  """P(order) by the textbook product: each pick's weight over what is left."""
  left = [i for i in range(len(s)) if candidates[i]]
  p = 1.0
  for i in order:
    p *= math.exp(s[i]) / sum(math.exp(s[j]) for j in left)
    left.remove(i)
  return p


def test_order_log_prob_is_plackett_luce_by_enumeration():
  total = 0.0
  for order in itertools.permutations(np.flatnonzero(CANDIDATES), 2):
    rank = np.full(4, 4, np.int32)
    rank[list(order)] = [0, 1]
    for temperature in (1.0, 0.5):
      got = float(order_policy.order_log_prob(jnp.asarray(SCORES)[None], jnp.asarray(CANDIDATES)[None],
                                              jnp.asarray(rank)[None], temperature)[0])
      assert math.isclose(got, math.log(plackett_luce(order, SCORES / temperature, CANDIDATES)),
                          rel_tol=1e-5)
    total += plackett_luce(order, SCORES, CANDIDATES)
  assert math.isclose(total, 1.0, rel_tol=1e-6)  # the ordered pairs are every outcome


def test_the_gumbel_top_k_draw_is_that_law():
  # 20,000 draws of the ordered pair; each of the 6 frequencies within 4.5 binomial standard
  # errors (sqrt(p (1 - p) / n) <= 0.0035) of its enumerated probability: a false alarm
  # has probability about 6 * 7e-6.
  n = 20_000
  keys = jax.random.split(jax.random.key(3), n)
  s = jnp.broadcast_to(jnp.asarray(SCORES), (n, 4))
  cand = jnp.broadcast_to(jnp.asarray(CANDIDATES), (n, 4))
  noisy = choice_scores(1.0, keys, s)
  chosen = scores.select_top_k(noisy, cand, jnp.full((n,), 2, jnp.int32))
  rank = np.asarray(scores.rank_descending(noisy, chosen))
  for order in itertools.permutations(np.flatnonzero(CANDIDATES), 2):
    freq = np.mean((rank[:, order[0]] == 0) & (rank[:, order[1]] == 1))
    p = plackett_luce(order, SCORES, CANDIDATES)
    assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / n), (order, freq, p)


def test_a_policy_file_round_trips_and_bad_files_are_refused(tmp_path):
  policy = order_policy.example_policy(6, dim=3, hidden=2, seed=4)
  path = order_policy.save_policy(policy, str(tmp_path / "p.json"), {"how": "test"})
  back = order_policy.load_policy(path)
  assert back == policy and hash(back) == hash(policy) and back.digest == policy.digest
  assert order_policy.read_info(path) == {"how": "test"}
  raw = json.loads(open(path).read())
  for bad, says in (({**raw, "format": "x"}, "not an order policy"),
                    ({**raw, "length": 5}, "policy.pos must be"),
                    ({**raw, "weights": {**raw["weights"], "b2": [float("inf")]}}, "not finite")):
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ArgumentError, match=says):
      order_policy.load_policy(str(tmp_path / "bad.json"))
  with pytest.raises(ArgumentError, match="at most"):
    order_policy.example_policy(4, dim=200, hidden=200)


def test_the_spec_needs_a_policy_and_the_canvas_its_length():
  with pytest.raises(ArgumentError, match="policy"):
    sampling.OrderPolicySpec(steps=2)
  with pytest.raises(ArgumentError, match="policy_temperature"):
    sampling.OrderPolicySpec(steps=2, policy=order_policy.example_policy(4),
                             policy_temperature=-1.0)
  spec = sampling.OrderPolicySpec(steps=2, policy=order_policy.example_policy(5))
  stub = lambda params, tokens_BxL, t_B: jnp.zeros(tokens_BxL.shape + (3,))
  with pytest.raises(ValueError, match="length 5 must be the canvas length 4"):
    sampling.sample(stub, None, jax.random.key(0), jnp.full((1, 4), 3), spec)


def test_each_step_commits_the_even_count():
  stub = lambda params, tokens_BxL, t_B: jnp.zeros(tokens_BxL.shape + (3,))
  spec = sampling.OrderPolicySpec(steps=3, policy=order_policy.example_policy(7),
                                  record_trajectory=True)
  out = sampling.sample(stub, None, jax.random.key(0), jnp.full((2, 7), 3), spec)
  traj = np.asarray(out.trajectory_KxBxL)
  written = [(traj[i] != 3).sum(-1) for i in range(3)]
  assert [w.tolist() for w in written] == [[3, 3], [5, 5], [7, 7]]  # 7 = 3 + 2 + 2
