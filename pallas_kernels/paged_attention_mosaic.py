"""Sentinel-masked paged attention on Mosaic GPU (Hopper): whole pages by TMA, mask in the tile.

Same contract as `paged_attention.paged_attention_reference` (read that module's
docstring): key t of row b sits in slot `slot_map[b, t]`, visible to query i iff
the slot is not SENTINEL and t <= q_positions[b, i]; GQA folds the G query heads
of a KV head into rows; a row with no visible key returns zeros.

Why a second kernel. JAX deprecated Pallas's Triton backend; Mosaic GPU is the
supported one. Mosaic moves memory with TMA, which copies rectangular boxes,
not the per-token gathers the Triton kernel reads. So this kernel walks the
slot map the way paged kernels on Hopper do (vLLM, FlashInfer): by *pages*.

Pages and the per-call plan (`make_page_plan`): `page_plan.py`.

Kernel. One warpgroup per program: the query tile [64, D] (rows padded to 64,
the WGMMA height) waits in shared memory; `stages` steps of K, V and key
positions are in flight by TMA while the tensor cores run S = Q K^T, the
masked online softmax (float32) and O += P V on the oldest; a consumed slot is
refilled with the step `stages` ahead. Splits write normalised partial outputs
with their max and denominator, merged by `paged_attention.merge_splits`.
Shared memory decides speed here: the walk's buffers and then the output tile
are scoped one after the other, so at the default 2 steps in flight a block
takes about 85 KB (head_dim 128) and two blocks share an SM, one issuing its
copies while the other computes. Each program copies its share of the page
list (`starts_window` starts) into shared memory with its query tile, so a
step's TMA issue reads page starts there, not from global memory.

Key shift (MemArt's aliased blocks, read at new positions: key t rotated by
R(key_shift[b, t]), exact delta-RoPE). The shifts are listed beside the keys'
positions and fetched with them. Per step, each 64-key sub-block of K is rotated
in registers before S = Q K^T: k' = k cos(a) + rotate_half(k) sin(a), a = shift
x frequency (range-reduced to [-pi, pi] before the approximate sin/cos). A
swizzled tile cannot be cut along its last axis, so rotate_half(k) is one more
WGMMA, K @ P with P the signed half-swap matrix (entries 0 and +-1: exact), and
the rotated keys go back to shared memory for the WGMMA that reads them. A call
without a shift compiles none of this.

Limits (each routed to the fallback, statically): 16-bit pools and queries of
the same dtype (WGMMA operands), head_dim a multiple of 64, a pool of whole
pages (slots a multiple of 16), a tiling whose buffers fit in shared memory
(`smem_bytes`: e.g. head_dim 128 at 8 pages per step and 4 stages does not).
Read note: a dead slot inside a page that holds a live token is read; its
weight is exactly zero, but a non-finite value there would poison the row
(0 * inf), as in every page-granular kernel. jaxkv's pools are zero-initialised
and only ever hold written K/V, so such a slot holds a finite value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import key_shift as ks
from pallas_kernels import paged_attention as pa
from pallas_kernels.page_plan import (
  BLOCK_R,
  PAGE,
  POS_PAD,
  STARTS_WINDOW_MAX,
  PagePlan,
  PageTiling,
  choose_page_tiling,
  make_page_plan,
  page_table,
)

NEG = pa.NEG
DTYPES = (jnp.bfloat16, jnp.float16)
_INV_2PI = 0.15915494309189535
_2PI_HI = 6.28125                  # 201 / 32: turns x _2PI_HI is exact below 2^16 turns
_2PI_LO = 2 * 3.141592653589793 - 6.28125


def _plgpu():
  """jax.experimental.pallas.mosaic_gpu, imported on first use (it pulls in the
  Mosaic GPU lowering, which a CPU-only reference call never needs)."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


SMEM_BYTES = 232_448   # shared memory one Hopper block may take (227 KB)


