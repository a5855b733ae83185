"""AR -> diffusion conversion (`mdjax.convert`): at attention fraction 0 the converted network
is the causal judge (transformers' logits, shifted by one); the folders `mdjax.load` reads,
in Dream's and Fast-dLLM v2's published tensor layout; a reused mask id; attention annealing;
bad input refused by name with no folder left."""

import dataclasses
import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest

from mdjax import convert, io
from mdjax.convert import __main__ as convert_main
from mdjax.convert import a2d
from mdjax.io import tensors
from mdjax.models import layers, published
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")
JUDGE = os.path.join(FIXTURES, "judge")
# transformers' float32 logits against mdjax's causal judges (tests/formats/test_judge.py).
LOGITS_ATOL = 1e-4


@functools.cache
def reference():
  with np.load(os.path.join(JUDGE, "reference.npz")) as z:
    return dict(z)


@functools.cache
def conversion(family):
  """(Plan, converted params) of a judge fixture's masked conversion, in memory."""
  chosen, params, _ = convert.converted(os.path.join(JUDGE, family), to="masked",
                                        written=False)
  return chosen, params


def _qwen3_folder(path) -> str:
  """A Qwen3 causal folder: the SDAR fixture's tensors (Qwen3's names, q/k norm) under a
  Qwen3ForCausalLM config.json."""
  source = os.path.join(FIXTURES, "sdar")
  os.makedirs(path, exist_ok=True)
  for name in os.listdir(source):
    if name.endswith((".safetensors", ".json")) and name != "config.json":
      shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
  with open(os.path.join(source, "config.json")) as f:
    raw = json.load(f)
  for key in ("auto_map", "block_size", "mask_token_id", "attn_implementation", "debug",
              "ep_size", "fuse_cross_entropy", "micro_forward", "skip_checkpoint", "use_deepep"):
    raw.pop(key, None)
  raw.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(raw, f)
  return str(path)


# ----------------------------------------------------------------------------
# Step 0: the causal pattern reproduces the AR model.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_causal_pattern_reproduces_the_ar_logits_shifted(family):
  chosen, params = conversion(family)
  config = chosen.config
  assert config.logit_shift and not config.causal and config.mask_id == chosen.causal.vocab_size
  assert config.vocab_size == chosen.causal.vocab_size + 1 and config.qkv_bias
  # The block conversion's network: the same weights, block-causal (Fast-dLLM v2's).
  block = convert.plan(os.path.join(JUDGE, family), to="block", block_size=4,
                       written=False).config
  assert block == dataclasses.replace(config, family="fast_dllm_v2", block_size=4)
  tokens = reference()[f"{family}_tokens"]
  want = reference()[f"{family}_logits"]  # transformers' causal logits: i predicts token i+1
  vocab = chosen.causal.vocab_size
  logits = np.asarray(jax.jit(lambda p: published.forward(config, p, tokens,
                                                          anneal=(0.0, None)))(params))
  # The shift: the converted prediction for token i is the AR model's output at i - 1.
  np.testing.assert_allclose(logits[:, 1:, :vocab], want[:, :-1], rtol=0, atol=LOGITS_ATOL)
  assert np.isneginf(logits[..., config.mask_id]).all()
  # The block NELBO's pass over [noisy; clean] at fraction 0 (noisy = clean): each block after
  # the clean blocks before it, causal inside, is the AR model too.
  pair = np.asarray(jax.jit(lambda p: published.block_pair(block, p, tokens, tokens,
                                                           anneal=(0.0, None)))(params))
  np.testing.assert_allclose(pair[:, 1:, :vocab], want[:, :-1], rtol=0, atol=LOGITS_ATOL)
  if family == "qwen2":  # fraction 1 (no annealing) is bidirectional: no longer the AR model
    own = np.asarray(jax.jit(lambda p: published.forward(config, p, tokens))(params))
    assert np.abs(own[:, 1:-1, :vocab] - want[:, :-2]).max() > 0.1


