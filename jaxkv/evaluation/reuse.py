"""Segment reuse evaluated through the batch engine (bench/reuse.py `--via=engine`).

A workload's prompts are served in order by the engine's `reuse` mechanism
(`jaxkv.engine.mechanisms.reuse`), as the batch-1 runner serves them: a prompt is
submitted once the one before it has its first token, i.e. has inserted its prefix
into the radix tree (matched at admission) and stored its runs (looked up in its
prefill). The rows then decode together, so a workload's replies cost one batched
decode instead of one decode per prompt. A scored prompt becomes two requests,
submitted together:

  1. a teacher-forced twin (`Request.forced` = the gold continuation): its
     log-probabilities give the continuation's NLL in one chunked pass. Its context
     says `cache: False`, so it inserts no prefix and stores no run, and
  2. the request itself (greedy, up to `gen` tokens, ending at a stop token), which
     then plans exactly as its twin did (same store, same radix tree) and stores.

Both carry `evaluate: True`, so each result brings the runner's `Prefill` record
(plan, tiers, FLOPs, bytes spliced, first-token logits). An unscored prompt is
served for its side effects only (one token, cached and stored).

Against the runner (`bench/reuse.py --via=runner`, one request at a time), the
twin's continuation is prefilled rather than decoded, and each layer pass runs in
`prefill_chunk`-token pieces, so log-probabilities and logits can differ in the last
bits (tests/test_evaluation_reuse.py bounds them). Plans, tiers, greedy tokens and the
store are the runner's. TTFT here includes the wait behind the rows admitted
earlier: timing stays with the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.config import SamplingConfig
from jaxkv.engine import executables
from jaxkv.engine.request import Request


@dataclasses.dataclass
class Prompt:
  """One prompt of a workload: ids, structural spans (None: its lines), and the gold
  continuation to score (None: served, not scored)."""
  ids: np.ndarray
  spans: Sequence[tuple[int, int]] | None = None
  continuation: np.ndarray | None = None


@dataclasses.dataclass
class Served:
  """What one prompt gave: the runner's `Prefill` record of its plan (the greedy
  request's), and when scored, the greedy tokens (up to and including a stop token)
  and the gold continuation's mean NLL (the twin's)."""
  pre: object
  greedy: np.ndarray | None = None
  nll: float | None = None
  twin_pre: object = None       # the twin's `Prefill`: the same plan (tests compare them)


def _request(rid: str, p: Prompt, sampling: SamplingConfig, *, forced=None,
             cache: bool = True) -> Request:
  ctx = {"spans": None if p.spans is None else [tuple(s) for s in p.spans],
         "cache": cache, "evaluate": True}
  return Request(rid, [int(t) for t in p.ids], sampling, mechanism="reuse", context=ctx,
                 forced=None if forced is None else [int(t) for t in forced])


def serve_all(engine, prompts: Sequence[Prompt], gen: int, progress=None) -> list[Served]:
  """Serves `prompts` in order through `engine` (which has a `reuse` mechanism);
  returns one `Served` per prompt. Raises RuntimeError naming the request when one
  fails. `progress(done, total)` is called as prompts complete."""
  reqs, need = [], {}
  for i, p in enumerate(prompts):
    if p.continuation is None:
      reqs.append(_request(f"{i}", p, SamplingConfig(max_tokens=1)))
      need[i] = 1
      continue
    reqs.append(_request(f"{i}:twin", p, SamplingConfig(max_tokens=1),
                         forced=p.continuation, cache=False))
    reqs.append(_request(f"{i}", p, SamplingConfig(max_tokens=gen)))
    need[i] = 2
  got: dict[str, object] = {}
  done, todo, last = 0, list(reversed(reqs)), None
  while todo or engine.busy:
    # the next prompt once the last one has its first token (prefix inserted, runs
    # stored: `Reuse.after_prefill` runs with it); a twin goes in with its sibling
    if todo and (last is None or last in got or last in engine.progress()):
      while todo:
        req = todo.pop()
        engine.submit(req)
        if not req.id.endswith(":twin"):
          last = req.id
          break
    for res in executables.step(engine):
      if res.finish_reason in ("error", "cancelled"):
        raise RuntimeError(f"reuse request {res.id} failed: {res.error or res.finish_reason}")
      got[res.id] = res
      i = int(res.id.split(":")[0])
      need[i] -= 1
      if need[i] == 0:
        done += 1
        if progress is not None:
          progress(done, len(prompts))
  out = []
  for i, p in enumerate(prompts):
    res = got[f"{i}"]
    if p.continuation is None:
      out.append(Served(res.extra["prefill"]))
      continue
    twin = got[f"{i}:twin"]
    out.append(Served(res.extra["prefill"], np.asarray(res.tokens, np.int32),
                      float(-np.mean(twin.logprob)), twin.extra["prefill"]))
  return out
