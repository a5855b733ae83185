"""Localized remasking (PURE-style): fill, re-score, remask around the worst drops, refill."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax.sampling import specs as specs_lib
from mdjax.sampling import transforms
from mdjax.sampling.revision import leave_group_out_logits
from mdjax.sampling.state import State

Array = jax.Array

# Row-key streams of the rounds (the base fill uses the row keys as they are).
_ROUND_STREAM = 0x3FFFFFFF
_CHOICE_STREAM = 0x7FFFFFFE  # within a round: the remask choice (steps use 0, 1, ...)


def windows_around(seed_BxL: Array, window: int) -> Array:
  """Positions within `window` of a seed (a running count over a 2w+1 window)."""
  length = seed_BxL.shape[1]
  padded = jnp.pad(seed_BxL.astype(jnp.int32), ((0, 0), (window + 1, window)))
  csum = jnp.cumsum(padded, axis=-1)
  i = jnp.arange(length)
  # Seeds in [i - w, i + w]: csum at padded index i + 2w + 1 minus csum at index i.
  return (csum[:, i + 2 * window + 1] - csum[:, i]) > 0


def choose_remask(spec: specs_lib.LocalRemaskSpec, keys_B: Array, editable_BxL: Array,
                  write_conf_BxL: Array, conf_now_BxL: Array) -> Array:
  """Seeds (largest confidence drop), their windows, and a random part of what precedes."""
  batch, length = editable_BxL.shape
  drop_BxL = write_conf_BxL - conf_now_BxL
  seed_BxL = transforms.select_top_k(drop_BxL, editable_BxL,
                                     jnp.full((batch,), spec.seeds, jnp.int32))
  near_BxL = windows_around(seed_BxL, spec.window)
  first_window_B = jnp.where(near_BxL, jnp.arange(length), length).min(-1)
  before_BxL = jnp.arange(length)[None] < first_window_B[:, None]
  pick_BxL = transforms.row_uniform(keys_B, transforms.REMASK, (length,)) < spec.context_fraction
  return editable_BxL & (near_BxL | (before_BxL & pick_BxL))


def sample_program(run, apply_fn, params, keys_B: Array, tokens_BxL: Array, fixed_BxL: Array,
                   *, spec: specs_lib.LocalRemaskSpec, mask_id: int, num_blocks: int):
  """The base fill, then `rounds` of re-score / remask / refill, in one program.

  `run(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, spec=, mask_id=, num_blocks=)` is
  the driver's family loop returning its final State.
  """
  batch, length = tokens_BxL.shape
  editable_BxL = ~fixed_BxL
  state = run(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, spec=spec.base, mask_id=mask_id,
              num_blocks=num_blocks)
  base_steps = spec.base.steps if hasattr(spec.base, "steps") else length
  refill_steps = spec.refill.steps if hasattr(spec.refill, "steps") else length
  t_B = jnp.full((batch * spec.score_groups,), 1.0 / spec.score_groups, jnp.float32)
  evaluate = lambda tokens_NxL: apply_fn(params, tokens_NxL, t_B)

  def one_round(state: State, r):
    round_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, _ROUND_STREAM - r)
    logits_BxLxV = leave_group_out_logits(evaluate, state.tokens_BxL, editable_BxL,
                                          spec.score_groups, mask_id)
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    conf_now_BxL = jnp.exp(jnp.take_along_axis(
        logp_BxLxV, jnp.minimum(state.tokens_BxL, logp_BxLxV.shape[-1] - 1)[..., None],
        axis=-1)[..., 0])
    choice_keys_B = jax.vmap(jax.random.fold_in, (0, None))(round_keys_B, _CHOICE_STREAM)
    remask_BxL = choose_remask(spec, choice_keys_B, editable_BxL, state.write_conf_BxL,
                               conf_now_BxL)
    refill = run(apply_fn, params, round_keys_B, jnp.where(remask_BxL, mask_id, state.tokens_BxL),
                 ~remask_BxL, spec=spec.refill, mask_id=mask_id, num_blocks=1)
    offset = base_steps + r * refill_steps
    return state.replace(
        tokens_BxL=refill.tokens_BxL,
        write_step_BxL=jnp.where(remask_BxL, refill.write_step_BxL + offset,
                                 state.write_step_BxL),
        write_conf_BxL=jnp.where(remask_BxL, refill.write_conf_BxL, state.write_conf_BxL),
        reopened_B=state.reopened_B + remask_BxL.sum(-1) + refill.reopened_B,
        nfe=state.nfe + 1 + refill.nfe, saved_calls=state.saved_calls + refill.saved_calls,
        contexts=state.contexts + spec.score_groups + refill.contexts), None

  state, _ = jax.lax.scan(one_round, state, jnp.arange(spec.rounds))
  return state
