"""Text in, text out for a loaded checkpoint: `mdjax.generate` under the names this module
has had (`complete`), and the padded id batches the reference samplers take
(`encode_prompts`, `sample_family`).

    model = mdjax.load("LLaDA-8B-Instruct", dtype="bfloat16")
    out = mdjax.generate(model, ["What is 7 * 8?"], max_new_tokens=64, chat=True, steps=64,
                         block_length=32, key=jax.random.key(0))
    print(out[0].text)
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from mdjax import generation, sampling
from mdjax.generation import Completions
from mdjax.pretrained import samplers as reference

Completion = Completions  # one release: `complete` returned a batch record of this name


def encode_prompts(model, prompts: Sequence[Any], *, chat: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Prompts -> (ids [B, P] left-padded to the longest, attention mask [B, P]), as
  `mdjax.generate` lays them out (`generation.prompt_ids`; padding `model.pad_id`, masked
  out by the attention mask)."""
  rows = generation.prompt_ids(model, prompts, chat=chat)
  width = max(len(r) for r in rows)
  # A canvas of the prompts alone (no positions to generate): left_padded's layout.
  prompt_BxP, valid_BxP, _ = generation.left_padded(rows, width, model.mask_id,
                                                    pad_id=model.pad_id)
  return prompt_BxP, valid_BxP.astype(np.int32)


def sample_family(model, prompt_BxP, spec: sampling.SamplerSpec, *, max_new_tokens: int,
                  attention_mask=None, key=None):
  """Any mdjax sampler family on [prompt, max_new_tokens masks]: ids [B, P + N] (one key
  for the batch, split into rows: the reference samplers' rule)."""
  prompt_BxP = reference._prompt(model, prompt_BxP)
  reference._check_int(max_new_tokens, "max_new_tokens", 1)
  batch, prompt_length = prompt_BxP.shape
  valid_BxL = reference._valid(attention_mask, batch, prompt_length, max_new_tokens)
  return reference._run(model, model.apply_fn, prompt_BxP, max_new_tokens, spec, valid_BxL,
                        key)


def complete(model, prompts: Sequence[Any], *, max_new_tokens: int,
             spec: sampling.SamplerSpec | None = None, chat: bool = False, key=None,
             stop_at_eos: bool = True, **knobs) -> Completions:
  """`mdjax.generate` (key None: key(0)); kept one release under this name."""
  return generation.generate(model, prompts, max_new_tokens=max_new_tokens, spec=spec,
                             chat=chat, key=jax.random.key(0) if key is None else key,
                             stop_at_eos=stop_at_eos, **knobs)
