"""Keys rotated on read inside the Triton paged-attention kernel (MemArt's aliased
slots, `pallas_kernels/key_shift.py`) against the reference path of `jaxkv.ops`
(gather, rotate with `apply_rope`, attend): interpreted on CPU, compiled on a GPU,
seeded as in tests/test_kernels.py (the seed is in every failure message), on the
same poisoned pools (unreferenced slots are NaN, so a wrong read cannot pass).

Tolerances: float32 max abs error <= 2e-5, as the unshifted sweep (the rotation's
angles are the same float32 products on both sides); bfloat16 within twice the bf16
reference's error against the float32 reference (tests/test_kernels.py explains).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.config import RopeConfig
from jaxkv.rope import delta_frequencies
from pallas_kernels import paged_attention as pa
from test_kernels import INTERPRET, NUM_LAYERS, S, _case, _check, _ref, export_for_cuda

IMPL = "interpret" if INTERPRET else "pallas"
ROPE = RopeConfig(theta=10000.0)
LLAMA3 = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position=8192)


def _shifted(seed, a, spread=5000, rope=ROPE):
  """The case's inputs plus seeded shifts in [-spread, spread] and their frequencies."""
  rng = np.random.default_rng(seed + 1)
  shift = rng.integers(-spread, spread + 1, a["slot_map"].shape).astype(np.int32)
  return dict(a, key_shift=jnp.asarray(shift),
              shift_freq=delta_frequencies(rope, a["q"].shape[-1]))


@pytest.mark.parametrize("page_size,shuffle,dead", [(16, False, 0.0), (16, True, 0.3),
                                                    (1, True, 0.5)])
@pytest.mark.parametrize("q_len,head_dim,groups", [(1, 64, 3), (12, 128, 2)])
def test_shifted_kernel_matches_the_reference(page_size, shuffle, dead, q_len, head_dim,
                                              groups):
  """Contiguous blocks (consecutive pages: one range read, swapped by a second
  load) and gathered ones (shuffled pages, pruned holes), decode and a chunk."""
  seed, a = _case(page_size=page_size, head_dim=head_dim, groups=groups, dead=dead,
                  q_len=q_len, shuffle_pages=shuffle, max_len=80)
  a = _shifted(seed, a)
  for layer in range(NUM_LAYERS):
    want = _ref(ops.paged_attention, **a, layer=layer, impl="reference")
    _check(seed, ops.paged_attention(**a, layer=layer, impl=IMPL), want)


@pytest.mark.parametrize("k_splits,block_k", [(3, 16), (8, 32)])
def test_shifted_splits_and_llama3_frequencies(k_splits, block_k):
  seed, a = _case(page_size=16, head_dim=64, groups=4, dead=0.2, q_len=1, max_len=200)
  a = _shifted(seed, a, spread=30000, rope=LLAMA3)
  want = _ref(ops.paged_attention, **a, layer=1, impl="reference")
  got = pa.paged_attention(**a, layer=1, k_splits=k_splits, block_k=block_k,
                           interpret=INTERPRET)
  _check(seed, got, want)


def test_zero_shift_is_the_unshifted_kernel():
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.3, q_len=5)
  plain = pa.paged_attention(**a, layer=0, interpret=INTERPRET)
  zero = pa.paged_attention(**a, layer=0, interpret=INTERPRET,
                            key_shift=jnp.zeros_like(a["slot_map"]),
                            shift_freq=delta_frequencies(RopeConfig(theta=10000.0), 64))
  np.testing.assert_allclose(np.asarray(zero), np.asarray(plain), rtol=0, atol=1e-6,
                             err_msg=f"seed={seed}")


