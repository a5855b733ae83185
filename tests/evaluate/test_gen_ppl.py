"""Generative perplexity (`mdjax.evaluate.gen_ppl`) under the causal judges of
tests/formats/test_judge.py (LlamaForCausalLM, Qwen2ForCausalLM).

The fixtures (tests/fixtures/judge/) come from tests/reference/judge.py: tiny random
checkpoints written by transformers' save_pretrained, transformers' logits, and per-sample
NLLs under the scoring rule of `mdjax.evaluate.gen_ppl`. Nothing here needs torch.

Tolerances. The logits of mdjax and transformers differ by at most 1e-4
(tests/formats/test_judge.py). A per-token NLL is a logsumexp minus the target's logit,
each off by at most the logits' bound, so a mean of them lies within 2e-4.
"""

import functools
import json
import os

import jax
import numpy as np
import pytest

from mdjax import tasks, tokenizers
from mdjax.evaluate import gen_ppl
from mdjax.models import published
from tests.paths import REPO
from tests.formats.test_judge import FAMILIES, FIXTURES, model, reference

NLL_ATOL = 2e-4
LLADA = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")
with open(os.path.join(FIXTURES, "texts.json")) as f:
  META = json.load(f)


@functools.cache
def scored(family):
  return gen_ppl.generative_perplexity(META["texts"], model(family), batch_size=4,
                                       max_length=META["max_length"], stride=META["stride"])


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


@pytest.mark.slow
def test_retokenization_across_tokenizers():
  """Texts from a sampler with another vocabulary (mdjax characters) are judged by the Qwen2
  fixture's byte-level BPE: its ids, its count, its BOS."""
  sampler = tokenizers.CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.'\n")
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


@pytest.mark.slow
def test_mdjax_causal_model_as_judge(tmp_path):
  """A mdjax model trained with objective "causal": its task's characters, the mask id as
  the start token, scored as `elbo.causal_bits` scores it."""
  from flax import nnx

  from mdjax import model as model_lib
  from mdjax import models
  from mdjax.evaluate import elbo
  from mdjax.train import state
  from experiments.tiny_text import tiny_config, write_corpus
  config = tiny_config(write_corpus(tmp_path / "corpus.txt"), causal=True)
  task = tasks.from_config(config)
  _, params, apply_fn = models.init(state.model_config(config, task), seed=0)
  judge = model_lib.task_model(task, apply_fn, nnx.to_pure_dict(params), config=config, step=0,
                               source=str(tmp_path / "causal"))
  windows = task.validation_windows(3)
  out = gen_ppl.generative_perplexity([task.decode(w) for w in windows], judge)
  bits = elbo.causal_bits(judge.denoiser, judge.params, windows, start_id=task.mask_id)
  np.testing.assert_allclose(out.nll_per_token_N, bits * np.log(2) / task.length, rtol=1e-5)
  assert (out.num_tokens_N == task.length).all()
  with pytest.raises(ValueError, match=r"texts\[1\]: .*outside the tokenizer's vocabulary"):
    gen_ppl.generative_perplexity(["thou art", "thou ~ art"], judge)
  config.objective = "nelbo"
  with pytest.raises(ValueError, match="objective='nelbo', not 'causal'"):
    gen_ppl.load_judge(model_lib.task_model(task, apply_fn, None, config=config, step=0,
                                            source="w"))


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
    gen_ppl.generative_perplexity(["ab"], LLADA)
  with pytest.raises(ValueError, match="neither a train.py workdir .* nor a torch checkpoint"):
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
