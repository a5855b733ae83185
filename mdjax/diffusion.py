"""Masked (absorbing-state) diffusion core: schedules, forward masking, losses.

Everything here is a pure function of arrays and static values, safe under
`jax.jit`, `jax.vmap` and `jax.grad`.

Time runs from t = 0 (clean data) to t = 1 (everything masked). A schedule
gives the probability alpha(t) that a token is still visible at time t.

The denoiser contract used by the losses and every sampler:

    apply_fn(params, tokens_BxL, t_B) -> logits_BxLxV

where V is the real vocabulary size and the mask id is V (never predicted).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser

Array = jax.Array
ApplyFn = Callable[[Any, Array, Array], Array]

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------
# Masking schedules.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """A masking schedule alpha(t) with alpha(0) = 1 and alpha(1) = eps.

  Methods take jax arrays (traced or not) or numpy / Python numbers; the
  latter are computed in float64 with numpy, for plans made before tracing.

  Subclasses define the base schedule through `_one_minus_alpha_base` (1 -
  alpha, computed directly so it stays accurate near t = 0) and
  `_weight_base` (-alpha'/(1 - alpha), computed in closed form so it stays
  finite and accurate near both ends). The optional clamp `eps` keeps a
  fraction eps of tokens visible at t = 1 (MDLM's convention):
  1 - alpha(t) = (1 - eps) * (1 - alpha_base(t)). The clamp cancels in the
  loss weight, so w(t) is the base schedule's.
  """

  eps: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.eps < 1.0:
      raise ValueError(f"eps={self.eps!r} must lie in [0, 1).")

  # Base schedule (eps = 0); subclasses override.
  def _one_minus_alpha_base(self, t, xp):
    raise NotImplementedError

  def _dalpha_base(self, t, xp):
    raise NotImplementedError

  def _weight_base(self, t, xp):
    return -self._dalpha_base(t, xp) / self._one_minus_alpha_base(t, xp)

  def one_minus_alpha(self, t) -> Array:
    """1 - alpha(t): the probability that a token is masked at time t."""
    t, xp = _as_time(t)
    return (1.0 - self.eps) * self._one_minus_alpha_base(t, xp)

  def alpha(self, t) -> Array:
    """alpha(t): the probability that a token is still visible at time t."""
    return 1.0 - self.one_minus_alpha(t)

  def dalpha(self, t) -> Array:
    """alpha'(t) (non-positive)."""
    t, xp = _as_time(t)
    return (1.0 - self.eps) * self._dalpha_base(t, xp)

  def weight(self, t) -> Array:
    """Loss weight w(t) = -alpha'(t) / (1 - alpha(t)) >= 0."""
    t, xp = _as_time(t)
    return self._weight_base(t, xp)


def _as_time(t):
  """Times as float arrays: numpy float64 for host plans, else jax arrays."""
  if isinstance(t, (np.ndarray, np.floating, float, int)):
    return np.asarray(t, np.float64), np
  return jnp.asarray(t, jnp.result_type(float)), jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearSchedule(Schedule):
  """alpha(t) = 1 - t; w(t) = 1/t."""

  def _one_minus_alpha_base(self, t, xp):
    return t

  def _dalpha_base(self, t, xp):
    return -xp.ones_like(t)

  def _weight_base(self, t, xp):
    return 1.0 / t


@dataclasses.dataclass(frozen=True, kw_only=True)
class CosineSchedule(Schedule):
  """alpha(t) = 1 - cos(pi/2 (1 - t)) = 1 - sin(pi t / 2)."""

  def _one_minus_alpha_base(self, t, xp):
    return xp.sin(0.5 * xp.pi * t)

  def _dalpha_base(self, t, xp):
    # cos(pi t/2) written as sin(pi (1-t)/2), so it is exactly 0 at t = 1.
    return -0.5 * xp.pi * xp.sin(0.5 * xp.pi * (1.0 - t))

  def _weight_base(self, t, xp):
    return 0.5 * xp.pi * xp.sin(0.5 * xp.pi * (1.0 - t)) / xp.sin(0.5 * xp.pi * t)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolynomialSchedule(Schedule):
  """alpha(t) = 1 - t**power; w(t) = power / t."""

  power: float = 2.0

  def __post_init__(self):
    super().__post_init__()
    if not self.power > 0:
      raise ValueError(f"power={self.power!r} must be > 0.")

  def _one_minus_alpha_base(self, t, xp):
    return t**self.power

  def _dalpha_base(self, t, xp):
    return -self.power * t ** (self.power - 1.0)

  def _weight_base(self, t, xp):
    return self.power / t


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogLinearSchedule(LinearSchedule):
  """MDLM's log-linear noise: sigma(t) = -log(1 - (1 - eps) t), alpha = e^-sigma.

  This is alpha(t) = 1 - (1 - eps) t: the linear schedule with MDLM's default
  clamp eps = 1e-3 (a fraction eps of tokens stays visible at t = 1).
  """

  eps: float = 1e-3


SCHEDULES: dict[str, type[Schedule]] = {
    "linear": LinearSchedule,
    "cosine": CosineSchedule,
    "polynomial": PolynomialSchedule,
    "loglinear": LogLinearSchedule,
}


def get_schedule(name: str, **kwargs) -> Schedule:
  """Builds a schedule by name, e.g. `get_schedule('polynomial', power=3)`."""
  if name not in SCHEDULES:
    raise ValueError(
        f"schedule={name!r} is unknown; known schedules: {sorted(SCHEDULES)}."
    )
  return SCHEDULES[name](**kwargs)


def as_schedule(value, field: str = "schedule") -> Schedule:
  """A Schedule as given, or one built from its name ('linear', 'cosine', ...)."""
  if isinstance(value, Schedule):
    return value
  if isinstance(value, str):
    if value not in SCHEDULES:
      raise ValueError(f"{field}={value!r} is unknown; known schedules: {sorted(SCHEDULES)}.")
    return SCHEDULES[value]()
  raise ValueError(f"{field}={value!r} must be a diffusion.Schedule or one of the names "
                   f"{sorted(SCHEDULES)}.")


# ----------------------------------------------------------------------------
# Forward process q(z_t | x).
# ----------------------------------------------------------------------------


def forward_mask(
    key: Array,
    x_BxL: Array,
    alpha_B: Array,
    mask_id: int,
    maskable_BxL: Array | None = None,
) -> Array:
  """Draws z_t ~ q(z_t | x): each maskable position kept with prob alpha(t)."""
  keep_BxL = jax.random.uniform(key, x_BxL.shape) < alpha_B[:, None]
  if maskable_BxL is not None:
    keep_BxL = keep_BxL | ~maskable_BxL
  return jnp.where(keep_BxL, x_BxL, mask_id)


def stratified_times(key: Array, batch: int, t_min: float = 1e-5) -> Array:
  """Antithetic times t_b = (u + b/B) mod 1, mapped into [t_min, 1]."""
  u = jax.random.uniform(key, ())
  t_B = jnp.mod(u + jnp.arange(batch) / batch, 1.0)
  return t_min + (1.0 - t_min) * t_B


def _token_nll(logits_BxLxV: Array, x_BxL: Array) -> Array:
  """-log p(x_i) at every position; logits may hold -inf for impossible ids."""
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_BxLxV, x_BxL[..., None], axis=-1)[..., 0]


