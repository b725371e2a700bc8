"""jaxkv.evaluation.closed_loop: agent episodes through the batch engine.

The model is a tiny random Llama with SmolLM2's tokenizer (real prompts, the real
engine, radix cache and pruning events). Where an outcome must be known, what it
"writes" is scripted over its real generation (each result's tokens are replaced);
elsewhere its own output runs: batching must not change an episode, and under the tool
grammar every turn is text that opens no call, or calls of the environment's tools.
"""

from __future__ import annotations

import json

import pytest

import hf_util
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import calls, traces
from jaxkv.data.traces import ToolCall, Turn
from jaxkv.engine import grammar as G
from jaxkv.evaluation import closed_loop, replay
from test_envs import CountingEnv

CACHE = CacheConfig(num_pages=1024, page_size=4, max_seq_len=3072)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_closed_loop"))


def _engine(llm, pruning=PruningConfig(method="none"), batch=4):
  return replay.engine_for(llm, pruning, CACHE, max_batch=batch)


def _react(name, args):
  return traces.format_react(Turn("assistant", f"Next I will call {name}.",
                                  (ToolCall(name, args),)))


def _script(monkeypatch, engine, tok, texts_by_task):
  """Each finished turn's tokens become the next scripted text of its episode's task."""
  real, seen = engine.step, {}

  def step(*a, **kw):
    out = real(*a, **kw)
    for res in out:
      task = res.id.split("/", 2)[2].rsplit("#", 1)[0]
      k = seen.get(task, 0)
      seen[task] = k + 1
      texts = texts_by_task[task]
      res.tokens = tok.encode(texts[min(k, len(texts) - 1)])
      res.completion_tokens = len(res.tokens)
    return out
  monkeypatch.setattr(engine, "step", step)


class ManyCounts(CountingEnv):
  def tasks(self):
    return [f"count/{i}" for i in range(5)]


class Lookup:
  """`get` answers the same for the same key; the agent may ask a question first."""

  def __init__(self, confirm: int = 0):
    self.confirm, self.asked = confirm, 0

  def tasks(self):
    return ["look/0"]

  def reset(self, task):
    self.asked = 0
    return ([{"role": "system", "content": "Use get."}, {"role": "user", "content": "Find x."}],
            [{"name": "get", "description": "reads a key", "parameters": {
                "type": "object", "properties": {"key": {"type": "string"}}}}])

  def step(self, tool_calls):
    return [{"role": "tool", "name": c.name, "content": f"value of {c.arguments.get('key')}"}
            for c in tool_calls]

  def user_reply(self, text):
    if "?" in text and self.asked < self.confirm:
      self.asked += 1
      return "Yes."
    return None

  def score(self, messages):
    return any("value of x" in str(m.get("content")) for m in messages)


def test_scripted_episodes_end_as_scripted(llm, monkeypatch):
  eng, rec = _engine(llm, PruningConfig(method="h2o", budget=40))
  tok = llm.tokenizer
  _script(monkeypatch, eng, tok, {
      "count/0": [_react("add", {})] * 3 + ["I reached 3."],
      "look/0": [_react("get", {"key": "x"}), _react("get", {"key": "x"})],
  })
  ep = closed_loop.run_episodes(eng, rec, [CountingEnv()], ["count/0"], max_tokens=8)[0]
  assert ep.outcome == "answer" and ep.correct and ep.n_calls == 3
  assert [m["role"] for m in ep.messages] == (["system", "user"] + ["assistant", "tool"] * 3
                                              + ["assistant"])
  assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["1", "2", "3"]
  assert all(t.cached_tokens > 0 for t in ep.turns[1:])       # the session's turn cached
  assert any(t.pruned for t in ep.turns)                      # budget 40 < the prompt
  row = ep.to_json()
  assert row["messages"] == ep.messages and json.dumps(row)
  # the same call with the same answer twice: nothing moved, the episode ends
  rep = closed_loop.run_episodes(eng, rec, [Lookup()], ["look/0"], max_tokens=8)[0]
  assert rep.outcome == "repeat" and not rep.completed and rep.n_calls == 2
  assert not rec.state.paths and not eng.busy                 # sessions closed, rows free
  eng.allocator.check()


