"""Tests for the host-side paged slot allocator (jaxkv/kv/allocator.py)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.kv.allocator import SENTINEL, OutOfSlotsError, PagedAllocator


def _snapshot(a: PagedAllocator):
  """Everything observable through the public API."""
  return (
      tuple((s, tuple(a.slot_map(s).tolist())) for s in a.sequences()),
      tuple(a.refcount(i) for i in range(a.num_slots)),
      tuple(a.holds(i) for i in range(a.num_slots)),
      tuple(a.free_pages().tolist()),
      a.num_live_slots,
  )


# ------------------------------------------------------------------ units
def test_constructor_validates():
  for bad in [(1, 4), (0, 4), (4, 0), (4, -1)]:
    with pytest.raises(ValueError):
      PagedAllocator(*bad)
  with pytest.raises(TypeError):
    PagedAllocator(4.0, 4)
  a = PagedAllocator(5, 4)
  assert (a.num_pages, a.page_size, a.num_slots) == (5, 4, 20)
  assert (a.num_free_pages, a.num_used_pages, a.num_live_slots) == (4, 0, 0)
  a.check()


def test_sentinel_page_never_handed_out():
  a = PagedAllocator(4, 4)
  s = a.new_sequence()
  slots = a.extend(s, 12)
  assert slots.dtype == np.int32
  assert slots.tolist() == list(range(4, 16))
  assert a.num_free_pages == 0
  with pytest.raises(OutOfSlotsError):
    a.extend(s, 1)
  assert all(a.refcount(i) == 0 for i in range(4))
  assert a.free_sequence(s).tolist() == list(range(4, 16))
  assert 0 not in a.free_pages().tolist()
  assert a.num_free_pages == 3
  a.check()


def test_extend_fills_tail_page_first():
  a = PagedAllocator(8, 4)
  s = a.new_sequence()
  assert a.extend(s, 3).tolist() == [4, 5, 6]
  assert a.extend(s, 2).tolist() == [7, 8]
  assert a.num_used_pages == 2
  assert a.slot_map(s).tolist() == [4, 5, 6, 7, 8]
  assert a.length(s) == 5
  assert a.extend(s, 0).tolist() == []
  a.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_sizes(page_size):
  a = PagedAllocator(4, page_size)
  s, t = a.new_sequence(), a.new_sequence()
  x = a.extend(s, page_size + 1)
  y = a.extend(t, 1)
  assert a.num_used_pages == 3
  assert len(set(x.tolist()) | set(y.tolist())) == page_size + 2
  assert min(x.min(), y.min()) >= page_size
  a.check()
  a.free_sequence(s)
  a.free_sequence(t)
  assert a.num_free_pages == 3 and a.num_live_slots == 0
  a.check()


def test_out_of_slots_leaves_state_unchanged():
  a = PagedAllocator(3, 4)
  s = a.new_sequence()
  a.extend(s, 3)
  before = _snapshot(a)
  with pytest.raises(OutOfSlotsError) as e:
    a.extend(s, 6)   # 1 left in the tail page + 4 in the free page
  msg = str(e.value)
  assert "6" in msg and "5 are free" in msg and "cache.num_pages" in msg
  assert (e.value.requested, e.value.available) == (6, 5)
  assert isinstance(e.value, RuntimeError)
  assert _snapshot(a) == before
  a.check()
  assert a.extend(s, 5).tolist() == [7, 8, 9, 10, 11]   # exactly what was free
  a.check()


def test_release_and_retain_validation():
  a = PagedAllocator(4, 2)
  s = a.new_sequence()
  x = a.extend(s, 2)
  with pytest.raises(ValueError):
    a.retain([SENTINEL])
  with pytest.raises(ValueError):
    a.release([SENTINEL])
  with pytest.raises(ValueError):
    a.retain([6])                 # never allocated
  with pytest.raises(ValueError):
    a.retain([1])                 # the sentinel page
  with pytest.raises(ValueError):
    a.retain([a.num_slots])       # out of range
  with pytest.raises(ValueError):
    a.release([int(x[0])])        # held by a slot map only, not externally
  a.retain(x)
  assert a.refcount(int(x[0])) == 2 and a.holds(int(x[0])) == 1
  a.free_sequence(s)
  assert a.num_used_pages == 1    # the hold keeps the page
  assert sorted(a.release(x).tolist()) == x.tolist()
  assert a.num_free_pages == 3
  with pytest.raises(ValueError, match="double free"):
    a.release(x[:1])
  a.check()


def test_evict_shared_slot_after_fork():
  a = PagedAllocator(4, 4)
  p = a.new_sequence()
  a.extend(p, 3)                  # slots 4, 5, 6
  c = a.fork(p)
  assert a.slot_map(c).tolist() == [4, 5, 6]
  assert a.evict(p, [1]).tolist() == []           # still in the child
  assert a.slot_map(p).tolist() == [4, SENTINEL, 6]
  assert a.refcount(5) == 1
  assert a.evict(p, [1]).tolist() == []           # already SENTINEL: ignored
  assert a.evict(c, [1]).tolist() == [5]          # the last reference
  assert a.refcount(5) == 0
  assert a.length(p) == 3                         # positions never shift
  a.check()


def test_evict_retained_slot():
  a = PagedAllocator(4, 4)
  s = a.new_sequence()
  x = a.extend(s, 4)
  a.retain(x[:2])
  assert a.evict(s, [0, 1, 2]).tolist() == [6]
  assert a.release(x[:2]).tolist() == [4, 5]
  assert a.num_used_pages == 1                    # slot 7 is still live
  assert a.evict(s, [3]).tolist() == [7]
  assert a.num_free_pages == 3
  a.check()


def test_free_sequence_after_fork_keeps_child():
  a = PagedAllocator(4, 4)
  p = a.new_sequence()
  a.extend(p, 6)
  c = a.fork(p)
  assert a.free_sequence(p).tolist() == []
  assert a.slot_map(c).tolist() == [4, 5, 6, 7, 8, 9]
  assert all(a.refcount(i) == 1 for i in range(4, 10))
  a.check()
  with pytest.raises(KeyError, match="unknown sequence"):
    a.slot_map(p)
  assert a.free_sequence(c).tolist() == [4, 5, 6, 7, 8, 9]
  assert a.num_free_pages == 3 and a.sequences() == []
  a.check()


def test_fork_child_takes_fresh_pages():
  a = PagedAllocator(4, 4)
  p = a.new_sequence()
  a.extend(p, 2)                                  # page 1, slots 4 and 5
  c = a.fork(p)
  assert a.extend(c, 1).tolist() == [8]           # page 2, not the parent's tail
  assert a.extend(p, 1).tolist() == [6]           # the parent still fills its tail
  a.check()


def test_adopt_shares_slots():
  a = PagedAllocator(4, 4)
  s, t = a.new_sequence(), a.new_sequence()
  x = a.extend(s, 3)
  a.adopt(t, [int(x[0]), SENTINEL, int(x[2])])
  assert a.slot_map(t).tolist() == [4, SENTINEL, 6]
  assert [a.refcount(i) for i in (4, 5, 6)] == [2, 1, 2]
  with pytest.raises(ValueError):
    a.adopt(t, [7])                               # allocated by nobody
  assert a.length(t) == 3
  assert a.free_sequence(s).tolist() == [5]
  assert a.free_sequence(t).tolist() == [4, 6]
  assert a.num_free_pages == 3
  a.check()


def test_truncate_returns_unused_tail():
  a = PagedAllocator(4, 4)
  s = a.new_sequence()
  a.extend(s, 6)                                  # 4..7, 8, 9
  assert a.truncate(s, 3).tolist() == [7, 8, 9]
  assert a.num_used_pages == 2                    # page 2 stays s's (empty) tail
  assert a.extend(s, 2).tolist() == [8, 9]        # refilled from the tail
  assert a.truncate(s, 5).tolist() == []
  with pytest.raises(ValueError):
    a.truncate(s, 6)
  a.check()


def test_input_validation():
  a = PagedAllocator(4, 4)
  s = a.new_sequence()
  a.extend(s, 2)
  with pytest.raises(KeyError):
    a.extend(99, 1)
  with pytest.raises(ValueError):
    a.extend(s, -1)
  with pytest.raises(TypeError):
    a.extend(s, 1.5)
  with pytest.raises(IndexError):
    a.evict(s, [2])
  with pytest.raises(IndexError):
    a.evict(s, [-1])
  with pytest.raises(TypeError):
    a.evict(s, [0.0])
  with pytest.raises(ValueError):
    a.refcount(a.num_slots)
  assert a.refcount(SENTINEL) == 0
  a.check()


def test_check_detects_corruption():
  a = PagedAllocator(4, 4)
  s = a.new_sequence()
  a.extend(s, 2)
  a._ref[4] += 1
  with pytest.raises(AssertionError, match="refcount mismatch"):
    a.check()
  a._ref[4] -= 1
  a._free[0].append(a._free[0][0])
  with pytest.raises(AssertionError, match="duplicate"):
    a.check()
  a._free[0].pop()
  a._free[0].append(0)
  with pytest.raises(AssertionError):
    a.check()


def test_shards_keep_each_sequence_in_its_page_range():
  """shards=4 over 16 pages: each shard's first page is reserved (never handed out,
  never referenced), a sequence's fresh pages come from its own shard only, a full
  shard refuses even while others have room, and freed pages go back to their shard."""
  a = PagedAllocator(16, 4, shards=4)
  assert a.num_free_pages == 12 and a.num_used_pages == 0
  assert all(p % 4 for p in a.free_pages())                     # pages 0, 4, 8, 12 reserved
  seqs = {d: a.new_sequence(shard=d) for d in range(4)}
  for d, s in seqs.items():
    slots = a.extend(s, 9)                                      # 3 pages: the whole shard
    assert set(a.shard_of(slots)) == {d} and not np.any(slots % 16 < 4)
    assert a.shard_free_pages(d) == 0
  with pytest.raises(OutOfSlotsError, match="in shard 1"):
    a.extend(seqs[1], 4)
  child = a.fork(seqs[2])
  a.free_sequence(seqs[2])
  a.free_sequence(child)
  assert a.shard_free_pages(2) == 3 and a.num_free_pages == 3
  b = a.new_sequence(shard=2)
  a.adopt(b, a.slot_map(seqs[0])[:2])                            # adopting across shards is fine
  assert set(a.shard_of(a.extend(b, 5))) == {2}
  a.check()
  with pytest.raises(ValueError, match="multiple of shards"):
    PagedAllocator(10, 4, shards=4)
  with pytest.raises(ValueError, match="shard 4 of 4"):
    a.new_sequence(shard=4)


# ---------------------------------------------------------- state machine
_PICK = st.integers(0, 10**6)


class AllocatorMachine(RuleBasedStateMachine):
  """Random operation sequences checked against a pure-Python refcount model."""

  @initialize(num_pages=st.integers(2, 8), page_size=st.sampled_from([1, 2, 4, 16]))
  def setup(self, num_pages, page_size):
    self.a = PagedAllocator(num_pages, page_size)
    self.ps = page_size
    self.maps: dict[int, list[int]] = {}      # seq -> slot map
    self.held: collections.Counter = collections.Counter()
    self.recipient: dict[int, int] = {}       # page -> seq it last extended

  # ---- model
  def model_ref(self) -> collections.Counter:
    ref = collections.Counter(self.held)
    for m in self.maps.values():
      ref.update(s for s in m if s != SENTINEL)
    return ref

  def live_slots(self) -> list[int]:
    return sorted(s for s, c in self.model_ref().items() if c > 0)

  def seq(self, i: int) -> int:
    seqs = sorted(self.maps)
    return seqs[i % len(seqs)]

  def freed_by(self, op) -> list[int]:
    """Runs op; returns the slots the model says reached refcount 0."""
    before = self.model_ref()
    out = op()
    after = self.model_ref()
    expected = sorted(s for s, c in before.items() if c > 0 and after[s] == 0)
    assert out.dtype == np.int32
    assert sorted(out.tolist()) == expected, (out, expected)
    assert SENTINEL not in out.tolist()
    return expected

  # ---- rules
  @precondition(lambda self: len(self.maps) < 6)
  @rule()
  def new_sequence(self):
    s = self.a.new_sequence()
    assert s not in self.maps
    self.maps[s] = []

  @precondition(lambda self: self.maps)
  @rule(i=_PICK, n=st.integers(0, 24))
  def extend(self, i, n):
    s = self.seq(i)
    ref = self.model_ref()
    free_before = set(self.a.free_pages().tolist())
    snap = _snapshot(self.a)
    try:
      got = self.a.extend(s, n)
    except OutOfSlotsError:
      assert n > len(free_before) * self.ps       # never a spurious failure
      assert _snapshot(self.a) == snap            # all-or-nothing
      return
    got = got.tolist()
    assert len(got) == n == len(set(got))
    for slot in got:
      assert slot >= self.ps                      # never the sentinel page
      assert ref[slot] == 0                       # not live anywhere else
      page = slot // self.ps
      # Fresh page, or this sequence's own (tail) page: never a parent's.
      assert page in free_before or self.recipient.get(page) == s, (page, s)
    for slot in got:
      self.recipient[slot // self.ps] = s
    taken = len(free_before) - self.a.num_free_pages
    full = -(-n // self.ps)
    assert full - 1 <= taken <= full              # the tail page is filled first
    self.maps[s].extend(got)
    assert self.a.slot_map(s).tolist()[-n or len(self.maps[s]):] == got

  @precondition(lambda self: self.maps and len(self.maps) < 6)
  @rule(i=_PICK)
  def fork(self, i):
    s = self.seq(i)
    c = self.a.fork(s)
    assert c not in self.maps
    self.maps[c] = list(self.maps[s])
    assert self.a.slot_map(c).tolist() == self.maps[s]

  @precondition(lambda self: self.maps)
  @rule(i=_PICK, picks=st.lists(_PICK, max_size=5), sentinel=st.booleans())
  def adopt(self, i, picks, sentinel):
    live = self.live_slots()
    slots = [live[p % len(live)] for p in picks] if live else []
    if sentinel:
      slots.insert(len(slots) // 2, SENTINEL)
    s = self.seq(i)
    self.a.adopt(s, slots)
    self.maps[s].extend(slots)

  @precondition(lambda self: self.maps)
  @rule(i=_PICK, slot=_PICK)
  def adopt_dead_slot_raises(self, i, slot):
    ref = self.model_ref()
    dead = [x for x in range(1, self.a.num_slots) if ref[x] == 0]
    if not dead:
      return
    snap = _snapshot(self.a)
    with pytest.raises(ValueError):
      self.a.adopt(self.seq(i), [dead[slot % len(dead)]])
    assert _snapshot(self.a) == snap

  @rule(picks=st.lists(_PICK, min_size=1, max_size=4))
  def retain(self, picks):
    live = self.live_slots()
    if not live:
      return
    slots = [live[p % len(live)] for p in picks]
    self.a.retain(slots)
    self.held.update(slots)

  @rule(picks=st.lists(_PICK, min_size=1, max_size=4))
  def release(self, picks):
    pool = sorted(self.held.elements())
    if not pool:
      return
    chosen = sorted({p % len(pool) for p in picks})
    slots = [pool[k] for k in chosen]

    def op():
      self.held.subtract(slots)
      self.held += collections.Counter()       # drop zero counts
      return self.a.release(slots)
    self.freed_by(op)

  @rule(slot=_PICK)
  def release_unheld_raises(self, slot):
    unheld = [x for x in range(self.a.num_slots) if self.held[x] == 0]
    snap = _snapshot(self.a)
    with pytest.raises(ValueError):
      self.a.release([unheld[slot % len(unheld)]])   # SENTINEL is always unheld
    assert _snapshot(self.a) == snap

  @precondition(lambda self: self.maps)
  @rule(i=_PICK, picks=st.lists(_PICK, max_size=6))
  def evict(self, i, picks):
    s = self.seq(i)
    m = self.maps[s]
    positions = [p % len(m) for p in picks] if m else []

    def op():
      for p in positions:
        m[p] = SENTINEL
      return self.a.evict(s, positions)
    self.freed_by(op)

  @precondition(lambda self: self.maps)
  @rule(i=_PICK, extra=st.integers(0, 3))
  def evict_out_of_range_raises(self, i, extra):
    s = self.seq(i)
    snap = _snapshot(self.a)
    with pytest.raises(IndexError):
      self.a.evict(s, [len(self.maps[s]) + extra])
    assert _snapshot(self.a) == snap

  @precondition(lambda self: self.maps)
  @rule(i=_PICK, cut=_PICK)
  def truncate(self, i, cut):
    s = self.seq(i)
    m = self.maps[s]
    length = cut % (len(m) + 1)

    def op():
      del m[length:]
      return self.a.truncate(s, length)
    self.freed_by(op)

  @precondition(lambda self: self.maps)
  @rule(i=_PICK)
  def free_sequence(self, i):
    s = self.seq(i)
    self.freed_by(lambda: (self.maps.pop(s), self.a.free_sequence(s))[1])
    with pytest.raises(KeyError):
      self.a.length(s)

  # ---- invariants
  @invariant()
  def consistent(self):
    a = self.a
    a.check()
    ref = self.model_ref()
    assert a.sequences() == sorted(self.maps)
    for s, m in self.maps.items():
      got = a.slot_map(s)
      assert got.dtype == np.int32 and got.tolist() == m
    for x in range(a.num_slots):
      assert a.refcount(x) == ref[x], (x, a.refcount(x), ref[x])
      assert a.holds(x) == self.held[x]
    assert a.refcount(SENTINEL) == 0
    live = [x for x in range(a.num_slots) if ref[x] > 0]
    assert a.num_live_slots == len(live)
    assert all(x >= self.ps for x in live)        # sentinel page never allocated
    free = a.free_pages().tolist()
    assert len(free) == len(set(free)) == a.num_free_pages
    for p in free:
      assert p != 0
      # A free page holds no live (in particular no aliased) slot.
      assert all(ref[x] == 0 for x in range(p * self.ps, (p + 1) * self.ps)), p
    live_pages = {x // self.ps for x in live}
    idle = set(range(1, a.num_pages)) - set(free) - live_pages
    assert len(idle) <= len(self.maps), idle      # at most one open tail per sequence
    if not self.maps and not self.held:
      assert a.num_free_pages == a.num_pages - 1  # nothing leaked

  def teardown(self):
    if not hasattr(self, "a"):
      return
    for s in list(self.maps):
      self.a.free_sequence(s)
    if self.held:
      self.a.release(list(self.held.elements()))
    self.a.check()
    assert self.a.num_free_pages == self.a.num_pages - 1
    assert self.a.num_live_slots == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
