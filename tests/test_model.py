"""One model, one generate: `mdjax.load` of every kind, `mdjax.generate`'s key rule."""

import os

import jax
import numpy as np
import pytest

import mdjax
from mdjax import loader, sampling
from tests.paths import REPO

PUBLISHED = os.path.join(REPO, "tests", "fixtures", "pretrained")
DIT = os.path.join(REPO, "tests", "fixtures", "dit")


@pytest.fixture(scope="module")
def llada():
  return mdjax.load(os.path.join(PUBLISHED, "llada"))


@pytest.fixture(scope="module")
def dream():
  return mdjax.load(os.path.join(PUBLISHED, "dream"))


def test_load_reads_every_kind_into_one_record(llada, trained):
  root, _ = trained
  workdir = mdjax.load(str(root / "char"))
  oracle = mdjax.load("oracle:two_color")
  mdlm = mdjax.load(os.path.join(DIT, "mdlm"))
  for model, family in ((llada, "llada"), (workdir, "mdjax"), (oracle, "oracle"),
                        (mdlm, "mdlm")):
    assert isinstance(model, mdjax.Model) and model.family == family
    assert model.denoiser.max_len == model.max_len and model.sampler is not None
  assert llada.pad_id == llada.eos_id and llada.mask_id < llada.vocab_size  # its own ids
  assert workdir.mask_id == workdir.vocab_size == workdir.task.vocab_size
  assert workdir.workdir == str(root / "char") and workdir.step > 0
  assert not oracle.takes_padding and oracle.params is None
  assert mdjax.load("two_color").family == "oracle"  # a bare task name, when no such path
  assert mdlm.mask_id == mdlm.vocab_size and mdlm.max_len == mdlm.config.model_length


