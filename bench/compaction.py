"""Pruning and segment reuse, each alone and composed in one session, on agent sessions
whose client clears old tool outputs.

    python bench/compaction.py --traces=data_local/tau2_heldout.json \\
        --out=bench/results_compaction.json [--keep=2] [--budget=3584] [--max_tokens=8192]
        [--max_sessions=0] [--methods=full,reuse,pruned,pruned+reuse,random+reuse]

Workload: context editing, what agent clients do to stay within a context budget. Each
held-out tau2 session (SmolLM2, its tool outputs in the chat) is replayed turn by
turn through the batch engine (`jaxkv.evaluation.replay`: every assistant turn
teacher-forced with its gold reply, sessions side by side), and at each turn the
client sends the history with every tool output but the last `--keep` replaced by a
short placeholder. When a new tool output arrives, the one that leaves the window
changes the prompt in the middle: the session's cached path matches up to it, and
what follows it (the later calls and tool outputs, now at other positions after
another context) is prefilled again, or spliced from the segment store. Sessions
with more than `--keep` tool outputs only (the others are never edited); a session
stops before its first turn over `--max_tokens`.

Methods (one engine each; the same sessions and turns):

    full           no pruning, no reuse: the session's cached path only
    reuse          segment reuse in the session (`pruned+reuse` with pruning off)
    pruned         IntentKV (query mode) at --budget
    pruned+reuse   both, composed (`jaxkv.engine.mechanisms.composed`)
    random+reuse   random pruning at --budget with reuse: the chance line for
                   IntentKV's choice of what to keep

Reuse runs the shipped server config's setting (tiered, int8 store). Per turn: prompt
tokens, tokens served from the session's path, spliced tokens, tokens prefilled
(token-layers computed / layers: a token spliced at every layer counts 0), TTFT inside
the batch, live prompt KV after the turn, and against the gold reply: NLL and greedy
agreement (the model's argmax is the gold token); a call turn (a tool output follows)
is exact when greedy writes the whole call.

Table per method, over every turn and over the edited turns (where a tool output was
cleared, the only turns where reuse can act): mean prefilled tokens, TTFT p50, mean
live KV after the turn; token agreement with a 95% bootstrap interval over sessions
(the unit that varies) and Delta-NLL against full, paired by turn, intervals over
sessions; for the pruned methods Delta-NLL against random+reuse (the chance line),
paired by turn, intervals over sessions; call turns exact with a Wilson interval and
exact McNemar p against full.
--tables_from=FILE reprints the tables; a run keeps --out's rows of the methods it
does not run (one process per method is fine).
"""

from __future__ import annotations

import collections
import json
import os
import sys

import jax
import numpy as np
from absl import app, flags

import common
import jaxkv
from jaxkv.config import CacheConfig, PruningConfig, ReuseConfig
from jaxkv.data import calls as calls_lib
from jaxkv.data import labels, traces
from jaxkv.engine.mechanisms.composed import Composed
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.evaluation import replay

METHODS = ("full", "reuse", "pruned", "pruned+reuse", "random+reuse")
PRUNING = {"full": "none", "reuse": "none", "pruned": "intentkv", "pruned+reuse": "intentkv",
           "random+reuse": "random"}
REUSE = ReuseConfig(method="tiered", storage="int8")      # configs/smollm2_agents.py's
CLEARED = "[tool output cleared]"


def define_flags():
  flags.DEFINE_string("traces", None, "ToolBench-format held-out traces (scripts/make_traces.py)")
  flags.DEFINE_string("out", None, "JSON rows, one per turn")
  flags.DEFINE_string("methods", ",".join(METHODS[:4]), "methods to run, comma-separated")
  flags.DEFINE_integer("keep", 2, "tool outputs the client keeps (the latest ones)")
  flags.DEFINE_integer("budget", 3584, "pruning budget C (live prompt KV entries)")
  flags.DEFINE_integer("max_sessions", 0, "first N eligible sessions (0: all)")
  flags.DEFINE_integer("max_tokens", 8192, "a session stops before its first turn over this")
  flags.DEFINE_integer("max_batch", 4, "sessions in flight")
  flags.DEFINE_string("tables_from", None, "reprint the tables of a results file")


