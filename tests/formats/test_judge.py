"""Causal judges (LlamaForCausalLM, Qwen2ForCausalLM): the checkpoints mdjax loads to score
samples (their generative perplexity: tests/evaluate/test_gen_ppl.py).

The fixtures (tests/fixtures/judge/) come from tests/reference/judge.py: tiny random
checkpoints written by transformers' save_pretrained (Qwen2's head tied to its embedding),
transformers' logits, and per-sample NLLs under the scoring rule of
`mdjax.evaluate.gen_ppl`. Nothing here needs torch.

Tolerances. The logits are float32 from two implementations whose reductions run in
different orders: each of the ~10 sums on the path to a logit (width 64 to 128) rounds to
float32 (relative 6e-8 per addition, at most ~1e-5 relative over 128 terms), and the logits
reach |12|, so 1e-4 bounds their difference with room (the fixtures differ by 2e-5).
"""

import functools
import json
import os

import jax
import numpy as np
import pytest

from mdjax import formats, io
from mdjax.io import tensors
from mdjax.models import published
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "judge")
FAMILIES = ("llama", "qwen2")
LOGITS_ATOL = 1e-4


@functools.cache
def model(family):
  return io.load(os.path.join(FIXTURES, family))


@functools.cache
def reference():
  with np.load(os.path.join(FIXTURES, "reference.npz")) as z:
    return dict(z)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_causal_logits_match_transformers(family):
  m = model(family)
  assert m.family == family and m.config.causal and m.config.mask_id is None
  # the Llama fixture has Llama 3.1's RoPE scaling (unscaled, its logits are off by ~10)
  assert m.config.rope_scaling == ((4.0, 1.0, 4.0, 32) if family == "llama" else None)
  with pytest.raises(ValueError, match=f"this '{family}' checkpoint is a causal LM"):
    formats.llada.generate(m, np.array([[5, 6]]), steps=2, gen_length=2, block_length=2)
  assert not m.config.logit_shift and m.config.qkv_bias == (family == "qwen2")
  stored = tensors.read_checkpoint(os.path.join(FIXTURES, family))
  if family == "qwen2":  # tied: no lm_head tensor; the head is the embedding
    assert "lm_head.weight" not in stored
    np.testing.assert_array_equal(m.params["head"], m.params["embed"].T)
  else:
    assert "lm_head.weight" in stored
  tokens = reference()[f"{family}_tokens"]
  changed = tokens.copy()  # causal: a later token changes nothing before it
  changed[:, 10:] = (changed[:, 10:] + 1) % 50
  both, cache = published.prefill(m.config, m.params, np.concatenate([tokens, changed]))
  logits, again = np.split(np.asarray(both), 2)
  np.testing.assert_allclose(logits, reference()[f"{family}_logits"], rtol=0, atol=LOGITS_ATOL)
  np.testing.assert_array_equal(again[:, :10], logits[:, :10])
  assert np.abs(again[:, 10:] - logits[:, 10:]).max() > 0.1
  if family == "llama":  # the cached pass: a window sees the cache before it, not after
    window, _ = published.decode(m.config, m.params, cache, np.concatenate([tokens, changed])[
        :, 6:11], 6)
    np.testing.assert_allclose(window, both[:, 6:11], rtol=0, atol=LOGITS_ATOL)


def test_layout_refuses_what_it_cannot_express(tmp_path):
  folder = tmp_path / "llama"
  io.save(model("llama"), str(folder))
  raw = json.loads((folder / "config.json").read_text())
  for key, value, match in (("attention_bias", True, "attention_bias=True is not supported"),
                            ("rope_parameters", {"rope_type": "yarn", "factor": 4.0},
                             "RoPE scaling .*'yarn'.* is not supported"),
                            ("rope_parameters", {"rope_type": "llama3"}, "missing 'factor'"),
                            ("hidden_act", "gelu", "hidden_act='gelu'")):
    (folder / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ValueError, match=match):
      io.load(str(folder))
  scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
  assert raw["rope_scaling"] == scaling  # transformers 4's keys and 5's, the same
  assert raw["rope_parameters"] == {**scaling, "rope_theta": 10000.0}
  (folder / "config.json").write_text(json.dumps(raw))
  again = io.load(str(folder))  # save -> load is the same model
  assert again.config == model("llama").config
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model("llama").params)):
    np.testing.assert_array_equal(a, b)


def test_sample_py_refuses_a_published_causal_lm_in_one_line(sample_cli):
  # Was an AttributeError traceback ('NoneType' object has no attribute 'knobs').
  proc = sample_cli(f"--pretrained={os.path.join(FIXTURES, 'llama')}", "--num_samples=2")
  assert proc.returncode == 1 and proc.stderr.strip().endswith(
      "this 'llama' checkpoint is a causal LM: it has no mask id and is not sampled by the "
      "diffusion samplers; it scores samples (mdjax.evaluate.generative_perplexity)."), proc.stderr
