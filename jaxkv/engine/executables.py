"""A bound on the compiled programs a long-running process keeps in memory.

Every padded shape and option set of the engine's jitted steps is its own compiled
program (`jaxkv.kv.plan` buckets the shapes: chunk lengths x batch buckets x
slot-map widths x the mechanisms' options), and JAX keeps each one for the life of
the process. On XLA:CPU one variant of SmolLM2's chunk step holds about 40 MB of
host memory, so a server whose traffic keeps reaching new shapes grows by that much
per shape (the soak: 17 -> 47 variants and +1.3 GB in six minutes).

`Budget.check()`, run between engine steps (`jaxkv.server.loop`), drops every
compiled program once the registered steps hold more than `limit` variants
(`jax.clear_caches()`), collects, and hands the freed heap back to the OS
(`malloc_trim`, glibc only: freed memory otherwise stays in the process). The
programs the traffic still uses come back on their next call from the persistent
compilation cache on disk (`jaxkv.runtime.compilation_cache`), a load rather than
a compile. A limit below the traffic's working set makes every few steps reload:
the clears are counted (`/metrics`) and logged with that advice.

Evaluations through the engine (`jaxkv.evaluation`) call `step(engine)` in place of
`engine.step()`: the same bound (`EVALUATION_LIMIT`) for a process that replays a
whole workload. Without it, `bench/reuse.py --via=engine` (24 prompts, segment reuse's
per-layer passes reach many shapes) died with "LLVM compilation error: Cannot allocate
memory" once the process passed the kernel's limit of 65,530 memory maps
(`vm.max_map_count`; each compiled program maps its code).

Measured (SmolLM2, XLA:CPU, `bench/soak.py`): without a bound the steps went from
17 to 47 variants and RSS from 3.6 to 5.0 GB in 355 s; docs/guides/server.md (Soak) has
the bounded run.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time

import jax

log = logging.getLogger(__name__)

_REGISTERED: list = []


def register(fn):
  """Counts `fn` (a `jax.jit` function) among the steps the budget watches; returns it."""
  _REGISTERED.append(fn)
  return fn


def count(steps=None) -> int:
  """Compiled variants the steps (default: the registered ones) hold now."""
  return sum(f._cache_size() for f in (_REGISTERED if steps is None else steps))  # pylint: disable=protected-access


def release() -> None:
  """Drops every compiled program and staging cache of the process, then returns the
  freed heap to the OS where the C library can (glibc's `malloc_trim`)."""
  jax.clear_caches()
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):    # not glibc: the memory is reused, not returned
    pass


class Budget:
  """At most `limit` compiled variants of `steps` (default: the registered jitted
  steps; 0: no bound)."""

  def __init__(self, limit: int, steps=None):
    if limit < 0:
      raise ValueError(f"the compiled-variant limit must be >= 0, got {limit}")
    self.limit = limit
    self.steps = steps
    self.clears = 0
    self._last_clear = 0.0

  def check(self) -> bool:
    """Releases every compiled program if the steps hold more than `limit`; returns
    whether it did."""
    if not self.limit:
      return False
    n = count(self.steps)
    if n <= self.limit:
      return False
    now = time.monotonic()
    if self._last_clear and now - self._last_clear < 60.0:
      log.warning("the compiled programs passed %d again %.0f s after the last release: "
                  "the traffic's working set is larger than the limit (raise "
                  "server.max_compiled)", self.limit, now - self._last_clear)
    release()
    self.clears += 1
    self._last_clear = now
    log.info("released %d compiled variants (limit %d); they reload from the "
             "persistent compilation cache when used again", n, self.limit)
    return True


EVALUATION_LIMIT = 64
_EVALUATION = Budget(EVALUATION_LIMIT)


def step(engine) -> list:
  """`engine.step()` for an evaluation loop: then releases the compiled programs past
  `EVALUATION_LIMIT` variants (module docstring); returns the step's finished results."""
  out = engine.step()
  _EVALUATION.check()
  return out
