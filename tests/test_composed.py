"""Mechanisms composed on one row (`jaxkv.engine.mechanisms.composed`): role agents
sharing one trajectory whose KV IntentKV prunes. With either mechanism made a no-op
the composition equals the other alone, turn by turn; with both on, pruning shows in
the trajectory every role reads; what cannot combine is refused with the reason.

Tiny random Llama with SmolLM2's tokenizer and template, random shared-A role
adapters, the pruned-session turns of test_sessions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, PruningConfig, SamplingConfig
from jaxkv.data import agents
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms import Mechanism, composed
from jaxkv.engine.mechanisms.agents import Agents
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.kv.state import SENTINEL
from jaxkv.models import lora as lora_lib
from mechanism_util import cancel_after_first_step
from test_agents import _lora
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=256, page_size=16, max_seq_len=2048)
TURNS = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]   # 2, 4, 6, 8
ROLES = (0, 1, 0, 2)
MAX = 12
PAIR = "agents+pruned"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_composed"))


def _engine(llm, lora, budget, scheme="base_lr_shared"):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=64, decode_steps=4), lora=lora,
               lr_rank=lora.rank if scheme == "base_lr_shared" else 0)
  ag = eng.add_mechanism(Agents(eng, scheme, names=agents.ROLES))
  pr = eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager,
                                PruningConfig(method="intentkv", budget=budget)))
  eng.add_mechanism(composed.Composed([ag, pr]))
  ag.open("s")
  return eng


def _turn(eng, i, mechanism, role=-1):
  prompt, ctx = eng.mechanisms["pruned"].context("s", MESSAGES[:i])
  req = Request(f"{mechanism}-{i}", prompt, SamplingConfig(max_tokens=MAX), adapter=role,
                mechanism=mechanism, context=ctx)
  (res,) = list(eng.run([req]))
  assert res.finish_reason in ("stop", "length"), res.error
  return res


def _zero_b(w):
  """Adapters whose B is zero: every role is the base model."""
  return lora_lib.LoraWeights(a=w.a, b={t: jnp.zeros_like(b) for t, b in w.b.items()},
                              scale=w.scale)


def test_with_pruning_a_no_op_it_equals_the_agents_alone(llm):
  """Budget above every turn: the composed turns give the agents mechanism's tokens,
  computed / shared counts and trajectory, and report no pruning."""
  w = _lora(llm)
  solo, both = _engine(llm, w, 4096), _engine(llm, w, 4096)
  for i, role in zip(TURNS, ROLES):
    a, c = _turn(solo, i, "agents", role), _turn(both, i, PAIR, role)
    assert c.tokens == a.tokens, i
    assert {k: c.extra[k] for k in a.extra} == a.extra, i
    assert c.extra["mechanisms"] == ["agents", "pruned"] and not c.extra["pruned"]
  assert c.extra["shared_tokens"] > 0
  for eng in (solo, both):
    eng.kv_manager.check()


def test_with_the_agents_a_no_op_it_equals_pruning_alone(llm):
  """Role adapters with B = 0 (the base model): the composed turns give the pruned
  mechanism's tokens, prefix hits, kept entries and QueryMemory cosine on the base
  model, turn by turn, and the budget bites."""
  w = _zero_b(_lora(llm))
  solo, both = _engine(llm, w, 64), _engine(llm, w, 64)
  pruned = 0
  for i, role in zip(TURNS, ROLES):
    p, c = _turn(solo, i, "pruned"), _turn(both, i, PAIR, role)
    assert c.tokens == p.tokens, i
    assert c.cached_tokens == p.cached_tokens, i
    for k in ("pruned", "kv_live_before", "kv_live_after"):
      assert c.extra[k] == p.extra[k], (i, k)
    assert c.extra["query_memory_cos"] == pytest.approx(p.extra["query_memory_cos"], abs=1e-5)
    pruned += p.extra["pruned"]
  assert pruned >= 2
  both.kv_manager.check()


def test_both_on_the_roles_read_the_pruned_trajectory(llm):
  """Distinct roles, a budget that bites: the trajectory every role reads keeps the
  holes of the turns before (dead slots in the region), QueryMemory advances across
  roles, and a cancelled turn leaves region and memory as they were."""
  eng = _engine(llm, _lora(llm), 64)
  ag, pr = eng.mechanisms["agents"], eng.mechanisms["pruned"]
  out = [_turn(eng, i, PAIR, role) for i, role in zip(TURNS[:3], ROLES)]
  assert any(r.extra["pruned"] for r in out[:2])
  region = ag.sessions["s"].regions[0]
  smap = eng.allocator.slot_map(region.seq)
  assert (smap == SENTINEL).any() and (smap != SENTINEL).sum() < smap.size
  assert out[2].extra["shared_tokens"] > 0 and out[2].extra["role"] == agents.ROLES[0]
  assert len(pr.state.seen) == 1
  before = (region.tokens.copy(), pr.state.seen["s"])
  prompt, ctx = pr.context("s", MESSAGES[:TURNS[3]])
  res = cancel_after_first_step(eng, Request("c", prompt, SamplingConfig(max_tokens=64),
                                             adapter=2, mechanism=PAIR, context=ctx))
  assert [r.finish_reason for r in res] == ["cancelled"]
  now = ag.sessions["s"].regions[0]
  assert np.array_equal(now.tokens, before[0]) and pr.state.seen["s"] == before[1]
  eng.kv_manager.check()
  assert ag.close("s")
  assert eng.allocator.sequences() == [] and pr.tree.locked_tokens == 0
  eng.kv_manager.check()


def test_what_does_not_combine_is_refused_with_the_reason(llm):
  eng = _engine(llm, _lora(llm), 64)
  ag, pr = eng.mechanisms["agents"], eng.mechanisms["pruned"]

  class Planner(Mechanism):                   # a mechanism that plans its own prefill
    name, owns_prefill = "memart", True

  for parts, why in (([ag], "two or more"), ([ag, ag], "two or more"),
                     ([ag, Planner()], "plans its own prefill"),
                     ([pr, Planner()], "in a sequence of its own")):
    with pytest.raises(ValueError, match=why):
      composed.Composed(parts)
  other = Agents.__new__(Agents)
  other.name, other.adapters = "agents2", True
  with pytest.raises(ValueError, match="each lay out"):
    composed.check([ag, other])
  assert composed.check([pr, ag]) == (ag, None)         # agents lays out, pruning joins
