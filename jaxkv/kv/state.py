"""Device-side KV state: the slot pool pytree and its pure update functions.

Invariants (docs/architecture.md):
- keys are stored post-RoPE, with the logical position each slot was written at,
  so re-positioning is an exact delta rotation;
- slot 0 is the sentinel: zero K/V, never written (writes aimed at it or at
  padding use an out-of-range index and are dropped);
- sequences address the pool through token-level slot maps `[B, T]` or, for
  layer-wise retention, `[L, B, T]`; SENTINEL marks evicted / unwritten tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig, ModelConfig

SENTINEL = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
  """Per-layer flat slot pools. Slot 0 is the sentinel."""
  k: jax.Array          # [L, S, Hkv, D] post-RoPE keys
  v: jax.Array          # [L, S, Hkv, D] (LoRA decoupled mode: the base value x W_v)
  positions: jax.Array  # [S] int32 logical position each slot was written at (-1: never)
  vlr: jax.Array | None = None  # [L, S, r] LoRA low-rank value cache x A_v * alpha / r
                                # (LRAgent; shared across heads and adapters), or None

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def num_slots(self) -> int:
    return self.k.shape[1]

  def nbytes_per_slot(self) -> int:
    """Bytes one slot holds across layers (K + V), d_kv accounting."""
    _, _, hkv, d = self.k.shape
    lr = 0 if self.vlr is None else self.num_layers * self.vlr.shape[-1] * self.vlr.dtype.itemsize
    return 2 * self.num_layers * hkv * d * self.k.dtype.itemsize + lr

  @property
  def lr_rank(self) -> int:
    """Rank of the low-rank value pool (0 when there is none)."""
    return 0 if self.vlr is None else self.vlr.shape[-1]


def init_pool(model: ModelConfig, cache: CacheConfig, lr_rank: int = 0) -> KVPool:
  """Zero pool sized by the cache config (zeros keep the sentinel exact).

  lr_rank > 0 adds the LoRA low-rank value pool `vlr` [L, S, lr_rank].
  """
  return init_slots(model, cache.num_slots, cache.dtype, lr_rank)


def init_slots(model: ModelConfig, num_slots: int, dtype, lr_rank: int = 0) -> KVPool:
  """Zero pool of `num_slots` slots (slot 0 included) in `dtype`."""
  dtype = jnp.dtype(dtype)
  shape = (model.num_layers, num_slots, model.num_kv_heads, model.head_dim)
  return KVPool(
      k=jnp.zeros(shape, dtype),
      v=jnp.zeros(shape, dtype),
      positions=jnp.full((num_slots,), -1, jnp.int32),
      vlr=(jnp.zeros((model.num_layers, num_slots, lr_rank), dtype) if lr_rank else None),
  )


def write_layer(pool_k: jax.Array, pool_v: jax.Array, layer: jax.Array,
                slots: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Scatters one layer's new keys/values into the full pools.

  Args:
    pool_k, pool_v: [L, S, Hkv, D].
    layer: scalar int (may be traced, e.g. the scan index).
    slots: [B, C] int32 destination slots; entries >= S (padding) are dropped.
      Callers never pass SENTINEL for a real token (see `write_slots`).
    k, v: [B, C, Hkv, D].
  """
  flat = slots.reshape(-1)
  kf = k.reshape(-1, *k.shape[2:]).astype(pool_k.dtype)
  vf = v.reshape(-1, *v.shape[2:]).astype(pool_v.dtype)
  pool_k = pool_k.at[layer, flat].set(kf, mode="drop")
  pool_v = pool_v.at[layer, flat].set(vf, mode="drop")
  return pool_k, pool_v


def write_lr(pool_vlr: jax.Array, layer: jax.Array, slots: jax.Array,
             vlr: jax.Array) -> jax.Array:
  """Scatters one layer's low-rank values [B, C, r] into vlr [L, S, r] (>= S: dropped)."""
  flat = vlr.reshape(-1, vlr.shape[-1]).astype(pool_vlr.dtype)
  return pool_vlr.at[layer, slots.reshape(-1)].set(flat, mode="drop")


def write_positions(positions: jax.Array, slots: jax.Array,
                    token_positions: jax.Array) -> jax.Array:
  """Records the logical position of every written slot. [S], [B, C], [B, C]."""
  return positions.at[slots.reshape(-1)].set(
      token_positions.reshape(-1).astype(jnp.int32), mode="drop")


def write_slots(slot_map: np.ndarray | jax.Array, positions, valid, num_slots: int):
  """Destination slots for a chunk: slot_map[b, positions[b, c]] where valid, else
  an out-of-range index (dropped by the scatter), so padding and the sentinel
  are never written.

  Args:
    slot_map: [B, T] int32.
    positions: [B, C] int32 logical positions of the chunk's tokens.
    valid: [B, C] bool.
    num_slots: S, the drop index.
  Returns:
    [B, C] int32.
  """
  xp = jnp if isinstance(slot_map, jax.Array) else np
  pos = xp.clip(positions, 0, slot_map.shape[-1] - 1)
  dest = xp.take_along_axis(slot_map, pos, axis=-1)
  ok = valid & (dest != SENTINEL)
  return xp.where(ok, dest, num_slots).astype(xp.int32)
