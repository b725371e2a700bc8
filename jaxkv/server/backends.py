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
             (every kind above runs in the batch engine with every other request:
             continuous batching, sampling, streaming)
    agents   `AgentRunner`: LRAgent's multi-LoRA sharing. Each request names a role
             adapter (`<model>:<role>`) and extends the session's one trajectory;
             under `server.agent_scheme` (base_lr_shared by default) a role reads
             the KV other roles computed instead of prefilling it again. A session
             holds `server.agent_max_tokens` slots of the pool while it is open, at
             most `server.agent_sessions` open

A session names its kind when it is opened (`POST /v1/sessions {"kind": ...}`);
one first seen in a request gets the first listed kind. Every kind runs on one KV
pool: the engine's `KVManager` (`ServeConfig.cache` sizes it), whose allocator,
radix trees and reservations the runners share, so a server holds one pool
whatever kinds it serves. Every kind but agents is an engine mechanism
(`jaxkv.engine.mechanisms`): its requests are engine requests built on the loop
thread (`engine_request`). Agents sessions are batch-1 runners whose calls run on the
engine loop thread between engine steps (`EngineLoop.call`), so engine and runners
never run at once and need no locks; the engine keeps the pages its running rows may
still take reserved against them. They decode greedily; a streamed reply arrives in
one piece once it is complete.

What each mechanism did comes back in `usage["jaxkv"]`; the mechanisms' counters
(and `BackendStats`) feed `/metrics`.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from jaxkv.config import ServeConfig, session_kinds
from jaxkv.engine.engine import Request, Result
from jaxkv.policies.sharing import lragent


