"""The Mosaic GPU kernel's page plan: which pages each program walks, built once per pass.

Pages. The slot map is cut into logical pages of PAGE = 16 tokens (the
allocator's page size). A page is *paged* when its live tokens sit on one
physical page, token t in slot `start + t % 16` with `start` a multiple of 16
(what the allocator gives a sequence, also after dead-slot eviction, which only
punches SENTINEL holes, and after a prefix-cache hit, which shares whole
pages). Its 16 keys and values are then one TMA box `pool[start:start + 16, h,
:]`, fetched whole; dead tokens in it are read and get exactly zero weight from
the mask. (Mosaic tiles the pool by 8 rows for the swizzled copy, so a box
must start on a multiple of 8 and the pool's slot count must be one too.) A slot map with a page
that is not paged (a per-token alias map: SemShareKV's reference rows, a token
spliced off its page) cannot be fetched this way: `paged_attention` then runs
the `fallback` kernel for the whole call (a `lax.cond` on `PagePlan.paged`).

Per call (`make_page_plan`, jnp, once per pass like `paged_attention.Plan`):
each row's live pages are listed in position order (dead pages cost nothing),
with their first slot and their 16 keys' positions (POS_PAD for dead tokens,
so one compare `key_pos <= query_pos` is the whole mask: sentinel and causal);
pages after a row block's last query are in no program's range, and where
they share its last step the row's first page is fetched in their place. The list is
cut into steps of `pages_per_step` pages (block_k = 16 * pages_per_step keys),
and each program (row, KV head, row block, split) walks its share of steps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import paged_attention as pa

PAGE = 16          # tokens per page (== jaxkv.kv.allocator's page size; tests check it)
BLOCK_R = 64       # query rows per program: one WGMMA tile height
POS_PAD = pa.POS_PAD  # position of a dead key: above every query
STARTS_WINDOW_MAX = 4096   # page starts (16 KB) a program may stage in shared memory


class PageTiling(NamedTuple):
  """Static tiling of one call (`choose_page_tiling`)."""
  pages_per_step: int   # pages per pipeline step (block_k = PAGE * pages_per_step)
  k_splits: int         # flash-decoding splits
  stages: int           # steps in flight (TMA pipeline depth)
  rows_p: int           # query rows padded to BLOCK_R
  n_pages: int          # listed pages per row, padded to whole steps and to 32
  starts_window: int = 0  # page starts a program stages in shared memory (0: read
                          # each from global memory as it issues the step)
  rows_out: int = 0     # output rows written per (row, KV head): the real rows rounded
                        # to 8 with one row block (decode: 8 of 64), else rows_p

  @property
  def block_k(self) -> int:
    return PAGE * self.pages_per_step


def choose_page_tiling(rows: int, t: int, *, programs: int = 1, pages_per_step=None,
                       k_splits=None, stages=None, stage_starts=None) -> PageTiling:
  """Defaults: 4 pages (64 keys) per step, 2 steps in flight (a block then takes
  about 85 KB of shared memory at head_dim 128, so two blocks share an SM: on an
  H200 at 32k x batch 8 0.36 ms against 0.41 with 3 steps, one block per SM); decode (one row
  block) over long contexts splits as the Triton kernel does
  (`paged_attention.choose_tiling`: shares of >= 512 tokens, enough programs
  to fill the GPU). stage_starts (default on): each program copies the page
  starts of its share of steps into shared memory once, with its query tile, so
  a step's TMA issue reads them there rather than by a scalar load from global
  memory queued behind the pipeline's own traffic; off where a share's list
  passes STARTS_WINDOW_MAX pages (one split over a very long context)."""
  pps = pages_per_step or 4
  if pps < 4 or pps & (pps - 1):   # P V's WGMMA: K = block_k, a multiple of 64 at 16 bits
    raise ValueError(f"pages_per_step={pps} must be a power of two >= 4 (block_k >= 64)")
  rows_p = -(-rows // BLOCK_R) * BLOCK_R
  if k_splits is None:
    fill = max(16, -(-pa.FILL_PROGRAMS // max(programs, 1)))
    k_splits = 1 if rows_p > BLOCK_R else max(1, min(pa.MAX_SPLITS, fill, t // pa.SPLIT_TOKENS))
  pages = -(-max(t, 1) // PAGE)
  grain = max(pps, 32)                  # whole steps, and whole copies of 32 starts (Mosaic
  n_pages = -(-pages // grain) * grain  # copies a multiple of 128 bytes)
  share = -(-n_pages // (pps * k_splits)) * pps        # >= the pages of one split's steps
  window = -(-share // 32) * 32                        # <= n_pages
  if stage_starts is False or window > STARTS_WINDOW_MAX:
    window = 0
  # One row block (decode, short chunks): write the real rows only, not the WGMMA's 64:
  # at GQA 7 the float32 partial outputs of 32 splits were 6% of the bytes a 32k decode
  # reads, written and read back by the merge.
  rows_out = -(-rows // 8) * 8 if rows_p == BLOCK_R else rows_p
  return PageTiling(pps, k_splits, stages or 2, rows_p, n_pages, window, rows_out)


@functools.partial(jax.tree_util.register_dataclass, data_fields=(
    "starts", "positions", "row_pos", "bounds", "paged", "shifts"), meta_fields=("tiling",))
@dataclasses.dataclass(frozen=True)
class PagePlan:
  """What the Mosaic kernel walks, from the slot map alone (`make_page_plan`);
  built once per pass and shared by its layers, like `paged_attention.Plan`."""
  tiling: PageTiling
  starts: jax.Array      # [B, n_pages] first slot of each listed page (padding: a real page)
  positions: jax.Array   # [B, n_pages * PAGE] its keys' positions, POS_PAD where dead
  row_pos: jax.Array     # [B, rows_p] folded query-row positions (pad -1)
  bounds: jax.Array      # [B, row blocks, k_splits, 3] step range [lo, hi) per program
                         # and the row block's count of visible listed pages
  paged: jax.Array       # [] bool: every page is paged (else the fallback runs)
  shifts: jax.Array | None = None   # [B, n_pages * PAGE] its keys' shifts (0 where dead),
                                    # or None: a call without a key shift


def page_table(slot_map: jax.Array, num_slots: int):
  """Logical pages of slot_map [B, T] -> (start [B, P], live [B, P, PAGE], paged []).

  start: slot of the page's token 0 (`slot - t % PAGE` of any live token);
  paged: every live token of every page sits at start + t % PAGE with start a
  multiple of PAGE (one physical page), inside the pool of `num_slots` slots."""
  b, t = slot_map.shape
  p = -(-max(t, 1) // PAGE)
  slots = jnp.pad(slot_map.astype(jnp.int32), ((0, 0), (0, p * PAGE - t)),
                  constant_values=pa.SENTINEL).reshape(b, p, PAGE)
  live = slots != pa.SENTINEL
  implied = slots - jnp.arange(PAGE, dtype=jnp.int32)
  start = jnp.max(jnp.where(live, implied, -1), axis=-1)
  any_live = live.any(-1)
  start = jnp.where(any_live, start, 0)
  same = jnp.where(live, implied == start[..., None], True).all()
  inside = jnp.where(any_live, (start >= 0) & (start + PAGE <= num_slots)
                     & (start % PAGE == 0), True).all()
  return start, live, same & inside


def make_page_plan(slot_map: jax.Array, q_positions: jax.Array, *, num_heads: int,
                   num_kv_heads: int, num_slots: int, pages_per_step=None, k_splits=None,
                   stages=None, stage_starts=None,
                   key_shift: jax.Array | None = None) -> PagePlan:
  """The page list, key positions and per-program step ranges for queries of
  `num_heads` heads at q_positions [B, Tq] over slot_map [B, T], on a pool of
  `num_slots` slots per layer; with key_shift [B, T], the listed keys' shifts.
  Pure jnp: call it inside the caller's jit. (The
  Triton fallback builds its own plan inside its `lax.cond` branch, so the common,
  paged call never compacts the slot map for it.)"""
  if num_heads % num_kv_heads:
    raise ValueError(f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}")
  b, tq = q_positions.shape
  g = num_heads // num_kv_heads
  tiling = choose_page_tiling(tq * g, slot_map.shape[1], programs=b * num_kv_heads,
                              pages_per_step=pages_per_step, k_splits=k_splits, stages=stages,
                              stage_starts=stage_starts)
  pps, k_splits, rows_p, n_pages = (tiling.pages_per_step, tiling.k_splits, tiling.rows_p,
                                    tiling.n_pages)
  start, live, paged = page_table(slot_map, num_slots)
  p = start.shape[1]
  page_live = live.any(-1)                                               # [B, P]
  idx = jnp.arange(p, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(page_live, idx, p + idx), axis=-1).astype(jnp.int32)
  n_live = page_live.sum(-1)                                             # [B]
  listed = jnp.pad(order, ((0, 0), (0, n_pages - p)))                    # padding -> page 0 ...
  real = jnp.arange(n_pages)[None, :] < n_live[:, None]
  first = jnp.take_along_axis(start, order[:, :1], axis=1)               # ... read as a real page
  starts = jnp.where(real, jnp.take_along_axis(start, listed, axis=1), first)
  tok = listed[..., None] * PAGE + jnp.arange(PAGE, dtype=jnp.int32)     # [B, n_pages, PAGE]
  tok_live = jnp.take_along_axis(live, listed[..., None], axis=1) & real[..., None]
  positions = jnp.where(tok_live, tok, POS_PAD).reshape(b, n_pages * PAGE)
  shifts = None
  if key_shift is not None:
    if key_shift.shape != slot_map.shape:
      raise ValueError(f"key_shift {key_shift.shape} does not match the slot map "
                       f"{slot_map.shape}")
    per = jnp.pad(key_shift.astype(jnp.int32), ((0, 0), (0, p * PAGE - slot_map.shape[1])))
    per = jnp.take_along_axis(per.reshape(b, p, PAGE), listed[..., None], axis=1)
    shifts = jnp.where(tok_live, per, 0).reshape(b, n_pages * PAGE)
  row_pos = pa.fold_positions(q_positions, g, rows_p)
  last = row_pos.reshape(b, -1, BLOCK_R).max(-1)                         # [B, RB]
  first_pos = positions.reshape(b, n_pages, PAGE).min(-1)                # [B, n_pages]
  n_vis = ((first_pos[:, None, :] <= last[:, :, None]) & real[:, None, :]).sum(-1)
  steps = -(-n_vis // pps)                                               # [B, RB]
  edges = jnp.arange(k_splits + 1)[None, None, :] * steps[..., None] // k_splits
  visible = jnp.broadcast_to(n_vis[..., None], edges[..., 1:].shape)
  bounds = jnp.stack([edges[..., :-1], edges[..., 1:], visible], axis=-1).astype(jnp.int32)
  return PagePlan(tiling, starts.astype(jnp.int32), positions, row_pos, bounds, paged, shifts)



__all__ = ["BLOCK_R", "PAGE", "POS_PAD", "STARTS_WINDOW_MAX", "PagePlan", "PageTiling",
           "choose_page_tiling", "make_page_plan", "page_table"]
