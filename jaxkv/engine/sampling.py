"""Per-row token sampling on device.

Sampling (per row): temperature 0 -> greedy; otherwise logits / temperature,
top-k (0: off), top-p (1.0: off), then a categorical draw with the key
`fold_in(PRNGKey(seed), position)` so a row's sample does not depend on what it
is batched with. A row with a token mask (structured output, `jaxkv.engine.grammar`)
chooses among the tokens its mask allows: the others' logits are -inf first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import SEED_MAX, SEED_MIN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-row sampling parameters (device arrays)."""
  temperature: jax.Array  # [B] float32; 0 -> greedy
  top_k: jax.Array        # [B] int32; 0 -> off
  top_p: jax.Array        # [B] float32; 1 -> off
  key: jax.Array          # [B, 2] uint32 raw PRNG keys
  # [B, ceil(V / 32)] int32 allowed-token bitmask (bit t % 32 of word t // 32; all
  # ones: unconstrained), or None: no row is constrained (the step compiled without it)
  token_mask: jax.Array | None = None

  @classmethod
  def greedy(cls, batch: int) -> SamplingParams:
    return cls(temperature=jnp.zeros(batch, jnp.float32), top_k=jnp.zeros(batch, jnp.int32),
               top_p=jnp.ones(batch, jnp.float32), key=jnp.zeros((batch, 2), jnp.uint32))

  @classmethod
  def from_configs(cls, configs, batch: int,
                   token_mask: np.ndarray | None = None) -> tuple[SamplingParams, bool]:
    """Params for `batch` rows from per-row `SamplingConfig`s (None: an idle row),
    and whether every row is greedy (a static flag that skips the sampler).
    token_mask: [batch, words] int32 bitmask of allowed tokens, or None."""
    temp = np.zeros(batch, np.float32)
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch, np.float32)
    keys = np.zeros((batch, 2), np.uint32)
    for i, s in enumerate(configs):
      if s is None:
        continue
      temp[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
      keys[i] = _raw_key(int(s.seed))
    mask = None if token_mask is None else jnp.asarray(token_mask, jnp.int32)
    return cls(jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p),
               jnp.asarray(keys), mask), not np.any(temp > 0)


def _raw_key(seed: int) -> np.ndarray:
  """Threefry key words [hi, lo] of a 64-bit seed (two's complement for negative
  ones), as `PRNGKey(seed)` makes them with 64-bit JAX: every seed gets its own
  stream (`PRNGKey` in JAX's default 32-bit mode keeps only the low 32 bits, so
  2^32 + 1 sampled as 1). Seeds in [0, 2^32) keep the key they always had."""
  if not SEED_MIN <= seed <= SEED_MAX:
    raise ValueError(f"seed {seed} is outside [{SEED_MIN}, {SEED_MAX}]")
  s = seed & ((1 << 64) - 1)
  return np.asarray([s >> 32, s & 0xFFFFFFFF], np.uint32)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """`logits` [B, V] with every token whose bit is 0 in `mask` [B, >= ceil(V / 32)]
  int32 set to -inf (the bit layout of llguidance's and xgrammar's bitmasks)."""
  vocab = logits.shape[-1]
  if mask.shape[-1] * 32 < vocab:
    raise ValueError(f"token mask of {mask.shape[-1]} words is narrower than {vocab} logits")
  ids = jnp.arange(vocab, dtype=jnp.int32)
  words = jnp.take(mask, ids >> 5, axis=-1)                # [B, V]
  allowed = (jnp.right_shift(words, ids & 31) & 1).astype(bool)
  return jnp.where(allowed, logits, -jnp.inf)


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array, *,
           greedy_only: bool) -> jax.Array:
  """Next tokens [B] int32 from logits [B, V] float32 at positions [B]."""
  if params.token_mask is not None:
    logits = apply_token_mask(logits, params.token_mask)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if greedy_only:
    return greedy
  vocab = logits.shape[-1]
  temp = jnp.maximum(params.temperature, 1e-6)[:, None]
  order = jnp.argsort(-logits, axis=-1)                     # [B, V] descending
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / temp
  rank = jnp.arange(vocab)[None, :]
  k = jnp.where(params.top_k > 0, params.top_k, vocab)[:, None]
  keep = rank < k
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs              # mass strictly above this token
  keep &= (before < params.top_p[:, None]) | (rank == 0)
  masked = jnp.where(keep, sorted_logits, -jnp.inf)
  keys = jax.vmap(jax.random.fold_in)(params.key, positions)
  choice = jax.vmap(jax.random.categorical)(keys, masked)  # index into sorted order
  sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(params.temperature > 0, sampled, greedy)
