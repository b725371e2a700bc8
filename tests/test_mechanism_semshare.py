"""SemShareKV as an engine mechanism: a `semshare` request run by the batch engine
gives SemShareRunner's prefill + greedy decode (same tokens, first-token logits within
1e-5, same similarity / reuse / kept entries), decoding through its per-layer view
beside plain rows that read their own slot map; the reference slots it aliases are
held while it runs and given back after; cancellation frees everything.

A random 6-layer model with SmolLM2's real tokenizer (as tests/test_semshare.py)."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig, SemShareConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.semshare import SemShare
from jaxkv.engine.semshare import SemShareRunner
from mechanism_util import beside_a_decoding_row, clip, prefill_starts, recording

CACHE = CacheConfig(num_pages=256, page_size=16, max_seq_len=1024)
MAX = 10


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _config(method, **kw):
  return SemShareConfig(method=method, **({"threshold": 0.0} | kw))


_Recording = recording(SemShare)


def _engine(llm, method, max_batch=4, **kw):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=32, decode_steps=4))
  runner = SemShareRunner(llm, _config(method, **kw), attn_impl="reference",
                          kv=eng.kv_manager)
  return eng, eng.add_mechanism(_Recording(runner))


def _request(rid, prompt, max_tokens=MAX):
  return Request(rid, [int(t) for t in prompt], SamplingConfig(max_tokens=max_tokens),
                 mechanism="semshare")


def _pair(seed):
  rng = np.random.default_rng(seed)
  ref = rng.integers(100, 40000, 200)
  target = ref.copy()
  target[150:160] = rng.integers(100, 40000, 10)   # a near copy: reused
  return ref, target


@pytest.mark.parametrize("method", ["semshare", "snapkv", "full"])
def test_engine_semshare_equals_the_runner(llm, method):
  ref, target = _pair(1)
  r = SemShareRunner(llm, _config(method), cache=CACHE, attn_impl="reference")
  want = []
  for p in (ref, target):
    pre = r.prefill(p)
    toks, _ = r.decode(pre, MAX, stop_ids=llm.tokenizer.stop_ids)
    r.release(pre.seq)
    want.append((pre, toks.tolist()))
  eng, mech = _engine(llm, method)
  stop = set(llm.tokenizer.stop_ids)
  for i, (p, (pre, toks)) in enumerate(zip((ref, target), want)):
    (res,) = list(eng.run([_request(f"r{i}", p)]))
    assert res.finish_reason in ("stop", "length"), res.error
    assert res.tokens == clip(toks, stop), f"request {i}"
    np.testing.assert_allclose(mech.logits[f"r{i}"], pre.logits, atol=1e-5, rtol=0)
    x = res.extra
    assert (x["reused"], x["live_entries"], x["shared_entries"]) == (
        pre.reused, pre.live_entries, pre.shared_entries), f"request {i}"
    assert x["similarity"] == round(pre.similarity, 4)
  if method == "semshare":
    assert want[1][0].reused and want[1][0].shared_entries > 0
  if method == "snapkv":                    # a per-layer view that is not the slot map
    assert want[1][0].live_entries < 6 * target.size
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and not mech.runner._holds


def test_semshare_rows_batch_with_plain_rows(llm):
  """Two reusing rows (per-layer views) and two plain rows in one decode call: every
  row equals its run alone."""
  ref, target = _pair(2)
  other = ref.copy()
  other[20:30] = np.random.default_rng(3).integers(100, 40000, 10)
  rng = np.random.default_rng(4)
  plain = [rng.integers(100, 40000, k).tolist() for k in (40, 90)]
  alone = {}
  for rid, p in (("a", target), ("b", other)):
    eng, _ = _engine(llm, "semshare")
    list(eng.run([_request("ref", ref)]))
    alone[rid] = next(iter(eng.run([_request(rid, p)])))
  for i, p in enumerate(plain):
    eng, _ = _engine(llm, "semshare")
    alone[f"p{i}"] = next(iter(eng.run([Request(f"p{i}", p, SamplingConfig(max_tokens=MAX))])))
  eng, mech = _engine(llm, "semshare")
  list(eng.run([_request("ref", ref)]))
  got = {r.id: r for r in eng.run([_request("a", target), Request("p0", plain[0],
                                   SamplingConfig(max_tokens=MAX)), _request("b", other),
                                   Request("p1", plain[1], SamplingConfig(max_tokens=MAX))])}
  for rid, res in alone.items():
    assert got[rid].tokens == res.tokens, rid
  assert got["a"].extra["reused"] and got["b"].extra["reused"] and got["p0"].extra is None
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and not mech.runner._holds


def test_prompts_admitted_together_reuse_the_earlier_reference(llm):
  """A reference and its near copy in one batch: the copy's prefill waits for the
  reference's to end (`serial_prefill`) and reuses it, as when run after it."""
  ref, target = _pair(5)
  eng, _ = _engine(llm, "semshare")
  list(eng.run([_request("ref", ref)]))
  alone = next(iter(eng.run([_request("t", target)])))
  eng, mech = _engine(llm, "semshare")
  got = {r.id: r for r in eng.run([_request("ref", ref), _request("t", target)])}
  assert got["t"].extra["reused"] and got["t"].tokens == alone.tokens
  assert got["t"].extra == alone.extra
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and not mech.runner._holds


