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
import agent_eval  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_agent_eval"))


def _session():
  return traces.parse_entry(hf_util.tool_session_entry())


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
  no_marker = llm.tokenizer.encode("Done, nothing to call.", add_bos=False)
  assert agent_eval.argument_prefix(llm.tokenizer, no_marker) == 0
