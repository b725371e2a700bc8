"""The Mosaic GPU paged-attention kernel against the reference: compiled on a GPU,
in Mosaic GPU's own interpreter elsewhere (simulated shared memory, TMA copies
and barriers; its matmuls are plain dots, see `paged_attention_mosaic._mosaic_call`).

Inputs come from test_kernels' seeded `_case` (`JAXKV_TEST_SEED=random` for
fresh ones; the seed is in every failure message). Tolerance: bfloat16, as in
test_kernels (`_check_bf16`): no worse than twice the bf16 reference, both
scored against the reference in float32 on the same inputs.

Poisoning: the kernel reads whole pages, so a dead slot inside a page that also
holds a live token is read (with zero weight). Those slots hold large finite
garbage (x100) here; every slot of a page that holds no live token, and every
slot after the last query, is NaN: a kernel that read one would return NaN.
"""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.kv.allocator import PagedAllocator
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_attention_mosaic as pm
from test_kernels import _case, _check, _check_bf16, _ref, export_for_cuda
from test_kernels_key_shift import _shifted

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
S = jax.ShapeDtypeStruct


def _poison_pages(seed, a, *, garbage=100.0):
  """NaN in every slot of a page with no live token; x`garbage` noise in the dead
  slots of pages that hold one (read with zero weight). SENTINEL stays 0 (the
  references gather it for every dead token; no listed page holds it)."""
  sm = np.asarray(a["slot_map"])
  rng = np.random.default_rng(seed)
  live = np.unique(sm[sm != pa.SENTINEL])
  pages = np.unique(live // pm.PAGE)
  read = (pages[:, None] * pm.PAGE + np.arange(pm.PAGE)).ravel()
  out = {}
  for name in ("k_pool", "v_pool", "vlr_pool"):
    if name not in a:
      continue
    x = np.array(a[name], np.float32)
    dead_in_page = np.setdiff1d(read, live)
    x[:, dead_in_page] = garbage * rng.standard_normal(x[:, dead_in_page].shape)
    x[:, np.setdiff1d(np.arange(x.shape[1]), read)] = np.nan
    x[:, pa.SENTINEL] = 0.0               # the references gather it for dead tokens
    out[name] = jnp.asarray(x, a[name].dtype)
  return dict(a, **out)


def _run(a, layer, **kw):
  """The kernel; its fallback is the XLA reference unless `fallback` says (one
  compile per case instead of two; the Triton fallback has its own test)."""
  kw.setdefault("fallback", "reference")
  return pm.paged_attention(**a, layer=layer, interpret=INTERPRET, **kw)


SWEEP = list(itertools.product([64, 128], [1, 3, 7], [0.0, 0.5, 1.0]))


@pytest.mark.parametrize("head_dim,groups,dead", SWEEP)
def test_mosaic_matches_reference(head_dim, groups, dead):
  for q_len in (1, 12):  # decode, and a prefill chunk of two row blocks at groups 7
    seed, a = _case(page_size=16, head_dim=head_dim, groups=groups, dead=dead, q_len=q_len,
                    dtype=jnp.bfloat16)
    a = _poison_pages(seed, a)
    plan = pm.make_page_plan(a["slot_map"], a["q_positions"], num_heads=groups * 2,
                             num_kv_heads=2, num_slots=a["k_pool"].shape[1])
    assert bool(plan.paged), f"seed={seed}: a page-by-page slot map must be paged"
    got = _run(a, jnp.int32(1), plan=plan)
    _check_bf16(seed, got, pa.paged_attention_reference, a, layer=1)
    if dead == 1.0:
      assert not np.asarray(got, np.float32).any(), "all-dead rows must return exact zeros"


@pytest.mark.parametrize("k_splits,pages_per_step,stages,stage_starts", [
    (None, None, None, None), (3, 4, 2, None), (3, 4, 2, False), (8, 8, 4, None)])
def test_mosaic_splits_and_pipeline_depths(k_splits, pages_per_step, stages, stage_starts):
  """Flash-decoding shares merged, and pipelines deeper or shallower than a
  program's step count (a split with fewer steps than stages in flight); page
  starts staged in shared memory (the default) or read from global memory."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=1, max_len=1200,
                  dtype=jnp.bfloat16)
  a = _poison_pages(seed, a)
  got = _run(a, 1, k_splits=k_splits, pages_per_step=pages_per_step, stages=stages,
             stage_starts=stage_starts)
  _check_bf16(seed, got, pa.paged_attention_reference, a, layer=1)


def test_mosaic_reads_no_future_or_dead_page():
  """Whole dead pages inside the context, pages after every query and an
  all-dead row are NaN (`_poison_pages`, and here also the future pages): no
  NaN comes back."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.0, q_len=4, batch=2,
                  max_len=160, dtype=jnp.bfloat16)
  sm = np.array(a["slot_map"])
  sm[:, 16:48] = pa.SENTINEL
  sm[1, :] = pa.SENTINEL
  q_pos = np.array([[60, 61, 62, 63], [-1, -1, -1, -1]], np.int32)
  a.update(slot_map=jnp.asarray(sm), q_positions=jnp.asarray(q_pos))
  want_a = dict(a, slot_map=jnp.asarray(np.where(np.arange(160) <= 63, sm, pa.SENTINEL)))
  a = _poison_pages(seed, want_a)
  a["slot_map"] = jnp.asarray(sm)            # the future pages are mapped, and NaN
  got = _run(a, 0)
  _check_bf16(seed, got, pa.paged_attention_reference, dict(a, slot_map=want_a["slot_map"]),
              layer=0)


