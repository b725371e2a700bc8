"""A pruned session whose prompts reuse stored segments (`["pruned", "reuse"]`,
`jaxkv.engine.mechanisms.composed`): pruning lays out the session's KV (its radix
path, holes and all), segment reuse plans the prompt up to the part the scorer reads.

With reuse a no-op the composition equals pruning alone turn by turn (for each scorer:
IntentKV's query span, SnapKV's window, H2O's new tokens); with pruning a no-op it
equals reuse alone request by request; with both on, a session whose history carries
another session's tool output splices it, prunes, keeps the spliced KV private to
itself and adopts it whole on its next turn; a cancelled turn leaves the books clean.

A random 6-layer model with SmolLM2's real tokenizer and chat template (as
tests/test_mechanism_reuse.py), the tool session of tests/test_sessions.py."""

from __future__ import annotations

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, PruningConfig, ReuseConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms import Mechanism, composed
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.kv.state import SENTINEL
from mechanism_util import cancel_after_first_step, clip, recording
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
TURNS = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]   # 2, 4, 6, 8
MAX = 8
PAIR = "pruned+reuse"
# session b: another user's opening, then the same tool calls and outputs as MESSAGES
OTHER = [MESSAGES[0], {"role": "user", "content": "Hello, this is mia_li_3668 again: "
                                                  "please drop the reservation to Boston."},
         *MESSAGES[2:]]
TIERED = dict(method="tiered", tiers=("exact", "approx"))


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


class _Reuse(recording(Reuse)):
  """Keeps the first-token logits of composed rows too (`plan_prefill`)."""

  def plan_prefill(self, row, tail_from, reuse_from=0, adapter=None):
    logits, queries = yield from super().plan_prefill(row, tail_from, reuse_from, adapter)
    self.logits[row.req.id] = logits
    return logits, queries


def _engine(llm, pruning: dict, reuse: dict, max_batch: int = 4):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=64, decode_steps=4))
  pr = eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager,
                                PruningConfig(**pruning)))
  runner = ReuseRunner(llm, ReuseConfig(storage="float32", cut_every=2, **reuse),
                       attn_impl="reference", kv=eng.kv_manager)
  ru = eng.add_mechanism(_Reuse(runner))
  eng.add_mechanism(composed.Composed([pr, ru]))
  return eng


def _turn(eng, session, messages, mechanism, rid=None):
  prompt, ctx = eng.mechanisms["pruned"].context(session, messages)
  req = Request(rid or f"{mechanism}-{session}-{len(messages)}", prompt,
                SamplingConfig(max_tokens=MAX), mechanism=mechanism, context=ctx)
  (res,) = list(eng.run([req]))
  assert res.finish_reason in ("stop", "length"), res.error
  return res, prompt, ctx


@pytest.mark.parametrize("method", ["intentkv", pytest.param("snapkv", marks=pytest.mark.slow),
                                    pytest.param("h2o", marks=pytest.mark.slow)])
def test_with_reuse_a_no_op_it_equals_pruning_alone(llm, method):
  """Reuse off: the composed turns give pruning's tokens, prefix hits, kept entries
  and QueryMemory cosine, turn by turn, with the scorer's queries from the tail the
  planner leaves to it; the budget bites."""
  pruning = dict(method=method, budget=96, snap_window=16)
  solo, both = _engine(llm, pruning, dict(method="none")), _engine(llm, pruning,
                                                                     dict(method="none"))
  bites = 0
  for i in TURNS:
    (p, *_), (c, *_) = _turn(solo, "s", MESSAGES[:i], "pruned"), _turn(both, "s", MESSAGES[:i],
                                                                        PAIR)
    assert c.tokens == p.tokens, (method, i)
    assert c.cached_tokens == p.cached_tokens, (method, i)
    for k in ("pruned", "kv_live_before", "kv_live_after"):
      assert c.extra[k] == p.extra[k], (method, i, k)
    if method == "intentkv":
      assert c.extra["query_memory_cos"] == pytest.approx(p.extra["query_memory_cos"],
                                                          abs=1e-5)
    assert c.extra["mechanisms"] == ["pruned", "reuse"] and c.extra["reused_tokens"] == 0
    bites += p.extra["pruned"]
  assert bites >= 2
  both.kv_manager.check()


@pytest.mark.slow
def test_with_pruning_a_no_op_it_equals_reuse_alone(llm):
  """Pruning off: each session's turn gives reuse's tokens, first-token logits (1e-5),
  prefix hits, tiers and reused tokens; the sessions after the first splice the tool
  outputs the first stored."""
  both = _engine(llm, dict(method="none"), TIERED)
  solo = _engine(llm, dict(method="none"), TIERED)
  stop = set(llm.tokenizer.stop_ids)
  reused = 0
  for s, msgs in (("a", MESSAGES[:6]), ("b", OTHER[:6]), ("c", OTHER[:8])):
    c, prompt, _ = _turn(both, s, msgs, PAIR)
    (r,) = list(solo.run([Request(f"reuse-{s}", prompt, SamplingConfig(max_tokens=MAX),
                                  mechanism="reuse")]))
    assert c.tokens == clip(r.tokens, stop), s
    np.testing.assert_allclose(both.mechanisms["reuse"].logits[f"{PAIR}-{s}-{len(msgs)}"],
                               solo.mechanisms["reuse"].logits[f"reuse-{s}"], atol=1e-5, rtol=0)
    assert c.cached_tokens == r.cached_tokens, s
    for k in ("tiers", "reused_tokens", "prefill_tokens", "runs"):
      assert c.extra[k] == r.extra[k], (s, k)
    reused += c.extra["reused_tokens"]
  assert reused > 0
  both.kv_manager.check()


