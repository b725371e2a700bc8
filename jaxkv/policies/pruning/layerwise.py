"""Per-layer KV retention: the prompt-compression baselines SemShareKV compares
with (its Table 1: SnapKV, PyramidKV, H2O), each layer keeping its own tokens
through a slot map with a layer axis ([L, B, T], SENTINEL = evicted there).

The session pruners (`policy.select_kept`) keep one set for all layers; these
score each layer separately with the same scorers (`scores.snapkv`,
`scores.h2o`, run on that layer's queries and keys alone) and keep each
layer's top tokens under that layer's budget (`select.keep_mask`):

- snapkv: the observation window's attention, max-pooled; one budget for all
  layers; the window is always kept;
- pyramidkv: SnapKV's scores with budgets that fall linearly with depth
  (PyramidKV's pyramidal funnel): the bottom layer keeps 2m - m / beta, the top
  m / beta, their mean m (beta = 20 as in its paper), each capped at T;
- h2o: attention accumulated over every prompt query; SemShareKV's modified H2O
  compresses 10% of the cache per layer, i.e. keeps 90%; the recent half of
  the budget is the floor (H2O's ratio mode).

Shapes: q [L, B, C, Hq, D] post-RoPE queries of every prompt token (positions
q_pos [B, C], padding -1); k [L, B, T, Hkv, D]; live [B, T] bool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies.pruning import scores, select

LAYERWISE_METHODS = ("snapkv", "pyramidkv", "h2o", "evict_random")


def pyramid_budgets(mean: int, num_layers: int, n: int, beta: float = 20.0) -> np.ndarray:
  """[L] PyramidKV budgets: linear from 2 m - m / beta (layer 0) to m / beta (top),
  mean m, each at least 1 and at most n."""
  top = mean / beta
  bottom = 2 * mean - top
  b = np.linspace(bottom, top, num_layers) if num_layers > 1 else np.asarray([mean])
  return np.clip(np.round(b), 1, n).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("method", "window"))
def layer_keep(q, q_pos, k, live, budgets, *, method: str, window: int = 32):
  """[L, B, T] bool: the tokens each layer keeps (a subset of live).

  Args:
    q, q_pos, k, live: see the module doc.
    budgets: [L] int32 tokens kept per layer (forced ones included).
    method: snapkv | pyramidkv | h2o (pyramidkv = snapkv here: its budgets differ) |
      evict_random (the chance line: SnapKV's forced window, the rest of each layer's
      budget drawn uniformly at random, a fixed key per layer).
    window: SnapKV's observation window (the last `window` queries).
  """
  if method not in LAYERWISE_METHODS:
    raise ValueError(f"layerwise method must be one of {LAYERWISE_METHODS}, got {method!r}")
  snap = scores.SnapKVConfig(window=window)

  def one(ql, kl, budget, key):
    if method == "h2o":
      s, forced = scores.h2o(ql[None], q_pos, kl[None], live, budget)
    else:
      last = jnp.max(q_pos, axis=1, keepdims=True)
      order = jnp.argsort(jnp.where(q_pos >= 0, -q_pos, jnp.iinfo(jnp.int32).max), axis=1)
      idx = order[:, :window]                                   # the last `window` queries
      win_pos = jnp.take_along_axis(q_pos, idx, axis=1)
      win_pos = jnp.where(win_pos > last - window, win_pos, -1)
      qw = jnp.take_along_axis(ql, idx[:, :, None, None], axis=1)
      s, forced = scores.snapkv(qw[None], win_pos, kl[None], live, snap)
      if method == "evict_random":
        s = jax.random.uniform(key, s.shape, s.dtype)
    return select.keep_mask(s, live, forced, budget)

  keys = jax.random.split(jax.random.PRNGKey(0), q.shape[0])
  return jax.lax.map(lambda a: one(*a), (q, k, budgets, keys))