def test_qwen3_converts_to_sdar_and_step_0_is_causal(tmp_path):
  folder = _qwen3_folder(tmp_path / "qwen3")
  chosen, params, causal_params = convert.converted(folder, to="block", keep_shift=False)
  assert chosen.layout == "sdar" and chosen.causal.qk_norm and chosen.config.qk_norm
  tokens = np.random.default_rng(0).integers(0, 200, (2, 16))
  want = np.asarray(jax.jit(lambda p: published.forward(chosen.causal, p, tokens))(
      causal_params))
  got = np.asarray(jax.jit(lambda p: published.forward(chosen.config, p, tokens,
                                                       anneal=(0, None)))(params))
  # No shift: the output at i predicts token i + 1 as the AR model's does.
  np.testing.assert_allclose(got[..., :chosen.causal.vocab_size], want, rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match="to='masked': the input has q/k norm"):
    convert.plan(folder, to="masked")
  with pytest.raises(ValueError, match="keep_shift=True: the input has q/k norm"):
    convert.plan(folder, to="block")


def test_anneal_visibility_is_causal_plus_a_fraction_of_later_keys():
  length, p = 32, 0.3
  visible = np.asarray(layers.anneal_visible((p, jax.random.key(3)), length))
  lower = np.tril(np.ones((length, length), bool))
  assert visible[lower].all()
  # Each of the 496 later keys is visible with probability p, independently: the count is
  # Binomial(496, 0.3), mean 148.8, sd sqrt(496 * 0.3 * 0.7) = 10.2; 5 sd is 51.
  upper = int(visible[~lower].sum())
  assert abs(upper - 496 * p) < 51, upper
  np.testing.assert_array_equal(np.asarray(layers.anneal_visible((0, None), length)), lower)
  assert np.asarray(layers.anneal_visible((1, None), length)).all()
  with pytest.raises(ValueError, match="anneal=\\(0.5, None\\)"):
    layers.anneal_visible((0.5, None), length)


# ----------------------------------------------------------------------------
# Folders.
# ----------------------------------------------------------------------------


def _shapes(folder):
  return {name: tuple(info.shape) for name, info in tensors.read_checkpoint(folder).items()}


@pytest.mark.parametrize("to,layout,reference_folder", [
    ("masked", "dream", os.path.join(FIXTURES, "pretrained", "dream")),
    ("block", "fast_dllm_v2", os.path.join(FIXTURES, "fast_dllm_v2"))])
def test_converted_folder_loads_in_the_published_layout(tmp_path, to, layout, reference_folder):
  out = str(tmp_path / "out")
  messages = []
  assert convert.convert(os.path.join(JUDGE, "qwen2"), out, to=to,
                         block_size=4 if to == "block" else None, log=messages.append) == out
  assert "qwen2" in messages[0] and layout in messages[0]
  assert sorted(os.listdir(tmp_path)) == ["out"]  # no OUT.partial left
  model = io.load(out)
  assert model.family == layout and model.mask_id == 300 and model.vocab_size == 301
  assert model.tokenizer.id_to_token(300) == a2d.MASK_TOKEN
  assert model.encode("to be" + a2d.MASK_TOKEN) == model.encode("to be") + [300]
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    assert json.load(f)["mask_token"] == a2d.MASK_TOKEN
  # The published code's layout: the reference fixture's tensor names, and its shapes where
  # the vocabulary (301 rows here, 320 there) is not an axis; its config.json keys.
  ours, theirs = _shapes(out), _shapes(reference_folder)
  assert set(ours) == set(theirs)
  for name, shape in theirs.items():
    assert ours[name] == (shape if "embed_tokens" not in name and "lm_head" not in name
                          else (301, shape[1]))
  with open(os.path.join(out, "config.json")) as f:
    ours_raw = json.load(f)
  with open(os.path.join(reference_folder, "config.json")) as f:
    theirs_raw = json.load(f)
  assert set(theirs_raw) - set(ours_raw) <= {"transformers_version", "conplemenrary_mask"}
  assert ours_raw["model_type"] == theirs_raw["model_type"]
  # The committed fixtures (tests/reference/a2d.py) are this conversion.
  committed = os.path.join(FIXTURES, "a2d", to)
  with open(os.path.join(committed, "config.json")) as f:
    assert json.load(f) == ours_raw
  fresh, kept = tensors.read_checkpoint(out), tensors.read_checkpoint(committed)
  for name in fresh:
    np.testing.assert_array_equal(tensors.read_tensor(fresh[name]),
                                  tensors.read_tensor(kept[name]))
  # Every causal weight kept; the mask row is the mean embedding, its head column zeros.
  judge = io.load(os.path.join(JUDGE, "qwen2"))
  np.testing.assert_array_equal(np.asarray(model.params["embed"])[:300],
                                np.asarray(judge.params["embed"]))
  np.testing.assert_allclose(np.asarray(model.params["embed"])[300],
                             np.asarray(judge.params["embed"]).mean(0), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(model.params["head"])[:, :300],
                                np.asarray(judge.params["head"]))
  assert not np.asarray(model.params["head"])[:, 300].any()


