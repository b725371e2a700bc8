"""IntentKV Phase-1: cross-turn QueryMemory and the rule score (sections 3.1-3.2, app. A/H).

Per session, a query memory M_t [L, Hq, D] (the shape of one post-RoPE query
row) follows eq. 2,

    M_t = exp(-lambda) M_{t-1} + Enc(q_t),      lambda = 0.5,

where Enc(q_t) averages the post-RoPE Q rows of the actionable query span, and
after each update M_t is projected to unit norm along the head dimension. M is
updated on EVERY request of a session (pruned or not), by serving and by the
Phase-2 feature extractor alike (`advance`), so the head is trained on the
memories serving produces.

Normalised encoding (`normalize_query`, on by default; a decision where the
paper is silent). Read literally, eq. 2 adds a raw Enc(q_t) to a unit-norm
M_{t-1}. Post-RoPE query means are far from unit norm (median ~13 over layers
and heads of SmolLM2 on a 221-token tau2 prompt), so the new turn outweighs the
decayed memory ~20:1 and cos(M_t, Enc(q_t)) has median 0.9998: memory mode
collapses to query mode. Normalising Enc(q_t) first gives every turn weight 1
and the previous memory weight exp(-lambda) = 0.61, which is what the decay is
for: a turn's intent fades over a few turns instead of at once. The rule score
(eq. 3) is a softmax over keys of M . K / sqrt(D), so the memory's scale would
otherwise also act as a per-turn temperature; with both unit-normed, query and
memory modes share one scale. `normalize_query=False` restores the literal form.

The rule score of candidate position j (eq. 3) is the softmax of
M_t[l, h] . K[l, h, j] / sqrt(D) over the candidate set, summed over layers and
GQA-expanded heads.

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
  normalize_query: bool = True  # unit-norm Enc(q_t) before eq. 2 (module docstring)
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


def update_memory(memory: jax.Array | None, enc: jax.Array, decay: float = 0.5,
                  normalize_query: bool = True) -> jax.Array:
  """Eq. 2 then the unit-norm projection. memory None (a new session) = zeros;
  `normalize_query` unit-norms Enc(q_t) first (module docstring)."""
  prev = jnp.zeros_like(enc) if memory is None else memory
  return unit_norm(jnp.exp(-decay) * prev + (unit_norm(enc) if normalize_query else enc))


def advance(memory: jax.Array | None, enc: jax.Array, *, mode: str, decay: float = 0.5,
            normalize_query: bool = True) -> tuple[jax.Array, jax.Array]:
  """One request's QueryMemory step, shared by serving and the Phase-2 extractor.

  Returns (m, new_memory): m is what scores this request -- M_t in `memory` mode,
  unit_norm(Enc(q_t)) in `query` mode (and for the learnable "-memory" ablation) --
  and new_memory = M_t is stored back in every mode, so a session's memory is the
  same whichever scorer reads it.
  """
  new = update_memory(memory, enc, decay, normalize_query)
  return (unit_norm(enc) if mode == "query" else new), new


def memory_cosine(memory: jax.Array, enc: jax.Array) -> jax.Array:
  """Mean over layers and heads of cos(M_t, Enc(q_t)): [L, B, Hq, D] x2 -> [B].
  Near 1 means the memory carries nothing but the current turn."""
  c = jnp.sum(unit_norm(memory.astype(jnp.float32)) * unit_norm(enc.astype(jnp.float32)), -1)
  return jnp.mean(c, axis=(0, 2))


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

  Returns (scores [B, T], new memory M_t [L, B, Hq, D]); in `query` mode the
  scores read unit_norm(Enc(q_t)) and the memory is still advanced (`advance`).
  """
  enc = encode_query(q_span, span_valid)
  m, new = advance(memory, enc, mode=cfg.mode, decay=cfg.decay,
                   normalize_query=cfg.normalize_query)
  return rule_scores(m, k, candidates), new


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

  def pop(self, key) -> jax.Array | None:
    """Removes and returns key's memory (None if absent)."""
    return self._items.pop(key, None)

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
