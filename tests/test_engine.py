"""Engine end to end on a tiny random Llama: greedy generation through chunked
prefill, paged decode and continuous batching equals HF `generate`; sampling is
seeded per row; bad requests become error results; a small pool queues."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine import driver
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms import Mechanism
from jaxkv.engine.request import Row
from jaxkv.engine.sampling import SamplingParams, sample
from jaxkv.kv import state as kv_state

VOCAB = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return hf_util.tiny_llama(tmp_path_factory.mktemp("tiny"), VOCAB)


def _engine(model, *, max_batch=3, page_size=4, num_pages=64, chunk=8, steps_=4, stop=(),
            impl="auto"):
  return Engine(model, stop, CacheConfig(num_pages=num_pages, page_size=page_size,
                                         max_seq_len=128),
                EngineConfig(max_batch=max_batch, prefill_chunk=chunk, decode_steps=steps_,
                             attention_impl=impl))


def _hf_greedy(hf, prompt, n):
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_generate(tiny):
  hf, model = tiny
  rng = np.random.default_rng(0)
  lengths = [5, 19, 1, 33, 12]        # ragged; more requests than rows
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in lengths]
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=10 + i)) for i, p in enumerate(prompts)]
  eng = _engine(model)
  results = {r.id: r for r in eng.run(reqs)}
  for i, p in enumerate(prompts):
    r = results[str(i)]
    assert r.finish_reason == "length"
    assert r.tokens == _hf_greedy(hf, p, 10 + i), f"request {i}"
  # Every slot went back to the pool.
  assert eng.allocator.num_live_slots == 0
  eng.allocator.check()
  assert eng.metrics.peak_live_slots > 0


def test_engine_runs_the_pallas_kernels(tiny):
  """The engine's attention goes through jaxkv.ops: with the Pallas kernels (run by
  the interpreter here) greedy generation still equals HF generate."""
  hf, model = tiny
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 21)]
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=6)) for i, p in enumerate(prompts)]
  results = {r.id: r.tokens for r in _engine(model, impl="interpret").run(reqs)}
  for i, p in enumerate(prompts):
    assert results[str(i)] == _hf_greedy(hf, p, 6), f"request {i}"


def test_prefill_and_decode_steps_lower_for_cuda_with_pallas(tiny):
  """The engine's jitted steps with attn_impl="pallas" lower for a CUDA GPU, with
  the kernels' set-up built once per step for all layers."""
  _, model = tiny
  graphdef, ws = nnx.split(model)
  eng = _engine(model)
  b, c, t = 2, 16, 128
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  ws_s = jax.tree.map(spec, ws)
  assert eng.kv is None                                  # allocated on the first run
  kv_s = jax.tree.map(spec, kv_state.init_pool(model.cfg, eng.cache_cfg))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  samp = SamplingParams(temperature=f32(b), top_k=i32(b), top_p=f32(b),
                        key=jax.ShapeDtypeStruct((b, 2), jnp.uint32))
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  prefill = jax.export.export(driver.chunk_step, platforms=["cuda"], disabled_checks=disabled)(
      graphdef, ws_s, kv_s, i32(b, c), i32(b, c), i32(b, t), read=i32(b, 1), sampling=samp,
      attn_impl="pallas", greedy_only=True)
  decode = jax.export.export(driver.decode_scan, platforms=["cuda"], disabled_checks=disabled)(
      graphdef, ws_s, kv_s, i32(b), i32(b), i32(b, t), i32(b), stop_ids=i32(2), sampling=samp,
      num_steps=4, attn_impl="pallas", greedy_only=True)
  assert model.cfg.num_layers >= 2
  for exp in (prefill, decode):
    text = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    # The layers share one plan: the live-block table (its sort) is built once per
    # step, outside the per-layer kernel wrapper, not inside it for every layer.
    wrapper = text.split("func.func private @paged_attention(")[1].split("func.func")[0]
    assert "sort" not in wrapper and text.count("call @sort(") == 1


