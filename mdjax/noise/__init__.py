"""Noise processes beyond the mask: the process as a value, its exact denoisers and losses.

    from mdjax import noise
    process = noise.get("uniform", vocab_size=2)          # or noise.Uniform(vocab_size=2, ...)
    z_BxL = process.corrupt(key, x0_BxL, t_B)
    step_BxLxS = process.reverse_step(posterior_BxLxV, z_BxL, s_B, t_B)
    loss, aux = noise.udlm_loss(apply_fn, params, key, x0_BxL, process=process)

`mdjax.load("oracle:two_color", noise="uniform")` is a task's exact denoiser under a process.
docs/diffusion.md describes the processes, their marginals, the exact reverse step and the
losses.
"""

from mdjax.noise.exact import Support, check_enumerable, exact_denoiser, exact_posterior
from mdjax.noise.losses import WEIGHTINGS, elbo_parts, gidd_loss, udlm_loss
from mdjax.noise.process import (
    PROCESSES,
    Absorbing,
    Hybrid,
    NoiseProcess,
    Uniform,
    as_process,
    get,
)

__all__ = ["PROCESSES", "WEIGHTINGS", "Absorbing", "Hybrid", "NoiseProcess", "Support",
           "Uniform", "as_process", "check_enumerable", "elbo_parts", "exact_denoiser",
           "exact_posterior", "get", "gidd_loss", "udlm_loss"]