def _brute_pages(slot_map, q_positions, g):
  """Per row and row block: the logical pages with a live token at or before the
  block's last query, in order."""
  out = []
  for b in range(slot_map.shape[0]):
    rows = np.repeat(q_positions[b], g)
    blocks = [rows[i:i + pm.BLOCK_R].max() for i in range(0, len(rows), pm.BLOCK_R)]
    per = []
    for last in blocks:
      pages = [j for j in range(-(-slot_map.shape[1] // pm.PAGE))
               if any(slot_map[b, t] != pa.SENTINEL and t <= last
                      for t in range(j * pm.PAGE, min((j + 1) * pm.PAGE, slot_map.shape[1])))]
      per.append(pages)
    out.append(per)
  return out


@pytest.mark.parametrize("k_splits", [1, 3])
@pytest.mark.parametrize("dead", [0.0, 0.6])
def test_page_plan_walks_exactly_the_live_visible_pages(k_splits, dead):
  seed, a = _case(page_size=16, head_dim=64, groups=7, dead=dead, q_len=12, max_len=600)
  sm, qp = np.asarray(a["slot_map"]), np.asarray(a["q_positions"])
  plan = pm.make_page_plan(a["slot_map"], a["q_positions"], num_heads=14, num_kv_heads=2,
                           num_slots=a["k_pool"].shape[1], k_splits=k_splits,
                           pages_per_step=4)
  pps, starts, pos = plan.tiling.pages_per_step, np.asarray(plan.starts), np.asarray(plan.positions)
  for b, per_block in enumerate(_brute_pages(sm, qp, 7)):
    for rb, want in enumerate(per_block):
      steps = [range(lo, hi) for lo, hi, _ in np.asarray(plan.bounds)[b, rb]]
      assert (np.asarray(plan.bounds)[b, rb, :, 2] == len(want)).all(), f"seed={seed}"
      walked = [e for st in steps for s in st for e in range(s * pps, (s + 1) * pps)]
      assert walked == sorted(walked) and len(set(walked)) == len(walked), f"seed={seed}"
      keys = pos[b].reshape(-1, pm.PAGE)[walked]
      real = [e for e, k in zip(walked, keys, strict=True) if (k != pm.POS_PAD).any()]
      got = [int(k[k != pm.POS_PAD].min()) // pm.PAGE for k in keys[[walked.index(e)
                                                                     for e in real]]]
      assert got[:len(want)] == want, f"seed={seed}: row {b} block {rb}"
      assert len(walked) < len(want) + pps, f"seed={seed}: more than one step past the last"
      window = plan.tiling.starts_window      # a program's staged starts hold its share
      assert window % 32 == 0 and 0 < window <= starts.shape[1]
      for st in steps:
        if len(st):
          src0 = min(st.start * pps, starts.shape[1] - window)
          assert src0 <= st.start * pps and st.stop * pps <= src0 + window, f"seed={seed}"
      for e in real:                      # each walked key: its slot and position
        t = pos[b].reshape(-1, pm.PAGE)[e]
        live = t != pm.POS_PAD
        np.testing.assert_array_equal(starts[b, e] + t[live] % pm.PAGE, sm[b, t[live]])


