"""bench/agent_eval.py: every tool-call turn is one sample, scored against its own gold
call, with the efficiency columns over the real decode steps."""

import dataclasses
import json
import pathlib
import sys

import pytest

import hf_util
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import traces
from jaxkv.engine.sessions import SessionRunner

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import agent_eval


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_agent_eval"))


def _session():
  return traces.parse_entry(hf_util.tool_session_entry())


@pytest.mark.slow
def test_each_call_turn_is_scored_against_its_own_gold(llm, monkeypatch):
  s = _session()
  assert agent_eval.call_turns(s) == [2, 4, 6]
  real = SessionRunner.run_turn

  def run_turn(self, sid, messages, tools, i, **kw):
    t = real(self, sid, messages, tools, i, **kw)
    assert kw["generate"] and t.reply_tokens >= 1
    # the model under test writes the gold call at turn 2, the right tool with a wrong
    # argument at turn 4, and whatever it generated at turn 6
    gold = s.turns[i]
    if i == 2:
      return dataclasses.replace(t, text=traces.format_react(gold))
    if i == 4:
      return dataclasses.replace(t, text='Action: get_reservation_details\n'
                                        'Action Input: {"reservation_id": "AIXC01"}')
    return t

  monkeypatch.setattr(SessionRunner, "run_turn", run_turn)
  cache = CacheConfig(num_pages=512, page_size=4, max_seq_len=2048)
  for cfg in (PruningConfig(method="none"), PruningConfig(method="intentkv", budget=60)):
    r = agent_eval.evaluate(llm, [s], cfg, cache, max_tokens=8)
    # the final answer (turn 7) follows the last call and cannot change a score: skipped
    assert r["n_calls"] == 3 and r["n_sessions"] == 1 and r["n_turns"] == 3
    # turn 6 from a tiny random model is no call: 1 exact of 3, 2 names of 3
    assert r["next_call_exact"] == pytest.approx(1 / 3)
    assert r["next_call_name"] == pytest.approx(2 / 3)
    lo, hi = r["next_call_exact_ci"]
    assert 0 < lo < 1 / 3 < hi < 1
    assert r["raw_reads"] >= r["eff_reads"] > 0
    # raw-text reading finds at least what the parsed calls carry
    assert r["next_call_copied"] >= r["next_call_args"] > 0
    old = lambda: {k: v for k, v in r.items() if not k.startswith("next_call_copied")}
    again = old()
    assert agent_eval.rescore([again], [s]) == 1 and again == r      # rows written before
    assert agent_eval.rescore([old()], [s, s]) == 0                  # another sample: untouched
  assert r["pruned_share"] > 0
  assert agent_eval.table([dict(method="intentkv_memory", layout="dead_slot", budget=60, **r)])


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
  t2a, t7a, t2b, t7b, flat = agent_eval.tables(rows)
  assert "Table 2" in t2a.title and "C=3584" in t2a.title and "C=4096" in t2b.title
  assert [c[:3] for c in t2a.lines] == [("full", "-", "0"), ("random", "compact", "3584"),
                                        ("h2o", "compact", "3584"),
                                        ("intentkv_query", "dead_slot", "3584")]
  assert "Table 7" in t7b.title and len(t7b.lines) == 1 + 3 * 2
  assert {c[1] for c in t7b.lines[1:]} == {"dead_slot", "compact"}
  assert len(flat.lines) == len(rows)
  # README blocks: the shapes only; a grid with one layout still gets a table
  assert len(agent_eval.tables(rows, everything=False)) == 4
  one = [r for r in rows if r["layout"] != "compact"]
  one_tables = agent_eval.tables(one, everything=False)
  assert [t.title.split(",")[:2] for t in one_tables] == [["C=3584", " dead_slot layout"],
                                                          ["C=4096", " dead_slot layout"]]
  assert [c[0] for c in one_tables[0].lines] == ["full", "random", "h2o", "intentkv_query"]
