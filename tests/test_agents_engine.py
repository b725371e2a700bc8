"""LRAgent sessions as an engine mechanism (`jaxkv.engine.mechanisms.agents`): each
served scheme gives `AgentRunner.respond`'s greedy tokens and its computed / shared
counts, call by call, in a batch with other rows; regions give way under pool
pressure; a cancelled call leaves the trajectory as it was. Tiny random Llama with
SmolLM2's tokenizer and template, random shared-A role adapters (as test_agents)."""

from __future__ import annotations

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.data import agents
from jaxkv.engine.agents import AgentRunner
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.agents import SERVED, Agents
from jaxkv.policies.sharing import lragent
from mechanism_util import cancel_after_first_step
from test_agents import _lora

STEPS = ("Plan a trip to Lisbon in three steps.", "Now step two, briefly.",
         "Now step three, briefly.", "Summarise the plan.")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_agents_engine"))


def _engine(llm, w, scheme, *, pages=160, batch=4):
  lr = w.rank if scheme in lragent.DECOUPLED else 0
  eng = Engine(llm.model, llm.tokenizer.stop_ids,
               CacheConfig(num_pages=pages, page_size=16, max_seq_len=512),
               EngineConfig(max_batch=batch, prefill_chunk=64, decode_steps=8),
               lora=w, lr_rank=lr)
  mech = eng.add_mechanism(Agents(eng, scheme, names=agents.ROLES, max_tokens=400))
  return eng, mech


def _call(rid, ids, role, session="s", max_tokens=8, **sampling):
  return Request(rid, list(ids), SamplingConfig(max_tokens=max_tokens, **sampling),
                 adapter=role, mechanism="agents", context={"session": session})


def _text(tok, tokens):
  return tok.decode([t for t in tokens if t not in tok.stop_ids])


@pytest.mark.parametrize("scheme", SERVED)
def test_each_call_equals_the_runner(llm, scheme):
  """Roles 0, 1, 0, 2 extend one chat: every reply and its computed / shared prompt
  tokens equal `AgentRunner.respond` on the same trajectory, each call running in a
  batch beside a plain request; a prompt that leaves the trajectory reuses only the
  common prefix."""
  tok = llm.tokenizer
  w = _lora(llm)
  eng, mech = _engine(llm, w, scheme)
  mech.open("s")
  runner = AgentRunner(llm, w, scheme, max_tokens=400, chunk=64)
  runner.start()
  plain = tok.encode_chat([{"role": "user", "content": "Name a colour."}],
                          add_generation_prompt=True)
  chat = []
  for turn, (role, step) in enumerate(zip((0, 1, 0, 2), STEPS)):
    chat.append({"role": "user", "content": step})
    ids = tok.encode_chat(chat, add_generation_prompt=True)
    reply, info = runner.respond(ids, role, 8, tok.stop_ids)
    got = {r.id: r for r in eng.run([_call(f"a{turn}", ids, role),
                                     Request(f"p{turn}", plain, SamplingConfig(max_tokens=6))])}
    res = got[f"a{turn}"]
    assert res.finish_reason in ("stop", "length"), res.error
    assert res.tokens == reply.tolist(), (scheme, turn)
    assert res.extra["shared_tokens"] == info["shared"] == res.cached_tokens
    assert res.extra["computed_tokens"] == info["computed"]
    assert res.extra["role"] == agents.ROLES[role] and res.extra["scheme"] == scheme
    assert mech.held_tokens("s") == runner.held.size == res.extra["trajectory_tokens"]
    chat.append({"role": "assistant", "content": _text(tok, res.tokens)})
  if scheme != "non_shared":              # a later role read what earlier ones wrote
    assert res.extra["shared_tokens"] > 0
  other = tok.encode_chat([{"role": "user", "content": "Something else entirely."}],
                          add_generation_prompt=True)
  reply, info = runner.respond(other, 1, 4, tok.stop_ids)
  res = next(eng.run([_call("back", other, 1, max_tokens=4)]))
  assert res.tokens == reply.tolist() and res.extra["shared_tokens"] == info["shared"]
  assert res.extra["shared_tokens"] < len(other)
  eng.kv_manager.check()
  assert mech.close("s") and eng.allocator.num_live_slots == sum(
      t.num_cached_tokens for t in eng.caches)      # only the plain rows' prefix cache
  eng.kv_manager.check()


