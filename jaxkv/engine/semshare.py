"""SemShareRunner: prompts served with SemShareKV (seed 001) on the substrate's
aliasing, per-layer slot maps and selective recompute.

One request (`prefill`):
1. the prompt's E-cache codes (embeddings, RoPE, LSH sign bits) are matched
   against every stored reference prompt (`policies.reuse.semshare.nearest`);
   the most similar reference is reused when its similarity reaches the
   threshold (0.8), otherwise the prompt is prefilled in full and stored as a
   reference (its slots held in the pool, its codes on the host; LRU under a
   byte budget). Methods that never reuse (full, the compression baselines)
   neither match nor store;
2. reuse: every target token gets a fresh slot, and is matched to a reference
   slot that its slot-map entries alias (no copy: the reference's post-RoPE
   K/V are read in place, not re-rotated, as the paper found best; the slots
   are held while the target lives);
3. the probe pass recomputes layer 0 for every token (the paper's first-layer
   full recompute) and measures each token's KV deviation from its match and
   the attention it receives; `semshare.plan` turns them into per-layer
   recompute sets and retention masks;
4. the second pass runs layers 1..L-1 with those sets (`forward.Recompute`, in
   up to `max_passes` windows of their own width) over a slot map with a layer
   axis [L, 1, T]: layer l reads a token's fresh slot where it was recomputed
   at l, its alias elsewhere (and, under retention "layer0", SENTINEL where
   layer l evicted it);
5. retention "layer" (the default): layer 0 ranks the tokens by the probe's
   attention, each later layer by the attention of its last `recent` queries
   over the keys it read (`semshare.observer_attention`), and each layer's
   evicted entries become SENTINEL for decode; then the first token's logits are read
   (TTFT stops, the scoring inside it); tokens evicted at every layer give
   their fresh slot back at once.

The compression baselines (snapkv / pyramidkv / h2o) prefill in full and then
keep each layer's own tokens (`policies.pruning.layerwise`), through the same
layer-axis slot map.

Memory is reported two ways: `kv_slots` (pool slots the request owns: one
slot spans every layer in this pool, so retention frees a slot only when a
token is evicted at all layers) and `live_entries` / `shared_entries` (layer x
token entries kept, and of those the ones aliased to the reference: what a
layer-paged pool would hold and share).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import COMPILER_OPTIONS, CacheConfig, SemShareConfig
from jaxkv.engine.driver import Driver, chunk_step, continue_one
from jaxkv.engine.kv_manager import KVManager
from jaxkv.engine.prefill_work import drain, pad_to
from jaxkv.kv import plan as plan_lib
from jaxkv.kv.allocator import OutOfSlotsError
from jaxkv.kv.state import SENTINEL
from jaxkv.models.forward import Capture, LayerWindow
from jaxkv.policies.pruning import layerwise
from jaxkv.policies.reuse import semshare
from jaxkv.policies.reuse.passes import layer_flops, layer_passes, recompute_index


@dataclasses.dataclass
class Reference:
  """A stored prompt: its ids, the pool slots held for it and its E-cache codes."""
  ids: np.ndarray        # [M] int32
  slots: np.ndarray      # [M] int32 pool slots (held by the store)
  codes: np.ndarray      # [M, nbits // 32] uint32
  nbytes: int            # held pool bytes + code bytes


@dataclasses.dataclass
class SemPrefill:
  """The outcome of one `prefill`."""
  seq: int
  ids: np.ndarray
  logits: np.ndarray             # [V] float32 at the last prompt token
  similarity: float              # to the best reference (0.0: none stored)
  reused: bool                   # the reference's KV was used
  slot_map: np.ndarray           # [L, T] per-layer slot map of the prompt
  layer_tokens: np.ndarray       # [L] tokens computed at each layer
  flops: float
  ttft_s: float
  match_s: float                 # E-cache codes + matching (inside ttft_s)
  kv_slots: int                  # pool slots this request owns after the prompt
  live_entries: int              # layer x token entries in the slot map
  shared_entries: int            # of those, aliased to the reference
  r_dynamic: float = 0.0

  @property
  def layer_kept(self) -> np.ndarray:
    """[L] prompt entries each layer keeps for decode."""
    return (self.slot_map != SENTINEL).sum(axis=1)

  @property
  def recomputed_share(self) -> float:
    """Token-layers computed / (L x T)."""
    return float(self.layer_tokens.sum()) / max(1, self.layer_tokens.size * self.ids.size)


@functools.partial(jax.jit, static_argnames=("graphdef", "theta"),
                   compiler_options=COMPILER_OPTIONS)
def _codes(graphdef, weights, tokens, positions, planes, theta: float):
  emb = nnx.merge(graphdef, weights).embed[...][tokens]
  return semshare.e_codes(emb, positions, planes, theta)


@jax.jit
def _probe_signals(pool, fresh, alias, q, valid):
  """Layer-0 KV deviation of each token from its alias, and the mean attention
  each token receives (q [C, Hq, D], fresh / alias slots [C])."""
  dev = semshare.kv_deviation(pool.k[0, fresh], pool.v[0, fresh], pool.k[0, alias],
                              pool.v[0, alias])
  return dev, semshare.column_attention(q, pool.k[0, fresh], valid)


@jax.jit
def _retention_scores(pool, lmap, q, q_pos, live):
  """[L - 1, C] attention each token receives at layers 1..L-1 from that layer's
  observers (q [L - 1, R, Hq, D], q_pos [L - 1, R] token indices or -1), the keys
  read through the layer's slot map lmap [L - 1, C] (fresh or aliased slots)."""
  def one(args):
    l, ql, pl = args
    return semshare.observer_attention(ql, pl, pool.k[l][lmap[l - 1]], live)
  return jax.lax.map(one, (1 + jnp.arange(lmap.shape[0]), q, q_pos))


