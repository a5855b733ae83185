"""prepare_data: shards and manifest, streaming, tokenizers; the pipeline's windows and rows;
bad input."""

import hashlib
import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import pytest

from mdjax import data, tasks
from mdjax.data import shards
from mdjax.prepare_data import in_validation, main, pieces, prepare
from mdjax.tasks.text import shakespeare_files

LENGTH = 16


def _plays(tmp, names=("tempest", "macbeth"), chars=20_000):
  """The opening `chars` characters of some plays, one .txt file each."""
  folder = tmp / "plays"
  folder.mkdir(exist_ok=True)
  files = shakespeare_files()
  for name in names:
    text = open(files[name], encoding="utf-8").read()[:chars]
    (folder / f"{name}.txt").write_text(text, encoding="utf-8")
  return folder


def _documents(folder):
  """The paragraphs of the .txt files of `folder`, in the order prepare_data reads them."""
  docs = []
  for name in sorted(os.listdir(folder)):
    docs += [p for p in (folder / name).read_text(encoding="utf-8").split("\n\n") if p]
  return docs


def _expected_stream(tokenizer, docs, split, fraction):
  """Each document of the split encoded on its own, followed by EOS."""
  kept = [d for i, d in enumerate(docs) if in_validation(i, fraction) == (split == "validation")]
  return np.concatenate([np.append(tokenizer.encode(d), tokenizer.eos_id) for d in kept])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Two plays as paragraphs, characters, small shards and small reading chunks."""
  tmp = tmp_path_factory.mktemp("corpus")
  folder = _plays(tmp)
  out = tmp / "char"
  prepare([str(folder)], "char", str(out), validation_fraction=0.05, shard_tokens=4000,
          documents="paragraph", chunk_chars=1000)
  return folder, out


def test_a_deeply_nested_jsonl_line_is_one_line_error(tmp_path, capsys):
  """100,000 nested arrays on a line: Python's parser raised a RecursionError (a traceback);
  the depth is counted first, and the command prints one line naming the file and line."""
  path = tmp_path / "docs.jsonl"
  path.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
  assert main([f"--input={path}", "--tokenizer=char", f"--out={tmp_path / 'out'}"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err
  assert err.startswith(f"prepare_data: error: input='{path}' line 2: nests 100,000 levels")


def test_manifest_and_shards_hold_each_document_tokenized(corpus):
  folder, out = corpus
  manifest = json.loads((out / "manifest.json").read_text())
  tokenizer = data.load_tokenizer(str(out))
  assert manifest["vocab_size"] == tokenizer.size and manifest["eos_id"] == tokenizer.eos_id
  assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["kind"] == "char"
  tokenizer_bytes = (out / "tokenizer.json").read_bytes()
  assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_bytes).hexdigest()
  docs = _documents(folder)
  for name in ("train", "validation"):
    split = manifest["splits"][name]
    assert split["documents"] == sum(in_validation(i, 0.05) == (name == "validation")
                                     for i in range(len(docs)))
    assert split["tokens"] == sum(s["tokens"] for s in split["shards"])
    stream = []
    for shard in split["shards"]:
      raw = (out / shard["file"]).read_bytes()
      assert hashlib.sha256(raw).hexdigest() == shard["sha256"]
      tokens = np.frombuffer(raw, "<u2")
      starts = np.frombuffer((out / shard["index"]).read_bytes(), "<u8")
      assert len(tokens) == shard["tokens"] and len(starts) == shard["documents"]
      assert tokens[-1] == tokenizer.eos_id and starts[0] == 0  # shards end at documents
      assert np.all(tokens[starts[1:] - 1] == tokenizer.eos_id)
      stream.append(tokens)
    np.testing.assert_array_equal(np.concatenate(stream),
                                  _expected_stream(tokenizer, docs, name, 0.05))
  assert len(manifest["splits"]["train"]["shards"]) >= 3  # 4,000-token shards


def test_streaming_reads_bounded_pieces_and_writes_the_same_shards(corpus, tmp_path):
  folder, out = corpus
  # One document per file (36,000+ characters each) read 1,000 characters at a time: no
  # piece holds much more than a chunk, and the shards equal those of one whole read.
  sizes = [len(t) for t, _, _ in pieces(sorted(str(p) for p in folder.iterdir()), "file",
                                        "text", 1000)]
  assert max(sizes) <= 2000 and sum(sizes) > 30_000
  small, whole = tmp_path / "small", tmp_path / "whole"
  for where, chunk in ((small, 1000), (whole, 1 << 20)):
    prepare([str(folder)], "char", str(where), validation_fraction=0.5, chunk_chars=chunk)
  a, b = (json.loads((p / "manifest.json").read_text())["splits"] for p in (small, whole))
  assert a == b and a["train"]["documents"] == 1
  # The paragraph-split corpus read in 1,000-character chunks matched whole paragraphs above.


def test_bpe_jsonl_and_a_tokenizer_file(tmp_path, corpus):
  folder, _ = corpus
  docs = _documents(folder)[:120]
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(docs)))
  bpe = tmp_path / "bpe"
  manifest = prepare([str(jsonl)], "bpe:300", str(bpe), validation_fraction=0.1,
                     text_field="content", bpe_training_chars=5000)
  assert manifest["tokenizer"]["kind"] == "bpe"
  assert 5000 <= manifest["tokenizer"]["bpe_training_chars"] < 5000 + 1
  tokenizer = data.load_tokenizer(str(bpe))
  assert tokenizer.size == 300 and manifest["vocab_size"] == 300
  split = data.Split(str(bpe), "train", manifest)
  np.testing.assert_array_equal(split.tokens(0, split.num_tokens),
                                _expected_stream(tokenizer, docs, "train", 0.1))
  # The tokenizer.json beside the shards is a `tokenizers` file: prepared with it, the same ids.
  again = tmp_path / "again"
  second = prepare([str(jsonl)], str(bpe / "tokenizer.json"), str(again), 0.1,
                   text_field="content")
  assert second["tokenizer"]["kind"] == "file"
  assert second["splits"] == manifest["splits"]
  # Another tokenizers file whose end-of-document token is '</s>': found, and its id is EOS.
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.train_from_iterator(docs, trainers.BpeTrainer(
      vocab_size=280, special_tokens=["<pad>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  hf.save(str(tmp_path / "hf.json"))
  third = prepare([str(jsonl)], str(tmp_path / "hf.json"), str(tmp_path / "hf"), 0.1,
                  text_field="content")
  hf_tokenizer = data.load_tokenizer(str(tmp_path / "hf"))
  assert isinstance(hf_tokenizer, data.HfTokenizer) and third["tokenizer"]["eos_token"] == "</s>"
  assert third["eos_id"] == hf.token_to_id("</s>") == 1
  split = data.Split(str(tmp_path / "hf"), "train", third)
  np.testing.assert_array_equal(split.tokens(0, split.num_tokens),
                                _expected_stream(hf_tokenizer, docs, "train", 0.1))


def test_ids_past_uint16_are_written_and_read_as_uint32(tmp_path):
  assert shards.dtype_for(1 << 16) == np.dtype("<u2") and shards.dtype_for(70_000) == "<u4"
  writer = shards.SplitWriter(str(tmp_path), "train", shards.dtype_for(70_000), 69_999, 4)
  for doc in ([65_536, 3], [69_998], [1, 2, 66_000]):
    writer.write(np.array(doc))
    writer.end_document()
  entry = writer.close()
  # A shard closes at the first document end at or past 4 tokens.
  assert [s["tokens"] for s in entry["shards"]] == [5, 4] and entry["documents"] == 3
  manifest = {"vocab_size": 70_000, "dtype": "uint32", "splits": {"train": entry}}
  split = data.Split(str(tmp_path), "train", manifest)
  np.testing.assert_array_equal(split.tokens(0, 9), [65_536, 3, 69_999, 69_998, 69_999, 1, 2,
                                                     66_000, 69_999])
  np.testing.assert_array_equal(split.document(2), [1, 2, 66_000])


def _source(out, batch_size=8, seed=0, documents="packed", process_index=0, process_count=1):
  task = tasks.get("corpus", dict(data_dir=str(out), length=LENGTH, documents=documents))
  config = ml_collections.ConfigDict(dict(batch_size=batch_size, seed=seed, eval_batches=2))
  return task, data.batch_source(config, task, process_index=process_index,
                                 process_count=process_count)


def test_packed_and_padded_windows(corpus):
  folder, out = corpus
  task, packed = _source(out)
  tokenizer = task.tokenizer
  stream = _expected_stream(tokenizer, _documents(folder), "train", 0.05)
  windows = packed.windows
  assert len(windows) == len(stream) // LENGTH
  boundaries = [int(o) // LENGTH for o in windows.split.token_offsets[1:-1]]  # shards crossed
  assert boundaries and any(int(o) % LENGTH for o in windows.split.token_offsets[1:-1])
  for i in (0, 1, *boundaries, len(windows) - 1):  # window i is the stream's i-th slice
    np.testing.assert_array_equal(windows[i], stream[i * LENGTH:(i + 1) * LENGTH])
  _, padded = _source(out, documents="padded")
  docs = [d for i, d in enumerate(_documents(folder)) if not in_validation(i, 0.05)]
  assert len(padded.windows) == len(docs)
  for i in range(len(docs)):  # the document, cut at the length, then EOS to the end
    ids = tokenizer.encode(docs[i])[:LENGTH]
    np.testing.assert_array_equal(padded.windows[i][:len(ids)], ids)
    assert np.all(padded.windows[i][len(ids):] == tokenizer.eos_id)
  assert task.vocab_size == tokenizer.size and task.mask_id == tokenizer.size
  assert task.eos_id == tokenizer.eos_id


def test_the_batch_of_a_step_and_each_process_rows(corpus):
  _, out = corpus
  _, source = _source(out)
  epoch = len(source.windows) // 8
  in_order = [source.batch_for(s) for s in range(epoch + 3)]
  # A function of (seed, step): asked out of order, or by a fresh source, the same rows.
  _, other = _source(out)
  for s in (epoch + 2, 3, 0, epoch):
    np.testing.assert_array_equal(other.batch_for(s), in_order[s])
  # An epoch's batches hold distinct windows (a permutation of them); the next epoch is
  # shuffled another way.
  import collections
  every = collections.Counter(tuple(source.windows[i]) for i in range(len(source.windows)))
  seen = collections.Counter(tuple(r) for r in np.concatenate(in_order[:epoch]))
  assert sum(seen.values()) == epoch * 8 and not seen - every
  assert not np.array_equal(in_order[epoch + 1], in_order[1])
  _, reseeded = _source(out, seed=1)
  assert not np.array_equal(reseeded.batch_for(0), in_order[0])
  # Process p of P reads rows [p B/P, (p+1) B/P): concatenated, the one-process batch.
  for count in (2, 4):
    parts = [_source(out, process_index=p, process_count=count)[1] for p in range(count)]
    for s in (0, epoch + 1):
      np.testing.assert_array_equal(np.concatenate([p.batch_for(s) for p in parts]),
                                    in_order[s])
  # The iterator state names the next step; restored, it goes on from there.
  assert source.state() == {"next_index": epoch + 3}
  source.restore(2, {"next_index": 2})
  np.testing.assert_array_equal(source.batch_for(2), in_order[2])
  with pytest.raises(ValueError, match="batch_size=8: must be divisible by the 3 processes"):
    _source(out, process_count=3)


def test_validation_batches_are_fixed_held_out_windows(corpus):
  folder, out = corpus
  task, _ = _source(out)
  config = ml_collections.ConfigDict(dict(batch_size=8, seed=0, eval_batches=2))
  first, again = data.validation_batches(config, task), data.validation_batches(config, task)
  assert len(first) == 2 and first[0].shape == (8, LENGTH)
  np.testing.assert_array_equal(np.concatenate(first), np.concatenate(again))
  held_out = _expected_stream(task.tokenizer, _documents(folder), "validation", 0.05)
  for row in np.concatenate(first):  # each a window of the validation stream
    assert any(np.array_equal(row, held_out[i:i + LENGTH])
               for i in range(0, len(held_out) - LENGTH + 1, LENGTH))
  halves = [data.validation_batches(config, task, process_index=p, process_count=2)[1]
            for p in range(2)]
  np.testing.assert_array_equal(np.concatenate(halves), first[1])
  x = task.validation_data(jax.random.key(0), 4)
  assert x.shape == (4, LENGTH) and x.max() < task.vocab_size


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


def test_bad_inputs_are_named(tmp_path, capsys):
  with pytest.raises(ValueError, match=r"--input='.*missing.txt': no such file or folder"):
    prepare([str(tmp_path / "missing.txt")], "char", str(tmp_path / "out"))
  jsonl = tmp_path / "docs.jsonl"
  jsonl.write_text('{"text": "a"}\n{"body": "b"}\n')
  with pytest.raises(ValueError, match=rf"{jsonl}:2: no text field 'text'.*\['body'\]"):
    prepare([str(jsonl)], "char", str(tmp_path / "out"), validation_fraction=0.0)
  with pytest.raises(ValueError, match=r"--tokenizer='bpe:12': bpe:N needs an integer N >= 258"):
    prepare([str(jsonl)], "bpe:12", str(tmp_path / "out"))
  # The command line: one line on stderr, exit status 1.
  capsys.readouterr()
  assert main([f"--input={tmp_path / 'missing.txt'}", "--tokenizer=char",
               f"--out={tmp_path / 'out'}"]) == 1
  assert capsys.readouterr().err.startswith("prepare_data: error: --input=")


def test_manifest_tokenizer_and_vocabulary_mismatches(corpus, tmp_path):
  _, out = corpus
  copy = shutil.copytree(out, tmp_path / "copy")
  with pytest.raises(ValueError, match=r"vocab_size=99: the corpus .* has \d+ ids"):
    tasks.get("corpus", dict(data_dir=str(copy), length=LENGTH, vocab_size=99))
  with pytest.raises(ValueError, match="was tokenized with another tokenizer"):
    tasks.get("corpus", dict(data_dir=str(copy), length=LENGTH, tokenizer_sha256="0" * 64))
  with pytest.raises(ValueError, match=r"length=5000: the validation split of .* not one packed"):
    tasks.check("corpus", dict(data_dir=str(copy), length=5000))
  (copy / "tokenizer.json").write_text(json.dumps({"char_vocab": "abc"}))
  with pytest.raises(ValueError, match=r"tokenizer.json does not match .*manifest.json"):
    tasks.get("corpus", dict(data_dir=str(copy), length=LENGTH))


def test_truncated_or_corrupt_shards_stop_or_are_skipped(corpus, tmp_path):
  _, out = corpus
  copy = shutil.copytree(out, tmp_path / "copy")
  manifest = data.read_manifest(str(copy))
  shard = copy / "train-00001.bin"
  raw = bytearray(shard.read_bytes())
  shard.write_bytes(raw[:-2])  # truncated
  with pytest.raises(data.CorruptShard, match=r"train-00001.bin holds \d+ bytes; the manifest"):
    data.Split(str(copy), "train", manifest)
  raw[10:12] = np.array([60_000], "<u2").tobytes()  # same size, an id no vocabulary holds
  shard.write_bytes(raw)
  with pytest.raises(data.CorruptShard, match=r"train-00001.bin is corrupt: its SHA-256"):
    data.Split(str(copy), "train", manifest)
  messages = []
  skipped = data.Split(str(copy), "train", manifest, on_corrupt="skip", log=messages.append)
  assert skipped.skipped == ["train-00001.bin"] and "Skipped" in messages[0]
  full = data.Split(str(out), "train", manifest)
  assert skipped.num_tokens == full.num_tokens - manifest["splits"]["train"]["shards"][1]["tokens"]
  # Checked by size only, the altered id is met when read, and the file named.
  sized = data.Split(str(copy), "train", manifest, verify="size")
  start = int(sized.token_offsets[1])
  with pytest.raises(data.CorruptShard, match=r"train-00001.bin holds id 60000, outside"):
    sized.tokens(start, start + 20)
  with pytest.raises(ValueError, match=r"data.on_corrupt='ignore' must be one of"):
    data.Split(str(copy), "train", manifest, on_corrupt="ignore")


def test_the_corpus_config_builds_and_traces_a_train_step(corpus):
  # configs/corpus.py as it is, on the module's corpus: shapes only (jax.eval_shape).
  from configs import corpus as corpus_config
  from mdjax import train
  _, out = corpus
  config = corpus_config.get_config()
  config.task_kwargs.data_dir = str(out)
  train.check_config(config)
  task = tasks.from_config(config)
  built = {}

  def init():
    state, _, built["apply_fn"], _ = train.init_state(config, train.make_mesh(1), task)
    return state

  state = jax.eval_shape(init)
  loss_fn = train.make_loss_fn(config, built["apply_fn"], task)
  x = data.batch_source(config, task).batch_for(0)
  assert x.shape == (config.batch_size, task.length) == (32, 128)
  loss, _ = jax.eval_shape(loss_fn, state.params, jax.random.key(0), x)
  assert loss.shape == ()


def test_config_data_options_reach_the_pipeline(corpus, tmp_path, capsys):
  _, out = corpus
  copy = shutil.copytree(out, tmp_path / "copy")
  (copy / "train-00001.bin").write_bytes((out / "train-00001.bin").read_bytes()[:-2])
  task = tasks.get("corpus", dict(data_dir=str(copy), length=LENGTH))
  config = ml_collections.ConfigDict(dict(batch_size=8, seed=0, data=dict(on_corrupt="stop")))
  with pytest.raises(data.CorruptShard, match="train-00001.bin holds"):
    data.batch_source(config, task)
  config.data.on_corrupt = "skip"
  source = data.batch_source(config, task)
  assert source.windows.split.skipped == ["train-00001.bin"]
  assert "train-00001.bin holds" in capsys.readouterr().err
  assert source.batch_for(0).shape == (8, LENGTH)
  for field, value, allowed in (("on_corrupt", "ignore", "must be one of"),
                                ("threads", -1, "must be an integer >= 0"),
                                ("verify", "none", "must be one of")):
    bad = ml_collections.ConfigDict(dict(batch_size=8, seed=0, data={field: value}))
    with pytest.raises(ValueError, match=rf"config field data.{field}={value!r}: {allowed}"):
      data.batch_source(bad, task)
  typo = ml_collections.ConfigDict(dict(batch_size=8, seed=0, data=dict(thread=2)))
  with pytest.raises(ValueError, match=r"config field data.thread: unknown"):
    data.batch_source(typo, task)
