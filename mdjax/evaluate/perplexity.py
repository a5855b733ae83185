"""The NELBO and perplexity bound of a MDLM / BD3-LM checkpoint on a token file.

  python -m mdjax.evaluate.perplexity --pretrained=DIR --tokens=FILE [--batch_size=16]
      [--num_batches=N] [--seed=0] [--dtype=float32] [--clipped]

DIR: a folder `mdjax.io.load` reads (kuleshov-group/mdlm-owt,
kuleshov-group/bd3lm-owt-block_size4, ...). FILE: token ids of the evaluation text, a .npy
array or a raw .bin (uint16 unless --bin_dtype says otherwise: nanoGPT's OpenWebText val.bin),
cut into consecutive windows of the model's length (the tail that does not fill one is
dropped). Prints one JSON line: nelbo_nats_per_token, bits_per_token, perplexity_bound,
num_tokens, stderr (nats per token), and the settings used.

How each model's papers compute it (`perplexity` below):
  MDLM (kuleshov-group/mdlm `_loss`): t = eps + (1 - eps) u, antithetic over the batch,
    eps = 1e-3 (`training.sampling_eps`); a token is masked with probability
    1 - exp(-sigma(t)) = (1 - 1e-3) t, and its -log p weighted by sigma'(t) / expm1(sigma(t))
    = 1 / t; every token counted.
  BD3-LM (kuleshov-group/bd3lms `_loss` at validation): one t per block, antithetic over the
    batch's blocks, uniform on [1e-3, 1] (the range `_check_val_sampling_intvl` calls the
    ELBO); masked with probability t, weighted 1 / t; one pass over [x_t; x_0]; the first
    token of each window kept visible and not counted (`ignore_bos`). `--clipped` uses the
    checkpoint's `sampling_eps_min/max` instead (its training range: a biased estimate, not
    a bound, as the reference says).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from mdjax import cli, diffusion, jsonl
from mdjax.evaluate.elbo import windows_nelbo
from mdjax.models import dit

BIN_DTYPES = ("uint16", "uint32", "int32", "int64")
ELBO_RANGE = (1e-3, 1.0)


def read_tokens(tokens, *, bin_dtype: str = "uint16") -> np.ndarray:
  """Token ids as a 1-D array: an array as given, a .npy file, or a raw .bin of `bin_dtype`
  (memory-mapped: nothing is read before it is used)."""
  if not isinstance(tokens, (str, os.PathLike)):
    array = np.asarray(tokens)
  else:
    path = os.fspath(tokens)
    if not os.path.isfile(path):
      raise ValueError(f"tokens_file={path!r} is not a file.")
    if path.endswith(".npy"):
      array = np.load(path, mmap_mode="r")
    elif path.endswith(".bin"):
      if bin_dtype not in BIN_DTYPES:
        raise ValueError(f"bin_dtype={bin_dtype!r} must be one of {BIN_DTYPES}.")
      array = np.memmap(path, dtype=bin_dtype, mode="r")
    else:
      raise ValueError(f"tokens_file={path!r} must end in .npy or .bin (raw token ids).")
  if not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"tokens hold dtype {array.dtype}; token ids must be integers.")
  return array.reshape(-1)


def windows(tokens_T: np.ndarray, length: int) -> np.ndarray:
  """Consecutive windows of `length` tokens, N x L (the tail that does not fill one dropped)."""
  count = len(tokens_T) // length
  if count < 1:
    raise ValueError(f"the token file holds {len(tokens_T)} tokens: fewer than one window of "
                     f"the model's {length}.")
  return np.asarray(tokens_T[:count * length]).reshape(count, length)


def eps_range(model, clipped: bool) -> tuple[float, float]:
  """BD3-LM's time range: the ELBO's [1e-3, 1], or the checkpoint's clipped training range."""
  if not clipped:
    return ELBO_RANGE
  buffers = getattr(model, "buffers", None) or {}
  if "sampling_eps_min" not in buffers or "sampling_eps_max" not in buffers:
    raise ValueError("clipped=True needs the checkpoint's sampling_eps_min / sampling_eps_max "
                     "(a BD3-LM folder loaded by mdjax.io.load); this model has none.")
  return _scalar(buffers, "sampling_eps_min"), _scalar(buffers, "sampling_eps_max")


