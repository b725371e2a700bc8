"""Agent sessions with pruning and the radix cache, on a tiny random Llama that
uses SmolLM2's real tokenizer and chat template.

- exact-mode reuse: radix prefix hits reproduce the no-reuse NLLs;
- IntentKV appendix E: prefix hits survive dead-slot eviction and are lost
  under the compact layout; pruned tokens stay pruned in the next turn;
- the budget and the forced set are honoured; pool slots never leak.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, PruningConfig
from jaxkv.engine.sessions import SessionRunner
from jaxkv.kv.state import SENTINEL

CACHE = CacheConfig(num_pages=512, page_size=4, max_seq_len=2048)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_sessions"))


def _call(name, **args):
  """An assistant tool call in ToolBench's ReAct form (SmolLM2's template does not
  render structured `tool_calls`; `traces.session_chat` picks this form for it)."""
  return {"role": "assistant",
          "content": (f"Thought: I will call {name}.\nAction: {name}\n"
                      f"Action Input: {json.dumps(args)}")}


MESSAGES = [
    {"role": "system", "content": "You are a travel agent. Use the tools."},
    {"role": "user", "content": "I am mia_li_3668; cancel my Boston trip."},
    _call("get_user_details", user_id="mia_li_3668"),
    {"role": "tool", "name": "get_user_details",
     "content": "reservations: NO6JO3 (BOS), AIXC01 (LAX), HKEG34 (SEA). " * 4},
    _call("get_reservation_details", reservation_id="NO6JO3"),
    {"role": "tool", "name": "get_reservation_details",
     "content": "NO6JO3: JFK to BOS, flight HAT136, basic economy, 2 passengers. " * 3},
    _call("cancel_reservation", reservation_id="NO6JO3"),
    {"role": "tool", "name": "cancel_reservation", "content": "status: cancelled"},
    {"role": "assistant", "content": "Done: NO6JO3 is cancelled."},
]


def _run(llm, radix=True, **pruning):
  runner = SessionRunner(llm, PruningConfig(**pruning), cache=CACHE, radix=radix,
                         prefill_chunk=64)
  return runner, runner.run_session("s", MESSAGES)


def test_exact_reuse_reproduces_no_reuse(llm):
  _, cold = _run(llm, radix=False)
  runner, warm = _run(llm, radix=True)
  assert [t.hit_tokens for t in cold] == [0] * 4
  assert all(t.hit_tokens > 0 for t in warm[1:])
  # turn i+1 reuses everything turn i computed (prompt + reply), minus nothing
  for a, b in itertools.pairwise(warm):
    assert b.hit_tokens == a.prompt_tokens + a.reply_tokens
  np.testing.assert_allclose([t.nll for t in warm], [t.nll for t in cold], atol=1e-4)
  assert runner.alloc.num_live_slots == runner.radix.num_cached_tokens  # only the cache holds
  runner.alloc.check()
  runner.radix.check()


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv", "h2o", "intentkv"])
def test_dead_slot_keeps_prefix_hits_and_compact_loses_them(llm, method):
  _, dead = _run(llm, method=method, layout="dead_slot", budget=80)
  _, comp = _run(llm, method=method, layout="compact", budget=80)
  assert any(t.pruned for t in dead[:-1])
  for a, b in itertools.pairwise(dead):        # dead-slot: every turn hits the whole previous turn
    assert b.hit_tokens == a.prompt_tokens + a.reply_tokens
  for a, b in itertools.pairwise(comp):        # compact: a pruned turn is not reusable
    if a.pruned:
      assert b.hit_tokens < a.prompt_tokens
  assert sum(t.hit_tokens for t in dead) > sum(t.hit_tokens for t in comp)


def test_budget_forced_set_and_persistent_holes(llm):
  budget = 80
  runner = SessionRunner(llm, PruningConfig(method="intentkv", budget=budget), cache=CACHE,
                         prefill_chunk=64)
  first = runner.run_turn("s", MESSAGES, None, 2)
  p = runner.prepare(MESSAGES, None, 6)       # skip a turn: the new part holds history
  second = runner.run_turn("s", MESSAGES, None, 6)
  forced = p["sys_len"] + (second.prompt_tokens - p["qs"])
  assert first.live_after == first.live_before or first.live_after <= max(budget, forced)
  assert second.pruned and second.live_after == max(budget, forced)
  # Every position pruned in turn 2 -- in its new part and inside the prefix it adopted
  # from turn 1 -- comes back from the radix cache as a SENTINEL hole when the session
  # names its holes, so it stays pruned in the next turn; a request naming no holes
  # matches only the live path.
  ids = np.asarray(p["ids"] + p["gold"])
  tokens, path_holes = runner.paths["s"]
  np.testing.assert_array_equal(tokens, ids)
  match = runner.radix.match_prefix(ids, holes=path_holes)
  assert match.n_matched == ids.size
  holes = np.asarray(match.slots) == SENTINEL
  np.testing.assert_array_equal(holes[:second.prompt_tokens], ~second.kept)
  assert holes[second.hit_tokens:second.prompt_tokens].any()
  assert not holes[second.prompt_tokens:].any()
  assert runner.radix.match_prefix(ids).n_matched <= int(np.argmax(holes))
  runner.alloc.check()
  runner.radix.check()


@pytest.mark.parametrize("layout", ["dead_slot", "compact"])
def test_history_budget_counts_only_the_history(llm, layout):
  """budget_scope="history": C history tokens on top of the system prompt and the
  query, the same kept set as the prompt-scope budget C + |forced|."""
  k = 12
  runner = SessionRunner(llm, PruningConfig(method="intentkv", budget=k, layout=layout,
                                            budget_scope="history"), cache=CACHE,
                         prefill_chunk=64)
  p = runner.prepare(MESSAGES, None, 6)
  got = runner.run_turn("s", MESSAGES, None, 6)
  forced = p["sys_len"] + (got.prompt_tokens - p["qs"])
  assert got.pruned and got.live_after == forced + k < got.live_before
  same = SessionRunner(llm, PruningConfig(method="intentkv", budget=forced + k, layout=layout),
                       cache=CACHE, prefill_chunk=64).run_turn("s", MESSAGES, None, 6)
  np.testing.assert_array_equal(got.kept, same.kept)
  history = p["qs"] - p["sys_len"]
  wide = SessionRunner(llm, PruningConfig(method="intentkv", budget=history, layout=layout,
                                          budget_scope="history"), cache=CACHE,
                       prefill_chunk=64).run_turn("s", MESSAGES, None, 6)
  assert not wide.pruned                     # no more history than C: nothing to prune
  with pytest.raises(ValueError, match="budget_scope"):
    PruningConfig(budget_scope="tokens")


@pytest.mark.parametrize("seed", [0, 1])
def test_holes_persist_across_turns_with_random_budgets(llm, seed):
  """Two interleaved sessions, a random budget per turn: a position pruned in any turn
  stays pruned in every later turn of its session (also inside adopted prefixes), the
  allocator and radix audits pass after every turn, and the pool ends with only the
  cache's slots live."""
  rng = np.random.default_rng(seed)
  other = [dict(m) for m in MESSAGES]
  other[1] = {"role": "user", "content": "I am omar_rossi_1241; cancel my Boston trip."}
  runner = SessionRunner(llm, PruningConfig(method="intentkv", budget=60), cache=CACHE,
                         prefill_chunk=64)
  pruned = {"a": None, "b": None}
  turns = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]
  for i in turns:
    for sid, msgs in (("a", MESSAGES), ("b", other)):
      runner.pruning = PruningConfig(method="intentkv", budget=int(rng.integers(40, 140)))
      t = runner.run_turn(sid, msgs, None, i)
      before = pruned[sid]
      if before is not None:               # earlier holes are still holes
        assert not t.kept[:before.size][before].any(), (sid, i)
      now = ~t.kept
      if before is not None:
        now[:before.size] |= before
      pruned[sid] = now
      runner.alloc.check()
      runner.radix.check()
  assert pruned["a"].any() and pruned["b"].any()
  # no pruned slot lingers: the live slots are exactly those the tree still caches
  cached = {int(s) for _, slots in runner.radix.paths() for s in slots if s != SENTINEL}
  assert runner.alloc.num_live_slots == len(cached)
  for sid in ("a", "b"):   # and the tree has no stale path
    tokens, holes = runner.paths[sid]
    assert runner.radix.match_prefix(tokens, holes=holes).n_matched == tokens.size


