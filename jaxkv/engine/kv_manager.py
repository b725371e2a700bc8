"""The KV manager: the one owner of device KV in serving.

    kv = KVManager(model.cfg, CacheConfig(num_pages=1024), graphdef, weights)
    seq = kv.allocator.new_sequence()
    kv.extend(seq, 300)                       # evicts cached KV first when the pool is short
    tree = kv.tree("prefix", adapter=-1)      # a radix tree on the one pool
    out = kv.driver.prefill(...)              # every step runs on the one pool

One `KVManager` holds, for everything that serves on one model:
- the pool (`kv_state.KVPool`, allocated on first use, sharded on a mesh, with the
  LoRA low-rank value pool `vlr` when `lr_rank > 0`) inside the one `Driver` that runs
  every jitted step on it;
- the host `PagedAllocator` (refcounts, holds, alias-aware free, one page range per
  data shard);
- the radix trees: named by what keeps them (the engine's prefix cache per adapter,
  a pruning runner's tree with dead-slot holes, the reuse runner's exact prefixes);
- reservations: pages an owner has promised its running requests (the engine
  reserves each row's worst case), which other owners' allocations may not take;
- evictors: caches other than radix trees (SemShareKV's reference prompts) that give
  pages back under pressure.

Anchors. vLLM v1 keeps one `KVCacheManager` over one `BlockPool` for its scheduler,
and SGLang one token-to-KV pool under every prefix-cache variant; both evict cached,
unreferenced blocks least recently used first when an allocation is short. This is
that, for a functional JAX engine: the pool is a pytree the steps donate, so it
lives in the one driver the manager owns, and everything else is host bookkeeping.

Policy when the pool is short (`make_room`): radix trees first (unlocked leaves,
least recently used; the tree with the most evictable KV first), then the
registered evictors in registration order. Reserved pages are never handed to
another owner; what an owner already reserved it allocates without a check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxkv import sharding
from jaxkv.config import CacheConfig, ModelConfig
from jaxkv.engine.driver import Driver
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import OutOfSlotsError, PagedAllocator
from jaxkv.kv.radix import RadixCache


class KVManager:
  """Pool, allocator, radix trees, reservations and evictors of one model's KV."""

  def __init__(self, model_cfg: ModelConfig, cache: CacheConfig, graphdef, weights, *,
               mesh=None, shards: int = 1, lr_rank: int = 0, attn_impl: str = "auto"):
    """Args:
      model_cfg: the model the pool is for (layers, KV heads, head dim).
      cache: the pool's size (`num_pages` x `page_size` slots) and dtype.
      graphdef, weights: the model's `nnx.split` (weights sharded already on a mesh).
      mesh: a ("data", "model") mesh to shard the pool on (None: one device).
      shards: page ranges (data shards) of the allocator (1 without a mesh).
      lr_rank: rank of the LoRA low-rank value pool (0: none); LRAgent's decoupled
        value cache needs it.
      attn_impl: the `jaxkv.ops` attention implementation of every step.
    """
    self.model_cfg, self.cache_cfg, self.mesh = model_cfg, cache, mesh
    self.graphdef, self.weights = graphdef, weights
    self.lr_rank, self.attn_impl = lr_rank, attn_impl
    self.allocator = PagedAllocator(cache.num_pages, cache.page_size, shards=shards)
    self._driver: Driver | None = None
    self._trees: dict[tuple[str, int], RadixCache] = {}
    self._reserved: dict[str, list[int]] = {}      # owner -> pages reserved per shard
    # name -> (evict(pages, shard) -> pages freed, held() -> slots it would release)
    self._evictors: dict[str, tuple[Callable[[int, int], int], Callable[[], np.ndarray]]] = {}

  # ------------------------------------------------------------------ device
  @property
  def driver(self) -> Driver:
    """The one driver (allocates the pool on first use)."""
    if self._driver is None:
      if self.mesh is None:
        pool = kv_state.init_pool(self.model_cfg, self.cache_cfg, lr_rank=self.lr_rank)
      else:
        pool = sharding.init_pool(self.model_cfg, self.cache_cfg, self.mesh,
                                  lr_rank=self.lr_rank)
      self._driver = Driver(self.graphdef, self.weights, pool, attn_impl=self.attn_impl,
                            mesh=self.mesh)
    return self._driver

  @property
  def kv(self) -> kv_state.KVPool | None:
    """The pool, or None before first use."""
    return None if self._driver is None else self._driver.kv

  @property
  def bytes_per_slot(self) -> int:
    """K and V of one token over every layer (+ the low-rank value cache)."""
    item = np.dtype(self.cache_cfg.dtype).itemsize
    return (2 * self.model_cfg.num_layers * self.model_cfg.d_kv
            + self.model_cfg.num_layers * self.lr_rank) * item

  @property
  def nbytes(self) -> int:
    """Device bytes of the pool (K, V, positions, the low-rank pool)."""
    slots = self.cache_cfg.num_slots
    return slots * self.bytes_per_slot + slots * 4

  # ------------------------------------------------------------------ trees
  def tree(self, name: str = "prefix", adapter: int = -1, *,
           dead_keys: bool = False) -> RadixCache:
    """The radix tree `name` of `adapter` (-1: the base model), made on first use.

    Each adapter has its own trees (an adapter's K/V differ from the base's); all of
    them hold slots of the one pool. `dead_keys`: IntentKV's dead-slot semantics
    (`RadixCache(cache_dead=True)`); a name keeps one setting."""
    key = (name, adapter)
    t = self._trees.get(key)
    if t is None:
      t = self._trees[key] = RadixCache(self.allocator, cache_dead=dead_keys)
    elif t.cache_dead != dead_keys:
      raise ValueError(f"radix tree {name!r} was made with dead_keys={t.cache_dead}")
    return t

  def trees(self, name: str | None = None) -> list[RadixCache]:
    """Every tree (of `name`, or all), in the order they were made."""
    return [t for (n, _), t in self._trees.items() if name is None or n == name]

  # ------------------------------------------------------------------ pages
  def reserve(self, owner: str, pages) -> None:
    """Sets the pages `owner` has promised its running work (an int for shard 0, or
    one per shard); other owners' allocations leave them free."""
    per = [int(pages)] if np.isscalar(pages) else [int(p) for p in pages]
    per += [0] * (self.allocator.shards - len(per))
    self._reserved[owner] = per

  def reserved(self, shard: int | None = 0, *, exclude: str | None = None) -> int:
    """Pages reserved on `shard` (None: every shard) by every owner but `exclude`."""
    per = list(self._reserved.items())       # a copy: /metrics reads from another thread
    return sum(sum(p) if shard is None else p[shard] for o, p in per if o != exclude)

  def available(self, shard: int = 0, *, owner: str | None = None) -> int:
    """Free pages of `shard` that `owner` may take (others' reservations kept)."""
    return self.allocator.shard_free_pages(shard) - self.reserved(shard, exclude=owner)

  @property
  def evictable_tokens(self) -> int:
    return sum(t.evictable_tokens for t in self._trees.values())

  def register_evictor(self, name: str, evict: Callable[[int, int], int],
                       held: Callable[[], np.ndarray]) -> None:
    """Adds a cache that gives pages back under pressure: `evict(pages, shard)` frees
    up to that many pages of `shard` (as best it can) and returns how many it freed;
    `held()` lists the slots it holds (what evicting all of it would release)."""
    if name in self._evictors:
      raise ValueError(f"an evictor named {name!r} is registered already")
    self._evictors[name] = (evict, held)

  def reclaimable(self, shard: int = 0) -> int:
    """Pages of `shard` that evicting every cache (radix trees' unlocked entries,
    the evictors) would free: pages whose live slots no sequence or state holds."""
    releases = np.zeros(self.allocator.num_slots, np.int64)
    for t in self._trees.values():
      np.add.at(releases, t.evictable_slots(), 1)
    for _, held in self._evictors.values():
      np.add.at(releases, np.asarray(held(), np.int64), 1)
    return self.allocator.freeable_pages(releases, shard)

  def make_room(self, pages: int, shard: int = 0, *, owner: str | None = None) -> int:
    """Evicts cached KV until `pages` pages of `shard` are available to `owner`:
    radix trees first (LRU unlocked leaves, the tree with the most evictable KV
    first), then the evictors. Returns the pages still missing (<= 0: enough).
    Evicts nothing when even evicting every cache could not make the room (a
    request that cannot be admitted yet does not wipe other owners' caches)."""
    short = pages - self.available(shard, owner=owner)
    if short > 0 and short > self.reclaimable(shard):
      return short
    size = self.cache_cfg.page_size
    for tree in sorted(self._trees.values(), key=lambda t: -t.evictable_tokens):
      while short > 0 and tree.evictable_tokens:
        if not tree.evict(short * size):
          break
        short = pages - self.available(shard, owner=owner)
    for evict, _ in self._evictors.values():
      if short <= 0:
        break
      evict(short, shard)
      short = pages - self.available(shard, owner=owner)
    return short

  def extend(self, seq: int, n: int, *, owner: str | None = None, make_room: bool = True,
             first: RadixCache | None = None) -> np.ndarray:
    """`allocator.extend(seq, n)` within what `owner` may take, making room first when
    the pool is short (`make_room=False`: no eviction). `first`: the caller's own
    radix tree, which gives back its least recently used entries before anything
    else, in a large step (at least n tokens, or a quarter of what it holds, so the
    next turns do not evict again at once). Raises OutOfSlotsError when even that is
    not enough."""
    shard = self.allocator.shard_of_sequence(seq)
    pages = self.allocator.pages_needed(seq, n)
    if first is not None and make_room and pages > self.available(shard, owner=owner):
      first.evict(max(n, first.num_cached_tokens // 4))
    if pages > self.available(shard, owner=owner) and (
        not make_room or self.make_room(pages, shard, owner=owner) > 0):
      raise OutOfSlotsError(
          f"KV pool exhausted: {pages} pages needed, {self.available(shard, owner=owner)} "
          f"available ({self.allocator.shard_free_pages(shard)} free, "
          f"{self.reserved(shard, exclude=owner)} reserved by running requests)",
          requested=pages, available=self.available(shard, owner=owner))
    return self.allocator.extend(seq, n)

  # ------------------------------------------------------------------ checks
  def check(self) -> None:
    """The allocator's and every tree's invariants (raises AssertionError)."""
    self.allocator.check()
    for t in self._trees.values():
      t.check()

  def stats(self) -> dict:
    """Gauges for /metrics and logs."""
    a = self.allocator
    return dict(pool_bytes=self.nbytes, pages=a.num_pages, free_pages=a.num_free_pages,
                live_slots=a.num_live_slots, sequences=len(a.sequences()),
                cached_tokens=sum(t.num_cached_tokens for t in self._trees.values()),
                reserved_pages=sum(sum(p) for p in self._reserved.values()),
                trees=len(self._trees))
