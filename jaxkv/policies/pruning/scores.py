"""Token scores [B, T] of the pruning baselines: StreamingLLM, SnapKV, H2O.

Every scorer is a pure jnp function over post-RoPE queries/keys already
gathered from the pool (`gather_keys`), returns one score per logical position
(higher = keep) and, where the method always keeps some tokens, a forced mask
for `select.keep_mask`. One kept set serves all layers and heads (the slot map
has no head axis), so per-(layer, head) statistics are summed over layers and
GQA-expanded query heads -- the aggregation IntentKV uses for its own rule
score (eq. 3), which keeps the comparison like for like.

Shapes: q [L, B, W, Hq, D] (W query rows with positions q_pos [B, W], padding
rows at position -1); k [L, B, T, Hkv, D]; live [B, T] bool.
"""

from __future__ import annotations

import dataclasses

import einops
import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class StreamingLLMConfig:
  sink: int = 4            # attention sinks kept at the start


@dataclasses.dataclass(frozen=True)
class SnapKVConfig:
  window: int = 32         # observation window: the last W prompt tokens (always kept)
  kernel: int = 7          # 1-D max-pool over positions


@dataclasses.dataclass(frozen=True)
class H2OConfig:
  recent_ratio: float = 0.5   # ratio mode: this share of the budget is the recent floor
  query_block: int = 256      # queries per block when accumulating attention

  def __post_init__(self):
    if not 0.0 <= self.recent_ratio <= 1.0:
      raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")


def random_retention(live: jax.Array, seed: jax.Array | int, event: jax.Array | int) -> jax.Array:
  """Chance control: i.i.d. uniform scores on live positions, so the budgeted top-k
  keeps a uniformly random C* of the candidates (the forced set is kept as for
  every method). One draw per (seed, event); pass something that differs between
  events (the live count does) so a session's events draw independently."""
  key = jax.random.fold_in(jax.random.key(seed), event)
  return jnp.where(live, jax.random.uniform(key, live.shape), -jnp.inf)


def gather_keys(pool_k: jax.Array, slot_map: jax.Array) -> jax.Array:
  """[L, S, Hkv, D] pool gathered at slot_map [B, T] -> [L, B, T, Hkv, D]."""
  return pool_k[:, slot_map]


def first_live(live: jax.Array, n: jax.Array | int) -> jax.Array:
  """[B, T] mask of the first n live positions of each row."""
  n = jnp.asarray(n)
  return live & (jnp.cumsum(live, axis=1) <= (n[:, None] if n.ndim else n))


def last_live(live: jax.Array, n: jax.Array | int) -> jax.Array:
  """[B, T] mask of the last n live positions of each row."""
  from_end = jnp.cumsum(live[:, ::-1], axis=1)[:, ::-1]
  n = jnp.asarray(n)
  return live & (from_end <= (n[:, None] if n.ndim else n))


def _logits(q: jax.Array, k: jax.Array) -> jax.Array:
  """q [B, W, Hq, D], k [B, T, Hkv, D] -> [B, Hq, W, T] float32 scaled logits."""
  qg = einops.rearrange(q, "b w (h g) d -> b w h g d", h=k.shape[2])
  s = jnp.einsum("bwhgd,bthd->bhgwt", qg, k, preferred_element_type=jnp.float32)
  return einops.rearrange(s, "b h g w t -> b (h g) w t") * q.shape[-1] ** -0.5