def test_memory_and_query_modes_keep_different_sets(llm):
  """The QueryMemory advances on every request and carries earlier turns: with query
  spans that differ from turn to turn, memory mode keeps a measurably different set
  than query mode once a session has history, and M_t is not just the current turn."""
  _, query = _run(llm, method="intentkv", intent_mode="query", budget=80)
  _, memory = _run(llm, method="intentkv", intent_mode="memory", budget=80)
  assert all(a.pruned for a in memory[1:])
  assert memory[0].memory_cos == pytest.approx(1.0, abs=1e-5)   # first turn: M_1 = Enc(q_1)
  assert all(t.memory_cos < 0.95 for t in memory[1:]), [t.memory_cos for t in memory]
  differ = [int((a.kept != b.kept).sum()) for a, b in zip(query[1:], memory[1:])]
  assert sum(differ) >= 4, differ
  # the literal eq. 2 (raw Enc(q_t); its scale effect: test_pruning) reaches serving
  _, literal = _run(llm, method="intentkv", intent_mode="memory", budget=80,
                    intent_normalize_query=False)
  assert not np.allclose([t.memory_cos for t in literal[1:]], [t.memory_cos for t in memory[1:]])


def test_turn_longer_than_the_cache_is_a_clear_error(llm):
  short = CacheConfig(num_pages=512, page_size=4, max_seq_len=100)
  runner = SessionRunner(llm, PruningConfig(), cache=short)
  with pytest.raises(ValueError, match="max_seq_len"):
    runner.run_session("s", MESSAGES)
  assert not runner.alloc.sequences()
  assert runner.alloc.num_live_slots == runner.radix.num_cached_tokens