def cleared(messages: list[dict], i: int, keep: int) -> tuple[list[dict], int]:
  """(messages[:i + 1], the prompt messages[:i] and the gold reply, with every tool
  output before i but the last `keep` replaced by `CLEARED`; how many were cleared)."""
  tools = [j for j in range(i) if messages[j]["role"] == "tool"]
  drop = set(tools[:max(0, len(tools) - keep)])
  return ([dict(m, content=CLEARED) if j in drop else m for j, m in enumerate(messages[:i + 1])],
          len(drop))


def sessions_for(tok, trace_sessions, keep: int, max_tokens: int) -> list[replay.Session]:
  """The replayed sessions: every assistant turn, its history cleared (`cleared`),
  `meta` per turn (edited: a tool output was cleared since the previous turn; call:
  a tool output follows the reply)."""
  out = []
  for s in trace_sessions:
    msgs, tools = traces.session_chat(s, tok)
    if sum(m["role"] == "tool" for m in msgs) <= keep:
      continue
    turns, meta, before = [], {}, 0
    for i, m in enumerate(msgs):
      if m["role"] != "assistant" or i == 0:
        continue
      view, n_cleared = cleared(msgs, i, keep)
      p = labels.prepare_turn(tok, view, tools, i, reply=True)
      if len(p["ids"]) + len(p["gold"]) + 1 > max_tokens:
        break
      turns.append(replay.Turn(i, messages=view))
      meta[i] = {"edited": n_cleared > before,
                 "call": i + 1 < len(msgs) and msgs[i + 1]["role"] == "tool"}
      before = n_cleared
    if any(v["edited"] for v in meta.values()):
      out.append(replay.Session(s.id, msgs, tools, turns, meta=meta))
  return out


def make_engine(llm, method: str, budget: int, cache: CacheConfig, batch: int):
  """The method's engine, the recording pruned mechanism and the mechanism its turns name."""
  eng, rec = replay.engine_for(llm, PruningConfig(method=PRUNING[method], budget=budget), cache,
                               max_batch=batch)
  if "reuse" not in method:
    return eng, rec, rec.name
  ru = eng.add_mechanism(Reuse(ReuseRunner(llm, REUSE, cache=cache, kv=eng.kv_manager)))
  return eng, rec, eng.add_mechanism(Composed([rec, ru])).name


def run_method(llm, method: str, sessions: list[replay.Session], args) -> list[dict]:
  pages = common.replay_pages(0, args.max_batch, "engine", args.max_tokens)
  cache = CacheConfig(num_pages=pages, page_size=16, max_seq_len=args.max_tokens)
  eng, rec, mech = make_engine(llm, method, args.budget, cache, args.max_batch)
  rows: list[dict] = []

  def record(k: int, t: replay.Turn, res, metrics) -> None:
    s, x = sessions[k], res.extra or {}
    g = metrics.reply_tokens                      # the gold reply (not the lookahead token)
    agree = int(np.sum(np.asarray(res.argmax[:g]) == np.asarray(res.tokens[:g])))
    prefilled = x.get("prefill_tokens", res.prompt_tokens - res.cached_tokens)
    rows.append(dict(method=method, session=s.id, turn=t.i, **s.meta[t.i],
                     prompt_tokens=res.prompt_tokens, cached=res.cached_tokens,
                     reused=x.get("reused_tokens", 0), prefilled=float(prefilled),
                     ttft_s=res.ttft_s, live_after=x["kv_live_after"], pruned=x["pruned"],
                     tokens=g, agree=agree, logprob=float(np.sum(res.logprob[:g]))))

  replay.replay(eng, rec, sessions, desc=method, mechanism=mech, on_result=record)
  eng.kv_manager.check()
  return rows