def test_reused_mask_id_takes_a_spare_row(tmp_path):
  judge = io.load(os.path.join(JUDGE, "qwen2"))
  rows = 304  # four spare rows past the tokenizer's 300 ids
  config = dataclasses.replace(judge.config, vocab_size=rows)
  rng = np.random.default_rng(0)
  params = dict(judge.params, embed=np.concatenate([np.asarray(judge.params["embed"]),
                                                    rng.normal(size=(4, 64)).astype(np.float32)]),
                head=np.concatenate([np.asarray(judge.params["head"]),
                                     rng.normal(size=(64, 4)).astype(np.float32)], 1))
  source = str(tmp_path / "spare")
  io.save(params, source, family="qwen2", config=config)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copyfile(os.path.join(JUDGE, "qwen2", name), os.path.join(source, name))
  out = convert.convert(source, str(tmp_path / "out"), to="masked", mask_id=302,
                        log=lambda m: None)
  model = io.load(out)
  assert model.mask_id == 302 and model.vocab_size == rows
  # tokenizer.json holds no gaps: placeholders up to the mask id.
  assert [model.tokenizer.id_to_token(i) for i in (300, 301, 302)] == [
      "<|unused_300|>", "<|unused_301|>", a2d.MASK_TOKEN]
  np.testing.assert_allclose(np.asarray(model.params["embed"])[302],
                             params["embed"][:300].mean(0),
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(model.params["embed"])[303], params["embed"][303])
  with pytest.raises(ValueError, match="mask_id=304 is out of range"):
    convert.plan(source, mask_id=304)


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("source,kwargs,message", [
    ("pretrained/dream", {}, r"model_type='Dream' is not supported \(supported: llama, qwen2, "
                             "qwen3"),
    ("judge/qwen2", {"mask_id": 300}, r"mask_id=300 is out of range"),
    ("judge/qwen2", {"mask_id": 5}, r"mask_id=5 is the tokenizer's token '&': no room"),
    ("judge/qwen2", {"mask_id": 299}, r"mask_id=299 is the tokenizer's token '<\|endoftext"),
    ("judge/qwen2", {"to": "block", "block_size": 5},
     r"block_size=5 must divide the input's max_position_embeddings=64"),
    ("judge/qwen2", {"block_size": 4}, r"block_size=4: only to='block' has blocks"),
    ("judge/qwen2", {"to": "block", "keep_shift": False}, r"keep_shift=False with to='block'"),
    ("judge/qwen2", {"to": "diffusion"}, r"to='diffusion' must be one of"),
    ("judge/qwen2", {"layout": "sdar", "to": "block", "keep_shift": False},
     r"layout='sdar': the input has no q/k norm"),
    ("judge/llama", {"to": "block", "block_size": 4},
     r"layout='fast_dllm_v2': the input cannot be written in it: its config.json does not keep "
     r"rope_scaling=\(4.0, 1.0, 4.0, 32\)"),
])
def test_bad_input_is_refused_and_leaves_no_folder(tmp_path, source, kwargs, message):
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=message):
    convert.convert(os.path.join(FIXTURES, source), str(out), log=lambda m: None, **kwargs)
  assert os.listdir(tmp_path) == []