def test_evidence_labels_count_copied_ids(llm):
  runner = SessionRunner(llm, PruningConfig(), cache=CACHE)
  p = runner.prepare(MESSAGES, None, 6)         # the next call copies NO6JO3 from a tool output
  ids = p["ids"]
  text = runner.tok.decode([ids[j] for j in np.nonzero(p["evidence"])[0]])
  assert "NO6JO3" in text.replace(" ", "")
  assert not p["evidence"][p["qs"]:].any()


@pytest.mark.slow
def test_learnable_mode_with_fresh_head_equals_phase1(llm):
  """A fresh residual head (fc2 = 0) keeps exactly what Phase-1 memory mode keeps;
  the -residual ablation does too with a randomised head."""
  import jax
  from flax import nnx

  from jaxkv.policies.pruning.residual import ResidualHead

  cfg = dict(method="intentkv", layout="dead_slot", budget=80)
  _, phase1 = _run(llm, intent_mode="memory", **cfg)
  head = ResidualHead(llm.config.head_dim, rngs=nnx.Rngs(0))
  runner = SessionRunner(llm, PruningConfig(intent_mode="learnable", **cfg), cache=CACHE,
                         prefill_chunk=64, head=head)
  fresh = runner.run_session("s", MESSAGES)
  for a, b in zip(phase1, fresh):
    np.testing.assert_array_equal(a.kept, b.kept)
  graphdef, state = nnx.split(head)
  state = jax.tree.map(lambda x: x + 0.5, state)          # non-zero fc2: the head now matters
  runner = SessionRunner(llm, PruningConfig(intent_mode="learnable", ablate_residual=True, **cfg),
                         cache=CACHE, prefill_chunk=64, head=(graphdef, state))
  for a, b in zip(phase1, runner.run_session("s", MESSAGES)):
    np.testing.assert_array_equal(a.kept, b.kept)
  runner = SessionRunner(llm, PruningConfig(intent_mode="learnable", **cfg), cache=CACHE,
                         prefill_chunk=64, head=(graphdef, state))
  changed = [not np.array_equal(a.kept, b.kept)
             for a, b in zip(phase1, runner.run_session("s", MESSAGES))]
  assert any(changed)                                     # ... and is used when not ablated
  with pytest.raises(ValueError, match="residual head"):    # no head, no head_path
    SessionRunner(llm, PruningConfig(intent_mode="learnable", head_path="", **cfg), cache=CACHE)
  with pytest.raises(ValueError, match=f"head_dim {2 * llm.config.head_dim}"):
    SessionRunner(llm, PruningConfig(intent_mode="learnable", **cfg), cache=CACHE,
                  head=ResidualHead(2 * llm.config.head_dim, rngs=nnx.Rngs(0)))


