"""KV mechanisms as engine plug-ins: a pruned agent session run by the batch engine
(continuous batching, chunked prefill, sampling) equals SessionRunner's turn by turn
(tokens, prefix hits, what was kept, IntentKV's QueryMemory), also when it shares
its batch with other sessions and plain requests; cancellation and errors free
everything."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, PruningConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.sessions import SessionRunner
from jaxkv.policies.pruning import intentkv
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=256, page_size=16, max_seq_len=2048)
TURNS = [i for i, m in enumerate(MESSAGES) if m["role"] == "assistant"]   # 2, 4, 6, 8
MAX = 12


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_mechanisms"))


def _engine(llm, pruning, max_batch=4, chunk=64):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=chunk, decode_steps=4))
  mech = eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager, pruning))
  return eng, mech


def _turn_request(mech, session, i, rid=None, sampling=SamplingConfig(max_tokens=MAX)):
  prompt, ctx = mech.context(session, MESSAGES[:i])
  return Request(rid or f"{session}-{i}", prompt, sampling, mechanism="pruned", context=ctx)


def _reference(llm, pruning):
  """SessionRunner's free-generation turns of one session (its own pool)."""
  runner = SessionRunner(llm, pruning, cache=CACHE, prefill_chunk=64)
  return [runner.run_turn("ref", MESSAGES, None, i, generate=True, max_tokens=MAX)
          for i in TURNS]


@pytest.mark.parametrize("method", ["intentkv", "snapkv", "h2o"])
def test_engine_turns_equal_session_runner(llm, method):
  pruning = PruningConfig(method=method, budget=64)
  want = _reference(llm, pruning)
  eng, mech = _engine(llm, pruning)
  for i, ref in zip(TURNS, want):
    (res,) = list(eng.run([_turn_request(mech, "s", i)]))
    assert res.finish_reason in ("stop", "length"), res.error
    assert res.tokens == ref.reply_ids, f"turn {i}"
    assert res.cached_tokens == ref.hit_tokens, f"turn {i}"
    x = res.extra
    assert (x["pruned"], x["kv_live_before"], x["kv_live_after"]) == (
        ref.pruned, ref.live_before, ref.live_after), f"turn {i}"
    if method == "intentkv":
      assert x["query_memory_cos"] == pytest.approx(ref.memory_cos, abs=1e-5)
  assert any(r.pruned for r in want)                  # the budget bites
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and mech.tree.locked_tokens == 0


def test_sessions_and_plain_requests_batch_together(llm):
  """Two pruned sessions and a plain request in one engine batch, turn after turn:
  every row equals its run alone (the batch changes nothing but the speed)."""
  pruning = PruningConfig(method="intentkv", budget=64)
  alone = {}
  for sid in ("a", "b"):
    eng, mech = _engine(llm, pruning)
    for i in TURNS:
      alone[sid, i] = next(iter(eng.run([_turn_request(mech, sid, i)]))).tokens
  plain_prompt = llm.encode([{"role": "user", "content": "Say hello in one line."}])
  plain_alone = next(iter(_engine(llm, pruning)[0].run(
      [Request("p", plain_prompt, SamplingConfig(max_tokens=MAX))]))).tokens
  eng, mech = _engine(llm, pruning)
  for i in TURNS:
    batch = [_turn_request(mech, "a", i), _turn_request(mech, "b", i),
             Request(f"p{i}", plain_prompt, SamplingConfig(max_tokens=MAX))]
    got = {r.id: r for r in eng.run(batch)}
    assert got[f"a-{i}"].tokens == alone["a", i] and got[f"b-{i}"].tokens == alone["b", i]
    assert got[f"p{i}"].tokens == plain_alone and got[f"p{i}"].extra is None
  assert len(mech.state.paths) == 2
  eng.kv_manager.check()


def test_sampling_cancel_and_errors_free_everything(llm):
  pruning = PruningConfig(method="intentkv", budget=64)
  eng, mech = _engine(llm, pruning, chunk=16)
  seeded = SamplingConfig(max_tokens=MAX, temperature=0.8, top_p=0.9, seed=7)
  a = next(iter(eng.run([_turn_request(mech, "x", TURNS[1], "x1", seeded)])))
  eng2, mech2 = _engine(llm, pruning, chunk=16)
  b = next(iter(eng2.run([_turn_request(mech2, "x", TURNS[1], "x1", seeded)])))
  assert a.tokens == b.tokens and a.extra["pruned"]   # seeded sampling is reproducible
  # cancelled mid-prefill: its lock and slots go, the session learns nothing from it
  req = _turn_request(mech, "y", TURNS[2], "y1")
  eng.submit(req)
  eng.step()                                          # admitted, first chunk of 16 tokens
  assert eng.cancel("y1")
  (res,) = eng.step()
  assert res.finish_reason == "cancelled" and "y" not in mech.state.paths
  assert mech.tree.locked_tokens == 0
  # cancelled after its prefill: the session keeps nothing of the turn (no path, no
  # QueryMemory step), so a retry of the turn is its first
  req = _turn_request(mech, "z", TURNS[1], "z1", SamplingConfig(max_tokens=40))
  eng.submit(req)
  while "z1" not in eng.progress():
    eng.step()
  assert eng.cancel("z1")
  (res,) = eng.step()
  assert res.finish_reason == "cancelled" and res.tokens
  assert "z" not in mech.state.paths
  assert intentkv.session_key(session_id="z") not in mech.state.memories
  assert mech.tree.locked_tokens == 0
  # a context missing a field is refused before anything is locked
  bad = Request("m", _turn_request(mech, "w", TURNS[0]).prompt, mechanism="pruned",
                context={"session": "w"})
  (res,) = list(eng.run([bad]))
  assert res.finish_reason == "error" and mech.tree.locked_tokens == 0
  # a mechanism the engine does not have, or on an adapter, is an error result
  bad = Request("z", [1, 2, 3], mechanism="memart")
  (res,) = list(eng.run([bad]))
  assert res.finish_reason == "error" and "not served here" in res.error
  (res,) = list(eng.run([Request("c", [1, 2, 3], mechanism="pruned")]))   # no context
  assert res.finish_reason == "error" and "refused" in res.error
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  with pytest.raises(ValueError, match="dead_slot"):
    Pruned(llm.tokenizer, llm.config, eng.kv_manager, PruningConfig(layout="compact"))
  assert np.isfinite(a.ttft_s)
