"""bench/reuse.py's tables: a workload's rows side by side (TTFT ratios, drift with
bootstrap intervals over requests), the paired table (each method against its
chance baseline, against the others, a method with @settings against its base, and
TTFT ratios paired by request where both rows were timed), workload (d)'s drift
tables and plot. Pure over the rows the bench writes; scripts/report.py renders the
README blocks from them."""

from __future__ import annotations

import common
from jaxkv.data import calls, reuse_workloads

# (method, its chance baseline), then the methods against each other: the paired table
CHANCE = (("epic", "epic_random"), ("cacheblend", "blend_random"), ("naive", "naive_norope"))
PAIRS = CHANCE + (("tiered", "cacheblend"), ("tiered", "epic"), ("cacheblend", "epic"),
                  ("epic", "naive"))
# at matched FLOPs (workload (a)): EPIC with more first tokens against CacheBlend, and
# CacheBlend recomputing more against tiered
MATCHED = (("epic@epic_tokens=40", "cacheblend"), ("cacheblend@blend_ratio=0.75", "tiered"),
           ("tiered@guard_base=4", "cacheblend"), ("tiered@guard_base=4", "epic@epic_tokens=40"),
           # tiered against random recompute at its own FLOPs (its chance line), and
           # the seed's guard schedule against the doubling one (the default)
           ("tiered", "blend_random@blend_ratio=0.75"),
           ("cacheblend@blend_ratio=0.75", "blend_random@blend_ratio=0.75"),
           ("tiered_seed", "tiered"))


def drift_tables(rows: list[dict]) -> list[common.Table]:
  """Workload (d): per kind, each method's KL / dNLL / FLOPs share per fraction."""
  out = []
  for kind in sorted({r["kind"] for r in rows}):
    rs = [r for r in rows if r["kind"] == kind]
    fracs = sorted({r["frac"] for r in rs})
    by = {(r["method"], r["frac"]): r for r in rs}
    lines = []
    for m in dict.fromkeys(r["method"] for r in rs):
      cells = []
      for f in fracs:
        r = by.get((m, f))
        cells.append("-" if r is None else f"{r['kl_first_token']:.3f} / "
                     f"{r['delta_nll']:+.3f} / {r['flops_ratio']:.2f}")
      lines.append((m, *cells))
    n = rs[0]["n_requests"]
    out.append(common.Table(
        f"workload perturbed, {kind}: KL first token / dNLL nats/tok / FLOPs vs none, by "
        f"the share of the {n} probes' left context perturbed", ("method", *(
            f"{f:g}" for f in fracs)), lines))
  return out


def drift_plot(rows: list[dict], path: str):
  """KL at the first token and dNLL vs the perturbed share, one panel per kind."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = [r for r in rows if r["workload"] == "perturbed"]
  kinds = sorted({r["kind"] for r in rows})
  fig, ax = plt.subplots(2, len(kinds), figsize=(4.2 * len(kinds), 7), squeeze=False)
  for j, kind in enumerate(kinds):
    for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "none"):
      rs = sorted((r for r in rows if r["kind"] == kind and r["method"] == m),
                  key=lambda r: r["frac"])
      f = [r["frac"] for r in rs]
      ax[0, j].plot(f, [max(r["kl_first_token"], 1e-6) for r in rs], "o-", label=m)
      ax[1, j].plot(f, [r["delta_nll"] for r in rs], "o-", label=m)
    ax[0, j].set(yscale="log", title=f"{kind}", ylabel="KL at the first token")
    ax[1, j].set(xlabel="share of the left context perturbed", ylabel="dNLL (nats/token)")
    ax[1, j].axhline(0, color="k", lw=0.8)
  ax[0, 0].legend(fontsize=8)
  fig.suptitle("segment reuse drift vs left-context perturbation (vs no reuse)")
  return common.save_figure(fig, plt, path)


def add_speedups(rows: list[dict]) -> None:
  """Sets ttft_ratio_vs_none / ttft_ratio_vs_prefix (how many times faster; None
  without that baseline) on one workload's rows. Each TTFT is divided by the `none`
  pass of its own invocation first (none_ttft_s; the machine's speed drifts between
  runs, ~10% here), the prefix row's by its own run's none likewise."""
  by = {r["method"]: r for r in rows}

  def norm(r):
    t = r.get("none_ttft_s") or by.get("none", {}).get("ttft_s")
    return r["ttft_s"] / t if t and r.get("ttft_s") else None

  for r in rows:
    for key, base in (("ttft_ratio_vs_none", "none"), ("ttft_ratio_vs_prefix", "prefix")):
      a, b = base in by and norm(by[base]), norm(r)
      r[key] = a / b if a and b else None


def _ci(r, field, fmt) -> str:
  """A drift cell: the mean, with its bootstrap interval over requests when the row has
  one (rows of the current protocol)."""
  ci = r.get(field + "_ci")
  cell = format(r[field], fmt)
  return cell if ci is None else f"{cell} [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def paired_table(rows: list[dict]) -> common.Table | None:
  """Each method against its chance baseline (`CHANCE`), then against the others
  (`PAIRS`), then each method run with @settings against its base method, a gated
  one against its base's `reject_random` run (the gates' control), and each timed
  method against the prefix cache, on the same requests: paired mean differences
  (a - b) with bootstrap intervals over requests, beside the FLOPs each spent (unequal
  FLOPs: not a matched comparison), and where both rows were timed, how many times
  sooner a's first token comes (b's mean TTFT over a's, `calls.ratio_ci`)."""
  by = {r["method"]: r for r in rows if "per_request" in r}
  lines = []
  variants = tuple((m, m.split("@")[0]) for m in by if "@" in m)
  # a gated variant against its base's random reject at a matched rate (the control)
  control = {b: m for m, b in variants if "reject_random" in m}
  gated = tuple((m, control[b]) for m, b in variants if b in control and m != control[b])
  timed = tuple((m, "prefix") for m in by if m not in ("none", "prefix")
                and "ttft" in by[m]["per_request"])
  for a, b in dict.fromkeys(PAIRS + MATCHED + variants + gated + timed):
    if a in by and b in by:
      x, y = by[a]["per_request"], by[b]["per_request"]
      d = lambda k, x=x, y=y: "{:+.4f} [{:+.4f}, {:+.4f}]".format(*calls.mean_ci(x[k], y[k]))
      fast = "-"
      if "ttft" in x and "ttft" in y:
        fast = "{:.2f}x [{:.2f}, {:.2f}]".format(*calls.ratio_ci(y["ttft"], x["ttft"]))
      lines.append((a, b, f"{by[a]['flops_ratio']:.3f} / {by[b]['flops_ratio']:.3f}",
                    d("agree"), d("kl"), d("dnll"), fast))
  if not lines:
    return None
  header = ("a", "b", "FLOPs vs none a / b", "d greedy agree", "d KL first", "d dNLL",
            "TTFT b / a")
  ttft = ("; TTFT b / a: how many times sooner a's first token comes, the ratio of mean "
          "TTFTs of the timed pass")
  if all(line[-1] == "-" for line in lines):     # quality-only rows: no TTFT column
    header, lines, ttft = header[:-1], [line[:-1] for line in lines], ""
  return common.Table(
      f"workload {rows[0]['workload']}, {rows[0]['storage']} store: a minus b on the same "
      f"{rows[0]['n_requests']} requests (paired, bootstrap 95% over requests; greedy "
      "agreement up to none's stop token: higher is better; KL and dNLL vs none: lower is "
      f"better{ttft}); the first rows are each method against its chance baseline",
      header, lines)


