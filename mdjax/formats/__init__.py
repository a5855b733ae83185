"""The published model formats, one file each, and their one registry.

A format's file (`llada`, `dream`, `sdar`, `fast_dllm_v2`, `llada2`, `mdlm`, `bd3lm`, `llama`,
`qwen2`, `diffusion_gemma`) holds all mdjax knows of that published family: config.json (or
another layout's tree) <-> its config (with what the params cannot express refused by key),
its tensors <-> params, the denoiser, its
special ids and length, save-time rules, its reference sampler (`Format.sampler`) and the
reference code's own sampling call on ids (`llada.generate`, `dream.diffusion_generate`,
`mdlm.mdlm_sample`, `bd3lm.bd3lm_sample`). A new format is its file and one line below.
Reading and writing the files themselves is `mdjax.io`.
"""

from __future__ import annotations

from mdjax.formats.base import Format, Leaf
from mdjax.formats.bd3lm import BD3LMFormat
from mdjax.formats.diffusion_gemma import DiffusionGemmaFormat
from mdjax.formats.dream import DreamFormat
from mdjax.formats.fast_dllm_v2 import FastDllmV2Format
from mdjax.formats.llada import LLaDAFormat
from mdjax.formats.llada2 import LLaDA2Format
from mdjax.formats.llama import LlamaFormat
from mdjax.formats.mdlm import MDLMFormat
from mdjax.formats.qwen2 import Qwen2Format
from mdjax.formats.sdar import SDARFormat
from mdjax.sampling.knobs import Knob

FORMATS: dict[str, Format] = {fmt.family: fmt for fmt in (
    LLaDAFormat(),
    DreamFormat(),
    SDARFormat(),
    FastDllmV2Format(),
    LLaDA2Format(),
    MDLMFormat(),
    BD3LMFormat(),
    LlamaFormat(),
    Qwen2Format(),
    DiffusionGemmaFormat(),
)}


def supported() -> str:
  """The supported model_types and architectures, for error messages."""
  return "; ".join(f"{name}: model_type {'/'.join(map(repr, f.model_types))}, architectures "
                   f"{'/'.join(map(repr, f.architectures))}" for name, f in FORMATS.items())


def detect(raw: dict, where: str) -> Format:
  """The format of a config.json, by model_type (or by architectures when it has none)."""
  for fmt in FORMATS.values():
    if fmt.matches(raw):
      return fmt
  raise ValueError(f"{where}: unsupported model_type={raw.get('model_type')!r}, "
                   f"architectures={raw.get('architectures')!r} (supported: {supported()})")


def reference_knobs() -> dict[str, Knob]:
  """The knobs the reference samplers declare as their own (`Sampler.own_knobs`: a knob no
  spec has, or one that takes other values there), by name; a name two of them declare is
  one record with every value either takes (`Knob.union`)."""
  out: dict[str, Knob] = {}
  for fmt in FORMATS.values():
    for knob in getattr(fmt.sampler, "own_knobs", ()):
      out[knob.name] = out[knob.name].union(knob) if knob.name in out else knob
  return out


def get(name: str) -> Format:
  """The format of the family named `name`; a ValueError naming the known ones otherwise."""
  if name not in FORMATS:
    raise ValueError(f"unknown family {name!r} (supported: {', '.join(FORMATS)})")
  return FORMATS[name]


__all__ = ["FORMATS", "Format", "Leaf", "detect", "get", "reference_knobs", "supported"]
