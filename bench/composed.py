"""Composed KV mechanisms on one agent workload: LRAgent sharing, IntentKV pruning
and segment reuse, each alone and composed in one session, through the batch engine.

    python bench/composed.py --traces=data_local/tau2_heldout.json \\
        --out=bench/results_composed.json [--budget=3584] [--max_sessions=0]
        [--max_tokens=6144] [--methods=non_shared,pruned,agents,agents+pruned,agents+random,
                                      agents+reuse,agents+pruned+reuse,agents+memart,...]

Each held-out session becomes an LRAgent trajectory (`jaxkv.data.agents`: plan /
action / reflect calls over one token stream) on SmolLM2 with the shipped role
adapters. Every method runs every trajectory as one session of the engine: each agent
call is a teacher-forced request (`Request.forced`: prompt = the trajectory before the
call, forced = the call's gold tokens, on the call's role adapter), so every method
reads the same contexts; the calls of a trajectory run in order, up to `max_batch`
trajectories at once (one open session each, closed when its trajectory ends).

    non_shared      agents (non_shared): every role keeps its own cache (the reference)
    pruned          agents (non_shared) + pruned: each role's own cache pruned by
                    IntentKV (memory mode) at --budget: pruning alone
    agents          agents (base_lr_shared): the roles share one base + low-rank cache
    agents+pruned   composed: that shared trajectory pruned by IntentKV at --budget
    agents+random   composed with random pruning at --budget: the chance line for
                    IntentKV's choice of what to keep
    agents+reuse    composed with segment reuse (tiered, int8: configs/smollm2_agents.py's):
                    a call splices runs other trajectories' calls stored (the session's
                    own prefix is the trajectory's), every pass on the call's role
                    adapter; a trajectory's first call finds the system prompt another
                    session of its domain computed
    agents+pruned+reuse  the three in one session
    agents+memart   composed with MemArt (configs/smollm2_agents.py's: blocks of 16,
                    top 32, re-ranking 4): the session's earlier conversation is the
                    previous held-out trajectory of its domain, written into its memory
                    by a recall before the first call; every call's prompt carries the
                    blocks retrieved for the task as a region (`Opening`). The session
                    is new, so the first call computes the region (nothing cached before
                    it to copy behind)
    .../cont-random the chance line for MemArt's retrieval: the recall's blocks replaced
                    by as many of the memory's live blocks drawn at random (in memory
                    order, seeded by trajectory): agents+memart/cont-random
    .../cont        continued: the session ran that earlier conversation first, as one
                    request, so the new conversation adopts the system prompt it shares
                    (and MemArt's region is copied from memory behind it), as an agents
                    session on a server goes from one conversation to the next:
                    agents/cont, agents+memart/cont, agents+pruned+reuse/cont,
                    agents+pruned+memart+reuse/cont (all four in one session)

Per call: prompt tokens prefilled (not read from the session's cache; with reuse the
token-layers computed over the layer count, spliced runs not counted), TTFT (admission
to first token, inside the engine), exact: the greedy token equals the gold one at
every step, i.e. free greedy generation over this cache writes the call exactly
(`jaxkv.engine.agents.call_accuracy`'s rule, the same for every method). Per
trajectory, at its end: the KV bytes its session holds (live slots of its regions x
bytes per slot, the low-rank value cache included).

Pruning context (decided here, the traces have no IntentKV spans): the protected
system prompt is the rendered system message; a call's actionable query span is the
trajectory since the previous call began (that call's output and the new context:
the tool result, the action cue).

Pick a budget above the protected system prompt plus the query span: below it the
forced set alone fills the budget, every scorer keeps the same entries, and IntentKV
and random pruning are identical by construction (the tau2 system prompts with their
tool schemas are 3,171-3,288 SmolLM2 tokens, so C = 1,024 prunes every trajectory to
that set; C = 3,584 leaves the scorer a choice).

Table per method: calls whose KV pruning cut, action calls exact with n and a Wilson
95% interval, exact McNemar
p (paired by call) against non_shared and agents; over every call's tokens, greedy
agreement with the gold token, its paired difference to agents+random (the chance
line) and Delta-NLL against non_shared (LRAgent's fidelity), each with a 95% bootstrap
interval over trajectories (the unit that varies); for a method with reuse, its
Delta-NLL against the same method without reuse (what splicing costs, paired), and
for one with MemArt against it without MemArt (what the region costs); mean prefilled
tokens per call, TTFT p50 (a first call's includes its recall), mean KV MB per
trajectory (the memory not counted). (Without non_shared in the run, Delta-NLL is read
against agents.) A second table puts each MemArt method beside itself without MemArt:
region tokens per call, memory written and held per trajectory, the first call's
prefill and TTFT.
--tables_from=FILE reprints the tables. A run keeps --out's rows of the methods it
does not run (so methods can run one process each).
"""

