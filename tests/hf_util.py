"""Shared helpers for tests that compare against HF transformers (torch CPU)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig
from jaxkv.kv import state as kv_state
from jaxkv.models.llama import Transformer


def build(cfg, params, dtype=jnp.float32):
  return Transformer.from_params(cfg, params, dtype=dtype)


def dense_forward(model, tokens: np.ndarray, page_size: int = 16, lr_rank: int = 0,
                  lora=None, adapter_ids=None, lora_mode: str = "full", cached: bool = True):
  """Full-sequence logits through the paged path (one chunk, contiguous slots), or
  through the cache-free path (`cached=False`).

  tokens: [B, T]; lora / adapter_ids / lora_mode become `forward.LoraInputs`;
  lr_rank sizes the pool's low-rank value cache. Returns logits [B, T, V] float32.
  """
  from jaxkv.models.forward import LoraInputs

  b, t = tokens.shape
  cfg = model.cfg
  positions = jnp.asarray(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)))
  li = None if lora is None else LoraInputs(lora, adapter_ids, mode=lora_mode)
  if not cached:
    return np.asarray(model.logits(model(jnp.asarray(tokens), positions, lora=li).hidden))
  num_pages = (b * t) // page_size + 2
  pool = kv_state.init_pool(cfg, CacheConfig(num_pages=num_pages, page_size=page_size,
                                             max_seq_len=t), lr_rank=lr_rank)
  slot_map = (page_size + np.arange(b * t, dtype=np.int32)).reshape(b, t)
  out = model(jnp.asarray(tokens), positions, pool, slot_map=jnp.asarray(slot_map), lora=li)
  return np.asarray(model.logits(out.hidden))


def tiny_llama(directory, vocab: int = 128):
  """A tiny random HF Llama (2 layers, GQA 2, tied) saved to `directory` and the
  same weights as a jaxkv model: (hf, model). Embeddings are scaled up so greedy
  choices are not near-ties."""
  import torch
  import transformers

  from jaxkv.models import weights

  cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True)
  torch.manual_seed(1)
  hf = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    hf.model.embed_tokens.weight.mul_(25.0)
  hf.save_pretrained(directory)
  return hf, build(*weights.load_hf_dir(directory))


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


def tool_session_entry(sid="s1"):
  """A ToolBench conversation whose later calls copy ids printed by earlier tools."""
  def call(name, **a):
    return {"from": "assistant", "value": f"Thought: call {name}.\nAction: {name}\n"
                                          f"Action Input: {json.dumps(a)}"}
  return {"id": sid, "conversations": [
      {"from": "system", "value": "You are a travel agent. Use the tools."},
      {"from": "user", "value": "I am mia_li_3668; cancel my Boston trip."},
      call("get_user_details", user_id="mia_li_3668"),
      {"from": "function", "value": "reservations: NO6JO3 (BOS), AIXC01 (LAX). " * 3},
      call("get_reservation_details", reservation_id="NO6JO3"),
      {"from": "function", "value": "NO6JO3: JFK to BOS, flight HAT136, 2 passengers. " * 2},
      call("cancel_reservation", reservation_id="NO6JO3", user_id="mia_li_3668"),
      {"from": "function", "value": "status: cancelled"},
      {"from": "assistant", "value": "Done: NO6JO3 is cancelled."}]}


def random_llm_with_real_tokenizer(num_layers: int = 6):
  """A random tiny Llama (d 64, 4 heads, 2 KV heads) with SmolLM2's real tokenizer:
  runner tests see real canonical tokens and chat templates without real weights."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  import jaxkv  # pylint: disable=import-outside-toplevel
  from jaxkv.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
  from jaxkv.models.llama import Transformer  # pylint: disable=import-outside-toplevel
  from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel
  tok = Tokenizer.load(presets.smollm2_gguf())
  cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                    num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16,
                    rms_norm_eps=1e-6)
  return jaxkv.LLM(Transformer(cfg, rngs=nnx.Rngs(0)), tok)
