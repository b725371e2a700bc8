"""Rotary position embeddings: five frequency variants and the rotation itself.

RoPE is split in two pure functions so the same code serves the model and
exact re-indexing of cached post-RoPE keys (splice, compact layouts):

- `rope_frequencies(rope, head_dim, seq_len)` -> (inv_freq [D/2], attention_scaling)
  for the HF `rope_scaling` variants default / linear / dynamic NTK / llama3 / YaRN;
- `apply_rope(x, positions, inv_freq, scaling)` rotates with the "rotate half"
  convention (HF Llama). Rotations compose, so a key stored post-RoPE at p_old
  moves to p_new exactly with `apply_rope(k, p_new - p_old, inv_freq, 1.0)`
  (the YaRN magnitude scaling must not be applied twice: pass 1.0 for deltas);
- `delta_frequencies(rope, head_dim)`: the frequencies for such a delta, or a
  clear error where no exact delta exists (dynamic NTK: a key's frequencies
  depend on the sequence length when it was written, which the pool does not
  record).

This module sits below both `jaxkv.models` and `jaxkv.kv` (it imports only jax
and the config), so the KV substrate can re-rotate keys without importing a model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.config import RopeConfig


def _default_inv_freq(theta: float, head_dim: int) -> jax.Array:
  exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  return 1.0 / (theta ** exponent)


def _llama3_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
  inv_freq = _default_inv_freq(rope.theta, head_dim)
  low_wavelen = rope.original_max_position / rope.low_freq_factor
  high_wavelen = rope.original_max_position / rope.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
  smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
      rope.high_freq_factor - rope.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[jax.Array, float]:
  factor = rope.factor
  if rope.attention_factor is not None:
    attention_factor = rope.attention_factor
  elif rope.mscale and rope.mscale_all_dim:
    attention_factor = (_yarn_get_mscale(factor, rope.mscale)
                        / _yarn_get_mscale(factor, rope.mscale_all_dim))
  else:
    attention_factor = _yarn_get_mscale(factor)
  base, dim = rope.theta, head_dim
  orig = rope.original_max_position

  def correction_dim(num_rotations):
    return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

  low = correction_dim(rope.beta_fast)
  high = correction_dim(rope.beta_slow)
  if rope.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  interpolation = 1.0 / (factor * pos_freqs)
  extrapolation = 1.0 / pos_freqs
  extrapolation_factor = 1 - ramp
  inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
  return inv_freq, attention_factor


def rope_frequencies(rope: RopeConfig, head_dim: int,
                     seq_len: jax.Array | int | None = None) -> tuple[jax.Array, float]:
  """Inverse frequencies [head_dim/2] and the cos/sin magnitude scaling.

  Args:
    rope: the variant and its parameters.
    head_dim: rotary dimension.
    seq_len: only for "dynamic" NTK: the current sequence length (max position
      + 1, may be traced). Past `original_max_position` the base grows as in HF
      `_compute_dynamic_ntk_parameters`; keys already cached keep the rotation
      they were written with (as in HF's cache).
  """
  if rope.kind == "default":
    return _default_inv_freq(rope.theta, head_dim), 1.0
  if rope.kind == "linear":
    return _default_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
  if rope.kind == "llama3":
    return _llama3_inv_freq(rope, head_dim), 1.0
  if rope.kind == "yarn":
    return _yarn_inv_freq(rope, head_dim)
  # dynamic NTK
  orig = rope.original_max_position
  if seq_len is None:
    seq_len = orig
  seq_len = jnp.maximum(jnp.asarray(seq_len, jnp.float32), orig)
  base = rope.theta * ((rope.factor * seq_len / orig) - (rope.factor - 1)) ** (
      head_dim / (head_dim - 2))
  exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  return 1.0 / (base ** exponent), 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scaling: float = 1.0) -> jax.Array:
  """Rotate-half RoPE.

  Args:
    x: [B, T, H, D].
    positions: [B, T] int (absolute positions, or deltas for re-indexing).
    inv_freq: [D/2] float32.
    scaling: cos/sin magnitude (YaRN attention factor; 1.0 otherwise).
  Returns:
    [B, T, H, D] in x.dtype.
  """
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
  cos = (jnp.cos(emb) * scaling).astype(x.dtype)
  sin = (jnp.sin(emb) * scaling).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def delta_frequencies(rope: RopeConfig, head_dim: int) -> jax.Array:
  """inv_freq [D/2] for exact re-indexing of stored post-RoPE keys by a delta.

  Raises ValueError for dynamic NTK: there the frequencies of a cached key are
  those in force when it was written (they grow with the sequence length past
  `original_max_position`), so R(p_new - p_old) at today's frequencies is not
  the rotation a fresh prefill at p_new would apply.
  """
  if rope.kind == "dynamic":
    raise ValueError("delta-RoPE re-indexing is not exact for dynamic-NTK RoPE (a cached key "
                     "keeps the base in force when it was written); recompute the keys instead")
  inv_freq, _ = rope_frequencies(rope, head_dim, None)
  return inv_freq
