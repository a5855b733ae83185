"""mdjax: masked (absorbing-state) discrete diffusion in JAX."""

from mdjax import diffusion
from mdjax.diffusion import (
    CosineSchedule,
    LinearSchedule,
    LogLinearSchedule,
    PolynomialSchedule,
    Schedule,
    get_schedule,
)

__version__ = "0.1.0"
