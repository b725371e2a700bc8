"""Segment reuse (seed 002): int8 storage, the store's budget, the index, the
tiers, and the runner against a no-reuse prefill of the same prompt.

The runner tests use a random 6-layer model (cuts every 2 layers) with SmolLM2's
real tokenizer, so the index sees real canonical tokens; drift numbers on real
weights are `bench/reuse.py`'s job. Tolerances: exact reuse stores float32 and
must match the no-reuse logits to 1e-5 (fp32 re-association only).
"""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_util
import jaxkv
from jaxkv.config import CacheConfig, ReuseConfig, RopeConfig
from jaxkv.engine import reuse as reuse_lib
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.kv import plan, quant
from jaxkv.models import presets
from jaxkv.models.forward import Capture, LayerWindow
from jaxkv.policies.reuse import admission, index, store

CACHE = CacheConfig(num_pages=128, page_size=16, max_seq_len=1024)


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer()


def _runner(llm, method, **kw):
  kw = dict(storage="float32", cut_every=2) | kw
  return ReuseRunner(llm, ReuseConfig(method=method, **kw), cache=CACHE, attn_impl="reference")


def _serve(runner, prompt, spans=()):
  """One request. No structural spans: random ids that happen to decode to a line
  break would otherwise split the runs (`index.line_spans`, the default)."""
  out = runner.prefill(prompt, spans)
  runner.release(out.seq)
  return out


def _prompts(seed=None):
  """(P1 = a + S + q1, P2 = a + S + q2, P3 = b + S + q1): S follows the same
  left context in P1 and P2, another one in P3."""
  rng = np.random.default_rng(seed)
  a, b = rng.integers(100, 40000, 50), rng.integers(100, 40000, 30)
  s, q1, q2 = (rng.integers(100, 40000, k) for k in (120, 20, 20))
  return (np.concatenate([a, s, q1]), np.concatenate([a, s, q2]), np.concatenate([b, s, q1]))


def _no_reuse(llm, prompt):
  return _serve(_runner(llm, "none"), prompt)


# ---------------------------------------------------------------------------- storage
@pytest.mark.parametrize("shape", [(3, 40, 2, 64), (17, 576), (5, 7, 48)])
def test_int8_round_trip_is_bounded(shape):
  rng = np.random.default_rng()
  x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 30.0)
  x.reshape(-1)[rng.integers(0, x.size, 5)] *= 40.0                  # outliers
  p = quant.quantize(jnp.asarray(x), "int8", 32)
  back = np.asarray(quant.dequantize(p))
  assert p.q.dtype == jnp.int8 and p.scale.dtype == jnp.float16
  assert np.all(np.abs(back - x) <= quant.error_bound(x, 32))
  assert np.abs(back - x).max() > 0                                   # it does round
  assert p.nbytes < x.nbytes / 3.5
  f16 = quant.quantize(jnp.asarray(x), "float16")
  assert f16.scale is None and f16.nbytes == x.nbytes // 2


def _segment(rng, n, fp, layers=2):
  """A host segment of random int8 K/V (numpy only: no compile per size)."""
  k = quant.Packed(rng.integers(-127, 128, (layers, n, 2, 16)).astype(np.int8),
                   rng.uniform(0, 1, (layers, n, 2, 1)).astype(np.float16))
  return store.Segment(ids=rng.integers(0, 99, n).astype(np.int32), left=np.zeros(0, np.int32),
                       positions=np.arange(n, dtype=np.int32), k=k, v=k, hidden={},
                       fingerprint=fp).seal()


