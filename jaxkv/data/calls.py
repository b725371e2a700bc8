"""Tool calls a model generated: parsing, matching against a trace, and rate intervals.

What next-call accuracy (IntentKV's task-level quality, `bench/agent_eval.py`) needs:

- `parse_calls(text)`: the calls in a generated assistant turn, in the forms the
  shipped models write -- Hermes / Qwen2.5 `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` blocks, the ReAct text `Action: NAME` / `Action Input: {...}`
  (SmolLM2's template, `traces.format_react`), or, failing both, bare JSON objects
  `{"name": ..., "arguments": ...}` (Qwen2.5-Coder-0.5B often drops the tags or
  writes a ```json fence; tool-call parsers of serving stacks accept it too). Text
  with none of these gives no call; a call cut off mid-JSON is no call.
- `match(pred, gold)`: (exact, name-only) for the first call of a turn. Arguments
  compare as parsed JSON values, so key order and whitespace do not count (and
  1 == 1.0, as JSON numbers); an argument text that is not a JSON object compares
  as its stripped text.
- `argument_hits(pred, gold)`: (gold argument values the first predicted call
  carries under the same key, gold arguments): the finer signal behind exact
  match -- an ID the call needs that was evicted cannot be copied, whatever tool
  the model picks.
- `argument_mentions(text, gold)`: (gold argument values the text writes after their
  key, gold arguments), read from the raw text: a `"key": value` anywhere in it
  whose value decodes to the gold one counts, so a call cut off or malformed later
  still shows whether the needed IDs were copied (SmolLM2-135M rarely closes its
  argument object within the token cap). Nested values count whole or not at all.
- `completed_call(name, text)`: the call a model completed when its turn was forced
  up to the arguments (next-call accuracy with the tool name given): the forced name
  with the first JSON value it wrote as arguments. Parsing the forced head plus the
  text would fail for Hermes blocks, whose outer object the model has not closed
  when generation stops at the end of the arguments.
- `wilson(k, n)`: the Wilson score 95% interval of a rate (sound at small n and at
  rates near 0 or 1, where the normal approximation is not).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

import numpy as np

from jaxkv.data.traces import ToolCall, parse_react

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


# Text that opens a call `parse_calls` reads (a Hermes block, a bare JSON call, a ReAct
# action): a stream holds text back from here, and free text under a strict tool
# grammar may not spell any of them (`jaxkv.engine.grammar.tool_calls`).
CALL_OPENERS = ("<tool_call>", '"name"', "Action:")

def _hermes(block: str) -> ToolCall | None:
  try:   # the first JSON value of the block (an unterminated block may run on)
    obj, _ = json.JSONDecoder().raw_decode(block.strip())
  except json.JSONDecodeError:
    return None
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str):          # some models write the arguments as a JSON string
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      args = {"_raw": args}
  return ToolCall(obj["name"].strip(), args if isinstance(args, dict) else {"_raw": args})


def _bare_json(text: str) -> tuple[ToolCall, ...]:
  """Top-level JSON objects in `text` that name a call, in order."""
  dec, out, i = json.JSONDecoder(), [], text.find("{")
  while i >= 0:
    try:
      obj, end = dec.raw_decode(text, i)
    except json.JSONDecodeError:
      i = text.find("{", i + 1)
      continue
    call = _hermes(json.dumps(obj)) if isinstance(obj, dict) and (
        "arguments" in obj or "parameters" in obj) else None
    if call is not None:
      out.append(call)
    i = text.find("{", end)
  return tuple(out)


def parse_calls(text: str) -> tuple[ToolCall, ...]:
  """Tool calls in a generated assistant turn (see the module docstring)."""
  blocks = _TOOL_CALL.findall(text)
  if blocks:
    return tuple(c for c in map(_hermes, blocks) if c is not None)
  try:
    react = parse_react(text)[1]
  except ValueError:                 # "Action Input:" without "Action:" and the like
    react = ()
  return react or _bare_json(text)


def completed_call(name: str, text: str) -> tuple[ToolCall, ...]:
  """(ToolCall(name, first JSON value of `text`),), or () when `text` does not start
  with a whole JSON value (a cut-off or malformed argument object is no call). A
  value that is not an object becomes `{"_raw": value}`, as in `_hermes`."""
  try:
    args, _ = json.JSONDecoder().raw_decode(text.strip())
  except json.JSONDecodeError:
    return ()
  return (ToolCall(name, args if isinstance(args, dict) else {"_raw": args}),)


def _canonical(arguments: dict):
  if set(arguments) == {"_raw"} and isinstance(arguments["_raw"], str):
    return arguments["_raw"].strip()
  return arguments


def match(pred: Sequence[ToolCall], gold: Sequence[ToolCall]) -> tuple[bool, bool]:
  """(exact, name-only) match of the first predicted call against the first gold one."""
  if not gold:
    raise ValueError("match: the gold turn makes no tool call")
  if not pred:
    return False, False
  p, g = pred[0], gold[0]
  name = p.name == g.name
  return name and _canonical(p.arguments) == _canonical(g.arguments), name


def argument_hits(pred: Sequence[ToolCall], gold: Sequence[ToolCall]) -> tuple[int, int]:
  """(gold top-level arguments whose value the first predicted call has under the same
  key, JSON-normalised; gold top-level arguments) for the first gold call."""
  if not gold:
    raise ValueError("argument_hits: the gold turn makes no tool call")
  g = _canonical(gold[0].arguments)
  if not isinstance(g, dict):              # a raw-text argument: all or nothing
    return int(bool(pred) and _canonical(pred[0].arguments) == g), 1
  p = _canonical(pred[0].arguments) if pred else {}
  p = p if isinstance(p, dict) else {}
  return sum(k in p and p[k] == v for k, v in g.items()), len(g)


def argument_mentions(text: str, gold: Sequence[ToolCall]) -> tuple[int, int]:
  """(gold top-level arguments of the first gold call whose JSON value `text` writes
  after `"key":` somewhere, gold top-level arguments); a raw-text gold argument counts
  when its text occurs. Values compare as decoded JSON (1 == 1.0, spacing ignored)."""
  if not gold:
    raise ValueError("argument_mentions: the gold turn makes no tool call")
  g = _canonical(gold[0].arguments)
  if not isinstance(g, dict):
    return int(bool(g) and g in text), 1
  dec, hits = json.JSONDecoder(), 0
  for key, value in g.items():
    for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:\s*", text):
      try:
        got, _ = dec.raw_decode(text, m.end())
      except json.JSONDecodeError:
        continue
      if got == value:
        hits += 1
        break
  return hits, len(g)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
  """Wilson score interval of k successes in n trials (95% by default); (nan, nan) at n = 0."""
  if n <= 0:
    return math.nan, math.nan
  if not 0 <= k <= n:
    raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
  p = k / n
  den = 1 + z * z / n
  mid = (p + z * z / (2 * n)) / den
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
  return max(0.0, mid - half), min(1.0, mid + half)


def _resamples(n: int, groups, reps: int, seed: int) -> list[np.ndarray] | None:
  """`reps` bootstrap resamples of n items as index arrays: items drawn with
  replacement, or with `groups` (one label per item) whole groups drawn with
  replacement and every item of a drawn group kept (a cluster bootstrap: the
  conversation or session is the unit that varies, not the question). None when
  fewer than two items, or fewer than two groups."""
  if groups is None:
    if n < 2:
      return None
    return list(np.random.default_rng(seed).integers(0, n, (reps, n)))
  labels = np.asarray(groups)
  if labels.shape != (n,):
    raise ValueError(f"bootstrap: need one group label per item, got {labels.shape} for {n}")
  members = [np.flatnonzero(labels == g) for g in dict.fromkeys(labels.tolist())]
  if len(members) < 2:
    return None
  draws = np.random.default_rng(seed).integers(0, len(members), (reps, len(members)))
  return [np.concatenate([members[g] for g in d]) for d in draws]


def ratio_ci(x, y, reps: int = 2000, seed: int = 0, level: float = 0.95,
             groups=None) -> tuple[float, float, float]:
  """mean(x) / mean(y) of paired per-item scores and its percentile bootstrap
  interval (items resampled with replacement, `reps` times, fixed seed; with
  `groups`, whole groups resampled: `_resamples`): how a method's mean F1 compares
  with full context's on the same questions. The interval is (nan, nan) when fewer
  than two pairs (groups), or a resample's mean(y) is 0."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.shape != y.shape or x.ndim != 1:
    raise ValueError(f"ratio_ci: need two paired 1-d score lists, got {x.shape}, {y.shape}")
  if not 0 < level < 1 or reps < 1:
    raise ValueError(f"ratio_ci: need 0 < level < 1 and reps >= 1, got {level}, {reps}")
  point = float(x.mean() / y.mean()) if x.size and y.mean() else math.nan
  idx = _resamples(x.size, groups, reps, seed)
  if idx is None:
    return point, math.nan, math.nan
  den = np.array([y[i].mean() for i in idx])
  if np.any(den == 0):
    return point, math.nan, math.nan
  r = np.array([x[i].mean() for i in idx]) / den
  lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
  return point, float(lo), float(hi)