def test_cli_one_line_naming_the_field(tmp_path, capsys):
  out = tmp_path / "out"
  status = convert_main.main([f"--input={JUDGE}/qwen2", "--to=masked", "--mask_id=7",
                              f"--out={out}"])
  err = capsys.readouterr().err
  assert status == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith("mdjax.convert: error: mask_id=7 is the tokenizer's token")  # named
  with pytest.raises(SystemExit) as usage:  # argparse's errors: the same name, one line
    convert_main.main([f"--input={JUDGE}/qwen2", "--to=sideways", f"--out={out}"])
  err = capsys.readouterr().err
  assert usage.value.code == 2 and err.startswith("mdjax.convert: error: argument --to: "), err
  assert len(err.strip().splitlines()) == 1, err
  assert os.listdir(tmp_path) == []
  os.makedirs(out / "x")
  with pytest.raises(ValueError, match="out=.* exists"):
    convert.convert(os.path.join(JUDGE, "qwen2"), str(out), log=lambda m: None)


def test_masked_without_shift_is_written_in_llada_layout(tmp_path):
  out = convert.convert(os.path.join(JUDGE, "qwen2"), str(tmp_path / "out"), to="masked",
                        keep_shift=False, log=lambda m: None)
  model = io.load(out)
  assert model.family == "llada" and not model.config.logit_shift and model.config.qkv_bias
  assert model.mask_id == 300 and model.tokenizer.id_to_token(300) == a2d.MASK_TOKEN


def test_llama_with_rope_scaling_is_written_as_dream(tmp_path):
  """Llama 3.1's RoPE frequencies are written as Dream's rope_scaling (its rotary module reads
  transformers' "llama3"), and the folder loads to the network converted in memory."""
  out = convert.convert(os.path.join(JUDGE, "llama"), str(tmp_path / "out"), to="masked",
                        log=lambda m: None)
  model = io.load(out)
  chosen, params = conversion("llama")
  assert model.family == "dream" and chosen.causal.rope_scaling is not None
  assert model.config.rope_scaling == chosen.causal.rope_scaling
  tokens = reference()["llama_tokens"]
  ours = np.asarray(jax.jit(lambda p: published.forward(model.config, p, tokens))(model.params))
  want = np.asarray(jax.jit(lambda p: published.forward(chosen.config, p, tokens))(params))
  np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------
# Attacks (issue 55): a linked side file, a vocabulary gap, an OUT.partial not this run's.
# ----------------------------------------------------------------------------


def _copy_of(tmp_path, family="qwen2") -> str:
  source = str(tmp_path / "input")
  shutil.copytree(os.path.join(JUDGE, family), source)
  return source


@pytest.mark.parametrize("name", [a2d.TOKENIZER_CONFIG_FILE, a2d.TOKENIZER_FILE,
                                  "generation_config.json"])
def test_a_linked_side_file_is_refused_before_anything_is_written(tmp_path, name):
  # Before: a tokenizer_config.json linked to any JSON file of the machine was read and its
  # contents written into the output folder (save refuses the same link).
  source = _copy_of(tmp_path)
  secret = tmp_path / "secret.json"
  shutil.copyfile(os.path.join(source, name), secret)
  os.remove(os.path.join(source, name))
  os.symlink(secret, os.path.join(source, name))
  with pytest.raises(ValueError, match=rf"{name}: a symbolic link \(to '{secret}'\); convert "
                     r"copies only regular files of the input folder"):
    convert.convert(source, str(tmp_path / "out"), log=lambda m: None)
  assert sorted(os.listdir(tmp_path)) == ["input", "secret.json"]  # nor OUT, nor OUT.partial


