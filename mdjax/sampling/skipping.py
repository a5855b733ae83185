"""A loop that jumps over idle steps, where a scan would branch at every one.

A `lax.cond` around the denoiser call hides the call from XLA's loop-invariant code
motion: what depends only on the parameters (rotary tables, weight layouts) is computed
again at every step inside the branch, 4 to 14% of a bench-model step on the CPU. A
`lax.while_loop` that calls the step unconditionally, then moves its index to the next
step that needs a call, keeps the step's body as a scan's and pays one cheap test per
step instead.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def in_range(num_steps: int, lo: Array, hi: Array) -> Array:
  """Steps lo..hi-1 as a (K,) bool mask."""
  steps_K = jnp.arange(num_steps)
  return (steps_K >= lo) & (steps_K < hi)


def next_needed(needs: Callable[[Any, Array], Array], num_steps: int, carry, start: Array):
  """The first step >= start that `needs(carry, step)`, or K if none does."""
  # `needs` never sees step K (both sides of & are evaluated): plans index by step, and
  # without jit (jax.disable_jit) a numpy plan would raise where XLA would clamp.
  in_plan = lambda i: jnp.minimum(i, num_steps - 1)
  return jax.lax.while_loop(lambda i: (i < num_steps) & ~needs(carry, in_plan(i)),
                            lambda i: i + 1, jnp.asarray(start, jnp.int32))


def loop(step: Callable[[Any, Array], Any], needs: Callable[[Any, Array], Array],
         num_steps: int, carry, *, skip_range: Callable[[Any, Array, Array], Any] | None = None,
         record: Callable[[Any], Any] | None = None):
  """`carry = step(carry, i)` for the steps i in 0..K-1 where `needs(carry, i)`.

  A step that is not needed must be one `step` would leave the carry unchanged at, so
  jumping over it changes nothing; `skip_range(carry, lo, hi)` does the bookkeeping of the
  steps lo..hi-1 jumped over (counters). `record(carry)`, when given, is stacked per step
  as a scan would stack it (a jumped step records the carry as it stands).
  Returns (carry, records with leading axis K, or None).
  """
  skip_range = skip_range or (lambda carry, lo, hi: carry)
  first = next_needed(needs, num_steps, carry, 0)
  carry = skip_range(carry, jnp.int32(0), first)
  records = None
  if record is not None:
    records = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_steps,) + x.shape), record(carry))

  def fill(records, carry, lo, hi):
    if records is None:
      return None
    mask_K = in_range(num_steps, lo, hi)
    return jax.tree.map(
        lambda r, x: jnp.where(mask_K.reshape((-1,) + (1,) * x.ndim), x[None], r),
        records, record(carry))

  def body(state):
    i, carry, records = state
    carry = step(carry, i)
    following = next_needed(needs, num_steps, carry, i + 1)
    return following, skip_range(carry, i + 1, following), fill(records, carry, i, following)

  _, carry, records = jax.lax.while_loop(lambda state: state[0] < num_steps, body,
                                         (first, carry, records))
  return carry, records


def call_if(pred: Array, fn: Callable[[], Any], otherwise):
  """`fn()` where `pred`, else `otherwise` (same structure): `lax.cond(pred, fn, ...)` as
  a while loop of zero or one trip, whose body XLA's loop-invariant code motion sees into
  (a branch's it does not), so the parameter-only work of a denoiser call in `fn` is done
  once per program instead of once per call."""
  _, out = jax.lax.while_loop(lambda state: state[0], lambda state: (jnp.bool_(False), fn()),
                              (jnp.asarray(pred, jnp.bool_), otherwise))
  return out
