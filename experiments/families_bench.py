"""SDAR, Fast-dLLM v2 and LLaDA2 side by side: `python experiments/families_bench.py` runs
`python -m mdjax.bench.families` (its docstring says what it measures) and writes
results/families.json."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mdjax.bench import families

if __name__ == "__main__":
  families.main()
