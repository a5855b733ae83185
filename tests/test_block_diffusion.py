"""Block diffusion (BD3-LM): the block-causal Transformer, the block pair pass, the block
NELBO, the block-causal oracle adapter and the ELBO's tightness on exact oracles."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import two_color as two_color_config
from mdjax import diffusion, models, tasks, train
from mdjax.tasks import scan_and_add, two_color

V, L = 7, 12
# Float32 rounding: the pair pass sums the same products over twice the keys (the masked
# ones contribute exact zeros) in another order; observed differences are ~1e-6 with O(1)
# activations at d_model 32, far below a wrong mask (which moves logits by O(0.1)).
ROUNDING = 2e-5


def _cfg(**kw):
  return models.TransformerConfig(**{**dict(vocab_size=V, max_len=L, d_model=32, num_layers=2,
                                            num_heads=4, d_ff=64), **kw})


def _tokens(seed, batch=3):
  return jax.random.randint(jax.random.key(seed), (batch, L), 0, V + 1)


# ----------------------------------------------------------------------------
# The block-causal Transformer.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["rope", "sinusoidal"])
@pytest.mark.slow
def test_block_size_L_is_bidirectional_and_1_is_causal(positions):
  """Same parameters (block_size adds none): block L computes the bidirectional model's
  logits, block 1 the causal model's, exactly (the same masks)."""
  _, params, plain = models.init(_cfg(positions=positions), seed=0)
  tokens, t_B = _tokens(0), jnp.full((3,), 0.5)
  for kw, reference in (({"block_size": L}, {}), ({"block_size": 1}, {"causal": True})):
    _, _, block_apply = models.init(_cfg(positions=positions, **kw), seed=0)
    _, _, ref_apply = models.init(_cfg(positions=positions, **reference), seed=0)
    np.testing.assert_array_equal(jax.jit(block_apply)(params, tokens, t_B),
                                  jax.jit(ref_apply)(params, tokens, t_B))
  assert plain.block_size is None and plain.block_pair is None


def test_block_causal_influence():
  """A position's logits move with tokens of its own and earlier blocks, never later ones."""
  block = 4
  _, params, apply_fn = models.init(_cfg(block_size=block), seed=1)
  tokens = jnp.full((1, L), V, jnp.int32)
  apply_fn = jax.jit(apply_fn)
  base = apply_fn(params, tokens, jnp.zeros(1))[0]
  for j in range(L):
    moved_L = jnp.abs(apply_fn(params, tokens.at[0, j].set(0), jnp.zeros(1))[0] - base).max(-1)
    sees_j = np.arange(L) // block >= j // block
    assert (np.asarray(moved_L)[sees_j] > 1e-4).all(), (j, moved_L)
    assert (np.asarray(moved_L)[~sees_j] == 0.0).all(), (j, moved_L)


@pytest.mark.parametrize("kw", [{"block_size": 4}, {"block_size": 3, "positions": "sinusoidal"},
                                {"block_size": L}])
