"""Evaluation of masked diffusion language models: log-likelihoods of continuations and of
long sequences, and the generative perplexity of samples under a causal judge
(`gen_ppl`). The lm-eval model lives in `mdjax.evaluate.harness` (imported on demand: it
needs lm_eval)."""

from mdjax.evaluate.gen_ppl import GenPPL, Judge, generative_perplexity, load_judge
from mdjax.evaluate.loglikelihood import ESTIMATORS, LogLikelihood, loglikelihood
from mdjax.evaluate.rolling import RollingLogLikelihood, loglikelihood_rolling

__all__ = ["ESTIMATORS", "GenPPL", "Judge", "LogLikelihood", "generative_perplexity",
           "load_judge", "RollingLogLikelihood", "loglikelihood",
           "loglikelihood_rolling"]
