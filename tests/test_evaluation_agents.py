"""LRAgent trajectories teacher-forced through the engine
(`jaxkv.evaluation.agents.serve_trajectories`) equal the batch-1 runner's evaluation
(`AgentRunner.run`), call by call, under each scheme the engine serves: per-token
log-probabilities of the gold tokens within 1e-5 (the engine prefills the gold
continuation, the runner decodes it), the same greedy tokens and the same prompt
tokens computed (what the session's region let the call read). Three trajectories,
two in flight at once (the third starts when one ends), so calls of different
sessions share engine steps. The pool's books are clean and every session closed
after. Tiny random Llama with SmolLM2's tokenizer and template, role adapters drawn
fresh each run (as tests/test_agents_engine.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import hf_util
from jaxkv.data import agents
from jaxkv.engine.agents import AgentRunner
from jaxkv.engine.mechanisms.agents import SERVED
from jaxkv.evaluation import agents as ev
from test_agents import _lora
from test_lora_train import _session

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
