"""MemArt (seed 003): conversation history kept as KV blocks and retrieved by
attention. Pure functions over arrays; the runner owns the pool and the index.

Blocks. The pool's pages double as memory blocks (BS = page size). Each block
gets an axis-aligned bounding box (AABB, eq. 2) of its keys, per layer and KV
head: `lo`, `hi` [L, NB, Hkv, D]. The keys are boxed content-only, R(-p)k
(`derotate`): the stored keys are post-RoPE, and a box over 16 rotated keys is
loose in the fast-rotating dimensions (`box_keys=rope` keeps them as stored,
the ablation). A box is 2 x D values per (layer, KV head), 1/8 of a 16-token
block's K/V.

Score (eq. 3, ArkVale's bound). For a query head q and a block K,
I(q, K) = sum_i max(q_i hi_i, q_i lo_i) >= q.k for every k in K (the bound is
attained coordinate-wise), so a block whose bound loses to another's actual
best key can be skipped without losing it. Queries are de-rotated the same way
as the keys, so the product is content against content; a query head h reads
the box of its KV head h // (H / Hkv) (GQA).

Aggregation (eq. 4, Table 1). Each query vector (token x head x layer) first
normalises its scores over the blocks, Softmax (exp(s I) / sum) or Reciprocal
Rank (1 / (rank + c), rank 1 = best), then the normalised scores are aggregated
over every query vector by Max or Sum. The paper selects one set of blocks for
all heads; we take it one step further, one set for all layers too, so a block
is spliced whole and the page is aliased as it lies (the paper does not say how
its layers choose).

Selection. The top-k aggregated blocks (ties: the earlier block), returned in
chronological order (`block_time`), padded with -1 when fewer than k are live.

Neighbours (`dilate`, not in the paper: `MemArtConfig.neighbors`). A block is
BS tokens cut wherever the page ends, so a retrieved block is often half a
sentence. With n > 0 each block's score is first raised to the best score
within n blocks of it (chronologically, in the same written span), so the top k
are whole windows of 2n + 1 blocks around the best ~k / (2n + 1): fewer places,
each read with its context, at the same decode KV length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.config import COMPILER_OPTIONS
from jaxkv.kv.state import SENTINEL
from jaxkv.rope import apply_rope


def derotate(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Content-only vectors R(-p)x from post-RoPE x [..., N, H, D] at positions [N]
  (inv_freq from `jaxkv.rope.delta_frequencies`; RoPE is orthogonal, so this is
  exact up to YaRN's uniform magnitude factor, which no ranking sees)."""
  lead = x.shape[:-3]
  flat = x.reshape((-1,) + x.shape[-3:])                        # [B, N, H, D]
  pos = jnp.broadcast_to(-positions.astype(jnp.int32), flat.shape[:2])
  return apply_rope(flat, pos, inv_freq, 1.0).reshape(lead + x.shape[-3:])


