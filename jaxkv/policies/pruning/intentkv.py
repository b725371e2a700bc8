"""IntentKV Phase-1: cross-turn QueryMemory and the rule score (sections 3.1-3.2, app. A/H).

Per session, a query memory M_t [L, Hq, D] (the shape of one post-RoPE query
row) follows eq. 2,

    M_t = exp(-lambda) M_{t-1} + Enc(q_t),      lambda = 0.5,

where Enc(q_t) averages the post-RoPE Q rows of the actionable query span, and
after each update M_t is projected to unit norm along the head dimension. The
rule score of candidate position j (eq. 3) is the softmax of M_t[l, h] . K[l, h, j]
/ sqrt(D) over the candidate set, summed over layers and GQA-expanded heads.

Modes: `query` scores with the unit-normed Enc(q_t) alone (no memory; the
normalisation keeps the two modes on one scale), `memory` with M_t.

Sessions are keyed as in appendix A/H: an explicit session id, else the token
tuple of a designated session span, else a hash of the first P = 256 input
tokens, else a request-local key that never matches another request. A
`QueryMemoryStore` keeps the memories of the 1,024 most recently used sessions.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from collections.abc import Sequence

import einops
import jax
import jax.numpy as jnp
import numpy as np

MODES = ("query", "memory")


@dataclasses.dataclass(frozen=True)
class IntentKVConfig:
  mode: str = "memory"         # "query" | "memory" ("learnable": issue 5)
  decay: float = 0.5           # lambda of eq. 2
  session_prefix: int = 256    # P: tokens hashed into the fallback session key
  store_capacity: int = 1024   # LRU of session memories

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"IntentKV mode must be one of {MODES}, got {self.mode!r}")
    if self.decay < 0:
      raise ValueError(f"decay must be >= 0, got {self.decay}")
    if self.session_prefix < 1 or self.store_capacity < 1:
      raise ValueError("session_prefix and store_capacity must be >= 1")


def encode_query(q_span: jax.Array, valid: jax.Array) -> jax.Array:
  """Enc(q_t): mean post-RoPE Q over the query span.

  q_span [L, B, W, Hq, D], valid [B, W] bool -> [L, B, Hq, D] float32 (zeros
  for a row with an empty span).
  """
  w = valid.astype(jnp.float32)
  total = jnp.einsum("lbwhd,bw->lbhd", q_span.astype(jnp.float32), w)
  return total / jnp.maximum(jnp.sum(w, axis=1), 1.0)[None, :, None, None]


def unit_norm(m: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Projection to unit L2 norm along the head dimension (last axis)."""
  return m / jnp.maximum(jnp.linalg.norm(m, axis=-1, keepdims=True), eps)


def update_memory(memory: jax.Array | None, enc: jax.Array, decay: float = 0.5) -> jax.Array:
  """Eq. 2 then the unit-norm projection. memory None (a new session) = zeros."""
  prev = jnp.zeros_like(enc) if memory is None else memory
  return unit_norm(jnp.exp(-decay) * prev + enc)


def rule_scores(memory: jax.Array, k: jax.Array, candidates: jax.Array) -> jax.Array:
  """Eq. 3: rule_j = sum_{l,h} softmax_{i in H}(M[l,h] . K[l,h,i] / sqrt(D))_j.

  memory [L, B, Hq, D]; k [L, B, T, Hkv, D] post-RoPE keys; candidates [B, T]
  bool (the set H the softmax runs over). Returns [B, T] float32, 0 outside H.
  """
  d = memory.shape[-1]
  mg = einops.rearrange(memory, "l b (h g) d -> l b h g d", h=k.shape[3])

  def layer(acc, mk):
    m, kk = mk
    s = jnp.einsum("bhgd,bthd->bhgt", m.astype(jnp.float32), kk.astype(jnp.float32))
    s = jnp.where(candidates[:, None, None], s * d ** -0.5, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(candidates[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.)), 0.)
    den = jnp.sum(p, axis=-1, keepdims=True)
    return acc + jnp.sum(p / jnp.where(den > 0, den, 1.0), axis=(1, 2)), None

  acc, _ = jax.lax.scan(layer, jnp.zeros(candidates.shape, jnp.float32), (mg, k))
  return acc


def intentkv_scores(q_span, span_valid, k, candidates, memory, cfg: IntentKVConfig):
  """Phase-1 scores and the memory to store back.

  Returns (scores [B, T], new memory [L, B, Hq, D]); in `query` mode the
  memory argument is ignored and the returned state is the normed encoding.
  """
  enc = encode_query(q_span, span_valid)
  m = unit_norm(enc) if cfg.mode == "query" else update_memory(memory, enc, cfg.decay)
  return rule_scores(m, k, candidates), m


_request_counter = itertools.count()


def session_key(*, session_id: str | None = None, tokens: Sequence[int] | None = None,
                session_span: tuple[int, int] | None = None, prefix: int = 256) -> tuple:
  """Appendix A/H priority order: explicit id > session-span tokens > hash of the
  first `prefix` tokens > a request-local key (never shared)."""
  if session_id is not None:
    return ("id", str(session_id))
  if tokens is not None and session_span is not None:
    s, e = session_span
    if e > s:
      return ("span", tuple(int(t) for t in tokens[s:e]))
  if tokens is not None and len(tokens):
    head = np.asarray(tokens[:prefix], np.int64).tobytes()
    return ("prefix", hashlib.sha256(head).hexdigest())
  return ("request", next(_request_counter))


class QueryMemoryStore:
  """LRU map session key -> memory [L, Hq, D] (host dict of device arrays)."""

  def __init__(self, capacity: int = 1024):
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {capacity}")
    self.capacity = capacity
    self._items: collections.OrderedDict[tuple, jax.Array] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._items)

  def __contains__(self, key) -> bool:
    return key in self._items

  def get(self, key) -> jax.Array | None:
    m = self._items.get(key)
    if m is not None:
      self._items.move_to_end(key)
    return m

  def put(self, key, memory: jax.Array) -> None:
    self._items[key] = memory
    self._items.move_to_end(key)
    while len(self._items) > self.capacity:
      self._items.popitem(last=False)

  def gather(self, keys: Sequence, shape, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Batch memories [L, B, Hq, D] for keys (zeros for new ones) and a [B] has-memory mask."""
    ms = [self.get(k) for k in keys]
    have = np.array([m is not None for m in ms])
    zero = jnp.zeros(shape, dtype)
    return jnp.stack([zero if m is None else m for m in ms], axis=1), jnp.asarray(have)

  def scatter(self, keys: Sequence, memory: jax.Array) -> None:
    """Store memory [L, B, Hq, D] back under each row's key."""
    for i, k in enumerate(keys):
      self.put(k, memory[:, i])
