"""Flax NNX decoder for Llama, Qwen2 and Qwen3 (one module, config flags).

- Llama: RMSNorm, SwiGLU, GQA, RoPE variants (incl. llama3 scaling), tied or
  untied embeddings;
- Qwen2: `qkv_bias=True`;
- Qwen3: `qk_norm=True` (RMSNorm over head_dim on q and k before RoPE).

Layer weights have two layouts (`Transformer(..., scan_layers=...)`):
- stacked along a leading layer axis and run with `lax.scan` (one traced layer:
  compile time independent of depth; training and compile-sensitive paths);
- one set of arrays per layer, run by an unrolled Python loop (MaxText's
  `scan_layers=False`): each layer's weights are their own jit arguments, so no
  per-layer dynamic-slice copies them out of the stack (on XLA:CPU those copies
  took 44% of a decode step), at the price of a compile that grows with depth.
`Transformer.relayout` converts between them; both compute the same function.

Projection matrices (q, k, v, o, gate, up, down) are stored either [in, out] (`x @ w`,
the stacked layout's default) or [out, in], torch's `nn.Linear` layout, under the
name + "_t" (`out_in=True`, the unrolled layout's default): on XLA:CPU a decode
step's M = 8-row GEMMs contract a weight's contiguous rows faster (SmolLM2's 30 layers
alone 31.4 vs 36.5 ms, a batch-1 48-token prefill 1.14x, a batch-8 decode step 1.02x;
`bench/layouts.py`, 2026-11-29), and on a GPU either layout is one transposed-operand
GEMM. `param_shapes` (the loaders' contract) stays [in, out] in both.
The model reads and writes the paged KV pool (jaxkv.kv.state) and calls `jaxkv.ops` for attention;
keys are written post-RoPE.

Everything besides tokens, positions and the pool travels as the small pytrees
of `jaxkv.models.forward` (LoRA inputs, a layer window, captures, selective
recompute), and the call returns a `ForwardOutput`. Without a pool the model
runs over the chunk alone (training).

Shared-A multi-LoRA (LRAgent; `jaxkv.models.lora`): per-row adapter indices
select each row's B, and `LoraInputs.mode` chooses whether the V adapter output
is folded into the cached value ("full") or kept as the pool's low-rank value
cache and expanded inside Flash-LoRA-Attention ("decoupled").

Cross jit boundaries with `nnx.split` / `nnx.merge` and pass the state as an
argument (see jaxkv.engine.driver); never close over the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import ops
from jaxkv.config import ModelConfig
from jaxkv.kv import state as kv_state
from jaxkv.models import forward as fwd
from jaxkv.models import lora as lora_lib
from jaxkv.rope import apply_rope, delta_frequencies, rope_frequencies


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in fp32, cast back (HF LlamaRMSNorm). x: [..., D], weight: [D]."""
  dtype = x.dtype
  x32 = x.astype(jnp.float32)
  var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  x32 = x32 * jax.lax.rsqrt(var + eps)
  return weight.astype(dtype) * x32.astype(dtype)


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


PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def proj(x: jax.Array, p: dict[str, jax.Array], name: str) -> jax.Array:
  """x [..., in] times projection `name` of layer weights `p`, in either storage:
  `name` as [in, out] or `name + "_t"` as [out, in] (module docstring)."""
  if name in p:
    return x @ p[name]
  return jnp.einsum("...i,oi->...o", x, p[name + "_t"])


def stored_name(name: str, out_in: bool) -> str:
  """The attribute a per-layer parameter is stored under."""
  return name + "_t" if out_in and name in PROJECTIONS else name


def _check_lora(lora: fwd.LoraInputs | None, kv: kv_state.KVPool) -> bool:
  """Validates the LoRA inputs against the pool; returns whether V is decoupled."""
  if lora is None or lora.mode == "full":
    return False
  if "v" not in lora.weights.targets:
    raise ValueError("lora mode 'decoupled' needs 'v' among the LoRA targets")
  if kv.vlr is None or kv.vlr.shape[-1] != lora.weights.rank:
    raise ValueError(f"lora mode 'decoupled' needs a pool with vlr of rank {lora.weights.rank} "
                     "(kv_state.init_pool(..., lr_rank=r))")
  return True


