"""Session replay through the engine (`jaxkv.evaluation.replay`) equals the batch-1
`SessionRunner` turn by turn -- teacher-forced NLL, what was kept, evidence recall,
free-generated tokens -- and batching sessions changes nothing but the speed."""

import itertools
import math
import pathlib
import sys

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.data import traces
from jaxkv.engine.sessions import SessionRunner
from jaxkv.evaluation import replay
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
TURNS = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]   # 2, 4, 6, 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_replay"))


def _session(sid, turns):
  return replay.Session(sid, MESSAGES, None, turns)


def _close(a, b, tol):
  return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


SLOW = pytest.mark.slow


@pytest.mark.parametrize("method", ["none", pytest.param("intentkv", marks=SLOW),
                                    pytest.param("snapkv", marks=SLOW), "h2o", "h2o@history"])
def test_forced_replay_equals_session_runner(llm, method):
  """Teacher-forced: NLL within 1e-5 (the engine prefills the reply in its own
  chunks beside other rows), prefix hits, the pruning event, the kept positions and
  evidence identical (method@history: a budget on the history alone)."""
  method, _, scope = method.partition("@")
  pruning = PruningConfig(method=method, budget=16 if scope else 64,
                          budget_scope=scope or "prompt")
  ref = SessionRunner(llm, pruning, cache=CACHE, prefill_chunk=64).run_session("s", MESSAGES)
  eng, rec = replay.engine_for(llm, pruning, CACHE, prefill_chunk=64, decode_steps=4)
  (got,) = replay.replay(eng, rec, [_session("s", replay.all_turns(MESSAGES))])
  assert [t.turn for t in got] == [t.turn for t in ref] == TURNS
  for a, b in zip(got, ref):
    assert abs(a.nll - b.nll) <= 1e-5, (a.turn, a.nll, b.nll)
    assert (a.prompt_tokens, a.reply_tokens, a.pruned, a.live_before, a.live_after) == (
        b.prompt_tokens, b.reply_tokens, b.pruned, b.live_before, b.live_after), a.turn
    np.testing.assert_array_equal(a.kept, b.kept)
    assert (a.evidence, a.evidence_kept, a.evidence_candidates,
            a.evidence_candidates_kept) == (b.evidence, b.evidence_kept,
                                            b.evidence_candidates, b.evidence_candidates_kept)
    assert (a.pt, a.eff_live_kv, a.raw_reads, a.eff_reads) == (
        b.pt, b.eff_live_kv, b.raw_reads, b.eff_reads)
    assert a.hit_tokens == b.hit_tokens, a.turn
    assert _close(a.memory_cos, b.memory_cos, 1e-5)
  if method != "none":
    assert any(t.pruned for t in ref)                 # the budget bites
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and rec.tree.locked_tokens == 0 and not rec.kept


@pytest.mark.slow
def test_free_turns_and_batched_sessions(llm):
  """Free turns equal SessionRunner's generated tokens; three sessions replayed side by
  side in one batch equal each replayed alone; `until` stops a reply early."""
  pruning = PruningConfig(method="intentkv", budget=64)
  turns = [replay.Turn(i, generate=i in (4, 8), max_tokens=10) for i in TURNS]
  runner = SessionRunner(llm, pruning, cache=CACHE, prefill_chunk=64)
  ref = [runner.run_turn("s", MESSAGES, None, t.i, generate=t.generate, max_tokens=10)
         for t in turns]
  eng, rec = replay.engine_for(llm, pruning, CACHE, prefill_chunk=64, decode_steps=4)
  (alone,) = replay.replay(eng, rec, [_session("s", turns)])
  for a, b in zip(alone, ref):
    assert a.reply_ids == b.reply_ids and a.text == b.text and a.kept.sum() == b.kept.sum()
    assert _close(a.nll, b.nll, 1e-4)
  # three sessions with their own system prompts, alone and then side by side
  chats = [[dict(MESSAGES[0], content=MESSAGES[0]["content"] + f" Desk {k}.")] + MESSAGES[1:]
           for k in range(3)]
  solo = []
  for k, chat in enumerate(chats):
    rec.set_policy(pruning)
    solo += replay.replay(eng, rec, [replay.Session(f"b{k}", chat, None, turns)])
  rec.set_policy(pruning)
  batched = replay.replay(eng, rec, [replay.Session(f"b{k}", c, None, turns)
                                     for k, c in enumerate(chats)])
  for got, ref in zip(batched, solo):
    for a, b in zip(got, ref):
      assert a.reply_ids == b.reply_ids and _close(a.nll, b.nll, 1e-5)
      assert a.hit_tokens == b.hit_tokens
      np.testing.assert_array_equal(a.kept, b.kept)
  rec.set_policy(pruning)
  free = replay.Turn(4, generate=True, max_tokens=10)
  cut = replay.Turn(4, generate=True, max_tokens=10, until=lambda ids: len(ids) >= 3)
  [full], [short] = replay.replay(eng, rec, [_session("u1", [free]), _session("u2", [cut])])
  assert len(full.reply_ids) > 3 and short.reply_ids == full.reply_ids[:3]
  eng.kv_manager.check()


