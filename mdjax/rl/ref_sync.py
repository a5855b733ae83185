"""d1's reference-model sync (`sync_ref_model`, `ref_model_sync_steps`,
`ref_model_mixup_alpha`): TRL's `SyncRefModelCallback` (trl/trainer/callbacks.py at d1's
pinned commit 0f88c17), from TR-DPO. After every `every`-th optimizer update (TRL's
`global_step`, which counts updates: with d1's inner loop, `num_iterations` of them per
rollout batch) the reference moves toward the policy just updated:

    ref <- alpha * policy + (1 - alpha) * ref

Here it is an optax transformation chained after the optimizer (its state: the update count
and the reference parameters), which passes the updates through unchanged. The checkpoint
keeps the optimizer's own state, so that `mdjax.load` reads the workdir as any other; the
synced reference is saved beside it (`FOLDER/<step>.npz`, written with each checkpoint and
pruned with them) and read back on resume, so a resumed run continues it bit for bit.

TRL skips the sync where it has no reference model: with PEFT (the reference is the base with
the adapters off; so d1's own runs, LoRA with sync_ref_model True, never sync) and with
beta = 0. The trainer refuses both settings rather than ignore the knob.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

Array = jax.Array

FOLDER = "ref_sync"  # in the workdir, beside checkpoints/


class RefSyncState(NamedTuple):
  count: Array  # optimizer updates made so far (TRL's global_step)
  ref_params: Any  # the reference, synced every `every` updates


def ref_sync(alpha: float, every: int) -> optax.GradientTransformation:
  """The sync as the last link of an optimizer chain (module docstring): `init(params)` takes
  the start as the reference; `update` returns the updates unchanged and, on every `every`-th
  update, mixes the updated parameters (params + updates) into the reference."""
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha={alpha!r} must be in [0, 1].")
  if not (isinstance(every, int) and every >= 1):
    raise ValueError(f"every={every!r} must be an integer >= 1.")

  def init(params):
    return RefSyncState(count=jnp.zeros((), jnp.int32),
                        ref_params=jax.tree.map(lambda p: jnp.array(p, copy=True), params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("ref_sync needs the parameters (optimizer.update(grads, state, params)).")
    count = state.count + 1
    due = count % every == 0

    def mix(ref, param, step):
      mixed = alpha * (param + step).astype(ref.dtype) + (1.0 - alpha) * ref
      return jnp.where(due, mixed, ref)

    ref = jax.tree.map(mix, state.ref_params, params, updates)
    return updates, RefSyncState(count=count, ref_params=ref)

  return optax.GradientTransformation(init, update)


def with_ref_sync(optimizer: optax.GradientTransformation, alpha: float, every: int
                  ) -> optax.GradientTransformation:
  """`optimizer`, then the sync: its state is (optimizer's state, RefSyncState)."""
  return optax.chain(optimizer, ref_sync(alpha, every))


def reference_of(opt_state) -> Any:
  """The synced reference parameters held by a `with_ref_sync` optimizer's state."""
  sync_state = opt_state[-1]
  if not isinstance(sync_state, RefSyncState):
    raise ValueError("this optimizer state has no synced reference (with_ref_sync).")
  return sync_state.ref_params


def _path(workdir: str, step: int) -> str:
  return os.path.join(workdir, FOLDER, f"{int(step)}.npz")


def save(workdir: str, step: int, state: RefSyncState) -> None:
  """Writes the sync state of checkpoint `step`, atomically (before the checkpoint itself:
  a checkpoint never lacks its reference)."""
  os.makedirs(os.path.join(workdir, FOLDER), exist_ok=True)
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(state.ref_params)]
  partial = _path(workdir, step) + ".partial.npz"
  np.savez(partial, count=np.asarray(state.count), **{f"leaf{i}": x for i, x in
                                                       enumerate(leaves)})
  os.replace(partial, _path(workdir, step))


def prune(workdir: str, keep_steps) -> None:
  """Removes the sync states of steps not in `keep_steps` (the checkpoints kept)."""
  folder = os.path.join(workdir, FOLDER)
  keep = {int(s) for s in keep_steps}
  for name in os.listdir(folder) if os.path.isdir(folder) else ():
    stem = name[:-len(".npz")] if name.endswith(".npz") else None
    if stem is not None and stem.isdigit() and int(stem) not in keep:
      os.remove(os.path.join(folder, name))


def load(workdir: str, step: int, params_like) -> RefSyncState:
  """The sync state saved with checkpoint `step`, its reference shaped as `params_like`; a
  ValueError when the file is missing (the run cannot continue its reference)."""
  path = _path(workdir, step)
  if not os.path.exists(path):
    raise ValueError(f"workdir={workdir!r}: checkpoint step {step} has no synced reference "
                     f"({path}); rl.sync_ref_model cannot resume it: use another workdir.")
  with np.load(path) as saved:
    leaves, treedef = jax.tree.flatten(params_like)
    ref = [jnp.asarray(saved[f"leaf{i}"], leaf.dtype) for i, leaf in enumerate(leaves)]
    return RefSyncState(count=jnp.asarray(saved["count"], jnp.int32),
                        ref_params=jax.tree.unflatten(treedef, ref))
