"""Storage quantization of K/V rows and hidden states kept off the pool (segment
reuse's host store; memory blocks later).

int8 is symmetric per group of `group` consecutive elements of the last axis,
with a float16 scale per group (amax / 127): 1 + 2 / group bytes per element,
1.06 at group 32. Rounding to the nearest step bounds the error of every element
by half a step:

    |x - dequantize(quantize(x))| <= 0.5 * amax_group / 127 * (1 + 2^-11)

(the factor is float16's rounding of the scale; x / scale never exceeds 127.06,
so nothing clips). float16 and float32 store the values cast, with no scale.
Functions are pure jnp: quantize on the device before `jax.device_get` (a
quarter of the bytes cross to the host), dequantize after `jax.device_put`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

STORAGE_DTYPES = {"int8": jnp.int8, "float16": jnp.float16, "float32": jnp.float32}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
  """A stored tensor: values (int8 / float16 / float32) and int8's group scales."""
  q: jax.Array                   # [..., D] stored values
  scale: jax.Array | None        # [..., D / group] float16 (int8 only), else None

  @property
  def nbytes(self) -> int:
    return int(self.q.nbytes) + (0 if self.scale is None else int(self.scale.nbytes))

  def rows(self, axis: int, lo: int, hi: int) -> Packed:
    """The slice lo:hi along `axis` (not the last), scales included."""
    sl = (slice(None),) * axis + (slice(lo, hi),)
    return Packed(self.q[sl], None if self.scale is None else self.scale[sl])


def group_of(dim: int, group: int) -> int:
  """The group size used for a last axis of `dim`: `group` if it divides dim,
  else the whole axis."""
  return group if dim % group == 0 else dim


def quantize(x: jax.Array, storage: str = "int8", group: int = 32) -> Packed:
  """x [..., D] -> Packed (see the module docstring for the error bound)."""
  if storage not in STORAGE_DTYPES:
    raise ValueError(f"storage must be one of {tuple(STORAGE_DTYPES)}, got {storage!r}")
  if storage != "int8":
    return Packed(jnp.asarray(x).astype(STORAGE_DTYPES[storage]), None)
  x = jnp.asarray(x, jnp.float32)
  d = x.shape[-1]
  g = group_of(d, group)
  xg = x.reshape(*x.shape[:-1], d // g, g)
  scale = (jnp.max(jnp.abs(xg), axis=-1) / 127.0).astype(jnp.float16)
  safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
  q = jnp.clip(jnp.round(xg / safe[..., None]), -127, 127).astype(jnp.int8)
  return Packed(q.reshape(x.shape), scale)


def dequantize(p: Packed, dtype=jnp.float32) -> jax.Array:
  """Packed -> [..., D] in `dtype`."""
  if p.scale is None:
    return jnp.asarray(p.q).astype(dtype)
  q = jnp.asarray(p.q)
  d = q.shape[-1]
  g = d // p.scale.shape[-1]
  x = q.reshape(*q.shape[:-1], d // g, g).astype(jnp.float32) * \
      jnp.asarray(p.scale).astype(jnp.float32)[..., None]
  return x.reshape(q.shape).astype(dtype)


def error_bound(x, group: int = 32) -> np.ndarray:
  """Per-element bound of int8's round-trip error for x [..., D] (host numpy)."""
  x = np.asarray(x, np.float32)
  d = x.shape[-1]
  g = group_of(d, group)
  amax = np.abs(x.reshape(*x.shape[:-1], d // g, g)).max(-1, keepdims=True)
  bound = 0.5 * amax / 127.0 * (1 + 2.0 ** -11) + 1e-7 * amax
  return np.broadcast_to(bound, (*x.shape[:-1], d // g, g)).reshape(x.shape)

