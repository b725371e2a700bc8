"""Role agents whose prompts reuse stored segments (`["agents", "reuse"]`, and with
IntentKV pruning of their trajectory `["agents", "pruned", "reuse"]`): the agents
mechanism lays out the session's trajectory, segment reuse plans the rest of each
prompt with the row's role adapter (`Mechanism.adapter_of`), and stores and splices
only segments of the KV form the roles write, low-rank values included
(`ReuseRunner.prefill_steps(lora=, form=)`).

With reuse a no-op the composition equals the agents alone (forced log-probabilities
within 1e-5, both LoRA modes); an exact-tier splice of another session's segments
(K, V and the low-rank values x A_v s) reproduces computing them; a base-model reuse
request never splices the roles' segments; three mechanisms in one session equal
agents + pruned with reuse off, and with everything on splice, prune and leave the
books clean after a cancel.

Tiny random Llama with SmolLM2's tokenizer and template, random shared-A role adapters
(test_agents), the tool session of test_sessions."""

from __future__ import annotations

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, PruningConfig, ReuseConfig, SamplingConfig
from jaxkv.data import agents
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms import composed
from jaxkv.engine.mechanisms.agents import Agents
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.reuse import ReuseRunner
from mechanism_util import cancel_after_first_step
from test_agents import _lora
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
TURNS = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]   # 2, 4, 6, 8
ROLES = (0, 1, 0, 2)
EXACT = dict(method="tiered", tiers=("exact", "approx"))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_roles_reuse"))


@pytest.fixture(scope="module")
def lora(llm):
  return _lora(llm)


@pytest.fixture(scope="module")
def forced(llm):
  return llm.tokenizer.encode("I will look up the reservation and cancel it now.")


def _engine(llm, lora, reuse=None, pruning=None, scheme="base_lr_shared"):
  """An engine with agents (and pruning with `pruning`, reuse with `reuse`) and their
  composition in list order, sessions "s", "t", "u" open."""
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=64, decode_steps=4), lora=lora,
               lr_rank=lora.rank if scheme == "base_lr_shared" else 0)
  parts = [eng.add_mechanism(Agents(eng, scheme, names=agents.ROLES))]
  if pruning is not None:
    parts.append(eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager,
                                          PruningConfig(**pruning))))
  if reuse is not None:
    runner = ReuseRunner(llm, ReuseConfig(storage="float32", cut_every=2, **reuse),
                         attn_impl="reference", kv=eng.kv_manager)
    parts.append(eng.add_mechanism(Reuse(runner)))
  if len(parts) > 1:
    eng.add_mechanism(composed.Composed(parts))
  for s in ("s", "t", "u"):
    parts[0].open(s)
  return eng


def _prompt(llm, i):
  return llm.tokenizer.encode_chat(MESSAGES[:i], add_generation_prompt=True)


def _call(eng, mechanism, session, prompt, role, forced=None, ctx=None, rid=None):
  req = Request(rid or f"{mechanism}-{session}-{len(prompt)}-{role}", list(prompt),
                SamplingConfig(max_tokens=len(forced) if forced else 8), adapter=role,
                mechanism=mechanism, context={"session": session, **(ctx or {})},
                forced=forced)
  (res,) = list(eng.run([req]))
  assert res.finish_reason in ("stop", "length"), res.error
  return res


@pytest.mark.parametrize("scheme", ["base_lr_shared",
                                    pytest.param("full_shared", marks=pytest.mark.slow)])
def test_with_reuse_a_no_op_it_equals_the_agents_alone(llm, lora, forced, scheme):
  """Reuse "none": the planner's layer passes run the row's role adapter (decoupled or
  full) and give the agents' forced log-probabilities (1e-5), greedy tokens and
  shared / computed counts, turn by turn across roles."""
  solo = _engine(llm, lora, scheme=scheme)
  both = _engine(llm, lora, dict(method="none"), scheme=scheme)
  for i, role in zip(TURNS, ROLES):
    a = _call(solo, "agents", "s", _prompt(llm, i), role, forced)
    c = _call(both, "agents+reuse", "s", _prompt(llm, i), role, forced)
    np.testing.assert_allclose(c.logprob, a.logprob, atol=1e-5, rtol=0)
    assert c.argmax == a.argmax, i
    assert {k: c.extra[k] for k in a.extra} == a.extra, i
    assert c.extra["mechanisms"] == ["agents", "reuse"] and c.extra["reused_tokens"] == 0
  assert c.extra["shared_tokens"] > 0
  both.kv_manager.check()


