"""The AR side of experiments/a2d.py: mdjax's causal Transformer written as a Llama folder
(`mdjax.convert.causal_export`) is the same network, read back by `mdjax.load`. (The
experiment itself: tests/test_experiments.py.)"""

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
from experiments.tiny_text import tiny_config, write_corpus

pytestmark = pytest.mark.slow


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


def test_export_refuses_an_existing_partial_and_keeps_it(exported, tmp_path):
  # Before: OUT.partial was deleted (shutil.rmtree) whoever made it.
  config, task, params, _ = exported
  partial = tmp_path / "llama.partial"
  partial.mkdir()
  (partial / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"llama.partial exists .*remove it, or choose another"):
    causal_export.write_folder(params, config, task, str(tmp_path / "llama"))
  assert (partial / "notes.txt").read_text() == "mine"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.partial"]