def test_batch_composition_does_not_change_results(tiny):
  _, model = tiny
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 3, 25, 14)]
  sampling = [SamplingConfig(max_tokens=12), SamplingConfig(temperature=1.0, seed=5, max_tokens=12),
              SamplingConfig(temperature=0.7, top_p=0.8, seed=9, max_tokens=12),
              SamplingConfig(temperature=1.2, top_k=5, seed=3, max_tokens=12)]
  reqs = [Request(str(i), p, s) for i, (p, s) in enumerate(zip(prompts, sampling))]
  together = {r.id: r.tokens for r in _engine(model, max_batch=4).run(reqs)}
  alone = {r.id: r.tokens for r in _engine(model, max_batch=1, page_size=1).run(reqs)}
  assert together == alone


def test_stop_tokens_end_a_request(tiny):
  _, model = tiny
  prompt = [5, 6, 7, 8]
  full = next(_engine(model).run([Request("a", prompt, SamplingConfig(max_tokens=12))])).tokens
  stop = full[5]
  first = full.index(stop)
  res = next(_engine(model, stop=[stop]).run([Request("a", prompt, SamplingConfig(max_tokens=12))]))
  assert res.finish_reason == "stop"
  assert res.tokens == full[:first + 1]


def test_bad_requests_are_errors_and_the_run_goes_on(tiny):
  _, model = tiny
  reqs = [Request("long", list(range(1, 120)), SamplingConfig(max_tokens=20)),
          Request("empty", [], SamplingConfig(max_tokens=4)),
          Request("ok", [1, 2, 3], SamplingConfig(max_tokens=4))]
  eng = _engine(model)
  eng.add_mechanism(_FailingFill())     # a plug-in that raises while filling its row
  reqs.insert(2, Request("fill", [5, 6, 7, 8], SamplingConfig(max_tokens=4),
                         mechanism="failing_fill"))
  out = {r.id: r for r in eng.run(reqs)}
  assert out["long"].finish_reason == "error" and "max_seq_len" in out["long"].error
  assert out["empty"].finish_reason == "error"
  assert out["fill"].finish_reason == "error" and "no memory block" in out["fill"].error
  assert out["ok"].finish_reason == "length" and len(out["ok"].tokens) == 4
  assert eng.allocator.num_used_pages == 0         # the failed row's sequence was freed
  eng.allocator.check()


class _FailingFill(Mechanism):
  name = "failing_fill"

  def fill(self, row):
    raise KeyError("no memory block")


def test_small_pool_queues_requests(tiny):
  """A pool that holds about one request at a time still serves them all."""
  _, model = tiny
  rng = np.random.default_rng(2)
  prompts = [rng.integers(1, VOCAB, 20).tolist() for _ in range(4)]
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=8)) for i, p in enumerate(prompts)]
  big = {r.id: r.tokens for r in _engine(model, max_batch=4).run(reqs)}
  small = {r.id: r for r in _engine(model, max_batch=4, num_pages=9).run(reqs)}
  assert {k: v.tokens for k, v in small.items()} == big
  # A request that can never fit is an error, not a hang.
  huge = [Request("x", rng.integers(1, VOCAB, 60).tolist(), SamplingConfig(max_tokens=8))]
  res = next(_engine(model, num_pages=9).run(huge))
  assert res.finish_reason == "error" and "KV pool too small" in res.error
  assert res.error_code == "too_large"        # the server answers it 400, not 500


def test_sample_top_k_one_is_greedy_and_top_p_keeps_mass():
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng()
  logits = jnp.asarray(rng.standard_normal((6, 50)).astype(np.float32) * 3)
  keys = jnp.asarray(np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(i)))
                               for i in range(6)]))
  pos = jnp.arange(6, dtype=jnp.int32)
  params = SamplingParams(jnp.full(6, 1.0), jnp.full(6, 1, jnp.int32), jnp.ones(6), keys)
  got = sample(logits, params, pos, greedy_only=False)
  assert np.array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
  # top_p tiny -> only the most likely token survives.
  params = SamplingParams(jnp.full(6, 1.0), jnp.zeros(6, jnp.int32), jnp.full(6, 1e-4), keys)
  got = sample(logits, params, pos, greedy_only=False)
  assert np.array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
  # Temperature sampling draws from the top-k set only.
  params = SamplingParams(jnp.full(6, 2.0), jnp.full(6, 3, jnp.int32), jnp.ones(6), keys)
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  for p in range(20):
    got = np.asarray(sample(logits, params, pos + 100 * p, greedy_only=False))
    assert all(g in t for g, t in zip(got, top3))


