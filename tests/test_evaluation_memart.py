"""MemArt evaluated through the engine (`jaxkv.evaluation.memart.serve_questions`)
equals the batch-1 runner's evaluation (bench/memart.py: `MemArtRunner.answer` greedy,
then teacher-forced on the gold answer over the blocks it used), question by question:
the same blocks retrieved (by the bound, re-ranked, in windows, with voters) or
spliced (full context's every block, a recent window, a memory of its own per
question), the same greedy tokens, probe tokens and decode KV length; first-token
logits within 1e-5 and the gold answers' NLLs within 1e-4 (the engine decodes rows
batched; full context's twin, with no key shift, is fed as prefill chunks). The
twins answer over their request's blocks, and the pool's books are clean after.

A random 3-layer model with SmolLM2's real tokenizer (as tests/test_memart_runner.py),
fresh random memories and questions each run."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, MemArtConfig
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.memart import MemArtRunner
from jaxkv.evaluation import memart as ev
from mechanism_util import clip, recording

CACHE = CacheConfig(num_pages=768, page_size=8, max_seq_len=1024)
CFG = MemArtConfig(block_size=8, top_k=6)
GEN = 8


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer(num_layers=3)


def _world(runner, rng):
  """What bench/memart.py writes per conversation: the history once per session
  span (MemArt's memory), once as one span (full context), and per question a
  memory of its own (plaintext's picked turns); returns (questions, memories)."""
  tok = lambda n: rng.integers(100, 40000, n)
  spans = [tok(int(n)) for n in rng.integers(30, 90, 5)]
  mem, full = runner.new_memory(), runner.new_memory()
  for i, s in enumerate(spans):
    runner.write(mem, s, tag=i)
  full_rows = runner.write(full, np.concatenate(spans), tag=-1)
  live = np.flatnonzero(mem.live)
  recent = np.sort(live[np.argsort(mem.time[live])[-CFG.top_k:]])
  own = [runner.new_memory() for _ in range(2)]
  own_rows = [runner.write(m, tok(40)) for m in own]
  qs = []
  for kw in [dict(), dict(rerank=2), dict(rerank=2, neighbors=1), dict(neighbors=1),
             dict(voters=True), dict(blocks=full_rows), dict(blocks=recent), dict(own=0),
             dict(own=1, answer=False)]:
    tail = tok(int(rng.integers(6, 14)))
    voters = np.arange(tail.size) < tail.size - 3 if kw.pop("voters", False) else None
    m = mem
    if "own" in kw:
      j = kw.pop("own")
      m, kw["blocks"] = own[j], own_rows[j]
    m = full if kw.get("blocks") is full_rows else m
    answer = tok(5) if kw.pop("answer", True) else None
    qs.append(ev.Question(m, tail, answer, voters=voters, **kw))
  return qs, [mem, full] + own


def _runner_eval(runner, qs, stop_ids):
  """bench/memart.py's two calls per question on the runner's own pool."""
  out = []
  for q in qs:
    a = runner.answer(q.memory, q.tail, GEN, blocks=q.blocks, stop_ids=stop_ids,
                      voters=q.voters, rerank=q.rerank, neighbors=q.neighbors)
    nll = None
    if q.answer is not None:
      f = runner.answer(q.memory, q.tail, q.answer.size, blocks=a.blocks, forced=q.answer)
      nll = float(-np.mean(f.logprobs))
    out.append((a, nll))
  return out


@pytest.mark.slow
def test_engine_evaluation_equals_the_runner(llm):
  seed = int(np.random.default_rng().integers(1 << 30))
  head = np.asarray(llm.tokenizer.encode("<|im_start|>user\nRecall:", add_bos=False), np.int32)
  solo = MemArtRunner(llm, CFG, head, cache=CACHE, attn_impl="reference")
  qs, mems = _world(solo, np.random.default_rng(seed))
  stop = set(llm.tokenizer.stop_ids)
  want = _runner_eval(solo, qs, llm.tokenizer.stop_ids)
  for m in mems:
    solo.forget(m)

  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=32, decode_steps=3))
  runner = MemArtRunner(llm, CFG, head, cache=CACHE, kv=eng.kv_manager)
  mech = eng.add_mechanism(recording(MemArt)(runner=runner))
  qs2, mems2 = _world(runner, np.random.default_rng(seed))   # the same writes, engine's pool
  done = []
  got = ev.serve_questions(eng, qs2, GEN, progress=lambda d, n: done.append((d, n)))
  assert done[-1] == (len(qs2), len(qs2))
  for i, ((a, nll), s) in enumerate(zip(want, got)):
    msg = f"question {i} (seed {seed})"
    np.testing.assert_array_equal(s.pre.blocks, a.blocks, err_msg=msg)
    assert s.tokens.tolist() == clip(a.tokens.tolist(), stop), msg
    np.testing.assert_allclose(mech.logits[f"{i}"], a.logits, atol=1e-5, err_msg=msg)
    assert s.usage["probe_tokens"] == a.probe_tokens, msg
    assert s.usage["prefill_tokens"] == a.prefill_tokens, msg
    assert s.usage["decode_kv_len"] == a.decode_kv_len - a.tokens.size + s.tokens.size, msg
    if nll is None:
      assert s.nll is None and s.twin_pre is None, msg
    else:
      assert abs(s.nll - nll) < 1e-4, msg
      np.testing.assert_array_equal(s.twin_pre.blocks, s.pre.blocks, err_msg=msg)
  assert any(s.pre.shift is None for s in got) and any(s.pre.shift is not None for s in got)
  assert any(s.usage["probe_tokens"] for s in got)       # some retrieved by a probe
  for m in mems2:
    runner.forget(m)
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []


def test_bad_requests_fail_alone(llm):
  """A runner-only mechanism refuses session requests, and a question whose blocks
  do not fit the cache fails with the runner's reason while the others are answered."""
  head = np.asarray(llm.tokenizer.encode("Recall:", add_bos=False), np.int32)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=2, prefill_chunk=32, decode_steps=2))
  runner = MemArtRunner(llm, CFG, head, cache=CacheConfig(num_pages=768, page_size=8,
                                                          max_seq_len=128), kv=eng.kv_manager)
  mech = eng.add_mechanism(MemArt(runner=runner))
  with pytest.raises(ValueError, match="evaluation requests only"):
    mech.context("s", [{"role": "user", "content": "hi"}])
  rng = np.random.default_rng()
  mem = runner.new_memory()
  rows = runner.write(mem, rng.integers(100, 40000, 120))
  tail = rng.integers(100, 40000, 8)
  with pytest.raises(RuntimeError, match=r"request 1 failed.*exceed max_seq_len"):
    ev.serve_questions(eng, [ev.Question(mem, tail, blocks=rows[:2]),
                             ev.Question(mem, tail, blocks=rows)], GEN)
  while eng.busy:
    eng.step()
  runner.forget(mem)
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  with pytest.raises(ValueError, match="MemArtSessions or"):
    MemArt()
