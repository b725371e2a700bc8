"""Segment discovery and the MinHash/LSH index of stored segments (seed 002,
section 3.1).

Discovery. A prompt is cut into structural spans (tool schemas, system sections,
tool outputs, documents: the caller passes their token ranges, e.g. from
`structural_spans`) and overlapping windows of `window` tokens. Window starts
are content-defined: winnowing picks, in every run of 2 * stride - 1 canonical
k-grams, the one with the smallest hash (`anchors`; mean spacing `stride`, at
most 2 * stride - 1). The same text therefore gets the same windows wherever it
sits in a prompt, which fixed-offset windows would not:
two 96-token windows offset by 24 tokens share only ~57% of their shingles,
below any useful LSH threshold.

Canonicalisation (index keys only; cached tensors always belong to the original
token ids): each token id maps to its decoded text, lower-cased and stripped,
with digits masked to 0 (timestamps, IDs); whitespace-only tokens drop out.
Shingles are k consecutive canonical tokens; MinHash and MinHash-LSH come from
`datasketch`.

Matching. An LSH hit only says a prompt window resembles part of a stored
segment. `align` then finds the shared diagonal from exact k-gram hits and
extends it to the maximal run of identical token ids: only identical ids are
ever spliced, so canonicalisation can never splice a different token. The
left-context match length m (identical tokens right before the run in the
prompt and in the segment's own exemplar) rides along for the depth guard.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Sequence

import numpy as np
from datasketch import MinHash, MinHashLSH

from jaxkv.config import ReuseConfig

_DIGITS = re.compile(r"\d")
_TEXT_CACHE: dict[int, list[str]] = {}
_CANON_CACHE: dict[int, list[str | None]] = {}


def _token_texts(tokenizer) -> list[str]:
  """Every token id's decoded text (a decode per vocabulary entry, ~1 s, cached)."""
  key = id(tokenizer)
  if key not in _TEXT_CACHE:
    _TEXT_CACHE[key] = [tokenizer.decode([i], skip_special_tokens=False)
                        for i in range(tokenizer.vocab_size)]
  return _TEXT_CACHE[key]


def canonical_table(tokenizer) -> list[str | None]:
  """Per token id its canonical string (None: whitespace only), cached per tokenizer."""
  key = id(tokenizer)
  if key not in _CANON_CACHE:
    _CANON_CACHE[key] = [_DIGITS.sub("0", t.strip().lower()) or None
                         for t in _token_texts(tokenizer)]
  return _CANON_CACHE[key]


def line_spans(ids, tokenizer, min_tokens: int = 1) -> list[tuple[int, int]]:
  """Structural spans of a prompt known only by its ids: the runs between tokens
  that contain a line break (one tool schema, document line or message line
  each), at least `min_tokens` long. What the runner uses when the caller gives
  no spans (serve.py's reuse mode)."""
  texts = _token_texts(tokenizer)
  ids = np.asarray(ids)
  brk = np.asarray([0 <= t < len(texts) and "\n" in texts[t] for t in ids.tolist()], bool)
  edges = np.flatnonzero(np.diff(np.r_[1, brk.astype(np.int8), 1]))
  return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]) if b - a >= min_tokens]


def canonical(ids, table: Sequence[str | None]) -> tuple[list[str], np.ndarray]:
  """(canonical strings, their token indices) of ids, whitespace dropped."""
  out, where = [], []
  for i, t in enumerate(np.asarray(ids).tolist()):
    s = table[t] if 0 <= t < len(table) else f"<{t}>"
    if s is not None:
      out.append(s)
      where.append(i)
  return out, np.asarray(where, np.int64)


def shingles(canon: Sequence[str], k: int) -> list[bytes]:
  """k consecutive canonical tokens, joined (one shingle if there are fewer)."""
  if len(canon) <= k:
    return [" ".join(canon).encode()] if canon else []
  return [" ".join(canon[i:i + k]).encode() for i in range(len(canon) - k + 1)]


def minhash(shings: Sequence[bytes], num_perm: int) -> MinHash:
  m = MinHash(num_perm=num_perm, seed=1)
  if shings:
    m.update_batch(list(shings))
  return m


def anchors(ids, table, cfg: ReuseConfig) -> np.ndarray:
  """Content-defined window starts (token indices into ids): winnowing
  (Schleimer et al., 2003) over the canonical k-gram hashes. In every run of
  w = 2 * stride - 1 consecutive k-grams the one with the smallest hash is an
  anchor (the rightmost on ties), so anchors are ~stride apart on average
  (density 2 / (w + 1)), never more than w apart, and whether a k-gram is an
  anchor depends only on the k-grams within w of it: text more than
  k + w - 2 tokens past a change gets the same anchors wherever it sits. The
  first k-gram is an anchor too, so the text's start is covered."""
  canon, where = canonical(ids, table)
  k = cfg.shingle
  n = len(canon) - k + 1
  if n <= 0:
    return np.zeros(0, np.int64)
  h = np.asarray([zlib.crc32(" ".join(canon[j:j + k]).encode()) for j in range(n)], np.int64)
  w = min(2 * cfg.stride - 1, n)
  view = np.lib.stride_tricks.sliding_window_view(h, w)
  # rightmost minimum of each run of w hashes, and the first k-gram: without it the
  # text before the first minimum (up to w - 1 k-grams) would lie in no window
  pick = np.arange(view.shape[0]) + (w - 1 - np.argmin(view[:, ::-1], axis=1))
  return where[np.unique(np.r_[0, pick])].astype(np.int64)