def nelbo_loss(
    apply_fn: ApplyFn,
    params: Any,
    key: Array,
    x_BxL: Array,
    *,
    schedule: Schedule,
    mask_id: int,
    maskable_BxL: Array | None = None,
    num_steps: int = 0,
    t_min: float = 1e-5,
    per_token: bool = False,
) -> tuple[Array, dict[str, Array]]:
  """MD4 negative ELBO of a batch, in nats per sequence.

  Continuous time (`num_steps=0`): E_t[w(t) sum_{masked i} -log p(x_i | z_t)]
  with antithetic t across the batch. Discrete time (`num_steps=T`): t is the
  end of one of T equal intervals [s, t], drawn stratified, and the weight is
  T (alpha(s) - alpha(t)) / (1 - alpha(t)), an unbiased estimate of the sum
  of the T interval terms. Visible positions contribute nothing (SUBS).

  `maskable_BxL` (bool, default all True) marks the positions the forward
  process may mask; the others (a prompt, padding) stay visible at every t, so
  the loss is the NELBO of the maskable tokens given them.

  `per_token=True` divides each row's NELBO by its number of maskable positions before the
  batch mean (LLaDA's SFT loss, normalized by the response length): the loss is then in nats
  per maskable token, rows of every length weighing the same; aux is unchanged.

  Returns (loss, aux): loss is the batch-mean NELBO in nats per sequence; aux
  holds `nelbo_nats` (same), `nelbo_nats_B` (per sequence, for error bars),
  `bits_per_token` and `masked_fraction` (both per maskable position).
  """
  schedule = as_schedule(schedule)
  if not isinstance(mask_id, (int, np.integer)) or isinstance(mask_id, bool) or mask_id < 1:
    raise ValueError(f"mask_id={mask_id!r} must be an integer >= 1 (the vocabulary size V).")
  if not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
    raise ValueError(f"num_steps={num_steps!r} must be 0 (continuous time) or an integer >= 1.")
  if not isinstance(per_token, bool):
    raise ValueError(f"per_token={per_token!r} must be True or False.")
  batch, _ = x_BxL.shape
  if maskable_BxL is None:
    maskable_BxL = jnp.ones(x_BxL.shape, bool)
  time_key, mask_key = jax.random.split(key)
  u_B = stratified_times(time_key, batch, t_min)
  if num_steps:
    # Interval index i in {1..T}: t = i/T, s = (i-1)/T.
    i_B = jnp.clip(jnp.ceil(u_B * num_steps), 1, num_steps)
    t_B, s_B = i_B / num_steps, (i_B - 1) / num_steps
    oma_t, oma_s = schedule.one_minus_alpha(t_B), schedule.one_minus_alpha(s_B)
    weight_B = num_steps * (oma_t - oma_s) / oma_t
  else:
    t_B = u_B
    weight_B = schedule.weight(t_B)
  z_BxL = forward_mask(mask_key, x_BxL, schedule.alpha(t_B), mask_id, maskable_BxL)
  logits_BxLxV = apply_fn(params, z_BxL, t_B)
  masked_BxL, nll_BxL = masked_nll(logits_BxLxV, x_BxL, z_BxL, mask_id)
  nelbo_B = weight_B * nll_BxL.sum(axis=-1)
  loss, aux = _nelbo_result(nelbo_B, masked_BxL, maskable_BxL)
  if per_token:
    loss = (nelbo_B / jnp.maximum(maskable_BxL.sum(axis=-1), 1)).mean()
  return loss, aux


