"""Learn2PD's filter objective: the oracle's labels, its way out of a stall, the fit, the CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.sampling import commit_filter
from mdjax.tasks import permutation
from mdjax.accelerators import learn2pd

N = 3
PARAMS = permutation.Params(n=N)


def examples(denoiser, final, temperature=0.0, rows=2):
  canvas = np.full((rows, N), N, np.int32)
  bound = sampling.BoundDenoiser(sampling.Denoiser.of(denoiser), None)
  return learn2pd.oracle_examples(bound, canvas, np.zeros(canvas.shape, bool),
                                  np.tile(final, (rows, 1)), jax.random.key(0), mask_id=N,
                                  width=N, blocks=False, temperature=temperature, num_steps=N,
                                  max_block_steps=4 * N)


def test_the_oracle_commits_exactly_the_proposals_equal_to_the_answer():
  # Permutation of 3 at temperature 0: the greedy teacher writes 0, 1, 2 left to right (ties
  # to the lower position and the lower id). The oracle's proposals are the argmax, 0
  # everywhere at first: only position 0 matches; then 1 everywhere (p = 1/2); then 2.
  denoiser = permutation.make_exact_denoiser(PARAMS)
  teacher = sampling.sample(denoiser, None, jax.random.key(0), np.full((2, N), N, np.int32),
                            learn2pd.teacher_spec(N, learn2pd.FilterConfig(rows=10)))
  np.testing.assert_array_equal(teacher.tokens_BxL, [[0, 1, 2]] * 2)
  out = examples(denoiser, [0, 1, 2])
  np.testing.assert_array_equal(out["steps_B"], [3, 3])
  np.testing.assert_allclose(out["features_NxW"][::2], [[1 / 3] * 3, [1, .5, .5], [1, 1, 1]],
                             rtol=1e-5)
  np.testing.assert_array_equal(out["labels_NxW"][::2], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  assert out["forced_steps"] == 0


def test_a_stalled_block_is_committed_from_the_answer():
  # A denoiser that always proposes 0: against the answer (1, 2, 0) only position 2 matches
  # at step 0; step 1 proposes the same block again, so the block is forced from the answer.
  def zeros(params, tokens_BxL, t_B):
    return jnp.broadcast_to(5.0 * jax.nn.one_hot(0, N), tokens_BxL.shape + (N,))

  out = examples(zeros, [1, 2, 0])
  np.testing.assert_array_equal(out["steps_B"], [2, 2])
  np.testing.assert_array_equal(out["labels_NxW"][::2], [[0, 0, 1], [0, 0, 1]])
  assert out["forced_steps"] == 2  # one a row


def test_the_fit_learns_a_rule_the_features_decide():
  # Labels 1 where the probability exceeds 0.5: a rule a 2-layer ReLU MLP represents exactly.
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(400, 4)).astype(np.float32)
  y = (x > 0.5).astype(np.float32)
  cfg = learn2pd.FilterConfig(rows=10, hidden=8, epochs=800, lr=3e-2, accept_threshold=0.5)
  filt, info = learn2pd.fit_filter(x, y, cfg, jax.random.key(0))
  assert info["examples"] == {"train": 320, "validation": 40, "test": 40}
  assert info["train_loss"] < 0.3 * info["first_train_loss"]
  # At 0.5 only the band where the fitted sigmoid has not yet turned errs: 160 test cells,
  # the band a few hundredths wide around 0.5 (~5% of uniform draws); 0.9 leaves 2x room.
  assert info["test"]["accuracy"] > 0.9
  assert info["test"]["threshold"] == 0.5
  assert filt.width == 4 and filt.hidden == 8


def test_config_refuses_bad_values():
  for knobs, param in ((dict(rows=5), "rows"), (dict(temperature=-1.0), "temperature"),
                       (dict(hidden=0), "hidden"), (dict(accept_threshold=2.0), "accept_threshold"),
                       (dict(block_length=0), "block_length")):
    with pytest.raises(ArgumentError) as error:
      learn2pd.FilterConfig(**knobs)
    assert error.value.param == param


@pytest.mark.slow
def test_the_command_writes_a_filter_the_sampler_reads(tmp_path):
  out = str(tmp_path / "perm.json")
  info = learn2pd.main(["--model", "oracle:permutation", "--out", out, "--rows", "40",
                        "--epochs", "50", "--temperature", "1"], log=lambda *a: None)
  filt = commit_filter.load_filter(out)
  assert filt.width == 6 and filt.hidden == 32 and filt.num_params == 2 * 6 * 32 + 32 + 6
  assert commit_filter.read_info(out)["examples"] == info["examples"]
  assert json.loads(open(out).read())["info"]["task"] == "permutation"
  spec = sampling.LearnedCommitSpec(steps=6, commit_filter=filt)
  result = sampling.sample(permutation.make_exact_denoiser(permutation.Params(n=6)), None,
                           jax.random.key(0), np.full((8, 6), 6, np.int32), spec)
  assert (np.asarray(result.tokens_BxL) < 6).all()
