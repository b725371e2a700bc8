"""SmolLM2-135M batch inference with SemShareKV.

    python scripts/serve.py --config=configs/smollm2_semshare.py \
        --input=examples/semshare_requests.jsonl --output=semshare_results.jsonl \
        [--config.semshare.threshold=0.8] [--config.semshare.method=fuzzy_full]

Requests run in the batch engine as SemShareKV requests, in file order; a prompt
whose E-cache LSH similarity to a stored earlier prompt reaches the threshold reuses
that prompt's K/V token by token (aliased, not copied), recomputing layer 0 and its
most deviating tokens, and keeps fewer tokens in deeper layers; other prompts are
prefilled in full and stored as references. Greedy by default (a request's sampling
settings are honoured).
"""

from jaxkv.config import (
  CacheConfig,
  EngineConfig,
  SamplingConfig,
  SemShareConfig,
  ServeConfig,
  to_config_dict,
)


def get_config():
  return to_config_dict(ServeConfig(
      model="smollm2-135m",
      dtype="float32",
      cache=CacheConfig(num_pages=2048, page_size=16, max_seq_len=8192, dtype="float32"),
      engine=EngineConfig(max_batch=1),
      sampling=SamplingConfig(temperature=0.0, max_tokens=64),
      mode="semshare",
      semshare=SemShareConfig(method="semshare"),
  ))
