"""Shared helpers for tests that compare against HF transformers (torch CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig
from jaxkv.kv import state as kv_state
from jaxkv.models.llama import Transformer


def build(cfg, params, dtype=jnp.float32):
  return Transformer.from_params(cfg, params, dtype=dtype)


def dense_forward(model, tokens: np.ndarray, page_size: int = 16, lr_rank: int = 0,
                  **model_kwargs):
  """Runs a whole batch of equal-length prompts in one chunk over a fresh pool.

  tokens: [B, T]; model_kwargs go to the model (e.g. lora, adapter_ids, lora_mode;
  lr_rank sizes the pool's low-rank value cache). Returns logits [B, T, V] float32.
  """
  b, t = tokens.shape
  cfg = model.cfg
  num_pages = (b * t) // page_size + 2
  pool = kv_state.init_pool(cfg, CacheConfig(num_pages=num_pages, page_size=page_size,
                                             max_seq_len=t), lr_rank=lr_rank)
  slot_map = (page_size + np.arange(b * t, dtype=np.int32)).reshape(b, t)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  ws = kv_state.write_slots(slot_map, positions, np.ones((b, t), bool), pool.num_slots)
  hidden, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slot_map),
                    jnp.asarray(ws), pool, **model_kwargs)
  return np.asarray(model.logits(hidden))


def tiny_chat_llm(directory):
  """A tiny random 2-layer Llama (vocab 49152) with SmolLM2's real tokenizer and chat
  template: fast sessions / training tests on real token streams."""
  import torch
  import transformers

  from jaxkv.engine.llm import LLM
  from jaxkv.models import presets, weights
  from jaxkv.tokens import Tokenizer

  cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=4096)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
  mcfg, params = weights.load_hf_dir(directory)
  tok = Tokenizer.load(presets.smollm2_gguf())
  return LLM(build(mcfg, params), tok, CacheConfig(num_pages=4, page_size=4))
