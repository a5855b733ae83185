"""KV-cached block decoding: the cached denoiser contract, its recompute adapter, the plan.

A denoiser offers the cached contract beside the plain one when its `Denoiser` value has
two passes (mdjax's Transformer has them: `models.make_apply_fn`):

  prefill(params, tokens_BxL, t_B) -> (logits_BxLxV, cache)
  decode(params, cache, tokens_BxW, start, t_B) -> (logits_BxWxV, cache)

With `kv_cache="dual"` (Fast-dLLM's DualCache) a family that decodes in blocks runs one
full pass (prefill) at the first step of each block, and every `refresh_every` steps
after it: that refreshes the cache and gives the step's logits. The block's other steps
run the denoiser on the block's W = block_length positions only (decode): their queries
attend to the cached keys and values of the prefix and the suffix, as last refreshed,
and to their own fresh ones.

With `kv_cache="exact"` on a block-causal denoiser (`Denoiser.block_size`, a Transformer
with `block_size`, or `diffusion.block_causal` of an oracle) the cache is exact: finished
blocks' keys and values never depend on later positions, and a block's queries see no
later block. One full pass at the first step fills the prompt's keys; at the first step of
every later block one pass over [finished block, current block] (2W positions) appends the
finished block's keys and values and gives the step's logits; the other steps run on the
block's W positions. The tokens are those of the same sampler without the cache on the
same block-causal model. The sampler's blocks must be whole model blocks, aligned with
them (block_length and the prompt length multiples of the model's block size).

What is exact: with `refresh_every=1` every step is a full pass, so the tokens are the
uncached sampler's; with `recompute_cache(apply_fn)` (any plain denoiser: exact oracles,
stubs) the window pass recomputes the full canvas, so again the tokens are the uncached
sampler's. What is approximate: between refreshes, the prefix and suffix keys and values
of a bidirectional model do not see the tokens the block wrote since the last refresh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.sampling import semi_autoregressive, skipping
from mdjax.sampling.base import BoundDenoiser, Canvas, Family, check

Array = jax.Array


@struct.dataclass
class KVPlan:
  """Per step (leading axis K): whether the step runs a full pass, and its window."""

  refresh: Array  # bool: a full pass that refreshes the cache
  start: Array  # int32: first position of the step's block (the window)
  # kv_cache="exact": bool, the first step of a block after the first (append the finished
  # block's keys); None for the dual cache.
  append: Array | None = None
  # A caller who knows that no row refreshes, appends or owes a refresh at this step (a
  # served lane: rows at different steps share a program, where a per-row choice would run
  # both passes) runs the window pass alone (static).
  window_only: bool = struct.field(pytree_node=False, default=False)
  # A caller who knows that every row refreshes or owes a refresh at this step, on the dual
  # cache (which appends nothing: its only other pass is the window), runs the full pass
  # alone (static; a served lane's rows that refresh, stepped in a program of their own).
  full_only: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class KVState:
  """The cache carried across steps."""

  cache: Any  # the denoiser's cache pytree, as its prefill returned it
  stale: Array  # a planned refresh was skipped (an idle step): the next call refreshes


def offers_cache(apply_fn) -> bool:
  """Whether the denoiser (a `Denoiser` or a function) meets the cached contract."""
  return Denoiser.of(apply_fn).offers_cache


_ADAPTERS: dict[Denoiser, Denoiser] = {}


def recompute_cache(apply_fn) -> Denoiser:
  """Any plain denoiser as a cached one that recomputes the full canvas.

  Its cache is the canvas itself: a window pass writes the window's tokens into it and
  runs the denoiser on the whole, so the cached sampler equals the uncached one token for
  token (no saving: for exact oracles and tests). One adapter per denoiser, so repeated
  calls reuse the compiled program.
  """
  plain = Denoiser.of(apply_fn)
  if plain.offers_cache:
    return plain
  adapter = _ADAPTERS.get(plain)
  if adapter is None:

    def prefill(params, tokens_BxL, t_B, valid_BxL=None):
      return plain(params, tokens_BxL, t_B, valid_BxL), tokens_BxL

    def decode(params, canvas_BxL, tokens_BxW, start, t_B, valid_BxL=None):
      canvas_BxL = jax.lax.dynamic_update_slice_in_dim(canvas_BxL, tokens_BxW, start, axis=1)
      logits_BxLxV = plain(params, canvas_BxL, t_B, valid_BxL)
      width = tokens_BxW.shape[1]
      return jax.lax.dynamic_slice_in_dim(logits_BxLxV, start, width, axis=1), canvas_BxL

    adapter = dataclasses.replace(plain, prefill=prefill, decode=decode)
    _ADAPTERS[plain] = adapter
  return adapter


# ----------------------------------------------------------------------------
# Host side: checks and the plan, before tracing.
# ----------------------------------------------------------------------------


def plan(denoiser: Denoiser, family: Family, spec, canvas: Canvas) -> KVPlan | None:
  """The refresh plan of a cached spec (None without a cache), after checking the call."""
  if spec.kv_cache == "none":
    return None
  name = type(spec).__name__
  if not family.decodes_blocks:
    raise ValueError(f"kv_cache={spec.kv_cache!r} is invalid for {name}: the {family.name} "
                     "family decodes no blocks; a KV cache needs ancestral, confidence or "
                     "entropy-bounded decoding with block_length.")
  block_length = family.block_length(spec)
  check(block_length is not None, "block_length", block_length,
        f"kv_cache={spec.kv_cache!r} needs blocks: set block_length (the cached window)")
  if not denoiser.offers_cache:
    raise ValueError(f"kv_cache={spec.kv_cache!r}: apply_fn offers no cached contract "
                     "(Denoiser.prefill and Denoiser.decode); wrap a plain denoiser with "
                     "mdjax.sampling.recompute_cache(apply_fn) to run the cached sampler by "
                     "full recomputation (exact, no saving).")
  steps = family.num_steps(spec, canvas.length)
  num_blocks = semi_autoregressive.count(block_length, steps, canvas)
  span_start = _generation_start(canvas)
  per_block = steps // num_blocks
  j = np.arange(steps) % per_block
  block_K = semi_autoregressive.step_blocks(num_blocks, per_block)
  start = (span_start + block_K * block_length).astype(np.int32)
  if spec.kv_cache == "exact":
    _check_exact(denoiser, name, block_length, span_start)
    first = np.arange(steps) == 0
    # One block: the first pass fills the prompt's keys and no block is ever appended.
    append = (j == 0) & (block_K > 0) if num_blocks > 1 else None
    return KVPlan(refresh=first, start=start, append=append)
  every = spec.refresh_every or per_block
  return KVPlan(refresh=j % every == 0, start=start)


def _check_exact(denoiser: Denoiser, name: str, block_length: int, span_start: int) -> None:
  """kv_cache='exact' needs a block-causal denoiser whose blocks the sampler's tile."""
  model_block = denoiser.block_size
  if model_block is None:
    raise ValueError(f"kv_cache='exact' is invalid for {name} on this denoiser: it has no "
                     "block-causal attention (Denoiser.block_size is None), so finished "
                     "blocks' keys depend on later positions. Use a Transformer with "
                     "block_size, diffusion.block_causal(apply_fn, block_size) for an oracle, "
                     "or kv_cache='dual' (approximate).")
  check(block_length % model_block == 0, "block_length", block_length,
        f"kv_cache='exact' needs a multiple of the model's block size {model_block}")
  if span_start % model_block:
    raise ValueError(f"the prompt holds {span_start} positions; kv_cache='exact' needs the "
                     f"generation to start on a model block boundary (a prompt length that "
                     f"is a multiple of the block size {model_block}).")


