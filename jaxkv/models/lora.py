"""Shared-A multi-LoRA for the decoder (LRAgent, seed 000), plus PEFT-format I/O.

Every adapter i (an agent role: plan / action / reflect) adds to each target
projection t in {q, k, v, o}

    delta_{t,i}(x) = (x A_t) B_{t,i} * alpha / r,

with ONE down-projection A_t per layer shared by all adapters and one
up-projection B_{t,i} per adapter (MTL-LoRA / Hydra-LoRA style). Because A is
shared, x A_t is adapter-independent: for t = v it is LRAgent's low-rank (LR)
value cache, stored in the KV pool as `KVPool.vlr` [L, S, r] (already scaled by
alpha / r) and expanded by each agent's B_{v,i} inside Flash-LoRA-Attention.

Layout (x @ w, layer-leading so the decoder's `lax.scan` slices one layer):

    a[t]: [L, d_in, r]      shared
    b[t]: [L, N, r, d_out]  per adapter; zero at init (PEFT's default), so an
                            untrained adapter is the base model exactly

A batch mixes adapters through a per-sequence index `adapter_ids` [B] (punica /
S-LoRA style: gather B_i per row, one shared x A per row; -1 = base model).

PEFT interchange: `save_peft` writes each adapter as a standard PEFT LoRA
directory (adapter_config.json + adapter_model.safetensors, keys
`base_model.model.model.layers.{l}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight`,
torch [out, in] layout), loadable by `peft.PeftModel.from_pretrained` on the
HF model; `load_peft` reads such directories back and refuses adapters whose
A differ (not shared-A), whose rank / alpha / targets disagree, or that use
PEFT features this implementation does not compute (rsLoRA, DoRA, bias,
per-module rank patterns), naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import LoraConfig, ModelConfig

PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_PEFT_KEY = "base_model.model.model.layers.{layer}.self_attn.{module}.lora_{ab}.weight"


def target_dims(cfg: ModelConfig, target: str) -> tuple[int, int]:
  """(d_in, d_out) of a target projection."""
  q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.d_kv
  return {"q": (cfg.hidden_size, q_width), "k": (cfg.hidden_size, kv_width),
          "v": (cfg.hidden_size, kv_width), "o": (q_width, cfg.hidden_size)}[target]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeights:
  """The arrays the decoder consumes (a jit argument; see the module docstring)."""
  a: dict            # target -> [L, d_in, r] shared down-projection
  b: dict            # target -> [L, N, r, d_out] per-adapter up-projection
  scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)  # alpha / r

  @property
  def targets(self) -> tuple[str, ...]:
    return tuple(self.a)

  @property
  def rank(self) -> int:
    return next(iter(self.a.values())).shape[-1]

  @property
  def num_adapters(self) -> int:
    return next(iter(self.b.values())).shape[1]


class MultiLoRA(nnx.Module):
  """Shared-A multi-LoRA parameters (trainable with Optax through `nnx.split`).

  A is initialised as PEFT does (Kaiming-uniform, bound 1 / sqrt(d_in)), B at zero.
  """

  def __init__(self, model_cfg: ModelConfig, cfg: LoraConfig, *, dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.cfg = cfg
    L, r, n = model_cfg.num_layers, cfg.rank, cfg.num_adapters
    for t in cfg.targets:
      d_in, d_out = target_dims(model_cfg, t)
      bound = 1.0 / math.sqrt(d_in)
      setattr(self, f"a_{t}", nnx.Param(jax.random.uniform(
          rngs.params(), (L, d_in, r), dtype, -bound, bound)))
      setattr(self, f"b_{t}", nnx.Param(jnp.zeros((L, n, r, d_out), dtype)))

  def weights(self) -> LoraWeights:
    return from_params(nnx.to_pure_dict(nnx.state(self)), self.cfg)

  def load(self, w: LoraWeights) -> None:
    """Copies arrays of matching shapes in (e.g. from `load_peft`)."""
    if set(w.targets) != set(self.cfg.targets):
      raise ValueError(f"targets {w.targets} != module targets {self.cfg.targets}")
    for t in self.cfg.targets:
      for name, arr in ((f"a_{t}", w.a[t]), (f"b_{t}", w.b[t])):
        p = getattr(self, name)
        if p[...].shape != arr.shape:
          raise ValueError(f"{name}: shape {arr.shape} != {p[...].shape}")
        p[...] = jnp.asarray(arr, p[...].dtype)


def from_params(params: dict, cfg: LoraConfig) -> LoraWeights:
  """LoraWeights of a MultiLoRA's pure-dict state {"a_q": ..., "b_q": ..., ...}
  (the form Optax trains and Orbax stores)."""
  return LoraWeights(a={t: params[f"a_{t}"] for t in cfg.targets},
                     b={t: params[f"b_{t}"] for t in cfg.targets}, scale=cfg.scale)


# ----------------------------------------------------------------------------- math
def select_b(b_layer: jax.Array, adapter_ids: jax.Array) -> jax.Array:
  """B of each row: b_layer [N, r, d_out], adapter_ids [B] -> [B, r, d_out] (0 for -1)."""
  ids = jnp.clip(adapter_ids, 0, b_layer.shape[0] - 1)
  return jnp.where((adapter_ids >= 0)[:, None, None], b_layer[ids], 0).astype(b_layer.dtype)


def down(x: jax.Array, a_layer: jax.Array, scale: float) -> jax.Array:
  """x A * scale: [B, C, d_in] x [d_in, r] -> [B, C, r] (the LR cache entry for v)."""
  return jnp.dot(x, a_layer.astype(x.dtype)) * jnp.asarray(scale, x.dtype)


def up(x_a: jax.Array, b_rows: jax.Array) -> jax.Array:
  """[B, C, r] x per-row B [B, r, d_out] -> [B, C, d_out]."""
  return jnp.einsum("bcr,bro->bco", x_a, b_rows.astype(x_a.dtype))


def delta(x: jax.Array, a_layer: jax.Array, b_rows: jax.Array, scale: float) -> jax.Array:
  """The adapter output x A B_i * scale of each row."""
  return up(down(x, a_layer, scale), b_rows)


# ----------------------------------------------------------------------------- PEFT I/O
def save_peft(w: LoraWeights, cfg: LoraConfig, directory, *, base_model: str = "") -> list:
  """Writes adapter i to directory/<names[i]>/ in PEFT format; returns the paths."""
  from safetensors.numpy import save_file

  root = pathlib.Path(directory)
  out = []
  for i, name in enumerate(cfg.names):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for t in w.targets:
      a, b = np.asarray(w.a[t], np.float32), np.asarray(w.b[t][:, i], np.float32)
      for layer in range(a.shape[0]):
        key = dict(layer=layer, module=PEFT_MODULES[t])
        tensors[_PEFT_KEY.format(ab="A", **key)] = np.ascontiguousarray(a[layer].T)
        tensors[_PEFT_KEY.format(ab="B", **key)] = np.ascontiguousarray(b[layer].T)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=cfg.rank, lora_alpha=cfg.alpha,
                  target_modules=sorted(PEFT_MODULES[t] for t in w.targets), lora_dropout=0.0,
                  bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
                  init_lora_weights=True, inference_mode=True, modules_to_save=None,
                  base_model_name_or_path=base_model or None,
                  rank_pattern={}, alpha_pattern={})
    (d / "adapter_config.json").write_text(json.dumps(config, indent=2))
    out.append(d)
  return out


def _read_config(d: pathlib.Path) -> dict:
  path = d / "adapter_config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{d}: no adapter_config.json (not a PEFT adapter directory)")
  c = json.loads(path.read_text())
  if c.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{d}: peft_type {c.get('peft_type')!r} is not LORA")
  for field, ok in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
    if bool(c.get(field, ok)) != ok:
      raise ValueError(f"{d}: {field}={c[field]} is not supported (plain LoRA only)")
  if c.get("bias", "none") != "none":
    raise ValueError(f"{d}: bias={c['bias']!r} is not supported (bias='none' only)")
  for field in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
    if c.get(field):
      raise ValueError(f"{d}: {field}={c[field]!r} is not supported")
  return c


def load_peft(directories: Sequence, model_cfg: ModelConfig,
              names: Sequence[str] | None = None) -> tuple[LoraConfig, LoraWeights]:
  """Reads PEFT LoRA directories (one per adapter, in index order) as shared-A multi-LoRA.

  Raises ValueError when the adapters disagree on rank / alpha / targets, when
  their A matrices differ (they must be shared), or when a tensor is missing or
  mis-shaped for `model_cfg`.
  """
  from safetensors.numpy import load_file

  dirs = [pathlib.Path(d) for d in directories]
  if not dirs:
    raise ValueError("load_peft needs at least one adapter directory")
  configs = [_read_config(d) for d in dirs]
  modules = {v: k for k, v in PEFT_MODULES.items()}
  first = configs[0]
  tm = first.get("target_modules")
  tm = [tm] if isinstance(tm, str) else list(tm or [])
  unknown = [m for m in tm if m not in modules]
  if unknown or not tm:
    raise ValueError(f"{dirs[0]}: target_modules {tm} must be among {sorted(modules)}")
  targets = tuple(t for t in PEFT_MODULES if PEFT_MODULES[t] in tm)
  for d, c in zip(dirs[1:], configs[1:]):
    ctm = c.get("target_modules")
    ctm = [ctm] if isinstance(ctm, str) else list(ctm or [])
    if (c["r"], c["lora_alpha"], sorted(ctm)) != (first["r"], first["lora_alpha"], sorted(tm)):
      raise ValueError(f"{d}: r / lora_alpha / target_modules differ from {dirs[0]}")
  r, L = int(first["r"]), model_cfg.num_layers
  cfg = LoraConfig(rank=r, alpha=float(first["lora_alpha"]), targets=targets,
                   names=tuple(names) if names else tuple(d.name for d in dirs))
  tensors = []
  for d in dirs:
    f = d / "adapter_model.safetensors"
    if not f.is_file():
      raise FileNotFoundError(f"{d}: no adapter_model.safetensors")
    tensors.append({k.replace(".default.", "."): v for k, v in load_file(str(f)).items()})
  a, b = {}, {}
  for t in targets:
    d_in, d_out = target_dims(model_cfg, t)
    a_layers, b_layers = [], []
    for layer in range(L):
      key = dict(layer=layer, module=PEFT_MODULES[t])
      ka, kb = _PEFT_KEY.format(ab="A", **key), _PEFT_KEY.format(ab="B", **key)
      per_a, per_b = [], []
      for d, ts in zip(dirs, tensors):
        if ka not in ts or kb not in ts:
          raise ValueError(f"{d}: missing {ka if ka not in ts else kb}")
        if ts[ka].shape != (r, d_in) or ts[kb].shape != (d_out, r):
          raise ValueError(f"{d}: {ka} / {kb} shapes {ts[ka].shape} / {ts[kb].shape}, "
                           f"model expects {(r, d_in)} / {(d_out, r)}")
        per_a.append(ts[ka].astype(np.float32))
        per_b.append(ts[kb].astype(np.float32).T)
      for d, x in zip(dirs[1:], per_a[1:]):
        if not np.array_equal(x, per_a[0]):
          raise ValueError(f"{d}: lora_A of layer {layer} {t} differs from {dirs[0]}'s; "
                           "shared-A multi-LoRA needs one A for all adapters")
      a_layers.append(per_a[0].T)
      b_layers.append(np.stack(per_b))
    a[t] = jnp.asarray(np.stack(a_layers))          # [L, d_in, r]
    b[t] = jnp.asarray(np.stack(b_layers))          # [L, N, r, d_out]
  return cfg, LoraWeights(a=a, b=b, scale=cfg.scale)
