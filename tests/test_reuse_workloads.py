"""Segment-reuse workloads (jaxkv.data.reuse_workloads) and bench/reuse.py's tables."""

import json
import pathlib
import re
import sys

import numpy as np
import pytest

from jaxkv.data import reuse_workloads as W
from jaxkv.data import texts, traces
from jaxkv.models import presets
from jaxkv.tokens import Tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import reuse
import reuse_tables

TOOLS = tuple({"name": f"tool_{i}", "description": f"Looks up record kind {i} by its id and "
               f"returns every field of it as JSON.",
               "parameters": {"type": "object", "properties": {f"id_{i}": {"type": "string"}}}}
              for i in range(6))
SYSTEM = ("You are an agent.\n## Refunds\n" + "Refunds go to the original payment method. " * 4
          + "\n## Changes\n" + "A change needs the user's explicit confirmation first. " * 4)


def _sessions():
  out = []
  for i in range(3):
    turns = (traces.Turn("system", SYSTEM), traces.Turn("user", f"Please look up record {i}."),
             traces.Turn("assistant", "I will look it up.",
                         (traces.ToolCall(f"tool_{i}", {f"id_{i}": f"R{i}"}),)))
    out.append(traces.Session(id=f"demo/{i}", task=f"demo/{i}", turns=turns, tools=TOOLS))
  return out


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.load(presets.smollm2_gguf())


def test_tool_subset_requests_carry_their_schemas_as_spans(tok):
  reqs = W.tool_subset(_sessions(), tok, 8, seed=3, tools=(2, 4), sections=(1, 2))
  assert len(reqs) == 8
  again = W.tool_subset(_sessions(), tok, 8, seed=3, tools=(2, 4), sections=(1, 2))
  assert all(np.array_equal(a.ids, b.ids) for a, b in zip(reqs, again))     # deterministic
  orders = set()
  for r in reqs:
    assert 2 <= r.meta["tools"] <= 4 and 1 <= r.meta["sections"] <= 2
    # sections + schemas + the user text, in prompt order, inside the prompt
    assert len(r.spans) == r.meta["tools"] + r.meta["sections"] + 1
    assert all(0 <= a < b <= r.ids.size for a, b in r.spans)
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(r.spans, r.spans[1:]))
    texts = [tok.decode(r.ids[a:b]) for a, b in r.spans]
    names = [json.loads(t)["name"] for t in texts if t.startswith("{")]
    assert len(names) == r.meta["tools"]
    orders.add(tuple(names))
    assert tok.decode(r.continuation).startswith("Thought:")
  assert len(orders) > 4                      # subsets in varying order


def test_perturbations_change_the_context_by_the_fraction():
  rng = np.random.default_rng(0)
  ids = np.arange(1000, 1100, dtype=np.int32)
  assert W.perturb(ids, 0.2, "insert", rng, (1, 50)).size == 120
  assert W.perturb(ids, 0.2, "delete", rng, (1, 50)).size == 80
  rep = W.perturb(ids, 0.2, "replace", rng, (1, 50))
  assert rep.size == 100 and int((rep != ids).sum()) == 20
  with pytest.raises(ValueError, match="insert, delete or replace"):
    W.perturb(ids, 0.2, "shuffle", rng, (1, 50))


def test_perturbed_pairs_keep_the_segment_and_shift_its_span(tok):
  (req,) = W.tool_subset(_sessions(), tok, 1, seed=1)
  pairs = W.perturbed([req], [0.0, 0.25], ["insert", "replace"], context=64)
  assert len(pairs) == 4
  lo, hi = max(req.spans, key=lambda s: s[1] - s[0])
  for ref, probe in pairs:
    assert ref is req
    shift = probe.ids.size - req.ids.size
    np.testing.assert_array_equal(probe.ids[lo + shift:], req.ids[lo:])
    assert (lo + shift, hi + shift) in probe.spans
    if probe.meta["frac"] == 0.0:
      np.testing.assert_array_equal(probe.ids, req.ids)


def _row(method, ttft, **kw):
  base = dict(method=method, workload="tool_subset", tier_accept={}, prefill_tokens=100.0,
              prompt_tokens=100.0, reused_tokens=0.0, prefill_flops=1.0, flops_ratio=1.0,
              ttft_s=ttft, compile_s=0.0, kl_first_token=0.0, delta_nll=0.0,
              greedy_agreement=1.0, greedy_ci=[0.9, 1.0], bytes_stored=0, bytes_moved=0,
              segments=0, break_even_median=None, n_requests=4, storage="int8", wall_s=1.0)
  return base | kw