@functools.partial(jax.jit, static_argnames=("method",))
def _layer_keep(pool, q, positions, fresh, budgets, *, method: str):
  """[L, 1, C] the tokens each layer keeps (q [L, 1, C, Hq, D] of the prefill)."""
  k = pool.k[:, fresh][:, None]                                     # [L, 1, C, Hkv, D]
  return layerwise.layer_keep(q, positions, k, positions >= 0, budgets, method=method)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _zero_slot(pool, slot):
  return dataclasses.replace(pool, k=pool.k.at[:, slot].set(0), v=pool.v.at[:, slot].set(0))


def _pad(x, n: int, value=0) -> np.ndarray:
  x = np.asarray(x)
  return np.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


_OWNER = "semshare"  # this runner's name in the KV manager (its allocations, its evictor)


class SemShareRunner:
  """A pool, its allocator and the reference store, for one model.

  Args:
    llm: a loaded `LLM`.
    cfg: the method and its parameters (`SemShareConfig`).
    cache: the pool (references live in it, held, until the store evicts them).
    attn_impl: `jaxkv.ops` implementation.
    max_passes: layer windows of the second pass (see `engine.reuse.layer_passes`).
  """

  def __init__(self, llm, cfg: SemShareConfig = SemShareConfig(), *,
               cache: CacheConfig = CacheConfig(num_pages=2048, page_size=16,
                                                max_seq_len=8192),
               attn_impl: str = "auto", max_passes: int = 4, kv: KVManager | None = None):
    self.cfg, self.mcfg, self.tok = cfg, llm.config, llm.tokenizer
    self.kv = kv if kv is not None else KVManager(self.mcfg, cache, llm.graphdef, llm.weights,
                                                  attn_impl=attn_impl)
    # the KV manager's weights: sharded like its pool when it serves a mesh
    self.graphdef, self.weights = self.kv.graphdef, self.kv.weights
    self.alloc = self.kv.allocator
    self.kv.register_evictor(_OWNER, self._give_back, self._held_slots)
    self.max_len, self.max_passes = cache.max_seq_len, max_passes
    self.planes = jnp.asarray(semshare.lsh_planes(self.mcfg.hidden_size, cfg.nbits,
                                                  cfg.lsh_seed))
    m = self.mcfg
    self.slot_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * np.dtype(
        cache.dtype).itemsize
    self.refs: collections.OrderedDict[int, Reference] = collections.OrderedDict()
    self.nbytes, self._next_ref = 0, 0
    self._holds: dict[int, np.ndarray] = {}       # seq -> aliased slots it holds
    self.zero_slot = None
    if cfg.method == "zero":            # one slot of zeros that matched entries alias
      self._zero_seq = self.alloc.new_sequence()
      self.zero_slot = int(self.kv.extend(self._zero_seq, 1, owner=_OWNER)[0])
      self.driver.kv = _zero_slot(self.driver.kv, self.zero_slot)
    # [L] per-layer budgets of the compression baselines in place of their own
    # (None: `compress_keep` / `h2o_keep`); a benchmark sets it to compare eviction
    # rules at identical per-layer budgets
    self.layer_budgets: np.ndarray | None = None

  @property
  def driver(self) -> Driver:
    """The KV manager's driver (the pool every step runs on)."""
    return self.kv.driver

  # ------------------------------------------------------------------ the store
  def _store(self, ids: np.ndarray, slots: np.ndarray, codes: np.ndarray) -> int | None:
    nbytes = int(slots.size * self.slot_bytes + codes.nbytes)
    if nbytes > self.cfg.byte_budget:
      return None
    while self.refs and self.nbytes + nbytes > self.cfg.byte_budget:
      self.forget(next(iter(self.refs)))
    self.alloc.retain(slots)
    key, self._next_ref = self._next_ref, self._next_ref + 1
    self.refs[key] = Reference(ids.copy(), slots.copy(), codes, nbytes)
    self.nbytes += nbytes
    return key

  def forget(self, key: int) -> None:
    """Drops a stored reference (its slots are freed once no target aliases them)."""
    ref = self.refs.pop(key)
    self.nbytes -= ref.nbytes
    self.alloc.release(ref.slots)

  def reset(self) -> None:
    for key in list(self.refs):
      self.forget(key)

  def _extend(self, seq: int, n: int) -> np.ndarray:
    """`KVManager.extend`, forgetting this runner's least recently used references
    first while the pool is too full (their slots free once no live target aliases
    them), then letting the manager make room from the other caches on the pool."""
    while True:
      try:
        return self.kv.extend(seq, n, owner=_OWNER, make_room=not self.refs)
      except OutOfSlotsError:
        if not self.refs:
          raise
        self.forget(next(iter(self.refs)))

  def _give_back(self, pages: int, shard: int = 0) -> int:
    """The KV manager's evictor: forgets least recently used references until
    `pages` pages of `shard` came free or none is left; returns the pages freed."""
    free0 = self.alloc.shard_free_pages(shard)
    while self.refs and self.alloc.shard_free_pages(shard) - free0 < pages:
      self.forget(next(iter(self.refs)))
    return self.alloc.shard_free_pages(shard) - free0

  def _held_slots(self) -> np.ndarray:
    """The slots the stored references hold (what forgetting them all releases)."""
    slots = [r.slots for r in self.refs.values()]
    return np.concatenate(slots) if slots else np.zeros(0, np.int32)

  def release(self, seq: int) -> None:
    self.alloc.free_sequence(seq)
    self.drop_holds(seq)

  def drop_holds(self, seq: int) -> None:
    """Releases the reference slots `seq`'s prompt aliased (held while it lives)."""
    held = self._holds.pop(seq, None)
    if held is not None and held.size:
      self.alloc.release(held)

  # -------------------------------------------------------------------- prefill
  def codes(self, ids, offset: int = 0, positions: np.ndarray | None = None) -> np.ndarray:
    """[n, nbits // 32] uint32 E-cache LSH codes of a prompt whose first token sits
    at position `offset`, or whose tokens sit at `positions` [n] (no pool touched)."""
    ids = np.asarray(ids, np.int32)
    c = plan_lib.chunk_len(ids.size)
    if positions is None:
      positions = np.arange(ids.size) + offset
    pos = _pad(np.asarray(positions, np.int32), c)
    return np.asarray(_codes(self.graphdef, self.weights, jnp.asarray(_pad(ids, c)),
                             jnp.asarray(pos), self.planes, self.cfg.e_rope_theta))[:ids.size]

  def _nearest(self, ids: np.ndarray, codes: np.ndarray | None, ref_ids: np.ndarray,
               ref_codes: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(index [n], distance [n]) of each target token's nearest reference token:
    with `SemShareConfig.align` the target's codes are taken at its positions in the
    reference's frame (`semshare.aligned_positions`), else at its own positions plus
    `offset` (`codes`: those, precomputed, or None)."""
    n = ids.size
    if self.cfg.align:
      pos = semshare.aligned_positions(ids, ref_ids)
      codes = self.codes(ids, positions=pos)
    else:
      pos = np.arange(offset, offset + n, dtype=np.int32)
      codes = self.codes(ids, offset) if codes is None else codes[:n]
    c, m = plan_lib.chunk_len(n), ref_codes.shape[0]
    w = plan_lib.chunk_len(m)
    idx, dist = semshare.nearest(jnp.asarray(_pad(codes, c)), jnp.asarray(_pad(pos, c)),
                                 jnp.asarray(_pad(ref_codes, w)),
                                 jnp.asarray(np.arange(w, dtype=np.int32)),
                                 jnp.asarray(np.arange(w) < m))
    return np.asarray(idx)[:n], np.asarray(dist)[:n]

  def match(self, reference, target, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(index [T] into the reference, Hamming distance [T]): every target token's
    nearest reference token, as `prefill` matches it; without `SemShareConfig.align`
    the target may be placed `offset` positions later than usual (the alignment
    takes any such shift back)."""
    reference, target = np.asarray(reference, np.int32), np.asarray(target, np.int32)
    return self._nearest(target, None, reference, self.codes(reference), offset)

  def similarity(self, reference, target) -> float:
    """A.3 similarity of target to reference (what `prefill` would compare to the
    threshold), without serving either: bins pairs the same way for every method."""
    return semshare.similarity(self.match(reference, target)[1], self.cfg.max_dist)

  def _best(self, ids: np.ndarray, codes: np.ndarray):
    """(key, similarity, index [n], distance [n]) of the most similar reference."""
    best = (None, 0.0, None, None)
    for key, ref in reversed(self.refs.items()):
      idx, dist = self._nearest(ids, codes, ref.ids, ref.codes)
      sim = semshare.similarity(dist, self.cfg.max_dist)
      if best[0] is None or sim > best[1]:
        best = (key, sim, idx, dist)
    return best

  def prefill(self, ids) -> SemPrefill:
    """Serves the prompt `ids` (see the module docstring); the sequence stays live
    for `decode` until `release`."""
    ids = plan_lib.prompt_ids(ids, self.max_len)
    t0 = time.perf_counter()
    found = self.find(ids)
    seq = self.alloc.new_sequence()
    try:
      self._extend(seq, ids.size)
    except Exception:
      self.alloc.free_sequence(seq)
      raise
    return self.prefill_into(seq, ids, found, t0=t0)

  def find(self, ids: np.ndarray) -> tuple:
    """Step 1: (codes or None, best reference key or None, its similarity, the
    index [n] of each token's match, seconds), the reference moved to the end of
    the LRU order when it will be reused (the last a full pool would forget)."""
    t0 = time.perf_counter()
    key, sim, idx, codes = None, 0.0, None, None
    if self.cfg.method in semshare.REUSE_METHODS:   # the others never reuse: no matching
      codes = self.codes(ids)
      key, sim, idx, _ = self._best(ids, codes)
      if key is not None and sim >= self.cfg.threshold:
        self.refs.move_to_end(key)
    return codes, key, sim, idx, time.perf_counter() - t0

  def prefill_into(self, seq: int, ids: np.ndarray, found: tuple | None = None, *,
                   t0: float | None = None) -> SemPrefill:
    """Steps 2-5 over a live sequence with fresh slots for every prompt token, each
    pass in one call (`prefill_steps` run to its end); `found`: `find`'s answer
    (None: found now, after the slots were taken)."""
    return drain(self.prefill_steps(seq, ids, found, t0=t0), self.driver, 0)

  def prefill_steps(self, seq: int, ids: np.ndarray, found: tuple | None = None, *,
                    chunk: int | None = None, t0: float | None = None, store: bool = True,
                    budgets=None):
    """`prefill_into` as a generator (what the engine's `SemShare` mechanism runs on
    its row): with `chunk`, every pass (the full prefill, the layer-0 probe, each
    window of the second pass) runs at most `chunk` prompt tokens per model call,
    with a bare yield between calls, so a long prompt delays the engine's decoding
    rows by one chunk at a time. The pieces are exact: a token's causal attention
    reads only earlier columns, which earlier pieces of the same pass wrote.
    `store`: False leaves the reference store as it was (the prompt is not stored,
    whether or not it reused: an evaluation's teacher-forced twin of a request);
    `budgets`: [L] per-layer counts the compression baselines keep for this prompt
    (None: `layer_budgets`). Returns the `SemPrefill`."""
    n, L = ids.size, self.mcfg.num_layers
    t0 = time.perf_counter() if t0 is None else t0
    codes, key, sim, idx, match_s = self.find(ids) if found is None else found
    c = plan_lib.chunk_len(n)
    matching = codes is not None
    fresh = self.alloc.slot_map(seq)[:n]
    reuse = matching and key is not None and sim >= self.cfg.threshold and key in self.refs
    run = _Pieces(self, ids, c, chunk)
    if not reuse:
      compress = self.cfg.method in layerwise.LAYERWISE_METHODS
      q_parts = []
      for a, b in run.pieces:
        yield from run.pause()
        out = run.call(a, b, lambda w: plan_lib.slot_rows([fresh], w),
                       capture=Capture(q=compress), read=b == n)
        q_parts.append(None if out.q is None else out.q[:, :, :b - a])
      layer_map = np.broadcast_to(fresh, (L, n)).copy()
      if compress:                       # the baselines: each layer keeps its own tokens
        q = pad_to(jnp.concatenate(q_parts, axis=2), c, 2)
        keep = np.asarray(_layer_keep(self.driver.kv, q, jnp.asarray(run.positions[None]),
                                      jnp.asarray(_pad(fresh, c)), self._budgets(n, budgets),
                                      method=self.cfg.method))[:, 0, :n]
        layer_map[~keep] = SENTINEL
      logits = np.asarray(jax.device_get(out.logits[0, 0]), np.float32)
      ttft = time.perf_counter() - t0
      kv_slots = n
      if compress:
        gone = np.flatnonzero(~keep.any(axis=0))
        self.alloc.evict(seq, gone)
        kv_slots -= gone.size
      if matching and store:
        self._store(ids, fresh, codes[:n])
      return SemPrefill(seq=seq, ids=ids, logits=logits, similarity=sim, reused=False,
                        slot_map=layer_map, layer_tokens=np.full(L, n, np.int64),
                        flops=self._flops([np.arange(n)] * L, n), ttft_s=ttft,
                        match_s=match_s, kv_slots=kv_slots,
                        live_entries=int((layer_map != SENTINEL).sum()), shared_entries=0)
    ref = self.refs[key]
    if self.cfg.method == "zero":
      alias = np.full(n, self.zero_slot, np.int32)
    elif self.cfg.method == "random":
      # drawn from the prompt and the reference, not from a running stream: a prompt
      # gets the same random match however many came before it (an evaluation's
      # teacher-forced twin the same as its request)
      rng = np.random.default_rng([self.cfg.lsh_seed, zlib.crc32(ids.tobytes()),
                                   zlib.crc32(ref.ids.tobytes())])
      alias = ref.slots[rng.integers(0, ref.slots.size, n)]
    else:
      alias = ref.slots[idx]
    # probe: layer 0 for every token, fresh slots only
    q0, xs = [], []
    for a, b in run.pieces:
      yield from run.pause()
      out0 = run.call(a, b, lambda w: plan_lib.slot_rows([fresh], w), lo=0, hi=1,
                      capture=Capture(q=True))
      q0.append(out0.q[0, 0, :b - a])
      xs.append(out0.hidden[:, :b - a])
    dev, att = _probe_signals(self.driver.kv, jnp.asarray(_pad(fresh, c)),
                              jnp.asarray(_pad(alias, c)), pad_to(jnp.concatenate(q0), c, 0),
                              jnp.asarray(np.arange(c) < n))
    p = semshare.plan(np.asarray(dev)[:n], np.asarray(att)[:n], self.cfg, L)
    layer_map = np.empty((L, n), np.int32)
    for l, s in enumerate(p.recompute):
      layer_map[l] = alias
      layer_map[l, s] = fresh[s]
    by_layer = p.budgets is not None and self.cfg.retention == "layer"
    if not by_layer:
      layer_map[~p.retain] = SENTINEL
    obs_q = [None] * L                    # retention "layer": layer l's observers' q
    # the rest of the layers, as few passes as their widths allow
    x = jnp.concatenate(xs, axis=1)
    lmap = lambda w: np.stack([plan_lib.slot_rows([m], w) for m in layer_map])
    for lo, hi in layer_passes([s.size for s in p.recompute], 1, L, self.max_passes):
      xs, qs = [], [[] for _ in range(lo, hi)]
      for a, b in run.pieces:
        yield from run.pause()
        out = run.call(a, b, lmap, lo=lo, hi=hi, x=x, sets=p.recompute, write=fresh,
                       capture=Capture(q=by_layer), read=hi == L and b == n)
        if hi < L:
          xs.append(out.hidden[:, :b - a])
        if by_layer:                      # per layer its recomputed rows, in index order
          for l in range(lo, hi):
            s = p.recompute[l]
            qs[l - lo].append(out.q[l - lo, 0, :int(((s >= a) & (s < b)).sum())])
      x = jnp.concatenate(xs, axis=1) if hi < L else None
      if by_layer:                        # the last rows: the recent tokens, recomputed
        for l in range(lo, hi):
          m = p.recompute[l].size
          obs_q[l] = jnp.concatenate(qs[l - lo])[m - min(self.cfg.recent, n):m]
    if by_layer:                          # evict for decode, by each layer's own attention
      p.retain = self._layer_retention(p, layer_map, obs_q, np.asarray(att)[:n], c)
      layer_map[~p.retain] = SENTINEL
    logits = np.asarray(jax.device_get(out.logits[0, 0]), np.float32)
    ttft = time.perf_counter() - t0
    # after the first token: give back what no layer keeps, hold what is aliased
    gone = np.flatnonzero(~p.retain.any(axis=0))
    self.alloc.evict(seq, gone)
    used = p.retain.copy()                           # [L, T] entries read from the alias
    for l, s in enumerate(p.recompute):
      used[l, s] = False
    held = np.unique(alias[used.any(axis=0)])
    self.alloc.retain(held)
    self._holds[seq] = held
    if self.cfg.store_reused and store:
      self._store(ids, fresh, codes[:n])
    return SemPrefill(seq=seq, ids=ids, logits=logits, similarity=sim, reused=True,
                      slot_map=layer_map, layer_tokens=np.asarray([s.size for s in p.recompute]),
                      flops=self._flops(p.recompute, n), ttft_s=ttft, match_s=match_s,
                      kv_slots=n - gone.size, live_entries=int(p.retain.sum()),
                      shared_entries=int(used.sum()), r_dynamic=p.r_dynamic)

  def _layer_retention(self, p, layer_map, obs_q, att0, c: int) -> np.ndarray:
    """Retention "layer" (`semshare.layer_retention`): layer 0 by the probe's
    attention `att0`, layer l >= 1 by its observers' queries `obs_q[l]` over the
    keys its slot map reads (one jitted call for layers 1..L-1)."""
    L, n = layer_map.shape
    if L == 1:
      return semshare.layer_retention(p, att0[None])
    obs = np.arange(n - obs_q[1].shape[0], n)                        # the recent tokens
    q = jnp.stack(obs_q[1:])                                         # [L - 1, R, Hq, D]
    q_pos = np.broadcast_to(obs, (L - 1, obs.size)).astype(np.int32)
    lmap = np.stack([_pad(m, c, SENTINEL) for m in layer_map[1:]])
    got = _retention_scores(self.driver.kv, jnp.asarray(lmap), q, jnp.asarray(q_pos),
                            jnp.asarray(np.arange(c) < n))
    return semshare.layer_retention(p, np.concatenate([att0[None], np.asarray(got)[:, :n]]))

  def _budgets(self, n: int, budgets=None) -> jax.Array:
    """[L] tokens each layer keeps under the compression baselines (`budgets`, else
    `layer_budgets` when set: e.g. SemShareKV's own per-layer counts on the same
    prompt)."""
    L = self.mcfg.num_layers
    budgets = self.layer_budgets if budgets is None else budgets
    if budgets is not None:
      budgets = np.asarray(budgets)
      if budgets.shape != (L,):
        raise ValueError(f"layer budgets must hold one count per layer ({L}), "
                         f"got shape {budgets.shape}")
      return jnp.asarray(np.clip(budgets, 1, n).astype(np.int32))
    if self.cfg.method == "h2o":
      return jnp.full((L,), int(np.ceil(self.cfg.h2o_keep * n)), jnp.int32)
    mean = int(np.ceil(self.cfg.compress_keep * n))
    if self.cfg.method == "pyramidkv":
      return jnp.asarray(layerwise.pyramid_budgets(mean, L, n))
    return jnp.full((L,), mean, jnp.int32)

  def _flops(self, sets, n: int) -> float:
    pos = np.arange(n, dtype=np.float64) + 1
    return (sum(layer_flops(self.mcfg, s.size, pos[s].sum()) for s in sets)
            + 2.0 * self.mcfg.hidden_size * self.mcfg.vocab_size)

  # --------------------------------------------------------------------- decode
  def decode(self, pre: SemPrefill, max_tokens: int, *, forced=None,
             stop_ids=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Greedy continuation (or teacher forcing with `forced`: log p per token)
    over the prompt's per-layer slot map; returns (tokens, log p or None). With
    `stop_ids` the tokens end at the first stop token (included). The
    continuation's slots are given back afterwards, so the prompt can be
    continued again (e.g. teacher-forced, then greedy)."""
    n = pre.ids.size
    if n + max_tokens > self.max_len:
      raise ValueError(f"{n} + {max_tokens} tokens exceed max_seq_len {self.max_len}")
    new = self._extend(pre.seq, max_tokens)
    width = plan_lib.width(n + max_tokens)
    L = self.mcfg.num_layers
    full = np.concatenate([pre.slot_map, np.broadcast_to(new, (L, max_tokens))], axis=1)
    lmap = np.stack([plan_lib.slot_rows([m], width) for m in full])
    wmap = plan_lib.slot_rows([self.alloc.slot_map(pre.seq)], width)
    toks, lp = continue_one(self.driver, pre.logits, n, lmap, max_tokens, forced=forced,
                            stop_ids=stop_ids, write_map=wmap)
    self.alloc.truncate(pre.seq, n)
    return toks, lp


class _Pieces:
  """A prompt's model calls in token pieces of at most `chunk` tokens (None: the
  whole prompt in one call, padded to `c`) over the runner's pool."""

  def __init__(self, runner, ids: np.ndarray, c: int, chunk: int | None):
    self.r, self.ids, self.c, n = runner, ids, c, ids.size
    size = n if not chunk else int(chunk)
    self.pieces = [(a, min(a + size, n)) for a in range(0, n, size)]
    self.positions = np.where(np.arange(c) < n, np.arange(c), -1).astype(np.int32)
    self.calls = 0

  def pause(self):
    """A bare yield before every call but the first (the engine's decode rows run)."""
    if self.calls:
      yield
    self.calls += 1

  def call(self, a: int, b: int, slot_map, *, lo: int | None = None, hi: int | None = None,
           x=None, sets=None, write=None, capture: Capture = Capture(), read: bool = False):
    """One `chunk_step` over prompt tokens [a, b): slot_map(width) its slot map; with
    lo / hi a layer window (x [1, n, D]: the window's input, None: embeddings), sets
    the per-layer recompute sets (prompt indices), write the tokens' own slots [n]."""
    r, n = self.r, self.ids.size
    cl = self.c if (a, b) == (0, n) else plan_lib.chunk_len(b - a, self.c)
    kw = {}
    if lo is not None:
      kw["window"] = LayerWindow(hidden_in=None if x is None else pad_to(x[:, a:b], cl, 1),
                                 start=lo, stop=hi)
    if sets is not None:
      kw["recompute"] = recompute_index(sets, lo, hi, a, b)
    if write is not None:
      kw["write_slots"] = jnp.asarray(_pad(write[a:b], cl, r.driver.kv.num_slots)[None])
    out, r.driver.kv = chunk_step(
        r.graphdef, r.weights, r.driver.kv, jnp.asarray(_pad(self.ids[a:b], cl)[None]),
        jnp.asarray(np.where(np.arange(cl) < b - a, np.arange(cl) + a, -1)
                    .astype(np.int32)[None]),
        jnp.asarray(slot_map(plan_lib.width(b))),
        read=jnp.asarray([[n - 1 - a]], np.int32) if read else None, capture=capture,
        return_hidden=hi is not None and hi < r.mcfg.num_layers, return_logits=read,
        attn_impl=r.driver.attn_impl, **kw)
    return out

