r"""The shipped IntentKV Phase-2 head's future-evidence recall@k on its validation
sessions, beside the Phase-1 rule and the chance line, with intervals over sessions.

    python bench/pruner_head_recall.py [--models=smollm2-135m,qwen2.5-coder-0.5b] \
        [--budgets=256,128] [--out=bench/results_pruner_head_recall.json]

The head's training logs recall@C* per epoch as one micro-averaged figure (its
manifest's `metrics.jsonl`): no interval, no chance line. Here, per shipped head
(`artifacts/<model>/pruner_head`), the validation rows are rebuilt exactly as the
training run built them (its manifest's config: the same trace file, sessions and
feature settings; features cached under `cache_dir`, extracted with the frozen model
when missing), and on every row (a turn whose candidate window [system prompt end,
query start) holds a future-evidence token) each scorer keeps its top k of the
window (`loss.recall_at`): the Phase-1 rule, the Phase-2 head (alpha clipped, as
served) and a uniformly random k (`loss.random_kept_at`, its expectation). Recall =
kept positives / positives, micro-averaged over rows; the 95% intervals and the
paired differences resample whole sessions (the unit that varies). "over k" rows
count only windows longer than k, where a choice is made. The labels are the head's
own training target (future-evidence tokens of the next `lookahead` turns), so this
measures how well it learned them, not next-call accuracy.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import app, flags
from flax import nnx

import common
from jaxkv import artifacts
from jaxkv.training import features, loss, train
from jaxkv.training.config import PrunerTrainConfig

FLAGS = flags.FLAGS
SCORERS = ("rule", "head", "random")


def define_flags():
  flags.DEFINE_list("models", ["smollm2-135m", "qwen2.5-coder-0.5b"],
                    "models whose shipped head (artifacts/<model>/pruner_head) is measured")
  flags.DEFINE_list("budgets", ["256", "128"], "k of recall@k (tokens kept per window)")
  flags.DEFINE_string("cache_dir", None, "feature cache (default: the training run's)")
  flags.DEFINE_string("out", None, "results JSON (rows)")
  flags.DEFINE_string("tables_from", None, "print the table of an existing results JSON")


def head_config(folder) -> PrunerTrainConfig:
  """The training run's config, from the head's manifest."""
  got = artifacts.read_manifest(folder)["config"]
  known = {f.name for f in dataclasses.fields(PrunerTrainConfig)}
  return PrunerTrainConfig(**{k: v for k, v in got.items() if k in known})


def per_row(graphdef, params, rows, budgets, cfg: PrunerTrainConfig) -> list[dict]:
  """Kept positives per scorer and budget, positives and window size, per row; the
  head's scores from the step training's own validation runs (`train.eval_step`)."""
  out = []
  for r in rows:
    _, _, s = train.eval_step(graphdef, params, train.make_batch([r]),
                              lc=train.loss_settings(cfg))
    s = np.asarray(s[0, :r.rule.size])
    rec = dict(session=r.session, turn=r.turn, window=int(r.rule.size),
               positives=int((r.labels == 1).sum()))
    for k in budgets:
      rec[f"rule@{k}"] = loss.recall_at(r.rule, r.labels, k)[0]
      rec[f"head@{k}"] = loss.recall_at(s, r.labels, k)[0]
      rec[f"random@{k}"] = loss.random_kept_at(r.labels, k)
    out.append(rec)
  return out


def _recall(rows_of_sessions, key):
  kept = sum(r[key] for rs in rows_of_sessions for r in rs)
  pos = sum(r["positives"] for rs in rows_of_sessions for r in rs)
  return kept / pos if pos else float("nan")


def summarize(model: str, recs: list[dict], budgets) -> list[dict]:
  """One row per (budget, all windows / windows longer than k): each scorer's recall
  and the head's paired differences, with session-bootstrap intervals."""
  out = []
  for k in budgets:
    for scope in ("all", "over k"):
      sel = [r for r in recs if scope == "all" or r["window"] > k]
      per = {}
      for r in sel:
        per.setdefault(r["session"], []).append(r)
      row = dict(model=model, budget=k, scope=scope, rows=len(sel), sessions=len(per),
                 positives=sum(r["positives"] for r in sel))
      for sc in SCORERS:
        row[sc] = common.cluster_bootstrap(per, lambda ss, sc=sc: _recall(ss, f"{sc}@{k}"))
      for other in ("rule", "random"):
        row[f"head_minus_{other}"] = common.cluster_bootstrap(
            per, lambda ss, o=other: _recall(ss, f"head@{k}") - _recall(ss, f"{o}@{k}"))
      out.append(row)
  return out


def tables(rows: list[dict]) -> list[common.Table]:
  ci = lambda x: f"{x[0]:.3f} [{x[1]:.3f}, {x[2]:.3f}]"
  d = lambda x: f"{x[0]:+.3f} [{x[1]:+.3f}, {x[2]:+.3f}]"
  lines = [(r["model"], str(r["budget"]), r["scope"], str(r["sessions"]), str(r["rows"]),
            str(r["positives"]), ci(r["rule"]), ci(r["head"]), ci(r["random"]),
            d(r["head_minus_rule"]), d(r["head_minus_random"])) for r in rows]
  return [common.Table(
      "the shipped Phase-2 heads on their validation sessions: future-evidence recall@k "
      "(kept positives / positives, over the turns with a positive; 'over k': windows "
      "longer than k only), random = a uniformly random k of the window (expected); 95% "
      "bootstrap over sessions, differences paired on the same rows",
      ("model", "k", "windows", "sessions", "rows", "positives", "Phase-1 rule",
       "Phase-2 head", "random (chance)", "head - rule", "head - random"), lines)]


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, tables)
    return
  budgets = [int(b) for b in FLAGS.budgets]
  if any(b < 1 for b in budgets):
    raise app.UsageError(f"--budgets must be positive, got {FLAGS.budgets}")
  rows = []
  for model in FLAGS.models:
    folder = artifacts.resolve(f"artifacts/{model}/pruner_head")
    cfg = head_config(folder)
    if FLAGS.cache_dir:
      cfg = dataclasses.replace(cfg, cache_dir=FLAGS.cache_dir)
    graphdef, state = artifacts.load_pruner_head(folder, model_name=model)
    params = nnx.to_pure_dict(state)
    by_session = features.load_or_extract(cfg, cfg.val_traces, cfg.max_val_sessions)
    recs = per_row(graphdef, params, [r for rs in by_session.values() for r in rs], budgets,
                   cfg)
    rows += summarize(model, recs, budgets)
    jax.clear_caches()
    print(f"{model}: {len(recs)} validation rows in {len(by_session)} sessions", flush=True)
  common.write_rows(FLAGS.out, rows)
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
