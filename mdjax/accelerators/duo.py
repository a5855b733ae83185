"""DUO's discrete consistency distillation (Sahoo et al., ICML 2025, "The Diffusion Duality",
Alg. 1; code: s-sahoo/duo, `algo.Distillation`) as the objective 'duo' (importing this
module registers it; train.py does).

A uniform-noise model (an mdjax workdir trained with noise="uniform") is its own teacher:
the student starts from it (`train.init_from`, the reference's `training.finetune_path`) and
the teacher is a frozen copy of the student, replaced by the student's weights every
distill.update_teacher_every steps (the train state keeps it, `TrainState.teacher_params`:
a resumed run has the same teacher). Round n (n = step // update_teacher_every) distills
over a step dt_n = 2^n / teacher_steps of the time t in [0, 1] (the step-halving schedule:
each round's student, the next round's teacher, takes steps twice as long). Each row:

  t ~ U(eps, 1) antithetic (eps = 1e-3), t <- min(t + dt, 1), s = t - dt;
  gamma_u = gamma_min + u (gamma_max - gamma_min)  (u = t, s: the Gaussian log-SNR, linear);
  one eps ~ N(0, I) (L x V) for both times: the Gaussian DDIM trajectory of x0 (with the
  true x0 as the denoiser it is deterministic given eps),
      w_u = sqrt(sigmoid(-gamma_u)) onehot(x0) + sqrt(sigmoid(gamma_u)) eps,
  x_t = argmax w_t, x_s = argmax w_s: the duality maps them to uniform-noise latents whose
  keep probability is alpha_u = (V P(argmax w_u = x0) - 1) / (V - 1) (the paper's eq. 10,
  `usdm_alpha`);
  loss = the mean over positions of KL(student(x_t, t) || teacher(x_s, s)) ('kl-bwd', the
  reference's default; 'kl-fwd' swaps the two), the teacher's side stop-gradient.

Where mdjax differs, and why:
- What the KL compares (distill.match). The reference's network outputs x_theta, the
  weights it plugs into the bridge q(x_s | x_t, x0 = x_theta), and its KL compares those.
  mdjax's denoiser outputs the posterior p(x0_i | x_t) (`mdjax.noise.process`); x_theta is
  the posterior with position i's own evidence q_t(x_t,i | v) divided out
  (`NoiseProcess.plugin_from_posterior`, match='plugin'). Near t = 0 that division is
  ill-conditioned (q_t(x_t,i | v) is about (1 - alpha) / V for v other than x_t,i: the
  posterior's tail divided by ~1e-5), and a student distilled on those weights was measured
  to sample noise (docs/accelerators.md, "DUO"). The default, match='posterior', compares the
  two denoisers' outputs as they are: the teacher's posterior at (x_s, s) nears x0 as s nears
  0, the anchor of the consistency chain.
- Times. The reference conditions its network on sigma = -log alpha; mdjax's on its
  schedule's time, here t(alpha) of the run's schedule (inverted by bisection), clipped to
  [1e-5, 1] as the NELBO's times are.
- The Gaussian range. The reference's [gamma_min, gamma_max] = [-4, -1] is tuned to GPT-2's
  50,257 tokens: it spans alpha from 0.9987 to 0.0062. Under a small vocabulary the same
  gammas span much less (65 characters: 1.0 to 0.25, never near the noise that sampling
  starts from). By default (None) the range is the gammas whose alphas are those two under
  the run's vocabulary (for V = 50,257 the reference's own); distill.gamma_min / gamma_max
  set them.
- The integral of eq. 10 is a trapezoid sum over the Gaussian (4,001 points in [-10, 10],
  float32, computed where it is used), not the reference's cached table read at its nearest
  point.
- The teacher is the student's copy at steps 0, K, 2K, ... (the reference's
  `_maybe_update_teacher_weights` with teacher_ema False, its script's setting).

config.distill (configs/distill_duo.py):
  teacher               the teacher's workdir (required; train.init_from is set to it)
  teacher_steps         T: round 0's step is 1/T (the reference's algo.T; its script: 512)
  update_teacher_every  steps a round (the reference's 10,000)
  loss                  'kl-bwd' (KL(student || teacher), the reference's default) or 'kl-fwd'
  match                 what the KL compares: 'posterior' (the denoisers' outputs) or
                        'plugin' (the reference's x_theta, the plug-in weights)
  gamma_min, gamma_max  the Gaussian log-SNR range (None: module docstring)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from jax.scipy.special import log_ndtr

from mdjax import diffusion
from mdjax.accelerators import distill
from mdjax.tasks import sft as sft_data
from mdjax.train import objectives, start_point
from mdjax.train.config_checks import ConfigError

NAME = "duo"
LOSSES = ("kl-bwd", "kl-fwd")
MATCHES = ("posterior", "plugin")
# configs/algo/distillation.yaml and scripts/distil_owt.sh of the reference.
TEACHER_STEPS, UPDATE_TEACHER_EVERY = 512, 10_000
REFERENCE_GAMMA, REFERENCE_VOCAB = (-4.0, -1.0), 50_257  # its range, for GPT-2's tokens
T_EPS = 1e-3  # the reference's training.sampling_eps: t ~ U(eps, 1)
MIN_TIME = 1e-5  # mdjax's NELBO draws t >= 1e-5: the student's and teacher's times alike
DEFAULTS = dict(teacher=None, teacher_steps=TEACHER_STEPS,
                update_teacher_every=UPDATE_TEACHER_EVERY, loss="kl-bwd", match="posterior",
                gamma_min=None, gamma_max=None)
QUADRATURE_POINTS, QUADRATURE_HALF_WIDTH = 4001, 10.0


# ----------------------------------------------------------------------------
# The duality: Gaussian latents, their argmax, their keep probability.
# ----------------------------------------------------------------------------


def gaussian_scales(gamma):
  """(signal, noise) = (sqrt(sigmoid(-gamma)), sqrt(sigmoid(gamma))): the Gaussian latent
  signal * onehot(x0) + noise * eps at log-SNR -gamma (variance preserving)."""
  return jnp.sqrt(jax.nn.sigmoid(-gamma)), jnp.sqrt(jax.nn.sigmoid(gamma))


def usdm_alpha(gamma_B, vocab_size: int):
  """The keep probability of argmax(w), w the Gaussian latent at gamma (the paper's eq. 10):
  (V P - 1) / (V - 1), P = P(argmax w = x0) = E_e[Phi(signal/noise + e)^(V-1)], e ~ N(0, 1)
  (the trapezoid sum of the module docstring, its weights normalised). Summed as 1 - alpha
  = V/(V - 1) E_e[1 - Phi^(V-1)], whose terms are small where alpha is near 1 (float32)."""
  signal, noise = gaussian_scales(jnp.asarray(gamma_B, jnp.float32))
  e_N = jnp.linspace(-QUADRATURE_HALF_WIDTH, QUADRATURE_HALF_WIDTH, QUADRATURE_POINTS)
  weight_N = jnp.exp(-0.5 * e_N**2).at[jnp.array([0, -1])].multiply(0.5)
  weight_N = weight_N / weight_N.sum()
  ratio = (signal / noise)[..., None]
  miss = -jnp.expm1((vocab_size - 1) * log_ndtr(ratio + e_N))  # 1 - Phi^(V-1)
  one_minus = vocab_size / (vocab_size - 1.0) * jnp.sum(weight_N * miss, -1)
  return jnp.clip(1.0 - one_minus, 0.0, 1.0)


def gamma_for_alpha(alpha: float, vocab_size: int) -> float:
  """The gamma at which `usdm_alpha` is `alpha` (bisection: alpha falls as gamma grows)."""
  alpha_of = jax.jit(usdm_alpha, static_argnums=1)
  low, high = -30.0, 30.0
  for _ in range(60):
    mid = 0.5 * (low + high)
    if float(alpha_of(jnp.float32(mid), vocab_size)) > alpha:
      low = mid
    else:
      high = mid
  return 0.5 * (low + high)


def gamma_range(opts: dict, vocab_size: int) -> tuple[float, float]:
  """(gamma_min, gamma_max): the configured ones, or those whose alphas under `vocab_size`
  tokens are the reference range's under GPT-2's (module docstring)."""
  out = []
  for name, reference in zip(("gamma_min", "gamma_max"), REFERENCE_GAMMA):
    if opts[name] is not None:
      out.append(float(opts[name]))
    else:
      alpha = float(usdm_alpha(jnp.float32(reference), REFERENCE_VOCAB))
      out.append(gamma_for_alpha(alpha, vocab_size))
  return out[0], out[1]


def trajectory_pair(key, x0_BxL, gamma_t_B, gamma_s_B, vocab_size: int):
  """(x_t, x_s): the argmax of the Gaussian latents of x0 at gamma_t and gamma_s with one
  eps (L x V per row), the reference's `_sample_trajectory`."""
  eps_BxLxV = jax.random.normal(key, x0_BxL.shape + (vocab_size,))
  onehot_BxLxV = jax.nn.one_hot(x0_BxL, vocab_size)

  def latent(gamma_B):
    signal_B, noise_B = gaussian_scales(gamma_B)
    return signal_B[:, None, None] * onehot_BxLxV + noise_B[:, None, None] * eps_BxLxV

  return (jnp.argmax(latent(gamma_t_B), -1).astype(x0_BxL.dtype),
          jnp.argmax(latent(gamma_s_B), -1).astype(x0_BxL.dtype))


def time_for_alpha(schedule: diffusion.Schedule, alpha_B, iterations: int = 40):
  """The schedule's time t with alpha(t) = alpha (bisection over [0, 1]; alpha(t) falls),
  clipped to [MIN_TIME, 1]."""
  alpha_B = jnp.asarray(alpha_B, jnp.float32)

  def body(_, bounds):
    low, high = bounds
    mid = 0.5 * (low + high)
    later = schedule.alpha(mid) > alpha_B  # alpha(mid) still above: t lies later
    return jnp.where(later, mid, low), jnp.where(later, high, mid)

  low, high = jax.lax.fori_loop(0, iterations, body,
                                (jnp.zeros_like(alpha_B), jnp.ones_like(alpha_B)))
  return jnp.clip(0.5 * (low + high), MIN_TIME, 1.0)


# ----------------------------------------------------------------------------
# The loss, as pure functions.
# ----------------------------------------------------------------------------


def log_plugin(process, logits_BxLxV, z_BxL, t_B):
  """log of the plug-in weights (the reference's x_theta) of a posterior's logits: log
  softmax(logits - log q_t(z_i | v)), `NoiseProcess.plugin_from_posterior` in log space."""
  log_likelihood = jnp.log(process.likelihood(z_BxL, t_B))
  return jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32) - log_likelihood, -1)


