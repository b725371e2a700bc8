"""Attention entry points over the paged KV pool.

Models call only this module for attention. Today every call runs the pure-jnp
reference (`paged_attention_reference`), on every backend; the Pallas GPU
kernels (pallas_kernels/) plug in behind the same signature, selected by
`impl` ("auto" | "reference"), and must agree with the reference to stated
tolerances.

Semantics of paged attention (shared by reference and kernels):
- query i of row b sits at logical position `q_positions[b, i]`; key t of row b
  is the token at logical position t, stored in slot `slot_map[b, t]`;
- key t is visible to query i iff `slot_map[b, t] != SENTINEL` and
  `t <= q_positions[b, i]` (causal by logical position; evicted tokens keep
  their positions, so survivors keep their RoPE phases);
- GQA: query head h reads KV head h // (Hq // Hkv);
- masked keys get exactly zero weight; a row with no visible key (all dead, or
  a padding query with a negative position) returns zeros, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kv.state import SENTINEL

IMPLS = ("auto", "reference")


def attention_mask(slot_map: jax.Array, q_positions: jax.Array) -> jax.Array:
  """Visibility [B, Tq, T] from a slot map [B, T] and query positions [B, Tq]."""
  t = jnp.arange(slot_map.shape[-1], dtype=jnp.int32)
  live = (slot_map != SENTINEL)[:, None, :]
  causal = t[None, None, :] <= q_positions[:, :, None]
  return live & causal


def masked_softmax_weights(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis with exact zeros where ~mask and all-dead rows = 0.

  scores: [..., T] float32; mask broadcastable to scores.
  """
  scores = jnp.where(mask, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(scores - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                              slot_map: jax.Array, q_positions: jax.Array, *,
                              layer: jax.Array | int | None = None,
                              scale: float | None = None) -> jax.Array:
  """Pure-jnp paged attention (gather the live slots, masked softmax).

  Args:
    q: [B, Tq, Hq, D] post-RoPE queries.
    k_pool, v_pool: [S, Hkv, D], or [L, S, Hkv, D] together with `layer`.
    slot_map: [B, T] int32 token-level slot map (SENTINEL = dead).
    q_positions: [B, Tq] int32 logical positions (negative: padding query).
    layer: layer index into a stacked pool (may be traced).
    scale: softmax scale, default 1/sqrt(D).
  Returns:
    [B, Tq, Hq, D] in q.dtype.
  """
  b, tq, hq, d = q.shape
  if layer is not None:
    k = k_pool[layer, slot_map]  # [B, T, Hkv, D]
    v = v_pool[layer, slot_map]
  else:
    k = k_pool[slot_map]
    v = v_pool[slot_map]
  hkv = k.shape[2]
  if hq % hkv:
    raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
  scale = d ** -0.5 if scale is None else scale
  qg = q.reshape(b, tq, hkv, hq // hkv, d)
  scores = jnp.einsum("bqhgd,bthd->bhgqt", qg, k,
                      preferred_element_type=jnp.float32) * scale
  mask = attention_mask(slot_map, q_positions)[:, None, None]  # [B, 1, 1, Tq, T]
  w = masked_softmax_weights(scores, mask)
  out = jnp.einsum("bhgqt,bthd->bqhgd", w.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, tq, hq, d).astype(q.dtype)


def paged_attention(q, k_pool, v_pool, slot_map, q_positions, *, layer=None,
                    scale=None, impl: str = "auto"):
  """Dispatching entry point; see `paged_attention_reference` for the contract."""
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
  with jax.named_scope("paged_attention"):
    return paged_attention_reference(q, k_pool, v_pool, slot_map, q_positions,
                                     layer=layer, scale=scale)
