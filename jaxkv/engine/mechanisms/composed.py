"""Mechanisms composed on one row: e.g. role agents sharing one trajectory whose KV
IntentKV prunes (`["agents", "pruned"]`).

A composition is an ordered list of mechanisms the engine has. Exactly one of them
lays out and caches the row's KV (the *layout*: it `match`es and `finish`es, e.g.
the agents trajectory region); every other one `join`s the row and acts on it
through the hooks it shares (`capture_q` / `on_chunk` during the engine's chunked
prefill, `after_prefill`: prune), then `leave`s it keeping only its per-session state
(QueryMemory). The order of application is the order of the hooks, not of the list:

    1. match     the layout adopts its cached prefix (agents: the region's slots,
                 holes of earlier prunings included)
    2. prefill   the engine's chunks, with the row's role adapter; queries captured
                 for whoever scores them
    3. after     in list order (pruning evicts into dead slots here)
    4. decode    the engine's, over the row's own slot map (holes masked)
    5. finish    the joined mechanisms leave first, then the layout caches the row
                 (agents: the pruned trajectory becomes the region every role reads)

What does not combine, and why (`check`, the server's 400):
  * two layouts (agents and pruned both cache KV of their own: agents is the layout,
    pruned joins it; two mechanisms that can only lay out, e.g. memart and reuse);
  * a mechanism that plans its own prefill (memart, reuse, semshare: spliced,
    retrieved or aliased rows) with anything else: its prefill runs on the base model
    through its runner, so it neither takes a role adapter nor hands a scorer the
    queries of the tokens it computes.
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


def check(mechanisms: list[Mechanism]) -> Mechanism:
  """The layout of a composition (ValueError, saying why, when the list cannot run)."""
  names = [m.name for m in mechanisms]
  if len(mechanisms) < 2 or len(set(names)) != len(names):
    raise ValueError(f"a composition names two or more distinct mechanisms, got {names}")
  own = [m.name for m in mechanisms if m.owns_prefill]
  if own:
    rest = [n for n in names if n != own[0]]
    raise ValueError(f"{own[0]!r} plans its own prefill on the base model (spliced, retrieved "
                     f"or aliased rows): it does not combine with {rest} (no role adapter, "
                     "no queries for a scorer)")
  layouts = [m for m in mechanisms if type(m).join is Mechanism.join]
  if len(layouts) > 1:
    raise ValueError(f"{[m.name for m in layouts]} each lay out and cache the row's KV: "
                     "at most one may")
  if not layouts:
    raise ValueError(f"none of {names} lays out and caches the row's KV (they only join "
                     "one): compose them with one that does, e.g. agents")
  return layouts[0]


class Composed(Mechanism):
  """Several mechanisms on one row (module docstring); its name joins theirs with "+"."""

  def __init__(self, mechanisms: list[Mechanism]):
    self.parts = list(mechanisms)
    self.layout = check(self.parts)
    self.others = [m for m in self.parts if m is not self.layout]
    self.name = "+".join(m.name for m in self.parts)
    self.adapters = any(m.adapters for m in self.parts)
    self.stats = {"requests": 0}

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

  def after_prefill(self, row) -> None:
    for m in self.parts:
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
