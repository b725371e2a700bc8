"""jaxkv: a functional JAX KV-cache toolkit for LLM agents.

Public API:
    jaxkv.load(model="smollm2-135m", ...) -> LLM       load weights + tokenizer + engine
    LLM.generate(prompts, sampling) -> [Completion]   strings or chat message lists
    jaxkv.ops.paged_attention(...)                    attention over the paged KV pool
    jaxkv.SessionRunner(llm, PruningConfig(...))      agent sessions with KV pruning
    jaxkv.policies.pruning                            pure pruning functions
    jaxkv.ReuseRunner(llm, ReuseConfig(...))          cross-prompt segment reuse (seed 002)
    jaxkv.SemShareRunner(llm, SemShareConfig(...))    KV of a similar prompt reused (seed 001)
    jaxkv.MemArtRunner(llm, MemArtConfig(...), head)  conversation memory as KV blocks (seed 003)
    jaxkv.functional                                  init_state / prefill / decode / generate:
                                                      pure paged inference to jit, vmap, grad
    jaxkv.sharding                                    ("data", "model") mesh and the rules table;
                                                      jaxkv.load(..., mesh=make_mesh(d, m))

`import jaxkv` itself is light: each name above (and JAX with it) is imported the
first time it is used, so the commands' `--help` and the config files load without
JAX. `from jaxkv import load` and `jaxkv.load(...)` work as with an eager import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import typing

from jaxkv import runtime as _runtime

try:   # the installed distribution's version (pyproject.toml's [project] version)
  __version__ = importlib.metadata.version("jaxkv")
except importlib.metadata.PackageNotFoundError:   # a source tree that was never installed
  __version__ = "0+unknown"

_runtime.quiet_tpu_probe()   # no "Unable to initialize backend 'tpu'" line (jaxkv.runtime)

if typing.TYPE_CHECKING:   # what the names are, for type checkers (imported lazily below)
  from jaxkv import functional, ops, sharding
  from jaxkv.config import (
    COMPILER_OPTIONS,
    CacheConfig,
    EngineConfig,
    MemArtConfig,
    ModelConfig,
    PruningConfig,
    ReuseConfig,
    RopeConfig,
    SamplingConfig,
    SemShareConfig,
    ServeConfig,
  )
  from jaxkv.engine.engine import Engine, Request, Result
  from jaxkv.engine.llm import LLM, Completion, load
  from jaxkv.engine.memart import MemArtRunner, MemArtSessions
  from jaxkv.engine.reuse import ReuseRunner
  from jaxkv.engine.semshare import SemShareRunner
  from jaxkv.engine.sessions import SessionRunner, TurnMetrics
  from jaxkv.kv.allocator import OutOfSlotsError, PagedAllocator
  from jaxkv.kv.radix import RadixCache
  from jaxkv.kv.state import SENTINEL, KVPool, init_pool
  from jaxkv.models.llama import Transformer
  from jaxkv.tokens import Tokenizer

# public name -> the module that defines it (a module's own name: the module)
_EXPORTS = {
    "functional": "jaxkv.functional", "ops": "jaxkv.ops", "sharding": "jaxkv.sharding",
    "policies": "jaxkv.policies",
    **dict.fromkeys(("COMPILER_OPTIONS", "CacheConfig", "EngineConfig", "MemArtConfig",
                     "ModelConfig", "PruningConfig", "ReuseConfig", "RopeConfig",
                     "SamplingConfig", "SemShareConfig", "ServeConfig"), "jaxkv.config"),
    **dict.fromkeys(("Engine", "Request", "Result"), "jaxkv.engine.engine"),
    **dict.fromkeys(("LLM", "Completion", "load"), "jaxkv.engine.llm"),
    **dict.fromkeys(("MemArtRunner", "MemArtSessions"), "jaxkv.engine.memart"),
    "ReuseRunner": "jaxkv.engine.reuse",
    "SemShareRunner": "jaxkv.engine.semshare",
    **dict.fromkeys(("SessionRunner", "TurnMetrics"), "jaxkv.engine.sessions"),
    **dict.fromkeys(("OutOfSlotsError", "PagedAllocator"), "jaxkv.kv.allocator"),
    "RadixCache": "jaxkv.kv.radix",
    **dict.fromkeys(("SENTINEL", "KVPool", "init_pool"), "jaxkv.kv.state"),
    "Transformer": "jaxkv.models.llama",
    "Tokenizer": "jaxkv.tokens",
}
# an exported package and the submodules the API promises on it
_PACKAGES = {"jaxkv.policies": ("jaxkv.policies.pruning",)}

__all__ = [
  "COMPILER_OPTIONS",
  "LLM",
  "SENTINEL",
  "CacheConfig",
  "Completion",
  "Engine",
  "EngineConfig",
  "KVPool",
  "MemArtConfig",
  "MemArtRunner",
  "MemArtSessions",
  "ModelConfig",
  "OutOfSlotsError",
  "PagedAllocator",
  "PruningConfig",
  "RadixCache",
  "Request",
  "Result",
  "ReuseConfig",
  "ReuseRunner",
  "RopeConfig",
  "SamplingConfig",
  "SemShareConfig",
  "SemShareRunner",
  "ServeConfig",
  "SessionRunner",
  "Tokenizer",
  "Transformer",
  "TurnMetrics",
  "functional",
  "init_pool",
  "load",
  "ops",
  "policies",
  "sharding",
]


def __getattr__(name: str):
  """An API name on first use (PEP 562): its module is imported then, and the name
  kept in the module globals so later uses do not come here."""
  if name.startswith("_"):
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")
  target = _EXPORTS.get(name, f"jaxkv.{name}")
  if target == f"jaxkv.{name}":   # a submodule (exported or not): just it
    try:
      value = importlib.import_module(target)
    except ModuleNotFoundError as e:
      if e.name != target:
        raise
      raise AttributeError(f"module 'jaxkv' has no attribute {name!r}") from None
    for sub in _PACKAGES.get(target, ()):
      importlib.import_module(sub)
  else:
    value = getattr(importlib.import_module(target), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