def test_a_vocabulary_gap_past_the_bound_is_refused(tmp_path):
  # Before: one placeholder token a missing id (an 8 MB input: 1.08 GB, 394 MB written).
  source = _copy_of(tmp_path)
  path = os.path.join(source, "config.json")
  with open(path) as f:
    raw = json.load(f)
  size = 300  # the fixture tokenizer's ids
  assert a2d.max_vocab_gap(size) == a2d.MIN_VOCAB_GAP == 1024
  assert a2d.max_vocab_gap(2_000_000) == 20_000
  for vocab, refused in ((size + 1024, False), (size + 1025, True), (2_000_000, True)):
    with open(path, "w") as f:
      json.dump({**raw, "vocab_size": vocab}, f)
    if not refused:  # the plan reads no weight: the gap alone decides
      assert a2d.plan(source).mask_id - size == 1024
      continue
    with pytest.raises(ValueError, match=rf"mask_id={vocab}: the tokenizer has 300 ids, so the "
                       rf"{vocab - size:,} ids between would each be written as a placeholder "
                       rf"token; at most {a2d.max_vocab_gap(vocab):,} are"):
      convert.convert(source, str(tmp_path / "out"), log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == ["input"]
  # A reused id far past the tokenizer's last is refused alike; in memory nothing is written.
  with pytest.raises(ValueError, match=r"mask_id=30000: .* 29,700 ids .* at most 20,000 are "
                     r".* or reuse an id nearer"):
    a2d.plan(source, mask_id=30_000)
  assert a2d.plan(source, mask_id=20_300).mask_id == 20_300  # 20,000 placeholders
  assert a2d.plan(source, written=False).mask_id == 2_000_000


def test_an_existing_out_partial_is_refused_and_kept(tmp_path):
  # Before: OUT.partial was deleted without a word, whoever made it.
  partial = tmp_path / "out.partial"
  partial.mkdir()
  (partial / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=rf"{partial} exists .*remove it, or choose another out"):
    convert.convert(os.path.join(JUDGE, "qwen2"), str(tmp_path / "out"), log=lambda m: None)
  assert (partial / "notes.txt").read_text() == "mine"
  assert sorted(os.listdir(tmp_path)) == ["out.partial"]
  os.remove(partial / "notes.txt")
  os.rmdir(partial)
  os.symlink(tmp_path / "elsewhere", partial)  # a dangling link is refused, not removed
  with pytest.raises(ValueError, match="out.partial exists"):
    convert.convert(os.path.join(JUDGE, "qwen2"), str(tmp_path / "out"), log=lambda m: None)
  assert os.path.islink(partial)


def test_a_failed_conversion_removes_only_its_own_partial(tmp_path, monkeypatch):
  def fail(*args, **kwargs):
    raise ValueError("stop")
  monkeypatch.setattr(a2d, "_check_written", fail)
  with pytest.raises(ValueError, match="stop"):
    convert.convert(os.path.join(JUDGE, "qwen2"), str(tmp_path / "out"), log=lambda m: None)
  assert os.listdir(tmp_path) == []


def test_causal_export_errors_name_the_program(tmp_path, capsys):
  from mdjax.convert import causal_export
  status = causal_export.main([f"--workdir={tmp_path}", f"--out={tmp_path / 'llama'}"])
  err = capsys.readouterr().err
  assert status == 2 and err == (f"mdjax.convert.causal_export: error: workdir={str(tmp_path)!r} "
                                 "holds no checkpoint.\n"), err
