"""Pallas kernels against their pure-jnp references: compiled on a GPU, interpreted elsewhere.

One sweep serves both: `INTERPRET` is False when JAX's default backend is a
GPU (run `JAX_PLATFORMS=cuda pytest tests/test_kernels.py` there) and True on
CPU, as in JAX's own Pallas tests. The interpreter runs the same masked loads
as the GPU (`pa.read_rows`). References run at float32 matmul precision
("highest"), so a GPU's TF32 default never blurs them.

Seeds are pinned: each case draws its inputs from a seed derived from its
parameters (`JAXKV_TEST_SEED`, default 0, is added), so CI reruns the same
inputs; `JAXKV_TEST_SEED=random` draws fresh ones. The seed is in every
failure message.

Poisoning: the Pallas interpreter fills output buffers with NaN before the
kernel runs, so an unwritten output tile cannot pass; pool slots that no live
token references are NaN too, so a kernel reading a wrong slot cannot pass;
where stated, SENTINEL (slot 0) and whole key blocks are poisoned to prove that
dead and future key blocks are not read. That the loops visit live blocks only
is checked on the live-block tables themselves against a brute-force count.

Tolerances:
  float32: max abs error vs the reference <= 2e-5 (summation order of the
  online softmax; values are O(1)).
  bfloat16: a fixed bound flakes, because one output ulp is 2^-5 once |x| >= 4
  (the materialised LoRA V reaches that). So, as FlashAttention's own tests do,
  both the kernel and the bf16 reference are scored against the reference run
  in float32 on the same (bf16-valued) inputs, and the kernel's max error must
  be at most twice the bf16 reference's. Measured over 120 seeded cases: ratio
  0.75 median, 1.32 max (the kernel keeps P and accumulators in f32; the
  reference rounds P and the materialised V to bf16).
"""

from __future__ import annotations

import itertools
import os
import secrets
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.kv.state import SENTINEL
from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import paged_attention as pa

F32_TOL = 2e-5
NUM_LAYERS = 2
INTERPRET = jax.default_backend() != "gpu"


def _seed(params) -> int:
  base = os.environ.get("JAXKV_TEST_SEED", "0")
  if base == "random":
    return secrets.randbits(32)
  return (int(base) + zlib.crc32(repr(sorted(params.items())).encode())) % (1 << 32)


def _ref(fn, *args, **kwargs):
  """A reference at full float32 matmul precision (no TF32 on GPUs)."""
  with jax.default_matmul_precision("highest"):
    return fn(*args, **kwargs)


