"""Mechanisms compose in one engine: a plain request, a pruned session turn
(IntentKV), a segment-reuse request and a SemShareKV request decode in the same
engine step over one KV manager, each row giving the tokens of its run alone; the
pool, the allocator and every radix tree are clean afterwards.

A random 6-layer model with SmolLM2's real tokenizer and chat template."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import (
  CacheConfig,
  EngineConfig,
  PruningConfig,
  ReuseConfig,
  SamplingConfig,
  SemShareConfig,
)
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.mechanisms.semshare import SemShare
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.engine.semshare import SemShareRunner
from test_reuse import _prompts
from test_sessions import MESSAGES

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
MAX = 16


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _engine(llm):
  """An engine with the three mechanisms, after the history the requests build on:
  a prompt stored for reuse, a reference stored for SemShareKV."""
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=512, decode_steps=4))
  kv = eng.kv_manager
  eng.add_mechanism(Pruned(llm.tokenizer, llm.config, kv,
                           PruningConfig(method="intentkv", budget=64)))
  eng.add_mechanism(Reuse(ReuseRunner(llm, ReuseConfig(method="cacheblend", storage="float32",
                                                       cut_every=2), attn_impl="reference",
                                      kv=kv)))
  eng.add_mechanism(SemShare(SemShareRunner(llm, SemShareConfig(threshold=0.0),
                                            attn_impl="reference", kv=kv)))
  p1, _, _ = _prompts(seed=7)
  ref = np.random.default_rng(8).integers(100, 40000, 160)
  list(eng.run([_req("seed-r", p1, "reuse"), _req("seed-s", ref, "semshare")]))
  return eng


def _req(rid, prompt, mechanism=None, context=None):
  return Request(rid, [int(t) for t in prompt], SamplingConfig(max_tokens=MAX),
                 mechanism=mechanism, context=context)


def _requests(eng):
  _, _, p3 = _prompts(seed=7)
  target = np.random.default_rng(8).integers(100, 40000, 160)
  target[100:110] = 7
  prompt, ctx = eng.mechanisms["pruned"].context("s", MESSAGES[:4])
  plain = np.random.default_rng(9).integers(100, 40000, 50)
  return [_req("pruned", prompt, "pruned", ctx), _req("reuse", p3, "reuse"),
          _req("semshare", target, "semshare"), _req("plain", plain)]


def test_four_mechanisms_in_one_step_equal_their_runs_alone(llm):
  alone = {}
  for i in range(4):
    eng = _engine(llm)
    req = _requests(eng)[i]
    (res,) = list(eng.run([req]))
    alone[req.id] = res
  eng = _engine(llm)
  seen = []
  decode = eng._decode

  def spy(rows):
    seen.append({r.req.mechanism for r in rows if r is not None and r.finish is None
                 and r.prefilled == len(r.req.prompt)})
    decode(rows)

  eng._decode = spy
  got = {r.id: r for r in eng.run(_requests(eng))}
  assert {None, "pruned", "reuse", "semshare"} in seen       # one decode call held all four
  for rid, want in alone.items():
    assert got[rid].finish_reason in ("stop", "length"), got[rid].error
    assert got[rid].tokens == want.tokens, rid
    assert got[rid].extra == want.extra, rid
  assert got["pruned"].extra["pruned"] and got["reuse"].extra["reused_tokens"] > 0
  assert got["semshare"].extra["reused"]
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  for tree in eng.kv_manager.trees():
    tree.check()
    assert tree.locked_tokens == 0