def _init_param(name: str, shape: tuple[int, ...], dtype, rngs: nnx.Rngs) -> nnx.Param:
  if name.endswith("norm"):
    return nnx.Param(jnp.ones(shape, dtype))
  if name.startswith("b"):
    return nnx.Param(jnp.zeros(shape, dtype))
  return nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape, dtype))


def _layer_shapes(cfg: ModelConfig, out_in: bool = False) -> dict[str, tuple[int, ...]]:
  """Per-layer stored name -> stacked shape [L, ...] (the "layers." entries;
  `out_in`: projections as [L, out, in] under name + "_t")."""
  out = {}
  for name, shape in param_shapes(cfg).items():
    if name.startswith("layers."):
      name = name.split(".", 1)[1]
      if out_in and name in PROJECTIONS:
        shape = shape[:-2] + shape[:-3:-1]
      out[stored_name(name, out_in)] = shape
  return out


def _to_stored(value: jax.Array, name: str, out_in: bool) -> jax.Array:
  """An [.., in, out] projection as stored (swapped when `out_in`); others as given."""
  return jnp.swapaxes(value, -1, -2) if out_in and name in PROJECTIONS else value


def _from_stored(values: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Stored {name: value} -> the `param_shapes` names and [.., in, out] layout."""
  out = {}
  for k, v in values.items():
    if k.endswith("_t") and k[:-2] in PROJECTIONS:
      k, v = k[:-2], jnp.swapaxes(v, -1, -2)
    out[k] = v
  return out


def _param_values(module: nnx.Module) -> dict[str, jax.Array]:
  """{attribute name: value} of a module's own `nnx.Param`s."""
  return {name: p[...] for name, p in vars(module).items() if isinstance(p, nnx.Param)}


class Layer(nnx.Module):
  """One decoder layer's weights (the unrolled layout)."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, out_in: bool = False):
    for name, shape in _layer_shapes(cfg, out_in).items():
      setattr(self, name, _init_param(name, shape[1:], dtype, rngs))

  def weights(self) -> dict[str, jax.Array]:
    return _param_values(self)


class Layers(nnx.Module):
  """All decoder layers' weights: stacked on a leading [L] axis (`stacked=True`,
  run with `lax.scan`) or one `Layer` per layer (unrolled); projections stored
  [in, out] or, `out_in`, [out, in] (module docstring)."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, stacked: bool = True,
               out_in: bool = False):
    self.is_stacked, self.out_in = stacked, out_in
    if stacked:
      for name, shape in _layer_shapes(cfg, out_in).items():
        setattr(self, name, _init_param(name, shape, dtype, rngs))
    else:
      self.each = nnx.List([Layer(cfg, dtype=dtype, rngs=rngs, out_in=out_in)
                            for _ in range(cfg.num_layers)])

  def stacked(self) -> dict[str, jax.Array]:
    """{stored name: [L, ...]} (stacked layout only: the unrolled one would copy)."""
    if not self.is_stacked:
      raise ValueError("these layers are unrolled; use layer(i) or Transformer.relayout")
    return _param_values(self)

  def layer(self, i: int) -> dict[str, jax.Array]:
    """Layer i's weights by stored name (unrolled layout; `proj` reads either)."""
    return self.each[i].weights()

  def assign(self, name: str, value: jax.Array) -> None:
    """Sets one parameter from its `param_shapes` name and [L, ...] value (projections
    [L, in, out]) in either layout."""
    value, name = _to_stored(value, name, self.out_in), stored_name(name, self.out_in)
    if self.is_stacked:
      getattr(self, name).set_value(value)
    else:
      for i, layer in enumerate(self.each):
        getattr(layer, name).set_value(value[i])

  def export(self) -> dict[str, jax.Array]:
    """{`param_shapes` name: [L, ...]} (projections [L, in, out]) in either layout
    (unrolled or `out_in`: into copies)."""
    if self.is_stacked:
      return _from_stored(self.stacked())
    per = [layer.weights() for layer in self.each]
    return _from_stored({name: jnp.stack([w[name] for w in per]) for name in per[0]})


