"""The SFT task's examples file (`mdjax.tasks.sft`): bad data refused in one line before
anything is built, and the rows read once and again when the file changes."""

import os

import jax
import numpy as np
import pytest

from mdjax import train
from mdjax.tasks import sft as sft_data
from tests.paths import REPO

LLADA = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")
SFT_LENGTH = 80  # the LLaDA fixture's chat template takes 24 tokens of a one-word prompt


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a", "response": "b"}\n{"prompt": "What?"}\n',
     r":2: no response: the line has no 'response' field; each line is a JSON object"),
    ('{"prompt": "a", "response": "b"}\n\n{"prompt": "a", "response": "b"\n',
     r":3: not JSON \(Expecting .*column 32\); each line is a JSON object"),
    ('{"prompt": "a", "response": "b"}\n' + "[" * 100_000 + "]" * 100_000 + "\n",
     r":2: nests 100,000 levels of JSON arrays and objects; at most 256 are read\.$"),
    ('{"prompt": "a", "response": "' + "word " * 100 + '"}\n',
     r":1: prompt \(24 tokens\) \+ response \(500\) \+ EOS do not fit length=80; raise "
     r"task_kwargs.length, or set task_kwargs.truncate=True"),
])
def test_sft_data_errors_are_one_line_before_anything_is_built(tmp_path, content, message):
  """train.py prints a ConfigError as one line: each bad file is one, found before the
  workdir exists."""
  from tests.train.test_sft import _sft_config
  data = tmp_path / "data.jsonl"
  data.write_text(content)
  config = _sft_config("pretrained:" + LLADA, **{"task_kwargs.path": str(data),
                                                 "task_kwargs.length": SFT_LENGTH})
  with pytest.raises(train.ConfigError,
                     match=rf"^config field task_kwargs\.path: {data}{message}") as error:
    train.train(config, str(tmp_path / "w"))
  assert "\n" not in str(error.value)
  assert not os.path.exists(tmp_path / "w")


def test_sft_rows_are_read_once_and_again_when_the_file_changes(tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_text('{"prompt": "a", "response": "b"}\n')
  start = "pretrained:" + LLADA
  first = sft_data.bind(path=str(data), start=start, length=SFT_LENGTH)
  again = sft_data.bind(path=str(data), start=start, length=SFT_LENGTH)
  np.testing.assert_array_equal(first.sample_data(jax.random.key(0), 2),
                                again.sample_data(jax.random.key(0), 2))
  data.write_text('{"prompt": "a", "response": "b c d e"}\n{"prompt": "x"}\n')
  with pytest.raises(ValueError, match=rf"^path: {data}:2: no response"):
    sft_data.bind(path=str(data), start=start, length=SFT_LENGTH)


def test_a_start_folder_with_deep_config_json_is_one_line(tmp_path):
  """A start folder's config.json nested 100,000 deep: a RecursionError before, now a
  ConfigError naming the file and the bound, before anything is built."""
  from tests.train.test_sft import _sft_config
  folder = tmp_path / "start"
  folder.mkdir()
  (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(train.ConfigError, match=rf"^config field train.init_from: "
                     rf"{folder}/config.json: nests 100,000 levels of JSON arrays and "
                     rf"objects; at most 256 are read\.$"):
    train.train(_sft_config(f"pretrained:{folder}"), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")
  (folder / "config.json").write_text("[]")
  with pytest.raises(train.ConfigError, match=r"config.json: not a JSON object \(a JSON list\)"):
    train.train(_sft_config(f"pretrained:{folder}"), str(tmp_path / "w"))