def test_both_on_the_spliced_kv_stays_private_to_its_session(llm):
  """A budget that bites, naive splicing: session b's history carries session a's tool
  outputs, spliced before the scorer's query span and pruned with the rest; b's radix
  path is private from its first spliced token (another request with b's very prompt
  stops there), b's next turn adopts its whole path (holes and spliced KV), and a
  turn cancelled mid-prefill leaves the pool, the trees and the session as they were."""
  eng = _engine(llm, dict(method="intentkv", budget=96), dict(method="naive"))
  pr, store = eng.mechanisms["pruned"], eng.mechanisms["reuse"].runner.store
  for i in TURNS[:2]:
    _turn(eng, "a", MESSAGES[:i], PAIR)
  assert pr.state.paths["a"][1].any()               # a's path has holes: what a computes
  keys = set(store.keys())                # the segments a stores after them attended to
  _turn(eng, "a", MESSAGES[:TURNS[2]], PAIR)
  new = [store.peek(k) for k in store.keys() if k not in keys]  # noqa: SIM118 (a pruned cache)
  assert new and not any(seg.exact for seg in new)
  b, prompt, ctx = _turn(eng, "b", OTHER[:TURNS[2]], PAIR)
  assert b.extra["reused_tokens"] > 0 and b.extra["pruned"]
  assert all(r["at"] + r["n"] <= ctx["qs"] for r in b.extra["runs"])   # the span: computed
  toks, holes, private = pr.state.paths["b"]
  first = min(r["at"] for r in b.extra["runs"] if r["tier"] != "reject")
  assert private == first and holes.any()
  assert pr.tree.match_prefix(prompt).n_matched <= private             # no one else's
  assert pr.tree.match_prefix(toks, holes=holes, private_from=private).n_matched == toks.size
  eng.kv_manager.check()
  nxt, _, _ = _turn(eng, "b", OTHER[:TURNS[3]], PAIR)
  assert nxt.cached_tokens >= len(prompt)
  assert pr.state.paths["b"][2] == private                              # still private there
  before = (pr.state.paths["b"][0].copy(), pr.state.seen["b"], len(eng.mechanisms["reuse"]
                                                                   .runner.store))
  prompt, ctx = pr.context("b", OTHER)
  res = cancel_after_first_step(eng, Request("cancelled", prompt, SamplingConfig(max_tokens=64),
                                             mechanism=PAIR, context=ctx))
  assert [r.finish_reason for r in res] == ["cancelled"]
  assert np.array_equal(pr.state.paths["b"][0], before[0]) and pr.state.seen["b"] == before[1]
  assert len(eng.mechanisms["reuse"].runner.store) == before[2]
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and pr.tree.locked_tokens == 0
  slots = pr.tree.match_prefix(toks, holes=holes, private_from=private).slots
  assert (slots == SENTINEL).sum() == holes[:slots.size].sum()


def test_the_shared_system_prompt_is_not_spliced_and_stays_shared(llm):
  """Session b's system prompt holds text session a's stored (another system prompt
  before it): reuse does not splice it there, so b's path stays exact and session c,
  opening with b's system prompt, adopts all of it (spliced KV there would make b's
  path private from that text, and c would compute its system prompt again)."""
  eng = _engine(llm, dict(method="intentkv", budget=4096), dict(method="naive"))
  text = MESSAGES[3]["content"]
  chats = {"a": ("You are a travel agent. Use the tools.\n" + text, "Cancel my Boston trip."),
           "b": ("You are an airline assistant for Hawaii. Be brief.\n" + text, "Hi there."),
           "c": ("You are an airline assistant for Hawaii. Be brief.\n" + text, "Hello!")}
  got = {}
  for s, (system, user) in chats.items():
    got[s] = _turn(eng, s, [{"role": "system", "content": system},
                            {"role": "user", "content": user}], PAIR)
  (b, _, bctx), (c, _, cctx) = got["b"], got["c"]
  assert all(r["at"] >= bctx["sys_len"] for r in b.extra["runs"])
  assert eng.mechanisms["pruned"].state.paths["b"][2] is None           # nothing private
  assert c.cached_tokens >= cctx["sys_len"]
  eng.kv_manager.check()


def test_what_does_not_combine_with_a_planner_is_refused(llm):
  eng = _engine(llm, dict(method="intentkv", budget=96), TIERED)
  pr, ru = eng.mechanisms["pruned"], eng.mechanisms["reuse"]
  assert composed.check([pr, ru]) == (pr, ru)       # pruning lays out, reuse plans

  class Roles(Mechanism):      # a layout on role adapters that does not name the row's
    name, adapters = "agents", True                   # adapter to a planner

    def match(self, req):
      return super().match(req)

  class Planner(Reuse):                             # a second planner
    name = "reuse2"

  for parts, why in (([Roles(), ru], "role adapters"), ([pr, ru, Planner(ru.runner)],
                                                       "at most one")):
    with pytest.raises(ValueError, match=why):
      composed.Composed(parts)
