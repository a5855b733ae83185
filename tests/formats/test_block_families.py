"""The block diffusion checkpoints (SDAR, Fast-dLLM v2, LLaDA2) through what every published
family goes through, with no code of their own: `mdjax.generate` on texts and chats,
sample.py --pretrained, mdjax's sampler families, the lm-eval adapter, and SFT, which trains
a block-causal start by the block NELBO and exports it back to its layout.

Each family's own parity with its published code is tests/formats/test_<family>.py."""

import importlib
import json
import os

import jax
import numpy as np
import pytest

import mdjax
from mdjax import diffusion, io, sampling, train
from mdjax.tasks import sft as sft_data
from mdjax.train import sft
from mdjax.train.loop import make_eval_loss
from tests.paths import REPO
from tests.formats import family_fixtures

FIXTURES = os.path.join(REPO, "tests", "fixtures")
FAMILIES = ("sdar", "fast_dllm_v2", "llada2")
CHAT = os.path.join(FIXTURES, "sft", "chat.jsonl")


model = family_fixtures.model  # each fixture loaded once per worker


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_generate_texts_and_chats_by_the_reference_decoder(family):
  """Texts and chats through the chat template, by the family's reference decoder with the
  exact block cache; the short prompt, left-padded in a batch with a longer one, gets what it
  gets alone (the positions, and so the blocks, count from each row's first token)."""
  m = model(family)
  assert m.family == family and m.padding_invariant
  assert m.denoiser.block_size is not None and m.denoiser.block_pair is not None
  key = jax.random.key(0)
  prompts = ["Hi", "Once upon a time"]
  both = mdjax.generate(m, prompts, max_new_tokens=8, key=key, stop_at_eos=False)
  alone = mdjax.generate(m, prompts[:1], max_new_tokens=8, key=key, stop_at_eos=False)
  # Row 0 draws with fold_in(key, 0) in both calls.
  np.testing.assert_array_equal(both.token_ids[0], alone.token_ids[0])
  # A row ends with the block that writes its EOS (the reference decoders' stop).
  assert all(1 <= len(ids) <= 8 and m.mask_id not in ids for ids in both.token_ids)


@pytest.mark.slow
def test_chat_through_the_template():
  m = model("sdar")
  chat = mdjax.generate(m, [[{"role": "user", "content": "Hello"}]], max_new_tokens=4,
                        key=jax.random.key(0), chat=True)
  prompt = m.encode(io.render_chat(m, [{"role": "user", "content": "Hello"}]))
  plain = mdjax.generate(m, [prompt], max_new_tokens=4, key=jax.random.key(0))
  np.testing.assert_array_equal(chat.token_ids[0], plain.token_ids[0])


@pytest.mark.slow
def test_sample_cli_pretrained(sample_cli, tmp_path):
  family = "fast_dllm_v2"
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "Hello"}\n{"prompt": [5, 6, 7]}\n')
  proc = sample_cli(f"--pretrained={os.path.join(FIXTURES, family)}", f"--prompts={prompts}",
                    "--max_new_tokens=8", f"--out={tmp_path}")
  assert proc.returncode == 0, proc.stderr
  rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
  m = model(family)
  expected = mdjax.generate(m, [m.encode("Hello"), [5, 6, 7]], max_new_tokens=8,
                            key=jax.random.key(0))
  assert [r["token_ids"] for r in rows] == [list(map(int, ids)) for ids in expected.token_ids]


# Families whose spec takes the prompt as it is (no positions or groups of a task).
SAMPLERS = ("ancestral", "confidence", "entropy_bounded", "revision")


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.slow
def test_mdjax_samplers_run_on_a_block_model(sampler):
  """mdjax's own families on LLaDA2 (the mixture of experts, partial RoPE, qk-norm):
  their first example spec, on a canvas. Every registered family runs on all three in
  `python -m mdjax.bench.families` (results/families.json, "samplers")."""
  m = model("llada2")
  prompt = [5, 6, 7, 8, 9]
  spec = sampling.families()[sampler].examples(tuple(range(5, 13)))[0]
  out = mdjax.generate(m, [prompt], max_new_tokens=8, key=jax.random.key(1), spec=spec,
                       stop_at_eos=False)
  ids = np.asarray(out.token_ids[0])
  assert len(ids) == 8 and not (ids == m.mask_id).any()