def _case(*, page_size, head_dim, groups, dead, q_len, dtype=jnp.float32, hkv=2, batch=3,
          max_len=48, rank=None, poison_free=True, shuffle_pages=True):
  """Random stacked pools, a paged ragged slot map, and queries at each row's end.

  Row lengths are ragged (row 0 full, the last row empty: all its queries are
  padding); tokens are laid out page by page on random distinct pages (page 0
  is reserved: it holds SENTINEL), or on consecutive pages with
  `shuffle_pages=False` (contiguous key blocks); a `dead` share of tokens is
  then evicted.
  """
  params = dict(locals())
  params["dtype"] = jnp.dtype(dtype).name
  seed = _seed(params)
  rng = np.random.default_rng(seed)
  lengths = np.concatenate([[max_len], rng.integers(1, max_len, batch - 2), [0]])
  pages_per_row = -(-max_len // page_size)
  num_pages = 1 + batch * pages_per_row + 3
  num_slots = num_pages * page_size
  order = rng.permutation(num_pages - 1) if shuffle_pages else np.arange(num_pages - 1)
  pages = 1 + order[:batch * pages_per_row].reshape(batch, -1)
  t = np.arange(max_len)
  slot_map = pages[:, t // page_size] * page_size + t % page_size
  slot_map[t[None, :] >= lengths[:, None]] = SENTINEL
  slot_map[rng.random(slot_map.shape) < dead] = SENTINEL
  slot_map = slot_map.astype(np.int32)

  def pool(*shape):
    x = rng.standard_normal((NUM_LAYERS, num_slots, *shape)).astype(np.float32)
    if poison_free:
      unused = np.setdiff1d(np.arange(num_slots), slot_map)
      x[:, unused] = np.nan
    x[:, SENTINEL] = 0.0
    return jnp.asarray(x, dtype)

  hq = hkv * groups
  q = jnp.asarray(rng.standard_normal((batch, q_len, hq, head_dim)), dtype)
  q_pos = lengths[:, None] - q_len + np.arange(q_len)[None, :]
  q_pos = np.where(q_pos >= 0, q_pos, -1).astype(np.int32)
  out = dict(q=q, k_pool=pool(hkv, head_dim), v_pool=pool(hkv, head_dim),
             slot_map=jnp.asarray(slot_map), q_positions=jnp.asarray(q_pos))
  if rank:
    out["vlr_pool"] = pool(rank)
    out["lora_b"] = jnp.asarray(rng.standard_normal((batch, rank, hkv, head_dim)) * 0.5, dtype)
  return seed, out


def _check(seed, got, want):
  """float32: max abs error against the reference."""
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert np.isfinite(got).all(), f"seed={seed}: NaN/inf in kernel output"
  err = np.abs(got - want).max()
  assert err <= F32_TOL, f"seed={seed}: max abs error {err} > {F32_TOL}"


def _check_bf16(seed, got, reference, a, layer):
  """bfloat16: no worse than twice the bf16 reference, both scored against the
  reference computed in float32 on the same inputs."""
  assert got.dtype == jnp.bfloat16
  up = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in a.items()}
  truth = np.asarray(_ref(reference, **up, layer=layer), np.float32)
  got = np.asarray(got, np.float32)
  assert np.isfinite(got).all(), f"seed={seed}: NaN/inf in kernel output"
  err = np.abs(got - truth).max()
  ref_err = np.abs(np.asarray(reference(**a, layer=layer), np.float32) - truth).max()
  assert err <= 2 * ref_err + 1e-6, (
      f"seed={seed}: kernel error {err} > 2 x bf16 reference error {ref_err}")


@pytest.mark.parametrize("q_dtype,pool_dtype", [(jnp.bfloat16, jnp.float32),
                                                 (jnp.float32, jnp.bfloat16)])
def test_mixed_query_and_pool_dtypes(q_dtype, pool_dtype):
  """A bf16 model over an fp32 pool (CacheConfig.dtype's default) and the reverse:
  both kernels promote the tiles as the reference's jnp arithmetic does (this
  failed in the CUDA lowering before: Triton's dot takes one element type).
  Tolerance: the fp32 reference of the same (promoted) inputs, within one output
  rounding of q's dtype (2^-7 relative for bf16) + 1e-5."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=5, rank=8,
                  dtype=pool_dtype)
  a = dict(a, q=a["q"].astype(q_dtype), lora_b=a["lora_b"].astype(q_dtype))
  up = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in a.items()}
  paged = ("q", "k_pool", "v_pool", "slot_map", "q_positions")
  cases = [(pa.paged_attention, pa.paged_attention_reference, paged),
           (fla.flash_lora_attention, fla.flash_lora_attention_reference, None)]
  for kernel, reference, keys in cases:
    pick = (lambda d, keys=keys: {k: d[k] for k in keys} if keys else d)
    got = kernel(**pick(a), layer=1, interpret=INTERPRET)
    assert got.dtype == q_dtype, f"seed={seed}: output {got.dtype}, queries {q_dtype}"
    want = np.asarray(_ref(reference, **pick(up), layer=1), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -7, atol=1e-5,
                               err_msg=f"seed={seed}: {kernel.__name__}")


SWEEP = list(itertools.product([1, 16], [64, 128], [1, 3, 7], [0.0, 0.5, 1.0]))


@pytest.mark.parametrize("page_size,head_dim,groups,dead", SWEEP)
def test_paged_attention_matches_reference(page_size, head_dim, groups, dead):
  for q_len in (1, 12):  # decode, and a prefill chunk (ragged rows mix real and padding)
    seed, a = _case(page_size=page_size, head_dim=head_dim, groups=groups, dead=dead,
                    q_len=q_len)
    layer = jnp.int32(1)
    want = _ref(pa.paged_attention_reference, **a, layer=layer)
    got = pa.paged_attention(**a, layer=layer, block_k=16, interpret=INTERPRET)
    _check(seed, got, want)
    if dead == 1.0:
      assert not np.asarray(got).any(), "all-dead rows must return exact zeros"


@pytest.mark.parametrize("head_dim,groups", [(64, 3), (128, 7)])
@pytest.mark.parametrize("q_len", [1, 12])
def test_paged_attention_bf16(head_dim, groups, q_len):
  seed, a = _case(page_size=16, head_dim=head_dim, groups=groups, dead=0.5, q_len=q_len,
                  dtype=jnp.bfloat16)
  got = pa.paged_attention(**a, layer=0, interpret=INTERPRET)
  _check_bf16(seed, got, pa.paged_attention_reference, a, layer=0)


@pytest.mark.parametrize("k_splits,block_k", [(None, None), (3, 16), (8, 32)])
def test_key_splits_merge_exactly(k_splits, block_k):
  """Flash-decoding: per-split partial softmaxes merge to the single-pass result."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=1, max_len=1200)
  want = _ref(pa.paged_attention_reference, **a, layer=1)
  got = pa.paged_attention(**a, layer=1, k_splits=k_splits, block_k=block_k, interpret=INTERPRET)
  _check(seed, got, want)


def test_dead_and_future_blocks_are_skipped_not_read():
  """Poison SENTINEL and every key block past the last query: a kernel that read
  them would multiply NaN by a zero weight and return NaN."""
  block_k = 16
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.0, q_len=4, batch=2,
                  max_len=96)
  sm = np.array(a["slot_map"])
  sm[:, 16:48] = SENTINEL                      # two whole dead blocks inside the context
  sm[1, :] = SENTINEL                          # and an entirely dead row
  q_pos = np.array([[60, 61, 62, 63], [-1, -1, -1, -1]], np.int32)
  a.update(slot_map=jnp.asarray(sm), q_positions=jnp.asarray(q_pos))
  want = _ref(pa.paged_attention_reference, **a, layer=0)
  k, v = np.array(a["k_pool"]), np.array(a["v_pool"])
  future = sm[0, 64:]                          # live slots, but after every query
  for x in (k, v):
    x[:, SENTINEL] = np.nan
    x[:, future] = np.nan
  a.update(k_pool=jnp.asarray(k), v_pool=jnp.asarray(v))
  got = pa.paged_attention(**a, layer=0, block_k=block_k, interpret=INTERPRET)
  _check(seed, got, want)


