"""bench/agent_splits.py: sliced trace specs, the Phase-2 head never scored on its own
training sessions, and budgets picked on a dev split from prompt lengths alone."""

import json
import pathlib
import sys

import pytest

import hf_util
from jaxkv import artifacts
from jaxkv.data import labels, traces
from jaxkv.models import presets
from jaxkv.tokens import Tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import agent_splits


def _trace_file(tmp_path, n=6, name="t.json"):
  path = tmp_path / name
  path.write_text(json.dumps([hf_util.tool_session_entry(f"s{i}") for i in range(n)]))
  return str(path)


def test_parse_spec_reads_python_slices():
  assert agent_splits.parse_spec("a/b.json") == ("a/b.json", slice(None))
  assert agent_splits.parse_spec("a/b.json[30:]") == ("a/b.json", slice(30, None))
  assert agent_splits.parse_spec(" a.json[:5] ") == ("a.json", slice(None, 5))
  assert agent_splits.parse_spec("a.json[2:-1]") == ("a.json", slice(2, -1))


def test_load_spec_slices_in_file_order_and_names_missing_files(tmp_path):
  path = _trace_file(tmp_path)
  assert [s.id for s in agent_splits.load_spec(path + "[2:4]")] == ["s2", "s3"]
  assert len(agent_splits.load_spec(path)) == 6
  with pytest.raises(FileNotFoundError, match=r"make_traces\.py"):
    agent_splits.load_spec(str(tmp_path / "nope.json") + "[1:]")


def _head(tmp_path, train, cap):
  head = tmp_path / "head"
  head.mkdir()
  (head / artifacts.MANIFEST).write_text(json.dumps({
      "kind": "pruner_head", "config": {"max_train_sessions": cap},
      "data": {"train": {"path": train, "sha256": artifacts.sha256(train)}}}))
  return str(head)


def test_a_head_is_refused_on_the_sessions_it_trained_on(tmp_path):
  train = _trace_file(tmp_path)
  other = _trace_file(tmp_path, n=5, name="other.json")   # same ids, other bytes
  head = _head(tmp_path, train, cap=3)
  assert agent_splits.head_trained_ids(head, train) == {"s0", "s1", "s2"}
  assert agent_splits.head_trained_ids(head, other) == set()
  with pytest.raises(ValueError, match=r"\[3:\]"):
    agent_splits.check_unseen(head, [train])
  with pytest.raises(ValueError, match="2 sessions"):
    agent_splits.check_unseen(head, [train + "[1:]"])
  agent_splits.check_unseen(head, [train + "[3:]", other])           # unseen: no error
  all_head = tmp_path / "all"
  all_head.mkdir()
  (all_head / artifacts.MANIFEST).write_text(json.dumps({
      "config": {"max_train_sessions": 0},
      "data": {"train": {"path": train, "sha256": artifacts.sha256(train)}}}))
  with pytest.raises(ValueError, match="6 sessions"):
    agent_splits.check_unseen(str(all_head), [train])
  agent_splits.check_unseen(str(tmp_path / "no_manifest"), [train])  # no manifest: no rule


def test_pick_budgets_prunes_the_share_asked():
  lengths = list(range(1000, 2000, 10))                 # 100 prompts
  budgets = agent_splits.pick_budgets(lengths, [0.9, 0.5, 0.25])
  for share, c in zip([0.9, 0.5, 0.25], budgets):
    assert c % agent_splits.PAGE == 0
    got = sum(n > c for n in lengths) / len(lengths)
    assert share <= got < share + 0.05, (share, c, got)
  with pytest.raises(ValueError, match="share"):
    agent_splits.pick_budgets(lengths, [1.0])
  with pytest.raises(ValueError, match="empty"):
    agent_splits.pick_budgets([], [0.5])


def test_call_spans_are_the_prompts_agent_eval_replays():
  tok = Tokenizer.load(presets.smollm2_gguf())
  s = traces.parse_entry(hf_util.tool_session_entry())
  got = agent_splits.call_spans([s], tok, 10_000)
  msgs, tools = traces.session_chat(s, tok)
  ps = [labels.prepare_turn(tok, msgs, tools, i) for i in agent_splits.call_turns(s)]
  assert got == [(len(p["ids"]), p["sys_len"], p["qs"]) for p in ps] and len(got) == 3
  assert agent_splits.call_spans([s], tok, 10) == []
  hist = agent_splits.lengths(got, "history")
  assert hist == [qs - sl for _, sl, qs in got] and hist == sorted(hist) and hist[-1] > 0


def test_room_counts_calls_whose_scorers_can_differ():
  spans = [(1000, 600, 900), (500, 300, 450), (2000, 600, 1900)]   # (n, sys_len, qs)
  # prompt scope: calls 1 and 3 prune at C = 700 and 800; both force 600 + 100 tokens,
  # so C = 700 leaves their scorers nothing to choose and C = 800 leaves 100
  assert agent_splits.room(spans, 700, "prompt") == (2 / 3, 0.0)
  assert agent_splits.room(spans, 800, "prompt") == (2 / 3, 2 / 3)
  assert agent_splits.room(spans, 400, "history") == (1 / 3, 1 / 3)
  assert agent_splits.room(spans, 100, "history") == (1.0, 1.0)