def smem_bytes(tiling: PageTiling, d: int, dtype, out_dtype, shifted: bool,
               rank: int = 0) -> int:
  """The kernel's shared memory: its buffers, each rounded up to 1 KB (the swizzled
  ones are 1 KB aligned), plus 3 KB for barriers and alignment. The walk's buffers (K, V and
  positions per stage, the q tile, the staged page starts; with a key shift the
  shifts per stage, the rotated K tile, P and the frequency row; with a LoRA `rank`,
  V_lr per stage, B_i and the effective V tile) and then the output tile (o, m, l)
  are scoped one after the other, so the larger of the two counts. (Mosaic's own
  count, head_dim 128, 8 pages x 4 stages, jax 0.10: 284,744 bytes; with 2 KB this
  gave 284,672, 72 short, so a tiling at the edge could pass here and fail to compile.)"""
  it, ot = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
  block_k, stages = tiling.block_k, tiling.stages
  kb = lambda n: -(-n // 1024) * 1024
  sizes = [BLOCK_R * d * it, BLOCK_R * 4, stages * block_k * d * it,
           stages * block_k * d * it, stages * block_k * 4]
  if tiling.starts_window:
    sizes.append(tiling.starts_window * 4)
  if shifted:
    sizes += [stages * block_k * 4, block_k * d * it, d * d * it, d * 4]
  if rank:                     # Flash-LoRA: V_lr per stage, B_i, the effective V tile
    sizes += [stages * rank * block_k * 4, rank * d * 4, block_k * d * it]
  out = kb(BLOCK_R * d * ot) + kb(2 * BLOCK_R * 4)
  return max(sum(kb(n) for n in sizes), out) + 3072


def supported(q, k_pool, v_pool) -> str | None:
  """Why the Mosaic kernel cannot take this call (None: it can). Static."""
  if k_pool.shape[-3] % PAGE:
    return f"the pool's {k_pool.shape[-3]} slots are not whole pages of {PAGE}"
  if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
    return (f"WGMMA takes 16-bit operands of one dtype (q {q.dtype}, pools "
            f"{k_pool.dtype}/{v_pool.dtype})")
  if q.shape[-1] % 64:
    return f"head_dim {q.shape[-1]} is not a multiple of 64"
  return None


def _semantics(plgpu):
  """Lane semantics (per-thread register arrays with the explicit layouts this
  kernel's loads and `layout_cast`s spell out): JAX 0.10's default; 0.11
  defaults to warpgroup, whose layout inference refuses this kernel's
  dynamically indexed shared-memory rings ("Failed to infer a possible set of
  layouts" on 0.10, an unsatisfiable tiling divisibility on 0.11.2)."""
  return plgpu.LoweringSemantics.Lane


def _interpret_params():
  """Mosaic GPU's own interpreter (simulated shared memory, TMA, barriers); the
  generic Pallas interpreter cannot run TMA copies."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _smem_transforms(plgpu, dtype, cols: int):
  swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def half_swap_matrix(d: int, dtype) -> jax.Array:
  """P [D, D] with x @ P = rotate_half(x) = concat(-x[D/2:], x[:D/2])."""
  h = d // 2
  cols = jnp.arange(d)
  src = jnp.where(cols < h, cols + h, cols - h)
  sign = jnp.where(cols < h, -1.0, 1.0)
  return (jnp.zeros((d, d), jnp.float32).at[src, cols].set(sign)).astype(dtype)


def _reduce_angle(a):
  """a - 2 pi round(a / 2 pi) in float32, two-constant (Cody-Waite) so the result
  is as exact as a: the approximate sin/cos are accurate on [-pi, pi] only."""
  turns = lax.round(a * _INV_2PI)
  return (a - turns * _2PI_HI) - turns * _2PI_LO


def _mosaic_call(q_rows, row_pos, starts, positions, bounds, offset, k_flat, v_flat,
                 shifted=None, lora=None, *, tiling: PageTiling, scale: float, out_dtype,
                 interpret: bool):
  """The kernel over folded rows q_rows [B, Hkv, rows_p, D]; returns per-split
  (o [K, B, Hkv, rows_out, D], m, l [K, B, Hkv, rows_p]; `PageTiling.rows_out`).
  `shifted`: (the plan's shifts [B, n_pages * PAGE], frequency row [D] float32,
  `half_swap_matrix`) for keys rotated on read, or None. `lora`: (the listed keys' low-rank values
  [B, r, n_pages * PAGE] float32, each row's B_i [B, Hkv, r, D] float32) for
  Flash-LoRA (`flash_lora_mosaic.py`: V = V_base + V_lr B_i per tile), or None."""
  plgpu = _plgpu()
  b, hkv, rows_p, d = q_rows.shape
  pps, k_splits, stages, window = (tiling.pages_per_step, tiling.k_splits, tiling.stages,
                                   tiling.starts_window)
  block_k = tiling.block_k
  dtype = q_rows.dtype
  rb_count = rows_p // BLOCK_R
  tx = _smem_transforms(plgpu, dtype, d)
  otx = _smem_transforms(plgpu, out_dtype, d)

  # Mosaic GPU's interpreter has no rules for plgpu.load and layout_cast; it has
  # no register layouts either, so it reads and keeps the plain arrays.
  def load_vec(ref, layout):
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

  def cast(x, layout):
    return x if interpret else plgpu.layout_cast(x, layout)

  def mma(a, b_ref, transpose=False):
    """a @ b_ref (b_ref.T with `transpose`) into a fresh float32 accumulator: one
    WGMMA, `a` a shared-memory ref or registers; the interpreter, whose WGMMA
    takes no transposed operand, multiplies the loaded tiles."""
    if interpret:
      a = a[...] if hasattr(a, "shape") and not isinstance(a, jax.Array) else a
      b = b_ref[...]
      return jnp.dot(a, b.T if transpose else b, preferred_element_type=jnp.float32)
    rows, cols = a.shape[0], b_ref.shape[0 if transpose else 1]

    def run(acc_ref):
      plgpu.wgmma(acc_ref, a, b_ref.transpose((1, 0)) if transpose else b_ref)
      return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC((rows, cols), jnp.float32))

  def attend(*refs):
    """The program's walk over its steps -> (acc, m, l); its buffers are scoped to it."""
    (q_ref, rowpos_ref, starts_ref, pos_ref, bounds_ref, offset_ref, k_ref, v_ref), refs = (
        refs[:8], refs[8:])
    shift_ref = freq_ref = perm_ref = vlr_ref = b_ref = None
    if shifted is not None:
      (shift_ref, freq_ref, perm_ref), refs = refs[:3], refs[3:]
    if lora is not None:
      (vlr_ref, b_ref), refs = refs[:2], refs[2:]
    (q_bar, k_bar, v_bar, q_smem, qpos_smem, k_smem, v_smem, kpos_smem), refs = (
        refs[:8], refs[8:])
    kshift_smem = kr_smem = perm_smem = freq_smem = vlr_smem = b_smem = veff_smem = None
    if shifted is not None:
      (kshift_smem, kr_smem, perm_smem, freq_smem), refs = refs[:4], refs[4:]
    if lora is not None:
      (vlr_smem, b_smem, veff_smem), refs = refs[:3], refs[3:]
    starts_smem = refs[0] if window else None
    row, h, rb, split = program()
    lo = bounds_ref[row, rb, split, 0]
    n = bounds_ref[row, rb, split, 1] - lo
    n_vis = bounds_ref[row, rb, split, 2]
    base = offset_ref[0]
    rows = pl.ds(rb * BLOCK_R, BLOCK_R)

    # Staged starts: the program's share of the page list, [src0, src0 + window) (it
    # holds pages lo * pps ... (lo + n) * pps - 1: window >= a share, clamped at the end).
    src0 = jnp.minimum(lo * pps, tiling.n_pages - window) if window else 0

    def issue(step, slot, staged=True):
      for i in range(pps):
        # A listed page after this row block's last query shares the last step:
        # the program's first page is read in its place (finite; masked by position).
        e = step * pps + i
        e = jnp.where(e < n_vis, e, lo * pps)
        s0 = (starts_smem[e - src0] if window and staged else starts_ref[row, e]) + base
        dst = pl.ds(i * PAGE, PAGE)
        plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(s0, PAGE), h], k_smem.at[slot, dst],
                                k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(s0, PAGE), h], v_smem.at[slot, dst],
                                v_bar.at[slot])
      plgpu.copy_gmem_to_smem(pos_ref.at[row, pl.ds(step * block_k, block_k)],
                              kpos_smem.at[slot], k_bar.at[slot])
      if shift_ref is not None:
        plgpu.copy_gmem_to_smem(shift_ref.at[row, pl.ds(step * block_k, block_k)],
                                kshift_smem.at[slot], k_bar.at[slot])
      if vlr_ref is not None:
        plgpu.copy_gmem_to_smem(vlr_ref.at[row, :, pl.ds(step * block_k, block_k)],
                                vlr_smem.at[slot], v_bar.at[slot])

    for t in range(stages):      # the first steps read their starts from global memory
      pl.when(t < n)(functools.partial(issue, lo + t, t, staged=False))
    plgpu.copy_gmem_to_smem(q_ref.at[row, h, rows], q_smem, q_bar.at[0])
    if window:
      plgpu.copy_gmem_to_smem(starts_ref.at[row, pl.ds(src0, window)], starts_smem,
                              q_bar.at[0])
    plgpu.copy_gmem_to_smem(rowpos_ref.at[row, rows], qpos_smem, q_bar.at[0])
    if shifted is not None:
      plgpu.copy_gmem_to_smem(perm_ref, perm_smem, q_bar.at[0])
      plgpu.copy_gmem_to_smem(freq_ref, freq_smem, q_bar.at[0])
    if lora is not None:
      plgpu.copy_gmem_to_smem(b_ref.at[row, h], b_smem, q_bar.at[0])
    plgpu.barrier_wait(q_bar.at[0])
    qpos = load_vec(qpos_smem, plgpu.Layout.WGMMA.reduce(1))
    qpos = lax.broadcast_in_dim(qpos, (BLOCK_R, block_k), [0])

    def rotated(slot):
      """K of `slot` rotated by its keys' shifts, in kr_smem, 64 keys at a time (the
      frequency row is reloaded per sub-block rather than held across the loop: a
      [64, D] float32 broadcast kept live would take 64 registers a thread at D 128)."""
      for j in range(block_k // BLOCK_R):
        part = pl.ds(j * BLOCK_R, BLOCK_R)
        k = load_vec(k_smem.at[slot, part], plgpu.Layout.WGMMA).astype(jnp.float32)
        k_half = mma(k_smem.at[slot, part], perm_smem)          # rotate_half(k), exact
        sh = load_vec(kshift_smem.at[slot, part], plgpu.Layout.WGMMA.reduce(1))
        freq = load_vec(freq_smem, plgpu.Layout.WGMMA.reduce(0))
        a = _reduce_angle(lax.broadcast_in_dim(sh.astype(jnp.float32), (BLOCK_R, d), [0])
                          * lax.broadcast_in_dim(freq, (BLOCK_R, d), [1]))
        kr_smem[part] = (k * jnp.cos(a) + k_half * jnp.sin(a)).astype(dtype)
      plgpu.commit_smem()                 # the registers' stores, before WGMMA reads them
      return kr_smem

    def effective(slot):
      """V_base + V_lr B_i of `slot` (Flash-LoRA) in veff_smem, 64 keys at a time: r
      rank-1 updates in registers (r < 16 is below a WGMMA's K), rounded to the
      pool's dtype as the materialising reference rounds V."""
      rank = b_smem.shape[0]
      for j in range(block_k // BLOCK_R):
        part = pl.ds(j * BLOCK_R, BLOCK_R)
        v = load_vec(v_smem.at[slot, part], plgpu.Layout.WGMMA).astype(jnp.float32)
        for i in range(rank):
          lr = load_vec(vlr_smem.at[slot, i, part], plgpu.Layout.WGMMA.reduce(1))
          bi = load_vec(b_smem.at[i], plgpu.Layout.WGMMA.reduce(0))
          v = v + (lax.broadcast_in_dim(lr, (BLOCK_R, d), [0])
                   * lax.broadcast_in_dim(bi, (BLOCK_R, d), [1]))
        veff_smem[part] = v.astype(dtype)
      plgpu.commit_smem()
      return veff_smem

    def step(i, carry):
      acc, m, l = carry
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_bar.at[slot])

      keys = k_smem.at[slot] if shifted is None else rotated(slot)
      s = mma(q_smem, keys, transpose=True) * scale
      kpos = load_vec(kpos_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
      mask = lax.broadcast_in_dim(kpos, (BLOCK_R, block_k), [1]) <= qpos
      s = jnp.where(mask, s, NEG)
      m_new = jnp.maximum(m, s.max(axis=1))
      corr = jnp.exp(m - m_new)
      p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
      l = corr * l + p.sum(axis=1)
      plgpu.barrier_wait(v_bar.at[slot])

      values = v_smem.at[slot] if lora is None else effective(slot)
      acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0]) + mma(p.astype(dtype), values)
      pl.when(i + stages < n)(functools.partial(issue, lo + i + stages, slot))
      return acc, m_new, l

    init = (cast(jnp.zeros((BLOCK_R, d), jnp.float32), plgpu.Layout.WGMMA),
            cast(jnp.full((BLOCK_R,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            cast(jnp.zeros((BLOCK_R,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
    return lax.fori_loop(0, n, step, init)

  def program():
    bh, rb, split = lax.axis_index("bh"), lax.axis_index("rb"), lax.axis_index("split")
    return bh // hkv, bh % hkv, rb, split

  def write(acc, m, l, o_ref, m_ref, l_ref, o_smem, ml_smem):
    """The normalised output tile with its max and denominator, out by TMA."""
    row, h, rb, split = program()
    rows = pl.ds(rb * BLOCK_R, BLOCK_R)
    inv = 1.0 / jnp.where(l > 0, l, 1.0)
    o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_dtype)
    ml_smem[0] = m
    ml_smem[1] = l
    plgpu.commit_smem()
    if rows_out == rows_p:
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, row, h, rows])
    else:                                  # one row block: its real rows only
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], o_ref.at[split, row, h])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[split, row, h, rows])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[split, row, h, rows])
    plgpu.wait_smem_to_gmem(0)

  n_in = 8 + 3 * (shifted is not None) + 2 * (lora is not None)

  def body(*refs):
    """The walk's buffers and then the output tile are scoped one after the other, so
    the output tile takes no shared memory of its own (a block's total decides how
    many blocks share an SM)."""
    ins, (o_ref, m_ref, l_ref, *bars) = refs[:n_in], refs[n_in:]
    if interpret:       # every buffer is scratch (below): no scopes in the interpreter
      bars, bufs, outs = bars[:3], bars[3:3 + len(buffers)], bars[3 + len(buffers):]
      write(*attend(*ins, *bars, *bufs), o_ref, m_ref, l_ref, *outs)
      return
    acc, m, l = pl.run_scoped(lambda *bufs: attend(*ins, *bars, *bufs), *buffers)
    pl.run_scoped(lambda o_smem, ml_smem: write(acc, m, l, o_ref, m_ref, l_ref, o_smem,
                                                ml_smem), *out_tile)

  barriers = [
      plgpu.Barrier(num_arrivals=2 + 2 * (shifted is not None)           # q + positions
                    + (lora is not None) + bool(window),                 # (+ P, freqs; B_i;
                    num_barriers=1),                                     # page starts)
      plgpu.Barrier(num_arrivals=pps + (1 if shifted is None else 2),    # K pages + positions
                    num_barriers=stages),                                # (+ shifts)
      plgpu.Barrier(num_arrivals=pps + (lora is not None),               # V pages (+ V_lr)
                    num_barriers=stages),
  ]
  buffers = [
      plgpu.SMEM((BLOCK_R, d), dtype, transforms=tx),                    # q tile
      plgpu.SMEM((BLOCK_R,), jnp.int32),                                 # its positions
      plgpu.SMEM((stages, block_k, d), dtype, transforms=tx),            # K pages
      plgpu.SMEM((stages, block_k, d), dtype, transforms=tx),            # V pages
      plgpu.SMEM((stages, block_k), jnp.int32),                          # key positions
  ]
  if shifted is not None:
    buffers += [
        plgpu.SMEM((stages, block_k), jnp.int32),                        # key shifts
        plgpu.SMEM((block_k, d), dtype, transforms=tx),                  # rotated K
        plgpu.SMEM((d, d), dtype, transforms=tx),                        # P
        plgpu.SMEM((d,), jnp.float32),                                   # frequency row
    ]
  if lora is not None:
    rank = lora[1].shape[2]
    buffers += [
        plgpu.SMEM((stages, rank, block_k), jnp.float32),                # V_lr, key-minor
        plgpu.SMEM((rank, d), jnp.float32),                              # B_i[:, h]
        plgpu.SMEM((block_k, d), dtype, transforms=tx),                  # V_base + V_lr B_i
    ]
  if window:
    buffers.append(plgpu.SMEM((window,), jnp.int32))                     # page starts
  rows_out = tiling.rows_out or rows_p
  out_type = [jax.ShapeDtypeStruct((k_splits, b, hkv, rows_out, d), out_dtype),
              jax.ShapeDtypeStruct((k_splits, b, hkv, rows_p), jnp.float32),
              jax.ShapeDtypeStruct((k_splits, b, hkv, rows_p), jnp.float32)]
  out_tile = [plgpu.SMEM((BLOCK_R, d), out_dtype, transforms=otx),      # o tile
              plgpu.SMEM((2, BLOCK_R), jnp.float32)]                     # m, l
  # Mosaic GPU's interpreter takes every buffer as plain scratch: its run_scoped hung
  # twice (no progress, ~3% CPU) on a loaded CPU; shared memory is no limit there.
  scratch = barriers + (buffers + out_tile if interpret else [])
  call = plgpu.kernel(body, out_type=out_type, scratch_types=scratch,
                      grid=(b * hkv, rb_count, k_splits), grid_names=("bh", "rb", "split"),
                      compiler_params=plgpu.CompilerParams(
                          approx_math=True, lowering_semantics=_semantics(plgpu)),
                      interpret=_interpret_params() if interpret else None)
  return call(q_rows, row_pos, starts, positions, bounds, offset, k_flat, v_flat,
              *(shifted or ()), *(lora or ()))