def test_unknown_tools_user_replies_turn_cap_and_overflow(llm, monkeypatch):
  eng, rec = _engine(llm)
  tok = llm.tokenizer
  _script(monkeypatch, eng, tok, {
      "look/0": ["Which key do you mean?", _react("fetch", {"key": "x"}),
                 _react("get", {"key": "x"}), "x is known."],
      "count/0": [_react("add", {})]})
  ep = closed_loop.run_episodes(eng, rec, [Lookup(confirm=1)], ["look/0"], max_tokens=8)[0]
  assert ep.outcome == "answer" and ep.correct and ep.n_calls == 2
  assert ep.messages[3] == {"role": "user", "content": "Yes."}       # the scripted user
  assert "no tool named 'fetch'" in ep.messages[5]["content"]
  assert "the tools are: get" in ep.messages[5]["content"]
  capped = closed_loop.run_episodes(eng, rec, [CountingEnv(target=9)], ["count/0"],
                                    max_tokens=8, max_turns=2)[0]
  assert capped.outcome == "turn_cap" and capped.n_calls == 2
  over = closed_loop.run_episodes(eng, rec, [CountingEnv()], ["count/0"], max_tokens=8,
                                  max_prompt=16)[0]
  assert over.outcome == "overflow" and over.turns == []
  with pytest.raises(ValueError, match="max_turns"):
    closed_loop.run_episodes(eng, rec, [CountingEnv()], ["count/0"], max_turns=0)


def test_batching_episodes_does_not_change_them(llm):
  """The model's own (greedy) output: five episodes three at a time equal one at a time."""
  eng, rec = _engine(llm)
  tasks = ManyCounts().tasks()
  one = closed_loop.run_episodes(eng, rec, [ManyCounts()], tasks, max_tokens=12, max_turns=3)
  three = closed_loop.run_episodes(eng, rec, [ManyCounts() for _ in range(3)], tasks,
                                   max_tokens=12, max_turns=3)
  assert [e.task for e in three] == tasks
  assert [e.messages for e in three] == [e.messages for e in one]
  assert [e.outcome for e in three] == [e.outcome for e in one]


def test_tool_grammar_keeps_every_turn_a_text_or_a_valid_call(llm):
  eng, rec = _engine(llm)
  gs = G.Grammars(llm.tokenizer, llm.config.vocab_size)
  eps = closed_loop.run_episodes(eng, rec, [Lookup(), Lookup()], ["look/0"] * 1,
                                 max_tokens=24, max_turns=4, grammars=gs)
  eps += closed_loop.run_episodes(eng, rec, [ManyCounts() for _ in range(2)],
                                  ManyCounts().tasks(), max_tokens=24, max_turns=4,
                                  grammars=gs)
  n_turns = 0
  for ep in eps:
    for m in ep.messages:
      if m["role"] != "assistant":
        continue
      n_turns += 1
      made = calls.parse_calls(m["content"])
      if made:
        assert {c.name for c in made} <= {"add", "get"}
      else:
        assert not any(o in m["content"] for o in calls.CALL_OPENERS), m["content"]
  assert n_turns >= len(eps)


def test_tool_grammar_takes_declared_tools_and_arguments_only(llm):
  gs = G.Grammars(llm.tokenizer, llm.config.vocab_size)
  tools = Lookup().reset("look/0")[1] + [
      {"name": "odd", "parameters": {"type": "bogus"}},
      {"name": "now", "parameters": {"type": "object", "properties": {}}}]
  text = closed_loop.tool_grammar(gs, tools)

  def ok(s):
    m = gs.compile(text)
    try:
      for t in llm.tokenizer.encode(s):
        m.consume(t)
    except ValueError:
      return False
    return m.accepting
  assert ok(_react("get", {"key": "x"})) and ok("I found nothing.")
  assert ok(_react("odd", {"anything": [1]}))        # a schema it cannot compile: any object
  assert not ok(_react("get", {"key": "x", "extra": 1}))   # only declared parameters
  assert not ok(_react("put", {"key": "x"}))               # only the environment's tools
  assert ok(_react("now", {})) and not ok(_react("now", {"n": 1}))   # none declared
