"""LoRA (mdjax.lora): zero-B adapters are the base model bit for bit (the published LLaDA
fixture and mdjax's Transformer), merged weights are the adapted model, the optimizer keeps
state for the adapters only, bad input is refused, a LoRA run checkpoints and loads, and
lr_scales of 0 freeze."""

import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

import mdjax
from mdjax import lora, models, train
from mdjax.train import state as train_state
from tests.paths import REPO
from experiments.tiny_text import tiny_config, write_corpus

LLADA = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")
ALL = ("attention", "mlp")


@pytest.fixture(scope="module")
def llada():
  return mdjax.load(LLADA)


def _transformer(mlp="swiglu", d_model=16):
  cfg = models.TransformerConfig(vocab_size=12, max_len=8, d_model=d_model, num_layers=2,
                                 num_heads=2, d_ff=24, mlp=mlp)
  _, params, apply_fn = models.init(cfg, seed=0)
  return nnx.to_pure_dict(params), apply_fn


def _tokens(vocab, batch=2, length=8, seed=0):
  # ids below vocab; some masked (the mask id is vocab for mdjax, the model's own for LLaDA)
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


def _adapted(params, apply_fn, targets=ALL, rank=4):
  config = lora.LoraConfig(rank=rank, alpha=8.0, targets=targets)
  return (config, {"base": params, "lora": lora.init(params, config, jax.random.key(1))},
          lora.adapt(apply_fn, config))


@functools.lru_cache(maxsize=None)
def _jit(denoiser):
  """A denoiser's plain pass compiled, once per denoiser (equal adapted denoisers are equal
  values: the tests share programs)."""
  return jax.jit(lambda params, x_BxL, t_B: denoiser(params, x_BxL, t_B))


def _size(logits):
  """The largest finite |logit| (the published models' mask logit is -inf)."""
  logits = np.asarray(logits)
  return float(np.abs(logits[np.isfinite(logits)]).max())


def _apart(a, b):
  """The largest difference of two logit arrays where they are finite."""
  a, b = np.asarray(a), np.asarray(b)
  finite = np.isfinite(a) & np.isfinite(b)
  return float(np.abs(a[finite] - b[finite]).max())


def _trained(config, params, apply_fn, x_BxL, steps=3):
  """A few Adam steps of the adapters on a cross-entropy (B leaves zero)."""
  optimizer = lora.optimizer(optax.adam(3e-2))
  opt_state = optimizer.init(params)
  t_B = jnp.full((x_BxL.shape[0],), 0.5)

  def loss(p):
    logits = apply_fn(p, x_BxL, t_B)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), x_BxL[..., None] % logits.shape[-1],
                                -1).mean()

  @jax.jit
  def step(p, s):
    grads = jax.grad(loss)(p)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, grads

  for _ in range(steps):
    params, opt_state, grads = step(params, opt_state)
  return params, opt_state, grads


# ----------------------------------------------------------------------------
# Exactness.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_zero_b_is_the_base_model_bit_for_bit(llada):
  x_BxL, t_B = _tokens(llada.vocab_size), jnp.full((2,), 0.5)
  _, params, adapted = _adapted(llada.params, llada.denoiser)
  # Published layout: every q, k, v, o, gate, up, down of the stacked layers, [N, in, r].
  assert params["lora"]["layers"]["q"]["q"]["a"].shape == (2, 64, 4)
  assert params["lora"]["layers"]["down"]["down"]["b"].shape == (2, 4, 64)
  assert adapted.offers_cache  # prefill and decode are adapted too
  np.testing.assert_array_equal(_jit(adapted)(params, x_BxL, t_B),
                                _jit(llada.denoiser)(llada.params, x_BxL, t_B))
  # mdjax's Transformer: the fused qkv in thirds, SwiGLU's [gate | up] in halves (GELU: up).
  gelu, _ = _transformer("gelu")
  adapters = lora.init(gelu, lora.LoraConfig(rank=4, alpha=8.0, targets=ALL), jax.random.key(1))
  assert set(adapters["blocks"][1]["mlp_in"]["kernel"]) == {"up"}
  base, apply_fn = _transformer()
  _, params, adapted = _adapted(base, apply_fn)
  kernel = params["lora"]["blocks"][0]["qkv"]["kernel"]
  assert set(kernel) == {"q", "k", "v"} and kernel["k"]["b"].shape == (4, 16)
  assert set(params["lora"]["blocks"][1]["mlp_in"]["kernel"]) == {"gate", "up"}
  x_BxL = _tokens(12)
  np.testing.assert_array_equal(_jit(adapted)(params, x_BxL, t_B),
                                _jit(apply_fn)(base, x_BxL, t_B))


