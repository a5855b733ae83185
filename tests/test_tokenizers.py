"""mdjax.tokenizers: mdjax's tokenizers and a folder's tokenizer.json, below the tasks and the
data pipeline that use them. (The tokenizers' behaviour: tests/tasks/test_text.py.)"""

import os
import subprocess
import sys

import pytest

from mdjax import tokenizers
from tests.paths import REPO


def test_characters_of_counts_a_document_separator():
  tok = tokenizers.CharTokenizer.from_text("ab\n", eos=True)
  assert tokenizers.characters_of(tok, [0, tok.eos_id, 1]) == 2 + len(
      tokenizers.DOCUMENT_SEPARATOR)


def test_a_folders_tokenizer_json(tmp_path):
  folder = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")
  assert tokenizers.load_hf_tokenizer(folder).get_vocab_size() > 0
  assert tokenizers.load_hf_tokenizer(str(tmp_path)) is None
  (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
  with pytest.raises(ValueError, match=r"tokenizer.json: unreadable tokenizer"):
    tokenizers.load_hf_tokenizer(str(tmp_path))


def test_text_a_tokenizer_json_cannot_encode_names_the_character():
  # A WordLevel vocabulary without an unknown token: the library's bare Exception becomes a
  # ValueError naming the first character it has no id for, in every encode path.
  from mdjax.convert.causal_export import char_tokenizer_json
  from mdjax.data.shards import HfTokenizer
  tok = HfTokenizer(char_tokenizer_json(" abc"), "<s>")
  assert tok.encode("ab c").tolist() == [1, 2, 0, 3]
  for encode in (tok.encode, lambda t: tok.encode_batch([t]), lambda t: tok.encode_many([t])):
    with pytest.raises(tokenizers.UnencodableText, match=r"text holds 'x' \(in 'ab cx b'\), "
                       "which the tokenizer has no id for \\(WordLevel error"):
      encode("ab cx b")


@pytest.mark.slow
def test_the_data_rooms_import_no_task():
  code = ("import sys, mdjax.data, mdjax.tokenizers\n"
          "assert not [m for m in sys.modules if m.startswith('mdjax.tasks')], 'tasks'\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
