"""bench/compaction.py: the client's cleared history and what each method does with it.

The tool session of tests/test_sessions.py on a random 6-layer Llama with SmolLM2's
tokenizer and chat template, replayed with `Turn.messages` (the history the client
sends) through the bench's engines: the turn whose history lost a tool output breaks
the session's cached path there; with reuse it splices the tool output a turn before
computed, so it prefills less than without."""

from __future__ import annotations

import pathlib
import sys

import pytest

import hf_util
from jaxkv.config import CacheConfig
from jaxkv.evaluation import replay
from test_sessions import MESSAGES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import compaction

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
TOOLS = [i for i, m in enumerate(MESSAGES) if m["role"] == "tool"]          # 3, 5, 7


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def test_cleared_keeps_the_latest_tool_outputs():
  view, n = compaction.cleared(MESSAGES, 8, keep=2)
  assert n == 1 and len(view) == 9
  assert view[TOOLS[0]]["content"] == compaction.CLEARED
  assert [view[j] for j in TOOLS[1:]] == [MESSAGES[j] for j in TOOLS[1:]]
  assert view[8] == MESSAGES[8]                     # the gold reply as it was
  assert compaction.cleared(MESSAGES, 6, keep=2) == (MESSAGES[:7], 0)
  assert compaction.cleared(MESSAGES, 8, keep=0)[1] == 3


def test_a_cleared_tool_output_breaks_the_path_and_reuse_splices_what_follows(llm):
  got = {}
  for method in ("full", "reuse"):
    eng, rec, mech = compaction.make_engine(llm, method, 4096, CACHE, batch=2)
    turns = [replay.Turn(i, messages=compaction.cleared(MESSAGES, i, keep=2)[0])
             for i in (4, 6, 8)]
    rows = {}
    replay.replay(eng, rec, [replay.Session("s", MESSAGES, None, turns)], mechanism=mech,
                  on_result=lambda k, t, res, m, rows=rows: rows.__setitem__(t.i, (res, m)))
    got[method] = rows
    eng.kv_manager.check()
  (full6, _), (full8, m8) = got["full"][6], got["full"][8]
  assert full8.cached_tokens < full6.prompt_tokens        # the path ends at the cleared output
  (reuse8, r8) = got["reuse"][8]
  assert reuse8.cached_tokens == full8.cached_tokens
  assert reuse8.extra["reused_tokens"] > 32               # the tool output turn 6 computed
  assert reuse8.extra["prefill_tokens"] < full8.prompt_tokens - full8.cached_tokens
  assert r8.reply_tokens == m8.reply_tokens and abs(r8.nll - m8.nll) < 1.0
