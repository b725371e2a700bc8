"""Segment reuse as an engine mechanism: a `reuse` request run by the batch engine
gives ReuseRunner's prefill + greedy decode (same tokens, first-token logits within
1e-5, same tiers and prefix hits), also beside plain requests in one batch; the
store and the radix tree it fills are the runner's; cancellation frees everything.

A random 6-layer model with SmolLM2's real tokenizer (as tests/test_reuse.py), so
the exact, approximate and blend tiers all have layers to work with."""

import dataclasses

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, ReuseConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.reuse import ReuseRunner
from mechanism_util import beside_a_decoding_row, clip, prefill_starts, recording
from test_reuse import _prompts

CACHE = CacheConfig(num_pages=256, page_size=16, max_seq_len=1024)
MAX = 10
METHODS = {"tiered": dict(tiers=("exact", "approx")), "cacheblend": {}, "none": {}}


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _config(method):
  return ReuseConfig(method=method, storage="float32", cut_every=2, **METHODS[method])


_Recording = recording(Reuse)


def _engine(llm, method, max_batch=4):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=32, decode_steps=4))
  runner = ReuseRunner(llm, _config(method), attn_impl="reference", kv=eng.kv_manager)
  return eng, eng.add_mechanism(_Recording(runner))


def _request(rid, prompt, max_tokens=MAX):
  return Request(rid, [int(t) for t in prompt], SamplingConfig(max_tokens=max_tokens),
                 mechanism="reuse", context={"spans": []})


def _runner_answers(llm, method, prompts):
  """ReuseRunner alone (its own pool): per prompt (prefill, greedy tokens)."""
  r = ReuseRunner(llm, _config(method), cache=CACHE, attn_impl="reference")
  out = []
  for p in prompts:
    pre = r.prefill(p, [])
    toks, _ = r.decode(pre, MAX, stop_ids=llm.tokenizer.stop_ids)
    r.release(pre.seq)
    out.append((pre, toks.tolist()))
  return out, r


@pytest.mark.parametrize("method", sorted(METHODS))
def test_engine_reuse_equals_the_runner(llm, method):
  p1, p2, p3 = _prompts(seed=3)
  prompts = [p1, p3, p2, p2]        # store; splice (approx / blend); exact + radix; radix
  want, runner = _runner_answers(llm, method, prompts)
  eng, mech = _engine(llm, method)
  stop = set(llm.tokenizer.stop_ids)
  for i, (p, (pre, toks)) in enumerate(zip(prompts, want)):
    (res,) = list(eng.run([_request(f"r{i}", p)]))
    assert res.finish_reason in ("stop", "length"), res.error
    assert res.tokens == clip(toks, stop), f"request {i}"
    np.testing.assert_allclose(mech.logits[f"r{i}"], pre.logits, atol=1e-5, rtol=0)
    assert res.cached_tokens == pre.prefix_hit, f"request {i}"
    x = res.extra
    assert x["tiers"] == sorted({run.tier for run in pre.runs}), f"request {i}"
    assert x["reused_tokens"] == sum(run.n for run in pre.runs if run.tier != "reject")
    assert x["prefill_tokens"] == round(pre.prefill_tokens, 1)
  if method != "none":
    assert want[1][0].runs and want[3][0].prefix_hit > 0     # splice and radix both ran
  assert len(mech.runner.store) == len(runner.store)          # the same segments stored
  assert mech.runner.store.keys() == runner.store.keys()
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  if mech.runner.radix is not None:
    mech.runner.radix.check()
    assert mech.runner.radix.locked_tokens == 0


def test_reuse_rows_batch_with_plain_rows(llm):
  """Reuse requests and plain requests in one batch: every row equals its run alone."""
  p1, p2, p3 = _prompts(seed=4)
  rng = np.random.default_rng(5)
  plain = [rng.integers(100, 40000, k).tolist() for k in (40, 70)]
  alone = {}
  for rid, p in (("a", p3), ("b", p2)):
    eng, _ = _engine(llm, "cacheblend")
    list(eng.run([_request("seed", p1)]))
    alone[rid] = next(iter(eng.run([_request(rid, p)]))).tokens
  for i, p in enumerate(plain):
    eng, _ = _engine(llm, "cacheblend")
    alone[f"p{i}"] = next(iter(eng.run([Request(f"p{i}", p, SamplingConfig(max_tokens=MAX))]))
                          ).tokens
  eng, mech = _engine(llm, "cacheblend")
  list(eng.run([_request("seed", p1)]))
  batch = [_request("a", p3), Request("p0", plain[0], SamplingConfig(max_tokens=MAX)),
           _request("b", p2), Request("p1", plain[1], SamplingConfig(max_tokens=MAX))]
  got = {r.id: r for r in eng.run(batch)}
  for rid, toks in alone.items():
    assert got[rid].tokens == toks, rid
  assert got["a"].extra["reused_tokens"] > 0 and got["p0"].extra is None
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and mech.runner.radix.locked_tokens == 0


