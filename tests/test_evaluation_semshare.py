"""SemShareKV evaluated through the engine (`jaxkv.evaluation.semshare.serve_pairs`)
equals the batch-1 runner's evaluation (bench/semshare.py's `serve_pair`: the
reference stored, the target prefilled once and continued greedy, on the gold answer
and on a continuation, the store reset after each pair), pair by pair: the same
match (similarity, reuse), recompute sets, per-layer slot map and entries kept, the
same greedy tokens; first-token logits within 1e-5 and the teacher-forced NLLs within
1e-4 (the engine runs each pass in 32-token pieces and decodes rows batched). The
twins plan exactly as their request, store nothing, and the pool's books are clean
after.

A random 6-layer model with SmolLM2's real tokenizer (as tests/test_semshare.py), fresh
random pairs each run."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.semshare import SemShare
from jaxkv.engine.semshare import SemShareRunner
from jaxkv.evaluation import semshare as ev
from jaxkv.kv.state import SENTINEL
from mechanism_util import clip
from test_mechanism_semshare import _config

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=512)
GEN, L = 8, 6


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _pairs(budgets: bool):
  """Near copies (reused at the 0.5 gate) and one unrelated target (prefilled in
  full); gold answers on some; `budgets`: per-layer counts for the baselines (above
  SnapKV's 32-query window, which it always keeps)."""
  rng = np.random.default_rng()
  tok = lambda n: rng.integers(100, 40000, n)
  out = []
  for i, (n, near) in enumerate([(200, True), (160, True), (180, False), (140, True)]):
    ref = tok(n)
    tgt = ref.copy()
    if near:
      lo = int(rng.integers(20, n - 30))
      tgt[lo:lo + 10] = tok(10)
    else:
      tgt = tok(n - 20)
    out.append(ev.Pair(ref, tgt, tok(6) if i % 2 == 0 else None, None,
                       rng.integers(40, 120, L) if budgets else None))
  return out


def _runner_eval(llm, method, pairs):
  """bench/semshare.py's `serve_pair`, one pair at a time on the runner's own pool."""
  r = SemShareRunner(llm, _config(method, threshold=0.5), cache=CACHE, attn_impl="reference")
  out = []
  for p in pairs:
    r.reset()
    r.layer_budgets = p.budgets
    r.release(r.prefill(p.ref).seq)
    pre = r.prefill(p.tgt)
    toks, _ = r.decode(pre, GEN, stop_ids=llm.tokenizer.stop_ids)
    nll = None
    if p.answer is not None:
      _, lp = r.decode(pre, p.answer.size, forced=p.answer)
      nll = float(-np.mean(lp))
    cont = toks if p.continuation is None else p.continuation
    _, lp = r.decode(pre, cont.size, forced=cont)
    out.append(ev.Served(pre, toks, nll, float(-np.mean(lp))))
    r.release(pre.seq)
  r.reset()
  return out


@pytest.mark.parametrize("method,given", [pytest.param("semshare", False, marks=pytest.mark.slow),
                                          ("semshare", True),
                                          ("random", True), ("snapkv", True),
                                          ("full", False)])
def test_engine_evaluation_equals_the_runner(llm, method, given):
  pairs = _pairs(budgets=method == "snapkv")
  seed = np.random.SeedSequence().entropy        # fresh inputs, named in every failure
  if given:                        # the continuation to score: another method's reply
    rng = np.random.default_rng(seed)
    pairs = [ev.Pair(p.ref, p.tgt, p.answer, rng.integers(100, 40000, 5), p.budgets)
             for p in pairs]
  want = _runner_eval(llm, method, pairs)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=32, decode_steps=4))
  mech = eng.add_mechanism(SemShare(SemShareRunner(
      llm, _config(method, threshold=0.5), cache=CACHE, attn_impl="reference",
      kv=eng.kv_manager)))
  seen = []
  got = ev.serve_pairs(eng, mech.runner, pairs, GEN, progress=lambda d, n: seen.append((d, n)))
  assert seen[-1] == (len(pairs), len(pairs))
  stop = set(llm.tokenizer.stop_ids)
  for i, (g, w) in enumerate(zip(got, want)):
    for pre in [g.pre] + g.twin_pres:
      # similarity within 1e-6 (rounding both to 6 places could split a tie at a boundary)
      assert pre.reused == w.pre.reused, (i, seed)
      assert abs(pre.similarity - w.pre.similarity) <= 1e-6, (i, seed)
      np.testing.assert_array_equal(pre.layer_tokens, w.pre.layer_tokens)
      np.testing.assert_array_equal(pre.slot_map == SENTINEL, w.pre.slot_map == SENTINEL)
      assert (pre.live_entries, pre.shared_entries) == (w.pre.live_entries,
                                                        w.pre.shared_entries), i
      np.testing.assert_allclose(pre.logits, w.pre.logits, atol=1e-5, rtol=0)
    assert len(g.twin_pres) == 1 + (pairs[i].answer is not None)
    assert g.tokens.tolist() == clip(w.tokens.tolist(), stop), f"pair {i}, seed {seed}"
    if w.nll is None:
      assert g.nll is None
    else:
      assert abs(g.nll - w.nll) < 1e-4, (i, g.nll, w.nll, seed)
    assert abs(g.cont_nll - w.cont_nll) < 1e-4, (i, g.cont_nll, w.cont_nll)
  reusing = method in ("semshare", "random")
  assert [w.pre.reused for w in want] == [reusing, reusing, False, reusing]
  if method == "snapkv":           # the budgets reached the baseline's prefill
    assert all((w.pre.slot_map != SENTINEL).sum(1).tolist()
               == np.clip(p.budgets, 1, p.tgt.size).tolist() for w, p in zip(want, pairs))
  assert not mech.runner.refs                  # reset after the last pair
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []


def test_a_failing_request_names_itself(llm):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=2, prefill_chunk=32, decode_steps=4))
  mech = eng.add_mechanism(SemShare(SemShareRunner(llm, _config("snapkv"),
                                                   attn_impl="reference", kv=eng.kv_manager)))
  p = _pairs(budgets=False)[0]
  bad = ev.Pair(p.ref, p.tgt, None, None, np.ones(L + 1, np.int64))
  with pytest.raises(RuntimeError, match=r"semshare request 0 failed: .*one count per layer"):
    ev.serve_pairs(eng, mech.runner, [bad], GEN)
