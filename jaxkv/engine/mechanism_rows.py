"""The engine's side of the KV mechanism plug-ins (`jaxkv.engine.mechanisms`).

`MechanismRows` is a mixin of `Engine`: rows whose mechanism plans its own prefill
(`Mechanism.owns_prefill`: each advances by one prefill, or one slice of a
generator prefill, per step; the first token is sampled from the logits they return) and
the decode views of rows whose KV is not their own slot map (per-layer slot maps,
key shifts). It reads the engine's `mechanisms`, `cfg`, `driver`, `model_cfg`,
`metrics` and `_emit`.
"""

from __future__ import annotations

import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine.request import Row
from jaxkv.engine.sampling import SamplingParams, sample
from jaxkv.kv.allocator import OutOfSlotsError

_sample_one = jax.jit(sample, static_argnames=("greedy_only",))


class MechanismRows:
  """Mixin of `Engine` (module docstring)."""

  def _owns(self, r: Row) -> bool:
    """Whether the row's mechanism computes its prompt itself (`owns_prefill`)."""
    return r.req.mechanism is not None and self.mechanisms[r.req.mechanism].owns_prefill

  def _own_prefill(self, rows: list[Row | None]) -> None:
    """Advances every row whose mechanism plans its own prefill by one piece of work
    this step: a whole prefill, or one slice of a prefill that is a generator (a
    MemArt history write: one chunk). This is what the engine's packed chunk call is
    for plain rows (every prefilling row advances by up to one chunk per step), so
    the rows already decoding wait for one piece per prefilling row, never for a
    whole long history. A row that finishes samples its first token from the logits
    its mechanism returns (as a chunk's readout would: the row's sampling at position
    n), then lets the mechanism finish its prefill work (`after_prefill`: e.g. store
    segments) off the TTFT path."""
    todo = [r for r in rows if r is not None and r.prefilled < r.n and r.finish is None
            and self._owns(r)]
    for r in sorted(todo, key=lambda r: r.order):   # admission order: each sees what
      self._own_prefill_one(r)                       # the ones before it stored / wrote

  def _own_prefill_one(self, r: Row) -> bool:
    """One mechanism prefill (or one slice of it); False when it is not done yet."""
    mech = self.mechanisms[r.req.mechanism]
    t0 = time.perf_counter()
    try:
      out = r.pending if r.pending is not None else mech.prefill(r)
      if inspect.isgenerator(out):       # one slice of its work per engine step
        try:
          next(out)
          r.pending = out
          return False
        except StopIteration as done:
          r.pending, logits = None, done.value
      else:
        logits = out
    except (ValueError, OutOfSlotsError) as e:      # this request's, not the batch's
      r.pending = None
      r.finish, r.error = "error", f"mechanism {r.req.mechanism!r} failed: {e}"
      return True
    n = r.n                        # the mechanism may lay out another sequence (MemArt)
    params, greedy_only = SamplingParams.from_configs([r.req.sampling], 1)
    logits = jnp.asarray(logits, jnp.float32)
    token = _sample_one(logits[None], params, jnp.asarray([n], jnp.int32),
                        greedy_only=greedy_only)
    lp = (None if r.req.forced is None else
          float(jax.nn.log_softmax(logits)[int(r.req.forced[0])]))
    r.prefilled = n
    r.first_token_at = time.perf_counter()
    self._emit(r, int(token[0]), lp)
    self.metrics.add_prefill(n - r.cached, r.first_token_at - t0)
    mech.after_prefill(r)
    return True

  def _views(self, rows: list[Row | None], slot_map: np.ndarray) -> dict:
    """The decode call's per-layer slot map and key shift when a row's mechanism has
    its own decode view (`Mechanism.decode_view`); {} when none has. The other rows
    read their own slot map at every layer, unshifted; every row writes its new
    tokens to its own slots (`write_map`)."""
    B, W = slot_map.shape
    layer_maps, shifts = {}, {}
    for i, r in enumerate(rows):
      if r is not None and r.req.mechanism is not None:
        lm, ks = self.mechanisms[r.req.mechanism].decode_view(r, W)
        if lm is not None:
          layer_maps[i] = lm
        if ks is not None:
          shifts[i] = ks
    out = {}
    if layer_maps:
      L = self.model_cfg.num_layers
      lmap = np.broadcast_to(slot_map, (L, B, W)).copy()
      for i, lm in layer_maps.items():
        lmap[:, i] = lm
      out.update(slot_map=lmap, write_map=self.driver.put(slot_map))
    if shifts:
      ks = np.zeros((B, W), np.int32)
      for i, k in shifts.items():
        ks[i] = k
      out["key_shift"] = self.driver.put(ks)
    return out