def _rot(seg):
  """Flips one bit of a segment's stored keys (the arrays may be read-only)."""
  q = np.array(seg.k.q)
  bits = q.reshape(-1).view(np.uint8)
  bits[bits.size // 3] ^= 1
  seg.k = quant.Packed(q, seg.k.scale)


def test_store_byte_budget_holds_under_random_insert_and_evict():
  rng = np.random.default_rng()
  fp = store.Fingerprint("m", "t", "r")
  evicted = []
  st = store.SegmentStore(byte_budget=40_000, on_evict=evicted.append)
  live = []
  for _ in range(200):
    op = rng.uniform()
    if op < 0.6:
      seg = _segment(rng, int(rng.integers(1, 300)), fp)
      key = st.put(seg)
      if seg.nbytes > st.budget:
        assert key is None
      else:
        live.append(key)
    elif op < 0.8 and len(st):
      st.get(rng.choice(st.keys()))                  # touch: becomes most recent
    elif len(st):
      st.remove(rng.choice(st.keys()))
    st.check()
  assert st.evictions > 0 and evicted
  assert set(st.keys()) <= set(live)
  # LRU: touching the oldest keeps it past the next eviction
  st2 = store.SegmentStore(byte_budget=3 * _segment(rng, 50, fp).nbytes)
  keys = [st2.put(_segment(rng, 50, fp)) for _ in range(3)]
  st2.get(keys[0])
  st2.put(_segment(rng, 50, fp))
  assert keys[0] in st2 and keys[1] not in st2


def test_checksum_and_fingerprint_refuse_with_reasons():
  rng = np.random.default_rng()
  fp = store.Fingerprint("m", "t", "r")
  seg = _segment(rng, 40, fp)
  assert seg.problem(fp) is None
  assert "rope differs" in seg.problem(dataclasses.replace(fp, rope="r2"))
  assert "adapter differs" in seg.problem(dataclasses.replace(fp, adapter="plan"))
  _rot(seg)
  assert seg.problem(fp) == "corrupt (checksum mismatch)"


def test_break_even_counts_reuses():
  rng = np.random.default_rng()
  seg = _segment(rng, 100, store.Fingerprint("m", "t", "r"))
  be = store.break_even(seg, layers_skipped=2, flops_per_token_layer=1e6, flops_per_s=1e9,
                        bytes_per_s=1e8)
  assert be.saved_s == pytest.approx(100 * 2 * 1e6 / 1e9)
  assert be.reuses == pytest.approx(be.store_s / (be.saved_s - be.hit_s))
  slow = store.break_even(seg, 2, 1e6, flops_per_s=1e9, bytes_per_s=1e3)
  assert slow.reuses == float("inf")


# ------------------------------------------------------------------------------ index
def test_windows_are_content_defined(llm):
  """Winnowing: text more than k + 2 * stride tokens past a change gets the same
  windows whatever precedes it (20 random prefix pairs)."""
  table = index.canonical_table(llm.tokenizer)
  cfg = ReuseConfig(stride=16, window=48, min_tokens=16)
  text = np.asarray(llm.tokenizer.encode(
      "The get_reservation_details tool returns the reservation, its flights, passengers "
      "and payment history. Use it before any change. " * 6))
  rng = np.random.default_rng()
  settle = cfg.shingle + 2 * cfg.stride
  for _ in range(20):
    na, nb = (int(x) for x in rng.integers(1, 80, 2))
    a = np.concatenate([rng.integers(100, 40000, na), text])
    b = np.concatenate([rng.integers(100, 40000, nb), text])
    wa = {(s - na, e - na) for s, e in index.windows(a, table, cfg) if s >= na + settle}
    wb = {(s - nb, e - nb) for s, e in index.windows(b, table, cfg) if s >= nb + settle}
    assert wa and wa == wb                          # the same windows, shifted


def test_winnowing_spacing():
  """Anchors on random text: at most 2 * stride - 1 k-grams apart, ~stride on average."""
  table = [f"t{i}" for i in range(5000)]
  cfg = ReuseConfig(stride=24, window=64)
  ids = np.random.default_rng().integers(0, 5000, 4000)
  a = index.anchors(ids, table, cfg)
  gaps = np.diff(a)
  assert gaps.max() <= 2 * cfg.stride - 1
  assert 0.7 * cfg.stride < gaps.mean() < 1.3 * cfg.stride


def test_align_finds_the_maximal_identical_run():
  rng = np.random.default_rng()
  seg = rng.integers(0, 1000, 200).astype(np.int32)
  prompt = np.concatenate([rng.integers(1000, 2000, 33), seg[20:150],
                           rng.integers(1000, 2000, 9)]).astype(np.int32)
  prompt[33 + 60] = 1999                          # one differing token inside
  run = index.align(prompt, 33 + 70, 33 + 100, seg, 90, 120, k=8, min_tokens=16)
  assert run == (33 + 61, 20 + 61, 150 - 20 - 61)
  assert index.align(prompt, 0, 30, seg, 0, 30, k=8, min_tokens=16) is None


def test_guarded_resume_deepens_along_the_run():
  cfg = ReuseConfig(cut_every=2, guard_base=8)
  seg = dataclasses.replace(_segment(np.random.default_rng(), 4, store.Fingerprint("m", "t", "r"),
                                     layers=6), hidden={2: None, 4: None})
  r = admission.guarded_resume(seg, m=0, n=40, cfg=cfg, num_layers=6)
  # W(1) = 8, W(3) = 16, W(5) = 32: boundaries 2, 4 and 6 (every layer stored)
  np.testing.assert_array_equal(r, np.r_[[0] * 8, [2] * 8, [4] * 16, [6] * 8])
  assert cfg.guard_window(0) == 0


def test_seed_guard_schedule_needs_the_whole_prefix_from_layer_16():
  """guard_schedule="seed": W(0) = 128, W(8) = 512, and from layer 16 the whole
  prefix, which only a run whose whole left context is identical passes."""
  cfg = ReuseConfig(guard_schedule="seed", cut_every=4)
  assert [cfg.guard_window(x) for x in (0, 3, 4, 8, 12, 15, 16, 29)] == [
      128, 128, 256, 512, 1024, 1024, None, None]
  seg = dataclasses.replace(_segment(np.random.default_rng(), 8, store.Fingerprint("m", "t", "r"),
                                     layers=24), hidden={4: None, 8: None, 16: None})
  # boundaries 4, 8, 16 and 24 (every layer stored): need W(3), W(7), W(15), W(23)
  r = admission.guarded_resume(seg, m=250, n=8, cfg=cfg, num_layers=24, p_lo=300)
  np.testing.assert_array_equal(r, np.r_[[4] * 6, [8] * 2])         # W(7) = 256 <= 250 + j
  whole = admission.guarded_resume(seg, m=300, n=8, cfg=cfg, num_layers=24, p_lo=300)
  np.testing.assert_array_equal(whole, [24] * 8)
  assert admission.guarded_resume(seg, m=10, n=8, cfg=cfg, num_layers=24, p_lo=300).max() == 0
  with pytest.raises(ValueError, match="guard_schedule"):
    ReuseConfig(guard_schedule="halving")


def test_context_threshold_refuses_approximate_tiers():
  """tau_ctx (`ctx_threshold`): a run whose left context's Jaccard with the stored
  one's falls below it gets no approximate tier (the reason says so); at or above it,
  or with the threshold at 0 (the default), the guard decides as before."""
  seg = dataclasses.replace(_segment(np.random.default_rng(), 40, store.Fingerprint("m", "t", "r"),
                                     layers=6), hidden={2: None, 4: None})
  match = index.Match(key=0, p_lo=70, s_lo=0, n=40, ctx_match=70, ctx_jaccard=0.3)
  for cfg, tier in [(ReuseConfig(), "approx"), (ReuseConfig(ctx_threshold=0.3), "approx"),
                    (ReuseConfig(ctx_threshold=0.5), "reject"),
                    (ReuseConfig(ctx_threshold=0.5, tiers=("blend",)), "reject"),
                    (ReuseConfig(ctx_threshold=0.2, tiers=("blend",)), "blend")]:
    d = admission.decide(match, seg, cfg, 6)
    assert d.tier == tier, (cfg.ctx_threshold, cfg.tiers, d)
    assert ("ctx_threshold" in d.reason) == (tier == "reject")
  with pytest.raises(ValueError, match="ctx_threshold"):
    ReuseConfig(ctx_threshold=1.5)


def test_random_reject_is_the_gates_seeded_chance_baseline():
  """reject_random = p turns down about a share p of the runs that would be spliced,
  the same ones for the same seed and run places, another set for another seed; p = 0
  and p = 1 reject none and all; exact runs are never turned down."""
  seg = dataclasses.replace(_segment(np.random.default_rng(), 40, store.Fingerprint("m", "t", "r"),
                                     layers=6), hidden={2: None, 4: None})
  matches = [index.Match(key=0, p_lo=70 + i, s_lo=0, n=40, ctx_match=70 + i, ctx_jaccard=0.9)
             for i in range(400)]

  def rejected(**kw):
    cfg = ReuseConfig(**kw)
    return [admission.decide(m, seg, cfg, 6).tier == "reject" for m in matches]

  assert not any(rejected()) and all(rejected(reject_random=1.0))
  a, b = rejected(reject_random=0.2), rejected(reject_random=0.2, seed=1)
  assert a == rejected(reject_random=0.2) and a != b
  assert 0.14 < np.mean(a) < 0.26 and 0.14 < np.mean(b) < 0.26
  d = admission.decide(matches[0], seg, ReuseConfig(reject_random=1.0), 6)
  assert "random reject" in d.reason and "approx" in d.reason
  exact = dataclasses.replace(seg, left=np.zeros(70, np.int32), exact=True)
  whole = index.Match(key=0, p_lo=70, s_lo=0, n=40, ctx_match=70, ctx_jaccard=1.0)
  assert admission.decide(whole, exact, ReuseConfig(reject_random=1.0), 6).tier == "exact"
  with pytest.raises(ValueError, match="reject_random"):
    ReuseConfig(reject_random=1.5)


# ----------------------------------------------------------------------------- runner
@pytest.mark.parametrize("regime", ["A", "B"])
def test_exact_tier_reproduces_no_reuse(llm, regime):
  p1, p2, _ = _prompts()
  ref = _no_reuse(llm, p2)
  r = _runner(llm, "tiered", regime=regime, reuse_layers=4 if regime == "B" else 0)
  first = _serve(r, p1)
  assert first.stored == 1 and not first.runs
  r.radix.clear()                                 # the pool forgot it; the store did not
  got = _serve(r, p2)
  assert [x.tier for x in got.runs] == ["exact"] and got.runs[0].n == 170
  np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5, rtol=0)
  L = llm.config.num_layers
  want = [20] * L if regime == "A" else [20] * 4 + [190] * 2
  np.testing.assert_array_equal(got.layer_tokens, want)
  assert got.flops < ref.flops


