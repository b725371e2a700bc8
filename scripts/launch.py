r"""Starts N processes of one command on this machine as one multi-host JAX job.

    python scripts/launch.py --processes=2 --devices_per_process=4 [--timeout=600] \
        -- python tests/sharding_worker.py --meshes=2x4

Each process gets JAXKV_COORDINATOR=127.0.0.1:<free port>, JAXKV_NUM_PROCESSES,
JAXKV_PROCESS_ID (read by `jaxkv.distributed.initialize`), and, with
`--devices_per_process`, JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=<n> (CPU collectives: gloo). Process
0's output goes to stdout, the others' to stderr with a "[pN]" prefix. Any process
failing, or the job outliving --timeout, ends every process; the exit code is the
first failing process's (124 on timeout).

On a real cluster, run the same command once per host with the three variables
set by your scheduler (or leave them unset where `jax.distributed.initialize()`
discovers the cluster itself: SLURM, Open MPI, Cloud TPU), and no XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, out, prefix: str) -> None:
  for line in iter(stream.readline, ""):
    out.write(prefix + line)
    out.flush()


def launch(command: list[str], processes: int, devices_per_process: int | None,
           timeout: float, port: int | None = None) -> int:
  """Runs `command` as `processes` cooperating processes; returns the exit code."""
  if processes < 1:
    raise ValueError(f"--processes must be >= 1, got {processes}")
  if not command:
    raise ValueError("no command given (put it after --)")
  address = f"127.0.0.1:{port or free_port()}"
  procs, pumps = [], []
  for pid in range(processes):
    env = {**os.environ, "JAXKV_COORDINATOR": address, "JAXKV_NUM_PROCESSES": str(processes),
           "JAXKV_PROCESS_ID": str(pid), "PYTHONUNBUFFERED": "1"}
    if devices_per_process:
      env["JAX_PLATFORMS"] = "cpu"
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={devices_per_process}").strip()
    p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    t = threading.Thread(target=_pump, args=(p.stdout, sys.stdout if pid == 0 else sys.stderr,
                                             "" if pid == 0 else f"[p{pid}] "), daemon=True)
    t.start()
    procs.append(p)
    pumps.append(t)
  deadline = time.monotonic() + timeout
  code = 0
  while any(p.poll() is None for p in procs):
    failed = [p for p in procs if p.poll() not in (None, 0)]
    if failed or time.monotonic() > deadline:
      code = failed[0].returncode if failed else 124
      if not failed:
        print(f"launch: timed out after {timeout:.0f} s", file=sys.stderr)
      for p in procs:
        if p.poll() is None:
          p.kill()
      break
    time.sleep(0.2)
  for p in procs:
    p.wait()
  for t in pumps:
    t.join(timeout=5)
  return code or next((p.returncode for p in procs if p.returncode), 0)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" in argv:
    i = argv.index("--")
    own, command = argv[:i], argv[i + 1:]
  else:
    own, command = argv, []
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--processes", type=int, default=2)
  ap.add_argument("--devices_per_process", type=int, default=None,
                  help="CPU devices per process (sets JAX_PLATFORMS=cpu and XLA_FLAGS)")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
  ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  args = ap.parse_args(own)
  try:
    return launch(command, args.processes, args.devices_per_process, args.timeout, args.port)
  except ValueError as e:
    print(f"launch: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
