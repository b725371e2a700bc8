"""MemArt as an engine mechanism: a chat session's turns run by the batch engine give
MemArtSessions.ask's answers (tokens identical, first-token logits within 1e-5, the
same blocks retrieved and written), decoding with their key shift beside plain rows;
memory is session state on the engine's pool, freed on close; a turn the session
cannot take fails alone.

A random 3-layer model with SmolLM2's real tokenizer and chat template (as
tests/test_memart_runner.py)."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, MemArtConfig, SamplingConfig
from jaxkv.engine import mechanism_rows
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.memart import MemArtSessions
from mechanism_util import beside_a_decoding_row, clip, recording

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
MAX = 10
CFG = MemArtConfig(block_size=16, top_k=4)
FACTS = ["My sister Ana lives in Lisbon and teaches piano to children.",
         "I adopted a grey cat called Biscuit last spring from the shelter.",
         "Our team ships the billing service every Tuesday after lunch.",
         "The spare key is under the blue flower pot by the back door."]
QUESTIONS = ["Where is the spare key?", "What is the cat called?", "Who teaches piano?"]


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer(num_layers=3)


def _turns():
  """Three turns of one session: each adds two facts to the history, then asks."""
  history, out = [], []
  for i, q in enumerate(QUESTIONS):
    for f in FACTS[i:i + 2]:
      history += [{"role": "user", "content": f}, {"role": "assistant", "content": "Noted."}]
    out.append(history + [{"role": "user", "content": q}])
  return out


_Recording = recording(MemArt)


def _engine(llm, max_batch=4, pack="auto"):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=64, decode_steps=4,
                            pack_prefill=pack))
  sessions = MemArtSessions(llm, CFG, CACHE, attn_impl="reference", kv=eng.kv_manager)
  return eng, eng.add_mechanism(_Recording(sessions))


def _request(llm, mech, rid, session, messages):
  return Request(rid, llm.encode(messages), SamplingConfig(max_tokens=MAX), mechanism="memart",
                 context=mech.context(session, messages))


def test_engine_turns_equal_memart_sessions(llm):
  ref = MemArtSessions(llm, CFG, CACHE, attn_impl="reference")
  eng, mech = _engine(llm)
  stop = set(llm.tokenizer.stop_ids)
  for i, msgs in enumerate(_turns()):
    ans, info = ref.ask("s", msgs, MAX)
    (res,) = list(eng.run([_request(llm, mech, f"t{i}", "s", msgs)]))
    assert res.finish_reason in ("stop", "length"), res.error
    assert res.tokens == clip(ans.tokens.tolist(), stop), f"turn {i}"
    np.testing.assert_allclose(mech.logits[f"t{i}"], ans.logits, atol=1e-5, rtol=0)
    x = res.extra
    assert x["retrieved_blocks"] == ans.blocks.size and x["prefill_tokens"] == ans.prefill_tokens
    assert x["decode_kv_len"] == ans.decode_kv_len
    assert {k: x[k] for k in info} == info, f"turn {i}"
    assert res.prompt_tokens == len(llm.encode(msgs)) > x["prefill_tokens"]
  assert ans.blocks.size == CFG.top_k                 # retrieval, not the whole history
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  live = eng.allocator.num_live_slots
  assert live > 0                                     # the head and the session's memory
  assert mech.close("s") and not mech.close("s")
  mech.runner.close()
  assert eng.allocator.num_live_slots == 0 < live


@pytest.mark.parametrize("pack", ["rows", "packed"])
def test_memart_rows_batch_with_plain_rows_and_errors_stay_alone(llm, pack, monkeypatch):
  """Two sessions' turns and a plain request in one batch equal their runs alone
  (tokens identical, first-token logits within 1e-5), with the sessions' prefill work
  (history writes, probes, questions) run one call per row or packed into one call
  per round (`EngineConfig.pack_prefill`); an edited history fails its own request
  only."""
  turns = _turns()
  other = [[{"role": m["role"], "content": m["content"].replace("Lisbon", "Porto")}
            for m in t] for t in turns]
  plain = np.random.default_rng(1).integers(100, 40000, 60).tolist()
  alone, logits = {}, {}
  for sid, ts in (("a", turns), ("b", other)):
    eng, mech = _engine(llm)
    for i, msgs in enumerate(ts[:2]):
      alone[sid, i] = next(iter(eng.run([_request(llm, mech, f"{sid}{i}", sid, msgs)]))).tokens
      logits[sid, i] = mech.logits[f"{sid}{i}"]
  eng, _ = _engine(llm)
  alone["p"] = next(iter(eng.run([Request("p", plain, SamplingConfig(max_tokens=MAX))]))).tokens
  calls = []
  run_chunk = mechanism_rows.run_chunk
  monkeypatch.setattr(mechanism_rows, "run_chunk",
                      lambda d, works, c: calls.append(len(works)) or run_chunk(d, works, c))
  eng, mech = _engine(llm, pack=pack)
  for i in range(2):
    batch = [_request(llm, mech, f"a{i}", "a", turns[i]), Request(
        "p", plain, SamplingConfig(max_tokens=MAX)), _request(llm, mech, f"b{i}", "b", other[i])]
    got = {r.id: r for r in eng.run(batch)}
    assert got[f"a{i}"].tokens == alone["a", i] and got[f"b{i}"].tokens == alone["b", i]
    assert got["p"].tokens == alone["p"] and got["p"].extra is None
    for sid in "ab":
      np.testing.assert_allclose(mech.logits[f"{sid}{i}"], logits[sid, i], atol=1e-5, rtol=0)
  assert got["a1"].extra["probe_tokens"] > 0        # the second turn's memory is probed
  assert max(calls) == (2 if pack == "packed" else 1)
  with pytest.raises(ValueError, match="no longer extends"):
    mech.context("a", other[2])                       # the server's 400
  stale = Request("x", llm.encode(other[2]), SamplingConfig(max_tokens=MAX), mechanism="memart",
                  context={"session": "a", "messages": other[2]})
  got = {r.id: r for r in eng.run([stale, Request("p2", plain, SamplingConfig(max_tokens=MAX))])}
  assert got["x"].finish_reason == "error" and "no longer extends" in got["x"].error
  assert got["p2"].tokens == alone["p"]
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []


def test_a_long_history_is_written_one_chunk_per_step(llm):
  """A MemArt turn whose unseen history is long writes it one chunk per engine step:
  a row already decoding gets its decode call in every one of those steps (it waits
  for one chunk at a time, never the whole history); the answer equals the turn's
  answer with the history written in one piece."""
  history = []
  for i in range(6):
    history += [{"role": "user", "content": " ".join(FACTS) + f" (note {i})"},
                {"role": "assistant", "content": "Noted."}]
  msgs = history + [{"role": "user", "content": QUESTIONS[0]}]
  want, _ = MemArtSessions(llm, CFG, CACHE, attn_impl="reference").ask("s", msgs, MAX)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=2, prefill_chunk=32, decode_steps=2))
  mech = eng.add_mechanism(MemArt(MemArtSessions(llm, CFG, CACHE, attn_impl="reference",
                                                 kv=eng.kv_manager)))
  steps, got = beside_a_decoding_row(eng, _request(llm, mech, "m", "s", msgs), 2)
  written = sum(len(llm.tokenizer.encode(f"{m['role']}: {m['content']}", add_bos=False))
                for m in history)
  assert steps >= written // 32                      # the history took a step per chunk
  assert got["m"].tokens == clip(want.tokens.tolist(), set(llm.tokenizer.stop_ids))
  assert got["m"].extra["retrieved_blocks"] == want.blocks.size
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []


def test_closed_mid_turn_long_chats_and_a_failing_finish(llm):
  """A session closed while its turn is writing is freed when that turn ends; a chat
  longer than the cache whose question fits is answered (the row reserves only what it
  prefills); a mechanism whose finish raises fails the step, and abort frees the rest
  without freeing anything twice."""
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=2, prefill_chunk=32, decode_steps=2))
  mech = eng.add_mechanism(MemArt(MemArtSessions(llm, CFG, CACHE, attn_impl="reference",
                                                 kv=eng.kv_manager)))
  head = eng.allocator.num_live_slots
  msgs = _turns()[2]
  eng.submit(_request(llm, mech, "t", "s", msgs))
  eng.step()                                          # part way through the history write
  assert mech.close("s")                              # deferred: the turn is in flight
  while eng.busy:
    (res,) = eng.step() or [None]
    if res is not None:
      assert res.finish_reason in ("stop", "length")
  assert "s" not in mech.sessions.sessions and eng.allocator.num_live_slots == head
  pair = [{"role": "user", "content": " ".join(FACTS)}, {"role": "assistant", "content": "Ok."}]
  history, msgs = [], [pair[0]]    # grown turn by turn: each turn writes what is new
  while len(llm.encode(msgs)) <= CACHE.max_seq_len:
    history += pair * 6
    msgs = history + [{"role": "user", "content": QUESTIONS[0]}]
    (res,) = list(eng.run([_request(llm, mech, f"l{len(history)}", "l", msgs)]))
    assert res.finish_reason in ("stop", "length"), res.error
  assert res.prompt_tokens > CACHE.max_seq_len > res.extra["decode_kv_len"]
  finish, calls = mech.finish, []

  def failing(row, cache):
    calls.append(row.req.id)
    finish(row, cache)
    raise RuntimeError("finish failed")

  mech.finish = failing
  eng.submit(_request(llm, mech, "f", "f", _turns()[0]))
  with pytest.raises(RuntimeError, match="finish failed"):
    while True:
      eng.step()
  mech.finish = finish
  assert eng.abort("finish failed") == [] and calls == ["f"]   # the row left before it raised
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and not mech._inflight and not mech._writing


def test_new_rows_pages_are_reserved_before_the_step_prefills(llm):
  """The pages a step's newly admitted rows may take are reserved before that step's
  prefills run, so a MemArt history write inside the step cannot take them."""
  eng, _ = _engine(llm)
  seen, prefill = [], eng._prefill

  def spy(rows):
    seen.append(eng.kv_manager.reserved(0))
    prefill(rows)

  eng._prefill = spy
  plain = np.random.default_rng(3).integers(100, 40000, 70).tolist()
  eng.submit(Request("p", plain, SamplingConfig(max_tokens=80)))
  eng.step()
  # its prompt's slots are allocated at admission; the pages its decode may still take
  assert seen[0] == eng._pages(len(plain) + 80) - eng._pages(len(plain)) > 0
