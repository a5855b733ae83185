"""Causal judges (LlamaForCausalLM, Qwen2ForCausalLM) and generative perplexity.

The fixtures (tests/fixtures/judge/) come from experiments/judge_reference.py: tiny random
checkpoints written by transformers' save_pretrained (Qwen2's head tied to its embedding),
transformers' logits, and per-sample NLLs under the scoring rule of
`mdjax.evaluate.gen_ppl`. Nothing here needs torch.

Tolerances. The logits are float32 from two implementations whose reductions run in
different orders: each of the ~10 sums on the path to a logit (width 64 to 128) rounds to
float32 (relative 6e-8 per addition, at most ~1e-5 relative over 128 terms), and the logits
reach |12|, so 1e-4 bounds their difference with room (the fixtures differ by 2e-5). A
per-token NLL is a logsumexp minus the target's logit, each off by at most the logits' bound,
so a mean of them lies within 2e-4.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import pretrained, tasks
from mdjax.evaluate import gen_ppl
from mdjax.models import published
from mdjax.pretrained import tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "fixtures", "judge")
FAMILIES = ("llama", "qwen2")
LOGITS_ATOL, NLL_ATOL = 1e-4, 2e-4
with open(os.path.join(FIXTURES, "texts.json")) as f:
  META = json.load(f)


@functools.cache
def model(family):
  return pretrained.load(os.path.join(FIXTURES, family))


@functools.cache
def reference():
  with np.load(os.path.join(FIXTURES, "reference.npz")) as z:
    return dict(z)


@functools.cache
def scored(family):
  return gen_ppl.generative_perplexity(META["texts"], model(family), batch_size=4,
                                       max_length=META["max_length"], stride=META["stride"])


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_logits_match_transformers(family):
  m = model(family)
  assert m.family == family and m.config.causal and m.config.mask_id is None
  # the Llama fixture has Llama 3.1's RoPE scaling (unscaled, its logits are off by ~10)
  assert m.config.rope_scaling == ((4.0, 1.0, 4.0, 32) if family == "llama" else None)
  with pytest.raises(ValueError, match=f"this '{family}' checkpoint is a causal LM"):
    pretrained.generate(m, np.array([[5, 6]]), steps=2, gen_length=2, block_length=2)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_nll_matches_transformers(family):
  out = scored(family)
  ref = reference()[f"{family}_nll_per_token"]
  assert out.num_tokens_N.tolist() == META[f"{family}_tokens_per_text"]
  np.testing.assert_allclose(out.nll_per_token_N, ref, rtol=0, atol=NLL_ATOL)
  counts = np.array(META[f"{family}_tokens_per_text"])
  assert out.gen_ppl == pytest.approx(np.exp((ref * counts).sum() / counts.sum()), rel=NLL_ATOL)
  # the third text is longer than the windows (77 and 49 tokens against 16)
  assert counts[2] > 2 * META["max_length"]


def test_windows_score_each_token_once():
  for n, length, stride in ((1, 4, 2), (4, 4, 2), (5, 4, 2), (11, 4, 3), (9, 4, 4)):
    windows = gen_ppl._windows(n, length, stride)
    targets = [t for _, first, last in windows for t in range(first, last + 1)]
    assert targets == list(range(1, n + 1))
    for start, first, last in windows:
      assert last - start <= length  # inputs [start, last) predict targets up to last
      assert start == 0 or first - start >= length - stride + 1


def test_retokenization_across_tokenizers():
  """Texts from a sampler with another vocabulary (mdjax characters) are judged by the Qwen2
  fixture's byte-level BPE: its ids, its count, its BOS."""
  sampler = tasks.text.CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.'\n")
  texts = ["to be or not to be, that is the question.", "the winter of our discontent"]
  ids = [sampler.encode(t) for t in texts]
  m = model("qwen2")
  out = gen_ppl.generative_perplexity([sampler.decode(i) for i in ids], m,
                                      sampler_tokens=ids, batch_size=2)
  bos = m.hf_config["bos_token_id"]
  for text, sampler_ids, nll, count, entropy, sampler_entropy in zip(
      texts, ids, out.nll_per_token_N, out.num_tokens_N, out.entropy_N, out.sampler_entropy_N):
    judge_ids = m.tokenizer.encode(text, add_special_tokens=False).ids
    assert count == len(judge_ids) < len(sampler_ids)  # merges: fewer judge tokens
    seq = np.array([bos] + judge_ids)  # shorter than the judge's 64 positions: one pass
    inputs = np.zeros((1, 64), np.int32)  # padded on the right: a causal model ignores it
    inputs[0, :len(seq) - 1] = seq[:-1]
    logp = jax.nn.log_softmax(published.forward(m.config, m.params, inputs)[0])
    direct = -np.asarray(logp)[np.arange(len(judge_ids)), seq[1:]].mean()
    assert nll == pytest.approx(direct, abs=1e-5)
    assert entropy == pytest.approx(gen_ppl.unigram_entropy(judge_ids))
    assert sampler_entropy == pytest.approx(gen_ppl.unigram_entropy(sampler_ids))
    assert entropy != pytest.approx(sampler_entropy)


