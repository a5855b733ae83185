"""A prepared corpus from an untrusted source: manifests naming files outside the folder,
links, FIFOs, forged indexes and dtypes, malformed manifests. Each is refused with one
ValueError naming the file (and the field), before anything outside the folder is opened.

The attacker writes the shards and the manifest both: every tampered file below has its
size and SHA-256 rewritten to match, so the checksum proves nothing."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from mdjax import data
from mdjax.prepare_data import prepare
from tests import attacks

WORDS = ("thou", "art", "the", "king", "and", "queen", "of", "night", "fair", "love")

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """40 short paragraphs, characters, 200-token shards: several shards per split."""
  tmp = tmp_path_factory.mktemp("attacks")
  rng = np.random.default_rng(0)
  paragraphs = [" ".join(rng.choice(WORDS, 6)) + "." for _ in range(40)]
  (tmp / "words.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
  prepare([str(tmp / "words.txt")], "char", str(tmp / "corpus"), validation_fraction=0.1,
          documents="paragraph", shard_tokens=200)
  return tmp / "corpus"


@pytest.fixture
def corpus(prepared, tmp_path):
  """A copy to tamper with, in a folder of its own (its parent is 'outside')."""
  return shutil.copytree(prepared, tmp_path / "corpus")


def _manifest(folder):
  return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder, manifest):
  (folder / "manifest.json").write_text(json.dumps(manifest))


def _sha256(raw: bytes) -> str:
  return hashlib.sha256(raw).hexdigest()


def _one_line_naming(error, *parts):
  message = str(error.value)
  assert isinstance(error.value, ValueError), type(error.value)
  assert "\n" not in message, message
  for part in parts:
    assert str(part) in message, (part, message)


def _forge_shard(manifest, i, raw: bytes, name=None):
  """Shard i of the train split made to describe `raw` (tokens, SHA-256, maybe its name)."""
  shard = manifest["splits"]["train"]["shards"][i]
  delta = len(raw) // 2 - shard["tokens"]
  shard.update(tokens=len(raw) // 2, sha256=_sha256(raw), **({"file": name} if name else {}))
  manifest["splits"]["train"]["tokens"] += delta


# ----------------------------------------------------------------------------
# Files outside the corpus folder.
# ----------------------------------------------------------------------------


def test_a_manifest_naming_a_file_outside_the_folder_is_refused_unread(corpus):
  outside = corpus.parent / "outside.bin"
  secret = np.array([7, 8, 9, 10], "<u2").tobytes()  # read as tokens, it would train the model
  outside.write_bytes(secret)
  manifest = _manifest(corpus)
  _forge_shard(manifest, 0, secret, "../outside.bin")
  _write_manifest(corpus, manifest)
  with attacks.recording_opens() as opened, pytest.raises(ValueError) as error:
    data.Split(str(corpus), "train", manifest)
  _one_line_naming(error, "manifest.json", "splits.train.shards[0].file", "../outside.bin")
  assert str(outside) not in opened
  with pytest.raises(ValueError) as error:  # and the manifest itself is refused when read
    data.read_manifest(str(corpus))
  _one_line_naming(error, "manifest.json", "splits.train.shards[0].file")


def test_absolute_paths_in_a_manifest_are_refused_unread(corpus):
  planted = corpus.parent / "planted.bin"
  raw = np.array([1, 2, 3, 0], "<u2").tobytes()
  planted.write_bytes(raw)
  manifest = _manifest(corpus)
  _forge_shard(manifest, 1, raw, str(planted))
  with attacks.recording_opens() as opened, pytest.raises(ValueError) as error:
    data.Split(str(corpus), "train", manifest)
  _one_line_naming(error, "manifest.json", "splits.train.shards[1].file", str(planted))
  assert str(planted) not in opened
  manifest = _manifest(corpus)
  manifest["tokenizer"]["file"] = "/etc/passwd"
  _write_manifest(corpus, manifest)
  with attacks.recording_opens() as opened, pytest.raises(ValueError) as error:
    data.load_tokenizer(str(corpus), manifest)
  _one_line_naming(error, "manifest.json", "tokenizer.file", "/etc/passwd")
  assert "/etc/passwd" not in opened


def test_a_shard_linked_to_a_file_outside_the_folder_is_refused_unread(corpus):
  # The link's target holds the very bytes the manifest describes: size and hash agree.
  outside = corpus.parent / "elsewhere.bin"
  shutil.copyfile(corpus / "train-00000.bin", outside)
  (corpus / "train-00000.bin").unlink()
  (corpus / "train-00000.bin").symlink_to(outside)
  for verify in ("checksum", "size"):
    with attacks.recording_opens() as opened, pytest.raises(ValueError) as error:
      data.Split(str(corpus), "train", _manifest(corpus), verify=verify)
    _one_line_naming(error, "manifest.json", "splits.train.shards[0].file", "outside the corpus")
    assert str(outside) not in opened
  # Not a corrupt shard that on_corrupt='skip' passes over: a folder planted with links stops.
  with pytest.raises(ValueError, match="outside the corpus folder"):
    data.Split(str(corpus), "train", _manifest(corpus), on_corrupt="skip", log=print)


@pytest.mark.parametrize("name, field", [("train-00001.bin", "splits.train.shards[1].file"),
                                         ("train-00001.idx", "splits.train.shards[1].index"),
                                         ("tokenizer.json", "tokenizer.file")])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(corpus, name, field):
  (corpus / name).unlink()
  os.mkfifo(corpus / name)
  with attacks.deadline(), pytest.raises(ValueError) as error:
    if name == "tokenizer.json":
      data.load_tokenizer(str(corpus))
    else:
      data.Split(str(corpus), "train", data.read_manifest(str(corpus)), on_corrupt="skip")
  _one_line_naming(error, "manifest.json", field, "not a regular file")


def test_legitimate_layouts_still_read(corpus):
  # A link inside the folder, and a folder reached through a link, are the corpus's own.
  (corpus / "store").mkdir()
  os.replace(corpus / "train-00000.bin", corpus / "store" / "train-00000.bin")
  (corpus / "train-00000.bin").symlink_to(os.path.join("store", "train-00000.bin"))
  (corpus.parent / "alias").symlink_to(corpus)
  for folder in (corpus, corpus.parent / "alias"):
    manifest = data.read_manifest(str(folder))
    assert data.load_tokenizer(str(folder)).size == manifest["vocab_size"]
    split = data.Split(str(folder), "train", manifest)
    assert split.num_tokens == manifest["splits"]["train"]["tokens"]
    assert split.document(0).size and split.tokens(0, split.num_tokens).max() < split.vocab_size


# ----------------------------------------------------------------------------
# Forged indexes and dtypes.
# ----------------------------------------------------------------------------


def _forge_index(corpus, starts):
  """train-00000.idx rewritten to `starts` (its size kept, its hash in the manifest)."""
  raw = np.array(starts, "<u8").tobytes()
  (corpus / "train-00000.idx").write_bytes(raw)
  manifest = _manifest(corpus)
  manifest["splits"]["train"]["shards"][0]["index_sha256"] = _sha256(raw)
  _write_manifest(corpus, manifest)
  return manifest


@pytest.mark.parametrize("forge, why", [
    (lambda s, n: list(s[:-1]) + [n + 5], "past the shard's"),  # past the end
    (lambda s, n: [s[0], s[2], s[1]] + list(s[3:]), "not after document 1"),  # decreasing
    (lambda s, n: [3] + list(s[1:]), "the first document starts at 0"),
    (lambda s, n: [s[0], s[1], s[1]] + list(s[3:]), "not after document 1"),  # an empty one
])
def test_forged_document_starts_are_refused_whatever_the_verify_mode(corpus, forge, why):
  starts = np.frombuffer((corpus / "train-00000.idx").read_bytes(), "<u8")
  tokens = _manifest(corpus)["splits"]["train"]["shards"][0]["tokens"]
  manifest = _forge_index(corpus, forge([int(s) for s in starts], tokens))
  for verify in ("checksum", "size"):
    with pytest.raises(data.CorruptShard) as error:
      data.Split(str(corpus), "train", manifest, verify=verify)
    _one_line_naming(error, "train-00000.idx", why)
  # A corrupt shard as any other: on_corrupt='skip' leaves it out.
  skipped = data.Split(str(corpus), "train", manifest, on_corrupt="skip", log=lambda _: None)
  assert skipped.skipped == ["train-00000.bin"]


def test_a_signed_dtype_with_negative_ids_is_refused(corpus):
  raw = np.array([-5, -1, 3, 0, 2], "<i2").tobytes()  # ids no vocabulary holds
  (corpus / "train-00000.bin").write_bytes(raw)
  (corpus / "train-00000.idx").write_bytes(np.array([0], "<u8").tobytes())
  manifest = _manifest(corpus)
  manifest["dtype"] = "int16"
  _forge_shard(manifest, 0, raw)
  shard = manifest["splits"]["train"]["shards"][0]
  manifest["splits"]["train"]["documents"] += 1 - shard["documents"]
  shard.update(documents=1, index_sha256=_sha256(np.array([0], "<u8").tobytes()))
  _write_manifest(corpus, manifest)
  with pytest.raises(ValueError) as error:
    data.Split(str(corpus), "train", manifest, verify="size")
  _one_line_naming(error, "manifest.json", "dtype='int16'", "uint16")
  with pytest.raises(ValueError) as error:
    data.read_manifest(str(corpus))
  _one_line_naming(error, "manifest.json", "dtype='int16'")


# ----------------------------------------------------------------------------
# Malformed manifests and tokenizers.
# ----------------------------------------------------------------------------


def _set(path):
  """A change to the manifest at a dotted path (an int selects a list item)."""
  def change(manifest, value):
    *parents, last = path
    for key in parents:
      manifest = manifest[key]
    manifest[last] = value
  return change


@pytest.mark.parametrize("path, value, field", [
    (("splits", "train", "shards", 0), ["train-00000.bin"], "splits.train.shards[0]"),
    (("splits", "train", "shards"), {"file": "x"}, "splits.train.shards"),
    (("splits", "train"), [], "splits.train"),
    (("splits",), [], "splits"),
    (("splits", "train", "shards", 0, "tokens"), -2, "splits.train.shards[0].tokens"),
    (("splits", "train", "shards", 0, "tokens"), "12", "splits.train.shards[0].tokens"),
    (("splits", "train", "shards", 0, "documents"), 1e3, "splits.train.shards[0].documents"),
    (("splits", "train", "shards", 0, "index"), None, "splits.train.shards[0].index"),
    (("splits", "train", "shards", 0, "sha256"), 5, "splits.train.shards[0].sha256"),
    (("splits", "train", "tokens"), 10**9, "splits.train.tokens"),
    (("vocab_size",), 0, "vocab_size"),
    (("vocab_size",), True, "vocab_size"),
    (("dtype",), "object", "dtype"),
    (("eos_id",), 10**6, "eos_id"),
    (("tokenizer",), ["tokenizer.json"], "tokenizer"),
    (("tokenizer", "eos_token"), 3, "tokenizer.eos_token"),
    (("tokenizer", "file"), "..", "tokenizer.file"),
])
def test_malformed_manifest_fields_are_named(corpus, path, value, field):
  manifest = _manifest(corpus)
  _set(path)(manifest, value)
  _write_manifest(corpus, manifest)
  with pytest.raises(ValueError) as error:
    data.read_manifest(str(corpus))
  _one_line_naming(error, "manifest.json", f"field {field}=")
  if path[0] == "splits":  # a manifest handed to Split as it is
    with pytest.raises(ValueError) as error:
      data.Split(str(corpus), "train", manifest)
    _one_line_naming(error, "manifest.json", f"field {field}=")


@pytest.mark.parametrize("text, why", [
    ("[]", "field the manifest=[]"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON"),
    ('{"version": ' + "1" * 5000 + "}", "is not JSON"),
    (b"\xff\xfe{}", "is not JSON"),
])
def test_a_manifest_that_is_no_object_is_named(corpus, text, why):
  write = (corpus / "manifest.json").write_bytes if isinstance(text, bytes) else (
      corpus / "manifest.json").write_text
  write(text)
  with pytest.raises(ValueError) as error:
    data.read_manifest(str(corpus))
  _one_line_naming(error, "manifest.json", why)


@pytest.mark.parametrize("text, why", [
    ('{"model": 1}', "not a `tokenizers` JSON it can read"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON"),
    ('{"char_vocab": ["a", "b"]}', "char_vocab must be a non-empty string"),
])
def test_a_malformed_tokenizer_file_is_named(corpus, text, why):
  (corpus / "tokenizer.json").write_text(text)
  manifest = _manifest(corpus)
  manifest["tokenizer"]["sha256"] = _sha256(text.encode())
  _write_manifest(corpus, manifest)
  with pytest.raises(ValueError) as error:
    data.load_tokenizer(str(corpus))
  _one_line_naming(error, "tokenizer.json", why)


def test_every_shard_skipped_is_a_value_error_naming_the_split(corpus):
  manifest = _manifest(corpus)
  for shard in manifest["splits"]["train"]["shards"]:
    (corpus / shard["file"]).write_bytes(b"")
  with pytest.raises(ValueError) as error:
    data.Split(str(corpus), "train", manifest, on_corrupt="skip", log=lambda _: None)
  _one_line_naming(error, str(corpus), "train split", "skipped")


# ----------------------------------------------------------------------------
# An output folder someone else prepared.
# ----------------------------------------------------------------------------


def _prepare_into(prepared, out):
  prepare([str(prepared.parent / "words.txt")], "char", str(out), validation_fraction=0.1,
          documents="paragraph", shard_tokens=200)


@pytest.mark.parametrize("name", ["tokenizer.json", "train-00000.bin", "validation-00000.idx"])
def test_prepare_writes_through_no_link_or_fifo_in_its_output_folder(prepared, tmp_path, name):
  victim = tmp_path / "victim.txt"
  victim.write_text("keep me")
  for planted in ("link", "fifo"):
    out = tmp_path / planted
    out.mkdir()
    if planted == "link":
      (out / name).symlink_to(victim)
    else:
      os.mkfifo(out / name)
    with attacks.deadline(), pytest.raises(ValueError) as error:  # opened to write, a FIFO waits
      _prepare_into(prepared, out)
    _one_line_naming(error, out / name, "a symbolic link" if planted == "link" else "not a regular file")
    assert victim.read_text() == "keep me"


def test_the_manifest_is_written_through_no_fixed_temporary_name(prepared, tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("keep me")
  out = tmp_path / "out"
  out.mkdir()
  (out / "manifest.json.tmp").symlink_to(victim)
  _prepare_into(prepared, out)
  assert victim.read_text() == "keep me"
  assert data.read_manifest(str(out)) == _manifest(prepared)
  assert sorted(p.name for p in out.iterdir() if "manifest" in p.name) == [
      "manifest.json", "manifest.json.tmp"]
