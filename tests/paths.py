"""Where the repository is, for tests at any depth of tests/ (scripts, configs, sample.py)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
