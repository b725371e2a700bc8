"""SmolLM2-135M batch inference with cross-prompt segment reuse.

    python scripts/serve.py --config=configs/smollm2_reuse.py \
        --input=examples/reuse_requests.jsonl --output=reuse_results.jsonl \
        [--config.reuse.method=cacheblend] [--config.reuse.storage=float16]

Requests run in the batch engine as reuse requests, in file order; each prompt's
segments (schemas, documents, any run of 32+ tokens an earlier prompt contained) are
spliced from the host store with delta-RoPE and admitted by tier (exact,
depth-guarded approx, CacheBlend probe), the rest prefilled. Greedy by default (a
request's sampling settings are honoured).
"""

from jaxkv.config import (
  CacheConfig,
  EngineConfig,
  ReuseConfig,
  SamplingConfig,
  ServeConfig,
  to_config_dict,
)


def get_config():
  return to_config_dict(ServeConfig(
      model="smollm2-135m",
      dtype="float32",
      cache=CacheConfig(num_pages=1024, page_size=16, max_seq_len=8192, dtype="float32"),
      engine=EngineConfig(max_batch=1),
      sampling=SamplingConfig(temperature=0.0, max_tokens=64),
      mode="reuse",
      reuse=ReuseConfig(method="tiered", storage="int8"),
  ))
