"""The host-resident segment store (seed 002, sections 3.2 and 3.5).

A `Segment` is a contiguous token run of a served prompt with what reusing it
needs: its ids, the exemplar's full left context (ids, for the exact tier and
the depth guard), the positions its keys were rotated to, per-layer post-RoPE K
and V (regime A: every layer; B: layers < L_reuse), the hidden state entering
every multicut boundary layer, and the fingerprint of what produced them. A run
that role adapters computed decoupled (LRAgent's base + low-rank form) also keeps
its low-rank values x A_v s per layer (`vlr`).

Accounting is d_kv-correct (the critique's point): a token costs
2 * L_kv * d_kv values of K/V plus d_model per stored boundary, at the storage
width (`jaxkv.kv.quant`; int8 = 1 byte + a float16 scale per group), plus 4
bytes per id. The store keeps at most `byte_budget` bytes, evicting the least
recently used segments; `on_evict` tells the index.

Integrity: every segment carries a CRC32 of its arrays, checked before it is
spliced, and a `Fingerprint` (model, tokenizer, RoPE, adapter). A segment that
fails either is refused with the reason, never spliced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from jaxkv.kv.quant import Packed


@dataclasses.dataclass(frozen=True)
class Fingerprint:
  """What must match for stored K/V to be valid (seed 002, section 3.2 metadata)."""
  model: str        # architecture + a digest of the weights
  tokenizer: str
  rope: str         # RoPE kind, base, scaling and head_dim
  adapter: str = "base"

  def mismatch(self, other: Fingerprint) -> str | None:
    """The first field that differs, as a reason, or None."""
    for f in dataclasses.fields(self):
      a, b = getattr(self, f.name), getattr(other, f.name)
      if a != b:
        return f"{f.name} differs (stored {a[:12]}, runner {b[:12]})"
    return None


def digest(*parts) -> str:
  h = hashlib.sha256()
  for p in parts:
    h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
  return h.hexdigest()


def fingerprint(model_cfg, weights_sample: np.ndarray, tokenizer_key: str,
                adapter: str = "base") -> Fingerprint:
  """Fingerprint of a model config, a sample of its weights (the first embedding
  rows are enough to tell checkpoints apart), a tokenizer and an adapter."""
  cfg = dataclasses.asdict(model_cfg)
  rope = cfg.pop("rope")
  return Fingerprint(
      model=digest(cfg, np.ascontiguousarray(weights_sample, np.float32).tobytes()),
      tokenizer=tokenizer_key, rope=digest(rope, model_cfg.head_dim), adapter=adapter)


@dataclasses.dataclass
class Segment:
  """One stored run of tokens (host numpy; see the module docstring)."""
  ids: np.ndarray                  # [n] int32
  left: np.ndarray                 # [m] int32 the exemplar's ids before the run
  positions: np.ndarray            # [n] int32 positions the keys were rotated to
  k: Packed                        # [L_kv, n, Hkv, D]
  v: Packed                        # [L_kv, n, Hkv, D]
  hidden: dict[int, Packed]        # boundary layer b -> [n, d_model] entering b
  fingerprint: Fingerprint
  structural: bool = True          # a structural span (indexed whole) or a gap region
  exact: bool = True               # False: computed after approximately reused K/V, so
                                   # not the exact function of its left context
  vlr: Packed | None = None        # [L_kv, n, r] LoRA low-rank values x A_v s of role
                                   # adapter rows run decoupled (LRAgent), else None
  crc: int = 0

  @property
  def n(self) -> int:
    return int(self.ids.size)

  @property
  def kv_layers(self) -> int:
    return int(self.k.q.shape[0])

  @property
  def nbytes(self) -> int:
    return (self.k.nbytes + self.v.nbytes + sum(h.nbytes for h in self.hidden.values())
            + (0 if self.vlr is None else self.vlr.nbytes) + self.ids.nbytes
            + self.left.nbytes + self.positions.nbytes)

  def checksum(self) -> int:
    c = 0
    arrays = [self.ids, self.positions, self.k.q, self.v.q]
    arrays += [x for x in (self.k.scale, self.v.scale) if x is not None]
    if self.vlr is not None:
      arrays += [self.vlr.q] + ([self.vlr.scale] if self.vlr.scale is not None else [])
    for b in sorted(self.hidden):
      arrays += [self.hidden[b].q] + ([self.hidden[b].scale]
                                      if self.hidden[b].scale is not None else [])
    for a in arrays:
      c = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), c)
    return c

  def seal(self) -> Segment:
    self.crc = self.checksum()
    return self

  def problem(self, fp: Fingerprint) -> str | None:
    """Why this segment must not be spliced by a runner with fingerprint `fp`
    (None: it may)."""
    why = self.fingerprint.mismatch(fp)
    if why is not None:
      return why
    if self.checksum() != self.crc:
      return "corrupt (checksum mismatch)"
    if self.k.q.shape[1] != self.n or self.v.q.shape != self.k.q.shape:
      return "corrupt (shapes disagree)"
    if self.vlr is not None and self.vlr.q.shape[:2] != self.k.q.shape[:2]:
      return "corrupt (low-rank values disagree)"
    return None

  def rows(self, lo: int, hi: int) -> Segment:
    """The run [lo, hi) as a segment view (left context extended by ids[:lo])."""
    return dataclasses.replace(
        self, ids=self.ids[lo:hi], left=np.concatenate([self.left, self.ids[:lo]]),
        positions=self.positions[lo:hi], k=self.k.rows(1, lo, hi), v=self.v.rows(1, lo, hi),
        hidden={b: h.rows(0, lo, hi) for b, h in self.hidden.items()},
        vlr=None if self.vlr is None else self.vlr.rows(1, lo, hi))


@dataclasses.dataclass(frozen=True)
class BreakEven:
  """Seed 002's break-even point for one segment on given hardware."""
  saved_s: float       # prefill time a hit saves (the layers it skips)
  hit_s: float         # what a hit costs: host -> device bytes (+ probe, re-rotation)
  store_s: float       # what storing costs once: device -> host bytes
  reuses: float        # hits needed to pay for storing it (inf: a hit never pays)


