"""The radix prefix cache (jaxkv/kv/radix.py) as a hypothesis state machine:
sequences, prefix cache and pruning against a model of slot contents."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.kv.allocator import OutOfSlotsError, PagedAllocator
from jaxkv.kv.radix import RadixCache
from jaxkv.kv.state import SENTINEL
from radix_util import cached_entries, free_slot_set

# ---------------------------------------------------------- state machine
_PICK = st.integers(0, 10**6)
_TOKENS = st.lists(st.integers(0, 1), max_size=6)


class RadixMachine(RuleBasedStateMachine):
  """Sequences, prefix cache and pruning against a model of slot contents.

  `content[slot]` is the token prefix whose last token's KV the slot holds and
  whether it was computed without a pruned position before it. Every cached
  slot must hold exactly its prefix's exact KV, every slot-map entry its own
  token's, and no referenced slot may sit in a free page.
  """

  @initialize(num_pages=st.integers(3, 16), page_size=st.sampled_from([1, 2, 4]),
              capacity=st.one_of(st.none(), st.integers(0, 24)))
  def setup(self, num_pages, page_size, capacity):
    self.a = PagedAllocator(num_pages, page_size)
    self.c = RadixCache(self.a, capacity_tokens=capacity)
    self.capacity = capacity
    self.toks: dict[int, list[int]] = {}       # seq -> token at each position
    self.content: dict[int, tuple[tuple, bool]] = {}
    self.locks: list[tuple] = []               # (handle, locked token prefix)
    self.queries = 0

  def seq(self, i: int) -> int:
    seqs = sorted(self.toks)
    return seqs[i % len(seqs)]

  def grow(self, s: int, new: list[int]) -> bool:
    """Appends tokens to s, evicting from the cache if the pool is full."""
    if not new:
      return True
    try:
      slots = self.a.extend(s, len(new))
    except OutOfSlotsError as e:
      self.c.evict(e.requested - e.available)
      try:
        slots = self.a.extend(s, len(new))
      except OutOfSlotsError:
        return False
    exact = SENTINEL not in self.a.slot_map(s)[:len(self.toks[s])].tolist()
    for slot, tok in zip(slots.tolist(), new):
      self.toks[s].append(tok)
      self.content[slot] = (tuple(self.toks[s]), exact)
    return True

  def expected_match(self, tokens) -> int:
    entries = cached_entries(self.c)
    n = 0
    while n < len(tokens) and tuple(tokens[:n + 1]) in entries:
      n += 1
    return n

  # ---- rules
  @precondition(lambda self: len(self.toks) < 6)
  @rule(prompt=_TOKENS, use_cache=st.booleans(), keep_last=st.booleans())
  def new_request(self, prompt, use_cache, keep_last):
    self.request(prompt, use_cache, keep_last)

  def request(self, prompt, use_cache, keep_last) -> int | None:
    """Starts a sequence for prompt; returns its id (None: the pool is full)."""
    s = self.a.new_sequence()
    self.toks[s] = []
    n = 0
    if use_cache:
      key = prompt if keep_last else prompt[:-1]
      n = self.expected_match(key)
      assert self.c.adopt_prefix(s, key) == n
      self.queries += 1
      self.toks[s] = list(prompt[:n])
      for p, slot in enumerate(self.a.slot_map(s).tolist()):
        assert self.content[slot] == (tuple(prompt[:p + 1]), True)
    if not self.grow(s, list(prompt[n:])):
      self.a.free_sequence(s)
      del self.toks[s]
      return None
    return s

  @precondition(lambda self: self.toks and len(self.toks) < 6)
  @rule(i=_PICK, extra=_TOKENS, finish=st.booleans())
  def next_turn(self, i, extra, finish):
    """An agent turn: cache the previous turn, then adopt it for the next one."""
    s = self.seq(i)
    toks = self.toks[s]
    self.c.insert(toks, self.a.slot_map(s))
    if finish:
      self.free_sequence(i)
    self.request(toks + extra, use_cache=True, keep_last=False)

  @precondition(lambda self: self.toks and len(self.toks) < 6)
  @rule(i=_PICK, cut=_PICK, extra=_TOKENS)
  def branch(self, i, cut, extra):
    """A request diverging from a cached sequence inside it (edge splits)."""
    s = self.seq(i)
    toks = self.toks[s]
    self.c.insert(toks, self.a.slot_map(s))
    cut = cut % (len(toks) + 1)
    prompt = toks[:cut] + [1 - toks[cut] if cut < len(toks) else 0] + extra
    new = self.request(prompt, use_cache=True, keep_last=True)
    if new is not None:
      self.c.insert(prompt, self.a.slot_map(new))

  @precondition(lambda self: self.toks)
  @rule(i=_PICK, new=_TOKENS)
  def extend(self, i, new):
    self.grow(self.seq(i), new)

  @precondition(lambda self: self.toks)
  @rule(i=_PICK, cut=st.one_of(st.none(), _PICK))
  def insert(self, i, cut):
    s = self.seq(i)
    n = len(self.toks[s]) if cut is None else cut % (len(self.toks[s]) + 1)
    toks, slots = self.toks[s][:n], self.a.slot_map(s)[:n].tolist()
    end = slots.index(SENTINEL) if SENTINEL in slots else n
    before = cached_entries(self.c)
    fresh = {tuple(toks[:p + 1]): slots[p] for p in range(end)
             if tuple(toks[:p + 1]) not in before}
    added = self.c.insert(toks, slots)
    after = cached_entries(self.c)
    if self.capacity is None:
      assert added == len(fresh)
      assert after == {**before, **fresh}
    else:
      assert added == len(after.keys() & fresh.keys())
      assert all(before.get(k, fresh.get(k)) == v for k, v in after.items())

  @precondition(lambda self: self.toks)
  @rule(i=_PICK, cut=_PICK)
  def lock(self, i, cut):
    s = self.seq(i)
    toks = self.toks[s][:cut % (len(self.toks[s]) + 1)]
    n = self.expected_match(toks)
    m = self.c.match_prefix(toks, lock=True)
    self.queries += 1
    entries = cached_entries(self.c)
    assert m.n_matched == n
    assert m.slots.tolist() == [entries[tuple(toks[:p + 1])] for p in range(n)]
    self.locks.append((m.handle, tuple(toks[:n])))

  @precondition(lambda self: self.locks)
  @rule(k=_PICK)
  def unlock(self, k):
    handle, _ = self.locks.pop(k % len(self.locks))
    self.c.release_lock(handle)

  @rule(n=st.integers(0, 20))
  def cache_evict(self, n):
    before = cached_entries(self.c)
    got = self.c.evict(n)
    after = cached_entries(self.c)
    assert after.items() <= before.items()
    assert len(before) - len(after) == got
    assert got >= n or self.c.evictable_tokens == 0

  @precondition(lambda self: self.toks)
  @rule(i=_PICK, picks=st.lists(_PICK, max_size=4))
  def prune(self, i, picks):
    s = self.seq(i)
    m = self.toks[s]
    self.a.evict(s, [p % len(m) for p in picks] if m else [])

  @precondition(lambda self: self.toks)
  @rule(i=_PICK, cut=_PICK)
  def truncate(self, i, cut):
    s = self.seq(i)
    n = cut % (len(self.toks[s]) + 1)
    self.a.truncate(s, n)
    del self.toks[s][n:]

  @precondition(lambda self: self.toks)
  @rule(i=_PICK)
  def free_sequence(self, i):
    s = self.seq(i)
    self.a.free_sequence(s)
    del self.toks[s]

  # ---- invariants
  @invariant()
  def consistent(self):
    a, c = self.a, self.c
    a.check()
    c.check()
    entries = cached_entries(c)
    assert c.num_cached_tokens == len(entries)
    if self.capacity is not None:
      assert len(entries) <= self.capacity
    cached = set(entries.values())
    for prefix, slot in entries.items():
      assert self.content[slot] == (prefix, True), (prefix, slot, self.content[slot])
    for slot in range(a.num_slots):
      assert a.holds(slot) == (slot in cached)
    mapped = set()
    for s, toks in self.toks.items():
      m = a.slot_map(s).tolist()
      assert len(m) == len(toks)
      for p, slot in enumerate(m):
        if slot != SENTINEL:
          assert self.content[slot][0] == tuple(toks[:p + 1])
          mapped.add(slot)
    assert not (cached | mapped) & free_slot_set(a)
    for _, prefix in self.locks:
      assert all(prefix[:p + 1] in entries for p in range(len(prefix)))
    assert c.stats.queries == self.queries

  def teardown(self):
    if not hasattr(self, "a"):
      return
    for handle, _ in self.locks:
      self.c.release_lock(handle)
    self.c.clear()
    for s in list(self.toks):
      self.a.free_sequence(s)
    self.c.check()
    self.a.check()
    assert self.c.num_cached_tokens == self.c.num_nodes == 0
    assert self.a.num_free_pages == self.a.num_pages - 1


RadixMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None)
TestRadixMachine = RadixMachine.TestCase
