"""The ELBO and causal likelihoods now live in `mdjax.evaluate.elbo`; this module keeps their
names for one release."""

from mdjax.evaluate.elbo import (causal_bits, causal_sample, discrete_nelbo,  # noqa: F401
                                 nelbo_estimate, windows_nelbo)
