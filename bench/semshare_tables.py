"""bench/semshare.py's result rows, tables and plot, pure over the per-pair records
the bench writes (<out>_records.json); scripts/report.py renders the docs' blocks from
the rows.

A row is one method over one group of pairs (all, a prompt-length bucket of 500
tokens, a similarity bin, how the reference was made). Quality, per pair then
averaged over the pairs, every interval a percentile bootstrap over pairs (the unit
that varies; `calls.mean_ci`):
- ROUGE-L vs gold: the greedy answer against the pair's gold answer (pairs that have
  one: Python-docs questions); `d_gold_vs_full` the paired difference from full
  recompute's on the same pairs;
- ROUGE-L vs full: the greedy output against full recompute's own;
- agreement: the share of full's tokens (up to and including its EOS) the method
  reproduces position by position, and `first_diff` the length of the common prefix;
- `cont_dnll`: teacher-forced NLL of full's own continuation under the method minus
  under full (nats per token), a one-sample proxy for KL(full || method) along full's
  greedy path.
`d_vs_semshare`: a method's ROUGE-L vs full minus SemShareKV's on the same pairs (the
retention comparison at identical per-layer budgets).
"""

from __future__ import annotations

import collections

import numpy as np

import common
from jaxkv.data import calls

SIM_BINS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


def _bucket(n: int) -> int:
  return int(round(n / 500.0) * 500) or 500


def _paired(rs: list[dict], other: dict, field: str) -> tuple | None:
  """Paired bootstrap of mean(field) - other's on the pairs both have."""
  both = [(r[field], other[r["id"]][field]) for r in rs
          if r.get(field) is not None and r["id"] in other
          and other[r["id"]].get(field) is not None]
  if not both:
    return None
  x, y = zip(*both)
  return calls.mean_ci(x, y)


def rows_of(name: str, recs: list[dict], by_method: dict[str, dict] | None = None,
            timed: bool = True) -> list[dict]:
  """Rows of one method's records; `by_method`: every method's records by pair id
  (for the paired differences vs full and vs semshare); `timed`: the TTFTs are of a
  second, compiled run (else they include compiles and the tables leave them out)."""
  by_method = by_method or {}
  groups = collections.defaultdict(list)
  for r in recs:
    groups[("all", "all")].append(r)
    groups[("length", _bucket(r["prompt_tokens"]))].append(r)
    k = int(np.searchsorted(SIM_BINS, r["similarity"], side="right")) - 1
    groups[("similarity", SIM_BINS[k])].append(r)
    kind = (r.get("meta") or {}).get("kind")
    if kind:
      groups[("kind", kind)].append(r)
  rows = []
  for (group, key), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
    mean = lambda f, rs=rs: float(np.mean([r[f] for r in rs]))
    ci = lambda f, rs=rs: calls.mean_ci([r[f] for r in rs if r.get(f) is not None])
    gold = [r for r in rs if r.get("rouge_l_vs_gold") is not None]
    dn = [r["dnll"] for r in rs if r.get("dnll") is not None]
    row = dict(
        method=name, group=group, key=key, timed=timed, n_pairs=len(rs),
        prompt_tokens=mean("prompt_tokens"),
        similarity=mean("similarity"), reused_share=mean("reused"), ttft_s=mean("ttft_s"),
        match_s=mean("match_s"), kv_bytes=mean("kv_bytes"), kv_bytes_live=mean("kv_bytes_live"),
        kv_bytes_shared=mean("kv_bytes_shared"), recomputed_share=mean("recomputed_share"),
        flops=mean("flops"), rouge_l_vs_text=mean("rouge_l_vs_text"),
        delta_nll=float(np.mean(dn)) if dn else None, n_answers=len(dn))
    row["rouge_l_vs_full"], *row["rouge_l_vs_full_ci"] = ci("rouge_l_vs_full")
    row["agreement"], *row["agreement_ci"] = ci("agreement")
    row["first_diff"] = mean("first_diff")
    row["n_gold"] = len(gold)
    if gold:
      row["rouge_l_vs_gold"], *row["rouge_l_vs_gold_ci"] = ci("rouge_l_vs_gold")
    if any(r.get("cont_dnll") is not None for r in rs):
      row["cont_dnll"], *row["cont_dnll_ci"] = ci("cont_dnll")
    if timed and name != "full" and "full" in by_method:
      both = [(by_method["full"][r["id"]]["ttft_s"], r["ttft_s"]) for r in rs
              if r["id"] in by_method["full"]]
      if both:                             # how many times sooner, paired over pairs
        row["speedup"], *row["speedup_ci"] = calls.ratio_ci(*zip(*both))
    for other, fields in (("full", ("rouge_l_vs_gold",)),
                          ("semshare", ("rouge_l_vs_full", "rouge_l_vs_gold"))):
      if name in (other, "full") or other not in by_method:
        continue
      for field in fields:
        got = _paired(rs, by_method[other], field)
        if got is not None:
          short = field.replace("rouge_l_vs_", "")
          row[f"d_{short}_vs_{other}"], *row[f"d_{short}_vs_{other}_ci"] = got
    rows.append(row)
  return rows


