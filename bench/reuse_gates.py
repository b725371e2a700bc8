r"""Calibrates segment reuse's two gates on a dev run, for a report on held-out data.

    python bench/reuse.py --traces=data_local/tau2_train.json --requests=24 \
        --methods=none,cacheblend,tiered --notimed --out=bench/results_reuse_dev.json
    python bench/reuse_gates.py --dev=bench/results_reuse_dev.json [--kl=0.01] \
        [--out=bench/results_reuse_gates.json]

then, with the printed thresholds, on the held-out trace file (never seen above):

    python bench/reuse.py --traces=data_local/tau2_heldout.json --requests=24 --notimed \
        --methods=none,cacheblend,cacheblend@probe_reject=<t>,tiered,tiered@ctx_threshold=<c> ...

The gates (`jaxkv.config.ReuseConfig`): the probe gate (`probe_reject`) recomputes in
full a blend run whose mean relative key deviation at the probe layer exceeds t; the
context gate (`ctx_threshold`) keeps a run out of the approximate tier when the MinHash
Jaccard of its left context with the stored segment's is below c. What a single run
costs in quality is not observed, only each request's first-token KL against no reuse,
so the rule is a request-level classifier fixed before looking: a request is harmed
when its KL exceeds --kl (the segment-reuse goal's bound); a gate at threshold x flags
a request when it would turn down at least one of its runs; x maximises Youden's J =
TPR - FPR over the dev requests (ties: the threshold that turns down fewer runs).
The candidates are the midpoints between observed values. The probe gate is fitted on
the cacheblend row (every run is a blend run), the context gate on the tiered row's
approximate-tier runs. Beside J, the AUC of the request's score (its largest deviation,
its smallest left-context Jaccard) for harm, with a bootstrap 95% interval over
requests, says whether the signal separates harmed requests at all. With no harmed dev
request a gate stays off (0).
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags

import common

FLAGS = flags.FLAGS
# gate -> (row it is fitted on, the run's tier it applies to, run field, turned down when)
GATES = {
    "probe_reject": ("cacheblend", "blend", 3, "above"),
    "ctx_threshold": ("tiered", "approx", 2, "below"),
}


def define_flags():
  flags.DEFINE_string("dev", "bench/results_reuse_dev.json", "bench/reuse.py rows of the "
                      "dev run (per_request values and runs)")
  flags.DEFINE_float("kl", 0.01, "a request is harmed when its first-token KL against no "
                     "reuse exceeds this")
  flags.DEFINE_integer("boot", 2000, "bootstrap resamples of the AUC interval")
  flags.DEFINE_string("out", None, "JSON: the chosen thresholds and their curves")


def request_values(row: dict, tier: str, field: int) -> list[list[float]]:
  """Per request: the gate's value on each run of `tier` (runs: [tier, tokens,
  ctx_jaccard, deviation])."""
  return [[r[field] for r in runs if r[0] == tier and r[field] is not None]
          for runs in row["per_request"]["runs"]]


def auc(score: np.ndarray, harmed: np.ndarray) -> float:
  """P(score of a harmed request > score of an unharmed one), ties count half."""
  pos, neg = score[harmed], score[~harmed]
  if not pos.size or not neg.size:
    return float("nan")
  gt = (pos[:, None] > neg[None, :]).mean()
  eq = (pos[:, None] == neg[None, :]).mean()
  return float(gt + eq / 2)


def auc_ci(score: np.ndarray, harmed: np.ndarray, boot: int, seed: int = 0) -> list[float]:
  """Bootstrap 95% interval of `auc` over requests (resamples without a harmed or
  an unharmed request are skipped)."""
  rng = np.random.default_rng(seed)
  vals = []
  for _ in range(boot):
    i = rng.integers(0, score.size, score.size)
    a = auc(score[i], harmed[i])
    if not np.isnan(a):
      vals.append(a)
  return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))] if vals else []


def fit(values: list[list[float]], kl: np.ndarray, bound: float, when: str,
        boot: int) -> dict:
  """The gate's curve over candidate thresholds and the Youden-optimal one."""
  harmed = kl > bound
  flat = np.array(sorted({v for vs in values for v in vs}))
  # the request's score, higher = more suspect: its largest deviation, or minus its
  # smallest Jaccard; requests without a run of the tier get none
  worst = max if when == "above" else (lambda vs: -min(vs))
  score = np.array([worst(vs) if vs else np.nan for vs in values])
  out = dict(n_requests=int(kl.size), n_harmed=int(harmed.sum()), n_runs=int(
      sum(len(vs) for vs in values)), kl_bound=bound)
  has = ~np.isnan(score)
  out["auc"] = auc(score[has], harmed[has])
  out["auc_ci"] = auc_ci(score[has], harmed[has], boot)
  if not harmed.any() or flat.size == 0:
    out.update(threshold=0.0, curve=[], reason="no harmed dev request: the gate stays off")
    return out
  cands = (flat[:-1] + flat[1:]) / 2 if flat.size > 1 else flat
  cands = np.concatenate([[flat[0] - 1e-6], cands, [flat[-1] + 1e-6]])
  curve = []
  for x in cands:
    down = [[v > x if when == "above" else v < x for v in vs] for vs in values]
    flagged = np.array([any(d) for d in down])
    tpr = float(flagged[harmed].mean())
    fpr = float(flagged[~harmed].mean()) if (~harmed).any() else 0.0
    curve.append(dict(threshold=round(float(max(x, 0.0)), 5), runs_down=int(sum(map(sum, down))),
                      flagged=int(flagged.sum()), tpr=tpr, fpr=fpr, j=tpr - fpr))
  best = max(curve, key=lambda c: (round(c["j"], 9), -c["runs_down"]))
  out.update(threshold=best["threshold"], curve=curve,
             reason=f"Youden J {best['j']:.2f} (TPR {best['tpr']:.2f}, FPR {best['fpr']:.2f})")
  return out


