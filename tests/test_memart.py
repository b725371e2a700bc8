"""MemArt (seed 003) retrieval: the AABB bound (eq. 3) against every key's score,
retrieval (Table 1's four strategies, chronological top-k) against a brute-force
numpy implementation, and de-rotation. Fresh random inputs every run;
tolerances: 1e-4 relative on fp32 dot products."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.config import MemArtConfig, RopeConfig
from jaxkv.policies.memory import memart
from jaxkv.rope import apply_rope, delta_frequencies


def _blocks(rng, l, nb, bs, hkv, d, fill=0.8):
  k = rng.standard_normal((l, nb, bs, hkv, d)).astype(np.float32)
  valid = rng.random((nb, bs)) < fill
  valid[:, 0] = True                      # every block holds at least one token
  return k, valid


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), g=st.sampled_from([1, 3]), bs=st.sampled_from([1, 8, 16]),
       scale=st.floats(0.1, 10.0))
def test_aabb_bound_is_an_upper_bound_of_every_key_score(seed, g, bs, scale):
  rng = np.random.default_rng(seed)
  l, nb, hkv, d, t = 2, 5, 2, 8, 3
  k, valid = _blocks(rng, l, nb, bs, hkv, d)
  k *= scale
  q = rng.standard_normal((l, t, hkv * g, d)).astype(np.float32) * scale
  lo, hi = memart.block_boxes(jnp.asarray(k), jnp.asarray(valid))
  bound = np.asarray(memart.box_bound(jnp.asarray(q), lo, hi))        # [L, T, H, NB]
  exact = np.asarray(memart.exact_block_max(jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid)))
  # every valid key, one by one (the head -> KV head map of GQA)
  for li, ti, h, n, b in itertools.product(range(l), range(t), range(hkv * g), range(nb),
                                           range(bs)):
    if valid[n, b]:
      s = float(q[li, ti, h] @ k[li, n, b, h // g])
      assert bound[li, ti, h, n] >= s - 1e-4 * (1 + abs(s)), (bound[li, ti, h, n], s)
  assert np.all(bound >= exact - 1e-4 * (1 + np.abs(exact)))
  if bs == 1:                             # a one-key box is the key itself: the bound is exact
    np.testing.assert_allclose(bound, exact, rtol=1e-4, atol=1e-4)


def test_empty_block_scores_minus_infinity():
  rng = np.random.default_rng()
  k, valid = _blocks(rng, 1, 3, 4, 1, 4)
  valid[1] = False
  lo, hi = memart.block_boxes(jnp.asarray(k), jnp.asarray(valid))
  s = np.asarray(memart.box_bound(jnp.asarray(rng.standard_normal((1, 2, 1, 4)), jnp.float32),
                                  lo, hi))
  assert np.all(np.isneginf(s[..., 1])) and np.all(np.isfinite(s[..., [0, 2]]))


def _brute_force(q, lo, hi, live, times, k, norm, agg, scale, c, qvalid):
  """Eq. 3 + Table 1 + chronological top-k, loop by loop in numpy."""
  l, t, h, d = q.shape
  nb, hkv = lo.shape[1], lo.shape[2]
  g = h // hkv
  agg_s = np.zeros(nb) if agg == "sum" else np.full(nb, 0.0)
  for li, ti, hi_ in itertools.product(range(l), range(t), range(h)):
    if not qvalid[ti]:
      continue
    s = np.full(nb, -np.inf)
    for n in range(nb):
      if live[n]:
        qq = q[li, ti, hi_].astype(np.float64)
        s[n] = np.sum(np.maximum(qq * hi[li, n, hi_ // g], qq * lo[li, n, hi_ // g]))
    if norm == "softmax":
      e = np.where(live, np.exp(scale * (s - s[live].max())), 0.0)
      w = e / e.sum()
    else:
      order = sorted(np.flatnonzero(live), key=lambda n: (-s[n], n))
      w = np.zeros(nb)
      for r, n in enumerate(order, 1):
        w[n] = 1.0 / (r + c)
    agg_s = agg_s + w if agg == "sum" else np.maximum(agg_s, w)
  cand = sorted(np.flatnonzero(live), key=lambda n: (-agg_s[n], n))[:k]
  chron = sorted(cand, key=lambda n: times[n])
  return np.array(chron + [-1] * (k - len(chron))), agg_s


@pytest.mark.parametrize("norm,agg", [("softmax", "max"), ("softmax", "sum"), ("rr", "max"),
                                      ("rr", "sum")])
def test_retrieve_equals_brute_force_scoring(norm, agg):
  rng = np.random.default_rng()
  l, nb, bs, hkv, g, d, t = 2, 24, 4, 2, 3, 8, 5
  k, valid = _blocks(rng, l, nb, bs, hkv, d)
  q = rng.standard_normal((l, t, hkv * g, d)).astype(np.float32)
  live = rng.random(nb) < 0.7
  times = rng.permutation(nb).astype(np.int32)             # chronology is not block order
  qvalid = np.array([True] * (t - 1) + [False])
  lo, hi = memart.block_boxes(jnp.asarray(k), jnp.asarray(valid))
  cfg = MemArtConfig(norm=norm, agg=agg)
  scale = 1 / np.sqrt(d)
  for top_k in (3, int(live.sum()) + 4):                   # also more than the live blocks
    got, got_s = memart.retrieve(jnp.asarray(q), jnp.asarray(qvalid), lo, hi, jnp.asarray(live),
                                 jnp.asarray(times), k=top_k, norm=norm, agg=agg,
                                 scale=float(scale), rr_c=cfg.rr_c)
    want, want_s = _brute_force(q, np.asarray(lo), np.asarray(hi), live, times, top_k, norm,
                                agg, scale, cfg.rr_c, qvalid)
    np.testing.assert_allclose(np.asarray(got_s)[live], want_s[live], rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(got), want)
    sel = np.asarray(got)[np.asarray(got) >= 0]
    assert np.all(np.diff(times[sel]) > 0)                 # chronological
    assert np.all(live[sel])


def _dilate_brute(scores, live, times, segment, n):
  out = np.full(scores.size, -np.inf, np.float32)
  by_time = {int(times[j]): j for j in np.flatnonzero(live)}
  for j in np.flatnonzero(live):
    best = scores[j]
    for step in (1, -1):                # walk while the neighbour is live, adjacent, same span
      for d in range(1, n + 1):
        i = by_time.get(int(times[j]) + step * d)
        if i is None or segment[i] != segment[j]:
          break
        best = max(best, scores[i])
    out[j] = best
  return out


@pytest.mark.parametrize("n", [0, 1, 2])
def test_dilate_equals_brute_force(n):
  """`dilate`: a live block's score is the best within n chronological, live,
  same-span neighbours (an evicted block or another span stops the window)."""
  rng = np.random.default_rng()
  nb = 40
  times = rng.permutation(nb).astype(np.int32)                   # rows out of time order
  cuts = np.sort(rng.choice(np.arange(1, nb), 6, replace=False))
  segment = np.searchsorted(cuts, times, side="right").astype(np.int32)  # runs in time
  live = rng.random(nb) < 0.8
  scores = rng.standard_normal(nb).astype(np.float32)
  got = np.asarray(memart.dilate(jnp.asarray(scores), jnp.asarray(live), jnp.asarray(times),
                                 jnp.asarray(segment), n))
  np.testing.assert_array_equal(got, _dilate_brute(scores, live, times, segment, n))


def test_neighbors_take_windows_around_the_best_blocks():
  """With neighbors n, top-k = the best block's window of 2n + 1 blocks, cut at
  its span's edge; the window then goes on to the next best block's."""
  times = np.arange(12, dtype=np.int32)
  segment = np.array([0] * 5 + [1] * 7, np.int32)
  live = np.ones(12, bool)
  live[9] = False                                                  # evicted
  scores = np.zeros(12, np.float32)
  scores[[4, 8, 2]] = [3.0, 2.0, 1.0]
  d = memart.dilate(jnp.asarray(scores), jnp.asarray(live), jnp.asarray(times),
                    jnp.asarray(segment), 1)
  pick = lambda k: set(np.asarray(memart.select_blocks(
      d, jnp.asarray(live), jnp.asarray(times), k, tie=jnp.asarray(scores))).tolist())
  assert pick(2) == {3, 4}                       # 5 is another span: the window stops
  assert pick(3) == {3, 4, 8}                    # a window's ties: its best block first
  assert pick(4) == {3, 4, 7, 8}                 # 9 is evicted
  assert pick(5) == {2, 3, 4, 7, 8}


def test_softmax_weights_sum_to_one_over_live_blocks():
  rng = np.random.default_rng()
  s = jnp.asarray(rng.standard_normal((3, 10)), jnp.float32)
  live = jnp.asarray(rng.random(10) < 0.6).at[0].set(True)
  w = np.asarray(memart.normalise(s, live, "softmax", 1.0, 60.0))
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  assert np.all(w[:, ~np.asarray(live)] == 0)
  rr = np.asarray(memart.normalise(s, live, "rr", 1.0, 0.0))
  assert np.isclose(rr.max(-1), 1.0).all()                # the best block: 1 / (1 + 0)


def test_derotate_inverts_rope_and_tightens_boxes():
  rng = np.random.default_rng()
  inv_freq = delta_frequencies(RopeConfig(theta=10000.0), 64)
  # one content vector repeated over 16 positions: content-only keys coincide
  base = rng.standard_normal((1, 1, 1, 2, 64)).astype(np.float32)
  raw = np.repeat(base, 16, axis=2)                              # [L, NB, BS, Hkv, D]
  pos = np.arange(100, 116, dtype=np.int32)
  roped = apply_rope(jnp.asarray(raw[0]), jnp.asarray(pos)[None], inv_freq)[None]  # [1,1,16,2,64]
  back = memart.derotate(roped.reshape(1, 16, 2, 64), jnp.asarray(pos), inv_freq)
  np.testing.assert_allclose(np.asarray(back), raw.reshape(1, 16, 2, 64), atol=1e-4)
  ones = jnp.ones((1, 16), bool)
  lo_r, hi_r = memart.block_boxes(back.reshape(1, 1, 16, 2, 64), ones)
  lo_p, hi_p = memart.block_boxes(roped, ones)
  assert float(jnp.sum(hi_r - lo_r)) < 1e-2 * float(jnp.sum(hi_p - lo_p))


def test_config_rejects_bad_values():
  for bad in (dict(norm="mean"), dict(agg="avg"), dict(box_keys="post"), dict(top_k=0),
              dict(block_size=0), dict(rr_c=-1.0), dict(rerank=-1),
              dict(neighbors=-1), dict(box_heads="all")):
    with pytest.raises(ValueError):
      MemArtConfig(**bad)


def test_blocks_aliased_at_new_positions_equal_a_fresh_prefill_there():
  """Decoupled positions (eq. 6) without copies: history written at positions
  100.. and aliased at 0.. with key_shift -100 gives the question the logits of a
  prefill of history + question at 0.. (RoPE attention is shift-invariant);
  tolerance 1e-4, fp32 rotation angles."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from jaxkv.config import CacheConfig, ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxkv.kv import state as kv_state  # pylint: disable=import-outside-toplevel
  from jaxkv.models.llama import Transformer  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng()
  cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6)
  model = Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  hist = rng.integers(0, 97, 40).astype(np.int32)
  qtok = rng.integers(0, 97, 8).astype(np.int32)
  cache = CacheConfig(num_pages=16, page_size=16, max_seq_len=160)
  pool = kv_state.init_pool(cfg, cache)
  # history written at positions 100..139 into slots 16..55
  smap = np.zeros((1, 140), np.int32)
  smap[0, 100:] = 16 + np.arange(40)
  out = model(jnp.asarray(hist[None]), jnp.asarray(100 + np.arange(40, dtype=np.int32))[None],
              pool, slot_map=jnp.asarray(smap))
  pool = out.kv
  # the question aliases those slots at 0..39 and writes its own at 40..47 (slots 64..71)
  qmap = np.concatenate([16 + np.arange(40), 64 + np.arange(8)]).astype(np.int32)[None]
  shift = np.concatenate([np.full(40, -100), np.zeros(8)]).astype(np.int32)[None]
  got = model(jnp.asarray(qtok[None]), jnp.asarray(40 + np.arange(8, dtype=np.int32))[None],
              pool, slot_map=jnp.asarray(qmap), key_shift=jnp.asarray(shift))
  fresh = kv_state.init_pool(cfg, cache)
  both = np.concatenate([hist, qtok])[None]
  want = model(jnp.asarray(both), jnp.asarray(np.arange(48, dtype=np.int32))[None], fresh,
               slot_map=jnp.asarray((16 + np.arange(48, dtype=np.int32))[None]))
  np.testing.assert_allclose(np.asarray(model.logits(got.hidden)),
                             np.asarray(model.logits(want.hidden))[:, 40:], atol=1e-4, rtol=1e-4)
  # without the shift the aliased keys sit 100 positions off: the logits differ
  off = model(jnp.asarray(qtok[None]), jnp.asarray(40 + np.arange(8, dtype=np.int32))[None],
              pool, slot_map=jnp.asarray(qmap))
  assert np.abs(np.asarray(model.logits(off.hidden)) -
                np.asarray(model.logits(want.hidden))[:, 40:]).max() > 1e-3