def test_free_generation_equals_engine_greedy(llm):
  """Free mode decodes with the engine's scan step: the reply equals LLM.generate's
  greedy reply to the same prompt."""
  from jaxkv.config import SamplingConfig
  runner = SessionRunner(llm, PruningConfig(), cache=CACHE, prefill_chunk=64)
  turn = runner.run_turn("s", MESSAGES, None, 2, generate=True, max_tokens=20)
  from jaxkv.engine.llm import LLM
  engine_llm = LLM(llm.model, llm.tokenizer, CACHE)        # the fixture's engine pool is tiny
  want = engine_llm.generate([MESSAGES[:2]], SamplingConfig(max_tokens=20))[0]
  assert want.finish_reason in ("stop", "length"), want.error
  assert turn.text == want.text and turn.reply_tokens == want.completion_tokens
  assert np.isnan(turn.nll)
  runner.alloc.check()
  runner.radix.check()


def test_a_plain_chat_is_served(llm):
  """A chat with no history before its user message (no system prompt, no tool
  calls) is an ordinary turn: the whole prompt is the query span, nothing is
  refused, and the reply equals the engine's greedy reply."""
  from jaxkv.config import SamplingConfig
  from jaxkv.engine.llm import LLM
  chat = [{"role": "user", "content": "Where is the spare key? Tell me in one line."}]
  runner = SessionRunner(llm, PruningConfig(method="intentkv", budget=4), cache=CACHE)
  turn = runner.run_turn("plain", chat, None, 1, generate=True, max_tokens=12)
  want = LLM(llm.model, llm.tokenizer, CACHE).generate([chat], SamplingConfig(max_tokens=12))[0]
  assert turn.text == want.text
  assert turn.live_after == turn.prompt_tokens     # all of it is the query span: kept
  runner.alloc.check()


def test_session_steps_compile_once_per_bucket(llm):
  """Turns whose prompts differ in length but share every bucket (chunk 256, width
  512, 256 query rows) reuse the compiled prefill, capture and pruning steps."""
  from jaxkv.engine import driver, sessions
  from jaxkv.policies.pruning import policy
  runner = SessionRunner(llm, PruningConfig(method="h2o", budget=100), cache=CACHE,
                         radix=False, prefill_chunk=256)

  def chat(words):
    return [{"role": "system", "content": "You are a travel agent. Use the tools."},
            {"role": "user", "content": "Please help with my trip. " + "really " * words},
            {"role": "assistant", "content": "Sure."}]

  lengths = {w: len(runner.prepare(chat(w), None, 2)["ids"]) for w in (150, 160, 170, 180)}
  assert all(129 <= n <= 250 for n in lengths.values()), lengths
  def sizes():
    return (driver.chunk_step._cache_size(), policy._select_kept_at._cache_size(),
            sessions._write_rows._cache_size())
  first = runner.run_turn("s0", chat(150), None, 2)
  assert first.pruned
  before = sizes()
  for w in (160, 170, 180):
    assert runner.run_turn(f"s{w}", chat(w), None, 2).pruned
  assert sizes() == before, lengths
  assert llm._engine is None          # runners bring their own pools; no engine pool was made


def test_query_slice_rows():
  from jaxkv.engine.sessions import query_slice
  cfg = PruningConfig(method="h2o", snap_window=4)
  # request computed tokens [hit=100, n=180); query span from 170; session saw 120
  assert query_slice("all", cfg, 100, 180, 170, 120) == (20, 60)
  assert query_slice("all", cfg, 10, 180, 170, 120) == (110, 60)    # compact: recomputed
  assert query_slice("all", cfg, 100, 180, 170, 0) == (0, 80)       # first turn
  assert query_slice("all", cfg, 100, 180, 170, 500) == (79, 1)     # never empty
  assert query_slice("window", cfg, 100, 180, 170, 120) == (76, 4)
  assert query_slice("span", cfg, 100, 180, 170, 120) == (70, 10)