def test_roles_of_two_sessions_batch_and_sample(llm):
  """Two sessions' calls, a sampled one among them, run in one batch; each equals its
  run alone (greedy: tokens; sampled with a seed: the same tokens again)."""
  tok = llm.tokenizer
  w = _lora(llm)
  ids = [tok.encode_chat([{"role": "user", "content": s}], add_generation_prompt=True)
         for s in STEPS[:2]]

  def run(reqs):
    eng, mech = _engine(llm, w, "base_lr_shared")
    for s in ("x", "y"):
      mech.open(s)
    out = {r.id: r.tokens for r in eng.run(reqs)}
    eng.kv_manager.check()
    return out

  reqs = [_call("g", ids[0], 1, "x"),
          _call("s", ids[1], 2, "y", temperature=0.8, seed=7)]
  together = run(reqs)
  assert together == {**run(reqs[:1]), **run(reqs[1:])}


def test_idle_regions_give_way_under_pressure(llm):
  """A pool too small for an idle session's trajectory and a new long request: the
  region is released (not the request refused); the session's next call recomputes
  its prompt (shared 0) and still gives the runner's tokens."""
  tok = llm.tokenizer
  w = _lora(llm)
  eng, mech = _engine(llm, w, "full_shared", pages=24, batch=1)
  mech.open("s")
  chat = [{"role": "user", "content": STEPS[0]}]
  ids = tok.encode_chat(chat, add_generation_prompt=True)
  first = next(eng.run([_call("a", ids, 0, max_tokens=8)]))
  assert mech.held_tokens("s") > 0 and eng.allocator.num_live_slots > 0
  long = list(np.resize(tok.encode(" travel plans and more"), 16 * 20))
  big = next(eng.run([Request("big", long, SamplingConfig(max_tokens=4))]))
  assert big.finish_reason == "length", big.error
  assert not mech.sessions["s"].regions                 # given back
  again = next(eng.run([_call("b", ids, 0, max_tokens=8)]))
  assert again.extra["shared_tokens"] == 0 and again.tokens == first.tokens
  eng.kv_manager.check()


def test_cancel_keeps_the_trajectory_and_refusals(llm):
  """A call cancelled mid-decode frees its slots and leaves the region as the last
  finished call set it; a base-model call, a closed session, a trajectory past the cap
  and the schemes a row cannot run are refused with the reason."""
  tok = llm.tokenizer
  w = _lora(llm)
  eng, mech = _engine(llm, w, "non_shared")
  mech.open("s")
  ids = tok.encode_chat([{"role": "user", "content": STEPS[0]}], add_generation_prompt=True)
  next(eng.run([_call("a", ids, 0)]))
  held = {k: r.tokens.copy() for k, r in mech.sessions["s"].regions.items()}
  out = cancel_after_first_step(eng, _call("c", ids, 0, max_tokens=64))
  assert [r.finish_reason for r in out] == ["cancelled"]
  now = mech.sessions["s"].regions
  assert set(now) == set(held) and all(np.array_equal(now[k].tokens, held[k]) for k in held)
  eng.kv_manager.check()
  base = Request("b", ids, SamplingConfig(max_tokens=4), mechanism="agents",
                 context={"session": "s"})
  assert "role adapter" in next(eng.run([base])).error
  assert "not open" in next(eng.run([_call("n", ids, 0, session="nope")])).error
  assert "trajectory cap" in next(eng.run([_call("m", ids, 0, max_tokens=400)])).error
  for bad in ("droidspeak", "base_shared"):
    with pytest.raises(ValueError, match="AgentRunner"):
      Agents(eng, bad)
  with pytest.raises(ValueError, match="decoupled"):
    Agents(eng, "base_lr_shared")                     # this engine runs adapters full
  for i in range(3):
    mech.open(f"o{i}")
  with pytest.raises(ValueError, match="agent_sessions"):
    mech.open("one too many")