def test_prompts_admitted_together_reuse_what_earlier_ones_store(llm):
  """A batch that holds a prompt and a later one built from its segments: the later
  row's prefill waits for the earlier one's to end (`serial_prefill`), so it splices
  what that one stored and answers as it does when run after it; a plain row beside
  them is not held up."""
  p1, _, p3 = _prompts(seed=4)
  want, _ = _runner_answers(llm, "cacheblend", [p1, p3])
  plain = np.random.default_rng(6).integers(100, 40000, 50).tolist()
  eng, _ = _engine(llm, "cacheblend")
  got = {r.id: r for r in eng.run([_request("seed", p1), _request("a", p3),
                                   Request("p", plain, SamplingConfig(max_tokens=MAX))])}
  stop = set(llm.tokenizer.stop_ids)
  assert got["a"].extra["reused_tokens"] == sum(r.n for r in want[1][0].runs
                                                if r.tier != "reject") > 0
  assert got["seed"].tokens == clip(want[0][1], stop)
  assert got["a"].tokens == clip(want[1][1], stop)
  assert got["p"].ttft_s < got["a"].ttft_s    # the plain row did not wait for them
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []


@pytest.mark.parametrize("budget", [512 << 20, 4096])
def test_prompts_sharing_no_run_prefill_side_by_side(llm, budget):
  """Admitted together: a prompt that shares no run of min_tokens with the earlier one
  starts its prefill beside it (`may_overlap`) when the store has room for all the
  earlier one can store, else it waits; one built from the earlier's segments waits
  and splices them. Every row's tokens and reuse equal the runner's, one after another."""
  p1, _, p3 = _prompts(seed=4)
  other = np.random.default_rng(8).integers(100, 40000, 150)
  cfg = dataclasses.replace(_config("cacheblend"), byte_budget=budget)
  r = ReuseRunner(llm, cfg, cache=CACHE, attn_impl="reference")
  want = {}
  for rid, p in (("seed", p1), ("other", other), ("a", p3)):
    pre = r.prefill(p, [])
    toks, _ = r.decode(pre, MAX, stop_ids=llm.tokenizer.stop_ids)
    r.release(pre.seq)
    want[rid] = (toks.tolist(), sum(x.n for x in pre.runs if x.tier != "reject"))
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=32, decode_steps=4))
  mech = eng.add_mechanism(Reuse(ReuseRunner(llm, cfg, attn_impl="reference",
                                             kv=eng.kv_manager)))
  started, got = prefill_starts(eng, mech, [_request(rid, p) for rid, p in
                                            (("seed", p1), ("other", other), ("a", p3))])
  side_by_side = budget > 4096
  assert (started["other"] == started["seed"]) == side_by_side, started
  assert started["a"] > started["seed"]
  stop = set(llm.tokenizer.stop_ids)
  for rid, (toks, reused) in want.items():
    assert got[rid].tokens == clip(toks, stop), rid
    assert got[rid].extra["reused_tokens"] == reused, rid
  assert want["a"][1] > 0 or budget == 4096
  eng.kv_manager.check()


def test_cancel_and_bad_context_free_everything(llm):
  p1, _, p3 = _prompts(seed=6)
  eng, mech = _engine(llm, "tiered")
  list(eng.run([_request("seed", p1)]))
  eng.submit(_request("mid", p3, max_tokens=40))
  eng.step()                                   # one 32-token piece of a 170-token prompt
  assert eng.busy and "mid" not in eng.progress()       # no token yet
  assert eng.cancel("mid")                     # cancelled inside its prefill
  (res,) = eng.step()
  assert res.finish_reason == "cancelled" and res.tokens == []
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and mech.runner.radix.locked_tokens == 0
  eng.submit(_request("c", p3, max_tokens=40))
  while "c" not in eng.progress():             # prefilled, first token out
    eng.step()
  assert eng.cancel("c")
  (res,) = eng.step()
  assert res.finish_reason == "cancelled" and len(res.tokens) >= 1
  (res,) = list(eng.run([Request("bad", p3.tolist(), mechanism="reuse",
                                 context={"spans": [(5, 2)]})]))
  assert res.finish_reason == "error" and "spans" in res.error
  eng.kv_manager.check()
  assert eng.allocator.sequences() == [] and mech.runner.radix.locked_tokens == 0


@pytest.mark.parametrize("method", ["none", "cacheblend"])
def test_a_long_prompt_delays_decoding_rows_by_one_chunk_at_most(llm, method):
  """A long reuse prompt is prefilled one 32-token piece per engine step (each layer
  pass of a blend plan too): a row already decoding gets its decode call in every one
  of those steps, never waiting for the whole prompt; the reuse row's tokens and
  first-token logits equal the runner's one call per pass."""
  p1, _, p3 = _prompts(seed=3)
  want, _ = _runner_answers(llm, method, [p1, p3])
  eng, mech = _engine(llm, method, max_batch=2)
  list(eng.run([_request("seed", p1)]))
  steps, got = beside_a_decoding_row(eng, _request("r", p3), 4)
  assert steps >= -(-len(p3) // 32) - 1               # the prompt took a step per piece
  pre, toks = want[1]
  assert got["r"].tokens == clip(toks, set(llm.tokenizer.stop_ids))
  np.testing.assert_allclose(mech.logits["r"], pre.logits, atol=1e-5, rtol=0)
  if method == "cacheblend":
    assert got["r"].extra["reused_tokens"] > 0
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