@pytest.mark.slow
def test_merge_is_the_adapted_model_and_the_base_stays_frozen(llada):
  t_B = jnp.full((2,), 0.5)
  base, apply_fn = _transformer()
  config, params, adapted = _adapted(base, apply_fn)
  x_BxL = _tokens(12)
  trained, _, grads = _trained(config, params, adapted, x_BxL)
  # The base gets no gradient and no update; the adapters moved (B is no longer zero).
  assert all(not np.any(g) for g in jax.tree.leaves(grads["base"]))
  jax.tree.map(np.testing.assert_array_equal, trained["base"], base)
  assert all(np.any(b) for b in jax.tree.leaves(trained["lora"]))
  # The published fixture: adapters as after training, B drawn (the programs of the test
  # above, compiled once).
  config_l, params_l, adapted_l = _adapted(llada.params, llada.denoiser)
  params_l["lora"] = jax.tree.map(
      lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), params_l["lora"])
  cases = ((config, trained, adapted, apply_fn, base, x_BxL),
           (config_l, params_l, adapted_l, llada.denoiser, llada.params,
            _tokens(llada.vocab_size)))
  for config, trained, adapted, apply_fn, base, x_BxL in cases:
    want = _jit(adapted)(trained, x_BxL, t_B)
    assert _apart(want, _jit(apply_fn)(base, x_BxL, t_B)) > 1e-3
    merged = lora.merge(trained, config)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    got = _jit(apply_fn)(merged, x_BxL, t_B)
    # The same W + scale * A @ B in float32 on both sides, inside one program on one and
    # eagerly on the other: only the order of float32 operations may differ, a few ulps
    # (2^-23 relative) of each logit after two layers; 1e-5 of the logits' size is ~100 ulps.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * _size(want))
    again = lora.merged(_lora_cfg(config), trained)  # what the SFT export and RL call
    jax.tree.map(np.testing.assert_array_equal, again, merged)
    assert lora.merged(_lora_cfg(None), base) is base
    assert lora.merged(_lora_cfg(config), merged) is merged  # plain already: as it is


def _lora_cfg(config):
  """A training config with `train.lora` as `config` (None: off)."""
  from configs.base import base_config
  c = base_config()
  if config is not None:
    c.train.lora.update(rank=config.rank, alpha=config.alpha, targets=config.targets)
  return c


# ----------------------------------------------------------------------------
# Optimizer state.
# ----------------------------------------------------------------------------


def test_optimizer_state_holds_only_the_adapters(llada):
  config, params, _ = _adapted(llada.params, llada.denoiser, targets=("q", "v"), rank=2)
  adam = optax.adam(1e-3)
  state = lora.optimizer(adam).init(params)
  arrays = [x for x in jax.tree.leaves(state) if np.ndim(x) > 0]
  adapters = jax.tree.leaves(params["lora"])
  # Adam's two moments of each adapter matrix, nothing of the base (only its step count).
  assert len(arrays) == 2 * len(adapters) == 2 * 2 * 2
  assert lora.count_bytes(arrays) == 2 * lora.count_bytes(params["lora"])
  full = adam.init(llada.params)
  assert lora.count_bytes(full) - lora.count_bytes(state) == (
      2 * lora.count_bytes(llada.params) - 2 * lora.count_bytes(params["lora"]))
  # 2 layers x (q: 64 x 2 + 2 x 64, v alike) float32 x 2 moments.
  assert lora.count_bytes(arrays) == 2 * 2 * 2 * (64 * 2 + 2 * 64) * 4


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


