import contextlib
import functools
import os
import sys
from typing import ClassVar

import pytest

# Tests run on the CPU; keep XLA from grabbing every core for its own pool.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


def _share_compiled_programs(limit: int = 2 << 30):
  """Keeps every program the tests compile in a persistent cache of their own.

  Compiling is most of the suite's time: 10,383 XLA compiles took 1,429 of about
  2,000 CPU seconds of the fast set (2026-11-30, cold, 2 workers), most of them
  0.1-0.2 s each for the tiny test models. The same programs recur across modules
  and workers (`_drop_executables_after_each_module` clears the in-memory cache, and
  the two workers never shared it), but `jaxkv.load`'s cache keeps only compiles of a
  second or more. Here every compile goes to `$JAXKV_CACHE/xla-tests` (default
  ~/.cache/jaxkv/xla-tests), so a cold run loads a third of its programs from what it
  compiled earlier and a second run nearly all of them. Compiled programs are keyed by
  their HLO, options and JAX version, so what the tests compute is unchanged. The
  variables are set before JAX is imported (JAX reads them then); the xdist workers
  and the subprocesses the tests start inherit them. A cache you name yourself
  ($JAX_COMPILATION_CACHE_DIR) is used as it is.

  A run adds about 80 MB; past `limit` bytes the oldest entries go first, once per
  run. (JAX's own bound, $JAX_COMPILATION_CACHE_MAX_SIZE, is not used: it tracks
  access times under a lock on every lookup, and made the fast set slower than no
  cache at all.)"""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  root = os.path.expanduser(os.environ.get("JAXKV_CACHE", "~/.cache/jaxkv"))
  path = os.path.join(root, "xla-tests")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  if not os.path.isdir(path) or "PYTEST_XDIST_WORKER" in os.environ:
    return                                  # the controller trims, before workers start
  entries = sorted((st.st_mtime, st.st_size, e.path) for e in os.scandir(path)
                   if e.is_file() and (st := e.stat()))
  total = sum(size for _, size, _ in entries)
  if total <= limit:
    return
  for _, size, name in entries:             # oldest first, down to half the limit
    with contextlib.suppress(OSError):
      os.remove(name)
    total -= size
    if total <= limit // 2:
      break


_share_compiled_programs()


def _share_gguf_parses():
  """Shares read-only GGUF parsing work inside the test process.

  transformers' GGUF import (the reference side of the real-weight tests) builds a
  `gguf.GGUFReader` for every config, weight and tokenizer load: 4-21 s per parse of
  the shipped files on a 2-core CPU, several times per file. Within this process a
  file is parsed once and the same reader object handed out again; the reference's
  code and results are unchanged (readers are read-only, the files immutable)."""
  try:
    import gguf
  except ImportError:
    return
  base = gguf.GGUFReader
  if getattr(base, "_jaxkv_shared", False):
    return

  class SharedGGUFReader(base):
    _jaxkv_shared = True
    _readers: ClassVar[dict] = {}

    def __new__(cls, path, mode="r"):
      if mode != "r":
        return super().__new__(cls)
      st = os.stat(path)
      key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
      if key not in cls._readers:
        reader = super().__new__(cls)
        base.__init__(reader, path, mode)
        cls._readers[key] = reader
      return cls._readers[key]

    def __init__(self, path, mode="r"):
      if mode != "r":
        base.__init__(self, path, mode)

  gguf.GGUFReader = SharedGGUFReader
  # transformers also rebuilds the same (arch, n_blocks) TensorNameMap once per
  # submodule (~400 times, ~10 s per model); it is a pure, read-only lookup table.
  gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


_share_gguf_parses()


@pytest.fixture(scope="module", autouse=True)
def _drop_executables_after_each_module():
  """Frees the XLA executables a test module compiled once it is done.

  Every XLA:CPU executable keeps its code in memory mappings (~1,000 for an
  unrolled SmolLM2 forward, measured with /proc/self/maps), and a process may
  hold at most vm.max_map_count (65,530 here). The full suite compiles hundreds of
  model shapes, so late in a run LLVM failed with "Cannot allocate memory" and
  XLA segfaulted inside a compile (2026-11-25, test 427 of 431). Modules share
  few shapes, so clearing between them costs little recompilation."""
  yield
  import jax
  jax.clear_caches()
