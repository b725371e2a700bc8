"""Flax NNX decoder for Llama, Qwen2 and Qwen3 (one module, config flags).

- Llama: RMSNorm, SwiGLU, GQA, RoPE variants (incl. llama3 scaling), tied or
  untied embeddings;
- Qwen2: `qkv_bias=True`;
- Qwen3: `qk_norm=True` (RMSNorm over head_dim on q and k before RoPE).

Layer weights are stacked along a leading layer axis and run with `lax.scan`
(one traced layer: compile time independent of depth). The model reads and
writes the paged KV pool (jaxkv.kv.state) and calls `jaxkv.ops` for attention;
keys are written post-RoPE. Weights layout is [in, out] (x @ w).

Shared-A multi-LoRA (LRAgent; `jaxkv.models.lora`) is an optional call
argument: per-row adapter indices select each row's B, and `lora_mode`
chooses whether the V adapter output is folded into the cached value ("full")
or kept as the pool's low-rank value cache and expanded inside
Flash-LoRA-Attention ("decoupled").

Cross jit boundaries with `nnx.split` / `nnx.merge` and pass the state as an
argument (see jaxkv.engine.steps); never close over the weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import ops
from jaxkv.config import ModelConfig
from jaxkv.kv import state as kv_state
from jaxkv.models import lora as lora_lib
from jaxkv.models.layers import apply_rope, gated_mlp, rms_norm, rope_frequencies


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Name -> shape of every parameter (the contract weight loaders fill)."""
  L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  H, K, Dh, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
  shapes = {
      "embed": (V, D),
      "final_norm": (D,),
      "layers.attn_norm": (L, D),
      "layers.wq": (L, D, H * Dh),
      "layers.wk": (L, D, K * Dh),
      "layers.wv": (L, D, K * Dh),
      "layers.wo": (L, H * Dh, D),
      "layers.mlp_norm": (L, D),
      "layers.w_gate": (L, D, F),
      "layers.w_up": (L, D, F),
      "layers.w_down": (L, F, D),
  }
  if cfg.qkv_bias:
    shapes.update({"layers.bq": (L, H * Dh), "layers.bk": (L, K * Dh),
                   "layers.bv": (L, K * Dh)})
  if cfg.qk_norm:
    shapes.update({"layers.q_norm": (L, Dh), "layers.k_norm": (L, Dh)})
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


LORA_MODES = ("full", "decoupled")


def _check_lora(lora, adapter_ids, mode: str, kv) -> bool:
  """Validates the LoRA arguments; returns whether V is decoupled (base + low rank)."""
  if mode not in LORA_MODES:
    raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {mode!r}")
  if lora is None:
    return False
  if adapter_ids is None:
    raise ValueError("lora weights need adapter_ids [B] (-1 selects the base model)")
  if mode == "full":
    return False
  if "v" not in lora.targets:
    raise ValueError("lora_mode='decoupled' needs 'v' among the LoRA targets")
  if kv.vlr is None or kv.vlr.shape[-1] != lora.rank:
    raise ValueError(f"lora_mode='decoupled' needs a pool with vlr of rank {lora.rank} "
                     "(kv_state.init_pool(..., lr_rank=r))")
  return True