def kl_terms(log_student_BxLxV, log_teacher_BxLxV, loss: str = "kl-bwd"):
  """KL per position: 'kl-bwd' KL(student || teacher), 'kl-fwd' KL(teacher || student)."""
  log_p, log_q = ((log_student_BxLxV, log_teacher_BxLxV) if loss == "kl-bwd"
                  else (log_teacher_BxLxV, log_student_BxLxV))
  p = jnp.exp(log_p)
  return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), -1)


def matched(process, logits_BxLxV, z_BxL, t_B, match: str):
  """The log-distribution the KL compares: the denoiser's posterior ('posterior') or its
  plug-in weights ('plugin', the reference's x_theta; `log_plugin`)."""
  if match == "plugin":
    return log_plugin(process, logits_BxLxV, z_BxL, t_B)
  return jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), -1)


def duo_loss(apply_fn, params, teacher_params, key, x0_BxL, *, process, dt, gamma_min: float,
             gamma_max: float, loss: str = "kl-bwd", match: str = "posterior"):
  """DUO's consistency loss of a batch (module docstring): (loss, aux), the loss the mean
  KL per position in nats between the student's and the teacher's `matched` outputs."""
  batch = x0_BxL.shape[0]
  vocab = process.vocab_size
  time_key, noise_key = jax.random.split(key)
  t_B = jnp.minimum(diffusion.stratified_times(time_key, batch, T_EPS) + dt, 1.0)
  s_B = t_B - dt
  gamma_t_B = gamma_min + t_B * (gamma_max - gamma_min)
  gamma_s_B = gamma_min + s_B * (gamma_max - gamma_min)
  x_t, x_s = trajectory_pair(noise_key, x0_BxL, gamma_t_B, gamma_s_B, vocab)
  alpha_t_B, alpha_s_B = usdm_alpha(gamma_t_B, vocab), usdm_alpha(gamma_s_B, vocab)
  time_t_B = time_for_alpha(process.schedule, alpha_t_B)
  time_s_B = time_for_alpha(process.schedule, alpha_s_B)
  log_student = matched(process, apply_fn(params, x_t, time_t_B), x_t, time_t_B, match)
  teacher_logits = jax.lax.stop_gradient(apply_fn(teacher_params, x_s, time_s_B))
  log_teacher = matched(process, teacher_logits, x_s, time_s_B, match)
  kl = kl_terms(log_student, log_teacher, loss).mean()
  return kl, {"kl": kl, "dt": jnp.asarray(dt, jnp.float32), "alpha_t": alpha_t_B.mean(),
              "noisy_fraction": (x_t != x0_BxL).mean(),
              "moved_fraction": (x_t != x_s).mean()}