def masked_nll(logits_BxLxV, x_BxL, z_BxL, mask_id: int):
  """(masked_BxL, nll_BxL): the masked positions and their -log p(x), 0 elsewhere."""
  if logits_BxLxV.shape[-1] != mask_id:  # a static shape: raised while tracing
    raise ValueError(f"mask_id={mask_id} but apply_fn returns {logits_BxLxV.shape[-1]} logits "
                     "per position; the mask id is the vocabulary size V (logits over the V "
                     "tokens, the mask class excluded).")
  masked_BxL = z_BxL == mask_id
  return masked_BxL, jnp.where(masked_BxL, _token_nll(logits_BxLxV, x_BxL), 0.0)


def _nelbo_result(nelbo_B, masked_BxL, maskable_BxL):
  """(loss, aux) of a per-sequence NELBO: its mean, and bits per maskable token."""
  loss = nelbo_B.mean()
  tokens = jnp.maximum(maskable_BxL.sum(), 1)
  aux = {
      "nelbo_nats": loss,
      "nelbo_nats_B": nelbo_B,
      "bits_per_token": nelbo_B.sum() / tokens / LN2,
      "masked_fraction": masked_BxL.sum() / tokens,
  }
  return loss, aux


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlmCorruption:
  """Knobs of the BERT-style MLM corruption objective.

  Per example a ratio r ~ U[0, 1] of the maskable positions is selected. Of
  the selected positions `mask_prob` become the mask id, `random_prob` a
  uniformly random token and the rest stay unchanged; an example is eligible
  for random tokens with probability `random_eligible_prob` (otherwise its
  random share is masked too); with probability `full_mask_prob` an example is
  fully masked (r = 1, every selected position masked). With probability
  `low_ratio_prob` a (not fully masked) example draws r ~ U[0, low_ratio_max]
  instead: lightly masked states, where a target's whole context is visible,
  become more frequent (the default 0 keeps r ~ U[0, 1]).
  """

  mask_prob: float = 0.8
  random_prob: float = 0.1
  random_eligible_prob: float = 0.5
  full_mask_prob: float = 0.1
  low_ratio_prob: float = 0.0
  low_ratio_max: float = 0.3

  def __post_init__(self):
    for name in ("mask_prob", "random_prob", "random_eligible_prob", "full_mask_prob",
                 "low_ratio_prob", "low_ratio_max"):
      value = getattr(self, name)
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r} must lie in [0, 1].")
    if self.mask_prob + self.random_prob > 1.0:
      raise ValueError(
          f"mask_prob + random_prob = {self.mask_prob + self.random_prob!r} "
          "must be at most 1."
      )


