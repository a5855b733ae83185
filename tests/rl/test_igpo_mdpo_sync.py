"""The pieces after d1 added to `mdjax.rl` (no training here): d1's reference-model sync
(TRL's SyncRefModelCallback, `mdjax.rl.ref_sync`), rejection-sampling fine-tuning's loss,
IGPO's hints (`mdjax.rl.igpo`) and MDPO's step advantages and loss (`mdjax.rl.mdpo`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mdjax import tasks
from mdjax.rl import igpo, losses, mdpo, ref_sync, trainer
from mdjax.tasks import sudoku4


# --- d1's reference sync -------------------------------------------------------------------------


def test_ref_sync_mixes_the_updated_policy_into_the_reference_every_k_updates():
  """SGD with a constant gradient: after update n the policy is p0 - n lr g; on every 3rd
  update TRL's callback sets ref <- a policy + (1 - a) ref. The chain's updates are SGD's
  own (the sync passes them through)."""
  lr, alpha, every = 0.1, 0.6, 3
  p0 = {"w": jnp.array([1.0, -2.0, 0.5])}
  g = {"w": jnp.array([0.3, 0.1, -0.2])}
  optimizer = ref_sync.with_ref_sync(optax.sgd(lr), alpha, every)
  state = optimizer.init(p0)
  params, ref = p0, np.asarray(p0["w"], np.float64)
  for n in range(1, 8):
    updates, state = optimizer.update(g, state, params)
    np.testing.assert_allclose(updates["w"], -lr * g["w"], rtol=1e-6)
    params = optax.apply_updates(params, updates)
    policy = np.asarray(p0["w"], np.float64) - n * lr * np.asarray(g["w"])
    if n % every == 0:
      ref = alpha * policy + (1 - alpha) * ref
    np.testing.assert_allclose(ref_sync.reference_of(state)["w"], ref, rtol=1e-6, atol=1e-7)
    assert int(state[-1].count) == n


def _rl_config(**rl):
  from configs import grpo
  c = grpo.get_config()
  c.train.init_from = "unused"
  c.rl.update(**rl)
  return c


@pytest.mark.parametrize("rl, match", [
    (dict(sync_ref_model=True, beta=0.0), r"rl.sync_ref_model=True: there is no reference"),
    (dict(ref_model_sync_steps=0), r"rl.ref_model_sync_steps=0: must be an integer >= 1"),
    (dict(ref_model_mixup_alpha=1.5), r"rl.ref_model_mixup_alpha=1.5: must be a number in"),
    (dict(igpo=True, estimator="elbo"), r"rl.igpo=True: IGPO filters the hinted tokens"),
    (dict(igpo_ratio_low=0.7), r"rl.igpo_ratio_high=0.6: must be a number in \[rl.igpo_ratio"),
    (dict(igpo_max_replacements=0), r"rl.igpo_max_replacements=0: must be an integer >= 1"),
])
def test_the_new_knobs_are_checked_by_name(rl, match):
  with pytest.raises(trainer.ConfigError, match=match):
    trainer.rl_options(_rl_config(**rl))


def test_sync_under_lora_and_igpo_of_another_objective_are_refused():
  c = _rl_config(sync_ref_model=True)
  c.train.lora.rank = 4
  with pytest.raises(trainer.ConfigError, match=r"sync_ref_model=True: with LoRA"):
    trainer.rl_options(c)
  c = _rl_config(igpo=True)
  c.objective = "wd1"
  with pytest.raises(trainer.ConfigError, match=r"rl.igpo=True: .*objective 'wd1' must be"):
    trainer.rl_options(c)
  c = _rl_config()
  c.objective = "mdpo"
  c.sampler.temperature = 0.0
  with pytest.raises(trainer.ConfigError, match=r"sampler.temperature=0.0: objective 'mdpo'"):
    trainer.rl_options(c)
  c.sampler.temperature = 1.0
  c.rl.mdpo_train_steps = 5  # the sampler runs 4
  with pytest.raises(trainer.ConfigError, match=r"rl.mdpo_train_steps=5: must be None"):
    trainer.rl_options(c)
  c.rl.mdpo_train_steps = None
  assert trainer.rl_options(c)["mdpo_train_steps"] == 4  # min(MDPO's 16, sampler.steps)


# --- rejection-sampling fine-tuning --------------------------------------------------------------


def test_rft_loss_is_the_nll_of_the_successes_per_token():
  """Rows 0 and 2 succeed: the loss is minus their summed log-likelihood over their 3 + 2
  tokens; the failures carry no gradient."""
  logps = jnp.array([[-1.0, -2.0, -0.5], [-3.0, -3.0, -3.0], [-0.25, -0.75, -9.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 1], [1, 1, 0]], jnp.float32)
  success = jnp.array([1.0, 0.0, 1.0])
  loss, metrics = losses.rft_loss(logps, mask, success)
  np.testing.assert_allclose(loss, (3.5 + 1.0) / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["kept_fraction"], 2 / 3, rtol=1e-6)
  grad = jax.grad(lambda x: losses.rft_loss(x, mask, success)[0])(logps)
  np.testing.assert_allclose(grad, -np.asarray(mask) * np.asarray(success)[:, None] / 5,
                             rtol=1e-6)
  nothing, _ = losses.rft_loss(logps, mask, jnp.zeros(3))
  assert float(nothing) == 0.0


# --- IGPO -----------------------------------------------------------------------------------------


def test_hint_masks_reveal_igpo_s_count_at_a_sorted_ratio_per_group():
  """Row b reveals C - int(C (1 - r_b)) positions, r_b in [low, high], sorted in its group;
  the revealed positions differ between rows (uniform subsets)."""
  completion, group = 16, 4
  reveal, ratio = igpo.hint_masks(jax.random.key(0), 32, completion, group, ratio_low=0.2,
                                  ratio_high=0.6)
  assert reveal.shape == (32, completion) and ((ratio >= 0.2) & (ratio <= 0.6)).all()
  assert (np.diff(ratio.reshape(-1, group), axis=1) >= 0).all()
  np.testing.assert_array_equal(reveal.sum(1), completion - (completion * (1 - ratio)).astype(int))
  assert len({row.tobytes() for row in reveal}) > 28


def test_replace_failed_groups_fills_the_first_rows_of_an_all_failed_group():
  """Group 0 has a success (untouched); group 1 all failed with hinted rows 5 and 7 correct
  (both used, max 4); group 2 all failed with 3 correct hinted rows (2 used, max 2), drawn
  among them; group 3 all failed, no correct hinted row (untouched)."""
  correct = np.array([0, 1, 0, 0] + [0] * 12, bool)
  hinted = np.array([1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0], bool)
  source, replaced = igpo.replace_failed_groups(0, correct, hinted, 4, max_replacements=4)
  np.testing.assert_array_equal(source[:8], [-1, -1, -1, -1, 5, 7, -1, -1])
  assert (source[12:] == -1).all()
  source, replaced = igpo.replace_failed_groups(0, correct, hinted, 4, max_replacements=2)
  assert (source[10:12] == -1).all() and len(set(source[8:10])) == 2
  assert set(source[8:10]) <= {8, 10, 11} and replaced.sum() == 4


def test_entropy_keep_keeps_the_drawn_tokens_and_the_most_uncertain_hints():
  """Row 0: 5 hinted positions, int(5 * 0.4) = 2 kept, the two of highest entropy; row 1: one
  hinted position, at least one kept; row 2: no hints, all kept."""
  entropy = jnp.array([[0.1, 0.9, 0.5, 0.7, 0.2, 0.3], [0.5] * 6, [0.0] * 6])
  hinted = jnp.array([[1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0] * 6], bool)
  keep = np.asarray(igpo.entropy_keep(entropy, hinted, 0.4))
  np.testing.assert_array_equal(keep[0], [0, 1, 0, 1, 0, 1])
  assert keep[1].all() and keep[2].all()


@pytest.mark.slow
def test_inpaint_failed_groups_puts_correct_hinted_rollouts_of_the_oracle_in_failed_groups():
  """Sudoku 4x4's exact oracle rolls out; groups 0 and 2 are made to fail (every cell 0):
  their first rows become hinted rollouts that pass the check, fixed to the truth at the
  hinted cells (written at no step), and the other groups are untouched."""
  task = tasks.get("sudoku4")
  source = trainer.sources.IdTaskSource(task)
  prompts = source.draw(jax.random.key(1), 4)
  group, spec = 4, trainer.sampling.make_spec("confidence", steps=4, temperature=1.0)
  oracle = sudoku4.make_exact_denoiser(task.params)

  def roll(hint_BxC=None, key=2):
    return trainer.rollout(oracle, None, jax.random.key(key), prompts, group, 16, spec,
                           sudoku4.MASK_ID, hint_BxC=hint_BxC)

  ids, write, _ = roll()
  ids = np.array(ids)
  failed = np.zeros(16, bool)
  failed[0:4] = failed[8:12] = True
  ids[failed, 16:] = 0
  opts = {**trainer.DEFAULTS, "igpo_max_replacements": 4}
  new_ids, new_write, hinted, metrics, _ = trainer.inpaint_failed_groups(
      opts, source, prompts, group, ids, write, np.ones((16, 16), np.float32),
      lambda hint: roll(hint, key=3), jax.random.key(4))
  assert metrics["igpo_failed_groups"] == 0.5 and metrics["rollouts"] == 32
  replaced = hinted.any(1)
  assert replaced[0:4].any() and replaced[8:12].any() and not replaced[4:8].any()
  np.testing.assert_array_equal(new_ids[~failed], ids[~failed])
  solved = sudoku4.checks(new_ids, task.params)["solved"]
  assert solved[replaced].all() and not solved[failed & ~replaced].any()
  truths = np.repeat(prompts.truths_PxC, group, 0)
  np.testing.assert_array_equal(new_ids[:, 16:][hinted], truths[hinted])
  assert (new_write[:, 16:][hinted] == -1).all() and (new_write[:, 16:][~hinted] >= 0).all()


# --- MDPO -----------------------------------------------------------------------------------------


def test_step_advantages_are_mdpo_s_adv_v4_normalised_per_step():
  """Two rows of one group, S = 3, by hand: row a's rewards (0, 1, 1), row b's (1, 0, 0).
  adv-v4: a: (0 + 1 + 1, 1 + 1 + 1, 0 + 1 + 1) = (2, 3, 2); b: (1 + 1 + 0, -1 + 1 + 0,
  0 + 1 + 0) = (2, 0, 1); per step over the group, (x - mean) / (std + 1e-4), std with ddof
  1: step 0 (0, 0); step 1 +-1.5 / (2.1213 + 1e-4); step 2 +-0.5 / (0.7071 + 1e-4)."""
  adv = mdpo.step_advantages(np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), 2)
  s1, s2 = 1.5 / (np.sqrt(4.5) + 1e-4), 0.5 / (np.sqrt(0.5) + 1e-4)
  np.testing.assert_allclose(adv, [[0, s1, s2], [0, -s1, -s2]], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(mdpo.select_steps(adv, 2), [1, 2])


def test_step_predictions_rebuild_each_step_of_an_oracle_rollout():
  """A 4-step rollout of Sudoku's exact oracle: step s's masked cells are those written at s
  or later; its prediction keeps every shown cell and the cells it committed; the last
  step's prediction is the final canvas; each prediction's confidence is the oracle's
  probability of it at that step's canvas."""
  task = tasks.get("sudoku4")
  oracle = sudoku4.make_exact_denoiser(task.params)
  rows = np.asarray(task.sample_data(jax.random.key(5), 6))
  canvas = rows.copy()
  canvas[:, 16:] = sudoku4.MASK_ID
  spec = trainer.sampling.make_spec("confidence", steps=4, temperature=1.0)
  out = trainer.sampling.sample(oracle, None, jax.random.key(6), canvas, spec,
                                mask_id=sudoku4.MASK_ID)
  ids, write = np.asarray(out.tokens_BxL), np.asarray(out.write_step_BxL)
  x0, conf, masked = (np.asarray(a) for a in mdpo.step_predictions(
      oracle, None, ids, write, jax.random.key(7), 16, mask_id=sudoku4.MASK_ID, num_steps=4,
      temperature=1.0))
  for s in range(4):
    np.testing.assert_array_equal(masked[s], write[:, 16:] >= s)
    keep = ~masked[s] | (write[:, 16:] == s)
    np.testing.assert_array_equal(x0[s][keep], ids[:, 16:][keep])
    noisy = np.where(write >= s, sudoku4.MASK_ID, ids)
    p = np.asarray(jax.nn.softmax(oracle(None, jnp.asarray(noisy), jnp.ones(6)), -1))[:, 16:]
    expected = np.take_along_axis(p, x0[s][..., None], -1)[..., 0]
    np.testing.assert_allclose(conf[s][masked[s]], expected[masked[s]], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(x0[-1], ids[:, 16:])


def test_mdpo_gradient_raises_validity_of_one_step_two_color_by_enumeration():
  """Prompt-less two_color, one step: x0 is the rollout, conf its probability, lambda 1.
  Over every outcome (c1, c2) of a policy with P(red) = p1, p2, weighted by its probability,
  with advantages r - E r (the group limit), MDPO's expected loss gradient in the two logits
  points against validity's gradient, so a step on it raises validity (a sign error, a wrong
  weight on the masked positions or a dropped confidence would not)."""
  def expected_loss(logits_2):
    logp_2x2 = jax.nn.log_softmax(jnp.stack([logits_2, -logits_2], -1), -1)  # [pos, color]
    p = jnp.exp(jax.lax.stop_gradient(logp_2x2))
    validity = p[0, 0] * p[1, 0] + p[0, 1] * p[1, 1]
    total = 0.0
    for c1 in range(2):
      for c2 in range(2):
        prob = p[0, c1] * p[1, c2]
        advantage = float(c1 == c2) - validity
        logps = jnp.stack([logp_2x2[0, c1], logp_2x2[1, c2]])[None, None]
        conf = jnp.exp(jax.lax.stop_gradient(logps))
        loss, _ = mdpo.mdpo_loss(logps, None, jnp.reshape(advantage, (1, 1)),
                                 jnp.ones((1, 1, 2)), conf, epsilon=0.2)
        total = total + prob * loss
    return total

  def validity(logits_2):
    p = jax.nn.sigmoid(2 * logits_2)
    return p[0] * p[1] + (1 - p[0]) * (1 - p[1])

  for logits in ([0.3, 0.1], [-0.4, -0.2], [0.2, 0.25]):
    logits = jnp.asarray(logits)
    g_loss, g_valid = jax.grad(expected_loss)(logits), jax.grad(validity)(logits)
    assert float(jnp.dot(-g_loss, g_valid)) > 0, (logits, g_loss, g_valid)
