"""Fixtures shared by test modules."""

import pytest

from mdjax import train
from tests.text_fixtures import tiny_config, write_corpus


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """A tiny corpus file, and a denoiser and a causal reference trained on it in seconds."""
  root = tmp_path_factory.mktemp("text")
  corpus = write_corpus(root / "corpus.txt")
  for name, causal in (("char", False), ("causal", True)):
    train.train(tiny_config(corpus, causal), str(root / name), log=lambda *a: None)
  return root, corpus
