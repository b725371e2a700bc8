"""The bound on compiled programs (jaxkv.engine.executables): a release drops the
compiled variants, the next call recompiles and computes the same values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import ServerConfig
from jaxkv.engine import driver, executables, mechanism_rows


def test_the_engine_steps_are_registered():
  steps = (driver.chunk_step, driver.decode_scan, mechanism_rows._sample_one)
  assert executables.count() >= executables.count(steps)
  assert all(any(s is r for r in executables._REGISTERED) for s in steps)


def test_budget_releases_past_its_limit_and_values_survive():
  f = jax.jit(lambda x: jnp.cumsum(x * 2.0))
  xs = [np.arange(n, dtype=np.float32) for n in (3, 5, 7)]
  want = [np.cumsum(x * 2.0) for x in xs]
  budget = executables.Budget(2, steps=[f])
  for x in xs[:2]:
    f(x)
  assert not budget.check() and executables.count([f]) == 2     # at the limit: kept
  f(xs[2])
  assert budget.check() and budget.clears == 1                  # past it: all dropped
  assert executables.count([f]) == 0
  for x, w in zip(xs, want):                                    # recompiled on use
    np.testing.assert_allclose(f(x), w, rtol=0, atol=0)
  assert executables.count([f]) == 3


def test_no_bound_and_bad_limits():
  f = jax.jit(lambda x: x + 1)
  f(1.0)
  f(np.ones(2))
  budget = executables.Budget(0, steps=[f])
  assert not budget.check() and executables.count([f]) == 2
  with pytest.raises(ValueError, match=">= 0"):
    executables.Budget(-1)
  with pytest.raises(ValueError, match="max_compiled"):
    ServerConfig(max_compiled=-1)


def test_an_evaluation_loop_under_the_bound_gives_the_same_tokens(monkeypatch):
  """`executables.step` (what `jaxkv.evaluation` loops run) releases past its limit
  between engine steps, and the engine's requests finish with the tokens of an
  unbounded run (programs reload or recompile on their next call)."""
  import hf_util
  from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
  from jaxkv.engine.engine import Engine, Request

  llm = hf_util.random_llm_with_real_tokenizer(num_layers=2)
  rng = np.random.default_rng()

  def engine():
    return Engine(llm.model, llm.tokenizer.stop_ids,
                  CacheConfig(num_pages=64, page_size=16, max_seq_len=256),
                  EngineConfig(max_batch=2, prefill_chunk=32, decode_steps=4))

  reqs = [Request(str(i), rng.integers(100, 30000, n).tolist(), SamplingConfig(max_tokens=6))
          for i, n in enumerate((9, 40, 70))]
  want = {r.id: r.tokens for r in engine().run(reqs)}
  budget = executables.Budget(1)
  monkeypatch.setattr(executables, "_EVALUATION", budget)
  eng, got = engine(), {}
  for r in reqs:
    eng.submit(r)
  while eng.busy:
    got.update({r.id: r.tokens for r in executables.step(eng)})
  assert got == want
  assert budget.clears >= 1
