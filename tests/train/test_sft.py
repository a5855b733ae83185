"""Supervised fine-tuning: response-only masking, the loss by hand, the LLaDA fixture through
the train loop and back through mdjax.io.save / load, a workdir start, bad input."""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mdjax import diffusion, io, train
from mdjax.models import published
from mdjax.tasks import sft as sft_data
from mdjax.train import sft
from mdjax.train.loop import make_eval_loss
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")
CHAT = os.path.join(FIXTURES, "sft", "chat.jsonl")
LLADA = os.path.join(FIXTURES, "pretrained", "llada")
EOS = 290  # the LLaDA fixture's


def _table_denoiser(params, tokens_BxL, t_B):
  """Logits = a row of `params` per input id plus a per-position bias: cheap, exact."""
  del t_B
  return params["table"][tokens_BxL] + params["position"][None, : tokens_BxL.shape[1]]


def _table_params(key, vocab, length):
  k1, k2 = jax.random.split(key)
  return {"table": jax.random.normal(k1, (vocab + 1, vocab)),
          "position": jax.random.normal(k2, (length, vocab))}


def _sft_config(workdir_or_dir, **overrides):
  config = importlib.import_module("configs.sft").get_config()
  config.train.init_from = workdir_or_dir  # also the task's tokenizer source (one reference)
  config.task_kwargs.update(path=CHAT, length=80)
  config.batch_size = 4
  config.train.update(num_steps=8, lr=3e-3, warmup_steps=0)
  config.update(log_every=4, eval_batches=1)
  config.checkpoint.update(every=8)
  config.update_from_flattened_dict(overrides)  # dotted paths: "train.lr"
  return config


# ----------------------------------------------------------------------------
# Rows and masking.
# ----------------------------------------------------------------------------


def test_rows_hold_prompt_response_and_eos_padding():
  vocab = sft_data.vocabulary("pretrained:" + LLADA)
  examples = sft_data.read_jsonl(CHAT)
  tokens_NxL, prompt_N = sft_data.encode_examples(examples, vocab, 80)
  # The first line: the chat template around the prompt, then the response, then EOS.
  prompt = vocab.encode(vocab.chat([{"role": "user", "content": "What is 7 * 8?"}]))
  response = vocab.encode("56.")
  assert prompt_N[0] == len(prompt)
  np.testing.assert_array_equal(tokens_NxL[0, :len(prompt)], prompt)
  np.testing.assert_array_equal(tokens_NxL[0, len(prompt):len(prompt) + len(response)], response)
  assert (tokens_NxL[0, len(prompt) + len(response):] == EOS).all()
  # messages: every turn before the last is the prompt.
  turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
           {"role": "user", "content": "Count to 3."}]
  assert prompt_N[6] == len(vocab.encode(vocab.chat(turns)))
  rows = sft_data.pack_rows(tokens_NxL, prompt_N)
  tokens, maskable = sft_data.unpack_rows(rows)
  np.testing.assert_array_equal(tokens, tokens_NxL)
  np.testing.assert_array_equal(maskable, np.arange(80)[None] >= prompt_N[:, None])


@pytest.mark.slow
def test_prompt_never_masked_response_and_eos_padding_masked_loss_ignores_prompt():
  vocab, length = 6, 12
  prompt_B = np.array([3, 7, 1, 5])
  tokens = np.random.default_rng(0).integers(0, vocab - 1, (4, length))
  tokens[:, -2:] = vocab - 1  # EOS padding, part of the response
  rows = jnp.asarray(sft_data.pack_rows(tokens, prompt_B))
  params = _table_params(jax.random.key(1), vocab, length)
  task = ml_collections.ConfigDict(dict(mask_id=vocab))
  config = ml_collections.ConfigDict(dict(schedule="linear"))
  loss_fn = jax.jit(sft.loss_fn(config, _table_denoiser, task))

  def loss_and_input(key):  # the loss and the canvas the denoiser was given
    seen = {}

    def spy(p, z_BxL, t_B):
      seen["z"] = z_BxL
      return _table_denoiser(p, z_BxL, t_B)

    return sft.loss_fn(config, spy, task)(params, key, rows)[0], seen["z"]

  _, z = jax.jit(jax.vmap(loss_and_input))(jax.random.split(jax.random.key(0), 64))
  z = np.asarray(z)  # 64 draws x B x L
  prompt_BxL = np.arange(length)[None] < prompt_B[:, None]
  assert not (z[:, prompt_BxL] == vocab).any()  # the prompt is always visible
  np.testing.assert_array_equal(z[:, prompt_BxL], np.broadcast_to(tokens[prompt_BxL], (64,) +
                                                                   tokens[prompt_BxL].shape))
  masked = z == vocab
  # Every response position, EOS included, is masked in some draw (a position escapes one
  # draw with probability E[1 - t] = 1/2, all 64 with 2^-64).
  assert masked[:, ~prompt_BxL].any(axis=0).all()
  # The prompt's predictions do not enter the loss: change them, the loss stays.
  garbled = {"table": params["table"],
             "position": params["position"].at[:3, 0].add(5.0)}  # every row's prompt...
  rows_long_prompt = jnp.asarray(sft_data.pack_rows(tokens, np.full(4, 3)))
  a = loss_fn(params, jax.random.key(0), rows_long_prompt)[0]
  b = loss_fn(garbled, jax.random.key(0), rows_long_prompt)[0]
  assert float(a) == float(b)
  c = loss_fn({"table": params["table"], "position": params["position"].at[3, 0].add(5.0)},
              jax.random.key(0), rows_long_prompt)[0]
  assert float(c) != float(a)  # ...but a response position's do