def break_even(seg: Segment, layers_skipped: int, flops_per_token_layer: float, *,
               flops_per_s: float, bytes_per_s: float, probe_s: float = 0.0) -> BreakEven:
  """Reuses needed before storing `seg` pays off: store_s / (saved_s - hit_s).

  saved_s: the skipped layers' FLOPs (2 x params per token and layer plus
  attention, from the caller) at `flops_per_s`; hit_s and store_s: the
  segment's bytes over the host link at `bytes_per_s`, plus the probe if any.
  """
  saved = seg.n * layers_skipped * flops_per_token_layer / flops_per_s
  moved = seg.nbytes / bytes_per_s
  hit = moved + probe_s
  reuses = moved / (saved - hit) if saved > hit else float("inf")
  return BreakEven(saved_s=saved, hit_s=hit, store_s=moved, reuses=reuses)


class SegmentStore:
  """Segments under a byte budget, least recently used evicted first."""

  def __init__(self, byte_budget: int, on_evict: Callable[[int], None] | None = None):
    self.budget = int(byte_budget)
    self.on_evict = on_evict
    self._segs: OrderedDict[int, Segment] = OrderedDict()
    self._next = 0
    self.nbytes = 0
    self.evictions = 0

  def __len__(self) -> int:
    return len(self._segs)

  def __contains__(self, key: int) -> bool:
    return key in self._segs

  def keys(self) -> list[int]:
    return list(self._segs)

  def put(self, seg: Segment) -> int | None:
    """Stores a sealed segment; returns its key, or None if it alone exceeds the
    budget. Evicts LRU segments until it fits."""
    size = seg.nbytes
    if size > self.budget:
      return None
    while self.nbytes + size > self.budget:
      self._evict_one()
    key, self._next = self._next, self._next + 1
    self._segs[key] = seg
    self.nbytes += size
    return key

  def get(self, key: int) -> Segment:
    """The segment, now the most recently used."""
    self._segs.move_to_end(key)
    return self._segs[key]

  def peek(self, key: int) -> Segment:
    """The segment, its LRU position unchanged."""
    return self._segs[key]

  def remove(self, key: int) -> None:
    seg = self._segs.pop(key)
    self.nbytes -= seg.nbytes
    if self.on_evict is not None:
      self.on_evict(key)

  def _evict_one(self) -> None:
    key = next(iter(self._segs))
    self.remove(key)
    self.evictions += 1

  def check(self) -> None:
    """Raises AssertionError if the byte count or the budget is off."""
    total = sum(s.nbytes for s in self._segs.values())
    assert total == self.nbytes, f"store counts {self.nbytes} bytes, holds {total}"
    assert self.nbytes <= self.budget, f"store holds {self.nbytes} > budget {self.budget}"