def test_bench_table_ratios_are_against_none_and_prefix():
  rows = [_row("none", 2.0), _row("prefix", 1.6),
          _row("tiered", 0.4, tier_accept={"exact": 1, "blend": 3}, break_even_median=0.5)]
  (table,) = reuse_tables.tables(rows)
  by = {line[0]: line for line in table.lines}
  assert by["tiered"][5] == "5.00x" and by["tiered"][6] == "4.00x"
  assert by["tiered"][1] == "exact:1 blend:3"
  assert by["none"][5] == "1.00x" and by["prefix"][6] == "1.00x"



def test_bench_quality_and_the_chance_table_pair_requests():
  """Rows of the current protocol carry per-request drift with bootstrap intervals;
  each method is compared with its chance baseline request by request."""
  per = lambda agree: [dict(kl=0.01 * i, dnll=0.0, agree=a, first_diff=4 * a)
                       for i, a in enumerate(agree)]
  q = reuse.quality(per([1.0, 0.5, 0.5, 0.0]))
  assert q["greedy_agreement"] == 0.5 and q["greedy_ci"][0] < 0.5 < q["greedy_ci"][1]
  assert q["first_diff"] == 2.0 and q["per_request"]["agree"] == [1.0, 0.5, 0.5, 0.0]
  rows = [_row("none", 2.0, **reuse.quality(per([1.0] * 4))),
          _row("epic", 1.0, **reuse.quality(per([1.0, 1.0, 0.5, 0.5]))),
          _row("epic_random", 1.0, **reuse.quality(per([0.5, 0.5, 0.0, 0.0])))]
  main, chance = reuse_tables.tables(rows)
  assert "bootstrap 95% intervals over requests" in main.title
  assert {line[0]: line for line in main.lines}["epic"][10] == "3.0"    # first diff
  (line,) = chance.lines
  assert line[:2] == ("epic", "epic_random") and line[3] == "+0.5000 [+0.5000, +0.5000]"


def test_the_paired_table_times_methods_request_by_request():
  """Timed rows pair TTFT by request: each timed method against the prefix cache and a
  method with @settings against its base; quality-only rows keep the table as it was."""
  per = lambda ttft: [dict(kl=0.0, dnll=0.0, agree=1.0, first_diff=4.0, ttft=t) for t in ttft]
  timed = lambda name, ttft: _row(name, float(np.mean(ttft)),
                                  **reuse.quality(per(ttft), timed=True))
  rows = [timed("none", [2.0] * 4), timed("prefix", [1.0, 2.0, 2.0, 1.0]),
          timed("tiered", [0.5, 1.0, 1.0, 0.5]), timed("tiered@regime=B", [1.0, 2.0, 2.0, 1.0])]
  _, paired = reuse_tables.tables(rows)
  assert paired.header[-1] == "TTFT b / a" and "times sooner" in paired.title
  by = {tuple(line[:2]): line[-1] for line in paired.lines}
  assert by[("tiered", "prefix")] == "2.00x [2.00, 2.00]"
  assert by[("tiered@regime=B", "tiered")] == "0.50x [0.50, 0.50]"
  assert by[("tiered@regime=B", "prefix")] == "1.00x [1.00, 1.00]"
  assert ("none", "prefix") not in by
  plain = [_row(r["method"], r["ttft_s"], **reuse.quality(per([1.0] * 4))) for r in rows]
  _, paired = reuse_tables.tables(plain)
  assert paired.header[-1] == "d dNLL" and "times sooner" not in paired.title


def test_bench_ratios_divide_by_each_runs_own_none():
  # a second invocation ran slower (its none pass: 3.0 s against the first's 2.0 s):
  # tiered's 0.6 s is 5x its own none, and 4x the prefix cache through each run's none
  rows = [_row("none", 2.0), _row("prefix", 1.6), _row("tiered", 0.6, none_ttft_s=3.0),
          _row("naive", 0.5)]
  reuse_tables.add_speedups(rows)
  by = {r["method"]: r for r in rows}
  assert by["tiered"]["ttft_ratio_vs_none"] == pytest.approx(5.0)
  assert by["tiered"]["ttft_ratio_vs_prefix"] == pytest.approx(4.0)
  assert by["naive"]["ttft_ratio_vs_prefix"] == pytest.approx(3.2)
  alone = [_row("naive", 0.5)]            # no baselines in the file: no ratio, no error
  reuse_tables.add_speedups(alone)
  assert alone[0]["ttft_ratio_vs_none"] is None and alone[0]["ttft_ratio_vs_prefix"] is None

def test_line_spans_split_a_prompt_at_line_breaks(tok):
  from jaxkv.policies.reuse.index import line_spans
  text = "Tools:\n" + "\n".join(json.dumps(t) for t in TOOLS[:3]) + "\nUser: hi"
  ids = tok.encode(text, add_bos=False)
  spans = line_spans(ids, tok, min_tokens=8)
  assert [json.loads(tok.decode(ids[a:b]))["name"] for a, b in spans] == [
      "tool_0", "tool_1", "tool_2"]


