"""RL on Sudoku 4x4 (d1's diffu-GRPO, or wd1) from a trained workdir: set train.init_from.

  python train.py --config=configs/sudoku4.py --workdir=/tmp/sudoku4   # the start, ~2 min
  python train.py --config=configs/grpo.py --workdir=/tmp/sudoku_grpo \
      --config.train.init_from=/tmp/sudoku4

Per step: batch_size / rl.num_generations puzzles, G completions each by `sampler` (one
compiled call), rewards (rl.rewards: 'sudoku4_solved', the exact check; 'sudoku', d1's rule),
group advantages, rl.num_iterations inner updates (mdjax.rl.trainer). --config.objective=wd1
trains wd1's weighted likelihood instead; rl.estimator="elbo" reads the MC-ELBO instead of
d1's one-step log-probabilities. The model fields come from the start point.

Every rl field takes a command-line value: --config.rl.rewards=sudoku,sudoku4_solved (or
'("sudoku", "sudoku4_solved")'), --config.rl.reward_weights=1.0,0.5 (unset: 1 each),
--config.rl.prompts=FILE.jsonl.
"""

import ml_collections
from ml_collections import config_dict

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "sudoku4"
  c.objective = "grpo"  # or "wd1", "spg", "mdpo", "rft" (SFT on the successful rollouts)
  c.batch_size = 64  # completions per step: 8 puzzles x num_generations
  c.log_every = 1
  c.num_eval_samples = 0
  c.train.update(init_from="", num_steps=40, lr=3e-4, lr_floor=1.0, warmup_steps=0,
                 b1=0.9, b2=0.99, weight_decay=0.0, grad_clip=1.0)
  c.checkpoint.update(every=10, keep=3)
  c.rl = dict(
      num_generations=8,
      num_iterations=4,  # inner updates per rollout batch (d1: 12 on LLaDA-8B)
      epsilon=0.5,  # d1's train.yaml
      beta=0.04,
      kl_estimator="k3",  # d1's; "k2": its gradient is KL(policy || ref)'s (docs/rl.md)
      p_mask_prompt=0.15,
      cfg_scale=0.0,
      estimator="one_step",  # or "elbo", "trajectory", "coupled" (DiffuCoder's mask pairs)
      elbo_samples=4,
      coupled_t_min=0.2,  # coupled: the pair's mask ratio t ~ U[0.2, 0.8] (DiffuCoder's)
      coupled_t_max=0.8,
      scale_by_std=False,
      # objective 'spg' (SPG's defaults; it reads no rl.estimator, epsilon or beta):
      spg_negative="mix",  # a negative-advantage row's bound: "mix", "eubo" or "elbo"
      spg_mix_weight=0.5,
      spg_eubo_beta=1.5,
      spg_num_draws=2,
      spg_block_length=config_dict.placeholder(int),  # None: sampler.block_length or all
      rewards=("sudoku4_solved",),  # the exact check; "sudoku": d1's fraction of blanks right
      # Typed placeholders (None until set), so that a command line can set them.
      reward_weights=config_dict.placeholder(tuple),  # None: 1 each
      prompts=config_dict.placeholder(str),  # text prompts' JSONL (task 'sft': its own file)
      max_prompt_length=200,  # text prompts only, as the two below
      max_completion_length=256,
      chat=True,
      # d1's reference sync (TRL's defaults; d1's train.yaml: True, 64 updates): every
      # ref_model_sync_steps updates, ref <- alpha policy + (1 - alpha) ref (grpo, beta > 0).
      sync_ref_model=False,
      ref_model_sync_steps=512,
      ref_model_mixup_alpha=0.6,
      # IGPO: a group whose rollouts all fail is drawn again with part of the true completion
      # fixed; correct hinted rollouts replace up to igpo_max_replacements of its rows.
      igpo=False,
      igpo_max_replacements=4,
      igpo_ratio_low=0.2,  # a hinted row shows r of the truth, r ~ U[low, high]
      igpo_ratio_high=0.6,
      igpo_entropy_keep=0.2,  # of the hinted tokens, the most uncertain fraction stays in the loss
      # objective 'mdpo': sampler steps trained per batch (None: MDPO's 16, at most sampler.steps)
      mdpo_train_steps=config_dict.placeholder(int),
      rft_min_reward=1.0,  # objective 'rft': rows with at least this reward are its successes
  )
  # d1's rollouts: LLaDA's low-confidence decoding (the drawn token's probability, LLaDA's
  # even counts), at temperature 1 here; 4 steps for the 16 cells.
  c.sampler.update(family="confidence", steps=4, score="prob", count_rule="even",
                   temperature=1.0)
  # Every model field is the start point's unless set (then it must match; dtype and remat
  # are compute knobs, free to differ).
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in c.model.items()})
  return c
