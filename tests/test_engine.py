"""Engine end to end on a tiny random Llama: greedy generation through chunked
prefill, paged decode and continuous batching equals HF `generate`; sampling is
seeded per row; bad requests become error results; a small pool queues."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
import torch
import transformers

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine import steps
from jaxkv.engine.engine import Engine, Request
from jaxkv.models import weights

VOCAB = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True)
  torch.manual_seed(1)
  hf = transformers.LlamaForCausalLM(cfg).eval()
  # Sharper logits than the default init so greedy choices are not near-ties.
  with torch.no_grad():
    hf.model.embed_tokens.weight.mul_(25.0)
  hf.save_pretrained(d)
  mcfg, params = weights.load_hf_dir(d)
  return hf, hf_util.build(mcfg, params)


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
  """The engine's jitted steps with attn_impl="pallas" lower for a CUDA GPU."""
  _, model = tiny
  graphdef, ws = nnx.split(model)
  eng = _engine(model)
  b, c, t = 2, 16, 128
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  ws_s = jax.tree.map(spec, ws)
  kv_s = jax.tree.map(spec, eng.kv)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  samp = steps.SamplingParams(temperature=f32(b), top_k=i32(b), top_p=f32(b),
                              key=jax.ShapeDtypeStruct((b, 2), jnp.uint32))
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  prefill = jax.export.export(steps.prefill_step, platforms=["cuda"], disabled_checks=disabled)(
      graphdef, ws_s, kv_s, i32(b, c), i32(b, c), i32(b, t), i32(b), samp,
      attn_impl="pallas", greedy_only=True)
  decode = jax.export.export(steps.decode_steps, platforms=["cuda"], disabled_checks=disabled)(
      graphdef, ws_s, kv_s, i32(b), i32(b), i32(b, t), i32(b), i32(2), samp,
      num_steps=4, attn_impl="pallas", greedy_only=True)
  for exp in (prefill, decode):
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


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
  out = {r.id: r for r in _engine(model).run(reqs)}
  assert out["long"].finish_reason == "error" and "max_seq_len" in out["long"].error
  assert out["empty"].finish_reason == "error"
  assert out["ok"].finish_reason == "length" and len(out["ok"].tokens) == 4


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


def test_sample_top_k_one_is_greedy_and_top_p_keeps_mass():
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng()
  logits = jnp.asarray(rng.standard_normal((6, 50)).astype(np.float32) * 3)
  keys = jnp.asarray(np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(i)))
                               for i in range(6)]))
  pos = jnp.arange(6, dtype=jnp.int32)
  params = steps.SamplingParams(jnp.full(6, 1.0), jnp.full(6, 1, jnp.int32), jnp.ones(6), keys)
  got = steps.sample(logits, params, pos, greedy_only=False)
  assert np.array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
  # top_p tiny -> only the most likely token survives.
  params = steps.SamplingParams(jnp.full(6, 1.0), jnp.zeros(6, jnp.int32), jnp.full(6, 1e-4), keys)
  got = steps.sample(logits, params, pos, greedy_only=False)
  assert np.array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
  # Temperature sampling draws from the top-k set only.
  params = steps.SamplingParams(jnp.full(6, 2.0), jnp.full(6, 3, jnp.int32), jnp.ones(6), keys)
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  for p in range(20):
    got = np.asarray(steps.sample(logits, params, pos + 100 * p, greedy_only=False))
    assert all(g in t for g, t in zip(got, top3))
