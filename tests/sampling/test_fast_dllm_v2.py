"""FastDllmV2Spec: Fast-dLLM v2's decoding rule, step by step on fixed logits, and its draw law
at temperature > 0 against the published top-p sampler (transcribed below in numpy)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling

FastDllmV2Spec = importlib.import_module("mdjax.sampling.families.fast_dllm_v2").FastDllmV2Spec

V = 5  # ids 0..4, mask id 5 (outside the vocabulary)
MASK = V


def fixed_logits(logits_LxV):
  """A denoiser whose logits never change: each step's rule is read directly."""
  logits_LxV = jnp.asarray(logits_LxV, jnp.float32)

  def apply(params, tokens_BxL, t_B):
    del params, t_B
    return jnp.broadcast_to(logits_LxV, tokens_BxL.shape + (V,))

  return apply


def confident(top, prob):
  """Logits whose softmax gives `top` probability `prob`, the rest equal."""
  rest = (1 - prob) / (V - 1)
  row = np.full(V, np.log(rest), np.float32)
  row[top] = np.log(prob)
  return row


def run(logits_LxV, tokens, spec):
  tokens = jnp.asarray([tokens], jnp.int32)
  result = sampling.sample(fixed_logits(logits_LxV), None, jax.random.key(0), tokens,
                           spec, fixed_BxL=np.asarray(tokens) != MASK)
  return np.asarray(result.tokens_BxL[0]), np.asarray(result.write_step_BxL[0])


def test_threshold_commits_in_sub_blocks_after_the_first_token():
  # Positions 0-1 are the prompt; 2..7 generated. Block 4, sub-blocks of 2.
  probs = [0.9, 0.9, 0.3, 0.95, 0.4, 0.6, 0.97, 0.92]
  logits = np.stack([confident(i % V, p) for i, p in enumerate(probs)])
  spec = FastDllmV2Spec(steps=7, threshold=0.9, block_size=4, sub_block_length=2,
                        temperature=0.0, skip_idle_steps=False)
  tokens, steps = run(logits, [1, 2] + [MASK] * 6, spec)
  assert tokens.tolist() == [1, 2, 2, 3, 4, 0, 1, 2]
  # step 0: sub-block [2, 3]: 3 clears 0.9, 2 does not (the best is 3 anyway);
  # step 1: 2 alone (the best of what is left); step 2: position 4 starts block 1: alone,
  # by argmax; step 3: 5 (the best of [5], nothing clears); step 4: sub-block [6, 7]: both
  # clear 0.9.
  assert steps[2:].tolist() == [1, 0, 2, 3, 4, 4]


def test_the_first_token_is_greedy_at_any_temperature():
  logits = np.stack([confident(3, 0.55)] * 8)
  spec = FastDllmV2Spec(steps=9, threshold=1.0, block_size=4, temperature=5.0,
                        skip_idle_steps=False)
  tokens, steps = run(logits, [0] * 4 + [MASK] * 4, spec)
  assert tokens[4] == 3 and steps[4] == 0


def test_the_last_step_commits_the_rest():
  logits = np.stack([confident(1, 0.3)] * 6)
  spec = FastDllmV2Spec(steps=2, threshold=0.9, temperature=0.0, skip_idle_steps=False)
  tokens, steps = run(logits, [0] + [MASK] * 5, spec)
  assert tokens.tolist() == [0, 1, 1, 1, 1, 1] and steps[1:].tolist() == [0, 1, 1, 1, 1]


def test_the_threshold_reads_the_distribution_drawn_from():
  """At temperature > 0 the probability compared is the drawn value's under the tempered,
  top-p renormalised law (as the published sampler returns it): a nucleus of one token has
  probability 1 and clears 0.99, though its plain softmax probability is 0.6."""
  logits = np.stack([confident(2, 0.6)] * 5)
  spec = FastDllmV2Spec(steps=5, threshold=0.99, temperature=1.0, top_p=0.5,
                        skip_idle_steps=False)
  tokens, steps = run(logits, [0] + [MASK] * 4, spec)
  assert tokens.tolist() == [0, 2, 2, 2, 2] and steps[1:].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("knobs, match", [
    ({"steps": 0}, "steps"), ({"steps": 4, "threshold": 1.5}, "threshold"),
    ({"steps": 4, "block_size": 0}, "block_size"),
    ({"steps": 4, "block_size": 8, "sub_block_length": 3}, "sub_block_length=3"),
])
def test_bad_spec(knobs, match):
  with pytest.raises(ValueError, match=match):
    FastDllmV2Spec(**knobs)


def published_top_p(logits_V, temperature, top_p):
  """Transcription of Fast_dLLM_QwenForCausalLM.sample_with_top_p's distribution
  (Efficient-Large-Model/Fast_dLLM_v2_7B modeling.py): softmax(logits / T), sorted, a token
  removed when the mass before it exceeds top_p, renormalised."""
  probs = np.exp(logits_V / temperature - np.max(logits_V / temperature))
  probs /= probs.sum()
  order = np.argsort(-probs, kind="stable")
  cumulative = np.cumsum(probs[order])
  remove = np.concatenate([[False], cumulative[:-1] > top_p])
  kept = probs.copy()
  kept[order[remove]] = 0.0
  return kept / kept.sum()


def test_draw_law_matches_the_published_top_p_sampler():
  """One step at temperature 0.7, top-p 0.8 on N rows of one masked sub-block position: the
  value frequencies within 4 binomial standard errors of the published law (seeded, so the
  test is deterministic; a correct sampler fails it with probability < 1e-4 per value)."""
  logits_V = np.array([2.0, 1.4, 1.1, 0.2, -1.0], np.float32)
  expected = published_top_p(logits_V, 0.7, 0.8)
  n = 4000
  spec = FastDllmV2Spec(steps=2, threshold=1.0, temperature=0.7, top_p=0.8,
                        skip_idle_steps=False)
  tokens = jnp.asarray(np.tile([[0, MASK]], (n, 1)), jnp.int32)
  result = sampling.sample(fixed_logits(np.stack([logits_V] * 2)), None, jax.random.key(3),
                           tokens, spec, fixed_BxL=np.asarray(tokens) != MASK)
  counts = np.bincount(np.asarray(result.tokens_BxL[:, 1]), minlength=V) / n
  stderr = np.sqrt(expected * (1 - expected) / n)
  assert expected[3:].sum() == 0 and counts[3:].sum() == 0  # outside the nucleus
  assert (np.abs(counts - expected) <= 4 * stderr + 1e-12).all(), (counts, expected)
