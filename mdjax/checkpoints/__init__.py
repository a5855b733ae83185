"""The published checkpoint families, one file each, and their one registry.

A family's file (`llada`, `dream`, `sdar`, `fast_dllm_v2`, `llada2`, `mdlm`, `bd3lm`, `llama`,
`qwen2`) holds all mdjax knows of
it: config.json <-> its config (with what the params cannot express refused by key), its
tensors <-> params, the denoiser, its special ids and length, save-time rules and its
reference sampler (`Family.sampler`). A new family is its file and one line below.
"""

from __future__ import annotations

from mdjax.checkpoints.base import Family, Leaf
from mdjax.checkpoints.bd3lm import BD3LM
from mdjax.checkpoints.dream import Dream
from mdjax.checkpoints.fast_dllm_v2 import FastDllmV2
from mdjax.checkpoints.llada import LLaDA
from mdjax.checkpoints.llada2 import LLaDA2
from mdjax.checkpoints.llama import Llama
from mdjax.checkpoints.mdlm import MDLM
from mdjax.checkpoints.qwen2 import Qwen2
from mdjax.checkpoints.sdar import SDAR
from mdjax.sampling.knobs import Knob

FAMILIES: dict[str, Family] = {family.family: family for family in (
    LLaDA(),
    Dream(),
    SDAR(),
    FastDllmV2(),
    LLaDA2(),
    MDLM(),
    BD3LM(),
    Llama(),
    Qwen2(),
)}


def supported() -> str:
  """The supported model_types and architectures, for error messages."""
  return "; ".join(f"{name}: model_type {'/'.join(map(repr, f.model_types))}, architectures "
                   f"{'/'.join(map(repr, f.architectures))}" for name, f in FAMILIES.items())


def detect(raw: dict, where: str) -> Family:
  """The family of a config.json, by model_type (or by architectures when it has none)."""
  for family in FAMILIES.values():
    if family.matches(raw):
      return family
  raise ValueError(f"{where}: unsupported model_type={raw.get('model_type')!r}, "
                   f"architectures={raw.get('architectures')!r} (supported: {supported()})")


def reference_knobs() -> dict[str, Knob]:
  """The knobs the reference samplers declare as their own (`Sampler.own_knobs`: a knob no
  spec has, or one that takes other values there), by name; a name two of them declare is
  one record with every value either takes (`Knob.union`)."""
  out: dict[str, Knob] = {}
  for family in FAMILIES.values():
    for knob in getattr(family.sampler, "own_knobs", ()):
      out[knob.name] = out[knob.name].union(knob) if knob.name in out else knob
  return out


def get(name: str) -> Family:
  """The family named `name`; a ValueError naming the known ones otherwise."""
  if name not in FAMILIES:
    raise ValueError(f"unknown family {name!r} (supported: {', '.join(FAMILIES)})")
  return FAMILIES[name]


__all__ = ["FAMILIES", "Family", "Leaf", "detect", "get", "reference_knobs", "supported"]
