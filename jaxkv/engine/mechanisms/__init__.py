"""KV mechanisms as per-request plug-ins of the engine loop.

A request names a mechanism (`Request.mechanism`) and carries what it needs
(`Request.context`); the engine runs it in an ordinary batch row, so it gets
continuous batching with every other request, chunked prefill interleaved with
decode, sampling, token streaming and cancellation, and calls the mechanism's
hooks where its KV management differs from a plain request:

    match(req)            the cached KV to adopt (a radix match with a lock), before
                          any page is taken; `unmatch` undoes it when the request
                          has to wait
    fill(row)             after admission: KV it writes itself into the row's fresh
                          slots from row.cached on (MemArt's memory region in a
                          composition); the engine prefills from there
    prefill(row)          a mechanism that plans its own prefill (which tokens at which
                          layers, spliced rows: `owns_prefill`) runs it over the row's
                          slots and returns the last prompt token's logits; the engine
                          samples the first token and decodes the row with the batch
    capture_q(row)        whether the row's prefill chunks capture post-RoPE queries
    on_chunk(row, q, lo, n)  the captured queries of prompt tokens [lo, lo + n)
    after_prefill(row)    after the last prompt chunk, before the row decodes (prune,
                          write memory); for an `owns_prefill` mechanism after its
                          first token (store segments: off the TTFT path)
    decode_view(row, w)   the row's decode view when it is not its own slot map: a
                          per-layer slot map [L, w] (aliased or evicted entries) and/or
                          a key shift [w] (keys rotated on read); the row's new tokens
                          still go to its own slots
    finish(row, cache)    the row leaves: cache what it wrote, release its locks, keep
                          per-session state; returns what it did (usage["jaxkv"])
    join(req) / leave(row, cache)
                          match / finish for a mechanism running inside a composition
                          (`composed.Composed`) whose KV another mechanism lays out: it
                          adopts and caches nothing of its own, and keeps only its
                          per-session state (pruning: QueryMemory); default: refused
    queries_from(row)     with capture_q: the first prompt position whose queries it
                          reads (a composition's planner computes the prompt from
                          there on through every layer)
    private_from(row)     a layout's: where the KV the row adopted stops being a plain
                          prefill's, holes aside (its session's private suffix), or None
    shared_prefix(row)    a layout's: the prompt's first positions that other sessions
                          share (pruning: the protected system prompt); a planner splices
                          nothing there, so their cached path stays exact and shared
    plan_prefill(row, tail_from, reuse_from, adapter)
                          a planner's prefill inside a composition (segment reuse): it
                          plans [cached, tail_from), splicing only from reuse_from on,
                          computes the tail plainly with its queries, caches nothing
                          itself and lowers `row.private_from` to its first
                          approximately reused position; on a role adapter's row with
                          that adapter (`plans_on_adapters`)
    adapter_of(row)       a layout on role adapters (agents): the row's LoRA inputs and
                          the KV form they write, for a planner's passes

The shape follows vLLM v1's KV-connector hooks (match before allocation, act after
it, save at the end), which is how CacheBlend runs inside vLLM, and SGLang's one
prefix-cache interface (match_prefix, cache_finished_req, evict, lock refs). A
mechanism's jitted math lives in `jaxkv/policies/`; its host state here; its KV
in the engine's `KVManager`. One file per mechanism.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Match:
  """What a mechanism adopts for a request before its prefill."""
  hit: int                        # prompt positions adopted (not prefilled)
  slots: np.ndarray               # [hit] int32 their slots (SENTINEL at holes)
  state: object = None            # the mechanism's per-row state (`row.state`)
  # the mechanism lays out the row's sequence itself in `prefill` (`owns_prefill`): the
  # engine allocates no prompt slots at admission (it still reserves the request's
  # prompt + max_tokens pages) and the mechanism sets `row.n` and `row.cached`
  defer: bool = False
  reserve: int | None = None      # with defer: the fresh prompt tokens it will take


class Mechanism:
  """Base class: a request that names no hook gets the plain engine's behaviour."""

  name = ""
  owns_prefill = False   # True: `prefill` computes the prompt, not the engine's chunks
  adapters = False       # True: its requests run on a role adapter (`Request.adapter`)
  plans_on_adapters = False   # a planner: True when `plan_prefill` runs role adapters
  # the `/metrics` counters it keeps in `self.stats`: (metric name, stats key, help)
  metrics: tuple[tuple[str, str, str], ...] = ()
  # prompt tokens per model call of a generator prefill that calls the model itself
  # (segment reuse, SemShareKV): the engine's `prefill_chunk`, set by `add_mechanism`
  prefill_chunk: int | None = None
  # True: a row's `prefill` starts only once every row of this mechanism admitted
  # before it has ended its own (sampled its first token, `after_prefill` run), so it
  # sees what they stored (segment reuse's store and radix tree, SemShareKV's
  # references), as the batch-1 runners do; the rows of other mechanisms run on
  serial_prefill = False

  def may_overlap(self, row, earlier) -> bool:
    """With `serial_prefill`: whether `row`'s prefill may start while `earlier` (a row
    of this mechanism admitted before it) is still prefilling, i.e. whether nothing
    `earlier` stores can change `row`'s plan (default: never)."""
    del row, earlier
    return False

  def match(self, req) -> Match:
    """The KV to adopt for `req` (default: none). Locks what it returns."""
    del req
    return Match(0, np.zeros(0, np.int32))

  def unmatch(self, match: Match) -> None:
    """Undoes `match` (the request waits for pages and will match again)."""
    del match

  def prefill(self, row):
    """Computes the row's prompt (positions [row.cached, row.n) have fresh slots in
    `row.seq`, or none with `Match.defer`) and returns the logits [V] float32 at its
    last token. A plain call runs in one engine step, like one row's prefill chunk; a
    generator's each `yield` ends its work for this engine step (the rows decoding
    get their decode call in between), and its return value is the logits: a prefill
    longer than a chunk yields `prefill_work.Work` (run by the engine, one chunk per
    step) or calls the model on at most `prefill_chunk` tokens between bare yields
    (segment reuse, SemShareKV). A ValueError or
    OutOfSlotsError fails this request only (its message is the error result)."""
    raise NotImplementedError(f"{type(self).__name__} does not plan its own prefill")

  def fill(self, row) -> int:
    """Writes the K/V of prompt positions [row.cached, row.cached + k) into the row's
    own fresh slots and returns k (< row.n - row.cached; default 0): the engine
    counts them as cached and prefills the rest. Sets `row.private_from` when that
    KV is not what a plain prefill computes. If it raises, the engine releases the
    row (`finish` with cache=False) and answers the request with the error."""
    del row
    return 0

  def capture_q(self, row) -> bool:
    del row
    return False

  def on_chunk(self, row, q, lo: int, n: int) -> None:
    """q: [L, C, Hq, D] queries of the row's chunk; rows [0, n) are prompt tokens
    [lo, lo + n)."""
    del row, q, lo, n

  def after_prefill(self, row) -> None:
    del row

  def decode_view(self, row, width: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(per-layer slot map [L, width] int32 or None, key shift [width] int32 or None)
    over positions [0, width) of the row; (None, None): its own slot map."""
    del row, width
    return None, None

  def finish(self, row, cache: bool) -> dict | None:
    """The row is done (`cache`: it finished normally; False on cancel / error).
    Must release whatever `match` locked. Returns usage["jaxkv"] or None."""
    del row, cache
    return None

  def join(self, req) -> object:
    """The row's state when it runs inside a composition whose KV layout another
    mechanism owns (`match` there); ValueError when this mechanism cannot."""
    raise ValueError(f"{self.name!r} cannot run on another mechanism's KV layout")

  def leave(self, row, cache: bool) -> dict | None:
    """`finish` for a row this mechanism `join`ed."""
    del row, cache
    return None

  def queries_from(self, row) -> int:
    """With `capture_q`: the first prompt position whose queries `on_chunk` must see
    (default: every computed one)."""
    return row.cached

  def private_from(self, row) -> int | None:
    """A layout's: the first adopted position (< row.cached) whose KV is not what a
    plain prefill computes, holes aside (a private suffix), or None."""
    del row
    return None

  def shared_prefix(self, row) -> int:
    """A layout's: how many first prompt positions other sessions share (default 0)."""
    del row
    return 0

  def adapter_of(self, row) -> tuple[object, str] | None:
    """A layout's whose rows run on role adapters: (the row's `LoraInputs`, one
    adapter id; the KV form it writes, e.g. "roles:base_lr_shared": rows of one form
    may read each other's KV). None: the base model."""
    del row
    return None

  def plan_prefill(self, row, tail_from: int | None, reuse_from: int = 0,
                   adapter: tuple[object, str] | None = None):
    """A planner's prefill in a composition (`composed`), a generator like `prefill`:
    plans the prompt's positions [row.cached, tail_from) (all of it: None), splicing
    nothing before `reuse_from` (the layout's shared prefix), computes
    [tail_from, n) through every layer after them, caches nothing itself (the
    layout caches the row) and sets `row.private_from` to the first position whose
    KV is approximate if that is earlier. `adapter`: the layout's `adapter_of(row)`
    (only with `plans_on_adapters`). Returns (logits [V] at the last prompt token,
    the tail's queries [(first position, q [L, C, Hq, D], count)])."""
    raise ValueError(f"{self.name!r} plans its own prefill on the base model (spliced, "
                     "retrieved or aliased rows) and cannot plan it inside a composition")
