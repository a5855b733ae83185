"""SDAR against the fixtures its published code wrote (tests/reference/sdar.py: SDARForCausalLM
and generate.py's block_diffusion_generate of JetAstra/SDAR): the loader, the block-causal
logits (a left-padded batch, and the cached passes the loop makes), every remasking strategy's
generations token for token through the default sampler (each case's two prompts as one
left-padded batch), save -> load bit for bit, and bad input. Nothing here needs torch."""

import dataclasses
import functools
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest

import mdjax
from mdjax import generation, io, sampling
from mdjax.formats import sdar
from mdjax.io import tensors
from mdjax.models import published
from mdjax.sampling import transforms
from tests.paths import REPO
from tests.formats import family_fixtures

FOLDER = family_fixtures.folder("sdar")
# The law settings of tests/reference/sdar.py (LAW_*), as generate.py's knobs.
LAW_STATIC = {"temperature": 0.7, "top_k": 0, "top_p": 1.0}
LAW_DYNAMIC = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
LAW_FILTERED = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
GENERATIONS = json.loads((FOLDER / "generations.json").read_text())


model = functools.partial(family_fixtures.model, "sdar")


reference = functools.partial(family_fixtures.reference, "sdar")


def _tolerance(expected: np.ndarray) -> float:
  # float32 (eps 1.2e-7) through 3 layers of sums over 64-128 terms, attention sharpened by
  # q/k norm weights of 3 and a 320-way head: a few hundred roundings of values of the
  # logits' size, so ~1e-5 of the largest logit (measured: 2.0e-6 of it).
  return family_fixtures.tolerance(expected, 1e-5)


