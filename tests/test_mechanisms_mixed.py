"""Mechanisms compose in one engine: a plain request, a pruned session turn
(IntentKV), a segment-reuse request, a SemShareKV request, a MemArt session turn and
an LRAgent role call (base_lr_shared: the engine runs adapter rows decoupled, so the
MemArt row's key shift meets Flash-LoRA attention) decode in the same engine step over
one KV manager, each row giving the tokens of its run alone; the pool, the allocator
and every radix tree are clean afterwards.

A random 6-layer model with SmolLM2's real tokenizer and chat template, random
shared-A role adapters."""

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
from jaxkv.data import agents
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.agents import Agents
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.mechanisms.semshare import SemShare
from jaxkv.engine.memart import MemArtSessions
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.engine.semshare import SemShareRunner
from test_agents import _lora
from test_reuse import _prompts
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
MAX = 16


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _engine(llm, mesh=None, max_batch=6):
  """An engine with the five mechanisms, after the history the requests build on:
  a prompt stored for reuse, a reference stored for SemShareKV, an agents session's
  first call (`mesh`: on a `jaxkv.sharding` mesh, as tests/sharding_worker.py runs it)."""
  w = _lora(llm)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=max_batch, prefill_chunk=512, decode_steps=4), mesh=mesh,
               lora=w, lr_rank=w.rank)
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
  eng.add_mechanism(Agents(eng, "base_lr_shared", names=agents.ROLES)).open("team")
  p1, _, _ = _prompts(seed=7)
  ref = np.random.default_rng(8).integers(100, 40000, 160)
  list(eng.run([_req("seed-r", p1, "reuse"), _req("seed-s", ref, "semshare"),
                _req("seed-a", _plan(llm), "agents", {"session": "team"}, adapter=0)]))
  return eng


def _plan(llm):
  return llm.encode([{"role": "user", "content": "Plan a trip to Lisbon in three steps."}])


def _req(rid, prompt, mechanism=None, context=None, adapter=-1):
  return Request(rid, [int(t) for t in prompt], SamplingConfig(max_tokens=MAX),
                 mechanism=mechanism, context=context, adapter=adapter)


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
          _req("memart", llm.encode(chat), "memart", eng.mechanisms["memart"].context("m", chat)),
          _req("agents", _plan(llm) + llm.tokenizer.encode(" Now carry out step one."),
               "agents", {"session": "team"}, adapter=1)]


@pytest.mark.slow
def test_six_kinds_in_one_step_equal_their_runs_alone(llm):
  alone = {}
  for i in range(6):
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
  assert {None, "pruned", "reuse", "semshare", "memart", "agents"} in seen   # one decode call
  assert got["agents"].extra["shared_tokens"] >= len(_plan(llm)) - 1      # read role 0's KV
  for rid, want in alone.items():
    assert got[rid].finish_reason in ("stop", "length"), got[rid].error
    assert got[rid].tokens == want.tokens, rid
    assert got[rid].extra == want.extra, rid
  assert got["pruned"].extra["pruned"] and got["reuse"].extra["reused_tokens"] > 0
  assert got["semshare"].extra["reused"] and got["memart"].extra["retrieved_blocks"] > 0
  eng.kv_manager.check()
  assert eng.mechanisms["agents"].close("team")      # the session's trajectory: its state
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
  held = {r.seq for r in eng.mechanisms["agents"].sessions["team"].regions.values()}
  assert set(eng.allocator.sequences()) == held     # only the session's trajectory
  for tree in eng.kv_manager.trees():
    assert tree.locked_tokens == 0
  assert not eng.mechanisms["semshare"].runner._holds
  assert not eng.mechanisms["memart"]._writing
  again = {r.id: r for r in eng.run(_requests(llm, eng))}
  assert all(r.finish_reason in ("stop", "length") for r in again.values()), again
