"""KV pruning on agent sessions: methods x layouts x budgets, side by side (IntentKV Tables 2, 7).

    python bench/pruning.py --traces=data_local/tau2_heldout.json --out=results.json \\
        [--methods=streaming_llm,snapkv,h2o,intentkv_query,intentkv_memory] \\
        [--layouts=dead_slot,compact] [--budgets=512,1024] [--max_sessions=8] \\
        [--model=smollm2-135m]

Any ToolBench-format file works (`jaxkv.data.traces.load_toolbench`). Every
session is replayed teacher-forced (assistant turns from the trace) with a radix
prefix cache; each configuration starts from a fresh cache and QueryMemory store.
The dead-slot layout (and the full cache) replays through the serving engine's
`pruned` mechanism, --batch sessions side by side (`jaxkv.evaluation.replay`);
the compact layout, which serving does not use, through the batch-1
`SessionRunner` (--replay=runner sends every layout there). A full-cache run (no
pruning, same radix cache) gives the reference NLL for Delta-NLL.

Columns (IntentKV section 4.1; means over sessions unless stated):
  PT           per-session max of the raw request size |R_t| (tokens)
  Eff. live    per-session max of the live KV |K_t| after pruning
  Raw / Eff.   per-session sums of |R_t| / |K_t| over decode steps (reply tokens)
  hit %        prefix-cache hit tokens / prompt tokens (all requests)
  wall s       per-session wall time (this machine; through the engine, where
               sessions overlap, the configuration's elapsed time / sessions)
  dNLL         mean over turns of NLL(gold turn | pruned) - NLL(gold turn | full)
  recall       future-evidence recall: kept / all history tokens copied into
               the next five tool-call arguments (micro-average)
  cand. recall the same over evidence outside the forced system prefix (tool
               schemas there repeat argument values and are always kept)
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
from absl import app, flags
from tqdm import tqdm

import common
import jaxkv
from jaxkv import artifacts
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import traces
from jaxkv.engine.sessions import SessionRunner
from jaxkv.evaluation import replay

METHODS = {
    "random": dict(method="random"),          # chance control: same forced set and budget
    "streaming_llm": dict(method="streaming_llm"),
    "snapkv": dict(method="snapkv"),
    "h2o": dict(method="h2o"),
    "intentkv_query": dict(method="intentkv", intent_mode="query"),
    "intentkv_memory": dict(method="intentkv", intent_mode="memory"),
}
# With --head: IntentKV Phase-2 and the appendix-B ablations (IntentKV Table 4).
LEARNABLE = {
    "intentkv_learnable": dict(method="intentkv", intent_mode="learnable"),
    "learnable-memory": dict(method="intentkv", intent_mode="learnable", ablate_memory=True),
    "learnable-xattn": dict(method="intentkv", intent_mode="learnable", ablate_xattn=True),
    "learnable-residual": dict(method="intentkv", intent_mode="learnable",
                               ablate_residual=True),
    # The head's scores max-pooled over 7 positions (SnapKV's kernel, not tuned), so a
    # kept token keeps its neighbours; on BFCL it did not beat the head (pruning-calls.md).
    "intentkv_maxpool": dict(method="intentkv", intent_mode="learnable", intent_pool=7),
}


class Runner:
  """Runs one configuration over the sessions: dead-slot layouts through one engine
  (built once, its policy switched between configurations: every session and cached
  path forgotten), compact ones through a fresh batch-1 `SessionRunner`."""

  def __init__(self, llm, cache: CacheConfig, *, batch: int = 8, engine: bool = True):
    self.llm, self.cache, self.batch, self.use_engine = llm, cache, batch, engine
    self.engine = self.rec = None

  def __call__(self, sessions, pruning: PruningConfig, desc: str, head=None):
    llm = self.llm
    head = head if pruning.intent_mode == "learnable" else None
    if not self.use_engine or pruning.layout != "dead_slot":      # on the engine's pool
      runner = SessionRunner(llm, pruning, cache=self.cache, head=head,
                             kv=None if self.engine is None else self.engine.kv_manager)
      return [runner.run_session(s.id, *traces.session_chat(s, llm.tokenizer))
              for s in tqdm(sessions, desc=desc, leave=False)]
    if self.engine is None:
      self.engine, self.rec = replay.engine_for(llm, pruning, self.cache, max_batch=self.batch,
                                                head=head)
    else:
      self.rec.set_policy(pruning, head=head)
    jobs = []
    for s in sessions:
      msgs, tools = traces.session_chat(s, llm.tokenizer)
      jobs.append(replay.Session(s.id, msgs, tools, replay.all_turns(msgs)))
    return replay.timed(self.engine, self.rec, jobs, desc=desc)


def summarize(turns_by_session, full_by_session) -> dict:
  per = [dict(pt=max(t.pt for t in ts), eff_live=max(t.eff_live_kv for t in ts),
              raw=sum(t.raw_reads for t in ts), eff=sum(t.eff_reads for t in ts),
              wall=sum(t.wall_s for t in ts)) for ts in turns_by_session if ts]
  flat = [t for ts in turns_by_session for t in ts]
  full = [t for ts in full_by_session for t in ts]
  dnll = [a.nll - b.nll for a, b in zip(flat, full)]
  ev = sum(t.evidence for t in flat)
  evc = sum(t.evidence_candidates for t in flat)
  return {
      "pt": float(np.mean([p["pt"] for p in per])),
      "eff_live_kv": float(np.mean([p["eff_live"] for p in per])),
      "raw_reads": float(np.mean([p["raw"] for p in per])),
      "eff_reads": float(np.mean([p["eff"] for p in per])),
      "prefix_hit_rate": sum(t.hit_tokens for t in flat) / max(1, sum(t.prompt_tokens
                                                                      for t in flat)),
      "wall_s": float(np.mean([p["wall"] for p in per])),
      "delta_nll": float(np.mean(dnll)) if dnll else math.nan,
      "future_evidence_recall": sum(t.evidence_kept for t in flat) / ev if ev else math.nan,
      # the same over evidence outside the forced system prefix: what the scorer chose
      "candidate_evidence_recall": (sum(t.evidence_candidates_kept for t in flat) / evc
                                    if evc else math.nan),
      "evidence_tokens": ev,
      "candidate_evidence_tokens": evc,
      "pruned_share": float(np.mean([t.pruned for t in flat])) if flat else 0.0,
      # IntentKV: median cos(M_t, Enc(q_t)) over turns after each session's first
      # (near 1: the memory is the current turn alone, and memory mode = query mode)
      "memory_cos": _median([t.memory_cos for ts in turns_by_session for t in ts[1:]]),
      "n_sessions": len(per),
      "n_turns": len(flat),
  }


def _median(xs) -> float:
  xs = [x for x in xs if not math.isnan(x)]
  return float(np.median(xs)) if xs else math.nan


FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this
  module next to other absl scripts never clashes)."""
  flags.DEFINE_string("traces", None, "ToolBench-format JSON")
  flags.DEFINE_string("tables_from", None, "print the tables of an earlier --out JSON and exit")
  flags.DEFINE_string("out", None, "write JSON rows here")
  flags.DEFINE_string("model", "smollm2-135m", "preset or model path")
  flags.DEFINE_string("methods", None,
                      f"default: {','.join(METHODS)}; also {','.join(LEARNABLE)} (--head)")
  flags.DEFINE_string("head", artifacts.PRUNER_HEAD,
                      "trained residual head for IntentKV learnable (default: the shipped "
                      "one; scripts/train_pruner.py makes others)")
  flags.DEFINE_string("layouts", "dead_slot,compact", "dead_slot and/or compact")
  flags.DEFINE_string("compact_budgets", None,
                      "budgets at which the compact layout also runs (default: all)")
  flags.DEFINE_string("budgets", "3584,4096",
                      "C; the forced set includes the tool-schema system prompt (~1.2-4.3k "
                      "tokens in tau2/agentdojo), so C* = C - |F| is the history kept")
  flags.DEFINE_integer("max_sessions", 8, "sessions to replay")
  flags.DEFINE_integer("max_tokens", 7000,
                       "skip sessions whose final prompt exceeds this many tokens")
  common.define_replay_flags(flags, "max_tokens")

