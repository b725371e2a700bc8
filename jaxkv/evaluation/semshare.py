"""SemShareKV evaluated through the batch engine (bench/semshare.py `--via=engine`).

The batch-1 evaluation (`SemShareRunner`, one pair at a time) prefills a pair's
reference (stored), then its target (matched against the store, reused when the
similarity passes the gate), and continues the target three ways from that one
prefill: greedy up to a stop token, teacher-forced on the gold answer, and
teacher-forced on full recompute's continuation; then it forgets the reference.

Here every continuation is a request of the engine's `semshare` mechanism
(`jaxkv.engine.mechanisms.semshare`), so the pairs' decodes run batched. A pair is
a group of requests served after its reference:

  1. the reference (one token; stored by its prefill) for the methods that reuse
     (`semshare.REUSE_METHODS`); the others neither match nor store, so they skip it;
  2. the target, greedy up to `gen` tokens (ending at a stop token), and its
     teacher-forced twins (`Request.forced`: the gold answer, full's continuation),
     submitted together. Each prefills the target itself; their context says
     `store: False`, so none becomes a reference and every one matches the store
     exactly as the runner's one prefill did. A pair without a given continuation
     scores its own greedy tokens: that twin goes in once the greedy request ends.

For the methods that reuse, the next pair's reference goes in once every request
of the group has its first token (its prefill is done), and the runner's store is
reset first, so each target sees its own reference only, as under the runner;
the group's rows keep decoding beside the next pair's prefills. Every request says
`evaluate: True`, so its result brings the runner's `SemPrefill` record.

Against the runner, each pass of the prefill runs in `prefill_chunk`-token pieces
and the rows decode batched, so logits and log-probabilities can differ in the
last bits (tests/test_evaluation_semshare.py bounds them); TTFT here includes the
wait behind other rows: timing stays with the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.config import SamplingConfig
from jaxkv.engine import executables
from jaxkv.engine.request import Request
from jaxkv.policies.reuse import semshare as semshare_lib


@dataclasses.dataclass
class Pair:
  """One pair: reference and target prompt ids; the gold answer to score (None:
  none); the continuation to score (None: the target's own greedy tokens); the [L]
  per-layer counts a compression baseline keeps (None: its own)."""
  ref: np.ndarray
  tgt: np.ndarray
  answer: np.ndarray | None = None
  continuation: np.ndarray | None = None
  budgets: np.ndarray | None = None


@dataclasses.dataclass
class Served:
  """One pair's outcome: the target's `SemPrefill` (the greedy request's), its greedy
  tokens (up to and including a stop token), the gold answer's mean NLL (None
  without an answer) and the continuation's, and the twins' records (tests compare
  their plans with the greedy request's)."""
  pre: object
  tokens: np.ndarray
  nll: float | None
  cont_nll: float
  twin_pres: list = dataclasses.field(default_factory=list)


def _request(rid: str, ids, pair: Pair, sampling: SamplingConfig, *, forced=None,
             store: bool = False) -> Request:
  ctx = {"store": store, "evaluate": True}
  if pair.budgets is not None:
    ctx["layer_budgets"] = [int(b) for b in pair.budgets]
  return Request(rid, [int(t) for t in ids], sampling, mechanism="semshare", context=ctx,
                 forced=None if forced is None else [int(t) for t in forced])


class _Schedule:
  """Which request goes in when (module docstring): one pair open at a time."""

  def __init__(self, engine, runner, pairs: Sequence[Pair], gen: int):
    self.engine, self.runner, self.pairs, self.gen = engine, runner, pairs, gen
    self.reusing = runner.cfg.method in semshare_lib.REUSE_METHODS
    self.got: dict[str, object] = {}
    self.sent: set[str] = set()
    self.open = -1               # the pair whose reference is (to be) stored
    self.complete = 0            # pairs with every result in

  def _submit(self, req: Request) -> None:
    self.engine.submit(req)
    self.sent.add(req.id)

  def _twin(self, rid: str, p: Pair, tokens) -> Request:
    return _request(rid, p.tgt, p, SamplingConfig(max_tokens=1), forced=tokens)

  def _group(self, i: int) -> list[str]:
    p = self.pairs[i]
    return [f"{i}"] + ([f"{i}:answer"] if p.answer is not None else []) + [f"{i}:cont"]

  def _submit_group(self, i: int) -> None:
    p = self.pairs[i]
    self._submit(_request(f"{i}", p.tgt, p, SamplingConfig(max_tokens=self.gen)))
    if p.answer is not None:
      self._submit(self._twin(f"{i}:answer", p, p.answer))
    if p.continuation is not None:
      self._submit(self._twin(f"{i}:cont", p, p.continuation))

  def _prefilled(self, i: int, live: dict) -> bool:
    """Every request of pair i's group is in and has its first token."""
    return all(r in self.sent and (r in self.got or r in live) for r in self._group(i))

  def submit_ready(self) -> None:
    live = self.engine.progress()
    for i in range(self.open + 1):              # continuations known only now
      if f"{i}:cont" not in self.sent and f"{i}" in self.got:
        self._submit(self._twin(f"{i}:cont", self.pairs[i], self.got[f"{i}"].tokens))
    i = self.open
    if i >= 0 and f"{i}" not in self.sent and f"{i}:ref" in self.got:
      self._submit_group(i)                     # its reference is stored
    if i + 1 < len(self.pairs) and (i < 0 or not self.reusing or self._prefilled(i, live)):
      if self.reusing:                          # the next pair sees its reference only
        self.runner.reset()
        p = self.pairs[i + 1]
        self._submit(_request(f"{i + 1}:ref", p.ref, p, SamplingConfig(max_tokens=1),
                              store=True))
      else:                                     # nothing stored: no reference needed
        self._submit_group(i + 1)
      self.open = i + 1

  def take(self, res) -> bool:
    """Records a result; True when it completes its pair (counted in `complete`)."""
    if res.finish_reason in ("error", "cancelled"):
      raise RuntimeError(f"semshare request {res.id} failed: {res.error or res.finish_reason}")
    self.got[res.id] = res
    if res.id.endswith(":ref"):
      return False
    done = all(r in self.got for r in self._group(int(res.id.split(":")[0])))
    self.complete += done
    return done

  def finished(self) -> bool:
    return self.open == len(self.pairs) - 1 and all(
        r in self.got for i in range(len(self.pairs)) for r in self._group(i))


def serve_pairs(engine, runner, pairs: Sequence[Pair], gen: int,
                progress=None) -> list[Served]:
  """Serves `pairs` through `engine` (which has a `semshare` mechanism over `runner`,
  a `SemShareRunner` on its KV manager); returns one `Served` per pair. Raises
  RuntimeError naming the request when one fails. `progress(done, total)` is called
  as pairs complete."""
  s = _Schedule(engine, runner, pairs, gen)
  while pairs and not s.finished():
    s.submit_ready()
    for res in executables.step(engine):
      if s.take(res) and progress is not None:
        progress(s.complete, len(pairs))
  if s.reusing:
    runner.reset()
  return [_served(s.got, i) for i in range(len(pairs))]


def _served(got: dict, i: int) -> Served:
  res, cont = got[f"{i}"], got[f"{i}:cont"]
  answer = got.get(f"{i}:answer")                   # None: the pair has no answer
  return Served(res.extra["prefill"], np.asarray(res.tokens, np.int32),
                None if answer is None else float(-np.mean(answer.logprob)),
                float(-np.mean(cont.logprob)),
                [t.extra["prefill"] for t in (answer, cont) if t is not None])