def check_exact_valid(denoiser: Denoiser, spec, canvas: Canvas, valid_BxL) -> None:
  """kv_cache='exact' with a validity mask: a block-causal model counts blocks from each
  row's first valid token, so every row's valid prompt must fill whole blocks."""
  if spec.kv_cache != "exact" or valid_BxL is None or isinstance(valid_BxL, jax.core.Tracer):
    return  # (a traced mask cannot be read before the run)
  valid = np.asarray(valid_BxL).astype(bool)
  prompt_B = valid[:, :_generation_start(canvas)].sum(-1)
  block = denoiser.block_size
  if (prompt_B % block).any():
    raise ValueError(f"valid_BxL leaves valid prompts of {sorted(set(prompt_B.tolist()))} "
                     f"positions; kv_cache='exact' needs each a multiple of the model's block "
                     f"size {block}.")


def _generation_start(canvas: Canvas) -> int:
  """First generated position: the cached window is a static-size slice, so the
  generated positions must be one span, the same in every row."""
  editable_BxL = ~canvas.fixed
  span = np.flatnonzero(editable_BxL[0])
  contiguous = span.size and span[-1] - span[0] + 1 == span.size
  if not contiguous or (editable_BxL != editable_BxL[0]).any():
    rows = [np.flatnonzero(row).tolist() for row in editable_BxL[:2]]
    raise ValueError(f"fixed_BxL leaves editable positions {rows} (first rows); a KV cache "
                     "needs the generated positions to be one span shared by every row (a "
                     "prompt, the generation, then an optional fixed suffix).")
  return int(span[0])