def test_token_level_maps_run_the_fallback():
  """A slot map that is not page by page (tokens on single-slot 'pages', as an
  alias map makes; or whole pages shifted off the 16-slot grid) cannot be
  fetched by pages: the whole call runs the Triton kernel (or the reference),
  with the same result."""
  seed, a = _case(page_size=1, head_dim=64, groups=3, dead=0.3, q_len=3, dtype=jnp.bfloat16)
  plan = pm.make_page_plan(a["slot_map"], a["q_positions"], num_heads=6, num_kv_heads=2,
                           num_slots=a["k_pool"].shape[1])
  assert not bool(plan.paged), f"seed={seed}"
  sm = np.asarray(a["slot_map"])
  shifted = np.where(np.arange(sm.shape[1]) < 16, 24 + np.arange(sm.shape[1]), 0)[None]
  start, _, paged = pm.page_table(jnp.asarray(shifted, jnp.int32), 4096)
  assert not bool(paged) and int(start[0, 0]) == 24    # consecutive slots, off the grid
  for fallback in ("triton", "reference"):
    got = _run(a, 1, fallback=fallback)
    _check_bf16(seed, got, pa.paged_attention_reference, a, layer=1)


def test_interpreted_calls_return_once_computed():
  """`settled`: an eager interpret=True call returns a computed result (the caller's
  next op must not race the interpreter's callbacks: that hung CI); under the
  caller's own trace nothing is waited for. A few seconds of matmuls stand in for
  the kernel, which JAX would hand back still running."""

  @functools.partial(jax.jit, static_argnames="interpret")
  def kernel(x, *, interpret=False):
    del interpret
    return jax.lax.fori_loop(0, 24, lambda _, y: jnp.tanh(y @ x), x)

  x = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 1024)), jnp.float32) / 32
  jax.block_until_ready(kernel(x))                         # compiled
  assert not kernel(x).is_ready(), "the stand-in must come back still running"
  assert pm.settled(kernel)(x, interpret=True).is_ready()
  assert jax.jit(lambda y: pm.settled(kernel)(y, interpret=True))(x).shape == x.shape


def test_unsupported_calls_go_to_the_fallback():
  q, pool = jnp.zeros((1, 1, 2, 64), jnp.bfloat16), jnp.zeros((2, 64, 2, 64), jnp.bfloat16)
  assert pm.supported(q, pool, pool) is None
  assert "16-bit" in pm.supported(q.astype(jnp.float32), pool, pool)
  assert "16-bit" in pm.supported(q, pool.astype(jnp.float32), pool)
  assert "head_dim" in pm.supported(jnp.zeros((1, 1, 2, 80), jnp.bfloat16),
                                    *(jnp.zeros((2, 64, 2, 80), jnp.bfloat16),) * 2)
  assert "whole pages" in pm.supported(q, pool[:, :40], pool[:, :40])
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=2)      # float32
  got = _ref(pm.paged_attention, **a, layer=0, fallback="reference")   # no TF32 on a GPU
  _check(seed, got, _ref(pa.paged_attention_reference, **a, layer=0))


