"""The greedy check, rolling log-likelihoods and the lm-eval model "mdjax" (end to end on the
local ScanAndAdd tasks, and on the tiny LLaDA fixture)."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import evaluate, tasks
from mdjax.evaluate import rolling
from tests import stubs
from tests.paths import REPO as ROOT
TWO_COLOR = tasks.get("two_color")


def _greedy_reference(params, context, length, mask_id):
  """LLaDA's suffix_greedy_prediction in numpy on the stub: one position a step, the most
  confident masked one (the first on a tie) takes its argmax."""
  x = np.concatenate([context, np.full(length, mask_id)])
  for _ in range(length):
    logits = stubs.stub_logits_np(params, x[None])[0, len(context):]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    masked = x[len(context):] == mask_id
    confidence = np.where(masked, probs.max(-1), -np.inf)
    pos = int(np.argmax(confidence))
    x[len(context) + pos] = int(np.argmax(logits[pos]))
  return x[len(context):]


def test_greedy_check_against_llada_loop():
  vocab, ctx, length = 6, 3, 4
  params = stubs.stub_params(vocab, ctx + length, seed=1)
  context_Bx3 = np.array([[0, 1, 2], [3, 4, 5], [5, 0, 1]])
  greedy_BxT = np.stack([_greedy_reference(params, c, length, vocab) for c in context_Bx3])
  continuation_BxT = greedy_BxT.copy()
  continuation_BxT[1, 2] = (continuation_BxT[1, 2] + 1) % vocab  # one token off: not greedy
  out = evaluate.loglikelihood(stubs.stub_denoiser, params, context_Bx3, continuation_BxT,
                               num_samples=4, batch_size=4, key=jax.random.key(0),
                               mask_id=vocab, check_greedy=True)
  np.testing.assert_array_equal(out.is_greedy_B, [True, False, True])
  estimate, stderr = out  # still unpacks as the two arrays
  assert estimate.shape == stderr.shape == (3,)
  plain = evaluate.loglikelihood(stubs.stub_denoiser, params, context_Bx3, continuation_BxT,
                                 num_samples=4, batch_size=4, key=jax.random.key(0),
                                 mask_id=vocab)
  assert plain.is_greedy_B is None
  np.testing.assert_array_equal(plain.estimate_B, out.estimate_B)


def _unigram(params, tokens_BxL, t_B):
  """Logits that ignore the canvas: a model of independent tokens, log p(x) = sum of
  log_softmax(params)[x_i], whatever the window."""
  del t_B
  return jnp.broadcast_to(params, tokens_BxL.shape + params.shape)


@pytest.mark.slow
def test_rolling_sums_windows_of_an_exact_factorized_model():
  """Independent tokens: every draw of a window is (T / l) times the masked tokens' log p, an
  unbiased estimate of its sum; iid counts make the standard error exact, so 4 of them
  bound a false alarm below 1e-4 (fixed seed)."""
  logits_V = jnp.array([0.0, 1.0, -1.0, 2.0])
  tokens_N = np.asarray(jax.random.randint(jax.random.key(0), (24,), 0, 4))
  exact = float(jax.nn.log_softmax(logits_V)[tokens_N].sum())
  assert rolling.windows_of(23, 8, 4)[:3] == [(0, 0, 4), (0, 4, 8), (4, 8, 12)]
  assert rolling.windows_of(23, 8, 4)[-1] == (16, 20, 23)
  out = evaluate.loglikelihood_rolling(_unigram, logits_V, tokens_N, max_len=8,
                                       key=jax.random.key(1), mask_id=4, estimator="iid",
                                       num_samples=32, batch_size=16, rows=2)
  assert out.num_tokens == 24 and out.num_windows == 6 and out.stderr > 0
  assert abs(out.estimate - exact) < 4 * out.stderr
  # A uniform model (the same programs): every draw is exactly -T ln 4, up to float32.
  flat = evaluate.loglikelihood_rolling(_unigram, jnp.zeros(4), tokens_N, max_len=8,
                                        key=jax.random.key(1), mask_id=4, estimator="iid",
                                        num_samples=32, batch_size=16, rows=2)
  assert flat.estimate == pytest.approx(-24 * math.log(4)) and flat.stderr < 1e-5
  with pytest.raises(ValueError, match=r"window=9 must be an integer in \[1, max_len=8\]"):
    evaluate.loglikelihood_rolling(_unigram, logits_V, tokens_N, max_len=8, window=9,
                                   key=jax.random.key(1), mask_id=4)


# ----------------------------------------------------------------------------
# The lm-eval model.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_only_the_adapter_imports_lm_eval():
  """`import mdjax` (and mdjax.evaluate) never imports lm_eval: only the two modules that
  exist for it name it, and nothing imports them."""
  import ast
  own = {os.path.join("mdjax", "evaluate", "harness.py"),
         os.path.join("mdjax", "evaluate", "lm_eval.py")}
  for folder, _, names in os.walk(os.path.join(ROOT, "mdjax")):
    for name in names:
      path = os.path.join(folder, name)
      if not name.endswith(".py") or os.path.relpath(path, ROOT) in own:
        continue
      for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
          modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names])
          assert not any(m.split(".")[0] == "lm_eval" or m.startswith("mdjax.evaluate.harness")
                         or m == "mdjax.evaluate.lm_eval" for m in modules), path


def test_bad_model_args():
  harness = pytest.importorskip("mdjax.evaluate.harness")
  with pytest.raises(ValueError, match=r"\['stepz'\] unknown to the mdjax model; known: .*"
                                       r"checkpoint, .*num_samples"):
    harness.MdjaxLM(task="scan_and_add", oracle=True, stepz=3)
  with pytest.raises(ValueError, match="needs oracle=true"):
    harness.MdjaxLM(task="scan_and_add")
  with pytest.raises(ValueError, match="gamma"):  # a knob of another family
    harness.MdjaxLM(task="scan_and_add", oracle=True, sampler="confidence", gamma=0.3)
  with pytest.raises(ValueError, match="max_length=26 exceeds the model's 25 positions"):
    harness.MdjaxLM(task="scan_and_add", oracle=True, max_length=26)
  with pytest.raises(ValueError, match="batch_size='auto' must be an integer"):
    harness.MdjaxLM(task="scan_and_add", oracle=True, batch_size="auto")
  from mdjax.evaluate import lm_eval as entry
  assert "unknown to the mdjax model" in entry.check(
      ["--model_args", "task=two_color,oracle=true,bogus=1", "--tasks", "x"])
  assert "no 'auto'" in entry.check(["--model_args", "task=two_color,oracle=true",
                                     "--tasks", "x", "--batch_size", "auto"])
  assert entry.check(["--model_args", "task=two_color,oracle=true", "--tasks", "x"]) is None


def _instance(kind, args, index):
  from lm_eval.api.instance import Instance
  return Instance(request_type=kind, doc={}, arguments=args, idx=index)


@pytest.mark.slow
def test_llada_fixture_padding_stops_and_ragged_prompts():
  """On the tiny LLaDA: context buckets (left padding) change an estimate by rounding only;
  generate_until's rows do not depend on their neighbours, and text is cut at a stop."""
  harness = pytest.importorskip("mdjax.evaluate.harness")
  from mdjax import io
  llada = io.load(os.path.join(ROOT, "tests", "fixtures", "pretrained", "llada"))
  pairs = [("The cat", " sat"), ("A much longer context here", " and")]
  requests = [_instance("loglikelihood", p, i) for i, p in enumerate(pairs)]
  common = dict(model=llada, num_samples=4, mc_batch_size=4, batch_size=2)
  # The long context's row unpadded (one shape), then both rows padded to 16 tokens.
  exact = harness.MdjaxLM(**common).loglikelihood(requests[1:], disable_tqdm=True)
  padded = harness.MdjaxLM(context_bucket=16, **common).loglikelihood(requests,
                                                                      disable_tqdm=True)
  assert all(np.isfinite(e) and e < 0 for e, _ in padded)
  np.testing.assert_allclose(padded[1][0], exact[0][0], rtol=1e-4)
  model = harness.MdjaxLM(model=llada, steps=4, batch_size=2)
  prompts = ["Hello", "Once upon a time there"]
  gen = lambda order, until: model.generate_until(
      [_instance("generate_until", (prompts[i], {"until": until, "max_gen_toks": 4}), i)
       for i in order], disable_tqdm=True)
  both = gen([0, 1], [])
  assert gen([1, 0], []) == both[::-1]
  stop = both[1][1:3] or "x"  # a piece of the text (a random model: any text)
  cut = gen([0, 1], [stop])
  assert cut[1] == both[1].split(stop)[0] and stop not in cut[1]


