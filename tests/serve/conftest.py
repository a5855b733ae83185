"""The serving tests' model and servers: the tiny Dream checkpoint of tests/fixtures (a
character codec, a chat template, positions from each row's first token), served by a real
uvicorn server on a free port in a thread of the test process (`mdjax.serve.server`)."""

import contextlib
import os

import pytest

import mdjax
from mdjax.serve.server import running
from tests.paths import REPO

DREAM = os.path.join(REPO, "tests", "fixtures", "pretrained", "dream")
CANVAS = 96  # each row's canvas: prompt + max_tokens fit in it


@pytest.fixture(scope="session")
def dream_model():
  return mdjax.load(DREAM)


@contextlib.contextmanager
def running_server(model, *, start=True, model_name="dream", **kwargs):
  """`mdjax.serve.server.running` with the tests' canvas (CANVAS) and model name;
  start=False leaves the engine unstarted."""
  kwargs.setdefault("canvas_length", CANVAS)
  with running(model, model_name=model_name, start_engine=start, **kwargs) as server:
    yield server


@pytest.fixture(scope="module")
def server(dream_model):
  with running_server(dream_model, max_batch=4, max_queue=16) as running_:
    yield running_
