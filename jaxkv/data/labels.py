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


def _history_chars(p: dict) -> tuple[int, int]:
  """The character range of `prepare_turn`'s prunable history: from the end of the
  system prompt to the start of the query span."""
  text, offsets = p["text"], p["offsets"]
  at = lambda t: offsets[t][0] if t < len(offsets) else len(text)
  return at(p["sys_len"]), at(p["qs"])


def prunable_only_values(p: dict, messages: Sequence[dict], i: int,
                         min_len: int = 3) -> list[str]:
  """Argument values of the (first) tool call at messages[i] -- the one next-call
  accuracy scores -- that its prompt (`prepare_turn`'s dict p) carries only in the
  prunable history: between the system prompt and the
  query span, and nowhere in either. Only those can be lost to pruning; a call with
  none is solved or failed the same under every policy that keeps the forced set."""
  text = p["text"]
  sys_c, q_c = _history_chars(p)
  return [v for v in future_tool_arguments(messages, i, lookahead=1, min_len=min_len)
          if v in text[sys_c:q_c] and v not in text[:sys_c] and v not in text[q_c:]]


def value_spans(p: dict, values: Iterable[str]) -> list[list[list[int]]]:
  """For each value, the token indices of each of its occurrences in the prunable
  history of `prepare_turn`'s dict p (between the system prompt and the query span):
  the tokens a pruned cache must keep whole for the model to copy that occurrence."""
  text, offsets = p["text"], p["offsets"]
  lo, hi = _history_chars(p)
  starts = np.array([o[0] for o in offsets], np.int64)
  ends = np.array([o[1] for o in offsets], np.int64)
  out = []
  for v in values:
    occ, i = [], text.find(v, lo)
    while i >= 0 and i + len(v) <= hi:
      occ.append(np.nonzero((starts < i + len(v)) & (ends > i))[0].tolist())
      i = text.find(v, i + 1)
    out.append(occ)
  return out


def values_coverage(spans: list[list[list[int]]], kept: np.ndarray) -> list[float]:
  """Per value of `value_spans`: the largest share of an occurrence's tokens in `kept`
  ([N] mask): 1.0 when some occurrence is whole, 0.0 when every occurrence is gone (or
  the value has none), in between when the best one was cut mid-value."""
  return [max((float(np.mean(kept[o])) for o in occ if o), default=0.0) for occ in spans]


def query_start(messages: Sequence[dict], i: int) -> int:
  """Index of the first message of the actionable query span before message i:
  the trailing run of user / tool messages (the latest request or tool results)."""
  j = i
  while j > 0 and messages[j - 1].get("role") in ("user", "tool"):
    j -= 1
  return j


def prepare_turn(tok, messages: Sequence[dict], tools, i: int, *, lookahead: int = LOOKAHEAD,
                 reply: bool = True) -> dict:
  """One agent request: prompt = messages[:i] (with the generation prompt), spans, labels.

  Shared by the session runner (metrics) and the Phase-2 feature extractor (labels).

  Returns a dict with `ids` (prompt token ids), `text` and `offsets` (the rendered
  prompt and each token's character span), `qs` (start of the actionable query
  span), `sys_len` (protected system prefix, <= qs), `evidence` ([N] bool, history
  tokens before qs copied into the next `lookahead` tool-call arguments) and, with
  `reply`, `gold` (token ids of messages[i] as the template renders it).

  Raises:
    ValueError: the chat template is not prefix-stable, so the reply cannot be
      replayed as a continuation of the prompt.
  """
  def render(msgs, gen):
    return tok.render_chat(list(msgs), tools=tools, add_generation_prompt=gen)

  text = render(messages[:i], True)
  ids, offsets = tok.encode_with_offsets(text)
  out = dict(ids=ids, text=text, offsets=offsets)
  if reply:
    full = tok.encode(render(messages[:i + 1], False), add_bos=False)
    if full[:len(ids)] != ids:
      raise ValueError(f"chat template is not prefix-stable at message {i}; cannot replay")
    out["gold"] = full[len(ids):]
  q0 = query_start(messages, i)
  # a chat that is all query (no history before its user / tool run) has qs = 0
  before_query = tok.encode(render(messages[:q0], False), add_bos=False) if q0 else []
  qs = min(len(before_query), len(ids) - 1)
  sys_len = 0
  if messages and messages[0].get("role") == "system":
    sys_len = len(tok.encode(render(messages[:1], False), add_bos=False))
  values = future_tool_arguments(messages, i, lookahead=lookahead)
  q_char = offsets[qs][0] if qs < len(offsets) else len(text)
  evidence = evidence_mask(text, offsets, values, end_char=q_char)
  evidence[qs:] = False
  out.update(qs=qs, sys_len=min(sys_len, qs), evidence=evidence)
  return out
