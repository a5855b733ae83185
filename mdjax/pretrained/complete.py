"""Text in, text out for a loaded checkpoint: prompts (optionally through its chat template)
left-padded into one batch, completed by its reference sampler or any mdjax family.

    model = pretrained.load("LLaDA-8B-Instruct", dtype="bfloat16")
    out = pretrained.complete(model, ["What is 7 * 8?"], max_new_tokens=64, chat=True,
                              steps=64, block_length=32)
    print(out.texts[0])
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import numpy as np

from mdjax import generation, sampling
from mdjax.pretrained import load as load_lib
from mdjax.pretrained import samplers as reference
from mdjax.pretrained.chat_template import render_chat

# The keyword arguments each reference sampler takes besides its lengths (the defaults
# `complete` fills in are below).
REFERENCE_KNOBS = {
    "llada": ("steps", "block_length", "temperature", "cfg_scale", "remasking",
              "logits_eos_inf", "confidence_eos_eot_inf", "threshold", "factor", "kv_cache"),
    "dream": ("steps", "eps", "alg", "alg_temp", "temperature", "top_p", "top_k",
              "per_row_count"),
}


@dataclasses.dataclass(frozen=True)
class Completion:
  """The completions of one batch of prompts.

  token_ids: each prompt's generated ids (the prompt and its padding dropped).
  texts: their decoded text (None without a tokenizer).
  prompt_BxP, attention_mask_BxP: the left-padded prompts as the sampler saw them.
  """

  token_ids: list[np.ndarray]
  texts: list[str] | None
  prompt_BxP: np.ndarray
  attention_mask_BxP: np.ndarray


def _tokenize(model, call):
  """call() of the model's tokenizer; the library's failure (a panic included) as a
  ValueError naming tokenizer.json."""
  try:
    return call()
  except BaseException as e:
    if not load_lib.tokenizer_failure(e):
      raise
    where = (os.path.join(model.source, load_lib.TOKENIZER_FILE) if model.source
             else "the model's tokenizer")
    raise ValueError(f"{where}: the tokenizer failed ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None


def encode_prompts(model, prompts: Sequence[Any], *, chat: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Prompts -> (ids [B, P] left-padded to the longest, attention mask [B, P]).

  A prompt is a text, a list of ids, or (with chat=True, or always for a list of dicts) a
  list of chat messages; a text with chat=True is one user message. Padding uses the EOS
  id (LLaDA's pad id) and is masked out by the attention mask.
  """
  if not prompts:
    raise ValueError("prompts is empty; give at least one prompt.")
  rows = []
  for i, prompt in enumerate(prompts):
    is_messages = isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict)
    if isinstance(prompt, str) or is_messages:
      if chat or is_messages:
        prompt = render_chat(model, [{"role": "user", "content": prompt}]
                             if isinstance(prompt, str) else prompt)
      if model.tokenizer is None:
        raise ValueError(f"prompt {i} is text but the checkpoint has no tokenizer.json; "
                         "give token ids.")
      ids = _tokenize(model, lambda: model.tokenizer.encode(prompt, add_special_tokens=False)).ids
    else:
      if chat:
        raise ValueError(f"prompt {i} is ids; chat=True needs texts or messages.")
      ids = list(prompt)
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size == 0:
      raise ValueError(f"prompt {i} is empty.")
    if ids.min() < 0 or ids.max() >= model.vocab_size or (ids == model.mask_id).any():
      raise ValueError(f"prompt {i} holds ids outside [0, {model.vocab_size}) or the mask id "
                       f"{model.mask_id}.")
    rows.append(ids.astype(np.int32))
  width = max(len(r) for r in rows)
  pad = model.eos_id if model.eos_id is not None else 0
  # A canvas of the prompts alone (no positions to generate): left_padded's layout.
  prompt_BxP, valid_BxP, _ = generation.left_padded(rows, width, model.mask_id, pad_id=pad)
  return prompt_BxP, valid_BxP.astype(np.int32)


def sample_family(model, prompt_BxP, spec: sampling.SamplerSpec, *, max_new_tokens: int,
                  attention_mask=None, key=None):
  """Any mdjax sampler family on [prompt, max_new_tokens masks]: ids [B, P + N]."""
  prompt_BxP = reference._prompt(model, prompt_BxP)
  reference._check_int(max_new_tokens, "max_new_tokens", 1)
  batch, prompt_length = prompt_BxP.shape
  valid_BxL = reference._valid(attention_mask, batch, prompt_length, max_new_tokens)
  return reference._run(model, model.apply_fn, prompt_BxP, max_new_tokens, spec, valid_BxL,
                        key)


def complete(model, prompts: Sequence[Any], *, max_new_tokens: int,
             spec: sampling.SamplerSpec | None = None, chat: bool = False, key=None,
             stop_at_eos: bool = True, **knobs) -> Completion:
  """Completes each prompt with `max_new_tokens` new tokens.

  spec None runs the checkpoint's reference sampler (`generate` for LLaDA with
  block_length = max_new_tokens and steps = max_new_tokens unless given;
  `diffusion_generate` for Dream with steps = max_new_tokens unless given), `knobs` its
  keyword arguments (REFERENCE_KNOBS); a `SamplerSpec` runs that mdjax family instead.
  The decoded text of a row stops before its first EOS (or EoT) when stop_at_eos.
  """
  prompt_BxP, mask_BxP = encode_prompts(model, prompts, chat=chat)
  if spec is not None:
    if knobs:
      raise ValueError(f"{sorted(knobs)} are reference-sampler arguments; with spec= the "
                       "spec carries the sampler's knobs.")
    ids_BxT = sample_family(model, prompt_BxP, spec, max_new_tokens=max_new_tokens,
                            attention_mask=mask_BxP, key=key)
  else:
    allowed = REFERENCE_KNOBS[model.family]
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
      raise ValueError(f"{unknown[0]}= does not apply to the {model.family} reference "
                       f"sampler; its arguments: {', '.join(allowed)}.")
    knobs.setdefault("steps", max_new_tokens)
    if model.family == "llada":
      knobs.setdefault("block_length", max_new_tokens)
      ids_BxT = reference.generate(model, prompt_BxP, gen_length=max_new_tokens,
                                   attention_mask=mask_BxP, key=key, **knobs)
    else:
      ids_BxT = reference.diffusion_generate(model, prompt_BxP, max_new_tokens=max_new_tokens,
                                             attention_mask=mask_BxP, key=key, **knobs)
  generated_BxN = np.asarray(jax.device_get(ids_BxT))[:, prompt_BxP.shape[1]:]
  stops = {i for i in (model.eos_id, model.config.eot_id) if i is not None}
  token_ids = []
  for row in generated_BxN:
    ends = np.flatnonzero(np.isin(row, list(stops))) if stop_at_eos and stops else []
    token_ids.append(row[:ends[0]] if len(ends) else row)
  texts = None
  if model.tokenizer is not None:
    texts = [_tokenize(model, lambda: model.tokenizer.decode([int(t) for t in row]))
             for row in token_ids]
  return Completion(token_ids=token_ids, texts=texts, prompt_BxP=prompt_BxP,
                    attention_mask_BxP=mask_BxP)