def table(rows: list[dict], edited: bool) -> common.Table:
  rows = [r for r in rows if r["edited"] or not edited]
  methods = list(dict.fromkeys(r["method"] for r in rows))
  by = {m: {(r["session"], r["turn"]): r for r in rows if r["method"] == m} for m in methods}
  full = by.get("full", {})
  lines = []
  for m in methods:
    turns = by[m]
    per = collections.defaultdict(lambda: np.zeros(3))     # session -> agree, tokens, dNLL
    for key, r in turns.items():
      ref = full.get(key)
      per[key[0]] += (r["agree"], r["tokens"], 0.0 if ref is None else
                      ref["logprob"] - r["logprob"])
    agree = common.cluster_bootstrap(per, lambda xs: sum(x[0] for x in xs) / sum(x[1] for x in xs))
    dnll = "-"
    if full and m != "full":
      d = common.cluster_bootstrap(per, lambda xs: sum(x[2] for x in xs) / sum(x[1] for x in xs))
      dnll = f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"
    vs_random = "-"                      # the chance line for pruning, paired by turn
    rnd = by.get("random+reuse", {})
    if rnd and m not in ("random+reuse", "full", "reuse"):
      pair = collections.defaultdict(lambda: np.zeros(2))
      for key, r in turns.items():
        if key in rnd:
          pair[key[0]] += (rnd[key]["logprob"] - r["logprob"], r["tokens"])
      d = common.cluster_bootstrap(pair, lambda xs: sum(x[0] for x in xs) / sum(x[1] for x in xs))
      vs_random = f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"
    calls = {k: r for k, r in turns.items() if r["call"]}
    k_ok = sum(r["agree"] == r["tokens"] for r in calls.values())
    lo, hi = calls_lib.wilson(k_ok, len(calls))
    p = "-"
    if full and m != "full":
      both = [k for k in calls if k in full]
      b = sum(calls[k]["agree"] == calls[k]["tokens"] and full[k]["agree"] != full[k]["tokens"]
              for k in both)
      c = sum(full[k]["agree"] == full[k]["tokens"] and calls[k]["agree"] != calls[k]["tokens"]
              for k in both)
      p = f"{calls_lib.mcnemar(b, c):.2f} ({b}-{c})"
    vals = list(turns.values())
    lines.append([m, str(len(vals)), str(sum(r["pruned"] for r in vals)),
                  f"{np.mean([r['prefilled'] for r in vals]):.0f}",
                  f"{np.mean([r['cached'] for r in vals]):.0f}",
                  f"{np.mean([r['reused'] for r in vals]):.0f}",
                  f"{np.median([r['ttft_s'] for r in vals]):.2f}",
                  f"{np.mean([r['live_after'] for r in vals]):.0f}",
                  f"{agree[0]:.3f} [{agree[1]:.3f}, {agree[2]:.3f}]", dnll, vs_random,
                  f"{k_ok}/{len(calls)} [{lo:.2f}, {hi:.2f}]" if calls else "-", p])
  n_s = len({r["session"] for r in rows})
  return common.Table(
      f"{'edited turns (a tool output cleared since the last turn)' if edited else 'every turn'}"
      f" of {n_s} sessions, teacher-forced through the engine; intervals: 95%, bootstrap over "
      "sessions (agreement, dNLL) or Wilson (calls); McNemar p against full (wins-losses)",
      ["method", "turns", "pruned", "prefilled / turn", "cached / turn", "spliced / turn",
       "TTFT p50 s", "live KV after", "token agreement [95% CI]", "dNLL vs full [95% CI]",
       "dNLL vs random+reuse (paired)", "calls exact [95% CI]", "p vs full"], lines)


def tables(rows: list[dict]) -> list[common.Table]:
  return [table(rows, edited=False), table(rows, edited=True)]


def main(argv):
  del argv
  args = flags.FLAGS
  if args.tables_from:
    common.print_tables_from(args.tables_from, tables)
    return
  if not args.traces:
    raise app.UsageError("--traces is required")
  methods = common.method_names(args.methods, METHODS)
  llm = jaxkv.load("smollm2-135m", verbose=False)
  found = traces.load_toolbench(args.traces)
  sessions = sessions_for(llm.tokenizer, found, args.keep, args.max_tokens)
  if args.max_sessions:
    sessions = sessions[:args.max_sessions]
  print(f"{len(sessions)} of {len(found)} sessions have a tool output cleared "
        f"(keep {args.keep}, {sum(len(s.turns) for s in sessions)} turns)", file=sys.stderr)
  rows: list[dict] = []
  if args.out and os.path.exists(args.out):      # a rerun keeps the other methods' rows
    with open(args.out) as f:
      rows = [r for r in json.load(f) if r["method"] not in methods]
  for m in methods:
    rows = [r for r in rows if r["method"] != m] + run_method(llm, m, sessions, args)
    common.write_rows(args.out, rows)
    jax.clear_caches()      # each method compiles its own pool's steps: free the last one's
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
