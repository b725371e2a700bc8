"""Teacher-forced rows continued as prefill (the engine's side of `Request.forced`).

A forced request's continuation is known before it runs, so after its prompt (and
its mechanism's `after_prefill`, e.g. a pruning event) the engine feeds it the way
it feeds a prompt: in prefill chunks that read every position's log-probability of
the next forced token and its greedy token, one chunk per engine step. A reply of g
tokens is then one or two chunked passes instead of g decode steps, and its KV is
written exactly as a prefill of the reply writes it (what the batch-1 evaluation
runners do). A row whose mechanism reads the pool through its own decode view (a
per-layer slot map, a key shift: SemShareKV, MemArt) keeps the decode path, which
applies the view.

`ForcedRows` is a mixin of `Engine`; it reads the engine's `mechanisms`, `cfg`,
`cache_cfg`, `mesh`, `driver`, `allocator`, `metrics`, `_slot_map`, `_lora` and
`_emit`.
"""

from __future__ import annotations

import time

import numpy as np

from jaxkv import distributed
from jaxkv.engine.request import Row
from jaxkv.kv import plan


class ForcedRows:
  """Mixin of `Engine` (module docstring)."""

  def _forced_by_prefill(self, r: Row) -> bool:
    """Whether the row is forced and its continuation runs as prefill chunks (asked of
    its mechanism's decode view once, when its prompt is done; cached on the row)."""
    if r.req.forced is None:
      return False
    if r.by_prefill is None:
      if r.req.mechanism is None:
        r.by_prefill = True
      else:
        width = plan.width(r.n + len(r.req.forced), self.cache_cfg.max_seq_len)
        view = self.mechanisms[r.req.mechanism].decode_view(r, width)
        r.by_prefill = all(v is None for v in view)
    return r.by_prefill

  def _forced_prefill(self, rows: list[Row | None]) -> None:
    """One prefill chunk of every forced row past its prompt with tokens left to
    feed: forced[k-1 .. ] at positions n + k - 1 .. (k = tokens appended so far),
    each scoring the forced token after it."""
    todo = [r for r in rows if r is not None and r.finish is None and r.prefilled == r.n
            and r.generated and self._forced_by_prefill(r)]
    if not todo:
      return
    if self.mesh is None:              # packed, as the prompt chunks are
      nb = plan.bucket(len(todo), 1, self.cfg.max_batch, hi=self.cfg.max_batch)
      sel = todo + [None] * (nb - len(todo))
    else:                              # rows keep their places (the data axis shards them)
      ids = {id(r) for r in todo}
      sel = [r if r is not None and id(r) in ids else None for r in rows]
    segments, targets = [], []
    for r in sel:
      if r is None:
        segments.append(None)
        targets.append(None)
        continue
      forced, k = r.req.forced, len(r.generated)
      feed = np.asarray(forced[k - 1:len(forced) - 1], np.int32)
      first = r.n + k - 1
      grow = first + min(feed.size, self.cfg.prefill_chunk) - self.allocator.length(r.seq)
      if grow > 0:
        self.allocator.extend(r.seq, grow)
      segments.append(plan.Row(feed, first))
      targets.append(np.asarray(forced[k:], np.int32))
    opts = self._lora(sel)
    t0 = time.perf_counter()
    for ch, out in self.driver.prefill(
        segments, chunk=self.cfg.prefill_chunk, max_width=self.cache_cfg.max_seq_len,
        slot_map=lambda w: self._slot_map(sel, w), read="all", targets=targets,
        options=lambda ch: opts):
      lp, am = distributed.fetch(out.logprob), distributed.fetch(out.argmax)
      for i, r in enumerate(sel):
        for j in range(0 if r is None else int(ch.count[i])):
          self._emit(r, int(am[i, j]), float(lp[i, j]))
      self.metrics.add_prefill(int(ch.count.sum()), time.perf_counter() - t0)
      break                            # the next chunk runs in the next step