# ----------------------------------------------------------------------------
# In the program.
# ----------------------------------------------------------------------------


def init(denoiser: BoundDenoiser, tokens_BxL: Array) -> KVState:
  """An empty cache of the prefill's shapes, marked stale so the first call refreshes."""
  denoiser = BoundDenoiser.of(denoiser)
  t_B = jnp.ones(tokens_BxL.shape[:1], jnp.float32)
  _, cache = jax.eval_shape(denoiser.prefill, tokens_BxL, t_B)
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), cache)
  return KVState(cache=cache, stale=jnp.array(True))


def call(denoiser: BoundDenoiser, state: KVState, tokens_BxL: Array, t, kv_plan: KVPlan,
         width: int) -> tuple[Array, KVState]:
  """This step's logits_BxLxV: a full pass that refreshes the cache, or a window pass.

  A window pass gives logits only on its W positions; the others are zeros (a step
  writes only inside its block). The window's fresh keys and values are not kept:
  the block is recomputed at each of its steps, and the prefix and suffix stay as
  refreshed.
  """
  denoiser = BoundDenoiser.of(denoiser)
  t_B = jnp.full(tokens_BxL.shape[:1], t, jnp.float32)

  def on_canvas(logits_BxWxV):
    """The block's logits at their positions of the canvas, zeros elsewhere."""
    batch, length = tokens_BxL.shape
    zeros_BxLxV = jnp.zeros((batch, length, logits_BxWxV.shape[-1]), logits_BxWxV.dtype)
    return jax.lax.dynamic_update_slice_in_dim(zeros_BxLxV, logits_BxWxV, kv_plan.start, axis=1)

  def full():
    logits_BxLxV, cache = denoiser.prefill(tokens_BxL, t_B)
    return logits_BxLxV, KVState(cache=cache, stale=jnp.array(False))

  def window():
    tokens_BxW = jax.lax.dynamic_slice_in_dim(tokens_BxL, kv_plan.start, width, axis=1)
    logits_BxWxV, _ = denoiser.decode(state.cache, tokens_BxW, kv_plan.start, t_B)
    return on_canvas(logits_BxWxV), state

  if kv_plan.window_only:
    return window()
  if kv_plan.full_only:
    if kv_plan.append is not None:  # an append is not a full pass: both run exactly
      raise ValueError("KVPlan.full_only is for the dual cache; the exact cache's rows may "
                       "append instead, so its plan chooses the pass per row.")
    return full()
  if kv_plan.append is None:
    return jax.lax.cond(kv_plan.refresh | state.stale, full, window)

  def append_and_window():
    # The finished block and the current one in one pass: the finished block's queries
    # see no later block (block-causal), so its fresh keys are final; keep them.
    begin = kv_plan.start - width
    tokens_Bx2W = jax.lax.dynamic_slice_in_dim(tokens_BxL, begin, 2 * width, axis=1)
    logits_Bx2WxV, cache = denoiser.decode(state.cache, tokens_Bx2W, begin, t_B)
    return on_canvas(logits_Bx2WxV[:, width:]), KVState(cache=cache, stale=jnp.array(False))

  branch = jnp.where(kv_plan.refresh | state.stale, 0, jnp.where(kv_plan.append, 1, 2))
  return jax.lax.switch(branch, [full, append_and_window, window])


def needs_full(state: KVState, kv_plan: KVPlan) -> Array:
  """Whether the step of `kv_plan` (one step's slice) makes more than a window pass: a
  refresh, an append, or a refresh owed."""
  owed = kv_plan.refresh | state.stale
  return owed if kv_plan.append is None else owed | kv_plan.append


def skipped(state: KVState, kv_plan: KVPlan) -> KVState:
  """The state after a step whose call was skipped: a skipped refresh is owed (a skipped
  append too: the next call makes a full pass, which is exact on a block-causal model)."""
  owed = kv_plan.refresh if kv_plan.append is None else kv_plan.refresh | kv_plan.append
  return state.replace(stale=state.stale | owed)


def skip_steps(state: KVState | None, kv_plan_K: KVPlan | None, lo: Array,
               hi: Array) -> KVState | None:
  """The state after the steps lo..hi-1 were jumped over (per-step plans `kv_plan_K`): a
  refresh or append planned at any of them is owed, as at one skipped step. None without
  a cache."""
  if state is None:
    return None
  in_range_K = skipping.in_range(kv_plan_K.refresh.shape[0], lo, hi)
  owed = lambda x_K: None if x_K is None else jnp.any(x_K & in_range_K)
  return skipped(state, kv_plan_K.replace(refresh=owed(kv_plan_K.refresh),
                                          append=owed(kv_plan_K.append)))