@pytest.mark.parametrize("q_len", [1, 7])
def test_shifted_kernel_bf16(q_len):
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.3, q_len=q_len,
                  dtype=jnp.bfloat16)
  a = _shifted(seed, a)
  got = ops.paged_attention(**a, layer=0, impl=IMPL)
  assert got.dtype == jnp.bfloat16
  up = {k: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for k, v in a.items()}
  truth = np.asarray(_ref(ops.paged_attention, **up, layer=0, impl="reference"), np.float32)
  ref16 = np.asarray(ops.paged_attention(**a, layer=0, impl="reference"), np.float32)
  err, ref_err = (np.abs(np.asarray(x, np.float32) - truth).max() for x in (got, ref16))
  assert np.isfinite(np.asarray(got, np.float32)).all(), f"seed={seed}"
  assert err <= 2 * ref_err + 1e-6, f"seed={seed}: kernel {err} > 2 x bf16 reference {ref_err}"


def test_one_shifted_plan_serves_every_layer_and_plans_must_match():
  """`ops.attention_plan(..., key_shift=)` builds the shifted plan once (what the
  model does for a MemArt batch); a plan without shifts beside a key_shift, or the
  reverse, is refused; a Mosaic plan carries the shifts too; Flash-LoRA calls get no
  plan (reference path)."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.3, q_len=3, max_len=64)
  a = _shifted(seed, a)
  hq, hkv = a["q"].shape[2], a["k_pool"].shape[2]
  kw = dict(num_heads=hq, num_kv_heads=hkv)
  plan = ops.attention_plan(a["slot_map"], a["q_positions"], impl=IMPL,
                            key_shift=a["key_shift"], **kw)
  assert plan.shifts is not None and plan.shifts.shape == plan.slots.shape
  for layer in range(NUM_LAYERS):
    want = _ref(ops.paged_attention, **a, layer=layer, impl="reference")
    _check(seed, ops.paged_attention(**a, layer=layer, impl=IMPL, plan=plan), want)
  bare = pa.make_plan(a["slot_map"], a["q_positions"], **kw)
  with pytest.raises(ValueError, match="disagree"):
    pa.paged_attention(**a, layer=0, plan=bare, interpret=True)
  unshifted = {k: v for k, v in a.items() if k not in ("key_shift", "shift_freq")}
  with pytest.raises(ValueError, match="disagree"):
    pa.paged_attention(**unshifted, layer=0, plan=plan, interpret=True)
  mosaic = ops.attention_plan(a["slot_map"], a["q_positions"], impl="mosaic",
                              key_shift=a["key_shift"], num_slots=1024, **kw)
  assert mosaic.shifts is not None          # the Mosaic kernel rotates in its tile too
  assert ops.attention_plan(a["slot_map"], a["q_positions"], impl=IMPL, lora=True,
                            key_shift=a["key_shift"], num_slots=1024, **kw) is None


def test_compacted_shifts_follow_the_live_tokens():
  slots = jnp.asarray([[0, 5, 6, 0, 9], [3, 0, 0, 0, 4]], jnp.int32)
  shift = jnp.asarray([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], jnp.int32)
  cslots, _, got = pa.compact_live(slots, 8, shift)
  np.testing.assert_array_equal(got, [[2, 3, 5, 0, 0, 0, 0, 0], [6, 10, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(cslots[:, :3], [[5, 6, 9], [3, 4, 0]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shifted_kernel_lowers_for_cuda(dtype):
  """The whole Pallas -> Triton lowering of the shifted kernel (the second, swapped
  load; cos / sin in the kernel), for decode at 4k context."""
  b, hkv, g, d, layers, slots, t = 2, 2, 7, 128, 4, 8192, 4096
  q, pool = S((b, 1, hkv * g, d), dtype), S((layers, slots, hkv, d), dtype)
  sm, qp, layer = S((b, t), jnp.int32), S((b, 1), jnp.int32), S((), jnp.int32)
  shift, freq = S((b, t), jnp.int32), S((d // 2,), jnp.float32)
  text = export_for_cuda(
      lambda *x: pa.paged_attention(*x[:5], layer=x[5], key_shift=x[6], shift_freq=x[7]),
      q, pool, pool, sm, qp, layer, shift, freq)
  assert text.count("__gpu$xla.gpu.triton") == 1
