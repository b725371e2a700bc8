"""How jaxkv sets up JAX for a run: the persistent compilation cache, and quiet
backend probing.

    from jaxkv import runtime
    runtime.compilation_cache()        # ~/.cache/jaxkv/xla unless JAX already has one

Both `jaxkv.load` and the commands (`--xla_cache`) turn the cache on through
`compilation_cache`, so the Python API and the CLI share one cache directory and
a second run loads its compiled steps instead of compiling them again.

`import jaxkv` calls `quiet_tpu_probe()`: JAX looks for every backend it knows
when it first starts, and on a machine without a TPU runtime it logs (at INFO,
which absl's handler prints) "Unable to initialize backend 'tpu': ... Failed to
open libtpu.so ...". That line reads as a failure but only says there is no TPU.
The filter drops exactly that record (the TPU backend, naming libtpu); every
other backend message and error still shows, and which backend JAX picks is
unchanged (a GPU install still uses its GPU). Nothing here imports JAX.
"""

from __future__ import annotations

import logging
import os

_XLA_BRIDGE = "jax._src.xla_bridge"   # the logger JAX's backend discovery writes to


class _NoTpuProbe(logging.Filter):
  """Drops JAX's "no TPU runtime here" INFO record, nothing else."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    return not (msg.startswith("Unable to initialize backend 'tpu'") and "libtpu" in msg)


def quiet_tpu_probe() -> None:
  """Installs the filter on JAX's backend logger (once; JAX need not be imported)."""
  logger = logging.getLogger(_XLA_BRIDGE)
  if not any(isinstance(f, _NoTpuProbe) for f in logger.filters):
    logger.addFilter(_NoTpuProbe())


def default_cache_dir() -> str:
  """`$JAXKV_CACHE/xla` (default ~/.cache/jaxkv/xla)."""
  from jaxkv.models.presets import cache_dir  # pylint: disable=import-outside-toplevel
  return str(cache_dir() / "xla")


def compilation_cache(path: str | bool | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache; returns the directory in use
  (None: no cache).

  path: None (default) keeps a directory JAX already has (your own
    `jax.config.update("jax_compilation_cache_dir", ...)` or
    $JAX_COMPILATION_CACHE_DIR) and otherwise uses `default_cache_dir()`; a
    directory uses that one; "" or False turns nothing on (JAX's own setting
    stays: off unless one of the two above set it).
  """
  import jax  # pylint: disable=import-outside-toplevel
  current = jax.config.jax_compilation_cache_dir
  if path is False or path == "":
    return current or None
  if path is None or path is True:
    if current:
      return current
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir()
  jax.config.update("jax_compilation_cache_dir", str(path))
  return str(path)
