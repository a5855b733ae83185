"""LLaDA2.1's joint threshold decoder (`sampling.LLaDA21Spec`): token for token against the
published `generate` on the tiny LLaDA2 checkpoint (tests/fixtures/llada21/, written by
tests/reference/llada21.py), against a numpy transcription of that loop on a stub, and its
properties on exact oracles and a hand-made editing denoiser."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.models import published
from tests import stubs
from tests.formats import family_fixtures

# --- a denoiser whose proposals edit: each position copies its right neighbour -------------

V = 5  # ids 0..4, the mask 5
# Position i proposes the token at i + 1 with logit 4 (p = e^4 / (e^4 + 4) = 0.932) when it is
# written, else 0 with logit 3 (p = 0.834).
P_COPY, P_ZERO = np.exp(4) / (np.exp(4) + 4), np.exp(3) / (np.exp(3) + 4)


def right_neighbour(params, tokens_BxL, t_B):
  del params, t_B
  right_BxL = jnp.concatenate([tokens_BxL[:, 1:], tokens_BxL[:, -1:]], 1)
  written_BxL = right_BxL != V
  value_BxL = jnp.where(written_BxL, right_BxL, 0)
  return jnp.where(written_BxL[..., None], 4.0, 3.0) * jax.nn.one_hot(value_BxL, V)


# A fixed 1 first (its proposal, the written token after it, differs with p = 0.932: never
# edited, being the prompt), four masks, a fixed 3 last.
CANVAS = np.array([[1, V, V, V, V, 3]], np.int32)


def _run(spec, canvas=CANVAS, denoiser=right_neighbour, params=None, key=0):
  return sampling.sample(denoiser, params, jax.random.key(key), canvas, spec, mask_id=V)


def test_masks_then_edits_from_the_right_as_derived():
  """threshold 0.8 < P_ZERO: step 0 writes every mask ([1, 0, 0, 0, 3, 3]); each post step
  then edits the rightmost 0 into the 3 after it (P_COPY > 0.5), one a step, and the fourth
  post step edits nothing and ends the block: 5 calls, edits [0, 1, 1, 1, 0]."""
  assert 0.8 < P_ZERO < 0.9 < P_COPY
  out = _run(sampling.LLaDA21Spec(threshold=0.8, editing_threshold=0.5, max_post_steps=16))
  assert out.tokens_BxL.tolist() == [[1, 3, 3, 3, 3, 3]]
  assert int(out.nfe) == 5 and out.rounds_B.tolist() == [5]
  assert out.extras["changes_KxB"][:, 0].tolist()[:6] == [0, 1, 1, 1, 0, 0]
  # The edited positions were last written at the post steps that edited them.
  assert out.write_step_BxL.tolist() == [[-1, 3, 2, 1, 0, -1]]


def test_no_edits_without_an_editing_threshold_below_one():
  """editing_threshold=1 (no probability is above it): the M2T writes stay, and the one post
  step that edits nothing ends the block. (With the edits this canvas ends all 3s: a run
  that never applied them fails the test above.)"""
  out = _run(sampling.LLaDA21Spec(threshold=0.8, editing_threshold=1.0))
  assert out.tokens_BxL.tolist() == [[1, 0, 0, 0, 3, 3]]
  assert int(out.nfe) == 2 and int(out.extras["changes_KxB"].sum()) == 0


@pytest.mark.parametrize("max_post_steps, tokens, calls", [
    (0, [1, 0, 0, 0, 3, 3], 1),  # the block is over once it holds no mask
    (2, [1, 0, 3, 3, 3, 3], 3),  # two post steps, two edits, then the budget is spent
])
def test_the_post_budget_ends_the_block(max_post_steps, tokens, calls):
  spec = sampling.LLaDA21Spec(threshold=0.8, editing_threshold=0.5,
                              max_post_steps=max_post_steps)
  out = _run(spec)
  assert out.tokens_BxL.tolist() == [tokens] and int(out.nfe) == calls


def test_below_the_threshold_one_mask_a_step_rightmost_first():
  """threshold 0.9: only the position left of a written token passes (P_COPY), one a step,
  from the right; then a post step without edits: 5 calls."""
  out = _run(sampling.LLaDA21Spec(threshold=0.9, editing_threshold=0.5))
  assert out.tokens_BxL.tolist() == [[1, 3, 3, 3, 3, 3]]
  assert out.write_step_BxL.tolist() == [[-1, 3, 2, 1, 0, -1]] and int(out.nfe) == 5


def test_the_top_k_fallback_writes_num_to_transfer():
  """threshold 0.95 (none passes): the fallback writes the num_to_transfer most confident,
  P_COPY first, then the ties of P_ZERO to the lower position."""
  out = _run(sampling.LLaDA21Spec(threshold=0.95, editing_threshold=1.0, num_to_transfer=2))
  assert out.write_step_BxL.tolist() == [[-1, 0, 1, 1, 0, -1]]


def test_steps_bounds_each_block_and_its_last_step_writes_every_mask():
  out = _run(sampling.LLaDA21Spec(threshold=0.95, editing_threshold=0.5, steps=2))
  assert out.write_step_BxL.tolist() == [[-1, 1, 1, 1, 0, -1]] and int(out.nfe) == 2
  assert sampling.num_steps(sampling.LLaDA21Spec(steps=2, block_length=2), 6) == 3 * 2


def test_edits_stay_inside_the_current_block():
  """Blocks of 2: the first block (positions 1, 2) is over before the second writes; its
  tokens are never edited afterwards, though each first-block token's proposal (its right
  neighbour, once written) differs with p = 0.932."""
  spec = sampling.LLaDA21Spec(threshold=0.8, editing_threshold=0.5, block_length=2)
  out = _run(spec)
  # Block 1: [0, 0] (the right neighbour of position 2 is masked); its post step sees
  # position 2's right neighbour still masked: no edit. Block 2: [0, 3], then an edit to 3.
  assert out.tokens_BxL.tolist() == [[1, 0, 0, 3, 3, 3]]


# --- a numpy transcription of the published loop, on the stub ------------------------------


def _softmax(logits):
  z = np.exp(logits - logits.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def reference_loop(params, row_L, mask_id, *, block_length, threshold, editing_threshold,
                   max_post_steps, num_to_transfer):
  """LLaDA2.1's generate loop (tests/reference/llada21.py) at temperature 0 on one row whose
  blocks are its masked positions in order, `block_length` at a time (float64): (tokens,
  calls, edits, the smallest margin of a decision)."""
  x = row_L.copy()
  masked = np.flatnonzero(x == mask_id)
  calls, edits, margin = 0, 0, np.inf
  for start in range(0, len(masked), block_length):
    block = masked[start:start + block_length]
    post_steps = 0
    while True:
      active = x[block] == mask_id
      if not active.any():
        post_steps += 1
      if post_steps > max_post_steps:
        break
      logits = stubs.stub_logits_np(params, x[None])[0][block].astype(np.float64)
      calls += 1
      probs = _softmax(logits)
      x0 = probs.argmax(-1)
      x0_p = probs.max(-1)
      top2 = np.sort(probs, -1)[:, -2:]
      margin = min(margin, (top2[:, 1] - top2[:, 0]).min(),
                   np.abs(x0_p - threshold).min(), np.abs(x0_p - editing_threshold).min())
      m2t = np.zeros(len(block), bool)
      if active.any():
        confidence = np.where(active, x0_p, -np.inf)
        high = (confidence > threshold) & active
        if high.sum() >= num_to_transfer:
          m2t = high
        else:
          k = min(num_to_transfer, active.sum())
          m2t[np.argsort(-confidence, kind="stable")[:k]] = True
      edit = ~active & (x0_p > editing_threshold) & (x0 != x[block])
      x[block[m2t | edit]] = x0[m2t | edit]
      edits += int(edit.sum())
      if not active.any() and not edit.any():
        break
  return x, calls, edits, margin


@pytest.mark.parametrize("knobs", [
    dict(block_length=4, threshold=0.5, editing_threshold=0.3, max_post_steps=3,
         num_to_transfer=1),
    dict(block_length=3, threshold=0.7, editing_threshold=0.0, max_post_steps=2,
         num_to_transfer=2),
    dict(block_length=12, threshold=0.9, editing_threshold=0.6, max_post_steps=16,
         num_to_transfer=1),
], ids=["quality-like", "speedy-like", "one-block"])
@pytest.mark.slow
def test_the_transcribed_loop_token_for_token_on_a_stub(knobs):
  """Three rows of different prompts in one batch (blocks of the rows' masked positions,
  ragged at the end), greedy: each row's tokens, calls (rounds_B) and edits are the loop's."""
  vocab, length = 7, 14
  params = stubs.stub_params(vocab, length, seed=3)
  params = jax.tree.map(lambda x: 3.0 * x, params)  # sharper: thresholds pass, edits happen
  canvas = np.full((3, length), vocab, np.int32)
  for row, prompt in enumerate(([2, 5], [1, 1, 4, 0], [6])):
    canvas[row, :len(prompt)] = prompt
  spec = sampling.LLaDA21Spec(temperature=0.0, **knobs)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), canvas, spec)
  changes_B = np.asarray(out.extras["changes_KxB"]).sum(0)
  np_params = jax.tree.map(np.asarray, params)
  total_edits = 0
  for row in range(3):
    tokens, calls, edits, margin = reference_loop(np_params, canvas[row], vocab, **knobs)
    assert margin > 1e-5, "a decision too close to call in float32"
    np.testing.assert_array_equal(np.asarray(out.tokens_BxL[row]), tokens)
    assert int(out.rounds_B[row]) == calls and int(changes_B[row]) == edits
    total_edits += edits
  if knobs["editing_threshold"] < 0.5:
    assert total_edits > 0, "the stub is meant to edit here"


# --- on exact oracles ------------------------------------------------------------------------


@pytest.mark.slow
def test_without_edits_it_is_the_threshold_decoder_token_for_token():
  """editing_threshold=1 on the permutation oracle at temperature 1: ConfidenceSpec's
  threshold rule (score = the drawn value's probability, at least one a step) draws the same
  values at the same steps (each step's key is fold_in(row key, step)), so the tokens are
  equal. The oracle's probabilities are 1/r (r unused items), never 0.4 (>= and > agree)."""
  model = mdjax.load("permutation")
  n = model.max_len
  canvas = np.full((256, n), model.mask_id, np.int32)
  ours = sampling.LLaDA21Spec(threshold=0.4, editing_threshold=1.0, temperature=1.0)
  theirs = sampling.ConfidenceSpec(steps=n, threshold=0.4, score="prob",
                                   score_transformed=True, temperature=1.0)
  run = lambda spec: sampling.sample(model.denoiser, model.params, jax.random.key(7), canvas,
                                     spec, mask_id=model.mask_id)
  a, b = run(ours), run(theirs)
  np.testing.assert_array_equal(np.asarray(a.tokens_BxL), np.asarray(b.tokens_BxL))
  # Two items written together from 1/2 each are equal half the time: invalid rows exist,
  # so the comparison covers steps that write several masks.
  repeated = [len(set(row)) < n for row in np.asarray(a.tokens_BxL).tolist()]
  assert 0 < sum(repeated) < len(repeated)
  # Its calls: the threshold decoder's, plus one post step a row (which edits nothing).
  np.testing.assert_array_equal(np.asarray(a.rounds_B), np.asarray(b.rounds_B) + 1)
  # An exact denoiser never doubts a written token (one-hot where visible): the Speedy
  # mode's edits never fire, even on the invalid rows.
  speedy = run(dataclasses.replace(ours, editing_threshold=0.0))
  np.testing.assert_array_equal(np.asarray(speedy.tokens_BxL), np.asarray(a.tokens_BxL))
  assert int(speedy.extras["changes_KxB"].sum()) == 0


def test_two_color_through_generate():
  """The reference's loop on two_color (greedy): the top-1 fallback writes the first color
  (p = 1/2), the second follows at p = 1 > 0.95, a post step edits nothing: 3 calls, and
  never a mismatched pair."""
  model = mdjax.load("two_color")
  out = mdjax.generate(model, [[]] * 8, max_new_tokens=2, key=0, spec=sampling.LLaDA21Spec())
  ids = np.array(out.token_ids)
  assert (ids[:, 0] == ids[:, 1]).all() and out.nfe == 3


# --- bad knobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("knobs, param", [
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(editing_threshold=-0.1), "editing_threshold"),
    (dict(max_post_steps=-1), "max_post_steps"),
    (dict(max_post_steps=1.5), "max_post_steps"),
    (dict(num_to_transfer=0), "num_to_transfer"),
    (dict(steps=0), "steps"),
    (dict(block_length=0), "block_length"),
    (dict(kv_cache="dual", block_length=2), "kv_cache"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_knobs_are_argument_errors_naming_the_knob(knobs, param):
  with pytest.raises(ArgumentError, match=f"^{param}=") as error:
    sampling.LLaDA21Spec(**knobs)
  assert error.value.param == param


def test_modes_are_the_model_cards():
  assert sampling.LLaDA21Spec.mode("speedy") == sampling.LLaDA21Spec(threshold=0.5,
                                                                     editing_threshold=0.0)
  quality = sampling.LLaDA21Spec.mode("quality", max_post_steps=5)
  assert (quality.threshold, quality.editing_threshold, quality.max_post_steps) == (0.7, 0.5, 5)
  with pytest.raises(ArgumentError, match="mode='fast' is invalid"):
    sampling.LLaDA21Spec.mode("fast")
  defaults = sampling.LLaDA21Spec()  # the published generate's
  assert (defaults.threshold, defaults.editing_threshold, defaults.max_post_steps,
          defaults.num_to_transfer, defaults.temperature) == (0.95, 0.9, 16, 1, 0.0)
  assert sampling.make_spec("llada21", threshold=0.7) == sampling.LLaDA21Spec(threshold=0.7)


# --- the published generate on the tiny LLaDA2 checkpoint ---------------------------------

CASES = family_fixtures.cases("llada21")
EOS_ID = 290


def _spec(kwargs: dict, eos_id: int | None) -> sampling.LLaDA21Spec:
  knobs = {k: v for k, v in kwargs.items() if k not in ("gen_length", "block_length")}
  return sampling.LLaDA21Spec(eos_id=eos_id, **knobs)


def _check_rows(case, generated_BxG, rounds_B):
  for row, got, rounds in zip(case["rows"], generated_BxG, rounds_B):
    expected = row["generated"]
    assert got[:len(expected)].tolist() == expected, row["seed"]
    if expected[-1] == EOS_ID:
      # The row ended: EOS after it. (sample_blocks still runs the ended row's later
      # blocks for the rows that have not, and writes them EOS: more rounds.)
      assert (got[len(expected):] == EOS_ID).all() and rounds >= row["calls"]
    else:
      assert rounds == row["calls"], row["seed"]


@pytest.mark.parametrize("case", [c for c in CASES if c["kwargs"]["block_length"] == 8],
                         ids=lambda c: c["name"])
@pytest.mark.slow
def test_published_generate_token_for_token_in_blocks_of_8(case):
  """Each case's rows as one left-padded batch through `sample_blocks` on the block-8
  network (what the llada2 sampler plans for block_length=8), with the checkpoint's EOS:
  each row's tokens as the published generate gave them alone, its forward calls too."""
  m = family_fixtures.model("llada2")
  kwargs, block = case["kwargs"], case["kwargs"]["block_length"]
  new = kwargs["gen_length"]
  prompts = [row["prompt"] for row in case["rows"]]
  longest = max(map(len, prompts))
  prompt_BxP = np.full((len(prompts), longest), m.pad_id, np.int32)
  valid_BxP = np.zeros(prompt_BxP.shape, bool)
  for i, p in enumerate(prompts):
    prompt_BxP[i, longest - len(p):], valid_BxP[i, longest - len(p):] = p, True
  denoiser = published.denoiser(dataclasses.replace(m.config, block_size=block))
  out = sampling.sample_blocks(denoiser, m.params, jax.random.key(0), prompt_BxP,
                               _spec(kwargs, m.eos_id), length=-(-new // block) * block,
                               blocks_of=block, window=-(-(longest + new) // block) * block,
                               mask_id=m.mask_id, valid_BxP=valid_BxP)
  _check_rows(case, np.asarray(out.tokens_BxT)[:, longest:], np.asarray(out.rounds_B))


@pytest.mark.slow
def test_published_defaults_token_for_token_through_generate():
  """The published defaults (blocks of 32, the model's) through `mdjax.generate` with the
  spec and blocks_of=32: each completion is the published generate's."""
  m = family_fixtures.model("llada2")
  (case,) = [c for c in CASES if c["name"] == "defaults"]
  assert _spec(case["kwargs"], None) == sampling.LLaDA21Spec()
  out = mdjax.generate(m, [row["prompt"] for row in case["rows"]],
                       max_new_tokens=case["kwargs"]["gen_length"], key=0,
                       spec=sampling.LLaDA21Spec(eos_id=m.eos_id), blocks_of=32)
  for completion, row in zip(out, case["rows"]):
    expected = row["generated"]
    assert EOS_ID not in expected and completion.token_ids.tolist() == expected
  assert out.plan.blocks_of == 32


@pytest.mark.slow
def test_the_llada2_default_sampler_with_editing_threshold_is_llada21s_generate():
  """The llada2 checkpoint's own sampler, given `editing_threshold` (LLaDA2.1's knobs, as
  its generate takes them), runs the published LLaDA2.1 generate: each row's tokens. The
  post-budget case names every knob the door passes on (threshold, editing_threshold,
  max_post_steps, num_to_transfer, block_length); the others run through `sample_blocks`
  and `generate(spec=)` above."""
  m = family_fixtures.model("llada2")
  (case,) = [c for c in CASES if c["name"] == "post_budget"]
  kwargs = case["kwargs"]
  knobs = {k: v for k, v in kwargs.items() if k != "gen_length"}
  for row in case["rows"]:  # one at a time, as the published generate runs them
    (completion,) = mdjax.generate(m, [row["prompt"]], max_new_tokens=kwargs["gen_length"],
                                   key=0, **knobs)
    expected = row["generated"]  # a completion stops before its EOS
    ended = EOS_ID in expected
    expected = expected[:expected.index(EOS_ID)] if ended else expected
    assert completion.token_ids.tolist() == expected, (case["name"], row["seed"])
    assert completion.finish_reason == ("stop" if ended else "length")


def test_the_llada2_default_sampler_plans_llada21_only_with_editing_knobs():
  m = family_fixtures.model("llada2")
  plain = m.sampler.plan(m, prompt_length=4, max_new_tokens=8)
  assert isinstance(plain.spec, sampling.ConfidenceSpec)
  editing = m.sampler.plan(m, prompt_length=4, max_new_tokens=8, editing_threshold=0.5,
                           threshold=0.7)
  assert editing.spec == sampling.LLaDA21Spec(threshold=0.7, editing_threshold=0.5,
                                              temperature=0.0, eos_id=m.eos_id)
  assert editing.blocks_of == plain.blocks_of == m.config.block_size
  with pytest.raises(ArgumentError, match="minimal_topk"):
    m.sampler.plan(m, prompt_length=4, max_new_tokens=8, editing_threshold=0.5,
                   minimal_topk=2)
  with pytest.raises(ArgumentError, match="editing_threshold"):
    m.sampler.plan(m, prompt_length=4, max_new_tokens=8, editing_threshold=1.5)
  with pytest.raises(ArgumentError, match="num_to_transfer"):  # LLaDA2.0's has no such knob
    m.sampler.plan(m, prompt_length=4, max_new_tokens=8, num_to_transfer=2)


@pytest.mark.slow
def test_served_rows_equal_generate_offline():
  """On a lane (rows stepped by the server, the second request's a step behind the first's)
  every row equals `generate`'s, token for token: temperature 1 on the permutation oracle,
  so the keys decide the tokens, and threshold 0.4, so some steps write two masks."""
  from mdjax.serve.engine import Engine
  model = mdjax.load("permutation")
  engine = Engine(model, max_batch=4)
  jobs, handles, done = [], [], {}
  for seed in (3, 4):
    job = engine.prepare([], max_new_tokens=model.max_len, seed=seed, n=2, sampler="llada21",
                         knobs=dict(threshold=0.4, temperature=1.0))
    listen = lambda update, seed=seed: update.completion is not None and done.__setitem__(
        (seed, update.choice), update.completion.token_ids)
    jobs.append(job), handles.append(engine.submit(job, listen))
    engine.run_once()
  for _ in range(200):
    if all(h.done for h in handles):
      break
    engine.run_once()
  assert len(done) == 4
  for job in jobs:
    want = mdjax.generate(model, [[]] * 2, max_new_tokens=model.max_len,
                          key=jax.random.key(job.seed), spec=job.spec)
    for choice in range(2):
      np.testing.assert_array_equal(done[job.seed, choice], want[choice].token_ids)
