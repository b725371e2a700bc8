"""The engine's jitted device steps: chunked prefill and multi-step decode.

Both are pure functions of (graphdef, weights state, KV pool, step inputs);
the weights cross the jit boundary as an argument (`nnx.split` state) and the
pool is donated, so XLA updates it in place. Decode runs `num_steps` tokens per
call with `lax.scan`, sampling on device; the host only sees tokens.

Sampling (per row): temperature 0 -> greedy; otherwise logits / temperature,
top-k (0: off), top-p (1.0: off), then a categorical draw with the key
`fold_in(PRNGKey(seed), position)` so a row's sample does not depend on what it
is batched with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.config import COMPILER_OPTIONS
from jaxkv.kv import state as kv_state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-row sampling parameters (device arrays)."""
  temperature: jax.Array  # [B] float32; 0 -> greedy
  top_k: jax.Array        # [B] int32; 0 -> off
  top_p: jax.Array        # [B] float32; 1 -> off
  key: jax.Array          # [B, 2] uint32 raw PRNG keys


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array, *,
           greedy_only: bool) -> jax.Array:
  """Next tokens [B] int32 from logits [B, V] float32 at positions [B]."""
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


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("graphdef", "attn_impl", "greedy_only"),
                   donate_argnames=("kv",))
def prefill_step(graphdef, weights, kv: kv_state.KVPool, tokens, positions, slot_map,
                 last_index, sampling: SamplingParams, *, attn_impl: str, greedy_only: bool):
  """One prefill chunk for every row.

  Args:
    tokens, positions: [B, C] int32 (positions < 0: padding).
    slot_map: [B, T] int32, already holding the chunk's slots.
    last_index: [B] int32 index in the chunk whose logits to sample (the last
      prompt token when this chunk ends a prompt; anything otherwise).
  Returns:
    (next_tokens [B] int32, kv).
  """
  model = nnx.merge(graphdef, weights)
  valid = positions >= 0
  ws = kv_state.write_slots(slot_map, positions, valid, kv.num_slots)
  hidden, kv = model(tokens, positions, slot_map, ws, kv, attn_impl=attn_impl)
  last = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]  # [B, D]
  logits = model.logits(last)
  last_pos = jnp.take_along_axis(positions, last_index[:, None], axis=1)[:, 0]
  return sample(logits, sampling, last_pos + 1, greedy_only=greedy_only), kv


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("graphdef", "num_steps", "attn_impl", "greedy_only"),
                   donate_argnames=("kv",))
def decode_steps(graphdef, weights, kv: kv_state.KVPool, tokens, positions, slot_map,
                 remaining, stop_ids, sampling: SamplingParams, *, num_steps: int,
                 attn_impl: str, greedy_only: bool):
  """`num_steps` decode steps with `lax.scan`.

  Args:
    tokens: [B] int32 last sampled token of each row (input of the first step).
    positions: [B] int32 its logical position; negative: inactive row.
    slot_map: [B, T] int32 holding slots for positions up to
      positions + min(num_steps, remaining) - 1.
    remaining: [B] int32 tokens each row may still generate.
    stop_ids: [K] int32 stop tokens (pad with -1).
  Returns:
    (out_tokens [num_steps, B] int32, emitted [num_steps, B] bool, kv). A row
    stops emitting after a stop token or when `remaining` runs out; its later
    steps write nothing.
  """
  model = nnx.merge(graphdef, weights)

  def step(carry, _):
    kv, tok, pos, left = carry
    live = (pos >= 0) & (left > 0)
    pos_in = jnp.where(live, pos, -1)[:, None]
    ws = kv_state.write_slots(slot_map, pos_in, live[:, None], kv.num_slots)
    hidden, kv = model(tok[:, None], pos_in, slot_map, ws, kv, attn_impl=attn_impl)
    nxt = sample(model.logits(hidden[:, 0]), sampling, pos + 1, greedy_only=greedy_only)
    nxt = jnp.where(live, nxt, tok)
    stop = jnp.any(nxt[:, None] == stop_ids[None, :], axis=-1)
    left = jnp.where(live, jnp.where(stop, 0, left - 1), left)
    return (kv, nxt, jnp.where(live, pos + 1, pos), left), (nxt, live)

  (kv, _, _, _), (out, emitted) = jax.lax.scan(
      step, (kv, tokens, positions, remaining), None, length=num_steps)
  return out, emitted, kv


def bucket(n: int, lo: int) -> int:
  """Smallest power of two >= max(n, lo): padded shapes that bound recompilation."""
  return max(lo, 1 << max(0, int(n) - 1).bit_length())


def bucket128(n: int, lo: int) -> int:
  """`bucket` up to 128, then the next multiple of 128 (long chunks waste < 128 rows)."""
  return bucket(n, lo) if n <= 128 else -(-int(n) // 128) * 128


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS,
                   static_argnames=("graphdef", "attn_impl", "capture_q", "all_logits"),
                   donate_argnames=("kv",))
def score_chunk(graphdef, weights, kv: kv_state.KVPool, tokens, positions, slot_map, targets,
                *, attn_impl: str, capture_q: bool, all_logits: bool = True):
  """Teacher-forced chunk: writes its KV and scores the given next tokens.

  Used by the session runner for prompt prefill (capturing post-RoPE queries
  for the pruning scorers) and for the NLL of a gold continuation.

  Args:
    tokens, positions: [B, C] int32 (positions < 0: padding, at the end of a row).
    slot_map: [B, T] int32, already holding the chunk's slots.
    targets: [B, C] int32 token expected after each position (any value where
      unused).
    all_logits: score every position; False scores only each row's last valid
      position (prompt prefill needs nothing else), skipping the vocab-sized
      head on the rest of the chunk.
  Returns:
    (logprob of targets and greedy argmax, [B, C] or [B, 1] without
    `all_logits`, kv, and q [L, B, C, Hq, D] when `capture_q` else None).
  """
  model = nnx.merge(graphdef, weights)
  valid = positions >= 0
  ws = kv_state.write_slots(slot_map, positions, valid, kv.num_slots)
  out = model(tokens, positions, slot_map, ws, kv, attn_impl=attn_impl, capture_q=capture_q)
  hidden, kv = out[:2]
  if not all_logits:
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)[:, None]             # [B, 1]
    hidden = jnp.take_along_axis(hidden, last[:, :, None], axis=1)
    targets = jnp.take_along_axis(targets, last, axis=1)
  logits = model.logits(hidden)
  logp = jax.nn.log_softmax(logits, axis=-1)
  lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return lp, jnp.argmax(logits, axis=-1).astype(jnp.int32), kv, (out[2] if capture_q else None)
