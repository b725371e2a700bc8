"""Paged attention reference = dense attention (numpy float64) on random inputs,
with dead slots, ragged lengths, GQA, page sizes 1 and 16, all-dead rows.

The modes cover both formulations of the reference: "prefill" runs the
per-(row, KV head) batched matmuls (and, at t = 128, the query-block loop);
"decode" and "short" (4 queries at each row's end, padding before the start)
stay under REF_PER_ROW_MAX and run the one-matmul-per-row path."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.kv.state import SENTINEL
from pallas_kernels import paged_attention as pa


def dense_attention(q, k, v, keep, q_pos):
  """q [B,Tq,Hq,D]; k,v [B,T,Hkv,D]; keep [B,T] bool; q_pos [B,Tq] -> float64."""
  b, tq, hq, d = q.shape
  hkv = k.shape[2]
  out = np.zeros((b, tq, hq, d))
  for bi in range(b):
    for i in range(tq):
      vis = keep[bi] & (np.arange(k.shape[1]) <= q_pos[bi, i])
      if not vis.any():
        continue
      for h in range(hq):
        kh = h // (hq // hkv)
        s = k[bi, vis, kh].astype(np.float64) @ q[bi, i, h].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[bi, i, h] = p @ v[bi, vis, kh].astype(np.float64)
  return out


def paged_layout(k, v, lengths, keep, page_size, rng):
  """Scatter dense k/v into a pool through randomly permuted pages."""
  b, t, hkv, d = k.shape
  pages_per_seq = -(-t // page_size)
  num_pages = 1 + b * pages_per_seq + 3
  page_ids = rng.permutation(np.arange(1, num_pages))[:b * pages_per_seq]
  page_ids = page_ids.reshape(b, pages_per_seq)
  slot_map = np.zeros((b, t), np.int32)
  k_pool = rng.standard_normal((num_pages * page_size, hkv, d)).astype(np.float32)
  v_pool = rng.standard_normal((num_pages * page_size, hkv, d)).astype(np.float32)
  k_pool[SENTINEL] = 0
  v_pool[SENTINEL] = 0
  for bi in range(b):
    for ti in range(lengths[bi]):
      slot = page_ids[bi, ti // page_size] * page_size + ti % page_size
      k_pool[slot], v_pool[slot] = k[bi, ti], v[bi, ti]
      if keep[bi, ti]:
        slot_map[bi, ti] = slot
  return k_pool, v_pool, slot_map


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dead_fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["prefill", "decode", "short"])
@pytest.mark.parametrize("t", [40, 128])   # 128: the reference's query-block loop
def test_paged_equals_dense(page_size, groups, dead_fraction, mode, t):
  rng = np.random.default_rng()
  b, hkv, d = 3, 2, 32
  hq = hkv * groups
  lengths = np.array([t, 23, 1])
  k = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
  keep = (rng.random((b, t)) >= dead_fraction) & (np.arange(t)[None] < lengths[:, None])
  k_pool, v_pool, slot_map = paged_layout(k, v, lengths, keep, page_size, rng)
  if mode == "prefill":
    q_pos = np.broadcast_to(np.arange(t), (b, t)).copy()
    q_pos[np.arange(t)[None] >= lengths[:, None]] = -1      # padding queries
  elif mode == "short":
    q_pos = lengths[:, None] - 4 + np.arange(4)[None]
    q_pos[q_pos < 0] = -1
  else:
    q_pos = (lengths - 1)[:, None]
  q = rng.standard_normal((b, q_pos.shape[1], hq, d)).astype(np.float32)
  out = ops.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                            jnp.asarray(slot_map), jnp.asarray(q_pos, np.int32))
  out = np.asarray(out)
  ref = dense_attention(q, k, v, keep, q_pos)
  per_row = hkv * hq * q_pos.shape[1] <= pa.REF_PER_ROW_MAX
  assert per_row == (mode != "prefill"), "the modes no longer cover both formulations"
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_dead_slot_gets_exactly_zero_weight():
  """Live keys score far below the sentinel's zero key: if the sentinel leaked
  into the softmax it would take all the weight (and its zero value would zero
  the output). Exact masking keeps the output on the live values."""
  rng = np.random.default_rng()
  d = 16
  q = rng.standard_normal((1, 1, 1, d)).astype(np.float32)
  k_pool = np.zeros((8, 1, d), np.float32)
  v_pool = np.zeros((8, 1, d), np.float32)
  for slot in (3, 4):
    k_pool[slot, 0] = -50.0 * q[0, 0, 0] / np.linalg.norm(q) + 0.1 * rng.standard_normal(d)
    v_pool[slot, 0] = rng.standard_normal(d)
  slot_map = np.array([[3, 0, 4]], np.int32)   # position 1 evicted (sentinel)
  stacked_k = np.stack([rng.standard_normal(k_pool.shape).astype(np.float32), k_pool])
  stacked_v = np.stack([rng.standard_normal(v_pool.shape).astype(np.float32), v_pool])
  out = ops.paged_attention(jnp.asarray(q), jnp.asarray(stacked_k), jnp.asarray(stacked_v),
                            jnp.asarray(slot_map), jnp.asarray([[2]], np.int32), layer=1)
  keep = np.array([[True, False, True]])
  ref = dense_attention(q, k_pool[slot_map], v_pool[slot_map], keep, np.array([[2]]))
  assert np.abs(ref).max() > 0.1
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def test_unknown_impl():
  with pytest.raises(ValueError, match="unknown attention impl"):
    ops.paged_attention(jnp.zeros((1, 1, 1, 2)), jnp.zeros((2, 1, 2)), jnp.zeros((2, 1, 2)),
                        jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                        impl="flashinfer")


def test_key_shift_equals_attention_over_rerotated_copies():
  """Aliasing with a key shift (MemArt's zero-copy re-positioning) reads the keys
  rotated by R(shift): the same as copying them, re-rotated, into fresh slots."""
  from jaxkv.config import RopeConfig  # pylint: disable=import-outside-toplevel
  from jaxkv.kv.splice import rerotate  # pylint: disable=import-outside-toplevel
  from jaxkv.rope import delta_frequencies  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng()
  b, t, hkv, g, d, s = 2, 24, 2, 3, 32, 64
  freq = delta_frequencies(RopeConfig(theta=10000.0), d)
  k_pool = rng.standard_normal((s, hkv, d)).astype(np.float32)
  v_pool = rng.standard_normal((s, hkv, d)).astype(np.float32)
  slot_map = rng.integers(1, s, (b, t)).astype(np.int32)     # aliases may repeat a slot
  slot_map[0, 5] = SENTINEL
  shift = rng.integers(-500, 500, (b, t)).astype(np.int32)
  q = rng.standard_normal((b, 4, hkv * g, d)).astype(np.float32)
  q_pos = np.array([[20, 21, 22, 23], [3, 9, 15, -1]], np.int32)
  got = ops.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                            jnp.asarray(slot_map), jnp.asarray(q_pos),
                            key_shift=jnp.asarray(shift), shift_freq=freq)
  # copies: every (row, t) its own slot, keys re-rotated by the shift
  k_rows = rerotate(jnp.asarray(k_pool[slot_map]).reshape(1, b * t, hkv, d),
                    jnp.zeros(b * t, jnp.int32), jnp.asarray(shift.reshape(-1)), freq)
  k_copy = np.concatenate([np.zeros((1, hkv, d), np.float32), np.asarray(k_rows)[0]])
  v_copy = np.concatenate([np.zeros((1, hkv, d), np.float32), v_pool[slot_map].reshape(-1, hkv, d)])
  copy_map = np.where(slot_map == SENTINEL, SENTINEL,
                      1 + np.arange(b * t, dtype=np.int32).reshape(b, t))
  want = ops.paged_attention(jnp.asarray(q), jnp.asarray(k_copy), jnp.asarray(v_copy),
                             jnp.asarray(copy_map), jnp.asarray(q_pos))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)
  zero = ops.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                             jnp.asarray(slot_map), jnp.asarray(q_pos),
                             key_shift=jnp.zeros((b, t), jnp.int32), shift_freq=freq)
  plain = ops.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                              jnp.asarray(slot_map), jnp.asarray(q_pos))
  np.testing.assert_allclose(np.asarray(zero), np.asarray(plain), atol=1e-6, rtol=1e-6)
  with pytest.raises(ValueError, match="shift_freq"):
    ops.paged_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                        jnp.asarray(slot_map), jnp.asarray(q_pos), key_shift=jnp.asarray(shift))
