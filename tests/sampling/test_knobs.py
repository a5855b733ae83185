"""The knob registry: every scalar field of every registered spec is a knob, read from the
spec's own fields; a value from outside is checked by type and range with one error type."""

import dataclasses

import pytest

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.sampling import knobs
from mdjax.sampling.families import dream


def test_every_scalar_field_of_every_family_is_a_knob_of_its_type():
  registry = knobs.all_knobs()
  for name, family in sampling.families().items():
    own = knobs.family_knobs(name)
    for field in dataclasses.fields(family.spec_type):
      value = field.default
      if field.metadata.get("internal"):  # set by the library: no flag, no request field
        assert field.name not in own, (name, field.name)
      elif isinstance(value, (bool, int, float, str)):
        assert field.name in own, (name, field.name)
        assert isinstance(value, own[field.name].kind), (name, field.name)
        assert registry[field.name].kind is own[field.name].kind
  assert knobs.family_knobs("confidence")["steps"].required
  assert knobs.family_knobs("confidence")["block_length"].optional
  assert knobs.all_knobs()["schedule"].default == "linear"  # a schedule is given by name
  assert "groups" not in knobs.family_knobs("ordered")  # set by its own notation
  for name in ("record_trajectory", "eos_id"):
    assert name not in registry


def test_every_knob_of_every_family_says_what_it_does_and_takes():
  for name in sampling.families():
    for knob in knobs.family_knobs(name).values():
      assert knob.help.strip(), (name, knob.name)
      if knob.choices is not None:
        assert knob.kind is str and (knob.default in knob.choices or knob.required), knob
  assert knobs.family_knobs("dream")["alg"].choices == dream.ALGS
  assert knobs.all_knobs()["kv_cache"].choices == sampling.KV_CACHES
  assert knobs.all_knobs()["steps"].minimum == 1


def test_a_declared_range_is_one_the_spec_refuses_outside():
  """A value outside a knob's declared choices or range is refused by the spec too: the
  declaration says what the checks already enforce."""
  probes = {"steps": 0, "top_k": 0, "temperature": -1.0, "min_p": 1.5, "eta": 2.0,
            "alg": "nope", "kv_cache": "nope", "score": "nope", "count_rule": "nope"}
  for family, spec_type in ((n, f.spec_type) for n, f in sampling.families().items()):
    own = knobs.family_knobs(family)
    for knob_name, bad in probes.items():
      if knob_name not in own or family in ("local_remask", "field_order", "ordered"):
        continue
      with pytest.raises(ArgumentError):
        own[knob_name].parse(bad)
      required = {"steps": 4} if "steps" in own and own["steps"].required else {}
      required.update({"k": 2} if "k" in own else {})
      with pytest.raises(ValueError):
        spec_type(**{**required, knob_name: bad})


def test_parse_checks_type_and_range_and_names_the_knob():
  knob = knobs.Knob(name="eta", kind=float, default=0.05, minimum=0.0, maximum=1.0)
  assert knob.parse(1) == 1.0 and isinstance(knob.parse(1), float)
  for bad in (True, "0.5", float("nan"), -0.1, 1.5, None):
    with pytest.raises(ArgumentError) as error:
      knob.parse(bad)
    assert error.value.param == "eta" and "in [0.0, 1.0]" in str(error.value)
  steps = knobs.Knob(name="steps", kind=int, default=dataclasses.MISSING, minimum=1)
  assert steps.parse(4.0) == 4
  with pytest.raises(ArgumentError, match="steps=0 is invalid: it must be an integer >= 1"):
    steps.parse(0)
  choice = knobs.Knob(name="alg", kind=str, default="origin", choices=("origin", "entropy"))
  with pytest.raises(ArgumentError, match="one of origin, entropy"):
    choice.parse("nope")
  assert knobs.Knob(name="top_k", kind=int, default=None, optional=True).parse(None) is None


def test_a_spec_check_raises_the_argument_error_naming_the_field():
  with pytest.raises(ArgumentError) as error:
    sampling.ConfidenceSpec(steps=4, top_p=2.0)
  assert error.value.param == "top_p" and isinstance(error.value, ValueError)


def test_one_name_one_type(monkeypatch):
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Clash(sampling.SamplerSpec):
    steps: str = "many"

  class Family(sampling.Family):
    spec_type = Clash

  monkeypatch.setitem(sampling.base._BY_NAME, "zz_clash", Family())
  with pytest.raises(TypeError, match="knob 'steps' is a str in family 'zz_clash'"):
    knobs.all_knobs()


def test_make_spec_names_a_required_field_left_out():
  """A family whose spec has a field with no default (speculative's k): `make_spec` names
  it (was a TypeError quoting SpeculativeSpec.__init__, a 21-line traceback in sample.py)."""
  for family, registered in sampling.families().items():
    required = [f.name for f in dataclasses.fields(registered.spec_type)
                if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if not required:
      continue
    with pytest.raises(ArgumentError) as error:
      sampling.make_spec(family)
    assert error.value.param == required[0] and f"needs {required[0]}" in str(error.value)
  with pytest.raises(ArgumentError, match="needs k"):
    sampling.make_spec("speculative")
