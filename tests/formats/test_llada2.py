"""LLaDA2 (llada2_moe) against the fixtures its published code wrote (tests/reference/llada2.py):
the loader (fused query_key_value, per-expert tensors, the expert bias), the block-causal
logits of the mixture-of-experts network (full and cached passes), LLaDA2MoeModelLM.generate
token for token through the default sampler, save -> load bit for bit, and bad input."""

import dataclasses
import functools
import json
import shutil

import jax
import numpy as np
import pytest

import mdjax
from mdjax import io
from mdjax.formats import llada2
from mdjax.models import published
from tests.formats import family_fixtures

FOLDER = family_fixtures.folder("llada2")
EOS_ID = 290


model = functools.partial(family_fixtures.model, "llada2")
reference = functools.partial(family_fixtures.reference, "llada2")
cases = functools.partial(family_fixtures.cases, "llada2")


def _tolerance(expected: np.ndarray) -> float:
  # float32 (eps 1.2e-7) through 3 layers of d_model 64 sums, a 2-of-8 expert mix and a
  # 320-way head: a few hundred roundings of values of the logits' size, ~1e-4 of the
  # largest logit. The routing choices the fixture took clear a 1e-4 relative margin, so
  # none flips on rounding (a flip would move logits by O(1)).
  return family_fixtures.tolerance(expected, 1e-4)


def test_config_and_tokenizer():
  m = model()
  c = m.config
  assert (m.family, c.family, c.block_size, c.logit_shift, c.qkv_bias, c.qk_norm) == (
      "llada2", "llada2", 32, False, False, True)
  assert (c.head_dim, c.rotary_dim, c.num_heads, c.num_kv_heads, c.num_layers) == (16, 8, 4, 2, 3)
  assert c.moe == llada2.MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=32,
                                   num_shared_experts=1, n_group=2, topk_group=1,
                                   routed_scaling_factor=2.5, first_dense_layers=1)
  assert (m.mask_id, m.eos_id, m.pad_id) == (300, EOS_ID, EOS_ID)
  assert set(m.params) == {"embed", "layers", "moe_layers", "final_norm", "head"}
  assert m.params["moe_layers"]["experts_gate"].shape == (2, 8, 64, 32)
  assert np.abs(np.asarray(m.params["moe_layers"]["expert_bias"])).min() > 0  # read, not zeros
  assert m.decode(m.encode("hi")) == "hi"
  assert m.sampler.knobs == ("block_length", "steps", "threshold", "minimal_topk",
                             "temperature", "top_p", "top_k", "editing_threshold",
                             "max_post_steps", "num_to_transfer")  # LLaDA2.1's last


def test_published_config_maps():
  """LLaDA2.0-mini's config.json (its published keys): no mask_token_id key, the mask and
  EOS ids of its vocabulary, RoPE over half of each 128-wide head, 256 experts."""
  raw = {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
         "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
         "hidden_size": 2048, "intermediate_size": 5120, "max_position_embeddings": 32768,
         "moe_intermediate_size": 512, "n_group": 8, "norm_topk_prob": True,
         "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
         "num_hidden_layers": 20, "num_key_value_heads": 4, "num_shared_experts": 1,
         "pad_token_id": 156892, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
         "rope_theta": 600000, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
         "tie_word_embeddings": False, "topk_group": 4, "use_bias": False,
         "use_qk_norm": True, "use_qkv_bias": False, "vocab_size": 157184}
  c = llada2.LLaDA2Format().config_from_hf(raw, "bfloat16")
  assert (c.mask_id, c.eos_id, c.rotary_dim, c.block_size, c.head_dim) == (
      156895, 156892, 64, 32, 128)
  assert (c.moe.num_experts, c.moe.experts_per_token, c.moe.n_group, c.moe.topk_group,
          c.moe.first_dense_layers, c.dense_layers) == (256, 8, 8, 4, 1, 1)