def main(argv):
  del argv
  args = FLAGS
  if args.tables_from:
    with open(args.tables_from) as f:
      print_tables(json.load(f))
    return
  if not args.traces:
    raise app.UsageError("--traces is required")

  llm = jaxkv.load(args.model)
  head = None
  methods = dict(METHODS)
  names = args.methods.split(",") if args.methods else list(methods)
  if args.head and set(names) & set(LEARNABLE):
    head = artifacts.load_pruner_head(args.head, model_name=args.model)
    methods.update(LEARNABLE)
  common.method_names(",".join(names), methods, " (learnable ones need --head)")
  sessions = []
  for s in traces.load_toolbench(args.traces):
    msgs, tools = traces.session_chat(s, llm.tokenizer)
    n = len(llm.tokenizer.encode_chat(msgs, tools=tools, add_generation_prompt=False))
    if n <= args.max_tokens and any(m["role"] == "assistant" for m in msgs[1:]):
      sessions.append(s)
    if len(sessions) == args.max_sessions:
      break
  pages = common.replay_pages(args.num_pages, args.batch, args.replay, args.max_tokens + 1024)
  cache = CacheConfig(num_pages=pages, page_size=16, max_seq_len=args.max_tokens + 1024)
  # Rows are written as each configuration finishes; a rerun with the same --out
  # resumes (configurations already in the file are not run again).
  rows = []
  if args.out and os.path.exists(args.out):
    with open(args.out) as f:
      rows = json.load(f)
  # learnable rows name their head (digest of its files): another head runs again
  head_id = (hashlib.sha256(json.dumps(artifacts.file_digests(artifacts.resolve(args.head)),
                                       sort_keys=True).encode()).hexdigest()[:12]
             if head is not None else None)
  have = {(r["method"], r["layout"], r["budget"], r.get("head")) for r in rows}
  run_config = Runner(llm, cache, batch=args.batch, engine=args.replay == "engine")
  full = run_config(sessions, PruningConfig(method="none"), "full cache")
  if ("full", "-", 0, None) not in have:
    rows.insert(0, dict(method="full", layout="-", budget=0, **summarize(full, full)))
  for budget in [int(b) for b in args.budgets.split(",")]:
    for name in names:
      for layout in args.layouts.split(","):
        if (layout == "compact" and args.compact_budgets is not None
            and str(budget) not in args.compact_budgets.split(",")):
          continue
        row_head = head_id if name in LEARNABLE else None
        if (name, layout, budget, row_head) in have:
          continue
        cfg = PruningConfig(layout=layout, budget=budget, **methods[name])
        turns = run_config(sessions, cfg, f"{name}/{layout}/C={budget}", head)
        rows.append(dict(method=name, layout=layout, budget=budget, **summarize(turns, full),
                         **({"head": row_head} if row_head else {})))
        r = rows[-1]
        print(f"{name:16s} {layout:9s} C={budget:5d}  eff_reads={r['eff_reads']:.0f} "
              f"hit={100 * r['prefix_hit_rate']:.0f}% dNLL={r['delta_nll']:+.3f} "
              f"recall={r['future_evidence_recall']:.3f} wall={r['wall_s']:.1f}s", flush=True)
        common.write_rows(args.out, rows)

  print(f"\n{args.model}, {len(sessions)} sessions / {rows[0]['n_turns']} turns from "
        f"{args.traces}; teacher-forced replay, radix prefix cache on")
  print_tables(rows)
  common.write_rows(args.out, rows)


