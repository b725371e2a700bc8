"""Host-side paged slot allocator: pages, refcounts and token-level slot maps.

The KV pool is a flat array of `num_slots = num_pages * page_size` slots per
layer. Pages of `page_size` slots are only the allocation unit: a sequence
addresses its tokens through a token-level slot map (logical position -> slot
id), so KV pruning can evict single tokens without shifting positions.

Invariants (docs/architecture.md):
- slot 0 is the sentinel (`SENTINEL`): never allocated, never freed, never
  written; page 0 (slots 0..page_size-1) is reserved so it is never handed out.
  A slot-map entry equal to SENTINEL means "evicted / not present";
- allocation is explicit and host-side: this numpy allocator owns the pages,
  per-slot refcounts and the free list; device code only reads slot maps;
- free is alias-aware: a slot's refcount counts every live slot-map entry and
  every external hold (`retain`, e.g. the radix prefix cache) on it. A slot is
  "freed" when its refcount reaches 0; its page goes back to the free list
  exactly when all its slots have refcount 0 and it is not a live sequence's
  open tail page (the page the sequence is still filling);
- a sequence fills the unused tail of its own tail page before taking fresh
  pages. The tail is kept rolled back: trailing tail-page slots whose refcount
  dropped to 0 (truncated pre-allocated decode slots, an evicted last token)
  are handed out again by that sequence's next `extend`. A forked child has no
  tail page, so it never appends into the parent's page.

Shards (`shards` > 1, a pool split on a mesh's "data" axis): the pages form
`shards` equal contiguous ranges, one per data shard; the first page of each
range is reserved like page 0 (the shard's own sentinel page, so a shard-local
slot index 0 never holds a token), and a sequence created on shard d takes its
fresh pages from range d only, so a batch row's own KV lives on the device that
holds its row. `SENTINEL` (global slot 0, in shard 0's reserved page) still marks
"absent" in slot maps; adopted / forked slots may come from any shard.

Every operation costs O(slots touched) (plus O(pages touched)); `check()` is
the O(num_slots + total map length) audit used by tests.
"""

from __future__ import annotations

import collections
import operator

import numpy as np

SENTINEL = 0

_EMPTY = np.zeros((0,), np.int32)


class OutOfSlotsError(RuntimeError):
  """Raised when the pool cannot hold a requested allocation.

  Attributes:
    requested: slots asked for (None when raised by a caller with a message).
    available: slots that could have been handed out to that sequence.
  """

  def __init__(self, message: str, *, requested: int | None = None,
               available: int | None = None):
    super().__init__(message)
    self.requested = requested
    self.available = available


class _Sequence:
  """One sequence's slot map (growable int32 buffer) and its open tail page."""
  __slots__ = ("buf", "shard", "size", "tail_next", "tail_page")

  def __init__(self, slots: np.ndarray = _EMPTY, shard: int = 0):
    self.shard = shard    # the page range its fresh pages come from
    self.buf = np.zeros((max(16, 2 * len(slots)),), np.int32)
    self.buf[:len(slots)] = slots
    self.size = len(slots)
    self.tail_page = -1   # open tail page id, -1: none
    self.tail_next = 0    # offset of the tail page's next unused slot

  @property
  def map(self) -> np.ndarray:
    """[size] int32 view (writes go to the buffer)."""
    return self.buf[:self.size]

  def append(self, slots: np.ndarray) -> None:
    end = self.size + len(slots)
    if end > len(self.buf):
      buf = np.zeros((max(end, 2 * len(self.buf)),), np.int32)
      buf[:self.size] = self.buf[:self.size]
      self.buf = buf
    self.buf[self.size:end] = slots
    self.size = end