def mean_ci(x, y=None, reps: int = 2000, seed: int = 0, level: float = 0.95,
            groups=None) -> tuple[float, float, float]:
  """mean(x), or with `y` the mean paired difference mean(x - y), and its percentile
  bootstrap interval (items resampled with replacement, `reps` times, fixed seed;
  with `groups`, whole groups: `_resamples`): e.g. a method's ROUGE-L against full's
  on the same pairs. (nan, nan) interval with fewer than two items (groups)."""
  x = np.asarray(x, np.float64)
  if y is not None:
    y = np.asarray(y, np.float64)
    if x.shape != y.shape:
      raise ValueError(f"mean_ci: need paired score lists, got {x.shape}, {y.shape}")
    x = x - y
  if x.ndim != 1 or not 0 < level < 1 or reps < 1:
    raise ValueError(f"mean_ci: need 1-d scores, 0 < level < 1 and reps >= 1, got "
                     f"{x.shape}, {level}, {reps}")
  point = float(x.mean()) if x.size else math.nan
  idx = _resamples(x.size, groups, reps, seed)
  if idx is None:
    return point, math.nan, math.nan
  lo, hi = np.quantile([x[i].mean() for i in idx], [(1 - level) / 2, (1 + level) / 2])
  return point, float(lo), float(hi)


def agreement(tokens, ref_tokens) -> tuple[float, int]:
  """Greedy agreement of a method's output with the reference's (both ended at their
  stop token): (share of the reference's tokens matched position by position, length
  of the common prefix). An output longer than the reference earns nothing for its
  extra tokens; one that stops early loses the rest."""
  a, b = np.asarray(tokens), np.asarray(ref_tokens)
  n = min(a.size, b.size)
  same = a[:n] == b[:n]
  first = int(np.argmin(same)) if not same.all() else n
  return float(same.sum() / max(1, b.size)), first


def mcnemar(b: int, c: int) -> float:
  """Exact two-sided McNemar p-value of paired outcomes: b pairs only the first
  method got right, c only the second (a binomial(b + c, 1/2) test); 1.0 when
  no pair is discordant."""
  if b < 0 or c < 0:
    raise ValueError(f"mcnemar: need counts >= 0, got {b}, {c}")
  n = b + c
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
  return min(1.0, 2 * tail)
