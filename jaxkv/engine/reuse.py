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
   whole, the computed runs around them and inside a span partly spliced) are
   stored with their K/V and boundary states, and
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

from jaxkv.config import CacheConfig, ReuseConfig
from jaxkv.engine.driver import Driver, chunk_step, continue_one
from jaxkv.engine.kv_manager import KVManager
from jaxkv.engine.prefill_work import drain, pad_to
from jaxkv.kv import plan, quant
from jaxkv.kv.state import SENTINEL
from jaxkv.models.forward import Capture, LayerWindow, LoraInputs
from jaxkv.policies.reuse import admission
from jaxkv.policies.reuse.index import SegmentIndex, canonical_table, line_spans
from jaxkv.policies.reuse.passes import (
  deviation,
  embed,
  inject,
  join_rows,
  keys_at,
  layer_flops,
  layer_passes,
  pack_rows,
  pad,
  recompute_index,
  splice_packed,
)
from jaxkv.policies.reuse.store import Fingerprint, Segment, SegmentStore, digest, fingerprint
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

  def fingerprint_of(self, form: str) -> Fingerprint:
    """The fingerprint of segments of KV form `form` ("base": the runner's own)."""
    if form == "base":
      return self.fingerprint
    return dataclasses.replace(self.fingerprint, adapter=f"{self.fingerprint.adapter}/{form}")

  def max_stored_bytes(self, ids: np.ndarray, lo: int) -> int:
    """An upper bound on the bytes storing the computed part ids[lo:] of a prompt
    adds to the store: every token in some segment at 4 bytes per value (K, V, the
    boundary states, the pool's low-rank values), each segment (at least
    `min_tokens`) with its ids, positions and whole left context."""
    n, total = int(ids.size) - lo, int(ids.size)
    if n <= 0 or not self.segments:
      return 0
    c = self.cfg
    per_token = 4 * (2 * self.kv_layers * c.num_kv_heads * c.head_dim
                     + len(self.cuts) * c.hidden_size + self.driver.kv.lr_rank * self.kv_layers) + 8
    return n * per_token + (n // self.reuse.min_tokens + 1) * 4 * total

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
                    reuse_from: int = 0, lora: LoraInputs | None = None,
                    form: str = "base"):
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
    spliced before this position (the prefix sessions share, computed exactly).

    A role adapter's row (LRAgent agents in a composition): `lora` (one row's
    `LoraInputs`) runs every pass with its adapter, and `form` names the KV form it
    writes (e.g. "roles:base_lr_shared"): it splices and stores only segments of that
    form (the store is shared, the fingerprints tell the forms apart), with their
    low-rank values x A_v s when the adapter runs decoupled."""
    if (lora is None) != (form == "base"):
      raise ValueError(f"a row on a role adapter names its KV form and only such a row "
                       f"does (form {form!r}, lora {'set' if lora is not None else 'None'})")
    fp = self.fingerprint_of(form)
    lr = lora is not None and lora.mode == "decoupled"
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
      def lookup(key):       # segments of this row's KV form only (another model's or
        seg = self.store.peek(key)               # RoPE's: found, refused with the reason)
        return seg if seg.fingerprint.adapter == fp.adapter else None
      matches = self.index.find(ids, spans, lookup, lo=max(hit, reuse_from))
      # the planned part's last token is always computed (the readout, or the token
      # before the tail)
      matches = [m if m.p_lo + m.n < stop else dataclasses.replace(m, n=stop - 1 - m.p_lo)
                 for m in matches]
      matches = [m for m in matches if m.n >= self.reuse.min_tokens]
      for m in matches:
        seg = self.store.get(m.key)
        why = seg.problem(fp) or (lr and seg.vlr is None and "no low-rank values")
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
      ks, vs, vlrs, pos, dest, newpos = [], [], [], [], [], []
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
        vlrs.append(part.vlr)
        dest.append(smap[m.p_lo:m.p_lo + m.n])
        newpos.append(np.arange(m.p_lo, m.p_lo + m.n, dtype=np.int32))
        # rerope=False (a chance baseline): keys keep their stored rotation
        pos.append(part.positions if self.reuse.rerope else newpos[-1])
        nbytes += part.k.nbytes + part.v.nbytes + (part.vlr.nbytes if lr else 0)
      self._splice(ks, vs, pos, dest, newpos, vlrs if lr else None)

    # 5: the chunk, with the recompute plan
    queries = []
    out, cuts_out, layer_tokens, flops_ctx = yield from self._run(
        hit, chunk_ids, c_len, smap, resume, blend, hidden_rows, admitted, chunk,
        tail=n - stop, queries=queries, lora=lora)
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
                                   cuts_out, radix, fp, lr)
    if not defer_store:
      res.finish(store)
    return res

  def _after_first_token(self, res: Prefill, hit, smap, spliced, spans, cuts_out,
                         radix: bool = True, fp=None, lr: bool = False,
                         store: bool = True) -> None:
    """Step 7: the exact prefix into the radix cache (with `radix`), the fully
    computed runs into the store (with `store`); sets `res.stored` and `res.store_s`."""
    t1 = time.perf_counter()
    ids, exact_to = res.ids, res.exact_to
    if radix and self.radix is not None:
      self.radix.insert(ids[:exact_to], smap[:exact_to])
    if store and self.segments:
      res.stored = self._store_runs(ids, hit, smap, ~spliced, spans, exact_to, cuts_out,
                                    fp or self.fingerprint, lr)
    res.store_s = time.perf_counter() - t1
    res.finish = None

  def _splice(self, ks, vs, pos, dest, newpos, vlrs=None) -> None:
    """One jitted splice of every admitted run (rows padded to a bucket), with their
    low-rank values when `vlrs` is given."""
    width = plan.chunk_len(sum(x.size for x in pos))
    def cat(parts, axis=0, value=0):
      return jnp.asarray(pad(np.concatenate([np.asarray(p) for p in parts], axis), width,
                              value, axis))
    def packed(parts):
      return quant.Packed(cat([p.q for p in parts], 1),
                          None if parts[0].scale is None else cat([p.scale for p in parts], 1))
    L = self.cfg.num_layers
    k, v = packed(ks), packed(vs)
    vlr = None if vlrs is None else packed(vlrs)
    if k.q.shape[0] < L:                      # regime B: no K/V above L_reuse (recomputed)
      grow = lambda a: jnp.pad(a, [(0, L - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
      k, v, vlr = (None if p is None else
                   quant.Packed(grow(p.q), None if p.scale is None else grow(p.scale))
                   for p in (k, v, vlr))
    self.driver.kv = splice_packed(self.driver.kv, k, v, cat(pos), cat(dest, value=SENTINEL),
                                    cat(newpos), self.inv_freq, vlr)

  def _run(self, hit, chunk_ids, c_len, smap, resume, blend, hidden_rows, admitted,
           chunk: int | None = None, tail: int = 0, queries: list | None = None,
           lora: LoraInputs | None = None):
    """Step 5 (see the module docstring), a generator of bare yields: with `chunk`,
    every layer pass runs at most `chunk` prompt tokens per call and yields after each
    call, so the engine's decoding rows get their step in between (the pieces of a
    pass are exact: a token's causal attention reads only earlier columns, which
    earlier pieces of the same pass wrote); None: each pass in one call. The last
    `tail` tokens are not planned: they run after every pass, through every layer,
    their queries appended to `queries` (`Prefill.queries`). Every call runs with
    `lora` (a role adapter's row) when given. Returns (the readout,
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
    x = None if plain else self._hidden_in(jnp.asarray(pad(chunk_ids, c_len)[None]),
                                           hidden_rows, c_len)
    stages = [(0, L)]
    if blend.any() and bl + 1 < L:
      stages = [(0, bl + 1), (bl + 1, L)]
    slots_all = before = None
    parts, out = [], None
    for si, (a, b) in enumerate(stages):
      if si == 0 and len(stages) == 2:              # blend: keys before the probe
        slots_all = jnp.asarray(pad(smap[hit:hit + rest], c_len, SENTINEL))
        before = keys_at(self.driver.kv, slots_all, bl)
      if si == 1:                                    # the probe's verdict
        after = keys_at(self.driver.kv, slots_all, bl)
        chosen = self._blend_choice(np.asarray(jax.device_get(deviation(before, after)))[:rest],
                                    hit, admitted)
        sets = [s if l <= bl else np.union1d(s, every[chosen]) for l, s in enumerate(sets)]
      passes = [(0, L)] if plain else layer_passes([s.size for s in sets], a, b,
                                                   self.reuse.max_passes)
      for lo, hi in passes:
        xs, cut_parts = [], []
        for p_lo, p_hi in pieces:
          out = self._piece(hit, chunk_ids, c_len, smap, p_lo, p_hi, lo, hi, cuts,
                            None if plain else sets,
                            None if x is None else x[:, p_lo:p_hi], len(pieces) == 1,
                            lora=lora)
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
                          False, capture_q=True, lora=lora)
        queries.append((hit + p_lo, out.q[:, 0], p_hi - p_lo))
        if out.hidden_cuts is not None:
          tail_cuts.append(out.hidden_cuts[:, :, :p_hi - p_lo])
        if p_hi < total:
          yield
      if tail_cuts:
        t = pad_to(jnp.concatenate(tail_cuts, axis=2), c_len, 2)
        cuts_out = t if cuts_out is None else join_rows(cuts_out, t, jnp.int32(rest))
    layer_tokens = np.asarray([s.size + tail for s in sets], np.int64)
    pos = hit + np.arange(total, dtype=np.float64) + 1
    flops = sum(layer_flops(self.cfg, s.size + tail, pos[s].sum() + pos[rest:].sum())
                for s in sets)
    return out, cuts_out, layer_tokens, flops

  def _piece(self, hit, chunk_ids, c_len, smap, a, b, lo, hi, cuts, sets, x, whole,
             capture_q: bool = False, lora: LoraInputs | None = None):
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
        jnp.asarray(pad(chunk_ids[a:b], cl)[None]),
        jnp.asarray(pad(hit + np.arange(a, b, dtype=np.int32), cl, -1)[None]),
        jnp.asarray(plan.slot_rows([smap], plan.width(hit + b))),
        read=jnp.asarray([[rest - 1 - a]], np.int32) if last else None,
        capture=Capture(q=capture_q, hidden_cuts=cuts if sets is None else
                        tuple(c for c in cuts if lo < c <= hi)),
        return_hidden=hi < L, return_logits=last, attn_impl=self.driver.attn_impl, lora=lora,
        **kw)
    return out

  def _hidden_in(self, tokens, hidden_rows, c_len):
    """The first pass's input [1, C, D]: embeddings with the stored boundary
    states of resumed tokens injected (None: embeddings only)."""
    if not hidden_rows:
      return None
    parts = [(where, h, rows) for b in sorted(hidden_rows) for where, h, rows in hidden_rows[b]]
    where = np.concatenate([p[0] for p in parts])
    nb = plan.chunk_len(where.size)
    q = pad(np.concatenate([np.asarray(h.q)[rows] for _, h, rows in parts]), nb)
    sc = (None if parts[0][1].scale is None else
          pad(np.concatenate([np.asarray(h.scale)[rows] for _, h, rows in parts]), nb))
    return inject(embed(self.graphdef, self.weights, tokens),
                   jnp.asarray(pad(where, nb, c_len).astype(np.int32)),
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
  def _store_runs(self, ids, hit, smap, fresh, spans, exact_to, cuts_out, fp,
                  lr: bool = False) -> int:
    """Stores the fully computed runs of this prompt under fingerprint `fp`, with
    their low-rank values with `lr`: structural spans computed whole as one segment
    each, and the computed runs of at least `min_tokens` outside them, the computed
    parts of a span partly spliced included (a tool list or policy text that one
    run of another prompt was spliced into is otherwise never stored: measured on
    tau2 first calls, whose system prompt is one 3k-token line). Returns how many
    were stored. Runs ending after `exact_to` attended to approximate K/V: stored
    with exact=False."""
    n, mt = ids.size, self.reuse.min_tokens
    comp = np.zeros(n, bool)
    comp[hit:] = fresh
    regions, covered = [], np.zeros(n, bool)
    for lo, hi in sorted(spans):
      if comp[lo:hi].all():
        covered[lo:hi] = True
        if hi - lo >= mt:
          regions.append((lo, hi, True))
    gap = comp & ~covered
    edges = np.flatnonzero(np.diff(np.r_[0, gap.astype(np.int8), 0]))
    for lo, hi in zip(edges[::2], edges[1::2]):
      if hi - lo >= mt:
        regions.append((int(lo), int(hi), False))
    stored = 0
    for lo, hi, structural in regions:
      nb = plan.chunk_len(hi - lo)
      slots = jnp.asarray(pad(smap[lo:hi], nb, SENTINEL))
      rows = jnp.asarray(pad(np.arange(lo - hit, hi - hit, dtype=np.int32), nb))
      k, v, h, vlr = jax.device_get(pack_rows(self.driver.kv, slots, cuts_out, rows,
                                               self.reuse.storage, self.reuse.group_size,
                                               self.kv_layers, lr))
      hidden = {} if h is None else {
          b: quant.Packed(h.q[i], None if h.scale is None else h.scale[i]).rows(0, 0, hi - lo)
          for i, b in enumerate(self.cuts)}
      k, v = k.rows(1, 0, hi - lo), v.rows(1, 0, hi - lo)
      seg = Segment(ids=ids[lo:hi].copy(), left=ids[:lo].copy(),
                    positions=np.arange(lo, hi, dtype=np.int32), k=k, v=v, hidden=hidden,
                    fingerprint=fp, structural=structural, exact=hi <= exact_to,
                    vlr=None if vlr is None else vlr.rows(1, 0, hi - lo)).seal()
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
