"""SmolLM2-135M over agent sessions (ToolBench-format traces) with IntentKV pruning.

    python scripts/make_traces.py --source=tau2 --domains=airline,retail \
        --out=data_local/tau2_train.json --held_out=data_local/tau2_heldout.json
    python scripts/serve.py --config=configs/smollm2_sessions.py \
        --input=data_local/tau2_heldout.json --output=sessions.jsonl \
        [--config.pruning.method=snapkv] [--config.pruning.layout=compact]

The tool-schema system prompt of these traces (~3.2k tokens for tau2 airline /
retail) is protected, so C = 3584 keeps roughly 0.3k tokens of other history
per request once the prompt outgrows it.
"""

from jaxkv.config import (
  CacheConfig,
  EngineConfig,
  PruningConfig,
  SamplingConfig,
  ServeConfig,
  to_config_dict,
)


def get_config():
  return to_config_dict(ServeConfig(
      model="smollm2-135m",
      dtype="float32",
      cache=CacheConfig(num_pages=2048, page_size=16, max_seq_len=8192, dtype="float32"),
      engine=EngineConfig(max_batch=1, prefill_chunk=256, decode_steps=16),
      sampling=SamplingConfig(temperature=0.0, max_tokens=128),
      mode="sessions",
      pruning=PruningConfig(method="intentkv", layout="dead_slot", budget=3584,
                            intent_mode="memory"),
  ))
