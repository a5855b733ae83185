"""The request models without a server: one field per registered knob, each checked by its
declared type and range; pydantic's errors become OpenAI's 400 naming the top-level field."""

import pydantic
import pytest

from mdjax.errors import ArgumentError
from mdjax import knob_registry
from mdjax.serve import fields


def _error(model, body, route="completions"):
  with pytest.raises(pydantic.ValidationError) as caught:
    model.model_validate(body)
  return fields.validation_error(caught.value.errors(), route)


def test_every_knob_of_the_registry_is_a_request_field():
  for model in (fields.CompletionRequest, fields.ChatRequest):
    assert set(knob_registry.every_knob()) <= set(model.model_fields)
    assert {"cfg_scale", "remasking", "steps", "temperature"} <= set(model.model_fields)


def test_a_knob_is_checked_by_its_declared_range_and_null_is_absent():
  ok = fields.CompletionRequest.model_validate({"prompt": "Hi", "steps": 4.0, "top_p": None})
  assert ok.steps == 4 and isinstance(ok.steps, int) and ok.top_p is None
  error = _error(fields.CompletionRequest, {"prompt": "Hi", "top_p": 1.5})
  assert error.param == "top_p" and "top_p=1.5 is invalid" in error.message
  assert "<= 1.0" in error.message
  error = _error(fields.CompletionRequest, {"prompt": "Hi", "score": "loudest"})
  assert error.param == "score" and "one of" in error.message
  error = _error(fields.CompletionRequest, {"prompt": "Hi", "stream": "yes"})
  assert error.param == "stream" and "true or false" in error.message


def test_unknown_missing_and_nested_fields_name_the_top_level_field():
  error = _error(fields.ChatRequest, {"prompt": "Hi"}, route="chat")
  assert error.param == "prompt" and "completions route" in error.message
  error = _error(fields.CompletionRequest, {})
  assert error.param == "prompt" and "required" in error.message
  error = _error(fields.ChatRequest, {"messages": [{"role": "wizard", "content": "x"}]}, "chat")
  assert error.param == "messages" and "wizard" in error.message
  error = _error(fields.CompletionRequest, {"prompt": "Hi", "logprobs": 3})
  assert error.param == "logprobs" and "not supported" in error.message
  assert fields.CompletionRequest.model_validate({"prompt": "Hi", "logprobs": False})


def test_prompt_and_stop_shapes():
  def prompts(prompt):
    return fields.CompletionRequest.model_validate({"prompt": prompt}).prompt

  assert prompts("Hi") == prompts(["Hi"]) == ["Hi"]
  assert [p.tolist() for p in prompts([1, 2])] == [[1, 2]]
  assert [p.tolist() for p in prompts([[1, 2]])] == [[1, 2]]
  assert prompts(["a", "b"]) == ["a", "b"]  # OpenAI's batch: several prompts
  assert [p.tolist() for p in prompts([[1], [2, 3]])] == [[1], [2, 3]]
  mixed = prompts(["a", [4]])
  assert mixed[0] == "a" and mixed[1].tolist() == [4]
  for bad in ([["a"]], [[1, 2.5]], [[1], [True]], ["a", [-1]]):
    assert _error(fields.CompletionRequest, {"prompt": bad}).param == "prompt", bad
  assert fields.CompletionRequest.model_validate({"prompt": "x", "stop": "."}).stop == ["."]
  error = _error(fields.CompletionRequest, {"prompt": "x", "stop": ["."] * 17})
  assert error.param == "stop" and "at most 16" in error.message


def test_server_defaults_are_checked_as_requests_are():
  assert fields.check_defaults({"steps": 8, "sampler": "confidence", "top_k": None}) == {
      "steps": 8, "sampler": "confidence"}
  with pytest.raises(ArgumentError, match="steps=0 is invalid") as error:
    fields.check_defaults({"steps": 0})
  assert error.value.param == "steps"
  with pytest.raises(ArgumentError, match="nope= is not a sampler knob"):
    fields.check_defaults({"nope": 1})


def test_a_body_is_utf8_json_nested_at_most_64_deep():
  assert fields.parse_body(b'\xef\xbb\xbf{"prompt": "Hi"}') == {"prompt": "Hi"}  # a BOM
  for raw, words in ((b"\xff\xfe{}", "not UTF-8"), (b'{"prompt": ', "not valid JSON"),
                     (b"[" * 65 + b"]" * 65, "nests 65 levels"),
                     (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON")):
    with pytest.raises(fields.APIError) as error:
      fields.parse_body(raw)
    assert error.value.status == 400 and error.value.param is None
    assert words in error.value.message, error.value.message
  assert fields.parse_body(b"[" * 64 + b"]" * 64) == eval("[" * 64 + "]" * 64)


def test_error_messages_name_the_model_not_its_folder(tmp_path):
  class State:
    model_name = "tiny"
    model_paths = fields.model_paths(type("M", (), {"source": str(tmp_path / "m")})())
  where = str(tmp_path / "m" / "tokenizer_config.json")
  assert fields.public(State, f"{where}: the chat template failed") == (
      "tiny/tokenizer_config.json: the chat template failed")
  assert fields.model_paths(type("M", (), {"source": None})()) == []
