"""Sentinel-masked paged attention over a token-level slot map (Pallas, Triton).

Contract (shared with `paged_attention_reference`, the pure-jnp reference):

- query i of row b sits at logical position `q_positions[b, i]`; key t of row b
  is the token at logical position t, stored in pool slot `slot_map[b, t]`;
- key t is visible to query i iff `slot_map[b, t] != SENTINEL` and
  `t <= q_positions[b, i]` (causal by logical position: evicted tokens leave a
  SENTINEL hole and survivors keep their positions and RoPE phases);
- GQA: query head h reads KV head h // (Hq // Hkv);
- masked keys get exactly zero weight; a row with no visible key (all dead, or
  a padding query with a negative position) returns zeros, never NaN.

Kernel layout. The G = Hq // Hkv query heads that share a KV head are folded
with the query tokens into R = Tq * G "rows" (row r = token r // G, head
r % G), so one program handles a [block_r, D] tile of rows against one KV head
and every matmul is a plain 2-D `jnp.dot` (Triton rejects batched dot_general
and wants every dim >= 16; rows are zero-padded up to block_r). The grid is
(batch, kv_head, row_block, k_split).

Live-token compaction and live-block tables. Inside the same jit the wrapper
moves each row's live tokens to the front in position order (`compact_live`:
their slots and logical positions), so dead tokens cost nothing, and turns the
compacted map into per-row lists of key blocks and, per program, the ranges of
that list it walks (`live_block_tables`): blocks after the row block's last
query position are in no range, so the kernel's `fori_loop`s run over visible
live keys only, with no branch per block. Blocks whose slots are consecutive
(whole pages laid end to end) are read as one range per KV row; the rest
(IntentKV holes, SemShareKV / MemArt aliases: any slot map) take a per-token
gather, masked only in the compaction's last, partial block.

With `k_splits > 1` (flash-decoding; the default for single-block decode over
long contexts) each program takes an equal share of its row's live blocks and
writes a normalised partial output plus its running max and denominator; the
wrapper merges them (log-sum-exp weights).

A stacked pool [L, S, Hkv, D] is read in place as [L*S, Hkv, D] with slot ids
offset by layer * S, so a layer scan never copies a layer out of the pool.

This file imports only jax (DESIGN.md); SENTINEL is slot 0 as in jaxkv.kv.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import key_shift as ks
from pallas_kernels.paged_attention_reference import (  # noqa: F401  (re-exported)
    REF_PER_ROW_MAX,
    REF_QUERY_BLOCK,
    SENTINEL,
    attend_reference,
    attention_mask,
    gather_kv,
    masked_softmax_weights,
    paged_attention_reference,
)

NEG = -1e30   # running-max floor; masked weights are zeroed explicitly, never by NEG alone
MIN_DOT = 16  # Triton tl.dot needs every dimension >= 16


# ----------------------------------------------------------------------------
# Shared kernel plumbing (also used by flash_lora_attention.py).
# ----------------------------------------------------------------------------

def _pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
  return max(floor, pl.next_power_of_2(int(n)))


def flat_pool(pool: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
  """[L, S, ...] + layer -> ([L*S, ...] view, slot offset [1]); [S, ...] -> offset 0."""
  if layer is None:
    return pool, jnp.zeros((1,), jnp.int32)
  num_layers, num_slots = pool.shape[:2]
  offset = jnp.asarray(layer, jnp.int32) * num_slots
  return pool.reshape(num_layers * num_slots, *pool.shape[2:]), offset.reshape(1)


class Tiling(NamedTuple):
  """Static tiling of one call (`choose_tiling`)."""
  block_r: int    # query rows per program
  block_k: int    # keys per loop step
  k_splits: int   # flash-decoding splits
  rows_p: int     # query rows padded to block_r
  t_p: int        # slot-map width padded to block_k


FILL_PROGRAMS = 256   # decode programs that keep an H100 / H200 busy (132 SMs; measured, README)
MAX_SPLITS = 64       # flash-decoding splits at most; each keeps >= SPLIT_TOKENS context tokens
SPLIT_TOKENS = 512


def choose_tiling(rows: int, t: int, *, programs: int = 1, block_r=None, block_k=None,
                  k_splits=None) -> Tiling:
  """Static tiling for `rows` folded query rows over a slot map of width `t`.

  Defaults: block_r = 64 rows for prefill, the next power of two >= 16 for
  decode; block_k = 64 keys. Decode (a single row block) over long contexts
  splits its live key blocks into equal shares of >= SPLIT_TOKENS context
  tokens (flash-decoding): 16 shares, or more when its `programs` (batch x KV
  heads: one row block each) are too few to fill the GPU, up to FILL_PROGRAMS
  programs in all (batch 1 x 8 KV heads at 32k: 32 shares instead of 16).
  """
  block_r = block_r or min(64, _pow2_at_least(rows))
  block_k = block_k or 64
  if block_r < MIN_DOT or block_k < MIN_DOT:
    raise ValueError(f"block_r={block_r} and block_k={block_k} must be >= {MIN_DOT}")
  rows_p = -(-rows // block_r) * block_r
  if k_splits is None:
    fill = max(16, -(-FILL_PROGRAMS // max(programs, 1)))
    k_splits = 1 if rows_p > block_r else max(1, min(MAX_SPLITS, fill, t // SPLIT_TOKENS))
  return Tiling(block_r, block_k, k_splits, rows_p, -(-max(t, 1) // block_k) * block_k)


POS_PAD = 1 << 30   # position of compaction padding: after every query, never visible


def compact_live(slots: jax.Array, t_p: int, key_shift: jax.Array | None = None):
  """Live tokens of each row moved to the front, in position order.

  slots [B, T] -> (cslots [B, t_p] with SENTINEL padding, cpos [B, t_p] their
  logical positions with POS_PAD padding, cshift [B, t_p] the live tokens' key shifts
  with 0 padding, or None without `key_shift`). A scatter at cumsum(live) - 1: O(B T).
  Dead tokens then cost the kernels nothing, not even a masked lane.
  """
  b, t = slots.shape
  live = slots != SENTINEL
  dest = jnp.where(live, jnp.cumsum(live, axis=1, dtype=jnp.int32) - 1, t_p)   # t_p: dropped
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  cslots = jnp.full((b, t_p), SENTINEL, jnp.int32).at[rows, dest].set(
      slots.astype(jnp.int32), mode="drop")
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  cpos = jnp.full((b, t_p), POS_PAD, jnp.int32).at[rows, dest].set(pos, mode="drop")
  cshift = None if key_shift is None else jnp.zeros((b, t_p), jnp.int32).at[rows, dest].set(
      key_shift.astype(jnp.int32), mode="drop")
  return cslots, cpos, cshift


def live_block_tables(cslots: jax.Array, cpos: jax.Array, row_pos: jax.Array, *, block_r: int,
                      block_k: int, k_splits: int, contiguous: bool = True):
  """Which key blocks each program visits: computed once per call with jnp.

  cslots, cpos [B, T_p] (`compact_live`), row_pos [B, R_p] (folded row
  positions). Key block j holds compacted tokens j*block_k .. (j+1)*block_k; it
  is live if it holds any live token, visible to a row block if its first
  token's position is at or before that row block's last query position (the
  visible blocks are a prefix), and contiguous if all its slots are live and
  consecutive (`slot0 + j`: whole pages laid end to end with no holes, what a
  fresh sequence gets), which the kernels read as one range instead of a
  per-token gather.

  Returns:
    table [B, T_p // block_k] int32: each row's block indices, contiguous live
      blocks first, then the other live blocks, each ascending, then the rest;
    bounds [B, R_blocks, k_splits, 4] int32: for each program the table
      ranges [c_lo, c_hi) of contiguous blocks and [g_lo, g_hi) of gathered
      blocks it visits. The visible blocks of a row block are dealt out to the
      k splits in equal shares (+- 1 block), so a pruned context keeps every
      split busy.
  Blocks of dead tokens do not exist after compaction, and blocks past the last
  query appear in no range: neither costs an iteration.
  """
  b, t_p = cslots.shape
  nb = t_p // block_k
  blocks = cslots.reshape(b, nb, block_k)
  live_tok = blocks != SENTINEL
  live = live_tok[..., 0]                                 # compacted: live blocks lead
  if contiguous:
    run = blocks == blocks[..., :1] + jnp.arange(block_k, dtype=blocks.dtype)
    contig = (live_tok & run).all(-1)
  else:
    contig = jnp.zeros_like(live)
  idx = jnp.arange(nb, dtype=jnp.int32)
  cat = jnp.where(contig, 0, jnp.where(live, 1, 2))
  table = (jnp.sort(cat * nb + idx, axis=-1) % nb).astype(jnp.int32)
  last = row_pos.reshape(b, -1, block_r).max(-1)                        # [B, RB]
  first_pos = cpos.reshape(b, nb, block_k)[..., 0]                      # [B, nb]
  visible = first_pos[:, None, :] <= last[:, :, None]                   # [B, RB, nb]
  n_cv = (contig[:, None] & visible).sum(-1)                            # [B, RB]
  n_gv = ((live & ~contig)[:, None] & visible).sum(-1)
  n_vis = (n_cv + n_gv)[..., None]
  split = jnp.arange(k_splits + 1)
  edges = split * n_vis // k_splits                                     # [B, RB, K + 1]
  lo, hi = edges[..., :-1], edges[..., 1:]
  ncv = n_cv[..., None]
  n_contig = contig.sum(-1)[:, None, None]
  bounds = jnp.stack([jnp.minimum(lo, ncv), jnp.minimum(hi, ncv),
                      n_contig + jnp.maximum(lo, ncv) - ncv,
                      n_contig + jnp.maximum(hi, ncv) - ncv], axis=-1)
  return table, bounds.astype(jnp.int32)


def fold_positions(q_positions: jax.Array, g: int, rows_p: int) -> jax.Array:
  """q_positions [B, Tq] -> folded row positions [B, R_p] (padding rows -1)."""
  pos = jnp.repeat(q_positions.astype(jnp.int32), g, axis=1)
  return jnp.pad(pos, ((0, 0), (0, rows_p - pos.shape[1])), constant_values=-1)


def fold_rows(q: jax.Array, hkv: int, rows_p: int) -> jax.Array:
  """q [B, Tq, Hq, D] -> rows [B, Hkv, R_p, D] (zero padding rows; their positions
  come from `fold_positions`)."""
  rows = einops.rearrange(q, "b t (h g) d -> b h (t g) d", h=hkv)
  return jnp.pad(rows, ((0, 0), (0, 0), (0, rows_p - rows.shape[2]), (0, 0)))


def unfold_rows(o: jax.Array, tq: int, hq: int) -> jax.Array:
  """rows [B, Hkv, R_p, D] -> [B, Tq, Hq, D]."""
  g = hq // o.shape[1]
  return einops.rearrange(o[:, :, :tq * g], "b h (t g) d -> b t (h g) d", t=tq)


def merge_splits(o, m, l):
  """Merge per-split normalised outputs o [K, ..., D] with maxes/denominators [K, ...]."""
  if o.shape[0] == 1:
    return o[0]
  m_all = jnp.max(m, axis=0)
  w = l * jnp.exp(m - m_all[None])
  denom = jnp.sum(w, axis=0)
  out = jnp.sum(o.astype(jnp.float32) * w[..., None], axis=0)
  return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def walk_live_blocks(table_ref, bounds_ref, slots_ref, pos_ref, offset, block_k: int, visit,
                     carry, shift_ref=None):
  """Fold `visit(carry, rows, live, key_pos)` over this program's key blocks
  (`visit(carry, rows, live, key_pos, shift)` with the keys' rotations [block_k]
  when `shift_ref` holds the compacted key shifts).

  Two branch-free loops over the ranges `live_block_tables` gave this program:
  contiguous blocks (`rows` = pl.ds(first slot, block_k), `live` = None: every
  key live) and then gathered blocks (`rows` = slot ids [block_k], `live` =
  their mask: only the compaction's tail is dead). `key_pos` [block_k] are the
  keys' logical positions. The online softmax is order-free, so the split costs
  nothing.
  """
  c_lo, c_hi, g_lo, g_hi = (bounds_ref[i] for i in range(4))
  shifted = (lambda t0: (shift_ref[pl.ds(t0, block_k)],)) if shift_ref is not None else (
      lambda t0: ())

  def contiguous(i, carry):
    t0 = pl.multiple_of(table_ref[i] * block_k, block_k)
    return visit(carry, pl.ds(slots_ref[t0] + offset, block_k), None,
                 pos_ref[pl.ds(t0, block_k)], *shifted(t0))

  def gathered(i, carry):
    t0 = pl.multiple_of(table_ref[i] * block_k, block_k)
    slots = slots_ref[pl.ds(t0, block_k)]
    return visit(carry, slots + offset, slots != SENTINEL, pos_ref[pl.ds(t0, block_k)],
                 *shifted(t0))

  carry = lax.fori_loop(c_lo, c_hi, contiguous, carry)
  return lax.fori_loop(g_lo, g_hi, gathered, carry)


def key_mask(key_pos, qpos, live):
  """Visibility [block_r, block_k] of keys at key_pos [block_k] to rows at qpos."""
  causal = key_pos[None, :] <= qpos[:, None]
  return causal if live is None else causal & live[None, :]


def online_softmax_update(carry, s, mask):
  """One online-softmax step on masked scores s [block_r, block_k] (float32).

  carry = (m [block_r], l [block_r]); returns (p, correction, (m_new, l_new))
  with p exactly zero where ~mask.
  """
  m, l = carry
  s = jnp.where(mask, s, NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  corr = jnp.exp(m - m_new)
  p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
  return p, corr, (m_new, corr * l + jnp.sum(p, axis=1))


def read_rows(pool_ref, rows, h, live):
  """Pool rows [rows, h, :] -> [block_k, D].

  A contiguous block (`live` None, `rows` a pl.ds) is one strided range. A
  gathered block is a masked gather: dead keys are not read (a Triton masked
  load issues no memory request for them) and come back as 0. The interpreter
  runs the very same masked loads, so tests exercise the GPU's load path.
  """
  if live is None:
    return pool_ref[rows, h, :]
  cols = lax.broadcasted_iota(jnp.int32, (1, pool_ref.shape[-1]), 1)
  return plgpu.load(pool_ref.at[rows[:, None], h, cols], mask=live[:, None], other=0)


def compute_dtype(q_ref, pool_ref):
  """The dtype the dots run in: queries and pool promoted (a bf16 model over an
  fp32 pool, or the reverse), as the reference's jnp arithmetic does; only the
  tiles are cast, never the pool. Equal dtypes: no cast."""
  return jnp.promote_types(q_ref.dtype, pool_ref.dtype)


def dot_precision(dtype):
  """IEEE fp32 for fp32 inputs (no silent TF32); native tensor-core path otherwise."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def row_specs(t_p: int, block_r: int, d: int, block_k: int) -> list:
  """BlockSpecs of (slot offset, compacted slots, their positions, row positions,
  q rows, live-block table, table bounds) over grid (b, h, r, s)."""
  row = pl.BlockSpec((None, t_p), lambda b, h, r, s: (b, 0))
  return [
      pl.no_block_spec,                                                       # offset [1]
      row, row,                                                               # slots, positions
      pl.BlockSpec((None, block_r), lambda b, h, r, s: (b, r)),               # row positions
      pl.BlockSpec((None, None, block_r, d), lambda b, h, r, s: (b, h, r, 0)),  # q rows
      pl.BlockSpec((None, t_p // block_k), lambda b, h, r, s: (b, 0)),        # table row
      pl.BlockSpec((None, None, None, 4), lambda b, h, r, s: (b, r, s, 0)),   # bounds
  ]


@functools.partial(jax.tree_util.register_dataclass, data_fields=(
    "slots", "positions", "row_pos", "table", "bounds", "shifts"), meta_fields=("tiling",))
@dataclasses.dataclass(frozen=True)
class Plan:
  """What a kernel call walks, computed from the slot map alone (`make_plan`).

  It depends on the slot map and query positions, not on the layer, so a forward
  pass whose layers share one slot map builds it once and passes it to every
  layer's call (`plan=`) instead of compacting and tabling per layer. A pytree:
  arrays are leaves, the static `tiling` is in the treedef.
  """
  tiling: Tiling
  slots: jax.Array       # [B, t_p] compacted live slots (`compact_live`)
  positions: jax.Array   # [B, t_p] their logical positions
  row_pos: jax.Array     # [B, rows_p] folded query-row positions (pad -1)
  table: jax.Array       # [B, t_p // block_k] live-block table
  bounds: jax.Array      # [B, row blocks, k_splits, 4] per-program ranges
  shifts: jax.Array | None = None  # [B, t_p] compacted key shifts (`key_shift.py`), or None


def make_plan(slot_map: jax.Array, q_positions: jax.Array, *, num_heads: int,
              num_kv_heads: int, block_r=None, block_k=None, k_splits=None,
              contiguous: bool = True, key_shift: jax.Array | None = None) -> Plan:
  """Tiling, compacted slot map and live-block tables for queries of `num_heads`
  heads at q_positions [B, Tq] over slot_map [B, T] (`choose_tiling`,
  `compact_live`, `live_block_tables`). Pure jnp: call it inside the caller's jit."""
  if num_heads % num_kv_heads:
    raise ValueError(f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}")
  b, tq = q_positions.shape
  rows = tq * (num_heads // num_kv_heads)
  tiling = choose_tiling(rows, slot_map.shape[1], programs=b * num_kv_heads, block_r=block_r,
                         block_k=block_k, k_splits=k_splits)
  row_pos = fold_positions(q_positions, num_heads // num_kv_heads, tiling.rows_p)
  cslots, cpos, shifts = compact_live(slot_map, tiling.t_p, key_shift)
  table, bounds = live_block_tables(cslots, cpos, row_pos, block_r=tiling.block_r,
                                    block_k=tiling.block_k, k_splits=tiling.k_splits,
                                    contiguous=contiguous)
  return Plan(tiling, cslots, cpos, row_pos, table, bounds, shifts)


def prepare(q, q_positions, slot_map, hkv: int, *, plan: Plan | None = None, block_r=None,
            block_k=None, k_splits=None, contiguous=True, key_shift=None):
  """The wrappers' shared set-up: the plan (given, or made here; with the compacted
  key shifts when `key_shift` is given) and the folded query rows. Returns (Tiling,
  kernel inputs after the offset, the compacted shifts or None)."""
  b, tq, hq, _ = q.shape
  if plan is None:
    plan = make_plan(slot_map, q_positions, num_heads=hq, num_kv_heads=hkv, block_r=block_r,
                     block_k=block_k, k_splits=k_splits, contiguous=contiguous,
                     key_shift=key_shift)
  elif (key_shift is None) != (plan.shifts is None):
    raise ValueError("key_shift and the plan disagree: build the plan with make_plan(..., "
                     "key_shift=) for a shifted call, without it otherwise")
  elif (block_r, block_k, k_splits, contiguous) != (None, None, None, True):
    raise ValueError("pass tiling knobs to make_plan, not beside a plan")
  tiling = plan.tiling
  t_p = -(-max(slot_map.shape[1], 1) // tiling.block_k) * tiling.block_k
  if (plan.row_pos.shape != (b, tiling.rows_p) or tiling.rows_p < tq * (hq // hkv)
      or plan.slots.shape != (b, t_p)):
    raise ValueError(f"plan (rows {plan.row_pos.shape}, slots {plan.slots.shape}) was not "
                     f"made for q {q.shape} with {hkv} KV heads over a slot map "
                     f"{slot_map.shape}")
  rows = fold_rows(q, hkv, tiling.rows_p)
  return (tiling, (plan.slots, plan.positions, plan.row_pos, rows, plan.table, plan.bounds),
          plan.shifts)


def out_specs(block_r: int, d: int) -> list:
  """BlockSpecs of the per-split (o, m, l) outputs."""
  return [
      pl.BlockSpec((None, None, None, block_r, d), lambda b, h, r, s: (s, b, h, r, 0)),
      pl.BlockSpec((None, None, None, block_r), lambda b, h, r, s: (s, b, h, r)),
      pl.BlockSpec((None, None, None, block_r), lambda b, h, r, s: (s, b, h, r)),
  ]


def out_shapes(k_splits: int, b: int, hkv: int, rows_p: int, d: int, dtype) -> list:
  return [jax.ShapeDtypeStruct((k_splits, b, hkv, rows_p, d), dtype),
          jax.ShapeDtypeStruct((k_splits, b, hkv, rows_p), jnp.float32),
          jax.ShapeDtypeStruct((k_splits, b, hkv, rows_p), jnp.float32)]


def compiler_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ----------------------------------------------------------------------------
# Kernel.
# ----------------------------------------------------------------------------

def _kernel(offset_ref, slots_ref, pos_ref, qpos_ref, q_ref, table_ref, bounds_ref, *refs,
            block_k: int, scale: float, shifted: bool):
  shift_ref, freq_ref = refs[:2] if shifted else (None, None)
  k_ref, v_ref, o_ref, m_ref, l_ref = refs[2:] if shifted else refs
  h = pl.program_id(1)
  ct = compute_dtype(q_ref, k_ref)
  q = q_ref[...].astype(ct)                        # [block_r, D]
  qpos = qpos_ref[...]                             # [block_r]
  prec = dot_precision(ct)

  def visit(carry, rows, live, key_pos, shift=None):
    acc, ml = carry
    if shift is None:
      k = read_rows(k_ref, rows, h, live).astype(ct)  # [block_k, D]
    else:                                             # rotated on read (MemArt aliases)
      k = ks.rotate_rows(k_ref, rows, h, live, shift, freq_ref, block_k).astype(ct)
    v = read_rows(v_ref, rows, h, live).astype(ct)
    s = jnp.dot(q, k.T, precision=prec, preferred_element_type=jnp.float32) * scale
    p, corr, ml = online_softmax_update(ml, s, key_mask(key_pos, qpos, live))
    pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    return corr[:, None] * acc + pv, ml

  block_r, d = q.shape
  init = (jnp.zeros((block_r, d), jnp.float32),
          (jnp.full((block_r,), NEG, jnp.float32), jnp.zeros((block_r,), jnp.float32)))
  acc, (m, l) = walk_live_blocks(table_ref, bounds_ref, slots_ref, pos_ref, offset_ref[0],
                                 block_k, visit, init, shift_ref)
  o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_r", "block_k", "k_splits", "num_warps", "num_stages", "contiguous",
    "interpret"))
def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                    slot_map: jax.Array, q_positions: jax.Array, *,
                    layer: jax.Array | int | None = None, scale: float | None = None,
                    plan: Plan | None = None, block_r: int | None = None,
                    block_k: int | None = None, k_splits: int | None = None,
                    num_warps: int = 4, num_stages: int = 2,
                    contiguous: bool = True, interpret: bool = False,
                    key_shift: jax.Array | None = None,
                    shift_freq: jax.Array | None = None) -> jax.Array:
  """Pallas paged attention; same arguments and result as `paged_attention_reference`.

  key_shift [B, T] int32 with shift_freq [D/2]: key t read rotated by
  R(key_shift[b, t]) (`key_shift.py`), as `jaxkv.ops.paged_attention`'s reference
  path does; a given plan must then carry the shifts (`make_plan(..., key_shift=)`).

  Tiling knobs (static): `block_r` query rows per program (>= 16), `block_k`
  keys per step (>= 16), `k_splits` key splits (flash-decoding), Triton
  `num_warps` / `num_stages`; `contiguous=False` sends every live block down
  the gather path (for A/B timing). `interpret=True` runs the kernel on CPU.
  `plan`: a `make_plan` result for this slot map and these query positions
  (then the tiling knobs go to `make_plan`), shared by the layers of one pass.
  """
  b, tq, hq, d = q.shape
  k_flat, offset = flat_pool(k_pool, layer)
  v_flat, _ = flat_pool(v_pool, layer)
  hkv = k_flat.shape[1]
  if hq % hkv:
    raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
  if k_flat.shape[2] != d or v_flat.shape != k_flat.shape:
    raise ValueError(f"pool shapes {k_pool.shape}/{v_pool.shape} do not match q {q.shape}")
  scale = d ** -0.5 if scale is None else scale
  if (key_shift is None) != (shift_freq is None):
    raise ValueError("key_shift needs shift_freq (jaxkv.rope.delta_frequencies) and back")
  tiling, inputs, shifts = prepare(q, q_positions, slot_map, hkv, plan=plan, block_r=block_r,
                                   block_k=block_k, k_splits=k_splits, contiguous=contiguous,
                                   key_shift=key_shift)
  block_r, block_k, k_splits, rows_p, t_p = tiling
  out_dtype = q.dtype if k_splits == 1 else jnp.float32
  extra, extra_specs = (), []
  if shifts is not None:       # the compacted shifts (one row per sequence) and [D] freqs
    extra = (shifts, ks.frequency_row(shift_freq))
    extra_specs = [pl.BlockSpec((None, t_p), lambda b, h, r, s: (b, 0)), pl.no_block_spec]
  o, m, l = pl.pallas_call(
      functools.partial(_kernel, block_k=block_k, scale=scale, shifted=shifts is not None),
      grid=(b, hkv, rows_p // block_r, k_splits),
      in_specs=(row_specs(t_p, block_r, d, block_k) + extra_specs
                + [pl.no_block_spec] * 2),                                    # K, V pools
      out_specs=out_specs(block_r, d),
      out_shape=out_shapes(k_splits, b, hkv, rows_p, d, out_dtype),
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="jaxkv_paged_attention",
  )(offset, *inputs, *extra, k_flat, v_flat)
  return unfold_rows(merge_splits(o, m, l), tq, hq).astype(q.dtype)


def cost(batch: int, q_len: int, live_tokens: int, num_heads: int, num_kv_heads: int,
         head_dim: int, kv_bytes: int, q_bytes: int) -> dict:
  """Floor of one call: FLOPs (2 matmuls) and the fewest bytes moved (K/V read once per
  KV head, q read, o written, slot ids read)."""
  flops = 4 * batch * q_len * live_tokens * num_heads * head_dim
  kv = 2 * batch * live_tokens * num_kv_heads * head_dim * kv_bytes
  qo = 2 * batch * q_len * num_heads * head_dim * q_bytes
  return {"flops": flops, "bytes": kv + qo + 4 * batch * live_tokens}


__all__ = [
  "SENTINEL",
  "Plan",
  "attention_mask",
  "cost",
  "live_block_tables",
  "make_plan",
  "masked_softmax_weights",
  "paged_attention",
  "paged_attention_reference",
]
