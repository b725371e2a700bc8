"""SemShareKV as an engine mechanism.

A request named `mechanism="semshare"` gets fresh slots for its whole prompt at
admission (no prefix adopted); `SemShareRunner.prefill_into` then matches it
against the stored reference prompts, and either prefills it in full (stored as a
reference) or reuses the most similar reference's KV: every token's slot-map entry
aliases its match, layer 0 is recomputed for every token (the probe) and the later
layers recompute what the plan picks, then each layer evicts by its own attention.
The engine samples the first token and decodes the row with the batch, through the
row's decode view (`decode_view`): the prompt's per-layer slot map (aliased and
evicted entries) followed by the row's own slots for the tokens it generates.

Each of the prefill's passes (the full prefill, the layer-0 probe, the windows of
the second pass) runs the prompt in pieces of the engine's `prefill_chunk` tokens,
one piece per engine step, so the rows decoding beside it wait one piece at a time
(the pieces are exact: the result equals the runner's one call per pass). The aliased reference
slots are held while the row lives and released when it leaves (`finish`); the store
and its references are the runner's, on the engine's KV manager (its evictor forgets
references when the pool needs pages).

`Request.context` serves evaluation (bench/semshare.py `--via=engine` drives the
engine with it, `jaxkv.evaluation.semshare`; a server never sets it): "store": False
leaves the reference store as it was (a teacher-forced twin of a request matches
exactly as the request does, and does not become a reference itself);
"layer_budgets": [L] the per-layer counts a compression baseline keeps for this
prompt (e.g. SemShareKV's own on the same pair); "evaluate": True puts the runner's
`SemPrefill` record (similarity, slot map, recompute sets, FLOPs, entries kept) in
`Result.extra["prefill"]`.

Prompts admitted together prefill one after another (`serial_prefill`: a prompt may
reuse the one before it), except where the earlier one cannot change the later's
plan (`may_overlap`): it stores nothing (context `store: False`, or a method that
never matches), or the later prompt's similarity to it is below the gate, so as a
stored reference it could not be the one reused. Unrelated prompts then prefill side
by side. The outcome is the serial one unless storing the earlier prompt would have
pushed out of the store (byte budget, pool pressure) the reference the later one
reuses.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.engine.mechanisms import Match, Mechanism
from jaxkv.kv.state import SENTINEL
from jaxkv.policies.reuse import semshare as semshare_lib


@dataclasses.dataclass
class _Turn:
  pre: object = None            # the runner's `SemPrefill`
  overlap: dict = dataclasses.field(default_factory=dict)   # earlier row id -> may overlap


class SemShare(Mechanism):
  """SemShareKV in the engine (module docstring). `runner`: a `SemShareRunner` on the
  engine's KV manager (`kv=engine.kv_manager`)."""

  name = "semshare"
  owns_prefill = True
  serial_prefill = True   # a prompt reuses what the prompts admitted before it stored
  metrics = (
      ("jaxkv_semshare_reused_requests_total", "reused_requests",
       "requests that reused a similar earlier prompt's KV"),
      ("jaxkv_semshare_reused_tokens_total", "reused_tokens",
       "prompt tokens of the requests that reused a reference"))

  def __init__(self, runner):
    self.runner = runner
    # counters for /metrics (one writer: the engine's thread)
    self.stats = {"requests": 0, "reused_requests": 0, "reused_tokens": 0}

  def match(self, req) -> Match:
    del req
    return Match(0, np.zeros(0, np.int32), _Turn())

  def may_overlap(self, row, earlier) -> bool:
    """True when `earlier` cannot change `row`'s plan (module docstring); the
    similarity is computed once per pair of rows."""
    cfg = self.runner.cfg
    if not (earlier.req.context or {}).get("store", True) or (
        cfg.method not in semshare_lib.REUSE_METHODS):
      return True
    seen = row.state.overlap
    if earlier.req.id not in seen:
      sim = self.runner.similarity(np.asarray(earlier.req.prompt, np.int32),
                                   np.asarray(row.req.prompt, np.int32))
      seen[earlier.req.id] = sim < cfg.threshold
    return seen[earlier.req.id]

  def prefill(self, row):
    ctx = row.req.context or {}
    pre = yield from self.runner.prefill_steps(row.seq, np.asarray(row.req.prompt, np.int32),
                                               chunk=self.prefill_chunk,
                                               store=ctx.get("store", True),
                                               budgets=ctx.get("layer_budgets"))
    row.state.pre = pre
    return pre.logits

  def decode_view(self, row, width: int):
    pre = row.state.pre
    n = pre.ids.size
    view = np.full((pre.slot_map.shape[0], width), SENTINEL, np.int32)
    view[:, :n] = pre.slot_map
    own = self.runner.alloc.slot_map(row.seq)[n:width]
    view[:, n:n + own.size] = own
    return view, None

  def finish(self, row, cache: bool) -> dict | None:
    del cache
    self.runner.drop_holds(row.seq)        # the engine frees the sequence itself
    pre = row.state.pre
    if pre is None:
      return None
    self.stats["requests"] += 1
    if pre.reused:
      self.stats["reused_requests"] += 1
      self.stats["reused_tokens"] += int(pre.ids.size)
    out = {"semshare": self.runner.cfg.method, "similarity": round(pre.similarity, 4),
           "reused": bool(pre.reused), "recomputed_share": round(pre.recomputed_share, 4),
           "shared_entries": int(pre.shared_entries), "live_entries": int(pre.live_entries)}
    if (row.req.context or {}).get("evaluate"):
      out["prefill"] = pre
    return out