def _shifted_reference(**kw):
  return ops.paged_attention(**kw, impl="reference")


@pytest.mark.parametrize("head_dim,groups,dead,q_len", [
    (64, 3, 0.0, 1), pytest.param(64, 7, 0.5, 12, marks=pytest.mark.slow),
    pytest.param(128, 1, 0.3, 1, marks=pytest.mark.slow), (128, 3, 0.0, 4)])
def test_mosaic_key_shift_matches_reference(head_dim, groups, dead, q_len):
  """Keys rotated on read in the tile (`key_shift`: MemArt's aliased blocks) against
  the reference path of jaxkv.ops (gather, rotate, attend), on poisoned pools, with
  shifts up to +-20,000 positions (angles range-reduced before the approximate
  sin/cos) and, at head_dim 64, 8 pages per step (two 64-key sub-blocks rotated per
  step; at 128 that tiling does not fit in shared memory, see the next tests)."""
  seed, a = _case(page_size=16, head_dim=head_dim, groups=groups, dead=dead, q_len=q_len,
                  dtype=jnp.bfloat16, max_len=200)
  a = _shifted(seed, _poison_pages(seed, a), spread=20000)
  for pps in (4, 8) if head_dim == 64 else (4,):     # 8 at 128 passes shared memory
    plan = pm.make_page_plan(a["slot_map"], a["q_positions"], num_heads=groups * 2,
                             num_kv_heads=2, num_slots=a["k_pool"].shape[1],
                             pages_per_step=pps, key_shift=a["key_shift"])
    assert bool(plan.paged) and plan.shifts is not None, f"seed={seed}"
    got = _run(a, jnp.int32(1), plan=plan)
    _check_bf16(seed, got, _shifted_reference, a, layer=1)
  # a shift of 0 everywhere is the unshifted call
  zero = dict(a, key_shift=jnp.zeros_like(a["key_shift"]))
  np.testing.assert_allclose(np.asarray(_run(zero, 1), np.float32),
                             np.asarray(_run(dict(zero, key_shift=None, shift_freq=None), 1),
                                        np.float32), atol=2e-2, rtol=0)


def test_mosaic_key_shift_plans_and_fallbacks():
  """The plan lists each key's shift beside its position (0 where dead); a plan made
  without shifts is refused for a shifted call; a token-level map runs the fallback
  with the shift (Triton or the reference)."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.4, q_len=2, dtype=jnp.bfloat16,
                  max_len=120)
  a = _shifted(seed, a, spread=300)
  kw = dict(num_heads=6, num_kv_heads=2, num_slots=a["k_pool"].shape[1])
  plan = pm.make_page_plan(a["slot_map"], a["q_positions"], key_shift=a["key_shift"], **kw)
  pos, sh = np.asarray(plan.positions), np.asarray(plan.shifts)
  want = np.asarray(a["key_shift"])
  for b in range(pos.shape[0]):
    live = pos[b] != pm.POS_PAD
    np.testing.assert_array_equal(sh[b, live], want[b, pos[b, live]], err_msg=f"seed={seed}")
    assert not sh[b, ~live].any(), f"seed={seed}"
  bare = pm.make_page_plan(a["slot_map"], a["q_positions"], **kw)
  with pytest.raises(ValueError, match="disagree"):
    _run(a, 1, plan=bare)
  with pytest.raises(ValueError, match="shift_freq"):
    _run(dict(a, shift_freq=None), 1)
  seed, t = _case(page_size=1, head_dim=64, groups=3, dead=0.3, q_len=3, dtype=jnp.bfloat16)
  t = _shifted(seed, t, spread=300)
  for fallback in ("triton", "reference"):
    _check_bf16(seed, _run(t, 1, fallback=fallback), _shifted_reference, t, layer=1)


def test_page_size_is_the_allocators():
  assert PagedAllocator(num_pages=4, page_size=pm.PAGE).page_size == pm.PAGE
  with pytest.raises(ValueError, match="pages_per_step"):
    pm.choose_page_tiling(8, 64, pages_per_step=3)


def test_ops_mosaic_impl():
  """impl="mosaic" through jaxkv.ops (compiled: GPU only) and its plan; on CPU the
  plan is built and the reference path serves "reference"."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=2, dtype=jnp.bfloat16)
  assert ops.resolve_impl("mosaic") == "mosaic"
  plan = ops.attention_plan(a["slot_map"], a["q_positions"], num_heads=6, num_kv_heads=2,
                            impl="mosaic", num_slots=a["k_pool"].shape[1])
  assert isinstance(plan, pm.PagePlan)
  with pytest.raises(ValueError, match="num_slots"):
    ops.attention_plan(a["slot_map"], a["q_positions"], num_heads=6, num_kv_heads=2,
                       impl="mosaic")
  if ON_GPU:
    got = ops.paged_attention(**a, layer=0, impl="mosaic", plan=plan)
    _check_bf16(seed, got, pa.paged_attention_reference, a, layer=0)