from __future__ import annotations

import collections
import json
import os
import sys

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

import common
import composed_memory
import jaxkv
from jaxkv import artifacts
from jaxkv.config import PAGE_SIZE, MemArtConfig, PruningConfig, ReuseConfig, SamplingConfig
from jaxkv.data import agents, traces
from jaxkv.data import calls as calls_lib
from jaxkv.engine.mechanisms import memart_region as region
from jaxkv.engine.mechanisms.composed import Composed
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.memart import MemArtSessions
from jaxkv.engine.request import Request
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.evaluation import agents as ev

# LRAgent sharing, IntentKV pruning and reuse alone and composed (the README's table),
# then MemArt in the compositions with the sessions and chance line it needs
ALONE_AND_COMPOSED = ("non_shared", "pruned", "agents", "agents+pruned", "agents+random",
                      "agents+reuse", "agents+pruned+reuse")
WITH_MEMART = ("agents+memart", "agents/cont", "agents+memart/cont", "agents+pruned+reuse/cont",
               "agents+pruned+memart+reuse/cont", "agents+memart/cont-random")
METHODS = ALONE_AND_COMPOSED + WITH_MEMART
REUSE = ReuseConfig(method="tiered", storage="int8")      # configs/smollm2_agents.py's
MEMART = MemArtConfig(block_size=PAGE_SIZE, top_k=32, rerank=4)   # configs/smollm2_agents.py's


def define_flags():
  flags.DEFINE_string("traces", None, "ToolBench-format held-out traces (scripts/make_traces.py)")
  flags.DEFINE_string("out", None, "JSON rows: one per call and one per trajectory")
  flags.DEFINE_string("methods", ",".join(METHODS), "methods to run, comma-separated")
  flags.DEFINE_integer("budget", 3584, "pruning budget C (live prompt KV entries)")
  flags.DEFINE_integer("max_sessions", 0, "first N sessions (0: all)")
  flags.DEFINE_integer("max_tokens", 6144, "trajectories longer than this are skipped")
  flags.DEFINE_integer("max_batch", 4, "trajectories in flight")
  flags.DEFINE_string("tables_from", None, "reprint the tables of a results file")


def contexts(session, traj, tok) -> list[dict]:
  """Per call: the pruning context (protected system prompt, query span start)."""
  messages, tools = traces.session_chat(session, tok)
  sys_len = 0
  if messages and messages[0]["role"] == "system":
    sys_len = len(tok.encode(tok.render_chat(messages[:1], tools=tools,
                                             add_generation_prompt=False)))
  out, prev = [], sys_len
  for c in traj.calls:
    qs = min(max(prev, sys_len), c.start - 1)
    out.append({"sys_len": int(min(sys_len, qs)), "qs": int(qs)})
    prev = c.start
  return out


