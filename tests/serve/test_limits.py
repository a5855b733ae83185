"""The server's bounds without a server (mdjax.serve.limits, Engine.prepare): every integer
knob of the registry is classified, each bound is an ArgumentError naming the field before
the prompt is encoded, JSON nesting is counted on the bytes."""

import json

import numpy as np
import pytest

from mdjax.errors import ArgumentError
from mdjax.knob_registry import every_knob
from mdjax.serve import limits
from mdjax.serve.engine import Engine


def test_every_integer_knob_is_bounded_or_says_why_not():
  tables = [set(limits.STEP_KNOBS), limits.POSITION_KNOBS, limits.GROUP_KNOBS,
            set(limits.PERIOD_KNOBS), set(limits.FREE_KNOBS), set(limits.MODEL_KNOBS)]
  ints = {name for name, knob in every_knob().items() if knob.kind is int}
  classified = set().union(*tables)
  assert ints == classified, (ints - classified, classified - ints)
  assert sum(len(t) for t in tables) == len(classified)  # each in exactly one table


@pytest.fixture(scope="module")
def engine(dream_model):
  return Engine(dream_model, canvas_length=96)


def test_the_default_max_steps_is_four_a_position(engine, dream_model):
  assert engine.room == 96 and engine.max_steps == 4 * 96
  assert Engine(dream_model, canvas_length=32, max_steps=10).max_steps == 10
  with pytest.raises(ArgumentError) as error:
    Engine(dream_model, max_steps=0)
  assert error.value.param == "max_steps"


@pytest.mark.parametrize("knobs,param,bound", [
    ({"steps": 10**7}, "steps", "384"),
    ({"steps": 385}, "steps", "384"),
    ({"denoising_steps": 10**6}, "denoising_steps", "384"),
    ({"block_length": 10**9}, "block_length", "96"),
    ({"window": 97}, "window", "96"),
    ({"score_groups": 17}, "score_groups", "16"),
    ({"max_post_steps": 385}, "max_post_steps", "384"),
    ({"reference_length": 97}, "reference_length", "96"),
    ({"condition_width": 10**9}, "condition_width", "not a request's"),
    # A period past int64 was an OverflowError in the KV plan (a 500); past the steps a
    # request runs it means nothing more. Every integer knob stays within int32.
    ({"refresh_every": 10**30}, "refresh_every", "2147483647"),
    ({"refresh_every": 385}, "refresh_every", "384"),
    ({"top_k": 2**31}, "top_k", "2147483647"),
    ({"top_k": -10**30}, "top_k", "2147483647"),
])
def test_a_knob_past_its_bound_is_refused_before_the_prompt_is_encoded(engine, knobs, param,
                                                                        bound):
  encoded = []
  model = engine.model.replace(encode=lambda text: encoded.append(text) or [])
  bounded = Engine(model, canvas_length=96)
  with pytest.raises(ArgumentError) as error:
    bounded.prepare("Hi", max_new_tokens=4, seed=0, knobs=knobs)
  assert error.value.param == param and bound in str(error.value), str(error.value)
  assert f"{param}=" in str(error.value)
  assert not encoded  # refused before any tokenizing


def test_the_steps_at_the_bound_are_served_and_the_sampler_s_total_is_checked(engine):
  job = engine.prepare("Hi", max_new_tokens=4, seed=0, knobs={"steps": 384})
  assert job.num_steps == 384
  with pytest.raises(ArgumentError, match="would run 9 steps") as error:
    limits.check_num_steps(9, 8)
  assert error.value.param == "steps"


def test_a_prompt_past_the_canvas_in_bytes_is_refused_before_it_is_tokenized(engine):
  longest = limits.longest_token_bytes(engine.model)
  assert longest == len("<|start_header_id|>")  # the fixture's longest (added) token
  assert engine.max_prompt_bytes == 96 * longest
  encoded = []
  model = engine.model.replace(encode=lambda text: encoded.append(len(text)) or [1])
  bounded = Engine(model, canvas_length=96)
  for prompt in ("x" * (96 * longest + 1), "\u00e9" * (96 * longest // 2 + 1)):
    with pytest.raises(ArgumentError, match="bytes of text") as error:
      bounded.prepare(prompt, max_new_tokens=4, seed=0)
    assert error.value.param == "prompt"
  chat = [{"role": "user", "content": "y" * (96 * longest)}, {"role": "user", "content": "z"}]
  with pytest.raises(ArgumentError, match="contents hold") as error:
    bounded.prepare(chat, max_new_tokens=4, seed=0, where="messages")
  assert error.value.param == "messages"
  many = [{"role": "user", "content": ""}] * 97
  with pytest.raises(ArgumentError, match="97 messages") as error:
    bounded.prepare(many, max_new_tokens=4, seed=0, where="messages")
  with pytest.raises(ArgumentError, match="97 token ids") as error:
    bounded.prepare(np.ones(97, np.int64), max_new_tokens=4, seed=0)
  assert not encoded
  # At the bound the prompt is tokenized (here to one token; a real one is then refused by
  # its tokens).
  bounded.prepare("x" * (96 * longest), max_new_tokens=4, seed=0)
  assert encoded == [96 * longest]


def test_longest_token_bytes_of_each_codec():
  from mdjax.tokenizers import BpeTokenizer, CharTokenizer

  class Of:
    def __init__(self, tokenizer):
      self.tokenizer = tokenizer

  assert limits.longest_token_bytes(Of(CharTokenizer("abc"))) == 4
  bpe = BpeTokenizer.train("the theme of the thesis " * 20, 300)
  longest = limits.longest_token_bytes(Of(bpe))
  assert longest >= len("<|endoftext|>")
  assert all(len(bpe.decode([i]).encode()) <= longest for i in range(bpe.size))
  assert limits.longest_token_bytes(Of(object())) == limits.UNKNOWN_TOKEN_BYTES


@pytest.mark.parametrize("text,depth", [
    (b"", 0), (b"1", 0), (b"{}", 1), (b'{"a": [1, {"b": []}]}', 4),
    (b'{"a": "[[[[{{{{", "b": ["\\"[[["]}', 2),  # brackets in strings, escaped quotes
    (b"[" * 1000 + b"]" * 1000, 1000),
])
def test_json_depth_counts_arrays_and_objects_outside_strings(text, depth):
  assert limits.json_depth(text) == depth


def test_json_depth_of_a_real_request():
  body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "[{"}]}],
          "stream_options": {"include_usage": True}}
  assert limits.json_depth(json.dumps(body).encode()) == 5 <= limits.MAX_JSON_DEPTH