def windows(ids, table, cfg: ReuseConfig, lo: int = 0, hi: int | None = None):
  """[(start, end)] content-defined windows of ids[lo:hi], in prompt indices."""
  hi = len(ids) if hi is None else hi
  starts = anchors(np.asarray(ids)[lo:hi], table, cfg) + lo
  return [(int(s), int(min(s + cfg.window, hi))) for s in starts
          if min(s + cfg.window, hi) - s >= cfg.min_tokens]


def structural_spans(tokenizer, text: str, pieces: Sequence[str]) -> list[tuple[int, int]]:
  """Token ranges of `pieces` (tool schemas, message contents, documents) found in
  the rendered prompt `text`: the tokens lying wholly inside each piece's first
  occurrence at or after the previous piece."""
  _, offsets = tokenizer.encode_with_offsets(text)
  starts = np.asarray([o[0] for o in offsets])
  ends = np.asarray([o[1] for o in offsets])
  spans, at = [], 0
  for piece in pieces:
    c0 = text.find(piece, at) if piece else -1
    if c0 < 0:
      continue
    c1 = c0 + len(piece)
    inside = np.nonzero((starts >= c0) & (ends <= c1) & (ends > starts))[0]
    if inside.size:
      spans.append((int(inside[0]), int(inside[-1]) + 1))
    at = c1
  return spans


@dataclasses.dataclass(frozen=True)
class Match:
  """prompt[p_lo:p_lo + n] == segment[key].ids[s_lo:s_lo + n] (identical ids)."""
  key: int
  p_lo: int
  s_lo: int
  n: int
  ctx_match: int    # identical tokens right before the run (prompt vs exemplar)
  ctx_jaccard: float  # MinHash Jaccard of the W_ctx canonical contexts


