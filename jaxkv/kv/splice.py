"""Splice: K/V rows enter the pool at new positions, exactly re-rotated, or are
aliased in place when their positions do not change.

Keys are stored post-RoPE with the position each slot was written at
(`KVPool.positions`), so moving a key from p_old to p_new is the delta rotation
R(p_new - p_old) (`jaxkv.rope`): exact for default, linear, llama3 and YaRN
RoPE (whose magnitude factor is already inside the stored key), refused for
dynamic NTK by `jaxkv.rope.delta_frequencies`. Values carry no position and
move unchanged, as do LoRA low-rank values.

Rows come from a host store (`KVRows`, e.g. `jax.device_get(gather_rows(...))`
kept by a reuse or memory policy) or straight from another sequence's slots
(`splice_slots`). Every slot of the pool covers all layers, so a splice writes
all of them; per-layer retention is a slot map with a layer axis, and a
selective recompute (`forward.Recompute`) overwrites the layers it recomputes.

`alias_slots` is the zero-copy mode for rows whose positions are unchanged
(a shared prefix or segment at the same offset): the sequence's slot map points
at the shared slots under allocator holds, and nothing is written.

Layer 0's K/V depend only on token and position, so a layer-0 key spliced and
re-rotated to p_new equals a fresh prefill at p_new (tests/test_splice.py runs
this for every RoPE variant): the standing test of the rotation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv.allocator import PagedAllocator
from jaxkv.kv.state import SENTINEL, KVPool
from jaxkv.rope import apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVRows:
  """Rows of K/V for N tokens across every layer, with where they were written."""
  k: jax.Array                  # [L, N, Hkv, D] post-RoPE keys
  v: jax.Array                  # [L, N, Hkv, D]
  positions: jax.Array          # [N] int32 logical position each key was rotated to
  vlr: jax.Array | None = None  # [L, N, r] LoRA low-rank values, or None


def gather_rows(pool: KVPool, slots: jax.Array) -> KVRows:
  """The rows held at `slots` [N] (SENTINEL rows read as zeros at position -1)."""
  return KVRows(k=pool.k[:, slots], v=pool.v[:, slots], positions=pool.positions[slots],
                vlr=None if pool.vlr is None else pool.vlr[:, slots])


def rerotate(k: jax.Array, old_positions: jax.Array, new_positions: jax.Array,
             inv_freq: jax.Array) -> jax.Array:
  """Post-RoPE keys [L, N, Hkv, D] rotated from old to new positions [N] (exact
  delta R(new - old); inv_freq from `jaxkv.rope.delta_frequencies`)."""
  delta = (new_positions - old_positions).astype(jnp.int32)[None]      # [1, N]
  return apply_rope(k, delta, inv_freq, 1.0)


def splice_rows(pool: KVPool, rows: KVRows, dest_slots: jax.Array, new_positions: jax.Array,
                inv_freq: jax.Array) -> KVPool:
  """Writes `rows` into the pool at `dest_slots` [N], keys re-rotated to
  `new_positions` [N]. Destinations that are SENTINEL or >= num_slots (padding)
  are dropped, so the sentinel is never written. Pure: jit it and donate the pool.
  """
  s = pool.num_slots
  dest = jnp.where((dest_slots != SENTINEL) & (dest_slots < s), dest_slots, s)
  new_positions = new_positions.astype(jnp.int32)
  k = rerotate(rows.k, rows.positions, new_positions, inv_freq).astype(pool.k.dtype)
  vlr = pool.vlr
  if vlr is not None and rows.vlr is not None:
    vlr = vlr.at[:, dest].set(rows.vlr.astype(vlr.dtype), mode="drop")
  return KVPool(k=pool.k.at[:, dest].set(k, mode="drop"),
                v=pool.v.at[:, dest].set(rows.v.astype(pool.v.dtype), mode="drop"),
                positions=pool.positions.at[dest].set(new_positions, mode="drop"), vlr=vlr)


def splice_slots(pool: KVPool, src_slots: jax.Array, dest_slots: jax.Array,
                 new_positions: jax.Array, inv_freq: jax.Array) -> KVPool:
  """Copies the rows at `src_slots` [N] (another sequence's) to `dest_slots` [N]
  at `new_positions` [N]; see `splice_rows`."""
  return splice_rows(pool, gather_rows(pool, src_slots), dest_slots, new_positions, inv_freq)


def alias_slots(allocator: PagedAllocator, seq: int, slots, written_at) -> None:
  """Zero-copy splice: appends shared `slots` [k] to `seq`'s slot map under holds.

  Args:
    written_at: [k] the positions those slots were written at (host copy of
      `KVPool.positions[slots]`, or the store's record). They must be exactly
      the positions they will hold in `seq` (its current length onward): an
      alias cannot re-rotate, so anything else must go through `splice_rows`.
  Raises:
    ValueError: positions differ (the message says where).
  """
  slots = np.asarray(slots, np.int32)
  want = allocator.length(seq) + np.arange(slots.size)
  got = np.asarray(written_at).reshape(-1)
  live = slots != SENTINEL
  bad = np.nonzero(live & (got != want))[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"alias needs unchanged positions: slot {slots[i]} was written at "
                     f"{got[i]} but would sit at {want[i]} (splice it with a delta rotation)")
  allocator.adopt(seq, slots)
