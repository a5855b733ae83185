"""`llada.generate` and `dream.diffusion_generate` (mdjax.formats): the reference rules (LLaDA, Fast-dLLM, Dream) as transcribed, on a stub
model and a tiny random Dream-shaped Transformer; token-level parity with the torch
references is tests/formats/test_parity.py."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.formats import dream as dream_format
from mdjax.formats import llada
from mdjax.sampling.families import confidence, dream
from tests import stubs

V, EOS, EOT = 12, 10, 11  # the stub's mask id is V
P, G = 3, 8  # prompt and generation lengths


def stub_model(length=P + G, seed=0, cached=False):
  apply_fn = sampling.recompute_cache(stubs.stub_denoiser) if cached else stubs.stub_denoiser
  return types.SimpleNamespace(denoiser=apply_fn, params=stubs.stub_params(V, length, seed),
                               mask_id=V, eos_id=EOS, config=types.SimpleNamespace(eot_id=EOT))


PROMPT = np.array([[1, 2, 3], [4, 5, 6]], np.int32)


def writes_per_step(result, steps):
  """Positions written at each step, per row (K x B)."""
  write_step = np.asarray(result.write_step_BxL)
  return np.stack([(write_step == i).sum(-1) for i in range(steps)])


# --- LLaDA's count schedule -----------------------------------------------------------------


def get_num_transfer_tokens(mask_num_B, steps):
  """LLaDA's generate.py, in numpy: base = n // steps, the remainder to the first steps."""
  base, remainder = mask_num_B // steps, mask_num_B % steps
  out = np.zeros((len(mask_num_B), steps), np.int64) + base[:, None]
  for i in range(len(mask_num_B)):
    out[i, :remainder[i]] += 1
  return out


@pytest.mark.parametrize("block_length, steps", [(5, 2), (5, 3), (6, 4)])
@pytest.mark.slow
def test_even_counts_are_llada_get_num_transfer_tokens(block_length, steps):
  # Row b has b + 1 masked positions in each block (the rest of the block given): every
  # count from 1 to the block length, with steps above and below it.
  num_blocks, batch = 2, block_length
  canvas = np.zeros((batch, num_blocks * block_length), np.int32)
  for b in range(batch):
    for n in range(num_blocks):
      canvas[b, n * block_length:n * block_length + b + 1] = V
  spec = sampling.ConfidenceSpec(steps=num_blocks * steps, block_length=block_length,
                                 count_rule="even", temperature=0.0, skip_idle_steps=False)
  params = stubs.stub_params(V, canvas.shape[1])
  # Every position editable: the given ones are simply not masked, so blocks stay aligned.
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), canvas, spec,
                           fixed_BxL=np.zeros(canvas.shape, bool))
  got = writes_per_step(result, num_blocks * steps)
  expect = get_num_transfer_tokens(np.arange(1, batch + 1), steps).T
  np.testing.assert_array_equal(got, np.concatenate([expect] * num_blocks))


# --- Fast-dLLM's factor rule --------------------------------------------------------------


def transfer_count_dynamic(confidence_n, factor):
  """get_transfer_index_dynamic's count for one row's n masked confidences (transcribed)."""
  n = len(confidence_n)
  threshs = [1 - factor / (m + 1) for m in range(1, n + 1)]
  threshs[0] = -1
  sorted_conf = sorted(confidence_n, reverse=True)
  for top_i in range(len(threshs)):
    if sorted_conf[top_i] < threshs[top_i]:
      break
  if top_i == 0 or top_i == len(threshs) - 1:
    top_i += 1
  return top_i


def test_factor_counts_are_fast_dllm_get_transfer_index_dynamic():
  rng = np.random.default_rng(0)
  length, rows = 9, 400
  score = np.sqrt(rng.uniform(size=(rows, length))).astype(np.float32)  # many above 1/2
  cand = rng.uniform(size=(rows, length)) < 0.7
  cand[np.arange(rows), rng.integers(0, length, rows)] = True  # a candidate in every row
  for factor in (0.5, 1.0, 2.0):
    got = np.asarray(confidence.factor_counts(score, cand, factor))
    expect = [transfer_count_dynamic(score[b][cand[b]].astype(np.float64), factor)
              for b in range(rows)]
    np.testing.assert_array_equal(got, expect)


# --- Dream's counts -------------------------------------------------------------------------


def dream_counts(num_masked, steps, eps, batch):
  """Dream's _sample counts in float32 (all rows alike): int(n * (1 - s/t)), int(n) last."""
  t = dream.timesteps(eps, steps)
  out, left = [], num_masked
  for i in range(steps):
    num_mask_token = np.float32(left * batch) / np.float32(batch)
    rate = np.float32(1) - t[i + 1] / t[i]
    k = int(num_mask_token * rate) if i < steps - 1 else int(num_mask_token)
    out.append(k)
    left -= k
  return out