@pytest.mark.parametrize("q_len,head_dim,groups", [(1, 128, 7), (1, 64, 3), (256, 64, 3)])
def test_mosaic_lowers_for_cuda(q_len, head_dim, groups):
  """jax.export for cuda runs the whole Pallas -> Mosaic GPU lowering: the call
  holds one Mosaic GPU kernel (and the Triton fallback behind its lax.cond)."""
  b, hkv, layers, slots, t = 2, 2, 4, 8192, 4096
  args = (S((b, q_len, hkv * groups, head_dim), jnp.bfloat16),
          S((layers, slots, hkv, head_dim), jnp.bfloat16),
          S((layers, slots, hkv, head_dim), jnp.bfloat16), S((b, t), jnp.int32),
          S((b, q_len), jnp.int32), S((), jnp.int32))
  text = export_for_cuda(lambda *x: pm.paged_attention(*x[:5], layer=x[5]), *args,
                         targets=("__gpu$xla.gpu.triton", "mosaic_gpu_v2"))
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
  assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1


def _mosaic_operands(text: str) -> list[int]:
  """The operand count of each Mosaic GPU custom call in exported StableHLO text."""
  calls = re.findall(r"stablehlo\.custom_call @mosaic_gpu_v2\(([^)]*)\)", text)
  return [len([x for x in c.split(",") if x.strip()]) for c in calls]


@pytest.mark.parametrize("head_dim,q_len,pps", [(64, 1, 4), (128, 1, 4), (64, 1, 8),
                                                (64, 256, 4)])
