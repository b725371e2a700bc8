"""Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized to fp32), tool-calling template."""

from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig, ServeConfig, to_config_dict


def get_config():
  return to_config_dict(ServeConfig(
      model="qwen2.5-coder-0.5b",
      dtype="float32",
      # 2 x 24 layers x d_kv 128 x 4 bytes = 24 KB per token; 16k slots = 400 MB.
      cache=CacheConfig(num_pages=1024, page_size=16, max_seq_len=4096, dtype="float32"),
      engine=EngineConfig(max_batch=8, prefill_chunk=256, decode_steps=16),
      sampling=SamplingConfig(temperature=0.0, max_tokens=256),
  ))