def test_bad_targets_ranks_and_dropout_are_refused(llada):
  base, _ = _transformer("gelu")
  with pytest.raises(ValueError, match=r"'gate' matches no matrix of these params; their "
                     r"matrices: q: blocks/\*/qkv/kernel\[\.\.\., 0:16\], k: .*, o: "
                     r"blocks/\*/proj/kernel, up: blocks/\*/mlp_in/kernel, down: "
                     r"blocks/\*/mlp_out/kernel\."):
    lora.init(base, lora.LoraConfig(rank=2, alpha=1.0, targets=("q", "gate")), jax.random.key(0))
  for field, bad in (("rank", 0), ("rank", -1), ("rank", 1.5), ("alpha", 0.0),
                     ("alpha", float("nan")), ("targets", ()), ("targets", ("qkv",)),
                     ("targets", ("q", "q"))):
    kwargs = {**dict(rank=2, alpha=1.0, targets=("q",)), field: bad}
    with pytest.raises(ValueError, match=f"{field}="):
      lora.LoraConfig(**kwargs)
  with pytest.raises(ValueError, match=r"dropout=0.1: only 0 is allowed. The adapters are "
                     "merged"):
    lora.LoraConfig(rank=2, alpha=1.0, targets=("q",), dropout=0.1)
  # A config saved before train.lora existed (an older workdir) trains no LoRA.
  assert lora.config_of(ml_collections.ConfigDict({"train": {"lr": 1e-3}})) is None
  config = _lora_cfg(None)
  for field, value, message in (
      ("rank", -1, r"train.lora.rank=-1: must be an integer >= 0"),
      ("dropout", 0.1, r"train.lora.dropout=0.1: must be a finite number equal to 0"),
      ("targets", ("q", "wq"), r"train.lora.targets=\('q', 'wq'\): must be a non-empty")):
    bad = _lora_cfg(None)
    bad.train.lora[field] = value
    with pytest.raises(train.ConfigError, match=message):
      train.check_config(bad)
  config.train.lr_scales = {"attn": 0.0}
  with pytest.raises(train.ConfigError, match=r"train.lr_scales.attn=0.0: unknown name"):
    train.check_config(config)
  with pytest.raises(ValueError, match=r"lr_scales: name 'attn' is unknown"):
    lora.lr_scaled(optax.sgd(1.0), {"attn": 0.0})
  with pytest.raises(ValueError, match=r"params: an adapted model's are \{'base', 'lora'\}"):
    lora.merge(llada.params, lora.LoraConfig(rank=2, alpha=1.0, targets=("q",)))


# ----------------------------------------------------------------------------
# Through the train loop.
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_lora_run_checkpoints_and_loads_as_the_adapted_model(tmp_path):
  config = tiny_config(write_corpus(tmp_path / "corpus.txt"))
  # Two micro-batches a step: the adapters' gradients accumulated (the base's never formed).
  config.train.update(num_steps=2, warmup_steps=0, lr=1e-2, grad_accum_steps=2)
  config.train.lora.update(rank=4, targets=ALL)
  config.update(num_eval_samples=0, log_every=1)
  config.checkpoint.every = 2
  workdir = str(tmp_path / "run")
  state = train.train(config, workdir, log=lambda *_: None)
  # Adam's moments: adapters only (a [D, r] and [r, out] pair per target).
  moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  assert lora.count_bytes(moments) == 2 * lora.count_bytes(state.params["lora"])
  model = mdjax.load(workdir)
  lora_config = lora.config_of(model.config)
  assert lora_config == lora.LoraConfig(rank=4, alpha=16.0, targets=ALL)
  # The loaded model is the adapters merged into the (untrained) base: plain params.
  assert jax.tree.structure(model.params) == jax.tree.structure(state.params["base"])
  np.testing.assert_array_equal(model.params["embed"]["embedding"],
                                state.params["base"]["embed"]["embedding"])
  x_BxL = train.batch_for_step(config, 0, model.task)[:4]
  t_B = jnp.full((4,), 0.5)
  want = _jit(lora.adapt(model.denoiser, lora_config))(state.params, x_BxL, t_B)
  base = _jit(model.denoiser)
  assert _apart(want, base(state.params["base"], x_BxL, t_B)) > 1e-4
  # As in the merge test: one float32 computation in two orders.
  np.testing.assert_allclose(base(model.params, x_BxL, t_B), want, rtol=0,
                             atol=1e-5 * _size(want))
  # Resuming under another LoRA, or with other leaves frozen, is refused before anything is
  # restored (the checkpoint is not taken for a corrupt one).
  config.train.num_steps = 3
  for field, value, message in (("lora.alpha", 8.0, r"'train.lora': \(LoraConfig\(rank=4, "
                                 r"alpha=16.0"),
                                ("lr_scales", {"mlp": 0.0}, r"'train.lr_scales': \('\{\} "
                                 r"\(frozen: None\)'")):
    changed = ml_collections.ConfigDict(config.to_dict())
    node, name = (changed.train.lora, "alpha") if field == "lora.alpha" else (changed.train,
                                                                               "lr_scales")
    node[name] = value
    with pytest.raises(train.CheckpointMismatch, match=message):
      train.train(changed, workdir, log=lambda *_: None)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]


