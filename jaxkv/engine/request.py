"""The engine's request, its result and its batch row.

`Request` is what a caller submits (prompt ids, sampling, and for a KV mechanism
its name and context); `Result` is what comes back when it finishes; `Row` is the
engine's per-row state while it runs (mechanisms read and extend it: `state`,
`extra`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxkv.config import SamplingConfig


@dataclasses.dataclass
class Request:
  """One generation request: prompt token ids and its sampling settings."""
  id: str
  prompt: list[int]
  sampling: SamplingConfig = SamplingConfig()
  session: str | None = None   # with the prefix cache: keep this session's KV cached
  adapter: int = -1            # index into the engine's LoRA adapter stack (-1: base)
  mechanism: str | None = None  # a KV mechanism the engine has (`Engine.add_mechanism`)
  context: dict | None = None  # what that mechanism needs (e.g. its session, spans)
  # teacher forcing (evaluation): the continuation to feed instead of sampled tokens;
  # the engine runs len(forced) greedy steps, no stop token ends them, and the result
  # carries each forced token's log-probability and the greedy token at each step
  forced: list[int] | None = None
  # a host-side stop condition on the tokens generated so far, checked after every
  # token: True ends the request there as "stop" (e.g. once the tool call it writes is
  # complete); the tokens a decode call computed past that point are dropped
  until: Callable[[list[int]], bool] | None = None
  # structured output: a `jaxkv.engine.grammar.Matcher` at the start of its grammar
  # (Grammars.compile); each token is chosen among those it allows, and the reply
  # ends ("stop") where the grammar does. One matcher per request: it keeps state.
  grammar: object = None


@dataclasses.dataclass
class Result:
  id: str
  tokens: list[int]
  prompt_tokens: int
  completion_tokens: int
  ttft_s: float
  latency_s: float
  finish_reason: str     # "stop" | "length" | "error" | "cancelled"
  error: str | None = None
  cached_tokens: int = 0  # prompt tokens served by the prefix cache (not prefilled)
  extra: dict | None = None  # what a KV mechanism did (the server's usage["jaxkv"])
  error_code: str | None = None  # with "error": "too_large" (can never run here: the
                                 # request's fault), "pool_busy" (the pool is held by open
                                 # sessions and memory now: retry later), None otherwise
  logprob: list[float] | None = None  # forced requests: log p(forced[t]) at each step t
  argmax: list[int] | None = None     # forced requests: the greedy token at each step


@dataclasses.dataclass
class Row:
  req: Request
  seq: int
  admitted: float
  prefilled: int = 0               # prompt tokens already through prefill
  generated: list[int] = dataclasses.field(default_factory=list)
  first_token_at: float | None = None
  finish: str | None = None
  cached: int = 0                  # prompt positions adopted from the prefix cache
  lock: object = None              # the prefix cache's lock on that path
  state: object = None             # the row's mechanism state (`Match.state`)
  extra: dict | None = None        # what its mechanism did (Result.extra)
  error: str | None = None         # why it failed (finish "error")
  # the first position whose KV differs from a plain prefill's, holes aside (a
  # composition's approximate reuse, or the private suffix its session adopted): the
  # layout caches the row's path from here under private keys (`kv.radix`)
  private_from: int | None = None
  pending: object = None           # a mechanism's prefill generator, part way through
  work: object = None              # the `prefill_work.Work` that generator waits on
  reply: object = None             # its `Done`, sent to the generator when it resumes
  # prompt tokens reported as served without prefill (Result.cached_tokens) when that
  # is not `cached`: a mechanism that lays out its own sequence sets it (MemArt)
  served: int | None = None
  order: int = 0                   # admission order (mechanism prefills run in it)
  # the row's prompt positions: the request's prompt, unless its mechanism lays out
  # another sequence (MemArt: the chat head, retrieved blocks and the question)
  n: int = -1
  by_prefill: bool | None = None   # forced rows: continuation fed as prefill (decided once)
  logprob: list[float] = dataclasses.field(default_factory=list)   # forced rows
  argmax: list[int] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    if self.n < 0:
      self.n = len(self.req.prompt)

  def emit(self, token: int, logprob: float | None, stop_ids) -> None:
    """Appends the token the model chose (a forced row: its forced token) and sets
    `finish` when the row ends there: a stop token, its `until`, the end of its
    grammar ("stop"), or its token limit ("length")."""
    token = self.take(token, logprob)
    self.generated.append(token)
    grammar = self.req.grammar
    if grammar is not None:
      try:
        grammar.consume(token)
      except ValueError as e:            # its mask allowed the token: a matcher fault
        self.finish, self.error = "error", f"structured output: {e}"
        return
    if self.req.forced is None and (token in stop_ids or (
        self.req.until is not None and self.req.until(self.generated)) or (
        grammar is not None and grammar.done)):
      self.finish = "stop"
    elif len(self.generated) >= self.req.sampling.max_tokens:
      self.finish = "length"

  def take(self, token: int, logprob: float | None) -> int:
    """The token the row appends after the model chose `token`: a forced row records
    it (and `logprob`, its forced token's) and appends its forced token."""
    if self.req.forced is None:
      return token
    self.argmax.append(token)
    self.logprob.append(logprob)
    return int(self.req.forced[len(self.generated)])


def forced_block(rows: list[Row | None], live: list[int], steps: int,
                 batch: int) -> tuple[np.ndarray, np.ndarray] | None:
  """(forced [steps, batch] int32, forced_rows [batch] bool) of a decode call with
  teacher-forced rows (row i's step s scores and feeds its next forced token), or
  None when no live row is forced."""
  rows_f = [i for i in live if rows[i].req.forced is not None]
  if not rows_f:
    return None
  forced, mask = np.zeros((steps, batch), np.int32), np.zeros(batch, bool)
  for i in rows_f:
    nxt = np.asarray(rows[i].req.forced[len(rows[i].generated):][:steps], np.int32)
    forced[:nxt.size, i], mask[i] = nxt, True
  return forced, mask


def cancelled(req: Request) -> Result:
  return Result(id=req.id, tokens=[], prompt_tokens=len(req.prompt), completion_tokens=0,
                ttft_s=0.0, latency_s=0.0, finish_reason="cancelled")


def error(req: Request, msg: str, code: str | None = None) -> Result:
  return Result(id=req.id, tokens=[], prompt_tokens=len(req.prompt), completion_tokens=0,
                ttft_s=0.0, latency_s=0.0, finish_reason="error", error=msg, error_code=code)
