"""Tests for the radix prefix cache (jaxkv/kv/radix.py): units; the stateful property
test against a model of slot contents is tests/test_radix_machine.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.kv.allocator import PagedAllocator
from jaxkv.kv.radix import PrefixMatch, RadixCache, RadixStats
from jaxkv.kv.state import SENTINEL
from radix_util import free_slot_set, new_seq


# ------------------------------------------------------------------ units
def test_insert_match_and_edge_splits():
  a = PagedAllocator(8, 4)
  s, x = new_seq(a, 6)
  c = RadixCache(a)
  assert c.insert([1, 2, 3, 4], x[:4]) == 4
  assert (c.num_nodes, c.num_cached_tokens) == (1, 4)
  n, slots = c.match_prefix([1, 2, 3, 9])
  assert n == 3 and slots.tolist() == x[:3].tolist() and slots.dtype == np.int32
  assert c.match_prefix([7, 1]).n_matched == 0
  assert c.match_prefix([]).slots.tolist() == []
  # [1, 2, 5, 6] diverges inside the edge [1, 2, 3, 4]: split into [1, 2] + {[3, 4], [5, 6]}.
  t, y = new_seq(a, 2)
  assert c.insert([1, 2, 5, 6], [x[0], x[1], y[0], y[1]]) == 2
  assert (c.num_nodes, c.num_cached_tokens) == (3, 6)
  assert c.match_prefix([1, 2, 5, 6, 7]).slots.tolist() == [x[0], x[1], y[0], y[1]]
  assert c.match_prefix([1, 2, 3, 4]).slots.tolist() == x[:4].tolist()
  assert c.match_prefix([1, 2]).n_matched == 2
  # Extending a leaf adds a child; inserting a cached prefix adds nothing.
  assert c.insert([1, 2, 3, 4, 8], x[:5]) == 1
  assert c.insert([1, 2], x[:2]) == 0
  assert c.num_nodes == 4
  assert sorted(tuple(p.tolist()) for p, _ in c.paths()) == [(1, 2, 3, 4, 8), (1, 2, 5, 6)]
  for slot in x[:5].tolist() + y.tolist():
    assert a.holds(slot) == 1
  assert a.holds(int(x[5])) == 0
  c.check()
  a.check()


def test_cached_slots_win_over_callers():
  a = PagedAllocator(8, 4)
  _, x = new_seq(a, 3)
  _, y = new_seq(a, 3)
  c = RadixCache(a)
  c.insert([1, 2], x[:2])
  assert c.insert([1, 2, 3], y) == 1        # only the new token is held
  assert c.match_prefix([1, 2, 3]).slots.tolist() == [x[0], x[1], y[2]]
  assert [a.holds(int(v)) for v in y] == [0, 0, 1]
  with pytest.raises(ValueError, match="already cached"):
    c.insert([5, 6], [y[2], y[1]])          # y[2] belongs to another prefix
  with pytest.raises(ValueError, match="twice"):
    c.insert([5, 6], [y[1], y[1]])
  with pytest.raises(ValueError, match="not live"):
    c.insert([5], [a.num_slots - 1])
  with pytest.raises(ValueError, match="2 tokens but 1"):
    c.insert([5, 6], [y[1]])
  with pytest.raises(ValueError):
    c.insert([[5]], [[y[1]]])
  with pytest.raises(TypeError):
    c.insert([5.0], [y[1]])
  assert [a.holds(int(v)) for v in y] == [0, 0, 1]   # failed inserts changed nothing
  assert c.num_cached_tokens == 3
  c.check()
  a.check()


def test_hit_statistics():
  a = PagedAllocator(8, 4)
  _, x = new_seq(a, 4)
  c = RadixCache(a)
  assert c.stats == RadixStats() and c.stats.hit_rate == 0.0
  c.insert([1, 2, 3, 4], x)
  c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])   # 4 of 8
  c.match_prefix([9, 9])                     # 0 of 2
  c.match_prefix([1, 2])                     # 2 of 2
  st_ = c.stats
  assert (st_.queries, st_.query_tokens, st_.hit_tokens) == (3, 12, 6)
  assert st_.hit_rate == pytest.approx(0.5)
  assert st_.inserted_tokens == 4 and st_.evicted_tokens == 0
  c.evict(10)
  assert c.stats.evicted_tokens == 4
  c.reset_stats()
  assert c.stats == RadixStats()


def test_lru_eviction_order_leaves_first():
  a = PagedAllocator(8, 4)
  _, x = new_seq(a, 12)
  c = RadixCache(a)
  c.insert([1, 1, 1], x[0:3])          # A
  c.insert([2, 2], x[3:5])             # B
  c.insert([3, 3, 3, 3], x[5:9])       # C
  c.match_prefix([1])                  # A is now the most recent: B, C, A
  assert c.evict(1) == 2               # whole node B (may overshoot)
  assert c.match_prefix([2]).n_matched == 0
  assert c.evict(4) == 4               # C
  assert [tuple(p.tolist()) for p, _ in c.paths()] == [(1, 1, 1)]
  # Leaves first: [1, 1] + {[1], [5, 5]}; the parent goes only after its children.
  c.insert([1, 1, 5, 5], [x[0], x[1], x[9], x[10]])
  c.match_prefix([1, 1, 1])            # leaf [5, 5] is older than leaf [1]
  assert c.evict(1) == 2
  assert c.match_prefix([1, 1, 5]).n_matched == 2
  assert c.evict(1) == 1               # leaf [1]; [1, 1] is a leaf only now
  assert c.num_nodes == 1
  assert c.evict(100) == 2
  assert (c.num_nodes, c.num_cached_tokens) == (0, 0)
  assert c.evict(0) == 0 and c.evict(-3) == 0
  c.check()
  a.check()


def test_locked_nodes_never_evicted():
  a = PagedAllocator(8, 4)
  _, x = new_seq(a, 8)
  c = RadixCache(a)
  c.insert([1, 2, 3], x[:3])
  c.insert([4, 5], x[3:5])
  m = c.match_prefix([1, 2, 9], lock=True)
  n, slots = m
  assert isinstance(m, PrefixMatch) and n == 2 and m.handle is not None
  assert c.locked_tokens == 3 and c.evictable_tokens == 2   # the whole node is locked
  # A split of the locked node keeps both halves locked; the handle stays valid.
  c.insert([1, 2, 7], [x[0], x[1], x[5]])
  assert c.locked_tokens == 3 and c.num_nodes == 4
  c.check()
  assert c.evict(100) == 3                 # [4, 5] and [7] only
  assert c.match_prefix([1, 2, 3]).n_matched == 3
  with pytest.raises(RuntimeError, match="outstanding"):
    c.clear()
  c.release_lock(m)
  with pytest.raises(ValueError, match="released twice"):
    c.release_lock(m.handle)
  with pytest.raises(ValueError):
    c.release_lock(c.match_prefix([1]))      # not locked
  assert c.locked_tokens == 0
  # Nested locks: the shared parent stays locked until both are released.
  h1 = c.match_prefix([1, 2, 3], lock=True).handle
  h0 = c.match_prefix([], lock=True).handle  # an empty match locks nothing
  c.insert([1, 6], [x[0], x[6]])
  h2 = c.match_prefix([1, 6], lock=True).handle
  c.release_lock(h1)
  c.release_lock(h0)
  c.check()
  assert c.evict(100) == 2                  # [2, 3] goes, [1] + [6] stay
  c.release_lock(h2)
  assert c.clear() == 2
  c.check()
  a.check()


def test_capacity_enforced_on_insert():
  a = PagedAllocator(16, 4)
  _, x = new_seq(a, 40)
  c = RadixCache(a, capacity_tokens=6)
  assert c.insert([1, 1, 1, 1], x[0:4]) == 4
  assert c.insert([2, 2, 2, 2], x[4:8]) == 4     # evicts [1, 1, 1, 1] (LRU)
  assert [tuple(p.tolist()) for p, _ in c.paths()] == [(2, 2, 2, 2)]
  assert c.stats.evicted_tokens == 4
  # Too long for the capacity: the new tail is trimmed, the prefix kept.
  assert c.insert(list(range(10, 20)), x[10:20]) == 6
  assert c.match_prefix(list(range(10, 20))).n_matched == 6
  assert [a.holds(int(v)) for v in x[10:20]] == [1] * 6 + [0] * 4
  c.check()
  # Everything else locked: only what fits is cached.
  h = c.match_prefix([10], lock=True).handle
  assert c.insert([3, 3], x[20:22]) == 0
  assert c.num_cached_tokens == 6
  c.release_lock(h)
  assert c.insert([4, 4], x[22:24]) == 2 and c.num_cached_tokens == 2
  assert RadixCache(a, capacity_tokens=0).insert([5], x[24:25]) == 0
  with pytest.raises(ValueError):
    RadixCache(a, capacity_tokens=-1)
  with pytest.raises(TypeError):
    RadixCache(a, capacity_tokens=1.5)
  c.check()
  a.check()


def test_sentinel_stops_insertion():
  a = PagedAllocator(8, 4)
  s, x = new_seq(a, 6)
  c = RadixCache(a)
  a.evict(s, [2])                           # a pruned position
  m = a.slot_map(s)
  assert m[2] == SENTINEL
  assert c.insert([1, 2, 3, 4, 5, 6], m) == 2
  assert c.match_prefix([1, 2, 3, 4, 5, 6]).n_matched == 2
  assert c.num_cached_tokens == 2
  assert c.insert([7, 8], [SENTINEL, x[3]]) == 0
  assert all(a.holds(int(v)) == 0 for v in x[2:])
  assert c.insert([], []) == 0
  c.check()
  a.check()


def test_cache_dead_keeps_holes_in_the_token_stream():
  """IntentKV dead-slot semantics: pruned positions are cached as SENTINEL holes
  (no hold), so a later turn matches the whole stream and adopts the holes."""
  a = PagedAllocator(8, 4)
  s, x = new_seq(a, 6)
  c = RadixCache(a, cache_dead=True)
  a.evict(s, [2, 4])
  m = a.slot_map(s)
  assert c.insert([1, 2, 3, 4, 5, 6], m) == 6
  holes = m == SENTINEL
  assert c.match_prefix([1, 2, 3, 4, 5, 6, 7]).n_matched == 2   # no holes named: live only
  match = c.match_prefix([1, 2, 3, 4, 5, 6, 7], holes=holes)
  assert match.n_matched == 6
  np.testing.assert_array_equal(match.slots, m)
  assert a.holds(int(x[2])) == 0 and a.holds(int(x[0])) == 1
  t = a.new_sequence()
  assert c.adopt_prefix(t, [1, 2, 3, 4, 5, 6], holes=holes) == 6
  np.testing.assert_array_equal(a.slot_map(t), m)          # the holes stay holes
  c.check()
  a.free_sequence(s)
  a.free_sequence(t)
  assert c.evict(100) == 6
  assert a.num_live_slots == 0
  c.check()
  a.check()


def test_holes_inside_an_adopted_prefix_persist_and_free_their_slots():
  """A session prunes inside the prefix it adopted: its reinsertion branches off the
  live path at the first new hole (aliasing the live slots, no copy), supersedes its
  old path, and the pruned slot is freed once no sequence maps it; a request that
  names no holes still gets the live prefix up to the branch point, exactly."""
  a = PagedAllocator(16, 4)
  s, x = new_seq(a, 8)
  c = RadixCache(a, cache_dead=True)
  toks = [1, 2, 3, 4, 5, 6, 7, 8]
  assert c.insert(toks, x) == 8                            # turn 1: all live
  t = a.new_sequence()                                     # turn 2 adopts it ...
  assert c.adopt_prefix(t, toks) == 8
  a.free_sequence(s)
  y = a.extend(t, 2)
  a.evict(t, [3, 5])                                       # ... and prunes inside it
  m2 = a.slot_map(t)
  c.insert(toks + [9, 10], m2, replaces=(toks, np.zeros(8, bool)))
  c.check()
  a.check()
  holes = m2 == SENTINEL
  assert c.match_prefix(toks + [9, 10], holes=holes).slots.tolist() == m2.tolist()
  assert c.match_prefix(toks + [9, 10]).n_matched == 3     # the live path now ends at 3
  assert a.holds(int(x[3])) == 0 and a.holds(int(x[5])) == 0   # superseded: no hold
  a.free_sequence(t)
  assert a.refcount(int(x[3])) == 0 and a.refcount(int(x[5])) == 0   # freed
  assert all(a.holds(int(v)) == 1 for v in [*x[:3], x[4], *x[6:], *y])
  u = a.new_sequence()                                     # turn 3: holes stay holes
  assert c.adopt_prefix(u, toks + [9, 10, 11], holes=holes) == 10
  np.testing.assert_array_equal(a.slot_map(u), m2)
  c.check()
  a.check()


def test_a_private_suffix_is_adopted_only_by_its_own_session():
  """Positions from `private_from` on are cached under private keys: a request that
  does not name them stops there (and caches its own KV beside them, no alias), the
  session that does adopts its path whole, holes inside the suffix included, and its
  next insert supersedes the old private path."""
  a = PagedAllocator(16, 4)
  s, x = new_seq(a, 8)
  c = RadixCache(a, cache_dead=True)
  toks = [1, 2, 3, 4, 5, 6, 7, 8]
  assert c.insert(toks, x, private_from=3) == 8
  assert c.match_prefix(toks).n_matched == 3                # shared keys end at 3
  assert c.match_prefix(toks, private_from=3).slots.tolist() == x.tolist()
  assert c.match_prefix(toks, private_from=5).n_matched == 3   # another suffix: no match
  o, z = new_seq(a, 5)                                         # another request, same tokens
  assert c.insert(toks, [*x[:3], *z]) == 5                  # its exact KV beside them
  assert c.match_prefix(toks).slots.tolist() == [*x[:3], *z]
  c.check()
  t = a.new_sequence()                                      # the session's next turn
  assert c.adopt_prefix(t, toks, private_from=3) == 8
  a.free_sequence(s)
  y = a.extend(t, 2)
  a.evict(t, [6])                                           # prunes inside its suffix
  m2 = a.slot_map(t)
  c.insert(toks + [9, 10], m2, private_from=3, replaces=(toks, None, 3))
  c.check()
  a.check()
  holes = m2 == SENTINEL
  assert c.match_prefix(toks + [9, 10], holes=holes, private_from=3).slots.tolist() == \
      m2.tolist()
  assert a.holds(int(x[6])) == 0 and a.refcount(int(x[6])) == 0   # superseded: freed
  a.free_sequence(t)
  assert all(a.holds(int(v)) == 1 for v in [*x[:6], x[7], *y])
  assert c.match_prefix(toks).slots.tolist() == [*x[:3], *z]   # the shared path stays
  c.check()
  a.check()


def test_a_shared_live_path_is_not_punched():
  """Another request extended the live path past the session's old end: the branch
  does not evict it, and that request keeps matching its live slots."""
  a = PagedAllocator(16, 4)
  s, x = new_seq(a, 6)
  c = RadixCache(a, cache_dead=True)
  c.insert([1, 2, 3, 4, 5, 6], x)
  o, z = new_seq(a, 2)
  c.insert([1, 2, 3, 4, 5, 6, 7, 7], [*x, *z])             # another request's longer path
  t = a.new_sequence()
  c.adopt_prefix(t, [1, 2, 3, 4, 5, 6])
  a.evict(t, [2])
  c.insert([1, 2, 3, 4, 5, 6], a.slot_map(t), replaces=([1, 2, 3, 4, 5, 6], None))
  assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 7]).slots.tolist() == [*x, *z]
  assert a.holds(int(x[2])) == 1                            # still cached on the live path
  with pytest.raises(ValueError, match="another prefix"):  # an alias must agree
    c.insert([1, 9, 3], [x[0], SENTINEL, x[1]])
  c.check()
  a.check()
  for seq in (s, t, o):
    a.free_sequence(seq)
  assert c.evict(100) == 12                                # live path 8 + branch 4
  assert a.num_live_slots == 0
  c.check()
  a.check()


def test_eviction_releases_only_the_cache_holds():
  a = PagedAllocator(4, 4)
  s, x = new_seq(a, 6)                         # pages 1 and 2
  c = RadixCache(a)
  c.insert([1, 2, 3, 4, 5, 6], x)
  assert c.evict(100) == 6
  assert all(a.refcount(int(v)) == 1 for v in x)   # the sequence still maps them
  assert not free_slot_set(a) & set(x.tolist())
  assert sorted(a.free_sequence(s).tolist()) == x.tolist()
  assert a.num_free_pages == 3
  # The other order: the cache keeps the slots of a freed sequence alive.
  s, x = new_seq(a, 6)
  c.insert([1, 2, 3, 4, 5, 6], x)
  assert a.free_sequence(s).tolist() == []
  assert not free_slot_set(a) & set(x.tolist())
  c.check()
  a.check()
  assert c.evict(100) == 6
  assert a.num_free_pages == 3 and a.num_live_slots == 0
  c.check()
  a.check()


def test_adopt_prefix_shares_and_never_writes_shared_slots():
  a = PagedAllocator(6, 4)
  s, x = new_seq(a, 3)                          # slots 4, 5, 6: page 1 is s's open tail
  c = RadixCache(a)
  c.insert([1, 2, 3], x)
  t = a.new_sequence()
  assert c.adopt_prefix(t, [1, 2, 3, 4]) == 3
  assert a.slot_map(t).tolist() == x.tolist()
  assert [a.refcount(int(v)) for v in x] == [3, 3, 3]   # s, the cache, t
  assert a.extend(t, 1).tolist() == [8]      # a fresh page, not s's tail slot 7
  assert a.extend(s, 1).tolist() == [7]      # s keeps filling its own tail
  with pytest.raises(ValueError, match="empty sequence"):
    c.adopt_prefix(t, [1, 2])
  u = a.new_sequence()
  assert c.adopt_prefix(u, [9]) == 0 and a.length(u) == 0
  assert c.stats.queries == 2
  # Freed sequences and cache eviction drop their own references only.
  a.free_sequence(s)
  c.evict(100)
  assert a.slot_map(t).tolist() == [4, 5, 6, 8]
  assert all(a.refcount(int(v)) == 1 for v in x)
  a.free_sequence(t)
  a.free_sequence(u)
  assert a.num_free_pages == 5
  c.check()
  a.check()


def test_check_detects_corruption():
  a = PagedAllocator(8, 4)
  _, x = new_seq(a, 4)
  c = RadixCache(a)
  c.insert([1, 2, 3], x[:3])
  c.insert([1, 5], [x[0], x[3]])
  c.check()
  c._num_tokens += 1
  with pytest.raises(AssertionError, match="counters"):
    c.check()
  c._num_tokens -= 1
  leaf = next(n for n in c._nodes() if not n.children)
  leaf.lock_ref = 1
  with pytest.raises(AssertionError, match="lock_ref"):
    c.check()
  leaf.lock_ref = 0
  a.release(leaf.slots)
  with pytest.raises(AssertionError, match="no external hold"):
    c.check()
  a.retain(leaf.slots)
  leaf.slots = leaf.slots.copy()
  leaf.slots[0] = SENTINEL
  with pytest.raises(AssertionError, match="SENTINEL"):
    c.check()


def test_retain_keeps_exactly_the_named_prefixes():
  """retain() evicts every path but the named prefixes, splitting a node that runs
  past one, and the kept slots still serve a match."""
  alloc = PagedAllocator(64, 4)
  cache = RadixCache(alloc)
  shared = np.arange(10, 22)
  paths = [np.concatenate([shared, np.arange(100, 108) + 10 * k]) for k in range(2)]
  for toks in paths:
    seq = alloc.new_sequence()
    alloc.extend(seq, len(toks))
    cache.insert(toks, alloc.slot_map(seq))
    alloc.free_sequence(seq)
  other = np.arange(200, 230)
  seq = alloc.new_sequence()
  alloc.extend(seq, len(other))
  cache.insert(other, alloc.slot_map(seq))
  alloc.free_sequence(seq)
  before, _ = cache.match_prefix(paths[0])
  assert before == len(paths[0])
  evicted = cache.retain([shared[:9]])       # ends inside the shared edge: split there
  assert evicted == 2 * 8 + len(other) + 3
  assert cache.num_cached_tokens == 9
  n, slots = cache.match_prefix(paths[1])
  assert n == 9 and (slots != 0).all()
  assert cache.match_prefix(other).n_matched == 0
  cache.check()
  assert cache.retain() == 9 and cache.num_cached_tokens == 0
  cache.check()
