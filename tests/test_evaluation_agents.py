"""LRAgent trajectories teacher-forced through the engine
(`jaxkv.evaluation.agents.serve_trajectories`) equal the batch-1 runner's evaluation
(`AgentRunner.run`), call by call, under each scheme the engine serves: per-token
log-probabilities of the gold tokens within 1e-5 (the engine prefills the gold
continuation, the runner decodes it), the same greedy tokens and the same prompt
tokens computed (what the session's region let the call read). Three trajectories,
two in flight at once (the third starts when one ends), so calls of different
sessions share engine steps. The pool's books are clean and every session closed
after. Tiny random Llama with SmolLM2's tokenizer and template, role adapters drawn
fresh each run (as tests/test_agents_engine.py). The hooks a composition with MemArt
runs through (a recall before a trajectory's first call, a region in every call's
prompt: bench/composed.py) keep that equality against the region's text."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np
import pytest

import hf_util
from jaxkv.data import agents
from jaxkv.engine.agents import AgentRunner
from jaxkv.engine.mechanisms import memart_region as region
from jaxkv.engine.mechanisms.agents import SERVED
from jaxkv.evaluation import agents as ev
from test_agents import _lora
from test_lora_train import _session

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import composed as composed_bench

ANSWERS = ("Done: NO6JO3 is cancelled.", "All set, the Boston trip is off.",
           "Cancelled NO6JO3; your refund takes five days.")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_evaluation_agents"))


@pytest.mark.parametrize("scheme", [s if s == "base_lr_shared" else
                                    pytest.param(s, marks=pytest.mark.slow) for s in SERVED])
def test_batched_trajectories_equal_the_runner(llm, scheme):
  trajs = [agents.build(_session(f"s{i}", a), llm.tokenizer) for i, a in enumerate(ANSWERS)]
  w = _lora(llm, seed=int(np.random.default_rng().integers(1 << 20)))
  refs = [AgentRunner(llm, w, scheme, max_tokens=256, chunk=64).run(t) for t in trajs]
  eng, mech = ev.engine(llm, w, scheme, max_tokens=256, max_batch=2, prefill_chunk=64)
  calls = []
  served = list(ev.serve_trajectories(eng, mech, trajs, max_batch=2, progress=calls.append))
  assert sorted(s.index for s in served) == [0, 1, 2]
  assert len(calls) == sum(len(t.calls) for t in trajs)
  for s in served:
    traj, ref = trajs[s.index], refs[s.index]
    assert len(s.calls) == len(traj.calls)
    for c, got, want in zip(traj.calls, s.calls, ref.calls):
      np.testing.assert_allclose(got.logprob, want.logprob, atol=1e-5, rtol=0)
      assert got.argmax == want.argmax.tolist(), (traj.session, c)
      assert got.extra["computed_tokens"] == want.computed, (traj.session, c)
    # what the session held at its end: the trajectory up to its last fed token, once
    # per role that ran under non_shared, once otherwise
    last = traj.calls[-1].end - 1
    held = ([max(c.end - 1 for c in traj.calls if c.role == r) for r in {c.role for c in
             traj.calls}] if scheme == "non_shared" else [last])
    assert s.live_slots == sum(held)
  assert not mech.sessions
  eng.kv_manager.check()


def test_bad_trajectories_are_refused(llm):
  eng, mech = ev.engine(llm, _lora(llm), "full_shared", max_tokens=256, max_batch=2)
  t = agents.build(_session(), llm.tokenizer)
  with pytest.raises(ValueError, match="share a session"):
    list(ev.serve_trajectories(eng, mech, [t, t]))
  with pytest.raises(ValueError, match="context before it"):
    list(ev.serve_trajectories(eng, mech, [dataclasses.replace(t, calls=[])]))
  with pytest.raises(ValueError, match="AgentRunner"):
    ev.engine(llm, _lora(llm), "droidspeak", max_tokens=256)


def test_a_composed_memart_session_reads_its_region_as_prompt_text(llm):
  """bench/composed.py's agents + memart through the `before` / `prepare` hooks: each
  trajectory's session first recalls (the previous trajectory of its domain written as
  its closed conversation), then every call's prompt carries the retrieved blocks at the
  first user message. Nothing precedes the region in a new trajectory's cache, so the
  first call computes it (a region is copied only behind a cached prefix) and later
  calls adopt it: every call equals agents alone on the trajectory with the region's
  tokens in its text (log-probabilities within 1e-5, the same greedy tokens). Memory
  sessions are gone at the end and the pool's books are clean."""
  sessions = [dataclasses.replace(_session(f"s{i}", a), task=f"travel/{i}")
              for i, a in enumerate(ANSWERS)]
  trajs = [agents.build(s, llm.tokenizer) for s in sessions]
  w = _lora(llm, seed=int(np.random.default_rng().integers(1 << 20)))
  eng, ag, mech, ma = composed_bench.make_engine(llm, w, "agents+memart", 0, 256, 2)
  assert mech == "agents+memart"
  ctxs = [[{} for _ in traj.calls] for traj in trajs]
  mem = composed_bench.Opening(ma, mech, False, sessions, trajs, ctxs, llm.tokenizer)
  assert [mem.prev[t] for t in range(3)] == [2, 0, 1]
  served = {}
  for s in ev.serve_trajectories(eng, ag, trajs, mechanism=mech, max_batch=2,
                                 before=mem.before, prepare=mem.prepare):
    served[s.index] = s
    mem.close(s.index)
  assert not ma.sessions.sessions and not ma.conversations
  eng.kv_manager.check()
  # the reference: agents alone on each trajectory with its region written in
  inserted = []
  for t, traj in enumerate(trajs):
    assert len(served[t].before) == 1                 # the recall alone
    ids = np.asarray(mem.recall(served[t].before)["ids"], np.int32)
    assert ids.size, traj.session                     # something was retrieved
    msgs, tools = mem.opening[t]
    at = region.head_length(llm.tokenizer, msgs, tools, traj.ids)
    assert served[t].calls[0].extra["memory_region_tokens"] == ids.size
    n = ids.size
    inserted.append(dataclasses.replace(
        traj, ids=np.concatenate([traj.ids[:at], ids, traj.ids[at:]]),
        calls=[dataclasses.replace(c, start=c.start + n, end=c.end + n) for c in traj.calls]))
  eng2, ag2 = ev.engine(llm, w, "base_lr_shared", max_tokens=256 + 512, max_batch=2)
  for s in ev.serve_trajectories(eng2, ag2, inserted, max_batch=2):
    for got, want in zip(served[s.index].calls, s.calls):
      np.testing.assert_allclose(got.logprob, want.logprob, atol=1e-5, rtol=0)
      assert got.argmax == want.argmax