def make_engine(llm, lora, method: str, budget: int, max_tokens: int, batch: int):
  """The method's engine, its agents mechanism, the mechanism name its requests carry
  and its MemArt mechanism (None without)."""
  scheme = "base_lr_shared" if method.startswith("agents") else "non_shared"
  kinds = method.split("/")[0].split("+")
  # MemArt's memory: a closed trajectory per open session, in pool pages
  memory = batch * (-(-max_tokens // PAGE_SIZE) + 1) if "memart" in kinds else 0
  if "memart" in kinds:                   # the region lengthens every prompt
    max_tokens += MEMART.top_k * MEMART.block_size * (2 * MEMART.neighbors + 1)
  eng, ag = ev.engine(llm, lora, scheme, max_tokens=max_tokens, max_batch=batch,
                      names=agents.ROLES, extra_pages=memory)
  parts, ma = [ag], None
  prune = {"pruned": "intentkv", "random": "random"}
  for kind in kinds[1:] if kinds[0] == "agents" else kinds:
    if kind in prune:
      parts.append(eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager,
                                            PruningConfig(method=prune[kind], budget=budget))))
    elif kind == "reuse":
      parts.append(eng.add_mechanism(Reuse(ReuseRunner(llm, REUSE, kv=eng.kv_manager))))
    elif kind == "memart":
      ma = eng.add_mechanism(MemArt(MemArtSessions(llm, MEMART, eng.cache_cfg,
                                                   kv=eng.kv_manager)))
      parts.append(ma)
  if len(parts) == 1:
    return eng, ag, ag.name, ma
  return eng, ag, eng.add_mechanism(Composed(parts)).name, ma


class Opening:
  """What a trajectory's session holds before its first call. Continued (a method
  named ".../cont"): the session's earlier conversation, the previous held-out
  trajectory of its domain (the first one's: the domain's last), run on the session
  as one request, so the new conversation adopts the system prompt it shares, as an
  agent session on a server does. With MemArt: before the first call a recall writes
  that conversation's lines into the session's memory and retrieves blocks for the
  task (its first user message), and every call's prompt carries them as a region at
  the first user message's content (`MemArt.turn`, as a server builds a composed
  call); the region is copied from memory behind a cached prefix, else computed."""

  def __init__(self, ma: MemArt | None, mech: str, continued: bool, sessions, trajs, ctxs, tok,
               random: bool = False):
    self.ma, self.mech, self.continued, self.trajs, self.ctxs = ma, mech, continued, trajs, ctxs
    self.random = random
    chats = [traces.session_chat(s, tok) for s in sessions]
    domain = [s.task.split("/")[0] for s in sessions]
    self.prev = {}
    for t, d in enumerate(domain):
      same = [u for u in range(len(domain)) if domain[u] == d]
      self.prev[t] = same[same.index(t) - 1]           # cyclic: the first takes the last
    user = [next(i for i, m in enumerate(msgs) if m["role"] == "user") for msgs, _ in chats]
    self.opening = [(msgs[:user[t] + 1], tools) for t, (msgs, tools) in enumerate(chats)]
    self.history = [msgs for msgs, _ in chats]

  def before(self, t: int, done: list) -> Request | None:
    sid, p = self.trajs[t].session, self.prev[t]
    if self.continued and not done:                    # the earlier conversation
      prompt, ctx = self.trajs[p].ids.tolist(), {"session": sid, **self.ctxs[p][-1]}
      if self.ma is not None:                          # (no memory yet: no region)
        prompt, ctx = self.ma.turn(sid, *self.opening[p], prompt, ctx)
      return Request("earlier", prompt, SamplingConfig(max_tokens=1, temperature=0.0),
                     adapter=0, mechanism=self.mech, context=ctx)
    if self.ma is None or len(done) > int(self.continued):
      return None
    self.ma.conversations[sid] = region.Conversation(        # closed: every message
        self.history[p], np.zeros(0, np.int32), np.zeros(0, np.int32), {})
    c = self.trajs[t].calls[0]
    got = self.ma.turn(sid, *self.opening[t], self.trajs[t].ids[:c.start].tolist(), {})
    if not isinstance(got, dict):
      raise RuntimeError(f"trajectory {sid}: no recall (no conversation to close)")
    return Request("recall", [int(self.trajs[t].ids[c.start - 1])],
                   SamplingConfig(max_tokens=1, temperature=0.0), mechanism="memart",
                   context=got)

  def prepare(self, t: int, k: int, prompt, ctx, done: list):
    if self.ma is None:
      return prompt, ctx
    recall = None
    if k == 0:
      recall = done[-1].extra["recall"]
      if self.random:                  # the chance line: as many memory blocks at random
        mem = self.ma.sessions.sessions[self.trajs[t].session][0]
        recall = composed_memory.random_blocks(mem, recall, np.random.default_rng(t))
    got = self.ma.turn(self.trajs[t].session, *self.opening[t], prompt, ctx, recall)
    if isinstance(got, dict):
      raise RuntimeError(f"trajectory {self.trajs[t].session}, call {k}: left its conversation")
    return got

  def recall(self, done: list) -> dict:
    """The recall's result (`Result.extra["recall"]`), {} without one."""
    return done[-1].extra["recall"] if self.ma is not None and done else {}

  def close(self, t: int) -> None:
    if self.ma is not None:
      self.ma.close(self.trajs[t].session)


