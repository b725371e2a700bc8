"""The reuse primitives: splice with exact delta-RoPE re-indexing, zero-copy
aliasing, and selective recompute in the forward pass.

Layer 0's K/V depend only on token and position, so a layer-0 key computed at
one position, spliced and re-rotated to another, must equal a fresh prefill
there (fp32 rounding only): run for every RoPE variant with an exact delta, on
random tiny models and on SmolLM2. Dynamic NTK has none and is refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv.config import CacheConfig, ModelConfig, PruningConfig, RopeConfig
from jaxkv.kv import splice
from jaxkv.kv import state as kv_state
from jaxkv.kv.allocator import PagedAllocator
from jaxkv.models import presets
from jaxkv.models.forward import Recompute
from jaxkv.models.llama import Transformer
from jaxkv.rope import delta_frequencies

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "linear": RopeConfig(kind="linear", factor=4.0),
    "llama3": RopeConfig(kind="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position=64),
    "yarn": RopeConfig(kind="yarn", factor=4.0, original_max_position=64),
}


def key_rtol(max_position: int) -> float:
  """Relative fp32 tolerance of a re-rotated key against a fresh one: the phase
  p * inv_freq carries an fp32 error of ~p * 2^-24 rad on each side (observed:
  2.7e-5 at p = 912 on SmolLM2), so allow p * 2^-23 plus rounding."""
  return 1e-6 + max_position * 2.0 ** -23


def _tiny(rope: RopeConfig, seed: int = 0) -> Transformer:
  cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, rope=rope, rms_norm_eps=1e-6)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def _prefill(model, pool, tokens, start, slots):
  """tokens [n] at positions start.. into `slots` [n]; returns the new pool."""
  n = len(tokens)
  pos = jnp.asarray(start + np.arange(n, dtype=np.int32))[None]
  smap = np.zeros((1, start + n), np.int32)
  smap[0, start:] = slots
  return model(jnp.asarray(tokens)[None], pos, pool, slot_map=jnp.asarray(smap)).kv


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)


def _check_layer0_splice(model, tokens, old_start, new_start):
  """Prefill at old_start, splice to new_start, compare with a fresh prefill there."""
  n = len(tokens)
  pool = kv_state.init_slots(model.cfg, 1 + 3 * n, jnp.float32)
  src = 1 + np.arange(n, dtype=np.int32)
  dst = 1 + n + np.arange(n, dtype=np.int32)
  fresh = 1 + 2 * n + np.arange(n, dtype=np.int32)
  pool = _prefill(model, pool, tokens, old_start, src)
  pool = _prefill(model, pool, tokens, new_start, fresh)
  inv_freq = delta_frequencies(model.cfg.rope, model.cfg.head_dim)
  pool = jax.jit(splice.splice_slots)(pool, jnp.asarray(src), jnp.asarray(dst),
                                      jnp.asarray(new_start + np.arange(n)), inv_freq)
  k, v = np.asarray(pool.k), np.asarray(pool.v)
  assert _rel(k[0, dst], k[0, fresh]) <= key_rtol(max(old_start, new_start) + n)
  np.testing.assert_array_equal(v[0, dst], v[0, fresh])        # values carry no position
  np.testing.assert_array_equal(np.asarray(pool.positions)[dst], new_start + np.arange(n))
  assert float(np.abs(k[:, 0]).max()) == 0.0                    # the sentinel is untouched
  return k, src, dst, fresh


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_layer0_splice_equals_fresh_prefill(kind):
  model = _tiny(ROPES[kind])
  tokens = np.random.default_rng().integers(0, 97, 24)
  k, src, dst, fresh = _check_layer0_splice(model, tokens, old_start=5, new_start=301)
  # the test can fail: without the rotation the keys are far off
  assert _rel(k[0, src], k[0, fresh]) > 1e-2
  # with no left context at either place, attention is translation invariant under
  # RoPE, so every layer's re-rotated keys match too (rounding compounds with depth)
  assert max(_rel(k[l, dst], k[l, fresh]) for l in (1, 2)) <= 1e-4


@pytest.mark.slow
def test_layer0_splice_equals_fresh_prefill_smollm2():
  llm = jaxkv.load(presets.SMOLLM2)
  ids = np.asarray(llm.tokenizer.encode("The weather tool returned: sunny, 21 degrees."))
  _check_layer0_splice(llm.model, ids, old_start=40, new_start=777)
  _check_layer0_splice(llm.model, ids, old_start=900, new_start=3)


def test_dynamic_ntk_has_no_exact_delta():
  rope = RopeConfig(kind="dynamic", factor=2.0, original_max_position=64)
  with pytest.raises(ValueError, match="dynamic-NTK"):
    delta_frequencies(rope, 16)
  llm = jaxkv.LLM(_tiny(rope), tokenizer=None)
  with pytest.raises(ValueError, match="dynamic-NTK"):
    jaxkv.SessionRunner(llm, PruningConfig(method="h2o", layout="compact", budget=64),
                        cache=CacheConfig(num_pages=8, page_size=16, max_seq_len=64))


def test_splice_rows_from_a_host_store_and_padding_is_dropped():
  model = _tiny(ROPES["default"])
  tokens = np.random.default_rng().integers(0, 97, 8)
  pool = _prefill(model, kv_state.init_slots(model.cfg, 40, jnp.float32), tokens, 0,
                  1 + np.arange(8))
  rows = jax.device_get(splice.gather_rows(pool, jnp.arange(1, 9)))      # host copy
  assert isinstance(rows.k, np.ndarray) and rows.k.shape == (3, 8, 2, 16)
  dest = np.asarray([20, 21, 22, 0, 40, 25, 26, 27], np.int32)   # SENTINEL and out of range
  out = splice.splice_rows(pool, rows, jnp.asarray(dest), jnp.asarray(100 + np.arange(8)),
                           delta_frequencies(model.cfg.rope, 16))
  assert float(jnp.abs(out.k[:, 0]).max()) == 0.0
  np.testing.assert_array_equal(np.asarray(out.positions)[[20, 21, 22, 25]], [100, 101, 102, 105])
  np.testing.assert_array_equal(np.asarray(out.v)[:, 20], rows.v[:, 0])


def test_alias_needs_unchanged_positions_and_takes_holds():
  alloc = PagedAllocator(num_pages=8, page_size=4)
  a = alloc.new_sequence()
  slots = alloc.extend(a, 6)
  b = alloc.new_sequence()
  with pytest.raises(ValueError, match="unchanged positions"):
    splice.alias_slots(alloc, b, slots[2:], written_at=np.arange(2, 6))   # b is empty: 0..3
  splice.alias_slots(alloc, b, slots[:4], written_at=np.arange(4))
  assert [alloc.refcount(s) for s in slots[:4]] == [2] * 4
  np.testing.assert_array_equal(alloc.slot_map(b), slots[:4])
  alloc.free_sequence(a)
  assert alloc.refcount(int(slots[0])) == 1                     # b still holds it
  alloc.check()


# ----------------------------------------------------------------------------- recompute
def _setup_segment(seed=0):
  """Prefix P (7) + segment S (9) + query Q (5) of one tiny model and its pool."""
  model = _tiny(ROPES["default"], seed)
  rng = np.random.default_rng()
  toks = rng.integers(0, 97, 21)
  return model, toks, 1 + np.arange(21, dtype=np.int32)


def _run(model, pool, toks, start, slots_all, recompute=None):
  """Chunk toks[start:] over the slot map 1 + arange (one sequence)."""
  n = len(toks) - start
  pos = jnp.asarray(start + np.arange(n, dtype=np.int32))[None]
  out = model(jnp.asarray(toks[start:])[None], pos, pool,
              slot_map=jnp.asarray(slots_all)[None], recompute=recompute)
  return out


def test_recompute_all_tokens_is_the_normal_prefill():
  model, toks, slots = _setup_segment()
  pool0 = kv_state.init_slots(model.cfg, 32, jnp.float32)
  ref = _run(model, pool0, toks, 0, slots)
  every = jnp.broadcast_to(jnp.arange(21, dtype=jnp.int32), (3, 1, 21))
  got = _run(model, pool0, toks, 0, slots, Recompute(every))
  np.testing.assert_array_equal(np.asarray(got.hidden), np.asarray(ref.hidden))
  np.testing.assert_array_equal(np.asarray(got.kv.k), np.asarray(ref.kv.k))
  np.testing.assert_array_equal(np.asarray(got.kv.v), np.asarray(ref.kv.v))


def test_recompute_none_of_the_reused_tokens_is_pure_reuse():
  """S and P already in the pool: a chunk [S, Q] recomputing only Q (padded index)
  leaves S's K/V untouched and gives Q the outputs of a plain Q-only prefill."""
  model, toks, slots = _setup_segment()
  pool0 = kv_state.init_slots(model.cfg, 32, jnp.float32)
  cached = _run(model, pool0, toks[:16], 0, slots).kv            # P + S in the pool
  ref = _run(model, cached, toks, 16, slots)                     # Q alone
  idx = np.full((3, 1, 8), -1, np.int32)                          # R = 8, Q = chunk 9..13
  idx[:, 0, :5] = 9 + np.arange(5)
  got = _run(model, cached, toks, 7, slots, Recompute(jnp.asarray(idx)))
  np.testing.assert_allclose(np.asarray(got.hidden[0, 9:]), np.asarray(ref.hidden[0]),
                             atol=1e-5, rtol=0)
  for a, b in ((got.kv.k, ref.kv.k), (got.kv.v, ref.kv.v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(got.kv.k)[:, slots[7:16]],
                                np.asarray(cached.k)[:, slots[7:16]])


def test_recompute_blends_a_spliced_segment():
  """CacheBlend's setting: S spliced from another context. Recomputing S at every
  layer reproduces the full prefill; recomputing it nowhere keeps the stale K/V
  beyond layer 0; a nested schedule lies in between, and layer 0 is exact."""
  model, toks, slots = _setup_segment(seed=1)
  other = np.random.default_rng(7).integers(0, 97, 7)            # a different prefix
  pool0 = kv_state.init_slots(model.cfg, 64, jnp.float32)
  full = _run(model, pool0, toks, 0, slots).kv
  side = _run(model, pool0, np.concatenate([other, toks[7:16]]), 0, 33 + np.arange(16)).kv
  base = _run(model, side, toks[:7], 0, slots).kv                # P, beside the side copy
  base = splice.splice_slots(base, jnp.asarray(33 + np.arange(7, 16)), jnp.asarray(slots[7:16]),
                             jnp.asarray(np.arange(7, 16)), delta_frequencies(model.cfg.rope, 16))
  seg = slots[7:16]
  def err(pool):
    return [_rel(np.asarray(pool.k)[l, seg], np.asarray(full.k)[l, seg]) for l in range(3)]
  all_s = jnp.broadcast_to(jnp.arange(14, dtype=jnp.int32), (3, 1, 14))
  exact = _run(model, base, toks, 7, slots, Recompute(all_s)).kv
  assert max(err(exact)) <= 1e-5
  nested = np.full((3, 1, 14), -1, np.int32)
  nested[0, 0] = np.arange(14)                                    # layer 0: everything
  nested[1:, 0, :8] = np.r_[np.arange(3), 9 + np.arange(5)]       # then S's first 3 + Q
  blend = _run(model, base, toks, 7, slots, Recompute(jnp.asarray(nested))).kv
  stale = err(base)
  assert stale[0] <= key_rtol(16) and stale[1] > 1e-3                # layer 0 splice exact
  assert err(blend)[0] <= 1e-5
  assert _rel(np.asarray(blend.k)[2, seg[:3]], np.asarray(full.k)[2, seg[:3]]) < stale[2]


def test_recompute_captures_the_recomputed_rows_queries_and_rejects_bad_shapes():
  """Capture(q) under Recompute hands back the listed rows' queries in index
  order: with every token listed they equal the plain prefill's (1e-6); with
  a subset, layer 0's rows equal the plain prefill's rows (same inputs there)."""
  from jaxkv.models.forward import Capture
  model, toks, slots = _setup_segment()
  pool0 = kv_state.init_slots(model.cfg, 32, jnp.float32)
  call = lambda rc: model(jnp.asarray(toks)[None], jnp.arange(21)[None], pool0,
                          slot_map=jnp.asarray(slots)[None], recompute=rc,
                          capture=Capture(q=True))
  want = np.asarray(call(None).q)                                 # [L, 1, 21, Hq, D]
  every = jnp.broadcast_to(jnp.arange(21, dtype=jnp.int32), (3, 1, 21))
  np.testing.assert_allclose(np.asarray(call(Recompute(every)).q), want, atol=1e-6, rtol=0)
  index = np.array([0, 5, 20, -1], np.int32)
  got = np.asarray(call(Recompute(jnp.asarray(np.broadcast_to(index, (3, 1, 4))))).q)
  assert got.shape == (3, 1, 4) + want.shape[3:]
  np.testing.assert_allclose(got[0, 0, :3], want[0, 0, index[:3]], atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="recompute index"):
    _run(model, pool0, toks, 0, slots, Recompute(jnp.zeros((2, 1, 4), jnp.int32)))
