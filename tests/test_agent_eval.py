"""bench/agent_eval.py: every tool-call turn is one sample, scored against its own gold
call, with the efficiency columns over the real decode steps."""

import dataclasses
import json
import math
import pathlib
import sys

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import labels, traces
from jaxkv.engine.sessions import SessionRunner

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import agent_env
import agent_eval
import agent_tables
import common


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_agent_eval"))


def _session():
  return traces.parse_entry(hf_util.tool_session_entry())


@pytest.mark.slow
def test_each_call_turn_is_scored_against_its_own_gold(llm, monkeypatch):
  """Through the engine (dead-slot, full cache) and the batch-1 runner (compact)."""
  s = _session()
  assert agent_eval.call_turns(s) == [2, 4, 6]
  real = agent_eval.Replay.run

  def run(self, plans, cfg, **kw):
    out = real(self, plans, cfg, **kw)
    for t, m in zip(plans[0].turns, out[0]):
      assert t.generate and m.reply_tokens >= 1
      # the model under test writes the gold call at turn 2, the right tool with a
      # wrong argument at turn 4, and whatever it generated at turn 6
      if t.i == 2:
        m.text = traces.format_react(s.turns[2])
      elif t.i == 4:
        m.text = 'Action: get_reservation_details\nAction Input: {"reservation_id": "AIXC01"}'
    return out

  monkeypatch.setattr(agent_eval.Replay, "run", run)
  replayer = agent_eval.Replay(llm, CacheConfig(num_pages=512, page_size=4, max_seq_len=2048),
                               batch=2)
  for cfg in (PruningConfig(method="none"), PruningConfig(method="intentkv", budget=60),
              PruningConfig(method="intentkv", budget=60, layout="compact")):
    r = agent_eval.evaluate(llm, [s], cfg, replayer, max_tokens=8)
  assert r["pruned_share"] > 0
  assert agent_tables.table([dict(method="intentkv_memory", layout="dead_slot", budget=60, **r)])


def test_given_name_forces_the_turn_up_to_the_arguments(llm, monkeypatch):
  """--given=name: the gold turn up to its arguments is forced; the model's text is
  the arguments, scored with the forced prefix (the tool name) in front."""
  s = _session()
  messages, tools = traces.session_chat(s, llm.tokenizer)
  real = SessionRunner.run_turn
  seen = {}

  def run_turn(self, sid, msgs, tls, i, **kw):
    t = real(self, sid, msgs, tls, i, **kw)
    seen[i] = kw["forced_reply"]
    if not kw["generate"]:
      return t
    gold = self.prepare(msgs, tls, i)["gold"]
    head = llm.tokenizer.decode(list(gold[:kw["forced_reply"]]))
    assert head.rstrip().endswith("Action Input:") and "Action: " in head
    # the model under test gets turn 2's arguments right and turn 4's wrong
    args = json.dumps(dict(s.turns[i].tool_calls[0].arguments)) if i == 2 else '{"x": 1}'
    return dataclasses.replace(t, text=("" if head.endswith(" ") else " ") + args)

  monkeypatch.setattr(SessionRunner, "run_turn", run_turn)
  runner = SessionRunner(llm, PruningConfig(method="none"),
                         cache=CacheConfig(num_pages=512, page_size=4, max_seq_len=2048))
  out = agent_eval.run_session(runner, s, llm.tokenizer, 8, given="name")
  scored = {r["turn"]: r for r in out if "exact" in r}
  assert all(seen[i] > 0 for i in scored) and sorted(scored) == [2, 4, 6]
  assert scored[2]["exact"] and scored[2]["name"]
  assert not scored[4]["exact"] and scored[4]["name"]   # the name was given
  assert scored[2]["arg_mentions"] == scored[2]["n_args"] > 0 == scored[4]["arg_mentions"]
  no_marker = llm.tokenizer.encode("Done, nothing to call.", add_bos=False)
  assert agent_eval.argument_prefix(llm.tokenizer, no_marker) == 0


