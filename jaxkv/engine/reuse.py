"""ReuseRunner: prompts prefilled with cross-prompt segment reuse (seed 002) on
the substrate's splice and selective-recompute primitives.

One request (`prefill`):
1. the radix prefix cache adopts the longest cached exact prefix (every method
   but `none`);
2. the rest of the prompt is searched for stored segments (`SegmentIndex.find`:
   content-defined windows and structural spans, MinHash-LSH, exact alignment);
3. each match is checked (fingerprint, checksum) and admitted to a tier
   (`admission.decide`), the reason recorded;
4. admitted runs are spliced into the sequence's new slots with exact
   delta-RoPE (`kv.splice.splice_rows`, int8 dequantised on the device);
5. the rest runs with a per-layer recompute set
   (`forward.Recompute`): fresh tokens at every layer, an approx run from its
   resume layer on (its stored boundary state injected as the token's hidden
   input), EPIC's first tokens everywhere, and for blend runs a first pass over
   layers <= blend_layer (the probe), then the most deviating tokens at every
   later layer; each layer pass in one call, or token pieces of at most
   `chunk` tokens under the engine (`prefill_steps`: a long prompt delays the
   rows decoding beside it by one piece at a time; the pieces are exact);
6. the first token's logits are read (TTFT stops here);
7. off the critical path: the prompt's fully computed runs (structural spans
   whole, gaps between them) are stored with their K/V and boundary states, and
   the exact prefix (up to the first approximately reused token) goes into the
   radix cache. Approximate K/V never enter the radix cache, where a later hit
   would take them for exact.

`decode` continues the sequence (greedy, or teacher-forced for a gold
continuation's NLL) and `release` frees it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import COMPILER_OPTIONS, CacheConfig, ReuseConfig
from jaxkv.engine.driver import Driver, chunk_step, continue_one
from jaxkv.engine.kv_manager import KVManager
from jaxkv.engine.prefill_work import drain, pad_to
from jaxkv.kv import plan, quant, splice
from jaxkv.kv.state import SENTINEL
from jaxkv.models.forward import Capture, LayerWindow, Recompute
from jaxkv.policies.reuse import admission
from jaxkv.policies.reuse.index import SegmentIndex, canonical_table, line_spans
from jaxkv.policies.reuse.store import Segment, SegmentStore, digest, fingerprint
from jaxkv.rope import delta_frequencies

SEGMENT_METHODS = ("naive", "epic", "cacheblend", "tiered")


@dataclasses.dataclass
class RunRecord:
  """One matched run and what admission made of it."""
  p_lo: int
  n: int
  tier: str
  reason: str
  ctx_match: int
  ctx_jaccard: float
  deviation: float | None = None   # blend: mean relative K deviation at the probe layer


@dataclasses.dataclass
class Prefill:
  """The outcome of one `prefill`."""
  seq: int
  ids: np.ndarray
  logits: np.ndarray               # [V] float32 at the last prompt token
  prefix_hit: int                  # tokens adopted from the radix cache
  runs: list[RunRecord]
  layer_tokens: np.ndarray         # [L] tokens computed at each layer
  flops: float                     # prefill FLOPs spent (layers + attention + head)
  ttft_s: float
  bytes_spliced: int               # stored bytes moved to the device
  # the first position whose K/V is not what a plain prefill computes (the first
  # approximately reused token: every later token attended to it); ids.size if none
  exact_to: int = 0
  approx_from: int = 0             # the first approximately reused position (ids.size: none)
  # with `prefill_steps(tail_from=)`: the tail's queries, (first position, q [L, C, Hq, D]
  # with rows [0, count) valid, count) per model call
  queries: list = dataclasses.field(default_factory=list, repr=False)
  stored: int = 0                  # segments stored after the request
  store_s: float = 0.0
  # step 7 when deferred (`prefill_into(defer_store=True)`): finish(store) runs it
  finish: Callable[[bool], None] | None = dataclasses.field(default=None, repr=False)

  @property
  def prefill_tokens(self) -> float:
    """Token-layers computed, in whole-token units (a fresh token counts 1)."""
    return float(self.layer_tokens.sum()) / max(1, self.layer_tokens.size)


def layer_flops(cfg, n_tokens: float, ctx_sum: float) -> float:
  """FLOPs of one layer over n tokens whose attention spans sum to ctx_sum:
  2 x (QKV + O + MLP parameters) per token + 4 x Hq x D per attended key."""
  d, hq, hkv, dh, ff = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size)
  params = d * hq * dh + 2 * d * hkv * dh + hq * dh * d + 3 * d * ff
  return 2.0 * params * n_tokens + 4.0 * hq * dh * ctx_sum


def layer_passes(sizes: Sequence[int], lo: int, hi: int, max_passes: int
                 ) -> list[tuple[int, int]]:
  """Splits layers [lo, hi) into at most `max_passes` consecutive windows, each
  run as one forward pass whose recompute width is its largest set (bucketed):
  the split that computes the fewest token-layers (dynamic programming). One
  width for every layer would make each layer run the deepest layer's set
  (the depth guard's sets grow with depth); more passes cost a dispatch and a
  compile each, hence the cap."""
  w = [plan.chunk_len(max(1, n)) for n in sizes[lo:hi]]
  n = len(w)
  cost = lambda i, j: (j - i) * max(w[i:j])           # layers i..j-1 in one pass
  best = {(0, 0): (0, ())}                            # (layers done, passes) -> (cost, cuts)
  for p in range(1, max(1, max_passes) + 1):
    for j in range(1, n + 1):
      cands = [(best[(i, p - 1)][0] + cost(i, j), best[(i, p - 1)][1] + (j,))
               for i in range(j) if (i, p - 1) in best]
      if cands:
        best[(j, p)] = min(cands)
  _, _, ends = min((best[(n, p)][0], p, best[(n, p)][1])       # ties: fewer passes
                   for p in range(1, max(1, max_passes) + 1) if (n, p) in best)
  starts = (0,) + ends[:-1]
  return [(lo + a, lo + b) for a, b in zip(starts, ends)]


@functools.partial(jax.jit, static_argnames=("graphdef",), compiler_options=COMPILER_OPTIONS)
def _embed(graphdef, weights, tokens):
  return nnx.merge(graphdef, weights).embed[...][tokens]


@functools.partial(jax.jit, donate_argnames=("pool",), compiler_options=COMPILER_OPTIONS)
def _splice_packed(pool, k: quant.Packed, v: quant.Packed, positions, dest, new_positions,
                   inv_freq):
  rows = splice.KVRows(k=quant.dequantize(k, pool.k.dtype), v=quant.dequantize(v, pool.v.dtype),
                       positions=positions)
  return splice.splice_rows(pool, rows, dest, new_positions, inv_freq)


# Every helper below is jitted over bucketed shapes (`plan.chunk_len`): an eager
# op or a per-length shape compiles one more XLA:CPU executable per request, and
# each one holds memory mappings (the kernel's limit is ~65k; a long benchmark ran
# out of them and LLVM failed with "Cannot allocate memory").
@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def _inject(x, where, h: quant.Packed):
  """x [1, C, D] with rows `where` [N] (C = padding: dropped) set to dequantised h."""
  return x.at[0, where].set(quant.dequantize(h, x.dtype), mode="drop")


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def _join_rows(head, tail, at):
  """[K, 1, C, D]: head's rows before `at`, then tail's rows from 0 (both padded to C)."""
  r = jnp.arange(head.shape[2])
  take = jnp.where(r < at, r, head.shape[2] + r - at)
  return jnp.take(jnp.concatenate([head, tail], axis=2), take, axis=2, mode="clip")


@functools.partial(jax.jit, static_argnames=("layer",), compiler_options=COMPILER_OPTIONS)
def _keys_at(pool, slots, layer: int):
  return pool.k[layer, slots]


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def _deviation(before, after):
  """Per token the relative L2 change of its keys [N, Hkv, D]."""
  n = before.shape[0]
  num = jnp.linalg.norm((after - before).reshape(n, -1), axis=-1)
  return num / jnp.maximum(jnp.linalg.norm(before.reshape(n, -1), axis=-1), 1e-6)


@functools.partial(jax.jit, static_argnames=("storage", "group", "layers"),
                   compiler_options=COMPILER_OPTIONS)
def _pack_rows(pool, slots, cuts, rows, storage: str, group: int, layers: int):
  """Quantised K/V of `slots` [N] (layers < `layers`) and boundary states
  cuts[:, 0, rows] ([K, 1, C, D] captured, rows [N] chunk indices)."""
  hidden = None if cuts is None else quant.quantize(cuts[:, 0, rows], storage, group)
  return (quant.quantize(pool.k[:layers, slots], storage, group),
          quant.quantize(pool.v[:layers, slots], storage, group), hidden)


def _pad(x, n: int, value=0, axis: int = 0) -> np.ndarray:
  """x padded along `axis` to length n with `value`."""
  x = np.asarray(x)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return np.pad(x, widths, constant_values=value)


def recompute_index(sets: Sequence[np.ndarray], lo: int, hi: int, a: int = 0,
                    b: int | None = None) -> Recompute:
  """[L, 1, R] recompute index of a call over layers [lo, hi) and chunk tokens [a, b):
  per layer the set's members in [a, b), rebased to a (-1 padding); R is the largest
  such set among those layers only."""
  local = [s if a == 0 and b is None else s[(s >= a) & (s < b)] - a for s in sets]
  r = plan.chunk_len(max(1, max(s.size for s in local[lo:hi])))
  idx = np.full((len(sets), 1, r), -1, np.int32)
  for l in range(lo, hi):
    idx[l, 0, :local[l].size] = local[l]
  return Recompute(jnp.asarray(idx))


_OWNER = "reuse"     # this runner's name in the KV manager (its radix tree, its allocations)


class ReuseRunner:
  """A pool, a radix cache, a segment store and its index, for one model.

  Args:
    llm: a loaded `LLM`.
    reuse: the method and its parameters (`ReuseConfig`).
    cache: the pool of this runner.
    attn_impl: `jaxkv.ops` implementation.
    adapter: the adapter name in the store's fingerprint ("base": none).
  """

  def __init__(self, llm, reuse: ReuseConfig = ReuseConfig(), *,
               cache: CacheConfig = CacheConfig(num_pages=1024, page_size=16,
                                                max_seq_len=8192),
               attn_impl: str = "auto", adapter: str = "base", kv: KVManager | None = None):
    self.cfg, self.tok, self.reuse = llm.config, llm.tokenizer, reuse
    self.kv = kv if kv is not None else KVManager(self.cfg, cache, llm.graphdef, llm.weights,
                                                  attn_impl=attn_impl)
    # the KV manager's weights: sharded like its pool when it serves a mesh
    self.graphdef, self.weights = self.kv.graphdef, self.kv.weights
    self.max_len = cache.max_seq_len
    self.alloc = self.kv.allocator
    self.radix = self.kv.tree(_OWNER) if reuse.method != "none" else None
    L = self.cfg.num_layers
    self.cuts = tuple(range(reuse.cut_every, L, reuse.cut_every))
    if reuse.regime == "B":
      self.kv_layers = reuse.reuse_layers or (max(self.cuts) if self.cuts else L)
      if not 0 < self.kv_layers < L:
        raise ValueError(f"reuse.reuse_layers must be in (0, {L}) for regime B")
      self.cuts = tuple(sorted({c for c in self.cuts if c <= self.kv_layers}
                               | {self.kv_layers}))
    else:
      self.kv_layers = L
    self.segments = reuse.method in SEGMENT_METHODS
    self.inv_freq = delta_frequencies(self.cfg.rope, self.cfg.head_dim) if self.segments else None
    self.index = SegmentIndex(reuse, canonical_table(self.tok)) if self.segments else None
    self.store = SegmentStore(reuse.byte_budget, on_evict=self._forget)
    sample = np.asarray(jax.device_get(llm.model.embed[...][:4]), np.float32)
    vocab = self.tok.vocab_size
    step = max(1, vocab // 512)
    tok_key = digest(vocab, [self.tok.id_to_token(i) for i in range(0, vocab, step)])
    self.fingerprint = fingerprint(self.cfg, sample, tok_key, adapter)

  # ------------------------------------------------------------------ bookkeeping
  @property
  def driver(self) -> Driver:
    """The KV manager's driver (the pool every step runs on)."""
    return self.kv.driver

  def _forget(self, key: int) -> None:
    if self.index is not None:
      self.index.remove(key)

  def release(self, seq: int) -> None:
    self.alloc.free_sequence(seq)

  def reset(self) -> None:
    """Forgets every cached prefix and stored segment (live sequences stay)."""
    if self.radix is not None:
      self.radix.clear()
    for key in self.store.keys():   # noqa: SIM118 (a SegmentStore: no __iter__)
      self.store.remove(key)

  def add_segment(self, seg: Segment) -> int | None:
    """Stores a sealed segment and indexes it; returns its key (None: too big)."""
    key = self.store.put(seg)
    if key is not None and self.index is not None:
      self.index.add(key, seg.ids, whole=seg.structural)
    return key

  # ---------------------------------------------------------------------- prefill
  def prefill(self, ids, spans: Sequence[tuple[int, int]] | None = None, *,
              store: bool = True) -> Prefill:
    """Prefills `ids` with reuse (see the module docstring); the sequence stays
    live for `decode` until `release`.

    Args:
      ids: the prompt's token ids.
      spans: structural spans [(lo, hi)] (tool schemas, documents, tool outputs);
        None: the prompt's lines (`index.line_spans`).
      store: store the prompt's fully computed runs afterwards.
    """
    ids = plan.prompt_ids(ids, self.max_len)
    n = ids.size
    t0 = time.perf_counter()
    seq = self.alloc.new_sequence()
    try:
      hit = self.radix.adopt_prefix(seq, ids[:n - 1]) if self.radix is not None else 0
      self.kv.extend(seq, n - hit, owner=_OWNER, first=self.radix)
    except Exception:
      self.alloc.free_sequence(seq)
      raise
    return self.prefill_into(seq, ids, hit, spans, store=store, t0=t0)

  def prefill_into(self, seq: int, ids: np.ndarray, hit: int,
                   spans: Sequence[tuple[int, int]] | None = None, *,
                   defer_store: bool = False, store: bool = True,
                   t0: float | None = None) -> Prefill:
    """Steps 2-7 of `prefill` over a live sequence that holds the radix hit
    ids[:hit] (adopted) and fresh slots for ids[hit:], each layer pass in one call
    (`prefill_steps` run to its end). With `defer_store`, step 7 (radix insert,
    storing the runs) waits for `Prefill.finish(store)`, so a server emits the first
    token before it."""
    return drain(self.prefill_steps(seq, ids, hit, spans, defer_store=defer_store,
                                    store=store, t0=t0), self.driver, 0)

  def prefill_steps(self, seq: int, ids: np.ndarray, hit: int,
                    spans: Sequence[tuple[int, int]] | None = None, *,
                    chunk: int | None = None, defer_store: bool = False, store: bool = True,
                    t0: float | None = None, radix: bool = True,
                    tail_from: int | None = None, exact_before: int | None = None,
                    reuse_from: int = 0):
    """`prefill_into` as a generator (what the engine's `Reuse` mechanism runs on its
    row): with `chunk`, at most `chunk` prompt tokens per model call and a bare
    yield after each call but the last, so a long prompt delays the engine's
    decoding rows by one chunk at a time; returns the `Prefill`.

    For a composition whose layout caches the row (`mechanisms.composed`):
    `radix=False` inserts nothing into this runner's radix tree; `tail_from`: the
    prompt's tail [tail_from, n) is not planned but computed after the plan through
    every layer (exact: causal attention reads only the planned tokens' final K/V),
    its post-RoPE queries captured (`Prefill.queries`, what a scorer reads);
    `exact_before`: positions from here on attended to KV that is not a plain
    prefill's (the session's holes, its private suffix): runs stored from there are
    not exact, and `Prefill.exact_to` is at most it; `reuse_from`: no segment is
    spliced before this position (the prefix sessions share, computed exactly)."""
    n = ids.size
    t0 = time.perf_counter() if t0 is None else t0
    if spans is None:
      spans = line_spans(ids, self.tok, self.reuse.min_tokens) if self.segments else []
    L = self.cfg.num_layers
    rest = n - hit
    # the planned part [hit, stop); the tail after it
    stop = n if tail_from is None else min(max(int(tail_from), hit), n - 1)
    smap = self.alloc.slot_map(seq)
    c_len = plan.chunk_len(rest, plan.chunk_len(n))
    chunk_ids = ids[hit:]

    # 2-3: matches and admission
    runs, admitted = [], []
    if self.segments and len(self.store) and stop > hit:
      matches = self.index.find(ids, spans, self.store.peek, lo=max(hit, reuse_from))
      # the planned part's last token is always computed (the readout, or the token
      # before the tail)
      matches = [m if m.p_lo + m.n < stop else dataclasses.replace(m, n=stop - 1 - m.p_lo)
                 for m in matches]
      matches = [m for m in matches if m.n >= self.reuse.min_tokens]
      for m in matches:
        seg = self.store.get(m.key)
        why = seg.problem(self.fingerprint)
        d = (admission.Decision("reject", why) if why else
             admission.decide(m, seg, self.reuse, L))
        runs.append(RunRecord(m.p_lo, m.n, d.tier, d.reason, m.ctx_match, m.ctx_jaccard))
        if d.accepted:
          admitted.append((m, seg, d, runs[-1]))

    # 4: per-token plan (chunk coordinates) and the splice
    resume = np.zeros(rest, np.int64)             # recomputed from this layer on
    blend = np.zeros(rest, bool)
    spliced = np.zeros(rest, bool)                # K/V of some layer came from the store
    hidden_rows: dict[int, list] = {}             # boundary -> [(chunk idx, Packed rows)]
    nbytes = 0
    if admitted:
      ks, vs, pos, dest, newpos = [], [], [], [], []
      for m, seg, d, _ in admitted:
        lo = m.p_lo - hit
        part = seg.rows(m.s_lo, m.s_lo + m.n)
        r = d.resume_of(m.n)
        resume[lo:lo + m.n] = r
        spliced[lo:lo + m.n] = True
        blend[lo:lo + m.n] = d.blend
        for b in np.unique(r[(r > 0) & (r < L)]):   # resumed from a stored boundary state
          at = np.flatnonzero(r == b)
          hidden_rows.setdefault(int(b), []).append((lo + at, part.hidden[int(b)], at))
        ks.append(part.k)
        vs.append(part.v)
        dest.append(smap[m.p_lo:m.p_lo + m.n])
        newpos.append(np.arange(m.p_lo, m.p_lo + m.n, dtype=np.int32))
        # rerope=False (a chance baseline): keys keep their stored rotation
        pos.append(part.positions if self.reuse.rerope else newpos[-1])
        nbytes += part.k.nbytes + part.v.nbytes
      self._splice(ks, vs, pos, dest, newpos)

    # 5: the chunk, with the recompute plan
    queries = []
    out, cuts_out, layer_tokens, flops_ctx = yield from self._run(
        hit, chunk_ids, c_len, smap, resume, blend, hidden_rows, admitted, chunk,
        tail=n - stop, queries=queries)
    logits = np.asarray(jax.device_get(out.logits[0, 0]), np.float32)
    ttft = time.perf_counter() - t0
    flops = flops_ctx + 2.0 * self.cfg.hidden_size * self.cfg.vocab_size
    # exact K/V end at the first spliced token unless it came from the exact tier
    approx_from = min([m.p_lo for m, _, d, _ in admitted if d.tier != "exact"], default=n)
    exact_to = approx_from if exact_before is None else min(approx_from, int(exact_before))
    res = Prefill(seq=seq, ids=ids, logits=logits, prefix_hit=hit, runs=runs,
                  layer_tokens=layer_tokens, flops=flops, ttft_s=ttft, bytes_spliced=nbytes,
                  exact_to=exact_to, approx_from=approx_from, queries=queries)
    # 7: after the first token
    res.finish = functools.partial(self._after_first_token, res, hit, smap, spliced, spans,
                                   cuts_out, radix)
    if not defer_store:
      res.finish(store)
    return res

  def _after_first_token(self, res: Prefill, hit, smap, spliced, spans, cuts_out,
                         radix: bool = True, store: bool = True) -> None:
    """Step 7: the exact prefix into the radix cache (with `radix`), the fully
    computed runs into the store (with `store`); sets `res.stored` and `res.store_s`."""
    t1 = time.perf_counter()
    ids, exact_to = res.ids, res.exact_to
    if radix and self.radix is not None:
      self.radix.insert(ids[:exact_to], smap[:exact_to])
    if store and self.segments:
      res.stored = self._store_runs(ids, hit, smap, ~spliced, spans, exact_to, cuts_out)
    res.store_s = time.perf_counter() - t1
    res.finish = None

  def _splice(self, ks, vs, pos, dest, newpos) -> None:
    """One jitted splice of every admitted run (rows padded to a bucket)."""
    width = plan.chunk_len(sum(x.size for x in pos))
    def cat(parts, axis=0, value=0):
      return jnp.asarray(_pad(np.concatenate([np.asarray(p) for p in parts], axis), width,
                              value, axis))
    def packed(parts):
      return quant.Packed(cat([p.q for p in parts], 1),
                          None if parts[0].scale is None else cat([p.scale for p in parts], 1))
    L = self.cfg.num_layers
    k, v = packed(ks), packed(vs)
    if k.q.shape[0] < L:                      # regime B: no K/V above L_reuse (recomputed)
      grow = lambda a: jnp.pad(a, [(0, L - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
      k = quant.Packed(grow(k.q), None if k.scale is None else grow(k.scale))
      v = quant.Packed(grow(v.q), None if v.scale is None else grow(v.scale))
    self.driver.kv = _splice_packed(self.driver.kv, k, v, cat(pos), cat(dest, value=SENTINEL),
                                    cat(newpos), self.inv_freq)

  def _run(self, hit, chunk_ids, c_len, smap, resume, blend, hidden_rows, admitted,
           chunk: int | None = None, tail: int = 0, queries: list | None = None):
    """Step 5 (see the module docstring), a generator of bare yields: with `chunk`,
    every layer pass runs at most `chunk` prompt tokens per call and yields after each
    call, so the engine's decoding rows get their step in between (the pieces of a
    pass are exact: a token's causal attention reads only earlier columns, which
    earlier pieces of the same pass wrote); None: each pass in one call. The last
    `tail` tokens are not planned: they run after every pass, through every layer,
    their queries appended to `queries` (`Prefill.queries`). Returns (the readout,
    the boundary states captured [K, 1, C, D] or None, tokens computed per layer [L],
    FLOPs)."""
    L, total = self.cfg.num_layers, chunk_ids.size
    rest = total - tail                               # the planned tokens
    size = total if not chunk else int(chunk)
    pieces = [(a, min(a + size, rest)) for a in range(0, rest, size)]
    cuts = self.cuts if self.segments else ()
    resume, blend = resume[:rest], blend[:rest]
    every = np.arange(rest)
    bl = self.reuse.blend_layer
    # layer l recomputes the tokens resuming at or below it, and blend runs up to the probe
    sets = [np.union1d(every[resume <= l], every[blend]) if l <= bl else every[resume <= l]
            for l in range(L)]
    plain = not resume.any() and not blend.any()     # nothing reused: the plain prefill
    x = None if plain else self._hidden_in(jnp.asarray(_pad(chunk_ids, c_len)[None]),
                                           hidden_rows, c_len)
    stages = [(0, L)]
    if blend.any() and bl + 1 < L:
      stages = [(0, bl + 1), (bl + 1, L)]
    slots_all = before = None
    parts, out = [], None
    for si, (a, b) in enumerate(stages):
      if si == 0 and len(stages) == 2:              # blend: keys before the probe
        slots_all = jnp.asarray(_pad(smap[hit:hit + rest], c_len, SENTINEL))
        before = _keys_at(self.driver.kv, slots_all, bl)
      if si == 1:                                    # the probe's verdict
        after = _keys_at(self.driver.kv, slots_all, bl)
        chosen = self._blend_choice(np.asarray(jax.device_get(_deviation(before, after)))[:rest],
                                    hit, admitted)
        sets = [s if l <= bl else np.union1d(s, every[chosen]) for l, s in enumerate(sets)]
      passes = [(0, L)] if plain else layer_passes([s.size for s in sets], a, b,
                                                   self.reuse.max_passes)
      for lo, hi in passes:
        xs, cut_parts = [], []
        for p_lo, p_hi in pieces:
          out = self._piece(hit, chunk_ids, c_len, smap, p_lo, p_hi, lo, hi, cuts,
                            None if plain else sets,
                            None if x is None else x[:, p_lo:p_hi], len(pieces) == 1)
          if hi < L:
            xs.append(out.hidden[:, :p_hi - p_lo])
          if out.hidden_cuts is not None:
            cut_parts.append(out.hidden_cuts[:, :, :p_hi - p_lo])
          if tail or (lo, hi, p_hi) != (passes[-1][0], L, rest):
            yield                                    # the engine's decode rows run
        x = jnp.concatenate(xs, axis=1) if hi < L else None
        if cut_parts:
          parts.append(pad_to(jnp.concatenate(cut_parts, axis=2), c_len, 2))
    cuts_out = jnp.concatenate(parts) if parts else None
    if tail:                                         # the tail: plain, queries captured
      tail_cuts = []
      for p_lo in range(rest, total, size):
        p_hi = min(p_lo + size, total)
        out = self._piece(hit, chunk_ids, c_len, smap, p_lo, p_hi, 0, L, cuts, None, None,
                          False, capture_q=True)
        queries.append((hit + p_lo, out.q[:, 0], p_hi - p_lo))
        if out.hidden_cuts is not None:
          tail_cuts.append(out.hidden_cuts[:, :, :p_hi - p_lo])
        if p_hi < total:
          yield
      if tail_cuts:
        t = pad_to(jnp.concatenate(tail_cuts, axis=2), c_len, 2)
        cuts_out = t if cuts_out is None else _join_rows(cuts_out, t, jnp.int32(rest))
    layer_tokens = np.asarray([s.size + tail for s in sets], np.int64)
    pos = hit + np.arange(total, dtype=np.float64) + 1
    flops = sum(layer_flops(self.cfg, s.size + tail, pos[s].sum() + pos[rest:].sum())
                for s in sets)
    return out, cuts_out, layer_tokens, flops

  def _piece(self, hit, chunk_ids, c_len, smap, a, b, lo, hi, cuts, sets, x, whole,
             capture_q: bool = False):
    """One call: prompt tokens [a, b) (chunk coordinates) through layers [lo, hi),
    recomputing `sets` (per layer, chunk indices; None: every token, no window)."""
    L, rest = self.cfg.num_layers, chunk_ids.size
    cl = c_len if whole else plan.chunk_len(b - a, c_len)
    last = hi == L and b == rest
    kw = {}
    if sets is not None:
      kw["recompute"] = recompute_index(sets, lo, hi, a, b)
      kw["window"] = LayerWindow(hidden_in=None if x is None else pad_to(x, cl, 1),
                                 start=lo, stop=hi)
    out, self.driver.kv = chunk_step(
        self.graphdef, self.weights, self.driver.kv,
        jnp.asarray(_pad(chunk_ids[a:b], cl)[None]),
        jnp.asarray(_pad(hit + np.arange(a, b, dtype=np.int32), cl, -1)[None]),
        jnp.asarray(plan.slot_rows([smap], plan.width(hit + b))),
        read=jnp.asarray([[rest - 1 - a]], np.int32) if last else None,
        capture=Capture(q=capture_q, hidden_cuts=cuts if sets is None else
                        tuple(c for c in cuts if lo < c <= hi)),
        return_hidden=hi < L, return_logits=last, attn_impl=self.driver.attn_impl, **kw)
    return out

  def _hidden_in(self, tokens, hidden_rows, c_len):
    """The first pass's input [1, C, D]: embeddings with the stored boundary
    states of resumed tokens injected (None: embeddings only)."""
    if not hidden_rows:
      return None
    parts = [(where, h, rows) for b in sorted(hidden_rows) for where, h, rows in hidden_rows[b]]
    where = np.concatenate([p[0] for p in parts])
    nb = plan.chunk_len(where.size)
    q = _pad(np.concatenate([np.asarray(h.q)[rows] for _, h, rows in parts]), nb)
    sc = (None if parts[0][1].scale is None else
          _pad(np.concatenate([np.asarray(h.scale)[rows] for _, h, rows in parts]), nb))
    return _inject(_embed(self.graphdef, self.weights, tokens),
                   jnp.asarray(_pad(where, nb, c_len).astype(np.int32)),
                   quant.Packed(jnp.asarray(q), None if sc is None else jnp.asarray(sc)))

  def _blend_choice(self, dev, hit, admitted) -> np.ndarray:
    """[rest] bool: the tokens each blend run recomputes after the probe (its top
    `blend_ratio` by key deviation, or as many drawn at random with select=random;
    all of it when `probe_reject` turns it down)."""
    chosen = np.zeros(dev.size, bool)
    for m, _, d, rec in admitted:
      if not d.blend:
        continue
      lo = m.p_lo - hit
      dv = dev[lo:lo + m.n]
      rec.deviation = float(dv.mean())
      if self.reuse.probe_reject and rec.deviation > self.reuse.probe_reject:
        chosen[lo:lo + m.n] = True                   # a full recompute
        rec.tier, rec.reason = "reject", (f"probe: mean K deviation {rec.deviation:.3f} > "
                                          f"{self.reuse.probe_reject}")
        continue
      k = int(np.ceil(self.reuse.blend_ratio * m.n))
      if self.reuse.select == "random":             # the chance baseline: as many tokens
        chosen[lo + admission.random_tokens(m, self.reuse, k)] = True
      else:
        chosen[lo + np.argsort(-dv)[:k]] = True
    return chosen

  # ------------------------------------------------------------------------ store
  def _store_runs(self, ids, hit, smap, fresh, spans, exact_to, cuts_out) -> int:
    """Stores the fully computed runs of this prompt (structural spans whole,
    gaps between them); returns how many were stored. Runs ending after
    `exact_to` attended to approximate K/V: stored with exact=False."""
    n, mt = ids.size, self.reuse.min_tokens
    comp = np.zeros(n, bool)
    comp[hit:] = fresh
    regions, covered = [], np.zeros(n, bool)
    for lo, hi in sorted(spans):
      covered[lo:hi] = True
      if hi - lo >= mt and comp[lo:hi].all():
        regions.append((lo, hi, True))
    gap = comp & ~covered
    edges = np.flatnonzero(np.diff(np.r_[0, gap.astype(np.int8), 0]))
    for lo, hi in zip(edges[::2], edges[1::2]):
      if hi - lo >= mt:
        regions.append((int(lo), int(hi), False))
    stored = 0
    for lo, hi, structural in regions:
      nb = plan.chunk_len(hi - lo)
      slots = jnp.asarray(_pad(smap[lo:hi], nb, SENTINEL))
      rows = jnp.asarray(_pad(np.arange(lo - hit, hi - hit, dtype=np.int32), nb))
      k, v, h = jax.device_get(_pack_rows(self.driver.kv, slots, cuts_out, rows,
                                          self.reuse.storage, self.reuse.group_size,
                                          self.kv_layers))
      hidden = {} if h is None else {
          b: quant.Packed(h.q[i], None if h.scale is None else h.scale[i]).rows(0, 0, hi - lo)
          for i, b in enumerate(self.cuts)}
      k, v = k.rows(1, 0, hi - lo), v.rows(1, 0, hi - lo)
      seg = Segment(ids=ids[lo:hi].copy(), left=ids[:lo].copy(),
                    positions=np.arange(lo, hi, dtype=np.int32), k=k, v=v, hidden=hidden,
                    fingerprint=self.fingerprint, structural=structural,
                    exact=hi <= exact_to).seal()
      stored += self.add_segment(seg) is not None
    return stored

  # ----------------------------------------------------------------------- decode
  def decode(self, pre: Prefill, max_tokens: int, *, forced=None,
             stop_ids=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Greedy continuation of a prefilled sequence: (tokens [<= max_tokens],
    log p(forced) [max_tokens] when `forced` is given: teacher forcing).
    With `stop_ids`, the tokens end at the first stop token (included)."""
    n = pre.ids.size
    if n + max_tokens > self.max_len:
      raise ValueError(f"{n} + {max_tokens} tokens exceed max_seq_len {self.max_len}")
    self.kv.extend(pre.seq, max_tokens, owner=_OWNER, first=self.radix)
    smap = plan.slot_rows([self.alloc.slot_map(pre.seq)], plan.width(n + max_tokens))
    return continue_one(self.driver, pre.logits, n, smap, max_tokens, forced=forced,
                        stop_ids=stop_ids)