def test_every_64_bit_seed_has_its_own_key():
  """Seeds above 2^32 used to collide with their low 32 bits (PRNGKey in JAX's default
  32-bit mode); seeds in [0, 2^32) keep the keys they always had; out of range: error."""
  from jaxkv.config import SEED_MAX, SEED_MIN
  from jaxkv.engine.sampling import _raw_key
  for s in (0, 1, 12345, (1 << 32) - 1):
    np.testing.assert_array_equal(_raw_key(s), jax.random.key_data(jax.random.PRNGKey(s)))
  seeds = [1, (1 << 32) + 1, 1 << 40, (1 << 62) + 1, -1, SEED_MIN, SEED_MAX]
  keys = {tuple(_raw_key(s)) for s in seeds}
  assert len(keys) == len(seeds)
  with pytest.raises(ValueError, match="seed"):
    SamplingConfig(seed=SEED_MAX + 1)


def test_compile_donation_and_sync_budgets(tiny):
  """Requests of lengths within one bucket reuse the compiled steps; the pool a
  step consumed is deleted (donated); decode syncs with the host once per
  `decode_steps` tokens, never per token, and moves nothing implicitly."""
  import jax
  _, model = tiny
  rng = np.random.default_rng()
  eng = _engine(model, max_batch=2, chunk=32, steps_=4)
  warm = [Request(f"w{i}", rng.integers(1, VOCAB, 17).tolist(), SamplingConfig(max_tokens=9))
          for i in range(3)]
  list(eng.run(warm[:2]))     # prefill packs its rows: batches of 2 and of 1 compile once
  list(eng.run(warm[2:]))
  sizes = driver.chunk_step._cache_size(), driver.decode_scan._cache_size()
  calls = []
  inner = eng.driver.decode

  def counted(*a, **kw):
    calls.append(1)
    with jax.transfer_guard("disallow"):     # every input is already on the device
      return inner(*a, **kw)

  eng.driver.decode = counted
  pool = eng.kv
  reqs = [Request(str(n), rng.integers(1, VOCAB, n).tolist(), SamplingConfig(max_tokens=9))
          for n in range(18, 32, 3)]
  out = list(eng.run(reqs))
  assert all(r.completion_tokens == 9 for r in out)
  assert (driver.chunk_step._cache_size(), driver.decode_scan._cache_size()) == sizes
  assert pool.k.is_deleted() and pool.v.is_deleted()
  # 5 requests in rows of 2: three admission waves, each 8 tokens after prefill = 2 calls
  assert len(calls) == 3 * 2


def test_decode_steps_adapt_to_what_rows_still_need(tiny):
  """decode_steps=16 with 4-token completions runs 4-step scans, not 16-step ones,
  and the tokens equal HF generate's."""
  hf, model = tiny
  rng = np.random.default_rng()
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 6, 3)]   # one chunk each
  eng = _engine(model, steps_=16)
  steps = []
  list(eng.run([Request("w", prompts[0], SamplingConfig(max_tokens=2))]))   # makes the driver
  inner = eng.driver.decode

  def counted(*a, num_steps, **kw):
    steps.append(num_steps)
    return inner(*a, num_steps=num_steps, **kw)

  eng.driver.decode = counted
  out = {r.id: r for r in eng.run([Request(str(i), p, SamplingConfig(max_tokens=5))
                                   for i, p in enumerate(prompts)])}
  assert steps == [4]                 # 1 token from prefill, 4 more in one 4-step scan
  for i, p in enumerate(prompts):
    assert out[str(i)].tokens == _hf_greedy(hf, p, 5)
  list(eng.run([Request("long", prompts[0], SamplingConfig(max_tokens=40))]))
  assert steps[1:] == [16, 16, 8]     # 39 = 16 + 16 + 7: capped, then rounded up


