"""Continuous-batching engine: host scheduler around the jitted steps.

A fixed number of rows (`EngineConfig.max_batch`) decode together. Each loop:
admit queued requests into empty rows (allocating their prompt slots), run one
prefill chunk for the rows with prompt left (ragged: each row advances through
its own prompt by up to `prefill_chunk` tokens; a long prompt takes one chunk per
loop, so rows already decoding wait for at most one chunk), then run up to
`EngineConfig.decode_steps` tokens for every decoding row in one `lax.scan` call
(fewer when no row needs that many: the step count is the largest remaining
budget rounded up to a power of two), and retire rows that hit a stop token or
their token limit, returning their slots to the allocator. Results are handed to
`on_result` the moment a request finishes.

Prefill and decode go through the one driver (`jaxkv.engine.driver`); shapes are
bucketed by `jaxkv.kv.plan`, so a run compiles a handful of step variants, not one
per request. The pool is allocated on the first run.

Timing: `ttft_s` runs from a request's admission into a row to its first token;
`latency_s` from admission to its last token (queueing before admission is in
the metrics' wall time).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import distributed, sharding
from jaxkv.config import CacheConfig, EngineConfig
from jaxkv.engine.driver import Driver
from jaxkv.engine.forced import ForcedRows
from jaxkv.engine.grammar import batch_mask
from jaxkv.engine.kv_manager import KVManager
from jaxkv.engine.mechanism_rows import MechanismRows
from jaxkv.engine.mechanisms import Mechanism
from jaxkv.engine.metrics import EngineMetrics
from jaxkv.engine.request import Request, Result, Row, forced_block
from jaxkv.engine.request import cancelled as _cancelled
from jaxkv.engine.request import error as _error
from jaxkv.engine.sampling import SamplingParams
from jaxkv.engine.session_holds import SessionHolds
from jaxkv.kv import plan
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import OutOfSlotsError, PagedAllocator
from jaxkv.kv.radix import RadixCache
from jaxkv.models.forward import Capture, LoraInputs

log = logging.getLogger(__name__)

_OWNER = "engine"     # the engine's name for its reservation in the KV manager
_TREE = "prefix"      # its radix trees' name there


class Engine(MechanismRows, SessionHolds, ForcedRows):
  """Serves requests on one model over the KV manager's pool and allocator."""

  def __init__(self, model: nnx.Module, stop_ids: Iterable[int], cache: CacheConfig,
               engine: EngineConfig, mesh=None, lora=None, lr_rank: int = 0):
    """mesh: a `jaxkv.sharding.make_mesh` ("data", "model") mesh to shard the
    weights, the pool and the batch rows on (None: one device).
    lora: a `jaxkv.models.lora.LoraWeights` adapter stack (LRAgent's shared-A role
    adapters; replicated on a mesh); each request picks one with `Request.adapter` (-1:
    the base model), and one batch mixes them. The prefix cache keeps one radix tree per
    adapter (an adapter's K/V differ from the base's), all on the one pool: a request
    adopts and caches in its own adapter's tree, and eviction takes from every tree.
    lr_rank: the pool's LoRA low-rank value cache (`KVManager`; 0: none). With one
    (of the adapters' rank, which need a LoRA on v) every adapter row runs decoupled
    (`LoraInputs.mode`, `lora_mode`): the pool keeps the base value and x A_v s, and
    attention applies the row's B_v (LRAgent's base_lr_shared, which the `agents`
    mechanism serves); the adapters' prefix-cache trees then hold that form too.
    Without one they run "full" (the adapter's own K/V in the pool).

    The engine's `kv_manager` (`jaxkv.engine.kv_manager.KVManager`) owns the pool,
    the allocator and the radix trees; session runners given the same manager
    (`kv=engine.kv_manager`) allocate from the same pool, and the engine keeps the
    pages its running rows may still need reserved against them."""
    if lora is not None and lr_rank and (lr_rank != lora.rank or "v" not in lora.targets):
      raise ValueError(f"a pool low-rank value cache of rank {lr_rank} runs the adapters "
                       f"decoupled: they need rank {lr_rank} and a LoRA on v (they have "
                       f"rank {lora.rank}, targets {lora.targets})")
    self.lora = lora
    self.lora_mode = "decoupled" if lora is not None and lr_rank else "full"
    self.model_cfg, self.cache_cfg, self.cfg, self.mesh = model.cfg, cache, engine, mesh
    self.graphdef, self.weights = nnx.split(model)
    if mesh is not None:
      self.weights = sharding.shard_weights(self.weights, mesh, model.cfg)
      if lora is not None:          # replicated: each row picks its adapter's B
        self.lora = sharding.replicate(lora, mesh)
    self.stop_ids = sorted({int(t) for t in stop_ids})
    self.driver: Driver | None = None     # the pool is allocated on the first run
    # with the pool's slots split on the mesh's "data" axis, each data shard's rows
    # allocate from that shard's pages (and the shard's first page is its sentinel)
    data = 1 if mesh is None else mesh.shape["data"]
    self.shards = data if (data > 1 and engine.max_batch % data == 0
                           and cache.num_pages % data == 0
                           and cache.num_pages >= 2 * data) else 1
    self.attn_impl = engine.attention_impl
    self.kv_manager = KVManager(model.cfg, cache, self.graphdef, self.weights, mesh=mesh,
                                shards=self.shards, lr_rank=lr_rank, attn_impl=self.attn_impl)
    self.allocator: PagedAllocator = self.kv_manager.allocator
    self.radix = self.kv_manager.tree(_TREE) if engine.prefix_cache else None  # the base's
    self.mechanisms: dict[str, Mechanism] = {}
    # open sessions: id -> [lock on the path of its latest turn or None, last use time,
    #                       the tree that lock is in]
    self._sessions: dict[str, list] = {}
    self.metrics = EngineMetrics(
        bytes_per_slot=2 * model.cfg.num_layers * model.cfg.d_kv * jnp.dtype(cache.dtype).itemsize)
    # step API state: queued requests, running rows, cancellations (guarded by _lock)
    self._lock = threading.Lock()
    self._waiting: collections.deque[Request] = collections.deque()
    self._rows: list[Row | None] = [None] * engine.max_batch
    self._admitted = 0                       # rows admitted so far (Row.order)
    self._cancelled: set[str] = set()

  def add_mechanism(self, mechanism: Mechanism) -> Mechanism:
    """Makes a KV mechanism (`jaxkv.engine.mechanisms`) available to requests that
    name it (`Request.mechanism`); returns it."""
    if mechanism.name in self.mechanisms:
      raise ValueError(f"a mechanism named {mechanism.name!r} is added already")
    self.mechanisms[mechanism.name] = mechanism
    mechanism.prefill_chunk = self.cfg.prefill_chunk
    return mechanism

  def cache_for(self, adapter: int) -> RadixCache | None:
    """The prefix cache (radix tree) of requests on `adapter` (-1: the base model)."""
    if self.radix is None or adapter < 0:
      return self.radix
    return self.kv_manager.tree(_TREE, adapter)

  @property
  def caches(self) -> list[RadixCache]:
    """Every prefix-cache tree (base first); empty without the prefix cache."""
    return self.kv_manager.trees(_TREE)

  @property
  def kv(self) -> kv_state.KVPool | None:   # the pool (None before the first run)
    return None if self.driver is None else self.driver.kv

  # ------------------------------------------------------------------ helpers
  def _sampling(self, rows: list[Row | None]) -> tuple[SamplingParams, bool]:
    """Per-row sampling, with the rows' grammar bitmasks when any row has one."""
    reqs = [None if r is None else r.req for r in rows]
    mask = batch_mask([None if q is None else q.grammar for q in reqs],
                      self.model_cfg.vocab_size)
    return SamplingParams.from_configs([None if q is None else q.sampling for q in reqs],
                                       len(rows), mask)

  def _slot_map(self, rows: list[Row | None], width: int) -> np.ndarray:
    return plan.slot_rows([None if r is None else self.allocator.slot_map(r.seq) for r in rows],
                          width)

  def _lora(self, rows: list[Row | None]) -> dict:
    """`lora=` for the driver: each row's adapter (-1 base, and for idle rows); none
    when no row runs on an adapter (the base model's step, no low-rank work)."""
    ids = np.asarray([-1 if r is None else r.req.adapter for r in rows], np.int32)
    if self.lora is None or not (ids >= 0).any():
      return {}
    return {"lora": LoraInputs(self.lora, self.driver.put(ids), mode=self.lora_mode)}

  def _note_memory(self) -> None:
    self.metrics.observe_live_slots(self.allocator.num_live_slots)

  # --------------------------------------------------------------- admission
  def _pages(self, n: int) -> int:
    return -(-n // self.cache_cfg.page_size)

  def _row_shard(self, i: int) -> int:
    """The data shard that holds batch row i (rows split evenly, in order)."""
    return i // (self.cfg.max_batch // self.shards)

  def _admit(self, req: Request, now: float, rows: list[Row | None],
             shard: int = 0) -> Row | Result:
    """Allocates the prompt's slots on `shard`'s pages, or raises OutOfSlotsError
    to make it wait.

    Admission reserves each row's worst case (prompt + max_tokens) in pages, so
    a running row can always grow during decode and nothing is preempted;
    slots are still allocated only as tokens arrive (peak KV = real use). A
    mechanism that lays out its row's sequence (`Match.defer`) names the fresh
    prompt tokens it will take (`Match.reserve`: e.g. MemArt's question), which is
    what is checked and reserved then.
    """
    n = len(req.prompt)
    if n == 0:
      return _error(req, "empty prompt")
    if req.forced is not None:           # teacher forcing: len(forced) greedy steps
      if not len(req.forced):
        return _error(req, "forced must hold at least one token")
      if req.grammar is not None:
        return _error(req, "a teacher-forced request cannot have a grammar")
      req.sampling = dataclasses.replace(req.sampling, max_tokens=len(req.forced),
                                         temperature=0.0)
    if req.adapter != -1 and (self.lora is None or not 0 <= req.adapter < self.lora.num_adapters):
      return _error(req, f"adapter {req.adapter} does not exist (the engine has "
                         f"{0 if self.lora is None else self.lora.num_adapters})")
    match = mech = found = None
    cache = self.cache_for(req.adapter)
    if req.mechanism is not None:
      mech = self.mechanisms.get(req.mechanism)
      if mech is None:
        return _error(req, f"mechanism {req.mechanism!r} is not served here (the engine has "
                           f"{sorted(self.mechanisms) or 'none'})")
      if req.adapter != -1 and not mech.adapters:
        return _error(req, f"mechanism {req.mechanism!r} runs on the base model, not on an "
                           "adapter")
      try:
        found = mech.match(req)                    # its own cache, locked
      except (KeyError, TypeError, ValueError) as e:   # e.g. a context it cannot use
        return _error(req, f"mechanism {req.mechanism!r} refused the request: {e!r}")
      hit = found.hit
      if found.defer and found.reserve is not None:   # it lays out its own sequence
        n = found.reserve
    too_long = self._too_long(n, req.sampling.max_tokens)
    if too_long:
      if found is not None:
        mech.unmatch(found)
      return _error(req, too_long, "too_large")
    if mech is None:
      if cache is not None:                        # the last prompt token is recomputed
        match = cache.match_prefix(req.prompt[:-1], lock=True)
      hit = match.n_matched if match is not None else 0
    need = self._reserve(n - hit, req.sampling.max_tokens, hit)
    outstanding = sum(self._reserve(r.n - r.cached, r.req.sampling.max_tokens,
                                    r.cached)
                      - self._pages(self.allocator.length(r.seq) - r.cached)
                      for i, r in enumerate(rows)
                      if r is not None and self._row_shard(i) == shard)
    # cached KV of finished requests goes first (every radix tree on the pool, least
    # recently used first), then other caches on the pool (the KV manager's evictors);
    # pages other owners reserved stay theirs
    short = self.kv_manager.make_room(need + outstanding, shard, owner=_OWNER)
    if short > 0:
      if match is not None:
        cache.release_lock(match)
      if found is not None:
        mech.unmatch(found)
      raise OutOfSlotsError(f"{need} pages needed, {self.allocator.shard_free_pages(shard)} "
                            f"free, {outstanding} reserved by running requests, "
                            f"{self.kv_manager.reserved(shard, exclude=_OWNER)} by others")
    seq = self.allocator.new_sequence(shard=shard)
    if hit:
      self.allocator.adopt(seq, (found or match).slots)
    if found is None or not found.defer:
      self.allocator.extend(seq, n - hit)
    self.metrics.cached_tokens += hit
    row = Row(req=req, seq=seq, admitted=now, prefilled=hit, cached=hit, lock=match,
              state=None if found is None else found.state, n=n, order=self._admitted)
    if found is not None and not found.defer:      # KV the mechanism writes itself
      return self._fill(row, mech)
    return row

  def _too_long(self, n: int, max_tokens: int) -> str | None:
    """Why a row of n prompt positions + max_tokens can never run here (None: it can)."""
    limit = self.cache_cfg.max_seq_len
    if n + max_tokens > limit:
      return f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds cache.max_seq_len={limit}"
    need = self._pages(n + max_tokens)
    room = self.cache_cfg.num_pages // self.shards - 1
    if need > room:
      where = f" per data shard ({self.shards})" if self.shards > 1 else ""
      return (f"KV pool too small for this request: it needs {need} pages of "
              f"{self.cache_cfg.page_size} slots, the pool has {room}{where}; raise "
              "cache.num_pages")
    return None

  def _reserve(self, new_prompt: int, max_tokens: int, hit: int) -> int:
    """Pages a row may still take: its new tokens, plus one when it adopted a prefix
    (the adopted slots are not its pages; its first fresh page starts mid-count)."""
    return self._pages(new_prompt + max_tokens) + (1 if hit else 0)

  # ------------------------------------------------------------------ phases
  def _prefill(self, rows: list[Row | None]) -> None:
    """One chunk of prefill for the rows with prompt left (each row's next
    `prefill_chunk` prompt tokens), packed: only they run, in a batch of the next
    power of two (a lone prompt costs one row, not max_batch; under a mesh the rows
    keep their places, which the data axis shards). A row whose prompt ends in the
    chunk samples its first token. One chunk per engine step, interleaved with the
    step's decode call: a long prompt delays the rows already decoding by one chunk
    per step, never by its whole prefill."""
    self._own_prefill(rows)
    rows = [r if r is not None and r.prefilled < r.n and not self._owns(r)
            else None for r in rows]
    todo = [r for r in rows if r is not None]
    if not todo:
      return
    if self.mesh is None:
      nb = plan.bucket(len(todo), 1, self.cfg.max_batch, hi=self.cfg.max_batch)
      rows = todo + [None] * (nb - len(todo))
    sampling, greedy_only = self._sampling(rows)
    opts = self._lora(rows)
    mechs = [None if r is None or r.req.mechanism is None else self.mechanisms[r.req.mechanism]
             for r in rows]
    capture = [m is not None and m.capture_q(r) for m, r in zip(mechs, rows)]
    if any(capture):
      opts = dict(opts, capture=Capture(q=True))
    t0 = time.perf_counter()
    n_tokens = 0
    segments = [None if r is None else plan.Row(np.asarray(r.req.prompt[r.prefilled:], np.int32),
                                                r.prefilled) for r in rows]
    targets = None           # forced rows: log p(forced[0]) at their last prompt token
    if any(r is not None and r.req.forced is not None for r in rows):
      targets = [None if r is None or r.req.forced is None else
                 np.append(r.req.prompt[r.prefilled + 1:], r.req.forced[0]) for r in rows]
    for ch, out in self.driver.prefill(
        segments, chunk=self.cfg.prefill_chunk, max_width=self.cache_cfg.max_seq_len,
        slot_map=lambda w: self._slot_map(rows, w), read="last", targets=targets,
        sampling=sampling, greedy_only=greedy_only, options=lambda ch: opts):
      n_tokens += int(ch.count.sum())
      for i, r in enumerate(rows):
        if r is not None and ch.count[i]:
          if capture[i]:
            mechs[i].on_chunk(r, out.q[:, i], r.prefilled, int(ch.count[i]))
          r.prefilled += int(ch.count[i])
      if ch.ends.any():
        nxt = distributed.fetch(out.token)
        lp = None if targets is None else distributed.fetch(out.logprob)[:, 0]
        now = time.perf_counter()
        for i in np.nonzero(ch.ends)[0]:
          r = rows[i]
          if mechs[i] is not None:
            mechs[i].after_prefill(r)      # e.g. prune, before the row decodes
          r.first_token_at = now
          self._emit(r, int(nxt[i]), None if lp is None else float(lp[i]))
      break                              # the next chunk runs in the next step
    self.metrics.add_prefill(n_tokens, time.perf_counter() - t0)

  def _emit(self, r: Row, token: int, logprob: float | None = None) -> None:
    r.emit(token, logprob, self.stop_ids)

  def _decode(self, rows: list[Row | None]) -> None:
    live = [i for i, r in enumerate(rows) if r is not None and r.finish is None
            and r.prefilled == r.n and not self._forced_by_prefill(r)]
    if not live:
      return
    if self.mesh is None:   # packed like the prefill: a lone row costs one row, not max_batch
      nb = plan.bucket(len(live), 1, self.cfg.max_batch, hi=self.cfg.max_batch)
      rows, live = [rows[i] for i in live] + [None] * (nb - len(live)), list(range(len(live)))
    B = len(rows)
    # Steps this call: the most any live row may still take, rounded up to a power
    # of two (a handful of compiled variants) and capped at decode_steps, so short
    # completions do not pay for decode_steps steps.
    # A row with a grammar takes one token per call: its next mask depends on it.
    cap = 1 if any(rows[i].req.grammar is not None for i in live) else self.cfg.decode_steps
    most = max(rows[i].req.sampling.max_tokens - len(rows[i].generated) for i in live)
    n = plan.bucket(min(most, cap), 1, cap, hi=cap)
    tokens = np.zeros(B, np.int32)
    positions = np.full(B, -1, np.int32)
    remaining = np.zeros(B, np.int32)
    need = 0
    for i in live:
      r = rows[i]
      pos = r.n + len(r.generated) - 1   # position of the last sampled token
      rem = r.req.sampling.max_tokens - len(r.generated)
      steps_here = min(n, rem)
      grow = pos + steps_here - self.allocator.length(r.seq)
      if grow > 0:
        self.allocator.extend(r.seq, grow)
      tokens[i], positions[i], remaining[i] = r.generated[-1], pos, rem
      need = max(need, pos + steps_here)
    self._note_memory()
    stop_ids = jnp.asarray(self.stop_ids or [-1], jnp.int32)
    sampling, greedy_only = self._sampling(rows)
    slot_map = self._slot_map(rows, plan.width(need, self.cache_cfg.max_seq_len))
    views = self._views([rows[i] if i in live else None for i in range(B)], slot_map)
    forced = forced_block(rows, live, n, B)
    if forced is not None:          # teacher-forced rows: steps on axis 0, rows on axis 1
      views.update(forced=self.driver.put(forced[0], batch_axis=1),
                   forced_rows=self.driver.put(forced[1]))
    t0 = time.perf_counter()
    res = self.driver.decode(tokens, positions, views.pop("slot_map", slot_map), remaining,
                             num_steps=n, stop_ids=stop_ids, sampling=sampling,
                             greedy_only=greedy_only, **self._lora(rows), **views)
    out, emitted = distributed.fetch(res.tokens), distributed.fetch(res.emitted)
    lp = None if res.logprob is None else distributed.fetch(res.logprob)
    dt = time.perf_counter() - t0
    count = 0
    for i in live:
      r = rows[i]
      for s in range(n):
        if emitted[s, i] and r.finish is None:
          self._emit(r, int(out[s, i]), None if lp is None else float(lp[s, i]))
          count += 1
    self.metrics.add_decode(count, dt)

  def _release(self, r: Row, cache: bool) -> None:
    """Frees the row's sequence; with the prefix cache on, first caches the tokens
    whose KV it wrote (prompt + every generated token but the last, which was never
    fed back), when the prompt was prefilled whole. A mechanism's row is its
    mechanism's to cache (`Mechanism.finish`)."""
    if r.req.mechanism is not None:
      if r.pending is not None:          # a prefill cut short (cancel, abort): its finally
        r.pending.close()
        r.pending = r.work = r.reply = None
      try:
        r.extra = self.mechanisms[r.req.mechanism].finish(r, cache)
      finally:
        self.allocator.free_sequence(r.seq)
      return
    tree = self.cache_for(r.req.adapter)
    if tree is not None:
      if cache and r.prefilled == r.n:
        done = np.asarray(list(r.req.prompt) + r.generated[:-1], np.int64)
        tree.insert(done, self.allocator.slot_map(r.seq)[:len(done)])
        if r.req.session is not None:
          self._hold_turn(r.req.session, tree, done)
      if r.lock is not None:
        tree.release_lock(r.lock)
    self.allocator.free_sequence(r.seq)

  def _retire(self, r: Row, now: float) -> Result:
    # Frees every slot of the row, including those allocated ahead for decode
    # steps it did not take (the prefix cache holds the ones it caches, a cancelled
    # plain row's too). A cancelled or failed row's mechanism keeps nothing of it
    # (`Mechanism.finish(cache=False)`: no session state advanced by a dropped turn).
    self._release(r, cache=r.req.mechanism is None or r.finish not in ("cancelled", "error"))
    return Result(id=r.req.id, tokens=list(r.generated), prompt_tokens=len(r.req.prompt),
                  completion_tokens=len(r.generated),
                  ttft_s=(r.first_token_at or now) - r.admitted,
                  latency_s=now - r.admitted, finish_reason=r.finish or "length",
                  error=r.error, cached_tokens=r.cached if r.served is None else r.served,
                  extra=r.extra, **({} if r.req.forced is None else
                                    {"logprob": list(r.logprob), "argmax": list(r.argmax)}))

  # -------------------------------------------------------------------- API
  def _ensure_driver(self) -> None:
    if self.driver is None:
      self.driver = self.kv_manager.driver

  def _update_reservation(self) -> None:
    """Tells the KV manager the pages the running rows may still take, per shard, so
    other owners of the pool (session runners) leave them free."""
    per = [0] * self.shards
    for i, r in enumerate(self._rows):
      if r is not None:
        per[self._row_shard(i)] += max(0, self._reserve(
            r.n - r.cached, r.req.sampling.max_tokens, r.cached)
            - self._pages(self.allocator.length(r.seq) - r.cached))
    self.kv_manager.reserve(_OWNER, per)

  def submit(self, req: Request) -> None:
    """Queues a request (thread-safe); `step` admits it when a row and pages are free."""
    with self._lock:
      self._waiting.append(req)

  def cancel(self, request_id: str) -> bool:
    """Cancels a queued or running request (thread-safe): the next `step` frees its
    slots and returns its result with finish_reason "cancelled" and the tokens so far.
    Returns False when no such request is queued or running."""
    with self._lock:
      known = (any(r.id == request_id for r in self._waiting) or
               any(r is not None and r.req.id == request_id for r in self._rows))
      if known:
        self._cancelled.add(request_id)
      return known

  @property
  def busy(self) -> bool:
    """True while a request is queued or running."""
    return bool(self._waiting) or any(r is not None for r in self._rows)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self._rows)

  def progress(self) -> dict[str, tuple[list[int], int]]:
    """(tokens generated so far (a copy), prompt tokens served by the prefix cache)
    of each running request with tokens, by id: what a streaming caller sends
    between `step`s. Call it from the thread that steps."""
    return {r.req.id: (list(r.generated), r.cached if r.served is None else r.served)
            for r in self._rows if r is not None and r.generated}

  def _admit_waiting(self, now: float) -> list[Result]:
    """Moves queued requests into free rows, first come first served; a request
    that does not fit while rows run waits at the head of the queue."""
    out = []
    with self._lock:
      # empty rows of the shard with the most free pages first
      empty = sorted((i for i, r in enumerate(self._rows) if r is None),
                     key=lambda i: (-self.allocator.shard_free_pages(self._row_shard(i)), i))
      for i in empty:
        while self._waiting:
          req = self._waiting[0]
          if req.id in self._cancelled:
            self._waiting.popleft()
            self._cancelled.discard(req.id)
            out.append(_cancelled(req))
            continue
          try:
            got = self._admit(req, now, self._rows, self._row_shard(i))
          except OutOfSlotsError as e:
            if any(r is not None for r in self._rows):
              return out           # wait for a row to retire and free its slots
            if self._release_idle_pin(req.session):
              continue             # an idle session's turn is evictable now: try again
            others = self.allocator.num_used_pages - self.kv_manager.reclaimable(None)
            got = (_error(req, f"KV pool too small for this request: {e}", "too_large")
                   if not others else
                   _error(req, f"the KV pool cannot hold this request now: {e}; {others} "
                          f"pages are held by open sessions and memory (close sessions, or "
                          f"raise cache.num_pages)", "pool_busy"))
          self._waiting.popleft()
          if isinstance(got, Result):
            out.append(got)
            continue
          self._rows[i] = got
          self._admitted += 1
          break
    return out

  def step(self, after_prefill=None) -> list[Result]:
    """One engine iteration: admit queued requests, one prefill pass and one decode
    call over the running rows, retire the finished ones. Returns the results that
    finished (errors and cancellations included). `after_prefill()`, if given, runs
    between prefill and decode: a server streams first tokens from there (`progress`)
    instead of after the decode call."""
    self._ensure_driver()
    now = time.perf_counter()
    with self._lock:
      for r in self._rows:
        if r is not None and r.req.id in self._cancelled:
          r.finish = "cancelled"
          self._cancelled.discard(r.req.id)
    results = self._retire_finished(now) + self._admit_waiting(now)
    # the new rows' pages are promised before any mechanism allocates inside this step
    # (a MemArt history write): other owners' allocations leave them free
    self._update_reservation()
    if any(r is not None for r in self._rows):
      self._note_memory()
      self._prefill(self._rows)
      self._forced_prefill(self._rows)       # teacher-forced continuations (forced.py)
      if after_prefill is not None:
        after_prefill()
      self._decode(self._rows)
      results += self._retire_finished(time.perf_counter())
    self._update_reservation()
    for res in results:
      self.metrics.add_request(res)
    return results

  def abort(self, error: str) -> list[Result]:
    """Fails every queued and running request with `error` and frees their slots:
    what a server does after a step raised, so one bad batch does not stop it."""
    with self._lock:
      waiting, self._waiting = list(self._waiting), collections.deque()
      self._cancelled.clear()
    out = [_error(req, error) for req in waiting]
    for i, r in enumerate(self._rows):
      if r is not None:
        self._rows[i] = None
        try:
          self._release(r, cache=False)
        except Exception:                # broad: free the other rows regardless
          log.exception("releasing request %s failed", r.req.id)
        out.append(dataclasses.replace(_error(r.req, error), tokens=list(r.generated),
                                       completion_tokens=len(r.generated)))
    self._update_reservation()
    return out

  def _retire_finished(self, now: float) -> list[Result]:
    out = []
    for i, r in enumerate(self._rows):
      if r is not None and r.finish is not None:
        self._rows[i] = None             # gone even if releasing it raises (no double free)
        out.append(self._retire(r, now))
    return out

  def run(self, requests: Iterable[Request]) -> Iterator[Result]:
    """Generates for every request; yields each result as soon as it finishes.

    Requests are read lazily from the iterable (one per free row), so a caller can
    stream a file. A request that cannot run (empty, longer than the cache) yields
    a result with finish_reason "error" and the run goes on. `submit` / `step`
    are the same engine driven by a caller's own loop (a server).
    """
    queue = iter(requests)
    exhausted = False
    t_start = time.perf_counter()
    while True:
      while not exhausted and len(self._waiting) < sum(r is None for r in self._rows):
        req = next(queue, None)
        if req is None:
          exhausted = True
        else:
          self.submit(req)
      if not self.busy:
        break
      yield from self.step()
    self.metrics.wall_s += time.perf_counter() - t_start
