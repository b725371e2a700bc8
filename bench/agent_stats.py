"""Paired statistics for bench/agent_eval.py's next-call rows: which calls can tell
methods apart, and whether one method beats another on them.

A call is **discriminative** when a gold argument value of it is found only in the
prunable history of its prompt (not in the forced system prompt, not in the current
query span: `labels.prunable_only_values`) and the full cache solves it (exact
match). Elsewhere every policy that keeps the forced set has the same evidence in
view, or nothing can be lost because nothing is won, so those calls only dilute a
comparison. `--calls=all` scores every call instead.

Per row, over the scored calls: the exact rate with its Wilson 95% interval, n, and
for each reference method (random, StreamingLLM, SnapKV, H2O at the same layout and
budget; the full cache) the exact two-sided McNemar p of the paired outcomes (fields
`p_vs_random`, `p_vs_streaming_llm`, `p_vs_snapkv`, `p_vs_h2o`, `p_vs_full`, with the
discordant split `split_vs_*` = [only this row right, only the reference right]); a
row compared
with itself, or with a reference that was not run, gets None. The full cache solves
every discriminative call by construction, so against it the split is [0, c]: its
p says whether a method loses calls the full cache solves, not a symmetric test.
Evidence recall's interval is a bootstrap over sessions (agent_eval.summarize).
`contrasts` pairs the rows the reference columns do not: IntentKV's head against its
rule, each scorer across layouts, and IntentKV dead-slot against the baselines compact
(the published Table 2 layouts). `pool` joins the rows of one grid run on disjoint
session sets (one results file per trace source) into one row per configuration.
"""

from __future__ import annotations

import math

import common
from jaxkv.data import calls as calls_lib

REFERENCES = ("random", "streaming_llm", "snapkv", "h2o", "full")
MODES = ("discriminative", "all")


def _outcomes(row: dict) -> dict[tuple[str, int], bool]:
  return {(c["session"], c["turn"]): bool(c["exact"]) for c in row.get("calls", ())}


def scored_calls(rows: list[dict], mode: str) -> list[tuple[str, int]] | None:
  """The (session, turn) keys scored under `mode`; None when `discriminative` has no
  full-cache row to define it."""
  if mode not in MODES:
    raise ValueError(f"calls mode must be one of {MODES}, got {mode!r}")
  with_calls = [r for r in rows if r.get("calls")]
  if not with_calls:
    return [] if mode == "all" else None
  full = next((r for r in with_calls if r["method"] == "full"), None)
  if mode == "all":
    return sorted(_outcomes(full or with_calls[0]))
  if full is None:
    return None
  return sorted((c["session"], c["turn"]) for c in full["calls"]
                if c["exact"] and c["prunable"] > 0)


def budget_key(r: dict) -> tuple[str, int]:
  """(budget_scope, C) of a row (rows written before budget_scope existed: prompt)."""
  return r.get("budget_scope", "prompt"), r["budget"]


def budget_cell(r: dict) -> str:
  """C as a table shows it: `3584` counts the whole prompt, `+256` the history alone
  (`budget_scope="history"`: the system prompt and the query kept on top)."""
  scope, b = budget_key(r)
  return f"+{b}" if scope == "history" and b else str(b)


def _reference(rows: list[dict], row: dict, name: str) -> dict | None:
  for r in rows:
    if r.get("calls") and r["method"] == name and (
        name == "full" or (r["layout"], budget_key(r)) == (row["layout"], budget_key(row))):
      return r
  return None


def annotate(rows: list[dict], mode: str = "discriminative") -> None:
  """Writes the scored-call fields into every next-call row of `rows` (in place)."""
  keys = scored_calls(rows, mode)
  for r in rows:
    if not r.get("calls"):
      continue
    mine = _outcomes(r)
    r["calls_scored"] = mode
    if keys is None:                       # no full-cache row yet
      r.update(n_scored=None, exact_scored=math.nan, exact_scored_ci=[math.nan, math.nan],
               **{f"p_vs_{b}": None for b in REFERENCES},
               **{f"split_vs_{b}": None for b in REFERENCES})
      continue
    ks = [k for k in keys if k in mine]
    hit = sum(mine[k] for k in ks)
    r.update(n_scored=len(ks), exact_scored=hit / len(ks) if ks else math.nan,
             exact_scored_ci=list(calls_lib.wilson(hit, len(ks))))
    pair(r, {k: mine[k] for k in ks}, lambda name, r=r: _reference(rows, r, name), _outcomes)