def _brute_force_blocks(slot_map, row_pos, block_r, block_k):
  """Per (row, row block): the blocks of compacted live tokens visible to it (first
  token at or before its last query) and which of them are contiguous."""
  out = {}
  for i in range(slot_map.shape[0]):
    t = np.flatnonzero(slot_map[i] != SENTINEL)        # live tokens, in position order
    blocks = [(k, t[k * block_k:(k + 1) * block_k]) for k in range(-(-len(t) // block_k))]
    for rb in range(row_pos.shape[1] // block_r):
      last = row_pos[i, rb * block_r:(rb + 1) * block_r].max()
      live = {k for k, pos in blocks if pos[0] <= last}
      contig = {k for k in live if len(blocks[k][1]) == block_k and
                (np.diff(slot_map[i, blocks[k][1]]) == 1).all()}
      out[i, rb] = live, contig
  return out


@pytest.mark.parametrize("k_splits", [1, 3, 4])
@pytest.mark.parametrize("page_size,dead,shuffle", [(16, 0.0, False), (16, 0.3, False),
                                                     (1, 0.5, True), (16, 0.97, True)])
def test_live_block_tables_visit_exactly_the_live_visible_blocks(k_splits, page_size, dead,
                                                                 shuffle):
  """After compaction, the loops' ranges cover every block of live tokens that
  starts at or before the row block's last query once, and nothing else (dead
  tokens and future blocks cost no iteration); contiguous blocks go down the
  range path; splits get equal shares (+- 1)."""
  block_k, block_r = 16, 16
  seed, a = _case(page_size=page_size, head_dim=64, groups=3, dead=dead, q_len=12,
                  max_len=200, batch=4, shuffle_pages=shuffle)
  hkv = a["k_pool"].shape[2]
  for contiguous in (True, False):
    tiling, (cslots, cpos, row_pos, _, table, bounds), shifts = pa.prepare(
        a["q"], a["q_positions"], a["slot_map"], hkv, block_r=block_r, block_k=block_k,
        k_splits=k_splits, contiguous=contiguous)
    assert shifts is None
    sm, row_pos = np.asarray(a["slot_map"]), np.asarray(row_pos)
    cslots, cpos = np.asarray(cslots), np.asarray(cpos)
    table, bounds = np.asarray(table), np.asarray(bounds)
    for i in range(sm.shape[0]):            # compaction keeps live tokens in order
      t = np.flatnonzero(sm[i] != SENTINEL)
      np.testing.assert_array_equal(cslots[i, :len(t)], sm[i, t])
      np.testing.assert_array_equal(cpos[i, :len(t)], t)
      assert (cslots[i, len(t):] == SENTINEL).all() and (cpos[i, len(t):] > 10 ** 6).all()
    assert tiling.k_splits == k_splits and bounds.shape[2] == k_splits
    want = _brute_force_blocks(sm, row_pos, block_r, block_k)
    for (i, rb), (live, contig) in want.items():
      if not contiguous:
        contig = set()
      got_c, got_g, shares = [], [], []
      for c_lo, c_hi, g_lo, g_hi in bounds[i, rb]:
        got_c += list(table[i, c_lo:c_hi])
        got_g += list(table[i, g_lo:g_hi])
        shares.append(c_hi - c_lo + g_hi - g_lo)
      assert sorted(got_c) == sorted(contig), f"seed={seed} row {i} block {rb}"
      assert sorted(got_c + got_g) == sorted(live), f"seed={seed} row {i} block {rb}"
      assert len(got_c + got_g) == len(set(got_c + got_g)), f"seed={seed}: a block twice"
      assert max(shares) - min(shares) <= 1, f"seed={seed}: {shares}"
    if page_size == 16 and dead == 0.0 and contiguous:
      assert bounds[..., 1].sum() > 0, "consecutive pages must take the contiguous path"
    if dead == 0.97:   # 97% evicted: about 6 live tokens a row, one block, not 13
      assert (bounds[..., 3] - bounds[..., 2] + bounds[..., 1] - bounds[..., 0]).sum(-1).max() <= 2


@pytest.mark.parametrize("fla_kernel", [False, True])
def test_contiguous_and_gather_paths_agree(fla_kernel):
  """Consecutive pages (range reads) and the same data forced through the masked
  gather give the reference's result; 64-key blocks span four 16-token pages."""
  seed, a = _case(page_size=16, head_dim=64, groups=7, dead=0.0, q_len=5, max_len=300,
                  shuffle_pages=False, rank=8 if fla_kernel else None)
  if fla_kernel:
    fn, ref = fla.flash_lora_attention, fla.flash_lora_attention_reference
  else:
    fn, ref = pa.paged_attention, pa.paged_attention_reference
  want = _ref(ref, **a, layer=1)
  for contiguous in (True, False):
    got = fn(**a, layer=1, block_k=64, k_splits=2, contiguous=contiguous, interpret=INTERPRET)
    _check(seed, got, want)


def test_unstacked_pool_and_scale():
  seed, a = _case(page_size=1, head_dim=64, groups=3, dead=0.5, q_len=5)
  a["k_pool"], a["v_pool"] = a["k_pool"][0], a["v_pool"][0]
  want = _ref(pa.paged_attention_reference, **a, scale=0.3)
  got = pa.paged_attention(**a, scale=0.3, interpret=INTERPRET)
  _check(seed, got, want)


LORA_SWEEP = [(4, 1, 0.0), (8, 3, 0.5), (16, 7, 1.0), (4, 7, 0.5), (8, 1, 1.0), (16, 3, 0.0)]


@pytest.mark.parametrize("rank,groups,dead", LORA_SWEEP)
@pytest.mark.parametrize("page_size", [1, 16])
def test_flash_lora_matches_materialize_then_attend(rank, groups, dead, page_size):
  for q_len in (1, 12):
    seed, a = _case(page_size=page_size, head_dim=64, groups=groups, dead=dead, q_len=q_len,
                    rank=rank)
    want = _ref(fla.flash_lora_attention_reference, **a, layer=1)
    got = fla.flash_lora_attention(**a, layer=1, block_k=16, interpret=INTERPRET)
    _check(seed, got, want)


def test_flash_lora_head_dim_128_bf16_and_splits():
  seed, a = _case(page_size=16, head_dim=128, groups=3, dead=0.5, q_len=1, rank=8,
                  max_len=700, dtype=jnp.bfloat16)
  got = fla.flash_lora_attention(**a, layer=0, k_splits=4, interpret=INTERPRET)
  _check_bf16(seed, got, fla.flash_lora_attention_reference, a, layer=0)


def test_flash_lora_per_sequence_adapters_equal_separate_runs():
  """One batch mixing adapters equals running each sequence with its own B alone."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=3, rank=8)
  both = fla.flash_lora_attention(**a, layer=0, interpret=INTERPRET)
  for i in range(a["q"].shape[0]):
    one = {k: (v[i:i + 1] if k in ("q", "slot_map", "q_positions", "lora_b") else v)
           for k, v in a.items()}
    alone = fla.flash_lora_attention(**one, layer=0, interpret=INTERPRET)
    _check(seed, both[i:i + 1], alone)


def test_flash_lora_with_zero_b_is_paged_attention():
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=4, rank=4)
  a["lora_b"] = jnp.zeros_like(a["lora_b"])
  got = fla.flash_lora_attention(**a, layer=0, interpret=INTERPRET)
  a.pop("vlr_pool"), a.pop("lora_b")
  _check(seed, got, _ref(pa.paged_attention_reference, **a, layer=0))


def test_bad_shapes_raise_clear_errors():
  _, a = _case(page_size=16, head_dim=64, groups=3, dead=0.0, q_len=1, rank=4)
  with pytest.raises(ValueError, match="lora_b"):
    fla.flash_lora_attention(**{**a, "lora_b": a["lora_b"][:, :2]}, layer=0, interpret=INTERPRET)
  with pytest.raises(ValueError, match="multiple of KV heads"):
    pa.paged_attention(a["q"][:, :, :5], a["k_pool"], a["v_pool"], a["slot_map"],
                       a["q_positions"], layer=0, interpret=INTERPRET)
  with pytest.raises(ValueError, match="unknown attention impl"):
    ops.paged_attention(a["q"], a["k_pool"], a["v_pool"], a["slot_map"], a["q_positions"],
                        layer=0, impl="flashinfer")


@pytest.mark.parametrize("fla_kernel", [False, True])
def test_one_plan_serves_every_layer(fla_kernel):
  """A plan made once (what a forward pass shares across its layers) gives each
  layer the same result as the per-call set-up, and the reference's."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.4, q_len=3, max_len=90,
                  rank=8 if fla_kernel else None)
  kernel, reference, mod = ((fla.flash_lora_attention, fla.flash_lora_attention_reference, fla)
                            if fla_kernel else (pa.paged_attention, pa.paged_attention_reference,
                                                pa))
  hq, hkv = a["q"].shape[2], a["k_pool"].shape[2]
  plan = mod.make_plan(a["slot_map"], a["q_positions"], num_heads=hq, num_kv_heads=hkv,
                       k_splits=2)
  assert isinstance(plan, pa.Plan) and plan.tiling.k_splits == 2
  if fla_kernel:
    assert plan.tiling.block_k == fla.DEFAULT_BLOCK_K
  for layer in range(NUM_LAYERS):
    got = kernel(**a, layer=layer, plan=plan, interpret=INTERPRET)
    _check(seed, got, _ref(reference, **a, layer=layer))
    per_call = kernel(**a, layer=layer, k_splits=2, block_k=plan.tiling.block_k,
                      interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(got), np.asarray(per_call), rtol=0, atol=1e-6)


def test_plan_mismatch_and_knobs_beside_a_plan_raise():
  _, a = _case(page_size=16, head_dim=64, groups=3, dead=0.0, q_len=2)
  hq, hkv = a["q"].shape[2], a["k_pool"].shape[2]
  plan = pa.make_plan(a["slot_map"][:2], a["q_positions"][:2], num_heads=hq, num_kv_heads=hkv)
  with pytest.raises(ValueError, match="was not made for"):
    pa.paged_attention(**a, layer=0, plan=plan, interpret=True)
  plan = pa.make_plan(a["slot_map"], a["q_positions"], num_heads=hq, num_kv_heads=hkv)
  with pytest.raises(ValueError, match="tiling knobs"):
    pa.paged_attention(**a, layer=0, plan=plan, block_k=32, interpret=True)
  with pytest.raises(ValueError, match="not a multiple"):
    pa.make_plan(a["slot_map"], a["q_positions"], num_heads=5, num_kv_heads=2)
  assert ops.attention_plan(a["slot_map"], a["q_positions"], num_heads=hq, num_kv_heads=hkv,
                            impl="reference") is None


@pytest.mark.parametrize("batch,hkv,t,want", [
    (1, 8, 32768, 32),    # 8 programs: split until ~256 programs run
    (1, 2, 65536, 64),    # ... at most MAX_SPLITS
    (1, 8, 8192, 16),     # >= 512 context tokens per split
    (8, 8, 32768, 16),    # 64 programs: the 16-split default already fills the GPU
    (64, 8, 32768, 16),
    (1, 2, 300, 1),       # short contexts are not split
])
def test_decode_splits_fill_the_gpu_at_small_batch(batch, hkv, t, want):
  sm = jnp.ones((batch, t), jnp.int32)
  qp = jnp.full((batch, 1), t - 1, jnp.int32)
  plan = jax.eval_shape(lambda s, p: pa.make_plan(s, p, num_heads=7 * hkv, num_kv_heads=hkv),
                        sm, qp)
  assert plan.tiling.k_splits == want
  prefill = pa.choose_tiling(7 * 256, t, programs=batch * hkv)
  assert prefill.k_splits == 1      # several row blocks: no splits


def test_ops_dispatch():
  assert ops.resolve_impl("auto") == ("pallas" if jax.default_backend() == "gpu"
                                      else "reference")
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=2, rank=4)
  kernel = "interpret" if INTERPRET else "pallas"
  want = _ref(ops.flash_lora_attention, **a, layer=0, impl="reference")
  _check(seed, ops.flash_lora_attention(**a, layer=0, impl=kernel), want)
  a.pop("vlr_pool"), a.pop("lora_b")
  want = _ref(ops.paged_attention, **a, layer=0, impl="reference")
  _check(seed, ops.paged_attention(**a, layer=0, impl=kernel), want)


# ----------------------------------------------------------------------------
# GPU lowering without a GPU (docs/kernels.md): jax.export for cuda runs the whole
# Pallas -> Triton lowering, so shape/op constraints of the GPU path are checked.
# ----------------------------------------------------------------------------

def export_for_cuda(fn, *shapes, targets=("__gpu$xla.gpu.triton",)):
  """The StableHLO text of fn exported for cuda, its kernels' custom calls allowed."""
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in targets],
  )(*shapes)
  return exported.mlir_module()


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_len,head_dim,groups", [(1, 128, 7), (256, 64, 3)])
def test_kernels_lower_for_cuda(dtype, q_len, head_dim, groups):
  b, hkv, layers, slots, t = 2, 2, 4, 8192, 4096
  q = S((b, q_len, hkv * groups, head_dim), dtype)
  pool = S((layers, slots, hkv, head_dim), dtype)
  sm, qp, layer = S((b, t), jnp.int32), S((b, q_len), jnp.int32), S((), jnp.int32)
  text = export_for_cuda(lambda *x: pa.paged_attention(*x[:5], layer=x[5]),
                         q, pool, pool, sm, qp, layer)
  assert text.count("__gpu$xla.gpu.triton") == 1
  lr, lb = S((layers, slots, 8), dtype), S((b, 8, hkv, head_dim), dtype)
  text = export_for_cuda(lambda *x: fla.flash_lora_attention(*x[:7], layer=x[7]),
                         q, pool, pool, lr, lb, sm, qp, layer)
  assert text.count("__gpu$xla.gpu.triton") == 1