def tables(rows: list[dict]) -> list[common.Table]:
  out = []
  order = list(reuse_workloads.WORKLOADS)
  for wl in sorted({r["workload"] for r in rows}, key=order.index):
    if wl == "perturbed":
      out += drift_tables([r for r in rows if r["workload"] == wl])
      continue
    for storage in dict.fromkeys(r["storage"] for r in rows if r["workload"] == wl):
      out += _workload_tables([r for r in rows if r["workload"] == wl
                               and r["storage"] == storage])
  return out


def _workload_tables(rs: list[dict]) -> list[common.Table]:
  add_speedups(rs)
  new = all("per_request" in r for r in rs)
  lines = []
  for r in rs:
    timed = r.get("timed", True)
    ratio = lambda key, r=r, timed=timed: ("-" if not timed or r.get(key) is None
                                           else f"{r[key]:.2f}x")
    acc = " ".join(f"{k}:{v}" for k, v in r["tier_accept"].items()) or "-"
    lines.append((r["method"], acc, f"{r['prefill_tokens']:.0f} / {r['prompt_tokens']:.0f}",
                  f"{r['flops_ratio']:.3f}", f"{1000 * r['ttft_s']:.0f}" if timed else "-",
                  ratio("ttft_ratio_vs_none"), ratio("ttft_ratio_vs_prefix"),
                  _ci(r, "kl_first_token", ".4f"), _ci(r, "delta_nll", "+.4f"),
                  f"{r['greedy_agreement']:.3f} [{r['greedy_ci'][0]:.2f}, "
                  f"{r['greedy_ci'][1]:.2f}]",
                  "-" if r.get("first_diff") is None else f"{r['first_diff']:.1f}",
                  f"{r['bytes_stored'] / 2 ** 20:.1f}", f"{r['bytes_moved'] / 2 ** 20:.1f}",
                  "-" if r["break_even_median"] is None else f"{r['break_even_median']:.2g}"))
  n = rs[0]["n_requests"]
  drift = ("drift vs no reuse, bootstrap 95% intervals over requests; greedy agreement: "
           "share of none's output, up to its stop token, reproduced position by position; "
           "first diff: common prefix length" if new else
           "drift vs no reuse; greedy agreement position-wise over the first tokens, no "
           "stop, Wilson interval over pooled tokens")
  pool = f", a pool of {rs[0]['num_pages']} pages" if rs[0].get("num_pages", 1024) < 1024 else ""
  out = [common.Table(
      f"workload {rs[0]['workload']}, {n} requests, {rs[0]['storage']} store{pool} (TTFT: mean "
      "over the requests of a second, compiled pass, '-' for a quality-only run; vs = how "
      f"many times faster, each TTFT divided by the none pass of its own run first; {drift})",
      ("method", "runs by tier", "prefill tok / prompt", "FLOPs vs none", "TTFT ms",
       "vs none", "vs prefix", "KL first", "dNLL nats/tok", "greedy agree [95% CI]",
       "first diff", "stored MiB", "moved MiB", "break-even reuses"), lines)]
  paired = paired_table(rs)
  return out if paired is None else out + [paired]
