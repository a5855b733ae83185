"""Autoregressive -> diffusion conversion (`mdjax.convert.a2d`): a Llama / Qwen2 / Qwen3
causal folder written as a published masked (Dream, LLaDA) or block (Fast-dLLM v2, SDAR)
diffusion folder, which `mdjax.load` reads and training starts from.

  python -m mdjax.convert --input=AR_DIR --to=masked|block [--block_size=N] [--mask_id=ID] \\
      [--no_shift] [--layout=dream|llada|sdar|fast_dllm_v2] --out=DIR
"""

from mdjax.convert.a2d import (LAYOUTS, MASK_TOKEN, SOURCES, TARGETS, Plan, causal_config,
                               convert, convert_params, converted, load_causal, plan)

__all__ = ["LAYOUTS", "MASK_TOKEN", "SOURCES", "TARGETS", "Plan", "causal_config", "convert",
           "convert_params", "converted", "load_causal", "plan"]
