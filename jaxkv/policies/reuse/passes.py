"""The math of a reuse prefill (seed 002) that is not the runner's bookkeeping:
per-layer FLOPs, the split of layers into passes, per-layer recompute indices,
and the jitted helpers over the pool (the splice of packed rows, boundary-state
injection, the blend probe's key deviation, packing rows for the store).

Every helper is jitted over bucketed shapes (`plan.chunk_len`): an eager op or a
per-length shape compiles one more XLA:CPU executable per request, and each one
holds memory mappings (the kernel's limit is ~65k; a long benchmark ran out of them
and LLVM failed with "Cannot allocate memory"). Used by `jaxkv.engine.reuse` and
`jaxkv.engine.semshare`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import COMPILER_OPTIONS
from jaxkv.kv import plan, quant, splice
from jaxkv.models.forward import Recompute


def layer_flops(cfg, n_tokens: float, ctx_sum: float) -> float:
  """FLOPs of one layer over n tokens whose attention spans sum to ctx_sum:
  2 x (QKV + O + MLP parameters) per token + 4 x Hq x D per attended key."""
  d, hq, hkv, dh, ff = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size)
  params = d * hq * dh + 2 * d * hkv * dh + hq * dh * d + 3 * d * ff
  return 2.0 * params * n_tokens + 4.0 * hq * dh * ctx_sum


def layer_passes(sizes: Sequence[int], lo: int, hi: int, max_passes: int
                 ) -> list[tuple[int, int]]:
  """Splits layers [lo, hi) into at most `max_passes` consecutive windows, each
  run as one forward pass whose recompute width is its largest set (bucketed):
  the split that computes the fewest token-layers (dynamic programming). One
  width for every layer would make each layer run the deepest layer's set
  (the depth guard's sets grow with depth); more passes cost a dispatch and a
  compile each, hence the cap."""
  w = [plan.chunk_len(max(1, n)) for n in sizes[lo:hi]]
  n = len(w)
  cost = lambda i, j: (j - i) * max(w[i:j])           # layers i..j-1 in one pass
  best = {(0, 0): (0, ())}                            # (layers done, passes) -> (cost, cuts)
  for p in range(1, max(1, max_passes) + 1):
    for j in range(1, n + 1):
      cands = [(best[(i, p - 1)][0] + cost(i, j), best[(i, p - 1)][1] + (j,))
               for i in range(j) if (i, p - 1) in best]
      if cands:
        best[(j, p)] = min(cands)
  _, _, ends = min((best[(n, p)][0], p, best[(n, p)][1])       # ties: fewer passes
                   for p in range(1, max(1, max_passes) + 1) if (n, p) in best)
  starts = (0,) + ends[:-1]
  return [(lo + a, lo + b) for a, b in zip(starts, ends)]


@functools.partial(jax.jit, static_argnames=("graphdef",), compiler_options=COMPILER_OPTIONS)
def embed(graphdef, weights, tokens):
  return nnx.merge(graphdef, weights).embed[...][tokens]


@functools.partial(jax.jit, donate_argnames=("pool",), compiler_options=COMPILER_OPTIONS)
def splice_packed(pool, k: quant.Packed, v: quant.Packed, positions, dest, new_positions,
                   inv_freq, vlr: quant.Packed | None = None):
  rows = splice.KVRows(k=quant.dequantize(k, pool.k.dtype), v=quant.dequantize(v, pool.v.dtype),
                       positions=positions,
                       vlr=None if vlr is None else quant.dequantize(vlr, pool.vlr.dtype))
  return splice.splice_rows(pool, rows, dest, new_positions, inv_freq)


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def inject(x, where, h: quant.Packed):
  """x [1, C, D] with rows `where` [N] (C = padding: dropped) set to dequantised h."""
  return x.at[0, where].set(quant.dequantize(h, x.dtype), mode="drop")


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def join_rows(head, tail, at):
  """[K, 1, C, D]: head's rows before `at`, then tail's rows from 0 (both padded to C)."""
  r = jnp.arange(head.shape[2])
  take = jnp.where(r < at, r, head.shape[2] + r - at)
  return jnp.take(jnp.concatenate([head, tail], axis=2), take, axis=2, mode="clip")


@functools.partial(jax.jit, static_argnames=("layer",), compiler_options=COMPILER_OPTIONS)
def keys_at(pool, slots, layer: int):
  return pool.k[layer, slots]


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def deviation(before, after):
  """Per token the relative L2 change of its keys [N, Hkv, D]."""
  n = before.shape[0]
  num = jnp.linalg.norm((after - before).reshape(n, -1), axis=-1)
  return num / jnp.maximum(jnp.linalg.norm(before.reshape(n, -1), axis=-1), 1e-6)


@functools.partial(jax.jit, static_argnames=("storage", "group", "layers", "lr"),
                   compiler_options=COMPILER_OPTIONS)
def pack_rows(pool, slots, cuts, rows, storage: str, group: int, layers: int, lr: bool):
  """Quantised K/V of `slots` [N] (layers < `layers`), their low-rank values with
  `lr`, and boundary states cuts[:, 0, rows] ([K, 1, C, D] captured, rows [N] chunk
  indices)."""
  hidden = None if cuts is None else quant.quantize(cuts[:, 0, rows], storage, group)
  vlr = quant.quantize(pool.vlr[:layers, slots], storage, group) if lr else None
  return (quant.quantize(pool.k[:layers, slots], storage, group),
          quant.quantize(pool.v[:layers, slots], storage, group), hidden, vlr)


def pad(x, n: int, value=0, axis: int = 0) -> np.ndarray:
  """x padded along `axis` to length n with `value`."""
  x = np.asarray(x)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return np.pad(x, widths, constant_values=value)


def recompute_index(sets: Sequence[np.ndarray], lo: int, hi: int, a: int = 0,
                    b: int | None = None) -> Recompute:
  """[L, 1, R] recompute index of a call over layers [lo, hi) and chunk tokens [a, b):
  per layer the set's members in [a, b), rebased to a (-1 padding); R is the largest
  such set among those layers only."""
  local = [s if a == 0 and b is None else s[(s >= a) & (s < b)] - a for s in sets]
  r = plan.chunk_len(max(1, max(s.size for s in local[lo:hi])))
  idx = np.full((len(sets), 1, r), -1, np.int32)
  for l in range(lo, hi):
    idx[l, 0, :local[l].size] = local[l]
  return Recompute(jnp.asarray(idx))
