"""MemArtRunner: conversation history kept as KV blocks in the pool and retrieved
by attention (MemArt, seed 003), on the substrate's aliasing and key shift.

Layout. Every prompt is ids laid out as `head + memory + tail`: the chat
template's head (system prompt, "user" opening) is prefilled once and held;
memory is the conversation's text; the tail is the new query and the
assistant opening. Full context runs all of it; MemArt runs only the tail.

Memory write (`write`, after each session, off the request path). A span of
history (a session) is prefilled after the held head, its slots start on a
fresh page, so the pool's pages are the memory blocks (BS = page size). Each
block gets its AABB (`policies.memory.memart.block_boxes`) per layer and KV
head over the de-rotated keys R(-p)k (`box_keys=rope`: as stored), and its
slots are held by the memory; the writing sequence is freed.

Request (`answer`):
1. probe: the tail is run after the head alone, capturing every layer's query;
   the de-rotated queries score every live block (eq. 3, Table 1's norm x agg)
   and the top-k blocks come back in chronological order (one jitted call);
2. splice without copies: a new sequence's slot map is head, then the blocks'
   slots (aliased: adopted refcounts, no K/V moved), then fresh slots for the
   tail. A block's keys are read rotated by `key_shift` = new position - the
   position it was written at (eq. 6 on read, `ops.paged_attention`), so
   the blocks sit at contiguous positions right after the head (a partly
   filled block's written tokens are packed: no holes);
3. the tail is prefilled (the only tokens computed with memory), the first
   token read (TTFT), then greedy decoding over the same map and shifts.

Budget: memory bytes = blocks x BS x slot bytes + boxes; a write past
`byte_budget` first evicts the least-retrieved blocks (ties: the oldest).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig, MemArtConfig
from jaxkv.engine.driver import Driver, continue_one
from jaxkv.engine.kv_manager import KVManager
from jaxkv.engine.prefill_work import Work, drain
from jaxkv.kv import plan as plan_lib
from jaxkv.kv.state import SENTINEL
from jaxkv.literal_chat import literal_backend
from jaxkv.policies.memory import memart
from jaxkv.rope import delta_frequencies


@dataclasses.dataclass
class Memory:
  """One conversation's memory: block rows (host) and their boxes (device)."""
  slots: np.ndarray       # [cap, BS] int32 held pool slots (SENTINEL: unused entry)
  positions: np.ndarray   # [cap, BS] int32 positions the keys were written at
  tokens: np.ndarray      # [cap] int32 written tokens per block
  ids: np.ndarray         # [cap, BS] int32 the token ids written (0 past `tokens`)
  live: np.ndarray        # [cap] bool
  time: np.ndarray        # [cap] int32 chronological order
  hits: np.ndarray        # [cap] int32 times retrieved (eviction: fewest first)
  segment: np.ndarray     # [cap] int32 the write (span) each block came from
  spans: list             # [cap] (start, end) of each block in its span's token ids
  tags: list              # [cap] whatever the writer attached (the span id)
  lo: jax.Array           # [L, cap, Hkv, D]
  hi: jax.Array
  clock: int = 0
  nbytes: int = 0
  writes: int = 0

  @property
  def num_blocks(self) -> int:
    return int(self.live.sum())


@dataclasses.dataclass
class Answer:
  """The outcome of one `answer`."""
  tokens: np.ndarray            # generated ids
  logprobs: np.ndarray | None   # teacher-forced log p (with `forced`)
  logits: np.ndarray            # [V] the last tail token's logits
  blocks: np.ndarray            # retrieved memory rows, chronological
  prefill_tokens: int           # tokens run through the model with memory (the tail)
  probe_tokens: int             # tokens run by the retrieval probe (the tail again)
  decode_kv_len: int            # live KV entries the answer attends to
  ttft_s: float
  latency_s: float


@dataclasses.dataclass
class TailPrefill:
  """What `prefill_into` laid out and computed for a tail."""
  logits: np.ndarray            # [V] the last tail token's logits
  blocks: np.ndarray            # retrieved memory rows, chronological
  probe_tokens: int
  start: int                    # positions adopted: the head and the spliced blocks
  n: int                        # the sequence's prompt positions (start + tail)
  shift: np.ndarray | None      # [n + max_tokens] key shift (None: nothing moved)