HEADER = ("method", "layout", "C", "PT", "Eff. live", "Raw reads", "Eff. reads", "hit %",
          "wall s", "dNLL", "recall", "cand. recall", "pruned %")


def _cells(r):
  return (r["method"], r["layout"], str(r["budget"]), f"{r['pt']:.0f}", f"{r['eff_live_kv']:.0f}",
          f"{r['raw_reads']:.0f}", f"{r['eff_reads']:.0f}", f"{100 * r['prefix_hit_rate']:.1f}",
          f"{r['wall_s']:.1f}", f"{r['delta_nll']:+.3f}", f"{r['future_evidence_recall']:.3f}",
          f"{r.get('candidate_evidence_recall', math.nan):.3f}", f"{100 * r['pruned_share']:.0f}")


def tables(rows: list[dict], everything: bool = True) -> list[common.Table]:
  """Table 2 shape (published layouts: baselines compact, IntentKV dead-slot, per budget
  where both exist), Table 7 shape (layout ablation), Table 4 shape (with the learnable
  methods), then (everything) every row."""
  out = []
  budgets = sorted({r["budget"] for r in rows if r["budget"]})
  full = [r for r in rows if r["method"] == "full"]
  for b in budgets:
    pub = [r for r in rows if r["budget"] == b and (
        (r["method"].startswith("intentkv") and r["layout"] == "dead_slot")
        or (not r["method"].startswith("intentkv") and r["layout"] == "compact"))]
    if any(r["layout"] == "compact" for r in pub):
      out.append(common.Table(f"Table 2 shape, C={b}: baselines in their published compact "
                              "layout, IntentKV dead-slot", HEADER,
                              [_cells(r) for r in full + pub]))
    abl = [r for r in rows if r["budget"] == b]
    if {r["layout"] for r in abl} >= {"dead_slot", "compact"}:
      out.append(common.Table(f"Table 7 shape, C={b}: the same scorers under both layouts",
                              HEADER, [_cells(r) for r in sorted(abl, key=lambda r: r["method"])]))
    t4 = {r["method"]: r for r in rows if r["budget"] == b and r["layout"] == "dead_slot"}
    if "intentkv_learnable" in t4:
      out.append(common.Table(f"Table 4 shape, C={b} (dead-slot): Phase-1, Phase-2 and its "
                              "ablations", T4_HEADER,
                              [_t4_cells(label, t4[m]) for m, label in T4_ROWS if m in t4]))
  if everything:
    out.append(common.Table("All rows", HEADER, [_cells(r) for r in rows]))
  return out


