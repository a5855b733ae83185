"""Fast-dLLM v2 against the fixtures its published code wrote (tests/reference/fast_dllm_v2.py):
the loader, the block-causal shifted logits (full and cached passes), `batch_sample` token for
token through the default sampler, save -> load bit for bit, and bad folders."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest

import mdjax
from mdjax import io
from mdjax.models import published
from tests.formats import family_fixtures

FOLDER = family_fixtures.folder("fast_dllm_v2")


model = functools.partial(family_fixtures.model, "fast_dllm_v2")
reference = functools.partial(family_fixtures.reference, "fast_dllm_v2")
cases = functools.partial(family_fixtures.cases, "fast_dllm_v2")


def _tolerance(expected: np.ndarray) -> float:
  # float32 (eps 1.2e-7) through 2 layers of d_model 64 sums and a 320-way head: a few
  # hundred roundings of values of the logits' size, so ~1e-4 of the largest logit.
  return family_fixtures.tolerance(expected, 1e-4)


def test_config_and_tokenizer():
  m = model()
  c = m.config
  assert (m.family, c.family, c.block_size, c.logit_shift, c.qkv_bias) == (
      "fast_dllm_v2", "fast_dllm_v2", 8, True, True)
  assert (m.mask_id, m.eos_id, c.num_heads, c.num_kv_heads, c.num_layers) == (300, 295, 4, 2, 2)
  assert m.decode(m.encode("hi")) == "hi"
  assert m.sampler.knobs == ("block_length", "threshold", "temperature", "top_p")


def test_full_pass_logits_match_the_published_forward():
  m, ref = model(), reference()
  got = np.asarray(jax.jit(published.forward, static_argnums=0)(m.config, m.params,
                                                                 ref["tokens_BxL"]))
  expected = ref["logits_BxLxV"]
  finite = np.isfinite(expected)
  assert (np.isfinite(got) == finite).all()  # the mask column only is -inf
  np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=_tolerance(expected))


def test_cached_block_pass_matches_the_published_denoising_pass():
  m, ref = model(), reference()
  prefix, block = ref["cached_prefix_BxP"], ref["cached_block_BxW"]
  canvas = np.concatenate([prefix, np.full_like(block, m.mask_id)], 1)
  _, cache = jax.jit(published.prefill, static_argnums=0)(m.config, m.params, canvas)
  got, _ = jax.jit(published.decode, static_argnums=0)(m.config, m.params, cache, block,
                                                       prefix.shape[1])
  expected = ref["cached_logits_BxWxV"]
  finite = np.isfinite(expected)
  np.testing.assert_allclose(np.asarray(got)[finite], expected[finite], rtol=0,
                             atol=_tolerance(expected))


@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
@pytest.mark.slow
def test_batch_sample_token_for_token(case):
  """Each case's rows as one (left-padded) batch through the default sampler: the published
  tokens up to its stop token, and a stop where the published row stopped."""
  m = model()
  out = mdjax.generate(m, case["prompts"], max_new_tokens=24, key=jax.random.key(0),
                       block_length=case["small_block_size"], threshold=case["threshold"])
  for completion, expected in zip(out, case["generated"]):
    stopped = expected[-1] == case["stop_token"]
    expected = expected[:-1] if stopped else expected[:24]
    assert completion.token_ids[:len(expected)].tolist() == expected, case["name"]
    if stopped:
      assert len(completion.token_ids) == len(expected) and completion.finish_reason == "stop"


def test_save_load_is_bit_for_bit(tmp_path):
  m = model()
  io.save(m, tmp_path / "out", max_shard_bytes=200_000)
  again = mdjax.load(tmp_path / "out")
  assert again.config == m.config
  for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  raw = json.loads((tmp_path / "out" / "config.json").read_text())
  source = json.loads((FOLDER / "config.json").read_text())
  assert {k: raw.get(k) for k in source} == source


def _copy(tmp_path):
  folder = tmp_path / "ckpt"
  shutil.copytree(FOLDER, folder)
  return folder


def _edit_config(folder, **changes):
  raw = json.loads((folder / "config.json").read_text())
  raw.update(changes)
  (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("changes, match", [
    ({"bd_size": 6}, "max_position_embeddings=4096 must be a multiple of bd_size=6"),
    ({"bd_size": 0}, "bd_size=0"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"head_dim": 32}, "head_dim"),
    ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts=8"),  # LLaDA2's MoE keys
])
def test_bad_config_is_refused_by_key(tmp_path, changes, match):
  folder = _copy(tmp_path)
  _edit_config(folder, **changes)
  with pytest.raises(ValueError, match=match):
    mdjax.load(folder)


def test_bad_tensors_are_refused_by_name(tmp_path):
  folder = _copy(tmp_path)
  index = json.loads((folder / "model.safetensors.index.json").read_text())
  del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.bias"):
    mdjax.load(folder)
  folder = _copy(tmp_path / "mixed")  # a LLaDA config.json over Fast-dLLM v2 tensors
  _edit_config(folder, model_type="llada", architectures=["LLaDAModelLM"], d_model=64,
               n_layers=2, n_heads=4)
  with pytest.raises(ValueError, match="n_layers=2 but the checkpoint holds tensors for 0"):
    mdjax.load(folder)


def test_bad_sampler_knobs(tmp_path):
  m = model()
  with pytest.raises(ValueError, match="block_length=3 .* must divide"):
    mdjax.generate(m, [[5, 6, 7]], max_new_tokens=8, key=jax.random.key(0), block_length=3)
  with pytest.raises(ValueError, match="threshold"):
    mdjax.generate(m, [[5, 6, 7]], max_new_tokens=8, key=jax.random.key(0), threshold=1.5)


def parity_figures() -> dict:
  """What the logits and generation tests above assert, as figures (mdjax/bench/families.py):
  the largest |mdjax - reference| of the full and the cached pass's finite logits, absolute
  and relative to the largest reference logit (the tests' tolerance is 1e-4 of it), and per
  generations.json case whether every row's tokens (and stop) equal the reference's."""
  m, ref = model(), reference()

  def gap(got, expected):
    finite = np.isfinite(expected)
    diff = float(np.abs(np.asarray(got)[finite] - expected[finite]).max())
    return diff, diff / max(1.0, float(np.abs(expected[finite]).max()))

  full = gap(jax.jit(published.forward, static_argnums=0)(m.config, m.params, ref["tokens_BxL"]),
             ref["logits_BxLxV"])
  prefix, block = ref["cached_prefix_BxP"], ref["cached_block_BxW"]
  canvas = np.concatenate([prefix, np.full_like(block, m.mask_id)], 1)
  _, cache = jax.jit(published.prefill, static_argnums=0)(m.config, m.params, canvas)
  got, _ = jax.jit(published.decode, static_argnums=0)(m.config, m.params, cache, block,
                                                       prefix.shape[1])
  cached = gap(got, ref["cached_logits_BxWxV"])
  equal = {}
  for case in cases():
    out = mdjax.generate(m, case["prompts"], max_new_tokens=24, key=jax.random.key(0),
                         block_length=case["small_block_size"], threshold=case["threshold"])
    same = True
    for completion, expected in zip(out, case["generated"]):
      stopped = expected[-1] == case["stop_token"]
      expected = expected[:-1] if stopped else expected[:24]
      same &= completion.token_ids[:len(expected)].tolist() == expected
      if stopped:
        same &= len(completion.token_ids) == len(expected) and completion.finish_reason == "stop"
    equal[case["name"]] = bool(same)
  return {"full_logits_max_abs": full[0], "full_logits_rel": full[1],
          "cached_logits_max_abs": cached[0], "cached_logits_rel": cached[1],
          "tolerance_rel": 1e-4, "tokens_equal": equal}
