"""The tables and the figure of bench/agent_eval.py's rows: next-call rows as
IntentKV's Table 2 (published layouts: baselines compact, IntentKV dead-slot) and
Table 7 (every scorer under both layouts) shapes per budget, the flat table, and the
paired tables (`agent_stats.tables`); closed-loop rows as `agent_env.env_table`;
`plot`, exact accuracy vs the budget. Presentation only: agent_eval computes the rows,
agent_stats their paired statistics, and the report renders these without loading a
model.
"""

from __future__ import annotations

import agent_env
import agent_stats
import common
from jaxkv.data import calls

HEADER = ("method", "layout", "C", "exact", "95% CI", "name", "95% CI", "args", "95% CI", "n",
          "pruned %", "Eff. live", "Eff. reads", "hit %")


def table(rows: list[dict]) -> common.Table:
  ci = lambda x: f"[{x[0]:.2f}, {x[1]:.2f}]"
  given = {r.get("given", "none") for r in rows}
  how = ("the tool name given, the model writes the arguments" if given == {"name"} else
         "the model writes the whole call" if given == {"none"} else f"given: {sorted(given)}")
  return common.Table(
      f"next-call accuracy ({how}, greedy over the pruned cache; args = gold argument values "
      "the call carries, pooled over arguments; Wilson 95% intervals)",
      HEADER, [(r["method"], r["layout"], agent_stats.budget_cell(r),
                f"{r['next_call_exact']:.3f}",
                ci(r["next_call_exact_ci"]), f"{r['next_call_name']:.3f}",
                ci(r["next_call_name_ci"]), f"{r.get('next_call_args', float('nan')):.3f}",
                ci(r.get("next_call_args_ci", [float("nan")] * 2)), str(r["n_calls"]),
                f"{100 * r['pruned_share']:.0f}",
                f"{r['eff_live_kv']:.0f}", f"{r['eff_reads']:.0f}",
                f"{100 * r['prefix_hit_rate']:.0f}") for r in rows])


PAPER_HEADER = ("method", "layout", "C", "exact", "95% CI", "name", "args", "copied", "95% CI",
                "n", "recall", "pruned %", "PT", "Eff. live", "Raw reads", "Eff. reads", "hit %")


LEGEND = ("(exact / name: next-call accuracy; args: gold argument values in the parsed call; "
          "copied: the same read from the raw text, Wilson 95%; recall: future-evidence "
          "tokens kept)")


def _paper_cells(r: dict) -> tuple[str, ...]:
  ci = lambda x: f"[{x[0]:.2f}, {x[1]:.2f}]"
  return (r["method"], r["layout"], agent_stats.budget_cell(r), f"{r['next_call_exact']:.3f}",
          ci(r["next_call_exact_ci"]), f"{r['next_call_name']:.3f}", f"{r['next_call_args']:.3f}",
          f"{r['next_call_copied']:.3f}" if "next_call_copied" in r else "-",
          ci(r["next_call_copied_ci"]) if "next_call_copied" in r else "-",
          str(r["n_calls"]), f"{r['future_evidence_recall']:.3f}",
          f"{100 * r['pruned_share']:.0f}", f"{r['pt']:.0f}", f"{r['eff_live_kv']:.0f}",
          f"{r['raw_reads']:.0f}", f"{r['eff_reads']:.0f}", f"{100 * r['prefix_hit_rate']:.0f}")


def _full_cells_on(full: dict, sessions: set) -> tuple[str, ...]:
  """The full row's exact / name accuracy over the calls of `sessions` only (the
  sessions a `--skip_sessions` grid ran its pruned methods on), so that its rate sits
  on the same calls as theirs; the columns its calls do not carry per call are '-'."""
  mine = [c for c in full["calls"] if c["session"] in sessions]
  k = sum(bool(c["exact"]) for c in mine)
  lo, hi = calls.wilson(k, len(mine))
  name = sum(bool(c["name"]) for c in mine)
  cells = ("full (same sessions)", "-", "0", f"{k / len(mine):.3f}", f"[{lo:.2f}, {hi:.2f}]",
           f"{name / len(mine):.3f}", "-", "-", "-", str(len(mine)))
  return cells + ("-",) * (len(PAPER_HEADER) - len(cells))