@pytest.mark.parametrize("path,kwargs,match", [
    ("/no/such/folder", {}, r"path='/no/such/folder' does not exist"),
    (os.path.join(PUBLISHED, "llada"), {"step": 3}, r"step=3 does not apply to .*a published"),
    ("oracle:two_color", {"dtype": "float32"}, r"dtype='float32' does not apply to .*oracle"),
    ("oracle:nope", {}, r"task='nope' is unknown"),
    (REPO + "/docs", {}, r"neither a train.py workdir .* nor a torch checkpoint"),
])
def test_load_bad_input_names_the_argument(path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    mdjax.load(path, **kwargs)


def test_kind_of_names_what_load_reads(trained):
  root, _ = trained
  assert loader.kind_of(str(root / "char")) == "workdir"
  assert loader.kind_of(os.path.join(PUBLISHED, "dream")) == "published"
  assert loader.kind_of("scan_and_add") == "oracle"


@pytest.mark.slow
def test_a_published_completion_does_not_depend_on_the_batch(llada, dream):
  """The key rule: row i draws with fold_in(key, i), every batch padded to the longest
  prompt of all. At temperature 1 the keys decide the tokens, so a per-batch key (the rule
  `pretrained.complete` had) would give other tokens at another batch size."""
  prompts = ["Hello", "Hi there, you", [5, 6, 7]]
  for model, knobs in ((llada, dict(steps=4, block_length=4, temperature=1.0)),
                       (dream, dict(steps=4, temperature=1.0))):
    run = lambda batch_size: mdjax.generate(model, prompts, max_new_tokens=8,
                                            key=jax.random.key(3), batch_size=batch_size,
                                            stop_at_eos=False, **knobs)
    together, one_by_one = run(None), run(1)
    for a, b in zip(together.token_ids, one_by_one.token_ids):
      np.testing.assert_array_equal(a, b)
    # The keys matter at this temperature: another key gives other tokens somewhere.
    other = mdjax.generate(model, prompts, max_new_tokens=8, key=jax.random.key(4),
                           stop_at_eos=False, **knobs)
    assert any((a != b).any() for a, b in zip(together.token_ids, other.token_ids))


@pytest.mark.slow
def test_a_dream_completion_does_not_depend_on_its_neighbours(dream):
  """Dream counts positions from each row's first real token: a prompt's completion is the
  same beside a short prompt or a long one (more padding before it)."""
  knobs = dict(steps=4, temperature=1.0, max_new_tokens=8, key=jax.random.key(5),
               stop_at_eos=False)
  beside_short = mdjax.generate(dream, ["Hello", "Hi"], **knobs)
  beside_long = mdjax.generate(dream, ["Hello", "Hi there, you are here, and so am I"], **knobs)
  assert beside_long.plan.longest_prompt > beside_short.plan.longest_prompt
  np.testing.assert_array_equal(beside_short[0].token_ids, beside_long[0].token_ids)


def test_generate_returns_completions_with_their_end(llada):
  out = mdjax.generate(llada, ["Hello", "Hi there, you"], max_new_tokens=8, steps=4,
                       block_length=4, key=jax.random.key(0))
  assert len(out) == 2 and out.texts == [c.text for c in out]
  for completion in out:
    assert completion.finish_reason in ("stop", "length")
    assert not np.isin(completion.token_ids, llada.stop_ids).any()
    assert completion.text == llada.decode([int(t) for t in completion.token_ids])
  assert out[0].prompt_ids.tolist() == llada.encode("Hello")


def test_generate_bad_input_before_compiling(llada):
  with pytest.raises(ValueError, match=r"max_new_tokens=-3 is invalid"):
    mdjax.generate(llada, ["a"], max_new_tokens=-3, key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"prompts line 1 has .* tokens; the model holds"):
    mdjax.generate(llada, [[5] * llada.max_len], max_new_tokens=4, key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"alg= does not apply to the llada"):
    mdjax.generate(llada, ["a"], max_new_tokens=4, alg="entropy", key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"with spec= the spec carries"):
    mdjax.generate(llada, ["a"], max_new_tokens=4, spec=sampling.AncestralSpec(steps=2),
                   steps=2, key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"batch_size=0 is invalid"):
    mdjax.generate(llada, ["a"], max_new_tokens=4, batch_size=0, key=jax.random.key(0))


@pytest.mark.slow
def test_mdlm_and_bd3lm_generate_from_nothing_by_their_reference_samplers():
  for name in ("mdlm", "bd3lm"):
    model = mdjax.load(os.path.join(DIT, name))
    out = mdjax.generate(model, [[], []], max_new_tokens=model.max_len, key=jax.random.key(0),
                         stop_at_eos=False)
    assert [len(ids) for ids in out.token_ids] == [model.max_len] * 2
    assert all((ids < model.mask_id).all() for ids in out.token_ids)


def test_an_oracle_completes_id_prompts():
  model = mdjax.load("oracle:two_color")
  spec = sampling.AncestralSpec(steps=1)
  out = mdjax.generate(model, [[0], [1]], spec=spec, max_new_tokens=1, key=jax.random.key(0))
  # The two-color corpus: both positions of a row share a color.
  assert [ids.tolist() for ids in out.token_ids] == [[0], [1]] and out.texts is not None
  with pytest.raises(ValueError, match=r"takes no padding .* give prompts of one length"):
    mdjax.generate(model, [[], [1]], spec=spec, max_new_tokens=1, key=jax.random.key(0))


def test_the_oracles_default_sampler_writes_the_invalid_rate_the_docs_state():
  # generation.md said "ancestral, one token a step", which reads as exact; the default runs
  # K = max_new_tokens ancestral steps, and two_color's invalid rate is 1/(2K) = 25% at K = 2.
  import re
  with open(os.path.join(REPO, "docs", "generation.md"), encoding="utf-8") as f:
    row = next(line for line in f if line.startswith('| a task name (`"two_color"`'))
  stated = re.search(r"invalid pairs at 1/\(2K\) = (\d+)%", row)
  assert stated and "one token a step" not in row, row
  model, n = mdjax.load("two_color"), 4000
  out = mdjax.generate(model, [[]] * n, max_new_tokens=2, key=jax.random.key(0))
  invalid = float(np.mean([ids[0] != ids[1] for ids in out.token_ids]))
  expected = int(stated.group(1)) / 100
  assert abs(invalid - expected) < 4 * np.sqrt(expected * (1 - expected) / n), invalid
  exact = mdjax.generate(model, [[]] * n, max_new_tokens=2, key=jax.random.key(0),
                         spec=sampling.RandomOrderSpec())
  assert all(ids[0] == ids[1] for ids in exact.token_ids)  # one position a step: exact


def test_a_workdirs_default_steps_are_its_configs_else_max_new_tokens():
  # docs/serving.md said a workdir's default steps follow max_tokens; they are the config's
  # sampler.steps, and max_new_tokens only where the config leaves them None.
  from mdjax.model import ConfiguredSampler
  model = mdjax.load("two_color")
  for settings, tokens, steps in (((("steps", 24),), 3, 24), ((("steps", 24),), 2, 24),
                                  ((("steps", None),), 2, 2)):
    sampler = ConfiguredSampler("ancestral", settings)
    plan = sampler.plan(model, prompt_length=0, max_new_tokens=tokens)
    assert plan.spec.steps == steps, (settings, tokens, plan.spec)
