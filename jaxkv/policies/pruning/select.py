"""Budgeted retention (IntentKV eq. 1) and the two eviction layouts (section 3.4, app. E).

Every pruning policy reduces to: a score per token `[B, T]`, a forced set (the
protected system prefix and the actionable query span, plus whatever the
method itself always keeps, e.g. StreamingLLM's sinks or SnapKV's window), and
a budget C. `keep_mask` turns them into the kept set

    K = F  u  top_{C*}(A, s),     C* = max(0, C - |F|),   A = live \\ F,

and skips compression for a row whose live length N <= C (appendix H). The
layouts then apply K to the KV state:

- `dead_slot_map` (IntentKV): dropped positions point at SENTINEL; kept tokens
  stay at their slots and logical positions, so RoPE phases and the radix
  identity of the token stream survive. Returning dropped slots to the host
  allocator is `PagedAllocator.evict`, which frees a slot only when no other
  sequence or radix node references it (alias-aware free).
- `compact_layout` (the published baselines): survivors are copied, in order,
  into fresh slots at positions 0..|K|-1 and their keys re-rotated by
  R(p_new - p_old); the sequence is shorter afterwards, so its token stream no
  longer matches any radix prefix (reuse is disabled after eviction).

All functions here are pure jnp over arrays and jit-compatible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv import splice
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import PagedAllocator
from jaxkv.kv.state import SENTINEL


def span_mask(length: int, starts: jax.Array, ends: jax.Array) -> jax.Array:
  """[B, length] bool, True for t in [starts[b], ends[b])."""
  t = jnp.arange(length, dtype=jnp.int32)[None, :]
  return (t >= starts[:, None]) & (t < ends[:, None])


def keep_mask(scores: jax.Array, live: jax.Array, forced: jax.Array,
              budget: jax.Array | int) -> jax.Array:
  """IntentKV eq. 1: forced set plus the top C* = max(0, C - |F|) candidates.

  Args:
    scores: [B, T] float, higher = keep (any scale; only the order matters).
    live: [B, T] bool, tokens currently in the cache (slot != SENTINEL).
    forced: [B, T] bool, always kept when live.
    budget: C, scalar or [B] int.
  Returns:
    [B, T] bool kept set (a subset of `live`). Rows with sum(live) <= C keep
    every live token. Ties break toward the earlier position.
  """
  budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), live.shape[:1])
  forced = forced & live
  cand = live & ~forced
  n_forced = jnp.sum(forced, axis=1)
  k = jnp.maximum(budget - n_forced, 0)
  s = jnp.where(cand, scores.astype(jnp.float32), -jnp.inf)
  order = jnp.argsort(-s, axis=1, stable=True)
  rank = jnp.argsort(order, axis=1, stable=True)          # rank of each position
  keep = forced | (cand & (rank < k[:, None]))
  skip = jnp.sum(live, axis=1) <= budget
  return jnp.where(skip[:, None], live, keep)


def dead_slot_map(slot_map: jax.Array, keep: jax.Array) -> jax.Array:
  """IntentKV eq. 7: S[j] <- SENTINEL for every j not kept; kept slots unchanged."""
  return jnp.where(keep, slot_map, SENTINEL)


def compact_plan(keep: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Where each survivor goes under the compact layout.

  Returns (src [B, T] int32: old position of the i-th survivor, valid only for
  i < n; n [B] int32 survivors per row).
  """
  t = keep.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)
  src = jnp.sort(jnp.where(keep, pos[None, :], t), axis=1).astype(jnp.int32)
  return jnp.minimum(src, t - 1), jnp.sum(keep, axis=1).astype(jnp.int32)


def compact_layout(pool: kv_state.KVPool, slot_map: jax.Array, keep: jax.Array,
                   dest_slots: jax.Array, inv_freq: jax.Array
                   ) -> tuple[kv_state.KVPool, jax.Array, jax.Array]:
  """Left-pack the survivors into fresh slots and re-rotate their keys.

  Args:
    pool: the KV pool.
    slot_map: [B, T] current slot map.
    keep: [B, T] kept set (from `keep_mask`).
    dest_slots: [B, T] int32 fresh slots from the host allocator: entry i < n[b]
      receives the i-th survivor of row b; the rest must be SENTINEL.
    inv_freq: [D/2] `jaxkv.rope.delta_frequencies` of the model (keys are stored
      post-RoPE; the delta rotation R(i - p_old) is exact for default, linear,
      llama3 and YaRN RoPE, with the YaRN magnitude already inside the stored
      key; dynamic NTK has no exact delta and `delta_frequencies` refuses it).
  Returns:
    (pool with survivors copied and re-rotated, new slot map [B, T] = dest
    slots for positions 0..n-1 and SENTINEL after, n [B]).
  """
  src, n = compact_plan(keep)
  b, t = slot_map.shape
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  valid = i < n[:, None]
  old_slots = jnp.take_along_axis(slot_map, src, axis=1)
  ok = valid & (dest_slots != SENTINEL)                        # never write the sentinel
  dest = jnp.where(ok, dest_slots, pool.num_slots)             # out of range: dropped
  new_pool = splice.splice_slots(pool, old_slots.reshape(-1), dest.reshape(-1),
                                 jnp.broadcast_to(i, (b, t)).reshape(-1), inv_freq)
  return new_pool, jnp.where(ok, dest_slots, SENTINEL), n


def evict_dropped(allocator: PagedAllocator, seq: int, keep_row: np.ndarray) -> np.ndarray:
  """Host side of the dead-slot layout for one sequence: every live position not in
  `keep_row` [T] is evicted from the allocator's slot map. Returns the slots that
  became free: a slot still referenced by a kept position of this sequence,
  another sequence (fork / shared prefix) or a radix-cache hold is not freed."""
  smap = allocator.slot_map(seq)
  keep_row = np.asarray(keep_row, bool)[:smap.size]
  dropped = np.nonzero((smap != SENTINEL) & ~keep_row)[0]
  return allocator.evict(seq, dropped)