def _ci_cell(r: dict, field: str, scale: float = 100.0, fmt: str = ".1f") -> str:
  if r.get(field) is None:
    return "-"
  lo, hi = r.get(f"{field}_ci", (float("nan"), float("nan")))
  return f"{scale * r[field]:{fmt}} [{scale * lo:{fmt}}, {scale * hi:{fmt}}]"


def _speedup(r: dict, f: dict | None) -> str:
  """full's mean TTFT / the row's: paired over pairs with its bootstrap interval where
  the row has one (rows written before it: the ratio alone)."""
  if not f or not r.get("timed", True):
    return "-"
  if r.get("speedup_ci") is None or r["method"] == "full":
    return f"{f['ttft_s'] / r['ttft_s']:.2f}x"
  lo, hi = r["speedup_ci"]
  return f"{r['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"


def tables(rows: list[dict]) -> list[common.Table]:
  out = []
  for group, title in (("all", "over every pair"),
                       ("length", "by prompt length (tokens, bucket of 500)"),
                       ("similarity", "by LSH similarity of the pair (bin lower edge)"),
                       ("kind", "by how the reference was made from the target")):
    rs = [r for r in rows if r["group"] == group]
    if not rs:
      continue
    full = {r["key"]: r for r in rs if r["method"] == "full"}
    lines = []
    for r in sorted(rs, key=lambda r: (str(r["key"]), r["method"])):
      f = full.get(r["key"])
      if "agreement" in r:
        agree = _ci_cell(r, "agreement", 1.0, ".2f")
      else:                                  # rows written before per-pair agreement
        agree = (f"{r['greedy_agreement']:.2f} [{r['greedy_ci'][0]:.2f}, "
                 f"{r['greedy_ci'][1]:.2f}]")
      lines.append((
          f"{r['key']:g}" if group in ("length", "similarity") else str(r["key"]),
          r["method"], str(r["n_pairs"]), f"{r['prompt_tokens']:.0f}",
          f"{r['similarity']:.2f}", f"{r['reused_share']:.2f}",
          f"{1000 * r['ttft_s']:.0f}" if r.get("timed", True) else "-",
          _speedup(r, f),
          f"{r['kv_bytes_live'] / 2 ** 20:.1f}", f"{r['recomputed_share']:.3f}",
          f"{r.get('n_gold', 0)}", _ci_cell(r, "rouge_l_vs_gold"),
          _ci_cell(r, "d_gold_vs_full"),
          _ci_cell(r, "rouge_l_vs_full") if "rouge_l_vs_full_ci" in r
          else f"{100 * r['rouge_l_vs_full']:.1f}",
          _ci_cell(r, "d_full_vs_semshare"), agree,
          _ci_cell(r, "cont_dnll", 1.0, "+.3f")))
    out.append(common.Table(
        f"SemShareKV {title}; TTFT of a compiled run (- : not timed); vs full = how many "
        "times sooner the first token comes (mean TTFTs, paired over pairs); KV kept = "
        "MiB of layer entries kept; ROUGE-L x 100 with 95% bootstrap intervals over pairs; "
        "d = paired difference",
        ("bin", "method", "pairs", "prompt tok", "similarity", "reused", "TTFT ms", "vs full",
         "KV kept", "recomputed", "gold n", "ROUGE-L vs gold", "d gold vs full",
         "ROUGE-L vs full", "d vs semshare", "agreement", "cont dNLL"), lines))
  return out


def plot(rows: list[dict], path: str) -> str:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for m in dict.fromkeys(r["method"] for r in rows):
    ln = sorted((r for r in rows if r["method"] == m and r["group"] == "length"),
                key=lambda r: r["key"])
    ax[0].plot([r["prompt_tokens"] for r in ln], [r["ttft_s"] for r in ln], "o-", label=m)
    sm = sorted((r for r in rows if r["method"] == m and r["group"] == "similarity"),
                key=lambda r: r["key"])
    if m != "full":
      ax[1].plot([r["similarity"] for r in sm], [100 * r["rouge_l_vs_full"] for r in sm],
                 "o-", label=m)
  ax[0].set(xlabel="prompt tokens", ylabel="TTFT (s)", title="TTFT by prompt length")
  ax[1].set(xlabel="LSH similarity of the pair", ylabel="ROUGE-L vs full recompute",
            title="quality vs similarity")
  ax[1].axvline(0.8, color="k", lw=0.8, ls="--")
  for a in ax:
    a.legend(fontsize=8)
  return common.save_figure(fig, plt, path)