def test_full_recompute_equals_no_reuse_and_naive_reuse_drifts(llm):
  p1, _, p3 = _prompts()
  ref = _no_reuse(llm, p3)
  outs = {}
  for name, method, kw in [("naive", "naive", {}), ("blend1", "cacheblend", dict(blend_ratio=1.0)),
                           ("epic_all", "epic", dict(epic_tokens=1000)),
                           ("blend", "cacheblend", {})]:
    r = _runner(llm, method, **kw)
    _serve(r, p1)
    outs[name] = _serve(r, p3)
  for name in ("blend1", "epic_all"):
    np.testing.assert_allclose(outs[name].logits, ref.logits, atol=1e-5, rtol=0)
  assert np.abs(outs["naive"].logits - ref.logits).max() > 1e-2      # reuse is approximate
  blend = outs["blend"]
  assert blend.runs[0].tier == "blend" and blend.runs[0].deviation > 0
  n = blend.runs[0].n
  # layers 0..1 recompute the run (the probe), later ones the top 15%
  assert blend.layer_tokens[0] == ref.layer_tokens[0]
  assert blend.layer_tokens[2] == ref.layer_tokens[2] - n + int(np.ceil(0.15 * n))


def test_chance_baselines_recompute_as_many_tokens_at_random(llm):
  """select=random recomputes as many tokens as EPIC / CacheBlend (same per-layer
  counts), drawn at random (other logits); all of a run drawn is no reuse again.
  rerope=False changes nothing where a segment lands at its stored position (P4: P1
  with another left context of the same length) and drifts where it moved (P3)."""
  p1, _, p3 = _prompts(seed=11)
  p4 = p1.copy()
  p4[:50] = np.random.default_rng(12).integers(100, 40000, 50)
  ref = _no_reuse(llm, p3)
  got = {}
  for name, method, kw in [("epic", "epic", {}), ("epic_r", "epic", dict(select="random")),
                           ("blend", "cacheblend", {}),
                           ("blend_r", "cacheblend", dict(select="random")),
                           ("epic_r_all", "epic", dict(select="random", epic_tokens=1000)),
                           ("blend_r_all", "cacheblend", dict(select="random", blend_ratio=1.0)),
                           ("naive", "naive", {}), ("norope", "naive", dict(rerope=False))]:
    r = _runner(llm, method, **kw)
    _serve(r, p1)
    got[name] = (_serve(r, p3), _serve(r, p4))
  for a, b in (("epic", "epic_r"), ("blend", "blend_r")):
    np.testing.assert_array_equal(got[a][0].layer_tokens, got[b][0].layer_tokens)
    assert np.abs(got[a][0].logits - got[b][0].logits).max() > 1e-4, (a, b)
  assert got["epic_r"][0].runs[0].reason.startswith("epic (random tokens)")
  for name in ("epic_r_all", "blend_r_all"):
    np.testing.assert_allclose(got[name][0].logits, ref.logits, atol=1e-5, rtol=0)
  assert got["naive"][1].runs[0].p_lo == 50 and got["naive"][1].runs[0].tier == "naive"
  np.testing.assert_allclose(got["norope"][1].logits, got["naive"][1].logits, atol=1e-5, rtol=0)
  assert np.abs(got["norope"][0].logits - got["naive"][0].logits).max() > 1e-3
  with pytest.raises(ValueError, match="select"):
    ReuseConfig(select="best")