def test_dream_time_grid_is_torch_linspace():
  torch = pytest.importorskip("torch")
  for eps in (1e-3, 0.0, 0.05):
    for steps in (1, 3, 7, 8, 64, 100, 257):
      np.testing.assert_array_equal(dream.timesteps(eps, steps),
                                    torch.linspace(1, eps, steps + 1).numpy())


@pytest.mark.slow
def test_dream_counts_are_dreams_float32_rule():
  for steps in (1, 3, 5, 11, 64):
    for eps in (1e-3, 0.1):
      expect = dream_counts(G, steps, eps, batch=2)
      assert sum(expect) == G
      for per_row in (False, True):
        got = dream.counts(np.array([G, G]), dream.ratios(eps, steps), per_row)
        np.testing.assert_array_equal(got, np.stack([expect, expect], 1))
  # In the run: each step writes its count in every row (alg_temp draws which), the batch
  # mean and each row's own count alike.
  steps = 5
  model = stub_model()
  for per_row in (False, True):
    out = sampling.sample(model.denoiser, model.params, jax.random.key(1),
                          np.concatenate([PROMPT, np.full((2, G), V, np.int32)], 1),
                          sampling.DreamSpec(steps=steps, alg="entropy", alg_temp=0.3,
                                             per_row_count=per_row, skip_idle_steps=False))
    np.testing.assert_array_equal(writes_per_step(out, steps),
                                  np.stack([dream_counts(G, steps, 1e-3, 2)] * 2, 1))


# --- the calls ------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_rules_on_a_stub():
  model = stub_model()
  plain = np.asarray(llada.generate(model, PROMPT, steps=8, gen_length=G, block_length=4))
  assert plain.shape == (2, P + G) and (plain != V).all()
  np.testing.assert_array_equal(plain[:, :P], PROMPT)
  # cfg_scale 0 is no guidance; guidance changes the logits, and so the tokens (the stub's
  # logits read the prompt, so masking it in the unconditional rows moves them).
  np.testing.assert_array_equal(
      llada.generate(model, PROMPT, steps=8, gen_length=G, block_length=4, cfg_scale=0.0), plain)
  guided = np.asarray(llada.generate(model, PROMPT, steps=8, gen_length=G, block_length=4,
                                   cfg_scale=2.0))
  assert (guided != V).all() and (guided[:, :P] == PROMPT).all()
  assert (guided[:, P:] != plain[:, P:]).any()
  # EOS is never written with logits_eos_inf.
  banned = np.asarray(llada.generate(model, PROMPT, steps=4, gen_length=G, block_length=4,
                                   logits_eos_inf=True, confidence_eos_eot_inf=True,
                                   temperature=1.0, key=jax.random.key(3)))
  assert (banned != V).all() and not (banned[:, P:] == EOS).any()
  # A stub recomputing its cache: the dual and prefix caches give the uncached tokens.
  cached = stub_model(cached=True)
  np.testing.assert_array_equal(llada.generate(cached, PROMPT, steps=8, gen_length=G,
                                             block_length=4, kv_cache="prefix"), plain)
  factor = dict(steps=8, gen_length=G, block_length=4, factor=1.0)
  np.testing.assert_array_equal(llada.generate(cached, PROMPT, kv_cache="dual", **factor),
                                llada.generate(model, PROMPT, **factor))


@pytest.mark.parametrize("cfg_scale", [0.5, 2.0])
@pytest.mark.slow
def test_guidance_is_llada_rule_on_the_models_logits(cfg_scale):
  """One step commits every position of one block at its argmax: the tokens are the argmax of
  un + (s + 1)(cond - un), computed here from the stub's logits of the canvas (cond) and of
  the canvas with its prompt masked (un), and differ from the unguided argmax."""
  model = stub_model()
  canvas = np.concatenate([PROMPT, np.full((2, G), V, np.int32)], 1)
  unconditional = np.where(np.arange(P + G) < P, V, canvas)
  cond = stubs.stub_logits_np(model.params, canvas)[:, P:]
  un = stubs.stub_logits_np(model.params, unconditional)[:, P:]
  expect = (un + (cfg_scale + 1) * (cond - un)).argmax(-1)
  # The case tells the rule apart from no guidance and from un + s (cond - un).
  assert (expect != cond.argmax(-1)).any()
  assert (expect != (un + cfg_scale * (cond - un)).argmax(-1)).any()
  one_step = dict(steps=1, gen_length=G, block_length=G)
  guided = np.asarray(llada.generate(model, PROMPT, cfg_scale=cfg_scale, **one_step))
  np.testing.assert_array_equal(guided[:, :P], PROMPT)
  np.testing.assert_array_equal(guided[:, P:], expect)
  unguided = np.asarray(llada.generate(model, PROMPT, **one_step))
  np.testing.assert_array_equal(unguided[:, P:], cond.argmax(-1))


