"""Sessions of the batch engine: each pins its latest turn in the prefix cache.

`SessionHolds` is a mixin of `Engine`. An open session keeps its latest turn
(prompt + reply) locked in the radix prefix cache, so the next turn, whose prompt
extends it, finds it there however much other traffic needed pages in between.
The engine updates the hold when a session's turn finishes; under pressure (a
request the pool cannot admit while nothing runs) the least recently used idle
session loses its hold first (`_release_idle_pin`), before the request is refused.
Call from the thread that steps. It reads the engine's `radix` and `_sessions`
({id: [lock or None, last used (monotonic s), tree]}).
"""

from __future__ import annotations

import time


class SessionHolds:
  """Mixin of `Engine` (module docstring)."""

  def open_session(self, session: str) -> None:
    """Registers `session` (idempotent). Needs `EngineConfig.prefix_cache`."""
    if self.radix is None:
      raise ValueError("sessions keep KV in the prefix cache: set engine.prefix_cache=True")
    self._sessions.setdefault(session, [None, time.monotonic(), self.radix])

  def close_session(self, session: str) -> bool:
    """Releases the session's hold (its KV stays cached, evictable); False if unknown."""
    entry = self._sessions.pop(session, None)
    if entry is not None and entry[0] is not None:
      entry[2].release_lock(entry[0])
    return entry is not None

  def _hold_turn(self, session: str, tree, tokens) -> None:
    """A turn of `session` finished and was cached in `tree`: its path is held (in
    place of the previous turn's) until the next turn or the session's close."""
    self.open_session(session)
    entry = self._sessions[session]
    if entry[0] is not None:
      entry[2].release_lock(entry[0])
    entry[:] = [tree.match_prefix(tokens, lock=True), time.monotonic(), tree]

  def _release_idle_pin(self, keep: str | None) -> bool:
    """Under pressure: releases the hold of the least recently used session but `keep`
    (it stays open; its turn stays cached, now evictable, so its next turn may
    prefill again). False when no session holds anything."""
    held = [(used, k) for k, (lock, used, _) in self._sessions.items()
            if lock is not None and k != keep]
    if not held:
      return False
    entry = self._sessions[min(held)[1]]
    entry[2].release_lock(entry[0])
    entry[0] = None
    return True

  def expire_sessions(self, idle_s: float) -> list[str]:
    """Closes the sessions unused for more than `idle_s` seconds; returns their ids."""
    now = time.monotonic()
    old = [k for k, (_, used, _) in self._sessions.items() if now - used > idle_s]
    for k in old:
      self.close_session(k)
    return old

  @property
  def sessions(self) -> dict[str, int]:
    """Open sessions -> tokens their hold keeps cached (from a copy: another thread
    may read it as a snapshot)."""
    return {k: (lock.n_matched if lock is not None else 0)
            for k, (lock, _, _) in self._sessions.copy().items()}

