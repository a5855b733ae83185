"""The knob registry: every scalar field of every registered spec is a knob, read from the
spec's own fields; a value from outside is checked by type and range with one error type."""

import dataclasses

import pytest

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.sampling import knobs


def test_every_scalar_field_of_every_family_is_a_knob_of_its_type():
  registry = knobs.all_knobs()
  for name, family in sampling.families().items():
    own = knobs.family_knobs(name)
    for field in dataclasses.fields(family.spec_type):
      value = field.default
      if isinstance(value, (bool, int, float, str)):
        assert field.name in own, (name, field.name)
        assert isinstance(value, own[field.name].kind), (name, field.name)
        assert registry[field.name].kind is own[field.name].kind
  assert knobs.family_knobs("confidence")["steps"].required
  assert knobs.family_knobs("confidence")["block_length"].optional
  assert knobs.all_knobs()["schedule"].default == "linear"  # a schedule is given by name
  assert "groups" not in knobs.family_knobs("ordered")  # set by its own notation


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
