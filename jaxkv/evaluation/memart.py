"""MemArt evaluated through the batch engine (bench/memart.py `--via=engine`).

The batch-1 evaluation (`MemArtRunner.answer`, one question at a time) answers a
question over a conversation's memory twice: greedy up to a stop token (retrieving
its blocks unless they are given: full context splices every block, the recent
window the latest), then teacher-forced on the gold answer over the same blocks.

Here both are requests of the engine's `memart` mechanism in its evaluation form
(`jaxkv.engine.mechanisms.memart`, context "memory"), so the questions' answers
decode batched. The caller writes the memories first (`MemArtRunner.write` on the
engine's KV manager: a conversation's history once per block layout, plaintext's
picked turns once per question); questions only read them and do not depend on each
other, so every one goes in at once and the engine admits as many as its rows and
pool take. A question whose blocks are given submits its teacher-forced twin beside
it; one that retrieves submits the twin when the greedy request ends, with the
blocks that request retrieved: both answer over the same blocks, as the runner's
two calls do. Every request says `evaluate: True`, so its result brings the
runner's `TailPrefill` record (blocks, probe tokens, layout, key shift).

Against the runner, the rows decode batched, and a twin whose blocks need no key
shift (full context) is fed as prefill chunks rather than decoded, so logits and
log-probabilities can differ in the last bits (tests/test_evaluation_memart.py
bounds them). TTFT here includes the wait behind other rows: timing stays with the
runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.config import SamplingConfig
from jaxkv.engine import executables
from jaxkv.engine.request import Request


@dataclasses.dataclass
class Question:
  """One question: the memory to answer over (a `MemArtRunner.Memory` on the
  engine's KV manager), the tail to prefill (question and template ids), the gold
  answer to score (None: none), the blocks to splice (None: retrieve), and
  retrieval's voters ([n] bool) and overrides (None: the runner's config)."""
  memory: object
  tail: np.ndarray
  answer: np.ndarray | None = None
  blocks: np.ndarray | None = None
  voters: np.ndarray | None = None
  rerank: int | None = None
  neighbors: int | None = None


@dataclasses.dataclass
class Served:
  """One question's outcome: the greedy request's `TailPrefill` (its blocks), its
  tokens (up to and including a stop token), the gold answer's mean NLL (None
  without an answer), what the mechanism reported (prefill / probe tokens, decode
  KV length, memory blocks) and the twin's `TailPrefill` (tests compare them)."""
  pre: object
  tokens: np.ndarray
  nll: float | None
  usage: dict
  twin_pre: object = None


def _request(rid: str, q: Question, sampling: SamplingConfig, blocks, *,
             forced=None) -> Request:
  ctx = {"memory": q.memory, "evaluate": True, "rerank": q.rerank, "neighbors": q.neighbors,
         "blocks": None if blocks is None else [int(b) for b in blocks],
         "voters": None if q.voters is None else [bool(v) for v in q.voters]}
  return Request(rid, [int(t) for t in q.tail], sampling, mechanism="memart", context=ctx,
                 forced=None if forced is None else [int(t) for t in forced])


def _twin(i: int, q: Question, blocks) -> Request:
  return _request(f"{i}:answer", q, SamplingConfig(max_tokens=1), blocks, forced=q.answer)


def serve_questions(engine, questions: Sequence[Question], gen: int,
                    progress=None) -> list[Served]:
  """Answers `questions` through `engine` (which has a `memart` mechanism over the
  runner that wrote their memories); returns one `Served` per question. Raises
  RuntimeError naming the request when one fails. `progress(done, total)` is called
  as questions complete."""
  need, got = {}, {}
  for i, q in enumerate(questions):
    engine.submit(_request(f"{i}", q, SamplingConfig(max_tokens=gen), q.blocks))
    need[i] = 1 + (q.answer is not None)
    if q.answer is not None and q.blocks is not None:
      engine.submit(_twin(i, q, q.blocks))
  done = 0
  while engine.busy:
    for res in executables.step(engine):
      if res.finish_reason in ("error", "cancelled"):
        raise RuntimeError(f"memart request {res.id} failed: {res.error or res.finish_reason}")
      got[res.id] = res
      i = int(res.id.split(":")[0])
      q = questions[i]
      if res.id == f"{i}" and q.answer is not None and q.blocks is None:
        engine.submit(_twin(i, q, res.extra["prefill"].blocks))     # what it retrieved
      need[i] -= 1
      if need[i] == 0:
        done += 1
        if progress is not None:
          progress(done, len(questions))
  return [_served(got, i) for i in range(len(questions))]


def _served(got: dict, i: int) -> Served:
  res, twin = got[f"{i}"], got.get(f"{i}:answer")
  usage = {k: v for k, v in res.extra.items() if k != "prefill"}
  return Served(res.extra["prefill"], np.asarray(res.tokens, np.int32),
                None if twin is None else float(-np.mean(twin.logprob)), usage,
                None if twin is None else twin.extra["prefill"])
