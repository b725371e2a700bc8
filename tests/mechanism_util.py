"""Helpers of the mechanism tests: a mechanism that records each request's
first-token logits, a runner's tokens cut at the first stop as the engine's are, a
request cancelled after its first engine step, a long prefill stepped beside a
decoding row, and the step each prefill of a batch started at."""

import inspect

import numpy as np

from jaxkv.config import SamplingConfig
from jaxkv.engine.engine import Request


def recording(cls):
  """A subclass of the mechanism `cls` whose `prefill` keeps each request's logits
  (`.logits[request id]`), for the 1e-5 check against its runner (a generator
  prefill's return value too)."""

  class Recording(cls):
    def __init__(self, *args, **kw):
      super().__init__(*args, **kw)
      self.logits = {}

    def prefill(self, row):
      out = super().prefill(row)
      if inspect.isgenerator(out):
        return self._recorded(row, out)
      self.logits[row.req.id] = out
      return out

    def _recorded(self, row, steps):
      logits = yield from steps
      self.logits[row.req.id] = logits
      return logits

  return Recording


def clip(tokens, stop_ids):
  """tokens up to and including the first stop token (the engine ends a row there)."""
  for i, t in enumerate(tokens):
    if t in stop_ids:
      return tokens[:i + 1]
  return tokens


def prefill_starts(eng, mech, reqs) -> tuple[dict, dict]:
  """Submits `reqs` (of mechanism `mech`) together and steps the engine dry; returns
  (the engine step at which each request's mechanism prefill started, results by id)."""
  step, started, prefill = [0], {}, mech.prefill

  def spy(row):
    started.setdefault(row.req.id, step[0])
    return prefill(row)

  mech.prefill = spy
  for req in reqs:
    eng.submit(req)
  got = {}
  while eng.busy:
    step[0] += 1
    got.update((r.id, r) for r in eng.step())
  return started, got


def cancel_after_first_step(eng, req) -> list:
  """Submits `req`, runs one engine step, cancels it and steps until the engine is
  idle; returns every result those steps gave."""
  eng.submit(req)
  eng.step()
  eng.cancel(req.id)
  out = []
  while eng.busy:
    out += eng.step()
  return out


def beside_a_decoding_row(eng, req, per_step: int) -> tuple[int, dict]:
  """Starts a short plain request decoding, submits `req` and steps until `req` has
  its first token, asserting that the short row gets `per_step` (the engine's
  decode_steps) new tokens in every step: it waits for one chunk of `req`'s prefill
  at a time, never the whole of it. Then cancels the short row and runs the engine
  dry. Returns (the steps `req`'s prefill took, every result by id)."""
  eng.submit(Request("short", np.random.default_rng(2).integers(100, 40000, 6).tolist(),
                     SamplingConfig(max_tokens=400)))
  eng.step()
  eng.submit(req)
  seen, steps, got = len(eng.progress()["short"][0]), 0, {}
  while req.id not in eng.progress() and req.id not in got:
    got.update({r.id: r for r in eng.step()})
    steps += 1
    now = len(eng.progress()["short"][0])
    assert now == seen + per_step, "the decoding row waited for more than one chunk"
    seen = now
  eng.cancel("short")
  while eng.busy:
    got.update({r.id: r for r in eng.step()})
  return steps, got
