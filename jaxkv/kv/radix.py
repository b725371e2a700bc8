"""Radix prefix cache (SGLang RadixAttention semantics) over the paged allocator.

A host-side radix tree maps token-id sequences to the KV slots that hold their
keys and values, so requests and agent turns that share a prefix reuse its KV
instead of recomputing it. Nodes hold a token-id array and the slot array of the
same length; children are keyed by their first token; edges are split like in a
standard radix tree when an inserted sequence diverges inside an edge. Why each
rule below is safe: docs/architecture.md, "Radix prefix cache".

Ownership: every cached slot carries one external hold of the cache
(`PagedAllocator.retain`), dropped when its node is evicted; sequences hold their
own references through their slot maps, so evicting a node never frees a slot a
live sequence maps. A hit is used by `adopt_prefix` (`PagedAllocator.adopt`).

What may be cached: `insert` caches a sequence's prefix up to its first SENTINEL
slot-map entry (a pruned position breaks exactness for every later token). Never
insert slot maps of `compact`-pruned sequences (positions no longer match token
indices), layer-wise `[L, T]` maps, or slots whose KV is not written yet.

Holes (`cache_dead=True`, IntentKV dead-slot pruning): a pruned position is cached
under the dead key -1 - token (`dead_keys`) with a SENTINEL slot and no hold. A
request matches through a hole only when it names it (`match_prefix(tokens,
holes=...)`), so a request without holes never adopts another's. A session pruning
inside its adopted prefix branches off at its first new hole (the branch aliases
the live path's slots, one hold per node, audited); `insert(..., replaces=(tokens,
holes))` then evicts its superseded path below the divergence.

Private suffixes (`private_from`): KV that is what a session keeps but not what a
plain prefill computes (segment reuse spliced approximate K/V there) is cached
under token + `PRIVATE` keys: only a request naming the same `private_from`
matches through it, so approximate KV is never served as exact.

Matching is token-granular (a hit may end inside a page); the engine writes only
positions >= n_matched of an adopted sequence. Eviction is LRU over unlocked leaves;
operations cost O(tokens touched + depth), `evict` O(nodes log nodes). Request
lifecycle (to keep a running request's prefix cached, `match_prefix(tokens,
lock=True)` + `alloc.adopt(seq, match.slots)`, then `release_lock(match)`):

  seq = alloc.new_sequence()
  n = cache.adopt_prefix(seq, prompt[:-1])   # shared KV for positions < n
  alloc.extend(seq, len(prompt) - n)         # prefill computes positions >= n
  ...                                        # decode, prune (dead slots)
  cache.insert(tokens_with_kv, alloc.slot_map(seq)[:len(tokens_with_kv)])
  alloc.free_sequence(seq)                   # cached slots stay (cache holds)
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterator

import numpy as np

from jaxkv.kv import radix_audit
from jaxkv.kv.allocator import PagedAllocator
from jaxkv.kv.state import SENTINEL

_NO_TOKENS = np.zeros((0,), np.int64)
_NO_SLOTS = np.zeros((0,), np.int32)


def _as_1d_int(values, what: str) -> np.ndarray:
  """1-D int64 copy of a sequence / array of integers."""
  arr = np.asarray(values)
  if arr.size == 0:
    return _NO_TOKENS.copy()
  if arr.ndim != 1:
    raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
  return arr.astype(np.int64)


# added to the keys of a path's private suffix (`dead_keys(private_from=)`): above any
# token id, so a private key never equals a shared one
PRIVATE = 1 << 40


def dead_keys(tokens, holes, private_from: int | None = None) -> np.ndarray:
  """Tree keys of a token stream: token ids, with -1 - token at the `holes` (bool mask,
  at most as long as tokens; missing entries are live). From `private_from` on the
  keys are token + PRIVATE (then -1 - that at holes): the path's private suffix."""
  keys = _as_1d_int(tokens, "tokens").copy()
  if private_from is not None:
    keys[max(0, int(private_from)):] += PRIVATE
  h = np.zeros(len(keys), bool)
  hm = np.asarray(holes, bool).reshape(-1)[:len(keys)]
  h[:len(hm)] = hm
  keys[h] = -1 - keys[h]
  return keys


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two 1-D arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