def test_approx_tier_recomputes_where_the_guard_refuses(llm):
  p1, _, p3 = _prompts()
  ref = _no_reuse(llm, p3)
  r = _runner(llm, "tiered", tiers=("exact", "approx"))
  _serve(r, p1)
  got = _serve(r, p3)
  (run,) = got.runs
  assert run.tier == "approx" and run.ctx_match == 0
  resume = admission.guarded_resume(r.store.peek(0), 0, run.n, r.reuse, 6)
  fresh = p3.size - run.n
  np.testing.assert_array_equal(got.layer_tokens,
                                [fresh + int((resume <= l).sum()) for l in range(6)])
  naive = _runner(llm, "naive")
  _serve(naive, p1)
  drift = np.abs(got.logits - ref.logits).max()
  assert drift < np.abs(_serve(naive, p3).logits - ref.logits).max()


@pytest.fixture(scope="module")
def smollm2():
  return jaxkv.load(presets.SMOLLM2)


def test_a_run_spliced_at_position_0_recomputes_its_first_token(smollm2, monkeypatch):
  """The attention sink (real SmolLM2 weights: a random model has none): a segment
  stored after a left context and spliced at position 0 (the context deleted)
  recomputes its first token at every layer under every method but exact (one more
  token per layer), which cuts naive reuse's first-token KL against no reuse (1.27 ->
  0.33 here; CacheBlend's probe already picks that token)."""
  enc = lambda t: np.asarray(smollm2.tokenizer.encode(t, add_bos=False), np.int32)
  ctx = enc("You are a helpful assistant for the airline. Follow the policy below carefully.")
  seg = enc(" The baggage policy: each passenger may bring one carry-on bag and one personal "
            "item. Checked bags cost 35 dollars each for economy, and are free for gold "
            "members. Refunds go to the original payment method within seven days.")
  q = enc(" Question: how much is a checked bag for economy?")
  p1, p0 = np.concatenate([ctx, seg, q]), np.concatenate([seg, q])   # S at position 0

  def serve(method, prompt, prime=None):
    r = ReuseRunner(smollm2, ReuseConfig(method=method, storage="float32", min_tokens=16),
                    cache=CACHE, attn_impl="reference")
    if prime is not None:
      _serve(r, prime)
    return _serve(r, prompt)

  exact = admission.Decision("exact", "same")
  assert admission.sink_first(exact) is exact
  assert admission.sink_first(admission.Decision("naive", "n", resume=6)).resume_of(3)[0] == 0
  ref = serve("none", p0)
  kl = lambda out: float(jnp.sum(jax.nn.softmax(ref.logits) * (
      jax.nn.log_softmax(ref.logits) - jax.nn.log_softmax(out.logits))))
  got = {True: serve("naive", p0, p1)}
  monkeypatch.setattr(admission, "sink_first", lambda d: d)
  got[False] = serve("naive", p0, p1)
  (run,) = got[True].runs
  assert run.p_lo == 0 and run.tier == "naive" and "position 0 recomputed" in run.reason
  np.testing.assert_array_equal(got[True].layer_tokens, got[False].layer_tokens + 1)
  assert kl(got[True]) < 0.5 * kl(got[False]), (kl(got[True]), kl(got[False]))


