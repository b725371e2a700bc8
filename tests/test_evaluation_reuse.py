"""Segment reuse evaluated through the engine (`jaxkv.evaluation.reuse.serve_all`)
equals the batch-1 runner's evaluation (bench/reuse.py's `serve`: prefill, the gold
continuation teacher-forced, then greedy), prompt by prompt: the same plans (prefix
hits, runs and tiers, token-layers computed, bytes spliced), the same greedy tokens,
the same store; first-token logits within 1e-5 and the gold continuation's NLL within
1e-4 (the engine prefills the continuation and runs each layer pass in 32-token
pieces, the runner decodes it and runs each pass whole).

A random 6-layer model with SmolLM2's real tokenizer (as tests/test_reuse.py), fresh
random prompts each run."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import EngineConfig
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.evaluation import reuse as ev
from mechanism_util import clip
from test_mechanism_reuse import CACHE, METHODS, _config
from test_reuse import _prompts

GEN, GOLD = 8, 12


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _workload():
  p1, p2, p3 = _prompts()
  rng = np.random.default_rng()
  gold = lambda: rng.integers(100, 40000, GOLD)
  # stored; spliced (approx / blend); served unscored; exact + radix; radix again
  return [ev.Prompt(p1, [], gold()), ev.Prompt(p3, [], gold()), ev.Prompt(p1[:90], []),
          ev.Prompt(p2, [], gold()), ev.Prompt(p2, [], gold())]


def _runner_eval(llm, method, prompts):
  """bench/reuse.py's `serve`, one prompt at a time on the runner's own pool."""
  r = ReuseRunner(llm, _config(method), cache=CACHE, attn_impl="reference")
  out = []
  for p in prompts:
    pre = r.prefill(p.ids, p.spans)
    if p.continuation is None:
      out.append(ev.Served(pre))
    else:
      _, lp = r.decode(pre, GOLD, forced=p.continuation)
      r.alloc.truncate(pre.seq, pre.ids.size)
      toks, _ = r.decode(pre, GEN, stop_ids=llm.tokenizer.stop_ids)
      out.append(ev.Served(pre, toks, float(-np.mean(lp))))
    r.release(pre.seq)
  return out, r


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "cacheblend"
                                    else m for m in sorted(METHODS)])
def test_engine_evaluation_equals_the_runner(llm, method):
  prompts = _workload()
  want, runner = _runner_eval(llm, method, prompts)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=32, decode_steps=4))
  mech = eng.add_mechanism(Reuse(ReuseRunner(llm, _config(method), attn_impl="reference",
                                             kv=eng.kv_manager)))
  seen = []
  got = ev.serve_all(eng, prompts, GEN, progress=lambda d, n: seen.append((d, n)))
  assert seen[-1] == (len(prompts), len(prompts))
  stop = set(llm.tokenizer.stop_ids)
  for i, (g, w) in enumerate(zip(got, want)):
    for pre in (g.pre, g.twin_pre) if g.twin_pre is not None else (g.pre,):
      assert pre.prefix_hit == w.pre.prefix_hit, f"prompt {i}"
      assert [(r.p_lo, r.n, r.tier) for r in pre.runs] == \
          [(r.p_lo, r.n, r.tier) for r in w.pre.runs], f"prompt {i}"
      np.testing.assert_array_equal(pre.layer_tokens, w.pre.layer_tokens)
      assert pre.bytes_spliced == w.pre.bytes_spliced
      np.testing.assert_allclose(pre.logits, w.pre.logits, atol=1e-5, rtol=0)
    if w.greedy is None:
      assert g.greedy is None and g.nll is None
      continue
    assert g.greedy.tolist() == clip(w.greedy.tolist(), stop), f"prompt {i}"
    assert abs(g.nll - w.nll) < 1e-4, (i, g.nll, w.nll)
  if method != "none":
    assert want[1].pre.runs and want[3].pre.prefix_hit > 0     # splice and radix both ran
  assert mech.runner.store.keys() == runner.store.keys()       # twins stored nothing
  eng.kv_manager.check()
  assert eng.allocator.sequences() == []
  if mech.runner.radix is not None:
    mech.runner.radix.check()
    assert mech.runner.radix.locked_tokens == 0


def test_a_failing_request_names_itself(llm):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=2, prefill_chunk=32, decode_steps=4))
  eng.add_mechanism(Reuse(ReuseRunner(llm, _config("tiered"), attn_impl="reference",
                                      kv=eng.kv_manager)))
  p1, _, _ = _prompts()
  with pytest.raises(RuntimeError, match=r"reuse request 0:twin failed: .*spans"):
    ev.serve_all(eng, [ev.Prompt(p1, [(5, 2)], p1[:4])], GEN)
