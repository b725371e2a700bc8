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
"""

from jaxkv import functional, ops, sharding
from jaxkv.config import (COMPILER_OPTIONS, CacheConfig, EngineConfig, MemArtConfig,
                          ModelConfig, PruningConfig, ReuseConfig, RopeConfig, SamplingConfig,
                          SemShareConfig, ServeConfig)
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

__all__ = [
    "COMPILER_OPTIONS", "CacheConfig", "Completion", "Engine", "EngineConfig", "KVPool", "LLM",
    "MemArtConfig", "MemArtRunner", "MemArtSessions", "ModelConfig", "OutOfSlotsError", "PagedAllocator", "PruningConfig", "RadixCache", "Request",
    "Result", "ReuseConfig", "ReuseRunner", "RopeConfig", "SENTINEL", "SamplingConfig",
    "SemShareConfig", "SemShareRunner", "ServeConfig", "SessionRunner", "Tokenizer",
    "Transformer", "TurnMetrics", "functional", "init_pool", "load", "ops", "sharding",
]