def mlm_corrupt(
    key: Array,
    x_BxL: Array,
    *,
    vocab_size: int,
    mask_id: int,
    corruption: MlmCorruption = MlmCorruption(),
    maskable_BxL: Array | None = None,
) -> tuple[Array, Array]:
  """Returns (corrupted tokens, selected positions) of the MLM objective."""
  batch, length = x_BxL.shape
  if maskable_BxL is None:
    maskable_BxL = jnp.ones(x_BxL.shape, bool)
  k_ratio, k_full, k_elig, k_sel, k_kind, k_rand = jax.random.split(key, 6)
  full_B = jax.random.uniform(k_full, (batch,)) < corruption.full_mask_prob
  # A separate stream for the low-ratio choice keeps the default's draws unchanged.
  low_B = jax.random.uniform(jax.random.fold_in(key, 7), (batch,)) < corruption.low_ratio_prob
  ratio_scale_B = jnp.where(low_B, corruption.low_ratio_max, 1.0)
  ratio_B = jnp.where(full_B, 1.0, jax.random.uniform(k_ratio, (batch,)) * ratio_scale_B)
  selected_BxL = maskable_BxL & (
      jax.random.uniform(k_sel, (batch, length)) < ratio_B[:, None]
  )
  eligible_B = (jax.random.uniform(k_elig, (batch,)) < corruption.random_eligible_prob) & ~full_B
  kind_BxL = jax.random.uniform(k_kind, (batch, length))
  to_random_BxL = (
      eligible_B[:, None]
      & (kind_BxL >= corruption.mask_prob)
      & (kind_BxL < corruption.mask_prob + corruption.random_prob)
  )
  # Non-eligible (and fully masked) examples mask their random share too.
  keep_share = 1.0 - corruption.mask_prob - corruption.random_prob
  to_mask_BxL = (kind_BxL < 1.0 - keep_share) & ~to_random_BxL
  to_mask_BxL = to_mask_BxL | full_B[:, None]
  random_BxL = jax.random.randint(k_rand, x_BxL.shape, 0, vocab_size, x_BxL.dtype)
  z_BxL = jnp.where(selected_BxL & to_mask_BxL, mask_id, x_BxL)
  z_BxL = jnp.where(selected_BxL & to_random_BxL, random_BxL, z_BxL)
  return z_BxL, selected_BxL


