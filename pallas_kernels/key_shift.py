"""Keys rotated on read inside the Pallas attention kernels (MemArt's aliased slots).

A slot written at position p and read at position p + delta needs its post-RoPE
key rotated by R(delta) (delta-RoPE: RoPE rotations compose). The reference path
gathers the keys and rotates them with `jaxkv.rope.apply_rope`; the kernels do it
per key block, so a batch holding a MemArt row keeps the kernel instead of falling
back to the reference for every row.

- the shifts are compacted with each row's live tokens (`paged_attention.compact_live`),
  so key block j's shifts sit beside its compacted slots and positions;
- `rotate_rows`: a key block [block_k, D] read and rotated in the kernel:
  k * cos + rotate_half(k) * sin with rotate_half = (-k[D/2:], k[:D/2]). Triton
  cannot slice a tile along its last axis, so the half-swapped block is a second
  load of the same rows with the column index (c + D/2) mod D (an L1/L2 hit: the
  rows were just read), and the sign is a column mask.

Rows with no shift carry 0 and come out unchanged (cos 0 = 1, sin 0 = 0) up to
rounding. This file imports only jax (DESIGN.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def frequency_row(shift_freq: jax.Array) -> jax.Array:
  """inv_freq [D/2] -> [D] (each frequency for both halves, as `apply_rope` lays them)."""
  f = shift_freq.astype(jnp.float32)
  return jnp.concatenate([f, f])


def rotate_reference(k: jax.Array, shift: jax.Array, shift_freq: jax.Array) -> jax.Array:
  """Gathered keys k [B, T, H, D] rotated by R(shift [B, T]) in jnp, as
  `jaxkv.rope.apply_rope` does (cos and sin in k's dtype): the kernels' fallback."""
  angle = frequency_row(shift_freq) * shift.astype(jnp.float32)[..., None]    # [B, T, D]
  cos = jnp.cos(angle)[:, :, None, :].astype(k.dtype)
  sin = jnp.sin(angle)[:, :, None, :].astype(k.dtype)
  half = k.shape[-1] // 2
  return k * cos + jnp.concatenate([-k[..., half:], k[..., :half]], axis=-1) * sin


def rotate_rows(pool_ref, rows, h, live, shift, freq_ref, block_k: int) -> jax.Array:
  """Pool rows [rows, h, :] rotated by R(shift[j]) -> [block_k, D] float32.

  rows: a `pl.ds` (contiguous block, every key live) or slot ids [block_k] with
  their `live` mask (dead keys are not read and come back 0); shift [block_k]
  int32; freq_ref [D] (`frequency_row`)."""
  d = pool_ref.shape[-1]
  cols = lax.broadcasted_iota(jnp.int32, (1, d), 1)
  swap = (cols + d // 2) % d
  if live is None:
    ids = rows.start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    k = plgpu.load(pool_ref.at[ids, h, cols])
    k_sw = plgpu.load(pool_ref.at[ids, h, swap])
  else:
    k = plgpu.load(pool_ref.at[rows[:, None], h, cols], mask=live[:, None], other=0)
    k_sw = plgpu.load(pool_ref.at[rows[:, None], h, swap], mask=live[:, None], other=0)
  angle = shift.astype(jnp.float32)[:, None] * freq_ref[...][None, :]
  sign = jnp.where(cols < d // 2, -1.0, 1.0)
  return (k.astype(jnp.float32) * jnp.cos(angle)
          + sign * k_sw.astype(jnp.float32) * jnp.sin(angle))
