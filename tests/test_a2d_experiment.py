"""The AR side of experiments/a2d.py: mdjax's causal Transformer written as a Llama folder
(`mdjax.convert.causal_export`) is the same network, read back by `mdjax.load`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mdjax
from mdjax import models, tasks
from mdjax.convert import causal_export
from mdjax.evaluate import gen_ppl
from mdjax.train.state import model_config
from tests.scripts import load_script
from tests.text_fixtures import tiny_config, write_corpus


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(config, task, params, folder): a causal model with every weight perturbed (so a swapped
  or transposed matrix, or a norm scale in the wrong place, changes the logits), exported."""
  root = tmp_path_factory.mktemp("a2d_export")
  config = tiny_config(write_corpus(root / "corpus.txt"), causal=True)
  task = tasks.from_config(config)
  _, params, _ = models.init(model_config(config, task), seed=0)
  params = nnx.to_pure_dict(params)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(treedef, [
      x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  folder = causal_export.write_folder(params, config, task, str(root / "llama"))
  return config, task, params, folder


def test_exported_llama_has_the_causal_models_logits(exported):
  config, task, params, folder = exported
  llama = mdjax.load(folder)
  assert (llama.family, llama.causal, llama.vocab_size) == ("llama", True, task.vocab_size + 1)
  windows = task.validation_windows(4)
  inputs = np.concatenate([np.full((4, 1), task.mask_id), windows[:, :-1]], axis=1)
  graphdef, _, apply_fn = models.init(model_config(config, task), seed=0)
  ours = apply_fn(params, jnp.asarray(inputs), jnp.zeros(4))
  theirs = llama.denoiser(llama.params, jnp.asarray(inputs), jnp.zeros(4))
  # float32 on both sides, the same operations up to their order (RoPE's tables on the
  # host against on the device, the norm's rsqrt): a few ulps of logits of size ~10.
  scale = float(jnp.abs(ours).max())
  np.testing.assert_allclose(theirs[..., :task.vocab_size], ours, atol=1e-5 * scale, rtol=0)
  assert float(jnp.abs(theirs[..., task.vocab_size]).max()) == 0.0  # the start id's column
  # The tokenizer gives the task's ids, and the folder is a judge with the start id first.
  text = task.decode(windows[0])
  assert llama.tokenizer.encode(text, add_special_tokens=False).ids == windows[0].tolist()
  judge = gen_ppl.load_judge(llama)
  assert judge.start_id == task.mask_id and judge.encode(text) == windows[0].tolist()


def test_export_refuses_what_llama_cannot_express(exported, tmp_path):
  config, task, params, _ = exported
  for field, value in (("time_conditioning", True), ("mlp", "gelu"), ("causal", False)):
    bad = config.copy_and_resolve_references()
    bad.model[field] = value
    with pytest.raises(ValueError, match=f"model.{field}="):
      causal_export.write_folder(params, bad, task, str(tmp_path / field))
    assert not (tmp_path / field).exists()
  bad = config.copy_and_resolve_references()
  bad.objective = "nelbo"
  with pytest.raises(ValueError, match="objective='nelbo'"):
    causal_export.check_exportable(bad)


def _rows(curves: dict, seconds: dict) -> list[dict]:
  """The experiment's rows from {(method, start): [NELBO at 75, 150, 300, 450 steps]}."""
  rows = []
  for (method, start), values in curves.items():
    for step, value in zip((75, 150, 300, 450), values):
      row = {"method": method, "start": start, "tokens": step * 2048, "steps": step,
             "val_nelbo_bits_per_token": value, "val_nelbo_se": 0.01, "anneal_steps": 0}
      if step == 450:
        row.update(sample_quality={"gen_ppl": 10.0, "entropy": 2.9},
                   train_seconds=seconds.get((method, start), 100.0))
      rows.append(row)
  return rows


def test_a2d_goals_and_report(tmp_path):
  a2d = load_script("a2d")
  curves = {("masked", "ar"): [3.0, 2.9, 2.8, 2.7], ("masked", "scratch"): [4.0, 3.6, 3.2, 3.0],
            ("block", "ar"): [2.95, 2.88, 2.78, 2.6], ("block", "scratch"): [3.9, 3.5, 3.0, 2.85],
            ("masked_anneal", "ar"): [3.1, 2.95, 2.8, 2.75]}
  rows = _rows(curves, {("masked_anneal", "ar"): 120.0})
  goals = a2d.goals(rows)
  masked = goals["masked_tokens_to_scratch_final"]
  # 3.0 is first reached at 75 steps, a sixth of the budget; the block run first goes below
  # 2.85 at 300 steps, two thirds.
  assert masked["converted_tokens"] == 75 * 2048 and masked["within_a_third"]
  block = goals["block_tokens_to_scratch_final"]
  assert block["converted_tokens"] == 300 * 2048 and not block["within_a_third"]
  assert goals["block_beats_masked_at_every_budget"]
  assert [round(d["difference"], 6) for d in goals["anneal_minus_direct"]] == [0.1, 0.05, 0.0, 0.05]
  assert goals["anneal_seconds_over_direct"] == 1.2
  results = {"rows": rows, "ar_bits_per_token": 2.3, "goals": goals, "examples": {"x": "y"},
             "reference_quality": {"ar_samples": {}, "held_out_text": {}}}
  a2d.write(results, str(tmp_path))
  assert (tmp_path / "a2d.png").stat().st_size > 0
  assert "| masked | ar | 153600 | 75 |" in (tmp_path / "a2d.md").read_text()