# ------------------------------------------------------------------ (b) retrieval
RST = """:mod:`json` --- JSON encoder and decoder
========================================

.. module:: json
   :synopsis: Encode and decode the JSON format.

**Source code:** :source:`Lib/json/__init__.py`

--------------

`JSON (JavaScript Object Notation) <https://json.org>`_, specified by
:rfc:`7159`, is a lightweight data interchange format [#rfc-errata]_. It is
easy for ``humans`` to read.

:mod:`json` exposes an API familiar to users of the :func:`marshal <marshal.dumps>`
module. Several ways to use it:

* first item
  continued

Basic usage::

    >>> import json

Later section
-------------
Not part of the intro.
"""


def test_intro_reads_title_and_prose_without_markup():
  title, text = texts.intro(RST)
  assert title == "json --- JSON encoder and decoder"
  assert text.startswith("JSON (JavaScript Object Notation), specified by 7159, is a "
                         "lightweight data interchange format. It is easy for humans to read.")
  assert text.endswith("json exposes an API familiar to users of the marshal module. "
                       "Several ways to use it:")
  assert "module::" not in text and "Source code" not in text and "Later" not in text
  assert texts.intro("no title here\n\njust text") is None


def test_doc_passages_and_a_missing_corpus(tmp_path):
  (tmp_path / "library").mkdir()
  (tmp_path / "library" / "json.rst.txt").write_text(RST)
  (tmp_path / "library" / "empty.rst.txt").write_text("Title\n=====\n\n.. note:: x\n")
  (p,) = texts.doc_passages(tmp_path, min_chars=50)
  assert p.doc == "library/json" and p.title.startswith("json")
  with pytest.raises(FileNotFoundError, match=re.escape("fetch_texts.py")):
    texts.doc_passages(tmp_path / "nothing")


def _passages(n=12):
  return [texts.Passage(doc=f"library/m{i}", title=f"m{i} --- module number {i}",
                        text=f"The m{i} module does thing {i} for you. " + "It has details. " * 8)
          for i in range(n)]


def test_retrieval_requests_ask_about_one_of_their_passages(tok):
  reqs = W.retrieval(_passages(), tok, 10, seed=2, k=(3, 5), pool=8)
  assert len(reqs) == 10
  again = W.retrieval(_passages(), tok, 10, seed=2, k=(3, 5), pool=8)
  assert all(np.array_equal(a.ids, b.ids) for a, b in zip(reqs, again))
  used = set()
  for r in reqs:
    assert 3 <= len(r.meta["docs"]) <= 5 and r.meta["target"] in r.meta["docs"]
    assert len(r.spans) == len(r.meta["docs"]) + 1             # passages + the question
    i = int(r.meta["target"].rsplit("m", 1)[1])
    assert tok.decode(r.continuation) == f"The m{i} module does thing {i} for you."
    assert f"m{i} --- module number {i}" in tok.decode(r.ids[r.spans[-1][0]:r.spans[-1][1]])
    used |= set(r.meta["docs"])
  assert len(used) <= 8                                        # drawn from the pool


# -------------------------------------------------------------------- (c) requote
def _tool_sessions():
  out = []
  for i in range(2):
    turns = [traces.Turn("system", SYSTEM), traces.Turn("user", f"Please fix order {i}.")]
    for j in range(3):
      turns += [traces.Turn("assistant", f"Step {j}.", (traces.ToolCall(
                    f"tool_{j}", {f"id_{j}": f"R{i}{j}"}),)),
                traces.Turn("tool", json.dumps({"record": f"R{i}{j}", "fields": list(range(
                    20 + j))}), name=f"tool_{j}")]
    turns.append(traces.Turn("assistant", "Done."))
    out.append(traces.Session(id=f"demo/{i}", task=f"demo/{i}", turns=tuple(turns), tools=TOOLS))
  return out


def test_requote_quotes_outputs_most_recent_first_in_a_new_context(tok):
  reqs = W.requote(_tool_sessions(), tok, 12, seed=0)
  assert len(reqs) == 12
  assert [r.meta["role"] for r in reqs] == ["A", "B"] * 6
  assert all(r.scored == (r.meta["role"] == "B") for r in reqs)
  for a, b in zip(reqs[::2], reqs[1::2]):
    session = next(s for s in _tool_sessions() if s.id == a.meta["session"])
    outs = [t.content for t in session.turns if t.role == "tool"][:b.meta["outputs"]]
    quoted = [tok.decode(b.ids[lo:hi]) for lo, hi in b.spans[1:]]
    assert quoted == outs[::-1]                     # most recent first
    assert [tok.decode(a.ids[lo:hi]) for lo, hi in a.spans[1:]] == outs
    assert np.array_equal(a.continuation, b.continuation)
    assert not np.array_equal(a.ids[:64], b.ids[:64])   # another agent, another prefix