@pytest.mark.slow
def test_full_pass_logits_match_the_published_forward():
  m, ref = model(), reference()
  config = dataclasses.replace(m.config, block_size=int(ref["block_size"]))
  got = np.asarray(jax.jit(published.forward, static_argnums=0)(
      config, m.params, ref["tokens_BxL"], ref["valid_BxL"]))
  expected = ref["logits_BxLxV"]
  real = ref["valid_BxL"]
  np.testing.assert_array_equal(np.isfinite(got[real]), np.isfinite(expected[real]))
  finite = np.isfinite(expected)
  np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=_tolerance(expected))


@pytest.mark.slow
def test_cached_block_pass_matches_the_published_cache_pass():
  m, ref = model(), reference()
  config = dataclasses.replace(m.config, block_size=int(ref["block_size"]))
  row, start = int(ref["cached_row"]), int(ref["cached_from"])
  tokens = ref["tokens_BxL"][row:row + 1]
  canvas = tokens.copy()
  canvas[:, start:] = m.mask_id  # the prefix's keys never see the block
  _, cache = jax.jit(published.prefill, static_argnums=0)(config, m.params, canvas)
  got, _ = jax.jit(published.decode, static_argnums=0)(config, m.params, cache,
                                                       tokens[:, start:], start)
  expected = ref["cached_logits_BxWxV"]
  finite = np.isfinite(expected)
  np.testing.assert_allclose(np.asarray(got)[finite], expected[finite], rtol=0,
                             atol=_tolerance(expected))


@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
@pytest.mark.slow
def test_generate_token_for_token(case):
  """Each case's rows as one left-padded batch through the default sampler: the published
  tokens, each row as it gave alone; a row the published loop ended with EOS stops there."""
  m = model()
  knobs = dict(case["kwargs"])
  new = knobs.pop("gen_length")
  if case["name"] == "defaults":  # the published defaults are the sampler's
    knobs = {}
  out = mdjax.generate(m, [row["prompt"] for row in case["rows"]], max_new_tokens=new,
                       key=jax.random.key(0), **knobs)
  for completion, row in zip(out, case["rows"]):
    expected = row["generated"]
    if expected[-1] == EOS_ID:
      assert completion.token_ids.tolist() == expected[:-1]
      assert completion.finish_reason == "stop"
    else:
      assert completion.token_ids.tolist() == expected