def pair(row: dict, mine: dict, reference, outcomes) -> None:
  """Writes `row`'s paired fields against each of REFERENCES: `p_vs_*` (exact McNemar
  p) and `split_vs_*` ([samples only `row` gets right, samples only the reference
  does]) over the samples both have; None against itself or a reference not run.
  `mine`: sample -> right; `reference(name)`: that reference's row or None;
  `outcomes(ref_row)`: its sample -> right."""
  for name in REFERENCES:
    ref = reference(name)
    if ref is None or ref is row:
      row[f"p_vs_{name}"] = row[f"split_vs_{name}"] = None
      continue
    _, b, c = discordant(mine, outcomes(ref), mine)
    row[f"p_vs_{name}"], row[f"split_vs_{name}"] = calls_lib.mcnemar(b, c), [b, c]


def discordant(a: dict, b: dict, keys) -> tuple[list, int, int]:
  """Of `keys` both outcome maps have: those keys, how many only `a` gets right, how
  many only `b` does (the McNemar split)."""
  both = [k for k in keys if k in a and k in b]
  return (both, sum(a[k] and not b[k] for k in both), sum(b[k] and not a[k] for k in both))


POOLED = ("method", "layout", "budget", "budget_scope", "given")


def pool(row_sets: list[list[dict]], mode: str = "discriminative") -> list[dict]:
  """One grid run on disjoint session sets (e.g. tau2 + AgentDojo in one results file,
  BFCL in another) -> one annotated row per configuration every set has, over the
  union of their calls: the per-call records joined (so the discriminative calls are
  the full cache's over both), evidence recall re-bootstrapped over the union of
  sessions, the pruned share weighted by scored turns. A configuration missing from
  any set is left out: a rate over part of the data would read as the whole. Raises
  when two sets share a session (the same call would count twice)."""
  sets = [[r for r in rows if r.get("calls")] for rows in row_sets]
  seen: dict[str, int] = {}
  for i, rows in enumerate(sets):
    for s in {c["session"] for r in rows for c in r["calls"]}:
      if seen.setdefault(s, i) != i:
        raise ValueError(f"session {s!r} is in results {seen[s]} and {i}: pool only "
                         "disjoint session sets")
  key = lambda r: (r["method"], r["layout"], budget_key(r))
  by_set = [{key(r): r for r in rows} for rows in sets]
  out = []
  for k in [k for k in by_set[0] if all(k in b for b in by_set[1:])] if by_set else []:
    parts = [b[k] for b in by_set]
    turns = [p["n_turns"] for p in parts]
    ev = [e for p in parts for e in p["evidence_by_session"]]
    recall, lo, hi = calls_lib.ratio_ci([a for a, _ in ev], [b for _, b in ev])
    out.append({**{f: parts[0][f] for f in POOLED if f in parts[0]},
                "calls": [c for p in parts for c in p["calls"]], "evidence_by_session": ev,
                "future_evidence_recall": recall, "future_evidence_recall_ci": [lo, hi],
                "pruned_share": sum(p["pruned_share"] * t for p, t in zip(parts, turns))
                / max(sum(turns), 1), "n_turns": sum(turns),
                "n_sessions": sum(p["n_sessions"] for p in parts)})
  annotate(out, mode)
  return out


HEADER = ("method", "layout", "C", "pruned %", "exact", "95% CI", "n") + tuple(
    f"p vs {b} (split)" for b in REFERENCES) + ("recall", "95% CI (sessions)")


def p_cell(r: dict, name: str) -> str:
  p, split = r.get(f"p_vs_{name}"), r.get(f"split_vs_{name}")
  return "-" if p is None else f"{p:.3f} ({split[0]}-{split[1]})"


def table(rows: list[dict]) -> common.Table | None:
  """The scored-call table of annotated rows (None when no row is annotated)."""
  done = [r for r in rows if r.get("calls_scored")]
  if not done:
    return None
  ci = lambda x: "-" if x is None or math.isnan(x[0]) else f"[{x[0]:.2f}, {x[1]:.2f}]"
  mode = done[0]["calls_scored"]
  what = ("discriminative calls (a gold argument value only in prunable history, solved by "
          "the full cache)" if mode == "discriminative" else "every call")
  return common.Table(
      f"next-call exact on {what}; Wilson 95%; exact McNemar p against each reference "
      "(split: calls only this row solves - only the reference solves); recall = "
      "future-evidence recall, bootstrap over sessions", HEADER,
      [(r["method"], r["layout"], budget_cell(r), f"{100 * r['pruned_share']:.0f}",
        f"{r['exact_scored']:.3f}", ci(r["exact_scored_ci"]), str(r["n_scored"]),
        *(p_cell(r, b) for b in REFERENCES), f"{r['future_evidence_recall']:.3f}",
        ci(r.get("future_evidence_recall_ci"))) for r in done])


SCORERS = ("intentkv_query", "intentkv_learnable")    # IntentKV's rule and its head
BASELINES = ("streaming_llm", "snapkv", "h2o", "random")


