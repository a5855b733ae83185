"""Every knob a request or a flag may name, in one registry: the sampler specs' knobs
(`mdjax.sampling.knobs`, declared on the spec fields with `knob(...)`) and the published
formats' reference samplers' own (`mdjax.formats.reference_knobs`). sample.py's flags and
the server's request fields and CLI defaults are generated from it.

A name several samplers take is one record of one type, taking every value any of them takes
(`Knob.union`); the sampler that runs checks its own (the spec's `__post_init__`, the
reference's `plan`), with an `ArgumentError` naming the knob.
"""

from __future__ import annotations

from mdjax import formats
from mdjax.sampling import base
from mdjax.sampling.knobs import Knob, all_knobs, family_knobs


def every_knob() -> dict[str, Knob]:
  """Every sampler knob by name: the specs' (the shared spec's first, then the families' by
  name), then the reference samplers' own."""
  out = all_knobs()  # one type a name, else a TypeError
  for family in sorted(base.families()):
    for knob in family_knobs(family).values():
      out[knob.name] = out[knob.name].union(knob)
  for name, knob in formats.reference_knobs().items():
    out[name] = out[name].union(knob) if name in out else knob
  return out