# ----------------------------------------------------------------------------
# The objective.
# ----------------------------------------------------------------------------


def options(config) -> dict:
  """config.distill's knobs with the defaults; a ConfigError naming a field that is unknown
  or out of range."""
  opts = distill.known_knobs(config, NAME, DEFAULTS)
  if not isinstance(opts["teacher"], str) or not opts["teacher"]:
    distill.refuse(opts, "teacher", "must name the teacher: a train.py workdir trained with "
                   "noise='uniform'")
  for name in ("teacher_steps", "update_teacher_every"):
    if not distill.is_integer(opts[name], 1):
      distill.refuse(opts, name, "must be an integer >= 1")
  if opts["loss"] not in LOSSES:
    distill.refuse(opts, "loss", f"must be one of {LOSSES}")
  if opts["match"] not in MATCHES:
    distill.refuse(opts, "match", f"must be one of {MATCHES}")
  for name in ("gamma_min", "gamma_max"):
    if opts[name] is not None and not distill.is_number(opts[name]):
      distill.refuse(opts, name, "must be None or a finite number")
  if (opts["gamma_min"] is not None and opts["gamma_max"] is not None
      and not opts["gamma_min"] < opts["gamma_max"]):
    distill.refuse(opts, "gamma_min", f"must be below gamma_max={opts['gamma_max']!r}")
  rounds = (config.train.num_steps - 1) // opts["update_teacher_every"] + 1
  if 2 ** (rounds - 1) > opts["teacher_steps"]:
    distill.refuse(opts, "teacher_steps", f"must be at least 2^(rounds - 1) = "
                   f"{2 ** (rounds - 1)}: train.num_steps={config.train.num_steps} makes "
                   f"{rounds} rounds of update_teacher_every={opts['update_teacher_every']}, "
                   "and the last round's step 2^(rounds - 1) / teacher_steps must not pass "
                   "the whole time")
  return opts


