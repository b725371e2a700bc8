"""Weight loading: GGUF files and HF safetensors directories -> (ModelConfig, params).

`params` is the flat {name: np.ndarray} dict of `llama.param_shapes` (stacked
layers, [in, out] matrices), filled into the NNX module by
`Transformer.load_params`.

GGUF: llama.cpp stores `attn_q` / `attn_k` of Llama-architecture models with
rows permuted for interleaved RoPE; we un-permute them so the one rotate-half
RoPE of jaxkv.rope applies to every source (Qwen2/Qwen3 GGUFs are not
permuted). Quantized tensors are dequantized to float32 with `gguf.quants`; the file is
parsed by `jaxkv.models.gguf_file` (fast metadata, memory-mapped tensors).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib

import einops
import numpy as np

from jaxkv.config import ModelConfig, RopeConfig
from jaxkv.models import gguf_file
from jaxkv.models.llama import param_shapes

_ARCHS = ("llama", "qwen2", "qwen3")

# GGUF per-layer tensor -> (our stacked name, transpose?)
_GGUF_LAYER = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True), "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True), "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False), "attn_k.bias": ("bk", False), "attn_v.bias": ("bv", False),
    "attn_q_norm.weight": ("q_norm", False), "attn_k_norm.weight": ("k_norm", False),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True), "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
# HF per-layer tensor (after "model.layers.{i}.") -> (our name, transpose?)
_HF_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's interleaved-RoPE row permutation. w: [out, in] (or [out])."""
  return einops.rearrange(w, "(h half two) ... -> (h two half) ...", h=n_head, two=2)


def _stack(per_layer: dict[str, list], num_layers: int, what: str) -> dict[str, np.ndarray]:
  out = {}
  for name, rows in per_layer.items():
    if any(r is None for r in rows):
      missing = [i for i, r in enumerate(rows) if r is None]
      raise ValueError(f"{what}: layer tensor {name!r} missing for layers {missing[:8]}")
    out[f"layers.{name}"] = np.stack(rows)
  return out


# ----------------------------------------------------------------------------- GGUF

