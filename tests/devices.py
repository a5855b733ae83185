"""Code run in a fresh Python process that sees several simulated CPU devices (XLA reads the
device count once, at start-up, so the test process itself cannot change it)."""

import os
import subprocess
import sys

from tests.paths import REPO


def cpu_devices_env(count: int) -> dict:
  """The environment of a process with `count` simulated CPU devices."""
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
  ).strip())


def run_on_cpu_devices(code: str, count: int, done: str) -> None:
  """Runs `code` in a process with `count` CPU devices; it must print `done` when its checks
  pass (stderr is shown otherwise)."""
  proc = subprocess.run([sys.executable, "-c", code], env=cpu_devices_env(count),
                        capture_output=True, text=True, timeout=300, cwd=REPO)
  assert done in proc.stdout, proc.stderr[-3000:]