def test_h2o_votes_with_the_same_tokens_in_both_layouts(llm, monkeypatch):
  """Compact recomputes the history its radix insert skipped; those queries must not
  vote: H2O's voters are the session's new tokens under either layout."""
  from jaxkv.policies.pruning import policy
  voters = {}
  real = policy.select_kept_at

  def spy(cfg, pool_k, slot_map, live, forced, q_rows=None, q_start=0, q_lo=0, q_count=0,
          *args, **kwargs):
    voters.setdefault(cfg.layout, []).append((q_start + q_lo, q_count))
    return real(cfg, pool_k, slot_map, live, forced, q_rows, q_start, q_lo, q_count, *args,
                **kwargs)

  monkeypatch.setattr(policy, "select_kept_at", spy)
  for layout in ("dead_slot", "compact"):
    _, turns = _run(llm, method="h2o", layout=layout, budget=60)
    assert sum(t.pruned for t in turns) >= 2
  assert voters["dead_slot"] == voters["compact"]
  assert len(voters["compact"]) >= 2 and voters["compact"][1][0] > 0   # later turns: new only


def test_set_policy_starts_sessions_afresh_and_keeps_the_shared_prefix(llm):
  """One runner switched between policies gives what a fresh runner with that policy
  gives (kept sets, NLLs), and between them keeps only the named prefix cached."""
  cfg = dict(method="intentkv", intent_mode="memory", budget=80)
  runner, first = _run(llm, method="h2o", budget=80)
  assert runner.paths and runner.radix.num_cached_tokens > 100
  sys_ids = runner.prepare(MESSAGES, None, 2)
  sys_ids = sys_ids["ids"][:sys_ids["sys_len"]]
  runner.set_policy(PruningConfig(**cfg), keep_prefixes=[sys_ids])
  assert not runner.paths and not runner.seen
  assert runner.radix.num_cached_tokens == len(sys_ids)
  runner.radix.check()
  switched = runner.run_session("s", MESSAGES)
  _, fresh = _run(llm, **cfg)
  assert switched[0].hit_tokens == len(sys_ids) and fresh[0].hit_tokens == 0
  assert any(t.pruned for t in fresh)
  for a, b in zip(switched, fresh):
    assert np.array_equal(a.kept, b.kept) and a.live_after == b.live_after
    assert a.nll == pytest.approx(b.nll, abs=1e-4)


def test_forced_reply_continues_the_gold_turn(llm):
  """forced_reply=k: the gold reply's first k tokens join the prompt and generation
  continues from them, as the engine's greedy continuation of that token stream."""
  from jaxkv.config import SamplingConfig
  from jaxkv.engine.engine import Request
  from jaxkv.engine.llm import LLM
  runner = SessionRunner(llm, PruningConfig(method="h2o", budget=60), cache=CACHE,
                         prefill_chunk=64)
  p = runner.prepare(MESSAGES, None, 4)
  k = 9
  turn = runner.run_turn("s", MESSAGES, None, 4, generate=True, max_tokens=12, forced_reply=k)
  assert turn.prompt_tokens == len(p["ids"]) + k and turn.kept.size == turn.prompt_tokens
  assert turn.pruned and turn.kept[-k:].all()        # the forced tokens are the query's
  plain = SessionRunner(llm, PruningConfig(), cache=CACHE, prefill_chunk=64)
  turn = plain.run_turn("s", MESSAGES, None, 4, generate=True, max_tokens=12, forced_reply=k)
  ids = [int(x) for x in p["ids"]] + [int(x) for x in p["gold"][:k]]
  engine_llm = LLM(llm.model, llm.tokenizer, CACHE)
  want = next(iter(engine_llm.stream([Request(id="0", prompt=ids,
                                                sampling=SamplingConfig(max_tokens=12))])))
  assert turn.text == want.text
  short = plain.run_turn("u", MESSAGES, None, 4, generate=True, max_tokens=12, forced_reply=k,
                         until=lambda ids: len(ids) >= 1)
  assert short.reply_tokens == 1 and want.text.startswith(short.text)
  for bad in (-1, len(p["gold"])):
    with pytest.raises(ValueError, match="forced_reply"):
      runner.run_turn("t", MESSAGES, None, 4, generate=True, forced_reply=bad)
  with pytest.raises(ValueError, match="forced_reply"):
    runner.run_turn("t", MESSAGES, None, 4, forced_reply=3)
  runner.alloc.check()