def test_paper_tables_pick_the_published_layouts_and_both_layouts():
  def row(method, layout, budget, exact):
    return dict(method=method, layout=layout, budget=budget, next_call_exact=exact,
                next_call_exact_ci=[0.0, 1.0], next_call_name=1.0, next_call_name_ci=[0.0, 1.0],
                next_call_args=exact, next_call_args_ci=[0.0, 1.0], next_call_copied=exact,
                next_call_copied_ci=[0.0, 1.0], n_calls=20,
                future_evidence_recall=0.5, pruned_share=0.75, pt=5000.0, eff_live_kv=3800.0,
                raw_reads=9e5, eff_reads=8e5, prefix_hit_rate=0.9)
  rows = [row("full", "-", 0, 0.45)] + [
      row(m, lay, b, 0.1) for b in (3584, 4096) for m in ("random", "h2o", "intentkv_query")
      for lay in ("dead_slot", "compact")]
  t2a, t7a, t2b, t7b, flat = agent_tables.tables(rows)
  assert "Table 2" in t2a.title and "C=3584" in t2a.title and "C=4096" in t2b.title
  assert [c[:3] for c in t2a.lines] == [("full", "-", "0"), ("random", "compact", "3584"),
                                        ("h2o", "compact", "3584"),
                                        ("intentkv_query", "dead_slot", "3584")]
  assert "Table 7" in t7b.title and len(t7b.lines) == 1 + 3 * 2
  assert {c[1] for c in t7b.lines[1:]} == {"dead_slot", "compact"}
  assert len(flat.lines) == len(rows)
  # README blocks: the shapes only; a grid with one layout still gets a table
  assert len(agent_tables.tables(rows, everything=False)) == 4
  one = [r for r in rows if r["layout"] != "compact"]
  one_tables = agent_tables.tables(one, everything=False)
  assert [t.title.split(",")[:2] for t in one_tables] == [["C=3584", " dead_slot layout"],
                                                          ["C=4096", " dead_slot layout"]]
  assert [c[0] for c in one_tables[0].lines] == ["full", "random", "h2o", "intentkv_query"]


def test_full_row_on_the_pruned_rows_sessions():
  """With --skip_sessions the pruned rows cover fewer sessions than full: a second full
  row counts full's calls on those sessions only (exact / name with Wilson), so the
  rates beside each other are over the same calls; with the same sessions, none."""
  def row(method, layout, budget, calls):
    return dict(method=method, layout=layout, budget=budget, next_call_exact=0.5,
                next_call_exact_ci=[0.0, 1.0], next_call_name=1.0, next_call_args=0.5,
                n_calls=len(calls), future_evidence_recall=0.5, pruned_share=0.5, pt=1.0,
                eff_live_kv=1.0, raw_reads=1.0, eff_reads=1.0, prefix_hit_rate=0.9,
                calls=[dict(session=s, turn=t, exact=e, name=n) for s, t, e, n in calls])
  full = row("full", "-", 0, [("a", 1, True, True), ("a", 2, True, True),
                              ("b", 1, False, True), ("c", 1, True, False)])
  pruned = row("random", "dead_slot", 3584, [("a", 1, False, True), ("b", 1, False, True)])
  (table,) = agent_tables.paper_tables([full, pruned])
  assert [c[0] for c in table.lines] == ["full", "full (same sessions)", "random"]
  same = table.lines[1]
  assert same[3] == "0.667" and same[5] == "1.000" and same[9] == "3"   # a: 2 of 2, b: 0 of 1
  lo, hi = (float(x) for x in same[4].strip("[]").split(","))
  assert 0.0 < lo < 0.667 < hi <= 1.0
  assert len(same) == len(agent_tables.PAPER_HEADER)
  everywhere = row("random", "dead_slot", 3584, [(s, 1, False, True) for s in "abc"])
  (table,) = agent_tables.paper_tables([full, everywhere])
  assert [c[0] for c in table.lines] == ["full", "random"]


def test_prunable_only_values_are_the_ones_pruning_can_take(llm):
  """A value in the current query span (the tool output just read, the user's request)
  or in the system prompt is safe; one only in the history between is prunable."""
  s = _session()
  messages, tools = traces.session_chat(s, llm.tokenizer)
  got = {i: labels.prunable_only_values(labels.prepare_turn(llm.tokenizer, messages, tools, i),
                                        messages, i) for i in agent_eval.call_turns(s)}
  # turn 2 copies the user id from the request, turn 4 the reservation from the tool
  # output it answers; turn 6's user id lies only in the (prunable) first user message
  assert got == {2: [], 4: [], 6: ["mia_li_3668"]}


