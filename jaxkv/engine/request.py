"""The engine's request, its result and its batch row.

`Request` is what a caller submits (prompt ids, sampling, and for a KV mechanism
its name and context); `Result` is what comes back when it finishes; `Row` is the
engine's per-row state while it runs (mechanisms read and extend it: `state`,
`extra`).
"""

from __future__ import annotations

import dataclasses

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
  pending: object = None           # a mechanism's prefill generator, part way through
  # prompt tokens reported as served without prefill (Result.cached_tokens) when that
  # is not `cached`: a mechanism that lays out its own sequence sets it (MemArt)
  served: int | None = None
  order: int = 0                   # admission order (mechanism prefills run in it)
  # the row's prompt positions: the request's prompt, unless its mechanism lays out
  # another sequence (MemArt: the chat head, retrieved blocks and the question)
  n: int = -1

  def __post_init__(self):
    if self.n < 0:
      self.n = len(self.req.prompt)


def cancelled(req: Request) -> Result:
  return Result(id=req.id, tokens=[], prompt_tokens=len(req.prompt), completion_tokens=0,
                ttft_s=0.0, latency_s=0.0, finish_reason="cancelled")


def error(req: Request, msg: str, code: str | None = None) -> Result:
  return Result(id=req.id, tokens=[], prompt_tokens=len(req.prompt), completion_tokens=0,
                ttft_s=0.0, latency_s=0.0, finish_reason="error", error=msg, error_code=code)
