"""Continuous-batching engine: host scheduler around the jitted steps.

A fixed number of rows (`EngineConfig.max_batch`) decode together. Each loop:
admit queued requests into empty rows (allocating their prompt slots), prefill
the admitted rows chunk by chunk (ragged: each row advances through its own
prompt), then run up to `EngineConfig.decode_steps` tokens for every decoding row
in one `lax.scan` call (fewer when no row needs that many: the step count is the
largest remaining budget rounded up to a power of two), and retire rows that hit
a stop token or their token limit, returning their slots to the allocator.
Results are handed to `on_result` the moment a request finishes.

Prefill and decode go through the one driver (`jaxkv.engine.driver`); shapes
are bucketed by `jaxkv.kv.plan`, so a run compiles a handful of step
variants, not one per request. The pool is allocated on the first run.

Timing: `ttft_s` runs from a request's admission into a row to its first
token; `latency_s` from admission to its last token (in batch mode every
request has arrived at start; queueing before admission is reported
separately in the metrics as wall time).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import distributed, sharding
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine.driver import Driver
from jaxkv.engine.metrics import EngineMetrics
from jaxkv.engine.sampling import SamplingParams
from jaxkv.kv import plan
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import OutOfSlotsError, PagedAllocator


@dataclasses.dataclass
class Request:
  """One generation request: prompt token ids and its sampling settings."""
  id: str
  prompt: list[int]
  sampling: SamplingConfig = SamplingConfig()


@dataclasses.dataclass
class Result:
  id: str
  tokens: list[int]
  prompt_tokens: int
  completion_tokens: int
  ttft_s: float
  latency_s: float
  finish_reason: str     # "stop" | "length" | "error"
  error: str | None = None


@dataclasses.dataclass
class _Row:
  req: Request
  seq: int
  admitted: float
  prefilled: int = 0               # prompt tokens already through prefill
  generated: list[int] = dataclasses.field(default_factory=list)
  first_token_at: float | None = None
  finish: str | None = None


class Engine:
  """Serves requests on one model; owns the KV pool and the host allocator."""

  def __init__(self, model: nnx.Module, stop_ids: Iterable[int], cache: CacheConfig,
               engine: EngineConfig, mesh=None):
    """mesh: a `jaxkv.sharding.make_mesh` ("data", "model") mesh to shard the
    weights, the pool and the batch rows on (None: one device)."""
    self.model_cfg = model.cfg
    self.cache_cfg = cache
    self.cfg = engine
    self.mesh = mesh
    self.graphdef, self.weights = nnx.split(model)
    if mesh is not None:   # host copies first: a mesh may span other processes' devices
      self.weights = sharding.shard(distributed.to_host(self.weights),
                                    sharding.param_shardings(self.weights, mesh, model.cfg))
    self.stop_ids = sorted(set(int(t) for t in stop_ids))
    self.driver: Driver | None = None     # the pool is allocated on the first run
    self.allocator = PagedAllocator(cache.num_pages, cache.page_size)
    self.metrics = EngineMetrics(
        bytes_per_slot=2 * model.cfg.num_layers * model.cfg.d_kv * jnp.dtype(cache.dtype).itemsize)
    self.attn_impl = engine.attention_impl

  @property
  def kv(self) -> kv_state.KVPool | None:
    return None if self.driver is None else self.driver.kv

  # ------------------------------------------------------------------ helpers
  def _sampling(self, rows: list[_Row | None]) -> tuple[SamplingParams, bool]:
    return SamplingParams.from_configs([None if r is None else r.req.sampling for r in rows],
                                       self.cfg.max_batch)

  def _slot_map(self, rows: list[_Row | None], width: int) -> np.ndarray:
    return plan.slot_rows([None if r is None else self.allocator.slot_map(r.seq) for r in rows],
                          width)

  def _note_memory(self) -> None:
    self.metrics.observe_live_slots(self.allocator.num_live_slots)

  # --------------------------------------------------------------- admission
  def _pages(self, n: int) -> int:
    return -(-n // self.cache_cfg.page_size)

  def _admit(self, req: Request, now: float, rows: list[_Row | None]) -> _Row | Result:
    """Allocates the prompt's slots, or raises OutOfSlotsError to make it wait.

    Admission reserves each row's worst case (prompt + max_tokens) in pages, so
    a running row can always grow during decode and nothing is preempted;
    slots are still allocated only as tokens arrive (peak KV = real use).
    """
    n = len(req.prompt)
    limit = self.cache_cfg.max_seq_len
    if n == 0:
      return _error(req, "empty prompt")
    if n + req.sampling.max_tokens > limit:
      return _error(req, f"prompt ({n} tokens) + max_tokens ({req.sampling.max_tokens}) "
                         f"exceeds cache.max_seq_len={limit}")
    need = self._pages(n + req.sampling.max_tokens)
    if need > self.cache_cfg.num_pages - 1:
      return _error(req, f"KV pool too small for this request: it needs {need} pages of "
                         f"{self.cache_cfg.page_size} slots, the pool has "
                         f"{self.cache_cfg.num_pages - 1}; raise cache.num_pages")
    outstanding = sum(
        self._pages(len(r.req.prompt) + r.req.sampling.max_tokens)
        - self._pages(self.allocator.length(r.seq)) for r in rows if r is not None)
    if self.allocator.num_free_pages < need + outstanding:
      raise OutOfSlotsError(f"{need} pages needed, {self.allocator.num_free_pages} free, "
                            f"{outstanding} reserved by running requests")
    seq = self.allocator.new_sequence()
    self.allocator.extend(seq, n)
    return _Row(req=req, seq=seq, admitted=now)

  # ------------------------------------------------------------------ phases
  def _prefill(self, rows: list[_Row | None]) -> None:
    todo = [r if r is not None and r.prefilled < len(r.req.prompt) else None for r in rows]
    if not any(todo):
      return
    sampling, greedy_only = self._sampling(rows)
    t0 = time.perf_counter()
    n_tokens = 0
    segments = [None if r is None else plan.Row(np.asarray(r.req.prompt[r.prefilled:], np.int32),
                                                r.prefilled) for r in todo]
    for ch, out in self.driver.prefill(
        segments, chunk=self.cfg.prefill_chunk, max_width=self.cache_cfg.max_seq_len,
        slot_map=lambda w: self._slot_map(rows, w), read="last", sampling=sampling,
        greedy_only=greedy_only):
      n_tokens += int(ch.count.sum())
      if not ch.ends.any():
        continue
      nxt = self.driver.fetch(out.token)
      now = time.perf_counter()
      for i in np.nonzero(ch.ends)[0]:
        r = rows[i]
        r.prefilled = len(r.req.prompt)
        r.first_token_at = now
        self._emit(r, int(nxt[i]))
    self.metrics.add_prefill(n_tokens, time.perf_counter() - t0)

  def _emit(self, r: _Row, token: int) -> None:
    r.generated.append(token)
    if token in self.stop_ids:
      r.finish = "stop"
    elif len(r.generated) >= r.req.sampling.max_tokens:
      r.finish = "length"

  def _decode(self, rows: list[_Row | None]) -> None:
    live = [i for i, r in enumerate(rows) if r is not None and r.finish is None
            and r.prefilled == len(r.req.prompt)]
    if not live:
      return
    B = self.cfg.max_batch
    # Steps this call: the most any live row may still take, rounded up to a power
    # of two (a handful of compiled variants) and capped at decode_steps, so short
    # completions do not pay for decode_steps steps.
    cap = self.cfg.decode_steps
    most = max(rows[i].req.sampling.max_tokens - len(rows[i].generated) for i in live)
    n = plan.bucket(min(most, cap), 1, cap, hi=cap)
    tokens = np.zeros(B, np.int32)
    positions = np.full(B, -1, np.int32)
    remaining = np.zeros(B, np.int32)
    need = 0
    for i in live:
      r = rows[i]
      pos = len(r.req.prompt) + len(r.generated) - 1   # position of the last sampled token
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
    t0 = time.perf_counter()
    res = self.driver.decode(tokens, positions, slot_map, remaining, num_steps=n,
                             stop_ids=stop_ids, sampling=sampling, greedy_only=greedy_only)
    out, emitted = self.driver.fetch(res.tokens), self.driver.fetch(res.emitted)
    dt = time.perf_counter() - t0
    count = 0
    for i in live:
      r = rows[i]
      for s in range(n):
        if emitted[s, i] and r.finish is None:
          self._emit(r, int(out[s, i]))
          count += 1
    self.metrics.add_decode(count, dt)

  def _retire(self, r: _Row, now: float) -> Result:
    # Frees every slot of the row, including those allocated ahead for decode
    # steps it did not take.
    self.allocator.free_sequence(r.seq)
    return Result(id=r.req.id, tokens=list(r.generated), prompt_tokens=len(r.req.prompt),
                  completion_tokens=len(r.generated),
                  ttft_s=(r.first_token_at or now) - r.admitted,
                  latency_s=now - r.admitted, finish_reason=r.finish or "length")

  # -------------------------------------------------------------------- API
  def run(self, requests: Iterable[Request]) -> Iterator[Result]:
    """Generates for every request; yields each result as soon as it finishes.

    Requests are read lazily from the iterable, so a caller can stream a file.
    A request that cannot run (empty, longer than the cache) yields a result
    with finish_reason "error" and the run goes on.
    """
    if self.driver is None:
      if self.mesh is None:
        kv = kv_state.init_pool(self.model_cfg, self.cache_cfg)
      else:   # built in place on the mesh (no single-device copy first)
        make = functools.partial(kv_state.init_pool, self.model_cfg, self.cache_cfg)
        kv = jax.jit(make, out_shardings=sharding.pool_shardings(
            jax.eval_shape(make), self.mesh, self.model_cfg))()
      self.driver = Driver(self.graphdef, self.weights, kv, attn_impl=self.attn_impl,
                           mesh=self.mesh)
    queue = iter(requests)
    pending: Request | None = None
    rows: list[_Row | None] = [None] * self.cfg.max_batch
    exhausted = False
    t_start = time.perf_counter()
    while True:
      # Admit into empty rows.
      for i in range(len(rows)):
        if rows[i] is not None:
          continue
        while not exhausted:
          req = pending if pending is not None else next(queue, None)
          pending = None
          if req is None:
            exhausted = True
            break
          try:
            got = self._admit(req, time.perf_counter(), rows)
          except OutOfSlotsError as e:
            if any(r is not None for r in rows):
              pending = req   # wait for a row to retire and free its slots
              break
            got = _error(req, f"KV pool too small for this request: {e}")
          if isinstance(got, Result):
            self.metrics.add_request(got)
            yield got
            continue
          rows[i] = got
          break
        if pending is not None or exhausted:
          break
      if all(r is None for r in rows):
        break
      self._note_memory()
      self._prefill(rows)
      self._decode(rows)
      now = time.perf_counter()
      for i, r in enumerate(rows):
        if r is not None and r.finish is not None:
          res = self._retire(r, now)
          rows[i] = None
          self.metrics.add_request(res)
          yield res
    self.metrics.wall_s += time.perf_counter() - t_start


def _error(req: Request, msg: str) -> Result:
  return Result(id=req.id, tokens=[], prompt_tokens=len(req.prompt), completion_tokens=0,
                ttft_s=0.0, latency_s=0.0, finish_reason="error", error=msg)
