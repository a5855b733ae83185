"""Learn2PD's learned commit filter: the family's contract (K fixed, at least LLaDA's count a
step, blocks, End-of-Text), its step against a numpy transcription of the reference's, bad
knobs, the filter file and JIT safety."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.sampling import commit_filter, driver
from mdjax.sampling.commit_filter import CommitFilter
from mdjax.sampling.families.learned_commit import example_filter
from tests import stubs
from tests.sampling.common import LENGTH, PROMPT, VOCAB, prompted_canvas, softmax

N = LENGTH - PROMPT  # 8 generated positions


def constant_filter(width: int, accept) -> CommitFilter:
  """A filter whose logits ignore the input: +20 at the slots in `accept`, -20 elsewhere."""
  b2 = np.full(width, -20.0)
  b2[list(accept)] = 20.0
  return CommitFilter.from_arrays(np.zeros((width, 2)), np.zeros(2), np.zeros((2, width)), b2)


def run(spec, batch=4, key=jax.random.key(0), params_seed=3):
  return sampling.sample(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH, params_seed), key,
                         prompted_canvas(batch), spec)


def writes_per_step(result, steps):
  """Per row, how many generated positions each step wrote."""
  write_step = np.asarray(result.write_step_BxL)[:, PROMPT:]
  return np.stack([(write_step == i).sum(-1) for i in range(steps)], -1)


def test_never_accepting_commits_llada_even_count_and_ends_within_k():
  # Nothing passes the filter: each step commits LLaDA's even count of the most probable
  # (8 over 3 steps: 3, 3, 2), and the canvas is full after exactly K steps.
  spec = sampling.LearnedCommitSpec(steps=3, commit_filter=constant_filter(N, ()),
                                    temperature=0.0)
  result = run(spec)
  assert sampling.num_steps(spec, LENGTH) == 3
  np.testing.assert_array_equal(writes_per_step(result, 3), [[3, 3, 2]] * 4)
  assert (np.asarray(result.tokens_BxL) != VOCAB).all()
  np.testing.assert_array_equal(result.rounds_B, [3] * 4)


@pytest.mark.slow
def test_accepting_everything_ends_in_one_step_and_blocks_advance_per_row():
  result = run(sampling.LearnedCommitSpec(steps=N, commit_filter=constant_filter(N, range(N))))
  np.testing.assert_array_equal(result.rounds_B, [1] * 4)
  assert int(result.nfe) == 1  # the steps after are skipped: nothing left to write
  # Blocks of 4 with 2 steps each (K = 4): all-accepting, block 1 starts at step 1, not 2.
  blocks = run(sampling.LearnedCommitSpec(steps=4, commit_filter=constant_filter(4, range(4)),
                                          block_length=4))
  write_step = np.asarray(blocks.write_step_BxL)[:, PROMPT:]
  np.testing.assert_array_equal(write_step, [[0] * 4 + [1] * 4] * 4)
  # Never accepting: LLaDA's even count inside each block, 2 + 2, then the next block.
  never = run(sampling.LearnedCommitSpec(steps=4, commit_filter=constant_filter(4, ()),
                                         block_length=4))
  np.testing.assert_array_equal(writes_per_step(never, 4), [[2, 2, 2, 2]] * 4)
  write_step = np.asarray(never.write_step_BxL)[:, PROMPT:]
  assert (write_step[:, :4] <= 1).all() and (write_step[:, 4:] >= 2).all()


def reference_step(params, tokens_BxL, filt, threshold, k, block):
  """One step of the reference's generate_learn2parallel at temperature 0 (numpy): the
  filter reads the block's W max probabilities, its sigmoid over threshold commits masked
  positions of the block, and the k most probable masked positions of the block are added."""
  probs = softmax(stubs.stub_logits_np(params, tokens_BxL))
  x0, x0_p = probs.argmax(-1), probs.max(-1)
  masked = tokens_BxL == VOCAB
  start, end = PROMPT + block[0], PROMPT + block[1]
  w = filt.arrays()
  logits = np.maximum(x0_p[:, start:end] @ w["w1"] + w["b1"], 0) @ w["w2"] + w["b2"]
  transfer = np.zeros_like(masked)
  transfer[:, start:end] = 1 / (1 + np.exp(-logits)) > threshold
  transfer &= masked
  confidence = np.where(masked, x0_p, -np.inf)
  confidence[:, end:] = -np.inf
  for b in range(len(tokens_BxL)):
    order = np.argsort(-confidence[b], kind="stable")[:k]
    transfer[b, order] = True
  return np.where(transfer, x0, tokens_BxL)


@pytest.mark.parametrize("block_length", [None, 4])
def test_each_step_is_the_reference_step(block_length):
  """The trajectory, step by step, against the reference's step on the same canvas, with a
  random filter (it commits some positions and not others) at its accept threshold."""
  width = block_length or N
  filt = example_filter(width, hidden=5, seed=4)
  params = stubs.stub_params(VOCAB, LENGTH, seed=3)
  steps = N
  spec = sampling.LearnedCommitSpec(steps=steps, commit_filter=filt, accept_threshold=0.6,
                                    temperature=0.0, block_length=block_length,
                                    record_trajectory=True)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), prompted_canvas(8),
                           spec)
  traj = np.asarray(result.trajectory_KxBxL)
  before = np.asarray(prompted_canvas(8))
  per_block = steps // (N // width)
  for row in range(8):
    tokens, block, step_in_block, count, parallel = before[row:row + 1], -1, 0, 0, 0
    for i in range(steps):
      masked = tokens[0, PROMPT:] == VOCAB
      if not masked.any():
        np.testing.assert_array_equal(traj[i, row], tokens[0])
        continue
      first = int(np.argmax(masked)) // width
      if first != block:
        block, step_in_block, count = first, 0, int(masked[first * width:(first + 1) * width].sum())
      k = count // per_block + (step_in_block < count % per_block)
      expected = reference_step(params, tokens, filt, 0.6, k,
                                (block * width, (block + 1) * width))
      np.testing.assert_array_equal(traj[i, row], expected[0], err_msg=f"row {row} step {i}")
      parallel += int((expected != tokens).sum()) > k
      tokens, step_in_block = expected, step_in_block + 1
  assert parallel > 0, "the filter must commit beyond the count somewhere, or the test is weak"


def ends_at_4(params, tokens_BxL, t_B):
  """Predicts id (position % 5) before position 4, surely, and EOS (5) from it on, more surely
  still (so a count by probability commits the end before the text)."""
  del params, t_B
  position_L = jnp.arange(tokens_BxL.shape[1])
  target_L = jnp.where(position_L < 4, position_L % 5, 5)
  weight_L = jnp.where(position_L < 4, 10.0, 30.0)[:, None]
  return jnp.broadcast_to(weight_L * jax.nn.one_hot(target_L, 6), tokens_BxL.shape + (6,))


@pytest.mark.slow
def test_end_of_text_fills_after_the_first_eos_and_saves_steps():
  length = 12
  canvas = np.full((2, length), 6, np.int32)
  never = constant_filter(length, ())
  plain = sampling.LearnedCommitSpec(steps=length, commit_filter=never, temperature=0.0, eos_id=5)
  eot = dataclasses.replace(plain, eot_exit=True)
  slow = sampling.sample(ends_at_4, None, jax.random.key(0), canvas, plain, mask_id=6)
  fast = sampling.sample(ends_at_4, None, jax.random.key(0), canvas, eot, mask_id=6)
  expected = [0, 1, 2, 3] + [5] * 8
  np.testing.assert_array_equal(fast.tokens_BxL, [expected] * 2)
  np.testing.assert_array_equal(slow.tokens_BxL, [expected] * 2)
  # Without it the count (one a step, most probable first) writes the EOS tail 4..11 before
  # the text 0..3: 12 steps. With it step 0 proposes EOS at 4..11 (equally sure: the first,
  # 4, is p) and fills 5..11; the count commits 4, then 0..3: 5 steps.
  np.testing.assert_array_equal(slow.rounds_B, [12, 12])
  np.testing.assert_array_equal(fast.rounds_B, [5, 5])
  np.testing.assert_array_equal(np.asarray(fast.write_step_BxL)[0, 4:], [0] * 8)
  # The filter's own EOS wins over the proposals': accepting only slot 8 ends the text at 8
  # (9..11 filled at step 0; 5..7 wait for the next step's proposals).
  at_8 = dataclasses.replace(eot, commit_filter=constant_filter(length, (8,)))
  out = sampling.sample(ends_at_4, None, jax.random.key(0), canvas, at_8, mask_id=6)
  np.testing.assert_array_equal(np.asarray(out.write_step_BxL)[0, 4:], [0, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(out.tokens_BxL)[0], expected)


@pytest.mark.parametrize("knobs, param", [
    (dict(accept_threshold=1.5), "accept_threshold"),
    (dict(accept_threshold=float("nan")), "accept_threshold"),
    (dict(eot_exit="yes"), "eot_exit"),
    (dict(block_length=4), "block_length"),  # the filter is 8 wide
    (dict(commit_filter="filter.json"), "commit_filter"),
    (dict(steps=0), "steps"),
])
def test_bad_knobs_name_the_knob(knobs, param):
  base = dict(steps=4, commit_filter=example_filter(N))
  with pytest.raises(ArgumentError) as error:
    sampling.LearnedCommitSpec(**{**base, **knobs})
  assert error.value.param == param


def test_a_filter_of_the_wrong_width_is_refused_before_compiling():
  params = stubs.stub_params(VOCAB, LENGTH)
  compiled = driver._program._cache_size()
  for spec, match in ((sampling.LearnedCommitSpec(steps=4, commit_filter=example_filter(6)),
                       "width 6 must be the generation length 8"),
                      (sampling.LearnedCommitSpec(steps=3, commit_filter=example_filter(4),
                                                  block_length=4),
                       "divisible by the number of blocks 2")):
    with pytest.raises(ValueError, match=match):
      sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), prompted_canvas(2), spec,
                      mask_id=VOCAB)
  assert driver._program._cache_size() == compiled
  eot = sampling.LearnedCommitSpec(steps=4, commit_filter=example_filter(N), eot_exit=True)
  with pytest.raises(ArgumentError, match="eot_exit=True is invalid: needs eos_id"):
    sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), prompted_canvas(2), eot,
                    mask_id=VOCAB)
  assert driver._program._cache_size() == compiled
  with pytest.raises(ArgumentError, match="needs steps"):
    sampling.make_spec("learned_commit")
  with pytest.raises(ArgumentError, match="needs its trained filter") as error:
    sampling.make_spec("learned_commit", steps=4)  # what a request naming it gets
  assert error.value.param == "commit_filter"


def test_filter_file_round_trip_and_refusals(tmp_path):
  filt = example_filter(N, hidden=3, seed=7)
  path = str(tmp_path / "filter.json")
  commit_filter.save_filter(filt, path, {"teacher": "sudoku4"})
  loaded = commit_filter.load_filter(path)
  assert loaded == filt and hash(loaded) == hash(filt) and loaded.digest == filt.digest
  assert commit_filter.read_info(path) == {"teacher": "sudoku4"}
  assert os.listdir(tmp_path) == ["filter.json"]  # written under a temporary name, renamed
  assert filt.num_params == 2 * N * 3 + 3 + N
  raw = json.loads(open(path).read())

  def refused(obj_or_text, match):
    bad = tmp_path / "bad.json"
    bad.write_text(obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text))
    with pytest.raises(ArgumentError, match=match) as error:
      commit_filter.load_filter(str(bad))
    assert error.value.param == "filter_file"

  refused("{not json", "not a JSON commit filter")
  refused({**raw, "format": "other"}, "not a commit filter")
  refused({**raw, "version": 2}, "version 2")
  refused({k: v for k, v in raw.items() if k != "w2"}, "lacks w2")
  refused({**raw, "b2": raw["b2"][:-1]}, "b2 must be 8 numbers")
  refused({**raw, "w1": "zeros"}, "w1 must be a list")
  refused({**raw, "b1": [1e999] * 3}, "not finite")
  refused({**raw, "width": 300, "hidden": 300}, "at most 65,536")
  with pytest.raises(ArgumentError, match="no such file"):
    commit_filter.load_filter(str(tmp_path / "missing.json"))
  (tmp_path / "huge.json").write_bytes(b" " * (commit_filter.MAX_FILE_BYTES + 1))
  with pytest.raises(ArgumentError, match="larger than"):
    commit_filter.load_filter(str(tmp_path / "huge.json"))


def test_specs_are_static_values_and_one_filter_is_one_program():
  a = sampling.LearnedCommitSpec(steps=N, commit_filter=example_filter(N, seed=1))
  b = sampling.LearnedCommitSpec(steps=N, commit_filter=example_filter(N, seed=1))
  assert a == b and hash(a) == hash(b)  # equal weights: one compiled program serves both
  c = dataclasses.replace(a, commit_filter=example_filter(N, seed=2))
  assert c != a  # other weights are other constants: another program
  assert "sha256=" in repr(a) and len(repr(a)) < 600  # the weights are not printed
  params = stubs.stub_params(VOCAB, LENGTH)
  fixed = np.asarray(prompted_canvas(2)) != VOCAB  # concrete: the width is checked before

  @jax.jit
  def inside(params, key, tokens):  # the spec is a static value, the canvas traced
    return sampling.sample(stubs.stub_denoiser, params, key, tokens, a, fixed).tokens_BxL

  traced = inside(params, jax.random.key(0), prompted_canvas(2))
  eager = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), prompted_canvas(2), b)
  np.testing.assert_array_equal(traced, eager.tokens_BxL)


def test_sample_cli_reads_the_filter_file(tmp_path):
  from mdjax import sampling_cli
  path = str(tmp_path / "f.json")
  commit_filter.save_filter(example_filter(N), path)
  values = {name: None for name in sampling_cli.sampler_flags()}
  values.update(steps=N, filter_file=path, accept_threshold=0.9)
  spec = sampling_cli.sampler_spec("learned_commit", values, {"steps", "filter_file",
                                                              "accept_threshold"}, length=LENGTH)
  assert spec.commit_filter == example_filter(N) and spec.accept_threshold == 0.9
  values["filter_file"] = None
  with pytest.raises(ValueError, match="needs --filter_file"):
    sampling_cli.sampler_spec("learned_commit", values, {"steps"}, length=LENGTH)
