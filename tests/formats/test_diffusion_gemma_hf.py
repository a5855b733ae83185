"""DiffusionGemma's Hugging Face layout against the folder transformers' own code wrote
(tests/reference/diffusion_gemma_hf.py: gemma's tiny orbax fixture converted by transformers'
convert_diffusion_gemma_weights.py, saved by save_pretrained in three shards, reloaded by
from_pretrained and run): the load gives the orbax path's network and params bit for bit and
transformers' logits, generation_config.json's settings become the default sampler's, save
writes the folder back tensor for tensor, and bad folders are refused by name."""

import dataclasses
import functools
import json
import shutil

import jax
import numpy as np
import pytest

import mdjax
from mdjax.formats import diffusion_gemma_hf as layout
from mdjax.io import diffusion_gemma_hf as hf_io
from mdjax.io import gemma_params
from mdjax.io import tensors as tensors_lib
from mdjax.models import diffusion_gemma as network
from tests.formats import family_fixtures

FOLDER = family_fixtures.folder("diffusion_gemma_hf") / "model"
ORBAX = family_fixtures.folder("diffusion_gemma") / "params"
# What gemma's tree does not say, as the writer's config.json says it.
GIVEN = {"sliding_window": 32, "experts_per_token": 2, "max_len": 64}
PROMPT = 9
# The writer's generation_config.json, as the default sampler's knobs (t_max -> max_temperature,
# stability_threshold 0 -> early_stop False, canvas_length 8 -> reference_length).
KNOBS = {"steps": 6, "entropy_bound": 2.0, "max_temperature": 1.0, "min_temperature": 0.5,
         "early_stop": False, "entropy_stop": 0.01, "reference_length": 8}

forward = jax.jit(network.forward, static_argnums=0, static_argnames="prompt_length")


@functools.cache
def hf_model():
  return mdjax.load(FOLDER)


@functools.cache
def orbax_model():
  return mdjax.load(ORBAX, config=GIVEN)


@functools.cache
def reference() -> dict:
  with np.load(FOLDER.parent / "reference.npz") as z:
    return dict(z)


def _equal_params(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _tolerance(expected: np.ndarray) -> float:
  # float32 through 6 layers of d_model 32, a 2-of-8 expert mix and a 128-way tied head, in
  # torch and in XLA: a few hundred roundings of the logits' size apart, far under 1e-4 of
  # the largest logit (the bound). The routing choices are the gemma fixture's, which
  # clear a 1e-4 relative margin, so none flips on rounding.
  return family_fixtures.tolerance(expected, 1e-4)


def test_loads_the_orbax_paths_network_and_params():
  m, o = hf_model(), orbax_model()
  assert m.family == "diffusion_gemma" and mdjax.loader.kind_of(str(FOLDER)) == "published"
  assert m.config == o.config and m.config.layer_types == ("local", "local", "global") * 2
  _equal_params(m.params, o.params)  # bit for bit: the conversion only moves values
  assert (m.mask_id, m.eos_id, m.eot_id, m.pad_id) == (o.mask_id, o.eos_id, o.eot_id, 0)
  assert m.noise == o.noise and m.denoiser.self_conditions and m.tokenizer is None
  # Each layer_scalar is stored twice (the encoder's buffer and the decoder's): both read.
  assert m.bytes_read > sum(x.nbytes for x in jax.tree.leaves(m.params))
  assert dict(m.sampler.defaults) == KNOBS


def _check(got, name):
  ref = reference()[name]
  np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=_tolerance(ref), err_msg=name)


def test_logits_match_transformers():
  """The one pass the model's denoiser runs over [prompt; canvas] against transformers'
  decoder pass after its encoder wrote the prompt into a DynamicCache, without and with
  self-conditioning logits (mdjax's condition: `encode_condition` of the same logits)."""
  m, ref = hf_model(), reference()
  condition = np.asarray(m.denoiser.encode_condition(m.params, ref["sc_logits"]))
  conditions = np.zeros((4, PROMPT + condition.shape[1], condition.shape[2]), np.float32)
  conditions[2:, PROMPT:] = condition  # rows 0-1: zeros, gemma's (and transformers') first step
  tokens = np.tile(np.concatenate([ref["prompt_BxP"], ref["canvas_BxW"]], axis=1), (2, 1))
  got = forward(m.config, m.params, tokens, None, conditions, prompt_length=PROMPT)[:, PROMPT:]
  _check(got[:2], "logits_prompt")
  _check(got[2:], "logits_prompt_sc")


