"""A published checkpoint as the one `mdjax.model.Model` record, the last step of reading a
folder (`published_model`, also for params built in memory): its format's denoiser, special
ids, length and reference sampler (`mdjax.formats`), the text codec of its tokenizer.json and
its chat template's renderer (`chat_template`)."""

from __future__ import annotations

import os
from typing import Callable, Sequence

from mdjax import formats
from mdjax.io.chat_template import render_chat
from mdjax.model import Model
from mdjax.tokenizers import TOKENIZER_FILE, tokenizer_failure


def _tokenizing(call, where: str):
  """call() of a tokenizer; the library's failure (a panic included) as a ValueError naming
  `where` (tokenizer.json)."""
  try:
    return call()
  except BaseException as e:
    if not tokenizer_failure(e):
      raise
    raise ValueError(f"{where}: the tokenizer failed ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None


def text_codec(tokenizer, source: str | None
               ) -> tuple[Callable[..., list[int]] | None, Callable[[Sequence[int]], str] | None]:
  """(encode(text, add_special_tokens=False) -> ids, decode(ids) -> text) of a
  `tokenizers.Tokenizer` (None, None without one)."""
  if tokenizer is None:
    return None, None
  where = os.path.join(source, TOKENIZER_FILE) if source else "the model's tokenizer"

  def encode(text: str, add_special_tokens: bool = False) -> list[int]:
    return list(_tokenizing(lambda: tokenizer.encode(
        text, add_special_tokens=add_special_tokens).ids, where))

  def decode(ids: Sequence[int]) -> str:
    return _tokenizing(lambda: tokenizer.decode([int(i) for i in ids]), where)

  return encode, decode


def published_model(*, params, config, family: str | None = None, denoiser=None,
                    tokenizer=None, chat_template: str | None = None, source: str | None = None,
                    hf_config: dict | None = None, bytes_read: int = 0,
                    buffers: dict | None = None) -> Model:
  """The Model of a published checkpoint's parts. family: the registry's name (default
  config.family); denoiser: its denoiser (None: the family's of `config`)."""
  kind = formats.get(family or config.family)
  mask_id, eos_id, eot_id, pad_id = kind.special_ids(config, hf_config)
  encode, decode = text_codec(tokenizer, source)
  return Model(denoiser=kind.denoiser(config) if denoiser is None else denoiser,
               params=params, family=kind.family, vocab_size=config.vocab_size,
               max_len=kind.max_len(config), mask_id_or_none=mask_id, eos_id=eos_id,
               eot_id=eot_id, pad_id=pad_id, encode=encode, decode=decode,
               tokenizer=tokenizer, chat_template=chat_template, chat_renderer=render_chat,
               sampler=kind.sampler, padding_invariant=kind.padding_invariant, config=config,
               source=source, hf_config=hf_config,
               buffers=buffers, bytes_read=bytes_read)