@pytest.mark.slow
def test_diffusion_generate_on_a_stub():
  model = stub_model()
  for alg in ("origin", "topk_margin"):
    out = np.asarray(dream_format.diffusion_generate(model, PROMPT, max_new_tokens=G, steps=4, alg=alg,
                                            temperature=0.5, top_p=0.9, top_k=5))
    assert out.shape == (2, P + G) and (out != V).all(), alg
    np.testing.assert_array_equal(out[:, :P], PROMPT)


def padded_stub(params, tokens_BxL, t_B, valid_BxL=None):
  """The stub counting positions from each row's first valid token and reading no padding
  (a published model's contract with `valid_BxL`)."""
  del t_B
  if valid_BxL is None:
    valid_BxL = jnp.ones(tokens_BxL.shape, bool)
  position_BxL = jnp.maximum(jnp.cumsum(valid_BxL, -1) - 1, 0)
  mixed_BxV = (params["mix"][tokens_BxL] * valid_BxL[..., None]).sum(1)
  return params["pos"][position_BxL] + mixed_BxV[:, None]


@pytest.mark.slow
def test_a_left_padded_batch_equals_each_row_alone():
  model = stub_model()
  model.denoiser = padded_stub
  batch = np.array([[5, 6, 7], [0, 0, 8]], np.int32)
  mask = np.array([[1, 1, 1], [0, 0, 1]], np.int32)
  keys = jax.random.split(jax.random.key(4), 2)
  kwargs = dict(steps=4, gen_length=4, block_length=2, temperature=0.8, remasking="random")
  together = np.asarray(llada.generate(model, batch, attention_mask=mask, key=keys, **kwargs))
  assert (together != V).all()
  # Row 1 is padded: alone it is its one real token (row 0, unpadded, is the contract tests').
  alone = np.asarray(llada.generate(model, np.array([[8]]), key=keys[1:], **kwargs))
  np.testing.assert_array_equal(alone[0], together[1, 2:])
  dream_kwargs = dict(max_new_tokens=4, steps=3, alg="maskgit_plus", alg_temp=0.5)
  together = dream_format.diffusion_generate(model, batch, attention_mask=mask, key=keys, **dream_kwargs)
  alone = dream_format.diffusion_generate(model, np.array([[8]]), key=keys[1:], **dream_kwargs)
  np.testing.assert_array_equal(alone[0], together[1, 2:])


BAD_GENERATE = [
    (dict(gen_length=8, block_length=3), "gen_length=8 must be a multiple of block_length=3"),
    (dict(steps=3), "steps=3 must be a multiple of the number of blocks"),
    (dict(remasking="top_k"), "remasking='top_k' is not supported"),
    (dict(kv_cache="paged"), "kv_cache='paged' is not supported"),
    (dict(cfg_scale=-1.0), "cfg_scale=-1.0"),
    (dict(threshold=0.0), "threshold=0.0"),
    (dict(threshold=1.5), "threshold=1.5"),
    (dict(factor=0.0), "factor=0.0"),
    (dict(threshold=0.9, factor=1.0), "set one"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(attention_mask=np.ones((2, 2))), "attention_mask has shape"),
    (dict(steps=0), "steps=0"),
]


@pytest.mark.parametrize("kwargs, message", BAD_GENERATE,
                         ids=[m.split("=")[0].split()[0] + str(i)
                              for i, (_, m) in enumerate(BAD_GENERATE)])
def test_generate_refuses_bad_input(kwargs, message):
  call = dict(steps=8, gen_length=8, block_length=4) | kwargs
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
    llada.generate(stub_model(), PROMPT, **call)


def test_bad_prompts_and_dream_arguments():
  model = stub_model()
  with pytest.raises(ValueError, match="holds the mask id 12"):
    llada.generate(model, np.array([[1, V, 3]]), steps=2, gen_length=2, block_length=2)
  with pytest.raises(ValueError, match="2-D integer"):
    llada.generate(model, np.array([1, 2, 3]), steps=2, gen_length=2, block_length=2)
  for kwargs, message in [(dict(alg="greedy"), "alg='greedy'"), (dict(eps=1.0), "eps=1.0"),
                          (dict(top_p=0.0), "top_p=0.0"), (dict(top_k=0), "top_k=0"),
                          (dict(alg_temp=-1.0), "alg_temp=-1.0"),
                          (dict(max_new_tokens=0), "max_new_tokens=0")]:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
      dream_format.diffusion_generate(model, PROMPT, **(dict(max_new_tokens=G, steps=4) | kwargs))
  no_eot = types.SimpleNamespace(**vars(model) | dict(config=types.SimpleNamespace(eot_id=None)))
  with pytest.raises(ValueError, match="needs the model's EoT id"):
    llada.generate(no_eot, PROMPT, steps=2, gen_length=2, block_length=2,
                 confidence_eos_eot_inf=True)