def test_step_api_submit_cancel_and_threads(tiny):
  """submit / step / cancel (what a server's engine loop drives) give run()'s tokens;
  a cancelled row returns its tokens so far and frees every slot; a cancelled queued
  request never runs; submissions from another thread join the running batch."""
  import threading
  import time
  _, model = tiny
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 15, 3, 22)]
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=12)) for i, p in enumerate(prompts)]
  want = {r.id: r.tokens for r in _engine(model, max_batch=2).run(reqs)}

  eng = _engine(model, max_batch=2, steps_=2)
  for r in reqs:
    eng.submit(r)
  assert not eng.cancel("nope")
  got = {}
  first = eng.step()                   # rows 0 and 1 admitted; 2 and 3 queued
  assert first == [] and eng.busy
  while "1" not in eng.progress():     # row 1's 15 prompt tokens take two chunks of 8
    assert eng.step() == []
  assert eng.cancel("1") and eng.cancel("3")
  while eng.busy:
    got.update({r.id: r for r in eng.step()})
  assert got["1"].finish_reason == "cancelled" and 0 < len(got["1"].tokens) < 12
  assert got["1"].tokens == want["1"][:len(got["1"].tokens)]
  assert got["3"].finish_reason == "cancelled" and got["3"].tokens == []
  assert got["0"].tokens == want["0"] and got["2"].tokens == want["2"]
  assert eng.allocator.num_live_slots == 0
  eng.allocator.check()

  def feed():
    for r in reqs:
      time.sleep(0.05)
      eng.submit(r)
  t = threading.Thread(target=feed)
  t.start()
  done, deadline = {}, time.monotonic() + 120
  while len(done) < len(reqs) and time.monotonic() < deadline:
    done.update({r.id: r.tokens for r in eng.step()})
    if not eng.busy:
      time.sleep(0.01)
  t.join()
  assert done == want
  assert eng.allocator.num_live_slots == 0


