"""Flash-LoRA attention (LRAgent's shared low-rank value cache) on Mosaic GPU (Hopper).

Same contract as `flash_lora_attention.flash_lora_attention_reference` (read that
module's docstring): V_i = V_base + V_lr B_i, V_lr [slots, r] shared by heads and
agents, B_i [r, Hkv, D] per sequence's adapter.

It is the page-by-page Mosaic kernel of `paged_attention_mosaic.py` (pages of K and
V by TMA, the mask in the tile, the same `PagePlan`) with one change in the step:
the V tile it multiplies by P is V_base + V_lr B_i, built in registers from the
fetched V page and the listed keys' low-rank values (r rank-1 updates: a rank below
16 is under a 16-bit WGMMA's K), rounded to the pool's dtype and put back in shared
memory for the P V WGMMA. So the effective values never reach global memory (the
materialising path writes and reads a [T, Hkv, D] tensor per agent), and V_lr is
read in its rank-r form: per call, its rows at the listed keys are gathered once
per layer ([B, r, listed keys], key-minor so a step's values are one TMA box).

Seed Algorithm 1 instead accumulates P V_lr and applies B_i once per query block;
on the tensor cores that needs a [block_k, r] WGMMA operand, which a rank of 8
cannot fill. Per step the update costs r x block_k x D multiply-adds on the CUDA
cores beside the tile's two WGMMAs.

Limits (routed to the fallback: the Triton Flash-LoRA kernel or the reference):
those of `paged_attention_mosaic.supported`, a slot map that is not page by page,
and a tiling past shared memory (`smem_bytes` with the rank).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_attention_mosaic as pm


@pm.settled
@functools.partial(jax.jit, static_argnames=(
    "scale", "pages_per_step", "k_splits", "stages", "stage_starts", "fallback",
    "interpret"))
def flash_lora_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                         vlr_pool: jax.Array, lora_b: jax.Array, slot_map: jax.Array,
                         q_positions: jax.Array, *, layer: jax.Array | int | None = None,
                         scale: float | None = None, plan: pm.PagePlan | None = None,
                         pages_per_step: int | None = None, k_splits: int | None = None,
                         stages: int | None = None, stage_starts: bool | None = None,
                         fallback: str = "triton", interpret: bool = False) -> jax.Array:
  """Mosaic GPU Flash-LoRA; same arguments and result as
  `flash_lora_attention.flash_lora_attention_reference`. `plan`, the tiling knobs,
  `fallback` and `interpret` as `paged_attention_mosaic.paged_attention`."""
  if fallback not in ("triton", "reference"):
    raise ValueError(f"fallback must be 'triton' or 'reference', got {fallback!r}")
  fla.check_shapes(q, k_pool, vlr_pool, lora_b, pa.flat_pool(k_pool, layer)[0],
                   pa.flat_pool(vlr_pool, layer)[0])

  def other():
    if fallback == "reference":
      return fla.flash_lora_attention_reference(q, k_pool, v_pool, vlr_pool, lora_b, slot_map,
                                                q_positions, layer=layer, scale=scale)
    return fla.flash_lora_attention(q, k_pool, v_pool, vlr_pool, lora_b, slot_map, q_positions,
                                    layer=layer, scale=scale, interpret=interpret)

  return pm.dispatch(q, k_pool, v_pool, slot_map, q_positions, other, layer=layer, plan=plan,
                     pages_per_step=pages_per_step, k_splits=k_splits, stages=stages,
                     stage_starts=stage_starts, scale=scale, interpret=interpret,
                     lora=(vlr_pool, lora_b))


__all__ = ["flash_lora_attention"]
