"""Attention entry points over the paged KV pool.

Models and the engine call only this module for attention. Each entry point is
backed by a pure-jnp reference (always available) and a Pallas kernel from
`pallas_kernels/`, chosen by `impl`:

- "auto": the Pallas (Triton) kernel when JAX's default backend is a GPU, the
  XLA reference otherwise (CPU, TPU);
- "reference": the pure-jnp reference on any backend;
- "pallas" (= "triton"): the Pallas Triton kernel, compiled for the GPU;
- "mosaic": paged attention on Mosaic GPU (Hopper; `pallas_kernels/
  paged_attention_mosaic.py`), which runs the Triton kernel for a call whose
  slot map is not page by page, and Flash-LoRA on Mosaic GPU
  (`pallas_kernels/flash_lora_mosaic.py`, the same page plan). JAX deprecated
  Pallas's Triton backend; "auto" moves to Mosaic once it measures at least as
  fast (docs/kernels.md);
- "interpret": the Pallas kernel run by the Pallas interpreter (any backend;
  slow, for tests and debugging).

Semantics of paged attention (shared by reference and kernels):
- query i of row b sits at logical position `q_positions[b, i]`; key t of row b
  is the token at logical position t, stored in slot `slot_map[b, t]`;
- key t is visible to query i iff `slot_map[b, t] != SENTINEL` and
  `t <= q_positions[b, i]` (causal by logical position; evicted tokens keep
  their positions, so survivors keep their RoPE phases);
- GQA: query head h reads KV head h // (Hq // Hkv);
- masked keys get exactly zero weight; a row with no visible key (all dead, or
  a padding query with a negative position) returns zeros, never NaN.
The kernels compact each row's live tokens first and loop over visible live key
blocks only: pruned tokens and keys after the last query are never read and cost
no iteration. That set-up depends on the slot map alone: `attention_plan` builds
it once for all the layers of a pass that share one slot map.
"""

from __future__ import annotations

import jax

from jaxkv.config import ATTENTION_IMPLS
from jaxkv.kv.state import SENTINEL
from jaxkv.rope import apply_rope
from pallas_kernels import flash_lora_attention as _fla
from pallas_kernels import flash_lora_mosaic as _flm
from pallas_kernels import paged_attention as _pa
from pallas_kernels import paged_attention_mosaic as _pam
from pallas_kernels.flash_lora_attention import flash_lora_attention_reference
from pallas_kernels.paged_attention import paged_attention_reference

if _pa.SENTINEL != SENTINEL:
  raise ImportError("pallas_kernels and jaxkv.kv disagree on the SENTINEL slot")

IMPLS = ATTENTION_IMPLS


def resolve_impl(impl: str) -> str:
  """'auto' -> 'pallas' on a GPU backend, 'reference' elsewhere; validates names."""
  if impl not in IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return "pallas" if impl == "triton" else impl


def attention_plan(slot_map, q_positions, *, num_heads: int, num_kv_heads: int,
                   impl: str = "auto", lora: bool = False, num_slots: int | None = None,
                   key_shift=None):
  """The kernels' per-call set-up (live-token compaction, live-block tables; the
  Mosaic kernel's page list) for one slot map and query positions, to build
  once and pass to every layer of a pass (`plan=`); None where `impl` resolves
  to the reference, which needs none. `lora`: for `flash_lora_attention` (its
  own key-block width). `num_slots`: slots per layer of the pool (the Mosaic
  plan checks that every page lies inside it). `key_shift`: the pass rotates keys on
  read (a MemArt row); the Triton and Mosaic paged-attention kernels do, so their plan
  then carries the shifts, and it is None for the calls that run the reference
  (Flash-LoRA with a key shift)."""
  impl = resolve_impl(impl)
  if impl == "reference":
    return None
  if key_shift is not None and lora:
    return None
  if impl == "mosaic":
    if num_slots is None:
      raise ValueError("the mosaic plan needs num_slots (slots per layer of the pool)")
    return _pam.make_page_plan(slot_map, q_positions, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, num_slots=num_slots,
                               key_shift=key_shift)
  if key_shift is not None:
    return _pa.make_plan(slot_map, q_positions, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, key_shift=key_shift)
  make = _fla.make_plan if lora else _pa.make_plan
  return make(slot_map, q_positions, num_heads=num_heads, num_kv_heads=num_kv_heads)