def run_method(llm, lora, method: str, sessions, trajs, ctxs, args) -> list[dict]:
  eng, ag, mech, ma = make_engine(llm, lora, method, args.budget, args.max_tokens,
                                  args.max_batch)
  variant = method.partition("/")[2].split("-")
  continued = "cont" in variant
  op = (Opening(ma, mech, continued, sessions, trajs, ctxs, llm.tokenizer,
                random="random" in variant) if ma is not None or continued else None)
  rows: list[dict] = []
  bar = tqdm(total=sum(len(t.calls) for t in trajs), desc=method, unit="call", file=sys.stderr)
  for done in ev.serve_trajectories(eng, ag, trajs, mechanism=mech, contexts=ctxs,
                                    max_batch=args.max_batch, progress=bar.update,
                                    before=op and op.before, prepare=op and op.prepare):
    traj = trajs[done.index]
    recall = op.recall(done.before) if op is not None else {}
    for k, (c, res) in enumerate(zip(traj.calls, done.calls)):
      x = res.extra or {}
      gold = traj.ids[c.start:c.end]
      # a composed call's recall runs before it: its time is the first call's
      ttft = res.ttft_s + (done.before[-1].latency_s if recall and k == 0 else 0)
      rows.append(dict(method=method, trace=traj.session, call=k, role=agents.ROLES[c.role],
                       tokens=c.end - c.start, prompt_tokens=c.start,
                       prefilled=x.get("prefill_tokens", x.get("computed_tokens")),
                       reused=x.get("reused_tokens", 0), ttft_s=ttft,
                       region=x.get("memory_region_tokens", 0),
                       exact=res.argmax == gold.tolist(),
                       agree=int(np.sum(np.asarray(res.argmax) == gold)),
                       logprob=float(np.sum(res.logprob)),
                       kv_live_before=x.get("kv_live_before"),
                       kv_live_after=x.get("kv_live_after")))
    rows.append(dict(method=method, trace=traj.session, trajectory=True,
                     tokens=len(traj), kv_bytes=done.live_slots * eng.kv_manager.bytes_per_slot,
                     memory_bytes=recall.get("memory_bytes", 0),
                     memory_written=recall.get("written_tokens", 0)))
    if op is not None:
      op.close(done.index)
  bar.close()
  eng.kv_manager.check()
  return rows


def without(m: str, kind: str) -> str:
  """Method m without mechanism `kind` and the variants that are its ("agents+memart/cont"
  -> "agents/cont", "agents+memart/cont-random" -> "agents/cont")."""
  base, _, variant = m.partition("/")
  own = {"memart": {"random"}}.get(kind, set())
  rest = "-".join(v for v in variant.split("-") if v and v not in own)
  return "+".join(k for k in base.split("+") if k != kind) + ("/" + rest if rest else "")