@dataclasses.dataclass
class BackendStats:
  """Counters for /metrics (one writer: the loop thread)."""
  requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  adapter_requests: collections.Counter = dataclasses.field(    # written by the server
      default_factory=collections.Counter)                       # thread (role -> count)
  agents_shared_tokens: int = 0    # prompt tokens a role read from KV it did not compute
  agents_computed_tokens: int = 0  # prompt tokens roles computed


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
    self.agents: dict[str, object] = {}   # "agents" session -> its AgentRunner
    impl = cfg.engine.attention_impl
    self.kv = self.engine.kv_manager       # the one pool every kind allocates from
    self.pruned = self.memart = self.reuse = self.semshare = None
    if "agents" in self.kinds and llm.lora is None:
      raise ValueError("server.sessions: 'agents' sessions run the role adapters: set "
                       "server.role_adapters")
    if ("agents" in self.kinds and cfg.server.agent_scheme in lragent.DECOUPLED
        and self.kv.lr_rank != llm.lora.rank):
      raise ValueError(f"server.agent_scheme={cfg.server.agent_scheme} keeps the value "
                       f"cache as base + low rank: the KV pool needs a low-rank value cache "
                       f"of rank {llm.lora.rank} (set llm.kv_lr_rank before the engine is "
                       f"made; cli.load_llm does)")
    if "pruned" in self.kinds:
      from jaxkv.engine.mechanisms.pruned import Pruned
      self.pruned = self.engine.mechanisms.get("pruned") or self.engine.add_mechanism(
          Pruned(self.tok, llm.config, self.kv, cfg.pruning))
    if "memart" in self.kinds:
      from jaxkv.engine.mechanisms.memart import MemArt
      from jaxkv.engine.memart import MemArtSessions
      self.memart = self.engine.mechanisms.get("memart") or self.engine.add_mechanism(MemArt(
          MemArtSessions(llm, cfg.memart, cfg.cache, system_prompt=cfg.system_prompt,
                         attn_impl=impl, kv=self.kv), write_chunk=cfg.engine.prefill_chunk))
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
               self.memart and self.memart.runner,
               *self.agents.copy().values()]
    found = [self.kv, *(r.kv for r in runners if r is not None)]
    return list({id(k): k for k in found}.values())

  @property
  def default(self) -> str:
    return self.kinds[0]

  # ------------------------------------------------------------------ sessions
  def open(self, session: str, kind: str | None = None) -> str:
    """The session's kind, opening it on `kind` (None: the default) if it is new;
    naming another kind than an open session's is refused. "prefix" sessions
    live in the engine (`Engine.open_session`), the others here."""
    if kind is not None and kind not in self.kinds:
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
    if kind == "prefix":
      self.engine.open_session(session)
    elif kind == "agents":
      if len(self.agents) >= self.server_cfg.agent_sessions:
        raise ValueError(f"{len(self.agents)} 'agents' sessions are open (server."
                         "agent_sessions): close one first")
      from jaxkv.engine.agents import AgentRunner
      runner = AgentRunner(self.llm, self.llm.lora, self.server_cfg.agent_scheme,
                           max_tokens=self.server_cfg.agent_max_tokens,
                           attn_impl=self.engine.attn_impl, kv=self.kv)
      runner.start()
      self.agents[session] = runner
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
    if kind == "pruned":
      self.pruned.close(session)
    elif kind == "memart":
      self.memart.close(session)
    elif kind == "agents":
      self.agents.pop(session).release()  # its trajectory's slots go back to the pool
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
    agents = self.agents.copy()
    out = {k: (v[0], int(agents[k].held.size) if k in agents else 0)
           for k, v in self._open.copy().items()}
    if self.engine.radix is not None:
      out.update({k: ("prefix", n) for k, n in self.engine.sessions.items()})
    return out

  # ------------------------------------------------------------------ requests
  # served by the batch engine (the others: a session runner between engine steps)
  ENGINE_KINDS = ("prefix", "pruned", "memart", "reuse", "semshare")

  def engine_request(self, kind: str, session: str, p, rid: str):
    """The engine `Request` of a request on a session kind the engine serves; raises
    ValueError for one this kind cannot take (the server's 400). Call on the loop
    thread (it opens the session)."""
    if kind == "prefix":
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, session=session,
                     adapter=p.adapter)
    if p.adapter >= 0:
      raise ValueError("role adapters run in the batch engine or in 'agents' sessions: "
                       "use one of those or no session")
    if kind in ("reuse", "semshare"):    # any prompt (reuse: its lines are the spans)
      self.open(session, kind)
      self.stats.requests[kind] += 1
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, mechanism=kind)
    if p.chat is None:
      raise ValueError(f"'{kind}' sessions take chat completions (their turns are messages)")
    msgs, tools = p.chat
    if kind == "memart":
      if tools:
        raise ValueError("'memart' sessions keep text history: tools are not supported")
      ctx = self.memart.context(session, msgs)       # the history must extend the memory's
      self.open(session, kind)
      self.stats.requests[kind] += 1
      return Request(id=rid, prompt=p.prompt, sampling=p.sampling, mechanism="memart",
                     context=ctx)
    self.open(session, kind)
    prompt, ctx = self.pruned.context(session, msgs, tools)
    self.stats.requests[kind] += 1
    return Request(id=rid, prompt=prompt, sampling=p.sampling, mechanism="pruned",
                   context=ctx)

  def run(self, kind: str, session: str, p, rid: str) -> Result:
    """Answers the parsed request `p` (`protocol.Parsed`) on the session's runner.
    Raises ValueError for a request this kind cannot take (the server's 400)."""
    if p.sampling.temperature > 0:
      raise ValueError(f"'{kind}' sessions decode greedily: send temperature 0")
    if (p.adapter >= 0) != (kind == "agents"):
      raise ValueError("'agents' sessions need a role model name (<model>:<role>)"
                       if kind == "agents" else "role adapters run in the batch engine or in "
                       "'agents' sessions: use one of those or no session")
    self.open(session, kind)
    t0 = time.perf_counter()
    max_tokens = p.sampling.max_tokens
    ids, ttft, cached, extra = self._agents(session, p, max_tokens)
    self.stats.requests[kind] += 1
    stop = set(self.tok.stop_ids)
    finish = "stop" if ids and ids[-1] in stop else "length"
    if finish == "stop":
      ids = ids[:-1]
    return Result(id=rid, tokens=[int(t) for t in ids], prompt_tokens=len(p.prompt),
                  completion_tokens=len(ids), ttft_s=ttft,
                  latency_s=time.perf_counter() - t0, finish_reason=finish,
                  cached_tokens=cached, extra=extra)

  def _agents(self, session, p, max_tokens):
    runner = self.agents[session]
    reply, info = runner.respond(p.prompt, p.adapter, max_tokens, self.tok.stop_ids)
    self.stats.agents_shared_tokens += info["shared"]
    self.stats.agents_computed_tokens += info["computed"]
    m, n = runner.cfg, runner.held.size
    kv = {s: lragent.kv_bytes(s, n, num_layers=m.num_layers, d_kv=m.d_kv,
                              hidden=m.hidden_size, rank=runner.lora.rank,
                              num_agents=runner.n_agents,
                              bytes_per_elem=np.dtype(runner.dtype).itemsize)
          for s in (runner.scheme, "non_shared")}
    extra = {"scheme": runner.scheme, "role": self.llm.adapters[p.adapter],
             "computed_tokens": info["computed"], "shared_tokens": info["shared"],
             "trajectory_tokens": int(n), "kv_bytes": kv[runner.scheme],
             "kv_bytes_non_shared": kv["non_shared"]}
    return reply.tolist(), info["ttft_s"], info["shared"], extra