class _Node:
  """One edge of the tree: tokens[i] is cached in slots[i]."""
  __slots__ = ("children", "id", "last_access", "lock_ref", "parent", "slots", "tokens")

  def __init__(self, node_id: int, tokens: np.ndarray, slots: np.ndarray,
               parent: _Node | None, last_access: int):
    self.id = node_id
    self.tokens = tokens          # [k] int64 keys: token ids, -1 - id at holes (k >= 1
                                  # except the root)
    self.slots = slots            # [k] int32 KV slots, SENTINEL exactly at holes
    self.children: dict[int, _Node] = {}   # first token -> child
    self.parent = parent
    self.lock_ref = 0             # locks on this node or a descendant
    self.last_access = last_access


@dataclasses.dataclass(frozen=True)
class RadixStats:
  """Cumulative counters of one cache (see `RadixCache.stats`)."""
  queries: int = 0          # match_prefix calls
  query_tokens: int = 0     # tokens asked for
  hit_tokens: int = 0       # tokens found cached
  inserted_tokens: int = 0  # tokens newly cached (after capacity trimming)
  evicted_tokens: int = 0   # tokens evicted (explicitly or for capacity)

  @property
  def hit_rate(self) -> float:
    """hit_tokens / query_tokens (0.0 before any query)."""
    return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class LockHandle:
  """A lock taken by `match_prefix(..., lock=True)`; give it to `release_lock`."""
  id: int


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixMatch:
  """Result of `match_prefix`; unpacks as `n_matched, slots = match`.

  Attributes:
    n_matched: length of the longest cached prefix.
    slots: [n_matched] int32 slots holding that prefix's KV.
    handle: the lock on the matched path (None unless `lock=True`).
  """
  n_matched: int
  slots: np.ndarray
  handle: LockHandle | None = None

  def __iter__(self) -> Iterator:
    return iter((self.n_matched, self.slots))


