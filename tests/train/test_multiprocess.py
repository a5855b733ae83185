"""Training as several processes: 2 processes x 2 devices against 1 process x 4 devices,
the 2-process workdir resumed by 1 process, the coordinator that cannot be reached."""

import functools
import json
import os
import shutil
import subprocess
import sys
import time
import types

import jax
import numpy as np
import portpicker
import pytest

from mdjax import train
from mdjax.train import distributed
from tests.paths import REPO

pytestmark = pytest.mark.slow

# A tiny job: 4 steps of 8 rows, a checkpoint every 2 steps, an evaluation with samples at
# the end (evaluation and sampling run in every process).
_FLAGS = ("--config=configs/two_color.py", "--config.train.num_steps=4",
          "--config.train.warmup_steps=2", "--config.checkpoint.every=2", "--config.log_every=1",
          "--config.batch_size=8", "--config.eval_batches=1", "--config.num_eval_samples=8")


def _train_py(workdir, devices: int, *flags, env=None) -> subprocess.Popen:
  # jax_num_cpu_devices rather than an XLA flag: the XLA flags are part of the compilation
  # cache's keys (see test_four_simulated_devices_match_one). Every program goes to the
  # run's cache, so the 1-process resume compiles nothing the 1-process run compiled.
  env = dict(os.environ, PYTHONPATH=REPO, JAX_NUM_CPU_DEVICES=str(devices),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **(env or {}))
  return subprocess.Popen([sys.executable, "train.py", *_FLAGS, f"--workdir={workdir}",
                           *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _finish(*procs) -> list[str]:
  outputs = [proc.communicate(timeout=240)[0] for proc in procs]
  for proc, out in zip(procs, outputs):
    assert proc.returncode == 0, out[-3000:]
  return outputs


def _rows(workdir) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in _rows(workdir) if "loss" in r}


@functools.cache
def _params(workdir, step):
  return jax.tree.leaves(train.load(str(workdir), step=step, log=lambda *a: None).params)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The job as 1 process x 4 devices and as 2 processes x 2 devices (process 0 told by
  flags, process 1 by JAX's environment variables), all started at once; then the
  2-process workdir without its last checkpoint, resumed by 1 process x 4 devices."""
  root = tmp_path_factory.mktemp("multiprocess")
  single, pair, resumed = root / "single", root / "pair", root / "resumed"
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  # The two processes compile the same programs at once: one could read the cache entry the
  # other is writing, so they keep out of the cache.
  no_cache = dict(JAX_ENABLE_COMPILATION_CACHE="false")
  procs = (
      _train_py(single, 4),
      _train_py(pair, 2, f"--coordinator={address}", "--num_processes=2", "--process_id=0",
                env=no_cache),
      _train_py(pair, 2, env=dict(no_cache, JAX_COORDINATOR_ADDRESS=address,
                                  JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")))
  outputs = _finish(*procs)
  shutil.copytree(pair, resumed)
  shutil.rmtree(resumed / "checkpoints" / "4")
  resumed_output, = _finish(_train_py(resumed, 4))
  return types.SimpleNamespace(single=single, pair=pair, resumed=resumed,
                               outputs=outputs, resumed_output=resumed_output)


# Tolerance of the comparisons: the same global batch, noise and program on 4 devices, but
# the gradients' cross-device sums are reduced in another order (XLA's in-process
# all-reduce against gloo's between processes). float32 rounds each sum to 2^-24 ~ 6e-8
# relative; through 4 Adam steps (lr <= 3e-3, updates bounded by the lr) the losses and
# parameters move apart by a few 1e-7 relative. rtol 1e-5 leaves two orders of margin and
# still catches any real difference (another row split or noise changes the loss by 1e-2).
_RTOL, _ATOL = 1e-5, 1e-7


def test_two_processes_train_as_one(runs):
  single, pair = _losses(runs.single), _losses(runs.pair)
  assert sorted(single) == sorted(pair) == [1, 2, 3, 4]
  np.testing.assert_allclose([pair[s] for s in range(1, 5)],
                             [single[s] for s in range(1, 5)], rtol=_RTOL)
  # Process 0 alone logs: every step once, one evaluation row (samples drawn on both).
  steps = [r["step"] for r in _rows(runs.pair)]
  assert steps == [1, 2, 3, 4, 4], steps
  evals = [r for r in _rows(runs.pair) if "val_bits_per_token" in r]
  single_eval = [r for r in _rows(runs.single) if "val_bits_per_token" in r]
  np.testing.assert_allclose(evals[0]["val_bits_per_token"],
                             single_eval[0]["val_bits_per_token"], rtol=_RTOL)
  assert "sample_invalid_fraction" in evals[0]
  assert runs.outputs[1].count("step 4/4") == 1 and "step 4/4" not in runs.outputs[2]
  # One checkpoint per saved step, written by both processes together (each its shards).
  checkpoints = runs.pair / "checkpoints"
  assert sorted(os.listdir(checkpoints)) == ["2", "4"]
  assert sorted(n for n in os.listdir(checkpoints / "4" / "state")
                if n.startswith("ocdbt.process_")) == ["ocdbt.process_0", "ocdbt.process_1"]
  for a, b in zip(_params(runs.pair, 4), _params(runs.single, 4)):
    np.testing.assert_allclose(a, b, rtol=_RTOL, atol=_ATOL)


def test_one_process_resumes_the_two_process_workdir(runs):
  assert "resumed from step 2" in runs.resumed_output
  resumed, pair = _losses(runs.resumed), _losses(runs.pair)
  assert sorted(resumed) == [1, 2, 3, 4]
  assert [resumed[s] for s in (1, 2)] == [pair[s] for s in (1, 2)]  # the rows it kept
  np.testing.assert_allclose([resumed[s] for s in (3, 4)], [pair[s] for s in (3, 4)],
                             rtol=_RTOL)
  for a, b in zip(_params(runs.resumed, 4), _params(runs.pair, 4)):
    np.testing.assert_allclose(a, b, rtol=_RTOL, atol=_ATOL)


def test_unreachable_coordinator_fails_in_bounded_time():
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"  # nobody listens there
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=f"cannot reach the coordinator at {address}"):
    distributed.initialize(distributed.Cluster(address, 2, 1), init_timeout_s=1)
  assert time.monotonic() - start < 5
  assert not jax.distributed.is_initialized()


def test_cluster_arguments_and_batch_split_are_checked():
  assert distributed.cluster_from(environ={}) is None
  env = dict(JAX_COORDINATOR_ADDRESS="h:1234", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="3")
  assert distributed.cluster_from(environ=env) == distributed.Cluster("h:1234", 4, 3)
  assert distributed.cluster_from(environ=dict(SLURM_NTASKS="8", SLURM_STEP_NODELIST="n1"))\
      == distributed.Cluster(auto=True)
  for args, message in ((("host", 2, 0), "coordinator='host' must be HOST:PORT"),
                        (("h:1", 2, 2), r"process_id=2 must be .* \[0, num_processes=2\)"),
                        (("h:1", 0, 0), "num_processes=0"),
                        (("h:1", None, 0), "num_processes missing")):
    with pytest.raises(ValueError, match=message):
      distributed.cluster_from(*args, environ={})
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='x'"):
    distributed.cluster_from(environ=dict(env, JAX_PROCESS_ID="x"))
  # 2 processes x 2 devices: a batch of 6 rows is refused, naming batch_size.
  devices = [types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1)]
  mesh = types.SimpleNamespace(shape={"data": 4}, devices=np.array(devices, dtype=object))
  assert distributed.check_batch_split(8, mesh) is None
  assert distributed.check_batch_split(6, mesh) == (
      "config field batch_size=6: must be divisible by the 4 devices of the mesh "
      "(2 processes x 2 devices).")