def test_a_continued_session_adopts_its_earlier_conversation(llm):
  """bench/composed.py's ".../cont" methods: the session first runs its earlier
  conversation (the previous trajectory of its domain), so the first call adopts the
  system prompt and template head they share and prefills only the rest, with the
  same log-probabilities (within 1e-5) and greedy tokens as a fresh session; with
  MemArt the region then sits behind that cached head and is copied from memory,
  every token of it, so the first call computes only what follows the region. (The
  three sessions open alike: without MemArt the common prefix runs into the user's
  first message.)"""
  sessions = [dataclasses.replace(_session(f"s{i}", a), task=f"travel/{i}")
              for i, a in enumerate(ANSWERS)]
  trajs = [agents.build(s, llm.tokenizer) for s in sessions]
  ctxs = [[{} for _ in traj.calls] for traj in trajs]
  w = _lora(llm, seed=int(np.random.default_rng().integers(1 << 20)))
  eng, ag = ev.engine(llm, w, "base_lr_shared", max_tokens=256, max_batch=2)
  fresh = {s.index: s for s in ev.serve_trajectories(eng, ag, trajs, max_batch=2)}
  for method in ("agents/cont", "agents+memart/cont"):
    eng, ag, mech, ma = composed_bench.make_engine(llm, w, method, 0, 256, 2)
    op = composed_bench.Opening(ma, mech, True, sessions, trajs, ctxs, llm.tokenizer)
    for s in ev.serve_trajectories(eng, ag, trajs, mechanism=mech, max_batch=2,
                                   before=op.before, prepare=op.prepare):
      traj, first = trajs[s.index], s.calls[0].extra
      assert len(s.before) == (1 if ma is None else 2), method     # + the recall
      msgs, tools = op.opening[s.index]
      at = region.head_length(llm.tokenizer, msgs, tools, traj.ids)
      start = traj.calls[0].start
      if ma is None:                   # the earlier conversation's common prefix adopted
        prev = trajs[op.prev[s.index]].ids
        same = next((i for i in range(min(prev.size, start)) if prev[i] != traj.ids[i]), start)
        assert first["computed_tokens"] == start - min(same, start - 1), (method, first)
      else:                            # the head adopted, the region copied
        assert first["computed_tokens"] == start - at, (method, first)
      if ma is None:
        for got, want in zip(s.calls, fresh[s.index].calls):
          np.testing.assert_allclose(got.logprob, want.logprob, atol=1e-5, rtol=0)
          assert got.argmax == want.argmax
      else:
        assert first["memory_spliced_tokens"] == first["memory_region_tokens"] > 0, first
      op.close(s.index)
    eng.kv_manager.check()


def test_memart_methods_pair_with_themselves_without_memart():
  """bench/composed.py's pairing: a MemArt method's reference drops MemArt and its own
  variant (random blocks), keeps the session's (continued); its chance line is itself
  with random blocks."""
  w = composed_bench.without
  assert w("agents+memart", "memart") == "agents"
  assert w("agents+memart/cont", "memart") == "agents/cont"
  assert w("agents+memart/cont-random", "memart") == "agents/cont"
  assert w("agents+pruned+memart+reuse/cont", "memart") == "agents+pruned+reuse/cont"
  assert w("agents+pruned+memart+reuse/cont", "reuse") == "agents+pruned+memart/cont"
  assert w("agents/cont", "memart") == "agents/cont"
  assert composed_bench._random_of("agents+memart/cont") == "agents+memart/cont-random"
  assert composed_bench._random_of("agents+memart") == "agents+memart/random"