def paired_cells(ra: dict, rb: dict, keys) -> tuple[int, tuple[str, ...]]:
  """Two rows over the `keys` both have: (n, the table cells n, a exact, b exact, split,
  exact McNemar p, d [95% CI, session bootstrap])."""
  oa, ob = _outcomes(ra), _outcomes(rb)
  both, only_a, only_b = discordant(oa, ob, keys)
  d, lo, hi = session_difference(oa, ob, both)
  return len(both), (str(len(both)), str(sum(oa[k] for k in both)),
                     str(sum(ob[k] for k in both)), f"{only_a}-{only_b}",
                     f"{calls_lib.mcnemar(only_a, only_b):.3f}",
                     f"{d:+.3f} [{lo:+.2f}, {hi:+.2f}]")


def contrasts(rows: list[dict]) -> common.Table | None:
  """The paired comparisons the readings cite beyond the reference columns, per budget:
  IntentKV's head against its rule (each layout), every scorer in the compact layout
  against itself dead-slot (does the layout move it), and IntentKV dead-slot against
  each baseline compact (IntentKV Table 2's shape). Counts and the exact McNemar p
  over the scored calls both rows have; None when no pair exists yet."""
  done = [r for r in rows if r.get("calls_scored") and r["method"] != "full"
          and r.get("n_scored")]
  keys = scored_calls(rows, done[0]["calls_scored"]) if done else None
  if keys is None:
    return None
  at = {(r["method"], r["layout"], budget_key(r)): r for r in done}
  out = []
  for b in sorted({budget_key(r) for r in done}):
    pairs = [("head vs rule", (SCORERS[1], lay), (SCORERS[0], lay))
             for lay in ("dead_slot", "compact")]
    pairs += [("compact vs dead-slot", (m, "compact"), (m, "dead_slot"))
              for m in SCORERS + BASELINES]
    pairs += [("Table 2 shape", (m, "dead_slot"), (base, "compact"))
              for m in SCORERS for base in BASELINES]
    for what, (ma, la), (mb, lb) in pairs:
      ra, rb = at.get((ma, la, b)), at.get((mb, lb, b))
      if ra is None or rb is None:
        continue
      out.append((budget_cell(ra), what, f"{ma} {la}", f"{mb} {lb}",
                  *paired_cells(ra, rb, keys)[1]))
  if not out:
    return None
  return common.Table(
      "paired contrasts on the same scored calls (split: only a solves - only b solves; "
      "exact McNemar p over calls; d = a's exact rate - b's, 95% bootstrap over sessions, "
      "the unit calls cluster in)",
      ("C", "contrast", "a", "b", "n", "a exact", "b exact", "split", "p",
       "d [95% CI, sessions]"), out)


def versus(rows: list[dict], others: list[dict]) -> common.Table | None:
  """Each pruned row of `rows` (e.g. a second head, run into a results file of its own
  with a copy of the grid's full-cache row) against every row of `others` (the grid) at
  its layout and budget, the full cache included: counts, exact McNemar p and the
  session-bootstrap difference over the scored calls both have. `rows`' full-cache
  row defines which calls are scored. None when nothing pairs."""
  done = [r for r in rows if r.get("calls") and r["method"] != "full"]
  keys = scored_calls(rows, done[0].get("calls_scored", "discriminative")) if done else None
  out = []
  for ra in done if keys is not None else ():
    for rb in others:
      if not rb.get("calls") or (rb["method"] != "full" and (rb["layout"], budget_key(rb))
                                 != (ra["layout"], budget_key(ra))):
        continue
      n, cells = paired_cells(ra, rb, keys)
      if n:
        out.append((budget_cell(ra), f"{ra['method']} {ra['layout']}",
                    ra.get("head") or "-", f"{rb['method']} {rb['layout']}", *cells))
  if not out:
    return None
  return common.Table(
      "a row against the grid's rows on the scored calls both have (split: only a solves - "
      "only b solves; exact McNemar p; d = a's exact rate - b's, 95% bootstrap over "
      "sessions)", ("C", "a", "a's head", "b", "n", "a exact", "b exact", "split", "p",
                    "d [95% CI, sessions]"), out)


