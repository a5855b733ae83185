"""Noise processes as values: absorbing (mask), uniform, and GIDD's hybrid of the two.

Every process here interpolates (GIDD, von Rütte et al. 2025, eq. 1): per position,

    q_t(z | x0) = alpha(t) [z = x0] + mask(t) [z = MASK] + uniform(t) / V   (z a token),

with alpha + mask + uniform = 1: a token is kept with probability alpha(t), else it is the
mask (mass `mask`) or a uniform draw over the V tokens (mass `uniform`, which may redraw x0).
States are the V tokens 0..V-1 and, for a process with a mask, the mask id V (S = V + 1
states; S = V without one). `coefficients(t)` gives (alpha, mask, uniform) and
`derivatives(t)` their time derivatives; everything else follows from them:

  marginal        q_t(. | x0 = w) over the S states, for a one-hot or any law w on the tokens;
  likelihood      q_t(z_i | x0_i = v) for every token v: a position's evidence about x0_i;
  corrupt         a draw z_t ~ q_t(. | x0);
  transition      q(x_t | x_s) for s < t: (alpha_t/alpha_s) [x_t = x_s] + n_st(x_t), with
                  n_st = noise_t - (alpha_t/alpha_s) noise_s (GIDD's q_{t|s});
  bridge          q(x_s | x_t, x0 = w), Bayes on the two above (UDLM/DUO's posterior for w);
  jump_rates      omega_t(z) = noise_t'(z) - (alpha'/alpha) noise_t(z): every state jumps to z
                  at rate omega_t(z) (GIDD's forward rate matrix alpha'/alpha I + omega 1^T);
  reverse_step    the exact per-position reverse step from a posterior p(x0_i | x_t).

The denoiser contract is the same for every process: `apply_fn(params, tokens_BxL, t_B)`
returns the posterior marginal p(x0_i | x_t) over the V tokens given the whole canvas, its own
position included. The exact reverse step is the mixture sum_v q(x_s | x_t, x0 = v) p(v | x_t).
Plugging the posterior itself into q(x_s | x_t, x0 = p), as UDLM/DUO write their sampler, is
not that mixture under uniform noise: it counts the position's own evidence twice, an error
that does not vanish as the steps grow. The mixture *is* the plug-in formula at the weights
p(v | x_t) / q_t(x_t,i | v), renormalised (`plugin_from_posterior`): the posterior with the
position's own evidence divided out. A network trained in the plug-in parameterisation is
mapped once, at its boundary (`posterior_from_plugin`).

Processes are frozen dataclasses (hashable: static jit arguments). Times are jax arrays (one
per row, `t_B`); methods are pure and jit-safe.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from mdjax import diffusion, errors

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseProcess:
  """An interpolating noise process over V tokens (module docstring); subclasses give
  `coefficients` and `derivatives`."""

  vocab_size: int
  schedule: diffusion.Schedule = diffusion.LinearSchedule()

  name: ClassVar[str] = ""
  has_mask: ClassVar[bool] = True

  def __post_init__(self):
    v = self.vocab_size
    errors.check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "vocab_size", v,
                 "an integer >= 1 (the real tokens; the mask id is vocab_size)")
    errors.check(isinstance(self.schedule, diffusion.Schedule), "schedule", self.schedule,
                 "a diffusion.Schedule (diffusion.as_schedule(name) builds one by name)")

  # Per process: (alpha, mask, uniform) of shape B each, and their time derivatives.
  def coefficients(self, t_B: Array) -> tuple[Array, Array, Array]:
    raise NotImplementedError

  def derivatives(self, t_B: Array) -> tuple[Array, Array, Array]:
    raise NotImplementedError

  @property
  def mask_id(self) -> int:
    """The mask id, V: a state of this process when `has_mask`, else read as unobserved."""
    return self.vocab_size

  @property
  def num_states(self) -> int:
    """S: the V tokens, plus the mask where the process has one."""
    return self.vocab_size + int(self.has_mask)

  def alpha(self, t_B: Array) -> Array:
    """The probability alpha(t) that a token is kept."""
    return self.coefficients(t_B)[0]

  def noise_BxS(self, t_B: Array) -> Array:
    """The noise mass per state, q_t(z | x0) - alpha [z = x0] (sums to 1 - alpha)."""
    return self._per_state(*self.coefficients(jnp.asarray(t_B))[1:])

  def _per_state(self, mask_B, uniform_B):
    tokens_BxV = jnp.broadcast_to((uniform_B / self.vocab_size)[:, None],
                                  mask_B.shape + (self.vocab_size,))
    if not self.has_mask:
      return tokens_BxV
    return jnp.concatenate([tokens_BxV, mask_B[:, None]], -1)

  def marginal(self, x0_BxLxV: Array, t_B: Array) -> Array:
    """q_t(. | x0 = w) (B x L x S) for w a one-hot or any law over the V tokens."""
    alpha_B = self.alpha(t_B)
    signal = alpha_B[:, None, None] * self._as_states(x0_BxLxV)
    return signal + self.noise_BxS(t_B)[:, None, :]

  def marginal_of_tokens(self, x0_BxL: Array, t_B: Array) -> Array:
    """q_t(. | x0) (B x L x S) of clean tokens."""
    return self.marginal(jax.nn.one_hot(x0_BxL, self.vocab_size), t_B)

  def _as_states(self, law_BxLxV):
    if not self.has_mask:
      return law_BxLxV
    return jnp.concatenate([law_BxLxV, jnp.zeros(law_BxLxV.shape[:-1] + (1,))], -1)

  def likelihood(self, z_BxL: Array, t_B: Array) -> Array:
    """q_t(z_i | x0_i = v) for every token v (B x L x V): position i's evidence about x0_i.

    A position holding the mask id under a process without a mask is read as unobserved
    (likelihood 1 for every v), so an absorbing canvas's masks mean "no evidence" here too.
    """
    alpha_B, mask_B, uniform_B = self.coefficients(jnp.asarray(t_B))
    is_token_BxLxV = jax.nn.one_hot(z_BxL, self.vocab_size)
    token = alpha_B[:, None, None] * is_token_BxLxV + (uniform_B / self.vocab_size)[:, None, None]
    masked = (mask_B[:, None, None] if self.has_mask else 1.0) * jnp.ones_like(token)
    return jnp.where((z_BxL == self.mask_id)[..., None], masked, token)

  def corrupt(self, key: Array, x0_BxL: Array, t_B: Array,
              maskable_BxL: Array | None = None) -> Array:
    """A draw z_t ~ q_t(. | x0): kept with probability alpha, else the mask with probability
    mask / (1 - alpha), else a uniform token. Positions outside `maskable_BxL` stay clean."""
    alpha_B, mask_B, uniform_B = self.coefficients(jnp.asarray(t_B))
    keep_key, kind_key, token_key = jax.random.split(key, 3)
    keep_BxL = jax.random.uniform(keep_key, x0_BxL.shape) < alpha_B[:, None]
    noise_BxL = self._draw_noise(kind_key, token_key, x0_BxL.shape, mask_B, uniform_B,
                                 x0_BxL.dtype)
    if maskable_BxL is not None:
      keep_BxL = keep_BxL | ~maskable_BxL
    return jnp.where(keep_BxL, x0_BxL, noise_BxL)

  def _draw_noise(self, kind_key, token_key, shape, mask_B, uniform_B, dtype):
    token_BxL = jax.random.randint(token_key, shape, 0, self.vocab_size, dtype)
    if not self.has_mask:
      return token_BxL
    total_B = mask_B + uniform_B
    mask_share_B = jnp.where(total_B > 0, mask_B / jnp.where(total_B > 0, total_B, 1.0), 1.0)
    to_mask_BxL = jax.random.uniform(kind_key, shape) < mask_share_B[:, None]
    return jnp.where(to_mask_BxL, self.mask_id, token_BxL)

  def prior_canvas(self, key: Array, batch: int, length: int, t: float = 1.0) -> Array:
    """A canvas drawn from the noise alone at time t (the sampler's start at t = 1)."""
    t_B = jnp.full((batch,), t)
    _, mask_B, uniform_B = self.coefficients(t_B)
    kind_key, token_key = jax.random.split(key)
    return self._draw_noise(kind_key, token_key, (batch, length), mask_B, uniform_B, jnp.int32)

  def transition(self, x_s_BxL: Array, s_B: Array, t_B: Array) -> Array:
    """q(x_t | x_s) for s < t (B x L x S): kept with alpha_t / alpha_s, else n_st."""
    keep_B, n_BxS = self._step(s_B, t_B)
    onehot = jax.nn.one_hot(x_s_BxL, self.num_states)
    return keep_B[:, None, None] * onehot + n_BxS[:, None, :]

  def _step(self, s_B, t_B):
    """(alpha_t / alpha_s, n_st per state) of the s -> t transition."""
    alpha_s, alpha_t = self.alpha(s_B), self.alpha(t_B)
    keep_B = alpha_t / alpha_s
    n_BxS = self.noise_BxS(t_B) - keep_B[:, None] * self.noise_BxS(s_B)
    return keep_B, jnp.maximum(n_BxS, 0.0)  # >= 0 up to rounding

  def bridge(self, x0_BxLxV: Array, z_BxL: Array, s_B: Array, t_B: Array) -> Array:
    """q(x_s | x_t = z, x0 = w) for s < t (B x L x S), w a one-hot or a law over the tokens.

    (alpha_t/alpha_s [x_s = z] + n_st(z)) q_s(x_s | w) / q_t(z | w): UDLM/DUO's posterior when
    w is a network's x0 prediction. For the exact reverse step from a posterior p(x0 | x_t)
    use `reverse_step` (module docstring).
    """
    keep_B, n_BxS = self._step(s_B, t_B)
    q_s_BxLxS = self.marginal(x0_BxLxV, s_B)
    z_onehot = jax.nn.one_hot(z_BxL, self.num_states)
    n_z_BxL = jnp.take_along_axis(n_BxS, z_BxL, axis=1)
    unnorm = (keep_B[:, None, None] * z_onehot + n_z_BxL[..., None]) * q_s_BxLxS
    return unnorm / unnorm.sum(-1, keepdims=True)

  def plugin_from_posterior(self, posterior_BxLxV: Array, z_BxL: Array, t_B: Array) -> Array:
    """The weights p(v | x_t) / q_t(z_i | v), renormalised: the posterior with position i's
    own evidence divided out, which `bridge` turns into the exact reverse step.

    Values the evidence rules out (q_t(z_i | v) = 0) get 0; where nothing is left (a
    posterior that contradicts its own position) the evidence alone, normalised.
    """
    lik_BxLxV = self.likelihood(z_BxL, t_B)
    possible = lik_BxLxV > 0
    safe_lik = jnp.where(possible, lik_BxLxV, 1.0)
    weights = jnp.where(possible, posterior_BxLxV / safe_lik, 0.0)
    total = weights.sum(-1, keepdims=True)
    fallback = lik_BxLxV / lik_BxLxV.sum(-1, keepdims=True)
    return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), fallback)

  def posterior_from_plugin(self, plugin_BxLxV: Array, z_BxL: Array, t_B: Array) -> Array:
    """The inverse map: p(v | x_t) proportional to w(v) q_t(z_i | v) (Bayes with position i's
    evidence), for a network trained to output the plug-in weights w."""
    unnorm = plugin_BxLxV * self.likelihood(z_BxL, t_B)
    return unnorm / unnorm.sum(-1, keepdims=True)

  def reverse_step(self, posterior_BxLxV: Array, z_BxL: Array, s_B: Array,
                   t_B: Array) -> Array:
    """The exact per-position reverse step from x_t = z (B x L x S): the mixture
    sum_v q(x_s | x_t, x0 = v) p(v | x_t) of the posterior marginals p(x0_i | x_t)."""
    plugin = self.plugin_from_posterior(posterior_BxLxV, z_BxL, t_B)
    return self.bridge(plugin, z_BxL, s_B, t_B)

  def jump_rates(self, t_B: Array) -> Array:
    """omega_t per state (B x S): the forward rate of a jump into each state."""
    alpha_B, mask_B, uniform_B = self.coefficients(jnp.asarray(t_B))
    dalpha_B, dmask_B, duniform_B = self.derivatives(jnp.asarray(t_B))
    ratio_B = dalpha_B / alpha_B
    return jnp.maximum(self._per_state(dmask_B - ratio_B * mask_B,
                                       duniform_B - ratio_B * uniform_B), 0.0)


