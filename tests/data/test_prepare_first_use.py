"""prepare_data as a new user meets it: one text file, a small folder (the documented commands),
the tail held out when documents are few, a small validation split named, no partial --out
after a failure, and the command line's one-line errors and exit statuses."""

import math
import os
import re
import shlex

import numpy as np
import pytest

from mdjax import data, tasks
from mdjax.prepare_data import main, prepare
from mdjax.tasks.text import shakespeare_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _play(chars, name="tempest"):
  return open(shakespeare_files()[name], encoding="utf-8").read()[:chars]


def _folder(tmp_path, count=20, chars=3000):
  """`count` .txt files, the openings of as many plays."""
  folder = tmp_path / "books"
  folder.mkdir()
  for name in sorted(shakespeare_files())[:count]:
    (folder / f"{name}.txt").write_text(_play(chars, name), encoding="utf-8")
  return folder


def _stream(out, split):
  manifest = data.read_manifest(str(out))
  tokens = data.Split(str(out), split, manifest)
  return tokens.tokens(0, tokens.num_tokens)


def test_one_text_file_holds_out_the_tail_of_its_text(tmp_path, capsys):
  text = _play(20_000)
  (tmp_path / "play.txt").write_text(text, encoding="utf-8")
  out = tmp_path / "out"
  manifest = prepare([str(tmp_path / "play.txt")], "char", str(out), validation_fraction=0.05)
  # The stated rule: from the start of the line holding character C - ceil(f C).
  cut = len(text) - math.ceil(0.05 * len(text))
  at = text.rfind("\n", 0, cut) + 1
  assert 0 < at <= cut and manifest["validation_rule"] == "tail"
  assert manifest["validation_from_character"] == cut
  tok = data.load_tokenizer(str(out))
  np.testing.assert_array_equal(_stream(out, "train"), np.append(tok.encode(text[:at]), tok.eos_id))
  np.testing.assert_array_equal(_stream(out, "validation"),
                                np.append(tok.encode(text[at:]), tok.eos_id))
  assert "1 document(s), fewer than the 20 that --validation_fraction=0.05 needs" in (
      capsys.readouterr().err)
  tasks.check("corpus", dict(data_dir=str(out), length=128))  # the trainer takes it
  # One line without a line end: the tail starts at the character itself.
  (tmp_path / "line.txt").write_text("abcd" * 250, encoding="utf-8")
  prepare([str(tmp_path / "line.txt")], "char", str(tmp_path / "line"), validation_fraction=0.1)
  assert len(_stream(tmp_path / "line", "train")) == 900 + 1
  assert len(_stream(tmp_path / "line", "validation")) == 100 + 1


def _documented_commands():
  """Each `python -m mdjax.prepare_data` command of README.md and docs/training.md."""
  found = []
  for page in ("README.md", "docs/training.md"):
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    found += [(page, line) for line in re.findall(r"^\.venv/bin/python -m mdjax\.prepare_data .*$",
                                                  text, re.M)]
  assert len(found) >= 2, found
  return found


@pytest.mark.parametrize("page,command", _documented_commands())
@pytest.mark.slow
def test_the_documented_command_prepares_a_small_folder(tmp_path, capsys, page, command):
  # The flags of the page's command, its folders replaced by a folder of 20 play openings.
  folder = _folder(tmp_path, chars=8000)
  argv = shlex.split(command)[3:]
  argv = [a.replace("/data/books_tok", str(tmp_path / "tok")) for a in argv]
  argv = [a.replace("/data/books", str(folder)) for a in argv]
  assert main(argv) == 0, capsys.readouterr().err
  err = capsys.readouterr().err
  assert not re.search(r"validation_fraction=0(?![.\d])", err)  # the trainer refuses it
  manifest = data.read_manifest(str(tmp_path / "tok"))
  assert manifest["splits"]["validation"]["tokens"] > 0
  tasks.check("corpus", dict(data_dir=str(tmp_path / "tok"), length=128))  # the trainer takes it


def test_a_small_validation_split_is_named(tmp_path, capsys):
  # 300 short paragraphs at 1%: three held out, fewer than 4 windows of 128 tokens.
  words = ["thou art the king of night and fair love"] * 300
  (tmp_path / "words.txt").write_text("\n\n".join(words), encoding="utf-8")
  manifest = prepare([str(tmp_path / "words.txt")], "char", str(tmp_path / "out"),
                     documents="paragraph")
  assert manifest["splits"]["validation"]["documents"] == 3
  assert manifest["validation_rule"] == "documents"
  err = capsys.readouterr().err
  assert ("warning: the validation split holds 123 tokens, less than one window of 128 "
          "(configs/corpus.py's length): train.py refuses it at that length") in err
  # A clean corpus: nothing said but the progress.
  prepare([str(tmp_path / "words.txt")], "char", str(tmp_path / "half"), documents="paragraph",
          validation_fraction=0.5)
  assert "prepare_data:" not in capsys.readouterr().err


def test_the_count_comes_before_the_tokenizer(tmp_path, monkeypatch):
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text('{"text": "' + "a long first document " * 50 + '"}\n{"body": "b"}\n')

  def never(*args, **kwargs):
    raise AssertionError("the BPE was trained before the inputs were checked")

  monkeypatch.setattr("mdjax.prepare_data.BpeTokenizer.train", never)
  with pytest.raises(ValueError, match=rf"{jsonl}:2: no text field 'text'"):
    prepare([str(jsonl)], "bpe:300", str(tmp_path / "out"), bpe_training_chars=100)