def settled(kernel):
  """`kernel` (a jitted Mosaic entry point) that, run eagerly with interpret=True,
  returns only once its result is computed.

  Mosaic GPU's interpreter runs eager JAX ops inside the kernel's IO callbacks. If
  the caller dispatches other work while the interpreted kernel is still running
  (JAX dispatches asynchronously), the callback's op and the caller's op can each
  wait for the other on the CPU device: the process hangs idle (seen in CI, in a
  test that computed its reference right after the kernel call). Under a trace
  (inside the caller's own jit) nothing is waited for."""

  @functools.wraps(kernel)
  def run(*args, **kwargs):
    out = kernel(*args, **kwargs)
    if kwargs.get("interpret") and not isinstance(out, jax.core.Tracer):
      jax.block_until_ready(out)
    return out

  return run


@settled
@functools.partial(jax.jit, static_argnames=(
    "scale", "pages_per_step", "k_splits", "stages", "stage_starts", "fallback",
    "interpret"))
def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, slot_map: jax.Array,
                    q_positions: jax.Array, *, layer: jax.Array | int | None = None,
                    scale: float | None = None, plan: PagePlan | None = None,
                    pages_per_step: int | None = None, k_splits: int | None = None,
                    stages: int | None = None, stage_starts: bool | None = None,
                    fallback: str = "triton",
                    interpret: bool = False, key_shift: jax.Array | None = None,
                    shift_freq: jax.Array | None = None) -> jax.Array:
  """Mosaic GPU paged attention; same arguments and result as
  `paged_attention.paged_attention_reference`.

  key_shift [B, T] int32 with shift_freq [D/2]: key t read rotated by
  R(key_shift[b, t]), as the Triton kernel (`key_shift.py`) and `jaxkv.ops`'s
  reference path do; a given plan must then carry the shifts
  (`make_page_plan(..., key_shift=)`).

  plan: `make_page_plan(...)` for this slot map and these query positions (the
  tiling knobs, `choose_page_tiling`'s, then go there), shared by the layers of one
  pass. fallback:
  "triton" (the Pallas Triton kernel) or "reference" (XLA), run for the whole
  call when a page is not paged or the call is not `supported`.
  `interpret=True` runs both kernels in their Pallas interpreters (CPU tests).
  """
  if fallback not in ("triton", "reference"):
    raise ValueError(f"fallback must be 'triton' or 'reference', got {fallback!r}")
  hq, d = q.shape[2:]
  k_flat, _ = pa.flat_pool(k_pool, layer)
  v_flat, _ = pa.flat_pool(v_pool, layer)
  hkv = k_flat.shape[1]
  if hq % hkv:
    raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
  if k_flat.shape[2] != d or v_flat.shape != k_flat.shape:
    raise ValueError(f"pool shapes {k_pool.shape}/{v_pool.shape} do not match q {q.shape}")
  if (key_shift is None) != (shift_freq is None):
    raise ValueError("key_shift needs shift_freq (jaxkv.rope.delta_frequencies) and back")

  def other():
    if fallback == "reference":
      if key_shift is None:
        return pa.paged_attention_reference(q, k_pool, v_pool, slot_map, q_positions,
                                            layer=layer, scale=scale)
      k = ks.rotate_reference(pa.gather_kv(k_pool, slot_map, layer), key_shift, shift_freq)
      return pa.attend_reference(q, k, pa.gather_kv(v_pool, slot_map, layer), slot_map,
                                 q_positions, d ** -0.5 if scale is None else scale)
    return pa.paged_attention(q, k_pool, v_pool, slot_map, q_positions, layer=layer,
                              scale=scale, interpret=interpret, key_shift=key_shift,
                              shift_freq=shift_freq)

  return dispatch(q, k_pool, v_pool, slot_map, q_positions, other, layer=layer, plan=plan,
                  pages_per_step=pages_per_step, k_splits=k_splits, stages=stages,
                  stage_starts=stage_starts, scale=scale, interpret=interpret,
                  key_shift=key_shift,
                  shift_freq=shift_freq)


