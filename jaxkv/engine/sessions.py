"""Multi-turn agent sessions over one KV pool, with pruning and a radix prefix cache.

A session is a chat (system, user, assistant tool calls, tool results, ...).
Every assistant turn is one request whose prompt is the chat before it, so each
turn's prompt extends the previous one and the radix cache serves the shared
prefix. Per request (IntentKV section 3 / appendix H):

1. match the longest cached prefix (radix) and adopt its slots -- under the
   dead-slot layout those include SENTINEL holes left by earlier pruning, so
   pruned tokens stay pruned and are not recomputed;
2. prefill the rest in chunks, capturing post-RoPE queries for the scorers;
3. once, if the live prompt exceeds the budget C: score, keep F + top-C*, and
   apply the layout (`dead_slot`: slot-map holes + alias-aware free;
   `compact`: copy + re-rotate survivors, and the request is not inserted into
   the radix cache afterwards, as in the published baselines);
4. teacher-forced replay: score the gold assistant turn from the trace (its
   NLL under the pruned cache); free mode (`generate=True`) decodes greedily;
5. insert prompt + reply into the radix cache and release the sequence.

Metrics follow IntentKV section 4.1 with decode steps = reply tokens after
the first: PT = max |R_t|, Eff. Live KV = max |K_t|, Raw / Eff. KV reads =
sum |R_t| / sum |K_t|, prefix-hit tokens, wall time; plus the NLL of the gold
turn and future-evidence recall (history tokens copied into the next five
tool-call arguments that survive).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import labels
from jaxkv.engine import steps
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import OutOfSlotsError, PagedAllocator
from jaxkv.kv.radix import RadixCache
from jaxkv.kv.state import SENTINEL
from jaxkv.models.layers import rope_frequencies
from jaxkv.policies.pruning import intentkv, policy, scores, select


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
  kept: np.ndarray | None = dataclasses.field(default=None, repr=False)  # [N] kept prompt mask

  def to_json(self) -> dict:
    return {k: v for k, v in dataclasses.asdict(self).items() if k != "kept"}


def _bucket(n: int, lo: int) -> int:
  return max(lo, 1 << max(0, int(n) - 1).bit_length())


class SessionRunner:
  """Runs sessions turn by turn on one pool (batch 1), with a pruning policy."""

  def __init__(self, llm, pruning: PruningConfig = PruningConfig(), *,
               cache: CacheConfig = CacheConfig(num_pages=2048, page_size=16,
                                                max_seq_len=8192),
               prefill_chunk: int = 256, radix: bool = True, attn_impl: str = "auto",
               head=None):
    """Args:
      llm: a loaded `LLM` (model, tokenizer, weights).
      pruning: the policy, layout and budget.
      cache: the pool of this runner (separate from llm's engine pool).
      prefill_chunk: tokens per prefill step.
      radix: use the radix prefix cache.
      attn_impl: `jaxkv.ops` implementation.
      head: IntentKV `learnable` mode: a trained `ResidualHead`, or its
        `nnx.split` (graphdef, state).
    """
    if pruning.method == "intentkv" and pruning.intent_mode == "learnable":
      if head is None:
        raise ValueError("IntentKV learnable mode needs a trained residual head "
                         "(pruning.head_path / SessionRunner(head=...))")
      self.head = nnx.split(head) if isinstance(head, nnx.Module) else tuple(head)
    else:
      self.head = (None, None)
    self.tok = llm.tokenizer
    self.cfg = llm.config
    self.graphdef, self.weights = llm.engine.graphdef, llm.engine.weights
    self.pruning = pruning
    self.chunk = prefill_chunk
    self.attn_impl = attn_impl
    self.kv = kv_state.init_pool(self.cfg, cache)
    self.max_len = cache.max_seq_len
    self.alloc = PagedAllocator(cache.num_pages, cache.page_size)
    # dead-slot pruning keeps holes in the cached token stream (IntentKV section 3.4)
    self.radix = RadixCache(self.alloc, cache_dead=True) if radix else None
    self.memories = intentkv.QueryMemoryStore(pruning.memory_capacity)
    self.inv_freq, _ = rope_frequencies(self.cfg.rope, self.cfg.head_dim, None)

  # ---------------------------------------------------------------- prompts
  def _render(self, messages, tools, add_generation_prompt):
    return self.tok.render_chat(list(messages), tools=tools,
                                add_generation_prompt=add_generation_prompt)

  def prepare(self, messages: Sequence[dict], tools, i: int) -> dict:
    """Prompt (messages[:i]), gold reply (messages[i]), spans and evidence labels."""
    text = self._render(messages[:i], tools, True)
    ids, offsets = self.tok.encode_with_offsets(text)
    full = self.tok.encode(self._render(messages[:i + 1], tools, False), add_bos=False)
    if full[:len(ids)] != ids:
      raise ValueError(f"chat template is not prefix-stable at message {i}; cannot replay")
    gold = full[len(ids):]
    before_query = self.tok.encode(self._render(messages[:_query_start(messages, i)], tools,
                                                False), add_bos=False)
    qs = min(len(before_query), len(ids) - 1)
    sys_len = 0
    if messages and messages[0].get("role") == "system":
      sys_len = len(self.tok.encode(self._render(messages[:1], tools, False), add_bos=False))
    values = labels.future_tool_arguments(messages, i)
    q_char = offsets[qs][0] if qs < len(offsets) else len(text)
    evidence = labels.evidence_mask(text, offsets, values, end_char=q_char)
    evidence[qs:] = False
    return dict(ids=ids, gold=gold, qs=qs, sys_len=min(sys_len, qs), evidence=evidence)

  # ---------------------------------------------------------------- device steps
  def _run_chunks(self, seq: int, toks: np.ndarray, start: int, stop: int, p0: int,
                  capture: bool, width: int):
    """Forward positions [start, stop) of `toks` written at logical p0 + (j - start)...

    Returns (logprobs of toks[j + 1] for j in [start, stop), greedy next token
    after each position, q rows or None).
    """
    smap = np.zeros((1, width), np.int32)
    m = self.alloc.slot_map(seq)
    smap[0, :m.size] = m
    lps, qs, nxts = [], [], []
    for c0 in range(start, stop, self.chunk):
      c1 = min(stop, c0 + self.chunk)
      n = c1 - c0
      cb = _bucket(n, 16)
      tokens = np.zeros((1, cb), np.int32)
      tokens[0, :n] = toks[c0:c1]
      pos = np.full((1, cb), -1, np.int32)
      pos[0, :n] = p0 + np.arange(c0 - start, c1 - start)
      tgt = np.zeros((1, cb), np.int32)
      nxt = toks[c0 + 1:c1 + 1]
      tgt[0, :nxt.size] = nxt
      lp, am, self.kv, q = steps.score_chunk(
          self.graphdef, self.weights, self.kv, jnp.asarray(tokens), jnp.asarray(pos),
          jnp.asarray(smap), jnp.asarray(tgt), attn_impl=self.attn_impl, capture_q=capture)
      lps.append(np.asarray(lp[0, :n]))
      nxts.append(np.asarray(am[0, :n]))
      if capture:
        qs.append(q[:, :, :n])
    q_all = jnp.concatenate(qs, axis=2) if capture else None
    return np.concatenate(lps), np.concatenate(nxts), q_all

  # ---------------------------------------------------------------- one request
  def run_turn(self, session_id: str, messages: Sequence[dict], tools, i: int, *,
               generate: bool = False, max_tokens: int = 128) -> TurnMetrics:
    """One request: the prompt messages[:i], reply = gold messages[i] (teacher-forced)
    or, with `generate`, up to `max_tokens` greedy tokens (nll is then nan)."""
    t0 = time.perf_counter()
    p = self.prepare(messages, tools, i)
    prompt, gold = np.asarray(p["ids"], np.int32), np.asarray(p["gold"], np.int32)
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
      hit = self.radix.adopt_prefix(seq, prompt[:n - 1]) if self.radix is not None else 0
      self._reserve(seq, n + g - hit)
      width = _bucket(n + g, 128)
      cfg = self.pruning
      rows = policy.query_rows(cfg)
      lp_prompt, nxt, q = self._run_chunks(seq, toks, hit, n, hit, rows is not None, width)
      smap = self.alloc.slot_map(seq)
      t = np.arange(smap.size)
      live = (smap != SENTINEL) & (t < n)
      live_before = int(live.sum())
      keep = live
      pruned = cfg.method != "none" and live_before > cfg.budget
      p0 = n
      if pruned:
        keep = self._select(session_id, smap, live, p, q, hit, n, width)
        if cfg.layout == "dead_slot":
          select.evict_dropped(self.alloc, seq, keep | (t >= n))   # reply slots stay
        else:
          seq, p0 = self._compact(seq, smap, keep, g, width), int(keep.sum())
      text = ""
      if generate:
        g = self._generate(seq, toks, n, p0, int(nxt[-1]), width)
        text = self.tok.decode(toks[n:n + g])
        nll = float("nan")
      else:
        lp_gold, _, _ = self._run_chunks(seq, toks, n, n + g, p0, False, width)
        nll = -float(lp_prompt[-1] + lp_gold[:-1].sum()) / max(g, 1)
      if self.radix is not None and not (pruned and cfg.layout == "compact"):
        # the last reply token has no KV yet in free mode; a gold turn is fully written
        cached = n + g - (1 if generate else 0)
        self.radix.insert(toks[:cached], self.alloc.slot_map(seq)[:cached])
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
        live_before=live_before, live_after=live_after, pruned=pruned, pt=n + steps_,
        eff_live_kv=live_after + steps_, raw_reads=steps_ * n + tri,
        eff_reads=steps_ * live_after + tri, nll=nll, evidence=int(ev.sum()),
        evidence_kept=int((ev & keep[:n]).sum()),
        evidence_candidates=int(ev[p["sys_len"]:].sum()),
        evidence_candidates_kept=int((ev & keep[:n])[p["sys_len"]:].sum()),
        wall_s=time.perf_counter() - t0, text=text,
        kept=np.asarray(keep[:n]))

  def _generate(self, seq, toks, n, p0, first, width) -> int:
    """Greedy decode into toks[n:], one token per step, until a stop token; returns length."""
    stop = set(self.tok.stop_ids)
    toks[n] = first
    g = 1
    while toks[n + g - 1] not in stop and n + g < toks.size:
      _, nxt, _ = self._run_chunks(seq, toks, n + g - 1, n + g, p0 + g - 1, False, width)
      toks[n + g] = nxt[-1]
      g += 1
    return g

  def _reserve(self, seq: int, n: int) -> None:
    """extend(seq, n), evicting LRU radix entries first when the pool is short."""
    try:
      self.alloc.extend(seq, n)
    except OutOfSlotsError:
      if self.radix is None:
        raise
      self.radix.evict(max(n, self.radix.num_cached_tokens // 4))
      self.alloc.extend(seq, n)

  def _select(self, session_id, smap, live, p, q, hit, n, width):
    cfg = self.pruning
    smap_b = np.zeros((1, width), np.int32)
    smap_b[0, :smap.size] = smap
    live_b = np.zeros((1, width), bool)
    live_b[0, :live.size] = live
    forced = np.zeros((1, width), bool)
    forced[0, p["qs"]:n] = True
    if cfg.protect_system:
      forced[0, :p["sys_len"]] = True
    k = scores.gather_keys(self.kv.k, jnp.asarray(smap_b))
    rows = policy.query_rows(cfg)
    qq = qpos = memory = None
    key = None
    if rows is not None:
      pos = np.arange(hit, n, dtype=np.int32)
      lo = {"window": max(0, pos.size - cfg.snap_window), "all": 0,
            "span": max(0, p["qs"] - hit)}[rows]
      qq, pos = q[:, :, lo:], pos[lo:]
      rb = _bucket(pos.size, 16)
      qq = jnp.pad(qq, ((0, 0), (0, 0), (0, rb - pos.size), (0, 0), (0, 0)))
      qpos = jnp.asarray(np.pad(pos, (0, rb - pos.size), constant_values=-1)[None])
    if cfg.method == "intentkv":
      key = intentkv.session_key(session_id=session_id)
      shape = (self.cfg.num_layers, self.cfg.num_heads, self.cfg.head_dim)
      memory, _ = self.memories.gather([key], shape)
    span = np.zeros((1, width), bool)
    span[0, p["qs"]:n] = True
    keep, new_mem = policy.select_kept(cfg, k, jnp.asarray(live_b), jnp.asarray(forced),
                                       qq, qpos, memory, jnp.asarray(span),
                                       head_graphdef=self.head[0], head_state=self.head[1])
    if cfg.method == "intentkv" and cfg.intent_mode != "query":
      self.memories.scatter([key], new_mem)
    return np.asarray(keep[0, :smap.size])

  def _compact(self, seq, smap, keep, g, width) -> int:
    n_keep = int(keep.sum())
    new = self.alloc.new_sequence()
    self._reserve(new, n_keep + g)
    dest = np.zeros((1, width), np.int32)
    dest[0, :n_keep] = self.alloc.slot_map(new)[:n_keep]
    smap_b = np.zeros((1, width), np.int32)
    smap_b[0, :smap.size] = smap
    keep_b = np.zeros((1, width), bool)
    keep_b[0, :keep.size] = keep
    self.kv, _, _ = _compact_jit(self.kv, jnp.asarray(smap_b), jnp.asarray(keep_b),
                                 jnp.asarray(dest), self.inv_freq)
    self.alloc.free_sequence(seq)
    return new

  # ---------------------------------------------------------------- sessions
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


_compact_jit = jax.jit(select.compact_layout, donate_argnums=(0,))


def _query_start(messages: Sequence[dict], i: int) -> int:
  """Index of the first message of the actionable query span before message i:
  the trailing run of user / tool messages (the latest request or tool results)."""
  j = i
  while j > 0 and messages[j - 1].get("role") in ("user", "tool"):
    j -= 1
  return j
