"""The distillation objectives 'dparallel' and 'd3llm': their masks and losses by hand and by
enumeration, their curricula, the config checks, and (slow) a short run that lowers the loss,
resumes bit for bit and trains LoRA adapters only."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import distill_d3llm, distill_dparallel
import mdjax
from mdjax import sampling, tasks, train
from mdjax.accelerators import d3llm, distill, dparallel
from mdjax.tasks import sudoku4
from mdjax.train.config_checks import ConfigError
from tests.accelerators.students import tiny_start, tiny_student, trained_and_resumed


def _ce(logits_V, target):
  logits_V = np.asarray(logits_V, np.float64)
  return float(np.log(np.exp(logits_V).sum()) - logits_V[target])


def _entropy(logits_V, temperature):
  z = np.asarray(logits_V, np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  return float(-(p * np.log(p + 1e-12)).sum())


LOGITS = np.array([[[0.0, 2.0], [1.0, -1.0], [0.5, 0.5]]], np.float32)  # 1 x 3 x 2
LOGITS_REV = np.array([[[3.0, 0.0], [0.0, 1.0], [-2.0, 2.0]]], np.float32)
TARGET = np.array([[1, 1, 0]], np.int32)


def test_certainty_forcing_terms_by_hand():
  # Copy 1 masks positions 0 and 1, copy 2 position 2. Copy 1: position 0 is right (argmax 1),
  # position 1 wrong (argmax 0): its entropy term is position 0's alone. Copy 2: position 2's
  # argmax is 1, the target 0: no right position, entropy 0.
  masked = np.array([[True, True, False]])
  loss, aux = dparallel.certainty_forcing_terms(LOGITS, LOGITS_REV, TARGET, masked, ~masked)
  ce = (_ce(LOGITS[0, 0], 1) + _ce(LOGITS[0, 1], 1)) / 2
  ce_rev = _ce(LOGITS_REV[0, 2], 0)
  ent = _entropy(LOGITS[0, 0], 0.5)
  assert float(loss) == pytest.approx(ce + ce_rev + 2.0 * ent, rel=1e-6)
  assert float(aux["correct_fraction"]) == pytest.approx(1 / 3)


def test_pseudo_trajectory_terms_by_hand():
  masked = np.array([[True, False, True]])
  loss, _ = d3llm.pseudo_trajectory_terms(LOGITS, LOGITS_REV, TARGET, masked, ~masked)
  ce = (_ce(LOGITS[0, 0], 1) + _ce(LOGITS[0, 2], 0)) / 2
  ce_rev = _ce(LOGITS_REV[0, 1], 1)
  ent = (_entropy(LOGITS[0, 0], 0.5) + _entropy(LOGITS[0, 2], 0.5)) / 2  # both right (ties: 0)
  assert float(loss) == pytest.approx((ce + ce_rev + 2.0 * ent) / 4, rel=1e-6)
  alone, _ = d3llm.pseudo_trajectory_terms(LOGITS, None, TARGET, masked, ~masked)
  assert float(alone) == pytest.approx((ce + 2.0 * ent) / 4, rel=1e-6)


def test_segments_cover_the_blocks_of_the_generation_the_last_one_shorter():
  # 5 generated positions after a prompt of 2, blocks of 2: [2, 4), [4, 6), [6, 7).
  in_block, after = dparallel.segments(jax.random.key(0), 3000, 7, 2, 2)
  in_block, after = np.asarray(in_block), np.asarray(after)
  blocks = {(2, 3): 0, (4, 5): 1, (6,): 2}
  index = np.array([blocks[tuple(np.flatnonzero(row))] for row in in_block])
  for b, end in enumerate((4, 6, 7)):
    np.testing.assert_array_equal(after[index == b], np.broadcast_to(np.arange(7) >= end,
                                                                     after[index == b].shape))
    # Uniform over 3 blocks: 4 standard errors of a binomial share of 3000 rows (0.034).
    assert abs((index == b).mean() - 1 / 3) < 4 * math.sqrt(2 / 9 / 3000)
  assert not in_block[:, :2].any() and not after[:, :2].any()


def test_semi_ar_masks_split_the_block_at_the_mask_probability():
  p = (1 - dparallel.EPS) * 0.5 + dparallel.EPS
  masked, rev, after = map(np.asarray, dparallel.semi_ar_masks(jax.random.key(1), 4000, 6, 2,
                                                               4, p))
  np.testing.assert_array_equal(masked & rev, False)
  np.testing.assert_array_equal(masked | rev, np.broadcast_to(np.arange(6) >= 2, masked.shape))  # one block of 4: all of it
  assert not after.any()
  # 16,000 block positions: 4 standard errors of the masked share are 0.016.
  assert abs(masked[:, 2:].mean() - p) < 4 * math.sqrt(p * (1 - p) / 16000)


def test_certainty_forcing_loss_is_its_masks_enumerated():
  # One block of 2 generated positions after a 1-token prompt: the 4 ways to split it, each
  # with its probability, give the loss's exact expectation over the key; the mean of N keys
  # is within 4 of its standard errors of it. The stub's logits depend on the canvas (how
  # many positions are masked), so each split has its own loss.
  weights_LxV = jnp.array([[0.0, 0.0, 0.0], [1.0, -0.5, 0.2], [0.3, 0.9, -1.0]])

  def stub(params, tokens_BxL, t_B):
    masked_B = (tokens_BxL == 3).sum(-1).astype(jnp.float32)
    return weights_LxV[None] * (1.0 + masked_B)[:, None, None] + 0.1 * t_B[:, None, None]

  target = jnp.array([[2, 1, 0]], jnp.int32)
  p = (1 - dparallel.EPS) * 0.5 + dparallel.EPS
  expected = 0.0
  terms = jax.jit(lambda z2, t2, masked, rev: dparallel.certainty_forcing_terms(
      *jnp.split(stub(None, z2, t2), 2), target, masked, rev)[0])
  for bits in itertools.product([False, True], repeat=2):
    masked = np.array([[False, *bits]])
    rev = np.array([[False, *(not b for b in bits)]])
    z = np.where(masked, 3, target)
    z_rev = np.where(rev, 3, target)
    t = np.array([masked.sum() / 2, rev.sum() / 2], np.float32)
    value = terms(np.concatenate([z, z_rev]), t, masked, rev)
    expected += float(value) * p ** sum(bits) * (1 - p) ** (2 - sum(bits))
  keys = jax.random.split(jax.random.key(2), 2000)
  losses = jax.jit(jax.vmap(lambda k: dparallel.certainty_forcing_loss(
      stub, None, k, target, prompt_length=1, mask_id=3, block_length=2)[0]))(keys)
  losses = np.asarray(losses, np.float64)
  assert abs(losses.mean() - expected) < 4 * losses.std() / math.sqrt(len(losses))


def test_the_trajectory_mask_is_the_teacher_canvas_at_the_selected_step():
  # Prompt of 1; the teacher wrote generated positions 1..4 at steps 2, 0, 3, 1.
  write = jnp.array([[-1, 2, 0, 3, 1]])
  whole = jnp.array([[False, True, True, True, True]])
  def mask(in_block, ratio):
    return np.asarray(d3llm.trajectory_mask(write, in_block, ratio, 1, 4))[0].tolist()
  # ratio 0.5 of a 4-block: int(0.5 * 4) = 2 unmasked -> trajectory step 2: only step 3 masked.
  assert mask(whole, 0.5) == [False, False, False, True, False]
  # ratio 0.8: int(0.2 * 4) = 0 -> step 0: all but the position written at step 0.
  assert mask(whole, 0.8) == [False, True, False, True, True]
  # ratio 0: step 4, clipped to the last (3): nothing masked.
  assert mask(whole, 0.0) == [False] * 5
  # The second block of 2 (positions 3, 4), ratio 0.5: step 2 + int(0.5 * 2) = 3: none.
  second = jnp.array([[False, False, False, True, True]])
  assert mask(second, 0.5) == [False] * 5
  # The first block (positions 1, 2), ratio 1.0: step 0: position 1 (written at 2) masked.
  first = jnp.array([[False, True, True, False, False]])
  assert mask(first, 1.0) == [False, True, False, False, False]


@pytest.mark.parametrize("progress, block, low", [
    (0.0, 8, 0.0), (0.25, 10, 0.2), (0.5, 12, 0.4), (0.6, 14, 0.48), (0.9, 16, 0.72),
    (1.0, 16, 0.8)])
def test_the_curricula_by_hand(progress, block, low):
  # Stages of 1/6: stage 1 (progress 0.25 -> 1.5) runs 8 -> 12 (10 halfway); stage 3 runs
  # 12 -> 16 (3.6: 14.4, truncated to 14); the last stage stays at 16.
  sizes = d3llm.scaled_block_lengths(16)
  assert sizes == (8, 8, 12, 12, 16, 16)
  got_block, got_low = d3llm.curriculum(progress, sizes, 0.0, 0.8)
  assert int(got_block) == block and float(got_low) == pytest.approx(low)


@pytest.mark.parametrize("module, changes, field", [
    (distill_dparallel, {}, "distill.teacher"),
    (distill_dparallel, {"distill.teacher": "sudoku4", "distill.mask_ratio": 1.5},
     "distill.mask_ratio"),
    (distill_dparallel, {"distill.teacher": "sudoku4", "distill.entropy_temperature": 0.0},
     "distill.entropy_temperature"),
    (distill_d3llm, {"distill.teacher": "sudoku4", "distill.min_mask_ratio": 0.9},
     "distill.min_mask_ratio"),
    (distill_d3llm, {"distill.teacher": "sudoku4", "distill.block_lengths": "8,x"},
     "distill.block_lengths"),
    (distill_d3llm, {"distill.teacher": "sudoku4", "train.init_from": "pretrained:/nowhere"},
     "train.init_from"),
    (distill_d3llm, {"distill.teacher": "sudoku4", "distill.teacher_sampler": "greedy"},
     "distill.teacher_sampler"),
])
def test_bad_distill_configs_are_refused_by_field(module, changes, field):
  config = module.get_config()
  with config.unlocked():
    config.update_from_flattened_dict(changes)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    distill.resolve_config(config)


@pytest.mark.parametrize("module", [distill_dparallel, distill_d3llm])
def test_the_pool_is_the_references_unless_the_teachers_law_is_asked(module):
  config = module.get_config()
  config.distill.teacher = "sudoku4"
  assert "teacher_sampler" not in config.distill  # the sudoku4 configs as they were
  assert distill.teacher_spec(16, distill.options(config)) == sampling.ConfidenceSpec(
      steps=16, score="prob", count_rule="even", temperature=0.0)
  with config.unlocked():
    config.distill.update(teacher_sampler="ancestral", temperature=1.0)
  spec = distill.teacher_spec(16, distill.options(config))
  assert spec == sampling.AncestralSpec(steps=16, temperature=1.0)
  # The exact oracle decoded by its own law: every solution cell a digit, written at one of
  # the steps. A step may write several cells, drawn apart (a grid may break); a row whose
  # cells were written one a step was drawn from the exact law: solved. (At 256 steps
  # about 63% of the rows: prod(1 - k / 256), k < 16.)
  oracle = mdjax.load("sudoku4")
  steps = 256
  tokens, writes = distill.teacher_pool(oracle, dataclasses.replace(spec, steps=steps),
                                        oracle.task, 64, 16, seed=0)
  assert ((tokens[:, 16:] >= 0) & (tokens[:, 16:] < sudoku4.NUM_DIGITS)).all()
  assert ((writes[:, 16:] >= 0) & (writes[:, 16:] < steps)).all()
  apart = np.array([len(set(w)) == 16 for w in writes[:, 16:]])
  assert 0 < apart.sum() < 64
  assert sudoku4.checks(tokens[apart])["solved"].all()


def test_a_knob_of_the_other_objective_is_refused():
  config = distill_dparallel.get_config()
  config.distill.teacher = "sudoku4"
  with config.unlocked():
    config.distill.block_lengths = "8,16"
  with pytest.raises(ConfigError, match=r"distill\.block_lengths: unknown to objective"):
    distill.resolve_config(config)


# ----------------------------------------------------------------------------
# Through the trainer.
# ----------------------------------------------------------------------------


def _mean_loss(config, params, apply_fn, task):
  """The loss on 8 fixed keys and batches (the train step's own rows)."""
  loss_fn = train.make_loss_fn(config, apply_fn, task)
  params = jax.tree.map(jnp.asarray, params)
  step = {"step": config.train.num_steps} if getattr(loss_fn, "takes_step", False) else {}
  values = [loss_fn(params, jax.random.key(100 + i),
                    jnp.asarray(train.batch_for_step(config, i, task)), **step)[0]
            for i in range(8)]
  return float(np.mean(values))


@pytest.mark.slow
@pytest.mark.parametrize("module, lora_rank", [(distill_dparallel, 0), (distill_d3llm, 4)])
def test_a_short_run_lowers_the_loss_resumes_bit_for_bit_and_trains_lora(tmp_path, module,
                                                                          lora_rank):
  config = tiny_student(module, **{"train.num_steps": 40, "train.lr": 3e-3, "checkpoint.every": 20,
                            "train.lora.rank": lora_rank})
  if lora_rank:  # LoRA adapts a trained start (here one NELBO step of the same model)
    config.train.init_from = tiny_start(tmp_path / "start")
  # Resumed from step 20: the same state (params, Adam) to the bit.
  whole = trained_and_resumed(config, tmp_path / "run")
  resolved = distill.resolve_config(config)
  task = tasks.from_config(resolved)
  first, _, apply_fn, _ = train.init_state(resolved, train.make_mesh(), task)
  first = jax.device_get(first)
  if lora_rank:  # only the adapters moved
    jax.tree.map(np.testing.assert_array_equal, whole.params["base"], first.params["base"])
  before = _mean_loss(resolved, first.params, apply_fn, task)
  after = _mean_loss(resolved, whole.params, apply_fn, task)
  assert after < before - 0.1, (before, after)