def test_mosaic_key_shift_lowers_for_cuda(head_dim, q_len, pps):
  """The shifted kernel (rotation in registers, K @ P on the tensor cores, the rotated
  tile back in shared memory) goes through the whole Mosaic GPU lowering: decode, two
  64-key sub-blocks per step (8 pages), and a prefill chunk (a bf16 output tile). It
  takes three more operands than the unshifted kernel (shifts, frequencies, P)."""
  b, hkv, groups, layers, slots, t = 2, 2, 3, 4, 8192, 4096
  args = (S((b, q_len, hkv * groups, head_dim), jnp.bfloat16),
          S((layers, slots, hkv, head_dim), jnp.bfloat16),
          S((layers, slots, hkv, head_dim), jnp.bfloat16), S((b, t), jnp.int32),
          S((b, q_len), jnp.int32), S((), jnp.int32), S((b, t), jnp.int32),
          S((head_dim // 2,), jnp.float32))
  targets = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")
  text = export_for_cuda(
      lambda *x: pm.paged_attention(*x[:5], layer=x[5], key_shift=x[6], shift_freq=x[7],
                                    pages_per_step=pps), *args, targets=targets)
  bare = export_for_cuda(lambda *x: pm.paged_attention(*x[:5], layer=x[5], pages_per_step=pps),
                         *args[:6], targets=targets)
  assert len(_mosaic_operands(text)) == 1
  assert _mosaic_operands(text)[0] == _mosaic_operands(bare)[0] + 3


def test_tilings_past_shared_memory_run_the_fallback():
  """A tiling whose buffers do not fit in a Hopper block's shared memory
  (`smem_bytes`: head_dim 128 at 8 pages per step and 4 stages, with or without a
  shift) is routed to the fallback statically instead of failing to compile; the
  default tiling fits."""
  b, hkv, groups, layers, slots, t, d = 2, 2, 3, 4, 8192, 4096, 128
  args = (S((b, 1, hkv * groups, d), jnp.bfloat16), S((layers, slots, hkv, d), jnp.bfloat16),
          S((layers, slots, hkv, d), jnp.bfloat16), S((b, t), jnp.int32), S((b, 1), jnp.int32),
          S((), jnp.int32), S((b, t), jnp.int32), S((d // 2,), jnp.float32))
  for pps, stages, fits in ((8, 4, False), (4, None, True)):
    tiling = pm.choose_page_tiling(groups, t, programs=b * hkv, pages_per_step=pps,
                                   stages=stages)
    for shifted in (False, True):
      out = jnp.float32 if tiling.k_splits > 1 else jnp.bfloat16
      assert (pm.smem_bytes(tiling, d, jnp.bfloat16, out, shifted) <= pm.SMEM_BYTES) == fits
      n = 8 if shifted else 6
      text = export_for_cuda(
          lambda *x, pps=pps, stages=stages, n=n: pm.paged_attention(
              *x[:5], layer=x[5], pages_per_step=pps, stages=stages,
              **(dict(key_shift=x[6], shift_freq=x[7]) if n == 8 else {})),
          *args[:n], targets=("__gpu$xla.gpu.triton", "mosaic_gpu_v2"))
      assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == int(fits), (pps, shifted)


def test_model_forward_with_mosaic_lowers_for_cuda():
  """A bf16 model over a bf16 pool, attn_impl="mosaic": the forward's layer scan
  holds the Mosaic GPU kernel (its plan built once for the pass), lowered for CUDA,
  also with a key shift (the plan carries the shifts). Over a float32 pool
  (CacheConfig.dtype's default) the same call runs Triton."""
  from flax import nnx

  from jaxkv.config import ModelConfig
  from jaxkv.kv import state as kv_state
  from jaxkv.models.llama import Transformer

  cfg = ModelConfig(vocab_size=97, hidden_size=128, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=64)
  model = Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, weights = nnx.split(model)
  b, c = 2, 8
  tokens = jnp.zeros((b, c), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
  smap = pm.PAGE + jnp.arange(b * 32, dtype=jnp.int32).reshape(b, 32)

  def forward(weights, pool, shift=None):
    out = nnx.merge(graphdef, weights)(tokens, pos, pool, slot_map=smap, attn_impl="mosaic",
                                       key_shift=shift)
    return out.hidden, out.kv

  shift = S(smap.shape, jnp.int32)          # a MemArt row: keys rotated in the kernel
  operands = {}
  for dtype, shifted, want in ((jnp.bfloat16, False, 1), (jnp.float32, False, 0),
                               (jnp.bfloat16, True, 1)):
    pool = kv_state.init_slots(cfg, pm.PAGE * 8, dtype)
    text = export_for_cuda(forward, jax.eval_shape(lambda: weights),
                           jax.eval_shape(lambda pool=pool: pool),
                           *([shift] if shifted else []),
                           targets=("__gpu$xla.gpu.triton", "mosaic_gpu_v2"))
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == want, (dtype, shifted)
    operands[dtype, shifted] = _mosaic_operands(text)
  bf16 = jnp.bfloat16                         # the shifted kernel takes its three inputs
  assert operands[bf16, True][0] == operands[bf16, False][0] + 3
