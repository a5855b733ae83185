"""Many processes: `jax.distributed` start-up, this process's rows, host copies, agreement.

One process per host (or per GPU) runs the same `train.py`; `initialize` joins them before
any array exists. The mesh then spans every process's devices (`make_mesh`), each process
hands in its own rows of a step's global batch (`process_rows`, then `global_batch`), and
jit runs one program over all devices. Only process 0 writes logs and metrics; every
process takes part in each orbax save and restore (orbax writes each array once).

On CPU the processes talk through gloo (TCP). A process that cannot reach the coordinator
fails after `init_timeout_s` with a RuntimeError naming the address; a process that dies
mid-run makes the others fail (their next collective, or JAX's heartbeat after
`heartbeat_timeout_s`), and the rerun resumes from the last complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Where this process stands: `coordinator` HOST:PORT (process 0 serves it), the number of
  processes and this one's id. `auto`: JAX finds all three (SLURM, TPU pod slices, Open MPI,
  Kubernetes)."""

  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False


def _parse_port(address: str, name: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{name}={address!r} must be HOST:PORT with a port in 1..65535.")
  return host.strip("[]"), int(port)


def cluster_from(coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, auto: bool = False,
                 environ=os.environ) -> Cluster | None:
  """The cluster from flags, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID, else a SLURM job step of several tasks (`auto`); None: one process."""
  if coordinator is None and num_processes is None and process_id is None:
    if environ.get(ENV_COORDINATOR):
      coordinator = environ[ENV_COORDINATOR]
      for env, value in ((ENV_NUM_PROCESSES, "num_processes"), (ENV_PROCESS_ID, "process_id")):
        text = environ.get(env)
        if text is not None and not text.strip().isdigit():
          raise ValueError(f"{env}={text!r} must be a non-negative integer.")
      num_processes = int(environ[ENV_NUM_PROCESSES]) if environ.get(ENV_NUM_PROCESSES) else None
      process_id = int(environ[ENV_PROCESS_ID]) if environ.get(ENV_PROCESS_ID) else None
    elif not auto and int(environ.get("SLURM_NTASKS", "1") or 1) > 1 and environ.get(
        "SLURM_STEP_NODELIST"):
      auto = True  # srun with several tasks: JAX reads SLURM's variables
  if auto:
    return Cluster(coordinator, num_processes, process_id, auto=True)
  if coordinator is None and num_processes is None and process_id is None:
    return None
  given = dict(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(f"{', '.join(missing)} missing: several processes need coordinator "
                     f"(HOST:PORT), num_processes and process_id; got {given}.")
  _parse_port(coordinator, "coordinator")
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes={num_processes!r} must be an integer >= 1.")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id!r} must be an integer in "
                     f"[0, num_processes={num_processes}).")
  return Cluster(coordinator, num_processes, process_id)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once `address` accepts TCP connections; a RuntimeError naming it after
  `timeout_s` (JAX's own wait ends in an abort of the process, not an exception)."""
  host, port = _parse_port(address, "coordinator")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(
          1.0, deadline - time.monotonic()))):
        return
    except OSError as error:
      if time.monotonic() >= deadline:
        raise RuntimeError(
            f"cannot reach the coordinator at {address} within {timeout_s:g} s ({error}); is "
            "process 0 running there, and is the port open between the hosts?") from None
    time.sleep(0.2)


