"""Fixtures shared by test modules; how the test run compiles (a shared cache, LLVM -O0,
XLA:CPU's elemental emitters)."""

import dataclasses
import importlib.metadata
import os
import shutil
import tempfile
import types

# Many tests compile the same programs: train steps of one config in several tests, the
# sampler programs of sample.py and of the train loop, programs that experiments lower
# and compile themselves. A persistent compilation cache, empty at the start of every run,
# compiles each once per run. It is set before jax is imported (the first compile decides
# whether the cache is used) and reaches pytest-xdist workers and the subprocesses of
# tests through the environment. A cache the caller configured is left alone.
_CACHE_ENV = "MDJAX_TEST_XLA_CACHE"
_OWNED_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  if _CACHE_ENV not in os.environ:  # the first process of the run: the cache is its own
    _OWNED_CACHE = tempfile.mkdtemp(prefix="mdjax-xla-cache-")
    os.environ[_CACHE_ENV] = _OWNED_CACHE
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_ENV]
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(
    "JAX_COMPILATION_CACHE_DIR") == os.environ.get(_CACHE_ENV):
  # One cache per xdist worker (and the subprocesses its tests start): two workers reading
  # and writing one entry at once can hand a reader a partly written executable, which
  # aborts the worker. Tests that share programs share a worker (`--dist loadgroup`).
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ[_CACHE_ENV],
                                                         os.environ["PYTEST_XDIST_WORKER"])
  os.makedirs(os.environ["JAX_COMPILATION_CACHE_DIR"], exist_ok=True)
  # Programs that compile in under 0.1 s cost more to store than to compile again.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# The suite is compile-bound: a sampler program runs in milliseconds and compiles in
# seconds. LLVM at -O1 compiles the CPU programs about 2.5x faster than the default, and -O0
# 1.6x faster again (the golden and left-padding tests side by side: 84 s at -O1, 52 s at
# -O0); the recorded samples (tests/sampling/golden.npz) come out bit for bit the same at
# either level. A level the caller sets wins.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()
# XLA:CPU's fusion emitters (MLIR, the default) compile the suite's small programs 2 to 3x
# slower than its older elemental emitters: the scan_and_add oracle's ancestral program in
# 0.7 s of CPU against 2.4 s, four tiny-Transformer sampler programs in 3.4 s against 7.9 s;
# the recorded samples (tests/sampling/golden.npz) come out bit for bit the same. XLA
# aborts on a flag it does not know, so it is set only for the jaxlib it was measured with.
if ("--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")
    and importlib.metadata.version("jaxlib").startswith("0.10.")):
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# XLA:CPU splits a program's LLVM module into parts compiled on parallel threads: quicker
# on idle cores, more CPU in all. The suite keeps every core busy (`-n 2` on two cores), so
# one part compiles it in less CPU time: the golden and parity tests in 35.7 s of CPU
# against 42.1 s, the contract's fill test in 27.0 and 31.6 s against 35.2 s; the recorded
# samples come out bit for bit the same.
if ("--xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]
    and importlib.metadata.version("jaxlib").startswith("0.10.")):
  os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR"))
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))

from mdjax import train  # noqa: E402
from experiments.tiny_text import tiny_config, write_corpus  # noqa: E402


def pytest_unconfigure(config):
  if _OWNED_CACHE is not None:
    shutil.rmtree(_OWNED_CACHE, ignore_errors=True)


def pytest_itemcollected(item):
  """Tests of the `trained` models (and of `id_workdir`) share one pytest-xdist worker, which
  trains them once; they are `slow` (the training takes ~20 s of a loaded worker: the fast
  subset leaves it out). Marked as each test is collected, before `-m` selects."""
  for fixture in ("trained", "id_workdir"):
    if fixture in getattr(item, "fixturenames", ()):
      item.add_marker(pytest.mark.xdist_group(fixture))
      item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own pass
def pytest_collection_modifyitems(config, items):
  """With --dist loadgroup, pytest-xdist (3.8) sends the tests of one `xdist_group` to one
  worker by the "@group" suffix it writes to `item._nodeid`; pytest 9 keeps node ids in
  `item._id` and ignores that attribute, so the suffix is written here where it is missing.
  """
  if not getattr(config.option, "loadgroup", False):
    return
  for item in items:
    names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")}
    suffix = "@" + "_".join(sorted(names))
    if not names or item.nodeid.endswith(suffix):
      continue
    node_id = getattr(item, "_id", None)
    if node_id is None:  # pytest < 9
      item._nodeid = item.nodeid + suffix
    else:  # the suffix after the parameters, in whichever form the id is printed
      last = node_id.names[-1] + ("" if node_id.params is None else f"[{node_id.params}]")
      item._id = dataclasses.replace(node_id, names=(*node_id.names[:-1], last + suffix),
                                     params=None)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """A tiny corpus file, and a denoiser and a causal reference trained on it in seconds."""
  root = tmp_path_factory.mktemp("text")
  corpus = write_corpus(root / "corpus.txt")
  for name, causal in (("char", False), ("causal", True)):
    train.train(tiny_config(corpus, causal), str(root / name), log=lambda *a: None)
  return root, corpus


@pytest.fixture(scope="session")
def id_workdir(tmp_path_factory):
  """A train.py workdir that speaks token ids only, as the quickstart's: configs/
  scan_and_add_cpu.py (25 positions, no text codec, no chat template) cut to 4 steps."""
  from configs import scan_and_add_cpu
  config = scan_and_add_cpu.get_config()
  config.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  config.batch_size, config.eval_batches, config.num_eval_samples = 8, 1, 0
  config.train.update(num_steps=4, warmup_steps=1)
  config.checkpoint.update(every=4)
  config.eval_every = 0
  workdir = tmp_path_factory.mktemp("ids") / "scan_and_add"
  train.train(config, str(workdir), log=lambda *a: None)
  return workdir


@pytest.fixture
def sample_cli(capsys):
  """Runs sample.py in this process: sample_cli(*flags) -> (returncode, stdout, stderr).

  The same main() and flags as the command line, without starting Python and jax again;
  a usage error gives returncode 1 and its message on stderr, as absl's app.run does.
  """
  from absl import app, flags

  import sample

  def run(*args):
    capsys.readouterr()
    flags.FLAGS.unparse_flags()  # every flag back to its default
    returncode, message = 0, ""
    try:
      flags.FLAGS(["sample.py", *args])
      sample.main([])
    except (app.UsageError, flags.Error) as error:
      returncode, message = 1, str(error)
    out, err = capsys.readouterr()
    return types.SimpleNamespace(returncode=returncode, stdout=out, stderr=err + message)

  return run


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops each module's compiled programs when it ends. Every CPU executable keeps memory
  mappings of its own; a worker holding those of hundreds of tests can reach the kernel's
  vm.max_map_count (65,530), and then XLA aborts the process mid-compile. Programs used
  again reload from the run's persistent cache."""
  yield
  jax.clear_caches()
