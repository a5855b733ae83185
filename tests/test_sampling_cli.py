"""mdjax.sampling_cli: sample.py's sampler flags generated from the knob registry, which apply
to a family or a reference sampler, the spec they build, the mode rules and a library error
in the flags' words; all without absl's global flags."""

import types

import pytest
from absl import flags

from mdjax import sampling, sampling_cli, tasks
from mdjax.errors import ArgumentError
from mdjax.knob_registry import every_knob

# What sample.py's flags hold when nothing is given (the notations' and DEFAULTS' defaults).
BLANK = {"steps": 8, "k": 4, "base": "confidence", "refill": "ancestral", "refill_steps": 4,
         "order": None, "groups": None, "eos": True, "eos_penalty": None, "eos_never": None,
         "eos_rank_last": None, "workdir": None, "oracle": True, "pretrained": None,
         "live": None, "prompts": None, "blocks_of": None, "max_new_tokens": None,
         "sampler": "ancestral"}


def _spec(family, length=16, task=None, **given):
  values = {**BLANK, **{name: None for name in every_knob() if name not in BLANK}, **given}
  return sampling_cli.sampler_spec(family, values, set(given), length=length, task=task)


def test_every_knob_is_a_flag_of_its_type_choices_and_range():
  fresh = flags.FlagValues()
  holders = sampling_cli.define_flags(fresh)
  registry = every_knob()
  assert set(holders) == set(registry) | set(sampling_cli.NOTATIONS)
  for name, knob in registry.items():
    flag = fresh[name]
    assert flag.default == sampling_cli.DEFAULTS.get(name, sampling_cli.NOTATIONS[name].default
                                                      if name in sampling_cli.NOTATIONS else None)
    assert (sampling_cli.NOTATIONS[name].help if name == "order" else knob.help) in flag.help
    if knob.choices is not None and name != "order":
      assert list(flag.parser.enum_values) == list(knob.choices), name
  fresh(["prog", "--alg=entropy", "--steps=3", "--noeos_never", "--top_p=0.5"])
  assert (fresh.alg, fresh.steps, fresh.eos_never, fresh.top_p) == ("entropy", 3, False, 0.5)
  for bad in ("--alg=nope", "--steps=0", "--top_p=1.5", "--cfg_scale=-1"):
    with pytest.raises(flags.IllegalFlagValueError, match=bad.split("=")[0]):
      fresh(["prog", bad])


def test_a_family_takes_its_spec_knobs_and_its_notations():
  assert "gamma" in sampling_cli.family_flags("entropy_bounded")
  assert "gamma" not in sampling_cli.family_flags("confidence")
  assert {"steps", "base", "refill"} <= sampling_cli.family_flags("local_remask")
  assert "groups" in sampling_cli.family_flags("ordered")
  assert "groups" not in sampling_cli.family_flags("left_to_right")
  assert "cfg_scale" in sampling_cli.reference_only()
  assert "steps" not in sampling_cli.reference_only()


def test_the_spec_of_a_family_from_the_flags_given():
  assert _spec("confidence", steps=4, order="position") == sampling.ConfidenceSpec(
      steps=4, order="position")
  assert _spec("ancestral") == sampling.AncestralSpec(steps=8)  # DEFAULTS
  remask = _spec("local_remask", temperature=0.5, rounds=3)
  assert remask.rounds == 3 and remask.base.temperature == remask.refill.temperature == 0.5
  assert remask.refill.steps == 4 and remask.base.steps == 8
  assert _spec("ordered", groups="0;1-2").groups == ((0,), (1, 2))
  with pytest.raises(ValueError, match="--gamma does not apply to --sampler=confidence; its "
                     "flags: .*--block_length"):
    _spec("confidence", gamma=0.3)
  with pytest.raises(ValueError, match="--cfg_scale does not apply"):
    _spec("confidence", cfg_scale=1.0)
  with pytest.raises(ArgumentError) as error:
    _spec("ordered", groups="0;x")
  assert error.value.param == "groups"
  with pytest.raises(ValueError, match="needs a task with named fields"):
    _spec("field_order", task=tasks.get("two_color"), order="[VOA]")
  scan = tasks.get("scan_and_add")
  assert _spec("field_order", length=scan.length, task=scan,
               order="[VOA][v×9]o×10[ht1]").notation == "[VOA][v×9]o×10[ht1]"


def test_a_reference_sampler_takes_the_knobs_it_names():
  sampler = types.SimpleNamespace(knobs=("steps", "cfg_scale"), spec_defaults={
      "temperature": 0.0})
  model = types.SimpleNamespace(family="llada", sampler=sampler, max_len=16)
  values = {**BLANK, **{name: None for name in every_knob() if name not in BLANK}}
  spec, knobs = sampling_cli.pretrained_sampler(model, {**values, "cfg_scale": 1.5},
                                                {"cfg_scale"})
  assert spec is None and knobs == {"cfg_scale": 1.5}
  with pytest.raises(ValueError, match="--alg does not apply to the llada reference sampler"):
    sampling_cli.pretrained_sampler(model, {**values, "alg": "entropy"}, {"alg"})
  spec, knobs = sampling_cli.pretrained_sampler(model, {**values, "sampler": "confidence"},
                                                {"sampler"})
  assert spec == sampling.ConfidenceSpec(steps=8, temperature=0.0) and knobs == {}


def test_the_modes_refuse_what_they_do_not_read():
  check = lambda given, **values: sampling_cli.check_modes({**BLANK, **values}, set(given))
  check(())
  with pytest.raises(ValueError, match="--cfg_scale applies only with --pretrained"):
    check({"cfg_scale"})
  with pytest.raises(ValueError, match="--max_new_tokens does not apply without --blocks_of"):
    check({"max_new_tokens"}, max_new_tokens=4)
  with pytest.raises(ValueError, match="--eos_never does not apply with --pretrained"):
    check({"eos_never"}, oracle=False, pretrained="/ckpt")
  with pytest.raises(ValueError, match="--groups does not apply with --live"):
    check({"groups"}, live="Hi", max_new_tokens=4)


def test_a_library_error_names_the_flag_that_gave_its_argument():
  values = {"steps": 0, "prompts": "p.jsonl", "length": 4, "block_length": 3}
  message = lambda error, **rename: sampling_cli.flag_message(error, values, rename)
  assert message(ArgumentError("steps", "steps=0 is invalid.")) == "--steps=0 is invalid."
  assert message(ArgumentError("prompts", "prompts line 2 has 9 tokens")) == (
      "--prompts='p.jsonl' line 2 has 9 tokens")
  assert message(ArgumentError("spec.block_length", "spec.block_length=3 must divide")) == (
      "--block_length=3 must divide")
  assert message(ArgumentError("max_new_tokens", "max_new_tokens=9 is too many"),
                 max_new_tokens="length") == "--length=9 is too many"
  assert message(ArgumentError("seed", "seed=-1 is invalid")) == "seed=-1 is invalid"  # no flag
  assert message(ValueError("steps=0 is bad")) == "steps=0 is bad"  # not an ArgumentError


def test_a_typed_prompt_is_ids_when_it_is_a_json_list_of_integers():
  """--live (and the live page's box) read `[10, 1, 2]` as token ids, anything else as text."""
  assert sampling_cli.typed_prompt("[10, 1, 2]") == [10, 1, 2]
  assert sampling_cli.typed_prompt(" [] ") == []
  for text in ("VALS 1 2", "[1, 2.5]", "[true]", "[1, 2", "[\"a\"]", "10, 1, 2", "[[1]]"):
    assert sampling_cli.typed_prompt(text) == text
