"""bench/composed_memory.py: its table pairs methods by question and resamples whole
conversations, and one conversation runs end to end through every method on a random
3-layer model with SmolLM2's tokenizer (the composed method writing the history once and
answering each question over its own recalled region)."""

from __future__ import annotations

import pathlib
import sys

import pytest

import hf_util
from jaxkv.data import conversations as C

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import composed_memory as cm

CONV = C.Conversation(
    "c0", "Ana", "Ben",
    (C.Session(1, "1 May 2024", (C.Turn("Ana", "D1:1", "I moved to Porto last month."),
                                 C.Turn("Ben", "D1:2", "Nice, how is the weather?"))),
     C.Session(2, "3 May 2024", (C.Turn("Ana", "D2:1", "My locker code is 4172."),
                                 C.Turn("Ben", "D2:2", "I will not tell anyone.")))),
    (C.QA("Which city did Ana move to?", "Porto", ("D1:1",), 5),
     C.QA("What is Ana's locker code?", "4172", ("D2:1",), 5)))


def _row(method, conv, q, said, f1=0.0):
  return dict(method=method, conversation=conv, question=q, said=said, f1=f1, prefilled=10,
              kv=100, ttft_s=0.1)


def test_table_pairs_by_question_and_counts_conversations():
  rows = [_row("memart", "a", "q1", True), _row("memart", "a", "q2", True),
          _row("memart", "b", "q1", False),
          _row("pruned+memart", "a", "q1", True), _row("pruned+memart", "a", "q2", False),
          _row("pruned+memart", "b", "q1", True)]
  (table,) = cm.tables(rows)
  by = {line[0]: line for line in table.lines}
  assert by["memart"][1] == "3 (2)" and by["pruned+memart"][1] == "3 (2)"
  assert by["pruned+memart"][5].startswith("1-1 p=1.000")      # b/q1 won, a/q2 lost
  assert by["memart"][2].startswith("0.67")


def test_random_blocks_draw_live_blocks_in_memory_order():
  """The chance line's region: as many blocks as were retrieved, live ones only, in
  chronological order, with their own token ids."""
  import types

  import numpy as np
  cap, bs = 12, 4
  rng = np.random.default_rng(0)
  mem = types.SimpleNamespace(live=np.arange(cap) % 3 != 0, time=rng.permutation(cap),
                              ids=rng.integers(1, 99, (cap, bs)), tokens=np.full(cap, bs),
                              slots=np.zeros((cap, bs), np.int32),
                              positions=np.zeros((cap, bs), np.int32))
  mem.tokens[5] = 2
  seen = set()
  for seed in range(20):
    got = cm.random_blocks(mem, {"blocks": [1, 2, 4], "ids": [], "memory_blocks": 8},
                           np.random.default_rng(seed))
    b = np.asarray(got["blocks"])
    assert b.size == 3 and mem.live[b].all() and len(set(b)) == 3
    assert (np.diff(mem.time[b]) > 0).all() and got["memory_blocks"] == 8
    want = np.concatenate([mem.ids[i][:mem.tokens[i]] for i in b])
    assert got["ids"] == want.tolist()
    seen |= set(b.tolist())
  assert seen == set(np.flatnonzero(mem.live).tolist())    # every live block drawn


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer(num_layers=3)


@pytest.mark.slow
def test_every_method_serves_the_conversation(llm):
  """Each method answers both questions; the composed one prefills only its question
  (the region is copied) and pruning drops history past the budget."""
  got = {m: cm.serve_conversation(llm, m, CONV, budget=64, gen=4) for m in cm.METHODS}
  for m, out in got.items():
    assert [qa.answer for qa, *_ in out] == ["Porto", "4172"], m
  for _, res, prefilled, _ in got["pruned+memart"] + got["pruned+memart/random"]:
    assert res.extra["memory_spliced_tokens"] == res.extra["memory_region_tokens"] > 0
    assert prefilled < res.prompt_tokens - res.extra["memory_region_tokens"]
  full = [pre for _, _, pre, _ in got["full"]]
  assert full[1] < full[0]                         # the history from the prefix cache
  assert all(kv < res.prompt_tokens for _, res, _, kv in got["pruned"])   # pruned
