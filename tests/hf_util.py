"""Shared helpers for tests that compare against HF transformers (torch CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import CacheConfig
from jaxkv.kv import state as kv_state
from jaxkv.models.llama import Transformer


def build(cfg, params, dtype=jnp.float32):
  model = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  model.load_params(params)
  return model


def dense_forward(model, tokens: np.ndarray, page_size: int = 16):
  """Runs a whole batch of equal-length prompts in one chunk over a fresh pool.

  tokens: [B, T]. Returns logits [B, T, V] float32 numpy.
  """
  b, t = tokens.shape
  cfg = model.cfg
  num_pages = (b * t) // page_size + 2
  pool = kv_state.init_pool(cfg, CacheConfig(num_pages=num_pages, page_size=page_size,
                                             max_seq_len=t))
  slot_map = (page_size + np.arange(b * t, dtype=np.int32)).reshape(b, t)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  ws = kv_state.write_slots(slot_map, positions, np.ones((b, t), bool), pool.num_slots)
  hidden, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slot_map),
                    jnp.asarray(ws), pool)
  return np.asarray(model.logits(hidden))
