"""One pruning event: method scores + forced set + budget -> kept set (jit, static config).

The caller (the session runner, or a user's own jitted loop) provides the
post-RoPE keys gathered at the slot map, the live mask, the base forced set
(protected system prefix + actionable query span), and the queries the method
reads, already sliced to the rows it needs:

  random, streaming_llm: none;
  snapkv:        the observation window (last W prompt tokens);
  h2o:           the prompt tokens new since the session's previous turn
                 (`sessions.query_slice`: the same voters in both layouts);
  intentkv:      the actionable query span (Enc(q_t) of eq. 2).

Queries come with their logical positions (-1 = padding row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.config import COMPILER_OPTIONS, PruningConfig
from jaxkv.kv import plan
from jaxkv.policies.pruning import intentkv, residual, scores
from jaxkv.policies.pruning.select import keep_mask


def query_rows(cfg: PruningConfig) -> str | None:
  """Which captured query rows the method reads: None | 'window' | 'all' | 'span'."""
  return {"none": None, "random": None, "streaming_llm": None, "snapkv": "window", "h2o": "all",
          "intentkv": "span"}[cfg.method]


def intentkv_config(cfg: PruningConfig) -> intentkv.IntentKVConfig:
  return intentkv.IntentKVConfig(mode=cfg.intent_mode, decay=cfg.intent_decay,
                                 normalize_query=cfg.intent_normalize_query,
                                 session_prefix=cfg.session_prefix,
                                 store_capacity=cfg.memory_capacity)


def select_kept(cfg: PruningConfig, k: jax.Array, live: jax.Array, forced: jax.Array,
                q: jax.Array | None = None, q_pos: jax.Array | None = None,
                memory: jax.Array | None = None, span: jax.Array | None = None,
                head_graphdef=None, head_state=None) -> tuple[jax.Array, jax.Array | None]:
  """The kept set of one pruning event.

  The budget C and the random control's seed travel as traced scalars (the static
  config carries fixed placeholders), so sweeping budgets or seeds compiles once
  per method and shape.

  Args:
    cfg: pruning config (static).
    k: [L, B, T, Hkv, D] post-RoPE keys at the slot map (`scores.gather_keys`).
    live: [B, T] bool.
    forced: [B, T] bool base forced set (system prefix + query span).
    q, q_pos: [L, B, W, Hq, D] and [B, W] queries the method reads (see module doc).
    memory: [L, B, Hq, D] IntentKV session memories (zeros for new sessions).
    span: [B, T] bool actionable query span (IntentKV learnable: K-bar^q).
    head_graphdef, head_state: `nnx.split` of a trained `ResidualHead` (learnable).
  Returns:
    (keep [B, T] bool, updated IntentKV memory or None).
  """
  return _select_kept(_static(cfg), k, live, forced, q, q_pos, memory, span,
                      jnp.asarray(cfg.budget, jnp.int32),
                      jnp.asarray(cfg.random_seed, jnp.int32), head_graphdef=head_graphdef,
                      head_state=head_state)


def select_kept_at(cfg: PruningConfig, pool_k: jax.Array, slot_map: jax.Array,
                   live: jax.Array, forced: jax.Array, q_rows: jax.Array | None = None,
                   q_start: int = 0, q_lo: int = 0, q_count: int = 0,
                   memory: jax.Array | None = None, span: jax.Array | None = None,
                   head_graphdef=None, head_state=None,
                   budget: int | None = None) -> tuple[jax.Array, jax.Array | None]:
  """`select_kept` for a serving loop: one jitted call that gathers the keys from
  the pool and slices the query rows itself (no eager, unbucketed copies).

  Args:
    pool_k: [L, S, Hkv, D] the pool's keys; slot_map [B, W] (bucketed width).
    q_rows: [L, B, Wq, Hq, D] captured queries of the prompt tokens just computed
      (row j at logical position q_start + j; Wq bucketed), or None.
    q_lo, q_count: the method reads rows [q_lo, q_lo + q_count) (traced; the
      static row count is `plan.chunk_len(q_count)`, padding rows get position -1).
    budget: this request's C (traced; None: `cfg.budget`), e.g. the caller's
      `budget_scope="history"` C.
    others: see `select_kept`.
  """
  rows = plan.chunk_len(max(int(q_count), 1)) if q_rows is not None else 0
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return _select_kept_at(_static(cfg), pool_k, slot_map, live, forced,
                         q_rows, i32(q_start), i32(q_lo), i32(q_count), memory, span,
                         i32(cfg.budget if budget is None else budget), i32(cfg.random_seed),
                         head_graphdef=head_graphdef, head_state=head_state, rows=rows)


def _select_kept_at_impl(cfg, pool_k, slot_map, live, forced, q_rows, q_start, q_lo, q_count,
                         memory, span, budget, seed, head_graphdef=None, head_state=None, *,
                         rows):
  k = scores.gather_keys(pool_k, slot_map)                 # [L, B, W, Hkv, D], inside the jit
  q = q_pos = None
  if q_rows is not None:
    q, q_pos = _slice_rows(q_rows, q_start, q_lo, q_count, live.shape[0], rows)
  return _kept(cfg, k, live, forced, q, q_pos, memory, span, budget, seed, head_graphdef,
               head_state)


def _static(cfg: PruningConfig) -> PruningConfig:
  """The config with its traced fields (budget, random_seed) and the host-side
  budget_scope set to placeholders."""
  return dataclasses.replace(cfg, budget=1, random_seed=0, budget_scope="prompt")


def _kept(cfg, k, live, forced, q, q_pos, memory, span, budget, seed, head_graphdef=None,
          head_state=None):
  """The pruning event itself (pure; the two jitted entry points wrap it)."""
  new_memory = None
  if cfg.method == "none":
    return live, None
  if cfg.method == "random":
    s = scores.random_retention(live, seed, jnp.sum(live, dtype=jnp.int32))
    f = jnp.zeros_like(live)
  elif cfg.method == "streaming_llm":
    s, f = scores.streaming_llm(live, scores.StreamingLLMConfig(sink=cfg.sink))
  elif cfg.method == "snapkv":
    s, f = scores.snapkv(q, q_pos, k, live, scores.SnapKVConfig(cfg.snap_window, cfg.snap_kernel))
  elif cfg.method == "h2o":
    # Ratio mode over the residual budget C* = C - |F| (F = protected system prefix +
    # query span), so H2O keeps as many tokens as every other method.
    c_star = jnp.maximum(budget - jnp.sum(forced & live, axis=1), 0)
    s, f = scores.h2o(q, q_pos, k, live, c_star, scores.H2OConfig(cfg.h2o_recent_ratio))
  elif cfg.method == "intentkv" and cfg.intent_mode == "learnable":
    candidates = live & ~forced
    m, new_memory = _advance(cfg, q, q_pos, memory)
    if cfg.ablate_residual:       # alpha = 0 is exactly the rule scorer (Phase-1)
      s = intentkv.rule_scores(m, k, candidates)
    else:                         # the extractor builds its rows with the same function
      inputs = residual.phase2_inputs(k, m, candidates, span & live,
                                      n_q=q.shape[2])      # all span rows (static)
      s = residual.phase2_scores((head_graphdef, head_state), inputs, candidates,
                                 ablate_xattn=cfg.ablate_xattn)
    f = jnp.zeros_like(live)
  elif cfg.method == "intentkv":
    candidates = live & ~forced
    s, new_memory = intentkv.intentkv_scores(q, q_pos >= 0, k, candidates, memory,
                                             intentkv_config(cfg))
    f = jnp.zeros_like(live)
  else:
    raise ValueError(f"unknown pruning method {cfg.method!r}")
  if cfg.method == "intentkv":
    s = scores.max_pool(s, cfg.intent_pool, where=live & ~forced)
  return keep_mask(s, live, forced | f, budget), new_memory


def _advance(cfg: PruningConfig, q, q_pos, memory):
  """(scoring memory, M_t) of this request (`intentkv.advance` on the span rows)."""
  mode = "query" if cfg.intent_mode == "query" or cfg.ablate_memory else "memory"
  return intentkv.advance(memory, intentkv.encode_query(q, q_pos >= 0), mode=mode,
                          decay=cfg.intent_decay, normalize_query=cfg.intent_normalize_query)


def advance_memory_at(cfg: PruningConfig, q_rows: jax.Array, q_start: int, q_lo: int,
                      q_count: int, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
  """IntentKV's per-request memory step for a serving loop (every request, pruned or
  not): reads the captured query rows [q_lo, q_lo + q_count) as `select_kept_at` does.

  Returns (M_t [L, B, Hq, D], cos(M_t, Enc(q_t)) [B] averaged over layers and heads).
  The pruning event, when there is one, recomputes the same M_t from the same
  previous memory (a mean over the span rows: cheap).
  """
  rows = plan.chunk_len(max(int(q_count), 1))
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return _advance_at(_static(cfg), q_rows, i32(q_start), i32(q_lo), i32(q_count), memory,
                     rows=rows)


def _slice_rows(q_rows, q_start, q_lo, q_count, b, rows):
  j = jnp.arange(rows, dtype=jnp.int32)
  idx = jnp.clip(q_lo + j, 0, q_rows.shape[2] - 1)
  q_pos = jnp.broadcast_to(jnp.where(j < q_count, q_start + q_lo + j, -1), (b, rows))
  return jnp.take(q_rows, idx, axis=2), q_pos


def _advance_at_impl(cfg, q_rows, q_start, q_lo, q_count, memory, *, rows):
  q, q_pos = _slice_rows(q_rows, q_start, q_lo, q_count, memory.shape[1], rows)
  enc = intentkv.encode_query(q, q_pos >= 0)
  _, new = _advance(cfg, q, q_pos, memory)
  return new, intentkv.memory_cosine(new, enc)


_advance_at = jax.jit(_advance_at_impl, compiler_options=COMPILER_OPTIONS,
                      static_argnames=("cfg", "rows"))
_select_kept = jax.jit(_kept, compiler_options=COMPILER_OPTIONS,
                       static_argnames=("cfg", "head_graphdef"))
_select_kept_at = jax.jit(_select_kept_at_impl, compiler_options=COMPILER_OPTIONS,
                          static_argnames=("cfg", "head_graphdef", "rows"))
