"""Cross-prompt segment reuse as an engine mechanism.

A request named `mechanism="reuse"` runs in an ordinary batch row: the reuse radix
tree's longest cached exact prefix is adopted at admission (`match`, locked), then
`ReuseRunner.prefill_into` plans and runs the rest of the prompt over the row's
slots (segments of earlier prompts found in the store, admitted to a tier, spliced
at their new positions with delta-RoPE, the rest computed with its per-layer
recompute set) and returns the last token's logits. The engine samples the first
token and decodes the row with the batch (the spliced K/V sit at their true
positions, so the decode view is the row's own slot map). After the first token
(`after_prefill`) the exact prefix goes into the radix tree and the prompt's fully
computed runs into the segment store, as the runner does off the critical path.

The plan spans layers (a token may be computed from layer r on only): each layer
pass runs the prompt's rest in pieces of the engine's `prefill_chunk` tokens, one
piece per engine step (the rows decoding beside it wait one piece at a time, as
beside a plain row's chunked prefill; the pieces are exact, so the result equals
the runner's one call per pass). A long prompt mostly found in the store or the
radix tree computes only its rest. Rows admitted together prefill one after another
(`serial_prefill`: each sees what the rows before it stored, as the runner does one
request at a time) unless the later row's part to plan shares no run of `min_tokens`
tokens with the earlier row's computed part and the store has room for all the
earlier row could store (`may_overlap`): then nothing the earlier one stores can
change the later one's plan, and they prefill side by side. The `ReuseRunner` holds the
store, the index and the fingerprint; this file holds no state of its own but the
counters.

`Request.context`: {"spans": [(lo, hi), ...]} the prompt's structural spans (tool
schemas, documents); missing or None: the prompt's lines (`index.line_spans`).
Inside a composition (`composed`, e.g. a pruned session's turns: `["pruned", "reuse"]`)
reuse is the planner: the layout (pruning's radix tree, holes and all) adopts the
session's prefix, reuse plans the rest of the prompt up to the part whose queries a
scorer reads (`plan_prefill`: that tail is computed through every layer after the
plan, exactly), stores its computed runs after the first token, and inserts nothing
in its own radix tree: the layout caches the row, from its first approximately reused
position on under private keys (`Row.private_from`), so only the session itself
adopts that KV again. Nothing is spliced inside the system prompt sessions share
(`reuse_from`): its path stays exact for the next session. On role agents' rows
(`["agents", "reuse"]`) every pass runs the row's role adapter, and only segments of
the KV form the roles write are spliced and stored (the layout's `adapter_of`). Runs
stored after one of the session's holes or inside its private suffix attended to KV a
plain prefill would not have: stored as not exact.

Two keys serve evaluation (bench/reuse.py drives the engine with them; a server never
sets them): "cache": False leaves the radix tree and the store as they were (no prefix
inserted, no run stored), so a teacher-forced twin of a request plans exactly as the
request itself; "evaluate": True puts the runner's `Prefill` record (plan, tiers,
FLOPs, bytes spliced, first-token logits) in `Result.extra["prefill"]`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.engine.mechanisms import Match, Mechanism
from jaxkv.kv.state import SENTINEL


@dataclasses.dataclass
class _Turn:
  lock: object = None           # the reuse radix tree's lock on the adopted prefix
  pre: object = None            # the runner's `Prefill`
  grams: set | None = None      # the min_tokens-grams of prompt[cached:] (`may_overlap`)
  overlap: dict = dataclasses.field(default_factory=dict)   # earlier row id -> may overlap


def _grams(ids: np.ndarray, lo: int, k: int) -> set[bytes]:
  """The k-token windows of ids[lo:] (as bytes)."""
  ids = np.ascontiguousarray(ids[lo:], np.int32)
  if ids.size < k:
    return set()
  win = np.lib.stride_tricks.sliding_window_view(ids, k)
  return {w.tobytes() for w in win}


class Reuse(Mechanism):
  """Segment reuse in the engine (module docstring). `runner`: a `ReuseRunner` on the
  engine's KV manager (`kv=engine.kv_manager`)."""

  name = "reuse"
  owns_prefill = True
  plans_on_adapters = True   # in a composition with agents: the row's role adapter
  # a prompt reuses what the prompts admitted before it stored; one that shares no
  # spliceable run with them prefills beside them (`may_overlap`)
  serial_prefill = True
  metrics = (
      ("jaxkv_reuse_reused_tokens_total", "reused_tokens",
       "prompt tokens spliced from stored segments"),
      ("jaxkv_reuse_prefix_tokens_total", "prefix_tokens",
       "prompt tokens adopted from the reuse prefix cache"))

  def __init__(self, runner):
    self.runner = runner
    # counters for /metrics (one writer: the engine's thread)
    self.stats = {"requests": 0, "reused_tokens": 0, "prefix_tokens": 0}

  def may_overlap(self, row, earlier) -> bool:
    """True when nothing `earlier` stores can change `row`'s plan: it stores nothing
    (context "cache": False, or a method without segments), or no run of `min_tokens`
    identical tokens of the part `row` plans occurs in the part `earlier` computes (a
    splice copies such a run, and runs are stored only from a prompt's computed
    part), and the store has room for all `earlier` could store (nothing `row` might
    match is evicted meanwhile). Decided once per pair of rows."""
    seen = row.state.overlap
    if earlier.req.id not in seen:
      runner, k = self.runner, self.runner.reuse.min_tokens
      if not runner.segments or not (earlier.req.context or {}).get("cache", True):
        seen[earlier.req.id] = True
      else:
        ids = np.asarray(earlier.req.prompt, np.int32)
        room = (runner.store.nbytes + runner.max_stored_bytes(ids, earlier.cached)
                <= runner.store.budget)
        seen[earlier.req.id] = room and self._grams(row, k).isdisjoint(
            self._grams(earlier, k))
    return seen[earlier.req.id]

  @staticmethod
  def _grams(row, k: int) -> set[bytes]:
    """The row's k-token windows from `row.cached` on, computed once per row."""
    if row.state.grams is None:
      row.state.grams = _grams(np.asarray(row.req.prompt, np.int32), row.cached, k)
    return row.state.grams

  @staticmethod
  def _check_spans(req) -> None:
    spans = (req.context or {}).get("spans")
    if spans is not None and any(not 0 <= lo < hi <= len(req.prompt) for lo, hi in spans):
      raise ValueError(f"spans must be (lo, hi) with 0 <= lo < hi <= {len(req.prompt)}")

  def match(self, req) -> Match:
    self._check_spans(req)
    tree = self.runner.radix
    if tree is None:                     # method "none": no prefix cache either
      return Match(0, np.zeros(0, np.int32), _Turn())
    m = tree.match_prefix(np.asarray(req.prompt[:-1], np.int32), lock=True)
    return Match(m.n_matched, m.slots, _Turn(lock=m))

  def unmatch(self, match: Match) -> None:
    if match.state.lock is not None:
      self.runner.radix.release_lock(match.state.lock)

  def _spans(self, row):
    spans = (row.req.context or {}).get("spans")
    return None if spans is None else [tuple(s) for s in spans]

  def prefill(self, row):
    pre = yield from self.runner.prefill_steps(
        row.seq, np.asarray(row.req.prompt, np.int32), row.cached, self._spans(row),
        chunk=self.prefill_chunk, defer_store=True)
    row.state.pre = pre
    return pre.logits

  def join(self, req) -> _Turn:
    self._check_spans(req)
    return _Turn()

  def plan_prefill(self, row, tail_from: int | None, reuse_from: int = 0,
                   adapter: tuple | None = None):
    lora, form = adapter if adapter is not None else (None, "base")
    hole = np.flatnonzero(self.runner.alloc.slot_map(row.seq)[:row.cached] == SENTINEL)
    bounds = [b for b in (row.private_from, hole[0] if hole.size else None) if b is not None]
    pre = yield from self.runner.prefill_steps(
        row.seq, np.asarray(row.req.prompt, np.int32), row.cached, self._spans(row),
        chunk=self.prefill_chunk, defer_store=True, radix=False, tail_from=tail_from,
        exact_before=min(bounds) if bounds else None, reuse_from=reuse_from, lora=lora,
        form=form)
    row.state.pre = pre
    if pre.approx_from < pre.ids.size:                # approximate KV from there on
      row.private_from = min(pre.approx_from, row.private_from if row.private_from is not None
                             else pre.approx_from)
    return pre.logits, pre.queries

  def after_prefill(self, row) -> None:
    if (row.req.context or {}).get("cache", True):
      row.state.pre.finish(True)

  def finish(self, row, cache: bool) -> dict | None:
    del cache                            # what it stores, after_prefill stored already
    t = row.state
    if t.lock is not None:
      self.runner.radix.release_lock(t.lock)
    return self._usage(row)

  def leave(self, row, cache: bool) -> dict | None:
    del cache
    return self._usage(row)

  def _usage(self, row) -> dict | None:
    pre = row.state.pre
    if pre is None:
      return None
    reused = sum(run.n for run in pre.runs if run.tier != "reject")
    self.stats["requests"] += 1
    self.stats["reused_tokens"] += reused
    self.stats["prefix_tokens"] += pre.prefix_hit
    out = {"reuse": self.runner.reuse.method, "cached_tokens": pre.prefix_hit,
           "reused_tokens": int(reused), "prefill_tokens": round(pre.prefill_tokens, 1),
           "tiers": sorted({run.tier for run in pre.runs}), "stored": pre.stored,
           "runs": [{"at": r.p_lo, "n": r.n, "tier": r.tier, "reason": r.reason}
                    for r in pre.runs]}
    if (row.req.context or {}).get("evaluate"):
      out["prefill"] = pre
    return out