def test_unrelated_prompts_prefill_side_by_side(llm):
  """Prompts admitted together at the real gate (0.8): one whose similarity to the
  earlier is below the gate starts its prefill beside it (`may_overlap`); a near copy
  waits for the earlier's prefill to end and reuses it. Every row's tokens, reuse and
  entries equal its run one after another."""
  ref, target = _pair(6)
  other = np.random.default_rng(7).integers(100, 40000, 180)
  eng, mech = _engine(llm, "semshare", threshold=0.8)
  assert mech.runner.similarity(ref, other) < 0.8 <= mech.runner.similarity(ref, target)
  serial = {rid: next(iter(eng.run([_request(rid, p)])))
            for rid, p in (("ref", ref), ("other", other), ("t", target))}
  eng, mech = _engine(llm, "semshare", threshold=0.8)
  started, got = prefill_starts(eng, mech, [_request(rid, p) for rid, p in
                                            (("ref", ref), ("other", other), ("t", target))])
  assert started["ref"] == started["other"] == 1 < started["t"]
  assert got["t"].extra["reused"] and not got["other"].extra["reused"]
  for rid, want in serial.items():
    assert got[rid].tokens == want.tokens, rid
    for k in ("reused", "live_entries", "shared_entries"):
      assert got[rid].extra[k] == want.extra[k], (rid, k)
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and not mech.runner._holds


def test_aliased_slots_held_until_the_row_leaves(llm):
  ref, target = _pair(5)
  eng, mech = _engine(llm, "semshare")
  list(eng.run([_request("ref", ref)]))
  eng.submit(_request("t", target, max_tokens=40))
  while "t" not in eng.progress():                   # prefilled, first token out
    eng.step()
  (seq,) = mech.runner._holds
  held = mech.runner._holds[seq]
  mech.runner.forget(next(iter(mech.runner.refs)))   # the store lets the reference go
  assert all(eng.allocator.refcount(s) > 0 for s in held)   # the row still holds it
  assert eng.cancel("t")
  (res,) = eng.step()
  assert res.finish_reason == "cancelled" and not mech.runner._holds
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and eng.allocator.num_live_slots == 0


@pytest.mark.parametrize("method", ["semshare", "snapkv"])
def test_a_long_prompt_delays_decoding_rows_by_one_chunk_at_most(llm, method):
  """A 200-token SemShareKV prompt is prefilled one 32-token piece per engine step
  (the full prefill, the layer-0 probe and every window of the second pass): a row
  already decoding gets its decode call in every one of those steps; the row's tokens,
  first-token logits and kept entries equal the runner's one call per pass."""
  ref, target = _pair(1)
  r = SemShareRunner(llm, _config(method), cache=CACHE, attn_impl="reference")
  r.release(r.prefill(ref).seq)
  pre = r.prefill(target)
  toks, _ = r.decode(pre, MAX, stop_ids=llm.tokenizer.stop_ids)
  eng, mech = _engine(llm, method, max_batch=2)
  list(eng.run([_request("ref", ref)]))
  steps, got = beside_a_decoding_row(eng, _request("t", target), 4)
  assert steps >= -(-target.size // 32) * (2 if method == "semshare" else 1)
  assert got["t"].tokens == clip(toks.tolist(), set(llm.tokenizer.stop_ids))
  np.testing.assert_allclose(mech.logits["t"], pre.logits, atol=1e-5, rtol=0)
  x = got["t"].extra
  assert (x["reused"], x["live_entries"], x["shared_entries"]) == (
      pre.reused, pre.live_entries, pre.shared_entries)
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and not mech.runner._holds