@pytest.mark.slow
def test_appended_canvas_and_the_window():
  """The decoder over the next canvas once transformers' encoder appended the first to the
  cache (mdjax's one pass: [prompt; canvas] as the encoder). And transformers' run at
  sliding window 4, which is not gemma's: with the window shorter than a row its decoder pass
  (no sliding mask inside the canvas with a DynamicCache) differs from gemma's, which mdjax
  reproduces, by far more than rounding (the writer's module docstring)."""
  m, ref = hf_model(), reference()
  tokens = np.concatenate([ref["prompt_BxP"], ref["canvas_BxW"], ref["next_BxW"]], axis=1)
  appended = PROMPT + ref["canvas_BxW"].shape[1]
  got = forward(m.config, m.params, tokens, None, None, prompt_length=appended)[:, appended:]
  _check(got, "logits_second")
  narrow = dataclasses.replace(m.config, sliding_window=4)
  got = np.asarray(forward(narrow, m.params, tokens[:, :appended], None, None,
                           prompt_length=PROMPT))[:, PROMPT:]
  want = ref["logits_prompt_window4"]
  assert np.abs(got - want).max() > 0.1 * np.abs(want).max()


@pytest.mark.slow
def test_same_key_same_tokens_through_both_loads():
  """generation_config.json's settings are the HF model's defaults; given the same knobs the
  orbax model draws the same tokens with the same key."""
  prompts = [[28, 68, 109, 78, 105], [69, 40, 26]]
  from_hf = mdjax.generate(hf_model(), prompts, max_new_tokens=8, key=3)
  from_orbax = mdjax.generate(orbax_model(), prompts, max_new_tokens=8, key=3, **KNOBS)
  assert [c.token_ids.tolist() for c in from_hf] == [c.token_ids.tolist() for c in from_orbax]
  spec = hf_model().sampler.plan(hf_model(), prompt_length=5, max_new_tokens=8).spec
  assert (spec.steps, spec.entropy_bound, spec.max_temperature, spec.early_stop) == (6, 2.0, 1.0,
                                                                                    False)


def _tensors(folder) -> dict:
  return {name: np.asarray(tensors_lib.read_tensor(info))
          for name, info in tensors_lib.read_checkpoint(str(folder)).items()}


def _json(path) -> dict:
  return json.loads(path.read_text())


@pytest.mark.slow
def test_save_writes_the_folder_back(tmp_path):
  """Tensor for tensor (names, dtypes, bytes; the vision tower copied), config.json and
  generation_config.json as transformers wrote them, sharded or not; and read back."""
  m = hf_model()
  for out, shard in ((tmp_path / "one", None), (tmp_path / "sharded", 200_000)):
    files = mdjax.io.save(m, out, max_shard_bytes=shard)
    assert (out / "model.safetensors.index.json").exists() == (shard is not None)
    source, written = _tensors(FOLDER), _tensors(out)
    assert sorted(source) == sorted(written)
    for name, value in source.items():
      assert written[name].dtype == value.dtype and written[name].tobytes() == value.tobytes(), name
    assert _json(out / "config.json") == _json(FOLDER / "config.json")
    assert _json(out / "generation_config.json") == _json(FOLDER / "generation_config.json")
    assert str(out / "config.json") in files
  back = mdjax.load(tmp_path / "one")
  assert back.config == m.config and back.sampler == m.sampler
  _equal_params(back.params, m.params)
  half = mdjax.load(FOLDER, dtype="bfloat16")  # cast as read; bfloat16 back, bit for bit
  mdjax.io.save(half, tmp_path / "half")
  again = mdjax.load(tmp_path / "half")
  assert again.config.dtype == "bfloat16"
  _equal_params(again.params, half.params)


def test_between_the_two_published_layouts(tmp_path):
  """gemma's params checkpoint -> this layout -> gemma's again, bit for bit; the folder has
  no vision tower (none was read) and the published sampler settings."""
  o = orbax_model()
  mdjax.io.save(o, tmp_path / "hf")
  raw = _json(tmp_path / "hf" / "config.json")
  assert "vision_config" not in raw and raw["canvas_length"] == 256
  assert raw["text_config"]["per_layer_config"] == {"2": {"head_dim": 16, "num_key_value_heads": 1},
                                                    "5": {"head_dim": 16, "num_key_value_heads": 1}}
  generation = _json(tmp_path / "hf" / "generation_config.json")
  assert (generation["max_denoising_steps"], generation["t_max"], generation["t_min"],
          generation["sampler_config"]["entropy_bound"], generation["stability_threshold"],
          generation["confidence_threshold"]) == (48, 0.8, 0.4, 0.1, 1, 0.005)
  back = mdjax.load(tmp_path / "hf")
  assert back.config == o.config
  _equal_params(back.params, o.params)
  gemma_params.save(back, tmp_path / "params")
  assert gemma_params.leaf_shapes(str(tmp_path / "params")) == gemma_params.leaf_shapes(str(ORBAX))
  _equal_params(mdjax.load(tmp_path / "params", config=GIVEN).params, o.params)


