"""SemShareKV (seed 001): reuse of a semantically similar prompt's KV through
token-level LSH matching. Pure functions; `jaxkv.engine.semshare` runs them.

E cache (section 4.3.1, A.1). Each prompt token's input embedding, rotated by
RoPE at its position (interleaved pairs (2k, 2k+1), theta_k = theta^(-2k/d), d
the embedding width), so the same token at nearby positions stays close and at
far positions drifts apart: matching then prefers tokens in the same place.

LSH (A.2, FAISS `IndexLSH` semantics). A random rotation to `nbits`
dimensions (orthonormal rows, like FAISS's RandomRotationMatrix), one sign bit
per dimension (bit = value > 0), packed 32 to a uint32; the distance is the
Hamming distance (`jnp.bitwise_count` of the XOR). Given FAISS's own rotation
matrix, the codes and distances equal `faiss.IndexLSH`'s (tested).

Matching. Every target token is matched to the reference token nearest in
Hamming distance; ties go to the reference token nearest in position (so a
prompt matched against itself maps every token to itself). The prompt-level
LSH distance is the mean of those nearest distances, and the similarity
clip(1 - distance / max_dist, 0, 1) (A.3).

Alignment (`aligned_positions`, `SemShareConfig.align`; not in the paper). A
natural edit (a sentence deleted or replaced) shifts every later token, and the
E cache's RoPE then moves the unchanged tokens' codes as far apart as unrelated
ones: on SmolLM2 with 20-40% of the sentences of a 1-2k token text deleted or
replaced, the mean nearest distance was 55-86 bits at the tokens' own positions,
against 80-82 for unrelated texts, so no such pair could pass the gate. So the
target's codes are taken at its tokens' positions in the reference's frame: each
target token is shifted by the offset of the nearest exact 4-gram it shares with
the reference (an anchor: a run occurring once there, nearest preceding; the first
anchor's before it). Unchanged runs then meet their own tokens at distance 0, and
the distance measures the edits: 12-32 bits for those pairs, 76-80 for unrelated
ones (48 pairs, `SemShareConfig.max_dist`).

Recompute and retention (4.3.3, 4.3.4, A.5, A.6), from two signals measured
at layer 0, which is recomputed for every token: the KV deviation (A.4:
||K_reused - K_fresh|| + ||V_reused - V_fresh||) and the mean attention each
token receives (averaged over heads, then over queries). Attention recovery
(eq. 1) at 55% splits hot from cold tokens (r_dynamic = hot share). Layer 1
recomputes the most deviating w_hot of the hot tokens and w_cold of the cold
ones; each later layer keeps the most deviating alpha_recomp(l) of the previous
layer's set (Insight 1: high-deviation tokens stay high-deviation, so one
ranking serves every layer). Layer 0 retains max(0.8, r_dynamic) of the tokens,
layer l retain_0 * alpha^l of them (A.6); the last `recent` tokens are always
recomputed and retained (the readout). Which ones (`cfg.retention`):
- "layer" (default): each layer ranks the tokens by the attention they receive
  at that layer ("the lowest attention scores from recent computations"): at
  layer 0 from every token (the probe's signal; 4.3.4 names the last
  1 - r_dynamic of the prompt, about 90% of it, and a second T x T pass for the
  difference was not worth its cost), at later layers from the last `recent`
  tokens, the ones every layer recomputes (SnapKV's observation window); its
  recomputed tokens (and at layer 0 every hot one) are kept first. The scores
  exist only once the layer has run, so these evictions act on decode: the
  prefill pass reads every token (`layer_retention`);
- "layer0": every layer ranked by layer 0's attention, nested (layer l keeps a
  subset of layer l-1), applied before the pass, so the recomputed tokens of
  later layers already attend without the evicted ones (`plan(...).retain`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import SemShareConfig
from jaxkv.policies.pruning import scores as scores_lib
from jaxkv.policies.pruning import select as select_lib

_BLOCK = 256    # target rows per Hamming / attention block
REUSE_METHODS = ("semshare", "fuzzy_full", "zero", "random", "blend")   # reuse a reference
RETAIN_METHODS = ("semshare", "zero", "random")                         # and evict (4.3.4)


def lsh_planes(dim: int, nbits: int, seed: int) -> np.ndarray:
  """[nbits, dim] float32 orthonormal rows (nbits <= dim) or columns (nbits > dim)
  of a random rotation, deterministic in seed."""
  g = np.random.default_rng(seed).standard_normal((max(dim, nbits), min(dim, nbits)))
  q, r = np.linalg.qr(g)
  q = q * np.sign(np.diag(r))                 # a unique, uniformly random rotation
  return (q.T if nbits <= dim else q).astype(np.float32)


def rope_interleaved(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """[T, D] rows rotated by RoPE at positions [T] (A.1: pairs (2k, 2k+1))."""
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d - d % 2, 2, dtype=jnp.float32) / d)
  ang = positions.astype(jnp.float32)[:, None] * freq[None, :]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  even, odd = x[:, 0:d - d % 2:2], x[:, 1:d - d % 2:2]
  out = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  out = out.reshape(x.shape[0], d - d % 2)
  return jnp.concatenate([out, x[:, d - d % 2:]], axis=-1) if d % 2 else out


def pack_bits(bits: jax.Array) -> jax.Array:
  """[..., nbits] bool -> [..., nbits // 32] uint32 (bit i of word w = bits[32 w + i])."""
  *lead, n = bits.shape
  words = bits.reshape(*lead, n // 32, 32).astype(jnp.uint32)
  return jnp.sum(words << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames=("theta",))
def e_codes(emb: jax.Array, positions: jax.Array, planes: jax.Array, theta: float) -> jax.Array:
  """LSH codes [T, nbits // 32] uint32 of the E cache: embeddings [T, D] at positions [T]."""
  x = rope_interleaved(emb.astype(jnp.float32), positions, theta)
  return pack_bits((x @ planes.T) > 0)


def aligned_positions(target, reference, k: int = 4) -> np.ndarray:
  """[T] int32: each target token's position in the reference's frame (module
  docstring): its own position plus the offset (reference index - target index) of
  the nearest preceding k-gram anchor, a run of k tokens that occurs exactly once in
  the reference and also in the target; the tokens before the first anchor take its
  offset; no anchor: the tokens' own positions. Clipped at 0."""
  t, r = np.asarray(target, np.int64), np.asarray(reference, np.int64)
  own = np.arange(t.size, dtype=np.int64)

  def grams(x):
    n = x.size - k + 1
    h = np.zeros(max(0, n), np.int64)
    for j in range(k if n > 0 else 0):
      h = h * 1_000_003 + x[j:j + n]
    return h

  gt, gr = grams(t), grams(r)
  if not gt.size or not gr.size:
    return own.astype(np.int32)
  uniq, first, count = np.unique(gr, return_index=True, return_counts=True)
  uniq, first = uniq[count == 1], first[count == 1]
  at = np.searchsorted(uniq, gt)
  hit = (at < uniq.size) & (uniq[np.minimum(at, max(0, uniq.size - 1))] == gt)
  if not hit.any():
    return own.astype(np.int32)
  starts = np.flatnonzero(hit)
  offsets = first[at[starts]] - starts
  # the anchor covering each token: the last anchor start at or before it
  which = np.searchsorted(starts, own, side="right") - 1
  off = offsets[np.maximum(which, 0)]
  return np.maximum(own + off, 0).astype(np.int32)


def hamming(a: jax.Array, b: jax.Array) -> jax.Array:
  """[N, W] x [M, W] uint32 codes -> [N, M] int32 Hamming distances."""
  return jnp.sum(jnp.bitwise_count(a[:, None, :] ^ b[None, :, :]), axis=-1, dtype=jnp.int32)


@jax.jit
def nearest(t_codes, t_pos, r_codes, r_pos, r_valid) -> tuple[jax.Array, jax.Array]:
  """Per target token the nearest reference token (ties: nearest in position).

  Args:
    t_codes: [T, W] uint32 target codes; t_pos [T] int32 their positions.
    r_codes: [M, W] uint32 reference codes; r_pos [M]; r_valid [M] bool (padding).
  Returns:
    (index [T] int32 into the reference, Hamming distance [T] int32).
  """
  t = t_codes.shape[0]
  pad = -t % _BLOCK
  tc = jnp.pad(t_codes, ((0, pad), (0, 0))).reshape(-1, _BLOCK, t_codes.shape[1])
  tp = jnp.pad(t_pos, (0, pad)).reshape(-1, _BLOCK)

  def block(args):
    codes, pos = args
    dist = hamming(codes, r_codes)                                       # [BLK, M]
    near = jnp.minimum(jnp.abs(pos[:, None] - r_pos[None, :]), (1 << 20) - 1)
    key = jnp.where(r_valid[None, :], dist * (1 << 20) + near, jnp.iinfo(jnp.int32).max)
    i = jnp.argmin(key, axis=1).astype(jnp.int32)
    return i, jnp.take_along_axis(dist, i[:, None], axis=1)[:, 0]

  idx, dist = jax.lax.map(block, (tc, tp))
  return idx.reshape(-1)[:t], dist.reshape(-1)[:t]


def similarity(dist, max_dist: float) -> float:
  """A.3: clip(1 - mean nearest Hamming distance / max_dist, 0, 1)."""
  d = float(np.mean(np.asarray(dist))) if np.size(dist) else max_dist
  return float(np.clip(1.0 - d / max_dist, 0.0, 1.0))


@jax.jit
def kv_deviation(k_a, v_a, k_b, v_b) -> jax.Array:
  """A.4: per token ||K_a - K_b||_2 + ||V_a - V_b||_2 over [N, Hkv, D] rows."""
  n = k_a.shape[0]
  dk = jnp.linalg.norm((k_a - k_b).reshape(n, -1).astype(jnp.float32), axis=-1)
  dv = jnp.linalg.norm((v_a - v_b).reshape(n, -1).astype(jnp.float32), axis=-1)
  return dk + dv


def column_attention(q: jax.Array, k: jax.Array, valid: jax.Array) -> jax.Array:
  """Mean causal attention each key receives (Insight 2's T vector): every valid
  row of q [C, Hq, D] observing the keys k [C, Hkv, D] (`observer_attention`);
  [C] float32, zero on padding."""
  pos = jnp.where(valid, jnp.arange(q.shape[0], dtype=jnp.int32), -1)
  return jnp.where(valid, observer_attention(q, pos, k, valid), 0.0)


def attention_recovery(scores: np.ndarray, thres: float) -> int:
  """Eq. 1: the fewest tokens (highest scores first) holding `thres` of the total."""
  s = np.sort(np.asarray(scores, np.float64))[::-1]
  total = s.sum()
  if total <= 0 or s.size == 0:
    return int(s.size)
  return int(min(s.size, np.searchsorted(np.cumsum(s), thres * total - 1e-12) + 1))


@functools.partial(jax.jit, static_argnames=("block",))
def observer_attention(q, q_pos, k, live, block: int = _BLOCK) -> jax.Array:
  """Mean causal attention each key receives from a set of observer queries.

  Args:
    q: [R, Hq, D] post-RoPE queries of the observers (any tokens of the prompt);
      q_pos [R] int32 their token indices (-1: padding row).
    k: [T, Hkv, D] the keys as the layer reads them; live [T] bool.
  Returns:
    [T] float32: attention probabilities summed over heads and observers, divided
    by (heads x observers); a key only counts for observers at or after it.
  """
  r, hq, d = q.shape
  # no wider than the observers (rounded up to 8): SemShareKV's 16 recent tokens padded
  # to a 256-row block made every layer's scores 16x the work (0.8 s of a 1.9 s TTFT at
  # 2k tokens on a 2-core CPU)
  block = min(block, -(-r // 8) * 8)
  pad = -r % block
  qb = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(-1, 1, block, hq, d)
  pb = jnp.pad(q_pos, (0, pad), constant_values=-1).reshape(-1, 1, block)

  def one(args):
    qs, ps = args
    w = scores_lib.causal_weights(qs, ps, k[None], live[None])          # [1, Hq, BLK, T]
    return jnp.sum(w, axis=(0, 1, 2))

  total = jnp.sum(jax.lax.map(one, (qb, pb)), axis=0)
  return total / (hq * jnp.maximum(jnp.sum(q_pos >= 0), 1))


@dataclasses.dataclass
class Plan:
  """What one reuse computes and keeps, per layer."""
  recompute: list[np.ndarray]   # [L] token indices recomputed at each layer (S_0 = all)
  retain: np.ndarray            # [L, T] bool: the token's KV stays in layer l's slot map
                                # (retention "layer0"; all True under "layer" until
                                # `layer_retention` replaces it after the pass)
  hot: np.ndarray               # [T] bool
  r_dynamic: float              # hot share (attention recovery / T)
  budgets: np.ndarray | None = None   # [L] tokens layer l keeps (methods with retention)
  forced: np.ndarray | None = None    # [L, T] bool: kept at layer l whatever their score


def _top(candidates: np.ndarray, key: np.ndarray, n: int) -> np.ndarray:
  """The n candidates with the largest key (ties: lower index), sorted."""
  if n >= candidates.size:
    return np.sort(candidates)
  order = np.lexsort((candidates, -key[candidates]))
  return np.sort(candidates[order[:max(0, n)]])


def plan(deviation, attention, cfg: SemShareConfig, num_layers: int) -> Plan:
  """Recompute sets and retention masks for `cfg.method` (see the module doc).

  Args:
    deviation: [T] layer-0 KV deviation of each target token from its match.
    attention: [T] mean attention each token receives at layer 0.
  """
  dev = np.asarray(deviation, np.float64)
  att = np.asarray(attention, np.float64)
  t, L = dev.size, num_layers
  every = np.arange(t)
  recent = every[max(0, t - cfg.recent):]
  n_hot = attention_recovery(att, cfg.hot_threshold)
  hot = np.zeros(t, bool)
  hot[_top(every, att, n_hot)] = True
  sets = [every]
  # a token whose layer-0 K/V equal its match's exactly (deviation 0: the same token at
  # the same position) has nothing to correct, so the deviation-ranked picks skip it:
  # on an identical pair only the recent tokens are recomputed, not the lowest
  # indices that ties among zeros would pick
  moved = dev > 0
  if cfg.method == "blend":
    s = np.union1d(recent, _top(every[moved], dev, int(np.ceil(cfg.blend_ratio * t))))
    sets += [s] * (L - 1)
  else:
    s1 = np.union1d(_top(every[hot & moved], dev, int(round(cfg.w_hot * hot.sum()))),
                    _top(every[~hot & moved], dev, int(round(cfg.w_cold * (~hot).sum()))))
    sets.append(np.union1d(recent, s1))
    for l in range(2, L):
      frac = (l - 2) / max(1, L - 3)
      alpha = cfg.recomp_alpha_first + frac * (cfg.recomp_alpha_last - cfg.recomp_alpha_first)
      prev = sets[-1]
      sets.append(np.union1d(recent, _top(prev[moved[prev]], dev,
                                          int(np.ceil(alpha * prev.size)))))
  retain = np.ones((L, t), bool)
  out = Plan(recompute=sets, retain=retain, hot=hot, r_dynamic=float(n_hot / max(1, t)))
  if cfg.method not in RETAIN_METHODS:
    return out
  n0 = int(np.ceil(max(cfg.retain_first, n_hot / max(1, t)) * t))
  out.forced = np.zeros((L, t), bool)
  out.budgets = np.zeros(L, np.int64)
  kept = every
  for l in range(L):
    forced = np.union1d(sets[min(l + 1, L - 1)] if l == 0 else sets[l], recent)
    if l == 0:
      forced = np.union1d(forced, every[hot])
    out.forced[l, forced] = True
    out.budgets[l] = n = max(int(np.ceil(n0 * cfg.retain_alpha ** l)), forced.size)
    if cfg.retention == "layer0":
      rest = np.setdiff1d(kept, forced)
      kept = np.union1d(forced, _top(rest, att, n - forced.size))
      retain[l] = False
      retain[l, kept] = True
  return out


def layer_retention(p: Plan, layer_scores) -> np.ndarray:
  """[L, T] bool retention "layer": each layer keeps its forced tokens, then the
  highest `layer_scores[l]` (ties: earlier token) up to `p.budgets[l]`
  (`select.keep_mask`, one row per layer)."""
  keep = select_lib.keep_mask(jnp.asarray(layer_scores, jnp.float32),
                              jnp.ones(p.forced.shape, bool), jnp.asarray(p.forced),
                              jnp.asarray(p.budgets, jnp.int32))
  return np.asarray(keep)
