"""Continuous-batching engine: host scheduler around the jitted steps.

A fixed number of rows (`EngineConfig.max_batch`) decode together. Each loop:
admit queued requests into empty rows (allocating their prompt slots), prefill
the admitted rows chunk by chunk (ragged: each row advances through its own
prompt), then run `decode_steps` tokens for every decoding row in one
`lax.scan` call, and retire rows that hit a stop token or their token limit,
returning their slots to the allocator. Results are handed to `on_result` the
moment a request finishes.

Shapes are bucketed (chunk length and slot-map width: powers of two) so a run
compiles a handful of step variants, not one per request.

Timing: `ttft_s` runs from a request's admission into a row to its first
token; `latency_s` from admission to its last token (in batch mode every
request has arrived at start; queueing before admission is reported
separately in the metrics as wall time).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine import steps
from jaxkv.engine.metrics import EngineMetrics
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import SENTINEL, OutOfSlotsError, PagedAllocator

_MIN_CHUNK = 16
_MIN_WIDTH = 128


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
  key: np.ndarray                  # [2] uint32 PRNG key of req.sampling.seed
  prefilled: int = 0               # prompt tokens already through prefill
  generated: list[int] = dataclasses.field(default_factory=list)
  first_token_at: float | None = None
  finish: str | None = None


def _bucket(n: int, lo: int, hi: int) -> int:
  """`steps.bucket` capped at hi (n itself when n > hi)."""
  return min(steps.bucket(n, lo), hi) if hi >= n else n


class Engine:
  """Serves requests on one model; owns the KV pool and the host allocator."""

  def __init__(self, model: nnx.Module, stop_ids: Iterable[int], cache: CacheConfig,
               engine: EngineConfig):
    self.model_cfg = model.cfg
    self.cache_cfg = cache
    self.cfg = engine
    self.graphdef, self.weights = nnx.split(model)
    self.stop_ids = sorted(set(int(t) for t in stop_ids))
    self.kv = kv_state.init_pool(model.cfg, cache)
    self.allocator = PagedAllocator(cache.num_pages, cache.page_size)
    self.metrics = EngineMetrics(bytes_per_slot=self.kv.nbytes_per_slot())
    self.attn_impl = engine.attention_impl

  # ------------------------------------------------------------------ helpers
  def _sampling_arrays(self, rows: list[_Row | None]) -> tuple[steps.SamplingParams, bool]:
    B = self.cfg.max_batch
    temp = np.zeros(B, np.float32)
    top_k = np.zeros(B, np.int32)
    top_p = np.ones(B, np.float32)
    keys = np.zeros((B, 2), np.uint32)
    for i, r in enumerate(rows):
      if r is None:
        continue
      s = r.req.sampling
      temp[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
      keys[i] = r.key
    greedy_only = not np.any(temp > 0)
    return steps.SamplingParams(jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p),
                                jnp.asarray(keys)), greedy_only

  def _slot_map(self, rows: list[_Row | None], need: int) -> np.ndarray:
    width = _bucket(need, _MIN_WIDTH, self.cache_cfg.max_seq_len)
    sm = np.full((self.cfg.max_batch, width), SENTINEL, np.int32)
    for i, r in enumerate(rows):
      if r is not None:
        m = self.allocator.slot_map(r.seq)
        sm[i, :len(m)] = m
    return sm

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
    key = np.asarray(jax.random.key_data(jax.random.PRNGKey(req.sampling.seed)), np.uint32)
    return _Row(req=req, seq=seq, admitted=now, key=key)

  # ------------------------------------------------------------------ phases
  def _prefill(self, rows: list[_Row | None]) -> None:
    todo = [i for i, r in enumerate(rows) if r is not None and r.prefilled < len(r.req.prompt)]
    if not todo:
      return
    B = self.cfg.max_batch
    sampling, greedy_only = self._sampling_arrays(rows)
    t0 = time.perf_counter()
    n_tokens = 0
    while todo:
      left = max(len(rows[i].req.prompt) - rows[i].prefilled for i in todo)
      C = _bucket(min(left, self.cfg.prefill_chunk), _MIN_CHUNK, self.cfg.prefill_chunk)
      tokens = np.zeros((B, C), np.int32)
      positions = np.full((B, C), -1, np.int32)
      last = np.zeros(B, np.int32)
      for i in todo:
        r = rows[i]
        chunk = r.req.prompt[r.prefilled:r.prefilled + C]
        tokens[i, :len(chunk)] = chunk
        positions[i, :len(chunk)] = np.arange(r.prefilled, r.prefilled + len(chunk))
        last[i] = len(chunk) - 1
        n_tokens += len(chunk)
      need = max(rows[i].prefilled + C for i in todo)
      slot_map = self._slot_map(rows, min(need, self.cache_cfg.max_seq_len))
      nxt, self.kv = steps.prefill_step(
          self.graphdef, self.weights, self.kv, jnp.asarray(tokens), jnp.asarray(positions),
          jnp.asarray(slot_map), jnp.asarray(last), sampling,
          attn_impl=self.attn_impl, greedy_only=greedy_only)
      nxt = np.asarray(nxt)
      now = time.perf_counter()
      for i in list(todo):
        r = rows[i]
        r.prefilled = min(r.prefilled + C, len(r.req.prompt))
        if r.prefilled == len(r.req.prompt):
          todo.remove(i)
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
    B, n = self.cfg.max_batch, self.cfg.decode_steps
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
    stop_ids = np.asarray(self.stop_ids or [-1], np.int32)
    sampling, greedy_only = self._sampling_arrays(rows)
    slot_map = self._slot_map(rows, need)
    t0 = time.perf_counter()
    out, emitted, self.kv = steps.decode_steps(
        self.graphdef, self.weights, self.kv, jnp.asarray(tokens), jnp.asarray(positions),
        jnp.asarray(slot_map), jnp.asarray(remaining), jnp.asarray(stop_ids), sampling,
        num_steps=n, attn_impl=self.attn_impl, greedy_only=greedy_only)
    out, emitted = np.asarray(out), np.asarray(emitted)
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
