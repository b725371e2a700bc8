"""Multi-host: JAX's own multi-controller runtime, started from the environment.

Every process runs the same program on the same inputs (SPMD); the mesh spans
all processes' devices (`jax.devices()` after initialisation), weights and the
pool are placed with global shardings, and results are gathered back to every
process with `fetch`. Nothing here moves data itself: `jax.distributed` and
XLA's collectives do (gloo between CPU processes, NCCL on GPUs, ICI/DCN on TPUs).

Environment (set by `scripts/launch.py` on one machine, or by your cluster's
launcher on many):

    JAXKV_COORDINATOR     host:port of process 0's coordinator service
    JAXKV_NUM_PROCESSES   how many processes take part
    JAXKV_PROCESS_ID      this process's index, 0 .. N-1

On a GPU or TPU cluster whose scheduler JAX already understands (SLURM, Open
MPI, Cloud TPU), leave them unset and call `initialize(auto=True)`:
`jax.distributed.initialize()` then reads the cluster's own variables.
"""

from __future__ import annotations

import os

import jax
import numpy as np

ENV = ("JAXKV_COORDINATOR", "JAXKV_NUM_PROCESSES", "JAXKV_PROCESS_ID")


def requested() -> bool:
  """True when the environment asks for a multi-process run."""
  return bool(os.environ.get("JAXKV_COORDINATOR"))


def initialize(auto: bool = False) -> bool:
  """Starts jax.distributed from JAXKV_* (or the cluster's variables with `auto`).

  Must run before any JAX computation. On CPU it selects gloo collectives.
  Returns True when this is now a multi-process run. Missing or malformed
  variables raise ValueError naming them.
  """
  if not requested() and not auto:
    return False
  if requested():
    missing = [v for v in ENV if not os.environ.get(v)]
    if missing:
      raise ValueError(f"multi-process run: {', '.join(missing)} not set (scripts/launch.py "
                       "sets all three)")
    try:
      n, pid = int(os.environ["JAXKV_NUM_PROCESSES"]), int(os.environ["JAXKV_PROCESS_ID"])
    except ValueError as e:
      raise ValueError(f"JAXKV_NUM_PROCESSES / JAXKV_PROCESS_ID must be integers: {e}") from e
    if not 0 <= pid < n:
      raise ValueError(f"JAXKV_PROCESS_ID={pid} outside 0..{n - 1}")
    kw = dict(coordinator_address=os.environ["JAXKV_COORDINATOR"], num_processes=n,
              process_id=pid)
  else:
    kw = {}
  if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kw)
  return jax.process_count() > 1


def is_leader() -> bool:
  """Process 0: the one that writes files and prints results."""
  return jax.process_index() == 0


def fetch(x) -> np.ndarray:
  """A device array as numpy on this process, gathered from every process when
  it spans devices this process cannot address."""
  if x is None:
    return None
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


_BARRIERS: dict[str, int] = {}


def barrier(name: str, timeout_s: float = 900.0) -> None:
  """Waits until every process reaches `barrier(name)`; nothing in a single-process run.

  Use it before the first cross-process transfer that follows host work whose length
  differs between processes (loading weights, a single-device run): gloo opens its TCP
  pairs at the first collective with a short connect timeout, so a process that gets
  there much later than another fails the job ("Gloo context initialization failed:
  Connect timeout"). This waits on the coordination service instead, with `timeout_s`.
  Every process must call it the same number of times with the same names (SPMD).
  """
  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  client = jax_distributed.global_state.client   # what jax's own checkpointing waits on
  if client is None:
    return
  n = _BARRIERS[name] = _BARRIERS.get(name, -1) + 1
  client.wait_at_barrier(f"jaxkv:{name}:{n}", timeout_in_ms=int(timeout_s * 1000))