class Layers(nnx.Module):
  """All decoder layers' weights, stacked on a leading [L] axis."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    for name, shape in param_shapes(cfg).items():
      if not name.startswith("layers."):
        continue
      name = name.split(".", 1)[1]
      if name.endswith("norm"):
        value = jnp.ones(shape, dtype)
      elif name.startswith("b"):
        value = jnp.zeros(shape, dtype)
      else:
        value = init(rngs.params(), shape, dtype)
      setattr(self, name, nnx.Param(value))

  def stacked(self) -> dict[str, jax.Array]:
    return {name: p[...] for name, p in vars(self).items() if isinstance(p, nnx.Param)}


class Transformer(nnx.Module):
  """Decoder-only LM over the paged KV pool."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    shapes = param_shapes(cfg)
    self.embed = nnx.Param(init(rngs.params(), shapes["embed"], dtype))
    self.layers = Layers(cfg, dtype=dtype, rngs=rngs)
    self.final_norm = nnx.Param(jnp.ones(shapes["final_norm"], dtype))
    self.lm_head = (None if cfg.tie_embeddings else
                    nnx.Param(init(rngs.params(), shapes["lm_head"], dtype)))

  def __call__(self, tokens: jax.Array, positions: jax.Array, slot_map: jax.Array,
               write_slots: jax.Array, kv: kv_state.KVPool, *,
               attn_impl: str = "auto", capture_q: bool = False,
               lora: lora_lib.LoraWeights | None = None, adapter_ids: jax.Array | None = None,
               lora_mode: str = "full", lr_write_slots: jax.Array | None = None,
               layer_range: tuple[int, int] | None = None, hidden_in: jax.Array | None = None,
               capture_hidden: int | None = None):
    """Runs the decoder over one chunk of tokens per row.

    Args:
      tokens: [B, C] int32.
      positions: [B, C] int32 logical positions; negative marks padding.
      slot_map: [B, T] or [L, B, T] int32, already holding this chunk's slots.
      write_slots: [B, C] int32 destination slots (>= num_slots: drop), see
        `kv_state.write_slots`.
      kv: the pool.
      attn_impl: `jaxkv.ops` implementation.
      capture_q: also return every layer's post-RoPE queries exactly as attention
        consumes them (the hook pruning scorers and IntentKV features read).
      lora: shared-A multi-LoRA weights (`jaxkv.models.lora`), or None.
      adapter_ids: [B] int32 adapter of each row (-1: base model); required with lora.
      lora_mode: "full": every target's delta is added to its projection, so the
        pool holds the writing adapter's full K/V (NonShared / FullShared);
        "decoupled" (LRAgent BaseShared / BaseLRShared): the pool's v holds the
        base value x W_v, `kv.vlr` the rank-r value x A_v * scale, and attention
        expands each row's own B_v inside Flash-LoRA-Attention.
      lr_write_slots: [B, C] destination slots of the low-rank values (default
        `write_slots`); BaseShared passes the agent's own slots here while
        `write_slots` drops the base K/V that another agent already wrote.
      layer_range: (l0, l1), static: run only layers l0 <= l < l1 (their KV is
        written, the other layers' pool entries are untouched; DroidSpeak's
        layer-selective recompute). The final norm is applied only if l1 = L.
      hidden_in: [B, C, D] input of layer l0 instead of the token embeddings.
      capture_hidden: static layer index l: also return the hidden state entering
        layer l (DroidSpeak's E-cache), [B, C, D].
    Returns:
      (hidden [B, C, D], updated pool), plus q [L', B, C, Hq, D] (the layers run)
      when `capture_q`, plus the captured hidden state when `capture_hidden`.
    """
    cfg = self.cfg
    b, c = tokens.shape
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    seq_len = jnp.max(positions) + 1 if cfg.rope.kind == "dynamic" else None
    inv_freq, rope_scale = rope_frequencies(cfg.rope, dh, seq_len)
    l0, l1 = (0, cfg.num_layers) if layer_range is None else layer_range
    if not 0 <= l0 < l1 <= cfg.num_layers:
      raise ValueError(f"layer_range {layer_range} outside [0, {cfg.num_layers}]")
    if capture_hidden is not None and not l0 <= capture_hidden < l1:
      raise ValueError(f"capture_hidden={capture_hidden} is not among the layers run {l0}..{l1}")
    x = self.embed[...][tokens] if hidden_in is None else hidden_in
    per_layer_map = slot_map.ndim == 3
    targets = () if lora is None else lora.targets
    decoupled = _check_lora(lora, adapter_ids, lora_mode, kv)
    lr_ws = write_slots if lr_write_slots is None else lr_write_slots

    def layer(carry, xs):
      x, pool_k, pool_v, pool_vlr = carry
      p, idx, lmap, lw = xs
      lmap = lmap if per_layer_map else slot_map
      rows_b = {t: lora_lib.select_b(lw["b"][t], adapter_ids) for t in targets}

      def adapt(t, inp, out):
        if t not in targets or (t == "v" and decoupled):
          return out
        return out + lora_lib.delta(inp, lw["a"][t], rows_b[t], lora.scale).astype(out.dtype)

      with jax.named_scope("attention"):
        y = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, kk, vv = y @ p["wq"], y @ p["wk"], y @ p["wv"]
        if cfg.qkv_bias:
          q, kk, vv = q + p["bq"], kk + p["bk"], vv + p["bv"]
        q, kk, vv = adapt("q", y, q), adapt("k", y, kk), adapt("v", y, vv)
        q = q.reshape(b, c, h, dh)
        kk = kk.reshape(b, c, k, dh)
        vv = vv.reshape(b, c, k, dh)
        if cfg.qk_norm:
          q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
          kk = rms_norm(kk, p["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq, rope_scale)
        kk = apply_rope(kk, positions, inv_freq, rope_scale)
        pool_k, pool_v = kv_state.write_layer(pool_k, pool_v, idx, write_slots, kk, vv)
        if decoupled:
          pool_vlr = kv_state.write_lr(pool_vlr, idx, lr_ws,
                                       lora_lib.down(y, lw["a"]["v"], lora.scale))
          b_v = rows_b["v"].reshape(b, -1, k, dh)                  # [B, r, Hkv, D]
          o = ops.flash_lora_attention(q, pool_k, pool_v, pool_vlr, b_v, lmap, positions,
                                       layer=idx, impl=attn_impl)
        else:
          o = ops.paged_attention(q, pool_k, pool_v, lmap, positions, layer=idx,
                                  impl=attn_impl)
        o = o.reshape(b, c, h * dh)
        x = x + adapt("o", o, o @ p["wo"])
      with jax.named_scope("mlp"):
        y = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        x = x + gated_mlp(y, p["w_gate"], p["w_up"], p["w_down"])
      return (x, pool_k, pool_v, pool_vlr), (q if capture_q else None)

    lw = None if lora is None else {"a": lora.a, "b": lora.b}
    xs = (self.layers.stacked(), jnp.arange(cfg.num_layers),
          slot_map if per_layer_map else None, lw)
    captured, start = None, l0
    if capture_hidden is not None and capture_hidden > l0:     # run up to it, keep x, go on
      head = jax.tree.map(lambda a: a[l0:capture_hidden], xs)
      (x, pk, pv, pvlr), q_head = jax.lax.scan(layer, (x, kv.k, kv.v, kv.vlr), head)
      kv = dataclasses.replace(kv, k=pk, v=pv, vlr=pvlr)
      l0 = capture_hidden
    if capture_hidden is not None:
      captured = x
    if (l0, l1) != (0, cfg.num_layers):
      xs = jax.tree.map(lambda a: a[l0:l1], xs)
    (x, pool_k, pool_v, pool_vlr), q_all = jax.lax.scan(layer, (x, kv.k, kv.v, kv.vlr), xs)
    if capture_q and start < l0:
      q_all = jnp.concatenate([q_head, q_all])
    if l1 == cfg.num_layers:
      x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    new_positions = kv_state.write_positions(kv.positions, write_slots, positions)
    pool = kv_state.KVPool(k=pool_k, v=pool_v, positions=new_positions, vlr=pool_vlr)
    out = (x, pool) + ((q_all,) if capture_q else ())
    return out + ((captured,) if capture_hidden is not None else ())

  def logits(self, hidden: jax.Array) -> jax.Array:
    """[..., D] -> [..., V] float32."""
    w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return jnp.dot(hidden, w, preferred_element_type=jnp.float32)

  @classmethod
  def from_params(cls, cfg: ModelConfig, params: dict[str, "np.ndarray"], *,  # noqa: F821
                  dtype=jnp.float32) -> "Transformer":
    """A module holding `params`, built without running the random initializers.

    The module is traced abstractly (`nnx.eval_shape`) and every parameter then
    set from `params`, so loading real weights does no throwaway init work.
    """
    net = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    net.load_params(params)
    return net

  def load_params(self, params: dict[str, "np.ndarray"]) -> None:  # noqa: F821
    """Fills every parameter from a flat {name: array} dict (see `param_shapes`).

    Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    expected = param_shapes(self.cfg)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
      raise ValueError(f"weights do not match the model config: missing {missing}, "
                       f"unexpected {extra}")
    for name, shape in expected.items():
      value = params[name]
      if tuple(value.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, "
                         f"config expects {shape}")
      holder = self
      *path, leaf = name.split(".")
      for part in path:
        holder = getattr(holder, part)
      param = getattr(holder, leaf)
      # set_value (not param[...] = ...) also fills an abstract module from nnx.eval_shape
      param.set_value(jnp.asarray(value, dtype=param.get_value().dtype))
