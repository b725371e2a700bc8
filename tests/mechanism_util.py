"""Helpers of the mechanism tests: a mechanism that records each request's
first-token logits, a runner's tokens cut at the first stop as the engine's are, and a
request cancelled after its first engine step."""

import inspect


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