def test_kernels_lower_for_cuda_mixed_dtypes():
  """bf16 queries over an fp32 pool (a bf16 model with CacheConfig's default
  pool) lower for CUDA: the tiles are promoted, Triton's dot sees one type."""
  b, hkv, g, d, layers, slots, t = 2, 2, 7, 128, 4, 8192, 4096
  q, pool = S((b, 1, hkv * g, d), jnp.bfloat16), S((layers, slots, hkv, d), jnp.float32)
  sm, qp, layer = S((b, t), jnp.int32), S((b, 1), jnp.int32), S((), jnp.int32)
  text = export_for_cuda(lambda *x: pa.paged_attention(*x[:5], layer=x[5]),
                         q, pool, pool, sm, qp, layer)
  assert text.count("__gpu$xla.gpu.triton") == 1
  lr, lb = S((layers, slots, 8), jnp.float32), S((b, 8, hkv, d), jnp.bfloat16)
  text = export_for_cuda(lambda *x: fla.flash_lora_attention(*x[:7], layer=x[7]),
                         q, pool, pool, lr, lb, sm, qp, layer)
  assert text.count("__gpu$xla.gpu.triton") == 1


def test_mosaic_gpu_backend_cannot_take_this_kernel(monkeypatch):
  """Why the Mosaic GPU kernel is a kernel of its own (paged_attention_mosaic.py,
  docs/kernels.md): this one, lowered with the Mosaic GPU backend, has its
  whole-array pool operands staged in shared memory (Mosaic copies every operand
  block in with TMA, which moves rectangular tiles, not the per-token gathers this
  kernel reads)."""
  plmgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  monkeypatch.setattr(pa, "compiler_params", lambda *_: plmgpu.CompilerParams())
  b, hkv, g, d, slots, t = 2, 2, 7, 128, 8192, 4096
  args = (S((b, 1, hkv * g, d), jnp.bfloat16), S((4, slots, hkv, d), jnp.bfloat16),
          S((4, slots, hkv, d), jnp.bfloat16), S((b, t), jnp.int32), S((b, 1), jnp.int32),
          S((), jnp.int32))
  pa.paged_attention.clear_cache()      # a cached Triton trace of these shapes would be reused
  try:
    with pytest.raises(Exception, match="shared memory"):
      jax.export.export(jax.jit(lambda *x: pa.paged_attention(*x[:5], layer=x[5])),
                        platforms=["cuda"])(*args)
  finally:
    pa.paged_attention.clear_cache()    # ... and neither may this Mosaic one be