def table(name: str, fitted: dict) -> common.Table:
  """The curve around the chosen threshold (every fifth candidate and the choice)."""
  curve = fitted["curve"]
  keep = [c for i, c in enumerate(curve) if i % 5 == 0 or c["threshold"] == fitted["threshold"]]
  lines = [(("**" if c["threshold"] == fitted["threshold"] else "") + f"{c['threshold']:.4f}",
            f"{c['runs_down']} / {fitted['n_runs']}",
            f"{c['flagged']} / {fitted['n_requests']}", f"{c['tpr']:.2f}", f"{c['fpr']:.2f}",
            f"{c['j']:+.2f}") for c in keep]
  ci = fitted["auc_ci"]
  return common.Table(
      f"{name}: {fitted['n_harmed']} of {fitted['n_requests']} dev requests harmed (KL > "
      f"{fitted['kl_bound']}); AUC of the request's score {fitted['auc']:.2f}"
      + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "") + f"; chosen {fitted['threshold']:.4f}: "
      f"{fitted['reason']}",
      ("threshold", "runs turned down", "requests flagged", "TPR", "FPR", "J"), lines)


def main(argv):
  del argv
  with open(FLAGS.dev) as f:
    rows = {r["method"]: r for r in json.load(f)}
  chosen, tables = {}, []
  for gate, (method, tier, field, when) in GATES.items():
    if method not in rows or "runs" not in rows[method].get("per_request", {}):
      raise app.UsageError(f"{FLAGS.dev} has no {method} row with per-request runs: run "
                           f"bench/reuse.py --methods=none,{method} on the dev traces first")
    row = rows[method]
    fitted = fit(request_values(row, tier, field), np.asarray(row["per_request"]["kl"]),
                 FLAGS.kl, when, FLAGS.boot)
    chosen[gate] = fitted
    tables.append(table(gate, fitted))
  common.print_tables(tables)
  print("\nchosen: " + ", ".join(f"{g}={v['threshold']}" for g, v in chosen.items()))
  if FLAGS.out:
    common.write_rows(FLAGS.out, [dict(gate=g, dev=FLAGS.dev, **v) for g, v in chosen.items()])


if __name__ == "__main__":
  define_flags()
  app.run(main)
