"""Multi-turn agent sessions over one KV pool, with pruning and a radix prefix cache.

A session is a chat (system, user, assistant tool calls, tool results, ...).
Every assistant turn is one request whose prompt is the chat before it, so each
turn's prompt extends the previous one and the radix cache serves the shared
prefix. Per request (IntentKV section 3 / appendix H):

1. match the longest cached prefix (radix) and adopt its slots -- under the
   dead-slot layout the session names its holes, so the match goes through them
   and adopts them as SENTINEL: a position pruned in any earlier turn stays
   pruned (and is not recomputed), also when it lay inside an adopted prefix;
2. prefill the rest in chunks, capturing post-RoPE queries for the scorers;
3. IntentKV: advance the session's QueryMemory (eq. 2) from this request's
   query span, on every request whether or not it prunes;
4. once, if the live prompt exceeds the budget C: score, keep F + top-C*, and
   apply the layout (`dead_slot`: slot-map holes + alias-aware free;
   `compact`: copy + re-rotate survivors, and the request is not inserted into
   the radix cache afterwards, as in the published baselines);
5. teacher-forced replay: score the gold assistant turn from the trace (its
   NLL under the pruned cache); free mode (`generate=True`) decodes greedily;
6. insert prompt + reply into the radix cache (holes as dead keys; the insert
   supersedes the session's previous path, so slots pruned there are freed once
   no sequence maps them) and release the sequence.

Metrics follow IntentKV section 4.1 with decode steps = reply tokens after
the first: PT = max |R_t|, Eff. Live KV = max |K_t|, Raw / Eff. KV reads =
sum |R_t| / sum |K_t|, prefix-hit tokens, wall time; plus the NLL of the gold
turn and future-evidence recall (history tokens copied into the next five
tool-call arguments that survive).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import COMPILER_OPTIONS, CacheConfig, PruningConfig
from jaxkv.data import labels
from jaxkv.engine.driver import Driver
from jaxkv.engine.kv_manager import KVManager
from jaxkv.engine.mechanisms.pruned import TREE, PruningState, query_slice  # noqa: F401
from jaxkv.engine.mechanisms.pruned import row as _row
from jaxkv.kv import plan
from jaxkv.kv.state import SENTINEL
from jaxkv.models.forward import Capture
from jaxkv.policies.pruning import policy, select
from jaxkv.rope import delta_frequencies


@dataclasses.dataclass
class TurnMetrics:
  """One request (assistant turn) of a session."""
  session: str
  turn: int
  prompt_tokens: int      # N
  reply_tokens: int       # G (gold turn, or generated)
  hit_tokens: int         # prompt tokens served by the radix cache
  live_before: int        # live prompt tokens before pruning
  live_after: int         # after pruning (== live_before when not pruned)
  pruned: bool
  pt: int                 # max_t |R_t|
  eff_live_kv: int        # max_t |K_t|
  raw_reads: int          # sum_t |R_t|
  eff_reads: int          # sum_t |K_t|
  nll: float              # mean NLL of the reply tokens (teacher-forced), nan in free mode
  evidence: int           # history tokens that future tool calls copy
  evidence_kept: int      # ... that survived
  wall_s: float
  text: str = ""          # generated reply (free mode)
  evidence_candidates: int = 0        # evidence outside the forced system prefix
  evidence_candidates_kept: int = 0   # ... that the policy kept
  memory_cos: float = float("nan")    # IntentKV: cos(M_t, Enc(q_t)), mean over layers / heads
  kept: np.ndarray | None = dataclasses.field(default=None, repr=False)  # [N] kept prompt mask
  reply_ids: list[int] | None = dataclasses.field(default=None, repr=False)  # generated ids

  def to_json(self) -> dict:
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in ("kept", "reply_ids")}


_OWNER = TREE       # this runner's name in the KV manager: its radix tree (shared with the
                    # engine's pruned mechanism), its allocations


class SessionRunner:
  """Runs sessions turn by turn on one pool (batch 1), with a pruning policy."""

  def __init__(self, llm, pruning: PruningConfig = PruningConfig(), *,
               cache: CacheConfig = CacheConfig(num_pages=2048, page_size=16,
                                                max_seq_len=8192),
               prefill_chunk: int = 256, radix: bool = True, attn_impl: str = "auto",
               head=None, kv: KVManager | None = None):
    """Args:
      llm: a loaded `LLM` (model, tokenizer, weights).
      pruning: the policy, layout and budget.
      cache: the pool of this runner when it has one of its own (`kv` None), and
        the longest sequence (`max_seq_len`) either way.
      prefill_chunk: tokens per prefill step.
      radix: use the radix prefix cache.
      attn_impl: `jaxkv.ops` implementation.
      head: IntentKV `learnable` mode: a trained `ResidualHead`, or its
        `nnx.split` (graphdef, state).
      kv: the `KVManager` whose pool to run on (a server's, shared with its engine
        and other runners; its attention implementation is used), or None for a
        pool of this runner's own (`cache`).
    """
    self.tok = llm.tokenizer
    self.cfg = llm.config
    self.chunk = prefill_chunk
    self.kv = kv if kv is not None else KVManager(self.cfg, cache, llm.graphdef, llm.weights,
                                                  attn_impl=attn_impl)
    self.max_len = cache.max_seq_len
    self.alloc = self.kv.allocator
    # dead-slot pruning keeps holes in the cached token stream (IntentKV section 3.4)
    self.radix = self.kv.tree(_OWNER, dead_keys=True) if radix else None
    self.state: PruningState | None = None
    self.set_policy(pruning, head=head)

  def set_policy(self, pruning: PruningConfig, *, head=None, keep_prefixes=()) -> None:
    """Switches the pruning policy and forgets every session: QueryMemory, radix paths
    and holes, and the radix cache itself except `keep_prefixes` (token arrays).

    A side-by-side evaluation runs its methods on one runner this way, keeping what
    a server shares across sessions (the system prompt with its tool schemas) and
    nothing a session made, so each method's own hits and re-prefills are what
    its metrics show. `head` as in __init__.
    """
    if self.state is None:
      self.state = PruningState(self.cfg, pruning, head=head)
    else:
      self.state.set_policy(pruning, head=head)
    if self.radix is not None:
      self.radix.retain(keep_prefixes)
    if pruning.layout == "compact":      # survivors are re-rotated: needs an exact delta
      self.inv_freq = delta_frequencies(self.cfg.rope, self.cfg.head_dim)

  # the policy state (`PruningState`, shared with the engine's pruned mechanism)
  @property
  def pruning(self) -> PruningConfig:
    return self.state.pruning

  @pruning.setter
  def pruning(self, cfg: PruningConfig) -> None:
    """A new budget or method for the next turns, sessions kept (`set_policy` forgets
    them)."""
    self.state.pruning = cfg

  head = property(lambda self: self.state.head)
  memories = property(lambda self: self.state.memories)
  seen = property(lambda self: self.state.seen)
  paths = property(lambda self: self.state.paths)

  # ---------------------------------------------------------------- prompts
  def prepare(self, messages: Sequence[dict], tools, i: int, reply: bool = True) -> dict:
    """Prompt (messages[:i]), gold reply (messages[i], with `reply`), spans and
    evidence labels (`labels.prepare_turn`)."""
    return labels.prepare_turn(self.tok, messages, tools, i, reply=reply)

  # ---------------------------------------------------------------- device steps
  def _run_chunks(self, seq: int, toks: np.ndarray, start: int, stop: int, p0: int,
                  capture: bool, width: int, all_logits: bool = True):
    """Forward toks[start:stop], written at logical positions p0 + (j - start).

    Returns (logprobs of toks[j + 1] and greedy next tokens -- for every j in
    [start, stop), or only for the last one without `all_logits` --, and with
    `capture` the post-RoPE queries [L, 1, Wq, Hq, D] of those tokens, row j - start
    holding token j; Wq is bucketed and rows past stop - start are padding).
    """
    smap = plan.slot_rows([self.alloc.slot_map(seq)], width)
    lps, nxts = [], []
    opts = {"capture": Capture(q=True)} if capture else {}
    q_buf = None
    for ch, out in self.driver.prefill(
        [plan.Row(toks[start:stop], p0)], chunk=self.chunk, slot_map=smap,
        read="all" if all_logits else "last", targets=[toks[start + 1:stop + 1]],
        options=lambda ch: opts):
      n = int(ch.count[0])
      if all_logits or ch.ends[0]:
        lps.append(np.asarray(out.logprob[0, :n]))
        nxts.append(np.asarray(out.argmax[0, :n]))
      if capture:
        if q_buf is None:      # room for the last padded chunk past the real rows
          l, b, _, h, d = out.q.shape
          q_buf = jnp.zeros((l, b, plan.chunk_len(stop - start + self.chunk), h, d),
                            out.q.dtype)
        q_buf = _write_rows(q_buf, out.q, int(ch.lo[0]))
    return np.concatenate(lps), np.concatenate(nxts), q_buf

  # ---------------------------------------------------------------- one request
  def run_turn(self, session_id: str, messages: Sequence[dict], tools, i: int, *,
               generate: bool = False, max_tokens: int = 128,
               forced_reply: int = 0, until=None) -> TurnMetrics:
    """One request: the prompt messages[:i], reply = gold messages[i] (teacher-forced)
    or, with `generate`, up to `max_tokens` greedy tokens (nll is then nan).

    `forced_reply` (with `generate`): the first that many tokens of the gold reply
    join the prompt (e.g. the call up to its arguments, so the model writes only
    the arguments); `text` is then the generated continuation alone. `until(ids)`
    (with `generate`): a host-side check of the reply so far, every 16 tokens;
    True ends the reply there (e.g. once the call it writes is complete)."""
    t0 = time.perf_counter()
    if not 0 < i <= len(messages) - (0 if generate and not forced_reply else 1):
      raise ValueError(f"turn {i} of a {len(messages)}-message session: the prompt is "
                       "messages[:i] and a gold reply needs messages[i]")
    p = self.prepare(messages, tools, i, reply=i < len(messages))
    prompt, gold = np.asarray(p["ids"], np.int32), np.asarray(p.get("gold", []), np.int32)
    if forced_reply:
      if not generate or not 0 < forced_reply < gold.size:
        raise ValueError(f"forced_reply needs generate and 0 < forced_reply < {gold.size} "
                         f"(the gold reply's tokens), got {forced_reply}")
      prompt = np.concatenate([prompt, gold[:forced_reply]])
      p = dict(p, evidence=np.concatenate([p["evidence"], np.zeros(forced_reply, bool)]))
    if generate:
      gold = np.zeros(max_tokens, np.int32)     # slots reserved for the reply
    n, g = prompt.size, gold.size
    if n + g > self.max_len:
      raise ValueError(f"session {session_id!r} turn {i}: prompt + reply = {n + g} tokens "
                       f"exceed cache.max_seq_len = {self.max_len}")
    toks = np.concatenate([prompt, gold])
    before = set(self.alloc.sequences())
    try:
      seq = self.alloc.new_sequence()
      prev = self.paths.get(session_id)
      hit = (self.radix.adopt_prefix(seq, prompt[:n - 1], holes=None if prev is None else prev[1])
             if self.radix is not None else 0)
      self._reserve(seq, n + g - hit)
      width = plan.width(n + g)
      cfg = self.pruning
      rows = policy.query_rows(cfg)
      lp_prompt, nxt, q = self._run_chunks(seq, toks, hit, n, hit, rows is not None, width,
                                           all_logits=False)
      smap = self.alloc.slot_map(seq)
      t = np.arange(smap.size)
      live = (smap != SENTINEL) & (t < n)
      live_before = int(live.sum())
      keep = live
      budget = self.state.budget_for(live, p["qs"], p["sys_len"], n)
      pruned = cfg.method != "none" and live_before > budget
      memory, new_memory, memory_cos = None, None, float("nan")
      if cfg.method == "intentkv":        # M_t advances on every request (eq. 2)
        memory, new_memory, memory_cos = self._advance_memory(session_id, p, q, hit, n)
      p0 = n
      if pruned:
        keep = self._select(session_id, smap, live, p, q, hit, n, width, budget, memory)
        if cfg.layout == "dead_slot":
          select.evict_dropped(self.alloc, seq, keep | (t >= n))   # reply slots stay
        else:
          seq, p0 = self._compact(seq, smap, keep, g, width), int(keep.sum())
      text = ""
      if generate:
        g = self._generate(seq, toks, n, p0, int(nxt[-1]), width, until=until)
        text = self.tok.decode(toks[n:n + g])
        nll = float("nan")
      else:
        lp_gold, _, _ = self._run_chunks(seq, toks, n, n + g, p0, False, width)
        nll = -float(lp_prompt[-1] + lp_gold[:-1].sum()) / max(g, 1)
      path = None
      if self.radix is not None and not (pruned and cfg.layout == "compact"):
        # the last reply token has no KV yet in free mode; a gold turn is fully written
        cached = n + g - (1 if generate else 0)
        slots = self.alloc.slot_map(seq)[:cached]
        self.radix.insert(toks[:cached], slots, replaces=prev)
        path = (toks[:cached].copy(), slots == SENTINEL)
      # stored once the turn has succeeded: M_t, the processed length, the path
      self.state.commit(session_id, new_memory, n + g, path)
      self.alloc.free_sequence(seq)
    except BaseException:
      for leaked in set(self.alloc.sequences()) - before:   # free this turn's sequences
        self.alloc.free_sequence(leaked)
      raise
    live_after = int(keep.sum())
    steps_ = max(g - 1, 0)
    tri = steps_ * (steps_ + 1) // 2
    ev = p["evidence"]
    return TurnMetrics(
        session=session_id, turn=i, prompt_tokens=n, reply_tokens=g, hit_tokens=hit,
        reply_ids=toks[n:n + g].tolist() if generate else None,
        live_before=live_before, live_after=live_after, pruned=pruned, pt=n + steps_,
        eff_live_kv=live_after + steps_, raw_reads=steps_ * n + tri,
        eff_reads=steps_ * live_after + tri, nll=nll, evidence=int(ev.sum()),
        evidence_kept=int((ev & keep[:n]).sum()),
        evidence_candidates=int(ev[p["sys_len"]:].sum()),
        evidence_candidates_kept=int((ev & keep[:n])[p["sys_len"]:].sum()),
        wall_s=time.perf_counter() - t0, text=text, memory_cos=memory_cos,
        kept=np.asarray(keep[:n]))

  def _generate(self, seq, toks, n, p0, first, width, steps_per_call: int = 16,
                until=None) -> int:
    """Greedy decode into toks[n:] with the engine's `lax.scan` decode step, until a
    stop token, the reserved length or `until(reply ids)`; returns the number of
    reply tokens."""
    stop = self.tok.stop_ids
    stop_ids = jnp.asarray(list(stop) or [-1], jnp.int32)
    smap = plan.slot_rows([self.alloc.slot_map(seq)], width)
    toks[n] = first
    g, cap = 1, toks.size - n
    while toks[n + g - 1] not in stop and g < cap and not (until and until(toks[n:n + g])):
      out = self.driver.decode([toks[n + g - 1]], [p0 + g - 1], smap, [cap - g],
                               num_steps=steps_per_call, stop_ids=stop_ids)
      new = np.asarray(out.tokens)[np.asarray(out.emitted)[:, 0], 0]
      toks[n + g:n + g + new.size] = new
      g += new.size
    return g

  @property
  def driver(self) -> Driver:
    """The KV manager's driver (the pool every step runs on)."""
    return self.kv.driver

  def _reserve(self, seq: int, n: int) -> None:
    """extend(seq, n). When the pool is short this runner's radix tree gives back its
    least recently used entries first, then the KV manager makes room from the other
    caches on the pool (`KVManager.extend(first=)`)."""
    self.kv.extend(seq, n, owner=_OWNER, first=self.radix)

  def _advance_memory(self, session_id, p, q, hit, n):
    return self.state.advance(session_id, p["qs"], q, hit, n)

  def _select(self, session_id, smap, live, p, q, hit, n, width, budget, memory=None):
    return self.state.select(session_id, self.driver.kv.k, smap, live, p["qs"], p["sys_len"], q,
                             hit, n, width, budget, memory)

  def _compact(self, seq, smap, keep, g, width) -> int:
    n_keep = int(keep.sum())
    new = self.alloc.new_sequence()
    self._reserve(new, n_keep + g)
    dest = _row(self.alloc.slot_map(new)[:n_keep], width)
    self.driver.kv, _, _ = _compact_jit(self.driver.kv, _row(smap, width),
                                        _row(keep, width, bool), dest, self.inv_freq)
    self.alloc.free_sequence(seq)
    return new

  # ---------------------------------------------------------------- sessions
  def close_session(self, session_id: str) -> bool:
    """Forgets a session: its QueryMemory, processed-token count and radix path (the
    KV it cached stays, unheld, for the LRU to evict). False if it had no state."""
    return self.state.close(session_id)

  def run_session(self, session_id: str, messages: Sequence[dict], tools=None, *,
                  generate: bool = False, max_tokens: int = 128) -> list[TurnMetrics]:
    """Every assistant turn after the first message, in order: teacher-forced replay,
    or free generation of each turn (the next prompt still carries the trace's turn,
    whose tool results follow from it)."""
    out = []
    for i, m in enumerate(messages):
      if m.get("role") == "assistant" and i > 0:
        out.append(self.run_turn(session_id, messages, tools, i, generate=generate,
                                 max_tokens=max_tokens))
    return out


_compact_jit = jax.jit(select.compact_layout, donate_argnums=(0,),
                       compiler_options=COMPILER_OPTIONS)


@functools.partial(jax.jit, donate_argnums=(0,), compiler_options=COMPILER_OPTIONS)
def _write_rows(buf: jax.Array, rows: jax.Array, offset) -> jax.Array:
  """buf [L, B, W, ...] with rows [L, B, C, ...] written at row offset (traced)."""
  start = (0, 0, offset) + (0,) * (buf.ndim - 3)
  return jax.lax.dynamic_update_slice(buf, rows.astype(buf.dtype), start)

