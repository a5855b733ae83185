"""Generation: end of sequence in every family, left-padded prompts, prompts files, a mesh."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import generation, models, sampling
from tests.devices import run_on_cpu_devices

pytestmark = pytest.mark.xdist_group("generation")

V, L, EOS = 6, 10, 5


def ends_at_4(params, tokens_BxL, t_B):
  """Predicts id (position % 5) before position 4 and EOS from it on, with certainty."""
  del params, t_B
  position_L = jnp.arange(tokens_BxL.shape[1])
  target_L = jnp.where(position_L < 4, position_L % 5, EOS)
  return jnp.broadcast_to(30.0 * jax.nn.one_hot(target_L, V), tokens_BxL.shape + (V,))


@pytest.mark.parametrize("name", sorted(sampling.families()))
@pytest.mark.slow
def test_every_family_ends_rows_at_eos(name):
  family = sampling.families()[name]
  generated = tuple(range(1, L))
  canvas = np.full((2, L), V, np.int32)
  canvas[:, 0] = 0  # a one-token prompt
  for spec in family.examples(generated)[:1]:
    spec = generation.with_eos(spec, EOS)
    out = sampling.sample(ends_at_4, None, jax.random.key(0), canvas, spec, mask_id=V)
    tokens = np.asarray(out.tokens_BxL)
    np.testing.assert_array_equal(tokens[:, :4], np.tile([0, 1, 2, 3], (2, 1)))
    assert (tokens[:, 4:] == EOS).all()  # EOS at 4, every position after it filled
    np.testing.assert_array_equal(out.generated_length_B, [3, 3])  # positions 1..3
    assert int(np.asarray(out.unfilled_B).sum()) == 0


@pytest.mark.slow
def test_eos_knobs_and_early_stop():
  canvas = np.full((3, L), V, np.int32)
  spec = sampling.ConfidenceSpec(steps=L, temperature=0.0, eos_id=EOS)
  out = sampling.sample(ends_at_4, None, jax.random.key(0), canvas, spec, mask_id=V)
  # One position a step, most confident first (ties: lower position): EOS at 4 is written at
  # step 4 after positions 0..3; the row is then finished and every later step is skipped.
  assert int(out.nfe) == 5 and int(out.saved_calls) == L - 5
  never = sampling.sample(ends_at_4, None, jax.random.key(0), canvas,
                          sampling.ConfidenceSpec(steps=L, temperature=0.0, eos_id=EOS,
                                                  eos_never=True), mask_id=V)
  assert not (np.asarray(never.tokens_BxL) == EOS).any()
  np.testing.assert_array_equal(never.generated_length_B, [L] * 3)
  # Ranked last, EOS proposals wait: 4 non-EOS positions are written before the first EOS.
  last = sampling.sample(ends_at_4, None, jax.random.key(0), canvas,
                         sampling.ConfidenceSpec(steps=L, eos_id=EOS, eos_rank_last=True),
                         mask_id=V)
  np.testing.assert_array_equal(np.asarray(last.write_step_BxL)[:, :4], np.tile(range(4), (3, 1)))
  # A penalty of 60 nats beats the 30-nat margin: EOS is no longer the argmax.
  pen = sampling.sample(ends_at_4, None, jax.random.key(0), canvas,
                        sampling.ConfidenceSpec(steps=L, temperature=0.0, eos_id=EOS,
                                                eos_penalty=60.0), mask_id=V)
  assert not (np.asarray(pen.tokens_BxL) == EOS).any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(eos_id=V), "outside the vocabulary"),
    (dict(eos_id=-1), "eos_id=-1"),
    (dict(eos_never=True), "needs eos_id"),
    (dict(eos_id=EOS, eos_penalty=-1.0), "eos_penalty=-1.0"),
])
def test_eos_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling.sample(ends_at_4, None, jax.random.key(0), np.full((1, L), V, np.int32),
                    sampling.ConfidenceSpec(steps=4, **kwargs), mask_id=V)


@pytest.fixture(scope="module")
def tiny():
  cfg = models.TransformerConfig(vocab_size=V, max_len=12, d_model=16, num_layers=2,
                                 num_heads=2, d_ff=32)
  _, params, apply_fn = models.init(cfg, seed=3)
  return apply_fn, params


@pytest.mark.slow
def test_padding_is_refused_when_editable(tiny):
  apply_fn, params = tiny
  tokens = np.full((1, 6), V, np.int32)
  valid = np.array([[False, True, True, True, True, True]])
  with pytest.raises(ValueError, match="padding must be fixed"):
    sampling.sample(apply_fn, params, jax.random.key(0), tokens,
                    sampling.ConfidenceSpec(steps=2), mask_id=V, valid_BxL=valid)
  with pytest.raises(ValueError, match="does not take it"):
    sampling.sample(ends_at_4, None, jax.random.key(0), np.where(valid, V, 0),
                    sampling.ConfidenceSpec(steps=2), mask_id=V, valid_BxL=valid)


def test_prompts_file_errors(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(ValueError, match="holds no prompt"):
    generation.read_prompts(str(empty))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
  with pytest.raises(ValueError, match="line 2 has no \"prompt\""):
    generation.read_prompts(str(bad))


@pytest.mark.slow
def test_mesh_split_equals_one_device():
  code = textwrap.dedent("""
    import jax, numpy as np
    from mdjax import mesh as mesh_lib, models, sampling
    from mdjax.train import make_mesh
    cfg = models.TransformerConfig(vocab_size=6, max_len=8, d_model=16, num_layers=1,
                                   num_heads=2, d_ff=32)
    _, params, apply_fn = models.init(cfg, seed=1)
    canvas = np.full((8, 8), 6, np.int32); canvas[:, 0] = 1
    spec = sampling.ConfidenceSpec(steps=4, eos_id=5)
    one = sampling.sample(apply_fn, params, jax.random.key(0), canvas, spec, mask_id=6)
    mesh = make_mesh(4)
    four = mesh_lib.sample_on_mesh(apply_fn, params, jax.random.key(0), canvas, spec, mesh,
                                   mask_id=6)
    assert four.tokens_BxL.sharding.num_devices == 4
    np.testing.assert_array_equal(np.asarray(one.tokens_BxL), np.asarray(four.tokens_BxL))
    try:
      mesh_lib.sample_on_mesh(apply_fn, params, jax.random.key(0), canvas[:6], spec, mesh,
                              mask_id=6)
    except ValueError as e:
      assert "does not divide the batch B=6" in str(e), e
    else:
      raise AssertionError("no error")
    print("MESH OK")
  """)
  # The run's XLA flags (tests/conftest.py: LLVM -O0, the elemental emitters) kept, the
  # device count added: with XLA_FLAGS replaced, the process compiled at -O3.
  run_on_cpu_devices(code, 4, "MESH OK")


@pytest.mark.slow
def test_bpe_documents_checkpoint_and_prompts_cli(tmp_path):
  """A tiny BPE model of padded documents: the tokenizer survives the checkpoint, a mismatched
  config is refused, and sample.py --prompts writes one completion per prompt."""
  import json

  import mdjax
  from mdjax import tasks, train
  from experiments.tiny_text import tiny_config, write_corpus

  corpus = write_corpus(tmp_path / "corpus.txt")
  config = tiny_config(corpus)
  config.task_kwargs.update(tokenizer="bpe", bpe_vocab_size=300, documents="padded")
  config.train.num_steps = 15
  config.num_eval_samples = 0
  workdir = str(tmp_path / "run")
  train.train(config, workdir, log=lambda *_: None)
  model = mdjax.load(workdir)
  task = tasks.from_config(config)
  assert model.tokenizer == task.tokenizer and model.task.eos_id == task.tokenizer.eos_id
  window = np.asarray(task.sample_data(jax.random.key(0), 4))
  # Padded documents: after the first EOS of a window every position is EOS.
  for row in window:
    hits = np.flatnonzero(row == task.eos_id)
    assert hits.size == 0 or (row[hits[0]:] == task.eos_id).all()
  with pytest.raises(ValueError, match="bpe_vocab_size=299"):
    tasks.get("text", dict(tasks.kwargs_of(config), bpe_vocab_size=299,
                           **task.checkpoint_metadata()))
  with pytest.raises(ValueError, match="holds a BPE tokenizer"):
    tasks.get("text", dict(tasks.kwargs_of(config), tokenizer="char",
                           **task.checkpoint_metadata()))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "Thou art"}\n{"prompt": "The"}\n{"prompt": "And the king of"}\n')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "sample.py"), f"--workdir={workdir}",
       f"--prompts={prompts}", f"--out={tmp_path / 'out'}", "--sampler=confidence",
       "--steps=4", "--batch_size=2", "--max_new_tokens=8"], capture_output=True, text=True,
      timeout=300, env=dict(os.environ, PYTHONPATH=root))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "output tokens/s" in proc.stdout
  rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
  assert [r["prompt"] for r in rows] == ["Thou art", "The", "And the king of"]
  for r in rows:
    assert r["generated_length"] == len(r["token_ids"]) <= 8
    assert task.eos_id not in r["token_ids"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "' + "word " * 40 + '"}\n')
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "sample.py"), f"--workdir={workdir}",
       f"--prompts={bad}", "--sampler=confidence", "--steps=4", "--max_new_tokens=8"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
  # The prompt is what is too long: the error names its line, not --max_new_tokens.
  assert proc.returncode == 2 and "bad.jsonl' line 1 has 200 tokens" in proc.stderr, proc.stderr
  assert "the model holds 16 positions, so a prompt may have at most 8 tokens" in proc.stderr
  assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "sample.py"), f"--workdir={workdir}",
       f"--prompts={prompts}", "--sampler=confidence", "--steps=4", "--max_new_tokens=-3"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
  assert proc.returncode == 2 and "--max_new_tokens=-3 is invalid" in proc.stderr, proc.stderr


GEN_V, GEN_LEN = 9, 12  # vocabulary and the model's length for `generate`


def _generation_model(block_size=None):
  cfg = models.TransformerConfig(vocab_size=GEN_V, max_len=GEN_LEN, d_model=32, num_layers=1,
                                 num_heads=2, d_ff=64, block_size=block_size,
                                 time_conditioning=block_size is None)
  _, params, apply_fn = models.init(cfg, seed=0)
  return mdjax.Model(denoiser=apply_fn, params=params, family="mdjax", vocab_size=GEN_V,
                     max_len=GEN_LEN, mask_id_or_none=GEN_V)


@pytest.mark.slow
def test_generate_gives_every_row_max_new_tokens_whatever_the_batch():
  """Prompts of 7, 1 and 0 tokens, 4 new tokens each: the same completions in one batch or
  one prompt at a time (row i draws with fold_in(key, i)). Programs of different batch sizes
  round differently (logits move by ~2e-7 here), which can flip a near-tie of this untrained
  model's almost flat distributions: the check uses ancestral draws, which it does not flip."""
  model = _generation_model()
  prompts = [[1, 2, 3, 4, 5, 6, 7], [8], []]
  spec = sampling.AncestralSpec(steps=4)
  run = lambda batch_size: mdjax.generate(model, prompts, spec=spec, max_new_tokens=4,
                                          key=jax.random.key(0), batch_size=batch_size)
  together, one_by_one = run(None), run(1)
  assert together.plan.layout == "canvas" and together.plan.canvas_length == 7 + 4
  assert together.texts is None
  np.testing.assert_array_equal(together.generated_length_B, [4, 4, 4])
  for a, b in zip(together.token_ids, one_by_one.token_ids):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="max_new_tokens=6 is too many.*line 1.*at most 5 new"):
    mdjax.generate(model, prompts, spec=spec, max_new_tokens=6, key=jax.random.key(0))


