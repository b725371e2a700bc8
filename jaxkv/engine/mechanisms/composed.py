"""Mechanisms composed on one row: role agents sharing one trajectory whose KV
IntentKV prunes (`["agents", "pruned"]`), a pruned session whose prompts reuse
stored segments (`["pruned", "reuse"]`), role agents whose prompts reuse segments
the roles stored (`["agents", "reuse"]`), any of these with MemArt memory of the
session's earlier conversations (`"memart"`), or all four.

A composition is an ordered list of mechanisms the engine has. Each takes one of
three roles:

  * the *layout* (exactly one) lays out and caches the row's KV: it `match`es and
    `finish`es (the agents trajectory region; a pruned session's radix path, holes
    included). A mechanism that cannot `join` is the layout; when every one can, the
    first that is not a planner is.
  * a *planner* (at most one: segment reuse) computes the prompt's rest in its own
    plan (spliced segments, per-layer recompute sets: `plan_prefill`) instead of the
    engine's chunks. The part whose queries a scorer reads (`queries_from`: IntentKV's
    query span, SnapKV's window, H2O's new tokens) is not planned: it runs after the
    plan through every layer, exactly, and its queries go to the scorers. Nor is the
    prefix sessions share (`shared_prefix`: pruning's protected system prompt) spliced:
    approximate KV there would make the path private, and every later session with
    that system prompt would compute it again (measured: bench/compaction.py).
  * the others *join* the row and act through the hooks they share (`fill`: MemArt
    copies a retrieved memory region into the row's slots; `capture_q` / `on_chunk`,
    `after_prefill`: prune), then `leave` it keeping only their per-session state
    (QueryMemory; MemArt's memory and conversation: `memart_region`).

The order of application is the order of the hooks, not of the list:

    1. match     the layout adopts its cached prefix (holes of earlier prunings and
                 the session's private suffix included); then MemArt fills the memory
                 region the prompt carries when it starts there (copied, re-rotated;
                 private from there on)
    2. prefill   the engine's chunks, with the row's role adapter, queries captured
                 for whoever scores them; or the planner's plan, then the scored tail,
                 every pass on the role adapter the layout names (`adapter_of`)
    3. after     the planner first (it stores the runs it computed, before anything
                 is evicted), then the rest in list order (pruning evicts here)
    4. decode    the engine's, over the row's own slot map (holes masked)
    5. finish    the joined mechanisms leave first, then the layout caches the row
                 (from `Row.private_from` on, the first approximately reused position,
                 under private keys: only the session adopts that KV again)

What does not combine, and why (`check`, the server's 400):
  * two layouts (two mechanisms that can only lay out, e.g. agents and memart);
  * a mechanism that plans its own prefill and can neither plan it inside a
    composition nor join one (semshare: aliased rows in a sequence of its own), or
    that can only join (memart: it needs a layout, e.g. agents or pruned);
  * two planners;
  * a planner that runs the base model only (`plans_on_adapters` False) with role
    adapters, or role adapters on a layout that does not name the row's adapter.
`usage["jaxkv"]` is the union of what each mechanism reports, plus "mechanisms".
"""

from __future__ import annotations

from jaxkv.engine.mechanisms import Match, Mechanism


class _RowView:
  """A row as one component sees it: its own `state`, everything else the row's."""

  __slots__ = ("_row", "state")

  def __init__(self, row, state):
    object.__setattr__(self, "_row", row)
    object.__setattr__(self, "state", state)

  def __getattr__(self, name):
    return getattr(self._row, name)

  def __setattr__(self, name, value):
    if name == "state":
      object.__setattr__(self, name, value)
    else:
      setattr(self._row, name, value)


def _plans(m: Mechanism) -> bool:
  return type(m).plan_prefill is not Mechanism.plan_prefill


def _joins(m: Mechanism) -> bool:
  return type(m).join is not Mechanism.join