def test_layer_passes_split_where_the_width_grows():
  sizes = [20] * 4 + [300] * 4 + [600] * 22
  assert reuse_lib.layer_passes(sizes, 0, 30, 4) == [(0, 4), (4, 8), (8, 30)]
  assert reuse_lib.layer_passes(sizes, 0, 30, 1) == [(0, 30)]
  assert reuse_lib.layer_passes(sizes, 2, 30, 2) == [(2, 8), (8, 30)]   # 6 x 384 + 22 x 640
  assert reuse_lib.layer_passes([50] * 6, 0, 6, 4) == [(0, 6)]     # one width: one pass
  rng = np.random.default_rng()
  for _ in range(20):                                 # never worse than one pass
    sz = np.sort(rng.integers(1, 700, 12)).tolist()
    ps = reuse_lib.layer_passes(sz, 0, 12, 3)
    assert len(ps) <= 3 and ps[0][0] == 0 and ps[-1][1] == 12
    assert all(b0 == a1 for (_, b0), (a1, _) in itertools.pairwise(ps))
    work = sum((b - a) * max(plan.chunk_len(n) for n in sz[a:b]) for a, b in ps)
    assert work <= 12 * plan.chunk_len(max(sz))


@pytest.mark.parametrize("method,kw", [("tiered", dict(tiers=("exact", "approx"))),
                                       ("cacheblend", {})])