def mlm_loss(
    apply_fn: ApplyFn,
    params: Any,
    key: Array,
    x_BxL: Array,
    *,
    vocab_size: int,
    mask_id: int,
    corruption: MlmCorruption = MlmCorruption(),
    maskable_BxL: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """MLM corruption objective: mean cross-entropy over the selected positions.

  The denoiser is called with t = the per-example selected fraction.
  """
  z_BxL, selected_BxL = mlm_corrupt(
      key, x_BxL, vocab_size=vocab_size, mask_id=mask_id,
      corruption=corruption, maskable_BxL=maskable_BxL,
  )
  if maskable_BxL is None:
    maskable_BxL = jnp.ones(x_BxL.shape, bool)
  t_B = selected_BxL.sum(-1) / jnp.maximum(maskable_BxL.sum(-1), 1)
  logits_BxLxV = apply_fn(params, z_BxL, t_B)
  nll_BxL = _token_nll(logits_BxLxV, x_BxL)
  count = jnp.maximum(selected_BxL.sum(), 1)
  loss = jnp.where(selected_BxL, nll_BxL, 0.0).sum() / count
  aux = {
      "mlm_nats_per_token": loss,
      "selected_fraction": selected_BxL.sum() / jnp.maximum(maskable_BxL.sum(), 1),
      "masked_fraction": (z_BxL == mask_id).sum() / jnp.maximum(maskable_BxL.sum(), 1),
  }
  return loss, aux


def causal_lm_loss(
    apply_fn: ApplyFn,
    params: Any,
    key: Array,
    x_BxL: Array,
    *,
    start_id: int,
) -> tuple[Array, dict[str, Array]]:
  """Next-token cross-entropy of a causal model, in nats per token.

  Position i sees `start_id`, x_0 .. x_{i-1} (the inputs shifted right by one), so the
  sum over positions is -log p(x) under the left-to-right factorisation. The model is
  called with t = 0. `key` is unused (the loss is deterministic).

  Returns (loss, aux): aux holds `nll_nats_B` (per sequence) and `bits_per_token`.
  """
  del key
  batch = x_BxL.shape[0]
  inputs_BxL = jnp.concatenate(
      [jnp.full((batch, 1), start_id, x_BxL.dtype), x_BxL[:, :-1]], axis=1)
  nll_BxL = _token_nll(apply_fn(params, inputs_BxL, jnp.zeros((batch,))), x_BxL)
  loss = nll_BxL.mean()
  return loss, {"nll_nats_B": nll_BxL.sum(-1), "bits_per_token": loss / LN2}


# ----------------------------------------------------------------------------
# Block diffusion (BD3-LM): blocks generated left to right, each by masked diffusion.
# ----------------------------------------------------------------------------


def check_block_size(block_size, length: int, field: str = "block_size") -> None:
  """A ValueError unless `block_size` is an integer >= 1 dividing the sequence length."""
  if not (isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool)
          and block_size >= 1 and length % block_size == 0):
    raise ValueError(f"{field}={block_size!r} must be an integer >= 1 that divides the "
                     f"sequence length {length}.")


def block_times(key: Array, batch: int, num_blocks: int, *, t_min: float = 1e-5,
                t_max: float = 1.0, antithetic: bool = True) -> Array:
  """One time per block, t_BxN in [t_min, t_max]: antithetic (stratified over all B x N
  blocks, as BD3-LM) or independent uniform draws. With N = 1 and t_max = 1 the antithetic
  times are `stratified_times(key, batch, t_min)`."""
  count = batch * num_blocks
  if antithetic:
    u = jax.random.uniform(key, ())
    u_BxN = jnp.mod(u + jnp.arange(count) / count, 1.0).reshape(batch, num_blocks)
  else:
    u_BxN = jax.random.uniform(key, (batch, num_blocks))
  return t_min + (t_max - t_min) * u_BxN


