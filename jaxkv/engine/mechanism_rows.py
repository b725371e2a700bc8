"""The engine's side of the KV mechanism plug-ins (`jaxkv.engine.mechanisms`).

`MechanismRows` is a mixin of `Engine`: rows whose mechanism plans its own prefill
(`Mechanism.owns_prefill`: each advances by one prefill, or one slice of a
generator prefill, per step; the first token is sampled from the logits they return) and
the decode views of rows whose KV is not their own slot map (per-layer slot maps,
key shifts), and the admission of rows a mechanism fills itself (`_fill`). It
reads the engine's `mechanisms`, `cfg`, `driver`, `model_cfg`, `metrics`, `_emit`
and `_release`.
"""

from __future__ import annotations

import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine import executables
from jaxkv.engine.prefill_work import run_chunk
from jaxkv.engine.request import Result, Row, error
from jaxkv.engine.sampling import sample
from jaxkv.kv.allocator import OutOfSlotsError

_sample_one = executables.register(jax.jit(sample, static_argnames=("greedy_only",)))


class MechanismRows:
  """Mixin of `Engine` (module docstring)."""

  def _fill(self, row: Row, mech) -> Row | Result:
    """Admits a row whose mechanism writes KV itself at admission (`Mechanism.fill`:
    MemArt's recalled blocks); the row's prompt is then computed up to the end of
    what it adopted and filled. A fill that raises leaves nothing held: the row is
    released (its sequence, its mechanism's locks) and its request answered with
    the error, so the engine goes on with the other rows."""
    try:
      row.cached = row.prefilled = row.cached + mech.fill(row)
    except Exception as e:   # any failure of a plug-in's fill
      self._release(row, cache=False)
      return error(row.req, f"mechanism {row.req.mechanism!r} could not fill the request: "
                            f"{e!r}")
    return row

  def _owns(self, r: Row) -> bool:
    """Whether the row's mechanism computes its prompt itself (`owns_prefill`)."""
    return r.req.mechanism is not None and self.mechanisms[r.req.mechanism].owns_prefill

  def _own_prefill(self, rows: list[Row | None]) -> None:
    """Advances every row whose mechanism plans its own prefill by one piece of work
    this step. A mechanism's prefill is a plain call (its logits) or a generator of
    `prefill_work.Work` (MemArt: the history's write, the retrieval probe, the
    question): one chunk of each row's work per step, packed into one `Driver.prefill`
    call per round (`run_chunk`) as the engine's chunk call is for plain rows, or one
    call per row (`EngineConfig.pack_prefill`), so the rows already decoding wait for
    one chunk per prefilling row, never for a whole long history. A row whose work
    finishes in a round goes on to its next work in the next round of the same step
    (a short probe and question follow the history's last chunk at once). A row
    whose prefill ends samples its first token from the logits its mechanism returns
    (as a chunk's readout would: the row's sampling at position n), then lets the
    mechanism finish its prefill work (`after_prefill`: e.g. store segments) off the
    TTFT path."""
    todo = sorted((r for r in rows if r is not None and r.prefilled < r.n and r.finish is None
                   and self._owns(r)), key=lambda r: r.order)   # admission order: each sees
    if not todo:                                                # what earlier ones wrote
      return
    t0, tokens, ran = time.perf_counter(), 0, set()
    fresh = [r for r in todo if r.work is None and self._may_start(r, todo)]
    while True:
      for r in fresh:
        self._advance(r)
      batch = [r for r in todo if r.work is not None and r.finish is None
               and r.work not in ran]
      if not batch:
        break
      works = [r.work for r in batch]
      ran.update(works)
      before = sum(w.done for w in works)
      if self._pack_prefill():
        dones = run_chunk(self.driver, works, self.cfg.prefill_chunk)
      else:
        dones = [run_chunk(self.driver, [w], self.cfg.prefill_chunk)[0] for w in works]
      tokens += sum(w.done for w in works) - before
      fresh = []
      for r, done in zip(batch, dones):
        if done is not None:
          r.work, r.reply = None, done
          fresh.append(r)
    if tokens:
      self.metrics.add_prefill(tokens, time.perf_counter() - t0)

  def _may_start(self, r: Row, todo: list[Row]) -> bool:
    """Whether the row's prefill may run this step: it has begun, or its mechanism
    lets prefills overlap, or no row of its mechanism admitted before it is still
    prefilling (`Mechanism.serial_prefill`) but those whose stores cannot change its
    plan (`Mechanism.may_overlap`)."""
    mech = self.mechanisms[r.req.mechanism]
    if r.pending is not None or not mech.serial_prefill:
      return True
    return not any(q.req.mechanism == r.req.mechanism and q.order < r.order
                   and not mech.may_overlap(r, q) for q in todo)

  def _pack_prefill(self) -> bool:
    """`EngineConfig.pack_prefill`: whether mechanism work runs packed (auto: off a CPU;
    measured on SmolLM2 at 8 concurrent MemArt chats on a 2-core CPU, packing padded
    batches gave 31 tok/s against 41 for one call per row)."""
    mode = self.cfg.pack_prefill
    return mode == "packed" or (mode == "auto" and jax.default_backend() != "cpu")

  def _advance(self, r: Row) -> None:
    """Runs the row's mechanism prefill until it asks for work (`r.work`), waits (a
    bare yield) or returns its logits (then the row samples its first token)."""
    mech = self.mechanisms[r.req.mechanism]
    try:
      if r.pending is None:
        out = mech.prefill(r)
        if not inspect.isgenerator(out):
          self._first_token(r, mech, out)
          return
        r.pending = out
      reply, r.reply = r.reply, None
      try:
        r.work = r.pending.send(reply)
      except StopIteration as done:
        r.pending = None
        self._first_token(r, mech, done.value)
    except (ValueError, OutOfSlotsError) as e:      # this request's, not the batch's
      r.pending = r.work = None
      r.finish, r.error = "error", f"mechanism {r.req.mechanism!r} failed: {e}"

  def _first_token(self, r: Row, mech, logits) -> None:
    n = r.n                        # the mechanism may lay out another sequence (MemArt)
    params, greedy_only = self._sampling([r])
    logits = jnp.asarray(logits, jnp.float32)
    token = _sample_one(logits[None], params, jnp.asarray([n], jnp.int32),
                        greedy_only=greedy_only)
    lp = (None if r.req.forced is None else
          float(jax.nn.log_softmax(logits)[int(r.req.forced[0])]))
    r.prefilled = n
    r.first_token_at = time.perf_counter()
    self._emit(r, int(token[0]), lp)
    mech.after_prefill(r)

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