def test_loss_equals_hand_computation():
  # B = 2 rows of L = 5, V = 4 ids (3 is EOS); prompts of 2 and 3 tokens.
  vocab, length = 4, 5
  tokens = np.array([[0, 1, 2, 3, 3], [2, 2, 0, 1, 3]])
  prompt_B = np.array([2, 3])
  rows = jnp.asarray(sft_data.pack_rows(tokens, prompt_B))
  params = _table_params(jax.random.key(3), vocab, length)
  key = jax.random.key(7)
  loss, aux = diffusion.nelbo_loss(
      _table_denoiser, params, key, jnp.asarray(tokens), schedule="linear", mask_id=vocab,
      maskable_BxL=jnp.asarray(np.arange(length)[None] >= prompt_B[:, None]), per_token=True)
  via_task = sft.loss_fn(ml_collections.ConfigDict(dict(schedule="linear")), _table_denoiser,
                         ml_collections.ConfigDict(dict(mask_id=vocab)))(params, key, rows)[0]
  # By hand: the same t and mask draws, LLaDA's sum over masked response tokens of
  # -log p / t / (response length), averaged over rows.
  time_key, mask_key = jax.random.split(key)
  t_B = np.asarray(diffusion.stratified_times(time_key, 2))
  u_BxL = np.asarray(jax.random.uniform(mask_key, (2, length)))
  response_BxL = np.arange(length)[None] >= prompt_B[:, None]
  masked_BxL = (u_BxL >= 1.0 - t_B[:, None]) & response_BxL
  z = np.where(masked_BxL, vocab, tokens)
  logits = np.asarray(params["table"])[z] + np.asarray(params["position"])[None]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll_BxL = -np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
  expected = np.mean([(nll_BxL[b] * masked_BxL[b]).sum() / t_B[b] / response_BxL[b].sum()
                      for b in range(2)])
  assert masked_BxL.any()
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  assert float(via_task) == float(loss)
  # aux keeps nats per sequence.
  np.testing.assert_allclose(np.asarray(aux["nelbo_nats_B"]),
                             [(nll_BxL[b] * masked_BxL[b]).sum() / t_B[b] for b in range(2)],
                             rtol=1e-5)


# ----------------------------------------------------------------------------
# From the LLaDA fixture, through the train loop, back through save / load.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_from_llada_fixture_lowers_response_loss_and_round_trips(tmp_path):
  config = _sft_config("pretrained:" + LLADA)
  workdir = str(tmp_path / "sft")
  state = train.train(config, workdir, log=lambda *a: None)
  assert int(state.step) == 8
  # The held-out loss (here on the training rows) of the start, by the loop's own evaluation.
  rows_written = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert rows_written[-1]["step"] == 8
  after = rows_written[-1]["val_bits_per_token"]
  resolved = sft.resolve_config(config)
  task = train.tasks.from_config(resolved)
  start = io.load(LLADA)
  view = sft.PublishedView(start.config)
  eval_loss = make_eval_loss(resolved, view, task, sft.loss_fn(resolved, view, task))
  before = train.evaluate(resolved, task, start.params, eval_loss)["val_bits_per_token"]
  assert after < 0.5 * before, (before, after)
  assert train.evaluate(resolved, task, state.params, eval_loss)["val_bits_per_token"] == after

  out = os.path.join(workdir, sft.EXPORT_DIR)
  loaded = io.load(out)
  assert loaded.config == start.config and loaded.family == "llada"
  assert os.path.isfile(os.path.join(out, "tokenizer.json"))
  tokens = np.asarray(sft_data.unpack_rows(task.sample_data(jax.random.key(0), 4))[0])
  forward = jax.jit(lambda params: published.forward(start.config, params, tokens))
  np.testing.assert_array_equal(np.asarray(forward(loaded.params)),
                                np.asarray(forward(state.params)))
  assert not np.array_equal(np.asarray(loaded.params["head"]), np.asarray(start.params["head"]))