def resolve_config(config):
  """A 'duo' config checked: the student starts as the teacher (train.init_from empty or
  the teacher, set to it), its model fields and noise process the teacher's; any other
  config unchanged."""
  if config.get("objective") != NAME:
    return config
  opts = options(config)
  teacher = opts["teacher"]
  where = start_point.workdir_of(teacher, f"distill.teacher={teacher!r}",
                                 "DUO's teacher is a train.py workdir trained with "
                                 "noise='uniform'.")
  init_from = config.get("train", {}).get("init_from")
  if init_from and sft_data.resolve_start(init_from) != sft_data.resolve_start(where):
    raise ConfigError(f"config field train.init_from={init_from!r}: DUO's student starts as "
                      f"its teacher ({where}); leave it unset or the same.")
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.train.init_from = where
  saved = start_point.workdir_start(resolved, where)
  if objectives.noise_name(saved) != "uniform":
    raise ConfigError(f"config field distill.teacher={teacher!r}: its noise is "
                      f"{objectives.noise_name(saved)!r}; DUO distills a uniform-noise model.")
  if objectives.process_fields(config) != objectives.process_fields(saved):
    raise ConfigError(f"config field noise={objectives.noise_name(config)!r}: the student's "
                      f"process {objectives.process_fields(config)} must be the teacher's "
                      f"{objectives.process_fields(saved)}.")
  return distill.resolve_student(resolved, "DUO's student")


def _loss_fn(config, apply_fn, task):
  opts = options(config)
  process = objectives.noise_process(config, task.vocab_size)
  gamma_min, gamma_max = gamma_range(opts, task.vocab_size)
  if not gamma_min < gamma_max:
    raise ConfigError(f"config field distill.gamma_min={gamma_min!r} must be below "
                      f"gamma_max={gamma_max!r}.")
  every, steps = opts["update_teacher_every"], opts["teacher_steps"]
  final_round = (config.train.num_steps - 1) // every

  def loss(params, key, x_BxL, step=None, teacher_params=None):
    # Without a step (evaluation) the last round's dt; without a teacher the student itself.
    n = final_round if step is None else jnp.asarray(step, jnp.int32) // every
    dt = jnp.exp2(jnp.asarray(n, jnp.float32)) / steps
    teacher = params if teacher_params is None else teacher_params
    return duo_loss(apply_fn, params, teacher, key, x_BxL, process=process, dt=dt,
                    gamma_min=gamma_min, gamma_max=gamma_max, loss=opts["loss"],
                    match=opts["match"])

  loss.takes_step = True  # the train step passes step=state.step (the round)
  loss.teacher_every = every  # and teacher_params=, the student's copy at the round's start
  return loss


objectives.register(objectives.Objective(
    NAME, _loss_fn, held_out_loss_fn=objectives.held_out_nelbo_fn,
    resolve_config=resolve_config, start_model=distill.start_model, teacher_copy=True))
