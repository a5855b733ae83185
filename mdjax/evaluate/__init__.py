"""Evaluation of masked diffusion language models: log-likelihoods of continuations and of
long sequences (`loglikelihood`, `rolling`), the ELBO of held-out sequences and exact causal
likelihoods (`elbo`), the perplexity bound of a MDLM / BD3-LM checkpoint on a token file
(`python -m mdjax.evaluate.perplexity`), and the generative perplexity of samples under a
causal judge (`gen_ppl`). The lm-eval model lives in `mdjax.evaluate.harness` (imported on
demand: it needs lm_eval)."""

import importlib

from mdjax.evaluate.elbo import (causal_bits, causal_sample, discrete_nelbo, nelbo_estimate,
                                 windows_nelbo)
from mdjax.evaluate.loglikelihood import ESTIMATORS, LogLikelihood, loglikelihood
from mdjax.evaluate.rolling import RollingLogLikelihood, loglikelihood_rolling

# The command-line modules' names load on first use: imported here, `python -m
# mdjax.evaluate.gen_ppl` would find the module already in sys.modules and warn on every run.
_GEN_PPL = ("GenPPL", "Judge", "generative_perplexity", "load_judge")


def __getattr__(name: str):
  if name in _GEN_PPL:
    return getattr(importlib.import_module("mdjax.evaluate.gen_ppl"), name)
  raise AttributeError(f"module 'mdjax.evaluate' has no attribute {name!r}")


__all__ = ["ESTIMATORS", "GenPPL", "Judge", "LogLikelihood", "RollingLogLikelihood",
           "causal_bits", "causal_sample", "discrete_nelbo", "generative_perplexity",
           "load_judge", "loglikelihood", "loglikelihood_rolling", "nelbo_estimate",
           "windows_nelbo"]