def initialize(cluster: Cluster | None, init_timeout_s: int = 300,
               heartbeat_timeout_s: int = 100) -> bool:
  """Joins this process to the others (before any array is made); False with one process.

  On CPU the collectives go through gloo. Processes other than 0 wait for the coordinator
  at most `init_timeout_s`; JAX stops every process `heartbeat_timeout_s` after one of them
  stops answering (its collectives usually fail sooner).
  """
  if cluster is None or (cluster.num_processes == 1 and not cluster.auto):
    return False
  for name, value in (("init_timeout_s", init_timeout_s),
                      ("heartbeat_timeout_s", heartbeat_timeout_s)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be an integer number of seconds >= 1.")
  if jax.distributed.is_initialized():
    return True
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  start = time.monotonic()
  if cluster.coordinator is not None and cluster.process_id not in (0, None):
    wait_for_coordinator(cluster.coordinator, init_timeout_s)
  remaining = max(1, int(init_timeout_s - (time.monotonic() - start)))
  jax.distributed.initialize(
      coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
      process_id=cluster.process_id, initialization_timeout=remaining,
      heartbeat_timeout_seconds=int(heartbeat_timeout_s))
  return True


def is_multiprocess() -> bool:
  return jax.process_count() > 1


# ----------------------------------------------------------------------------
# The global batch.
# ----------------------------------------------------------------------------


def check_batch_split(batch_size: int, mesh: Mesh) -> str | None:
  """Why `batch_size` cannot be split over the mesh's devices (None when it can)."""
  devices = mesh.shape["data"]
  if batch_size % devices == 0:
    return None
  processes = len({d.process_index for d in mesh.devices.flat})
  where = (f"{devices} devices of the mesh" if processes == 1 else
           f"{devices} devices of the mesh ({processes} processes x {devices // processes} "
           "devices)")
  return f"config field batch_size={batch_size}: must be divisible by the {where}."


def process_row_range(batch_size: int, mesh: Mesh) -> tuple[int, int]:
  """[start, stop) of the global batch's rows this process's devices hold."""
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  rows = sorted({(index[0].start or 0, batch_size if index[0].stop is None else index[0].stop)
                 for index in sharding.addressable_devices_indices_map(
                     (batch_size,)).values()})
  start, stop = rows[0][0], rows[-1][1]
  if sum(b - a for a, b in rows) != stop - start:  # the mesh's devices are not in process order
    raise ValueError(f"this process's devices hold rows {rows} of the batch, not one slice.")
  return start, stop


def check_process_slice(batch_size: int, mesh: Mesh) -> None:
  """That this process's devices hold rows [p B / P, (p + 1) B / P) of the batch, the rows
  its data source reads (p its index, P the process count)."""
  rows = batch_size // jax.process_count()
  start = jax.process_index() * rows
  held = process_row_range(batch_size, mesh)
  if held != (start, start + rows):
    raise ValueError(f"process {jax.process_index()}'s devices hold rows {held} of the batch "
                     f"of {batch_size}, not its share {(start, start + rows)}.")


def process_rows(batch_BxL: np.ndarray, mesh: Mesh) -> np.ndarray:
  """This process's rows of a whole global batch (what a data source hands each process)."""
  start, stop = process_row_range(batch_BxL.shape[0], mesh)
  return batch_BxL[start:stop]


def global_batch(rows_bxL: np.ndarray, batch_size: int, mesh: Mesh) -> jax.Array:
  """The global [batch_size, ...] array, split on `data`, from each process's own rows."""
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  return jax.make_array_from_process_local_data(sharding, np.asarray(rows_bxL),
                                                (batch_size, *np.shape(rows_bxL)[1:]))


# ----------------------------------------------------------------------------
# Host copies and agreement.
# ----------------------------------------------------------------------------


def host_copy(tree):
  """The whole values of (possibly sharded) global arrays as numpy, on every process; with
  one process the tree as it is. Evaluation and sampling then run on each process's own
  devices, the same inputs giving the same figures everywhere."""
  if not is_multiprocess():
    return tree
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


class AnyProcess:
  """Whether a flag was set on any process, agreed one call late without waiting: each call
  starts a gather of this call's flags over the mesh and returns the previous call's outcome
  (all processes call it at the same points, so all get the same answers). With one process
  the flag itself."""

  def __init__(self, mesh: Mesh):
    self.mesh, self.pending = mesh, None
    self.sharding = NamedSharding(mesh, PartitionSpec("data"))
    self.any = jax.jit(lambda flags: flags.any(), out_shardings=NamedSharding(mesh,
                                                                              PartitionSpec()))

  def __call__(self, flag: bool) -> bool:
    if not is_multiprocess():
      return flag
    local = np.full((len(self.sharding.addressable_devices),), bool(flag))
    previous, self.pending = self.pending, self.any(jax.make_array_from_process_local_data(
        self.sharding, local, (self.mesh.size,)))
    return previous is not None and bool(previous)


def any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process (all processes call it at the same point)."""
  if not is_multiprocess():
    return flag
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.array([flag], np.bool_))))


def barrier(name: str) -> None:
  """Waits for every process to reach `name` (nothing with one process)."""
  if is_multiprocess():
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
