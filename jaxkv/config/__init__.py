"""Frozen dataclass configs for models, the KV cache, sampling, the KV mechanisms and
serving: one namespace, `from jaxkv.config import CacheConfig, ServeConfig, ...`.

  core.py     the model architecture, LoRA, the KV cache, sampling, the engine's step
              shapes, the device mesh; the ConfigDict round-trip every command's config
              takes (`to_config_dict`, `from_config_dict`: unknown fields refused)
  methods.py  pruning, segment reuse, SemShareKV, MemArt
  serve.py    the HTTP server and `ServeConfig`, the root of serve.py / server.py

Every config validates itself on construction (a ValueError naming the field); the
comment after each field is its `--config.*` help text (`jaxkv.cli`) and its line in
docs/configuration.md (`scripts/config_reference.py`).
"""

from jaxkv.config.core import (
  ATTENTION_IMPLS,
  COMPILER_OPTIONS,
  LORA_TARGETS,
  PAGE_SIZE,
  SEED_MAX,
  SEED_MIN,
  CacheConfig,
  EngineConfig,
  LoraConfig,
  MeshConfig,
  ModelConfig,
  RopeConfig,
  SamplingConfig,
  dataclass_type,
  from_config_dict,
  to_config_dict,
)
from jaxkv.config.methods import (
  BUDGET_SCOPES,
  MEMART_AGGS,
  MEMART_BOX_HEADS,
  MEMART_BOX_KEYS,
  MEMART_NORMS,
  MEMART_WRITE_TURNS,
  PRUNING_LAYOUTS,
  PRUNING_METHODS,
  REUSE_METHODS,
  REUSE_STORAGE,
  REUSE_TIERS,
  SEMSHARE_METHODS,
  MemArtConfig,
  PruningConfig,
  ReuseConfig,
  SemShareConfig,
)
from jaxkv.config.serve import (
  SERVE_MODES,
  SESSION_KINDS,
  ServeConfig,
  ServerConfig,
  session_kinds,
)

__all__ = [
    "ATTENTION_IMPLS",
    "BUDGET_SCOPES",
    "COMPILER_OPTIONS",
    "LORA_TARGETS",
    "MEMART_AGGS",
    "MEMART_BOX_HEADS",
    "MEMART_BOX_KEYS",
    "MEMART_NORMS",
    "MEMART_WRITE_TURNS",
    "PAGE_SIZE",
    "PRUNING_LAYOUTS",
    "PRUNING_METHODS",
    "REUSE_METHODS",
    "REUSE_STORAGE",
    "REUSE_TIERS",
    "SEED_MAX",
    "SEED_MIN",
    "SEMSHARE_METHODS",
    "SERVE_MODES",
    "SESSION_KINDS",
    "CacheConfig",
    "EngineConfig",
    "LoraConfig",
    "MemArtConfig",
    "MeshConfig",
    "ModelConfig",
    "PruningConfig",
    "ReuseConfig",
    "RopeConfig",
    "SamplingConfig",
    "SemShareConfig",
    "ServeConfig",
    "ServerConfig",
    "dataclass_type",
    "from_config_dict",
    "session_kinds",
    "to_config_dict",
]
