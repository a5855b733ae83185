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


def test_the_server_s_bounds_are_flags(capsys):
  args = _parse("--max_steps=64", "--max_body_bytes=4096", "--allowed_hosts=a.example,[::1]",
                "--max_lane_bytes=65536")
  assert (args.max_steps, args.max_body_bytes, args.allowed_hosts, args.max_lane_bytes) == (
      64, 4096, "a.example,[::1]", 65536)
  defaults = _parse()
  assert defaults.max_steps is None and defaults.max_body_bytes == 1 << 20
  assert defaults.allowed_hosts is None and defaults.max_lane_bytes is None
  for flag in ("--max_steps=0", "--max_body_bytes=0", "--max_lane_bytes=0"):
    with pytest.raises(SystemExit) as exit_:
      serve_main.main(["--model=m", flag])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith(f"mdjax.serve: error: {flag} is invalid")


def test_allowed_hosts_default_to_the_bound_address_and_this_machine():
  from mdjax.serve.gate import allowed_hosts, host_name
  assert allowed_hosts("0.0.0.0") == ("0.0.0.0", "127.0.0.1", "localhost", "[::1]")
  assert allowed_hosts("::") == ("[::]", "127.0.0.1", "localhost", "[::1]")
  assert allowed_hosts("127.0.0.1", "Mdjax.Internal, ::1") == ("mdjax.internal", "[::1]")
  assert allowed_hosts(None, "*") == ("*",)
  assert [host_name(h) for h in ("LocalHost:8000", "[::1]:80", "10.0.0.5", "[fe80::1]")] == [
      "localhost", "[::1]", "10.0.0.5", "[fe80::1]"]
  with pytest.raises(ValueError, match="allowed_hosts is empty"):
    allowed_hosts(None, " , ")
