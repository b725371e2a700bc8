"""jaxkv.engine.agent_loop: the closed loop runs the model's calls in the environment,
ends on a final answer, and accounts Compl / Raw / True Acc as the paper does.

The model is a tiny random Llama with SmolLM2's tokenizer (real prompts, real
radix cache and pruning events); what it "writes" each turn is scripted over its
real generation, so the loop's outcomes are known.
"""

import dataclasses
import importlib.util
import json

import pytest

import hf_util
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import envs, traces
from jaxkv.data.traces import ToolCall, Turn
from jaxkv.engine import agent_loop
from jaxkv.engine.sessions import SessionRunner
from test_envs import CountingEnv

CACHE = CacheConfig(num_pages=1024, page_size=4, max_seq_len=3072)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_agent_loop"))


def _script(monkeypatch, texts, seen=None):
  """run_turn runs for real; its text is replaced by texts[k] on the k-th call."""
  real, calls = SessionRunner.run_turn, []

  def run_turn(self, sid, messages, tools, i, **kw):
    assert kw["generate"] and i == len(messages) - 1
    t = real(self, sid, messages, tools, i, **kw)
    if seen is not None:
      seen.append([dict(m) for m in messages[:i]])
    k = len(calls)
    calls.append(i)
    return dataclasses.replace(t, text=texts[min(k, len(texts) - 1)])

  monkeypatch.setattr(SessionRunner, "run_turn", run_turn)
  return calls


def _react(name, args):
  return traces.format_react(Turn("assistant", f"Next I will call {name}.",
                                  (ToolCall(name, args),)))


def test_episode_runs_calls_until_the_answer(llm, monkeypatch):
  seen = []
  _script(monkeypatch, [_react("add", {})] * 3 + ["I reached 3."], seen)
  runner = SessionRunner(llm, PruningConfig(method="h2o", budget=40), cache=CACHE)
  ep = agent_loop.run_episode(runner, CountingEnv(), "count/0", max_tokens=8)
  assert ep.outcome == "answer" and ep.completed and ep.correct and ep.n_calls == 3
  assert [m["role"] for m in ep.messages] == (["system", "user"] + ["assistant", "tool"] * 3
                                              + ["assistant"])
  assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["1", "2", "3"]
  # each request saw the environment's outputs so far, and the radix cache served
  # the shared prefix of the previous request
  assert [sum(m["role"] == "tool" for m in s) for s in seen] == [0, 1, 2, 3]
  assert all(t.hit_tokens > 0 for t in ep.turns[1:])
  assert any(t.pruned for t in ep.turns)           # budget 40 < the grown prompt
  row = ep.to_json()
  assert row["answer"] == "I reached 3." and row["n_turns"] == 4
  json.dumps(row)


def test_turn_cap_empty_and_overflow_are_not_completed(llm, monkeypatch):
  runner = SessionRunner(llm, PruningConfig(method="none"), cache=CACHE)
  _script(monkeypatch, [_react("add", {})])
  capped = agent_loop.run_episode(runner, CountingEnv(target=9), "count/0", max_turns=2,
                                  max_tokens=8, session_id="a")
  assert capped.outcome == "turn_cap" and not capped.correct and capped.n_calls == 2
  _script(monkeypatch, ["   "])
  empty = agent_loop.run_episode(runner, CountingEnv(), "count/0", max_tokens=8,
                                 session_id="b")
  assert empty.outcome == "empty" and not empty.correct
  small = SessionRunner(llm, PruningConfig(method="none"),
                        cache=CacheConfig(num_pages=64, page_size=4, max_seq_len=16))
  over = agent_loop.run_episode(small, CountingEnv(), "count/0", max_tokens=8)
  assert over.outcome == "overflow" and over.turns == []
  # a call truncated by the token cap is no answer; a long plain answer still is
  real = SessionRunner.run_turn
  for text, want in (('<tool_call>\n{"name": "add", "argu', "cut_off"),
                     ("I counted to one and then", "answer")):
    def capped_turn(self, sid, messages, tools, i, _text=text, **kw):
      return dataclasses.replace(real(self, sid, messages, tools, i, **kw), text=_text,
                                 reply_tokens=kw["max_tokens"])
    monkeypatch.setattr(SessionRunner, "run_turn", capped_turn)
    ep = agent_loop.run_episode(runner, CountingEnv(), "count/0", max_tokens=8,
                                session_id=f"cut-{want}")
    assert ep.outcome == want and ep.completed == (want == "answer")
  # a wrong answer is completed but not correct
  _script(monkeypatch, [_react("add", {}), "Stopped at 1."])
  wrong = agent_loop.run_episode(runner, CountingEnv(), "count/0", max_tokens=8,
                                 session_id="c")
  assert wrong.completed and not wrong.correct

  s = agent_loop.summarize([capped, empty, over, wrong, wrong, dataclasses.replace(
      wrong, correct=True)])
  assert (s["n_tasks"], s["n_completed"], s["n_correct"]) == (6, 3, 1)
  assert s["compl"] == pytest.approx(0.5) and s["raw_acc"] == pytest.approx(1 / 3)
  assert s["true_acc"] == pytest.approx(1 / 6)
  assert s["true_acc"] == pytest.approx(s["raw_acc"] * s["compl"])
  assert (s["n_turn_cap"], s["n_empty"], s["n_overflow"], s["n_answer"]) == (1, 1, 1, 3)
  lo, hi = s["true_acc_ci"]
  assert 0 < lo < 1 / 6 < hi < 1
  with pytest.raises(ValueError, match="max_turns"):
    agent_loop.run_episode(runner, CountingEnv(), "count/0", max_turns=0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tau2") is None, reason="tau2 not installed")
def test_tau2_episode_with_the_gold_calls_is_correct(llm, monkeypatch):
  """The loop's parsing, execution and grading end to end on a real tau2 task: an agent
  that writes the gold calls in ReAct and states the totals solves it."""
  env = envs.Tau2Env(domains=("airline",))
  tid = "tau2/airline/23"
  crit = env._tasks[tid][1].evaluation_criteria
  texts = [_react(a.name, dict(a.arguments)) for a in crit.actions]
  texts.append("Totals: " + ", ".join(crit.communicate_info))
  _script(monkeypatch, texts)
  runner = SessionRunner(llm, PruningConfig(method="none"),
                         cache=CacheConfig(num_pages=4096, page_size=16, max_seq_len=16384))
  ep = agent_loop.run_episode(runner, env, tid, max_tokens=4)
  assert ep.outcome == "answer" and ep.n_calls == len(crit.actions)
  assert ep.correct and ep.checks == {"db": True, "communicate": True}