def test_config_and_tokenizer():
  m = model()
  c = m.config
  assert (m.family, c.family, c.block_size, c.qk_norm, c.qkv_bias, c.logit_shift) == (
      "sdar", "sdar", 4, True, False, False)
  # head_dim is its own key: heads x head_dim = 128 != hidden 64, as SDAR-4B's 4096 != 2560
  assert (c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (64, 4, 2, 32, 3)
  assert (m.mask_id, m.eos_id, m.eot_id, m.pad_id, c.rope_theta, c.max_len) == (
      300, 290, None, 290, 1e6, 4096)
  assert m.padding_invariant and m.denoiser.block_size == 4
  assert m.decode(m.encode("Hi!")) == "Hi!"
  assert m.sampler.knobs == ("block_length", "denoising_steps", "temperature", "top_k", "top_p",
                             "remasking_strategy", "confidence_threshold", "eb_threshold")


# SDAR-4B-Chat's config.json (JetAstra/SDAR training/model/SDAR-4B-Chat/), its architecture keys.
SDAR_4B = {"architectures": ["SDARForCausalLM"], "model_type": "sdar", "attention_bias": False,
           "bos_token_id": 151643, "eos_token_id": 151643, "block_size": 4,
           "mask_token_id": 151669, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
           "intermediate_size": 9728, "max_position_embeddings": 32768,
           "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "use_sliding_window": False, "vocab_size": 151936}


def test_the_published_4b_config_maps_to_its_weights():
  """Its parameter count is the published index's total_size (8822848512 bytes of
  bfloat16); the mask and end-of-turn ids default to the Qwen3 vocabulary's."""
  c = sdar.SDARFormat().config_from_hf(SDAR_4B, "bfloat16")
  assert published.num_params(c) * 2 == 8822848512
  assert (c.head_dim * c.num_heads, c.d_model, c.block_size, c.qk_norm) == (4096, 2560, 4, True)
  without = {k: v for k, v in SDAR_4B.items() if k != "mask_token_id"}
  c = sdar.SDARFormat().config_from_hf(without, "bfloat16")
  assert (c.mask_id, c.eos_id, c.eot_id) == (151669, 151643, 151645)
  raw = sdar.SDARFormat().config_to_hf(c)
  assert {k: raw[k] for k in SDAR_4B} == SDAR_4B  # save writes the published keys back


def test_the_published_chat_template_renders_as_transformers_does():
  # transformers' apply_chat_template renders it with tools=None (it opens `{%- if tools %}`);
  # the writer checked this text with transformers.
  assert model().render_chat([{"role": "user", "content": "Hi!"}]) == (
      "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_the_published_forward():
  """A left-padded batch: blocks of 4 and positions from each row's first real token."""
  m, ref = model(), reference()
  got = np.asarray(jax.jit(published.forward, static_argnums=0)(
      m.config, m.params, ref["tokens_BxL"], ref["valid_BxL"]))
  expected = ref["logits_BxLxV"]
  defined = ~np.isnan(expected)  # NaN: padded queries
  finite = np.isfinite(expected)
  assert (np.isfinite(got) == finite)[defined].all()  # the mask column only is -inf
  np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=_tolerance(expected))


def test_cached_passes_match_the_published_cache():
  """The prompt's blocks prefilled, a block's denoising pass against them, the finished
  block appended, the next block's pass: `block_diffusion_generate`'s store_kv passes."""
  m, ref = model(), reference()
  prefix, block, final, nxt = (ref[k] for k in ("prefix_1xP", "block_1xW", "block_final_1xW",
                                                "next_1xW"))
  start, width = prefix.shape[1], block.shape[1]
  canvas = np.concatenate([prefix, np.full((1, 2 * width), m.mask_id, np.int32)], 1)
  decode = jax.jit(published.decode, static_argnums=0)
  _, cache = jax.jit(published.prefill, static_argnums=0)(m.config, m.params, canvas)
  got = {}
  got["block_logits_1xWxV"], _ = decode(m.config, m.params, cache, block, start)
  _, cache = decode(m.config, m.params, cache, final, start)
  got["next_logits_1xWxV"], _ = decode(m.config, m.params, cache, nxt, start + width)
  for name, logits in got.items():
    expected = ref[name]
    finite = np.isfinite(expected)
    np.testing.assert_allclose(np.asarray(logits)[finite], expected[finite], rtol=0,
                               atol=_tolerance(expected), err_msg=name)


@pytest.mark.parametrize("case", GENERATIONS["cases"], ids=lambda c: c["name"])
@pytest.mark.slow
def test_generations_token_for_token(case):
  """Greedy (the fixture writer patched a greedy draw into the published loop); the two
  prompts, of different lengths and so different partial last blocks, as one batch. Each row
  up to its first EOS, where the published loop stopped (after that block) and mdjax's row
  ends."""
  knobs = dict(case["kwargs"])
  new = knobs.pop("gen_length")
  ids, _, plan, _ = generation.generate_ids(
      model(), [np.asarray(p) for p in case["prompts"]], max_new_tokens=new,
      key=jax.random.key(0), temperature=0.0, **knobs)
  assert plan.blocks_of == knobs["block_length"]
  for row, (got, expected) in enumerate(zip(ids, case["until_stop"])):
    assert got.tolist() == expected, f"row {row}"


def test_entropy_bounded_maps_to_mdjax_entropy_bounded():
  """The published branch raises (the writer ran it and recorded the error); the knob maps
  to mdjax's entropy-bounded family with eb_threshold its bound."""
  assert GENERATIONS["entropy_bounded_as_published"].startswith(
      "UnboundLocalError: cannot access local variable 'transfer_index'")
  run = sdar.plan(model(), prompt_length=6, max_new_tokens=8,
                  remasking_strategy="entropy_bounded", eb_threshold=0.5, temperature=0.0)
  assert isinstance(run.spec, sampling.EntropyBoundedSpec)
  assert (run.spec.gamma, run.spec.steps, run.blocks_of) == (0.5, 4, 4)


def _first_steps(n: int, **knobs) -> np.ndarray:
  """n rows of the law block (4 masks after the law prefix), each with its own key, through
  the first step of the default sampler's spec: the block after that step, n x 4. The block
  is denoised as sample_blocks denoises it: its 4 positions against the prefix's cache."""
  m, ref = model(), reference()
  prefix = ref["law_prefix_1xP"]
  start = prefix.shape[1]
  run = sdar.plan(m, prompt_length=start, max_new_tokens=4, **knobs)
  # One step's law: without the end-of-row rule, which acts after a row's EOS.
  spec = dataclasses.replace(run.spec, record_trajectory=True, skip_idle_steps=False,
                             eos_id=None)
  canvas = np.concatenate([prefix, np.full((1, 4), m.mask_id, np.int32)], 1)
  _, cache = published.prefill(m.config, m.params, canvas)
  cache = jax.tree.map(lambda x: np.repeat(x, n, axis=1 if x.ndim == 5 else 0), cache)

  def block_logits(params_and_cache, tokens_Bx4, t_B):
    params, cache = params_and_cache
    return published.decode(m.config, params, cache, tokens_Bx4, start)[0]

  out = sampling.sample(block_logits, (m.params, cache), jax.random.key(7),
                        np.full((n, 4), m.mask_id, np.int32), spec, mask_id=m.mask_id)
  return np.asarray(out.trajectory_KxBxL)[0]


def _within_4_standard_errors(expected: np.ndarray, counts: np.ndarray, n: int):
  # Each outcome's frequency over n independent rows is a binomial proportion: its standard
  # error is sqrt(p (1 - p) / n); 4 of them bound a fixed-seed draw's deviation.
  se = np.sqrt(expected * (1 - expected) / n)
  np.testing.assert_array_less(np.abs(counts / n - expected), 4 * se + 1e-12)
  return se


N_LAW = 2000


def test_the_drawn_distribution_is_the_published_one():
  """Temperature, top-k and top-p as the sampler's spec applies them (to the draw and, with
  score_transformed, to the score) against sample_with_temperature_topk_topp's own
  distribution (its top_k_logits, top_p_logits and softmax)."""
  ref = reference()
  spec = sdar.plan(model(), prompt_length=8, max_new_tokens=4, **LAW_FILTERED).spec
  got = np.asarray(transforms.transformed_probs(ref["law_logits_1xWxV"], spec))
  expected = ref["law_probs_filtered_1xWxV"]
  np.testing.assert_array_equal(got > 0, expected > 0)  # the same values kept
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)  # float32 softmax rounding


@pytest.mark.slow
def test_static_step_law_at_temperature_matches_the_published_draw():
  """low_confidence_static at temperature 0.7 (blocks of 4, 4 steps: one commit a step; top-k
  and top-p change the distribution only, checked above). The published step draws X_i ~ p_i (its sample_with_temperature_topk_topp:
  `law_probs_static` is that function's own distribution) and commits the position whose
  p_i(X_i) is largest, so position i is committed with value v with probability
  p_i(v) * prod_{j != i} P(p_j(X_j) < p_i(v))."""
  ref = reference()
  p = ref["law_probs_static_1xWxV"][0].astype(np.float64)
  p /= p.sum(-1, keepdims=True)  # stored in float32
  plain = _softmax(ref["law_logits_1xWxV"][0].astype(np.float64))

  def law(score):  # score[i, v]: what position i's proposal v is ranked by
    below = lambda j, t: (p[j] * (score[j] < t)).sum()
    return np.array([[p[i, v] * np.prod([below(j, score[i, v]) for j in range(4) if j != i])
                      if p[i, v] > 0 else 0.0 for v in range(p.shape[1])] for i in range(4)])

  expected, untransformed = law(p), law(plain)
  assert abs(expected.sum() - 1) < 1e-9  # one commit a row, surely
  first = _first_steps(N_LAW, remasking_strategy="low_confidence_static", **LAW_STATIC)
  written = first != model().mask_id
  assert (written.sum(1) == 1).all()
  row, position = np.nonzero(written)
  counts = np.zeros_like(expected)
  np.add.at(counts, (position, first[row, position]), 1)
  common = expected > 0.01  # the outcomes that carry the law (and every position's total)
  se = _within_4_standard_errors(expected[common], counts[common], N_LAW)
  _within_4_standard_errors(expected.sum(1), counts.sum(1), N_LAW)
  # Ranking by the untransformed softmax (mdjax's default score) would be told apart.
  assert (np.abs(untransformed[common] - expected[common]) > 8 * se).any()


@pytest.mark.slow
def test_dynamic_step_law_counts_match_the_published_draw():
  """low_confidence_dynamic at temperature 1 (one commit a step scheduled): the published
  step commits every position whose drawn value has p_j(X_j) above the threshold, at least
  one. The number of such positions is a sum of independent Bernoullis of chance
  q_j = sum_v p_j(v) [p_j(v) > threshold] (Poisson-binomial), so m = max(S, 1) commits."""
  ref = reference()
  p = ref["law_probs_dynamic_1xWxV"][0].astype(np.float64)
  p /= p.sum(-1, keepdims=True)  # stored in float32
  threshold = float(ref["law_threshold"])
  q = (p * (p > threshold)).sum(-1)
  pmf = np.array([1.0])
  for qj in q:  # the Poisson-binomial pmf of S, one position at a time
    pmf = np.convolve(pmf, [1 - qj, qj])
  expected = np.array([pmf[0] + pmf[1], pmf[2], pmf[3], pmf[4]])  # m = 1, 2, 3, 4
  first = _first_steps(N_LAW, remasking_strategy="low_confidence_dynamic",
                       confidence_threshold=threshold, **LAW_DYNAMIC)
  written = first != model().mask_id
  counts = np.bincount(written.sum(1), minlength=5)[1:]
  assert counts.sum() == N_LAW and 0.1 < expected[1:].sum() < 0.9  # the threshold decides
  _within_4_standard_errors(expected, counts, N_LAW)
  many = written.sum(1) >= 2  # there, exactly the values above the threshold are written
  rows, cols = np.nonzero(written & many[:, None])
  assert (p[cols, first[rows, cols]] > threshold).all()


def _softmax(x):
  e = np.exp(x - x[np.isfinite(x)].max())
  return e / e.sum(-1, keepdims=True)


def test_the_sampler_maps_each_strategy():
  m = model()
  spec = lambda **kw: sdar.plan(m, prompt_length=5, max_new_tokens=8, **kw).spec
  dynamic = spec()  # generate.py's defaults: blocks of 4, 4 steps, threshold 0.85, T = 1
  assert (dynamic.steps, dynamic.threshold, dynamic.threshold_floor, dynamic.count_rule,
          dynamic.score, dynamic.score_transformed, dynamic.temperature, dynamic.top_k) == (
      4, 0.85, "count", "even_block", "prob", True, 1.0, None)
  static = spec(remasking_strategy="low_confidence_static", top_k=5, top_p=0.9)
  assert (static.threshold, static.order, static.top_k, static.top_p) == (None, "score", 5, 0.9)
  assert spec(remasking_strategy="sequential").order == "position"
  wide = sdar.plan(m, prompt_length=5, max_new_tokens=8, block_length=8)
  assert wide.denoiser.block_size == 8 and wide.blocks_of == 8  # the loop's mask, not config's
  assert wide.window == 24 and wide.window % 8 == 0  # the whole prompt and generation


def _same_params(a, b):
  flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, path
    assert x.tobytes() == y.tobytes(), path


@pytest.mark.parametrize("shard", [None, 300_000], ids=["one-file", "sharded"])
def test_load_save_load_bit_for_bit(tmp_path, shard):
  m = model()
  io.save(m, tmp_path / "out", max_shard_bytes=shard)
  again = mdjax.load(tmp_path / "out")
  assert again.config == m.config and again.family == "sdar"
  _same_params(m.params, again.params)
  raw = json.loads((tmp_path / "out" / "config.json").read_text())
  source = json.loads((FOLDER / "config.json").read_text())
  for key in ("model_type", "architectures", "block_size", "head_dim", "mask_token_id",
              "fuse_cross_entropy", "attn_implementation", "num_key_value_heads",
              "eos_token_id", "bos_token_id", "rope_theta", "tie_word_embeddings"):
    assert raw[key] == source[key], key
  assert (tmp_path / "out" / "chat_template.jinja").read_text() == m.chat_template
  assert (shard is None) != (tmp_path / "out" / "model.safetensors.index.json").exists()


def _folder(tmp_path, **config_changes):
  folder = pathlib.Path(shutil.copytree(FOLDER, tmp_path / "sdar"))
  raw = json.loads((folder / "config.json").read_text())
  raw.update(config_changes)
  (folder / "config.json").write_text(json.dumps(raw))
  return folder


def _no_weight_read(monkeypatch):
  def refuse(info):
    raise AssertionError(f"tensor {info.name} was read")
  monkeypatch.setattr(tensors, "read_tensor", refuse)


@pytest.mark.parametrize("changes, match", [
    ({"block_size": 0}, r"block_size=0 must be >= 1"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"use_sliding_window": True}, r"use_sliding_window=True is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"RoPE scaling .* not supported"),
    ({"mask_token_id": 320}, r"mask_id=320 must be an id in \[0, vocab_size=320\)"),
    ({"head_dim": 16}, (r"self_attn\.q_proj\.weight' has shape \[128, 64\], expected "
                        r"\[64, 64\]")),
], ids=["block_size", "attention_bias", "sliding_window", "hidden_act", "rope_scaling",
        "mask_id", "head_dim"])
def test_a_bad_config_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, changes,
                                                           match):
  folder = _folder(tmp_path, **changes)
  _no_weight_read(monkeypatch)
  with pytest.raises(ValueError, match=match):
    mdjax.load(folder)