def causal_weights(q: jax.Array, q_pos: jax.Array, k: jax.Array, live: jax.Array) -> jax.Array:
  """Softmax attention of each query row over live keys at positions <= its own.

  q [B, W, Hq, D], q_pos [B, W], k [B, T, Hkv, D], live [B, T] -> [B, Hq, W, T];
  masked entries are exactly 0 and padding rows (q_pos < 0) are all 0.
  """
  t = jnp.arange(k.shape[1], dtype=jnp.int32)
  mask = live[:, None, :] & (t[None, None, :] <= q_pos[:, :, None])     # [B, W, T]
  s = jnp.where(mask[:, None], _logits(q, k), -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(mask[:, None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  den = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(den > 0, den, 1.0)


def max_pool(scores: jax.Array, kernel: int, where: jax.Array | None = None) -> jax.Array:
  """Each position's score raised to the largest within `kernel` positions around it
  (centred; SnapKV's clustering), so a high-scoring token's neighbours are kept with it.

  scores [B, T]; `where` [B, T] bool: only those positions' scores are pooled, and the
  others keep their own (a forced or dead neighbour lends nothing). kernel 1 returns
  `scores` unchanged.
  """
  if kernel == 1:
    return scores
  src = scores if where is None else jnp.where(where, scores, -jnp.inf)
  pad = kernel // 2
  pooled = lax.reduce_window(src, -jnp.inf, lax.max, (1, kernel), (1, 1),
                             ((0, 0), (pad, kernel - 1 - pad)))
  return pooled if where is None else jnp.where(where, pooled, scores)


def streaming_llm(live: jax.Array, cfg: StreamingLLMConfig = StreamingLLMConfig()):
  """Sinks + most recent: score = position (recency), forced = first `sink` live tokens."""
  t = jnp.arange(live.shape[1], dtype=jnp.float32)
  return jnp.broadcast_to(t, live.shape), first_live(live, cfg.sink)


def snapkv(q_win: jax.Array, win_pos: jax.Array, k: jax.Array, live: jax.Array,
           cfg: SnapKVConfig = SnapKVConfig()):
  """SnapKV: attention of the last W queries, summed over the window, max-pooled.

  Returns (scores [B, T], forced [B, T] = the observation window's positions).
  """
  def layer(carry, qk):
    q, kk = qk
    w = causal_weights(q, win_pos, kk, live)                 # [B, Hq, W, T]
    return carry + jnp.sum(w, axis=(1, 2)), None              # sum over heads and window
  b, t = live.shape
  votes, _ = lax.scan(layer, jnp.zeros((b, t), jnp.float32), (q_win, k))
  pooled = max_pool(votes, cfg.kernel)
  tpos = jnp.arange(t, dtype=jnp.int32)[None, :]
  in_window = (tpos >= jnp.min(jnp.where(win_pos >= 0, win_pos, t), axis=1, keepdims=True))
  return pooled, live & in_window


def h2o(q_all: jax.Array, q_pos: jax.Array, k: jax.Array, live: jax.Array, budget,
        cfg: H2OConfig = H2OConfig()):
  """H2O heavy hitters: attention accumulated over every prompt query (causal).

  Ratio mode: the last `recent_ratio * budget` live tokens are forced (the
  recent floor); the rest of the budget goes to the highest accumulated scores.
  `budget` (scalar or [B]) is the budget H2O itself splits: `policy.select_kept`
  passes the residual budget C* = C - |F| left after the protected tokens.
  Queries are processed in blocks of `cfg.query_block` to bound memory.
  """
  _, b, n, hq, d = q_all.shape
  blk = min(cfg.query_block, n)
  n_p = -(-n // blk) * blk
  q_all = jnp.pad(q_all, ((0, 0), (0, 0), (0, n_p - n), (0, 0), (0, 0)))
  q_pos = jnp.pad(q_pos, ((0, 0), (0, n_p - n)), constant_values=-1)

  def layer(acc, qk):
    q, kk = qk
    def block(acc, i):
      qb = lax.dynamic_slice_in_dim(q, i * blk, blk, axis=1)
      pb = lax.dynamic_slice_in_dim(q_pos, i * blk, blk, axis=1)
      return acc + jnp.sum(causal_weights(qb, pb, kk, live), axis=(1, 2)), None
    acc, _ = lax.scan(block, acc, jnp.arange(n_p // blk))
    return acc, None

  acc, _ = lax.scan(layer, jnp.zeros(live.shape, jnp.float32), (q_all, k))
  recent = jnp.floor(cfg.recent_ratio * jnp.asarray(budget, jnp.float32)).astype(jnp.int32)
  return acc, last_live(live, recent)


__all__ = [
  "H2OConfig",
  "SnapKVConfig",
  "StreamingLLMConfig",
  "causal_weights",
  "first_live",
  "gather_keys",
  "h2o",
  "last_live",
  "max_pool",
  "snapkv",
  "streaming_llm",
]
