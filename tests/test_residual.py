"""IntentKV Phase-2 residual head: parameter count, the day-zero / alpha = 0 floor
(exactly the Phase-1 rule scores and ranking), features and cross-attention
against direct numpy recomputations, alpha clipping, jit equivalence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.policies.pruning import intentkv, residual
from jaxkv.policies.pruning.select import keep_mask

L, B, T, HQ, HKV, D = 3, 2, 24, 6, 2, 16
BUDGET = 10


def _inputs(seed=0):
  """Random keys, unit-normed memory, live / span / candidate masks."""
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((L, B, T, HKV, D)).astype(np.float32)
  mem = np.asarray(intentkv.unit_norm(jnp.asarray(rng.standard_normal((L, B, HQ, D)),
                                                  jnp.float32)))
  live = rng.random((B, T)) > 0.25
  live[:, :2] = True
  span = np.zeros((B, T), bool)
  span[0, T - 6:] = True                       # row 0: query span at the tail
  span[1, 8:13] = True                         # row 1: a span in the middle
  span &= live
  cand = live & ~span
  return jnp.asarray(k), jnp.asarray(mem), jnp.asarray(live), jnp.asarray(span), jnp.asarray(cand)


def _randomise(head, seed=1, scale=0.5):
  """Give every parameter (fc2 included) random non-zero values; alpha kept."""
  graphdef, state = nnx.split(head)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [x if x.shape == () else scale * jax.random.normal(kk, x.shape, x.dtype)
         for x, kk in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, new))


def _set_alpha(head, value):
  head.alpha[...] = jnp.asarray(value, jnp.float32)
  return head


def test_parameter_count():
  assert residual.num_params(residual.ResidualHead(128, rngs=nnx.Rngs(0))) == 214_274
  assert residual.num_params(residual.ResidualHead(64, rngs=nnx.Rngs(0))) == 124_162


def test_fresh_head_is_exactly_phase1():
  k, mem, live, span, cand = _inputs()
  head = residual.ResidualHead(D, rngs=nnx.Rngs(0))
  assert float(head.alpha[...]) == 1.0
  assert not np.any(np.asarray(head.fc2.kernel[...])) and not np.any(np.asarray(head.fc2.bias[...]))
  rule = intentkv.rule_scores(mem, k, cand)
  s = residual.learnable_scores(nnx.split(head), k, mem, cand, span, live=live)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rule))
  np.testing.assert_array_equal(keep_mask(s, live, span, BUDGET),
                                keep_mask(rule, live, span, BUDGET))


def test_alpha_zero_with_random_fc2_is_phase1():
  k, mem, live, span, cand = _inputs(3)
  head = _set_alpha(_randomise(residual.ResidualHead(D, rngs=nnx.Rngs(0))), 0.0)
  assert np.any(np.asarray(head.fc2.kernel[...]))
  rule = intentkv.rule_scores(mem, k, cand)
  s = residual.learnable_scores(head, k, mem, cand, span, live=live)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rule))
  np.testing.assert_array_equal(keep_mask(s, live, span, BUDGET),
                                keep_mask(rule, live, span, BUDGET))


def test_random_weights_change_scores():
  k, mem, live, span, cand = _inputs(4)
  head = _randomise(residual.ResidualHead(D, rngs=nnx.Rngs(0)))
  rule = np.asarray(intentkv.rule_scores(mem, k, cand))
  s = np.asarray(residual.learnable_scores(head, k, mem, cand, span, live=live))
  assert np.all(np.isfinite(s))
  assert np.max(np.abs(s - rule)[np.asarray(cand)]) > 1e-3
  np.testing.assert_array_equal(s[~np.asarray(cand)], 0.)
  s_x = np.asarray(residual.learnable_scores(head, k, mem, cand, span, live=live,
                                             ablate_xattn=True))
  assert not np.allclose(s_x, s)                 # -x-attn changes the residual


def test_token_features_against_numpy():
  k, mem, live, span, cand = _inputs(5)
  rule = intentkv.rule_scores(mem, k, cand)
  got = np.asarray(residual.token_features(k, mem, rule, cand))
  kn, mn, rn, cn = (np.asarray(x, np.float64) for x in (k, mem, rule, cand))
  g = HQ // HKV
  k_exp = np.repeat(kn, g, axis=3)               # GQA: query head h reads KV head h // g
  assert k_exp.shape == (L, B, T, HQ, D)
  want = np.zeros((B, T, 3 * D + 1))
  for b in range(B):
    m_bar = mn[:, b].mean(axis=(0, 1))
    for j in range(T):
      if not cn[b, j]:
        continue
      k_bar = k_exp[:, b, j].mean(axis=(0, 1))
      want[b, j] = np.concatenate([k_bar, m_bar, k_bar * m_bar, [rn[b, j]]])
  assert got.shape == (B, T, 3 * D + 1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_query_key_summary_against_numpy():
  k, mem, live, span, cand = _inputs(6)
  stale = np.asarray(span).copy()
  stale[0, T - 6] = True                         # a span position that was evicted
  live_np = np.asarray(live).copy()
  live_np[0, T - 6] = False
  kn = np.asarray(k, np.float64)
  for n_q in (None, 3, T + 4):
    kq, valid = residual.query_key_summary(k, jnp.asarray(stale), n_q, live=jnp.asarray(live_np))
    kq, valid = np.asarray(kq), np.asarray(valid)
    rows = T if n_q is None else n_q
    assert kq.shape == (B, rows, D) and valid.shape == (B, rows)
    for b in range(B):
      pos = np.nonzero(stale[b] & live_np[b])[0][-rows:]
      assert valid[b].sum() == len(pos) and valid[b, :len(pos)].all()
      np.testing.assert_allclose(kq[b, :len(pos)], kn[:, b, pos].mean(axis=(0, 2)),
                                 rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(kq[b, len(pos):], 0.)


def _np_xattn(q, k, v, valid):
  """Direct multi-head attention, one query row at a time."""
  b_, t_, h_, dh = q.shape
  out = np.zeros((b_, t_, h_, dh))
  for b in range(b_):
    idx = np.nonzero(valid[b])[0]
    for t in range(t_):
      for h in range(h_):
        if not len(idx):
          continue
        s = np.array([q[b, t, h] @ k[b, i, h] for i in idx]) / np.sqrt(dh)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[b, t, h] = sum(pi * v[b, i, h] for pi, i in zip(p, idx))
  return out


def test_cross_attention_against_numpy():
  rng = np.random.default_rng(7)
  head = _randomise(residual.ResidualHead(D, rngs=nnx.Rngs(0)), seed=2, scale=0.3)
  n_q = 5
  phi = rng.standard_normal((B, T, 3 * D + 1)).astype(np.float32)
  kq = rng.standard_normal((B, n_q, D)).astype(np.float32)
  valid = np.array([[True, False, True, True, False], [False] * n_q])   # row 1: none valid
  got = np.asarray(head.cross_attention(jnp.asarray(phi), jnp.asarray(kq), jnp.asarray(valid)))
  p64 = lambda lin, x: x.astype(np.float64) @ np.asarray(lin.kernel[...], np.float64) + \
      np.asarray(lin.bias[...], np.float64)
  h, dh = residual.NUM_HEADS, residual.WIDTH // residual.NUM_HEADS
  q = p64(head.w_q, phi).reshape(B, T, h, dh)
  kk = p64(head.w_k, kq).reshape(B, n_q, h, dh)
  v = p64(head.w_v, kq).reshape(B, n_q, h, dh)
  want = _np_xattn(q, kk, v, valid).reshape(B, T, residual.WIDTH)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(got[1], 0.)
  # Invalid rows carry no weight: changing them changes nothing.
  kq2 = kq.copy()
  kq2[0, 1] = 100.
  got2 = np.asarray(head.cross_attention(jnp.asarray(phi), jnp.asarray(kq2), jnp.asarray(valid)))
  np.testing.assert_array_equal(got2, got)
  # No NaN in gradients either, when no row is valid.
  grad = jax.grad(lambda x: jnp.sum(head.cross_attention(x, jnp.asarray(kq),
                                                         jnp.asarray(valid))))(jnp.asarray(phi))
  assert np.all(np.isfinite(np.asarray(grad)))


def test_alpha_clipping():
  rng = np.random.default_rng(8)
  head = _randomise(residual.ResidualHead(D, rngs=nnx.Rngs(0)))
  phi = jnp.asarray(rng.standard_normal((B, T, 3 * D + 1)), jnp.float32)
  kq = jnp.asarray(rng.standard_normal((B, 4, D)), jnp.float32)
  valid = jnp.ones((B, 4), bool)
  rule = jnp.asarray(rng.random((B, T)), jnp.float32)
  r = np.asarray(head.residual(phi, kq, valid))
  for alpha, eff_clip in ((9.0, 5.0), (-7.5, -5.0), (2.5, 2.5)):
    _set_alpha(head, alpha)
    s = np.asarray(head(phi, kq, valid, rule))
    np.testing.assert_allclose(s, np.asarray(rule) + eff_clip * r, rtol=1e-5, atol=1e-5)
    s_train = np.asarray(head(phi, kq, valid, rule, clip_alpha=False))
    np.testing.assert_allclose(s_train, np.asarray(rule) + alpha * r, rtol=1e-5, atol=1e-5)


def test_jit_matches_eager():
  k, mem, live, span, cand = _inputs(9)
  head = _randomise(residual.ResidualHead(D, rngs=nnx.Rngs(0)), scale=0.2)
  graphdef, state = nnx.split(head)
  fn = jax.jit(residual.learnable_scores, static_argnames=("n_q", "ablate_xattn", "clip_alpha"))
  for kw in ({}, {"n_q": 8}, {"ablate_xattn": True}):
    eager = np.asarray(residual.learnable_scores((graphdef, state), k, mem, cand, span,
                                                 live=live, **kw))
    jitted = np.asarray(fn((graphdef, state), k, mem, cand, span, live=live, **kw))
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
  # Weights are arguments, not constants: new weights, same compiled function.
  state2 = jax.tree_util.tree_map(lambda x: x * 0.5, state)
  a = np.asarray(fn((graphdef, state), k, mem, cand, span, live=live))
  b = np.asarray(fn((graphdef, state2), k, mem, cand, span, live=live))
  assert not np.allclose(a, b)
  assert fn._cache_size() == 3


def test_bad_shapes():
  k, mem, live, span, cand = _inputs()
  with pytest.raises(ValueError):
    residual.token_features(k, mem[:, :, :5], jnp.zeros((B, T)), cand)
  with pytest.raises(ValueError):
    residual.query_key_summary(k, span, 0)


def test_load_head_round_trips_quietly(tmp_path, caplog):
  """A saved head loads back with the same parameters, neither step printing Orbax's
  INFO lines (about 14 each), and leaves the caller's absl verbosity as it was."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  head = _randomise(residual.ResidualHead(D, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(head))
  before = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    with caplog.at_level("INFO"):
      residual.save_head(tmp_path / "head", D, params)
      _, state = residual.load_head(tmp_path / "head")
    assert absl_logging.get_verbosity() == absl_logging.INFO
  finally:
    absl_logging.set_verbosity(before)
  assert not [r for r in caplog.records if r.levelno < 30], caplog.text
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(state), params)
