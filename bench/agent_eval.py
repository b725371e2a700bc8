"""Task accuracy under KV pruning (IntentKV's quality measure), side by side.

Next-call accuracy over replayed sessions:

    python bench/agent_eval.py --traces=data_local/tau2_heldout.json --out=results.json \\
        [--methods=full,random,streaming_llm,snapkv,h2o,intentkv_query,intentkv_memory,
                   intentkv_learnable] [--budgets=3584,4096] [--layouts=dead_slot,compact] \\
        [--max_sessions=8] [--min_calls=1] [--model=smollm2-135m]

Any ToolBench-format file works. For every assistant turn of a session that makes
a tool call, the real history up to that turn (tool outputs included) goes through
the engine with the method under test -- radix prefix cache on, pruning events
exactly as in serving, one QueryMemory per session -- and the model then generates
the turn freely (greedy, its own tool-call template, up to --max_tokens). The call
it writes is scored against the trace (`jaxkv.data.calls`): exact match of tool name
and JSON-normalised arguments, and name only. Later turns still see the trace's
history, so every turn is one sample, and a miss is what IntentKV claims to
prevent: an argument needed now was evicted earlier.

Closed loop in a tool environment (`jaxkv.engine.agent_loop`, `jaxkv.data.envs`):

    python bench/agent_eval.py --env=tau2|agentdojo|my.module:MyEnv \\
        [--traces=data_local/tau2_heldout.json] [--max_tasks=N] [--max_turns=32] ...

The model acts: its calls run in the environment until it answers (or hits the
turn cap / the cache, or repeats its last calls and gets the same answers), and the
benchmark's own offline check grades the episode. With --traces only the tasks its
session ids name run (the held-out split); tasks that an agent doing nothing passes
are skipped and counted. Episodes run --batch at a time through the engine
(`jaxkv.evaluation.closed_loop`, bench/agent_env.py), each turn under the tool grammar
(--constrain: calls name the environment's tools and carry only their declared
parameters); tau2 runs with its domain policy (--policy) and a scripted user that
answers --confirm of the agent's questions with a yes; --max_tokens is raised to fit
the longest gold call of the tasks. Each episode's transcript is kept in the row.

Rows (JSON, written as each configuration finishes; a rerun with the same --out
resumes, next-call runs from the last --checkpoint_every sessions: each session's turn
metrics go to <out>.partial.jsonl as they finish, a progress line each time): method,
layout, budget; next-call mode: next_call_exact / next_call_name (rates) with their
Wilson 95% intervals (`*_ci`), n_calls, n_sessions,
next_call_args (gold argument values the generated call carries under the same key,
`calls.argument_hits`, pooled over n_args arguments), next_call_copied (the same
values read from the raw text, `calls.argument_mentions`: a call cut off by the token
cap still shows the IDs it copied), the generated `texts` and per call (`calls`:
session, turn, exact, name, prunable = its prunable-only gold values, kept = all of
them survived pruning whole, `kept_values`; kept_share = the least-kept value's largest
share of one occurrence's tokens kept: 1.0 whole, 0 gone, between: cut mid-value; None
where not recorded); closed loop:
compl, raw_acc, true_acc with intervals, n_tasks, the outcome counts and each
episode (`episodes`); both: pruned_share and the efficiency columns of
`bench/pruning.py` over the real decode steps: pt, eff_live_kv, raw_reads,
eff_reads, prefix_hit_rate, wall_s; learnable rows: head (its path and file digest,
`head_fingerprint`). `full` (no pruning) is the headroom; `random`
the chance baseline. The dead-slot layout and the full cache replay through the serving
engine's `pruned` mechanism, --batch sessions side by side (`jaxkv.evaluation.replay`:
a free turn with the tool name given stops at the token that completes the call);
the compact layout, which serving does not use, through the batch-1 `SessionRunner`
(--replay=runner: everything there, a free turn checked for completion every 16
tokens). Between configurations only the system prompts every session shares stay
cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
from absl import app, flags
from tqdm import tqdm

import agent_env
import agent_splits
import agent_stats
import agent_tables
import common
import jaxkv
import pruning
from jaxkv import artifacts
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import calls, envs, labels, traces
from jaxkv.engine import agent_loop
from jaxkv.engine.sessions import SessionRunner, TurnMetrics
from jaxkv.evaluation import replay

METHODS = {"full": dict(method="none"), **pruning.METHODS, **pruning.LEARNABLE}


call_turns = agent_splits.call_turns


def head_fingerprint(path: str) -> str:
  """`path@<12 hex>`: the head folder's path and a digest of its files' sha256s, kept on
  learnable rows (which head scored them) and in their journal key (a resumed run never
  mixes sessions scored by two heads)."""
  digests = artifacts.file_digests(artifacts.resolve(path))
  return f"{path}@{hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:12]}"


ARG_MARKERS = ('"arguments": ', '"arguments":', "Action Input: ", "Action Input:")


def argument_prefix(tokenizer, gold) -> int:
  """Tokens of a gold call turn up to where its arguments begin (the thought, the tool
  name and the template's markup before them); 0 if no marker is found."""
  text = tokenizer.decode(list(gold))
  pos = next((text.index(m) + len(m) for m in ARG_MARKERS if m in text), None)
  if pos is None:
    return 0
  k = 0
  while k < len(gold) and len(tokenizer.decode(list(gold[:k + 1]))) <= pos:
    k += 1
  return k


def plan_session(session: traces.Session, tokenizer, max_tokens: int,
                 given: str = "none") -> replay.Session:
  """The turns to run for one session's samples: one per tool-call turn.

  Every assistant turn up to the last scored one runs (so pruning and the memory
  advance as in serving); a turn without a gold call (a text reply in between) is
  teacher-forced, not generated, and turns after the last call (the final answer)
  cannot change a score and are skipped. `given="name"`: the gold turn up to its
  arguments (thought, tool name) is forced, the model writes the arguments and
  generation stops once they are a whole JSON value; the call scored is the gold
  name with those arguments (`calls.completed_call`), so `name` is then the rate
  of well-formed argument objects."""
  messages, tools = traces.session_chat(session, tokenizer)
  scored = set(call_turns(session))
  # with the head forced, the reply is done once it completes the call
  done = lambda ids: bool(calls.completed_call("", tokenizer.decode(list(ids))))
  turns, prunable, spans, history = [], {}, {}, {}
  for i, m in enumerate(messages):
    if m.get("role") != "assistant" or i == 0 or i > max(scored, default=-1):
      continue
    k = 0
    if i in scored:
      p = labels.prepare_turn(tokenizer, messages, tools, i)
      prunable[i] = labels.prunable_only_values(p, messages, i)
      spans[i] = labels.value_spans(p, prunable[i])
      history[i] = p["qs"] - p["sys_len"]    # what the history scope's C counts
      if given == "name":
        k = argument_prefix(tokenizer, p["gold"])
    turns.append(replay.Turn(i, generate=i in scored, max_tokens=max_tokens, forced_reply=k,
                             until=done if k else None))
  return replay.Session(session.id, messages, tools, turns,
                        meta={"prunable": prunable, "spans": spans, "history": history})


def kept_values(plan: replay.Session, metrics) -> dict[int, list[float]]:
  """Per scored turn: how much of each prunable-only gold value survived pruning, the
  largest share of one occurrence's tokens kept (`labels.values_coverage`: 1.0 whole,
  0.0 gone, between: cut mid-value), from the turn's kept mask. Turns whose metrics
  carry no mask (read back from a journal) are left out; journals written before the
  shares hold booleans (whole or not)."""
  spans = plan.meta.get("spans", {})
  return {t.i: [round(c, 4) for c in labels.values_coverage(spans[t.i],
                                                            np.asarray(m.kept, bool))]
          for t, m in zip(plan.turns, metrics) if t.i in spans and m.kept is not None}


def score_session(session: traces.Session, plan: replay.Session, metrics,
                  kept: dict[int, list[bool]] | None = None) -> list[dict]:
  """One sample per tool-call turn: {turn, exact, name, text, prunable (gold argument
  values found only in prunable history), values_kept (`kept_values`: each of those
  values whole in the pruned cache, None when not known), ...} plus the turn's
  metrics; the other turns' records carry their metrics only."""
  kept = kept_values(plan, metrics) if kept is None else kept
  out = []
  for t, m in zip(plan.turns, metrics):
    rec = dict(session=session.id, turn=t.i, metrics=m)
    if t.generate:
      gold = session.turns[t.i].tool_calls
      # with the head forced, the call is the gold name and the arguments written
      pred = (calls.completed_call(gold[0].name, m.text) if t.forced_reply
              else calls.parse_calls(m.text))
      exact, name = calls.match(pred, gold)
      hits, n_args = calls.argument_hits(pred, gold)
      rec.update(exact=exact, name=name, arg_hits=hits, n_args=n_args, text=m.text,
                 arg_mentions=calls.argument_mentions(m.text, gold)[0],
                 prunable=len(plan.meta.get("prunable", {}).get(t.i, [])),
                 values_kept=kept.get(t.i), history=plan.meta.get("history", {}).get(t.i))
    out.append(rec)
  return out


def run_session(runner: SessionRunner, session: traces.Session, tokenizer,
                max_tokens: int, given: str = "none") -> list[dict]:
  """`plan_session`'s turns on the batch-1 `SessionRunner`, scored."""
  plan = plan_session(session, tokenizer, max_tokens, given)
  metrics = [runner.run_turn(session.id, plan.messages, plan.tools, t.i, generate=t.generate,
                             max_tokens=t.max_tokens, forced_reply=t.forced_reply,
                             until=t.until) for t in plan.turns]
  return score_session(session, plan, metrics)


def summarize(samples_by_session: list[list[dict]]) -> dict:
  """Rates with Wilson intervals, and the efficiency columns of bench/pruning.py."""
  flat = [s for ss in samples_by_session for s in ss if "exact" in s]
  n = len(flat)
  k_exact, k_name = sum(s["exact"] for s in flat), sum(s["name"] for s in flat)
  k_args, n_args = sum(s["arg_hits"] for s in flat), sum(s["n_args"] for s in flat)
  k_copied = sum(s["arg_mentions"] for s in flat)
  turns = [[s["metrics"] for s in ss] for ss in samples_by_session]
  eff = pruning.summarize(turns, turns)
  # evidence recall with its interval over sessions (the unit that varies)
  ev = [[sum(t.evidence_kept for t in ts), sum(t.evidence for t in ts)] for ts in turns]
  _, ev_lo, ev_hi = calls.ratio_ci([k for k, _ in ev], [n for _, n in ev])
  keep = ("pt", "eff_live_kv", "raw_reads", "eff_reads", "prefix_hit_rate", "wall_s",
          "pruned_share", "n_sessions", "n_turns", "future_evidence_recall")
  return dict(next_call_exact=k_exact / n if n else float("nan"),
              next_call_exact_ci=list(calls.wilson(k_exact, n)),
              next_call_name=k_name / n if n else float("nan"),
              next_call_name_ci=list(calls.wilson(k_name, n)), n_calls=n,
              # gold argument values the call carries (pooled over arguments)
              next_call_args=k_args / n_args if n_args else float("nan"),
              next_call_args_ci=list(calls.wilson(k_args, n_args)), n_args=n_args,
              # the same values read from the raw text (a cut-off call still shows them)
              next_call_copied=k_copied / n_args if n_args else float("nan"),
              next_call_copied_ci=list(calls.wilson(k_copied, n_args)),
              texts=[s["text"] for s in flat],
              # per call, for the paired tests (agent_stats.annotate)
              calls=[dict(session=s["session"], turn=s["turn"], exact=bool(s["exact"]),
                          name=bool(s["name"]), prunable=s["prunable"],
                          kept=all(v == 1 for v in s["values_kept"])
                          if s.get("values_kept") else None,
                          kept_share=_least_share(s.get("values_kept")),
                          history=s.get("history"))
                     for s in flat],
              evidence_by_session=ev, future_evidence_recall_ci=[ev_lo, ev_hi],
              **{k: eff[k] for k in keep})


def _least_share(values) -> float | None:
  """The call's least-kept value (`kept_values`' shares; the call needs every value
  whole): None without values or when they were recorded as booleans only."""
  if not values or any(isinstance(v, bool) for v in values):
    return None
  return min(values)


def rescore(rows: list[dict], sessions) -> int:
  """Fills `next_call_copied` into next-call rows written before it existed, from their
  stored texts and the sessions' gold calls (same sessions, same order: the texts are
  one per call turn); returns the number of rows filled. A row whose text count does
  not match the sessions is left alone."""
  gold = [s.turns[i].tool_calls for s in sessions for i in call_turns(s)]
  done = 0
  for r in rows:
    if "next_call_exact" not in r or "next_call_copied" in r or len(r["texts"]) != len(gold):
      continue
    k = sum(calls.argument_mentions(t, g)[0] for t, g in zip(r["texts"], gold))
    r.update(next_call_copied=k / r["n_args"] if r["n_args"] else float("nan"),
             next_call_copied_ci=list(calls.wilson(k, r["n_args"])))
    done += 1
  return done


class Replay:
  """Both replays behind one switch: dead-slot layouts (and the full cache) through
  the serving engine, --batch sessions side by side (`jaxkv.evaluation.replay`);
  compact through the batch-1 `SessionRunner` (or everything there, engine=False),
  on the engine's pool and radix tree.

  Every configuration starts from the same cache, as on a server that has served the
  domain before: every session forgotten, and the system prompts every session of a
  domain shares (`keep_prefixes`) cached -- prefilled first if they are not. (Before,
  the first configuration of a process started cold and showed the full cache's
  83% prefix hits instead of the 91% of every later dead-slot row.)"""

  def __init__(self, llm, cache: CacheConfig, *, batch: int = 8, engine: bool = True):
    self.llm, self.use_engine = llm, engine
    self.engine, self.rec = replay.engine_for(llm, PruningConfig(method="none"), cache,
                                              max_batch=batch)
    self.runner = SessionRunner(llm, PruningConfig(method="none"), cache=cache,
                                kv=self.engine.kv_manager)

  def _warm(self, prefixes) -> None:
    replay.warm(self.engine, self.rec, prefixes)
    self.rec.kept.clear()

  def run(self, plans: list[replay.Session], cfg: PruningConfig, *, head=None,
          keep_prefixes=(), desc: str = "") -> list[list]:
    """The metrics of every planned turn under `cfg`, per session."""
    self.rec.set_policy(PruningConfig(method="none"), keep_prefixes=keep_prefixes)
    self._warm(keep_prefixes)
    if self.use_engine and cfg.layout == "dead_slot":
      self.rec.set_policy(cfg, head=head, keep_prefixes=keep_prefixes)
      return replay.timed(self.engine, self.rec, plans, desc=desc)
    self.runner.set_policy(cfg, head=head, keep_prefixes=keep_prefixes)
    return [[self.runner.run_turn(p.id, p.messages, p.tools, t.i, generate=t.generate,
                                  max_tokens=t.max_tokens, forced_reply=t.forced_reply,
                                  until=t.until) for t in p.turns]
            for p in tqdm(plans, desc=desc, leave=False)]


def evaluate(llm, sessions, cfg: PruningConfig, replayer: Replay, *, head=None,
             max_tokens: int = 96, desc: str = "", keep_prefixes=(),
             given: str = "none", journal: common.Journal | None = None, key: str = "",
             every: int = 16) -> dict:
  """One configuration over `sessions` (sessions start afresh; of the cache only
  `keep_prefixes`, the shared system prompts, stay), `every` sessions at a time: each
  session's turn metrics go to `journal` under `key` as its chunk finishes, and the
  sessions it already holds are not run again (a killed run resumes)."""
  head = head if cfg.method == "intentkv" and cfg.intent_mode == "learnable" else None
  plans = [plan_session(s, llm.tokenizer, max_tokens, given) for s in sessions]
  journal = journal or common.Journal(None)
  done, kept = {}, {}
  for sid, value in journal.done(key).items():   # {"turns", "kept"}; a bare list before
    ms = value["turns"] if isinstance(value, dict) else value
    done[sid] = [TurnMetrics(**m) for m in ms]
    if isinstance(value, dict):
      kept[sid] = {int(i): v for i, v in value["kept"].items()}
  todo, t0 = [p for p in plans if p.id not in done], time.perf_counter()
  if len(todo) < len(plans):
    print(f"{desc}: {len(plans) - len(todo)} sessions done before ({journal.path})")
  for i in range(0, len(todo), every):
    part = todo[i:i + every]
    for p, m in zip(part, replayer.run(part, cfg, head=head, keep_prefixes=keep_prefixes,
                                       desc=desc)):
      done[p.id], kept[p.id] = m, kept_values(p, m)
      journal.add(key, p.id, dict(turns=[t.to_json() for t in m], kept=kept[p.id]))
    print(f"{desc}: {i + len(part)} of {len(todo)} sessions in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
  metrics = [done[p.id] for p in plans]
  return summarize([score_session(s, p, m, kept.get(p.id, {}))
                    for s, p, m in zip(sessions, plans, metrics)])


def system_prefixes(tokenizer, sessions) -> list:
  """The distinct system-prompt token prefixes of `sessions` (what every session of a
  domain shares, so a server prefills it once)."""
  out = {}
  for s in sessions:
    messages, tools = traces.session_chat(s, tokenizer)
    p = labels.prepare_turn(tokenizer, messages, tools, call_turns(s)[0])
    out[tuple(p["ids"][:p["sys_len"]])] = None
  return [list(k) for k in out]


def discriminative_sessions(rows: list[dict], sessions, tokenizer,
                            history_over: int | None = None) -> list:
  """The sessions that can hold a discriminative call: before the full cache has run,
  those with a call whose gold value lies only in prunable history; after it, those
  with a call it solved among them (the others cannot change a discriminative score).
  `history_over` = C (history scope): of those, the ones with such a call whose prunable
  history (`history` on the full row) exceeds C; the others score as the full cache."""
  keys = agent_stats.scored_calls(rows, "discriminative")
  if keys is not None:
    ids = {sid for sid, _ in keys}
    can = None if history_over is None else agent_stats.can_change(rows, history_over)
    if can is not None:
      ids = {sid for sid, _ in can}
    return [s for s in sessions if s.id in ids]
  out = []
  for s in sessions:
    messages, tools = traces.session_chat(s, tokenizer)
    if any(labels.prunable_only_values(labels.prepare_turn(tokenizer, messages, tools, i),
                                       messages, i) for i in call_turns(s)):
      out.append(s)
  return out


FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("traces", None, "ToolBench-format JSON (scripts/make_traces.py), or "
                      "several comma-separated, each optionally sliced (path[30:]): "
                      "next-call accuracy over their sessions")
  flags.DEFINE_string("out", None, "write JSON rows here (a rerun resumes)")
  flags.DEFINE_integer("checkpoint_every", 16, "next-call mode: sessions per chunk, each "
                       "chunk's sessions saved to <out>.partial.jsonl as it finishes")
  flags.DEFINE_string("tables_from", None, "print the tables of an earlier --out JSON and exit; "
                      "several, comma-separated (one grid on disjoint session sets, e.g. "
                      "one file per trace source): the paired tables over their union")
  flags.DEFINE_string("full_from", None, "next-call mode: copy the full-cache row of this "
                      "results file (run on the same --traces, --model and flags) instead of "
                      "running it, e.g. to score a second --head on a grid's calls")
  flags.DEFINE_string("versus", None, "with --tables_from: also print each of its pruned rows "
                      "against this results file's rows (agent_stats.versus)")
  flags.DEFINE_string("model", "smollm2-135m", "preset or model path")
  flags.DEFINE_string("methods", "full,random,streaming_llm,snapkv,h2o,intentkv_query,"
                      "intentkv_memory,intentkv_learnable", f"of {','.join(METHODS)}")
  flags.DEFINE_string("head", artifacts.PRUNER_HEAD, "residual head for learnable methods")
  flags.DEFINE_string("layouts", "dead_slot,compact", "dead_slot and/or compact")
  flags.DEFINE_string("budgets", "2048,3072", "C, with the tool-schema system prompt forced")
  flags.DEFINE_enum("budget_scope", "prompt", ["prompt", "history"], "what --budgets count: "
                    "prompt = the whole prompt (IntentKV's C); history = the tokens outside "
                    "the system prompt and the current query (shown as +C): every call with "
                    "more history prunes and the scorers choose among it")
  flags.DEFINE_integer("max_sessions", 8, "sessions to replay (per --traces file)")
  flags.DEFINE_integer("max_prompt", 7000, "skip sessions whose final prompt exceeds this; "
                       "--env: an episode whose prompt + reply would exceed it overflows")
  flags.DEFINE_integer("min_calls", 1, "skip sessions with fewer tool-call turns (a session's "
                       "first call has no history to prune, so short sessions add little)")
  flags.DEFINE_integer("max_tokens", 96, "generated tokens per turn")
  common.define_replay_flags(flags, "max_prompt")
  flags.DEFINE_enum("calls", "discriminative", list(agent_stats.MODES),
                    "calls the paired table scores: discriminative = a gold argument value "
                    "found only in prunable history and solved by the full cache (needs "
                    "the full method); all = every call")
  flags.DEFINE_bool("skip_sessions", False, "with --calls=discriminative, run only the "
                    "sessions that can hold a discriminative call (a call with a gold value "
                    "only in prunable history; after the full cache, one it solved; under "
                    "--budget_scope=history, one whose prunable history exceeds C): the "
                    "efficiency and recall columns then cover those sessions alone")
  flags.DEFINE_enum("given", "none", ["none", "name"], "next-call mode: none = the model writes "
                    "the whole turn; name = the gold turn up to the arguments (thought, tool "
                    "name) is forced and the model writes the arguments, the values it must "
                    "copy from the history that pruning kept")
  flags.DEFINE_string("env", None, "closed loop instead of --traces replay: tau2, agentdojo or "
                      "module:Class (jaxkv.data.envs.Environment); with --traces, only the "
                      "tasks its session ids name (e.g. the held-out split)")
  flags.DEFINE_list("domains", None, "--env=tau2 domains (default airline,retail) or "
                    "--env=agentdojo suites (default all four)")
  flags.DEFINE_integer("max_tasks", 0, "--env: at most this many non-trivial tasks (0: all)")
  flags.DEFINE_integer("max_turns", agent_loop.MAX_TURNS, "--env: assistant turns per episode")
  flags.DEFINE_bool("constrain", True, "--env: decode each turn under the tool grammar (calls "
                    "name the environment's tools, arguments follow their schemas)")
  flags.DEFINE_integer("confirm", 1, "--env=tau2: questions of the agent the scripted user "
                       "answers with a yes before a question ends the episode")
  flags.DEFINE_bool("policy", True, "--env=tau2: the domain policy in the system prompt")


def _sessions(llm) -> list:
  sessions, seen = [], set()
  for spec in FLAGS.traces.split(","):
    try:
      part = agent_splits.load_spec(spec)
    except FileNotFoundError as e:
      raise app.UsageError(str(e)) from e
    found = 0
    for s in part:
      msgs, tools = traces.session_chat(s, llm.tokenizer)
      n = len(llm.tokenizer.encode_chat(msgs, tools=tools, add_generation_prompt=False))
      if n + FLAGS.max_tokens <= FLAGS.max_prompt and len(call_turns(s)) >= max(FLAGS.min_calls,
                                                                                 1):
        if s.id in seen:
          raise app.UsageError(f"session {s.id!r} appears twice in --traces")
        seen.add(s.id)
        sessions.append(s)
        found += 1
      if found == FLAGS.max_sessions:
        break
  return sessions


def main(argv):
  del argv
  if FLAGS.tables_from and "," in FLAGS.tables_from:
    sets = []
    for path in FLAGS.tables_from.split(","):
      with open(path) as f:
        sets.append(json.load(f))
    try:
      rows = agent_stats.pool(sets, FLAGS.calls)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    common.print_tables(agent_stats.tables(rows))
    return
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, agent_tables.tables)
    if FLAGS.versus:
      with open(FLAGS.tables_from) as f, open(FLAGS.versus) as g:
        common.print_tables([t for t in [agent_stats.versus(json.load(f), json.load(g))]
                             if t is not None])
    return
  if not FLAGS.traces and not FLAGS.env:
    raise app.UsageError("give --traces (next-call accuracy; make one with "
                         "scripts/make_traces.py) or --env (closed loop)")
  names = common.method_names(FLAGS.methods, METHODS)
  env = None
  if FLAGS.env:
    kwargs = {}
    if FLAGS.domains and FLAGS.env in ("tau2", "agentdojo"):
      kwargs = {"domains" if FLAGS.env == "tau2" else "suites": tuple(FLAGS.domains)}
    if FLAGS.env == "tau2":
      kwargs.update(include_policy=FLAGS.policy, confirmations=FLAGS.confirm)
    make_env = lambda: envs.load_env(FLAGS.env, **kwargs)
    try:
      env = make_env()
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  if FLAGS.traces and set(names) & set(pruning.LEARNABLE):
    try:   # a head is scored only on sessions it never trained on
      agent_splits.check_unseen(FLAGS.head, FLAGS.traces.split(","))
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  llm = jaxkv.load(FLAGS.model)
  head = (artifacts.load_pruner_head(FLAGS.head, model_name=FLAGS.model)
          if set(names) & set(pruning.LEARNABLE) else None)
  head_id = head_fingerprint(FLAGS.head) if head is not None else None
  # one replay for every configuration; between them only the system prompts every
  # session shares stay cached (Replay), as on a server
  if env is None:
    sessions = _sessions(llm)
    pages = common.replay_pages(FLAGS.num_pages, FLAGS.batch, FLAGS.replay,
                                FLAGS.max_prompt + 1024)
    cache = CacheConfig(num_pages=pages, page_size=16, max_seq_len=FLAGS.max_prompt + 1024)
    replayer = Replay(llm, cache, batch=FLAGS.batch, engine=FLAGS.replay == "engine")
    shared = system_prefixes(llm.tokenizer, sessions)
    what = f"{len(sessions)} sessions from {FLAGS.traces}"
  else:
    ids = ([s.id for spec in FLAGS.traces.split(",") for s in agent_splits.load_spec(spec)]
           if FLAGS.traces else None)
    tasks, trivial = agent_env.select_tasks(env, ids, FLAGS.max_tasks)
    if not tasks:
      raise app.UsageError(f"no task of --env={FLAGS.env} to run ({len(trivial)} trivial)")
    cache = CacheConfig(num_pages=FLAGS.num_pages, page_size=16, max_seq_len=FLAGS.max_prompt)
    eng, rec = replay.engine_for(llm, PruningConfig(method="none"), cache, max_batch=FLAGS.batch)
    loop = agent_env.Loop(eng, rec, make_env, batch=FLAGS.batch, constrain=FLAGS.constrain,
                          runner=SessionRunner(llm, PruningConfig(method="none"), cache=cache,
                                               kv=eng.kv_manager))
    shared = list({tuple(agent_loop.system_prefix(llm.tokenizer, *env.reset(t))): None
                   for t in tasks})
    longest = agent_env.longest_gold_call(env, tasks, llm.tokenizer)
    max_tokens = max(FLAGS.max_tokens, longest + 16)     # room for the longest gold call
    what = (f"{len(tasks)} tasks of --env={FLAGS.env} ({len(trivial)} trivial ones skipped: "
            f"doing nothing passes them), at most {FLAGS.max_turns} turns, "
            f"prompt + reply <= {FLAGS.max_prompt} tokens, {max_tokens} tokens per turn "
            f"(longest gold call {longest}), calls "
            f"{'under the tool grammar' if FLAGS.constrain else 'unconstrained'}")
  print(what, flush=True)
  rows = []
  if FLAGS.out and os.path.exists(FLAGS.out):
    with open(FLAGS.out) as f:
      rows = json.load(f)
  if env is None and FLAGS.full_from and not any(r["method"] == "full" for r in rows):
    with open(FLAGS.full_from) as f:
      full = [r for r in json.load(f) if r["method"] == "full"]
    if not full:
      raise app.UsageError(f"--full_from={FLAGS.full_from} holds no full-cache row")
    rows.append(full[0])
  if env is None and (rescore(rows, sessions) + agent_splits.fill_history(rows, sessions,
                                                                             llm.tokenizer)):
    common.write_rows(FLAGS.out, rows)
  scope = FLAGS.budget_scope
  journal = common.Journal(FLAGS.out and FLAGS.out + ".partial.jsonl")   # sessions as they go
  have = {(r["method"], r["layout"], r["budget"]) for r in rows
          if r["method"] == "full" or agent_stats.budget_key(r)[0] == scope}
  configs = [("full", "-", 0)] if "full" in names else []
  configs += [(m, lay, int(b)) for b in FLAGS.budgets.split(",") for m in names if m != "full"
              for lay in FLAGS.layouts.split(",")]
  for name, layout, budget in configs:
    if (name, layout, budget) in have:
      continue
    desc, prefixes = f"{name}/{layout}/C={budget}", shared
    if env is None and FLAGS.calls == "discriminative" and FLAGS.skip_sessions:
      sessions = run_on = discriminative_sessions(rows, sessions, llm.tokenizer)
      if name != "full" and scope == "history":    # only the sessions C can change
        run_on = discriminative_sessions(rows, sessions, llm.tokenizer, budget)
        prefixes = system_prefixes(llm.tokenizer, run_on)
      if not run_on:
        print(f"{desc}: no scored call has more prunable history than C: not run")
        continue
    elif env is None:
      run_on = sessions
    cfg = (PruningConfig(method="none") if name == "full" else
           PruningConfig(layout=layout, budget=budget, budget_scope=scope, **METHODS[name]))
    learnable = name in pruning.LEARNABLE
    key = json.dumps([FLAGS.model, name, layout, budget, scope, FLAGS.given, FLAGS.max_tokens]
                     + ([head_id] if learnable else []))   # another head: another key
    if env is None:
      r = evaluate(llm, run_on, cfg, replayer, head=head, max_tokens=FLAGS.max_tokens,
                   desc=f"{desc} ({len(run_on)} sessions)", keep_prefixes=prefixes,
                   given=FLAGS.given, journal=journal, key=key, every=FLAGS.checkpoint_every)
      line = f"exact={r['next_call_exact']:.3f} name={r['next_call_name']:.3f} n={r['n_calls']}"
    else:
      r = loop.evaluate(tasks, cfg, head=head, keep_prefixes=shared, max_turns=FLAGS.max_turns,
                        max_tokens=max_tokens, desc=desc)
      line = (f"compl={r['compl']:.3f} raw={r['raw_acc']:.3f} true={r['true_acc']:.3f} "
              f"n={r['n_tasks']}")
    if env is None:
      r["given"] = FLAGS.given
    if name != "full":
      r["budget_scope"] = scope
    if learnable:
      r["head"] = head_id
    rows.append(dict(method=name, layout=layout, budget=budget, **r))
    print(f"{name:18s} {layout:9s} C={budget:5d} {line}", flush=True)
    agent_stats.annotate(rows, FLAGS.calls)      # paired fields against the rows so far
    agent_env.annotate(rows)
    common.write_rows(FLAGS.out, rows)
    journal.drop(key)
  agent_stats.annotate(rows, FLAGS.calls)   # every row against today's references
  agent_env.annotate(rows)
  common.write_rows(FLAGS.out, rows)
  print(f"\n{FLAGS.model}, {what}")
  common.print_tables(agent_tables.tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
