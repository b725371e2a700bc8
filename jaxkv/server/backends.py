"""Session kinds served beside the batch engine: each agent session picks how its
KV is kept, and all of them run in one server (`server.sessions`).

    prefix   the batch engine with its radix prefix cache: the session's latest
             turn stays locked in the cache (continuous batching, role adapters)
    pruned   the engine's `Pruned` mechanism (`jaxkv.engine.mechanisms.pruned`): the
             radix cache with persistent dead-slot holes and the configured pruning
             policy (`ServeConfig.pruning`; IntentKV keeps its QueryMemory M_t per
             session across turns); its requests run in the batch engine with
             every other request (continuous batching, sampling, streaming)
    memart   the engine's `MemArt` mechanism: the history lives in MemArt memory
             blocks, only the new question is prefilled over the retrieved blocks
             (`ServeConfig.memart`)
    reuse    the engine's `Reuse` mechanism: segments of earlier prompts (tool
             outputs, documents) are spliced at their new positions
             (`ServeConfig.reuse`; the segment store is shared by every reuse session)
    semshare the engine's `SemShare` mechanism: a prompt similar enough to an earlier
             one (LSH token matching, `ServeConfig.semshare.threshold`) reuses that
             prompt's KV with selective recompute; others are prefilled and kept as
             references (shared by every semshare session)
    agents   the engine's `Agents` mechanism: LRAgent's multi-LoRA sharing. Each
             request names a role adapter (`<model>:<role>`) and extends the
             session's one trajectory; under `server.agent_scheme` (base_lr_shared
             by default) a role reads the KV other roles computed instead of
             prefilling it again. A trajectory is at most `server.agent_max_tokens`
             tokens, at most `server.agent_sessions` sessions are open, and idle
             sessions' trajectories give way under pool pressure

A session names its kind when it is opened (`POST /v1/sessions {"kind": ...}`);
one first seen in a request gets the first listed kind. Every kind runs on one KV
pool: the engine's `KVManager` (`ServeConfig.cache` sizes it), whose allocator,
radix trees and reservations the runners share, so a server holds one pool
whatever kinds it serves. Every kind is an engine mechanism
(`jaxkv.engine.mechanisms`) or the engine's own prefix cache: its requests are engine
requests built on the loop thread (`engine_request`) and run in the batch engine with
every other request (continuous batching, sampling, token streaming, cancellation).

What each mechanism did comes back in `usage["jaxkv"]`; the mechanisms' counters
(and `BackendStats`) feed `/metrics`.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxkv.config import ServeConfig, session_kinds
from jaxkv.engine import compose_request
from jaxkv.engine.compose_request import Recall
from jaxkv.engine.engine import Request
from jaxkv.policies.sharing import lragent

__all__ = ["BackendStats", "Recall", "SessionBackends"]


@dataclasses.dataclass
class BackendStats:
  """Counters for /metrics (one writer: the loop thread)."""
  requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  adapter_requests: collections.Counter = dataclasses.field(    # written by the server
      default_factory=collections.Counter)                       # thread (role -> count)


class SessionBackends:
  """The runners behind the non-prefix kinds and the sessions open on them.

  Every method runs on the engine loop thread (`EngineLoop.call`).
  """

  def __init__(self, llm, cfg: ServeConfig):
    self.kinds = session_kinds(cfg.server.sessions)
    self.engine = llm.engine
    if "prefix" in self.kinds and self.engine.radix is None and len(self.kinds) > 1:
      raise ValueError("server.sessions: 'prefix' sessions keep KV in the engine's prefix "
                       "cache: set engine.prefix_cache=True or leave 'prefix' out")
    self.tok, self.llm, self.server_cfg = llm.tokenizer, llm, cfg.server
    self.stats = BackendStats()
    self._open: dict[str, list] = {}     # session -> [kind, last use] (not prefix ones)
    impl = cfg.engine.attention_impl
    self.kv = self.engine.kv_manager       # the one pool every kind allocates from
    self.pruned = self.memart = self.reuse = self.semshare = self.agents = None
    if "agents" in self.kinds:
      if llm.lora is None:
        raise ValueError("server.sessions: 'agents' sessions run the role adapters: set "
                         "server.role_adapters")
      if (cfg.server.agent_scheme in lragent.DECOUPLED) != (self.kv.lr_rank > 0):
        raise ValueError(f"server.agent_scheme={cfg.server.agent_scheme}: the engine's "
                         f"pool needs {'a' if self.kv.lr_rank == 0 else 'no'} low-rank value "
                         "cache (llm.kv_lr_rank, set before the engine is made; "
                         "cli.load_llm does)")
      from jaxkv.engine.mechanisms.agents import Agents
      self.agents = self.engine.mechanisms.get("agents") or self.engine.add_mechanism(Agents(
          self.engine, cfg.server.agent_scheme, names=llm.adapters,
          max_tokens=cfg.server.agent_max_tokens, max_sessions=cfg.server.agent_sessions))
    if "pruned" in self.kinds:
      from jaxkv.engine.mechanisms.pruned import Pruned
      self.pruned = self.engine.mechanisms.get("pruned") or self.engine.add_mechanism(
          Pruned(self.tok, llm.config, self.kv, cfg.pruning))
    if "memart" in self.kinds:
      from jaxkv.engine.mechanisms.memart import MemArt
      from jaxkv.engine.memart import MemArtSessions
      self.memart = self.engine.mechanisms.get("memart") or self.engine.add_mechanism(MemArt(
          MemArtSessions(llm, cfg.memart, cfg.cache, system_prompt=cfg.system_prompt,
                         attn_impl=impl, kv=self.kv)))
    if "reuse" in self.kinds:
      from jaxkv.engine.mechanisms.reuse import Reuse
      from jaxkv.engine.reuse import ReuseRunner
      self.reuse = self.engine.mechanisms.get("reuse") or self.engine.add_mechanism(Reuse(
          ReuseRunner(llm, cfg.reuse, cache=cfg.cache, attn_impl=impl, kv=self.kv)))
    if "semshare" in self.kinds:
      from jaxkv.engine.mechanisms.semshare import SemShare
      from jaxkv.engine.semshare import SemShareRunner
      self.semshare = self.engine.mechanisms.get("semshare") or self.engine.add_mechanism(
          SemShare(SemShareRunner(llm, cfg.semshare, cache=cfg.cache, attn_impl=impl,
                                  kv=self.kv)))

  @property
  def kv_managers(self) -> list:
    """The distinct KV managers (pools) of the engine and every runner: one."""
    runners = [self.reuse and self.reuse.runner, self.semshare and self.semshare.runner,
               self.memart and self.memart.runner]
    found = [self.kv, *(r.kv for r in runners if r is not None)]
    return list({id(k): k for k in found}.values())

  @property
  def default(self) -> str:
    return self.kinds[0]

  # ------------------------------------------------------------------ sessions
  def compose(self, kinds) -> str:
    """The kind of a session composing several served kinds (e.g. ["pruned",
    "agents"]): "+"-joined in `COMPOSE_ORDER` (e.g. "agents+pruned"), its `Composed`
    mechanism added to the engine on first use. ValueError (the server's 400) for kinds that are not
    served or do not combine, saying why (`jaxkv.engine.mechanisms.composed`)."""
    kinds = list(dict.fromkeys(kinds))
    bad = [k for k in kinds if k not in self.kinds]
    if bad:
      raise ValueError(f"session kind(s) {bad} not served here (server.sessions = "
                       f"{','.join(self.kinds)})")
    if "prefix" in kinds:
      raise ValueError("'prefix' is the engine's own prefix cache, not a mechanism: it does "
                       "not combine (every mechanism caches its session's KV itself)")
    if len(kinds) == 1:
      return kinds[0]
    name = compose_request.name(kinds)
    compose_request.mechanism(self.engine, name)
    return name

  def open(self, session: str, kind: str | list | None = None) -> str:
    """The session's kind, opening it on `kind` (None: the default; a list: those
    kinds composed, `compose`) if it is new; naming another kind than an open
    session's is refused. "prefix" sessions live in the engine
    (`Engine.open_session`), the others here."""
    if isinstance(kind, (list, tuple)):
      kind = self.compose(kind)
    elif kind is not None and kind not in self.kinds and kind not in self.engine.mechanisms:
      raise ValueError(f"session kind {kind!r} is not served here (server.sessions = "
                       f"{','.join(self.kinds)})")
    have = self._open.get(session)
    if have is None and self.engine.radix is not None and session in self.engine.sessions:
      have = ["prefix"]
    if have is not None:
      if kind is not None and kind != have[0]:
        raise ValueError(f"session {session!r} is open as {have[0]!r}, not {kind!r}: close "
                         "it first or use another id")
      if have[0] != "prefix":
        have[1] = time.monotonic()
      return have[0]
    kind = kind or self.default
    n_open = len(self._open) + (len(self.engine.sessions) if self.engine.radix is not None
                                else 0)
    if n_open >= self.server_cfg.max_sessions:
      raise ValueError(f"{n_open} sessions are open (server.max_sessions="
                       f"{self.server_cfg.max_sessions}): close one or wait for idle ones "
                       f"to expire (server.session_idle_s={self.server_cfg.session_idle_s:g})")
    if kind == "prefix":
      self.engine.open_session(session)
    elif "agents" in kind.split("+"):
      self.agents.open(session)
    if kind != "prefix":
      self._open[session] = [kind, time.monotonic()]
    return kind

  def close(self, session: str) -> str | None:
    """Frees what the session holds (its runner's state, or its engine hold);
    returns its kind (None: unknown)."""
    entry = self._open.pop(session, None)
    if entry is None:
      return "prefix" if self.engine.radix is not None and self.engine.close_session(
          session) else None
    kind = entry[0]
    parts = kind.split("+")
    if "pruned" in parts:
      self.pruned.close(session)
    if "memart" in parts:
      self.memart.close(session)
    if "agents" in parts:
      self.agents.close(session)     # its trajectory's slots go back to the pool
    return kind

  def expire(self, idle_s: float) -> list[str]:
    """Closes the sessions (every kind) unused for more than `idle_s` seconds."""
    now = time.monotonic()
    old = [k for k, (_, used) in self._open.items() if now - used > idle_s]
    for k in old:
      self.close(k)
    if self.engine.radix is not None:
      old += self.engine.expire_sessions(idle_s)
    return old

  def kind_of(self, session: str, role: bool = False) -> str:
    """The kind a request of `session` runs on: its own if open, else the default,
    or for a request naming a role adapter the first of agents / prefix served
    (read-only, so the server thread may ask without waiting for the loop)."""
    have = self._open.get(session)
    if have is not None:
      return have[0]
    if self.engine.radix is not None and session in self.engine.sessions:
      return "prefix"
    if role:
      return next((k for k in self.kinds if k in ("agents", "prefix")), self.default)
    return self.default

  @property
  def sessions(self) -> dict[str, tuple[str, int]]:
    """Open sessions -> (kind, tokens kept for it: the engine hold of a prefix
    session, the trajectory of an agents session, 0 otherwise). A copy: the server
    thread reads it as a snapshot."""
    out = {k: (v[0], self.agents.held_tokens(k) if "agents" in v[0].split("+") else 0)
           for k, v in self._open.copy().items()}
    if self.engine.radix is not None:
      out.update({k: ("prefix", n) for k, n in self.engine.sessions.items()})
    return out

  # ------------------------------------------------------------------ requests
  def engine_request(self, kind: str, session: str, p, rid: str, recalled: dict | None = None):
    """The engine `Request` of a request on a session kind the engine serves; raises
    ValueError for one this kind cannot take (the server's 400). Call on the loop
    thread (it opens the session). A composition with memart that opens a new
    conversation gets a `Recall` first: run its request, then call again with its
    result (`Result.extra["recall"]`) as `recalled`."""
    if kind == "prefix":
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, grammar=p.grammar,
                     session=session, adapter=p.adapter)
    parts = kind.split("+")
    if (p.adapter >= 0) != ("agents" in parts):
      raise ValueError(f"'{kind}' sessions need a role model name (<model>:<role>)"
                       if "agents" in parts else "role adapters run in the batch engine or "
                       "in 'agents' sessions: use one of those or no session")
    if len(parts) > 1:                   # a composition (`jaxkv.engine.compose_request`)
      if ("pruned" in parts or "memart" in parts) and p.chat is None:
        raise ValueError(f"'{kind}' sessions take chat completions (their turns are messages)")
      msgs, tools = p.chat if p.chat is not None else (None, None)
      got = compose_request.request(
          self.engine.mechanisms, kind, session, msgs, tools, p.sampling, rid=rid,
          encode=lambda: p.prompt, grammar=p.grammar, adapter=p.adapter, recalled=recalled,
          opened=lambda: self.open(session, kind))
      if not isinstance(got, Recall):
        self.stats.requests[kind] += 1
      return got
    if kind == "agents":
      self.agents.check(len(p.prompt), p.sampling.max_tokens)
      self.open(session, kind)
      self.stats.requests[kind] += 1
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, grammar=p.grammar,
                     adapter=p.adapter, mechanism="agents", context={"session": session})
    if kind in ("reuse", "semshare"):    # any prompt (reuse: its lines are the spans)
      self.open(session, kind)
      self.stats.requests[kind] += 1
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, grammar=p.grammar,
                     mechanism=kind)
    if p.chat is None:
      raise ValueError(f"'{kind}' sessions take chat completions (their turns are messages)")
    msgs, tools = p.chat
    if kind == "memart":
      if tools:
        raise ValueError("'memart' sessions keep text history: tools are not supported")
      ctx = self.memart.context(session, msgs)       # the history must extend the memory's
      self.open(session, kind)
      self.stats.requests[kind] += 1
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, grammar=p.grammar,
                     mechanism="memart", context=ctx)
    self.open(session, kind)
    prompt, ctx = self.pruned.context(session, msgs, tools)
    self.stats.requests[kind] += 1
    return Request(id=rid, prompt=prompt, sampling=p.sampling, grammar=p.grammar,
                   mechanism="pruned", context=ctx)
