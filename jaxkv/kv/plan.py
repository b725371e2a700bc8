"""Host-side shapes of device steps: one bucketing policy, one chunk planner and
one slot-map builder, shared by every runner (engine, sessions, agents, feature
extraction, training).

Bucketing bounds recompilation: a jitted step compiles once per padded shape,
so lengths are rounded up to powers of two from `lo` up to `fine` (or to
multiples of `step` when given), then to multiples of `fine`. Chunk lengths
use multiples of 16 up to 128, then of 128: a chunk's cost is its padded token
count (prefill is compute-bound: on XLA:CPU a 37-token prompt ran 107-122 ms
padded to 64 and 86-102 ms padded to 48, SmolLM2), and a chunk step compiles
in 2-3 s. Slot-map widths use powers of two up to 512, then multiples of 512
(the reference attention is dense over the width, so a tight width is worth a
few more compiles than powers of two would cost).

A chunk covers, for every row of a batch, that row's next tokens (ragged: rows
advance through their own token lists); padding has position -1, which every
step treats as "no token" (nothing written, nothing attended from).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from jaxkv.config import PAGE_SIZE
from jaxkv.kv.state import SENTINEL

CHUNK_LO, CHUNK_FINE = 16, 128     # chunk lengths: 16, 32, 48, ..., 128, 256, 384, ...
WIDTH_LO, WIDTH_FINE = 128, 512    # slot-map widths: 128, 256, 512, 1024, 1536, ...

__all__ = [
  "PAGE_SIZE",
  "Chunk",
  "Row",
  "bucket",
  "chunk_len",
  "contiguous_slots",
  "plan_chunks",
  "prompt_ids",
  "slot_rows",
  "width",
]


def bucket(n: int, lo: int, fine: int, hi: int | None = None, step: int | None = None) -> int:
  """Powers of two >= lo (multiples of `step` >= lo, if given) up to `fine`, then
  multiples of `fine`; capped at hi (n itself when n > hi, so a caller never gets
  less than it asked for)."""
  n = int(n)
  if n > fine:
    b = -(-n // fine) * fine
  elif step:
    b = max(lo, -(-n // step) * step)
  else:
    b = max(lo, 1 << max(0, n - 1).bit_length())
  if hi is not None:
    b = min(b, max(hi, n))
  return b


def prompt_ids(ids, max_len: int) -> np.ndarray:
  """ids as int32, or a ValueError when empty or not shorter than max_len."""
  ids = np.asarray(ids, np.int32)
  if ids.size < 1:
    raise ValueError("empty prompt")
  if ids.size >= max_len:
    raise ValueError(f"prompt of {ids.size} tokens does not fit the cache's max_seq_len "
                     f"{max_len}")
  return ids


def chunk_len(n: int, hi: int | None = None) -> int:
  """Padded chunk length for n tokens."""
  return bucket(n, CHUNK_LO, CHUNK_FINE, hi, step=CHUNK_LO)


def width(n: int, hi: int | None = None) -> int:
  """Padded slot-map width for logical positions [0, n)."""
  return bucket(n, WIDTH_LO, WIDTH_FINE, hi)


@dataclasses.dataclass(frozen=True)
class Row:
  """One row's tokens still to run: ids[k] sits at logical position start + k."""
  ids: np.ndarray
  start: int = 0


@dataclasses.dataclass
class Chunk:
  """One padded chunk of a batch (numpy; the driver moves it to the device)."""
  tokens: np.ndarray      # [B, C] int32
  positions: np.ndarray   # [B, C] int32, -1 on padding
  lo: np.ndarray          # [B] int32 index into each row's ids where the chunk starts
  count: np.ndarray       # [B] int32 valid tokens per row (0: the row sits this one out)
  ends: np.ndarray        # [B] bool: the row's last token is in this chunk
  need: int               # max position + 1 over the batch (slot-map width to cover)
  index: int              # chunk number in the plan

  @property
  def last(self) -> np.ndarray:
    """[B] int32 chunk index of each row's last valid token (0 for idle rows)."""
    return np.maximum(self.count - 1, 0).astype(np.int32)


def plan_chunks(rows: Sequence[Row | None], chunk: int, *,
                cuts: Sequence[int] | None = None) -> Iterator[Chunk]:
  """Chunks covering every row's ids, at most `chunk` tokens per row each.

  Each chunk's length is `chunk_len` of the longest remaining piece (capped at
  `chunk`), so ragged rows share one padded shape. `cuts` (one row only) gives
  explicit boundaries instead, e.g. to keep a query span in one chunk; a piece
  between two cuts may then exceed `chunk`.
  """
  b = len(rows)
  done = np.zeros(b, np.int64)
  total = np.asarray([0 if r is None else len(r.ids) for r in rows], np.int64)
  if cuts is not None:
    if b != 1:
      raise ValueError("explicit chunk cuts take one row")
    cuts = [int(c) for c in cuts]
    if cuts[0] != 0 or cuts[-1] != total[0] or any(x >= y for x, y in itertools.pairwise(cuts)):
      raise ValueError(f"cuts must rise strictly from 0 to {total[0]}, got {cuts}")
  index = 0
  while np.any(done < total):
    if cuts is not None:
      take = np.asarray([cuts[index + 1] - cuts[index]])
      c = chunk_len(int(take[0]))
    else:
      take = np.minimum(total - done, chunk)
      c = chunk_len(int(take.max()), chunk)
    tokens = np.zeros((b, c), np.int32)
    positions = np.full((b, c), -1, np.int32)
    need = 0
    for i, r in enumerate(rows):
      if r is None or take[i] == 0:
        continue
      lo, n = int(done[i]), int(take[i])
      tokens[i, :n] = r.ids[lo:lo + n]
      positions[i, :n] = r.start + lo + np.arange(n)
      need = max(need, r.start + lo + n)
    ends = (take > 0) & (done + take == total)
    yield Chunk(tokens=tokens, positions=positions, lo=done.astype(np.int32),
                count=take.astype(np.int32), ends=ends, need=need, index=index)
    done = done + take
    index += 1


def slot_rows(maps: Sequence[np.ndarray | None], width: int) -> np.ndarray:
  """[B, width] int32 slot map: row i holds maps[i] at the front, SENTINEL after
  (and everywhere for a None row). Longer maps are cut at `width`."""
  out = np.full((len(maps), width), SENTINEL, np.int32)
  for i, m in enumerate(maps):
    if m is not None:
      m = np.asarray(m)[:width]
      out[i, :m.size] = m
  return out


def contiguous_slots(first: int, positions) -> np.ndarray:
  """Slots of a region laid out contiguously from slot `first` (no allocator:
  scratch pools, LRAgent's per-agent regions, feature extraction)."""
  return (int(first) + np.asarray(positions)).astype(np.int32)