def test_pooled_boxes_span_every_head_and_still_bound():
  """`box_heads=pooled`: one box per layer and block over every KV head's keys =
  the per-head boxes' min / max over heads; its eq. 3 bound is >= the per-head
  bound >= every key's score."""
  rng = np.random.default_rng()
  l, slots_n, hkv, g, d, bs, nb = 2, 64, 3, 2, 8, 4, 5
  pool_k = jnp.asarray(rng.standard_normal((l, slots_n, hkv, d)), jnp.float32)
  slots = jnp.asarray(rng.permutation(slots_n)[:nb * bs].reshape(nb, bs), jnp.int32)
  valid = rng.random((nb, bs)) < 0.7
  valid[:, 0] = True
  pos = jnp.asarray(rng.integers(0, 500, (nb, bs)), jnp.int32)
  inv = delta_frequencies(RopeConfig(), d)
  lo, hi = memart.pool_boxes(pool_k, slots, jnp.asarray(valid), pos, inv, raw=True)
  plo, phi = memart.pool_boxes(pool_k, slots, jnp.asarray(valid), pos, inv, raw=True, pooled=True)
  assert plo.shape == (l, nb, 1, d)
  np.testing.assert_array_equal(plo[:, :, 0], lo.min(axis=2))
  np.testing.assert_array_equal(phi[:, :, 0], hi.max(axis=2))
  q = jnp.asarray(rng.standard_normal((l, 3, hkv * g, d)), jnp.float32)
  each, pooled = memart.box_bound(q, lo, hi), memart.box_bound(q, plo, phi)
  keys = memart.derotate(pool_k[:, slots.reshape(-1)], pos.reshape(-1), inv)
  exact = memart.exact_block_max(q, keys.reshape(l, nb, bs, hkv, d), jnp.asarray(valid))
  assert np.all(np.asarray(pooled) >= np.asarray(each) - 1e-4)
  assert np.all(np.asarray(each) >= np.asarray(exact) - 1e-4)
