"""KV pruning for agent sessions (IntentKV, StreamingLLM, SnapKV, H2O, random) as an
engine mechanism, and the per-session pruning state it shares with evaluation.

A pruned request is one assistant turn of a session: its prompt is the chat so far
(`Pruned.request` renders it and marks the actionable query span and the protected
system prompt). In the engine, per row (IntentKV section 3 / appendix H):

1. match: the longest prefix cached in the "pruned" radix tree, going through the
   session's own holes (dead keys), adopted and locked -- a position pruned in an
   earlier turn stays pruned and is not recomputed;
2. prefill the rest chunk by chunk (batched with every other row), capturing the
   post-RoPE queries the scorer reads;
3. after the prefill: IntentKV advances the session's QueryMemory (eq. 2) on every
   request; if the live prompt exceeds the budget C, score, keep the forced set +
   top-C* and evict the rest in place (dead-slot layout: SENTINEL in the slot map,
   slots freed once nothing maps them);
4. decode over the pruned slot map (sampling, streaming: the engine's);
5. finish: insert prompt + reply, holes as dead keys, superseding the session's
   previous path; keep the session's QueryMemory, processed length and path.

Serving prunes with the dead-slot layout only (IntentKV's): `compact` moves the
survivors to new positions, which the published baselines evaluate but which
loses prefix-cache hits; it stays in `SessionRunner` (teacher-forced evaluation).

`PruningState` is the state both share: the policy, the Phase-2 head, QueryMemory,
processed lengths and radix paths per session, and the pruning event itself.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import artifacts
from jaxkv.config import PruningConfig
from jaxkv.data import labels
from jaxkv.engine.mechanisms import Match, Mechanism
from jaxkv.kv import plan
from jaxkv.kv.state import SENTINEL
from jaxkv.policies.pruning import intentkv, policy, select

TREE = "pruned"     # the radix tree (with dead keys) pruned sessions cache in


def row(x, width: int, dtype=np.int32) -> jax.Array:
  """[1, width] device row holding x at the front (zeros = SENTINEL / False after)."""
  out = np.zeros((1, width), dtype)
  out[0, :len(x)] = x
  return jnp.asarray(out)


def remember(lru: collections.OrderedDict, key, value, capacity: int) -> None:
  lru[key] = value
  lru.move_to_end(key)
  if len(lru) > capacity:
    lru.popitem(last=False)


def query_slice(rows: str, cfg: PruningConfig, hit: int, n: int, qs: int,
                seen: int) -> tuple[int, int]:
  """(first, count) of the captured query rows a method reads; row j is prompt token
  hit + j (the request computed tokens [hit, n)).

    window (SnapKV): the last snap_window prompt tokens;
    span (IntentKV): the actionable query span [qs, n);
    all (H2O): the tokens new to the session since its previous turn, [seen, n).

  H2O's voters are pinned to the new tokens so both layouts see the same set: under
  dead-slot the radix hit ends near `seen`, while compact (not reinserted after a
  pruned turn) recomputes the whole history, which must not vote again.
  """
  total = n - hit
  lo = {"window": max(0, total - cfg.snap_window), "all": max(0, min(seen, n - 1) - hit),
        "span": max(0, qs - hit)}[rows]
  return lo, total - lo


def _private(path) -> int | None:
  """The private suffix's start of a session's radix path (None: none, or no path)."""
  return None if path is None or len(path) < 3 else path[2]


class PruningState:
  """The policy and what it keeps per session, for serving and evaluation alike."""

  def __init__(self, model_cfg, pruning: PruningConfig, head=None):
    self.model_cfg = model_cfg
    self.set_policy(pruning, head=head)

  def set_policy(self, pruning: PruningConfig, *, head=None) -> None:
    """Switches the policy and forgets every session. `head`: IntentKV learnable
    mode's trained `ResidualHead` or its `nnx.split` (None: `pruning.head_path`)."""
    if pruning.method == "intentkv" and pruning.intent_mode == "learnable":
      if head is None:   # pruning.head_path: the shipped head unless set
        if not pruning.head_path:
          raise ValueError("IntentKV learnable mode needs a trained residual head "
                           "(pruning.head_path / SessionRunner(head=...))")
        head = artifacts.load_pruner_head(pruning.head_path)
      head = nnx.split(head) if isinstance(head, nnx.Module) else tuple(head)
      head_dim = nnx.merge(*head).head_dim
      if head_dim != self.model_cfg.head_dim:
        raise ValueError(f"the residual head was trained for head_dim {head_dim}, but the "
                         f"model has head_dim {self.model_cfg.head_dim}: train it on this "
                         "model")
      self.head = head
    else:
      self.head = (None, None)
    self.pruning = pruning
    self.memories = intentkv.QueryMemoryStore(pruning.memory_capacity)
    # tokens of each session already processed (its previous prompt + reply), LRU
    self.seen: collections.OrderedDict[str, int] = collections.OrderedDict()
    # each session's last radix path (tokens, holes, private_from): the next turn names
    # its holes and private suffix to match through them, and its insert supersedes
    # this path (radix "Holes", "Private suffixes")
    self.paths: collections.OrderedDict[str, tuple] = collections.OrderedDict()

  def advance(self, session: str, qs: int, q, hit: int, n: int):
    """(the session's QueryMemory before this request -- zeros for a new session --,
    M_t after it, cos(M_t, Enc(q_t)))."""
    key = intentkv.session_key(session_id=session)
    m = self.model_cfg
    prev, _ = self.memories.gather([key], (m.num_layers, m.num_heads, m.head_dim))
    q_lo, q_count = query_slice("span", self.pruning, hit, n, qs, 0)
    new, cos = policy.advance_memory_at(self.pruning, q, hit, q_lo, q_count, prev)
    return prev, new, float(cos[0])

  def select(self, session: str, pool_k, smap, live, qs: int, sys_len: int, q, hit: int,
             n: int, width: int, budget: int, memory=None) -> np.ndarray:
    """The pruning event: the kept prompt positions ([len(smap)] bool). `budget` is the
    request's C (`budget_for`); `memory` is IntentKV's memory before this request (the
    event advances it itself)."""
    cfg = self.pruning
    span = np.zeros(n, bool)
    span[qs:] = True
    forced = _forced(n, qs, sys_len, cfg.protect_system)
    rows = policy.query_rows(cfg)
    q_lo = q_count = 0
    if rows is not None:
      q_lo, q_count = query_slice(rows, cfg, hit, n, qs, self.seen.get(session, 0))
    keep, _ = policy.select_kept_at(
        cfg, pool_k, row(smap, width), row(live, width, bool), row(forced, width, bool),
        q if rows is not None else None, hit, q_lo, q_count, memory, row(span, width, bool),
        head_graphdef=self.head[0], head_state=self.head[1], budget=budget)
    return np.asarray(keep[0, :smap.size])

  def budget_for(self, live, qs: int, sys_len: int, n: int) -> int:
    """This request's C: `pruning.budget`, plus with budget_scope="history" the live
    tokens of its protected system prompt and query span (`live`: [>= n] bool)."""
    cfg = self.pruning
    if cfg.budget_scope == "prompt":
      return cfg.budget
    return cfg.budget + int(np.asarray(live[:n])[_forced(n, qs, sys_len,
                                                          cfg.protect_system)].sum())

  def commit(self, session: str, new_memory, processed: int, path=None) -> None:
    """Keeps what a turn that succeeded leaves: M_t, its processed length and (when
    it was cached) its radix path (tokens, holes[, private_from])."""
    cap = self.pruning.memory_capacity
    if new_memory is not None:
      self.memories.scatter([intentkv.session_key(session_id=session)], new_memory)
    remember(self.seen, session, processed, cap)
    if path is not None:
      remember(self.paths, session, path, cap)

  def close(self, session: str) -> bool:
    """Forgets a session's QueryMemory, processed length and radix path (the KV it
    cached stays, unheld, for the LRU). False if it had no state."""
    gone = (self.memories.pop(intentkv.session_key(session_id=session)),
            self.seen.pop(session, None), self.paths.pop(session, None))
    return any(x is not None for x in gone)