@pytest.mark.slow
def test_lm_eval_adapter_scores_and_generates():
  harness = pytest.importorskip("mdjax.evaluate.harness")
  from lm_eval.api.instance import Instance
  m = model("sdar")
  lm = harness.MdjaxLM(model=m, num_samples=4, mc_batch_size=4, batch_size=2, steps=4)
  scored = lm.loglikelihood([Instance(request_type="loglikelihood", doc={},
                                      arguments=("The cat", " sat"), idx=0)],
                            disable_tqdm=True)
  assert np.isfinite(scored[0][0]) and scored[0][0] < 0
  text = lm.generate_until([Instance(request_type="generate_until", doc={},
                                     arguments=("Hello", {"until": [], "max_gen_toks": 4}),
                                     idx=0)], disable_tqdm=True)
  assert isinstance(text[0], str)


def _sft_config(folder, length=96):
  config = importlib.import_module("configs.sft").get_config()
  config.train.init_from = "pretrained:" + folder
  config.task_kwargs.update(path=CHAT, length=length)
  config.batch_size = 4
  config.train.update(num_steps=6, lr=3e-3, warmup_steps=0)
  config.update(log_every=3, eval_batches=1)
  config.checkpoint.update(every=6)
  return config


@pytest.mark.slow
def test_sft_trains_by_the_block_nelbo_and_exports_the_layout(tmp_path):
  """SFT from a block-causal folder (LLaDA2: its experts and fused projection go back to
  their stored layout): its loss is the block NELBO per response token (each block after the
  clean blocks before it, the logits the decoder reads; `published.block_pair`, checked for
  every block network in tests/models/test_published.py), the held-out loss falls, and the
  export loads as the same family, bit for bit the trained params."""
  family = "llada2"
  folder = os.path.join(FIXTURES, family)
  config = _sft_config(folder)
  resolved = sft.resolve_config(config)
  task = train.tasks.from_config(resolved)
  _, params, apply_fn = sft.start_model(resolved, task)
  assert apply_fn.block_size == model(family).denoiser.block_size
  rows = task.sample_data(jax.random.key(0), 4)
  tokens_BxL, maskable_BxL = sft_data.unpack_rows(rows)
  loss, _ = jax.jit(sft.loss_fn(resolved, apply_fn, task))(params, jax.random.key(1), rows)
  _, aux = diffusion.block_nelbo_loss(apply_fn, params, jax.random.key(1), tokens_BxL,
                                      block_size=apply_fn.block_size,
                                      schedule=train.objectives.masking_schedule(resolved),
                                      mask_id=task.mask_id, maskable_BxL=maskable_BxL)
  per_token = np.asarray(aux["nelbo_nats_B"]) / np.maximum(np.asarray(maskable_BxL).sum(-1), 1)
  np.testing.assert_allclose(float(loss), per_token.mean(), rtol=1e-5)

  workdir = str(tmp_path / "sft")
  state = train.train(config, workdir, log=lambda *a: None)
  eval_loss = make_eval_loss(resolved, apply_fn, task, sft.loss_fn(resolved, apply_fn, task))
  before = train.evaluate(resolved, task, params, eval_loss)["val_bits_per_token"]
  after = train.evaluate(resolved, task, state.params, eval_loss)["val_bits_per_token"]
  assert after < before, (before, after)
  loaded = io.load(os.path.join(workdir, sft.EXPORT_DIR))
  assert loaded.family == family and loaded.config == model(family).config
  for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want, np.float32))


def test_sft_refuses_rows_that_cut_a_block():
  block = model("sdar").denoiser.block_size
  with pytest.raises(train.config_checks.ConfigError, match="multiple of"):
    sft.resolve_config(_sft_config(os.path.join(FIXTURES, "sdar"), length=8 * block + 1))
