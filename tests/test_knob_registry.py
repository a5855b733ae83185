"""mdjax.knob_registry: every knob a request or a flag may name, the specs' and the reference
samplers', one record of one type a name, taking every value any sampler takes."""

import inspect
import sys

import pytest

from mdjax import formats, sampling
from mdjax.knob_registry import every_knob
from mdjax.sampling import knobs
from mdjax.sampling.knobs import Knob

KINDS = {"bool": bool, "int": int, "float": float, "str": str}


def _reference_samplers():
  return {name: family.sampler for name, family in formats.FORMATS.items()
          if family.sampler is not None}


def test_every_knob_holds_every_family_and_reference_knob_with_help():
  registry = every_knob()
  for family in sampling.families():
    for name, knob in knobs.family_knobs(family).items():
      assert registry[name].kind is knob.kind, (family, name)
  for format_name, sampler in _reference_samplers().items():
    for name in sampler.knobs:
      assert name in registry, (format_name, name)
  assert all(knob.help.strip() for knob in registry.values())
  assert {"record_trajectory", "eos_id", "notation"}.isdisjoint(registry)


def test_a_reference_sampler_declares_its_own_knobs_once_with_its_plans_types():
  """Each format's `knobs` are its own records or spec knobs of the same name, of the type
  its `plan(...)` signature gives them."""
  specs = knobs.all_knobs()
  for format_name, sampler in _reference_samplers().items():
    own = {knob.name: knob for knob in sampler.own_knobs}
    assert set(own) <= set(sampler.knobs), format_name
    assert len(own) == len(sampler.own_knobs), format_name  # once each
    signature = inspect.signature(sys.modules[type(sampler).__module__].plan)
    for name in sampler.knobs:
      knob = own.get(name) or specs.get(name)
      assert knob is not None, (format_name, name, "neither its own nor a spec knob")
      parts = [p.strip() for p in str(signature.parameters[name].annotation).split("|")]
      kinds = [KINDS[p] for p in parts if p != "None"]
      assert kinds == [knob.kind], (format_name, name, parts)
      if name in own and "None" in parts:
        assert knob.optional, (format_name, name)


def test_a_name_several_samplers_take_takes_every_value_of_each():
  registry = every_knob()
  assert registry["kv_cache"].choices == sampling.KV_CACHES + ("prefix",)  # LLaDA's prefix
  assert registry["kv_cache"].parse("prefix") == "prefix"
  assert registry["top_k"].minimum == 0 and registry["top_k"].optional  # SDAR's 0: all
  assert set(registry["order"].choices) == {"score", "position", "max_prob", "lowest_index",
                                            "fixed"}  # confidence's and speculative's
  assert registry["cache"].optional  # MDLM's reference: None decides from the model
  assert registry["cfg_scale"].parse(1) == 1.0
  assert registry["steps"].minimum == 1


def test_union_refuses_two_types_for_one_name():
  a = Knob(name="x", kind=int, default=1, minimum=1, maximum=4)
  b = Knob(name="x", kind=int, default=None, optional=True, minimum=0)
  joined = a.union(b)
  assert (joined.default, joined.optional, joined.minimum, joined.maximum) == (1, True, 0, None)
  with pytest.raises(TypeError, match="one name, one type"):
    a.union(Knob(name="x", kind=float, default=1.0))