def gguf_config(meta: dict) -> ModelConfig:
  """ModelConfig from GGUF metadata (`gguf_file.read(path).metadata`)."""
  arch = meta.get("general.architecture")
  if arch not in _ARCHS:
    raise ValueError(f"unsupported GGUF architecture {arch!r}; jaxkv loads {_ARCHS}")
  g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
  hidden = int(g("embedding_length"))
  heads = int(g("attention.head_count"))
  head_dim = int(g("attention.key_length", hidden // heads))
  vocab = g("vocab_size")
  if vocab is None:
    vocab = len(meta["tokenizer.ggml.tokens"])
  rope_kind = meta.get(f"{arch}.rope.scaling.type", "none")
  rope_kw = dict(theta=float(g("rope.freq_base", 10000.0)))
  if rope_kind in ("linear", "yarn"):
    rope_kw.update(kind=rope_kind, factor=float(g("rope.scaling.factor")),
                   original_max_position=int(g("rope.scaling.original_context_length",
                                               g("context_length"))))
  elif rope_kind not in ("none", None):
    raise ValueError(f"GGUF rope scaling {rope_kind!r} is not supported")
  return ModelConfig(
      vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(g("feed_forward_length")),
      num_layers=int(g("block_count")), num_heads=heads,
      num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
      rope=RopeConfig(**rope_kw),
      rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
      max_position=int(g("context_length", 8192)),
      tie_embeddings=False,  # fixed below from the tensor list
      qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", architecture=arch)


def load_gguf(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads and dequantizes a GGUF checkpoint. Raises ValueError on a bad file."""
  import dataclasses

  path = pathlib.Path(path)
  f = gguf_file.read(path)
  cfg = gguf_config(f.metadata)
  tensors = f.tensors
  if "rope_freqs.weight" in tensors:
    raise ValueError(f"{path}: llama3 rope_freqs tensors are not supported from GGUF; "
                     "load the HF safetensors checkpoint instead")
  cfg = dataclasses.replace(cfg, tie_embeddings="output.weight" not in tensors)

  L = cfg.num_layers
  wanted = [f"blk.{i}.{suffix}" for i in range(L) for suffix in _GGUF_LAYER
            if f"blk.{i}.{suffix}" in tensors]
  wanted += ["token_embd.weight", "output_norm.weight"]
  if not cfg.tie_embeddings:
    wanted.append("output.weight")
  missing = [k for k in wanted if k not in tensors]
  if missing:
    raise ValueError(f"{path}: tensors {missing} missing")
  # gguf.quants is numpy; its large ops release the GIL, so threads overlap.
  with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as ex:
    deq = dict(zip(wanted, ex.map(lambda k: tensors[k].dequantize(), wanted)))

  per_layer: dict[str, list] = {}
  for i in range(L):
    for suffix, (name, transpose) in _GGUF_LAYER.items():
      key = f"blk.{i}.{suffix}"
      if key not in deq:
        continue
      w = deq.pop(key)
      if cfg.architecture == "llama" and suffix in ("attn_q.weight", "attn_k.weight"):
        w = unpermute_rows(w, cfg.num_heads if "attn_q" in suffix else cfg.num_kv_heads)
      per_layer.setdefault(name, [None] * L)[i] = w.T if transpose else w
  params = _stack(per_layer, L, str(path))
  params["embed"] = deq["token_embd.weight"]
  params["final_norm"] = deq["output_norm.weight"]
  if not cfg.tie_embeddings:
    params["lm_head"] = deq["output.weight"].T
  _check(cfg, params, str(path))
  return cfg, params


# ----------------------------------------------------------------------- HF safetensors

def hf_config(d: dict) -> ModelConfig:
  """ModelConfig from an HF config.json dict (llama / qwen2 / qwen3)."""
  arch = d.get("model_type")
  if arch not in _ARCHS:
    raise ValueError(f"unsupported model_type {arch!r}; jaxkv loads {_ARCHS}")
  rp = dict(d.get("rope_parameters") or {})
  rp.update(d.get("rope_scaling") or {})
  theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
  kind = rp.get("rope_type", rp.get("type", "default")) or "default"
  rope_kw: dict = dict(kind=kind, theta=theta)
  if kind != "default":
    rope_kw["factor"] = float(rp.get("factor", 1.0))
    orig = rp.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    rope_kw["original_max_position"] = int(orig)
  if kind == "llama3":
    rope_kw.update(low_freq_factor=float(rp["low_freq_factor"]),
                   high_freq_factor=float(rp["high_freq_factor"]))
  if kind == "yarn":
    for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
              "truncate"):
      if rp.get(k) is not None:
        rope_kw[k] = rp[k]
  heads = int(d["num_attention_heads"])
  return ModelConfig(
      vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
      intermediate_size=int(d["intermediate_size"]),
      num_layers=int(d["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(d.get("num_key_value_heads") or heads),
      head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
      rope=RopeConfig(**rope_kw), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      max_position=int(d.get("max_position_embeddings", 8192)),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
      qk_norm=arch == "qwen3", architecture=arch)


def load_hf_dir(directory: str | pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads config.json + *.safetensors from an HF checkpoint directory."""
  from safetensors.numpy import load_file
  directory = pathlib.Path(directory)
  cfg_path = directory / "config.json"
  if not cfg_path.exists():
    raise FileNotFoundError(f"{cfg_path} not found: not an HF checkpoint directory")
  try:
    raw_cfg = json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
  if not isinstance(raw_cfg, dict):
    raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw_cfg).__name__}")
  try:
    cfg = hf_config(raw_cfg)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{cfg_path}: {e}") from None
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {directory}")
  raw: dict[str, np.ndarray] = {}
  for f in files:
    for k, v in load_file(str(f)).items():
      raw[k] = v.astype(np.float32) if v.dtype != np.float32 else v
  L = cfg.num_layers
  per_layer: dict[str, list] = {}
  used = set()
  for i in range(L):
    for suffix, (name, transpose) in _HF_LAYER.items():
      key = f"model.layers.{i}.{suffix}"
      if key in raw:
        used.add(key)
        w = raw[key]
        per_layer.setdefault(name, [None] * L)[i] = w.T if transpose else w
  params = _stack(per_layer, L, str(directory))
  params["embed"] = raw["model.embed_tokens.weight"]
  params["final_norm"] = raw["model.norm.weight"]
  used |= {"model.embed_tokens.weight", "model.norm.weight"}
  if not cfg.tie_embeddings:
    params["lm_head"] = raw["lm_head.weight"].T
    used.add("lm_head.weight")
  ignored = sorted(set(raw) - used - {"lm_head.weight"})
  if ignored:
    raise ValueError(f"{directory}: unexpected tensors {ignored[:8]} "
                     f"(({len(ignored)} in all); is this a {cfg.architecture} checkpoint?")
  _check(cfg, params, str(directory))
  return cfg, params


def _check(cfg: ModelConfig, params: dict[str, np.ndarray], what: str) -> None:
  expected = param_shapes(cfg)
  for name, shape in expected.items():
    if name not in params:
      raise ValueError(f"{what}: missing tensor for {name!r}")
    if tuple(params[name].shape) != shape:
      raise ValueError(f"{what}: {name!r} has shape {params[name].shape}, expected {shape}")


def load(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """A .gguf file or an HF directory -> (config, params)."""
  path = pathlib.Path(path)
  if path.is_dir():
    return load_hf_dir(path)
  if path.suffix == ".gguf":
    return load_gguf(path)
  raise ValueError(f"{path}: expected a .gguf file or an HF checkpoint directory")
