"""Evaluation of masked diffusion language models: log-likelihoods of continuations."""

from mdjax.evaluate.loglikelihood import ESTIMATORS, LogLikelihood, loglikelihood

__all__ = ["ESTIMATORS", "LogLikelihood", "loglikelihood"]
