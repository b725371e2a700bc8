"""Flash-LoRA on Mosaic GPU (`pallas_kernels/flash_lora_mosaic.py`) against the
materialise-then-attend reference: compiled on a GPU, in Mosaic GPU's own
interpreter elsewhere, lowered for CUDA with `jax.export`.

Inputs come from test_kernels' seeded `_case` (`JAXKV_TEST_SEED=random` for fresh
ones; the seed is in every failure message), pools poisoned as in
test_kernels_mosaic (`_poison_pages`: NaN in every slot of a page with no live
token, x100 noise in the dead slots of a read page; the low-rank pool too), with
a different B_i per sequence (one batch mixes agents). Tolerance: bfloat16, no
worse than twice the bf16 reference, both scored against the reference in
float32 (`_check_bf16`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import flash_lora_mosaic as fm
from pallas_kernels import paged_attention_mosaic as pm
from test_kernels import S, _case, _check_bf16, export_for_cuda
from test_kernels_mosaic import INTERPRET, _mosaic_operands, _poison_pages


def _run(a, layer, **kw):
  kw.setdefault("fallback", "reference")
  return fm.flash_lora_attention(**a, layer=layer, interpret=INTERPRET, **kw)


@pytest.mark.parametrize("head_dim,groups,dead,q_len,rank", [
    (64, 3, 0.0, 1, 8), pytest.param(64, 7, 0.5, 12, 8, marks=pytest.mark.slow),
    pytest.param(128, 1, 0.3, 1, 16, marks=pytest.mark.slow), (128, 3, 0.0, 4, 4)])
def test_mosaic_flash_lora_matches_materialise_then_attend(head_dim, groups, dead, q_len,
                                                            rank):
  """Decode and a chunk of two row blocks, GQA 1-7, dead tokens, ranks 4-16, 4 pages
  per step (and 8 at head_dim 64: two 64-key sub-blocks per step)."""
  seed, a = _case(page_size=16, head_dim=head_dim, groups=groups, dead=dead, q_len=q_len,
                  dtype=jnp.bfloat16, rank=rank, max_len=200)
  a = _poison_pages(seed, a)
  for pps in (4, 8) if head_dim == 64 else (4,):
    plan = pm.make_page_plan(a["slot_map"], a["q_positions"], num_heads=groups * 2,
                             num_kv_heads=2, num_slots=a["k_pool"].shape[1], pages_per_step=pps)
    assert bool(plan.paged), f"seed={seed}"
    got = _run(a, jnp.int32(1), plan=plan)
    _check_bf16(seed, got, fla.flash_lora_attention_reference, a, layer=1)
  # B = 0: plain paged attention
  zero = dict(a, lora_b=jnp.zeros_like(a["lora_b"]))
  plain = {k: v for k, v in zero.items() if k not in ("vlr_pool", "lora_b")}
  np.testing.assert_allclose(np.asarray(_run(zero, 1), np.float32),
                             np.asarray(pm.paged_attention(**plain, layer=1,
                                                           interpret=INTERPRET,
                                                           fallback="reference"), np.float32),
                             atol=1e-2, rtol=0, err_msg=f"seed={seed}")


def test_mosaic_flash_lora_splits_and_fallbacks():
  """Flash-decoding splits merged; a token-level slot map and a tiling past shared
  memory run the fallback (Triton or the reference) with the same result; a plan
  with key shifts is refused."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=1, max_len=1200,
                  dtype=jnp.bfloat16, rank=8)
  a = _poison_pages(seed, a)
  _check_bf16(seed, _run(a, 1, k_splits=3, stages=2), fla.flash_lora_attention_reference, a,
              layer=1)
  seed, t = _case(page_size=1, head_dim=64, groups=3, dead=0.3, q_len=3, dtype=jnp.bfloat16,
                  rank=8)
  for fallback in ("triton", "reference"):
    _check_bf16(seed, _run(t, 1, fallback=fallback), fla.flash_lora_attention_reference, t,
                layer=1)
  shifted = pm.make_page_plan(a["slot_map"], a["q_positions"], num_heads=6, num_kv_heads=2,
                              num_slots=a["k_pool"].shape[1],
                              key_shift=jnp.zeros_like(a["slot_map"]))
  with pytest.raises(ValueError, match="disagree"):
    _run(a, 1, plan=shifted)


@pytest.mark.parametrize("head_dim,q_len,rank,pps,stages,fits", [
    (128, 1, 8, 4, None, True), (64, 256, 8, 4, None, True), (64, 1, 16, 8, None, True),
    (128, 1, 8, 8, None, True), (128, 1, 8, 8, 3, False)])
def test_mosaic_flash_lora_lowers_for_cuda(head_dim, q_len, rank, pps, stages, fits):
  """The whole Mosaic GPU lowering: decode, a prefill chunk, two sub-blocks per step;
  the kernel takes two more operands than paged attention (V_lr listed, B_i), and a
  tiling past shared memory holds no Mosaic kernel (the Triton fallback only)."""
  b, hkv, groups, layers, slots, t = 2, 2, 3, 4, 8192, 4096
  args = (S((b, q_len, hkv * groups, head_dim), jnp.bfloat16),
          S((layers, slots, hkv, head_dim), jnp.bfloat16),
          S((layers, slots, hkv, head_dim), jnp.bfloat16), S((layers, slots, rank), jnp.bfloat16),
          S((b, rank, hkv, head_dim), jnp.bfloat16), S((b, t), jnp.int32),
          S((b, q_len), jnp.int32), S((), jnp.int32))
  targets = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")
  text = export_for_cuda(lambda *x: fm.flash_lora_attention(*x[:7], layer=x[7],
                                                            pages_per_step=pps,
                                                            stages=stages),
                         *args, targets=targets)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == int(fits)
  if fits:
    bare = export_for_cuda(lambda *x: pm.paged_attention(*x[:3], *x[5:7], layer=x[7],
                                                         pages_per_step=pps,
                                                         stages=stages),
                           *args, targets=targets)
    assert _mosaic_operands(text)[0] == _mosaic_operands(bare)[0] + 2


def test_ops_routes_mosaic_flash_lora():
  """impl="mosaic" with lora: a page plan, and the Mosaic Flash-LoRA kernel in the
  lowered call (was: the Triton kernel)."""
  seed, a = _case(page_size=16, head_dim=64, groups=3, dead=0.5, q_len=2, dtype=jnp.bfloat16,
                  rank=8)
  plan = ops.attention_plan(a["slot_map"], a["q_positions"], num_heads=6, num_kv_heads=2,
                            impl="mosaic", lora=True, num_slots=a["k_pool"].shape[1])
  assert isinstance(plan, pm.PagePlan), f"seed={seed}"
  shapes = [jax.eval_shape(lambda x=x: x) for x in (a["q"], a["k_pool"], a["v_pool"],
                                                    a["vlr_pool"], a["lora_b"], a["slot_map"],
                                                    a["q_positions"])]
  text = export_for_cuda(lambda *x: ops.flash_lora_attention(*x, layer=0, impl="mosaic"),
                         *shapes, targets=("__gpu$xla.gpu.triton", "mosaic_gpu_v2"))
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