def _alpha_and_rate(schedule: diffusion.Schedule, t_B):
  t_B = jnp.asarray(t_B, jnp.result_type(float))
  return t_B, schedule.alpha(t_B), schedule.dalpha(t_B)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Absorbing(NoiseProcess):
  """MD4/MDLM's masking: a token is kept with alpha(t), else it is the mask.

  `corrupt` is `diffusion.forward_mask` (the same draws for the same key).
  """

  name: ClassVar[str] = "absorbing"
  has_mask: ClassVar[bool] = True

  def coefficients(self, t_B):
    t_B, alpha_B, _ = _alpha_and_rate(self.schedule, t_B)
    return alpha_B, self.schedule.one_minus_alpha(t_B), jnp.zeros_like(alpha_B)

  def derivatives(self, t_B):
    _, _, dalpha_B = _alpha_and_rate(self.schedule, t_B)
    return dalpha_B, -dalpha_B, jnp.zeros_like(dalpha_B)

  def corrupt(self, key, x0_BxL, t_B, maskable_BxL=None):
    return diffusion.forward_mask(key, x0_BxL, self.alpha(t_B), self.mask_id, maskable_BxL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Uniform(NoiseProcess):
  """Uniform-state noise (D3PM uniform, UDLM, DUO, DiffusionGemma): a token is kept with
  alpha(t), else replaced by a uniform draw over the V tokens (which may equal it). No mask.
  With the linear schedule the noise probability is t (DiffusionGemma's LinearSchedule)."""

  name: ClassVar[str] = "uniform"
  has_mask: ClassVar[bool] = False

  def coefficients(self, t_B):
    t_B, alpha_B, _ = _alpha_and_rate(self.schedule, t_B)
    return alpha_B, jnp.zeros_like(alpha_B), self.schedule.one_minus_alpha(t_B)

  def derivatives(self, t_B):
    _, _, dalpha_B = _alpha_and_rate(self.schedule, t_B)
    return dalpha_B, jnp.zeros_like(dalpha_B), -dalpha_B


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hybrid(NoiseProcess):
  """GIDD's interpolation between masking and uniform noise (von Rütte et al. 2025, "Generalized
  Interpolating Discrete Diffusion", sec. 4; `HybridDiffusion` in github.com/dvruette/gidd):

      alpha = (1 - tau) / C,  mask = tau / C,  uniform = c / C,
      c = B (tau (1 - tau))^(gamma/2),  C = 1 + c,  B = 2^gamma p_uniform / (1 - p_uniform),

  at tau = 1 - alpha_schedule(t): the linear schedule (the default) gives GIDD's process with
  tau = t. Uniform noise peaks mid-way (at tau = 1/2 with gamma = 1 it is a share p_uniform of
  every token) and vanishes at both ends: t = 1 is all masks. p_uniform = 0 is absorbing.
  """

  p_uniform: float = 0.1
  gamma: float = 1.0

  name: ClassVar[str] = "hybrid"
  has_mask: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    p = self.p_uniform
    errors.check(isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0,
                 "p_uniform", p, "a number in [0, 1)")
    g = self.gamma
    # gamma in (0, 2] keeps every jump rate omega_t >= 0 (a valid forward process).
    errors.check(isinstance(g, (int, float)) and not isinstance(g, bool) and 0.0 < g <= 2.0,
                 "gamma", g, "a number in (0, 2]")

  @property
  def scale(self) -> float:
    """GIDD's B = 2^gamma p_uniform / (1 - p_uniform)."""
    return 2.0**self.gamma * self.p_uniform / (1.0 - self.p_uniform)

  def _tau(self, t_B):
    t_B = jnp.asarray(t_B, jnp.result_type(float))
    return self.schedule.one_minus_alpha(t_B), -self.schedule.dalpha(t_B)

  def coefficients(self, t_B):
    tau_B, _ = self._tau(t_B)
    c_B = self.scale * (tau_B * (1.0 - tau_B))**(self.gamma / 2)
    return (1.0 - tau_B) / (1.0 + c_B), tau_B / (1.0 + c_B), c_B / (1.0 + c_B)

  def derivatives(self, t_B):
    tau_B, dtau_B = self._tau(t_B)
    g = self.gamma
    c_B = self.scale * (tau_B * (1.0 - tau_B))**(g / 2)
    # dc/dtau = B (g/2) (1 - 2 tau) (tau (1 - tau))^(g/2 - 1): finite at 0 < tau < 1.
    base_B = jnp.maximum(tau_B * (1.0 - tau_B), 1e-30)
    dc_B = self.scale * (g / 2) * (1.0 - 2.0 * tau_B) * base_B**(g / 2 - 1) * dtau_B
    big_c = 1.0 + c_B
    dalpha = (-dtau_B * big_c - (1.0 - tau_B) * dc_B) / big_c**2
    dmask = (dtau_B * big_c - tau_B * dc_B) / big_c**2
    duniform = dc_B / big_c**2
    return dalpha, dmask, duniform


PROCESSES: dict[str, type[NoiseProcess]] = {
    "absorbing": Absorbing, "uniform": Uniform, "hybrid": Hybrid}


def get(name, vocab_size: int, **kwargs) -> NoiseProcess:
  """The process `name` ('absorbing', 'uniform', 'hybrid') over `vocab_size` tokens; kwargs
  are its fields (schedule= a Schedule or a schedule's name, p_uniform=, gamma=)."""
  errors.check(name in PROCESSES, "noise", name, f"one of {sorted(PROCESSES)}")
  if isinstance(kwargs.get("schedule"), str):
    kwargs["schedule"] = diffusion.as_schedule(kwargs["schedule"])
  fields = {f.name for f in dataclasses.fields(PROCESSES[name])} - {"vocab_size"}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise errors.ArgumentError(unknown[0], f"{unknown[0]}={kwargs[unknown[0]]!r} is invalid: "
                               f"the {name} process takes {sorted(fields)}.")
  return PROCESSES[name](vocab_size=vocab_size, **kwargs)


def as_process(value, vocab_size: int, param: str = "noise") -> NoiseProcess:
  """A process as given (its vocab_size checked) or built by name over `vocab_size` tokens."""
  if isinstance(value, NoiseProcess):
    errors.check(value.vocab_size == vocab_size, param, value,
                 f"a process over the model's {vocab_size} tokens")
    return value
  errors.check(isinstance(value, str) and value in PROCESSES, param, value,
               f"one of {sorted(PROCESSES)} or a mdjax.noise process value")
  return get(value, vocab_size)

