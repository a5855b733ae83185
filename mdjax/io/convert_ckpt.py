"""Converts a torch / Lightning checkpoint of MDLM or BD3-LM into a Hugging Face folder.

  python -m mdjax.io.convert_ckpt IN.ckpt OUT_DIR --config=CONFIG.json [--raw]
      [--dtype=float32|bfloat16]

Needs the `[reference]` extra (torch). The file is read with torch's own restricted loader,
`torch.load(path, weights_only=True)`; a Lightning checkpoint whose metadata torch refuses
(the reference code saves its OmegaConf config and tokenizer in `hyper_parameters`) is read
with mdjax's restricted reader instead (`mdjax.io.lightning`: metadata objects
become inert placeholders, code is never run). The weights (the EMA's unless --raw) are
checked against CONFIG.json by `mdjax.io.load` and written by `mdjax.io.save`
in the published layout (config.json, model.safetensors with `backbone.*` names).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import tempfile

import numpy as np

from mdjax import cli
from mdjax.io import lightning
from mdjax.io import tensors as tensors_lib
from mdjax.io.folder import CONFIG_FILE, load, read_config_json, save

# What the converted folder keeps of a state dict: the network and the reference's buffers.
_KEEP_PREFIX = "backbone."
_KEEP_NAMES = ("sampling_eps_min", "sampling_eps_max")


def _torch_weights(path: str, ema: bool) -> dict[str, np.ndarray] | None:
  """{name: array} read by torch.load(weights_only=True); None if torch refuses the file's
  metadata."""
  try:
    import torch
  except ImportError as e:
    raise ValueError("--reader=torch needs torch: pip install 'mdjax[reference]' (or pass "
                     "--reader=mdjax)") from e
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"torch.load(weights_only=True) refused {path} ({first}); reading it with "
          "mdjax.io.lightning (metadata objects skipped, never run)", file=sys.stderr)
    return None
  weights = lightning.select_weights(obj, path, ema=ema,
                                     is_tensor=lambda v: isinstance(v, torch.Tensor))

  def host(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: through its bits
      import ml_dtypes
      return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
  return {n: host(t) for n, t in weights.items()}


def convert(path: str, out_dir: str, config, *, ema: bool = True, dtype: str | None = None,
            reader: str = "torch") -> list[str]:
  """Writes the HF folder of a checkpoint; returns the files written."""
  weights = _torch_weights(path, ema) if reader == "torch" else None
  if weights is None:
    weights = {n: np.array(t.read()) for n, t in
               lightning.state_tensors(lightning.read_ckpt(path), path, ema=ema).items()}
  kept = {n: v for n, v in weights.items() if n.startswith(_KEEP_PREFIX) or n in _KEEP_NAMES}
  raw = read_config_json(config, os.path.dirname(os.path.abspath(path)), path)
  with tempfile.TemporaryDirectory() as tmp:
    tensors_lib.write_checkpoint(tmp, kept, metadata={"format": "pt"})
    tensors_lib.write_json(os.path.join(tmp, CONFIG_FILE), raw)
    model = load(tmp, dtype=dtype)
    # No source folder: nothing beside the temporary weights is to be copied.
    return save(dataclasses.replace(model, source=None), out_dir)


def main(argv=None):
  parser = cli.Parser("convert_ckpt", prog="python -m mdjax.io.convert_ckpt",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("ckpt", help="the .ckpt / .pt file")
  parser.add_argument("out_dir", help="the Hugging Face folder to write")
  parser.add_argument("--config", required=True,
                      help="config.json of the architecture (MDLM or BD3-LM keys)")
  parser.add_argument("--raw", action="store_true",
                      help="the raw state_dict, not the EMA weights")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
  parser.add_argument("--reader", choices=("torch", "mdjax"), default="torch",
                      help="torch.load(weights_only=True), or mdjax's restricted reader")
  args = parser.parse_args(argv)
  try:
    written = convert(args.ckpt, args.out_dir, args.config, ema=not args.raw, dtype=args.dtype,
                      reader=args.reader)
  except ValueError as error:
    cli.fail("convert_ckpt", error, cli.USAGE)
  except OSError as error:
    cli.fail("convert_ckpt", error, cli.RUNTIME)
  for path in written:
    print(path)


if __name__ == "__main__":
  main()