# ---------------------------------------------------------------- (d) drift table/plot
def test_drift_tables_and_plot(tmp_path):
  rows = [dict(method=m, workload="perturbed", kind=k, frac=f, tier_accept={},
               kl_first_token=0.01 * f * (m != "none"), delta_nll=0.02 * f, greedy_agreement=1.0,
               greedy_ci=[0.9, 1.0], flops_ratio=0.5, reused_tokens=10.0, n_requests=3,
               storage="int8")
          for m in ("none", "naive") for k in ("insert", "replace") for f in (0.0, 0.5)]
  tabs = reuse_tables.tables(rows)
  assert [t.title.split(",")[1].split(":")[0].strip() for t in tabs] == ["insert", "replace"]
  by = {line[0]: line for line in tabs[0].lines}
  assert by["naive"][2] == "0.005 / +0.010 / 0.50"
  path = reuse_tables.drift_plot(rows, str(tmp_path / "drift.png"))
  assert pathlib.Path(path).stat().st_size > 10_000


# ToolBench's released shape (toolllama's system prompt): the API list inline, as a
# Python literal, after "Specifically, you have access to the following APIs:".
TB_APIS = [{"name": f"api_{i}_for_svc{i % 5}", "description": (
    f'This is the subfunction for tool "svc{i % 5}", you can use this tool.The description '
    f'of this function is: "Returns record {i} of the service with every field."'),
    "parameters": {"type": "object", "properties": {"record_id": {
        "type": "string", "description": "the record", "example_value": f"R{i}"}},
        "required": ["record_id"], "optional": []}} for i in range(32)]
TB_SYSTEM = (
    "You are AutoGPT, you can use many tools(functions) to do the following task.\nFirst I "
    "will give you the task description, and your task start.\nAt each step, you need to give "
    "your thought to analyze the status now and what to do next, with a function call to "
    "actually excute your step. Your output should follow this format:\nThought:\nAction:\n"
    "Action Input:\n\nAfter the call, you will get the call result, and you are now in a new "
    "state.\nThen you will analyze your status now, then decide what to do next...\nAfter many "
    "(Thought-call) pairs, you finally perform the task, then you can give your finial answer."
    "\nRemember: \n1.the state change is irreversible, you can't go back to one of the former "
    "state, if you want to restart the task, say \"I give up and restart\".\n2.All the thought "
    "is short, at most in 5 sentence.\nLet's Begin!\nTask description: You should use "
    "functions to help handle the real time user querys. Remember:\n1.ALWAYS call \"Finish\" "
    "function at the end of the task.\n2.Do not use origin tool APIs, use only subfunctions"
    "(APIs).\nSpecifically, you have access to the following APIs: " + repr(TB_APIS))


def test_toolbench_shaped_sessions_carry_each_api_once(tok, tmp_path):
  """A ToolBench file in its released shape (32 APIs inline in the system prompt): the
  list becomes the session's tools and leaves the system text, so the workload's header
  and sections hold no API and a request holds exactly the 4-8 schemas it drew; chat
  messages list each API once either way, and the file round-trips."""
  entries = [{"id": f"tb/{i}", "conversations": [
      {"from": "system", "value": TB_SYSTEM},
      {"from": "user", "value": f"Get record R{i} of svc{i % 5}.\nBegin!\n"},
      {"from": "assistant", "value": f"Thought: look it up.\nAction: api_{i}_for_svc{i % 5}\n"
                                     f"Action Input: {{\"record_id\": \"R{i}\"}}"}]}
             for i in range(3)]
  path = tmp_path / "tb.json"
  path.write_text(json.dumps(entries))
  sessions = traces.load_toolbench(path)
  s = sessions[0]
  names = [t["name"] for t in TB_APIS]
  assert [t["name"] for t in s.tools] == names
  system = s.turns[0].content
  assert system.endswith("you have access to the following APIs:")
  assert not any(n in system for n in names)
  assert not any(n in x for n in names for x in [W._header(s), *W.policy_sections(s)])
  for r in W.tool_subset(sessions, tok, 6, seed=1):
    text = tok.decode(r.ids)
    counts = [text.count(f'"{n}"') for n in names]
    assert sorted(counts)[-1] == 1 and sum(counts) == r.meta["tools"]
    assert 4 <= r.meta["tools"] <= 8 and r.ids.size < 1500
  react = traces.to_messages(s, react=True)[0]["content"]       # tools in the system text
  assert all(react.count(n) == 1 for n in names)
  assert not any(n in traces.to_messages(s)[0]["content"] for n in names)   # template's
  out = tmp_path / "again.json"
  traces.dump_toolbench(sessions, out)
  assert traces.load_toolbench(out) == sessions
  value = traces.to_entry(s)["conversations"][0]["value"]
  assert value.startswith(system) and all(value.count(n) == 1 for n in names)
