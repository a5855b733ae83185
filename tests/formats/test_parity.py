"""Parity with the published code on tiny random checkpoints in the published layouts.

The fixtures (tests/fixtures/pretrained/) come from tests/reference/pretrained.py: the
checkpoints, the transformers reference logits (LLaDA as a bidirectional Llama, Dream as a
bidirectional Qwen2 with its logit shift) and the token outputs of the published sampling
loops (LLaDA generate.py, Fast-dLLM's generate / prefix / dual cache loops, Dream's `_sample`)
at temperature 0, every decision clearing a 1e-4 relative margin. Nothing here needs torch.
"""

import functools
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import formats, io
from mdjax.models import published

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "fixtures", "pretrained")
FAMILIES = ("llada", "dream")
with open(os.path.join(FIXTURES, "generations.json")) as f:
  CASES = json.load(f)
PADDED = [c for c in CASES if c["attention_mask_BxP"] is not None]


@functools.cache
def model(family):
  return io.load(os.path.join(FIXTURES, family))


@functools.cache
def reference_logits():
  with np.load(os.path.join(FIXTURES, "reference_logits.npz")) as z:
    return dict(z)


def run(case, prompt_BxP, attention_mask_BxP):
  # llada.generate or dream.diffusion_generate
  fn = getattr(getattr(formats, case["family"]), case["fn"])
  mask = None if attention_mask_BxP is None else jnp.asarray(attention_mask_BxP, jnp.int32)
  return np.asarray(fn(model(case["family"]), jnp.asarray(prompt_BxP, jnp.int32),
                       attention_mask=mask, **case["kwargs"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_tokenizer(family):
  m = model(family)
  c = m.config
  assert (m.family, c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.mlp_hidden) == (
      family, 320, 64, 2, 4, 128)
  assert (c.mask_id, c.eos_id) == (300, 290)
  if family == "llada":
    assert (c.num_kv_heads, c.eot_id, c.qkv_bias, c.logit_shift) == (4, 310, False, False)
    assert (c.rope_theta, c.norm_eps) == (500000.0, 1e-5)
  else:
    assert (c.num_kv_heads, c.qkv_bias, c.logit_shift) == (2, True, True)
    assert (c.rope_theta, c.norm_eps) == (1e6, 1e-6)
  ids = m.tokenizer.encode("Hi!\n").ids
  assert ids == [40, 73, 1, 95] and m.tokenizer.decode(ids) == "Hi!\n"
  assert m.tokenizer.token_to_id("<|mdm_mask|>") == c.mask_id
  assert m.chat_template and "add_generation_prompt" in m.chat_template


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_logits_match_reference(family):
  """Within 1e-4 (float32) wherever the reference defines them (NaN: a padded position, or
  Dream's first real position, whose shifted logit is a padded query's); -inf exactly where
  the reference has it (the mask id)."""
  z = reference_logits()
  m = model(family)
  ref = z[f"{family}_logits"]
  got = np.asarray(published.forward(m.config, m.params, jnp.asarray(z[f"{family}_tokens"]),
                                     jnp.asarray(z[f"{family}_valid"])))
  assert got.shape == ref.shape and got.dtype == np.float32
  defined = ~np.isnan(ref)
  assert defined.any(axis=-1).sum() >= 28  # all but a few padded positions
  np.testing.assert_array_equal(np.isneginf(got[defined]), np.isneginf(ref[defined]))
  finite = defined & np.isfinite(ref)
  np.testing.assert_allclose(got[finite], ref[finite], rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_generation_matches_reference(case):
  """Token for token what the published loop produced (the case's `reference`)."""
  out = run(case, case["prompt_BxP"], case["attention_mask_BxP"])
  np.testing.assert_array_equal(out, np.asarray(case["output_BxT"]),
                                err_msg=f"{case['name']} ({case['reference']})")


@pytest.mark.parametrize("case", PADDED, ids=[c["name"] for c in PADDED])
@pytest.mark.slow
def test_left_padded_rows_equal_rows_alone(case):
  """A left-padded row generates what its unpadded prompt generates alone."""
  prompt, mask = np.asarray(case["prompt_BxP"]), np.asarray(case["attention_mask_BxP"], bool)
  width = prompt.shape[1]
  for row in np.flatnonzero(~mask.all(axis=1)):
    alone = prompt[row][mask[row]][None]
    out = run(case, alone, None)
    np.testing.assert_array_equal(out[0, alone.shape[1]:],
                                  np.asarray(case["output_BxT"])[row, width:],
                                  err_msg=f"{case['name']} row {row}")