def values_table(rows: list[dict]) -> common.Table | None:
  """Whether the scored calls' prunable-only gold values survived pruning whole, and
  the exact rate on each side: per row, over the scored calls whose record carries it
  (`kept`, agent_eval.kept_values; rows run before it have none). Evidence recall
  counts tokens; a value cut anywhere cannot be copied, so this is the share that
  could be. None when no row carries it."""
  done = [r for r in rows if r.get("calls_scored") and r["method"] != "full"]
  keys = scored_calls(rows, done[0]["calls_scored"]) if done else None
  out = []
  for r in done if keys is not None else ():
    by = {(c["session"], c["turn"]): c for c in r["calls"] if c.get("kept") is not None}
    cs = [by[k] for k in keys if k in by]
    if not cs:
      continue
    kept = [c for c in cs if c["kept"]]
    lost = [c for c in cs if not c["kept"]]
    lo, hi = calls_lib.wilson(len(kept), len(cs))
    rate = lambda xs: (f"{sum(c['exact'] for c in xs) / len(xs):.3f} "
                       f"({sum(c['exact'] for c in xs)}/{len(xs)})" if xs else "-")
    shares = [c["kept_share"] for c in lost if c.get("kept_share") is not None]
    mid = f"{sum(0 < x < 1 for x in shares)}/{len(shares)}" if shares else "-"
    out.append((r["method"], r["layout"], budget_cell(r), str(len(cs)),
                f"{len(kept) / len(cs):.3f}", f"[{lo:.2f}, {hi:.2f}]", rate(kept), rate(lost),
                mid))
  if not out:
    return None
  return common.Table(
      "the scored calls' prunable-only gold values kept whole (some occurrence with every "
      "token kept) by the pruned cache, Wilson 95%, the exact rate when they were / were "
      "not, and of the cut calls those whose value was cut mid-value (part of an "
      "occurrence kept; rows run before this record show -)",
      ("method", "layout", "C", "n", "values kept", "95% CI", "exact if kept",
       "exact if cut", "cut mid-value"), out)


def can_change(rows: list[dict], budget: int) -> list[tuple[str, int]] | None:
  """The scored (discriminative) calls a history-scope budget C can change: those whose
  prunable history (`history` on the full-cache row's calls) exceeds C. None without a
  full row, or when a scored call lacks `history` (rows written before the field)."""
  keys = scored_calls(rows, "discriminative")
  full = next((r for r in rows if r["method"] == "full" and r.get("calls")), None)
  if keys is None or full is None:
    return None
  hist = {(c["session"], c["turn"]): c.get("history") for c in full["calls"]}
  if any(hist.get(k) is None for k in keys):
    return None
  return [k for k in keys if hist[k] > budget]


def pruned_table(rows: list[dict]) -> common.Table | None:
  """Each pruned row's exact rate on the scored calls its budget can change: those whose
  prunable history (`history`, on the full-cache row's calls) exceeds C under the
  history scope. The others prune nothing, nor did their session before them, so they
  equal the full cache whatever the method (counting them puts every rate nearer the
  full cache's). The subset depends on C alone, so rows of one C stay paired (their
  McNemar splits are the main table's: a call that cannot change is never discordant).
  None without a full row carrying `history`."""
  keys = scored_calls(rows, "discriminative")
  if not keys or can_change(rows, 0) is None:
    return None
  full_exact = _outcomes(next(r for r in rows if r["method"] == "full" and r.get("calls")))
  out = []
  for r in rows:
    if r["method"] == "full" or not r.get("calls") or budget_key(r)[0] != "history":
      continue
    mine = _outcomes(r)
    can = [k for k in can_change(rows, r["budget"]) if k in mine]
    if not can:
      continue
    k = sum(mine[c] for c in can)
    lo, hi = calls_lib.wilson(k, len(can))
    ref = sum(full_exact[c] for c in can) / len(can)
    out.append((r["method"], r["layout"], budget_cell(r), f"{len(can)} of {len(keys)}",
                f"{k / len(can):.3f} ({k})", f"[{lo:.2f}, {hi:.2f}]",
                f"{100 * (ref - k / len(can)):.1f}"))
  if not out:
    return None
  return common.Table(
      "on the scored calls each budget can change (prunable history longer than C; the "
      "others equal the full cache under every method): exact, Wilson 95%, and points "
      "below the full cache on the same calls",
      ("method", "layout", "C", "n (can change)", "exact", "95% CI", "below full"), out)


def tables(rows: list[dict]) -> list[common.Table]:
  """The scored-call table, the contrasts, the calls each budget can change and the
  values-kept table of `rows`, those that exist yet."""
  return [t for t in (table(rows), contrasts(rows), pruned_table(rows), values_table(rows))
          if t is not None]


def session_difference(a: dict, b: dict, keys) -> tuple[float, float, float]:
  """a's exact rate minus b's over `keys` ((session, turn) -> right), with its 95%
  bootstrap interval resampling whole sessions (calls of one session are not
  independent samples); nan when no key."""
  per: dict[str, list[int]] = {}
  for k in keys:
    net = per.setdefault(k[0], [0, 0])
    net[0] += int(a[k]) - int(b[k])
    net[1] += 1
  if not per:
    return math.nan, math.nan, math.nan
  return common.cluster_bootstrap(per, lambda xs: sum(x[0] for x in xs) / sum(x[1] for x in xs))