@pytest.mark.slow
def test_lr_scale_zero_freezes_those_leaves_bit_for_bit():
  base, apply_fn = _transformer()
  config = _lora_cfg(None).train
  config.update(lr=1e-2, warmup_steps=0, num_steps=10)
  config.lr_scales = {"q": 0.0, "mlp": 0.0, "embed": 0.5}
  optimizer = train_state.make_optimizer(config)
  opt_state = optimizer.init(base)
  x_BxL, t_B = _tokens(12), jnp.full((2,), 0.5)

  @jax.jit
  def step(params, opt_state):
    grads = jax.grad(lambda p: (apply_fn(p, x_BxL, t_B) ** 2).mean())(params)
    updates, _ = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), grads

  after, grads = step(base, opt_state)
  for n in range(2):
    block, old = after["blocks"][n], base["blocks"][n]
    for name in ("mlp_in", "mlp_out"):  # the MLP group frozen
      np.testing.assert_array_equal(block[name]["kernel"], old[name]["kernel"])
    # q's columns of the fused qkv frozen, k's and v's trained.
    np.testing.assert_array_equal(block["qkv"]["kernel"][:, :16], old["qkv"]["kernel"][:, :16])
    assert np.all(block["qkv"]["kernel"][:, 16:] != old["qkv"]["kernel"][:, 16:])
    assert np.all(block["proj"]["kernel"] != old["proj"]["kernel"])
  # Adam's first step moves each trained entry by lr (times its scale): 1e-2, embed's 5e-3.
  step = np.abs(after["embed"]["embedding"] - base["embed"]["embedding"])
  # Adam's first update is lr * g / (|g| + 1e-8): lr to 1e-3 where |g| > 1e-5.
  moved = np.abs(np.asarray(grads["embed"]["embedding"])) > 1e-5
  assert moved.sum() > 16
  np.testing.assert_allclose(step[moved], 5e-3, rtol=1e-3)
  # Frozen leaves keep no optimizer state: Adam's moments of every other leaf.
  moments = [x for x in jax.tree.leaves(opt_state) if np.ndim(x) > 0]
  frozen = sum(lora.count_bytes(base["blocks"][n][name]) for n in range(2)
               for name in ("mlp_in", "mlp_out"))
  assert lora.count_bytes(moments) == 2 * (lora.count_bytes(base) - frozen)
  # Every scale 1 is one rate: the optimizer of a run without scales (its state resumes).
  config.lr_scales = {"attention": 1.0, "mlp": 1.0, "embed": 1.0, "head": 1.0, "norm": 1.0}
  plain = _lora_cfg(None).train
  assert (jax.tree.structure(train_state.make_optimizer(config).init(base))
          == jax.tree.structure(train_state.make_optimizer(plain).init(base)))


def test_every_pass_survives_the_parameter_wrappers():
  """LoRA's merge and a mesh's gather wrap every pass a denoiser offers (through
  `Denoiser.map_passes`), DiffusionGemma's self-conditioning input included; the wrapped
  encode_condition reads the merged weights."""
  from mdjax import mesh as mesh_lib
  from mdjax.denoiser import Denoiser
  apply = lambda params, tokens, t: tokens
  encode = lambda params, shaped: shaped @ params["q"]
  base = Denoiser(apply, block_size=4, encode_condition=encode, max_len=8)
  config = lora.LoraConfig(rank=1, alpha=1.0, targets=("q",))
  adapted = lora.adapt(base, config)
  assert adapted.block_size == 4 and adapted.max_len == 8
  assert adapted.encode_condition.fn is encode and adapted.prefill is None
  assert lora.unadapted(adapted) == base
  w = jnp.arange(6.0).reshape(2, 3)
  adapters = jax.tree.map(jnp.ones_like, lora.init({"q": w}, config, jax.random.key(0)))
  params, shaped = {"base": {"q": w}, "lora": adapters}, jnp.ones((1, 2))
  merged = lora.merge(params, config)["q"]
  assert not np.allclose(merged, w)  # the adapter moves the weights encode_condition reads
  np.testing.assert_allclose(adapted.encode_condition(params, shaped), shaped @ merged)
  gathered = mesh_lib.gathered(base, mesh_lib.make_mesh(1))
  assert gathered.encode_condition is not None and gathered.block_size == 4
  np.testing.assert_allclose(gathered.encode_condition({"q": w}, shaped), shaped @ w)