def check(mechanisms: list[Mechanism]) -> tuple[Mechanism, Mechanism | None]:
  """(the layout, the planner or None) of a composition; ValueError, saying why,
  when the list cannot run."""
  names = [m.name for m in mechanisms]
  if len(mechanisms) < 2 or len(set(names)) != len(names):
    raise ValueError(f"a composition names two or more distinct mechanisms, got {names}")
  own = [m.name for m in mechanisms if m.owns_prefill and not _plans(m) and not _joins(m)]
  if own:
    rest = [n for n in names if n != own[0]]
    raise ValueError(f"{own[0]!r} plans its own prefill on the base model in a sequence of "
                     f"its own (retrieved or aliased rows): it does not combine with {rest}")
  planners = [m for m in mechanisms if m.owns_prefill and _plans(m)]
  if len(planners) > 1:
    raise ValueError(f"{[m.name for m in planners]} each plan the prompt's prefill: at most "
                     "one may")
  planner = planners[0] if planners else None
  if planner is not None and not planner.plans_on_adapters and any(m.adapters
                                                                   for m in mechanisms):
    roles = [m.name for m in mechanisms if m.adapters]
    raise ValueError(f"{planner.name!r} plans the prefill on the base model: it does not "
                     f"combine with role adapters ({roles}: no role adapter in its passes)")
  layouts = [m for m in mechanisms if not _joins(m)]
  if len(layouts) > 1:
    raise ValueError(f"{[m.name for m in layouts]} each lay out and cache the row's KV: "
                     "at most one may")
  if not layouts:      # a joiner that plans its own prefill alone (memart) cannot lay out
    layouts = [m for m in mechanisms if m is not planner and not m.owns_prefill][:1]
  if not layouts or (type(layouts[0]).match is Mechanism.match
                     and type(layouts[0]).finish is Mechanism.finish):
    raise ValueError(f"none of {names} lays out and caches the row's KV (they only join "
                     "one): compose them with one that does, e.g. agents")
  kvs = {id(k) for k in (_kv(m) for m in mechanisms) if k is not None}
  if len(kvs) > 1:
    raise ValueError(f"{names} keep their KV in different KV managers: build them on one")
  roles = [m.name for m in mechanisms if m.adapters]
  if planner is not None and roles and type(layouts[0]).adapter_of is Mechanism.adapter_of:
    raise ValueError(f"{planner.name!r} runs role adapters ({roles}) only on a layout that "
                     f"names the row's adapter; {layouts[0].name!r} does not")
  return layouts[0], planner


def _kv(m: Mechanism):
  """The mechanism's KV manager when it names one (its own or its runner's)."""
  return getattr(m, "kv", None) or getattr(getattr(m, "runner", None), "kv", None)


class Composed(Mechanism):
  """Several mechanisms on one row (module docstring); its name joins theirs with "+"."""

  def __init__(self, mechanisms: list[Mechanism]):
    self.parts = list(mechanisms)
    self.layout, self.planner = check(self.parts)
    self.others = [m for m in self.parts if m is not self.layout]
    self.name = "+".join(m.name for m in self.parts)
    self.adapters = any(m.adapters for m in self.parts)
    self.owns_prefill = self.planner is not None
    self.serial_prefill = self.owns_prefill and self.planner.serial_prefill
    self.stats = {"requests": 0}

  def may_overlap(self, row, earlier) -> bool:
    return self.planner.may_overlap(self._view(row, self.planner),
                                    self._view(earlier, self.planner))

  def _view(self, row, m: Mechanism) -> _RowView:
    return _RowView(row, row.state[m.name])

  def match(self, req) -> Match:
    found = self.layout.match(req)
    states = {self.layout.name: found.state}
    try:
      for m in self.others:
        states[m.name] = m.join(req)
    except BaseException:
      self.layout.unmatch(found)
      raise
    return Match(found.hit, found.slots, states, defer=found.defer, reserve=found.reserve)

  def unmatch(self, match: Match) -> None:
    self.layout.unmatch(Match(match.hit, match.slots, match.state[self.layout.name]))

  def capture_q(self, row) -> bool:
    return any(m.capture_q(self._view(row, m)) for m in self.parts)

  def on_chunk(self, row, q, lo: int, n: int) -> None:
    for m in self.parts:
      view = self._view(row, m)
      if m.capture_q(view):
        m.on_chunk(view, q, lo, n)

  def prefill(self, row):
    """The planner's plan of the prompt, then the tail the scorers read (module
    docstring); the logits at the last prompt token."""
    if self.planner is None:
      raise NotImplementedError(f"{self.name} has no planner: the engine's chunks prefill")
    scorers = [(m, self._view(row, m)) for m in self.parts
               if m is not self.planner and m.capture_q(self._view(row, m))]
    tail = min((m.queries_from(v) for m, v in scorers), default=None)
    lay = self._view(row, self.layout)
    pf = self.layout.private_from(lay)        # and a joiner's filled region (`fill`)
    if pf is not None:
      row.private_from = pf if row.private_from is None else min(pf, row.private_from)
    logits, queries = yield from self.planner.plan_prefill(
        self._view(row, self.planner), tail, self.layout.shared_prefix(lay),
        self.layout.adapter_of(lay))
    for lo, q, count in queries:
      for m, v in scorers:
        m.on_chunk(v, q, lo, count)
    return logits

  def fill(self, row) -> int:
    return sum(m.fill(self._view(row, m)) for m in self.parts)

  def after_prefill(self, row) -> None:
    first = [] if self.planner is None else [self.planner]
    for m in first + [m for m in self.parts if m is not self.planner]:
      m.after_prefill(self._view(row, m))

  def decode_view(self, row, width: int):
    views = [v for v in (m.decode_view(self._view(row, m), width) for m in self.parts)
             if any(x is not None for x in v)]
    if len(views) > 1:
      raise ValueError(f"{self.name}: more than one mechanism changes the decode view")
    return views[0] if views else (None, None)

  def finish(self, row, cache: bool) -> dict | None:
    out = {"mechanisms": [m.name for m in self.parts]}
    try:
      for m in self.others:
        out.update(m.leave(self._view(row, m), cache) or {})
    finally:
      out.update(self.layout.finish(self._view(row, self.layout), cache) or {})
    self.stats["requests"] += 1
    return out