def listed_low_rank(vlr_flat: jax.Array, plan: PagePlan, offset) -> jax.Array:
  """Flash-LoRA's low-rank values [B, r, n_pages * PAGE] float32 of the plan's listed
  keys, in the order of `plan.positions` (a listed page's 16 slots: its dead ones too,
  which get zero weight)."""
  b, n = plan.starts.shape
  slots = (plan.starts[..., None] + jnp.arange(PAGE, dtype=jnp.int32)).reshape(b, n * PAGE)
  return jnp.swapaxes(vlr_flat[slots + offset].astype(jnp.float32), 1, 2)


def dispatch(q, k_pool, v_pool, slot_map, q_positions, other, *, layer, plan, pages_per_step,
             k_splits, stages, stage_starts=None, scale, interpret, key_shift=None,
             shift_freq=None,
             lora=None) -> jax.Array:
  """One call of the Mosaic kernel, or `other()` (the caller's fallback, the same
  result) where it cannot run: a call that is not `supported` or whose tiling passes
  shared memory (statically), a slot map with a page that is not paged (`lax.cond`).
  Makes the plan (`plan` None, with the tiling knobs) or checks the given one against
  the call. `lora`: (vlr_pool, lora_b) for Flash-LoRA (`flash_lora_mosaic.py`)."""
  b, tq, hq, d = q.shape
  k_flat, offset = pa.flat_pool(k_pool, layer)
  v_flat, _ = pa.flat_pool(v_pool, layer)
  hkv = k_flat.shape[1]
  if supported(q, k_pool, v_pool) is not None:
    return other()
  if plan is None:
    plan = make_page_plan(slot_map, q_positions, num_heads=hq, num_kv_heads=hkv,
                          num_slots=k_pool.shape[-3], pages_per_step=pages_per_step,
                          k_splits=k_splits, stages=stages, stage_starts=stage_starts,
                          key_shift=key_shift)
  elif (pages_per_step, k_splits, stages, stage_starts) != (None, None, None, None):
    raise ValueError("pass tiling knobs to make_page_plan, not beside a plan")
  if (key_shift is None) != (plan.shifts is None):
    raise ValueError("key_shift and the page plan disagree: build the plan with "
                     "make_page_plan(..., key_shift=) for a shifted call, without it otherwise")
  tiling = plan.tiling
  if (plan.row_pos.shape != (b, tiling.rows_p) or tiling.rows_p < tq * (hq // hkv)
      or tiling.n_pages * PAGE < slot_map.shape[1] or plan.starts.shape[0] != b):
    raise ValueError(f"page plan (rows {plan.row_pos.shape}, pages {plan.starts.shape}) was "
                     f"not made for q {q.shape} with {hkv} KV heads over a slot map "
                     f"{slot_map.shape}")
  out_dtype = q.dtype if tiling.k_splits == 1 else jnp.float32
  rank = 0 if lora is None else lora[0].shape[-1]
  if smem_bytes(tiling, d, q.dtype, out_dtype, key_shift is not None, rank) > SMEM_BYTES:
    return other()                     # this tiling's buffers do not fit: the fallback

  def mosaic():
    shifted = None if key_shift is None else (plan.shifts, ks.frequency_row(shift_freq),
                                                  half_swap_matrix(d, q.dtype))
    low_rank = None
    if lora is not None:
      vlr_flat, _ = pa.flat_pool(lora[0], layer)
      low_rank = (listed_low_rank(vlr_flat, plan, offset),
                  jnp.swapaxes(lora[1], 1, 2).astype(jnp.float32))     # [B, Hkv, r, D]
    o, m, l = _mosaic_call(pa.fold_rows(q, hkv, tiling.rows_p), plan.row_pos, plan.starts,
                           plan.positions, plan.bounds, offset, k_flat, v_flat, shifted,
                           low_rank, tiling=tiling, scale=d ** -0.5 if scale is None else scale,
                           out_dtype=out_dtype, interpret=interpret)
    rows = o.shape[3]                  # tiling.rows_out: m and l keep the whole tile
    return pa.unfold_rows(pa.merge_splits(o, m[..., :rows], l[..., :rows]), tq,
                          hq).astype(q.dtype)

  return lax.cond(plan.paged, mosaic, other)


# The page plan's names (page_plan.py) are re-exported: callers plan and call through here.
__all__ = ["BLOCK_R", "PAGE", "POS_PAD", "SMEM_BYTES", "STARTS_WINDOW_MAX", "PagePlan",
           "PageTiling", "choose_page_tiling", "dispatch", "half_swap_matrix",
           "listed_low_rank", "make_page_plan", "page_table", "paged_attention", "smem_bytes",
           "supported"]