_OWNER = "memart"    # this runner's name in the KV manager


class MemArtRunner:
  """A pool, its allocator and the held chat head, for one model.

  Args:
    llm: a loaded `LLM`; cfg: `MemArtConfig`; cache: the pool (page size = the
      block size); head_ids: the template tokens every prompt starts with.
  """

  def __init__(self, llm, cfg: MemArtConfig, head_ids, *,
               cache: CacheConfig = CacheConfig(num_pages=2048, page_size=16,
                                                max_seq_len=8192),
               attn_impl: str = "auto", prefill_chunk: int = 2048,
               kv: KVManager | None = None):
    if kv is not None:
      cache = dataclasses.replace(kv.cache_cfg, max_seq_len=cache.max_seq_len)
    if cache.page_size != cfg.block_size:
      raise ValueError(f"MemArt blocks are pool pages: cache.page_size {cache.page_size} must "
                       f"equal memart.block_size {cfg.block_size}")
    if prefill_chunk < 1:
      raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    self.cfg, self.mcfg, self.prefill_chunk = cfg, llm.config, prefill_chunk
    self.kv = kv if kv is not None else KVManager(self.mcfg, cache, llm.graphdef, llm.weights,
                                                  attn_impl=attn_impl)
    # the KV manager's weights: sharded like its pool when it serves a mesh
    self.graphdef, self.weights = self.kv.graphdef, self.kv.weights
    self.alloc = self.kv.allocator
    self.max_len = cache.max_seq_len
    self.inv_freq = delta_frequencies(self.mcfg.rope, self.mcfg.head_dim)
    m = self.mcfg
    self.slot_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * np.dtype(
        cache.dtype).itemsize
    self.box_heads = 1 if cfg.box_heads == "pooled" else m.num_kv_heads
    self.box_bytes = 2 * m.num_layers * self.box_heads * m.head_dim * 4
    self.head = np.asarray(head_ids, np.int32)
    seq = self.alloc.new_sequence()
    self.head_slots = self._prefill(seq, self.head, 0)[0]
    self.alloc.retain(self.head_slots)                   # held for every prompt
    self.alloc.free_sequence(seq)

  # ----------------------------------------------------------------- plumbing
  @property
  def driver(self) -> Driver:
    """The KV manager's driver (the pool every step runs on)."""
    return self.kv.driver

  def _prefill(self, seq: int, ids: np.ndarray, start: int, *, capture_q: bool = False,
               key_shift: np.ndarray | None = None, owner: str = _OWNER):
    """ids at positions start.. appended to `seq` (fresh slots), in chunks of at
    most `prefill_chunk` tokens (a long history's attention scores stay
    chunk x context, not context^2): (new slots, logits [V] of the last token,
    q or None, q's padded positions)."""
    return self.run_steps(self._prefill_steps(seq, ids, start, capture_q=capture_q,
                                           key_shift=key_shift, owner=owner))

  def run_steps(self, steps):
    """Runs a generator of prefill work (the `*_steps` methods) alone, chunk by chunk
    (`prefill_work.drain`); returns its result."""
    return drain(steps, self.driver, self.prefill_chunk)

  def _prefill_steps(self, seq: int, ids: np.ndarray, start: int, *, capture_q: bool = False,
                     key_shift: np.ndarray | None = None, owner: str = _OWNER):
    """`_prefill` as a generator that yields its `Work` (the engine packs it with
    other rows' work; `drain` runs it alone) and returns its result."""
    ids = np.asarray(ids, np.int32)
    slots = self.kv.extend(seq, ids.size, owner=owner)
    done = yield Work(ids, start, lambda: self.alloc.slot_map(seq), capture_q=capture_q,
                      key_shift=key_shift)
    return slots, done.logits, done.q, done.positions

  def _adopt_head(self, seq: int) -> None:
    self.alloc.adopt(seq, self.head_slots)

  # ------------------------------------------------------------------ memory
  def new_memory(self, capacity: int = 64) -> Memory:
    m, bs = self.mcfg, self.cfg.block_size
    shape = (m.num_layers, capacity, self.box_heads, m.head_dim)
    return Memory(np.zeros((capacity, bs), np.int32), np.zeros((capacity, bs), np.int32),
                  np.zeros(capacity, np.int32), np.zeros((capacity, bs), np.int32),
                  np.zeros(capacity, bool),
                  np.zeros(capacity, np.int32), np.zeros(capacity, np.int32),
                  np.zeros(capacity, np.int32), [None] * capacity, [None] * capacity,
                  jnp.full(shape, jnp.inf, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))

  def _grow(self, mem: Memory, need: int) -> None:
    cap = mem.live.size
    if need <= cap:
      return
    new = self.new_memory(max(need, 2 * cap))
    for f in ("slots", "positions", "tokens", "ids", "live", "time", "hits", "segment"):
      getattr(new, f)[:cap] = getattr(mem, f)
    new.spans[:cap], new.tags[:cap] = mem.spans, mem.tags
    mem.slots, mem.positions, mem.tokens, mem.live = new.slots, new.positions, new.tokens, new.live
    mem.ids = new.ids
    mem.time, mem.hits, mem.spans, mem.tags = new.time, new.hits, new.spans, new.tags
    mem.segment = new.segment
    mem.lo = new.lo.at[:, :cap].set(mem.lo)
    mem.hi = new.hi.at[:, :cap].set(mem.hi)

  def block_nbytes(self) -> int:
    return self.cfg.block_size * self.slot_bytes + self.box_bytes

  def evict(self, mem: Memory, rows) -> None:
    """Drops memory blocks (their slots free once no live request aliases them)."""
    for r in np.atleast_1d(rows):
      held = mem.slots[r][mem.slots[r] != SENTINEL]
      self.alloc.release(held)
      mem.live[r] = False
      mem.nbytes -= self.block_nbytes()

  def forget(self, mem: Memory) -> None:
    self.evict(mem, np.flatnonzero(mem.live))

  def write(self, mem: Memory, ids, tag=None) -> np.ndarray:
    """Appends a span of history (its own prefill after the head) as blocks;
    returns their memory rows. Evicts least-retrieved blocks past the budget."""
    return self.run_steps(self.write_steps(mem, ids, tag))

  def write_steps(self, mem: Memory, ids, tag=None):
    """`write` as a generator of prefill work (`jaxkv.engine.prefill_work`) that
    returns the memory rows: the engine's MemArt mechanism writes a long history a
    chunk per engine step, batched with other rows' work. The span's sequence is
    freed if the generator is closed part way (a cancelled request)."""
    ids = plan_lib.prompt_ids(ids, self.max_len - self.head.size)
    bs = self.cfg.block_size
    nb = -(-ids.size // bs)
    if nb * self.block_nbytes() > self.cfg.byte_budget:
      raise ValueError(f"a span of {ids.size} tokens ({nb} blocks) exceeds memart.byte_budget "
                       f"{self.cfg.byte_budget}")
    while mem.nbytes + nb * self.block_nbytes() > self.cfg.byte_budget:
      live = np.flatnonzero(mem.live)
      self.evict(mem, live[np.lexsort((mem.time[live], mem.hits[live]))[0]])
    seq = self.alloc.new_sequence()
    try:
      self._adopt_head(seq)
      slots = (yield from self._prefill_steps(seq, ids, self.head.size))[0]
    except BaseException:
      self.alloc.free_sequence(seq)
      raise
    pos = self.head.size + np.arange(ids.size, dtype=np.int32)
    pad = nb * bs - ids.size
    slots_b = np.r_[slots, np.full(pad, SENTINEL, np.int32)].reshape(nb, bs)
    pos_b = np.r_[pos, np.zeros(pad, np.int32)].reshape(nb, bs)
    self.alloc.retain(slots)                                # the memory's hold
    self.alloc.free_sequence(seq)
    free = np.flatnonzero(~mem.live)
    if free.size < nb:
      self._grow(mem, mem.live.size + nb - free.size)
      free = np.flatnonzero(~mem.live)
    rows = free[:nb]
    mem.slots[rows], mem.positions[rows] = slots_b, pos_b
    mem.tokens[rows] = np.minimum(bs, ids.size - np.arange(nb) * bs)
    mem.ids[rows] = np.r_[ids, np.zeros(pad, np.int32)].reshape(nb, bs)
    mem.live[rows], mem.hits[rows] = True, 0
    mem.time[rows] = mem.clock + np.arange(nb)
    mem.segment[rows] = mem.writes
    mem.clock += nb
    mem.writes += 1
    for j, r in enumerate(rows):
      mem.spans[r], mem.tags[r] = (j * bs, min(ids.size, (j + 1) * bs)), tag
    lo, hi = memart.pool_boxes(self.driver.kv.k, jnp.asarray(slots_b),
                               jnp.asarray(slots_b != SENTINEL), jnp.asarray(pos_b),
                               self.inv_freq, raw=self.cfg.box_keys == "raw",
                               pooled=self.cfg.box_heads == "pooled")
    idx = jnp.asarray(rows)
    mem.lo, mem.hi = mem.lo.at[:, idx].set(lo), mem.hi.at[:, idx].set(hi)
    mem.nbytes += nb * self.block_nbytes()
    return rows

  # ----------------------------------------------------------------- requests
  def probe(self, tail_ids, voters=None):
    """The tail run after the head alone: (every layer's queries, positions);
    `voters` ([n] bool, default all) picks the tail tokens whose queries score
    blocks (e.g. the question without the instruction around it)."""
    return self.run_steps(self.probe_steps(tail_ids, voters))

  def probe_steps(self, tail_ids, voters=None):
    """`probe` as a generator of prefill work."""
    tail = np.asarray(tail_ids, np.int32)
    if tail.size > self.prefill_chunk:
      raise ValueError(f"a probe of {tail.size} tokens exceeds prefill_chunk "
                       f"{self.prefill_chunk}")
    seq = self.alloc.new_sequence()
    try:
      self._adopt_head(seq)
      _, _, q, pos = yield from self._prefill_steps(seq, tail, self.head.size, capture_q=True)
    finally:
      self.alloc.free_sequence(seq)
    if voters is not None:
      v = np.zeros(pos.size, bool)
      v[:tail.size] = np.asarray(voters, bool)
      pos = np.where(v, pos, -1)
    return q, pos

  def _score(self, mem: Memory, probe, k: int, norm: str | None, agg: str | None,
             rerank: int = 0, neighbors: int = 0):
    """One jitted retrieval over the memory: (blocks [k] padded -1, scores: [cap] of
    every block by the bound, or [rerank x k] of the re-scored candidates)."""
    q, pos = probe
    scale = self.cfg.softmax_scale or self.mcfg.head_dim ** -0.5
    args = (q, jnp.asarray(np.maximum(pos, 0)), jnp.asarray(pos >= 0), mem.lo, mem.hi,
            jnp.asarray(mem.live), jnp.asarray(mem.time), jnp.asarray(mem.segment))
    kw = dict(k=k, norm=norm or self.cfg.norm, agg=agg or self.cfg.agg, scale=float(scale),
              rr_c=float(self.cfg.rr_c), raw=self.cfg.box_keys == "raw", neighbors=neighbors)
    if rerank:
      return memart.retrieve_probe_rerank(*args, self.driver.kv.k, jnp.asarray(mem.slots),
                                          jnp.asarray(mem.positions), self.inv_freq, r=rerank,
                                          **kw)
    return memart.retrieve_probe(*args, self.inv_freq, **kw)

  def rank(self, mem: Memory, probe, top_k: int | None = None, *, norm: str | None = None,
           agg: str | None = None, rerank: int | None = None,
           neighbors: int | None = None) -> np.ndarray:
    """Memory rows for a probe's queries (eq. 3, Table 1; `cfg.rerank`, `cfg.neighbors`),
    chronological (no -1); norm / agg / rerank / neighbors override the config."""
    if not mem.live.any():
      return np.zeros(0, np.int32)
    rerank = self.cfg.rerank if rerank is None else rerank
    neighbors = self.cfg.neighbors if neighbors is None else neighbors
    blocks = np.asarray(self._score(mem, probe, top_k or self.cfg.top_k, norm, agg, rerank,
                                    neighbors)[0])
    return blocks[blocks >= 0]

  def scores(self, mem: Memory, probe, *, norm: str | None = None,
             agg: str | None = None) -> np.ndarray:
    """Aggregated block scores [cap] of a probe (dead rows -inf): one jitted
    call; `select` then takes any k on the host (the recall@k ablation)."""
    return np.where(mem.live, np.asarray(self._score(mem, probe, 1, norm, agg)[1]), -np.inf)

  def exact_scores(self, mem: Memory, probe, *, norm: str | None = None,
                   agg: str | None = None) -> np.ndarray:
    """`scores` with each block's exact content-only max q.k in place of its eq. 3
    bound (the same normalisation and aggregation): what the boxes approximate,
    read from every block's keys (the retrieval ablation's upper bound)."""
    q, pos = probe
    scale = self.cfg.softmax_scale or self.mcfg.head_dim ** -0.5
    got = memart.exact_probe_scores(
        q, jnp.asarray(np.maximum(pos, 0)), jnp.asarray(pos >= 0), self.driver.kv.k,
        jnp.asarray(mem.slots), jnp.asarray(mem.positions), jnp.asarray(mem.live),
        self.inv_freq, norm=norm or self.cfg.norm, agg=agg or self.cfg.agg,
        scale=float(scale), rr_c=float(self.cfg.rr_c))
    return np.where(mem.live, np.asarray(got), -np.inf)

  @staticmethod
  def select(mem: Memory, scores: np.ndarray, k: int) -> np.ndarray:
    """Host top-k of `scores` (ties: the earlier row), chronological: the same
    rule as `policies.memory.memart.select_blocks`."""
    live = np.flatnonzero(mem.live)
    best = live[np.argsort(-scores[live], kind="stable")[:k]]
    return best[np.argsort(mem.time[best], kind="stable")].astype(np.int32)

  def retrieve(self, mem: Memory, tail_ids, top_k: int | None = None,
               voters=None, rerank: int | None = None,
               neighbors: int | None = None) -> np.ndarray:
    """`rank` of the tail's `probe`."""
    return self.run_steps(self.retrieve_steps(mem, tail_ids, top_k, voters, rerank, neighbors))

  def needs_probe(self, mem: Memory, top_k: int | None = None) -> bool:
    """Whether retrieval must score: more live blocks than it keeps."""
    return mem.num_blocks > (top_k or self.cfg.top_k)

  def retrieve_steps(self, mem: Memory, tail_ids, top_k: int | None = None, voters=None,
                     rerank: int | None = None, neighbors: int | None = None):
    """`retrieve` as a generator of prefill work. A memory of at most k live blocks
    is retrieved whole (chronological) without a probe: every score would pick them
    all."""
    if not self.needs_probe(mem, top_k):                # every live block, chronological
      return self.select(mem, np.zeros(mem.live.size), mem.num_blocks)
    probe = yield from self.probe_steps(tail_ids, voters)
    return self.rank(mem, probe, top_k, rerank=rerank, neighbors=neighbors)

  def answer(self, mem: Memory, tail_ids, max_tokens: int, *, blocks=None, forced=None,
             stop_ids=None, top_k: int | None = None, voters=None,
             rerank: int | None = None, neighbors: int | None = None) -> Answer:
    """Retrieves (unless `blocks` is given; `voters` as in `probe`, `rerank` and
    `neighbors` override the config's), splices and answers the tail."""
    t0 = time.perf_counter()
    seq = self.alloc.new_sequence()
    try:
      pre = self.prefill_into(seq, mem, tail_ids, max_tokens, blocks=blocks, top_k=top_k,
                              voters=voters, rerank=rerank, neighbors=neighbors)
      ttft = time.perf_counter() - t0
      n, shift = pre.n, pre.shift
      w = plan_lib.width(n + max_tokens)
      self.kv.extend(seq, max_tokens, owner=_OWNER)
      smap = plan_lib.slot_rows([self.alloc.slot_map(seq)], w)
      toks, lp = continue_one(self.driver, pre.logits, n, smap, max_tokens, forced=forced,
                              stop_ids=stop_ids,
                              key_shift=None if shift is None else _pad(shift[:w], w)[None])
      kv_len = self.kv_len(seq, n) + len(toks)
    finally:
      self.alloc.free_sequence(seq)
    return Answer(toks, lp, pre.logits, pre.blocks, n - pre.start, pre.probe_tokens, kv_len,
                  ttft, time.perf_counter() - t0)

  def kv_len(self, seq: int, n: int) -> int:
    """Live KV entries among the first n positions of `seq` (what its prompt attends to)."""
    return int(np.sum(self.alloc.slot_map(seq)[:n] != SENTINEL))

  def prefill_into(self, seq: int, mem: Memory, tail_ids, max_tokens: int, *, blocks=None,
                   top_k: int | None = None, voters=None, rerank: int | None = None,
                   neighbors: int | None = None, owner: str = _OWNER) -> TailPrefill:
    """Lays out the empty sequence `seq` as the held head, the retrieved blocks
    (aliased, no copy) and the tail, and prefills the tail over them with the key
    shift that moves the blocks' keys to their new positions: what `answer` runs
    before decoding, and the engine's `MemArt` mechanism on its row (`owner`: whose
    allocation the tail's slots are, for the KV manager's reservations)."""
    return self.run_steps(self.prefill_into_steps(
        seq, mem, tail_ids, max_tokens, blocks=blocks, top_k=top_k, voters=voters,
        rerank=rerank, neighbors=neighbors, owner=owner))

  def prefill_into_steps(self, seq: int, mem: Memory, tail_ids, max_tokens: int, *,
                         blocks=None, top_k: int | None = None, voters=None,
                         rerank: int | None = None, neighbors: int | None = None,
                         owner: str = _OWNER):
    """`prefill_into` as a generator of prefill work (the probe's, then the tail's)."""
    tail = np.asarray(tail_ids, np.int32)
    probe = 0
    if blocks is None:
      probe = tail.size if self.needs_probe(mem, top_k) else 0
      blocks = yield from self.retrieve_steps(mem, tail, top_k, voters, rerank, neighbors)
    blocks = np.asarray(blocks, np.int32)
    h = self.head.size
    ok = mem.slots[blocks] != SENTINEL                     # partly filled blocks: packed
    spliced, written = mem.slots[blocks][ok], mem.positions[blocks][ok]
    start = h + spliced.size
    if start + tail.size + max_tokens > self.max_len:
      raise ValueError(f"{blocks.size} blocks + {tail.size} tail tokens + {max_tokens} exceed "
                       f"max_seq_len {self.max_len}")
    mem.hits[blocks] += 1
    self._adopt_head(seq)
    self.alloc.adopt(seq, spliced)                          # aliases: refcounts, no copy
    new_pos = h + np.arange(spliced.size, dtype=np.int32)
    shift = np.r_[np.zeros(h, np.int32), new_pos - written,
                  np.zeros(tail.size + max_tokens, np.int32)].astype(np.int32)
    if not shift.any():             # nothing moved (full context): the kernels' path
      shift = None
    _, logits, _, _ = yield from self._prefill_steps(seq, tail, start, key_shift=shift,
                                                     owner=owner)
    return TailPrefill(logits, blocks, probe, start, start + tail.size, shift)

  def close(self) -> None:
    """Gives the head back (memories must be `forget`-ed by their owners)."""
    self.alloc.release(self.head_slots)


_MARK = "\x00MEMORY\x00"


class MemArtSessions:
  """Chat sessions whose history lives in MemArt memory (serve.py mode=memart).

  A request is a session id and its OpenAI-style messages: every message before
  the last is history, the last must be the user's. History the session's
  memory has not seen yet is written as one span ("role: content" lines) before
  the question is answered from retrieved blocks, so only the question is
  prefilled. A rerun that skips answered requests catches up on their history
  at the session's next request. A history that no longer extends what was
  written (an edited earlier message) is refused.
  """

  def __init__(self, llm, cfg: MemArtConfig, cache: CacheConfig, *, system_prompt: str = "",
               attn_impl: str = "auto", kv: KVManager | None = None):
    self.tok = llm.tokenizer
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": _MARK}]
    head, self.tail_text = self.tok.render_chat(msgs, add_generation_prompt=True).split(_MARK)
    self.runner = MemArtRunner(llm, cfg, self.encode(head), cache=cache, attn_impl=attn_impl,
                               kv=kv)
    self.sessions: dict[str, tuple[Memory, list[str]]] = {}

  def encode(self, text: str, literal: bool = False) -> np.ndarray:
    """Ids of template text, or of message text (`literal`: special tokens stay text)."""
    enc = literal_backend(self.tok).encode(text, add_special_tokens=False).ids if literal else (
        self.tok.encode(text, add_bos=False))
    return np.asarray(enc, np.int32)

  def ask(self, session: str, messages: list[dict], max_tokens: int) -> tuple[Answer, dict]:
    """Writes the unseen history, answers the last (user) message; returns the
    answer and what happened (memory blocks, blocks written)."""
    mem, tail, voters, info = self.prepare(session, messages)
    ans = self.runner.answer(mem, tail, max_tokens, stop_ids=self.tok.stop_ids, voters=voters)
    return ans, info

  def check(self, session: str, messages: list[dict]) -> list[str]:
    """The request's history lines; raises ValueError for messages this session cannot
    take (not ending with a user message, non-text content, an edited history)."""
    last = messages[-1] if messages else None
    if not last or last.get("role") != "user" or not isinstance(last.get("content"), str):
      raise ValueError("memart mode needs messages ending with a user message (text content)")
    lines = []
    for m in messages[:-1]:
      if not isinstance(m.get("content"), str):
        raise ValueError("memart mode keeps text history: every message needs string content")
      lines.append(f"{m['role']}: {m['content']}")
    seen = self.sessions[session][1] if session in self.sessions else []
    if lines[:len(seen)] != seen:
      raise ValueError(f"session {session!r}: the history no longer extends what its memory "
                       "holds (an earlier message changed, and memory is only ever added "
                       "to); resend the history unchanged with new messages after it, or "
                       "start a new session (another \"user\")")
    return lines

  def tail(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(the tokens an answer prefills: the last message and the template after it,
    which of them vote in retrieval: the message's)."""
    q = self.encode(messages[-1]["content"], literal=True)
    tail = np.r_[q, self.encode("\n" + self.tail_text)].astype(np.int32)
    return tail, np.arange(tail.size) < q.size

  def prepare(self, session: str, messages: list[dict]) -> tuple[Memory, np.ndarray,
                                                                 np.ndarray, dict]:
    """Writes the history the session's memory has not seen; returns (its memory, the
    tail to answer: the question and the template after it, the tail tokens whose
    queries vote in retrieval, what happened: memory blocks, blocks written, bytes)."""
    return self.runner.run_steps(self.prepare_steps(session, messages))

  def prepare_steps(self, session: str, messages: list[dict]):
    """`prepare` as a generator of prefill work (the history's write)."""
    lines = self.check(session, messages)
    mem, seen = self.sessions.get(session) or (self.runner.new_memory(), [])
    new = lines[len(seen):]
    written = written_tokens = 0
    if new:
      span = self.encode("\n".join(new) + "\n", literal=True)
      written = (yield from self.runner.write_steps(mem, span, tag=len(seen))).size
      written_tokens = span.size
      seen = seen + new
    self.sessions[session] = (mem, seen)
    tail, voters = self.tail(messages)
    return mem, tail, voters, dict(memory_blocks=mem.num_blocks, blocks_written=int(written),
                                   written_tokens=int(written_tokens), memory_bytes=mem.nbytes)

  def close(self, session: str) -> None:
    """Frees a session's memory."""
    mem, _ = self.sessions.pop(session)
    self.runner.forget(mem)


def _pad(x, n: int, value=0) -> np.ndarray:
  x = np.asarray(x)
  return np.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)