def test_entropy_of_a_known_histogram():
  # p = (1/4, 1/4, 1/2): -2 (1/4) log(1/4) - (1/2) log(1/2) = 1.5 log 2 nats
  assert gen_ppl.unigram_entropy([7, 3, 9, 9, 3, 9, 7, 9]) == pytest.approx(1.5 * np.log(2))
  assert gen_ppl.unigram_entropy([5] * 10) == 0.0
  assert gen_ppl.unigram_entropy(np.arange(16)) == pytest.approx(np.log(16))
  # "abab" in the Llama fixture's characters: two ids equally often
  out = gen_ppl.generative_perplexity(["abab", "aaaa"], model("llama"), batch_size=2)
  np.testing.assert_allclose(out.entropy_N, [np.log(2), 0.0], atol=1e-12)
  assert out.mean_entropy == pytest.approx(np.log(2) / 2)
  assert out.sampler_entropy_N is None and out.mean_sampler_entropy is None


def test_mdjax_causal_model_as_judge(tmp_path):
  """A mdjax model trained with objective "causal": its task's characters, the mask id as
  the start token, scored as `likelihood.causal_bits` scores it."""
  from flax import nnx

  from mdjax import likelihood, models
  from mdjax.train import checkpoints, state
  from tests.text_fixtures import tiny_config, write_corpus
  config = tiny_config(write_corpus(tmp_path / "corpus.txt"), causal=True)
  task = tasks.from_config(config)
  _, params, apply_fn = models.init(state.model_config(config, task), seed=0)
  judge = checkpoints.Model(config=config, apply_fn=apply_fn, params=nnx.to_pure_dict(params),
                            task=task, step=0, workdir=str(tmp_path / "causal"))
  windows = task.validation_windows(3)
  out = gen_ppl.generative_perplexity([task.decode(w) for w in windows], judge)
  bits = likelihood.causal_bits(judge.apply_fn, judge.params, windows, start_id=task.mask_id)
  np.testing.assert_allclose(out.nll_per_token_N, bits * np.log(2) / task.length, rtol=1e-5)
  assert (out.num_tokens_N == task.length).all()
  with pytest.raises(ValueError, match=r"texts\[1\]: .*outside the tokenizer's vocabulary"):
    gen_ppl.generative_perplexity(["thou art", "thou ~ art"], judge)
  config.objective = "nelbo"
  with pytest.raises(ValueError, match="objective='nelbo', not 'causal'"):
    gen_ppl.load_judge(checkpoints.Model(config=config, apply_fn=apply_fn, params=None,
                                         task=task, step=0, workdir="w"))


