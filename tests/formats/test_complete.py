"""Texts in, texts out for a checkpoint: prompts, chat, `generate`, sample.py --pretrained."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from mdjax import formats, generation, io, sampling
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "pretrained")


@pytest.fixture(scope="module")
def llada():
  return io.load(os.path.join(FIXTURES, "llada"))


def encoded(model, prompts, chat=False):
  """(ids [B, P], attention mask [B, P]): the prompts left-padded as `mdjax.generate` lays
  them out."""
  rows = generation.prompt_ids(model, prompts, chat=chat)
  prompt_BxP, valid_BxP, _ = generation.left_padded(rows, max(map(len, rows)), model.mask_id,
                                                    pad_id=model.pad_id)
  return prompt_BxP, valid_BxP.astype(np.int32)


def test_prompts_left_padded_with_their_mask(llada):
  prompt_BxP, mask_BxP = encoded(llada, ["Hi!", [5, 6, 7, 8, 9]])
  assert prompt_BxP.shape == mask_BxP.shape == (2, 5)
  np.testing.assert_array_equal(mask_BxP, [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(prompt_BxP[0, 2:], llada.tokenizer.encode("Hi!").ids)
  np.testing.assert_array_equal(prompt_BxP[0, :2], [llada.eos_id] * 2)  # LLaDA pads with EOS


def test_chat_template_renders_as_hugging_face(llada):
  # The LLaDA template (Llama-3 style): bos, one header per turn, the assistant's opened.
  text = io.render_chat(llada, [{"role": "user", "content": " Hi! "}])
  assert text == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n")
  chat_BxP, _ = encoded(llada, ["Hi!"], chat=True)
  np.testing.assert_array_equal(chat_BxP[0], llada.tokenizer.encode(text).ids)


def test_bad_prompts(llada, tmp_path):
  with pytest.raises(ValueError, match="prompts is empty"):
    encoded(llada, [])
  with pytest.raises(ValueError, match=f"prompts line 2 holds .*mask id {llada.mask_id}"):
    encoded(llada, ["a", [1, llada.mask_id]])
  with pytest.raises(ValueError, match="prompts line 1 is ids; chat=True"):
    encoded(llada, [[1, 2]], chat=True)
  no_template = dataclasses.replace(llada, chat_template=None)
  with pytest.raises(ValueError, match="chat template"):
    encoded(no_template, ["a"], chat=True)
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
  assert generation.read_prompts(str(path), messages=True) == [
      "a", [{"role": "user", "content": "b"}]]
  path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
  with pytest.raises(ValueError, match="line 2"):
    generation.read_prompts(str(path), messages=True)


def test_generate_is_the_reference_sampler_cut_at_the_end_of_text(llada):
  prompts = ["Hello", "Hi there, you"]
  out = generation.generate(llada, prompts, max_new_tokens=8, steps=4, block_length=4,
                            key=jax.random.key(0))
  prompt_BxP, mask_BxP = encoded(llada, prompts)
  ids_BxT = np.asarray(formats.llada.generate(llada, prompt_BxP, steps=4, gen_length=8,
                                              block_length=4, attention_mask=mask_BxP))
  for row, got in zip(ids_BxT[:, prompt_BxP.shape[1]:], out.token_ids):
    ends = np.flatnonzero(np.isin(row, [llada.eos_id, llada.config.eot_id]))
    np.testing.assert_array_equal(got, row[:ends[0]] if len(ends) else row)
  assert out.texts == [llada.tokenizer.decode(list(map(int, ids))) for ids in out.token_ids]
  with pytest.raises(ValueError, match="alg= does not apply to the llada"):
    generation.generate(llada, prompts, max_new_tokens=8, alg="entropy", key=jax.random.key(0))


@pytest.mark.slow
def test_any_family_samples_a_checkpoint(llada):
  """A family on the checkpoint's own ids: the mask id (inside the vocabulary) never comes
  out, and generate(spec=) is `sampling.sample` on the encoded prompts."""
  spec = sampling.ConfidenceSpec(steps=4, block_length=4, kv_cache="dual", temperature=0.0)
  prompt_BxP, mask_BxP = encoded(llada, ["Hello", "Hi there, you"])
  canvas_BxL = np.concatenate([prompt_BxP, np.full((2, 8), llada.mask_id, np.int32)], 1)
  valid_BxL = np.concatenate([mask_BxP.astype(bool), np.ones((2, 8), bool)], 1)
  ids_BxT = np.asarray(sampling.sample(llada.denoiser, llada.params, jax.random.key(0),
                                       canvas_BxL, spec, mask_id=llada.mask_id,
                                       valid_BxL=valid_BxL).tokens_BxL)
  np.testing.assert_array_equal(ids_BxT[:, :prompt_BxP.shape[1]], prompt_BxP)
  assert not (ids_BxT == llada.mask_id).any()
  out = generation.generate(llada, ["Hello", "Hi there, you"], max_new_tokens=8, spec=spec,
                            stop_at_eos=False, key=jax.random.key(0))
  np.testing.assert_array_equal(np.stack(out.token_ids), ids_BxT[:, prompt_BxP.shape[1]:])


def test_sample_cli_pretrained(sample_cli, llada, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "Hello"}\n{"prompt": "Hi there, you"}\n')
  proc = sample_cli(f"--pretrained={os.path.join(FIXTURES, 'llada')}",
                    f"--prompts={prompts}", "--max_new_tokens=8", "--steps=4",
                    "--block_length=4", f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr
  assert "2 completions" in proc.stdout
  rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
  out = generation.generate(llada, ["Hello", "Hi there, you"], max_new_tokens=8, steps=4,
                            block_length=4, key=jax.random.fold_in(jax.random.key(0), 0))
  assert [r["token_ids"] for r in rows] == [ids.tolist() for ids in out.token_ids]
  proc = sample_cli(f"--pretrained={os.path.join(FIXTURES, 'llada')}", f"--prompts={prompts}",
                    "--max_new_tokens=8", "--alg=entropy")
  assert proc.returncode == 1 and "--alg does not apply to the llada" in proc.stderr


@pytest.mark.slow
def test_sample_cli_samples_mdlm_and_bd3lm_from_nothing(sample_cli, tmp_path):
  """MDLM and BD3-LM folders through sample.py: unconditional rows by their reference
  samplers (BD3-LM past its length, block by block), and id prompts completed."""
  dit = os.path.join(REPO, "tests", "fixtures", "dit")
  proc = sample_cli(f"--pretrained={os.path.join(dit, 'mdlm')}", "--num_samples=3",
                    "--steps=4", f"--out={tmp_path / 'mdlm'}")
  assert proc.returncode == 0, proc.stderr
  rows = [json.loads(line) for line in (tmp_path / "mdlm" / "completions.jsonl").open()]
  assert len(rows) == 3 and all(r["generated_length"] == len(r["token_ids"]) for r in rows)
  bd3lm = os.path.join(dit, "bd3lm")
  length = 2 * io.load(bd3lm).max_len  # past the model's positions
  proc = sample_cli(f"--pretrained={bd3lm}", "--num_samples=2", f"--length={length}",
                    f"--out={tmp_path / 'bd3lm'}")
  assert proc.returncode == 0, proc.stderr
  rows = [json.loads(line) for line in (tmp_path / "bd3lm" / "completions.jsonl").open()]
  assert [len(r["token_ids"]) for r in rows] == [length, length]
  prompts = tmp_path / "ids.jsonl"
  prompts.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [8]}\n')
  proc = sample_cli(f"--pretrained={os.path.join(dit, 'mdlm')}", f"--prompts={prompts}",
                    "--max_new_tokens=4", "--steps=4")
  assert proc.returncode == 0 and "2 completions" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_a_family_by_name_inherits_the_reference_greedy_default(sample_cli, llada, tmp_path,
                                                               monkeypatch):
  """--sampler=confidence on LLaDA without --temperature is greedy, as LLaDA's reference
  sampler: it once switched to temperature 1 silently."""
  seen = []
  real = sampling.sample
  monkeypatch.setattr(sampling, "sample",
                      lambda *args, **kwargs: seen.append(args[4]) or real(*args, **kwargs))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "Hello"}\n')
  base = (f"--pretrained={os.path.join(FIXTURES, 'llada')}", f"--prompts={prompts}",
          "--max_new_tokens=4", "--sampler=confidence", "--steps=4")
  assert sample_cli(*base).returncode == 0
  assert sample_cli(*base, "--temperature=0.7").returncode == 0
  assert [spec.temperature for spec in seen] == [0.0, 0.7]