def test_a_failed_run_leaves_no_partial_out(tmp_path):
  folder = tmp_path / "in"
  folder.mkdir()
  (folder / "a.txt").write_text(_play(5000), encoding="utf-8")
  (folder / "b.txt").write_bytes(b"fine, then \xff\xfe not UTF-8")
  for out in (tmp_path / "new", tmp_path / "kept"):
    if out.name == "kept":  # an existing folder keeps what it held, and only that
      out.mkdir()
      (out / "notes.md").write_text("mine")
    with pytest.raises(ValueError, match=r"b.txt is not UTF-8 text"):
      prepare([str(folder)], "bpe:300", str(out), validation_fraction=0.5,
              bpe_training_chars=1000)
    assert sorted(os.listdir(tmp_path)) == ["in"] + (["kept"] if out.name == "kept" else [])
  assert os.listdir(tmp_path / "kept") == ["notes.md"]
  # Moved into an existing folder on success, beside what it held.
  (folder / "b.txt").write_text("now text", encoding="utf-8")
  prepare([str(folder)], "char", str(tmp_path / "kept"), validation_fraction=0.5)
  assert {"notes.md", "manifest.json", "train-00000.bin"} <= set(os.listdir(tmp_path / "kept"))
  assert sorted(os.listdir(tmp_path)) == ["in", "kept"]


def test_command_line_errors_are_one_line_with_their_status(tmp_path, capsys):
  folder = _folder(tmp_path, count=2, chars=500)
  good = [f"--input={folder}", "--tokenizer=char", f"--out={tmp_path / 'out'}"]

  def error_of(argv, status):
    if status == 2 and any(a.startswith("--bogus") for a in argv):
      with pytest.raises(SystemExit) as exit_:
        main(argv)
      assert exit_.value.code == 2
    else:
      assert main(argv) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("prepare_data: error: ") and "\n" not in err, err
    return err

  # Usage (flags): exit status 2.
  assert "unrecognized arguments: --bogus" in error_of(good + ["--bogus=1"], 2)
  assert "--tokenizer='bpe:12'" in error_of(good[:1] + ["--tokenizer=bpe:12"] + good[2:], 2)
  assert "--validation_fraction=1.0 must lie in [0, 1)" in error_of(
      good + ["--validation_fraction=1"], 2)
  assert "must be 0 or at least 1e-12" in error_of(good + ["--validation_fraction=1e-300"], 2)
  assert main(good + ["--validation_fraction=0.5"]) == 0
  capsys.readouterr()
  assert "already holds a prepared corpus" in error_of(good, 2)
  # Runtime (the inputs): exit status 1.
  (folder / "bad.txt").write_bytes(b"\xff")
  assert "bad.txt is not UTF-8" in error_of(good[:2] + [f"--out={tmp_path / 'o2'}"], 1)


def test_a_tokenizer_json_without_the_texts_characters_is_one_line(tmp_path, capsys):
  # A character-level tokenizer.json with no unknown token (what causal_export writes): the
  # tokenizers library raises "WordLevel error: Missing [UNK] token" from inside a batch.
  from mdjax.convert.causal_export import char_tokenizer_json
  vocab = tmp_path / "tokenizer.json"
  vocab.write_text(char_tokenizer_json("\n abdehlorw"), encoding="utf-8")
  (tmp_path / "in.txt").write_text("hello world\nhello zebra\n", encoding="utf-8")
  out = tmp_path / "out"
  status = main([f"--input={tmp_path / 'in.txt'}", f"--tokenizer={vocab}", "--eos_token=<s>",
                 f"--out={out}"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert status == 1, err  # found in the inputs, as a file that is not UTF-8
  assert err.startswith(f"prepare_data: error: --tokenizer='{vocab}' cannot encode the input: "
                        "text holds 'z' (in 'hello zebra\\n'), which the tokenizer has no id for "
                        "(WordLevel error: Missing [UNK] token"), err
  assert sorted(os.listdir(tmp_path)) == ["in.txt", "tokenizer.json"]  # no partial --out


def test_md_files_are_text_and_skipped_files_are_named(tmp_path, capsys):
  folder = tmp_path / "notes"
  (folder / "sub").mkdir(parents=True)
  (folder / "a.md").write_text("# Notes\n\nsome text\n", encoding="utf-8")
  (folder / "sub" / "b.txt").write_text("more text\n", encoding="utf-8")
  (folder / "c.pdf").write_bytes(b"%PDF")
  (folder / "d.html").write_text("<p>", encoding="utf-8")
  manifest = prepare([str(folder)], "char", str(tmp_path / "out"), validation_fraction=0.3)
  assert [os.path.basename(i["path"]) for i in manifest["inputs"]] == ["a.md", "b.txt"]
  assert (f"prepare_data: skipped 2 file(s) that are not .txt, .md or .jsonl: {folder}/c.pdf, "
          f"{folder}/d.html.") in capsys.readouterr().err
  # A single .md file is text too.
  single = prepare([str(folder / "a.md")], "char", str(tmp_path / "one"), validation_fraction=0.3)
  assert single["splits"]["train"]["tokens"] > 0