@pytest.mark.slow
def test_generate_past_the_model_length_on_a_block_causal_model():
  """12 positions, blocks of 4: a 5-token prompt and 10 new tokens go block by block (the
  prompt's partial block first), 10 tokens a row."""
  model = _generation_model(block_size=4)
  out = mdjax.generate(model, [[1, 2, 3, 4, 5], [6]], spec=sampling.ConfidenceSpec(steps=2),
                       max_new_tokens=10, key=jax.random.key(1))
  assert out.plan.layout == "blocks" and (out.plan.blocks_of, out.plan.window) == (4, 8)
  assert out.plan.length == 12  # 10 rounded up to whole blocks, the rest cut off
  np.testing.assert_array_equal(out.generated_length_B, [10, 10])
  assert all((ids < GEN_V).all() for ids in out.token_ids)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens=0 is invalid"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5 is invalid"),
    (dict(max_new_tokens=4, block_length=3), "spec.block_length=3 must divide max_new_tokens=4"),
    (dict(max_new_tokens=4, window=4), "window=4 applies only with blocks_of"),
    (dict(max_new_tokens=4, blocks_of=12), "blocks_of=12 is invalid"),
])
def test_plan_generation_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    generation.plan_generation([3, 1], max_len=GEN_LEN, **kwargs)
  with pytest.raises(ValueError, match=r"start=2 is invalid.*\[3 \(the longest prompt\), 6\]"):
    generation.left_padded([np.zeros(3, np.int32)], 6, GEN_V, start=2)
  plan = generation.plan_generation([3, 1], 8, max_len=GEN_LEN, blocks_of=4)
  assert (plan.layout, plan.window, plan.length) == ("blocks", 8, 8)