def _folder(tmp_path, config=None, generation=None, tensors=None):
  """A copy of the fixture with config.json / generation_config.json edited (functions of the
  dict) and its tensors replaced (one model.safetensors)."""
  out = tmp_path / "bad"
  shutil.rmtree(out, ignore_errors=True)
  shutil.copytree(FOLDER, out)
  for name, edit in (("config.json", config), ("generation_config.json", generation)):
    if edit is not None:
      raw = _json(out / name)
      edit(raw)
      (out / name).write_text(json.dumps(raw))
  if tensors is not None:
    for f in out.glob("model*"):
      f.unlink()
    tensors_lib.write_checkpoint(str(out), tensors)
  return out


def _text(**changes):
  return lambda raw: raw["text_config"].update(changes)


def test_bad_folders(tmp_path):
  cases = [
      (_text(hidden_activation="gelu"), None, "text_config.hidden_activation='gelu'"),
      (lambda r: r.update(tie_word_embeddings=False), None, "tie_word_embeddings=False"),
      (_text(use_bidirectional_attention="all"), None, "use_bidirectional_attention='all'"),
      (_text(layer_types=["full_attention"] * 5), None, "text_config.layer_types"),
      (_text(per_layer_config={"2": {"head_dim": 16}, "5": {"head_dim": 32}}), None,
       "per_layer_config"),
      (_text(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
                              "sliding_attention": {"rope_theta": 1e4}}), None,
       "full_attention.rope_type='yarn'"),
      (_text(num_experts=None), None, "num_experts"),
      (_text(hidden_size=64), None, "has shape"),
      (None, lambda g: g.update(t_min=2.0), "t_max: max_temperature"),
      (None, lambda g: g.update(sampler_config={"_cls_name": "TopK", "k": 1}), "sampler_config"),
      (None, lambda g: g.update(max_denoising_steps=0), "max_denoising_steps=0"),
  ]
  for config, generation, message in cases:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
      mdjax.load(_folder(tmp_path, config, generation))
  stored = _tensors(FOLDER)
  name = "model.decoder.layers.0.self_attn.q_proj.weight"
  for tensors, message in (
      ({k: v for k, v in stored.items() if k != name}, f"missing tensor.*{name}"),
      ({**stored, "model.decoder.layers.0.extra": stored[name]}, "unexpected tensor.*extra"),
      ({**stored, name: stored[name][:8]}, f"{name}' has shape \\[8, 32\\]"),
      ({**stored, "lm_head.weight": stored["model.decoder.embed_tokens.weight"] + 1},
       "lm_head.weight differ"),
      ({**stored, "model.encoder.language_model.layers.0.layer_scalar": np.full(1, 2, np.float32)},
       "layer_scalar differ")):
    with pytest.raises(ValueError, match=message):
      mdjax.load(_folder(tmp_path, tensors=tensors))
  # The older config keys (global_head_dim, num_global_key_value_heads) and vLLM's
  # self_conditioning_size read as transformers 5.25's per_layer_config does.
  def older(raw):
    raw["text_config"].pop("per_layer_config")
    raw["text_config"].update(global_head_dim=16, num_global_key_value_heads=1)
    raw["self_conditioning_size"] = 48
  assert mdjax.load(_folder(tmp_path, older)).config == hf_model().config
  with pytest.raises(ValueError, match="self_condition.*has shape"):
    mdjax.load(_folder(tmp_path, lambda raw: raw.update(self_conditioning_size=64)))
  # Copies that agree are read as one: the conversion's encoder copies and head beside them.
  encoder = {k.replace(layout.DECODER, layout.ENCODER): v for k, v in stored.items()
             if k.startswith(layout.DECODER) and not k.startswith(layout.SELF_CONDITIONING)}
  both = mdjax.load(_folder(tmp_path, tensors={
      **stored, **encoder, "lm_head.weight": stored["model.decoder.embed_tokens.weight"]}))
  _equal_params(both.params, hf_model().params)
  with pytest.raises(ValueError, match="config=.* does not apply"):
    mdjax.load(FOLDER, config=GIVEN)
  with pytest.raises(ValueError, match="the folder the model was loaded from"):
    mdjax.io.save(hf_model(), FOLDER)
  with pytest.raises(ValueError, match="k_eq_v_global=False cannot be written"):
    o = orbax_model()
    hf_io.save(o.replace(config=dataclasses.replace(o.config, k_eq_v_global=False)),
               tmp_path / "never")


def test_tokenizer_and_chat_template(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  out = _folder(tmp_path)

  def write(size):
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (out / "tokenizer.json").write_text(tokenizer.to_str())

  write(128)
  (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  m = mdjax.load(out)
  assert m.encode("t5 t7") == [5, 7] and m.decode([5, 7]) == "t5 t7"
  assert m.chat_template.startswith("{% for m")
  mdjax.io.save(m, tmp_path / "copy")
  assert (tmp_path / "copy" / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
  assert (tmp_path / "copy" / "chat_template.jinja").exists()
  write(200)
  with pytest.raises(ValueError, match="200 ids, more than"):
    mdjax.load(out)
