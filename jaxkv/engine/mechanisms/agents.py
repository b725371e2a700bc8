"""LRAgent multi-LoRA KV sharing as an engine mechanism: role agents of one session
extend one trajectory and read each other's KV.

A request named `mechanism="agents"` runs on a role adapter (`Request.adapter`) in an
ordinary batch row, beside plain requests, other roles and other mechanisms
(continuous batching, sampling, streaming, cancellation). Its session keeps, per slot
region, the slots of the trajectory's KV and the tokens they hold:

    non_shared      one region per role: a role reads only what it computed itself
                    (every role prefills every token it has not seen: N x compute)
    full_shared     one region: whoever computed a token first wrote its K/V with its
                    own adapter, and every role reads it as is
    base_lr_shared  one region holding the base K/V and the rank-r value cache x A_v s
                    (A is shared, so it is role-independent given the hidden state);
                    each role applies its own B_v inside Flash-LoRA attention. The
                    engine runs every adapter row decoupled (`Engine(lr_rank=...)`).

`match` adopts the region's slots for the longest prefix of the prompt its tokens
hold (at most the prompt minus its last token, which is recomputed for the first
token's logits), so only the rest is prefilled, with the row's adapter; `finish`
makes the row's slots (prompt + every generated token but the last, which was never
fed back) the region's new content: the trajectory as that call left it. A prompt
that leaves the trajectory (an edited message, a reply tokenised differently) reuses
the common prefix only. Two calls of one session running at once each read the
region as it was when they were admitted; the one that finishes last sets it (as
two requests of a plain prefix session). This is `AgentRunner.respond`'s contract,
batched; its two other schemes need what a batch row does not have (DroidSpeak a
per-agent recompute copy of critical layers, base_shared a low-rank pool per agent):
they stay on the runner (`jaxkv.engine.agents`), which evaluates all five.

Regions are cache, not pins: under pool pressure the KV manager releases the regions
of sessions with no call running, least recently used first (registered evictor
"agents"); the next call of such a session recomputes its trajectory. A session's
trajectory is capped at `max_tokens`; at most `max_sessions` are open.
`Request.context`: {"session": id} of a session opened with `open`.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from jaxkv.engine.mechanisms import Match, Mechanism
from jaxkv.models.forward import LoraInputs
from jaxkv.policies.sharing import lragent

SERVED = ("non_shared", "full_shared", "base_lr_shared")   # the schemes a batch row runs


@dataclasses.dataclass
class _Region:
  seq: int                 # the allocator sequence holding its slots
  tokens: np.ndarray       # the tokens whose KV it holds, positions [0, size)


@dataclasses.dataclass
class _Session:
  regions: dict[int, _Region] = dataclasses.field(default_factory=dict)
  used: float = 0.0
  running: int = 0         # calls admitted and not finished


@dataclasses.dataclass
class _Call:
  session: str
  role: int
  hit: int                 # prompt tokens read from the region without running


def _common(a: np.ndarray, b: np.ndarray) -> int:
  m = min(a.size, b.size)
  diff = np.flatnonzero(a[:m] != b[:m])
  return int(diff[0]) if diff.size else m


class Agents(Mechanism):
  """LRAgent sessions in the engine (module docstring).

  Args:
    engine: the `Engine` it serves in (its KV manager, adapter stack and LoRA mode).
    scheme: one of `SERVED`; a decoupled one needs the engine's low-rank value cache.
    names: the role adapters' names (usage["jaxkv"]["role"]).
    max_tokens: the longest trajectory a session keeps.
    max_sessions: sessions open at once.
  """

  name = "agents"
  adapters = True
  metrics = (
      ("jaxkv_agents_shared_tokens_total", "shared_tokens", "prompt tokens a role read "
       "from KV another role (or its own earlier turn) computed"),
      ("jaxkv_agents_computed_tokens_total", "computed_tokens",
       "prompt tokens roles computed in agents sessions"))

  def __init__(self, engine, scheme: str, *, names=(), max_tokens: int = 4096,
               max_sessions: int = 4):
    self.scheme = lragent.check_scheme(scheme)
    if scheme not in SERVED:
      raise ValueError(f"the engine serves the sharing schemes {SERVED}; {scheme} needs "
                       "what a batch row does not have (droidspeak: a recompute copy of "
                       "its critical layers per agent; base_shared: a low-rank value pool "
                       "per agent): run it with jaxkv.engine.agents.AgentRunner")
    if engine.lora is None:
      raise ValueError("agents sessions run role adapters: the engine has no LoRA stack")
    decoupled = scheme in lragent.DECOUPLED
    if decoupled != (engine.lora_mode == "decoupled"):
      raise ValueError(f"scheme {scheme} needs the engine's adapter rows "
                       f"{'decoupled' if decoupled else 'full'} (a pool "
                       f"{'with' if decoupled else 'without'} the low-rank value cache "
                       f"of rank {engine.lora.rank}); the engine runs them {engine.lora_mode}")
    self.kv, self.lora, self.model_cfg = engine.kv_manager, engine.lora, engine.model_cfg
    self.lora_mode = engine.lora_mode
    self.dtype = np.dtype(engine.cache_cfg.dtype)
    self.names = tuple(names) or tuple(str(i) for i in range(self.lora.num_adapters))
    self.max_tokens, self.max_sessions = max_tokens, max_sessions
    self.sessions: dict[str, _Session] = {}
    self.kv.register_evictor(self.name, self._evict, self._held_slots)
    # counters for /metrics (one writer: the engine's thread)
    self.stats = {"requests": 0, "shared_tokens": 0, "computed_tokens": 0}

  # ------------------------------------------------------------------ sessions
  def open(self, session: str) -> None:
    """Opens `session` (a no-op when it is open); ValueError past `max_sessions`."""
    if session in self.sessions:
      return
    if len(self.sessions) >= self.max_sessions:
      raise ValueError(f"{len(self.sessions)} 'agents' sessions are open (server."
                       "agent_sessions): close one first")
    self.sessions[session] = _Session(used=time.monotonic())

  def close(self, session: str) -> bool:
    """Gives the session's slots back (a call running keeps its own until it ends)."""
    s = self.sessions.pop(session, None)
    if s is None:
      return False
    for reg in s.regions.values():
      self.kv.allocator.free_sequence(reg.seq)
    return True

  def held_tokens(self, session: str) -> int:
    """The trajectory the session keeps (its longest region; 0 once evicted)."""
    s = self.sessions.get(session)
    return max((r.tokens.size for r in s.regions.values()), default=0) if s else 0

  def check(self, prompt_tokens: int, max_tokens: int) -> None:
    """ValueError for a call no session can take (what the server answers 400)."""
    if prompt_tokens + max_tokens > self.max_tokens:
      raise ValueError(f"{prompt_tokens} prompt + {max_tokens} reply tokens exceed the "
                       f"'agents' session's trajectory cap {self.max_tokens} "
                       "(server.agent_max_tokens)")

  def _region(self, role: int) -> int:
    return role if self.scheme == "non_shared" else 0

  # ------------------------------------------------------------------ eviction
  def _idle(self) -> list[tuple[float, str]]:
    return sorted((s.used, k) for k, s in self.sessions.items() if not s.running and s.regions)

  def _held_slots(self) -> np.ndarray:
    """The slots of idle sessions' regions (what evicting them would release)."""
    alloc = self.kv.allocator
    got = [alloc.slot_map(r.seq) for _, k in self._idle()
           for r in self.sessions[k].regions.values()]
    return np.concatenate(got).astype(np.int64) if got else np.zeros(0, np.int64)

  def _evict(self, pages: int, shard: int) -> int:
    """Drops idle sessions' regions on `shard`, least recently used first, until
    `pages` pages are free (their sessions stay open and recompute on their next call)."""
    alloc = self.kv.allocator
    before = alloc.shard_free_pages(shard)
    for _, k in self._idle():
      if alloc.shard_free_pages(shard) - before >= pages:
        break
      s = self.sessions[k]
      for key in [key for key, r in s.regions.items()
                  if alloc.shard_of_sequence(r.seq) == shard]:
        alloc.free_sequence(s.regions.pop(key).seq)
    return alloc.shard_free_pages(shard) - before

  # ------------------------------------------------------------------ hooks
  def match(self, req) -> Match:
    sid = (req.context or {}).get("session")
    s = self.sessions.get(sid)
    if s is None:
      raise ValueError(f"'agents' session {sid!r} is not open")
    if not 0 <= req.adapter < self.lora.num_adapters:
      raise ValueError("an 'agents' call runs on a role adapter (<model>:<role>)")
    self.check(len(req.prompt), req.sampling.max_tokens)
    reg = s.regions.get(self._region(req.adapter))
    hit = 0 if reg is None else min(_common(reg.tokens, np.asarray(req.prompt, np.int32)),
                                    len(req.prompt) - 1)
    slots = (np.zeros(0, np.int32) if reg is None
             else self.kv.allocator.slot_map(reg.seq)[:hit].copy())
    s.running += 1
    s.used = time.monotonic()
    return Match(hit, slots, _Call(sid, req.adapter, hit))

  def adapter_of(self, row) -> tuple[LoraInputs, str]:
    """The row's role adapter as a composition's planner runs it (segment reuse), and
    the KV form it writes: every role's under a sharing scheme (a role reads what
    another computed), the role's own under non_shared."""
    role = row.req.adapter
    ids = jnp.asarray([role], jnp.int32)       # placed as the planner's other inputs
    form = (f"role{role}:non_shared" if self.scheme == "non_shared"
            else f"roles:{self.scheme}")
    return LoraInputs(self.lora, ids, mode=self.lora_mode), form

  def unmatch(self, match: Match) -> None:
    s = self.sessions.get(match.state.session)
    if s is not None:
      s.running -= 1

  def finish(self, row, cache: bool) -> dict | None:
    c: _Call = row.state
    s = self.sessions.get(c.session)
    if s is None:                        # closed while the call ran: nothing to keep
      return None
    s.running -= 1
    s.used = time.monotonic()
    if not cache or row.prefilled < row.n:
      return None
    alloc = self.kv.allocator
    tokens = np.asarray(list(row.req.prompt) + row.generated[:-1], np.int32)
    seq = alloc.new_sequence(shard=alloc.shard_of_sequence(row.seq))
    alloc.adopt(seq, alloc.slot_map(row.seq)[:tokens.size])
    old = s.regions.pop(self._region(c.role), None)
    if old is not None:
      alloc.free_sequence(old.seq)
    s.regions[self._region(c.role)] = _Region(seq, tokens)
    computed = row.n - row.cached    # past the adopted hit and any joiner's fill (MemArt's region)
    self.stats["requests"] += 1
    self.stats["shared_tokens"] += c.hit
    self.stats["computed_tokens"] += computed
    kv = {sc: lragent.model_kv_bytes(sc, int(tokens.size), self.model_cfg, self.lora,
                                     self.dtype.itemsize) for sc in (self.scheme, "non_shared")}
    return {"scheme": self.scheme, "role": self.names[c.role], "computed_tokens": computed,
            "shared_tokens": c.hit, "trajectory_tokens": int(tokens.size),
            "kv_bytes": kv[self.scheme], "kv_bytes_non_shared": kv["non_shared"]}