def test_layer_passes_do_not_change_the_result(llm, method, kw):
  """Several passes (one recompute width each) compute what one pass computes."""
  p1, _, p3 = _prompts()
  got = {}
  for passes in (1, 4):
    r = _runner(llm, method, max_passes=passes, **kw)
    _serve(r, p1)
    got[passes] = _serve(r, p3)
  np.testing.assert_allclose(got[4].logits, got[1].logits, atol=2e-5, rtol=0)
  np.testing.assert_array_equal(got[4].layer_tokens, got[1].layer_tokens)


def test_corrupt_or_mismatched_segments_are_never_spliced(llm):
  p1, p2, _ = _prompts()
  ref = _no_reuse(llm, p2)
  r = _runner(llm, "naive")
  _serve(r, p1)
  r.radix.clear()
  _rot(r.store.peek(0))                              # one bit of rot in the host copy
  got = _serve(r, p2)
  assert [(x.tier, x.reason) for x in got.runs] == [("reject", "corrupt (checksum mismatch)")]
  np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5, rtol=0)
  other = _runner(llm, "naive")
  other.fingerprint = dataclasses.replace(
      other.fingerprint, rope=store.digest(dataclasses.asdict(RopeConfig(theta=1e6)), 16))
  _serve(other, p1)                                  # stored under another RoPE
  other.radix.clear()
  other.fingerprint = r.fingerprint
  got = _serve(other, p2)
  assert got.runs[0].tier == "reject" and got.runs[0].reason.startswith("rope differs")
  np.testing.assert_allclose(got.logits, ref.logits, atol=1e-5, rtol=0)


