"""Reinforcement learning with verifiable rewards for masked diffusion LMs.

  logps_BxC = mdjax.rl.per_token_logps(model, ids_BxL, prompt_length, key=key)
  advantages_B = mdjax.rl.group_advantages(rewards_B, group_size)
  loss, metrics = mdjax.rl.grpo_loss(logps, old_logps, ref_logps, advantages, mask,
                                     epsilon=0.2, beta=0.04)

`per_token_logps_fn` / `elbo_logps_fn` are the functional forms a trainer jits (params an
argument); `grpo_loss` is d1's diffu-GRPO, `wd1_loss` wd1's weighted likelihood;
`mdjax.rl.rewards` is the registry of reward functions (text -> float); `mdjax.rl.spg`
SPG's sandwiched bounds and loss, `mdjax.rl.igpo` IGPO's hints, `mdjax.rl.mdpo` MDPO's step
advantages and loss, `mdjax.rl.ref_sync` d1's reference sync. Importing `mdjax.rl`
registers the training objectives 'grpo', 'wd1', 'spg', 'mdpo' and 'rft'
(`mdjax.rl.trainer`: `train.py --config=configs/grpo.py`).
"""

from mdjax.rl import igpo, mdpo, prompts, ref_sync, rewards, spg
from mdjax.rl.logps import (complementary_masks, coupled_logps_fn, elbo_logps_fn,
                             per_token_logps, per_token_logps_fn, trajectory_logps_fn)
from mdjax.rl.losses import completion_mask, group_advantages, grpo_loss, rft_loss, wd1_loss
from mdjax.rl.rewards import RewardError
from mdjax.rl import trainer  # registers the objectives

__all__ = ["RewardError", "complementary_masks", "completion_mask", "coupled_logps_fn",
           "elbo_logps_fn", "group_advantages", "grpo_loss", "igpo", "mdpo",
           "per_token_logps", "per_token_logps_fn", "prompts", "ref_sync", "rewards", "rft_loss",
           "spg", "trainer", "trajectory_logps_fn", "wd1_loss"]