def test_save_load_is_bit_for_bit(tmp_path):
  m = model()
  written = io.save(m, tmp_path / "out", max_shard_bytes=300_000)
  assert any(p.endswith("model.safetensors.index.json") for p in written)
  again = mdjax.load(tmp_path / "out")
  assert again.config == m.config
  for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(again.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  stored = lambda folder: set(json.loads(
      (folder / "model.safetensors.index.json").read_text())["weight_map"])
  assert stored(tmp_path / "out") == stored(FOLDER)  # the published names, fused and per expert
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


def _drop_tensor(folder, name):
  index = json.loads((folder / "model.safetensors.index.json").read_text())
  del index["weight_map"][name]
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("changes, match", [
    ({"use_bias": True}, "use_bias=True"),
    ({"score_function": "softmax"}, "score_function='softmax'"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"num_experts": 7}, "num_experts=7 must be a multiple of n_group=2"),
    ({"topk_group": 3}, "topk_group=3"),
    ({"num_experts_per_tok": 5}, "experts_per_token=5"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1"),
    ({"num_shared_experts": 0}, "num_shared_experts=0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"bd_size": 32}, "bd_size=32"),  # Fast-dLLM v2's key in a LLaDA2 config.json
    ({"attention_bias": True}, "attention_bias=True"),  # SDAR's
])
def test_bad_config_is_refused_by_key(tmp_path, changes, match):
  folder = _copy(tmp_path)
  _edit_config(folder, **changes)
  with pytest.raises(ValueError, match=match):
    mdjax.load(folder)


@pytest.mark.parametrize("drop, match", [
    ("model.layers.2.mlp.experts.3.up_proj.weight",
     r"missing tensor\(s\) model.layers.2.mlp.experts.3.up_proj.weight"),
    ("model.layers.1.attention.query_key_value.weight",
     r"model.layers.1.attention.query_key_value.weight\[q\]"),
    ("model.layers.1.mlp.gate.expert_bias", "model.layers.1.mlp.gate.expert_bias"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
])
def test_missing_tensor_is_named(tmp_path, drop, match):
  folder = _copy(tmp_path)
  _drop_tensor(folder, drop)
  with pytest.raises(ValueError, match=match):
    mdjax.load(folder)


def test_mixed_or_misshaped_folders_are_refused(tmp_path):
  folder = _copy(tmp_path / "heads")  # query_key_value rows for 3 KV heads, not 2
  _edit_config(folder, num_key_value_heads=1)
  with pytest.raises(ValueError, match=r"query_key_value.weight' has shape \[128, 64\], "
                                       r"expected 96 rows"):
    mdjax.load(folder)
  folder = _copy(tmp_path / "dense")  # every layer dense: the experts are not its tensors
  _edit_config(folder, first_k_dense_replace=3)
  with pytest.raises(ValueError, match=r"missing tensor\(s\) model.layers.1.mlp.gate_proj"):
    mdjax.load(folder)
  folder = _copy(tmp_path / "llada")  # a LLaDA config.json over LLaDA2 tensors
  _edit_config(folder, model_type="llada", architectures=["LLaDAModelLM"], d_model=64,
               n_layers=3, n_heads=4)
  with pytest.raises(ValueError, match="n_layers=3 but the checkpoint holds tensors for 0"):
    mdjax.load(folder)


def test_bad_sampler_knobs():
  m = model()
  generate = functools.partial(mdjax.generate, m, [[5, 6, 7]], key=jax.random.key(0))
  with pytest.raises(ValueError, match="block_length=0"):
    generate(max_new_tokens=8, block_length=0)
  with pytest.raises(ValueError, match="minimal_topk=9"):
    generate(max_new_tokens=8, minimal_topk=9)
  with pytest.raises(ValueError, match="threshold=1.5"):
    generate(max_new_tokens=8, threshold=1.5)
  with pytest.raises(ValueError, match="max_len=512"):
    generate(max_new_tokens=500)


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

  config = dataclasses.replace(m.config, block_size=int(ref["block_size"]))
  full = gap(jax.jit(published.forward, static_argnums=0)(
      config, m.params, ref["tokens_BxL"], ref["valid_BxL"]), ref["logits_BxLxV"])
  row, start = int(ref["cached_row"]), int(ref["cached_from"])
  tokens = ref["tokens_BxL"][row:row + 1]
  canvas = tokens.copy()
  canvas[:, start:] = m.mask_id
  _, cache = jax.jit(published.prefill, static_argnums=0)(config, m.params, canvas)
  got, _ = jax.jit(published.decode, static_argnums=0)(config, m.params, cache,
                                                       tokens[:, start:], start)
  cached = gap(got, ref["cached_logits_BxWxV"])
  equal = {}
  for case in cases():
    knobs = dict(case["kwargs"])
    new = knobs.pop("gen_length")
    if case["name"] == "defaults":
      knobs = {}
    out = mdjax.generate(m, [r["prompt"] for r in case["rows"]], max_new_tokens=new,
                         key=jax.random.key(0), **knobs)
    same = True
    for completion, r in zip(out, case["rows"]):
      expected = r["generated"]
      if expected[-1] == EOS_ID:
        same &= (completion.token_ids.tolist() == expected[:-1]
                 and completion.finish_reason == "stop")
      else:
        same &= completion.token_ids.tolist() == expected
    equal[case["name"]] = bool(same)
  return {"full_logits_max_abs": full[0], "full_logits_rel": full[1],
          "cached_logits_max_abs": cached[0], "cached_logits_rel": cached[1],
          "tolerance_rel": 1e-4, "tokens_equal": equal}
