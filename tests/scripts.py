"""Research scripts of experiments/, loaded from their files for the tests that run them small.

A research script is no library module: tests reach it by its path, as a command line would,
never as a package module. Each load is a fresh module, so a test's
monkeypatching stays with it.
"""

import importlib.util
import os

from tests.paths import REPO


def load_script(name: str):
  """experiments/<name>.py as a fresh module named `script_<name>`."""
  path = os.path.join(REPO, "experiments", f"{name}.py")
  if not os.path.isfile(path):
    raise ValueError(f"name={name!r}: no research script {path}")
  spec = importlib.util.spec_from_file_location(f"script_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
