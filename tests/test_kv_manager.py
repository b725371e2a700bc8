"""KVManager: one pool, allocator and set of radix trees shared by every owner;
reservations kept from other owners; cached KV evicted in a fixed order when an
allocation is short. Host bookkeeping only (the pool itself is never touched)."""

import numpy as np
import pytest

from jaxkv.config import CacheConfig, ModelConfig
from jaxkv.engine.kv_manager import KVManager
from jaxkv.kv.allocator import OutOfSlotsError

MODEL = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8)


def manager(pages: int = 9, page: int = 4, **kw) -> KVManager:
  return KVManager(MODEL, CacheConfig(num_pages=pages, page_size=page, max_seq_len=64),
                   None, None, **kw)


def cached(kv: KVManager, tree, tokens) -> None:
  """Caches `tokens` in `tree` the way a finished request does (its slots held)."""
  seq = kv.allocator.new_sequence()
  slots = kv.allocator.extend(seq, len(tokens))
  tree.insert(np.asarray(tokens), slots)
  kv.allocator.free_sequence(seq)


def test_trees_are_named_per_adapter_on_one_allocator():
  kv = manager()
  base, plan = kv.tree("prefix"), kv.tree("prefix", adapter=0)
  assert base is kv.tree("prefix") and plan is not base
  holes = kv.tree("pruned", dead_keys=True)
  assert holes.cache_dead and not base.cache_dead
  assert kv.trees("prefix") == [base, plan] and len(kv.trees()) == 3
  with pytest.raises(ValueError, match="dead_keys"):
    kv.tree("pruned")
  for t in kv.trees():
    assert t.allocator is kv.allocator


def test_reservations_are_kept_from_other_owners():
  kv = manager(pages=9, page=4)                       # 8 usable pages
  kv.reserve("engine", 5)
  assert kv.available(owner="engine") == 8 and kv.available(owner="pruned") == 3
  seq = kv.allocator.new_sequence()
  kv.extend(seq, 12, owner="pruned")                  # 3 pages: exactly what is left
  with pytest.raises(OutOfSlotsError, match="reserved by running requests"):
    kv.extend(seq, 1, owner="pruned")                 # the tail page is full: a 4th page
  kv.extend(seq := kv.allocator.new_sequence(), 20, owner="engine")   # its own reservation
  kv.reserve("engine", 0)
  kv.check()


def test_make_room_evicts_trees_largest_first_then_evictors():
  kv = manager(pages=9, page=4)
  small, big = kv.tree("a"), kv.tree("b")
  cached(kv, small, range(4))                         # 1 page
  cached(kv, big, range(100, 112))                    # 3 pages
  given = []

  def evictor(pages, shard):
    given.append(pages)
    return 0
  kv.register_evictor("other", evictor, lambda: np.zeros(0, np.int32))
  assert kv.available() == 4
  assert kv.make_room(6) <= 0                         # the bigger tree gives first
  assert big.num_cached_tokens < 12 and kv.available() >= 6
  assert kv.make_room(8) <= 0 and small.num_cached_tokens == 0 == big.num_cached_tokens
  assert given == []                                  # the trees sufficed
  assert kv.make_room(9) == 1 and given == []         # more than the pool: nothing tried
  with pytest.raises(ValueError, match="registered already"):
    kv.register_evictor("other", evictor, lambda: np.zeros(0, np.int32))
  kv.check()


def test_hopeless_room_evicts_nothing():
  """When even evicting every cache could not make the room (a running sequence holds
  the pages), make_room leaves the caches alone instead of wiping them for nothing."""
  kv = manager(pages=9, page=4)
  tree = kv.tree("cache")
  cached(kv, tree, range(8))                          # 2 pages, evictable
  busy = kv.allocator.new_sequence()
  kv.extend(busy, 20)                                 # 5 pages held by a live sequence
  assert kv.available() == 1 and kv.reclaimable() == 2
  assert kv.make_room(4) == 3                         # 1 free + 2 reclaimable < 4
  assert tree.num_cached_tokens == 8                  # untouched
  assert kv.make_room(3) <= 0 and tree.num_cached_tokens == 0   # feasible: done
  kv.check()


def test_extend_first_evicts_the_callers_own_tree_in_a_large_step():
  kv = manager(pages=9, page=4)
  mine, other = kv.tree("mine"), kv.tree("other")
  cached(kv, mine, range(16))                         # 4 pages
  cached(kv, other, range(50, 66))                    # 4 pages: the pool is full
  seq = kv.allocator.new_sequence()
  kv.extend(seq, 4, owner="x", first=mine)
  # its own tree went first, by at least n or a quarter of what it held; the other's stayed
  assert mine.num_cached_tokens <= 12 and other.num_cached_tokens == 16
  with pytest.raises(OutOfSlotsError):
    kv.extend(kv.allocator.new_sequence(), 40, make_room=False)
  kv.check()


def test_nbytes_counts_the_low_rank_value_cache():
  plain, lora = manager(), manager(lr_rank=4)
  slots = 9 * 4
  per_token = 2 * MODEL.num_layers * MODEL.d_kv * 4
  assert plain.nbytes == slots * (per_token + 4)
  assert lora.nbytes == plain.nbytes + slots * MODEL.num_layers * 4 * 4
  assert plain.stats()["pool_bytes"] == plain.nbytes