def block_boxes(k: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """AABB of each block's keys (eq. 2).

  Args:
    k: [L, NB, BS, Hkv, D] keys of NB blocks of BS tokens.
    valid: [NB, BS] bool, the tokens that are written (a partly filled block is
      boxed over its written tokens; an empty one gets an empty box, lo > hi).
  Returns:
    lo, hi: [L, NB, Hkv, D] float32.
  """
  m = valid[None, :, :, None, None]
  k = k.astype(jnp.float32)
  lo = jnp.min(jnp.where(m, k, jnp.inf), axis=2)
  hi = jnp.max(jnp.where(m, k, -jnp.inf), axis=2)
  return lo, hi


def box_bound(q: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
  """Eq. 3: I(q, K) = sum_i max(q_i hi_i, q_i lo_i), an upper bound of q.k over K.

  Args:
    q: [L, T, H, D] query vectors of T tokens (H = G x Hkv heads, GQA).
    lo, hi: [L, NB, Hkv, D] block boxes.
  Returns:
    [L, T, H, NB] float32 (an empty box, lo = +inf > hi = -inf, gives -inf).
  """
  l, t, h, d = q.shape
  hkv = lo.shape[2]
  qg = q.astype(jnp.float32).reshape(l, t, hkv, h // hkv, d)
  # max(q hi, q lo) = relu(q) hi + min(q, 0) lo: two matmuls instead of [.., NB, D].
  pos = jnp.einsum("ltkgd,lnkd->ltkgn", jnp.maximum(qg, 0.0), jnp.where(jnp.isfinite(hi), hi, 0.0))
  neg = jnp.einsum("ltkgd,lnkd->ltkgn", jnp.minimum(qg, 0.0), jnp.where(jnp.isfinite(lo), lo, 0.0))
  empty = jnp.any(~jnp.isfinite(lo), axis=-1) | jnp.any(~jnp.isfinite(hi), axis=-1)  # [L, NB, Hkv]
  s = pos + neg
  s = jnp.where(jnp.moveaxis(empty, 1, -1)[:, None, :, None, :], -jnp.inf, s)
  return s.reshape(l, t, h, -1)


def normalise(scores: jax.Array, live: jax.Array, norm: str, scale: float,
              rr_c: float) -> jax.Array:
  """Table 1's per-query normalisation over the block axis (last) of `scores`;
  blocks not `live` [NB] get 0 weight."""
  s = jnp.where(live, scores, -jnp.inf)
  if norm == "softmax":
    return jax.nn.softmax(s * scale, axis=-1, where=live)
  if norm == "rr":
    # rank 1 = best; ties broken toward the earlier block (a stable argsort of -s).
    order = jnp.argsort(-s, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True) + 1
    return jnp.where(live, 1.0 / (rank.astype(jnp.float32) + rr_c), 0.0)
  raise ValueError(f"norm must be softmax or rr, got {norm!r}")


def aggregate(weights: jax.Array, agg: str, query_valid: jax.Array | None = None) -> jax.Array:
  """Table 1's aggregation of normalised weights [..., T, H, NB] over every
  query vector (all axes but the last); `query_valid` [T] drops padded tokens."""
  if query_valid is not None:
    m = query_valid.reshape((1,) * (weights.ndim - 3) + (-1, 1, 1))
    weights = jnp.where(m, weights, 0.0)
  w = weights.reshape(-1, weights.shape[-1])
  if agg == "max":
    return jnp.max(w, axis=0)
  if agg == "sum":
    return jnp.sum(w, axis=0)
  raise ValueError(f"agg must be max or sum, got {agg!r}")


def select_blocks(agg_scores: jax.Array, live: jax.Array, block_time: jax.Array,
                  k: int, tie: jax.Array | None = None) -> jax.Array:
  """The top-k live blocks by aggregated score (ties: the higher `tie` [NB] if
  given, then the earlier block index), in chronological order of `block_time`
  [NB]; [k] int32, -1 past the live count."""
  nb = agg_scores.shape[0]
  k_eff = min(k, nb)
  s = jnp.where(live, agg_scores, -jnp.inf)
  if tie is None:
    order = jnp.argsort(-s, stable=True)[:k_eff]                # best first
  else:
    order = jnp.lexsort((-jnp.where(live, tie, -jnp.inf), -s))[:k_eff]
  ok = live[order]
  t = jnp.where(ok, block_time[order], jnp.iinfo(jnp.int32).max)
  chron = jnp.argsort(t, stable=True)
  idx = jnp.where(ok[chron], order[chron], -1).astype(jnp.int32)
  if k_eff < k:
    idx = jnp.concatenate([idx, jnp.full((k - k_eff,), -1, jnp.int32)])
  return idx


def dilate(scores: jax.Array, live: jax.Array, block_time: jax.Array, segment: jax.Array,
           n: int) -> jax.Array:
  """Each live block's score raised to the best live score within n blocks of
  it: its chronological neighbours (`block_time` one apart per step, no evicted
  gap) written in the same span (`segment` [NB] equal). Dead blocks: -inf; n = 0:
  the scores (dead masked). [NB] float32; O(NB log NB + n NB)."""
  ninf = jnp.float32(-jnp.inf)
  s = jnp.where(live, scores.astype(jnp.float32), ninf)
  if n == 0:
    return s
  big = jnp.iinfo(jnp.int32).max
  order = jnp.argsort(jnp.where(live, block_time, big), stable=True)
  ss, ts, gs, ls = s[order], block_time[order], segment[order], live[order]
  out = ss
  for d in range(1, n + 1):
    for fwd in (True, False):              # the neighbour d blocks earlier, then later
      def sh(x, fill):
        pad = jnp.full((d,), fill, x.dtype)
        return jnp.concatenate([pad, x[:-d]]) if fwd else jnp.concatenate([x[d:], pad])
      ok = sh(ls, False) & (sh(gs, -1) == gs) & (jnp.abs(ts - sh(ts, 0)) == d)
      out = jnp.maximum(out, jnp.where(ok, sh(ss, ninf), ninf))
  out = jnp.where(ls, out, ninf)
  return jnp.zeros_like(out).at[order].set(out)


def select_windows(scores: jax.Array, live: jax.Array, block_time: jax.Array,
                   segment: jax.Array, k: int, n: int) -> jax.Array:
  """`select_blocks` over `dilate`d scores: windows of 2n + 1 blocks around the
  best, a window's ties going to its best block first."""
  return select_blocks(dilate(scores, live, block_time, segment, n), live, block_time, k,
                       tie=scores)


@functools.partial(jax.jit, static_argnames=("k", "norm", "agg", "scale", "rr_c",
                                             "neighbors"))
def retrieve(q: jax.Array, query_valid: jax.Array, lo: jax.Array, hi: jax.Array,
             live: jax.Array, block_time: jax.Array, *, k: int, norm: str, agg: str,
             scale: float, rr_c: float, segment: jax.Array | None = None,
             neighbors: int = 0) -> tuple[jax.Array, jax.Array]:
  """One jitted retrieval: eq. 3 bounds -> Table 1 norm / agg -> chronological top-k.

  Args:
    q: [L, T, H, D] content-only query vectors (`derotate`d) of the new prompt.
    query_valid: [T] bool (padding False).
    lo, hi: [L, NB, Hkv, D] the memory's boxes; live: [NB] bool, the blocks in
      memory; block_time: [NB] int32, their chronological order.
    segment, neighbors: [NB] int32 the span each block was written in, and n of
      `dilate` (0: off, segment unused).
  Returns:
    (blocks [k] int32, chronological, -1 padded; aggregated scores [NB], before
    `dilate`).
  """
  bound = box_bound(q, lo, hi)                                  # [L, T, H, NB]
  w = normalise(bound, live, norm, scale, rr_c)
  agg_scores = aggregate(w, agg, query_valid)
  if neighbors:
    return select_windows(agg_scores, live, block_time, segment, k, neighbors), agg_scores
  return select_blocks(agg_scores, live, block_time, k), agg_scores


def rerank(q: jax.Array, query_valid: jax.Array, candidates: jax.Array, keys: jax.Array,
           key_valid: jax.Array, block_time: jax.Array, *, k: int, norm: str, agg: str,
           scale: float, rr_c: float, live: jax.Array | None = None,
           segment: jax.Array | None = None,
           neighbors: int = 0) -> tuple[jax.Array, jax.Array]:
  """Re-scores candidate blocks by their keys' exact max q.k and keeps the best k.

  q [L, T, H, D] content-only queries; candidates [R] memory rows (-1: none);
  keys [L, R, BS, Hkv, D] their content-only keys, key_valid [R, BS];
  block_time [NB]. Normalised (`norm`) over the candidates alone and
  aggregated (`agg`) as `retrieve` does. With `neighbors` n > 0 (live, segment
  [NB] as in `retrieve`) the candidates' scores are `dilate`d over the whole
  memory, so a window may take a neighbour that was no candidate. Returns (rows
  [k] int32, chronological, -1 padded; the candidates' aggregated exact scores [R]).
  """
  ok = candidates >= 0
  rows = jnp.maximum(candidates, 0)
  exact = exact_block_max(q, keys, key_valid & ok[:, None])            # [L, T, H, R]
  s = aggregate(normalise(exact, ok, norm, scale, rr_c), agg, query_valid)
  if neighbors:
    full = jnp.full(block_time.shape, -jnp.inf, jnp.float32).at[rows].max(
        jnp.where(ok, s, -jnp.inf))
    return select_windows(full, live, block_time, segment, k, neighbors), s
  pick = select_blocks(s, ok, block_time[rows], k)
  return jnp.where(pick >= 0, rows[jnp.maximum(pick, 0)], -1).astype(jnp.int32), s


def exact_block_max(q: jax.Array, k: jax.Array, valid: jax.Array) -> jax.Array:
  """max over a block's keys of q.k, the quantity eq. 3 bounds: q [L, T, H, D],
  k [L, NB, BS, Hkv, D], valid [NB, BS] -> [L, T, H, NB] (tests, tightness)."""
  l, t, h, d = q.shape
  hkv = k.shape[3]
  qg = q.astype(jnp.float32).reshape(l, t, hkv, h // hkv, d)
  s = jnp.einsum("ltkgd,lnbkd->ltkgnb", qg, k.astype(jnp.float32))
  s = jnp.where(valid[None, None, None, None], s, -jnp.inf)
  return jnp.max(s, axis=-1).reshape(l, t, h, -1)


# -- reads of the pool: the runner's jitted retrieval over a probe's queries (pure
#    functions of the pool's keys and the memory's block rows)

@functools.partial(jax.jit, static_argnames=("raw", "pooled"), compiler_options=COMPILER_OPTIONS)
def pool_boxes(pool_k, slots, valid, positions, inv_freq, *, raw: bool, pooled: bool = False):
  """AABBs [L, nb, Hkv, D] of the blocks at slots [nb, BS] (written `valid`);
  `pooled`: [L, nb, 1, D], each over every KV head's keys."""
  l, (nb, bs) = pool_k.shape[0], slots.shape
  k = pool_k[:, slots.reshape(-1)]                                 # [L, nb*BS, Hkv, D]
  if raw:
    k = derotate(k, positions.reshape(-1), inv_freq)
  k = k.reshape((l, nb, bs) + k.shape[2:])
  if pooled:                                   # heads folded into the block's tokens
    k = k.reshape(l, nb, bs * k.shape[3], 1, k.shape[4])
    valid = jnp.repeat(valid, pool_k.shape[2], axis=1)
  return block_boxes(k, valid)


_PROBE_STATIC = ("k", "norm", "agg", "scale", "rr_c", "raw", "neighbors")


@functools.partial(jax.jit, static_argnames=_PROBE_STATIC, compiler_options=COMPILER_OPTIONS)
def retrieve_probe(q, positions, valid, lo, hi, live, times, segment, inv_freq, *, k, norm,
                   agg, scale, rr_c, raw: bool, neighbors: int = 0):
  """q [L, 1, C, Hq, D] post-RoPE at positions [C] -> (blocks [k], scores)."""
  q = q[:, 0]
  if raw:
    q = derotate(q, positions, inv_freq)
  return retrieve(q, valid, lo, hi, live, times, k=k, norm=norm, agg=agg, scale=scale,
                  rr_c=rr_c, segment=segment, neighbors=neighbors)


@functools.partial(jax.jit, static_argnames=_PROBE_STATIC + ("r",),
                   compiler_options=COMPILER_OPTIONS)
def retrieve_probe_rerank(q, positions, valid, lo, hi, live, times, segment, pool_k, slots,
                          block_pos, inv_freq, *, k, r, norm, agg, scale, rr_c, raw: bool,
                          neighbors: int = 0):
  """`retrieve_probe` for r x k candidates (no neighbours yet), then their exact
  re-scoring (`rerank`, neighbours there): only the candidates' keys are
  gathered. -> (blocks [k], candidates' scores)."""
  cand, _ = retrieve_probe(q, positions, valid, lo, hi, live, times, segment, inv_freq,
                           k=r * k, norm=norm, agg=agg, scale=scale, rr_c=rr_c, raw=raw)
  qd = derotate(q[:, 0], positions, inv_freq)
  rows = jnp.maximum(cand, 0)
  cs = slots[rows]                                                      # [R, BS]
  keys = pool_block_keys(pool_k, cs, block_pos[rows], inv_freq)
  return rerank(qd, valid, cand, keys, cs != SENTINEL, times, k=k, norm=norm, agg=agg,
                scale=scale, rr_c=rr_c, live=live, segment=segment, neighbors=neighbors)


def pool_block_keys(pool_k, slots, block_pos, inv_freq):
  """Content-only keys [L, n, BS, Hkv, D] of the blocks at slots / block_pos [n, BS]."""
  k = derotate(pool_k[:, slots.reshape(-1)], block_pos.reshape(-1), inv_freq)
  return k.reshape((k.shape[0],) + slots.shape + k.shape[2:])


@functools.partial(jax.jit, static_argnames=("norm", "agg", "scale", "rr_c"),
                   compiler_options=COMPILER_OPTIONS)
def exact_probe_scores(q, positions, valid, pool_k, slots, block_pos, live, inv_freq, *, norm,
                       agg, scale, rr_c):
  """Aggregated scores [cap] from each block's exact content-only max q.k (the
  quantity eq. 3 bounds): q [L, 1, C, Hq, D] post-RoPE at positions [C]; the blocks'
  keys at slots / block_pos [cap, BS] (SENTINEL: unused entry)."""
  qd = derotate(q[:, 0], positions, inv_freq)
  k = pool_block_keys(pool_k, slots, block_pos, inv_freq)
  exact = exact_block_max(qd, k, slots != SENTINEL)             # [L, C, Hq, cap]
  return aggregate(normalise(exact, live, norm, scale, rr_c), agg, valid)
