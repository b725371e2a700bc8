"""The engine request of one call of a composed session (kinds named as a list, e.g.
`["agents", "pruned", "memart", "reuse"]`), built the same way by the server
(`jaxkv.server.backends`) and by `serve.py`'s JSONL lines.

A composition's name is its kinds "+"-joined in `COMPOSE_ORDER` (the one that lays the
KV out first: "agents+pruned+memart+reuse"); the engine serves it through a
`jaxkv.engine.mechanisms.composed.Composed` of that name. A call's prompt is its
messages as pruning renders them (its query span and system prompt in the context)
when pruning is part of it, else the caller's encoding of them. With MemArt, a call
that opens a new conversation first needs a *recall* (`Recall`: one engine request
of the memart mechanism that writes the closed conversation into the session's
memory and retrieves blocks for the new question); the caller runs it and builds
the call again with its `Result.extra["recall"]`, and the call's prompt then carries
those blocks as a region at its first user message (`MemArt.turn`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxkv.config import SamplingConfig
from jaxkv.engine.mechanisms.composed import Composed
from jaxkv.engine.request import Request

# the order a composed session's kinds are named in: the one that lays out the KV first
COMPOSE_ORDER = ("agents", "pruned", "memart", "reuse", "semshare")


@dataclasses.dataclass
class Recall:
  """A memart composition's recall: run `request`, then build the call again with its
  `Result.extra["recall"]`."""
  request: Request


def name(kinds) -> str:
  """The composition's name: its distinct kinds "+"-joined in `COMPOSE_ORDER`
  (ValueError for a kind that is not a mechanism)."""
  kinds = list(dict.fromkeys(kinds))
  bad = [k for k in kinds if k not in COMPOSE_ORDER]
  if bad:
    raise ValueError(f"{bad} cannot be composed: a composition names mechanisms "
                     f"({', '.join(COMPOSE_ORDER)})")
  return "+".join(sorted(kinds, key=COMPOSE_ORDER.index))


def mechanism(engine, kind: str):
  """The engine's composed mechanism `kind` (a `name`), added on first use from the
  parts the engine already has (ValueError from `composed.check`, saying why, when
  they do not combine)."""
  if kind not in engine.mechanisms:
    engine.add_mechanism(Composed([engine.mechanisms[k] for k in kind.split("+")]))
  return engine.mechanisms[kind]


def request(mechanisms: dict, kind: str, session: str, messages: list[dict], tools,
            sampling: SamplingConfig, *, rid: str, encode: Callable[[], list[int]],
            grammar=None, adapter: int = -1, recalled: dict | None = None,
            opened: Callable[[], None] | None = None) -> Request | Recall:
  """The `Request` of one call of composed session `session` on `kind` (a `name`), or
  the `Recall` to run first. `mechanisms`: the engine's, by name; `encode()`: the
  call's prompt ids when pruning is not part of the composition; `opened()`: run once
  the call is known to fit (the caller opens or touches its session). ValueError for
  a call the composition cannot take (the server's 400, a serve.py line's error)."""
  parts = kind.split("+")
  if "pruned" in parts:
    prompt, ctx = mechanisms["pruned"].context(session, messages, tools)
  else:                                  # (agents + reuse: lines as spans)
    prompt, ctx = list(encode()), {"session": session}
  agents = mechanisms.get("agents") if "agents" in parts else None
  if agents is not None:
    agents.check(len(prompt), sampling.max_tokens)
  if opened is not None:
    opened()
  if "memart" in parts:
    got = mechanisms["memart"].turn(session, messages, tools, prompt, ctx, recalled)
    if isinstance(got, dict):
      return Recall(Request(id=f"{rid}-recall", prompt=list(prompt[-1:]),
                            sampling=SamplingConfig(max_tokens=1, temperature=0.0),
                            mechanism="memart", context=got))
    prompt, ctx = got
    if agents is not None:               # the region made the prompt longer
      agents.check(len(prompt), sampling.max_tokens)
  return Request(id=rid, prompt=prompt, sampling=sampling, grammar=grammar, adapter=adapter,
                 mechanism=kind, context=ctx)