def paper_tables(rows: list[dict]) -> list[common.Table]:
  """IntentKV's Table 2 (published layouts: baselines compact, IntentKV dead-slot) and
  Table 7 (every scorer under both layouts) per budget, over next-call rows: accuracy
  with the efficiency columns of the same free-running decode (which therefore
  differ by method, unlike a teacher-forced replay's). `full` heads both; where the
  pruned rows ran on fewer sessions than full (`--skip_sessions`), a second full row
  counts only those sessions' calls, the ones the pruned rates are over."""
  out, full = [], [r for r in rows if r["method"] == "full"]
  for b in sorted({r["budget"] for r in rows if r["budget"]}):
    at = [r for r in rows if r["budget"] == b]
    ran = {c["session"] for r in at for c in r.get("calls", [])}
    head = [_paper_cells(r) for r in full]
    if full and "calls" in full[0] and ran and ran < {c["session"] for c in full[0]["calls"]}:
      head.append(_full_cells_on(full[0], ran))
    layouts = {r["layout"] for r in at}
    if len(layouts) == 1:          # a one-layout grid: every method in one table
      out.append(common.Table(
          f"C={b}, {layouts.pop()} layout, every method {LEGEND}", PAPER_HEADER,
          head + [_paper_cells(r) for r in at]))
      continue
    pub = [r for r in at if (r["layout"] == "dead_slot") == r["method"].startswith("intentkv")]
    if pub:
      out.append(common.Table(
          f"Table 2 shape, C={b}: baselines in their published compact layout, IntentKV "
          f"dead-slot {LEGEND}", PAPER_HEADER, head + [_paper_cells(r) for r in pub]))
    if layouts >= {"dead_slot", "compact"}:
      out.append(common.Table(
          f"Table 7 shape, C={b}: the same scorers under both layouts", PAPER_HEADER,
          head + [_paper_cells(r) for r in sorted(at, key=lambda r: (r["method"], r["layout"]))]))
  return out


def tables(rows: list[dict], everything: bool = True) -> list[common.Table]:
  """Next-call rows: Tables 2 and 7 shapes per budget, then (everything, or when no
  budget has both layouts) the flat table; closed-loop rows: their table."""
  out = []
  calls_rows = [r for r in rows if "next_call_exact" in r]
  env_rows = [r for r in rows if "true_acc" in r]
  if calls_rows:
    out += agent_stats.tables(calls_rows)
    shapes = paper_tables(calls_rows)
    out += shapes
    if everything or not shapes:
      out.append(table(calls_rows))
  if env_rows:
    out.append(agent_env.env_table(env_rows))
  return out


def plot(rows: list[dict], path: str) -> str:
  """Exact accuracy on the scored calls vs the budget C, one panel per layout, one
  line per method with its Wilson 95% interval as error bars; the full cache (which
  solves every discriminative call) as a dashed line."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  done = [r for r in rows if r.get("calls_scored") and r["method"] != "full"
          and r.get("n_scored")]
  layouts = sorted({r["layout"] for r in done}) or ["-"]
  fig, ax = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts) + 1.5, 4),
                         squeeze=False)
  full = next((r for r in rows if r["method"] == "full" and r.get("n_scored")), None)
  methods = list(dict.fromkeys(r["method"] for r in done))
  history = any(r.get("budget_scope") == "history" for r in done)
  for j, lay in enumerate(layouts):
    a = ax[0, j]
    # budgets as evenly spaced categories, the methods side by side within each
    cells = {agent_stats.budget_key(r): agent_stats.budget_cell(r)
             for r in done if r["layout"] == lay}
    pos = {b: i for i, b in enumerate(sorted(cells))}
    for k, m in enumerate(methods):
      rs = sorted((r for r in done if r["method"] == m and r["layout"] == lay),
                  key=agent_stats.budget_key)
      if not rs:
        continue
      x = [pos[agent_stats.budget_key(r)] + 0.1 * (k - (len(methods) - 1) / 2) for r in rs]
      y = [r["exact_scored"] for r in rs]
      err = [[v - r["exact_scored_ci"][0] for v, r in zip(y, rs)],
             [r["exact_scored_ci"][1] - v for v, r in zip(y, rs)]]
      a.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=m)
    if full is not None:
      a.axhline(full["exact_scored"], color="k", ls="--", lw=1, label="full cache")
    n = max((r["n_scored"] for r in done if r["layout"] == lay), default=0)
    a.set_xticks(range(len(pos)), [cells[b] for b in sorted(cells)])
    a.set_xlim(-0.6, len(pos) - 0.4)
    scope = "history tokens kept" if history else "tokens"
    a.set(xlabel=f"budget C ({scope})", ylabel="next-call exact (scored calls)", ylim=(-0.05, 1.05),
          title=f"{lay} layout, n = {n} {done[0]['calls_scored'] if done else ''} calls")
  ax[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # outside
  return common.save_figure(fig, plt, path)