def _check_time_range(t_min, t_max) -> None:
  for name, value in (("t_min", t_min), ("t_max", t_max)):
    if not (isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
            and math.isfinite(value)):
      raise ValueError(f"{name}={value!r} must be a finite number in [0, 1].")
  if not 0.0 <= t_min < t_max <= 1.0:
    raise ValueError(f"(t_min, t_max)=({t_min!r}, {t_max!r}) must satisfy "
                     "0 <= t_min < t_max <= 1.")


def block_nelbo_loss(
    apply_fn: ApplyFn,
    params: Any,
    key: Array,
    x_BxL: Array,
    *,
    block_size: int,
    schedule: Schedule,
    mask_id: int,
    maskable_BxL: Array | None = None,
    t_min: float = 1e-5,
    t_max: float = 1.0,
    antithetic: bool = True,
) -> tuple[Array, dict[str, Array]]:
  """Block-diffusion (BD3-LM) negative ELBO of a batch, in nats per sequence.

  The sequence is cut into N = L / block_size blocks; -log p(x) = sum_b -log p(x_b | x_<b)
  and each term is bounded by MD4's NELBO of block b conditioned on the clean blocks
  before it: E_{t_b}[w(t_b) sum_{masked i in b} -log p(x_i | z_b, x_<b)], with one time
  per block. All blocks are trained by one denoiser pass over [noisy; clean]
  (its `Denoiser.block_pair(params, z_BxL, x_BxL, t_B)`: a block-causal Transformer, or an
  exact oracle through `block_causal`). block_size = L is `nelbo_loss` (the same draws for
  the same key); block_size = 1 is an unbiased estimate of the autoregressive NLL.

  Times are antithetic over the batch's B x N blocks (`antithetic=False`: independent).
  A clipped range (t_min, t_max) is BD3-LM's variance-reduction knob for training: the
  loss is then the weighted loss averaged over t ~ U[t_min, t_max], no longer a bound, so
  evaluate with the default range. The denoiser is told the row's mean block time
  (block-causal models are not time-conditioned; for N = 1 it is the block's time).

  Returns (loss, aux) with the keys of `nelbo_loss`.
  """
  schedule = as_schedule(schedule)
  if not isinstance(mask_id, (int, np.integer)) or isinstance(mask_id, bool) or mask_id < 1:
    raise ValueError(f"mask_id={mask_id!r} must be an integer >= 1 (the vocabulary size V).")
  batch, length = x_BxL.shape
  check_block_size(block_size, length)
  _check_time_range(t_min, t_max)
  if not isinstance(antithetic, bool):
    raise ValueError(f"antithetic={antithetic!r} must be True or False.")
  denoiser = Denoiser.of(apply_fn)
  if denoiser.block_pair is None:
    raise ValueError("apply_fn has no block_pair: the block NELBO needs a block-causal "
                     "denoiser (TransformerConfig.block_size, or diffusion.block_causal("
                     "apply_fn, block_size) for an exact oracle).")
  model_block = denoiser.block_size
  if model_block is not None and model_block != block_size:
    raise ValueError(f"block_size={block_size} but the denoiser is block-causal with blocks "
                     f"of {model_block}; they must match.")
  if maskable_BxL is None:
    maskable_BxL = jnp.ones(x_BxL.shape, bool)
  num_blocks = length // block_size
  time_key, mask_key = jax.random.split(key)
  t_BxN = block_times(time_key, batch, num_blocks, t_min=t_min, t_max=t_max,
                      antithetic=antithetic)
  alpha_BxL = jnp.repeat(schedule.alpha(t_BxN), block_size, axis=1)
  # The same draw as forward_mask, per position, so block_size = L is nelbo_loss.
  keep_BxL = (jax.random.uniform(mask_key, x_BxL.shape) < alpha_BxL) | ~maskable_BxL
  z_BxL = jnp.where(keep_BxL, x_BxL, mask_id)
  logits_BxLxV = denoiser.block_pair(params, z_BxL, x_BxL, t_BxN.mean(-1))
  masked_BxL, nll_BxL = masked_nll(logits_BxLxV, x_BxL, z_BxL, mask_id)
  nll_BxN = nll_BxL.reshape(batch, num_blocks, block_size).sum(-1)
  return _nelbo_result((schedule.weight(t_BxN) * nll_BxN).sum(-1), masked_BxL, maskable_BxL)


