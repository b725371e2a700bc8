"""One engine loop thread under an asyncio server: continuous batching for HTTP.

Every HTTP request `submit`s a `jaxkv.engine.engine.Request` and reads events
from its own `asyncio.Queue`; one thread steps the engine (`Engine.step`: admit,
prefill, a `lax.scan` of decode steps, retire) as long as anything is queued or
running, so concurrent requests share every decode step. After each step the
thread posts, thread-safely onto the server's event loop,

    ("tokens", [ids so far], cached prompt tokens)   for every running request
                                                     that grew, and
    ("done", Result)           for every request that finished,

once after the step's prefill (first tokens: TTFT does not wait for the decode
call) and once after its decode, so streaming sends a delta per engine step
(up to `EngineConfig.decode_steps` tokens).

Agent sessions (with the engine's prefix cache): a request naming a session
keeps that session's latest turn locked in the cache (`Engine.open_session` /
`close_session`); `call(fn)` runs such engine operations on the loop thread
between steps, and sessions idle for `session_idle_s` are closed there.

Robustness: more than `max_pending` queued + running requests raise `QueueFull`
(the server answers 429); `cancel` (a client that went away) frees the row's
slots at the next step; an exception inside a step fails the requests then in
the engine with an error result and frees their slots (`Engine.abort`), and the
loop goes on serving; `stop` cancels what is left and joins the thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
import traceback

from jaxkv.engine import executables
from jaxkv.engine.engine import Engine, Request, Result

log = logging.getLogger("jaxkv.server")


class QueueFull(Exception):
  """More requests are queued or running than the server takes."""


@dataclasses.dataclass
class _Waiter:
  loop: asyncio.AbstractEventLoop
  queue: asyncio.Queue
  tokens: list = dataclasses.field(default_factory=list)   # the tokens last posted

  def send(self, event: tuple) -> None:
    """Puts `event` on the queue from any thread (nothing when the server is gone)."""
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
    except RuntimeError:   # the event loop is closed
      pass


@dataclasses.dataclass
class LoopStats:
  """Counters for /metrics (read without a lock: plain ints, one writer)."""
  finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  rejected_full: int = 0
  step_errors: int = 0
  steps: int = 0
  busy_s: float = 0.0


class EngineLoop:
  """Owns the engine; the only thread that calls `Engine.step`."""

  def __init__(self, engine: Engine, max_pending: int = 256, session_idle_s: float = 600.0,
               expire=None, max_compiled: int = 0):
    """expire(idle_s): closes sessions idle that long (default: the engine's own,
    with its prefix cache); called on the loop thread about once a second.
    max_compiled: the bound on compiled step variants checked after every step
    (`jaxkv.engine.executables.Budget`; 0: none)."""
    self.engine = engine
    if expire is None and engine.radix is not None:
      expire = engine.expire_sessions
    self._expire = expire
    self.max_pending = max_pending
    self.session_idle_s = session_idle_s
    self._ops: collections.deque = collections.deque()   # (fn, future): loop thread
    self.stats = LoopStats()
    self._waiters: dict[str, _Waiter] = {}
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._stopping = False
    self._draining = False      # shutting down: new requests refused, running ones go on
    self._thread: threading.Thread | None = None
    self._expired_at = 0.0
    self.compiled = executables.Budget(max_compiled)

  # ------------------------------------------------------------ server side
  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="jaxkv-engine-loop", daemon=True)
    self._thread.start()

  @property
  def alive(self) -> bool:
    return (self._thread is not None and self._thread.is_alive() and not self._stopping
            and not self._draining)

  @property
  def pending(self) -> int:
    """Requests queued or running."""
    return len(self._waiters)

  def _check_room(self) -> None:
    """Raises QueueFull while stopping or past max_pending (hold self._lock)."""
    if self._stopping or self._draining:
      raise QueueFull("the server is shutting down")
    if self.pending >= self.max_pending:
      self.stats.rejected_full += 1
      raise QueueFull(f"{self.pending} requests queued or running "
                      f"(server.max_pending={self.max_pending})")

  def submit(self, req: Request) -> asyncio.Queue:
    """Queues `req`; its events arrive on the returned queue (call from the event loop)."""
    aloop = asyncio.get_running_loop()
    with self._lock:
      self._check_room()
      waiter = _Waiter(aloop, asyncio.Queue())
      self._waiters[req.id] = waiter
      self.engine.submit(req)
    self._wake.set()
    return waiter.queue

  def cancel(self, request_id: str) -> None:
    """The client went away: the next step frees the request's slots."""
    if self.engine.cancel(request_id):
      self._wake.set()

  def call(self, fn) -> concurrent.futures.Future:
    """Runs `fn()` on the loop thread between steps (engine state such as sessions
    is only touched there: session admin, building a mechanism's request); the
    future carries its result or exception."""
    fut = concurrent.futures.Future()
    self._ops.append((fn, fut))
    self._wake.set()
    return fut

  def _run_ops(self) -> None:
    while self._ops:
      fn, fut = self._ops.popleft()
      try:
        fut.set_result(fn())
      except Exception as e:  # handed to the caller
        fut.set_exception(e)
    if self._expire is not None and time.monotonic() - self._expired_at > 1.0:
      self._expired_at = time.monotonic()
      self._expire(self.session_idle_s)

  def drain(self) -> None:
    """Shutdown begins: new requests are refused (`alive` is False); running ones go on."""
    with self._lock:
      self._draining = True

  def cancel_all(self) -> int:
    """Cancels every queued and running engine request and answers each at once with
    a "cancelled" result (its tokens as last posted); returns how many. The engine
    frees their slots at its next step, but the answers do not wait for it: a step
    that is still compiling or prefilling a long prompt when a shutdown's grace
    period ends would otherwise outlast uvicorn's flush and leave the clients
    without a reply (seen under load: a compile past the 10 s flush)."""
    with self._lock:
      waiters = dict(self._waiters)
      self._waiters.clear()
    for rid, waiter in waiters.items():
      self.engine.cancel(rid)
      waiter.send(("done", Result(rid, waiter.tokens, 0, len(waiter.tokens), 0.0, 0.0,
                                  "cancelled")))
    self._wake.set()
    return len(waiters)

  def stop(self, timeout: float = 30.0) -> None:
    """Cancels every queued and running request, lets the loop retire them, joins."""
    with self._lock:
      self._stopping = True
    self.cancel_all()
    if self._thread is not None:
      self._thread.join(timeout)

  # ------------------------------------------------------------ loop thread
  def _post(self, rid: str, event: tuple, final: bool = False) -> None:
    with self._lock:
      waiter = self._waiters.pop(rid, None) if final else self._waiters.get(rid)
    if waiter is not None:
      waiter.send(event)

  def _post_progress(self) -> None:
    for rid, (tokens, cached) in self.engine.progress().items():
      waiter = self._waiters.get(rid)
      if waiter is not None and len(tokens) > len(waiter.tokens):
        waiter.tokens = tokens              # a copy (Engine.progress)
        self._post(rid, ("tokens", tokens, cached))

  def _run(self) -> None:
    while True:
      self._run_ops()
      if not self.engine.busy:
        if self._stopping:
          self._run_ops()
          return
        self.compiled.check()            # session ops compile too
        self._wake.wait(0.5)
        self._wake.clear()
        continue
      t0 = time.perf_counter()
      try:
        results = self.engine.step(after_prefill=self._post_progress)
      except Exception as e:  # isolate: fail this batch, keep serving
        self.stats.step_errors += 1
        log.error("engine step failed; failing its requests:\n%s", traceback.format_exc())
        results = self.engine.abort(f"engine step failed: {type(e).__name__}: {e}")
      self.stats.steps += 1
      self.stats.busy_s += time.perf_counter() - t0
      self._post_progress()
      for res in results:
        self.stats.finished[res.finish_reason] += 1
        self._post(res.id, ("done", res), final=True)
      self.compiled.check()              # after the results are out: a release is slow