class RadixCache:
  """Radix tree of cached token prefixes over a `PagedAllocator`'s slots."""

  def __init__(self, allocator: PagedAllocator, *, capacity_tokens: int | None = None,
               cache_dead: bool = False):
    """Creates an empty cache.

    Args:
      allocator: the allocator owning the slots (holds are taken on it).
      capacity_tokens: if set (>= 0), `insert` evicts LRU leaves, then trims the
        newly cached tail, so that at most this many tokens stay cached.
      cache_dead: dead-slot semantics (module docstring, "Holes"): `insert` caches
        the whole stream, pruned positions as dead keys, so the session's next turn
        matches its full prefix "as if no pruning had happened" (IntentKV 3.4) and
        adopts the holes as holes. Such a hit is not bit-exact w.r.t. an unpruned
        run (the method's trade; only the pruning session takes it). Default
        False: exact caching up to the first SENTINEL.
    """
    if capacity_tokens is not None:
      if isinstance(capacity_tokens, bool) or int(capacity_tokens) != capacity_tokens:
        raise TypeError(f"capacity_tokens must be an integer, got {capacity_tokens!r}")
      capacity_tokens = int(capacity_tokens)
      if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
    self._alloc = allocator
    self._capacity = capacity_tokens
    self._cache_dead = bool(cache_dead)
    self._ids = itertools.count()
    self._root = _Node(next(self._ids), _NO_TOKENS, _NO_SLOTS, None, 0)
    self._clock = 0
    # [S] nodes caching each slot (> 1 only for hole branches aliasing a live path),
    # and the (position, token) it was first cached at: aliases must agree
    self._cached = np.zeros((allocator.num_slots,), np.int32)
    self._slot_pos = np.full((allocator.num_slots,), -1, np.int64)
    self._slot_tok = np.full((allocator.num_slots,), -1, np.int64)
    self._num_tokens = 0
    self._num_nodes = 0
    self._locked_tokens = 0
    self._locks: dict[int, _Node] = {}    # live handle id -> locked node
    self._lock_ids = itertools.count()
    self._stats = RadixStats()

  def __repr__(self) -> str:
    return (f"RadixCache(tokens={self._num_tokens}, nodes={self._num_nodes}, "
            f"locked_tokens={self._locked_tokens}, capacity={self._capacity})")

  # ------------------------------------------------------------- properties
  @property
  def allocator(self) -> PagedAllocator:
    return self._alloc

  @property
  def cache_dead(self) -> bool:
    """Whether `insert` keeps pruned positions as dead keys (IntentKV's holes)."""
    return self._cache_dead

  @property
  def capacity_tokens(self) -> int | None:
    return self._capacity

  @property
  def num_cached_tokens(self) -> int:
    """Tokens (= slots) held by the cache."""
    return self._num_tokens

  @property
  def num_nodes(self) -> int:
    """Nodes in the tree, the root excluded."""
    return self._num_nodes

  @property
  def locked_tokens(self) -> int:
    """Cached tokens on a locked path (not evictable)."""
    return self._locked_tokens

  @property
  def evictable_tokens(self) -> int:
    return self._num_tokens - self._locked_tokens

  def evictable_slots(self) -> np.ndarray:
    """[n] int32 the slots unlocked nodes hold (one entry per hold: a slot two nodes
    cache appears twice), i.e. what evicting everything evictable would release."""
    parts = [n.slots[n.slots != SENTINEL] for n in self._nodes()
             if n is not self._root and n.lock_ref == 0]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

  @property
  def stats(self) -> RadixStats:
    """Snapshot of the cumulative counters."""
    return self._stats

  def reset_stats(self) -> None:
    self._stats = RadixStats()

  # ---------------------------------------------------------------- queries
  def match_prefix(self, tokens, *, lock: bool = False, holes=None,
                   private_from: int | None = None) -> PrefixMatch:
    """Longest cached prefix of `tokens`; refreshes the LRU time of its path.

    Counts one query in `stats`. Does not change the tree's shape: a match that
    ends inside an edge refreshes (and, with `lock`, locks) that whole node.

    Args:
      tokens: [n] int token ids.
      lock: also lock the matched path against eviction until
        `release_lock(match.handle)`.
      holes: optional bool mask of the positions this request has pruned (its
        session's holes); the match goes through those positions' dead keys
        and returns SENTINEL there.
      private_from: the start of this request's private suffix (its session's,
        module docstring); None: none.
    Returns:
      PrefixMatch(n_matched, slots [n_matched] int32, handle); unpacks as
      `n_matched, slots`.
    """
    toks = (_as_1d_int(tokens, "tokens") if holes is None and private_from is None else
            dead_keys(tokens, () if holes is None else holes, private_from))
    node, n, parts = self._walk(toks)
    self._clock += 1
    self._touch(node)
    s = self._stats
    self._stats = dataclasses.replace(s, queries=s.queries + 1,
                                      query_tokens=s.query_tokens + len(toks),
                                      hit_tokens=s.hit_tokens + n)
    slots = np.concatenate(parts)[:n] if parts else _NO_SLOTS.copy()
    handle = None
    if lock:
      handle = LockHandle(next(self._lock_ids))
      self._locks[handle.id] = node
      self._add_lock(node, 1)
    return PrefixMatch(n, slots.astype(np.int32), handle)

  def paths(self) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every root-to-leaf path as (tokens [k] int64, slots [k] int32)."""
    out = []
    stack = [(self._root, _NO_TOKENS, _NO_SLOTS)]
    while stack:
      node, toks, slots = stack.pop()
      toks = np.concatenate([toks, node.tokens])
      slots = np.concatenate([slots, node.slots])
      if not node.children and node is not self._root:
        out.append((toks, slots.astype(np.int32)))
      stack.extend((c, toks, slots) for c in node.children.values())
    return out

  # -------------------------------------------------------------- mutations
  def insert(self, tokens, slots, *, replaces=None, private_from: int | None = None) -> int:
    """Caches `(tokens[i], slots[i])` up to the first SENTINEL slot (all of it, holes
    as dead keys, with `cache_dead`).

    `slots[i]` must hold the written KV of `tokens[i]` at logical position i
    (e.g. a sequence's slot map, sliced to its tokens with written KV). The
    part already cached keeps its cached slots (the caller's are not held);
    each newly cached slot gets one hold of the cache (`allocator.retain`). A
    new slot may already be cached only at the same position and token (a hole
    branch aliasing the live path). Without `cache_dead`, caching stops at the
    first SENTINEL: a pruned position breaks the cacheable prefix (see the
    module docstring). With `capacity_tokens`, LRU leaves are then evicted and,
    if that is not enough, the newly cached tail is trimmed. All-or-nothing on
    error.

    Args:
      tokens: [n] int token ids.
      slots: [n] int slots (SENTINEL: a hole, or the end of the cached prefix).
      replaces: optional (tokens, holes) or (tokens, holes, private_from) of the
        path this insert supersedes (the session's previous insert): its nodes below
        the point where the two paths part are evicted if unlocked and not extended
        by other requests.
      private_from: positions from here on are cached under private keys (module
        docstring); None: none.
    Returns:
      Number of newly cached tokens.
    Raises:
      ValueError: length mismatch; a new slot is already cached at another
        position or token, repeated, out of range or not live.
    """
    toks = _as_1d_int(tokens, "tokens")
    sl = _as_1d_int(slots, "slots")
    if len(toks) != len(sl):
      raise ValueError(f"insert: {len(toks)} tokens but {len(sl)} slots")
    dead = sl == SENTINEL
    end = int(np.argmax(dead)) if dead.any() and not self._cache_dead else len(sl)
    toks, sl = dead_keys(toks[:end], dead[:end], private_from), sl[:end]
    node, n, _ = self._walk(toks)
    self._clock += 1
    new = sl[n:]
    if new.size:
      live = new != SENTINEL
      held, pos = new[live], np.arange(n, len(sl))[live]
      if np.any((new < 0) | (new >= self._alloc.num_slots)):
        raise ValueError(f"insert: slot out of range [0, {self._alloc.num_slots})")
      alias = self._cached[held] > 0
      bad = alias & ((self._slot_pos[held] != pos) | (self._slot_tok[held] != toks[pos]))
      if np.any(bad):
        raise ValueError(f"insert: slot {int(held[bad][0])} is already cached for another "
                         f"prefix (another position or token)")
      if len(np.unique(held)) != len(held):
        raise ValueError("insert: a slot appears twice in the new part")
      self._alloc.retain(held)        # validates liveness before any change
      depth = self._depth(node)
      if n < depth:                   # diverges inside node's edge: split it
        node = self._split(node, len(node.tokens) - (depth - n))
      leaf = _Node(next(self._ids), toks[n:].copy(), new.astype(np.int32), node, self._clock)
      node.children[int(toks[n])] = leaf
      self._cached[held] += 1
      self._slot_pos[held], self._slot_tok[held] = pos, toks[pos]
      self._num_tokens += len(new)
      self._num_nodes += 1
      node = leaf
    self._touch(node)
    if replaces is not None:
      self._drop_superseded(dead_keys(*replaces), toks, keep=node)
    added = len(new)
    if added and self._capacity is not None and self._num_tokens > self._capacity:
      self._evict(self._num_tokens - self._capacity, protect=node)
      over = self._num_tokens - self._capacity
      if over > 0:
        added -= self._trim(node, over)
    s = self._stats
    self._stats = dataclasses.replace(s, inserted_tokens=s.inserted_tokens + added)
    return added

  def _drop_superseded(self, old: np.ndarray, new: np.ndarray, keep: _Node) -> int:
    """Evicts the nodes of path `old` that lie wholly past its common prefix with
    `new`, from its end upwards, while they are unlocked leaves; returns tokens."""
    node, n, _ = self._walk(old)
    if n != len(old) or n != self._depth(node):
      return 0                        # the old path ends inside an edge: shared, keep
    split = _common_prefix(old, new)
    evicted = 0
    while (node is not self._root and node is not keep and not node.children
           and node.lock_ref == 0 and self._depth(node) - len(node.tokens) >= split):
      parent = node.parent
      evicted += len(node.slots)
      self._remove_leaf(node)
      node = parent
    s = self._stats
    self._stats = dataclasses.replace(s, evicted_tokens=s.evicted_tokens + evicted)
    return evicted

  def adopt_prefix(self, seq: int, tokens, *, holes=None, private_from: int | None = None
                   ) -> int:
    """Matches `tokens` and adopts the hit into the empty sequence `seq`.

    `allocator.adopt` appends the matched slots to seq's slot map and adds one
    reference per slot, so seq holds its own references and survives eviction
    of the nodes. seq must be empty (the cached KV was written at positions
    0..n-1, and an empty sequence has no tail page, so its next `extend` takes
    fresh pages). The engine must then compute only positions >= n_matched. An
    engine that needs the logits of the last prompt token should pass
    `tokens[:-1]`, so at least that token is recomputed.

    Args:
      seq: a live, empty sequence id of the cache's allocator.
      tokens: [n] int token ids of the request.
      holes: the request's own holes (`match_prefix`); they are adopted as SENTINEL.
      private_from: the start of the request's private suffix (`match_prefix`).
    Returns:
      n_matched, the number of positions adopted.
    Raises:
      ValueError: seq is not empty.
    """
    if self._alloc.length(seq) != 0:
      raise ValueError(f"adopt_prefix: sequence {seq} has {self._alloc.length(seq)} "
                       f"positions; a prefix can only be adopted by an empty sequence")
    n, slots = self.match_prefix(tokens, holes=holes, private_from=private_from)
    if n:
      self._alloc.adopt(seq, slots)
    return n

  def release_lock(self, handle: LockHandle | PrefixMatch) -> None:
    """Releases a lock taken by `match_prefix(..., lock=True)`.

    Raises:
      ValueError: the handle was already released or is not this cache's.
    """
    if isinstance(handle, PrefixMatch):
      handle = handle.handle
    node = self._locks.pop(handle.id, None) if isinstance(handle, LockHandle) else None
    if node is None:
      raise ValueError(f"release_lock: {handle!r} is not a live lock of this cache "
                       f"(released twice?)")
    self._add_lock(node, -1)

  def evict(self, num_tokens: int) -> int:
    """Evicts LRU unlocked leaves until `num_tokens` tokens are gone.

    Whole nodes are evicted (the count may overshoot); a parent becomes a
    candidate once its last child is gone. Each evicted slot loses the cache's
    hold (`allocator.release`); the allocator frees it only if no slot map
    refers to it any more.

    Returns:
      Tokens evicted (less than asked when only locked nodes remain).
    """
    return self._evict(int(num_tokens))

  def clear(self) -> int:
    """Evicts everything; returns the tokens evicted.

    Raises:
      RuntimeError: locks are outstanding.
    """
    if self._locks:
      raise RuntimeError(f"clear: {len(self._locks)} lock(s) are outstanding")
    return self._evict(self._num_tokens)

  def retain(self, prefixes=()) -> int:
    """Evicts everything but the cached part of each of `prefixes` (token arrays);
    returns the tokens evicted. A node that runs past a prefix is split at its end,
    so exactly the prefix stays (e.g. a system prompt every session shares).

    Raises:
      RuntimeError: locks are outstanding.
    """
    if self._locks:
      raise RuntimeError(f"retain: {len(self._locks)} lock(s) are outstanding")
    kept = []
    for p in prefixes:
      toks = _as_1d_int(p, "prefixes")
      node, n, _ = self._walk(toks)
      if n == 0:
        continue
      if self._depth(node) > n:                 # the match ends inside node's edge
        node = self._split(node, len(node.tokens) - (self._depth(node) - n))
      self._add_lock(node, 1)
      kept.append(node)
    try:
      return self._evict(self._num_tokens)
    finally:
      for node in kept:
        self._add_lock(node, -1)

  # -------------------------------------------------------------- internals
  def _walk(self, toks: np.ndarray) -> tuple[_Node, int, list[np.ndarray]]:
    """Deepest node touched by the match, matched length, slot arrays on the way."""
    node, n, parts = self._root, 0, []
    while n < len(toks):
      child = node.children.get(int(toks[n]))
      if child is None:
        break
      k = _common_prefix(child.tokens, toks[n:])
      node, n = child, n + k
      parts.append(child.slots)
      if k < len(child.tokens):
        break
    return node, n, parts

  def _depth(self, node: _Node) -> int:
    d = 0
    while node is not self._root:
      d += len(node.tokens)
      node = node.parent
    return d

  def _touch(self, node: _Node) -> None:
    while node is not None:
      node.last_access = self._clock
      node = node.parent

  def _add_lock(self, node: _Node, delta: int) -> None:
    while node is not self._root:
      before = node.lock_ref
      node.lock_ref += delta
      if (before == 0) != (node.lock_ref == 0):
        self._locked_tokens += len(node.tokens) if before == 0 else -len(node.tokens)
      node = node.parent

  def _split(self, node: _Node, k: int) -> _Node:
    """Splits node's edge after k tokens; returns the new parent (the prefix).

    The existing node object keeps the suffix, so lock handles on it stay valid.
    """
    parent = _Node(next(self._ids), node.tokens[:k].copy(), node.slots[:k].copy(),
                   node.parent, node.last_access)
    parent.lock_ref = node.lock_ref
    node.parent.children[int(node.tokens[0])] = parent
    node.tokens, node.slots = node.tokens[k:].copy(), node.slots[k:].copy()
    node.parent = parent
    parent.children[int(node.tokens[0])] = node
    self._num_nodes += 1
    return parent

  def _uncache(self, held: np.ndarray) -> None:
    self._alloc.release(held)
    self._cached[held] -= 1
    gone = held[self._cached[held] == 0]
    self._slot_pos[gone] = self._slot_tok[gone] = -1

  def _remove_leaf(self, node: _Node) -> None:
    self._uncache(node.slots[node.slots != SENTINEL])
    del node.parent.children[int(node.tokens[0])]
    self._num_tokens -= len(node.slots)
    self._num_nodes -= 1

  def _trim(self, leaf: _Node, k: int) -> int:
    """Uncaches the last min(k, len) tokens of an unlocked leaf; returns how many."""
    k = min(k, len(leaf.slots))
    if k == len(leaf.slots):
      self._remove_leaf(leaf)
      return k
    drop = leaf.slots[-k:]
    self._uncache(drop[drop != SENTINEL])
    leaf.tokens, leaf.slots = leaf.tokens[:-k].copy(), leaf.slots[:-k].copy()
    self._num_tokens -= k
    return k

  def _evictable(self, node: _Node, protect: _Node | None) -> bool:
    return (node is not self._root and node is not protect and not node.children
            and node.lock_ref == 0)

  def _evict(self, num_tokens: int, protect: _Node | None = None) -> int:
    if num_tokens <= 0:
      return 0
    heap = [(n.last_access, n.id, n) for n in self._nodes() if self._evictable(n, protect)]
    heapq.heapify(heap)
    evicted = 0
    while evicted < num_tokens and heap:
      _, _, node = heapq.heappop(heap)
      evicted += len(node.slots)
      self._remove_leaf(node)
      parent = node.parent
      if self._evictable(parent, protect):
        heapq.heappush(heap, (parent.last_access, parent.id, parent))
    s = self._stats
    self._stats = dataclasses.replace(s, evicted_tokens=s.evicted_tokens + evicted)
    return evicted

  def _nodes(self) -> Iterator[_Node]:
    """Every node but the root, parents before children."""
    stack = list(self._root.children.values())
    while stack:
      node = stack.pop()
      yield node
      stack.extend(node.children.values())

  # ------------------------------------------------------------------ audit
  def check(self) -> None:
    """Audits the tree against itself and the allocator (`jaxkv.kv.radix_audit.check_radix`).

    Raises:
      AssertionError: with a description of the first inconsistency found.
    """
    radix_audit.check_radix(self)
