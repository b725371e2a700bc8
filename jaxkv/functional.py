"""Pure functional API: paged-KV inference as functions over one pytree state.

For research code that wants jaxkv's paged forward inside its own JAX program:

    import jaxkv
    from jaxkv import functional as F

    llm = jaxkv.load("smollm2-135m")
    state = F.init_state(llm.config, batch=2, max_len=256)
    run = F.jit(F.generate, static_argnames=("graphdef", "num_tokens"))
    tokens, state = run(llm.graphdef, llm.weights, state, prompts, lengths, num_tokens=32)

Everything here is a pure function of (graphdef, weights, state, inputs): jit
it, `jax.vmap` it over prompts, take `jax.grad` through it (e.g. with respect
to LoRA parameters, `forward.LoraInputs`). No host allocator runs: `State`
reserves a page table up front (row b owns pages [1 + b P, 1 + (b + 1) P); page
0 holds the sentinel slot), and slots are computed on device as
`page_table[b, t // page] * page + t % page`. Padding tokens have position -1
and are never written.

Compiler options: JAX accepts `compiler_options` only on the outermost jit, so
these functions carry none. Wrap them with `F.jit` (or pass
`compiler_options=jaxkv.config.COMPILER_OPTIONS` to your own `jax.jit`) to get
the options every jaxkv step uses (today none: XLA's defaults measured fastest;
see `jaxkv.config.COMPILER_OPTIONS` for the history).

Decoding inside `generate` is the driver's own `decode_loop` (one `lax.scan`),
and its prefill the driver's `forward_chunk`: the same code as the engine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.config import COMPILER_OPTIONS, PAGE_SIZE, ModelConfig
from jaxkv.engine import driver
from jaxkv.engine.sampling import SamplingParams
from jaxkv.kv import state as kv_state
from jaxkv.models import forward as fwd


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
  """KV pool, per-row page table and lengths of a fixed batch of sequences."""
  kv: kv_state.KVPool     # [L, S, Hkv, D] pool, S = (1 + B P) * page_size
  page_table: jax.Array   # [B, P] int32 pages each row owns
  lengths: jax.Array      # [B] int32 tokens written per row
  page_size: int = dataclasses.field(default=PAGE_SIZE, metadata=dict(static=True))

  @property
  def max_len(self) -> int:
    return self.page_table.shape[-1] * self.page_size

  def slot_map(self) -> jax.Array:
    """[B, max_len] int32 slot of every logical position of every row."""
    t = jnp.arange(self.max_len, dtype=jnp.int32)
    return self.page_table[:, t // self.page_size] * self.page_size + t % self.page_size


def init_state(cfg: ModelConfig, batch: int, max_len: int, *, page_size: int = PAGE_SIZE,
               dtype=jnp.float32, lr_rank: int = 0) -> State:
  """An empty state for `batch` rows of up to `max_len` tokens each.

  lr_rank > 0 adds the LoRA low-rank value pool (decoupled LoRA mode).
  """
  if batch < 1 or max_len < 1 or page_size < 1:
    raise ValueError(f"need batch, max_len and page_size >= 1, got {batch}, {max_len}, "
                     f"{page_size}")
  pages = -(-max_len // page_size)
  table = 1 + jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  kv = kv_state.init_slots(cfg, (1 + batch * pages) * page_size, dtype, lr_rank)
  return State(kv=kv, page_table=table, lengths=jnp.zeros(batch, jnp.int32),
               page_size=page_size)


def _chunk_positions(state: State, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """[B, C] positions state.lengths + c for c < lengths, -1 after (padding)."""
  c = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  return jnp.where(c < lengths[:, None], state.lengths[:, None] + c, -1)


def _check_fits(state: State, new: int) -> None:
  if new > state.max_len:
    raise ValueError(f"{new} tokens per row do not fit the state's max_len {state.max_len}")


def prefill(graphdef, weights, state: State, tokens: jax.Array, lengths: jax.Array, *,
            lora: fwd.LoraInputs | None = None,
            attn_impl: str = "auto") -> tuple[jax.Array, State]:
  """Appends a chunk to every row; returns the logits after each row's last token.

  Args:
    tokens: [B, C] int32, row b's first lengths[b] entries are real.
    lengths: [B] int32 real tokens per row (0: the row takes no tokens).
  Returns:
    (logits [B, V] float32 at each row's last real token, new state). Positions
    continue from `state.lengths`; the caller keeps state.lengths + C <= max_len.
  """
  _check_fits(state, tokens.shape[1])
  model = nnx.merge(graphdef, weights)
  positions = _chunk_positions(state, tokens, lengths)
  out = model(tokens, positions, state.kv, slot_map=state.slot_map(), lora=lora,
              attn_impl=attn_impl)
  last = jnp.maximum(lengths - 1, 0)[:, None, None]
  logits = model.logits(jnp.take_along_axis(out.hidden, last, axis=1)[:, 0])
  return logits, dataclasses.replace(state, kv=out.kv, lengths=state.lengths + lengths)


def decode(graphdef, weights, state: State, tokens: jax.Array, *,
           lora: fwd.LoraInputs | None = None,
           attn_impl: str = "auto") -> tuple[jax.Array, State]:
  """One token per row ([B] int32) at position state.lengths; returns logits [B, V]."""
  return prefill(graphdef, weights, state, tokens[:, None], jnp.ones_like(state.lengths),
                 lora=lora, attn_impl=attn_impl)


def generate(graphdef, weights, state: State, tokens: jax.Array, lengths: jax.Array, *,
             num_tokens: int, sampling: SamplingParams | None = None,
             lora: fwd.LoraInputs | None = None,
             attn_impl: str = "auto") -> tuple[jax.Array, State]:
  """Prefills the prompts, then generates `num_tokens` tokens per row (greedy, or
  per-row `sampling`). num_tokens is static; there are no stop tokens (a fixed
  length keeps every shape static; the batch engine handles stops).

  Returns:
    (tokens [B, num_tokens] int32, state with the prompts and all but the last
    generated token written, as after any decode).
  """
  _check_fits(state, tokens.shape[1] + num_tokens)
  positions = _chunk_positions(state, tokens, lengths)
  read = jnp.maximum(lengths - 1, 0)[:, None]
  smap = state.slot_map()
  out, kv = driver.forward_chunk(graphdef, weights, state.kv, tokens, positions, smap,
                                 read=read, sampling=sampling, lora=lora, attn_impl=attn_impl,
                                 greedy_only=sampling is None)
  first = out.token
  pos = state.lengths + lengths
  if num_tokens > 1:
    dec, kv = driver.decode_loop(graphdef, weights, kv, first, pos, smap,
                                 jnp.full_like(pos, num_tokens - 1), sampling=sampling,
                                 lora=lora, num_steps=num_tokens - 1, attn_impl=attn_impl,
                                 greedy_only=sampling is None)
    toks = jnp.concatenate([first[:, None], dec.tokens.T], axis=1)
  else:
    toks = first[:, None]
  new_len = pos + num_tokens - 1
  return toks, dataclasses.replace(state, kv=kv, lengths=new_len)


def jit(fun=None, **kwargs):
  """`jax.jit` with jaxkv's compiler options (usable as a decorator)."""
  if fun is None:
    return functools.partial(jit, **kwargs)
  return jax.jit(fun, compiler_options=COMPILER_OPTIONS, **kwargs)
