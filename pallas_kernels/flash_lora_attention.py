"""Flash-LoRA-Attention (LRAgent, seed 000 Algorithm 1) over the paged slot map.

LRAgent shares one low-rank value cache across agents: for a LoRA on W_v with
shared down-projection A and per-agent up-projection B_i, a token's value is

    V_i = x W_v + (x A) B_i = V_base + V_lr B_i,      V_lr = x A * scale: [slots, r]

and V_lr is shared across heads and agents. Materialising V_i costs a full
[T, Hkv, D] tensor per agent; Algorithm 1 instead runs one online-softmax pass
that accumulates both P V_base ([rows, D]) and P V_lr ([rows, r]), and applies
B_i once per query block after the key loop:

    O = (P V_base + (P V_lr) B_i) / l

so the per-agent work is one [rows, r] x [r, D] product per block, and the LR
cache is read in its native rank-r form.

Masking, GQA folding, live-block tables (dead and future blocks are never
visited), the contiguous / gather read paths, key splits and the stacked-pool
layout are those of `paged_attention.py` (same contract, same plumbing).
Triton wants every matmul dim >= 16, so ranks r < 16 are read as r_pad = 16
columns whose extra columns repeat column r - 1, and B is zero-padded to
r_pad rows: the duplicates meet zero rows of B, so the result is exact and the
pool is never copied or padded.

Shapes: q [B, Tq, Hq, D]; k_pool, v_pool [S, Hkv, D] (or [L, S, Hkv, D] with
`layer`); vlr_pool [S, r] (or [L, S, r]), r a power of two; lora_b
[B, r, Hkv, D], the B_i of each sequence's adapter (for an adapter stack
`b_stack[n, r, Hkv, D]` and per-sequence `adapter_idx[B]`, pass
`b_stack[adapter_idx]`: one batch mixes agents).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paged_attention as pa

# Keys per block. Smaller than paged attention's 64: each block also carries the
# [block_k, r_pad] V_lr gather and a third accumulator. On an H100 (bf16, batch 8
# x 16k, r 8): block_k 32 took 0.39 ms, 64 took 0.57 ms, 128 took 6.5 ms (spills);
# `python bench/attention_kernels.py --tune` re-measures it.
DEFAULT_BLOCK_K = 32


def materialise_v(v_pool, vlr_pool, lora_b, slot_map, layer=None):
  """V = V_base + V_lr B_i of each sequence's slots: [B, T, Hkv, D] in the pool's dtype."""
  v_lr = pa.gather_kv(vlr_pool, slot_map, layer)                       # [B, T, r]
  delta = jnp.einsum("btr,brhd->bthd", v_lr.astype(jnp.float32), lora_b.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
  return (pa.gather_kv(v_pool, slot_map, layer).astype(jnp.float32) + delta).astype(v_pool.dtype)


def flash_lora_attention_reference(q, k_pool, v_pool, vlr_pool, lora_b, slot_map, q_positions,
                                   *, layer=None, scale=None):
  """Materialise V = V_base + V_lr B_i per sequence, then masked paged attention."""
  v = materialise_v(v_pool, vlr_pool, lora_b, slot_map, layer)
  return pa.attend_reference(q, pa.gather_kv(k_pool, slot_map, layer), v, slot_map,
                             q_positions, scale)


def _read_lr(vlr_ref, rows, cols, live, block_k: int):
  """V_lr rows x cols -> [block_k, r_pad] (see `pa.read_rows`): a contiguous block
  is read as first slot + j, a gathered one with dead keys masked (not read)."""
  if live is None:
    ids = rows.start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    return plgpu.load(vlr_ref.at[ids, cols[None, :]])
  return plgpu.load(vlr_ref.at[rows[:, None], cols[None, :]], mask=live[:, None], other=0)


def _kernel(offset_ref, slots_ref, pos_ref, qpos_ref, q_ref, table_ref, bounds_ref, b_ref, k_ref,
            v_ref, vlr_ref, o_ref, m_ref, l_ref, *, block_k: int, scale: float, rank: int):
  h = pl.program_id(1)
  ct = pa.compute_dtype(q_ref, k_ref)
  ct_lr = jnp.promote_types(ct, vlr_ref.dtype)     # the low-rank dot: never narrower than V_lr
  prec_lr = pa.dot_precision(ct_lr)
  q = q_ref[...].astype(ct)                        # [block_r, D]
  qpos = qpos_ref[...]
  prec = pa.dot_precision(ct)
  r_pad = b_ref.shape[0]
  cols = jnp.minimum(lax.broadcasted_iota(jnp.int32, (r_pad,), 0), rank - 1)

  def visit(carry, rows, live, key_pos):
    acc, acc_lr, ml = carry
    k = pa.read_rows(k_ref, rows, h, live).astype(ct)
    v = pa.read_rows(v_ref, rows, h, live).astype(ct)
    v_lr = _read_lr(vlr_ref, rows, cols, live, block_k).astype(ct_lr)  # [block_k, r_pad]
    s = jnp.dot(q, k.T, precision=prec, preferred_element_type=jnp.float32) * scale
    p, corr, ml = pa.online_softmax_update(ml, s, pa.key_mask(key_pos, qpos, live))
    pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    pv_lr = jnp.dot(p.astype(ct_lr), v_lr, precision=prec_lr,
                    preferred_element_type=jnp.float32)
    return corr[:, None] * acc + pv, corr[:, None] * acc_lr + pv_lr, ml

  block_r, d = q.shape
  init = (jnp.zeros((block_r, d), jnp.float32), jnp.zeros((block_r, r_pad), jnp.float32),
          (jnp.full((block_r,), pa.NEG, jnp.float32), jnp.zeros((block_r,), jnp.float32)))
  acc, acc_lr, (m, l) = pa.walk_live_blocks(table_ref, bounds_ref, slots_ref, pos_ref,
                                            offset_ref[0], block_k, visit, init)
  # Algorithm 1, line "O += O_lr B_i": once per query block, after the key loop.
  acc = acc + jnp.dot(acc_lr, b_ref[...].astype(jnp.float32), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
  o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
  m_ref[...] = m
  l_ref[...] = l


def check_shapes(q, k_pool, vlr_pool, lora_b, k_flat, vlr_flat) -> tuple[int, int]:
  """(KV heads, rank) of a Flash-LoRA call; ValueError for shapes that do not agree
  (k_flat, vlr_flat: the pools as `pa.flat_pool` returns them)."""
  b, _, hq, d = q.shape
  hkv, rank = k_flat.shape[1], vlr_flat.shape[-1]
  if hq % hkv:
    raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
  if vlr_flat.shape[0] != k_flat.shape[0]:
    raise ValueError(f"LR pool {vlr_pool.shape} does not match KV pool {k_pool.shape}")
  if lora_b.shape != (b, rank, hkv, d):
    raise ValueError(f"lora_b {lora_b.shape} != (batch, rank, Hkv, D) = {(b, rank, hkv, d)}")
  return hkv, rank


def make_plan(slot_map, q_positions, *, num_heads: int, num_kv_heads: int, block_k=None,
              **kw) -> pa.Plan:
  """`pa.make_plan` with this kernel's default block_k (its tiles hold a third
  accumulator, so it runs best on narrower key blocks than paged attention)."""
  return pa.make_plan(slot_map, q_positions, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      block_k=block_k or DEFAULT_BLOCK_K, **kw)


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_r", "block_k", "k_splits", "num_warps", "num_stages", "contiguous",
    "interpret"))
def flash_lora_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                         vlr_pool: jax.Array, lora_b: jax.Array, slot_map: jax.Array,
                         q_positions: jax.Array, *, layer: jax.Array | int | None = None,
                         scale: float | None = None, plan: pa.Plan | None = None,
                         block_r: int | None = None, block_k: int | None = None,
                         k_splits: int | None = None,
                         num_warps: int = 4, num_stages: int = 2, contiguous: bool = True,
                         interpret: bool = False) -> jax.Array:
  """Pallas Flash-LoRA-Attention; same result as `flash_lora_attention_reference`.

  Tiling knobs as `pa.paged_attention` (default block_k DEFAULT_BLOCK_K); `plan`:
  a `make_plan` result shared by the layers of one pass.
  """
  b, tq, hq, d = q.shape
  k_flat, offset = pa.flat_pool(k_pool, layer)
  v_flat, _ = pa.flat_pool(v_pool, layer)
  vlr_flat, _ = pa.flat_pool(vlr_pool, layer)
  hkv, rank = check_shapes(q, k_pool, vlr_pool, lora_b, k_flat, vlr_flat)
  if rank & (rank - 1):
    raise ValueError(f"LoRA rank {rank} must be a power of two (Triton tile shapes)")
  scale = d ** -0.5 if scale is None else scale
  r_pad = max(pa.MIN_DOT, rank)
  if plan is None:
    block_k = block_k or DEFAULT_BLOCK_K
  b_rows = jnp.pad(lora_b, ((0, 0), (0, r_pad - rank), (0, 0), (0, 0)))   # zero rows
  tiling, inputs, _ = pa.prepare(q, q_positions, slot_map, hkv, plan=plan, block_r=block_r,
                              block_k=block_k, k_splits=k_splits, contiguous=contiguous)
  block_r, block_k, k_splits, rows_p, t_p = tiling
  out_dtype = q.dtype if k_splits == 1 else jnp.float32
  o, m, l = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k, scale=scale, rank=rank),
      grid=(b, hkv, rows_p // block_r, k_splits),
      in_specs=pa.row_specs(t_p, block_r, d, block_k) + [
          pl.BlockSpec((None, r_pad, None, d), lambda b, h, r, s: (b, 0, h, 0)),    # B_i[:, h]
          pl.no_block_spec, pl.no_block_spec, pl.no_block_spec,               # K, V, V_lr pools
      ],
      out_specs=pa.out_specs(block_r, d),
      out_shape=pa.out_shapes(k_splits, b, hkv, rows_p, d, out_dtype),
      compiler_params=pa.compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="jaxkv_flash_lora_attention",
  )(offset, *inputs, b_rows, k_flat, v_flat, vlr_flat)
  return pa.unfold_rows(pa.merge_splits(o, m, l), tq, hq).astype(q.dtype)


def cost(batch: int, q_len: int, live_tokens: int, num_heads: int, num_kv_heads: int,
         head_dim: int, rank: int, kv_bytes: int, q_bytes: int) -> dict:
  """Floor of one call: paged attention plus the rank-r value term (P V_lr, O_lr B)."""
  base = pa.cost(batch, q_len, live_tokens, num_heads, num_kv_heads, head_dim, kv_bytes, q_bytes)
  flops = base["flops"] + 2 * batch * q_len * num_heads * rank * (live_tokens + head_dim)
  lr_bytes = batch * live_tokens * rank * kv_bytes + batch * rank * num_kv_heads * head_dim * 4
  return {"flops": flops, "bytes": base["bytes"] + lr_bytes}