def _scalar(buffers: dict, name: str) -> float:
  """A buffer of one value as a float (the reference stores the eps bounds with shape (1,))."""
  value = np.asarray(buffers[name])
  if value.size != 1:
    raise ValueError(f"the checkpoint's {name} has shape {value.shape}; one value expected.")
  return float(value.reshape(()))


def perplexity(model, tokens_file, *, batch_size: int, key: jax.Array,
               num_batches: int | None = None, clipped: bool = False,
               bin_dtype: str = "uint16") -> dict:
  """NELBO per token, bits per token and the perplexity bound exp(NELBO) of a MDLM or BD3-LM
  `model` (`denoiser`, `params`, `config` a DiTConfig) on `tokens_file` (a path, or an array
  of ids), cut into windows of the model's length; each model's own estimator (module
  docstring). Batches are `elbo.windows_nelbo`'s: batch b draws from fold_in(key, b);
  `stderr` is over batches (NaN with one). Returns its dict plus `model`, `t_min`, `t_max`,
  `windows`."""
  config = getattr(model, "config", None)
  if not isinstance(config, dit.DiTConfig):
    raise ValueError(f"model.config={config!r} must be a mdjax.models.dit.DiTConfig (a MDLM "
                     "or BD3-LM checkpoint).")
  apply_fn = getattr(model, "denoiser", None) or dit.denoiser(config)
  tokens_T = read_tokens(tokens_file, bin_dtype=bin_dtype)
  x_NxL = windows(tokens_T, config.model_length)
  bad = x_NxL[(x_NxL < 0) | (x_NxL >= config.vocab_size)]
  if bad.size:
    raise ValueError(f"the token file holds id {int(bad[0])}; the model's ids are "
                     f"0..{config.vocab_size - 1}.")
  if config.block_size is None:
    if clipped:
      raise ValueError("clipped=True is BD3-LM's clipped schedule; this is a MDLM model.")
    t_min, t_max = ELBO_RANGE
    out = windows_nelbo(
        apply_fn, model.params, x_NxL, batch_size=batch_size, num_batches=num_batches, key=key,
        schedule=diffusion.LogLinearSchedule(eps=config.noise_eps), t_min=t_min)
  else:
    t_min, t_max = eps_range(model, clipped)
    out = windows_nelbo(
        apply_fn, model.params, x_NxL, batch_size=batch_size, num_batches=num_batches, key=key,
        schedule=diffusion.LinearSchedule(), t_min=t_min, t_max=t_max,
        block_size=config.block_size, first_maskable=False)
  return {**out, "model": config.family, "t_min": t_min, "t_max": t_max,
          "windows": int(len(x_NxL))}


def main(argv=None) -> dict:
  parser = cli.Parser(
      "perplexity", prog="python -m mdjax.evaluate.perplexity",
      description="NELBO (bits per token) and the perplexity bound of a MDLM / BD3-LM "
                  "checkpoint on a token file.")
  parser.add_argument("--pretrained", required=True, help="the checkpoint folder (or .ckpt)")
  parser.add_argument("--tokens", required=True, help="token ids: .npy, or a raw .bin")
  parser.add_argument("--batch_size", type=int, default=16, help="windows per batch (16: the "
                      "reference's eval batch)")
  parser.add_argument("--num_batches", type=int, default=None, help="default: every full batch")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--clipped", action="store_true",
                      help="BD3-LM: the checkpoint's clipped training range (not a bound)")
  parser.add_argument("--bin_dtype", choices=BIN_DTYPES, default="uint16")
  args = parser.parse_args(argv)
  from mdjax import io  # the loader, only for the command line
  model = io.load(args.pretrained, dtype=args.dtype)
  result = perplexity(model, args.tokens, batch_size=args.batch_size,
                      num_batches=args.num_batches, key=jax.random.key(args.seed),
                      clipped=args.clipped, bin_dtype=args.bin_dtype)
  result.update(pretrained=args.pretrained, tokens=args.tokens, dtype=args.dtype)
  # Strict JSON: a value that is not finite (stderr of one batch) prints as null.
  print(jsonl.dumps(result))
  return result


if __name__ == "__main__":
  cli.run("perplexity", main)  # ValueError: a bad folder, token file or setting