@pytest.mark.slow
def test_lm_eval_end_to_end_on_local_tasks(monkeypatch):
  """lm-eval's simple_evaluate over the YAML tasks, the exact ScanAndAdd denoiser as the
  model: every answer is the one the law allows, so acc and exact_match are 1 (see
  tests/lm_eval_tasks.py; 8 stratified draws cover the counts 1..3)."""
  pytest.importorskip("lm_eval")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  from tests import lm_eval_tasks
  monkeypatch.chdir(ROOT)
  output = lm_eval_tasks.evaluate("task=scan_and_add,oracle=true,num_samples=8,"
                                  "mc_batch_size=8", limit=4, tasks=lm_eval_tasks.TASKS[:2])
  results = output["results"]
  assert results["mdjax_scan_and_add_mc"]["acc,none"] == 1.0
  assert results["mdjax_scan_and_add_gen"]["exact_match,none"] == 1.0
  assert lm_eval_tasks.rows(count=4) == [
      __import__("json").loads(line) for line in
      open(lm_eval_tasks.DATA).read().splitlines()[:4]]


def test_trained_workdir(trained):
  """A train.py workdir (the suite's tiny character model): requests scored as the direct
  call scores the same ids (one shape, so one batch), ragged prompts completed."""
  harness = pytest.importorskip("mdjax.evaluate.harness")
  root, _ = trained
  model = harness.MdjaxLM(checkpoint=str(root / "char"), num_samples=4, mc_batch_size=4,
                          batch_size=2, steps=4)
  pairs = [("Thou art", " the"), ("The king", " and")]
  got = model.loglikelihood([_instance("loglikelihood", p, i) for i, p in enumerate(pairs)],
                            disable_tqdm=True)
  ids = [model.encode_pair(*p) for p in pairs]
  assert [len(c) for c, _ in ids] == [8, 8] and [len(t) for _, t in ids] == [4, 4]
  direct = evaluate.loglikelihood(model.backend.denoiser, model.backend.params,
                                  [c for c, _ in ids], [t for _, t in ids], num_samples=4,
                                  batch_size=4, key=jax.random.key(0),
                                  mask_id=model.backend.mask_id, max_len=16)
  np.testing.assert_allclose([e for e, _ in got], direct.estimate_B, rtol=1e-6)
  texts = model.generate_until(
      [_instance("generate_until", (p, {"until": ["."], "max_gen_toks": 4}), i)
       for i, p in enumerate(["Thou", "The king "])], disable_tqdm=True)
  assert all(len(t) <= 4 and "." not in t for t in texts)
  # loglikelihood_rolling: windows of 8 characters (half the model's 16), as the direct call.
  text = "The king and art"  # 16 characters: two windows
  rolled = model.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,), 0)],
                                       disable_tqdm=True)
  direct = evaluate.loglikelihood_rolling(
      model.backend.denoiser, model.backend.params, model.backend.encode(text), max_len=16,
      key=jax.random.key(0), mask_id=model.backend.mask_id, num_samples=4, batch_size=4,
      rows=2)
  assert direct.num_windows == 2 and rolled[0] == pytest.approx(direct.estimate, rel=1e-6)


def test_a_model_of_uniform_or_hybrid_noise_is_refused():
  """lm-eval's log-likelihoods mask positions (absorbing noise): a uniform or hybrid model is
  an ArgumentError naming `model` (was: a number that bounds nothing)."""
  harness = pytest.importorskip("mdjax.evaluate.harness")
  import mdjax
  from mdjax.errors import ArgumentError
  assert harness.backend_of(mdjax.load("oracle:two_color")).model.noise is None
  for noise in ("uniform", "hybrid"):
    with pytest.raises(ArgumentError, match=f"denoises {noise} noise") as error:
      harness.backend_of(mdjax.load("oracle:two_color", noise=noise))
    assert error.value.param == "model"