_BLOCK_ADAPTERS: dict[Any, Denoiser] = {}


def block_causal(apply_fn: ApplyFn, block_size: int) -> Denoiser:
  """A plain denoiser (an exact oracle) as the block-causal denoiser it implies.

  On a canvas, block b's logits are the denoiser's on the canvas with every later block
  masked: for an exact denoiser of the data law that is the exact conditional
  p(x_b | x_<b, z_b), later blocks marginalized. `.block_pair(params, noisy, clean, t_B)`
  gives noisy block b's logits on [clean blocks < b, noisy block b, masked after], the
  pass `block_nelbo_loss` needs. Each call evaluates N = L / block_size canvases per row
  in one batched call. One adapter per (apply_fn, block_size), so compiled programs are
  reused.
  """
  if not (isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool)
          and block_size >= 1):
    raise ValueError(f"block_size={block_size!r} must be an integer >= 1.")
  found = _BLOCK_ADAPTERS.get((apply_fn, block_size))
  if found is not None:
    return found

  def per_block(params, canvas_fn, length, t_B):
    """Logits of each block b from the canvas canvas_fn(b): one call on N x B canvases."""
    check_block_size(block_size, length)
    num_blocks = length // block_size
    canvases_NxBxL = jnp.stack([canvas_fn(b) for b in range(num_blocks)])
    n, batch = canvases_NxBxL.shape[:2]
    logits = apply_fn(params, canvases_NxBxL.reshape(n * batch, length), jnp.tile(t_B, n))
    logits_NxBxLxV = logits.reshape(n, batch, length, -1)
    block_L = np.arange(length) // block_size
    # Position i reads the canvas of its own block.
    return logits_NxBxLxV[block_L, :, np.arange(length)].transpose(1, 0, 2)

  def adapter(params, tokens_BxL, t_B):
    length = tokens_BxL.shape[1]
    block_L = jnp.arange(length) // block_size
    mask_id = _mask_id_of(apply_fn, params, tokens_BxL, t_B)
    return per_block(params, lambda b: jnp.where(block_L <= b, tokens_BxL, mask_id), length, t_B)

  def block_pair(params, noisy_BxL, clean_BxL, t_B):
    length = noisy_BxL.shape[1]
    block_L = jnp.arange(length) // block_size
    mask_id = _mask_id_of(apply_fn, params, noisy_BxL, t_B)
    canvas = lambda b: jnp.where(block_L < b, clean_BxL,
                                 jnp.where(block_L == b, noisy_BxL, mask_id))
    return per_block(params, canvas, length, t_B)

  denoiser = Denoiser(adapter, block_size=block_size, block_pair=block_pair)
  _BLOCK_ADAPTERS[(apply_fn, block_size)] = denoiser
  return denoiser


def _mask_id_of(apply_fn, params, tokens_BxL, t_B) -> int:
  """The mask id V: the denoiser's number of logits (a static shape)."""
  return int(jax.eval_shape(apply_fn, params, tokens_BxL, t_B).shape[-1])
