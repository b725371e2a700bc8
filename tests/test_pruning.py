"""Pruning policies against direct re-computations (numpy loops) on small random
tensors; budgeted top-k with a forced set; QueryMemory; session keys; the
dead-slot and compact layouts; alias-safe eviction (hypothesis)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import test_ops
from jaxkv import ops
from jaxkv.kv.allocator import PagedAllocator
from jaxkv.kv.state import SENTINEL, KVPool
from jaxkv.policies.pruning import intentkv, scores, select
from jaxkv.rope import apply_rope

L, B, T, HQ, HKV, D = 3, 2, 40, 6, 2, 16


def _rng():
  seed = np.random.randint(1 << 30)
  return seed, np.random.default_rng(seed)


def _qk(rng, w):
  q = rng.standard_normal((L, B, w, HQ, D)).astype(np.float32)
  k = rng.standard_normal((L, B, T, HKV, D)).astype(np.float32)
  live = rng.random((B, T)) > 0.3
  return q, k, live


def _softmax_rows(s, mask):
  """Masked softmax of a vector; zeros where ~mask, all-zero if nothing visible."""
  out = np.zeros_like(s, dtype=np.float64)
  if mask.any():
    e = np.exp(s[mask] - s[mask].max())
    out[mask] = e / e.sum()
  return out


def _summed_attention(q, k, live, q_pos, b):
  """Direct sum over layers, query heads and query rows of each row's causal softmax."""
  g = HQ // HKV
  total = np.zeros(T)
  for l in range(L):
    for h in range(HQ):
      for i in range(q.shape[2]):
        vis = live[b] & (np.arange(T) <= q_pos[b, i])
        total += _softmax_rows(k[l, b, :, h // g] @ q[l, b, i, h] / np.sqrt(D), vis)
  return total


def test_keep_mask_is_forced_plus_top_k():
  seed, rng = _rng()
  b, t = 6, 50
  s = rng.standard_normal((b, t)).astype(np.float32)
  live = rng.random((b, t)) > 0.2
  forced = rng.random((b, t)) > 0.85
  budget = np.array([10, 3, 0, 100, 25, 1])
  got = np.asarray(select.keep_mask(s, live, forced, budget))
  for i in range(b):
    if live[i].sum() <= budget[i]:
      want = live[i]
    else:
      f = forced[i] & live[i]
      cand = np.nonzero(live[i] & ~f)[0]
      k = max(0, budget[i] - f.sum())
      top = cand[np.argsort(-s[i, cand], kind="stable")[:k]]
      want = f.copy()
      want[top] = True
    np.testing.assert_array_equal(got[i], want, err_msg=f"seed={seed} row={i}")
  assert not (got & ~live).any()


def test_streaming_llm_keeps_sinks_and_recent():
  live = np.ones((1, 30), bool)
  live[0, [1, 20]] = False
  sc, forced = scores.streaming_llm(jnp.asarray(live))
  keep = np.asarray(select.keep_mask(sc, live, forced, 10))[0]
  live_pos = np.nonzero(live[0])[0]
  want = set(live_pos[:4]) | set(live_pos[-6:])
  assert set(np.nonzero(keep)[0]) == want


def test_snapkv_matches_direct_computation():
  seed, rng = _rng()
  w = 5
  q, k, live = _qk(rng, w)
  win_pos = np.stack([np.arange(T - w, T), np.arange(T - 12 - w, T - 12)]).astype(np.int32)
  cfg = scores.SnapKVConfig(window=w, kernel=3)
  got, forced = scores.snapkv(q, win_pos, k, live, cfg)
  for b in range(B):
    votes = _summed_attention(q, k, live, win_pos, b)
    pooled = np.array([votes[max(0, j - 1):j + 2].max() for j in range(T)])
    np.testing.assert_allclose(got[b], pooled, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(forced[b], live[b] & (np.arange(T) >= win_pos[b, 0]))


@pytest.mark.parametrize("kernel", [1, 2, 3, 7])
def test_max_pool_matches_direct_computation(kernel):
  """Each pooled position holds the largest score of the positions `where` allows
  within the centred window (left half kernel // 2); the others keep their own."""
  seed, rng = _rng()
  s = rng.standard_normal((B, T)).astype(np.float32)
  where = rng.random((B, T)) > 0.4
  got = np.asarray(scores.max_pool(s, kernel, where=where))
  full = np.asarray(scores.max_pool(s, kernel))
  lo, hi = kernel // 2, kernel - 1 - kernel // 2
  for b in range(B):
    for j in range(T):
      win = slice(max(0, j - lo), j + hi + 1)
      assert full[b, j] == s[b, win].max(), f"seed={seed} b={b} j={j}"
      want = s[b, win][where[b, win]].max() if where[b, j] else s[b, j]
      assert got[b, j] == want, f"seed={seed} b={b} j={j}"


def test_intentkv_pool_keeps_the_top_k_of_the_pooled_scores():
  """intent_pool=k: the kept set is keep_mask over IntentKV's scores max-pooled among
  the candidates (forced and dead tokens lend nothing); intent_pool=1 leaves the
  scores as they are."""
  from jaxkv.config import PruningConfig
  from jaxkv.policies.pruning import policy
  seed, rng = _rng()
  w = 6
  q, k, live = _qk(rng, w)
  q_pos = np.broadcast_to(np.arange(T - w, T, dtype=np.int32), (B, w))
  forced = np.zeros((B, T), bool)
  forced[:, :3] = forced[:, T - w:] = True
  mem = np.zeros((L, B, HQ, D), np.float32)
  cand = live & ~forced
  for pool in (1, 5):
    cfg = PruningConfig(method="intentkv", intent_mode="query", budget=18, intent_pool=pool)
    s, _ = intentkv.intentkv_scores(q, q_pos >= 0, k, cand, mem, policy.intentkv_config(cfg))
    s = np.asarray(s)
    pooled = s.copy()
    for b in range(B):
      for j in np.flatnonzero(cand[b]):
        win = slice(max(0, j - pool // 2), j + pool // 2 + 1)
        pooled[b, j] = s[b, win][cand[b, win]].max()
    want = np.asarray(select.keep_mask(pooled, live, forced, 18))
    got = np.asarray(policy.select_kept(cfg, k, live, forced, q, q_pos, mem)[0])
    np.testing.assert_array_equal(got, want, err_msg=f"seed={seed} pool={pool}")
  with pytest.raises(ValueError, match="intent_pool"):
    PruningConfig(method="intentkv", intent_pool=0)


def test_h2o_matches_direct_computation():
  seed, rng = _rng()
  n = 23
  q, k, live = _qk(rng, n)
  q_pos = np.stack([np.arange(T - n, T), np.r_[np.arange(n - 3), [-1, -1, -1]]]).astype(np.int32)
  acc, forced = scores.h2o(q, q_pos, k, live, 8, scores.H2OConfig(recent_ratio=0.5,
                                                                  query_block=4))
  for b in range(B):
    want = _summed_attention(q, k, live, q_pos, b)
    np.testing.assert_allclose(acc[b], want, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    assert set(np.nonzero(np.asarray(forced[b]))[0]) == set(np.nonzero(live[b])[0][-4:])


def test_rule_score_matches_eq3():
  seed, rng = _rng()
  _, k, live = _qk(rng, 1)
  mem = intentkv.unit_norm(jnp.asarray(rng.standard_normal((L, B, HQ, D)), jnp.float32))
  cand = live & (rng.random((B, T)) > 0.2)
  got = np.asarray(intentkv.rule_scores(mem, k, cand))
  mem = np.asarray(mem)
  g = HQ // HKV
  for b in range(B):
    want = np.zeros(T)
    for l in range(L):
      for h in range(HQ):
        want += _softmax_rows(k[l, b, :, h // g] @ mem[l, b, h] / np.sqrt(D), cand[b])
    np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6, err_msg=f"seed={seed}")
  assert np.allclose(got.sum(1), L * HQ, rtol=1e-5)      # each (l, h) softmax sums to 1


def test_query_memory_recurrence_and_norm():
  seed, rng = _rng()
  q1 = rng.standard_normal((L, B, 4, HQ, D)).astype(np.float32)
  q2 = rng.standard_normal((L, B, 3, HQ, D)).astype(np.float32)
  valid1 = np.ones((B, 4), bool)
  valid2 = np.array([[1, 1, 0], [1, 0, 0]], bool)
  e1 = np.asarray(intentkv.encode_query(q1, valid1))
  np.testing.assert_allclose(e1, q1.mean(2), rtol=1e-5, atol=1e-6)
  m1 = intentkv.update_memory(None, e1, 0.5)
  e2 = np.asarray(intentkv.encode_query(q2, valid2))
  np.testing.assert_allclose(e2[:, 1], q2[:, 1, 0], rtol=1e-5, atol=1e-6)
  m2 = np.asarray(intentkv.update_memory(m1, e2, 0.5))
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  raw = np.exp(-0.5) * np.asarray(m1) + unit(e2)           # Enc(q_t) normalised first
  np.testing.assert_allclose(m2, unit(raw), rtol=1e-5, atol=1e-6, err_msg=f"seed={seed}")
  np.testing.assert_allclose(np.linalg.norm(m2, axis=-1), 1.0, rtol=1e-5)
  literal = np.asarray(intentkv.update_memory(m1, 10 * e2, 0.5, normalize_query=False))
  np.testing.assert_allclose(literal, unit(np.exp(-0.5) * np.asarray(m1) + 10 * e2),
                             rtol=1e-5, atol=1e-6)
  # the normalised memory keeps the previous turn: cos(M_2, Enc_2) < 1 measurably, and
  # unchanged by Enc's scale; the literal form is dominated by a large Enc
  cos = np.asarray(intentkv.memory_cosine(jnp.asarray(m2), e2))
  assert (cos < 0.95).all(), cos
  np.testing.assert_allclose(intentkv.update_memory(m1, 10 * e2, 0.5), m2, rtol=1e-5, atol=1e-6)
  assert (np.asarray(intentkv.memory_cosine(jnp.asarray(literal), e2)) > cos).all()
  k = rng.standard_normal((L, B, T, HKV, D)).astype(np.float32)
  cand = np.ones((B, T), bool)
  for mode, scorer in (("query", intentkv.unit_norm(e2)), ("memory", m2)):
    s, m_new = intentkv.intentkv_scores(q2, valid2, k, cand, m1,
                                        intentkv.IntentKVConfig(mode=mode))
    np.testing.assert_allclose(s, intentkv.rule_scores(scorer, k, cand), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m_new, m2, rtol=1e-5, atol=1e-6)   # stored in every mode


def test_query_memory_store_is_lru():
  store = intentkv.QueryMemoryStore(capacity=2)
  store.put("a", jnp.ones(2))
  store.put("b", jnp.ones(2) * 2)
  assert store.get("a") is not None          # refresh a: b is now least recent
  store.put("c", jnp.ones(2) * 3)
  assert "b" not in store and "a" in store and "c" in store and len(store) == 2
  m, have = store.gather(["c", "zzz"], (2,))
  assert m.shape == (2, 2) and have.tolist() == [True, False] and not m[:, 1].any()
  with pytest.raises(ValueError):
    intentkv.QueryMemoryStore(0)
  with pytest.raises(ValueError, match="mode"):
    intentkv.IntentKVConfig(mode="learnable-ish")


def test_session_key_priority():
  toks = list(range(1000))
  assert intentkv.session_key(session_id="s1", tokens=toks) == ("id", "s1")
  assert intentkv.session_key(tokens=toks, session_span=(3, 6)) == ("span", (3, 4, 5))
  a = intentkv.session_key(tokens=toks)
  b = intentkv.session_key(tokens=toks[:256] + [7] * 50)    # same first P = 256 tokens
  c = intentkv.session_key(tokens=[9] + toks[1:])
  assert a == b and a[0] == "prefix" and a != c
  r1, r2 = intentkv.session_key(), intentkv.session_key()
  assert r1[0] == "request" and r1 != r2                    # never shared


def test_dead_slot_attention_equals_attention_over_kept_set():
  seed, rng = _rng()
  s = 128
  kp = rng.standard_normal((s, HKV, D)).astype(np.float32)
  vp = rng.standard_normal((s, HKV, D)).astype(np.float32)
  kp[0] = vp[0] = 0
  smap = (1 + rng.permutation(s - 1)[:B * T]).reshape(B, T).astype(np.int32)
  live = np.ones((B, T), bool)
  sc = rng.standard_normal((B, T)).astype(np.float32)
  keep = np.asarray(select.keep_mask(sc, live, np.zeros((B, T), bool), 12))
  dead = np.asarray(select.dead_slot_map(smap, keep))
  assert (dead[keep] == smap[keep]).all() and (dead[~keep] == SENTINEL).all()
  q = rng.standard_normal((B, 2, HQ, D)).astype(np.float32)
  q_pos = np.full((B, 2), T - 1, np.int32)
  got = ops.paged_attention_reference(q, kp, vp, dead, q_pos)
  want = test_ops.dense_attention(q, kp[smap], vp[smap], keep, q_pos)
  np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"seed={seed}")


def test_compact_layout_packs_and_rerotates():
  seed, rng = _rng()
  s, t = 96, 20
  inv_freq = 1.0 / (10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
  raw = rng.standard_normal((L, B, t, HKV, D)).astype(np.float32)
  vals = rng.standard_normal((L, B, t, HKV, D)).astype(np.float32)
  pos = np.broadcast_to(np.arange(t), (B, t))
  smap = (1 + np.arange(B * t)).reshape(B, t).astype(np.int32)
  k = np.zeros((L, s, HKV, D), np.float32)
  v = np.zeros((L, s, HKV, D), np.float32)
  for l in range(L):
    k[l, smap] = np.asarray(apply_rope(raw[l], pos, inv_freq))
    v[l, smap] = vals[l]
  positions = np.full((s,), -1, np.int32)
  positions[smap] = pos                     # the pool records where each key was rotated to
  pool = KVPool(k=jnp.asarray(k), v=jnp.asarray(v), positions=jnp.asarray(positions))
  keep = rng.random((B, t)) > 0.5
  n = keep.sum(1)
  dest = np.zeros((B, t), np.int32)
  for b in range(B):
    dest[b, :n[b]] = 50 + 20 * b + np.arange(n[b])
  new_pool, new_map, got_n = select.compact_layout(pool, smap, keep, dest, inv_freq)
  assert got_n.tolist() == n.tolist()
  for b in range(B):
    src = np.nonzero(keep[b])[0]
    new = dest[b, :n[b]]
    assert (np.asarray(new_map)[b, :n[b]] == new).all()
    assert (np.asarray(new_map)[b, n[b]:] == SENTINEL).all()
    for l in range(L):
      want_k = np.asarray(apply_rope(raw[l, b][None, src], np.arange(n[b])[None], inv_freq))[0]
      np.testing.assert_allclose(new_pool.k[l, new], want_k, atol=1e-4, err_msg=f"seed={seed}")
      np.testing.assert_array_equal(new_pool.v[l, new], vals[l, b, src])
    assert (np.asarray(new_pool.positions)[new] == np.arange(n[b])).all()
  assert not np.asarray(new_pool.k[:, 0]).any()               # sentinel untouched


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_dead_slot_eviction_never_frees_a_referenced_slot(data):
  """Random sequences, forks (shared prefixes) and radix-style holds; evicting a
  random drop set frees only slots no other map or hold still references."""
  alloc = PagedAllocator(num_pages=256, page_size=data.draw(st.sampled_from([1, 4, 16])))
  seqs = []
  for _ in range(data.draw(st.integers(1, 4))):
    sq = alloc.new_sequence()
    alloc.extend(sq, data.draw(st.integers(1, 40)))
    seqs.append(sq)
    if data.draw(st.booleans()):
      child = alloc.fork(sq)
      alloc.extend(child, data.draw(st.integers(0, 10)))
      seqs.append(child)
  held = set()
  for sq in seqs:
    m = alloc.slot_map(sq)
    live = m[m != SENTINEL]
    if live.size and data.draw(st.booleans()):
      hold = live[:data.draw(st.integers(1, live.size))]
      alloc.retain(hold)
      held |= set(hold.tolist())
  for _ in range(data.draw(st.integers(1, 4))):
    sq = data.draw(st.sampled_from(seqs))
    n = alloc.length(sq)
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    freed = select.evict_dropped(alloc, sq, keep)
    refs = set()
    for other in seqs:
      refs |= set(alloc.slot_map(other).tolist())
    assert SENTINEL not in set(freed.tolist())
    assert not (set(freed.tolist()) & (refs | held)), "freed a slot still referenced"
    m = alloc.slot_map(sq)
    assert (m[~keep] == SENTINEL).all()
    alloc.check()


@pytest.mark.parametrize("method", ["random", "streaming_llm", "snapkv", "h2o", "intentkv"])
def test_every_method_keeps_budget_many_tokens(method):
  """select_kept keeps exactly max(C, |F|) live tokens for every method (H2O's recent
  floor is a share of C* = C - |F|, SnapKV's window and StreamingLLM's sinks are
  small), so methods compare at equal KV."""
  from jaxkv.config import PruningConfig
  from jaxkv.policies.pruning import policy
  seed, rng = _rng()
  w = 8
  q, k, live = _qk(rng, w)
  q_pos = np.broadcast_to(np.arange(T - w, T, dtype=np.int32), (B, w))
  forced = np.zeros((B, T), bool)
  forced[:, :5] = True
  forced[:, T - w:] = True
  mem = np.zeros((L, B, HQ, D), np.float32)
  compiled = None
  for budget in (20, 13, 27):          # the budget is traced: one compile for the sweep
    cfg = PruningConfig(method=method, budget=budget, snap_window=4, sink=2)
    keep, _ = policy.select_kept(cfg, k, live, forced, q, q_pos, mem)
    keep = np.asarray(keep)
    n_forced = (forced & live).sum(1)
    want = np.where(live.sum(1) <= budget, live.sum(1), np.maximum(budget, n_forced))
    np.testing.assert_array_equal(keep.sum(1), want, err_msg=f"seed={seed} budget={budget}")
    assert not (keep & ~live).any() and (keep | ~(forced & live)).all()
    compiled = compiled or policy._select_kept._cache_size()
  assert policy._select_kept._cache_size() == compiled


def test_random_retention_is_a_seeded_uniform_draw():
  """The chance control keeps the forced set plus C* candidates drawn uniformly: the
  same (seed, event) gives the same set, another seed or event another one, and
  over many events every candidate is kept with probability C* / |candidates|."""
  from jaxkv.config import PruningConfig
  from jaxkv.policies.pruning import policy
  live = np.ones((1, 64), bool)
  live[0, 60:] = False                       # 60 live tokens
  forced = np.zeros((1, 64), bool)
  forced[0, :4] = True                       # C* = 20 - 4 = 16 of 56 candidates
  k = np.zeros((1, 1, 64, 1, 4), np.float32)

  def kept(seed, live_=live):
    cfg = PruningConfig(method="random", budget=20, random_seed=seed)
    return np.asarray(policy.select_kept(cfg, k, live_, forced)[0])[0]

  a, b = kept(0), kept(0)
  np.testing.assert_array_equal(a, b)
  assert a[:4].all() and a.sum() == 20 and not a[60:].any()
  assert not np.array_equal(a, kept(1))
  other = live.copy()
  other[0, 59] = False                       # another event (live count) draws anew
  assert not np.array_equal(a[:59], kept(0, other)[:59])
  freq = np.mean([kept(s)[4:60] for s in range(200)], axis=0)
  np.testing.assert_allclose(freq.mean(), 16 / 56, atol=1e-6)   # exactly C* per draw
  assert np.abs(freq - 16 / 56).max() < 0.13                   # ~4 sigma at n = 200
