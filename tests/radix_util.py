"""Helpers of the radix-cache tests (tests/test_radix.py, tests/test_radix_machine.py)."""

from __future__ import annotations

import numpy as np

from jaxkv.kv.allocator import PagedAllocator
from jaxkv.kv.radix import RadixCache


def new_seq(a: PagedAllocator, n: int) -> tuple[int, np.ndarray]:
  """A new sequence with n slots: (id, its slots)."""
  s = a.new_sequence()
  return s, a.extend(s, n)


def cached_entries(cache: RadixCache) -> dict[tuple, int]:
  """{token prefix: slot of its last token} for every cached prefix."""
  out = {}
  for toks, slots in cache.paths():
    toks = tuple(toks.tolist())
    for i, slot in enumerate(slots.tolist()):
      assert out.setdefault(toks[:i + 1], slot) == slot
  return out


def free_slot_set(a: PagedAllocator) -> set[int]:
  """Every slot of the allocator's free pages."""
  ps = a.page_size
  return {p * ps + j for p in a.free_pages().tolist() for j in range(ps)}