# ----------------------------------------------------------------------------
# From an mdjax workdir.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_from_an_mdjax_workdir(tmp_path):
  examples = [{"prompt": f"{a}+{b}=", "response": f"{a + b}"} for a in range(4) for b in range(4)]
  path = tmp_path / "sums.jsonl"
  path.write_text("".join(json.dumps(e) + "\n" for e in examples))
  text = tmp_path / "sums.txt"  # the pretraining text: documents of the same characters
  text.write_text("\n\n".join(f"{e['prompt']}{e['response']}" for e in examples * 4))
  base = importlib.import_module("configs.base").base_config()
  base.task = "text"
  base.task_kwargs = ml_collections.ConfigDict(dict(
      text_path=str(text), length=8, documents="padded", validation_fraction=0.25))
  base.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  base.batch_size = 4
  # The start workdir: an initialized model saved as a checkpoint (no step compiled).
  start_dir = str(tmp_path / "start")
  base_task = train.tasks.from_config(base)
  base_state, *_ = train.init_state(base, train.make_mesh(1), base_task)
  train.save(train.checkpoint_manager(start_dir, base), base_state, base, base_task)
  start = train.load(start_dir)

  config = _sft_config(start_dir, **{"task_kwargs.path": str(path), "task_kwargs.length": 8,
                                     "train.num_steps": 1, "checkpoint.every": 1})
  resolved = sft.resolve_config(config)
  assert resolved.model.to_dict() == start.config.model.to_dict()
  task = train.tasks.from_config(resolved)
  assert task.vocab_size == start.task.vocab_size and task.eos_id == start.task.eos_id
  state, *_ = train.init_state(resolved, train.make_mesh(1), task)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tuned = train.train(config, str(tmp_path / "sft"), log=lambda *a: None)
  assert int(tuned.step) == 1
  assert not np.array_equal(np.asarray(jax.tree.leaves(tuned.params)[0]),
                            np.asarray(jax.tree.leaves(start.params)[0]))
  assert not os.path.exists(tmp_path / "sft" / sft.EXPORT_DIR)  # the workdir is the result
  with pytest.raises(ValueError, match=r"model\.d_model=32 differs from the start point's 16"):
    sft.resolve_config(_sft_config(start_dir, **{"model.d_model": 32}))


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


def test_bad_input_is_refused(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "What?"}\n')
  with pytest.raises(ValueError, match=rf"{bad}:3: no response"):
    sft_data.read_jsonl(str(bad))
  bad.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
  with pytest.raises(ValueError, match=rf"{bad}:1: no response.*'user' turn"):
    sft_data.read_jsonl(str(bad))
  vocab = sft_data.vocabulary("pretrained:" + LLADA)
  examples = sft_data.read_jsonl(CHAT)
  with pytest.raises(ValueError, match=rf"{CHAT}:1: the prompt is 37 tokens.*length=30"):
    sft_data.encode_examples(examples, vocab, 30)
  with pytest.raises(ValueError, match=rf"{CHAT}:1: prompt \(37 tokens\).*truncate=True"):
    sft_data.encode_examples(examples, vocab, 40)
  tokens, prompt = sft_data.encode_examples(examples[:1], vocab, 39, truncate=True)
  assert prompt[0] == 37 and (tokens[0, 37:] != EOS).all()  # the response cut to 2 tokens
  bad.write_text('{"prompt": "<|mdm_mask|>", "response": "x"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:1: the prompt encodes to id 300"):
    sft_data.encode_examples(sft_data.read_jsonl(str(bad)), vocab, 80)
  # The architecture of the start point against the config's.
  with pytest.raises(train.ConfigError, match=r"model\.num_layers=3 differs from the start "
                                              r"point's 2 \(.*llada/config\.json\)"):
    sft.resolve_config(_sft_config("pretrained:" + LLADA, **{"model.num_layers": 3}))
  with pytest.raises(train.ConfigError, match=r"train\.init_from: .*not an mdjax workdir"):
    sft.resolve_config(_sft_config(str(tmp_path)))
  with pytest.raises(train.ConfigError, match=r"task_kwargs\.length=5000"):
    sft.resolve_config(_sft_config("pretrained:" + LLADA, **{"task_kwargs.length": 5000}))
  with pytest.raises(train.ConfigError, match=r"task_kwargs\.path"):  # before anything is built
    train.train(_sft_config("pretrained:" + LLADA, **{"task_kwargs.path": str(tmp_path / "x")}),
                str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")