@pytest.mark.slow
def test_block_pair_is_the_plain_pass_per_block(kw):
  """Noisy block b's logits from the pair pass = the plain block-causal pass over
  [clean blocks < b, noisy block b, anything after] at block b."""
  block = kw["block_size"]
  _, params, apply_fn = models.init(_cfg(**kw), seed=2)
  clean = jax.random.randint(jax.random.key(1), (3, L), 0, V)
  noisy = jnp.where(jax.random.bernoulli(jax.random.key(2), 0.5, (3, L)), V, clean)
  t_B = jnp.full((3,), 0.3)
  pair = jax.jit(apply_fn.block_pair)(params, noisy, clean, t_B)
  assert pair.shape == (3, L, V)
  block_L = np.arange(L) // block
  for b in range(L // block):
    # Later blocks hold junk: the block-causal pass must not see them.
    canvas = np.where(block_L < b, clean, np.where(block_L == b, noisy, (clean + 1) % V))
    plain = apply_fn(params, jnp.asarray(canvas), t_B)
    np.testing.assert_allclose(pair[:, block_L == b], plain[:, block_L == b], atol=ROUNDING)


def test_config_refuses_bad_block_sizes():
  for kw, needle in [({"block_size": 0}, "block_size=0"), ({"block_size": L + 1}, "max_len"),
                     ({"block_size": 2.0}, "block_size=2.0"),
                     ({"block_size": 2, "causal": True}, "causal=True"),
                     ({"block_size": 2, "time_conditioning": True}, "time_conditioning")]:
    with pytest.raises(ValueError, match=needle):
      _cfg(**kw)
  _, params, plain = models.init(_cfg(), seed=0)
  model = models.Transformer(_cfg(), rngs=__import__("flax").nnx.Rngs(0))
  with pytest.raises(ValueError, match="block_size"):
    model.block_pair(_tokens(0), _tokens(1), jnp.zeros(3))


# ----------------------------------------------------------------------------
# The block NELBO.
# ----------------------------------------------------------------------------


def test_block_size_L_is_nelbo_loss_with_the_same_key():
  """One block: the same times and masks as nelbo_loss, so the same loss (oracle: exactly;
  Transformer: up to the pair pass's rounding)."""
  key, schedule = jax.random.key(7), diffusion.LinearSchedule()
  x = two_color.sample_data(jax.random.key(3), 512)
  _, params, apply_fn = models.init(_cfg(block_size=L), seed=3)
  _, _, bidirectional = models.init(_cfg(), seed=3)
  tokens = jax.random.randint(jax.random.key(4), (8, L), 0, V)

  @jax.jit
  def both(params, x, tokens):
    oracle = (diffusion.nelbo_loss(two_color.exact_denoiser, None, key, x, schedule=schedule,
                                   mask_id=two_color.MASK_ID)[1]["nelbo_nats_B"],
              diffusion.block_nelbo_loss(diffusion.block_causal(two_color.exact_denoiser, 2),
                                         None, key, x, block_size=2, schedule=schedule,
                                         mask_id=two_color.MASK_ID)[1]["nelbo_nats_B"])
    model = (diffusion.nelbo_loss(bidirectional, params, key, tokens, schedule=schedule,
                                  mask_id=V)[0],
             diffusion.block_nelbo_loss(apply_fn, params, key, tokens, block_size=L,
                                        schedule=schedule, mask_id=V)[0])
    return oracle, model

  (ref, block), (model_ref, model_block) = both(params, x, tokens)
  np.testing.assert_array_equal(block, ref)
  np.testing.assert_allclose(model_block, model_ref, rtol=1e-5)


@pytest.mark.slow
def test_block_loss_gradients_finite_and_times():
  _, params, apply_fn = models.init(_cfg(block_size=4), seed=4)
  x = jax.random.randint(jax.random.key(5), (4, L), 0, V)
  loss_fn = functools.partial(diffusion.block_nelbo_loss, apply_fn, block_size=4,
                              schedule=diffusion.CosineSchedule(), mask_id=V, t_min=0.3,
                              t_max=0.8)
  (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      params, jax.random.key(6), x)
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert aux["nelbo_nats_B"].shape == (4,) and 0 < aux["masked_fraction"] < 1
  # Antithetic: the B x N times are one stratified grid, shifted, inside [t_min, t_max].
  t_BxN = diffusion.block_times(jax.random.key(0), 4, 3, t_min=0.3, t_max=0.8)
  gaps = np.diff(np.sort(np.asarray(t_BxN).ravel()))
  np.testing.assert_allclose(gaps[gaps < 0.5 * 0.5 / 12 * 2], 0.5 / 12, rtol=1e-4)
  assert 0.3 <= float(t_BxN.min()) and float(t_BxN.max()) <= 0.8
  independent = diffusion.block_times(jax.random.key(0), 4, 3, antithetic=False)
  assert independent.shape == (4, 3)


def test_block_loss_bad_input():
  x = two_color.sample_data(jax.random.key(0), 4)
  oracle = diffusion.block_causal(two_color.exact_denoiser, 1)
  call = lambda apply_fn=oracle, **kw: diffusion.block_nelbo_loss(
      apply_fn, None, jax.random.key(0), x, **{**dict(
          block_size=1, schedule="linear", mask_id=two_color.MASK_ID), **kw})
  for kw, needle in [(dict(block_size=3), "block_size=3 must be an integer >= 1 that divides"),
                     (dict(block_size=0), "block_size=0"),
                     (dict(t_min=0.5, t_max=0.5), r"\(t_min, t_max\)=\(0.5, 0.5\)"),
                     (dict(t_max=1.5), r"\(t_min, t_max\)"),
                     (dict(antithetic=1), "antithetic=1"),
                     (dict(block_size=2), "blocks of 1"),
                     (dict(apply_fn=two_color.exact_denoiser), "no block_pair")]:
    with pytest.raises(ValueError, match=needle):
      call(**kw)
  with pytest.raises(ValueError, match="block_size=0"):
    diffusion.block_causal(two_color.exact_denoiser, 0)
  assert diffusion.block_causal(two_color.exact_denoiser, 1) is oracle  # one program


# ----------------------------------------------------------------------------
# Exact oracles: the block NELBO is tight for every block size, a uniform model is worse.
# ----------------------------------------------------------------------------


def _scan_uniform(params, tokens_BxL, t_B):
  del params, t_B
  return jnp.zeros(tokens_BxL.shape + (scan_and_add.VOCAB_SIZE,))


# (task module, denoiser, block size, batch). Batches are sized for seconds of CPU time; the
# tolerances come from each estimate's own standard error.
_TIGHTNESS_CASES = (
    [(two_color, two_color.exact_denoiser, b, 20_000) for b in (1, 2)]
    + [(two_color, two_color.uniform_denoiser, 1, 20_000)]
    + [(scan_and_add, scan_and_add.exact_denoiser, b, 1_000) for b in (1, 5, 25)]
    + [(scan_and_add, _scan_uniform, 5, 1_000)])


@functools.cache
def _block_nelbos(seed=0):
  """Per case: the mean block NELBO (nats per sequence) and its standard error. All cases
  in one compiled program (compiling is most of the cost)."""
  data = [task.sample_data(jax.random.key(seed), batch) for task, _, _, batch in _TIGHTNESS_CASES]

  def losses(key, data):
    return [diffusion.block_nelbo_loss(
        diffusion.block_causal(denoiser, block), None, key, x, block_size=block,
        schedule=diffusion.LinearSchedule(), mask_id=task.MASK_ID)[1]["nelbo_nats_B"]
            for (task, denoiser, block, _), x in zip(_TIGHTNESS_CASES, data)]

  out = {}
  for (task, denoiser, block, batch), nelbo_B in zip(
      _TIGHTNESS_CASES, jax.jit(losses)(jax.random.key(seed + 1), data)):
    nelbo_B = np.asarray(nelbo_B, np.float64)
    out[task, denoiser, block] = nelbo_B.mean(), nelbo_B.std() / np.sqrt(batch)
  return out


@pytest.mark.xdist_group("block_tightness")
@pytest.mark.parametrize("block", [1, 2])
@pytest.mark.slow
def test_two_color_block_elbo_is_tight(block):
  mean, se = _block_nelbos()[two_color, two_color.exact_denoiser, block]
  # 4 Monte Carlo standard errors of the batch mean around the entropy ln 2.
  assert abs(mean - two_color.ENTROPY_NATS) < 4 * se, (block, mean, se)


@pytest.mark.xdist_group("block_tightness")
@pytest.mark.parametrize("block", [1, 5, 25])
@pytest.mark.slow
def test_scan_and_add_block_elbo_is_tight(block):
  mean, se = _block_nelbos()[scan_and_add, scan_and_add.exact_denoiser, block]
  entropy_nats = scan_and_add.entropy_bits() * math.log(2)
  assert scan_and_add.entropy_bits() == pytest.approx(35.389, abs=1e-3)
  assert abs(mean - entropy_nats) < 4 * se, (block, mean / math.log(2), se / math.log(2))


@pytest.mark.xdist_group("block_tightness")
@pytest.mark.slow
def test_uniform_block_denoisers_are_strictly_worse():
  mean, se = _block_nelbos()[two_color, two_color.uniform_denoiser, 1]
  # Uniform: every masked token costs ln 2, so the block NELBO is 2 ln 2 in expectation.
  assert abs(mean - 2 * math.log(2)) < 4 * se
  assert mean - 4 * se > two_color.ENTROPY_NATS
  mean, se = _block_nelbos()[scan_and_add, _scan_uniform, 5]
  # Uniform over 14 ids: L ln 14 nats in expectation.
  assert abs(mean - scan_and_add.DEFAULT.length * math.log(14)) < 4 * se
  assert mean - 4 * se > scan_and_add.entropy_bits() * math.log(2)


def test_oracle_adapter_masks_later_blocks():
  """The adapter's block b sees blocks <= b of the canvas: two-color with blocks of 1,
  position 0 never sees position 1, position 1 copies position 0."""
  adapter = diffusion.block_causal(two_color.exact_denoiser, 1)
  tokens = jnp.array([[two_color.MASK_ID, two_color.RED], [two_color.BLUE, two_color.MASK_ID]])
  probs = jax.nn.softmax(adapter(None, tokens, jnp.zeros(2)), -1)
  np.testing.assert_allclose(probs[0, 0], [0.5, 0.5])  # the red at position 1 is later
  np.testing.assert_allclose(probs[1, 1], [0.0, 1.0])  # copies the earlier blue


# ----------------------------------------------------------------------------
# Training with a block size.
# ----------------------------------------------------------------------------


def test_train_config_selects_the_block_loss_and_refuses_bad_block_sizes(tmp_path):
  config = two_color_config.get_config()
  config.model.block_size = 1
  config.block_nelbo.t_min = 0.2
  task = tasks.from_config(config)
  train.check_config(config)
  _, _, apply_fn = models.init(train.model_config(config, task))
  loss_fn = train.make_loss_fn(config, apply_fn, task)
  assert loss_fn.func is diffusion.block_nelbo_loss
  assert loss_fn.keywords["block_size"] == 1 and loss_fn.keywords["t_min"] == 0.2
  bad = [("model.block_size", 3, "model.block_size=3 must be an integer >= 1 that divides"),
         ("model.block_size", 0, "model.block_size=0"),
         ("block_nelbo.t_max", 0.1, "block_nelbo.t_min=0.2"),
         ("objective", "mlm", "needs objective='nelbo'")]
  for path, value, needle in bad:
    config = two_color_config.get_config()
    config.model.block_size, config.block_nelbo.t_min = 1, 0.2
    node, name = (config, path) if "." not in path else (config[path.split(".")[0]],
                                                         path.split(".")[1])
    node[name] = value
    with pytest.raises(ValueError, match=needle):
      train.check_config(config)
      train.model_config(config, tasks.from_config(config))


@pytest.mark.slow
def test_trained_block_model_samples_past_its_length_from_the_cli(tmp_path, sample_cli):
  """train.py with block_size, then sample.py --blocks_of: the checkpoint's block-causal
  model generates 3 x its 16-position windows on the exact cache, from a text prefix of any
  length."""
  from experiments.tiny_text import tiny_config, write_corpus
  config = tiny_config(write_corpus(tmp_path / "corpus.txt"))
  config.model.block_size = 4
  config.sampler.update(family="confidence", steps=8, block_length=4)
  train.train(config, str(tmp_path / "run"), log=lambda *a: None)
  proc = sample_cli(f"--workdir={tmp_path / 'run'}", "--sampler=ancestral", "--steps=4",
                    "--blocks_of=4", "--length=48", "--prefix=Tho", "--num_samples=3",
                    f"--out={tmp_path / 'out'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "cached=True" in proc.stdout
  rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
  # A 3-character prefix on blocks of 4: its block is finished first (the cache stays exact).
  assert len(rows) == 3 and all(len(r["tokens"]) == 3 + 48 for r in rows)
  assert all(r["text"].startswith("Tho") and "·" not in r["text"] for r in rows)
  for flags, needle in ((["--blocks_of=4", "--length=10"], "length=10 is invalid"),
                        (["--blocks_of=4", "--context=2"], "window=2 is invalid"),
                        (["--length=20"], "--length does not apply without --blocks_of")):
    proc = sample_cli(f"--workdir={tmp_path / 'run'}", *flags, "--num_samples=2")
    assert proc.returncode == 1 and needle in proc.stderr, proc.stderr[-2000:]