def test_an_exact_splice_of_role_segments_equals_computing_them(llm, lora, forced):
  """Session t's first call is session s's prompt on the same role: reuse splices s's
  stored runs (exact tier: K, V and the low-rank values) and t's forced
  log-probabilities equal the agents computing the whole prompt (1e-5); the segments
  are of the roles' form, and a base-model reuse request of that prompt splices none."""
  eng = _engine(llm, lora, EXACT)
  store = eng.mechanisms["reuse"].runner.store
  prompt = _prompt(llm, TURNS[1])
  _call(eng, "agents+reuse", "s", prompt, 0)
  segs = [store.peek(k) for k in store.keys()]  # noqa: SIM118 (a SegmentStore)
  assert segs and all(g.fingerprint.adapter.endswith("roles:base_lr_shared") for g in segs)
  assert all(g.vlr is not None and g.vlr.q.shape == (llm.config.num_layers, g.n, lora.rank)
             for g in segs)
  t = _call(eng, "agents+reuse", "t", prompt, 0, forced)
  assert t.extra["reused_tokens"] > len(prompt) // 2 and t.extra["tiers"] == ["exact"]
  ref = _call(_engine(llm, lora), "agents", "t", prompt, 0, forced)
  np.testing.assert_allclose(t.logprob, ref.logprob, atol=1e-5, rtol=0)
  assert t.argmax == ref.argmax
  (base,) = list(eng.run([Request("base", list(prompt), SamplingConfig(max_tokens=4),
                                  mechanism="reuse")]))
  assert base.extra["reused_tokens"] == 0 and base.extra["runs"] == []
  eng.kv_manager.check()


@pytest.mark.slow
def test_three_mechanisms_with_reuse_off_equal_agents_and_pruning(llm, lora):
  """["agents", "pruned", "reuse"] with reuse "none" gives agents + pruned's tokens,
  pruning and sharing counts turn by turn, the budget biting."""
  pruning = dict(method="intentkv", budget=64)
  pair = _engine(llm, lora, pruning=pruning)
  three = _engine(llm, lora, dict(method="none"), pruning)
  bites = 0
  for i, role in zip(TURNS, ROLES):
    prompt, ctx = pair.mechanisms["pruned"].context("s", MESSAGES[:i])
    a = _call(pair, "agents+pruned", "s", prompt, role, ctx=ctx)
    c = _call(three, "agents+pruned+reuse", "s", prompt, role, ctx=ctx)
    assert c.tokens == a.tokens, i
    for k in ("pruned", "kv_live_before", "kv_live_after", "shared_tokens",
              "computed_tokens"):
      assert c.extra[k] == a.extra[k], (i, k)
    assert c.extra["query_memory_cos"] == pytest.approx(a.extra["query_memory_cos"], abs=1e-5)
    bites += a.extra["pruned"]
  assert bites >= 2
  three.kv_manager.check()


def test_three_mechanisms_splice_prune_and_cancel_cleanly(llm, lora):
  """Everything on: session u's roles splice the tool outputs session s's roles stored,
  its scorer's query span is computed, the turn prunes; usage reports each mechanism;
  a cancelled call leaves the trajectory, the store and the pool as they were."""
  eng = _engine(llm, lora, dict(method="naive"), dict(method="intentkv", budget=96))
  pr, ag = eng.mechanisms["pruned"], eng.mechanisms["agents"]
  store = eng.mechanisms["reuse"].runner.store
  for i, role in zip(TURNS[:2], ROLES):
    prompt, ctx = pr.context("s", MESSAGES[:i])
    _call(eng, "agents+pruned+reuse", "s", prompt, role, ctx=ctx)
  prompt, ctx = pr.context("u", MESSAGES[:TURNS[2]])
  u = _call(eng, "agents+pruned+reuse", "u", prompt, 1, ctx=ctx)
  assert u.extra["mechanisms"] == ["agents", "pruned", "reuse"]
  assert u.extra["reused_tokens"] > 0 and u.extra["pruned"] and u.extra["role"] == "action"
  assert all(r["at"] + r["n"] <= ctx["qs"] for r in u.extra["runs"])
  before = (ag.sessions["u"].regions[0].tokens.copy(), pr.state.seen["u"], len(store))
  prompt, ctx = pr.context("u", MESSAGES)
  res = cancel_after_first_step(eng, Request("c", prompt, SamplingConfig(max_tokens=32),
                                             adapter=2, mechanism="agents+pruned+reuse",
                                             context=ctx))
  assert [r.finish_reason for r in res] == ["cancelled"]
  assert np.array_equal(ag.sessions["u"].regions[0].tokens, before[0])
  assert (pr.state.seen["u"], len(store)) == before[1:]
  eng.kv_manager.check()
  for s in ("s", "t", "u"):
    ag.close(s)
  assert eng.allocator.sequences() == [] and pr.tree.locked_tokens == 0
  eng.kv_manager.check()