def print_tables(rows: list[dict]) -> None:
  common.print_tables(tables(rows))


T4_HEADER = ("variant", "cand. recall", "recall", "dNLL", "cos(M, Enc)",
             "evidence tokens (cand.)", "turns")
T4_ROWS = (("random", "random (chance)"), ("intentkv_query", "Phase-1 query"),
           ("intentkv_memory", "Phase-1 memory"),
           ("intentkv_learnable", "Phase-2 (learnable)"), ("learnable-memory", "  - memory"),
           ("learnable-xattn", "  - x-attn"), ("learnable-residual", "  - residual"))


def _t4_cells(label, r):
  return (label, f"{r.get('candidate_evidence_recall', math.nan):.3f}",
          f"{r['future_evidence_recall']:.3f}", f"{r['delta_nll']:+.3f}",
          # query mode and "-memory" score with Enc(q_t) itself (their M_t is kept, unread)
          "1 (Enc)" if r["method"] in ("intentkv_query", "learnable-memory")
          else _fmt_cos(r.get("memory_cos", math.nan)),
          f"{r['evidence_tokens']} ({r.get('candidate_evidence_tokens', 0)})", str(r["n_turns"]))


def _fmt_cos(x: float) -> str:
  return "-" if math.isnan(x) else f"{x:.4f}"


if __name__ == "__main__":
  define_flags()
  app.run(main)