def _index(value, what: str) -> int:
  """Python int from an int-like (rejects bool and floats)."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what} must be an integer, got {value!r}")
  try:
    return operator.index(value)
  except TypeError:
    raise TypeError(f"{what} must be an integer, got {value!r}") from None


def _int_array(values, what: str) -> np.ndarray:
  """1-D int64 array from a sequence / array of integers (scalars allowed)."""
  arr = np.asarray(values)
  if arr.size == 0:
    return np.zeros((0,), np.int64)
  if arr.ndim > 1:
    raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
  return np.atleast_1d(arr).astype(np.int64)


class PagedAllocator:
  """Pages, refcounts and token-level slot maps over a flat KV slot pool.

  State (S = num_slots, P = num_pages):
    _ref: [S] int32 total references (slot-map entries + external holds).
    _held: [S] int32 external holds (`retain` minus `release`).
    _page_live: [P] int32 number of slots with refcount > 0 in each page.
    _tail_owner: [P] int64 sequence whose open tail page this is, -1: none.
    _free: per shard, a deque of its free page ids (FIFO); _is_free: [P] bool.
  """

  def __init__(self, num_pages: int, page_size: int, shards: int = 1):
    """Creates an empty pool; page 0 (the sentinel page) is never free, nor is the
    first page of any other shard's range.

    Args:
      num_pages: P >= 2 * shards (each shard's first page is reserved), a
        multiple of `shards`.
      page_size: slots per page, >= 1.
      shards: page ranges (data shards) sequences allocate from (module docstring).
    """
    num_pages = _index(num_pages, "num_pages")
    page_size = _index(page_size, "page_size")
    shards = _index(shards, "shards")
    if shards < 1 or num_pages % shards or num_pages < 2 * shards:
      raise ValueError(f"num_pages must be a multiple of shards = {shards} with at least 2 "
                       f"pages per shard (the first is reserved), got {num_pages}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self._shards, self._shard_pages = shards, num_pages // shards
    self._num_pages = num_pages
    self._page_size = page_size
    self._num_slots = num_pages * page_size
    self._ref = np.zeros((self._num_slots,), np.int32)
    self._held = np.zeros((self._num_slots,), np.int32)
    self._page_live = np.zeros((num_pages,), np.int32)
    self._tail_owner = np.full((num_pages,), -1, np.int64)
    q = self._shard_pages
    self._free = [collections.deque(range(d * q + 1, (d + 1) * q)) for d in range(shards)]
    self._is_free = np.ones((num_pages,), bool)
    self._is_free[::q] = False          # the reserved (sentinel) page of every shard
    self._seqs: dict[int, _Sequence] = {}
    self._next_id = 0
    self._num_live = 0

  def __repr__(self) -> str:
    return (f"PagedAllocator(num_pages={self._num_pages}, page_size={self._page_size}, "
            f"free_pages={self.num_free_pages}, live_slots={self._num_live}, "
            f"sequences={len(self._seqs)})")

  # ------------------------------------------------------------- properties
  @property
  def num_pages(self) -> int:
    return self._num_pages

  @property
  def page_size(self) -> int:
    return self._page_size

  @property
  def num_slots(self) -> int:
    return self._num_slots

  @property
  def shards(self) -> int:
    return self._shards

  @property
  def num_free_pages(self) -> int:
    return sum(len(f) for f in self._free)

  def shard_free_pages(self, shard: int) -> int:
    """Free pages in `shard`'s range."""
    return len(self._free[shard])

  def shard_of(self, slots) -> np.ndarray:
    """The shard whose page range holds each slot."""
    return np.asarray(slots) // (self._shard_pages * self._page_size)

  @property
  def num_used_pages(self) -> int:
    """Pages out of the free lists (reserved pages excluded), open tail pages included."""
    return self._num_pages - self._shards - self.num_free_pages

  @property
  def num_live_slots(self) -> int:
    """Slots with refcount > 0."""
    return self._num_live

  # ---------------------------------------------------------------- queries
  def sequences(self) -> list[int]:
    """Live sequence ids, ascending."""
    return sorted(self._seqs)

  def slot_map(self, seq: int) -> np.ndarray:
    """[length(seq)] int32 copy of seq's slot map, SENTINEL where evicted."""
    return self._get(seq).map.copy()

  def length(self, seq: int) -> int:
    """Number of logical positions in seq's map (evicted ones included)."""
    return self._get(seq).size

  def shard_of_sequence(self, seq: int) -> int:
    """The shard whose page range seq's fresh pages come from."""
    return self._get(seq).shard

  def pages_needed(self, seq: int, n: int) -> int:
    """Fresh pages `extend(seq, n)` would take (after the room left in its tail page)."""
    s = self._get(seq)
    room = self._page_size - s.tail_next if s.tail_page >= 0 else 0
    return -(-max(0, n - room) // self._page_size)

  def freeable_pages(self, releases: np.ndarray, shard: int | None = None) -> int:
    """Pages that would come free if each slot lost `releases[slot]` references (e.g.
    every cache dropping its holds): in use, no sequence's open tail page, and every
    live slot on them left with no reference. In `shard`'s range, or all."""
    ps = self._page_size
    left = self._ref.astype(np.int64) - releases
    ok = (left <= 0).reshape(self._num_pages, ps).all(axis=1)
    ok &= ~self._is_free & (self._tail_owner < 0) & (self._page_live > 0)
    if shard is not None:
      q = self._shard_pages
      return int(ok[shard * q:(shard + 1) * q].sum())
    return int(ok.sum())

  def refcount(self, slot: int) -> int:
    """References to `slot`: slot-map entries plus external holds."""
    return int(self._ref[self._slot(slot)])

  def holds(self, slot: int) -> int:
    """External holds (`retain` minus `release`) on `slot`."""
    return int(self._held[self._slot(slot)])

  def free_pages(self) -> np.ndarray:
    """[num_free_pages] int32 free page ids, shard by shard, each in the order it
    will be handed out."""
    return np.fromiter((p for f in self._free for p in f), np.int32, self.num_free_pages)

  # -------------------------------------------------------------- mutations
  def new_sequence(self, shard: int = 0) -> int:
    """Registers an empty sequence whose fresh pages come from `shard`'s range and
    returns its id (ids are never reused)."""
    if not 0 <= shard < self._shards:
      raise ValueError(f"shard {shard} of {self._shards}")
    seq = self._next_id
    self._next_id += 1
    self._seqs[seq] = _Sequence(shard=shard)
    return seq

  def extend(self, seq: int, n: int) -> np.ndarray:
    """Allocates `n` fresh slots and appends them to seq's slot map.

    Fills the unused tail of seq's own tail page first, then takes fresh pages
    from the free list. All-or-nothing: on failure nothing changes.

    Args:
      seq: a live sequence id.
      n: number of slots, >= 0.
    Returns:
      [n] int32 the new slots, in position order.
    Raises:
      OutOfSlotsError: fewer than `n` slots are available to seq.
    """
    s = self._get(seq)
    n = _index(n, "n")
    if n < 0:
      raise ValueError(f"extend: n must be >= 0, got {n}")
    if n == 0:
      return _EMPTY.copy()
    ps = self._page_size
    room = ps - s.tail_next if s.tail_page >= 0 else 0
    from_tail = min(n, room)
    rest = n - from_tail
    pages_needed = -(-rest // ps)
    free = self._free[s.shard]
    if pages_needed > len(free):
      available = room + len(free) * ps
      where = f" in shard {s.shard}" if self._shards > 1 else ""
      raise OutOfSlotsError(
          f"out of KV slots: sequence {seq} asked for {n} slot(s) but only {available} "
          f"are free{where} ({len(free)} free page(s) x page_size {ps} + {room} left in "
          f"its tail page); raise cache.num_pages (now {self._num_pages}) or free / "
          f"evict sequences", requested=n, available=available)
    parts = []
    if from_tail:
      start = s.tail_page * ps + s.tail_next
      parts.append(np.arange(start, start + from_tail, dtype=np.int32))
      self._page_live[s.tail_page] += from_tail
      s.tail_next += from_tail
      if s.tail_next == ps:   # the tail page is full: it is no longer a tail
        self._tail_owner[s.tail_page] = -1
        s.tail_page, s.tail_next = -1, 0
    for _ in range(pages_needed):
      page = free.popleft()
      self._is_free[page] = False
      take = min(ps, rest)
      rest -= take
      parts.append(np.arange(page * ps, page * ps + take, dtype=np.int32))
      self._page_live[page] = take
      if take < ps:           # only the last fresh page can be partial
        s.tail_page, s.tail_next = page, take
        self._tail_owner[page] = seq
    slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
    self._ref[slots] = 1
    self._num_live += n
    s.append(slots)
    return slots.copy()

  def adopt(self, seq: int, slots) -> None:
    """Appends existing live slots (e.g. a prefix-cache hit) to seq's map, shared.

    Args:
      seq: a live sequence id.
      slots: [k] ints; each non-sentinel slot gets refcount += 1, SENTINEL
        entries are appended as evicted positions.
    Raises:
      ValueError: a non-sentinel slot is not live (refcount 0) or out of range.
    """
    s = self._get(seq)
    arr = self._slots(slots, "adopt")
    live = arr[arr != SENTINEL]
    self._require_live(live, "adopt")
    np.add.at(self._ref, live, 1)
    s.append(arr.astype(np.int32))

  def fork(self, seq: int) -> int:
    """New sequence sharing a copy of seq's slot map (every live slot ref += 1).

    The child has no tail page, so its `extend` takes fresh pages and never
    writes into the parent's partially filled page.

    Returns:
      The child's sequence id.
    """
    m = self._get(seq).map
    live = m[m != SENTINEL]
    np.add.at(self._ref, live, 1)
    child = self._next_id
    self._next_id += 1
    self._seqs[child] = _Sequence(m, shard=self._seqs[seq].shard)
    return child

  def retain(self, slots) -> None:
    """External hold (e.g. the radix cache): refcount += 1 per slot.

    Args:
      slots: [k] ints, each live and not SENTINEL (duplicates hold twice).
    Raises:
      ValueError: a slot is SENTINEL, out of range or not live.
    """
    arr = self._slots(slots, "retain")
    if np.any(arr == SENTINEL):
      raise ValueError("retain: cannot hold the SENTINEL slot")
    self._require_live(arr, "retain")
    np.add.at(self._held, arr, 1)
    np.add.at(self._ref, arr, 1)

  def release(self, slots) -> np.ndarray:
    """Drops external holds taken with `retain`.

    Args:
      slots: [k] ints (duplicates release twice).
    Returns:
      [f] int32 ascending slots whose refcount reached 0.
    Raises:
      ValueError: SENTINEL, out of range, a double free (refcount 0), or more
        releases than holds on a slot (its references are slot maps).
    """
    arr = self._slots(slots, "release")
    if np.any(arr == SENTINEL):
      raise ValueError("release: the SENTINEL slot is never held nor freed")
    uniq, counts = np.unique(arr, return_counts=True)
    bad = self._held[uniq] < counts
    if np.any(bad):
      slot = int(uniq[bad][0])
      if self._ref[slot] == 0:
        raise ValueError(f"release: double free of slot {slot} (refcount 0)")
      raise ValueError(
          f"release: slot {slot} has {int(self._held[slot])} external hold(s) but "
          f"{int(counts[bad][0])} release(s) were asked; its other "
          f"{int(self._ref[slot] - self._held[slot])} reference(s) are slot maps")
    np.subtract.at(self._held, uniq, counts.astype(np.int32))
    return self._decref(arr)

  def evict(self, seq: int, positions) -> np.ndarray:
    """Evicts logical positions of seq: map entries -> SENTINEL, refs dropped.

    Positions never shift. Positions already SENTINEL (and duplicates) are ignored.

    Args:
      seq: a live sequence id.
      positions: [k] ints in [0, length(seq)).
    Returns:
      [f] int32 ascending slots whose refcount reached 0.
    Raises:
      IndexError: a position is out of range.
    """
    s = self._get(seq)
    pos = _int_array(positions, "positions")
    if pos.size == 0:
      return _EMPTY.copy()
    bad = (pos < 0) | (pos >= s.size)
    if np.any(bad):
      raise IndexError(f"evict: position {int(pos[bad][0])} out of range for sequence "
                       f"{seq} of length {s.size}")
    pos = np.unique(pos)
    m = s.map
    slots = m[pos]
    m[pos] = SENTINEL
    return self._decref(slots[slots != SENTINEL])

  def truncate(self, seq: int, length: int) -> np.ndarray:
    """Drops positions >= length (e.g. unused pre-allocated decode slots).

    Args:
      seq: a live sequence id.
      length: new length, 0 <= length <= length(seq).
    Returns:
      [f] int32 ascending slots whose refcount reached 0.
    """
    s = self._get(seq)
    length = _index(length, "length")
    if not 0 <= length <= s.size:
      raise ValueError(f"truncate: length must be in [0, {s.size}] for sequence {seq}, "
                       f"got {length}")
    dropped = s.map[length:].copy()
    s.size = length
    return self._decref(dropped[dropped != SENTINEL])

  def free_sequence(self, seq: int) -> np.ndarray:
    """Drops all of seq's references and forgets it (its tail page included).

    Returns:
      [f] int32 ascending slots whose refcount reached 0.
    """
    s = self._get(seq)
    del self._seqs[seq]
    tail = s.tail_page
    if tail >= 0:
      self._tail_owner[tail] = -1
    m = s.map
    freed = self._decref(m[m != SENTINEL])
    if tail >= 0:
      self._maybe_free_page(tail)
    return freed

  # -------------------------------------------------------------- internals
  def _get(self, seq: int) -> _Sequence:
    key = _index(seq, "seq")
    try:
      return self._seqs[key]
    except KeyError:
      raise KeyError(f"unknown sequence id {key} (never created or already freed)") from None

  def _slot(self, slot: int) -> int:
    slot = _index(slot, "slot")
    if not 0 <= slot < self._num_slots:
      raise ValueError(f"slot {slot} out of range [0, {self._num_slots})")
    return slot

  def _slots(self, slots, what: str) -> np.ndarray:
    arr = _int_array(slots, f"{what}: slots")
    bad = (arr < 0) | (arr >= self._num_slots)
    if np.any(bad):
      raise ValueError(f"{what}: slot {int(arr[bad][0])} out of range [0, {self._num_slots})")
    return arr

  def _require_live(self, slots: np.ndarray, what: str) -> None:
    dead = self._ref[slots] == 0
    if np.any(dead):
      raise ValueError(f"{what}: slot {int(slots[dead][0])} is not live (refcount 0); "
                       f"only allocated slots can be shared")

  def _decref(self, slots: np.ndarray) -> np.ndarray:
    """Drops one reference per entry of `slots` (validated, no SENTINEL).

    Returns [f] int32 ascending slots that reached refcount 0; their pages are
    rolled into their owner's tail or returned to the free list.
    """
    if slots.size == 0:
      return _EMPTY.copy()
    np.subtract.at(self._ref, slots, 1)
    freed = np.unique(slots[self._ref[slots] == 0]).astype(np.int32)
    if freed.size == 0:
      return freed
    ps = self._page_size
    pages = freed // ps
    np.subtract.at(self._page_live, pages, 1)
    self._num_live -= int(freed.size)
    for page in np.unique(pages).tolist():
      owner = int(self._tail_owner[page])
      if owner >= 0:
        self._rollback_tail(self._seqs[owner])
      self._maybe_free_page(page)
    return freed

  def _rollback_tail(self, s: _Sequence) -> None:
    """Returns trailing refcount-0 slots of s's tail page to its unused tail."""
    base = s.tail_page * self._page_size
    while s.tail_next > 0 and self._ref[base + s.tail_next - 1] == 0:
      s.tail_next -= 1

  def _maybe_free_page(self, page: int) -> None:
    if (self._page_live[page] == 0 and self._tail_owner[page] < 0
        and not self._is_free[page]):
      self._free[page // self._shard_pages].append(page)
      self._is_free[page] = True

  # ------------------------------------------------------------------ audit
  def check(self) -> None:
    """Recomputes all bookkeeping from the slot maps and holds.

    Raises:
      AssertionError: with a description of the first inconsistency found.
    """
    ps, num_pages = self._page_size, self._num_pages

    def fail(msg: str):
      raise AssertionError(f"PagedAllocator.check: {msg}")

    expected = self._held.astype(np.int64)
    if np.any(self._held < 0):
      fail(f"negative external holds on slots {np.flatnonzero(self._held < 0)[:8].tolist()}")
    for seq, s in self._seqs.items():
      m = s.map
      if np.any((m < 0) | (m >= self._num_slots)):
        fail(f"sequence {seq} maps to out-of-range slots")
      np.add.at(expected, m[m != SENTINEL], 1)
    reserved = np.zeros((num_pages,), bool)
    reserved[::self._shard_pages] = True
    by_page = lambda x: x.reshape(num_pages, ps)
    if np.any(by_page(expected)[reserved] != 0) or np.any(by_page(self._ref)[reserved] != 0):
      fail("a reserved page (page 0, or a shard's first page) is referenced")
    diff = np.flatnonzero(expected != self._ref)
    if diff.size:
      slot = int(diff[0])
      fail(f"refcount mismatch on {diff.size} slot(s), first slot {slot}: stored "
           f"{int(self._ref[slot])}, recomputed {int(expected[slot])} (slot maps + "
           f"{int(self._held[slot])} external hold(s))")
    live = (self._ref > 0).reshape(num_pages, ps).sum(axis=1)
    if np.any(live != self._page_live):
      page = int(np.flatnonzero(live != self._page_live)[0])
      fail(f"page {page} live count stored {int(self._page_live[page])}, "
           f"recomputed {int(live[page])}")
    if int(live.sum()) != self._num_live:
      fail(f"num_live_slots is {self._num_live}, recomputed {int(live.sum())}")
    free = [p for f in self._free for p in f]
    if len(set(free)) != len(free):
      fail(f"duplicate pages in the free list {sorted(free)}")
    if any(not 0 <= p < num_pages or reserved[p] for p in free):
      fail(f"free list holds a reserved or out-of-range page: {sorted(free)}")
    for d, f in enumerate(self._free):
      if any(p // self._shard_pages != d for p in f):
        fail(f"shard {d}'s free list holds another shard's page: {sorted(f)}")
    is_free = np.zeros((num_pages,), bool)
    is_free[free] = True
    if np.any(is_free != self._is_free):
      fail("free-page mask disagrees with the free list")
    tails = np.full((num_pages,), -1, np.int64)
    for seq, s in self._seqs.items():
      if s.tail_page < 0:
        continue
      p, nxt = s.tail_page, s.tail_next
      if not 0 <= p < num_pages or reserved[p] or not 0 <= nxt < ps:
        fail(f"sequence {seq} has a bad tail (page {p}, next offset {nxt})")
      if tails[p] >= 0:
        fail(f"page {p} is the tail page of sequences {int(tails[p])} and {seq}")
      tails[p] = seq
      if np.any(self._ref[p * ps + nxt:(p + 1) * ps] != 0):
        fail(f"sequence {seq}'s unused tail (page {p} from offset {nxt}) has live slots")
      if nxt > 0 and self._ref[p * ps + nxt - 1] == 0:
        fail(f"sequence {seq}'s tail page {p} was not rolled back past dead slot "
             f"{p * ps + nxt - 1}")
    if np.any(tails != self._tail_owner):
      page = int(np.flatnonzero(tails != self._tail_owner)[0])
      fail(f"tail owner of page {page} is stored {int(self._tail_owner[page])}, "
           f"recomputed {int(tails[page])}")
    for p in free:
      if live[p]:
        fail(f"free page {p} has {int(live[p])} live slot(s)")
      if tails[p] >= 0:
        fail(f"free page {p} is the tail page of sequence {int(tails[p])}")
    in_use = (live > 0) | (tails >= 0)
    leaked = np.flatnonzero(~in_use & ~is_free & ~reserved)
    if leaked.size:
      fail(f"pages {leaked.tolist()} are neither free nor in use (leak)")
