"""IntentKV Phase-2: the residual learnable pruner (section 3.3, app. B/H), inference side.

The Phase-2 score adds a learned residual to the Phase-1 rule score (eq. 4):

    s_j = rule_j + clip(alpha, -5, 5) * MLP(phi_j || c_j),

with per-token features (eq. 5)

    phi_j = [k_bar_j || m_bar || k_bar_j * m_bar || rule_j]      (3D + 1 columns),

where k_bar_j is the mean of the post-RoPE key K[l, h, j] over layers and
GQA-expanded query heads and m_bar the mean of the session memory M_t over
layers and query heads, and a multi-head cross-attention readout (eq. 6)

    c_j = CrossAttn(W_Q phi_j, W_K K_bar^q, W_V K_bar^q)          (d_c columns)

over K_bar^q, the per-position key means at the live positions of the
actionable query span. `ResidualHead` holds the weights; `learnable_scores`
composes Phase-1 `rule_scores`, the features and the head as a pure function
of the head's (graphdef, state), so the weights are jit arguments.

Topology (section 3.3): H_c = 4 heads of width d_c / H_c = 32, d_c = 128; W_Q:
3D+1 -> d_c, W_K, W_V: D -> d_c, all with bias, no output projection; MLP
3D+1+d_c -> 256 -> GELU -> 1 with the output layer fc2 zero-initialised in
weight and bias; alpha a learned scalar initialised to 1. Under (alpha = 1,
fc2 = 0) the scores equal the rule scores exactly, and gradients still reach
fc2. Parameter counts (`num_params`):

    D = 128 (Qwen3-8B, Qwen2.5-14B): 214,274 (the paper's count);
    D = 64  (SmolLM2):               124,162
      = W_Q 193*128+128 + W_K 64*128+128 + W_V 64*128+128
        + fc1 321*256+256 + fc2 256+1 + alpha 1.

Ablation knobs (appendix B; inference-time only, same checkpoint):

  -memory:   the caller passes unit_norm(Enc(q_t)) (IntentKV `query` mode) as
             `memory` instead of M_t; it then feeds the rule score and m_bar
             alike. Nothing in this module changes.
  -x-attn:   `ablate_xattn=True` forces c_j = 0 (fc1 still sees d_c zero
             columns, so the same checkpoint loads).
  -residual: alpha = 0 (set the `alpha` parameter to 0); the scores are then
             the rule scores exactly, so the ranking is Phase-1's.

Decisions where the paper is silent or ambiguous:

  * GQA expansion. Expanding Hkv to Hq repeats each KV head G = Hq / Hkv
    times, so the mean over the Hq expanded heads equals the mean over the
    Hkv KV heads exactly (uniform weights); k_bar and K_bar^q are computed
    as the latter, without materialising the expanded tensor.
  * K_bar^q aggregates over layers and KV heads the same way as k_bar (one
    D-vector per live query-span position); it is padded to a static n_q
    rows with a validity mask. When the span has more than n_q live
    positions the LAST n_q (closest to the decision point) are kept, in
    position order; the default n_q = T never truncates.
  * The cross-attention is standard scaled dot-product attention per head,
    logits / sqrt(d_c / H_c); invalid rows get exactly zero weight, and a
    row with no valid query-span key reads c_j = 0 (no NaN).
  * GELU is the exact (erf) form, as torch.nn.GELU's default.
  * Positions outside the candidate set H get phi_j = 0 and a final score of
    0 (as `rule_scores`); only candidates are ranked by `keep_mask`, so this
    changes nothing for selection and keeps dead / sentinel rows inert.
  * Non-zero initialisers (lecun-normal kernels, zero biases) are Flax's
    defaults; the paper does not state them.
  * alpha is clipped to [-5, 5] only when `clip_alpha=True` (inference, the
    default); training calls with `clip_alpha=False`.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
from absl import logging as absl_logging
from flax import nnx

from jaxkv.policies.pruning.intentkv import rule_scores

NUM_HEADS = 4        # H_c
WIDTH = 128          # d_c
HIDDEN = 256         # h, the MLP body
ALPHA_CLIP = 5.0     # alpha in [-5, 5] at inference


def mean_keys(k: jax.Array) -> jax.Array:
  """Per-position mean of post-RoPE keys over layers and GQA-expanded heads.

  k [L, B, T, Hkv, D] -> [B, T, D] float32. The mean over the Hq = G * Hkv
  expanded query heads equals the mean over the Hkv KV heads (each KV head
  is repeated G times), which is what is computed.
  """
  return jnp.mean(k.astype(jnp.float32), axis=(0, 3))


def phi(kbar: jax.Array, mbar: jax.Array, rule: jax.Array, candidates: jax.Array) -> jax.Array:
  """Eq. 5 from its parts, the one copy serving and training share:
  phi_j = [k_bar_j || m_bar || k_bar_j * m_bar || rule_j].

  kbar [B, T, D], mbar [B, D], rule [B, T], candidates [B, T] bool -> phi
  [B, T, 3D + 1] float32, zero outside the candidates.
  """
  kbar = kbar.astype(jnp.float32)
  m = jnp.broadcast_to(mbar.astype(jnp.float32)[:, None, :], kbar.shape)
  out = jnp.concatenate([kbar, m, kbar * m, rule.astype(jnp.float32)[..., None]], axis=-1)
  return jnp.where(candidates[..., None], out, 0.)


def token_features(k: jax.Array, memory: jax.Array, rule: jax.Array,
                   candidates: jax.Array) -> jax.Array:
  """Eq. 5 from keys and memory: `phi(mean_keys(k), mean of M_t, rule, candidates)`.

  Args:
    k: [L, B, T, Hkv, D] post-RoPE keys at the slot map.
    memory: [L, B, Hq, D] the session memory M_t (or unit_norm(Enc(q_t)) for
      the -memory ablation), Hq a multiple of Hkv.
    rule: [B, T] Phase-1 rule scores (eq. 3).
    candidates: [B, T] bool, the candidate set H; rows outside it are zero.
  Returns:
    phi [B, T, 3D + 1] float32.
  """
  _check_memory(k, memory)
  return phi(mean_keys(k), mean_memory(memory), rule, candidates)


def mean_memory(memory: jax.Array) -> jax.Array:
  """m_bar: the mean of M_t over layers and query heads, [L, B, Hq, D] -> [B, D]."""
  return jnp.mean(memory.astype(jnp.float32), axis=(0, 2))


def _check_memory(k, memory):
  num_layers, b, _, hkv, d = k.shape
  if memory.shape[0] != num_layers or memory.shape[1] != b or memory.shape[3] != d:
    raise ValueError(f"memory {memory.shape} does not match keys {k.shape}")
  if memory.shape[2] % hkv:
    raise ValueError(f"query heads {memory.shape[2]} not a multiple of KV heads {hkv}")


def query_key_summary(k: jax.Array, span_mask: jax.Array, n_q: int | None = None,
                      live: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """K_bar^q of eq. 6: per-position key means at the live query-span positions.

  Args:
    k: [L, B, T, Hkv, D] post-RoPE keys at the slot map.
    span_mask: [B, T] bool, the LIVE positions of the actionable query span
      (positions evicted in an earlier round must be False; pass `live` to
      have it intersected here).
    n_q: static number of rows (default T). If a row has more than n_q span
      positions, the last n_q are kept.
    live: optional [B, T] bool live mask, ANDed into span_mask.
  Returns:
    (kq [B, n_q, D] float32, zeros in invalid rows; valid [B, n_q] bool). Valid
    rows come first, in increasing position order.
  """
  t = k.shape[2]
  n_q = t if n_q is None else int(n_q)
  if n_q < 1:
    raise ValueError(f"n_q must be >= 1, got {n_q}")
  mask = span_mask if live is None else span_mask & live
  pos = jnp.arange(t, dtype=jnp.int32)
  order = jnp.sort(jnp.where(mask, pos[None, :], t), axis=1)       # span positions first
  count = jnp.sum(mask, axis=1).astype(jnp.int32)                   # [B]
  idx = jnp.maximum(count - n_q, 0)[:, None] + jnp.arange(n_q, dtype=jnp.int32)[None, :]
  valid = idx < count[:, None]
  src = jnp.take_along_axis(order, jnp.minimum(idx, t - 1), axis=1)
  src = jnp.where(valid, src, 0)
  kq = jnp.take_along_axis(mean_keys(k), src[..., None], axis=1)
  return jnp.where(valid[..., None], kq, 0.), valid


def masked_cross_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           valid: jax.Array) -> jax.Array:
  """Multi-head attention of T queries over n_q keys with a key validity mask.

  q [B, T, H, dh], k and v [B, n_q, H, dh], valid [B, n_q] bool ->
  [B, T, H, dh]. Invalid keys get exactly zero weight; a row with no valid
  key returns zeros (no NaN, and finite gradients).
  """
  logits = jnp.einsum("bthd,bnhd->bhtn", q, k) * q.shape[-1] ** -0.5
  mask = valid[:, None, None, :]
  mx = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  mx = jax.lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.))
  p = jnp.where(mask, jnp.exp(jnp.where(mask, logits - mx, 0.)), 0.)
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.)
  return jnp.einsum("bhtn,bnhd->bthd", p, v)


class ResidualHead(nnx.Module):
  """The residual head of eq. 4/6 (weights in float32).

  Args:
    head_dim: D, the backbone's attention head dimension.
    rngs: initialisation randomness.
    num_heads, width, hidden: H_c, d_c and h (paper: 4, 128, 256).
  """

  def __init__(self, head_dim: int, *, rngs: nnx.Rngs, num_heads: int = NUM_HEADS,
               width: int = WIDTH, hidden: int = HIDDEN):
    if width % num_heads:
      raise ValueError(f"width {width} not divisible by num_heads {num_heads}")
    self.head_dim = head_dim
    self.num_heads = num_heads
    self.width = width
    feat = 3 * head_dim + 1
    self.w_q = nnx.Linear(feat, width, rngs=rngs)
    self.w_k = nnx.Linear(head_dim, width, rngs=rngs)
    self.w_v = nnx.Linear(head_dim, width, rngs=rngs)
    self.fc1 = nnx.Linear(feat + width, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, 1, kernel_init=nnx.initializers.zeros,
                          bias_init=nnx.initializers.zeros, rngs=rngs)
    self.alpha = nnx.Param(jnp.ones((), jnp.float32))

  def cross_attention(self, phi: jax.Array, kq: jax.Array, kq_valid: jax.Array) -> jax.Array:
    """Eq. 6: c [B, T, d_c] from phi [B, T, 3D+1] over kq [B, n_q, D] (no output proj.)."""
    b, t, _ = phi.shape
    n = kq.shape[1]
    h, dh = self.num_heads, self.width // self.num_heads
    q = self.w_q(phi).reshape(b, t, h, dh)
    k = self.w_k(kq).reshape(b, n, h, dh)
    v = self.w_v(kq).reshape(b, n, h, dh)
    return masked_cross_attention(q, k, v, kq_valid).reshape(b, t, self.width)

  def residual(self, phi: jax.Array, kq: jax.Array, kq_valid: jax.Array, *,
               ablate_xattn: bool = False) -> jax.Array:
    """MLP(phi_j || c_j) -> [B, T] (before alpha)."""
    phi = phi.astype(jnp.float32)
    if ablate_xattn:
      c = jnp.zeros(phi.shape[:-1] + (self.width,), jnp.float32)
    else:
      c = self.cross_attention(phi, kq.astype(jnp.float32), kq_valid)
    hidden = jax.nn.gelu(self.fc1(jnp.concatenate([phi, c], axis=-1)), approximate=False)
    return self.fc2(hidden)[..., 0]

  def scale(self, clip_alpha: bool = True) -> jax.Array:
    """alpha, clipped to [-5, 5] when `clip_alpha` (inference)."""
    alpha = self.alpha[...]
    return jnp.clip(alpha, -ALPHA_CLIP, ALPHA_CLIP) if clip_alpha else alpha

  def __call__(self, phi: jax.Array, kq: jax.Array, kq_valid: jax.Array, rule: jax.Array, *,
               ablate_xattn: bool = False, clip_alpha: bool = True) -> jax.Array:
    """Eq. 4: s [B, T] = rule + clip(alpha) * MLP(phi || c).

    Args:
      phi: [B, T, 3D+1] features (`token_features`).
      kq, kq_valid: [B, n_q, D] and [B, n_q] (`query_key_summary`).
      rule: [B, T] Phase-1 rule scores.
      ablate_xattn: the -x-attn ablation (c_j = 0).
      clip_alpha: clip alpha to [-5, 5] (inference); False while training.
    """
    r = self.residual(phi, kq, kq_valid, ablate_xattn=ablate_xattn)
    return rule.astype(jnp.float32) + self.scale(clip_alpha) * r


def num_params(head: ResidualHead) -> int:
  """Trainable parameter count (214,274 at D = 128; 124,162 at D = 64)."""
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(nnx.state(head, nnx.Param)))


class Phase2Inputs(NamedTuple):
  """What the residual head reads for one pruning event (a pytree).

  The Phase-2 extractor (`jaxkv.training.features`) stores exactly these per row
  and serving computes them in the pruning event, both through `phase2_inputs`.
  """
  rule: jax.Array       # [B, T] eq. 3 over the candidates (0 elsewhere)
  kbar: jax.Array       # [B, T, D] per-position key means
  mbar: jax.Array       # [B, D] mean of the memory the scorer used
  kq: jax.Array         # [B, n_q, D] K_bar^q (valid rows first)
  kq_valid: jax.Array   # [B, n_q] bool


def phase2_inputs(k: jax.Array, memory: jax.Array, candidates: jax.Array,
                  span_mask: jax.Array, *, n_q: int | None = None,
                  live: jax.Array | None = None) -> Phase2Inputs:
  """The head's inputs from the keys at the slot map and the scoring memory.

  k [L, B, T, Hkv, D]; memory [L, B, Hq, D] (M_t, or unit_norm(Enc(q_t)) for the
  -memory ablation); candidates, span_mask [B, T] bool; n_q, live: see
  `query_key_summary`.
  """
  _check_memory(k, memory)
  kq, kq_valid = query_key_summary(k, span_mask, n_q, live)
  return Phase2Inputs(rule=rule_scores(memory, k, candidates), kbar=mean_keys(k),
                      mbar=mean_memory(memory), kq=kq, kq_valid=kq_valid)


def phase2_scores(head, inputs: Phase2Inputs, candidates: jax.Array, *,
                  ablate_xattn: bool = False, clip_alpha: bool = True) -> jax.Array:
  """Eq. 4 from `Phase2Inputs` (serving) or the same arrays from stored rows
  (training): [B, T] float32, 0 outside the candidates."""
  module = head if isinstance(head, nnx.Module) else nnx.merge(*head)
  features = phi(inputs.kbar, inputs.mbar, inputs.rule, candidates)
  s = module(features, inputs.kq, inputs.kq_valid, inputs.rule, ablate_xattn=ablate_xattn,
             clip_alpha=clip_alpha)
  return jnp.where(candidates, s, 0.)


def learnable_scores(head, k: jax.Array, memory: jax.Array, candidates: jax.Array,
                     span_mask: jax.Array, *, live: jax.Array | None = None,
                     n_q: int | None = None, ablate_xattn: bool = False,
                     clip_alpha: bool = True) -> jax.Array:
  """Phase-2 scores: rule (eq. 3) + residual (eq. 4) over the candidate set,
  `phase2_scores(head, phase2_inputs(...))`.

  Pure and jit-compatible: pass the head in split form, `nnx.split(head)`, so
  its weights are traced arguments (mark n_q, ablate_xattn, clip_alpha
  static). An `nnx.Module` is also accepted for eager use.

  Args:
    head: (graphdef, state) of a `ResidualHead`, or the module itself.
    k: [L, B, T, Hkv, D] post-RoPE keys at the slot map.
    memory: [L, B, Hq, D] session memory M_t (the caller passes the unit-normed
      Enc(q_t) for the -memory ablation).
    candidates: [B, T] bool, the candidate set H = live minus forced.
    span_mask: [B, T] bool, the actionable query span (live positions only, or
      pass `live`).
    live: optional [B, T] bool live mask, intersected with span_mask.
    n_q: static row count of K_bar^q (default T).
    ablate_xattn, clip_alpha: see `ResidualHead.__call__`.
  Returns:
    [B, T] float32 scores, 0 outside the candidate set.
  """
  inputs = phase2_inputs(k, memory, candidates, span_mask, n_q=n_q, live=live)
  return phase2_scores(head, inputs, candidates, ablate_xattn=ablate_xattn,
                       clip_alpha=clip_alpha)


# ----------------------------------------------------------------------------- files
# The head's file format lives with the head, so serving loads it without importing
# the trainer (jaxkv.training writes it; jaxkv.artifacts and the runners read it).
@contextlib.contextmanager
def _orbax_quiet():
  """Orbax logs about 14 INFO lines per save or restore: run it at WARNING, then give
  the caller's absl verbosity back."""
  level = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.WARNING)
  try:
    yield
  finally:
    absl_logging.set_verbosity(level)


def save_head(path, head_dim: int, params) -> pathlib.Path:
  """Final head: path/head.json (topology) + path/state (Orbax, pure dict of params)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path).resolve()
  path.mkdir(parents=True, exist_ok=True)
  (path / "head.json").write_text(json.dumps({"head_dim": int(head_dim)}))
  with _orbax_quiet(), ocp.StandardCheckpointer() as ck:
    ck.save(path / "state", params, force=True)
  return path


def load_head(path):
  """(graphdef, state) of a head saved by `save_head` (for `learnable_scores`)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path).resolve()
  meta = json.loads((path / "head.json").read_text())
  graphdef, state = nnx.split(ResidualHead(meta["head_dim"], rngs=nnx.Rngs(0)))
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(state))
  with _orbax_quiet(), ocp.StandardCheckpointer() as ck:
    pure = ck.restore(path / "state", target)
  nnx.replace_by_pure_dict(state, pure)
  return graphdef, state
