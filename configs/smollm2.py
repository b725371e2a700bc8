"""SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32): the shipped default."""

from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig, ServeConfig, to_config_dict


def get_config():
  return to_config_dict(ServeConfig(
      model="smollm2-135m",
      dtype="float32",
      # 1,024 pages x 16 slots = 16k token slots = 1.4 GiB of fp32 K/V at
      # 2 x 30 layers x d_kv 192 x 4 bytes = 46 KB per token.
      cache=CacheConfig(num_pages=1024, page_size=16, max_seq_len=2048, dtype="float32"),
      engine=EngineConfig(max_batch=8, prefill_chunk=256, decode_steps=16),
      sampling=SamplingConfig(temperature=0.0, max_tokens=128),
  ))