def test_sessions_sharing_a_system_prompt_wait_for_it_to_be_cached(llm):
  """The first session of a system prompt's group starts alone; the others start once
  it is cached and find it there (all at once, each would prefill it)."""
  pruning = PruningConfig(method="none")
  eng, rec = replay.engine_for(llm, pruning, CACHE, prefill_chunk=64)
  got = replay.replay(eng, rec, [_session(f"g{k}", [replay.Turn(2), replay.Turn(4)])
                                 for k in range(3)])
  assert got[0][0].hit_tokens == 0
  assert all(g[0].hit_tokens >= 20 for g in got[1:])     # the system prompt and more
  eng.kv_manager.check()


def test_a_failed_turn_raises_and_frees_everything(llm):
  pruning = PruningConfig(method="snapkv", budget=64)
  small = CacheConfig(num_pages=512, page_size=16, max_seq_len=128)
  eng, rec = replay.engine_for(llm, pruning, small, prefill_chunk=64)
  with pytest.raises(RuntimeError, match="turn 8"):
    replay.replay(eng, rec, [_session("s", [replay.Turn(8)]),
                             _session("t", [replay.Turn(2)])])
  assert not eng.busy and eng.allocator.sequences() == [] and not rec.kept
  eng.kv_manager.check()
  with pytest.raises(ValueError, match="gold reply"):
    replay.replay(eng, rec, [_session("s", [replay.Turn(len(MESSAGES))])])
  with pytest.raises(ValueError, match="unique"):
    replay.replay(eng, rec, [_session("s", [replay.Turn(2)]), _session("s", [replay.Turn(2)])])
  assert not eng.busy and eng.allocator.sequences() == []


@pytest.mark.slow
def test_pruning_bench_columns_reproduce_through_the_engine(llm):
  """bench/pruning.py's columns from the engine replay equal the batch-1 runner's
  (wall time aside; Delta-NLL within 1e-5); compact still runs on the runner."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
  import pruning as bench_pruning
  sessions = [traces.parse_entry(hf_util.tool_session_entry())]
  rows = {}
  for engine in (True, False):
    run = bench_pruning.Runner(llm, CACHE, batch=2, engine=engine)
    full = run(sessions, PruningConfig(method="none"), "")
    for layout in ("dead_slot", "compact"):
      turns = run(sessions, PruningConfig(method="h2o", budget=60, layout=layout), "")
      rows[engine, layout] = bench_pruning.summarize(turns, full)
    assert (run.engine is not None) == engine
  for layout in ("dead_slot", "compact"):
    a, b = rows[True, layout], rows[False, layout]
    assert a["pruned_share"] > 0
    for k in a:
      if k != "wall_s":
        assert a[k] == pytest.approx(b[k], abs=1e-5, nan_ok=True), (layout, k)


@pytest.mark.parametrize("method", [pytest.param("random", marks=SLOW),
                                    pytest.param("streaming_llm", marks=SLOW),
                                    pytest.param("snapkv", marks=SLOW), "h2o", "intentkv"])
def test_every_dead_slot_method_adopts_its_holes(llm, method):
  """After a pruned turn the next turn is served from the cache up to the end of the
  previous reply, holes included (they stay pruned, nothing is recomputed)."""
  pruning = PruningConfig(method=method, budget=64)
  eng, rec = replay.engine_for(llm, pruning, CACHE, prefill_chunk=64, decode_steps=4)
  (got,) = replay.replay(eng, rec, [_session("s", replay.all_turns(MESSAGES))])
  assert any(t.pruned for t in got[:-1])
  for prev, t in itertools.pairwise(got):
    assert t.hit_tokens == prev.prompt_tokens + prev.reply_tokens, (method, t.turn)
    if prev.pruned:   # the holes came along: fewer live tokens than the prompt before
      assert t.live_before < t.prompt_tokens