def paged_attention(q, k_pool, v_pool, slot_map, q_positions, *, layer=None,
                    scale=None, impl: str = "auto", key_shift=None, shift_freq=None,
                    plan=None):
  """Paged attention; see the module docstring and `paged_attention_reference`.

  q [B, Tq, Hq, D]; k_pool, v_pool [S, Hkv, D] or [L, S, Hkv, D] with `layer`;
  slot_map [B, T] int32; q_positions [B, Tq] int32. Returns [B, Tq, Hq, D].

  key_shift [B, T] int32 (optional): key t is read rotated by R(key_shift[b, t])
  (exact delta-RoPE on read, `shift_freq` from `jaxkv.rope.delta_frequencies`),
  so a slot written at position p can be aliased at position p + shift without a
  copy (MemArt's decoupled positions). The Triton kernel ("pallas", "interpret")
  and the Mosaic kernel ("mosaic") rotate each key block as they read it;
  "reference" runs the reference path (gather, rotate, attend).

  plan: `attention_plan(slot_map, q_positions, ...)` built once for the layers
  sharing this slot map (optional; the kernels build it per call otherwise).
  """
  impl = resolve_impl(impl)
  if key_shift is not None:
    if shift_freq is None:
      raise ValueError("key_shift needs shift_freq (jaxkv.rope.delta_frequencies)")
    if impl in ("pallas", "interpret"):
      with jax.named_scope(f"paged_attention_shifted_{impl}"):
        return _pa.paged_attention(q, k_pool, v_pool, slot_map, q_positions, layer=layer,
                                   scale=scale, plan=plan, key_shift=key_shift,
                                   shift_freq=shift_freq, interpret=impl == "interpret")
    if impl == "mosaic":
      with jax.named_scope("paged_attention_shifted_mosaic"):
        return _pam.paged_attention(q, k_pool, v_pool, slot_map, q_positions, layer=layer,
                                    scale=scale, plan=plan, key_shift=key_shift,
                                    shift_freq=shift_freq)
    with jax.named_scope("paged_attention_shifted"):
      k = apply_rope(_pa.gather_kv(k_pool, slot_map, layer), key_shift, shift_freq, 1.0)
      return _pa.attend_reference(q, k, _pa.gather_kv(v_pool, slot_map, layer), slot_map,
                                  q_positions, scale)
  with jax.named_scope(f"paged_attention_{impl}"):
    if impl == "reference":
      return paged_attention_reference(q, k_pool, v_pool, slot_map, q_positions,
                                       layer=layer, scale=scale)
    if impl == "mosaic":
      return _pam.paged_attention(q, k_pool, v_pool, slot_map, q_positions, layer=layer,
                                  scale=scale, plan=plan)
    return _pa.paged_attention(q, k_pool, v_pool, slot_map, q_positions, layer=layer,
                               scale=scale, plan=plan, interpret=impl == "interpret")


def flash_lora_attention(q, k_pool, v_pool, vlr_pool, lora_b, slot_map, q_positions, *,
                         layer=None, scale=None, impl: str = "auto", plan=None,
                         key_shift=None, shift_freq=None):
  """Paged attention with a low-rank value term: V = V_base + V_lr B_i (LRAgent).

  vlr_pool [S, r] (or [L, S, r]) is the shared rank-r value cache; lora_b
  [B, r, Hkv, D] each sequence's B_i. See pallas_kernels/flash_lora_attention.py.
  plan: `attention_plan(..., lora=True)`, as for `paged_attention`.
  key_shift / shift_freq: keys rotated on read, as for `paged_attention` (a MemArt
  row in a batch with decoupled adapter rows); the reference path runs it.
  """
  if key_shift is not None:
    if shift_freq is None:
      raise ValueError("key_shift needs shift_freq (jaxkv.rope.delta_frequencies)")
    with jax.named_scope("flash_lora_attention_shifted"):
      k = apply_rope(_pa.gather_kv(k_pool, slot_map, layer), key_shift, shift_freq, 1.0)
      v = _fla.materialise_v(v_pool, vlr_pool, lora_b, slot_map, layer)
      return _pa.attend_reference(q, k, v, slot_map, q_positions, scale)
  impl = resolve_impl(impl)
  with jax.named_scope(f"flash_lora_attention_{impl}"):
    if impl == "reference":
      return flash_lora_attention_reference(q, k_pool, v_pool, vlr_pool, lora_b, slot_map,
                                            q_positions, layer=layer, scale=scale)
    if impl == "mosaic":
      return _flm.flash_lora_attention(q, k_pool, v_pool, vlr_pool, lora_b, slot_map,
                                       q_positions, layer=layer, scale=scale, plan=plan)
    return _fla.flash_lora_attention(q, k_pool, v_pool, vlr_pool, lora_b, slot_map,
                                     q_positions, layer=layer, scale=scale, plan=plan,
                                     interpret=impl == "interpret")
