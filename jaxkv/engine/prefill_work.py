"""Prefill work that a mechanism hands to the engine, so that mechanism prefills batch.

A mechanism whose prefill is a generator (`Mechanism.prefill`, MemArt's history
write, retrieval probe and question) does not call the model itself: it yields
`Work` -- ids to run at positions start.. of a sequence whose slots it has already
allocated -- and gets the work's `Done` back (`generator.send`) once the work's last
token has run. The engine runs one chunk of every prefilling row's work per step:
packed into one `Driver.prefill` call per round (`run_chunk`: a batch of the next
power of two, as plain prompts are packed), so eight MemArt turns share one call on an
accelerator, or one call per row where prefill is compute-bound and packing only pads
(`EngineConfig.pack_prefill`, auto: rows on a CPU). Outside the engine, `drain` runs
a generator's work alone, chunk by chunk (the batch-1 runner, the benchmarks).

A bare `yield` (None) means "nothing to run now": the row waits for the next engine
step (e.g. another turn of its session is writing its history).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import distributed
from jaxkv.kv import plan
from jaxkv.models.forward import Capture


@dataclasses.dataclass(eq=False)
class Work:
  """One prefill a mechanism asks for: `ids` at positions start.. of a sequence.

  slot_map: returns the sequence's slot map (host [T] int32) holding the ids' slots
    (read at each chunk: the sequence may not grow meanwhile, but it is cheap).
  capture_q: return every layer's post-RoPE queries of the ids (a retrieval probe).
  key_shift: [>= start + ids.size] int32 per slot-map column: keys read rotated by it
    (spliced blocks at new positions), or None.
  """
  ids: np.ndarray
  start: int
  slot_map: Callable[[], np.ndarray]
  capture_q: bool = False
  key_shift: np.ndarray | None = None
  done: int = 0                                   # tokens run so far
  parts: list = dataclasses.field(default_factory=list)   # (q, positions) per chunk

  def __post_init__(self):
    self.ids = np.asarray(self.ids, np.int32)
    if self.ids.size == 0:
      raise ValueError("prefill work needs at least one token")

  @property
  def finished(self) -> bool:
    return self.done >= self.ids.size


@dataclasses.dataclass(frozen=True)
class Done:
  """What a finished `Work` gives back to its generator."""
  logits: np.ndarray            # [V] float32 at the last token
  q: jax.Array | None           # [L', 1, C, Hq, D] queries (capture_q), C padded
  positions: np.ndarray         # [C] int32 logical positions of q's tokens, -1: padding


def pad_to(x, n: int, axis: int, value=0):
  """x (a host or device array) padded along `axis` to length n with `value`."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return (jnp.pad if isinstance(x, jax.Array) else np.pad)(x, pad, constant_values=value)


def _queries(parts: list) -> tuple[jax.Array, np.ndarray]:
  """One work's captured queries: the single chunk's as it came (padded), or the
  chunks' valid tokens joined and padded to the next power of two."""
  if len(parts) == 1:
    return parts[0]
  n = sum(int((p >= 0).sum()) for _, p in parts)
  q = jnp.concatenate([q[:, :, :int((p >= 0).sum())] for q, p in parts], axis=2)
  pos = np.concatenate([p[p >= 0] for _, p in parts]).astype(np.int32)
  width = 1 << max(0, n - 1).bit_length()
  return pad_to(q, width, 2), pad_to(pos, width, 0, -1)


def run_chunk(driver, works: Sequence[Work], chunk: int) -> list[Done | None]:
  """One chunk (at most `chunk` tokens) of every work in one packed `Driver.prefill`
  call, a batch of the next power of two; returns per work its `Done` when its last
  token ran in this chunk, else None (run it again)."""
  works = list(works)
  nb = 1 << max(0, len(works) - 1).bit_length()
  rows = [plan.Row(w.ids[w.done:], w.start + w.done) for w in works] + [None] * (nb - len(works))
  maps = [w.slot_map() for w in works] + [None] * (nb - len(works))
  capture = any(w.capture_q for w in works)
  shifted = any(w.key_shift is not None for w in works)

  def options(ch):
    out = dict(capture=Capture(q=capture), return_logits=True)
    if shifted:
      w_ = plan.width(ch.need)
      ks = np.zeros((nb, w_), np.int32)
      for i, w in enumerate(works):
        if w.key_shift is not None:
          s = np.asarray(w.key_shift[:w_], np.int32)
          ks[i, :s.size] = s
      out["key_shift"] = driver.put(ks)
    return out

  ch, out = next(iter(driver.prefill(rows, chunk=chunk,
                                     slot_map=lambda w_: plan.slot_rows(maps, w_),
                                     options=options)))
  logits = distributed.fetch(out.logits) if ch.ends[:len(works)].any() else None
  got: list[Done | None] = []
  for i, w in enumerate(works):
    w.done += int(ch.count[i])
    if w.capture_q:
      w.parts.append((out.q[:, i:i + 1], np.asarray(ch.positions[i], np.int32)))
    if not (ch.ends[i] and w.finished):
      got.append(None)
      continue
    q, pos = _queries(w.parts) if w.capture_q else (None, np.asarray(ch.positions[i]))
    got.append(Done(np.asarray(logits[i, 0], np.float32), q, pos))
  return got


def drain(steps, driver, chunk: int):
  """Runs a prefill generator to its end outside the engine (its work alone, chunk by
  chunk); returns its return value."""
  reply = None
  while True:
    try:
      item = steps.send(reply)
    except StopIteration as done:
      return done.value
    reply = None
    while isinstance(item, Work) and reply is None:
      reply = run_chunk(driver, [item], chunk)[0]