def test_generate_reads_prompts_as_the_server_does_and_names_a_bad_key(monkeypatch):
  """`generate(m, [10, 1, 2])` drew three one-token completions, where the server reads
  `"prompt": [10, 1, 2]` as one prompt; `key=0` was a raw JAX TypeError. Now the flat list
  is refused showing both spellings, an int key is jax.random.key's seed, and a bad key is an
  ArgumentError naming `key`: all before anything compiles."""
  from mdjax.errors import ArgumentError

  model = _generation_model()
  spec = sampling.AncestralSpec(steps=2)
  sampled = []
  real = generation.sampling.sample
  monkeypatch.setattr(generation.sampling, "sample",
                      lambda *a, **kw: sampled.append(1) or real(*a, **kw))
  for prompts in ([10, 1, 2], (10, 1, 2), [np.int32(10)]):
    with pytest.raises(ArgumentError) as error:
      mdjax.generate(model, prompts, spec=spec, max_new_tokens=2, key=jax.random.key(0))
    assert error.value.param == "prompts"
  message = str(error.value)
  with pytest.raises(ArgumentError) as error:
    mdjax.generate(model, [10, 1, 2], spec=spec, max_new_tokens=2, key=jax.random.key(0))
  assert "[[10, 1, 2]] for one prompt" in str(error.value), error.value
  assert "[[10], [1], [2]] for one-id prompts" in str(error.value), error.value
  assert "[[10]] for one prompt" in message
  with pytest.raises(ArgumentError, match=r"line 2 is the id 7; .* \(\[7\] for that one id\)"):
    mdjax.generate(model, [[1], 7], spec=spec, max_new_tokens=2, key=jax.random.key(0))
  for key, shown in ((0.5, "key=0.5"), ("0", "key='0'"), (-1, "key=-1"), (2**32, "key=4294967296"),
                     (jax.random.split(jax.random.key(0), 3), "shape (3,)"), (None, "None")):
    with pytest.raises(ArgumentError) as error:
      mdjax.generate(model, [[1, 2]], spec=spec, max_new_tokens=2, key=key)
    assert error.value.param == "key" and shown in str(error.value), error.value
    assert "jax.random.key" in str(error.value)
  assert not sampled  # nothing ran
  # An int key is jax.random.key's seed (what the server does with a request's seed).
  seeded = mdjax.generate(model, [[1, 2]], spec=spec, max_new_tokens=2, key=5)
  keyed = mdjax.generate(model, [[1, 2]], spec=spec, max_new_tokens=2, key=jax.random.key(5))
  np.testing.assert_array_equal(seeded[0].token_ids, keyed[0].token_ids)