def _rewritten(tmp_path, edit) -> pathlib.Path:
  """The fixture with its weights rewritten in one file after `edit(tensors)`."""
  folder = _folder(tmp_path)
  infos = tensors.read_checkpoint(str(FOLDER))
  weights = {name: tensors.read_tensor(info) for name, info in infos.items()}
  edit(weights)
  for old in list(folder.glob("model*.safetensors*")):
    old.unlink()
  tensors.write_checkpoint(str(folder), weights)
  return folder


def test_a_tied_head_is_read_from_the_embedding(tmp_path):
  """tie_word_embeddings (SDARForCausalLM's _tied_weights_keys): no lm_head.weight stored."""
  folder = _rewritten(tmp_path, lambda w: w.pop("lm_head.weight"))
  raw = json.loads((folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
  tied = mdjax.load(folder)
  np.testing.assert_array_equal(np.asarray(tied.params["head"]),
                                np.asarray(model().params["embed"]).T)


def test_a_missing_tensor_is_named(tmp_path, monkeypatch):
  folder = _rewritten(tmp_path, lambda w: w.pop("model.layers.1.self_attn.k_norm.weight"))
  _no_weight_read(monkeypatch)
  with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\."
                                       r"k_norm\.weight"):
    mdjax.load(folder)


def test_a_folder_mixing_two_families_is_refused(tmp_path, monkeypatch):
  """Dream's (Qwen2) q/k/v biases beside SDAR's tensors, and LLaDA's embedding name."""
  def mix(w):
    w["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
    w["model.transformer.wte.weight"] = w["model.embed_tokens.weight"]
  folder = _rewritten(tmp_path, mix)
  _no_weight_read(monkeypatch)
  with pytest.raises(ValueError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\."
                                       r"q_proj\.bias, model\.transformer\.wte\.weight"):
    mdjax.load(folder)
  os.remove(folder / "model.safetensors")  # and an SDAR config over a LLaDA folder
  shutil.copy(pathlib.Path(REPO) / "tests/fixtures/pretrained/llada/model.safetensors", folder)
  with pytest.raises(ValueError, match=r"num_hidden_layers=3 but the checkpoint holds tensors "
                                       r"for 0 layers"):
    mdjax.load(folder)


@pytest.mark.parametrize("knobs, match", [
    ({"block_length": 0}, r"block_length=0"),
    ({"denoising_steps": 0}, r"denoising_steps=0"),
    ({"remasking_strategy": "random"}, r"remasking_strategy='random' is not supported"),
    ({"confidence_threshold": 1.5}, r"confidence_threshold=1\.5 must lie in \[0, 1\]"),
    ({"top_p": 0.0}, r"top_p=0\.0 must lie in \(0, 1\]"),
    ({"top_k": -1}, r"top_k=-1"),
    ({"eb_threshold": -0.1}, r"eb_threshold=-0\.1"),
], ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_bad_sampler_knobs(knobs, match):
  with pytest.raises(ValueError, match=match):
    mdjax.generate(model(), ["Hi"], max_new_tokens=4, key=jax.random.key(0), **knobs)


def test_blocks_that_do_not_divide_the_models_are_refused():
  """The cache of finished blocks is exact only in whole model blocks."""
  with pytest.raises(ValueError, match=r"blocks_of=6 is invalid: must be a multiple of the "
                                       r"model's block size 4"):
    mdjax.generate(model(), ["Hi"], max_new_tokens=12, key=jax.random.key(0), blocks_of=6)


def parity_figures() -> dict:
  """What the logits and generation tests above assert, as figures (mdjax/bench/families.py):
  the largest |mdjax - reference| of the full and the cached passes' finite logits, absolute
  and relative to the largest reference logit (the tests' tolerance is 1e-5 of it), and per
  generations.json case whether every row's tokens equal the reference's."""
  m, ref = model(), reference()

  def gap(got, expected):
    finite = np.isfinite(expected)
    diff = float(np.abs(np.asarray(got)[finite] - expected[finite]).max())
    return diff, diff / max(1.0, float(np.abs(expected[finite]).max()))

  full, full_rel = gap(jax.jit(published.forward, static_argnums=0)(
      m.config, m.params, ref["tokens_BxL"], ref["valid_BxL"]), ref["logits_BxLxV"])
  prefix, block, final, nxt = (ref[k] for k in ("prefix_1xP", "block_1xW", "block_final_1xW",
                                                "next_1xW"))
  start, width = prefix.shape[1], block.shape[1]
  canvas = np.concatenate([prefix, np.full((1, 2 * width), m.mask_id, np.int32)], 1)
  decode = jax.jit(published.decode, static_argnums=0)
  _, cache = jax.jit(published.prefill, static_argnums=0)(m.config, m.params, canvas)
  block_logits, _ = decode(m.config, m.params, cache, block, start)
  _, cache = decode(m.config, m.params, cache, final, start)
  next_logits, _ = decode(m.config, m.params, cache, nxt, start + width)
  cached = [gap(block_logits, ref["block_logits_1xWxV"]), gap(next_logits,
                                                              ref["next_logits_1xWxV"])]
  equal = {}
  for case in GENERATIONS["cases"]:
    knobs = dict(case["kwargs"])
    new = knobs.pop("gen_length")
    ids, _, _, _ = generation.generate_ids(
        m, [np.asarray(p) for p in case["prompts"]], max_new_tokens=new,
        key=jax.random.key(0), temperature=0.0, **knobs)
    equal[case["name"]] = all(got.tolist() == expected
                              for got, expected in zip(ids, case["until_stop"]))
  return {"full_logits_max_abs": full, "full_logits_rel": full_rel,
          "cached_logits_max_abs": max(c[0] for c in cached),
          "cached_logits_rel": max(c[1] for c in cached), "tolerance_rel": 1e-5,
          "tokens_equal": equal}