class Transformer(nnx.Module):
  """Decoder-only LM over the paged KV pool."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
               scan_layers: bool = True, out_in: bool | None = None):
    """`out_in`: projections stored [out, in] (None: in the unrolled layout only)."""
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    shapes = param_shapes(cfg)
    self.embed = nnx.Param(init(rngs.params(), shapes["embed"], dtype))
    out_in = not scan_layers if out_in is None else out_in
    self.layers = Layers(cfg, dtype=dtype, rngs=rngs, stacked=scan_layers, out_in=out_in)
    self.final_norm = nnx.Param(jnp.ones(shapes["final_norm"], dtype))
    self.lm_head = (None if cfg.tie_embeddings else
                    nnx.Param(init(rngs.params(), shapes["lm_head"], dtype)))

  def __call__(self, tokens: jax.Array, positions: jax.Array,
               kv: kv_state.KVPool | None = None, *, slot_map: jax.Array | None = None,
               write_slots: jax.Array | None = None, lora: fwd.LoraInputs | None = None,
               window: fwd.LayerWindow | None = None, capture: fwd.Capture = fwd.Capture(),
               recompute: fwd.Recompute | None = None, key_shift: jax.Array | None = None,
               attn_impl: str = "auto") -> fwd.ForwardOutput:
    """Runs the decoder over one chunk of tokens per row.

    Args:
      tokens: [B, C] int32.
      positions: [B, C] int32 logical positions; negative marks padding.
      kv: the pool, or None to run without a cache (training): the chunk then
        attends to itself only, positions must lie in [0, C), and the output
        carries no pool.
      slot_map: [B, T] or [L, B, T] int32, already holding this chunk's slots
        (required with a pool).
      write_slots: [B, C] int32 destination slots (>= num_slots: dropped). Default:
        `kv_state.write_slots(slot_map, positions, ...)`; required with a
        per-layer slot map, whose layers may disagree.
      lora: shared-A multi-LoRA inputs (`forward.LoraInputs`), or None.
      window: run only a window of layers (`forward.LayerWindow`), or None.
      capture: what to hand back (`forward.Capture`).
      recompute: selective recompute (`forward.Recompute`), or None (every token
        at every layer).
      key_shift: [B, T] int32 rotation applied to each slot-map entry's key on
        read (`ops.paged_attention`): slots aliased at positions other than the
        ones they were written at (MemArt); None: keys read as stored.
      attn_impl: `jaxkv.ops` implementation.
    Returns:
      `forward.ForwardOutput`.
    """
    cfg = self.cfg
    b, c = tokens.shape
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    window = window or fwd.LayerWindow()
    l0 = window.start
    l1 = cfg.num_layers if window.stop is None else window.stop
    if not 0 <= l0 < l1 <= cfg.num_layers:
      raise ValueError(f"layer window ({l0}, {l1}) outside [0, {cfg.num_layers}]")
    cap_at = capture.hidden_at
    if cap_at is not None and not l0 <= cap_at < l1:
      raise ValueError(f"capture hidden_at={cap_at} is not among the layers run {l0}..{l1}")
    if any(not l0 <= c <= l1 for c in capture.hidden_cuts):
      raise ValueError(f"capture hidden_cuts={capture.hidden_cuts} outside the window "
                       f"{l0}..{l1}")
    if recompute is not None and recompute.index.shape[:2] != (cfg.num_layers, b):
      raise ValueError(f"recompute index must be [L={cfg.num_layers}, B={b}, R], got "
                       f"{recompute.index.shape}")
    cached = kv is not None
    if not cached:                       # a scratch pool: the chunk attends to itself
      lr_rank = lora.weights.rank if lora is not None and lora.mode == "decoupled" else 0
      kv = kv_state.init_slots(cfg, 1 + b * c, self.embed[...].dtype, lr_rank)
      slot_map = (1 + jnp.arange(b * c, dtype=jnp.int32)).reshape(b, c)
    elif slot_map is None:
      raise ValueError("a forward pass over a pool needs its slot_map")
    per_layer_map = slot_map.ndim == 3
    if write_slots is None:
      if per_layer_map:
        raise ValueError("a per-layer slot map needs explicit write_slots [B, C]")
      write_slots = kv_state.write_slots(slot_map, positions, positions >= 0, kv.num_slots)
    seq_len = jnp.max(positions) + 1 if cfg.rope.kind == "dynamic" else None
    inv_freq, rope_scale = rope_frequencies(cfg.rope, dh, seq_len)
    x = self.embed[...][tokens] if window.hidden_in is None else window.hidden_in
    decoupled = _check_lora(lora, kv)
    shift_freq = None
    if key_shift is not None:
      shift_freq = delta_frequencies(cfg.rope, dh)      # refuses dynamic NTK
    targets = () if lora is None else lora.weights.targets
    # The kernels' compaction and live-block tables depend on the slot map and
    # positions only: built once here when every layer reads the same ones.
    plan = None
    if not per_layer_map and recompute is None:
      plan = ops.attention_plan(slot_map, positions, num_heads=h, num_kv_heads=k,
                                impl=attn_impl, lora=decoupled, num_slots=kv.num_slots,
                                key_shift=key_shift)
    lr_ws = write_slots if lora is None or lora.lr_write_slots is None else lora.lr_write_slots

    def layer(carry, xs):
      x, pool_k, pool_v, pool_vlr = carry
      p, idx, lmap, lw, sel = xs
      lmap = lmap if per_layer_map else slot_map
      if sel is None:                    # every token of the chunk
        xin, pos, ws, lws = x, positions, write_slots, lr_ws
      else:                              # only the tokens listed for this layer
        ok = sel >= 0
        at = jnp.clip(sel, 0, c - 1)
        xin = jnp.take_along_axis(x, at[..., None], axis=1)
        pos = jnp.where(ok, jnp.take_along_axis(positions, at, axis=1), -1)
        ws = jnp.where(ok, jnp.take_along_axis(write_slots, at, axis=1), kv.num_slots)
        lws = jnp.where(ok, jnp.take_along_axis(lr_ws, at, axis=1), kv.num_slots)
      n = xin.shape[1]
      rows_b = {t: lora_lib.select_b(lw["b"][t], lora.adapter_ids) for t in targets}

      def adapt(t, inp, out):
        if t not in targets or (t == "v" and decoupled):
          return out
        return out + lora_lib.delta(inp, lw["a"][t], rows_b[t],
                                    lora.weights.scale).astype(out.dtype)

      with jax.named_scope("attention"):
        y = rms_norm(xin, p["attn_norm"], cfg.rms_norm_eps)
        q, kk, vv = proj(y, p, "wq"), proj(y, p, "wk"), proj(y, p, "wv")
        if cfg.qkv_bias:
          q, kk, vv = q + p["bq"], kk + p["bk"], vv + p["bv"]
        q, kk, vv = adapt("q", y, q), adapt("k", y, kk), adapt("v", y, vv)
        q = q.reshape(b, n, h, dh)
        kk = kk.reshape(b, n, k, dh)
        vv = vv.reshape(b, n, k, dh)
        if cfg.qk_norm:
          q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
          kk = rms_norm(kk, p["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, pos, inv_freq, rope_scale)
        kk = apply_rope(kk, pos, inv_freq, rope_scale)
        pool_k, pool_v = kv_state.write_layer(pool_k, pool_v, idx, ws, kk, vv)
        if decoupled:
          pool_vlr = kv_state.write_lr(pool_vlr, idx, lws,
                                       lora_lib.down(y, lw["a"]["v"], lora.weights.scale))
          b_v = rows_b["v"].reshape(b, -1, k, dh)                  # [B, r, Hkv, D]
          o = ops.flash_lora_attention(q, pool_k, pool_v, pool_vlr, b_v, lmap, pos,
                                       layer=idx, impl=attn_impl, plan=plan,
                                       key_shift=key_shift, shift_freq=shift_freq)
        else:
          o = ops.paged_attention(q, pool_k, pool_v, lmap, pos, layer=idx, impl=attn_impl,
                                  key_shift=key_shift, shift_freq=shift_freq, plan=plan)
        o = o.reshape(b, n, h * dh)
        xin = xin + adapt("o", o, proj(o, p, "wo"))
      with jax.named_scope("mlp"):                 # SwiGLU
        y = rms_norm(xin, p["mlp_norm"], cfg.rms_norm_eps)
        xin = xin + proj(jax.nn.silu(proj(y, p, "w_gate")) * proj(y, p, "w_up"), p,
                         "w_down")
      if sel is None:
        x = xin
      else:                              # scatter back; padding entries are dropped
        rows = jnp.arange(b)[:, None]
        x = x.at[rows, jnp.where(ok, sel, c)].set(xin, mode="drop")
      return (x, pool_k, pool_v, pool_vlr), (q if capture.q else None)

    lw = None if lora is None else {"a": lora.weights.a, "b": lora.weights.b}
    per_layer = (slot_map if per_layer_map else None, lw,
                 None if recompute is None else recompute.index)

    def run(carry, lo, hi):
      """Layers lo..hi-1: one `lax.scan` (stacked) or an unrolled loop."""
      if self.layers.is_stacked:
        xs = (self.layers.stacked(), jnp.arange(cfg.num_layers)) + per_layer
        if (lo, hi) != (0, cfg.num_layers):
          xs = jax.tree.map(lambda a: a[lo:hi], xs)
        return jax.lax.scan(layer, carry, xs)
      ys = []
      for i in range(lo, hi):
        xs_i = (self.layers.layer(i), i) + jax.tree.map(lambda a: a[i], per_layer)
        carry, y = layer(carry, xs_i)
        ys.append(y)
      return carry, (jnp.stack(ys) if ys and ys[0] is not None else None)

    carry = (x, kv.k, kv.v, kv.vlr)
    hidden_at, cuts, q_parts = None, {}, []
    stops = sorted(set(capture.hidden_cuts) | ({cap_at} if cap_at is not None else set()))
    for s in stops + [l1]:                       # run to each capture, keep x, go on
      if s > l0:
        carry, q_s = run(carry, l0, s)
        q_parts.append(q_s)
        l0 = s
      if s == cap_at:
        hidden_at = carry[0]
      if s in capture.hidden_cuts:
        cuts[s] = carry[0]
    x, pool_k, pool_v, pool_vlr = carry
    q_all = None
    if capture.q:
      q_all = q_parts[0] if len(q_parts) == 1 else jnp.concatenate(q_parts)
    if l1 == cfg.num_layers:
      x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    pool = None
    if cached:
      new_positions = kv_state.write_positions(kv.positions, write_slots, positions)
      pool = kv_state.KVPool(k=pool_k, v=pool_v, positions=new_positions, vlr=pool_vlr)
    hidden_cuts = (jnp.stack([cuts[c] for c in capture.hidden_cuts])
                   if capture.hidden_cuts else None)
    return fwd.ForwardOutput(hidden=x, kv=pool, q=q_all, hidden_at=hidden_at,
                             hidden_cuts=hidden_cuts)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """[..., D] -> [..., V] float32."""
    w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return jnp.dot(hidden, w, preferred_element_type=jnp.float32)

  @classmethod
  def from_params(cls, cfg: ModelConfig, params: dict[str, np.ndarray], *,
                  dtype=jnp.float32, scan_layers: bool = True,
                  out_in: bool | None = None) -> Transformer:
    """A module holding `params`, built without running the random initializers.

    The module is traced abstractly (`nnx.eval_shape`) and every parameter then
    set from `params`, so loading real weights does no throwaway init work.
    """
    net = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0),
                                     scan_layers=scan_layers, out_in=out_in))
    net.load_params(params)
    return net

  def params(self) -> dict[str, jax.Array]:
    """Every parameter as the flat {name: array} dict of `param_shapes` (the
    inverse of `load_params`; the unrolled layout stacks its layers into copies)."""
    out = {"embed": self.embed[...], "final_norm": self.final_norm[...]}
    out.update({f"layers.{k}": v for k, v in self.layers.export().items()})
    if self.lm_head is not None:
      out["lm_head"] = self.lm_head[...]
    return out

  def relayout(self, scan_layers: bool, out_in: bool | None = None) -> Transformer:
    """This model in another layer layout (stacked for `lax.scan`, or unrolled; the
    projections' storage as in `__init__`); returns self if the layout matches."""
    out_in = not scan_layers if out_in is None else out_in
    if (scan_layers, out_in) == (self.layers.is_stacked, self.layers.out_in):
      return self
    return Transformer.from_params(self.cfg, self.params(), dtype=self.embed[...].dtype,
                                   scan_layers=scan_layers, out_in=out_in)

  def load_params(self, params: dict[str, np.ndarray]) -> None:
    """Fills every parameter from a flat {name: array} dict (see `param_shapes`).

    Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    expected = param_shapes(self.cfg)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
      raise ValueError(f"weights do not match the model config: missing {missing}, "
                       f"unexpected {extra}")
    dtype = self.embed.get_value().dtype
    for name, shape in expected.items():
      value = params[name]
      if tuple(value.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}, "
                         f"config expects {shape}")
      # set_value (not param[...] = ...) also fills an abstract module from nnx.eval_shape
      if name.startswith("layers."):
        self.layers.assign(name.split(".", 1)[1], jnp.asarray(value, dtype=dtype))
      else:
        getattr(self, name).set_value(jnp.asarray(value, dtype=dtype))