def _paired(by: dict, m: str, ref: str, gain, fmt: str) -> str:
  """Method m against method `ref` per gold token, paired by call: sum over calls of
  `gain(m's row, ref's row)` over m's tokens, with a 95% bootstrap over trajectories;
  "-" when either run is absent or they are one."""
  if ref == m or ref not in by or m not in by:
    return "-"
  pair = {}
  for key, r in by[m].items():
    if key in by[ref]:
      pair.setdefault(key[0], np.zeros(2))
      pair[key[0]] += (gain(r, by[ref][key]), r["tokens"])
  d = common.cluster_bootstrap(pair, lambda xs: sum(x[0] for x in xs) / sum(x[1] for x in xs))
  return f"{d[0]:{fmt}} [{d[1]:{fmt}}, {d[2]:{fmt}}]"


def _dnll(by: dict, m: str, ref: str) -> str:
  """Method m's Delta-NLL per gold token against method `ref` (`_paired`)."""
  return _paired(by, m, ref, lambda r, o: o["logprob"] - r["logprob"], "+.4f")


def _dnll_without(by: dict, m: str, kind: str) -> str:
  """Method m's Delta-NLL against m without `kind` (`without`), "-" when m has none."""
  return _dnll(by, m, without(m, kind))


def _random_of(m: str) -> str:
  """MemArt method m's chance line (its recall's blocks drawn at random)."""
  base, _, variant = m.partition("/")
  return f"{base}/{variant + '-' if variant else ''}random"


def memory_table(rows: list[dict]) -> common.Table | None:
  """What MemArt adds to each method with it, beside the same method with random
  memory blocks (the chance line, when run) and without MemArt: the region per call,
  the memory per trajectory, the first call's prefill and TTFT (its recall's
  included), prefill per call, Delta-NLL against random blocks (paired)."""
  calls = [r for r in rows if not r.get("trajectory")]
  present = {r["method"] for r in calls}
  by = {m: {(r["trace"], r["call"]): r for r in calls if r["method"] == m} for m in present}
  with_mem = [m for m in METHODS if m in present and without(m, "memart") != m
              and "random" not in m.partition("/")[2].split("-")]
  if not with_mem:
    return None
  lines = []
  for m in with_mem:
    for name in (m, _random_of(m), without(m, "memart")):
      cs = [r for r in calls if r["method"] == name]
      if not cs:
        continue
      first = [r for r in cs if r["call"] == 0]
      traj = [r for r in rows if r.get("trajectory") and r["method"] == name]
      lines.append([name, str(len({r["trace"] for r in cs})),
                    f"{np.mean([r.get('region', 0) for r in cs]):.0f}",
                    f"{np.mean([r.get('memory_written', 0) for r in traj]):.0f}",
                    f"{np.mean([r.get('memory_bytes', 0) for r in traj]) / 2 ** 20:.1f}",
                    f"{np.mean([r['prefilled'] for r in first]):.0f}",
                    f"{np.median([r['ttft_s'] for r in first]):.1f}",
                    f"{np.mean([r['prefilled'] for r in cs]):.0f}",
                    _dnll(by, name, _random_of(m)) if name == m else "-"])
  return common.Table(
      "MemArt in the composition: the previous trajectory of the domain as the session's "
      "closed conversation (region = retrieved memory tokens in each call's prompt; "
      "dNLL paired by call, 95% bootstrap over trajectories)",
      ["method", "trajectories", "region tokens / call", "memory written / trajectory",
       "memory MB / trajectory", "first call prefilled", "first call TTFT p50 s",
       "prefilled / call", "dNLL vs random blocks [95% CI]"], lines)


def tables(rows: list[dict]) -> list[common.Table]:
  return [t for t in (table(rows), memory_table(rows)) if t is not None]


