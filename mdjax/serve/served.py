"""Which samplers a lane serves (one step at a time on a padded canvas), and a sampler family
named by a request as the model's default sampler."""

from __future__ import annotations

import dataclasses

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.model import ConfiguredSampler, Model
from mdjax.sampling import canvas_stepping

# Families whose specs name canvas positions: a padded canvas would move them.
POSITIONAL = ("ordered", "field_order")
ROUNDS = "it runs rounds of its own, not one step at a time"
# DiffusionGemma's canvases are its default sampler, laid out by the model (the prompt as
# the encoder's, the canvas width, its stop ids); a request names none of that.
DEFAULT_ONLY = "it is the DiffusionGemma model's default sampler: leave sampler out"


def why_not_served(run, family) -> str | None:
  """Why a sampler cannot run one step at a time on a lane (None: it can). Every step-wise
  family is served: on one canvas (KV-cached specs too: `lanes`), or block by block
  (`block_lanes`); a spec that names canvas positions on a canvas of exactly its prompt and
  new tokens (`POSITIONAL`); record_trajectory is left to the canvas events; and
  DiffusionGemma's canvases, a step of a canvas a tick and its encoder pass as the canvas's
  commit (`canvas_lanes`). The other composite families are not: a step of theirs is
  rounds of several programs (speculative verification, local remasking's inner runs),
  which `Stepper.start` refuses."""
  if family.composite and not canvas_stepping.serves(run.spec):
    return ROUNDS
  return None


def named_sampler(model: Model, sampler: str, knobs: dict) -> ConfiguredSampler:
  """A sampler family by name (sample.py's --sampler) as the default sampler: the model's
  reference defaults (greedy for a published checkpoint) for knobs not given, its EOS."""
  known = sorted(sampling.families()) + ["left_to_right"]
  if not isinstance(sampler, str) or sampler not in known:
    raise ArgumentError.invalid("sampler", sampler, f"it must be a sampler family's name: one "
                                f"of {', '.join(known)}")
  family = sampling.families().get(sampler)
  why = (DEFAULT_ONLY if sampler == "diffusion_gemma_canvases" else ROUNDS
         if family and family.composite else "its spec names canvas positions"
         if sampler in POSITIONAL else None)
  if why == DEFAULT_ONLY:
    raise ArgumentError("sampler", f"sampler={sampler!r} is not named by a request: {why} "
                        "(a DiffusionGemma server runs it by default, its knobs as fields).")
  if why:  # refused before its spec is built (its required fields are no request's)
    raise ArgumentError("sampler", f"sampler={sampler!r} is not served: {why}; use "
                        "mdjax.generate (or sample.py) for it.")
  named = ConfiguredSampler(family=sampler, eos_id=model.eos_id)
  fields = set(named.knobs)
  defaults = {} if model.sampler is None else dict(model.sampler.spec_defaults)
  inherited = {k: v for k, v in defaults.items() if k in fields and k not in knobs}
  return dataclasses.replace(named, settings=tuple(sorted(inherited.items())))
