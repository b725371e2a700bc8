"""The radix prefix cache's full audit (`RadixCache.check`), used by tests,
`KVManager.check` and the soak benchmark.

It recomputes the tree's bookkeeping (counters, the cached-slot mask, lock counts, slot
aliases) from the nodes and compares it with what `jaxkv.kv.radix.RadixCache` maintains
incrementally, raising AssertionError on the first inconsistency. It reads the cache's
private fields on purpose: the module is the cache's friend, so `radix.py` stays about the
tree's operations.
"""

from __future__ import annotations

import numpy as np

from jaxkv.kv.allocator import SENTINEL


def check_radix(cache) -> None:
  """Audits the tree against itself and the allocator.

  Checks: parent / child links and first-token keys; every node non-empty
  with equally long token and slot arrays; no SENTINEL and no slot cached
  twice (each cached slot carries exactly one hold of the cache, so the
  allocator shows >= 1 hold on it); the cached-slot mask, token, node and
  locked-token counters; lock counts equal to the live handles below each
  node; LRU times never newer below than above; the capacity bound.

  Raises:
    AssertionError: with a description of the first inconsistency found.
  """
  def fail(msg: str):
    raise AssertionError(f"RadixCache.check: {msg}")

  root = cache._root
  if root.parent is not None or len(root.tokens) or len(root.slots):
    fail("the root has a parent or tokens")
  expected_locks: dict[int, int] = {}
  for node in cache._locks.values():
    while node is not root:
      expected_locks[node.id] = expected_locks.get(node.id, 0) + 1
      node = node.parent
  seen = np.zeros_like(cache._cached)
  tokens = nodes = locked = 0
  depth = {root.id: 0}
  for node in cache._nodes():
    nodes += 1
    if len(node.tokens) == 0 or len(node.tokens) != len(node.slots):
      fail(f"node {node.id} has {len(node.tokens)} tokens and {len(node.slots)} slots")
    parent = node.parent
    if parent is None or parent.children.get(int(node.tokens[0])) is not node:
      fail(f"node {node.id} is not its parent's child under its first token")
    if node.last_access > parent.last_access and parent is not root:
      fail(f"node {node.id} was accessed after its parent {parent.id}")
    if node.lock_ref != expected_locks.get(node.id, 0):
      fail(f"node {node.id} lock_ref {node.lock_ref}, live handles below it "
           f"{expected_locks.get(node.id, 0)}")
    sl = node.slots
    if sl.dtype != np.int32 or (np.any(sl == SENTINEL) and not cache._cache_dead):
      fail(f"node {node.id} caches SENTINEL or has slots of dtype {sl.dtype}")
    if np.any((sl == SENTINEL) != (node.tokens < 0)):
      fail(f"node {node.id}: SENTINEL slots and dead keys disagree")
    d0 = depth[parent.id]
    depth[node.id] = d0 + len(sl)
    live = sl != SENTINEL
    pos, sl = d0 + np.flatnonzero(live), sl[live]
    if np.any((sl < 0) | (sl >= len(seen))):
      fail(f"node {node.id} has out-of-range slots")
    if len(np.unique(sl)) != len(sl):
      fail(f"node {node.id} caches a slot twice")
    if np.any((cache._slot_pos[sl] != pos) | (cache._slot_tok[sl] != node.tokens[live])):
      fail(f"node {node.id} caches a slot at another position or token than its aliases")
    seen[sl] += 1
    for slot in sl.tolist():
      if cache._alloc.holds(slot) < seen[slot]:
        fail(f"cached slot {slot} (node {node.id}) has no external hold for each node "
             f"caching it")
    tokens += len(node.slots)
    locked += len(node.slots) if node.lock_ref else 0
  if np.any(seen != cache._cached):
    fail("the cached-slot mask disagrees with the tree")
  if (tokens, nodes, locked) != (cache._num_tokens, cache._num_nodes, cache._locked_tokens):
    fail(f"counters (tokens, nodes, locked) stored "
         f"{(cache._num_tokens, cache._num_nodes, cache._locked_tokens)}, recomputed "
         f"{(tokens, nodes, locked)}")
  if cache._capacity is not None and tokens > cache._capacity:
    fail(f"{tokens} tokens cached over capacity {cache._capacity}")
