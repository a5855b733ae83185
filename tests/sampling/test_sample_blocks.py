"""`sample_blocks`: any family block by block after a sliding window, exactly cached."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import models, sampling

V, MODEL_BLOCK = 9, 4
WINDOW, BLOCK = 8, 4  # the model is trained (here: built) for WINDOW + BLOCK = 12 positions
TRAIN_LEN = WINDOW + BLOCK


def _cfg(**kw):
  return models.TransformerConfig(**{**dict(vocab_size=V, max_len=TRAIN_LEN, d_model=32,
                                            num_layers=2, num_heads=4, d_ff=64,
                                            block_size=MODEL_BLOCK), **kw})


@pytest.fixture(scope="module")
def block_model():
  _, params, apply_fn = models.init(_cfg(), seed=1)
  return apply_fn, params


def _prompt(batch=3, length=4):
  return np.random.default_rng(0).integers(0, V, (batch, length)).astype(np.int32)


FAMILIES = [
    sampling.ConfidenceSpec(steps=2, temperature=0.7),
    sampling.AncestralSpec(steps=4, temperature=0.8),
    sampling.EntropyBoundedSpec(steps=4, gamma=0.5),
    sampling.SpeculativeSpec(k=2),  # calls the denoiser on B x K contexts
    sampling.RemaskSpec(steps=6, eta=0.2),
    sampling.RandomOrderSpec(),
    sampling.DeferSpec(steps=4),  # calls the denoiser on J x B contexts
]


@pytest.mark.xdist_group("block_model")
@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: type(s).__name__)
@pytest.mark.slow
def test_cached_is_the_recomputed_window_past_the_training_length(block_model, spec):
  """Five blocks after a 4-token prompt: 24 positions, twice the model's 12, so the window
  slides. The exact cache (one prefill per block, the family's calls on the block alone)
  gives the tokens of running the denoiser on [window, block] at every call."""
  apply_fn, params = block_model
  kw = dict(length=5 * BLOCK, blocks_of=BLOCK, window=WINDOW, mask_id=V)
  key = jax.random.key(2)
  plain = sampling.sample_blocks(apply_fn, params, key, _prompt(), spec, cached=False, **kw)
  cached = sampling.sample_blocks(apply_fn, params, key, _prompt(), spec, **kw)
  np.testing.assert_array_equal(cached.tokens_BxT, plain.tokens_BxT)
  tokens = np.asarray(cached.tokens_BxT)
  assert tokens.shape == (3, 4 + 5 * BLOCK) and (tokens < V).all()
  np.testing.assert_array_equal(tokens[:, :4], _prompt())
  assert int(cached.nfe) == int(plain.nfe) + 5  # one prefill per block
  assert int(cached.blocks_run) == 5


@pytest.mark.xdist_group("block_model")
@pytest.mark.slow
def test_within_the_window_it_is_the_block_sampler(block_model):
  """While the sequence fits the window nothing slides: greedy confidence decoding block by
  block equals `sample` with block_length on the whole canvas, padding and all."""
  apply_fn, params = block_model
  prompt = _prompt(length=4)
  canvas = np.concatenate([prompt, np.full((3, 8), V, np.int32)], 1)
  whole = sampling.sample(apply_fn, params, jax.random.key(0), canvas,
                          sampling.ConfidenceSpec(steps=4, block_length=BLOCK, temperature=0.0))
  blocks = sampling.sample_blocks(apply_fn, params, jax.random.key(0), prompt,
                                  sampling.ConfidenceSpec(steps=2, temperature=0.0), length=8,
                                  blocks_of=BLOCK, window=WINDOW, mask_id=V)
  np.testing.assert_array_equal(blocks.tokens_BxT, whole.tokens_BxL)


@pytest.mark.xdist_group("block_model")
@pytest.mark.slow
def test_left_padded_prompts_and_no_prompt(block_model):
  """Rows of a left-padded batch give the tokens they give alone (greedy), with the cache;
  and an empty prompt generates from nothing."""
  apply_fn, params = block_model
  spec = sampling.ConfidenceSpec(steps=2, temperature=0.0)
  kw = dict(length=3 * BLOCK, blocks_of=BLOCK, window=WINDOW, mask_id=V)
  prompts = [_prompt(1, 8)[0], _prompt(1, 4)[0]]
  padded = np.zeros((2, 8), np.int32)
  padded[0], padded[1, 4:] = prompts
  valid = np.zeros((2, 8), bool)
  valid[0], valid[1, 4:] = True, True
  batch = sampling.sample_blocks(apply_fn, params, jax.random.key(0), padded, spec,
                                 valid_BxP=valid, **kw)
  for row, prompt in enumerate(prompts):
    alone = sampling.sample_blocks(apply_fn, params, jax.random.key(0), prompt[None], spec, **kw)
    np.testing.assert_array_equal(np.asarray(batch.tokens_BxT)[row, 8:],
                                  np.asarray(alone.tokens_BxT)[0, len(prompt):])
  empty = sampling.sample_blocks(apply_fn, params, jax.random.key(0), np.zeros((2, 0), np.int32),
                                 sampling.ConfidenceSpec(steps=2), **kw)
  assert np.asarray(empty.tokens_BxT).shape == (2, 3 * BLOCK)
  assert (np.asarray(empty.tokens_BxT) < V).all()


@pytest.mark.xdist_group("block_model")
@pytest.mark.slow
def test_prompts_of_any_length_finish_their_last_block(block_model):
  """Prompts of 3, 6 and 1 tokens on blocks of 4: each finishes its partial block first, so
  the cache stays exact (cached = recomputed, past the training length), each row gets its
  `length` positions after its own prompt, and a row gives what it gives alone."""
  apply_fn, params = block_model
  spec = FAMILIES[0]  # random draws, several positions a step
  prompts = [_prompt(1, 3)[0], _prompt(1, 6)[0][::-1], _prompt(1, 1)[0]]
  padded, valid = np.zeros((3, 6), np.int32), np.zeros((3, 6), bool)
  for row, prompt in enumerate(prompts):
    padded[row, 6 - len(prompt):], valid[row, 6 - len(prompt):] = prompt, True
  kw = dict(length=4 * BLOCK, blocks_of=BLOCK, window=WINDOW, mask_id=V)
  key = jax.random.key(3)
  cached = sampling.sample_blocks(apply_fn, params, key, padded, spec, valid_BxP=valid, **kw)
  plain = sampling.sample_blocks(apply_fn, params, key, padded, spec, valid_BxP=valid,
                                 cached=False, **kw)
  np.testing.assert_array_equal(cached.tokens_BxT, plain.tokens_BxT)
  tokens = np.asarray(cached.tokens_BxT)
  assert tokens.shape == (3, 6 + 4 * BLOCK) and (tokens[:, 6:] < V).all()
  np.testing.assert_array_equal(tokens[:, :6], padded)
  assert int(cached.blocks_run) == 5  # tails of up to 3 tokens: one block more
  # The one-token row alone (a tail shorter than the batch's longest): the same positions.
  alone = sampling.sample_blocks(apply_fn, params, sampling.row_keys(key, 3)[2:], prompts[2][None],
                                 spec, **kw)
  np.testing.assert_array_equal(tokens[2, 6:], np.asarray(alone.tokens_BxT)[0, 1:])


def test_split_tails_layout():
  prompt = np.array([[0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 6, 7, 8, 1]], np.int32)
  valid = prompt > 0
  whole, whole_valid, tail = sampling.block_generation.split_tails(prompt, valid, 4, V)
  np.testing.assert_array_equal(whole, [[0, 0, 0, 1, 2, 3, 4], [0, 0, 0, 6, 7, 8, 1]])
  np.testing.assert_array_equal(whole_valid, whole > 0)
  np.testing.assert_array_equal(tail, [[5], [V]])


EOS, TRIGGER = 7, 2


def _eos_stub(params, tokens_BxL, t_B, valid_BxL=None):
  """Proposes EOS everywhere once the window (the valid positions before the block, which
  is the last BLOCK valid ones) holds TRIGGER; otherwise token 1, and TRIGGER at the
  block's last position."""
  length = tokens_BxL.shape[1]
  last_B = length - 1 - jnp.argmax(valid_BxL[:, ::-1], -1)
  position_L = jnp.arange(length)
  window_BxL = valid_BxL & (position_L[None] <= (last_B - BLOCK)[:, None])
  seen_B = ((tokens_BxL == TRIGGER) & window_BxL).any(-1)
  plain_BxLxV = jnp.zeros((1, length, V)).at[..., 1].set(5.0)
  plain_BxLxV = jnp.where((position_L[None] == last_B[:, None])[..., None],
                          jnp.zeros(V).at[TRIGGER].set(9.0), plain_BxLxV)
  ended_LxV = jnp.zeros((length, V)).at[:, EOS].set(5.0)
  return jnp.where(seen_B[:, None, None], ended_LxV[None], plain_BxLxV)


def test_rows_end_at_eos_and_no_block_runs_once_every_row_has():
  """Row 0's prompt holds TRIGGER: its first block is all EOS. Row 1 writes TRIGGER at the
  end of its first block and EOS from the second on. Four blocks were asked for; two ran."""
  prompt = np.array([[TRIGGER, 1, 1, 1], [1, 1, 1, 1]], np.int32)
  spec = sampling.ConfidenceSpec(steps=2, temperature=0.0, eos_id=EOS)
  out = sampling.sample_blocks(_eos_stub, {}, jax.random.key(0), prompt, spec, length=4 * BLOCK,
                               blocks_of=BLOCK, window=WINDOW, mask_id=V, cached=False)
  generated = np.asarray(out.tokens_BxT)[:, 4:]
  np.testing.assert_array_equal(generated[0], [EOS] * 16)
  np.testing.assert_array_equal(generated[1], [1, 1, 1, TRIGGER] + [EOS] * 12)
  np.testing.assert_array_equal(out.generated_length_B, [0, 4])
  # Block 0: two calls. Block 1: its first step writes EOS in both rows, which ends them, so
  # its second step makes no call. Blocks 2 and 3: none.
  assert int(out.blocks_run) == 2 and int(out.nfe) == 2 + 1


@pytest.mark.xdist_group("block_model")
def test_bad_input(block_model):
  apply_fn, params = block_model
  spec = sampling.ConfidenceSpec(steps=2)
  kw = dict(length=8, blocks_of=BLOCK, window=WINDOW, mask_id=V)
  call = lambda **over: sampling.sample_blocks(
      *(over.pop("model", block_model)), jax.random.key(0), over.pop("prompt", _prompt()),
      over.pop("spec", spec), **{**kw, **over})
  with pytest.raises(ValueError, match="window=2 is invalid"):
    call(window=2)
  with pytest.raises(ValueError, match="length=10 is invalid"):
    call(length=10)
  with pytest.raises(ValueError, match="blocks_of=2 is invalid.*model's block size 4"):
    call(blocks_of=2, window=8, length=8)
  with pytest.raises(ValueError, match="window=6 is invalid.*model's block size 4"):
    call(window=6)
  with pytest.raises(ValueError, match="spec.kv_cache='exact' is invalid"):
    call(spec=dataclasses.replace(spec, block_length=BLOCK, kv_cache="exact"))
  with pytest.raises(ValueError, match="eos_id=9 is outside"):
    call(spec=dataclasses.replace(spec, eos_id=9))
  with pytest.raises(ValueError, match="prompt_BxP holds ids"):
    call(prompt=np.full((1, 4), V, np.int32))
  _, bidi_params, bidi = models.init(_cfg(block_size=None), seed=0)
  with pytest.raises(ValueError, match="cached=True needs a block-causal denoiser"):
    call(model=(bidi, bidi_params))
  with pytest.raises(ValueError, match="exceeds max_len"):
    call(window=12)  # 16 positions on a 12-position model
  del params, apply_fn
