import functools
import os
import sys
from typing import ClassVar

import pytest

# Tests run on the CPU; keep XLA from grabbing every core for its own pool.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


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