def test_a_span_partly_spliced_stores_its_computed_parts(llm):
  """One structural span over the whole of P3 = b + S + q1 + r: S + q1 is spliced from
  P1's stored run, and the span's computed part after it (r, >= min_tokens) is stored
  as a run (not exact: it attended to approximate K/V), where before nothing of a
  span partly spliced was; the spliced run is not stored again."""
  p1, _, p3 = _prompts(seed=3)
  p3 = np.concatenate([p3, np.random.default_rng(9).integers(100, 40000, 40)])
  r = _runner(llm, "naive")
  _serve(r, p1)
  r.radix.clear()
  before = set(r.store.keys())
  got = _serve(r, p3, [(0, p3.size)])
  (run,) = [x for x in got.runs if x.tier != "reject"]            # S (+ q1), from P1's run
  assert run.p_lo == 30 and run.n >= 120
  new = [r.store.peek(k) for k in r.store.keys() if k not in before]  # noqa: SIM118
  spans = sorted((int(g.positions[0]), int(g.positions[-1]) + 1) for g in new)
  assert spans == [(run.p_lo + run.n, p3.size)]                     # b is under min_tokens
  assert all(not g.structural and not g.exact for g in new)
  assert got.stored == len(new)


def test_decode_after_exact_reuse_matches_no_reuse(llm):
  p1, p2, _ = _prompts()
  base = _runner(llm, "none")
  pre = base.prefill(p2, ())
  want, _ = base.decode(pre, 8)
  r = _runner(llm, "tiered")
  _serve(r, p1)
  r.radix.clear()
  pre = r.prefill(p2, ())
  got, lp = r.decode(pre, 8, forced=want)
  np.testing.assert_array_equal(got[0], want[0])
  assert np.all(np.isfinite(lp)) and lp.shape == (8,)
  pre2 = r.prefill(p2, ())                               # the radix prefix now, then greedy
  np.testing.assert_array_equal(r.decode(pre2, 8)[0], want)


def test_hidden_cuts_capture_the_window_boundaries(llm):
  model = llm.model
  toks = jnp.asarray(np.random.default_rng().integers(0, 49152, (1, 12)))
  pos = jnp.arange(12)[None]
  out = model(toks, pos, None, capture=Capture(hidden_cuts=(0, 2, 6)))
  h2 = model(toks, pos, None, window=LayerWindow(stop=2)).hidden
  np.testing.assert_array_equal(np.asarray(out.hidden_cuts[1]), np.asarray(h2))
  np.testing.assert_array_equal(np.asarray(out.hidden_cuts[0]),
                                np.asarray(model.embed[...][toks]))
  with pytest.raises(ValueError, match="hidden_cuts"):
    model(toks, pos, None, window=LayerWindow(stop=2), capture=Capture(hidden_cuts=(3,)))


def test_reuse_config_rejects_bad_fields():
  with pytest.raises(ValueError, match=re.escape("reuse.method")):
    ReuseConfig(method="blendy")
  with pytest.raises(ValueError, match="tiers"):
    ReuseConfig(tiers=("exact", "fuzzy"))
  with pytest.raises(ValueError, match="regime"):
    ReuseConfig(regime="C")