def common_suffix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common suffix of two id arrays."""
  n = min(a.size, b.size)
  if n == 0:
    return 0
  neq = np.nonzero(a[a.size - n:][::-1] != b[b.size - n:][::-1])[0]
  return int(neq[0]) if neq.size else n


def align(prompt: np.ndarray, p_lo: int, p_hi: int, seg: np.ndarray, s_lo: int, s_hi: int,
          k: int, min_tokens: int) -> tuple[int, int, int] | None:
  """The maximal run of identical ids shared by prompt and seg on the diagonal
  that the exact k-grams of prompt[p_lo:p_hi] and seg[s_lo:s_hi] agree on most:
  (p_start, s_start, n), or None when no run of min_tokens exists."""
  k = max(1, min(k, p_hi - p_lo, s_hi - s_lo))
  grams: dict[bytes, int] = {}
  for s in range(s_lo, s_hi - k + 1):
    grams.setdefault(seg[s:s + k].tobytes(), s)
  votes: dict[int, int] = {}
  for p in range(p_lo, p_hi - k + 1):
    s = grams.get(prompt[p:p + k].tobytes())
    if s is not None:
      votes[p - s] = votes.get(p - s, 0) + 1
  if not votes:
    return None
  d = max(votes, key=votes.get)                      # p = s + d
  t0, t1 = max(0, d), min(prompt.size, seg.size + d)
  eq = prompt[t0:t1] == seg[t0 - d:t1 - d]
  # the run through the window's best-agreeing part
  centre = min(max((p_lo + p_hi) // 2, t0), t1 - 1)
  if not eq[centre - t0]:
    hits = np.nonzero(eq[max(p_lo, t0) - t0:min(p_hi, t1) - t0])[0]
    if not hits.size:
      return None
    centre = max(p_lo, t0) + int(hits[0])
  c = centre - t0
  false = np.nonzero(~eq)[0]
  lo = int(false[false < c].max()) + 1 if np.any(false < c) else 0
  hi = int(false[false > c].min()) if np.any(false > c) else eq.size
  if hi - lo < min_tokens:
    return None
  return t0 + lo, t0 + lo - d, hi - lo


class SegmentIndex:
  """MinHash-LSH over the windows (and whole structural spans) of stored segments.

  Keys are (segment key, lo, hi) ranges of a segment; `query` returns the
  candidate ranges for one prompt window. Thread-unsafe, host-side.
  """

  def __init__(self, cfg: ReuseConfig, table: Sequence[str | None]):
    self.cfg, self.table = cfg, table
    self.lsh = MinHashLSH(threshold=cfg.seg_threshold, num_perm=cfg.num_perm)
    self._keys: dict[int, list[tuple[int, int, int]]] = {}

  def __len__(self) -> int:
    return sum(len(v) for v in self._keys.values())

  def signature(self, ids) -> MinHash:
    return minhash(shingles(canonical(ids, self.table)[0], self.cfg.shingle), self.cfg.num_perm)

  def add(self, key: int, ids, whole: bool = True) -> int:
    """Indexes segment `key` (its token ids): every window, and the whole span
    when `whole` (a structural span). Returns the number of index keys."""
    ids = np.asarray(ids)
    ranges = set(windows(ids, self.table, self.cfg))
    if whole or not ranges:
      ranges.add((0, ids.size))
    entries = []
    for lo, hi in sorted(ranges):
      name = (key, lo, hi)
      self.lsh.insert(name, self.signature(ids[lo:hi]), check_duplication=False)
      entries.append(name)
    self._keys[key] = entries
    return len(entries)

  def remove(self, key: int) -> None:
    for name in self._keys.pop(key, []):
      self.lsh.remove(name)

  def query(self, ids) -> list[tuple[int, int, int]]:
    """(segment key, lo, hi) ranges whose signature passes tau_seg against ids."""
    return list(self.lsh.query(self.signature(ids)))

  def find(self, prompt, spans: Sequence[tuple[int, int]], lookup, lo: int = 0) -> list[Match]:
    """Matches of stored segments in prompt[lo:], non-overlapping, longest first.

    Args:
      prompt: the prompt's token ids.
      spans: structural spans (prompt index ranges) queried whole, besides the
        content-defined windows.
      lookup: key -> the stored segment (its `.ids`, and `.left`, the exemplar's
        left context, for the context match), e.g. `SegmentStore.peek`; None skips
        the key (a segment the caller may not splice).
      lo: tokens before lo are already served (a radix prefix hit).
    """
    prompt = np.asarray(prompt, np.int32)
    queries = set(windows(prompt, self.table, self.cfg, lo))
    queries |= {(max(a, lo), b) for a, b in spans if b - max(a, lo) >= self.cfg.min_tokens}
    found: dict[tuple[int, int, int], Match] = {}
    for p0, p1 in sorted(queries):
      for key, s0, s1 in self.query(prompt[p0:p1]):
        seg = lookup(key)
        if seg is None:                              # not this caller's to splice
          continue
        run = align(prompt, p0, p1, seg.ids, s0, s1, self.cfg.shingle, self.cfg.min_tokens)
        if run is None:
          continue
        ps, ss, n = run
        if ps < lo:                                  # trim what the prefix hit covers
          ss, n, ps = ss + lo - ps, n - (lo - ps), lo
        if n < self.cfg.min_tokens or (key, ps, ss) in found:
          continue
        found[(key, ps, ss)] = self._match(prompt, key, ps, ss, n, seg)
    chosen = select_matches(list(found.values()), self.cfg.min_tokens)
    return [m if m.ctx_match >= 0 else                 # trimmed: its context changed
            self._match(prompt, m.key, m.p_lo, m.s_lo, m.n, lookup(m.key)) for m in chosen]

  def _match(self, prompt, key, ps, ss, n, seg) -> Match:
    ctx_seg = np.concatenate([np.asarray(seg.left, np.int32), np.asarray(seg.ids[:ss], np.int32)])
    m = common_suffix(prompt[:ps], ctx_seg)
    w = self.cfg.ctx_window
    a, b = self.signature(prompt[max(0, ps - w):ps]), self.signature(ctx_seg[-w:])
    jac = 1.0 if ps == 0 and ctx_seg.size == 0 else float(a.jaccard(b))
    return Match(key=key, p_lo=ps, s_lo=ss, n=n, ctx_match=m, ctx_jaccard=jac)


def select_matches(matches: list[Match], min_tokens: int) -> list[Match]:
  """Greedy non-overlapping cover of the prompt: longest runs first (ties: the
  longer exact left context), each trimmed to the part still free; sorted by
  prompt position."""
  taken = []                                          # (p_lo, p_hi)
  out = []
  for m in sorted(matches, key=lambda m: (-m.n, -m.ctx_match, m.key)):
    lo, hi = m.p_lo, m.p_lo + m.n
    for a, b in taken:                               # trim against earlier picks
      if a <= lo < b:
        lo = b
      if a < hi <= b:
        hi = a
    if hi - lo < min_tokens or any(lo < b and a < hi for a, b in taken):
      continue
    if lo != m.p_lo:      # the trimmed run starts later: its context is measured again
      m = dataclasses.replace(m, p_lo=lo, s_lo=m.s_lo + lo - m.p_lo, ctx_match=-1)
    out.append(dataclasses.replace(m, n=hi - lo))
    taken.append((lo, hi))
  return sorted(out, key=lambda m: m.p_lo)
