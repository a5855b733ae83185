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