def _forced(n: int, qs: int, sys_len: int, protect_system: bool) -> np.ndarray:
  """[n] bool the base forced set: the query span [qs, n) and, protected, the system
  prompt [0, sys_len)."""
  forced = np.zeros(n, bool)
  forced[qs:] = True
  if protect_system:
    forced[:sys_len] = True
  return forced


@dataclasses.dataclass
class _Turn:
  """A pruned row's state."""
  session: str
  qs: int                      # start of the actionable query span
  sys_len: int                 # the protected system prompt
  width: int                   # slot-map width of the pruning event (SessionRunner's)
  prev: tuple | None           # the session's previous radix path (tokens, holes[, private])
  lock: object = None          # the radix match's lock
  q_parts: list = dataclasses.field(default_factory=list)   # (lo, q [L, n, Hq, D])
  new_memory: object = None
  memory_cos: float = float("nan")
  live_before: int = 0
  live_after: int = 0
  pruned: bool = False


class Pruned(Mechanism):
  """Pruned agent sessions in the engine (module docstring)."""

  name = "pruned"
  metrics = (
      ("jaxkv_pruning_events_total", "events", "requests whose KV was pruned"),
      ("jaxkv_pruned_tokens_total", "pruned_tokens", "live prompt KV entries pruned away"),
      ("jaxkv_pruning_kept_tokens_total", "kept_tokens",
       "live prompt KV entries kept by pruned requests"))

  def __init__(self, tokenizer, model_cfg, kv, pruning: PruningConfig, *, head=None):
    if pruning.layout != "dead_slot":
      raise ValueError("serving prunes with the dead_slot layout (compact loses prefix-cache "
                       "hits; it is evaluated with SessionRunner): set pruning.layout="
                       "dead_slot")
    self.tok, self.kv = tokenizer, kv
    self.state = PruningState(model_cfg, pruning, head=head)
    self.tree = kv.tree(TREE, dead_keys=True)
    # counters for /metrics (one writer: the engine's thread)
    self.stats = {"events": 0, "pruned_tokens": 0, "kept_tokens": 0}

  @property
  def pruning(self) -> PruningConfig:
    return self.state.pruning

  def set_policy(self, pruning: PruningConfig, *, head=None, keep_prefixes=()) -> None:
    """Switches the policy between evaluations on an idle engine: every session is
    forgotten, and of this mechanism's radix tree only `keep_prefixes` (token arrays:
    the system prompts sessions share, as on a server) stay cached, so each policy's
    own hits and re-prefills are what its metrics show."""
    if pruning.layout != "dead_slot":
      raise ValueError("serving prunes with the dead_slot layout only")
    self.state.set_policy(pruning, head=head)
    self.tree.retain(keep_prefixes)

  def context(self, session: str, messages, tools=None) -> tuple[list[int], dict]:
    """(prompt token ids, `Request.context`) of a turn whose prompt is `messages`."""
    p = labels.prepare_turn(self.tok, messages, tools, len(messages), reply=False)
    return list(p["ids"]), {"session": session, "qs": p["qs"], "sys_len": p["sys_len"]}

  # ------------------------------------------------------------------ hooks
  def match(self, req) -> Match:
    ctx = req.context
    session, qs, sys_len = ctx["session"], ctx["qs"], ctx["sys_len"]   # before any lock
    prev = self.state.paths.get(session)
    prompt = np.asarray(req.prompt, np.int64)
    width = plan.width(len(req.prompt) + req.sampling.max_tokens)
    m = self.tree.match_prefix(prompt[:-1], lock=True, holes=None if prev is None else prev[1],
                               private_from=_private(prev))
    return Match(m.n_matched, m.slots, _Turn(session, qs, sys_len, width, prev, lock=m))

  def private_from(self, row) -> int | None:
    pf = _private(row.state.prev)
    return pf if pf is not None and pf < row.cached else None

  def shared_prefix(self, row) -> int:
    return row.state.sys_len

  def queries_from(self, row) -> int:
    n = len(row.req.prompt)
    t = row.state
    return {"window": n - self.pruning.snap_window, "span": t.qs,
            "all": min(self.state.seen.get(t.session, 0), n - 1)
            }.get(policy.query_rows(self.pruning), n)

  def unmatch(self, match: Match) -> None:
    self.tree.release_lock(match.state.lock)

  def join(self, req) -> _Turn:
    """Pruning of a row whose KV another mechanism lays out and caches (an agents
    trajectory): the same event after the prefill, no radix tree of its own."""
    ctx = req.context
    width = plan.width(len(req.prompt) + req.sampling.max_tokens)
    return _Turn(ctx["session"], ctx["qs"], ctx["sys_len"], width, None)

  def leave(self, row, cache: bool) -> dict | None:
    t = row.state
    if cache and row.prefilled == len(row.req.prompt):
      self.state.commit(t.session, t.new_memory, len(row.req.prompt) + len(row.generated))
    return self._usage(t)

  def capture_q(self, row) -> bool:
    del row
    return policy.query_rows(self.pruning) is not None

  def on_chunk(self, row, q, lo: int, n: int) -> None:
    row.state.q_parts.append((lo, q[:, :n]))

  def _queries(self, row, hit: int, n: int):
    """[L, 1, Wq, Hq, D] the captured queries of tokens [hit, n), row j = token hit + j."""
    parts = row.state.q_parts
    if not parts:
      return None
    l, _, h, d = parts[0][1].shape
    buf = jnp.zeros((l, 1, plan.chunk_len(max(n - hit, 1)), h, d), parts[0][1].dtype)
    for lo, q in parts:
      buf = buf.at[:, 0, lo - hit:lo - hit + q.shape[1]].set(q)
    return buf

  def after_prefill(self, row) -> None:
    t, cfg = row.state, self.pruning
    alloc = self.kv.allocator
    n, hit = len(row.req.prompt), row.cached
    smap = alloc.slot_map(row.seq)
    live = (smap != SENTINEL) & (np.arange(smap.size) < n)
    t.live_before = t.live_after = int(live.sum())
    q = self._queries(row, hit, n)
    t.q_parts = []
    memory = None
    if cfg.method == "intentkv":        # M_t advances on every request (eq. 2)
      memory, t.new_memory, t.memory_cos = self.state.advance(t.session, t.qs, q, hit, n)
    budget = self.state.budget_for(live, t.qs, t.sys_len, n)
    t.pruned = cfg.method != "none" and t.live_before > budget
    if t.pruned:
      keep = self.state.select(t.session, self.kv.driver.kv.k, smap, live, t.qs, t.sys_len, q,
                               hit, n, t.width, budget, memory)
      select.evict_dropped(alloc, row.seq, keep | (np.arange(smap.size) >= n))
      t.live_after = int((keep & live).sum())
      self.stats["events"] += 1
      self.stats["pruned_tokens"] += t.live_before - t.live_after
      self.stats["kept_tokens"] += t.live_after

  def finish(self, row, cache: bool) -> dict | None:
    t = row.state
    try:
      if cache and row.prefilled == len(row.req.prompt):
        toks = np.asarray(list(row.req.prompt) + row.generated[:-1], np.int64)
        slots = self.kv.allocator.slot_map(row.seq)[:toks.size]
        # a composition's approximate KV (`Row.private_from`) and the adopted suffix's
        pf = min((p for p in (row.private_from, self.private_from(row)) if p is not None),
                 default=None)
        self.tree.insert(toks, slots, replaces=t.prev, private_from=pf)
        self.state.commit(t.session, t.new_memory, len(row.req.prompt) + len(row.generated),
                          (toks.copy(), slots == SENTINEL, pf))
    finally:
      self.tree.release_lock(t.lock)
    return self._usage(t)

  def _usage(self, t: _Turn) -> dict:
    cfg = self.pruning
    extra = {"pruning": cfg.method, "budget": cfg.budget, "pruned": bool(t.pruned),
             "kv_live_before": t.live_before, "kv_live_after": t.live_after}
    if cfg.method == "intentkv":
      extra["query_memory_cos"] = round(t.memory_cos, 6)
    return extra

  def close(self, session: str) -> bool:
    return self.state.close(session)

  @property
  def memories(self):
    """IntentKV's QueryMemory per session (`PruningState.memories`)."""
    return self.state.memories