def table(rows: list[dict]) -> common.Table:
  calls = [r for r in rows if not r.get("trajectory")]
  present = {r["method"] for r in calls}
  methods = [m for m in METHODS if m in present] + sorted(present - set(METHODS))
  base = "non_shared" if "non_shared" in methods else "agents"     # the dNLL reference
  by = {m: {(r["trace"], r["call"]): r for r in calls if r["method"] == m} for m in methods}
  lines = []
  for m in methods:
    act = {k: r for k, r in by[m].items() if r["role"] == "action"}
    n, k = len(act), sum(r["exact"] for r in act.values())
    lo, hi = calls_lib.wilson(k, n)

    def p_vs(ref):
      if ref not in by or ref == m:
        return "-"
      keys = [key for key in act if key in by[ref]]
      b = sum(act[key]["exact"] and not by[ref][key]["exact"] for key in keys)
      c = sum(by[ref][key]["exact"] and not act[key]["exact"] for key in keys)
      return f"{calls_lib.mcnemar(b, c):.2f} ({b}-{c})"

    per = collections.defaultdict(lambda: np.zeros(2))    # trace -> agree, tokens
    for key, r in by[m].items():
      per[key[0]] += (r["agree"], r["tokens"])
    agree = common.cluster_bootstrap(per, lambda xs: sum(x[0] for x in xs) / sum(x[1] for x in xs))
    dnll = _dnll(by, m, base)
    # the chance line: greedy agreement against random pruning's, paired
    vs_random = _paired(by, m, "agents+random", lambda r, o: r["agree"] - o["agree"], "+.3f")
    vs_plain = _dnll_without(by, m, "reuse")     # reuse's cost: against the method without it
    vs_memory = _dnll_without(by, m, "memart")   # the memory region's, likewise
    traj = [r for r in rows if r.get("trajectory") and r["method"] == m]
    cut = sum(1 for r in by[m].values() if r.get("kv_live_before") is not None
              and r["kv_live_after"] < r["kv_live_before"])
    lines.append([m, str(n), str(cut), f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]" if n else "-",
                  p_vs("non_shared"), p_vs("agents"),
                  f"{agree[0]:.3f} [{agree[1]:.3f}, {agree[2]:.3f}]", vs_random, dnll, vs_plain,
                  vs_memory,
                  f"{np.mean([r['prefilled'] for r in by[m].values()]):.0f}",
                  f"{np.median([r['ttft_s'] for r in by[m].values()]):.3f}",
                  f"{np.mean([r['kv_bytes'] for r in traj]) / 2 ** 20:.1f}" if traj else "-"])
  n_traj = len({r["trace"] for r in calls})
  header = ["method", "n action", "calls pruned", "action exact [95% CI]", "p vs non_shared",
            "p vs agents", "token agreement [95% CI]", "agreement - random (paired)",
            f"dNLL vs {base} [95% CI]", "dNLL vs without reuse", "dNLL vs without memart",
            "prefilled / call", "TTFT p50 s", "KV MB / trajectory"]
  # no column of dashes (no non_shared, agents+random, or pair with and without a kind)
  drop = {i for i in range(1, len(header)) if lines and all(line[i] == "-" for line in lines)}
  header = [h for i, h in enumerate(header) if i not in drop]
  lines = [[x for i, x in enumerate(line) if i not in drop] for line in lines]
  return common.Table(
      f"agent calls teacher-forced through the engine ({n_traj} trajectories; action calls "
      "exact = greedy writes the call's arguments exactly; McNemar p (wins-losses), paired "
      "by call)",
      header, lines)


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
  _, lora = artifacts.load_role_adapters(llm.config)
  sessions = traces.load_toolbench(args.traces)
  if args.max_sessions:
    sessions = sessions[:args.max_sessions]
  kept, trajs, ctxs = [], [], []
  for s in sessions:
    traj = agents.build(s, llm.tokenizer)
    if len(traj) <= args.max_tokens and traj.calls and traj.calls[0].start >= 1:
      kept.append(s)
      trajs.append(traj)
      ctxs.append(contexts(s, traj, llm.tokenizer))
  print(f"{len(trajs)} of {len(sessions)} trajectories fit {args.max_tokens} tokens",
        file=sys.stderr)
  rows: list[dict] = []
  if args.out and os.path.exists(args.out):      # a rerun keeps the other methods' rows
    with open(args.out) as f:
      rows = [r for r in json.load(f) if r["method"] not in methods]
  for m in methods:
    rows = [r for r in rows if r["method"] != m] + run_method(llm, lora, m, kept, trajs, ctxs,
                                                              args)
    common.write_rows(args.out, rows)
    jax.clear_caches()      # each method compiles its own pool's steps: free the last one's
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
