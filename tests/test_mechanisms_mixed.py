"""Mechanisms compose in one engine: a plain request, a pruned session turn
(IntentKV), a segment-reuse request, a SemShareKV request and a MemArt session turn
decode in the same engine step over one KV manager, each row giving the tokens of its
run alone; the pool, the allocator and every radix tree are clean afterwards.

A random 6-layer model with SmolLM2's real tokenizer and chat template."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import (
  CacheConfig,
  EngineConfig,
  MemArtConfig,
  PruningConfig,
  ReuseConfig,
  SamplingConfig,
  SemShareConfig,
)
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.mechanisms.semshare import SemShare
from jaxkv.engine.memart import MemArtSessions
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.engine.semshare import SemShareRunner
from test_reuse import _prompts
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
MAX = 16


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _engine(llm, mesh=None, max_batch=5):
  """An engine with the four mechanisms, after the history the requests build on:
  a prompt stored for reuse, a reference stored for SemShareKV (`mesh`: on a
  `jaxkv.sharding` mesh, as tests/sharding_worker.py runs it)."""
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=512, decode_steps=4), mesh=mesh)
  kv = eng.kv_manager
  eng.add_mechanism(Pruned(llm.tokenizer, llm.config, kv,
                           PruningConfig(method="intentkv", budget=64)))
  eng.add_mechanism(Reuse(ReuseRunner(llm, ReuseConfig(method="cacheblend", storage="float32",
                                                       cut_every=2), attn_impl="reference",
                                      kv=kv)))
  eng.add_mechanism(SemShare(SemShareRunner(llm, SemShareConfig(threshold=0.0),
                                            attn_impl="reference", kv=kv)))
  eng.add_mechanism(MemArt(MemArtSessions(llm, MemArtConfig(block_size=16, top_k=4), CACHE,
                                          attn_impl="reference", kv=kv)))
  p1, _, _ = _prompts(seed=7)
  ref = np.random.default_rng(8).integers(100, 40000, 160)
  list(eng.run([_req("seed-r", p1, "reuse"), _req("seed-s", ref, "semshare")]))
  return eng


def _req(rid, prompt, mechanism=None, context=None):
  return Request(rid, [int(t) for t in prompt], SamplingConfig(max_tokens=MAX),
                 mechanism=mechanism, context=context)


def _requests(llm, eng):
  _, _, p3 = _prompts(seed=7)
  target = np.random.default_rng(8).integers(100, 40000, 160)
  target[100:110] = 7
  prompt, ctx = eng.mechanisms["pruned"].context("s", MESSAGES[:4])
  plain = np.random.default_rng(9).integers(100, 40000, 50)
  chat = []
  for fact in ("My sister Ana lives in Lisbon and teaches piano to children.",
               "The spare key is under the blue flower pot by the back door.",
               "Our team ships the billing service every Tuesday after lunch."):
    chat += [{"role": "user", "content": fact}, {"role": "assistant", "content": "Noted."}]
  chat.append({"role": "user", "content": "Where is the spare key?"})
  return [_req("pruned", prompt, "pruned", ctx), _req("reuse", p3, "reuse"),
          _req("semshare", target, "semshare"), _req("plain", plain),
          _req("memart", llm.encode(chat), "memart", eng.mechanisms["memart"].context("m", chat))]


def test_five_mechanisms_in_one_step_equal_their_runs_alone(llm):
  alone = {}
  for i in range(5):
    eng = _engine(llm)
    req = _requests(llm, eng)[i]
    (res,) = list(eng.run([req]))
    alone[req.id] = res
  eng = _engine(llm)
  seen = []
  decode = eng._decode

  def spy(rows):
    seen.append({r.req.mechanism for r in rows if r is not None and r.finish is None
                 and r.prefilled == r.n})
    decode(rows)

  eng._decode = spy
  got = {r.id: r for r in eng.run(_requests(llm, eng))}
  assert {None, "pruned", "reuse", "semshare", "memart"} in seen   # one decode call: all five
  for rid, want in alone.items():
    assert got[rid].finish_reason in ("stop", "length"), got[rid].error
    assert got[rid].tokens == want.tokens, rid
    assert got[rid].extra == want.extra, rid
  assert got["pruned"].extra["pruned"] and got["reuse"].extra["reused_tokens"] > 0
  assert got["semshare"].extra["reused"] and got["memart"].extra["retrieved_blocks"] > 0
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  for tree in eng.kv_manager.trees():
    tree.check()
    assert tree.locked_tokens == 0


def test_cancel_and_an_exception_mid_batch_free_every_mechanism(llm):
  """Rows of every mechanism in flight: one is cancelled mid-decode, then a decode call
  raises (as a failing step does in a server) and the engine aborts the batch; the
  allocator, every radix tree, SemShareKV's reference holds and MemArt's writers are
  clean, and the engine serves the same requests again afterwards."""
  eng = _engine(llm)
  reqs = _requests(llm, eng)
  for r in reqs:
    eng.submit(r)
  eng.step()
  eng.step()                                       # every row prefilled, some decoding
  assert eng.cancel("reuse")
  decode = eng.driver.decode
  calls = []

  def failing(*a, **kw):
    calls.append(1)
    raise RuntimeError("device lost")

  eng.driver.decode = failing
  with pytest.raises(RuntimeError, match="device lost"):
    eng.step()
  assert calls
  out = {r.id: r for r in eng.abort("device lost")}
  assert {r.id for r in reqs} - {"reuse"} <= set(out) and all(
      r.finish_reason == "error" for r in out.values())
  eng.driver.decode = decode
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  for tree in eng.kv_manager.trees():
    assert tree.locked_tokens == 0
  assert not eng.mechanisms["semshare"].runner._holds
  assert not eng.mechanisms["memart"]._writing
  again = {r.id: r for r in eng.run(_requests(llm, eng))}
  assert all(r.finish_reason in ("stop", "length") for r in again.values()), again
