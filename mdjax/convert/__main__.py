"""python -m mdjax.convert --input=AR_DIR --to=masked|block [--block_size=N] [--mask_id=ID]
[--no_shift] [--layout=dream|llada|sdar|fast_dllm_v2] --out=DIR

Writes the diffusion folder of a causal Llama / Qwen2 / Qwen3 folder (`mdjax.convert.a2d`).
Bad input is one line on stderr, `mdjax.convert: error: ...` naming the field, exit status 2
(1 for a failed read or write), and no output folder.
"""

from __future__ import annotations

import sys

from mdjax import cli
from mdjax.convert import a2d

NAME = "mdjax.convert"


def main(argv=None) -> int:
  parser = cli.Parser(NAME, prog="python -m mdjax.convert", description=__doc__.split(
      "\n\n")[1])
  parser.add_argument("--input", required=True, help="the causal folder (config.json, "
                      "safetensors, tokenizer.json)")
  parser.add_argument("--to", required=True, choices=a2d.TARGETS)
  parser.add_argument("--block_size", type=int, default=None,
                      help="the blocks of to=block (default: the layout's, 32 or 4)")
  parser.add_argument("--mask_id", type=int, default=None,
                      help="reuse this id as the mask (default: append a new id)")
  parser.add_argument("--no_shift", action="store_true",
                      help="drop the one-position shift (LLaDA / SDAR layouts)")
  parser.add_argument("--layout", default=None, choices=a2d.LAYOUTS,
                      help="the family written (default: by --to, the shift and the input)")
  parser.add_argument("--out", required=True, help="the new folder")
  args = parser.parse_args(argv)
  try:
    a2d.convert(args.input, args.out, to=args.to, block_size=args.block_size,
                mask_id=args.mask_id, keep_shift=not args.no_shift, layout=args.layout,
                log=lambda message: print(message, file=sys.stderr))
  except ValueError as error:
    return cli.report(NAME, error, cli.USAGE)
  except OSError as error:
    return cli.report(NAME, error, cli.RUNTIME)
  return 0


if __name__ == "__main__":
  sys.exit(main())