def test_bad_input(tmp_path):
  m = model("llama")
  run = functools.partial(gen_ppl.generative_perplexity, judge=m)
  for kwargs, match in (
      (dict(texts="abc"), "texts='abc' must be a non-empty sequence"),
      (dict(texts=[]), "texts=.* must be a non-empty sequence"),
      (dict(texts=["ab", 3]), r"texts\[1\] is a int"),
      (dict(texts=["ab", "caf\u00e9"]), r"texts\[1\]: .*unknown token"),
      (dict(texts=["ab", ""]), r"texts\[1\] is empty"),
      (dict(texts=["ab"], batch_size=0), "batch_size=0 must be"),
      (dict(texts=["ab"], max_length=65), r"max_length=65 must be an integer in \[1, 64\]"),
      (dict(texts=["ab"], max_length=8, stride=9), r"stride=9 must be an integer in \[1, 8\]"),
      (dict(texts=["ab"], sampler_tokens=[[1], [2]]), "sampler_tokens has 2 rows for 1"),
      (dict(texts=["ab"], sampler_tokens=[[]]), r"sampler_tokens\[0\] is empty")):
    with pytest.raises(ValueError, match=match):
      run(**kwargs)
  with pytest.raises(ValueError, match="'llada' checkpoint, not a causal LM"):
    gen_ppl.generative_perplexity(["ab"], os.path.join(ROOT, "fixtures", "pretrained", "llada"))
  with pytest.raises(ValueError, match="neither a Hugging Face folder"):
    gen_ppl.load_judge(str(tmp_path))
  with pytest.raises(ValueError, match="judge is a int"):
    gen_ppl.load_judge(3)
  with pytest.raises(ValueError, match="causal=False must be True for family='llama'"):
    published.PublishedConfig(**{**vars(m.config), "causal": False})
  with pytest.raises(ValueError, match="mask_id=5, logit_shift=False: a causal model has no"):
    published.PublishedConfig(**{**vars(m.config), "mask_id": 5})
  with pytest.raises(ValueError, match=r"rope_scaling=\(4.0, 4.0, 1.0, 32\) must be None or"):
    published.PublishedConfig(**{**vars(m.config), "rope_scaling": (4.0, 4.0, 1.0, 32)})
  bad = tmp_path / "bad.jsonl"
  for content, match in (('{"text": "ab"}\nnot json\n', "line 2: not JSON"),
                         ('{"prompt": "ab"}\n', "line 1: no string field"), ("", "no sample")):
    bad.write_text(content)
    with pytest.raises(ValueError, match=f"samples=.*{match}"):
      gen_ppl.read_samples(str(bad))
  with pytest.raises(ValueError, match="samples=.*must be a .jsonl file"):
    gen_ppl.read_samples(str(tmp_path / "x.txt"))
  with pytest.raises(ValueError, match="a folder without samples.jsonl"):
    gen_ppl.read_samples(str(tmp_path))


def test_layout_refuses_what_it_cannot_express(tmp_path):
  folder = tmp_path / "llama"
  pretrained.save(model("llama"), str(folder))
  raw = json.loads((folder / "config.json").read_text())
  for key, value, match in (("attention_bias", True, "attention_bias=True is not supported"),
                            ("rope_parameters", {"rope_type": "yarn", "factor": 4.0},
                             "RoPE scaling .*'yarn'.* is not supported"),
                            ("rope_parameters", {"rope_type": "llama3"}, "missing 'factor'"),
                            ("hidden_act", "gelu", "hidden_act='gelu'")):
    (folder / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ValueError, match=match):
      pretrained.load(str(folder))
  scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
  assert raw["rope_scaling"] == scaling  # transformers 4's keys and 5's, the same
  assert raw["rope_parameters"] == {**scaling, "rope_theta": 10000.0}
  (folder / "config.json").write_text(json.dumps(raw))
  again = pretrained.load(str(folder))  # save -> load is the same model
  assert again.config == model("llama").config
  for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model("llama").params)):
    np.testing.assert_array_equal(a, b)


def test_cli(tmp_path, capsys):
  texts = ["To be, or not to be", "Hello, world!"]
  samples = tmp_path / "samples.jsonl"
  samples.write_text("".join(json.dumps({"tokens": [1, 2, 2], "text": t}) + "\n"
                             for t in texts))
  per_sample = tmp_path / "rows.jsonl"
  summary = gen_ppl.main([f"--judge={os.path.join(FIXTURES, 'qwen2')}",
                          f"--samples={tmp_path}", "--batch_size=2", f"--out={per_sample}"])
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  direct = gen_ppl.generative_perplexity(texts, model("qwen2"), batch_size=2)
  assert printed["gen_ppl"] == pytest.approx(direct.gen_ppl, rel=1e-6) == summary["gen_ppl"]
  assert printed["num_samples"] == 2
  assert printed["sampler_entropy"] == pytest.approx(gen_ppl.unigram_entropy([1, 2, 2]))
  rows = [json.loads(line) for line in per_sample.read_text().splitlines()]
  np.testing.assert_allclose([r["nll_per_token"] for r in rows], direct.nll_per_token_N,
                             rtol=1e-6)
