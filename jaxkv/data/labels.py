"""Future-action evidence labels (IntentKV section 3.5, used by metrics and training).

A history token is evidence when its text lies inside a literal occurrence, in
the rendered history, of an argument value of one of the next five tool calls
of the same session -- e.g. a reservation id that a tool output printed and a
later call copies. Argument values are the scalar leaves of the arguments JSON
(strings and numbers, as written by `json.dumps` for non-strings); values
shorter than `min_len` characters are ignored (a lone digit would match
everywhere).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np

from jaxkv.data import traces

LOOKAHEAD = 5


def argument_strings(arguments, min_len: int = 3) -> list[str]:
  """Scalar leaves of a tool call's arguments (dict / list / JSON string), deduplicated."""
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      return [arguments] if len(arguments) >= min_len else []
  out: list[str] = []

  def walk(x):
    if isinstance(x, dict):
      for v in x.values():
        walk(v)
    elif isinstance(x, (list, tuple)):
      for v in x:
        walk(v)
    elif x is not None and not isinstance(x, bool):
      text = x if isinstance(x, str) else json.dumps(x)
      if len(text) >= min_len and text not in out:
        out.append(text)
  walk(arguments)
  return out


def future_tool_arguments(messages: Sequence[dict], start: int,
                          lookahead: int = LOOKAHEAD, min_len: int = 3) -> list[str]:
  """Argument values of the first `lookahead` tool calls in messages[start:] (structured
  `tool_calls`, or ReAct `Action:` / `Action Input:` text)."""
  calls = []
  for m in messages[start:]:
    if m.get("role") != "assistant":
      continue
    if m.get("tool_calls"):
      calls.extend(c.get("function", c) for c in m["tool_calls"])
    elif "Action Input:" in (m.get("content") or ""):      # ReAct text (ToolBench form)
      try:
        _, parsed = traces.parse_react(m["content"])
      except ValueError:
        continue
      calls.extend({"name": c.name, "arguments": c.arguments} for c in parsed)
  values: list[str] = []
  for c in calls[:lookahead]:
    for v in argument_strings(c.get("arguments", {}), min_len):
      if v not in values:
        values.append(v)
  return values


def evidence_mask(text: str, offsets: Sequence[tuple[int, int]], values: Iterable[str],
                  end_char: int | None = None) -> np.ndarray:
  """[num_tokens] bool: tokens overlapping an occurrence of any value in text[:end_char]."""
  end_char = len(text) if end_char is None else end_char
  covered = np.zeros(len(text) + 1, bool)
  hay = text[:end_char]
  for v in values:
    i = hay.find(v)
    while i >= 0:
      covered[i:i + len(v)] = True
      i = hay.find(v, i + 1)
  if not len(offsets):
    return np.zeros(0, bool)
  cum = np.concatenate([[0], np.cumsum(covered)])
  starts = np.array([o[0] for o in offsets], np.int64)
  ends = np.array([o[1] for o in offsets], np.int64)
  return (cum[ends] - cum[starts]) > 0
