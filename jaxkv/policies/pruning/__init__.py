"""KV pruning: scores (StreamingLLM, SnapKV, H2O, IntentKV Phase-1), budgeted
selection with a forced set, and the dead-slot / compact layouts."""

from jaxkv.policies.pruning.intentkv import (
  IntentKVConfig,
  QueryMemoryStore,
  encode_query,
  intentkv_scores,
  rule_scores,
  session_key,
  update_memory,
)
from jaxkv.policies.pruning.scores import (
  H2OConfig,
  SnapKVConfig,
  StreamingLLMConfig,
  gather_keys,
  h2o,
  snapkv,
  streaming_llm,
)
from jaxkv.policies.pruning.select import (
  compact_layout,
  dead_slot_map,
  evict_dropped,
  keep_mask,
  span_mask,
)

__all__ = [
  "H2OConfig",
  "IntentKVConfig",
  "QueryMemoryStore",
  "SnapKVConfig",
  "StreamingLLMConfig",
  "compact_layout",
  "dead_slot_map",
  "encode_query",
  "evict_dropped",
  "gather_keys",
  "h2o",
  "intentkv_scores",
  "keep_mask",
  "rule_scores",
  "session_key",
  "snapkv",
  "span_mask",
  "streaming_llm",
  "update_memory",
]