def test_long_prefill_delays_decoding_rows_by_one_chunk_at_most(tiny):
  """Chunked prefill interleaved with decode: a long prompt is prefilled one chunk per
  engine step, and a row already decoding gets its decode call in every one of those
  steps (it waits for at most one chunk, never the whole prompt); both requests give
  the tokens HF generate gives them alone."""
  hf, model = tiny
  rng = np.random.default_rng(5)
  short = Request("short", rng.integers(1, VOCAB, 6).tolist(), SamplingConfig(max_tokens=40))
  long = Request("long", rng.integers(1, VOCAB, 90).tolist(), SamplingConfig(max_tokens=4))
  eng = _engine(model, max_batch=2, chunk=8, steps_=2)
  eng.submit(short)
  assert eng.step() == [] and len(eng.progress()["short"][0]) == 3   # prefill + 2 decoded
  eng.submit(long)
  got, prefill_steps = {}, 0
  seen = len(eng.progress()["short"][0])
  while eng.busy:
    prefilling = "long" not in eng.progress() and "long" not in got
    got.update({r.id: r for r in eng.step()})
    if prefilling and "short" not in got:
      prefill_steps += 1
      now = len(eng.progress()["short"][0])
      assert now == seen + 2, "the decoding row waited more than one chunk"
      seen = now
  assert prefill_steps == -(-90 // 8)          # one step per chunk of the long prompt
  assert got["short"].tokens == _hf_greedy(hf, short.prompt, 40)
  assert got["long"].tokens == _hf_greedy(hf, long.prompt, 4)
  eng.kv_manager.check()
  assert eng.allocator.num_live_slots == 0


def _prefix_engine(model, num_pages=64):
  return Engine(model, (), CacheConfig(num_pages=num_pages, page_size=4, max_seq_len=128),
                EngineConfig(max_batch=3, prefill_chunk=8, decode_steps=4, prefix_cache=True))


def test_prefix_cache_reproduces_hf_and_prefills_only_the_rest(tiny):
  """Requests sharing a 37-token prefix, in two waves: the second wave adopts the
  cached prefix (and the first wave's replies) and prefills only its own tail;
  every reply equals HF greedy on the full prompt; holds and locks balance."""
  hf, model = tiny
  rng = np.random.default_rng(3)
  shared = rng.integers(1, VOCAB, 37).tolist()
  tails = [rng.integers(1, VOCAB, n).tolist() for n in (3, 9, 1, 14, 6)]
  eng = _prefix_engine(model)
  waves = [[Request(f"a{i}", shared + t, SamplingConfig(max_tokens=6)) for i, t in
            enumerate(tails[:2])],
           [Request(f"b{i}", shared + t, SamplingConfig(max_tokens=6)) for i, t in
            enumerate(tails)]]
  first = {r.id: r for r in eng.run(waves[0])}
  prefilled = eng.metrics.prefill_tokens
  second = {r.id: r for r in eng.run(waves[1])}
  for wave, got in zip(waves, (first, second)):
    for req in wave:
      assert got[req.id].tokens == _hf_greedy(hf, req.prompt, 6), req.id
  assert all(r.cached_tokens == 0 for r in first.values())
  for i, t in enumerate(tails):
    r = second[f"b{i}"]
    # at least the shared prefix; a tail the first wave saw is cached to its last token
    assert 37 <= r.cached_tokens <= 37 + len(t) - 1, (i, r.cached_tokens)
  assert second["b0"].cached_tokens == 37 + len(tails[0]) - 1
  new_prefill = eng.metrics.prefill_tokens - prefilled
  assert new_prefill == sum(len(r.prompt) - second[r.id].cached_tokens for r in waves[1])
  assert eng.metrics.cached_tokens == sum(r.cached_tokens for r in second.values())
  eng.allocator.check()
  eng.radix.check()
  assert eng.radix.locked_tokens == 0
  assert eng.allocator.num_live_slots == eng.radix.num_cached_tokens > 0


def test_prefix_cache_evicts_under_pressure_and_stays_exact(tiny):
  """A pool that holds one request at a time: cached KV of finished requests is
  evicted (LRU) to admit the next, and results still equal HF."""
  hf, model = tiny
  rng = np.random.default_rng(4)
  prompts = [rng.integers(1, VOCAB, 40).tolist() for _ in range(4)]
  eng = _prefix_engine(model, num_pages=14)     # 13 usable pages of 4: one 40+8 request
  got = {r.id: r for r in eng.run(Request(str(i), p, SamplingConfig(max_tokens=8))
                                  for i, p in enumerate(prompts))}
  for i, p in enumerate(prompts):
    assert got[str(i)].finish_reason == "length", got[str(i)].error
    assert got[str(i)].tokens == _hf_greedy(hf, p, 8)
  assert eng.radix.stats.evicted_tokens > 0
  eng.allocator.check()
  eng.radix.check()


def test_prefix_cache_abort_and_cancel_release_locks(tiny):
  _, model = tiny
  eng = _prefix_engine(model)
  shared = list(range(1, 30))
  list(eng.run([Request("warm", shared + [40], SamplingConfig(max_tokens=3))]))
  eng.submit(Request("x", shared + [41, 42], SamplingConfig(max_tokens=50)))
  eng.submit(Request("y", shared + [43], SamplingConfig(max_tokens=50)))
  eng.step()
  assert eng.radix.locked_tokens > 0
  assert eng.cancel("x")
  out = {r.id: r for r in eng.step()}
  assert out["x"].finish_reason == "cancelled"
  aborted = eng.abort("test abort")
  assert [r.id for r in aborted] == ["y"] and aborted[0].finish_reason == "error"
  assert eng.radix.locked_tokens == 0 and not eng.busy
  eng.allocator.check()
  eng.radix.check()


@pytest.mark.parametrize("held", [True, False])
def test_session_hold_keeps_a_turn_cached_under_pressure(tiny, held):
  """A session's latest turn stays in the prefix cache while other requests need
  the pages (held); without a session it is evicted and the next turn recomputes."""
  hf, model = tiny
  rng = np.random.default_rng(5)
  eng = _prefix_engine(model, num_pages=30)    # 29 pages of 4: the hold + one request
  turn1 = rng.integers(1, VOCAB, 40).tolist()
  sid = "agent-1" if held else None
  (r1,) = eng.run([Request("t1", turn1, SamplingConfig(max_tokens=8), session=sid)])
  others = [Request(f"o{i}", rng.integers(1, VOCAB, 40).tolist(), SamplingConfig(max_tokens=8))
            for i in range(3)]
  assert all(r.finish_reason == "length" for r in eng.run(others))
  turn2 = turn1 + r1.tokens + rng.integers(1, VOCAB, 5).tolist()
  (r2,) = eng.run([Request("t2", turn2, SamplingConfig(max_tokens=8), session=sid)])
  assert r2.tokens == _hf_greedy(hf, turn2, 8)
  if held:
    assert r2.cached_tokens == len(turn1) + len(r1.tokens) - 1
    assert eng.sessions["agent-1"] == len(turn2) + 7
    assert eng.close_session("agent-1") and not eng.close_session("agent-1")
  else:
    assert r2.cached_tokens < len(turn1)
  assert eng.radix.locked_tokens == 0
  eng.allocator.check()
  eng.radix.check()


def test_sessions_expire_and_need_the_prefix_cache(tiny):
  _, model = tiny
  eng = _prefix_engine(model)
  list(eng.run([Request("a", [1, 2, 3, 4, 5], SamplingConfig(max_tokens=2), session="s")]))
  assert eng.sessions == {"s": 6} and eng.radix.locked_tokens == 6
  assert eng.expire_sessions(3600) == [] and eng.expire_sessions(0) == ["s"]
  assert eng.sessions == {} and eng.radix.locked_tokens == 0
  with pytest.raises(ValueError, match="prefix_cache"):
    _engine(model).open_session("s")


def test_forced_requests_score_a_continuation_like_hf(tiny):
  """Teacher forcing (`Request.forced`, evaluation through the engine): the engine
  feeds the given continuation, stop tokens in it included, and returns each token's
  log-probability and the greedy token at each step, equal to HF's one forward pass
  over prompt + continuation; a plain row in the same batch gives its solo tokens."""
  hf, model = tiny
  rng = np.random.default_rng(3)
  prompt = rng.integers(1, VOCAB, 21).tolist()
  forced = rng.integers(1, VOCAB, 11).tolist()
  forced[4] = 7                                   # a stop token: it does not end the row
  plain = Request("plain", rng.integers(1, VOCAB, 9).tolist(), SamplingConfig(max_tokens=6))
  solo = next(_engine(model, stop=(7,)).run([plain]))
  eng = _engine(model, stop=(7,), chunk=8)
  got = {r.id: r for r in eng.run([Request("f", prompt, SamplingConfig(max_tokens=3),
                                           forced=forced), plain])}
  f = got["f"]
  assert f.finish_reason == "length" and f.tokens == forced and len(f.logprob) == len(forced)
  with torch.no_grad():
    logits = hf(torch.tensor([prompt + forced])).logits[0].float()
  logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
  want = logp[torch.arange(len(forced)), torch.tensor(forced)].numpy()
  np.testing.assert_allclose(f.logprob, want, atol=1e-4)
  assert f.argmax == logp.argmax(-1).tolist()
  assert got["plain"].tokens == solo.tokens and got["plain"].logprob is None
  assert "at least one" in next(eng.run([Request("e", prompt, forced=[])])).error
  eng.allocator.check()
  # a row whose mechanism reads the pool through a decode view (here a zero key
  # shift: MemArt's kind) is fed by decode steps instead of prefill chunks: same values
  eng.add_mechanism(_ZeroShift())
  g = next(eng.run([Request("v", prompt, forced=forced, mechanism="zero_shift")]))
  assert not eng._forced_by_prefill(Row(Request("x", prompt, forced=forced,
                                                mechanism="zero_shift"), seq=0, admitted=0.0))
  np.testing.assert_allclose(g.logprob, want, atol=1e-4)
  assert g.argmax == f.argmax and g.tokens == forced
  eng.allocator.check()


class _ZeroShift(Mechanism):
  """A mechanism whose decode view is a key shift of zero (no effect on the values)."""
  name = "zero_shift"

  def decode_view(self, row, width):
    return None, np.zeros(width, np.int32)
