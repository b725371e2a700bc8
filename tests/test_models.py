"""Model numerics against HF transformers (torch CPU): tiny random configs of every
architecture and RoPE variant (fp32, <= 1e-4 max abs), loaded through the
safetensors-directory loader (a `save_pretrained` round trip)."""

import re

import numpy as np
import pytest
import torch
import transformers

import hf_util
from jaxkv.models import weights

TOL = 1e-4

_BASE = dict(vocab_size=256, hidden_size=96, intermediate_size=112, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6)

CASES = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama_tied_mha": (transformers.LlamaConfig,
                       dict(tie_word_embeddings=True, num_key_value_heads=6)),
    "llama3_rope": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "linear_rope": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "dynamic_rope": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        max_position_embeddings=32)),
    "yarn_rope": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128})),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=False)),
}


def _hf_model(name, tmp_path):
  cls, extra = CASES[name]
  cfg = cls(**{**_BASE, **extra})
  torch.manual_seed(hash(name) % 1000)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  # Random norms and biases too, so q/k-norm and bias paths are exercised.
  with torch.no_grad():
    for n, p in model.named_parameters():
      if "norm" in n or n.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(tmp_path)
  return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name, tmp_path):
  hf = _hf_model(name, tmp_path)
  cfg, params = weights.load_hf_dir(tmp_path)
  assert cfg.architecture == CASES[name][0].model_type
  model = hf_util.build(cfg, params)
  tokens = np.random.default_rng().integers(0, _BASE["vocab_size"], (2, 40))
  ours = hf_util.dense_forward(model, tokens)
  with torch.no_grad():
    ref = hf(torch.tensor(tokens)).logits.numpy()
  err = np.abs(ours - ref).max()
  assert err <= TOL, f"{name}: max abs logit error {err:.3g} > {TOL}"
  # the cache-free forward (training) is the same model
  err = np.abs(hf_util.dense_forward(model, tokens, cached=False) - ref).max()
  assert err <= TOL, f"{name} without a cache: max abs logit error {err:.3g} > {TOL}"


def test_paged_chunked_equals_one_shot(tmp_path):
  """Prefill in chunks through a scattered, page-size-1 slot map = one shot."""
  import jax.numpy as jnp

  from jaxkv.config import CacheConfig
  from jaxkv.kv import state as kv_state

  hf = _hf_model("qwen2", tmp_path)
  del hf
  cfg, params = weights.load_hf_dir(tmp_path)
  model = hf_util.build(cfg, params)
  rng = np.random.default_rng()
  T = 37
  tokens = rng.integers(0, cfg.vocab_size, (1, T))
  ref = hf_util.dense_forward(model, tokens)
  pool = kv_state.init_pool(cfg, CacheConfig(num_pages=200, page_size=1))
  slot_map = np.zeros((1, 64), np.int32)
  slot_map[0, :T] = rng.permutation(np.arange(1, 200))[:T]
  outs = []
  for start in range(0, T, 8):
    chunk = tokens[:, start:start + 8]
    pos = np.arange(start, start + chunk.shape[1])[None]
    out = model(jnp.asarray(chunk), jnp.asarray(pos), pool, slot_map=jnp.asarray(slot_map))
    pool = out.kv
    outs.append(np.asarray(model.logits(out.hidden)))
  ours = np.concatenate(outs, axis=1)
  assert np.abs(ours - ref).max() <= TOL
  # Positions are recorded for every written slot; the sentinel stays untouched.
  assert np.array_equal(np.asarray(pool.positions)[slot_map[0, :T]], np.arange(T))
  assert float(jnp.abs(pool.k[:, 0]).max()) == 0.0


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_captured_queries_equal_hf_post_rope_queries(name, tmp_path, monkeypatch):
  """`Capture(q=True)` returns every layer's post-RoPE q exactly where attention
  consumes it: equal to HF's own apply_rotary_pos_emb output."""
  import importlib

  import jax.numpy as jnp

  from jaxkv.config import CacheConfig
  from jaxkv.kv import state as kv_state
  from jaxkv.models.forward import Capture

  hf = _hf_model(name, tmp_path)
  mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
  seen = []
  orig = mod.apply_rotary_pos_emb
  def spy(q, k, *a, **kw):
    out = orig(q, k, *a, **kw)
    seen.append(out[0].detach().numpy())            # [B, H, T, D]
    return out
  monkeypatch.setattr(mod, "apply_rotary_pos_emb", spy)
  tokens = np.random.default_rng().integers(0, 256, (2, 11))
  with torch.no_grad():
    hf(torch.tensor(tokens))
  cfg, params = weights.load_hf_dir(tmp_path)
  model = hf_util.build(cfg, params)
  pool = kv_state.init_pool(cfg, CacheConfig(num_pages=40, page_size=1))
  slot_map = (1 + np.arange(22, dtype=np.int32)).reshape(2, 11)
  pos = np.broadcast_to(np.arange(11, dtype=np.int32), (2, 11))
  q = model(jnp.asarray(tokens), jnp.asarray(pos), pool, slot_map=jnp.asarray(slot_map),
            capture=Capture(q=True)).q
  assert q.shape == (cfg.num_layers, 2, 11, cfg.num_heads, cfg.head_dim)
  want = np.stack(seen).transpose(0, 1, 3, 2, 4)      # [L, B, T, H, D]
  assert np.abs(np.asarray(q) - want).max() <= TOL


def test_unknown_architecture_is_a_clear_error(tmp_path):
  import json
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
    weights.load_hf_dir(tmp_path)


def test_wrong_shapes_are_a_clear_error(tmp_path):
  _hf_model("llama", tmp_path)
  cfg, params = weights.load_hf_dir(tmp_path)
  params["layers.wq"] = params["layers.wq"][:, :, :-1]
  with pytest.raises(ValueError, match=re.escape("layers.wq")):
    hf_util.build(cfg, params)


def test_not_a_gguf_file(tmp_path):
  bad = tmp_path / "x.gguf"
  bad.write_bytes(b"not a gguf at all")
  with pytest.raises(ValueError, match="not a GGUF file"):
    weights.load_gguf(bad)
