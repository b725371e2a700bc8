"""Next-call accuracy under KV pruning (IntentKV's task-level quality), side by side.

    python bench/agent_eval.py --traces=data_local/tau2_heldout.json --out=results.json \\
        [--methods=full,random,streaming_llm,snapkv,h2o,intentkv_query,intentkv_memory,
                   intentkv_learnable] [--budgets=2048,3072] [--layouts=dead_slot,compact] \\
        [--max_sessions=8] [--model=smollm2-135m]

Any ToolBench-format file works. For every assistant turn of a session that makes
a tool call, the real history up to that turn (tool outputs included) goes through
`SessionRunner` with the method under test -- radix prefix cache on, pruning events
exactly as in serving, one QueryMemory per session -- and the model then generates
the turn freely (greedy, its own tool-call template, up to --max_tokens). The call
it writes is scored against the trace (`jaxkv.data.calls`): exact match of tool name
and JSON-normalised arguments, and name only. Later turns still see the trace's
history, so every turn is one sample, and a miss is what IntentKV claims to
prevent: an argument needed now was evicted earlier.

Rows (JSON, written as each configuration finishes; a rerun with the same --out
resumes): method, layout, budget, next_call_exact / next_call_name (rates) with
their Wilson 95% intervals (`*_ci`), n_calls, n_sessions, pruned_share, and the
efficiency columns of `bench/pruning.py` over the real decode steps: pt,
eff_live_kv, raw_reads, eff_reads, prefix_hit_rate, wall_s. `full` (no pruning) is
the headroom; `random` the chance baseline.
"""

from __future__ import annotations

import os

from absl import app, flags
from tqdm import tqdm

import common
import pruning

import jaxkv
from jaxkv import artifacts
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import calls, traces
from jaxkv.engine.sessions import SessionRunner

METHODS = {"full": dict(method="none"), **pruning.METHODS, **pruning.LEARNABLE}


def call_turns(session: traces.Session) -> list[int]:
  """Message indices of the assistant turns that make a tool call (after the first message)."""
  return [i for i, t in enumerate(session.turns) if i > 0 and t.role == "assistant"
          and t.tool_calls]


def run_session(runner: SessionRunner, session: traces.Session, tokenizer,
                max_tokens: int) -> list[dict]:
  """One sample per tool-call turn: {turn, exact, name, text} plus the turn's metrics.

  Every assistant turn runs (so pruning and the memory advance as in serving);
  turns without a gold call are generated too but not scored."""
  messages, tools = traces.session_chat(session, tokenizer)
  scored = set(call_turns(session))
  out = []
  for i, m in enumerate(messages):
    if m.get("role") != "assistant" or i == 0:
      continue
    t = runner.run_turn(session.id, messages, tools, i, generate=True, max_tokens=max_tokens)
    rec = dict(turn=i, metrics=t)
    if i in scored:
      exact, name = calls.match(calls.parse_calls(t.text), session.turns[i].tool_calls)
      rec.update(exact=exact, name=name, text=t.text)
    out.append(rec)
  return out


def summarize(samples_by_session: list[list[dict]]) -> dict:
  """Rates with Wilson intervals, and the efficiency columns of bench/pruning.py."""
  flat = [s for ss in samples_by_session for s in ss if "exact" in s]
  n = len(flat)
  k_exact, k_name = sum(s["exact"] for s in flat), sum(s["name"] for s in flat)
  turns = [[s["metrics"] for s in ss] for ss in samples_by_session]
  eff = pruning.summarize(turns, turns)
  keep = ("pt", "eff_live_kv", "raw_reads", "eff_reads", "prefix_hit_rate", "wall_s",
          "pruned_share", "n_sessions", "n_turns", "future_evidence_recall")
  return dict(next_call_exact=k_exact / n if n else float("nan"),
              next_call_exact_ci=list(calls.wilson(k_exact, n)),
              next_call_name=k_name / n if n else float("nan"),
              next_call_name_ci=list(calls.wilson(k_name, n)), n_calls=n,
              **{k: eff[k] for k in keep})


def evaluate(llm, sessions, cfg: PruningConfig, cache: CacheConfig, *, head=None,
             max_tokens: int = 96, desc: str = "") -> dict:
  """One configuration over `sessions` (a fresh runner: pool, radix cache, memories)."""
  runner = SessionRunner(llm, cfg, cache=cache,
                         head=head if cfg.intent_mode == "learnable" else None)
  samples = [run_session(runner, s, llm.tokenizer, max_tokens)
             for s in tqdm(sessions, desc=desc, leave=False)]
  return summarize(samples)


FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("traces", None, "ToolBench-format JSON (scripts/make_traces.py)")
  flags.DEFINE_string("out", None, "write JSON rows here (a rerun resumes)")
  flags.DEFINE_string("tables_from", None, "print the table of an earlier --out JSON and exit")
  flags.DEFINE_string("model", "smollm2-135m", "preset or model path")
  flags.DEFINE_string("methods", "full,random,streaming_llm,snapkv,h2o,intentkv_query,"
                      "intentkv_memory,intentkv_learnable", f"of {','.join(METHODS)}")
  flags.DEFINE_string("head", artifacts.PRUNER_HEAD, "residual head for learnable methods")
  flags.DEFINE_string("layouts", "dead_slot,compact", "dead_slot and/or compact")
  flags.DEFINE_string("budgets", "2048,3072", "C, with the tool-schema system prompt forced")
  flags.DEFINE_integer("max_sessions", 8, "sessions to replay")
  flags.DEFINE_integer("max_prompt", 7000, "skip sessions whose final prompt exceeds this")
  flags.DEFINE_integer("max_tokens", 96, "generated tokens per turn")
  flags.DEFINE_integer("num_pages", 2048, "KV pool pages")


HEADER = ("method", "layout", "C", "exact", "95% CI", "name", "95% CI", "n", "pruned %",
          "Eff. live", "Eff. reads", "hit %")


def table(rows: list[dict]) -> common.Table:
  ci = lambda x: f"[{x[0]:.2f}, {x[1]:.2f}]"
  return common.Table(
      "next-call accuracy (free generation over the pruned cache; Wilson 95% intervals)",
      HEADER, [(r["method"], r["layout"], str(r["budget"]), f"{r['next_call_exact']:.3f}",
                ci(r["next_call_exact_ci"]), f"{r['next_call_name']:.3f}",
                ci(r["next_call_name_ci"]), str(r["n_calls"]), f"{100 * r['pruned_share']:.0f}",
                f"{r['eff_live_kv']:.0f}", f"{r['eff_reads']:.0f}",
                f"{100 * r['prefix_hit_rate']:.0f}") for r in rows])


def main(argv):
  del argv
  import json
  if FLAGS.tables_from:
    with open(FLAGS.tables_from) as f:
      common.print_tables([table(json.load(f))])
    return
  if not FLAGS.traces:
    raise app.UsageError("--traces is required (make one with scripts/make_traces.py)")
  if not os.path.exists(FLAGS.traces):
    raise app.UsageError(f"{FLAGS.traces} does not exist; make it with scripts/make_traces.py "
                         "--source=tau2 --domains=airline,retail --out=data_local/tau2_train.json "
                         "--held_out=data_local/tau2_heldout.json")
  names = FLAGS.methods.split(",")
  unknown = sorted(set(names) - set(METHODS))
  if unknown:
    raise app.UsageError(f"unknown methods {unknown}; known: {sorted(METHODS)}")
  llm = jaxkv.load(FLAGS.model)
  head = (artifacts.load_pruner_head(FLAGS.head, model_name=FLAGS.model)
          if set(names) & set(pruning.LEARNABLE) else None)
  sessions = []
  for s in traces.load_toolbench(FLAGS.traces):
    msgs, tools = traces.session_chat(s, llm.tokenizer)
    n = len(llm.tokenizer.encode_chat(msgs, tools=tools, add_generation_prompt=False))
    if n + FLAGS.max_tokens <= FLAGS.max_prompt and call_turns(s):
      sessions.append(s)
    if len(sessions) == FLAGS.max_sessions:
      break
  cache = CacheConfig(num_pages=FLAGS.num_pages, page_size=16,
                      max_seq_len=FLAGS.max_prompt + 1024)
  rows = []
  if FLAGS.out and os.path.exists(FLAGS.out):
    with open(FLAGS.out) as f:
      rows = json.load(f)
  have = {(r["method"], r["layout"], r["budget"]) for r in rows}
  configs = [("full", "-", 0)] if "full" in names else []
  configs += [(m, lay, int(b)) for b in FLAGS.budgets.split(",") for m in names if m != "full"
              for lay in FLAGS.layouts.split(",")]
  for name, layout, budget in configs:
    if (name, layout, budget) in have:
      continue
    cfg = (PruningConfig(method="none") if name == "full" else
           PruningConfig(layout=layout, budget=budget, **METHODS[name]))
    r = evaluate(llm, sessions, cfg, cache, head=head, max_tokens=FLAGS.max_tokens,
                 desc=f"{name}/{layout}/C={budget}")
    rows.append(dict(method=name, layout=layout, budget=budget, **r))
    print(f"{name:18s} {layout:9s} C={budget:5d} exact={r['next_call_exact']:.3f} "
          f"name={r['next_call_name']:.3f} n={r['n_calls']}", flush=True)
    common.write_rows(FLAGS.out, rows)
  print(f"\n{FLAGS.model}, {len(sessions)} sessions from {FLAGS.traces}")
  common.print_tables([table(rows)])


if __name__ == "__main__":
  define_flags()
  app.run(main)
