"""The one sequence driver: a jitted chunk step, a `lax.scan` decode, and the
host loop that feeds chunks to the step.

Every runner (the batch engine, agent sessions, LRAgent agents, Phase-2
feature extraction, LoRA training) goes through these; they differ only in
policy: which tokens, which slot map, which options.

- `chunk_step` (jitted `forward_chunk`): one forward pass over a padded chunk
  [B, C] (`Transformer` with its `forward` options), then a readout: logits
  only at the chunk indices `read` [B, R] (the vocab-sized head is the costliest
  matmul, so a prompt prefill reads one row), log p(targets), the greedy argmax,
  and a next token sampled at each row's last read index. Without a pool it is
  a plain differentiable forward (training).
- `decode_scan` (jitted `decode_loop`): `num_steps` single-token steps in one
  `lax.scan`, sampling on device (the host only sees tokens), or teacher-forced
  with `forced` tokens whose log-probabilities it returns.
- `Driver`: owns a pool and the weights' `nnx.split`; `prefill` plans chunks
  (`jaxkv.kv.plan`), runs `chunk_step` on each and yields the outputs; `decode`
  runs `decode_scan`. Weights are jit arguments, the pool is donated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import sharding
from jaxkv.config import COMPILER_OPTIONS
from jaxkv.engine import executables
from jaxkv.engine.sampling import SamplingParams, sample
from jaxkv.kv import plan
from jaxkv.kv import state as kv_state
from jaxkv.models import forward as fwd


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  """Readout of one chunk step (fields are None when not asked for)."""
  token: jax.Array | None      # [B] next token at each row's last read index
  logprob: jax.Array | None    # [B, R] log p(targets) at the read indices
  argmax: jax.Array | None     # [B, R] greedy token at the read indices
  q: jax.Array | None = None   # [L', B, C, Hq, D] post-RoPE queries (Capture.q)
  hidden_at: jax.Array | None = None  # [B, C, D] (Capture.hidden_at)
  hidden_cuts: jax.Array | None = None  # [K, B, C, D] (Capture.hidden_cuts)
  hidden: jax.Array | None = None     # [B, C, D] the output hidden (return_hidden)
  logits: jax.Array | None = None     # [B, R, V] float32 at the read indices (return_logits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  tokens: jax.Array             # [N, B] int32 sampled (or greedy) token of each step
  emitted: jax.Array            # [N, B] bool: the row was live at that step
  logprob: jax.Array | None     # [N, B] log p(forced token) (teacher forcing)
  hidden_at: jax.Array | None   # [N, B, D] (Capture.hidden_at)


def _readout(model, hidden, positions, read, targets, sampling, greedy_only):
  """Logits at the read indices -> (token, logprob, argmax, logits)."""
  h = jnp.take_along_axis(hidden, read[..., None], axis=1)               # [B, R, D]
  logits = model.logits(h)                                               # [B, R, V]
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logprob = None
  if targets is not None:
    logp = jax.nn.log_softmax(logits, axis=-1)
    logprob = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  if sampling is None:
    token = argmax[:, -1]
  else:
    pos = jnp.take_along_axis(positions, read[:, -1:], axis=1)[:, 0]
    token = sample(logits[:, -1], sampling, pos + 1, greedy_only=greedy_only)
  return token, logprob, argmax, logits


def forward_chunk(graphdef, weights, kv: kv_state.KVPool | None, tokens, positions,
               slot_map=None, *, read=None, targets=None, sampling: SamplingParams | None = None,
               write_slots=None, lora: fwd.LoraInputs | None = None,
               window: fwd.LayerWindow | None = None, capture: fwd.Capture = fwd.Capture(),
               recompute: fwd.Recompute | None = None, key_shift=None, attn_impl: str = "auto",
               greedy_only: bool = True, return_hidden: bool = False,
               return_logits: bool = False) -> tuple[StepOutput, kv_state.KVPool | None]:
  """One forward pass over a chunk, with a readout.

  Args:
    kv: the pool (donated), or None for a cache-free forward (training).
    tokens, positions: [B, C] int32 (positions < 0: padding).
    slot_map: [B, T] or [L, B, T] int32, already holding the chunk's slots.
    read: [B, R] int32 chunk indices whose logits to compute, or None (no logits:
      e.g. a layer window that stops before the last layer).
    targets: [B, R] int32 token whose log-probability to return at each read index.
    sampling: per-row sampling of `token` (None: greedy).
    write_slots, lora, window, capture, recompute, key_shift: see `Transformer.__call__`.
    return_hidden: also return the output hidden state (a layer window's output,
      before the final norm when the window stops early).
    return_logits: also return the float32 logits at the read indices.
  Returns:
    (StepOutput, the new pool).
  """
  model = nnx.merge(graphdef, weights)
  out = model(tokens, positions, kv, slot_map=slot_map, write_slots=write_slots, lora=lora,
              window=window, capture=capture, recompute=recompute, key_shift=key_shift,
              attn_impl=attn_impl)
  token = logprob = argmax = logits = None
  if read is not None:
    token, logprob, argmax, logits = _readout(model, out.hidden, positions, read, targets,
                                              sampling, greedy_only)
  return StepOutput(token, logprob, argmax, out.q, out.hidden_at, out.hidden_cuts,
                    out.hidden if return_hidden else None,
                    logits if return_logits else None), out.kv


def decode_loop(graphdef, weights, kv: kv_state.KVPool, tokens, positions, slot_map, remaining,
                *, stop_ids=None, sampling: SamplingParams | None = None, forced=None,
                forced_rows=None, write_map=None, lora: fwd.LoraInputs | None = None,
                key_shift=None, capture: fwd.Capture = fwd.Capture(), num_steps: int,
                attn_impl: str = "auto",
                greedy_only: bool = True) -> tuple[DecodeOutput, kv_state.KVPool]:
  """`num_steps` decode steps in one `lax.scan`.

  Args:
    tokens: [B] int32 input of the first step (the last sampled token).
    positions: [B] int32 its logical position; negative: inactive row.
    slot_map: [B, T] or [L, B, T] int32 holding slots for positions up to
      positions + min(num_steps, remaining) - 1.
    remaining: [B] int32 tokens each row may still generate.
    stop_ids: [K] int32 stop tokens (pad with -1), or None.
    sampling: per-row sampling (None: greedy).
    forced: [num_steps, B] int32 teacher forcing: step s scores forced[s] and
      feeds it to step s + 1 instead of the sampled token.
    forced_rows: [B] bool, with `forced`: the rows it forces (None: every row); the
      others sample and feed their own tokens. A forced row does not stop at a stop
      token (it runs its `remaining` steps).
    write_map: [B, T] slot map that destination slots are read from (default
      `slot_map`; required when `slot_map` has a layer axis).
    lora, capture, key_shift: see `Transformer.__call__` (capture.q is not supported
      here; key_shift [B, T] stays fixed over the steps, 0 for the entries they write).
  Returns:
    (DecodeOutput, the new pool). A row stops emitting after a stop token or
    when `remaining` runs out; its later steps write nothing.
  """
  if capture.q:
    raise ValueError("decode_scan does not capture queries")
  model = nnx.merge(graphdef, weights)
  wmap = slot_map if write_map is None else write_map
  if wmap.ndim != 2:
    raise ValueError("decode with a per-layer slot map needs write_map [B, T]")
  stops = jnp.full((1,), -1, jnp.int32) if stop_ids is None else stop_ids

  def step(carry, forced_s):
    kv, tok, pos, left = carry
    live = (pos >= 0) & (left > 0)
    pos_in = jnp.where(live, pos, -1)[:, None]
    ws = kv_state.write_slots(wmap, pos_in, live[:, None], kv.num_slots)
    out = model(tok[:, None], pos_in, kv, slot_map=slot_map, write_slots=ws, lora=lora,
                capture=capture, key_shift=key_shift, attn_impl=attn_impl)
    logits = model.logits(out.hidden[:, 0])
    nxt = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if sampling is None else
           sample(logits, sampling, pos + 1, greedy_only=greedy_only))
    lp = None
    if forced_s is not None:
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), forced_s[:, None],
                               axis=-1)[:, 0]
    feed = nxt if forced_s is None else (
        forced_s if forced_rows is None else jnp.where(forced_rows, forced_s, nxt))
    stop = jnp.any(nxt[:, None] == stops[None, :], axis=-1)
    if forced_rows is not None:
      stop = stop & ~forced_rows
    left = jnp.where(live, jnp.where(stop, 0, left - 1), left)
    hid = None if out.hidden_at is None else out.hidden_at[:, 0]
    carry = (out.kv, jnp.where(live, feed, tok), jnp.where(live, pos + 1, pos), left)
    return carry, (jnp.where(live, nxt, tok), live, lp, hid)

  (kv, _, _, _), (out, emitted, lp, hid) = jax.lax.scan(
      step, (kv, tokens, positions, remaining), forced, length=num_steps)
  return DecodeOutput(out, emitted, lp, hid), kv


# The jitted steps every runner calls (the pool is donated). The pure functions
# above are for callers that are already inside a jit of their own (a training
# step): JAX accepts compiler options only on the outermost jit, so wrap yours
# with `compiler_options=jaxkv.config.COMPILER_OPTIONS`.
# Both count toward the server's bound on compiled programs (`executables`).
chunk_step = jax.jit(forward_chunk, compiler_options=COMPILER_OPTIONS,
                     static_argnames=("graphdef", "attn_impl", "greedy_only", "return_hidden",
                                      "return_logits"),
                     donate_argnames=("kv",))
executables.register(chunk_step)
decode_scan = jax.jit(decode_loop, compiler_options=COMPILER_OPTIONS,
                      static_argnames=("graphdef", "num_steps", "attn_impl", "greedy_only"),
                      donate_argnames=("kv",))
executables.register(decode_scan)

SlotMapFn = Callable[[int], np.ndarray]
OptionsFn = Callable[[plan.Chunk], dict]


class Driver:
  """A pool and the weights it is run with; the one prefill loop and decode call.

  Args:
    graphdef, weights: `nnx.split(model)`.
    kv: the pool this driver owns (updated in place: each call donates it).
    attn_impl: `jaxkv.ops` implementation.
  """

  def __init__(self, graphdef, weights, kv: kv_state.KVPool, *, attn_impl: str = "auto",
               mesh=None):
    self.graphdef, self.weights, self.kv, self.attn_impl = graphdef, weights, kv, attn_impl
    self.mesh = mesh   # jax.sharding.Mesh: host batches go out with rows on "data"

  def put(self, x, batch_axis: int = 0) -> jax.Array:
    """A host array onto the device(s): rows (axis `batch_axis`) split on the mesh's
    "data" axis when the driver has a mesh (jaxkv.sharding), else the default device."""
    if self.mesh is None:
      return jax.device_put(x)
    return jax.device_put(x, sharding.batch_sharding(self.mesh, np.shape(x), batch_axis))

  def prefill(self, rows: Sequence[plan.Row | None], *, chunk: int,
              slot_map: np.ndarray | SlotMapFn, max_width: int | None = None,
              read: str | None = "last", targets: Sequence[np.ndarray | None] | None = None,
              sampling: SamplingParams | None = None, greedy_only: bool = True,
              options: OptionsFn | None = None,
              cuts: Sequence[int] | None = None) -> Iterator[tuple[plan.Chunk, StepOutput]]:
    """Runs every row's tokens through `chunk_step`, chunk by chunk; yields
    (chunk, output) after each step (the pool is already updated).

    Args:
      rows: per batch row the tokens to run and their first position (None: idle).
      chunk: tokens per row per step (see `plan.plan_chunks`; `cuts` overrides).
      slot_map: the attention slot map, or a function of the padded width
        (`plan.width(chunk.need, max_width)`) returning it.
      read: "last" (each row's last token in the chunk), "all" (every index) or
        None (no logits).
      targets: per row, the token expected after each of its ids (aligned with
        `rows[i].ids`; log-probabilities come back in `StepOutput.logprob`).
      sampling, greedy_only: how `StepOutput.token` is drawn.
      options: chunk -> extra `chunk_step` keyword arguments (write_slots, lora,
        window, capture, recompute, key_shift).
    """
    for ch in plan.plan_chunks(rows, chunk, cuts=cuts):
      smap = slot_map(plan.width(ch.need, max_width)) if callable(slot_map) else slot_map
      b, c = ch.tokens.shape
      rd = tg = None
      if read == "last":
        rd = ch.last[:, None]
      elif read == "all":
        rd = np.broadcast_to(np.arange(c, dtype=np.int32), (b, c))
      elif read is not None:
        raise ValueError(f"read must be 'last', 'all' or None, got {read!r}")
      if targets is not None and rd is not None:
        full = np.zeros((b, c), np.int32)
        for i, t in enumerate(targets):
          if t is not None and ch.count[i]:
            lo, n = int(ch.lo[i]), int(ch.count[i])
            seg = np.asarray(t[lo:lo + n])             # may end early: zeros after
            full[i, :seg.size] = seg
        tg = self.put(np.take_along_axis(full, rd, axis=1))
      extra = options(ch) if options is not None else {}
      out, self.kv = chunk_step(
          self.graphdef, self.weights, self.kv, self.put(ch.tokens), self.put(ch.positions),
          self.put(smap), read=None if rd is None else self.put(rd), targets=tg,
          sampling=sampling,
          attn_impl=self.attn_impl, greedy_only=greedy_only, **extra)
      yield ch, out

  def decode(self, tokens, positions, slot_map, remaining, *, num_steps: int,
             **kw) -> DecodeOutput:
    """One `decode_scan` call on the driver's pool (see there for the arguments).

    Host arrays are moved with explicit `jax.device_put`, so the call runs under
    `jax.transfer_guard("disallow")`: one host round trip per call, none per token.
    """
    put = self.put                           # explicit host -> device transfers
    out, self.kv = decode_scan(self.graphdef, self.weights, self.kv,
                               put(np.asarray(tokens, np.int32)),
                               put(np.asarray(positions, np.int32)), put(slot_map),
                               put(np.asarray(remaining, np.int32)), num_steps=num_steps,
                               attn_impl=self.attn_impl, **kw)
    return out


def continue_one(driver: Driver, logits: np.ndarray, n: int, slot_map: np.ndarray,
                 max_tokens: int, *, forced=None, stop_ids=None,
                 write_map: np.ndarray | None = None,
                 key_shift: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
  """One prefilled sequence continued from its last prompt logits: greedy, or
  teacher-forced with `forced` [max_tokens] (then log p of each forced token is
  returned too). With `stop_ids` the tokens end at the first stop token
  (included).

  Args:
    logits: [V] the last prompt token's logits; n: the prompt length.
    slot_map: [1, W] or [L, 1, W] holding slots for positions < n + max_tokens.
    write_map: [1, W] where the new tokens' K/V go (needed with a layer axis).
    key_shift: [1, W] keys rotated on read (aliased, re-positioned slots), or None.
  Returns:
    (tokens [<= max_tokens] int32, log p [max_tokens] or None).
  """
  first = int(np.argmax(logits)) if forced is None else int(forced[0])
  f = None
  if forced is not None:
    forced = np.asarray(forced, np.int32)
    f = jnp.asarray(np.r_[forced[1:], forced[-1:]][:max_tokens, None])
  stops = None if stop_ids is None else np.asarray(sorted(stop_ids), np.int32)
  out = driver.decode([first], [n], jnp.asarray(slot_map), [max_tokens], num_steps=max_tokens,
                      forced=f, stop_ids=None if stops is None else jnp.asarray(stops),
                      write_map=None if write_map is None else jnp.asarray(write_map),
                      key_shift=None if key_shift is None else jnp.asarray(key_shift))
  toks = np.r_[first, np.asarray(out.tokens)[:max_tokens - 1, 0]].astype(np.int32)
  if stops is not None:
    hit = np.flatnonzero(np.isin(toks, stops))
    toks = toks[:hit[0] + 1] if hit.size else toks
  lp = None
  if forced is not None:
    first_lp = float(jax.nn.log_softmax(jnp.asarray(logits))[forced[0]])
    lp = np.r_[first_lp, np.asarray(out.logprob)[:max_tokens - 1, 0]]
  return toks, lp
