"""python -m mdjax.serve's sampler flags: one a knob of the registry (its type, help and
choices), checked by the knob's range, a bad one a one-line usage error naming the flag."""

import pytest

from mdjax.errors import ArgumentError
from mdjax.knob_registry import every_knob
from mdjax.serve import __main__ as serve_main


def _parse(*flags):
  return serve_main._parser().parse_args(["--model=m", *flags])


def test_every_knob_is_a_flag_of_its_type_and_choices():
  actions = {a.dest: a for a in serve_main._parser()._actions}
  for name, knob in every_knob().items():
    action = actions[name]
    assert action.default is None and knob.help in action.help, name
    if knob.kind is not bool:
      assert action.type is knob.kind and action.choices == knob.choices, name
  args = _parse("--steps=8", "--alg=entropy", "--eos_never", "--first_hitting=false",
                "--top_p=0.5")
  assert serve_main._defaults(args) == {"steps": 8, "alg": "entropy", "eos_never": True,
                                        "first_hitting": False, "top_p": 0.5}
  assert serve_main._defaults(_parse("--sampler=confidence")) == {"sampler": "confidence"}


@pytest.mark.parametrize("flag", ["--alg=nope", "--steps=many", "--eos_never=maybe"])
def test_a_flag_of_the_wrong_type_or_choice_is_one_line(flag, capsys):
  with pytest.raises(SystemExit) as exit_:
    _parse(flag)
  err = capsys.readouterr().err.strip()
  assert exit_.value.code == 2 and len(err.splitlines()) == 1
  assert err.startswith("mdjax.serve: error: ") and flag.split("=")[0] in err


def test_a_value_out_of_range_names_its_flag(capsys):
  with pytest.raises(ArgumentError) as error:
    serve_main._defaults(_parse("--steps=0"))
  with pytest.raises(SystemExit):
    serve_main._usage_error(error.value, {"steps"})
  assert capsys.readouterr().err.startswith(
      "mdjax.serve: error: --steps=0 is invalid: it must be an integer >= 1")
  with pytest.raises(SystemExit):
    serve_main._usage_error(ArgumentError("spec.block_length", "spec.block_length=3 must "
                                          "divide max_new_tokens=4."), {"block_length"})
  assert "error: --block_length=3 must divide" in capsys.readouterr().err