def test_value_spans_are_the_prunable_occurrences_and_kept_needs_every_token(llm):
  """The tokens of a prunable-only value's occurrences in the history; the value counts
  as kept only when some occurrence keeps every token."""
  s = _session()
  messages, tools = traces.session_chat(s, llm.tokenizer)
  p = labels.prepare_turn(llm.tokenizer, messages, tools, 6)
  (occ,) = labels.value_spans(p, ["mia_li_3668"])
  assert occ
  for o in occ:
    assert o == list(range(o[0], o[-1] + 1)) and p["sys_len"] <= o[0] and o[-1] < p["qs"]
    assert "mia_li_3668" in llm.tokenizer.decode([p["ids"][j] for j in o])
  kept = np.ones(len(p["ids"]), bool)
  assert labels.values_coverage([occ], kept) == [1.0]
  kept[[o[len(o) // 2] for o in occ]] = False       # one token cut in every occurrence
  cut = [1 - 1 / len(o) for o in occ]
  assert max(cut) < 1                                # so the value no longer counts as kept
  assert labels.values_coverage([occ], kept) == [max(cut)]      # cut mid-value
  kept[occ[0]] = True                                # one occurrence whole again
  assert labels.values_coverage([occ], kept) == [1.0]
  kept[:] = False
  assert labels.values_coverage([occ, []], kept) == [0.0, 0.0]  # gone; no occurrence
  assert labels.value_spans(p, ["not in the prompt"]) == [[]]


def test_values_table_splits_exact_by_whether_the_values_survived():
  import agent_stats

  def row(method, exact, kept, shares=(None,) * 4):
    calls = [dict(session="a", turn=t, exact=e, name=True, prunable=1, kept=k, kept_share=x)
             for t, e, k, x in zip((1, 2, 3, 4), exact, kept, shares)]
    return dict(method=method, layout="dead_slot", budget=100, calls=calls)
  full = row("full", (True,) * 4, (True,) * 4)
  rand = row("random", (True, False, False, True), (True, False, False, None),
             (1.0, 0.5, 0.0, None))           # turn 2 cut mid-value, turn 3 gone
  old = row("h2o", (True, False, False, False), (None,) * 4)   # run before the field
  bools = row("snapkv", (True, False, False, True), (True, False, False, None))
  rows = [full, rand, old, bools]
  agent_stats.annotate(rows, "discriminative")
  table = agent_stats.values_table(rows)
  assert [c[:3] for c in table.lines] == [("random", "dead_slot", "100"),
                                          ("snapkv", "dead_slot", "100")]
  assert table.lines[0][3:5] == ("3", "0.333")
  assert table.lines[0][6:] == ("1.000 (1/1)", "0.000 (0/2)", "1/2")
  assert table.lines[1][8] == "-"                  # kept recorded, shares not
  assert agent_stats.values_table([full, old]) is None


def test_pruned_table_counts_only_the_calls_the_budget_can_change():
  """A scored call whose history is at most C prunes nothing: the table rates each row
  on the others only, against the full cache on the same calls; a row of prompt scope,
  or a full row without `history`, gives no table."""
  import agent_stats

  def row(method, exact, budget=100, history=None):
    calls = [dict(session="a", turn=t, exact=e, name=True, prunable=1)
             for t, e in zip((1, 2, 3, 4), exact)]
    if history:
      for c, h in zip(calls, history):
        c["history"] = h
    return dict(method=method, layout="dead_slot", budget=budget, budget_scope="history",
                calls=calls)
  full = row("full", (True,) * 4, 0, history=(50, 100, 150, 400))
  rows = [full, row("h2o", (True, True, False, True)), row("random", (True, True, False, False)),
          row("snapkv", (True, True, True, True), budget=200)]
  table = agent_stats.pruned_table(rows)
  assert [line[:4] for line in table.lines] == [("h2o", "dead_slot", "+100", "2 of 4"),
                                                ("random", "dead_slot", "+100", "2 of 4"),
                                                ("snapkv", "dead_slot", "+200", "1 of 4")]
  assert [line[4:] for line in table.lines] == [("0.500 (1)", "[0.09, 0.91]", "50.0"),
                                                ("0.000 (0)", "[0.00, 0.66]", "100.0"),
                                                ("1.000 (1)", "[0.21, 1.00]", "0.0")]
  del full["calls"][3]["history"]                 # written before the field
  assert agent_stats.pruned_table(rows) is None


def test_fill_history_is_the_prunable_history_of_each_call(llm):
  """Rows written before `history` get it from the sessions (the tokens between the
  system prompt and the query span); calls of other sessions stay as they are."""
  import agent_splits

  s = _session()
  messages, tools = traces.session_chat(s, llm.tokenizer)
  rows = [dict(method="full", calls=[dict(session=s.id, turn=t) for t in (2, 6)]
               + [dict(session="elsewhere", turn=2)])]
  assert agent_splits.fill_history(rows, [s], llm.tokenizer) == 2
  for c in rows[0]["calls"][:2]:
    p = labels.prepare_turn(llm.tokenizer, messages, tools, c["turn"])
    assert c["history"] == p["qs"] - p["sys_len"]
  assert rows[0]["calls"][0]["history"] < rows[0]["calls"][1]["history"]
  assert "history" not in rows[0]["calls"][2]
  assert agent_splits.fill_history(rows, [s], llm.tokenizer) == 0
  twins = [dict(method=m, calls=[dict(session=s.id, turn=t) for t in (2, 6)])
           for m in ("h2o", "random")]          # rows repeat the same calls
  assert agent_splits.fill_history(twins, [s], llm.tokenizer) == 4
  assert all(r["calls"] == rows[0]["calls"][:2] for r in twins)


def test_kept_share_is_the_least_kept_value_and_booleans_have_none():
  """A call needs every value whole: its share is its least-kept value's; a journal
  written before the shares (booleans) gives whole-or-not and no share."""
  assert agent_eval._least_share([1.0, 0.25, 0.5]) == 0.25
  assert agent_eval._least_share([True, False]) is None
  assert agent_eval._least_share(None) is None and agent_eval._least_share([]) is None


def test_paired_fields_score_discriminative_calls_only():
  import agent_stats

  def row(method, exact, layout="dead_slot", budget=100):
    calls = [dict(session="a", turn=t, exact=e, name=True, prunable=p)
             for t, e, p in zip((1, 2, 3, 4), exact, (1, 0, 2, 1))]
    return dict(method=method, layout=layout, budget=budget, calls=calls, pruned_share=1.0,
                future_evidence_recall=0.5, future_evidence_recall_ci=[0.4, 0.6])
  full = row("full", (True, True, True, False), "-", 0)
  rand = row("random", (False, True, False, False))
  ikv = row("intentkv_query", (True, True, False, False))
  other = row("random", (True, True, True, True), budget=200)   # another budget: not paired
  rows = [full, rand, ikv, other]
  agent_stats.annotate(rows, "discriminative")          # calls 1 and 3 (prunable, full solves)
  assert (ikv["n_scored"], ikv["exact_scored"]) == (2, 0.5)
  assert ikv["split_vs_random"] == [1, 0] and ikv["p_vs_random"] == 1.0
  assert ikv["split_vs_full"] == [0, 1] and ikv["p_vs_snapkv"] is None
  assert rand["p_vs_random"] is None and other["split_vs_random"] is None
  assert full["split_vs_full"] is None and full["exact_scored"] == 1.0
  agent_stats.annotate(rows, "all")
  assert ikv["n_scored"] == 4 and ikv["split_vs_random"] == [1, 0]
  t = agent_stats.table(rows)
  assert len(t.lines) == 4 and "every call" in t.title
  agent_stats.annotate([rand, ikv], "discriminative")   # no full row: nothing to define it
  assert ikv["n_scored"] is None and math.isnan(ikv["exact_scored"])


def test_contrasts_pair_the_rows_the_readings_cite():
  import agent_stats

  def row(method, layout, exact, budget=100):
    calls = [dict(session="s", turn=t, exact=e, name=True, prunable=1)
             for t, e in enumerate(exact)]
    return dict(method=method, layout=layout, budget=budget, budget_scope="history",
                calls=calls, pruned_share=1.0, future_evidence_recall=0.5)
  assert agent_stats.contrasts([row("snapkv", "compact", (True,) * 5)]) is None   # no full row
  rows = [row("full", "-", (True, True, True, True, False), 0),    # scores calls 0-3
          row("intentkv_learnable", "dead_slot", (True, True, True, False, True)),
          row("intentkv_query", "dead_slot", (False, True, False, False, False)),
          row("intentkv_learnable", "compact", (True, False, True, True, True)),
          row("snapkv", "compact", (False, False, True, True, True)),
          row("snapkv", "dead_slot", (False, False, True, True, True), budget=200)]
  agent_stats.annotate(rows, "discriminative")
  t = agent_stats.contrasts(rows)
  got = {(r[1], r[2], r[3]): (r[0], r[4], r[5], r[6], r[7]) for r in t.lines}
  assert all(r[9].startswith(("+", "-")) for r in t.lines)   # d [CI over sessions]
  assert got == {
      ("head vs rule", "intentkv_learnable dead_slot", "intentkv_query dead_slot"):
          ("+100", "4", "3", "1", "2-0"),
      ("compact vs dead-slot", "intentkv_learnable compact", "intentkv_learnable dead_slot"):
          ("+100", "4", "3", "3", "1-1"),
      ("Table 2 shape", "intentkv_learnable dead_slot", "snapkv compact"):
          ("+100", "4", "3", "2", "2-1"),
      ("Table 2 shape", "intentkv_query dead_slot", "snapkv compact"):
          ("+100", "4", "1", "2", "1-2")}    # snapkv at another budget pairs with nothing


def test_versus_pairs_a_second_head_with_the_grid_on_its_own_sessions():
  """A second head's row (its own file, the grid's full row copied, fewer sessions) meets
  every grid row at its layout and budget, and the full cache, on the calls both have."""
  import agent_stats

  def row(method, layout, exact, budget=100, sessions=("s", "t"), **kw):
    calls = [dict(session=s, turn=t, exact=e, name=True, prunable=1)
             for s in sessions for t, e in enumerate(exact)]
    return dict(method=method, layout=layout, budget=budget, budget_scope="history",
                calls=calls, pruned_share=1.0, future_evidence_recall=0.5, **kw)
  full = row("full", "-", (True, True, True, False), 0)          # scores calls 0-2
  grid = [full, row("streaming_llm", "dead_slot", (True, False, False, True)),
          row("intentkv_learnable", "dead_slot", (False, False, True, True)),
          row("snapkv", "compact", (True, True, True, True))]   # another layout
  mine = row("intentkv_learnable", "dead_slot", (True, True, False, False),
             sessions=("t",), head="heads/b@0123")                  # session t only
  t = agent_stats.versus([full, mine], grid)
  got = {r[3]: (r[0], r[1], r[2], r[4], r[5], r[6], r[7]) for r in t.lines}
  head = ("+100", "intentkv_learnable dead_slot", "heads/b@0123")
  assert got == {"full -": (*head, "3", "2", "3", "0-1"),
                 "streaming_llm dead_slot": (*head, "3", "2", "1", "1-0"),
                 "intentkv_learnable dead_slot": (*head, "3", "2", "1", "2-1")}
  assert agent_stats.versus([mine], grid) is None                   # no full row of its own


def test_session_difference_resamples_whole_sessions():
  import agent_stats
  keys = [("s1", 0), ("s1", 1), ("s1", 2), ("s2", 0), ("s2", 1)]
  a = dict.fromkeys(keys, True)
  b = {k: k[0] == "s2" for k in keys}      # b misses every call of s1, none of s2
  d, lo, hi = agent_stats.session_difference(a, b, keys)
  assert d == pytest.approx(3 / 5)
  # a resample drawing s2 twice has no difference: resampling sessions, not calls,
  # puts 0 inside the interval (a bootstrap over the 5 calls would not reach it)
  assert lo == pytest.approx(0.0) and hi == pytest.approx(1.0)
  assert all(map(math.isnan, agent_stats.session_difference(a, b, [])))


def test_pool_joins_disjoint_session_sets():
  import agent_stats

  def row(method, layout, session, exact, share, evidence):
    calls = [dict(session=session, turn=t, exact=e, name=True, prunable=1)
             for t, e in enumerate(exact)]
    return dict(method=method, layout=layout, budget=160, budget_scope="history", given="name",
                calls=calls, pruned_share=share, n_turns=len(exact), n_sessions=1,
                evidence_by_session=[evidence], future_evidence_recall=0.0)
  a = [row("full", "-", "tau2/1", (True, True, False), 0.0, [4, 4]),
       row("snapkv", "dead_slot", "tau2/1", (True, False, False), 1.0, [1, 4]),
       row("h2o", "dead_slot", "tau2/1", (False, False, False), 1.0, [0, 4])]
  b = [row("full", "-", "bfcl/1", (True, False), 0.0, [2, 2]),
       row("snapkv", "dead_slot", "bfcl/1", (False, True), 0.5, [2, 2])]   # no h2o row here
  rows = agent_stats.pool([a, b])
  assert [(r["method"], r["layout"]) for r in rows] == [("full", "-"), ("snapkv", "dead_slot")]
  snap = rows[1]
  # scored: the full cache's exact calls over both sets (tau2/1 turns 0-1, bfcl/1 turn 0)
  assert snap["n_scored"] == 3 and snap["exact_scored"] == pytest.approx(1 / 3)
  assert snap["split_vs_full"] == [0, 2] and snap["p_vs_h2o"] is None
  assert snap["pruned_share"] == pytest.approx((3 * 1.0 + 2 * 0.5) / 5)
  assert snap["future_evidence_recall"] == pytest.approx(3 / 6)      # pooled over sessions
  assert snap["budget_scope"] == "history" and snap["given"] == "name"
  one = agent_stats.pool([a])          # one set: the row's own scored figures
  agent_stats.annotate(a, "discriminative")
  assert [r["exact_scored"] for r in one] == [r["exact_scored"] for r in a]
  with pytest.raises(ValueError, match="'tau2/1' is in results 0 and 1"):
    agent_stats.pool([a, a])


def test_accuracy_vs_budget_plot(tmp_path):
  import agent_stats

  def row(method, budget, layout, exact):
    calls = [dict(session="a", turn=t, exact=e, name=True, prunable=1)
             for t, e in enumerate(exact)]
    return dict(method=method, layout=layout, budget=budget, calls=calls, pruned_share=1.0,
                future_evidence_recall=0.5)
  rows = [row("full", 0, "-", (True,) * 4)] + [
      row(m, b, lay, (True, b > 200, False, m == "h2o")) for m in ("random", "h2o")
      for b in (100, 300) for lay in ("dead_slot", "compact")]
  agent_stats.annotate(rows, "discriminative")
  path = agent_tables.plot(rows, str(tmp_path / "sub" / "acc.png"))
  assert pathlib.Path(path).stat().st_size > 10_000


@pytest.mark.slow
def test_every_configuration_starts_from_the_same_warm_cache(llm):
  """The shared system prompt is cached before each configuration, so the first one
  run in a process sees the same prefix hits as the ones after it."""
  s = _session()
  plan = agent_eval.plan_session(s, llm.tokenizer, 4)
  shared = agent_eval.system_prefixes(llm.tokenizer, [s])
  rep = agent_eval.Replay(llm, CacheConfig(num_pages=512, page_size=4, max_seq_len=2048),
                          batch=2)
  first = []
  for cfg in (PruningConfig(method="none"), PruningConfig(method="snapkv", budget=60),
              PruningConfig(method="snapkv", budget=60, layout="compact"),
              PruningConfig(method="none")):
    (ms,) = rep.run([plan], cfg, keep_prefixes=shared)
    first.append(ms[0].hit_tokens)
  assert first[0] >= len(shared[0]) - 1 and len(set(first)) == 1, first
  rep.engine.kv_manager.check()


def test_discriminative_sessions_are_the_ones_that_can_score(llm):
  s = _session()
  entry = hf_util.tool_session_entry("short")
  entry["conversations"] = entry["conversations"][:4] + entry["conversations"][-1:]
  short = traces.parse_entry(entry)                   # one call, its value in the request
  assert agent_eval.discriminative_sessions([], [s, short], llm.tokenizer) == [s]
  full = dict(method="full", layout="-", budget=0,
              calls=[dict(session=s.id, turn=6, exact=True, name=True, prunable=1),
                     dict(session="short", turn=2, exact=True, name=True, prunable=0)])
  assert agent_eval.discriminative_sessions([full], [s, short], llm.tokenizer) == [s]
  # at a history budget C only a scored call with more prunable history than C can change
  full["calls"][0]["history"], full["calls"][1]["history"] = 300, 900
  assert agent_eval.discriminative_sessions([full], [s, short], llm.tokenizer, 299) == [s]
  assert agent_eval.discriminative_sessions([full], [s, short], llm.tokenizer, 300) == []
  del full["calls"][0]["history"]                     # rows before the field: every session
  assert agent_eval.discriminative_sessions([full], [s, short], llm.tokenizer, 300) == [s]
  full["calls"][0]["exact"] = False                   # the full cache fails it: nothing left
  assert agent_eval.discriminative_sessions([full], [s, short], llm.tokenizer) == []


def test_closed_loop_rows_are_paired_over_tasks():
  def row(method, solved, layout="dead_slot", budget=2048):
    return dict(method=method, layout=layout, budget=budget, true_acc=0.0,
                episodes=[dict(task=f"t{i}", correct=c) for i, c in enumerate(solved)])
  full = row("full", [1, 1, 1, 1, 0, 1, 1, 1], "-", 0)
  rnd = row("random", [0, 0, 1, 0, 0, 0, 0, 0])
  ikv = row("intentkv_query", [1, 1, 1, 0, 1, 1, 0, 1])
  other = row("random", [1] * 8, budget=4096)           # another budget: not ikv's reference
  rows = [full, rnd, ikv, other]
  agent_env.annotate(rows)
  assert ikv["split_vs_random"] == [5, 0] and ikv["split_vs_full"] == [1, 2]
  assert ikv["p_vs_random"] == pytest.approx(0.0625)   # exact McNemar, 5-0
  assert ikv["p_vs_snapkv"] is None and full["p_vs_full"] is None
  assert other["p_vs_full"] is not None and rnd["split_vs_full"] == [0, 6]
  table = agent_env.env_table([dict(r, compl=1.0, raw_acc=0.5, true_acc_ci=[0, 1],
                                    n_tasks=8, mean_turns=2.0, pruned_share=0.5, pt=1.0,
                                    eff_live_kv=1.0, eff_reads=1.0, prefix_hit_rate=0.5,
                                    wall_s=1.0) for r in rows])
  assert "0.062 (5-0)" in table.lines[2]


def test_a_killed_configuration_resumes_from_its_saved_sessions(llm, tmp_path):
  """Each session's turn metrics are saved as its chunk finishes; a rerun runs only the
  sessions not saved (a torn last line, as a kill mid-write leaves, runs again) and
  scores the same as a run that was never stopped."""
  entry = hf_util.tool_session_entry("second")
  sessions = [_session(), traces.parse_entry(entry)]
  rep = agent_eval.Replay(llm, CacheConfig(num_pages=512, page_size=4, max_seq_len=2048),
                          batch=2)
  ran = []
  run = rep.run
  rep.run = lambda plans, cfg, **kw: (ran.append([p.id for p in plans]), run(plans, cfg, **kw))[1]
  cfg = PruningConfig(method="snapkv", budget=60)
  path = tmp_path / "rows.json.partial.jsonl"
  go = lambda journal: agent_eval.evaluate(llm, sessions, cfg, rep, max_tokens=4, every=1,
                                           journal=journal, key="k")
  whole = go(common.Journal(str(path)))
  assert ran == [[sessions[0].id], [sessions[1].id]]
  shares = [c["kept_share"] for c in whole["calls"] if c["prunable"]]
  assert shares and all(0 <= x <= 1 for x in shares)     # journaled with the sessions
  lines = path.read_text().splitlines()
  assert len(lines) == 2
  path.write_text(lines[0] + "\n" + lines[1][:40])      # killed while writing the second
  ran.clear()
  again = go(common.Journal(str(path)))
  assert ran == [[sessions[1].id]]
  for k in ("next_call_exact", "n_calls", "texts", "calls", "pruned_share", "n_turns"):
    assert again[k] == whole[k], k
  assert set(common.Journal(str(path)).done("k")) == {s.id for s in sessions}
  common.Journal(str(path)).drop("k")
  assert not path.exists()


def test_head_fingerprint_names_the_head_by_its_files(tmp_path):
  """A learnable row names its head by path and files: the same files give the same
  fingerprint (wherever the folder is), one changed byte another, so a resumed journal
  never mixes two heads' sessions."""
  for name in ("a", "b"):
    (tmp_path / name / "state").mkdir(parents=True)
    (tmp_path / name / "head.json").write_text('{"hidden": 8}')
    (tmp_path / name / "state" / "w").write_bytes(b"\x00\x01")
  a, b = (agent_eval.head_fingerprint(str(tmp_path / n)) for n in ("a", "b"))
  assert a.startswith(str(tmp_path / "a") + "@") and a.split("@")[1] == b.split("@")[1]
  (tmp_path / "b" / "state" / "w").write_bytes(b"\x00\x02")
  assert agent_eval.head_fingerprint(str(tmp_path / "b")).split("@")[1] != b.split("@")[1]
