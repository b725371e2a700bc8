"""SmolLM2-135M chat sessions whose history lives in MemArt memory (seed 003).

    python scripts/serve.py --config=configs/smollm2_memart.py \
        --input=examples/memart_requests.jsonl --output=memart_results.jsonl \
        [--config.memart.top_k=32] [--config.memart.norm=rr]

Requests run one at a time; `"user"` names the session. Each request's earlier
messages are written once into the session's memory as 16-token KV blocks (pool
pages, boxed by their keys); its last user message alone is prefilled, over the
top-k blocks its own queries retrieve (spliced without copies). Greedy decoding.
"""

from jaxkv.config import (CacheConfig, EngineConfig, MemArtConfig, SamplingConfig, ServeConfig,
                          to_config_dict)


def get_config():
  return to_config_dict(ServeConfig(
      model="smollm2-135m",
      dtype="float32",
      cache=CacheConfig(num_pages=2048, page_size=16, max_seq_len=8192, dtype="float32"),
      engine=EngineConfig(max_batch=1),
      sampling=SamplingConfig(temperature=0.0, max_tokens=48),
      mode="memart",
      memart=MemArtConfig(block_size=16, top_k=32),
  ))
