"""Shared-A multi-LoRA (LRAgent) against HF transformers + peft (torch CPU).

Adapters are built in peft with one A copied across adapters and random B (an
untrained LoRA has B = 0 and would make every check trivial), saved with
peft's own `save_pretrained`, read by `jaxkv.models.lora.load_peft`, and run
with per-row adapter indices in one batch. Tolerances: fp32, <= 1e-4 max abs
on logits (as the base-model parity tests).
"""

import json
import re

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

import hf_util
from jaxkv.config import LoraConfig
from jaxkv.models import lora, weights
from jaxkv.models.forward import Capture, LayerWindow, LoraInputs

TOL = 1e-4
_BASE = dict(vocab_size=256, hidden_size=96, intermediate_size=112, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
ARCH = {"llama": transformers.LlamaConfig,
        "qwen3": lambda **kw: transformers.Qwen3Config(head_dim=32, **kw)}
MODULES = {("q", "v"): ["q_proj", "v_proj"], ("q", "k", "v", "o"): ["q_proj", "k_proj",
                                                                     "v_proj", "o_proj"]}
NAMES = ("plan", "action", "reflect")


def _peft_model(arch, targets, tmp_path, rank=4, alpha=8.0, share_a=True):
  torch.manual_seed(0)
  base = transformers.AutoModelForCausalLM.from_config(ARCH[arch](**_BASE)).eval()
  base.save_pretrained(tmp_path / "base")
  cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=MODULES[targets],
                        lora_dropout=0.0)
  model = peft.get_peft_model(base, cfg, adapter_name=NAMES[0])
  for name in NAMES[1:]:
    model.add_adapter(name, cfg)
  with torch.no_grad():
    for mod in model.modules():
      if isinstance(mod, peft.tuners.lora.LoraLayer):
        for name in NAMES:
          if share_a and name != NAMES[0]:
            mod.lora_A[name].weight.copy_(mod.lora_A[NAMES[0]].weight)
          mod.lora_B[name].weight.normal_(0.0, 0.2)
  model.save_pretrained(tmp_path / "peft", selected_adapters=list(NAMES))
  return model.eval()


def _hf_logits(model, tokens, adapter):
  model.set_adapter(adapter)
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.numpy()


def _ours(tmp_path):
  cfg, params = weights.load_hf_dir(tmp_path / "base")
  lcfg, lw = lora.load_peft([tmp_path / "peft" / n for n in NAMES], cfg)
  return hf_util.build(cfg, params), lcfg, lw


@pytest.mark.parametrize("arch", sorted(ARCH))
@pytest.mark.parametrize("targets", sorted(MODULES))
def test_mixed_batch_matches_peft(arch, targets, tmp_path):
  """One batch, rows on adapters [2, 0, 1, -1]: each row equals peft with that
  adapter active (row -1: the base model with adapters disabled)."""
  hf = _peft_model(arch, targets, tmp_path)
  model, lcfg, lw = _ours(tmp_path)
  assert lcfg.targets == targets and lcfg.names == NAMES and lw.rank == 4
  tokens = np.random.default_rng().integers(0, _BASE["vocab_size"], (4, 24))
  ids = np.array([2, 0, 1, -1], np.int32)
  out = hf_util.dense_forward(model, tokens, lora=lw, adapter_ids=jnp.asarray(ids))
  for row, i in enumerate(ids):
    if i >= 0:
      ref = _hf_logits(hf, tokens[row:row + 1], NAMES[i])[0]
    else:
      with hf.disable_adapter(), torch.no_grad():
        ref = hf(torch.as_tensor(tokens[row:row + 1])).logits.numpy()[0]
    np.testing.assert_allclose(out[row], ref, atol=TOL, rtol=0)
  # adapters differ from each other and from the base (the check has teeth)
  assert np.abs(out[0] - out[1]).max() > 1e-2 and np.abs(out[2] - out[3]).max() > 1e-2


@pytest.mark.parametrize("targets", sorted(MODULES))
def test_decoupled_value_cache_equals_full(targets, tmp_path):
  """BaseLRShared's layout (pool v = x W_v, vlr = x A_v s, attention expands each
  row's B_v through Flash-LoRA-Attention) reproduces the folded-in LoRA value."""
  _peft_model("llama", targets, tmp_path)
  model, _, lw = _ours(tmp_path)
  tokens = np.random.default_rng().integers(0, _BASE["vocab_size"], (3, 40))
  ids = jnp.asarray([1, 2, 0], jnp.int32)
  full = hf_util.dense_forward(model, tokens, lora=lw, adapter_ids=ids)
  dec = hf_util.dense_forward(model, tokens, lr_rank=lw.rank, lora=lw, adapter_ids=ids,
                              lora_mode="decoupled")
  np.testing.assert_allclose(dec, full, atol=1e-5, rtol=0)


def test_save_peft_round_trip(tmp_path):
  """Our save_peft -> peft.PeftModel.from_pretrained gives our logits; load_peft
  of our own files gives the arrays back bit for bit."""
  _peft_model("llama", ("q", "v"), tmp_path)
  model, lcfg, lw = _ours(tmp_path)
  lw = dataclass_b_scaled(lw, 1.7)                  # weights peft never saw
  out_dir = tmp_path / "ours"
  lora.save_peft(lw, lcfg, out_dir, base_model=str(tmp_path / "base"))
  cfg2, lw2 = lora.load_peft([out_dir / n for n in NAMES], model.cfg)
  assert cfg2 == lcfg
  for t in lw.targets:
    np.testing.assert_array_equal(np.asarray(lw2.a[t]), np.asarray(lw.a[t]))
    np.testing.assert_array_equal(np.asarray(lw2.b[t]), np.asarray(lw.b[t]))
  tokens = np.random.default_rng().integers(0, _BASE["vocab_size"], (1, 16))
  ours = hf_util.dense_forward(model, tokens, lora=lw, adapter_ids=jnp.asarray([1]))
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
  hf = peft.PeftModel.from_pretrained(base, out_dir / NAMES[1]).eval()
  with torch.no_grad():
    ref = hf(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def dataclass_b_scaled(lw, f):
  return lora.LoraWeights(a=lw.a, b={t: v * f for t, v in lw.b.items()}, scale=lw.scale)


def test_fresh_adapters_are_the_base_model(tmp_path):
  """B = 0 at init (PEFT's default): every adapter equals the base exactly."""
  hf_util_model = _base_model(tmp_path)
  ml = lora.MultiLoRA(hf_util_model.cfg, LoraConfig(rank=4, targets=("q", "k", "v", "o")),
                      rngs=nnx.Rngs(1))
  tokens = np.random.default_rng().integers(0, _BASE["vocab_size"], (3, 12))
  base = hf_util.dense_forward(hf_util_model, tokens)
  out = hf_util.dense_forward(hf_util_model, tokens, lora=ml.weights(),
                              adapter_ids=jnp.asarray([0, 1, 2], jnp.int32))
  np.testing.assert_array_equal(out, base)
  w = ml.weights()
  assert w.a["o"].shape == (3, 6 * 16, 4) and w.b["k"].shape == (3, 3, 4, 2 * 16)
  bound = 1 / np.sqrt(96)
  assert 0 < np.abs(np.asarray(w.a["q"])).max() <= bound


def _base_model(tmp_path):
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(**_BASE)).save_pretrained(tmp_path)
  return hf_util.build(*weights.load_hf_dir(tmp_path))


def test_model_rejects_bad_lora_arguments(tmp_path):
  model = _base_model(tmp_path / "m")
  ml = lora.MultiLoRA(model.cfg, LoraConfig(rank=4, targets=("q",)), rngs=nnx.Rngs(0))
  tokens = np.zeros((1, 4), np.int64)
  with pytest.raises(TypeError, match="adapter_ids"):
    LoraInputs(ml.weights())
  with pytest.raises(ValueError, match="'v' among the LoRA targets"):
    hf_util.dense_forward(model, tokens, lr_rank=4, lora=ml.weights(),
                          adapter_ids=jnp.zeros(1, jnp.int32), lora_mode="decoupled")
  ml = lora.MultiLoRA(model.cfg, LoraConfig(rank=4), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="vlr of rank 4"):
    hf_util.dense_forward(model, tokens, lora=ml.weights(),
                          adapter_ids=jnp.zeros(1, jnp.int32), lora_mode="decoupled")
  with pytest.raises(ValueError, match="lora mode must be"):
    LoraInputs(ml.weights(), jnp.zeros(1, jnp.int32), mode="shared")


def test_load_peft_refuses_what_it_cannot_compute(tmp_path):
  _peft_model("llama", ("q", "v"), tmp_path, share_a=False)
  cfg, _ = weights.load_hf_dir(tmp_path / "base")
  dirs = [tmp_path / "peft" / n for n in NAMES]
  with pytest.raises(ValueError, match="shared-A"):
    lora.load_peft(dirs, cfg)
  lora.load_peft(dirs[:1], cfg)                      # a single adapter is fine
  conf = json.loads((dirs[1] / "adapter_config.json").read_text())
  for field, value, msg in (("r", 8, "r / lora_alpha"), ("use_rslora", True, "use_rslora"),
                            ("bias", "all", "bias")):
    (dirs[1] / "adapter_config.json").write_text(json.dumps({**conf, field: value}))
    with pytest.raises(ValueError, match=msg):
      lora.load_peft(dirs, cfg)
  with pytest.raises(FileNotFoundError, match=re.escape("adapter_config.json")):
    lora.load_peft([tmp_path], cfg)
  with pytest.raises(ValueError, match="targets must be"):
    LoraConfig(targets=("q", "gate"))


def test_layer_window_and_hidden_capture_compose_to_the_full_forward(tmp_path):
  """DroidSpeak hooks: running layers [0, l) then [l, L) from the hidden state
  captured entering layer l reproduces the full forward and its pool (fp32
  rounding only: the split compiles as different programs)."""
  import jax

  from jaxkv.config import CacheConfig
  from jaxkv.kv import state as kv_state

  model = _base_model(tmp_path)
  ml = lora.MultiLoRA(model.cfg, LoraConfig(rank=4), rngs=nnx.Rngs(0))
  w = dataclass_b_scaled(ml.weights(), 0.0)
  w = lora.LoraWeights(a=w.a, b={t: jax.random.normal(jax.random.key(1), v.shape) * 0.1
                                 for t, v in w.b.items()}, scale=w.scale)
  rng = np.random.default_rng()
  tokens = jnp.asarray(rng.integers(0, _BASE["vocab_size"], (1, 10)))
  pos = jnp.arange(10, dtype=jnp.int32)[None]
  smap = 16 + pos
  fresh = lambda: kv_state.init_pool(model.cfg, CacheConfig(num_pages=3, page_size=16))
  kw = dict(slot_map=smap, lora=LoraInputs(w, jnp.asarray([1], jnp.int32)))
  full = model(tokens, pos, fresh(), capture=Capture(q=True, hidden_at=1), **kw)
  assert full.q.shape[0] == 3 and full.hidden_at.shape == (1, 10, 96)
  pool_a = model(tokens, pos, fresh(), window=LayerWindow(stop=1), **kw).kv
  assert float(jnp.abs(pool_a.k[1:]).max()) == 0.0          # only layer 0 written
  out = model(tokens, pos, pool_a, window=LayerWindow(full.hidden_at, 1, 3), **kw)
  for a, b in ((out.hidden, full.hidden), (out.kv.k, full.kv.k), (out.kv.v, full.kv.v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="capture hidden_at"):
    model(tokens, pos, fresh(), window=LayerWindow(start=1), capture=Capture(hidden_at=0), **kw)


def test_engine_serves_mixed_adapters_like_peft_generate(tmp_path):
  """The batch engine with an adapter stack: requests on adapters [2, 0, 1, -1, 0] run
  in one batch (chunked prefill + scanned decode) and each greedy continuation equals
  peft's `generate` with that adapter active; with the prefix cache on, a repeated
  request adopts its cached prompt from its own adapter's tree (and still equals
  peft), never from another adapter's or the base's."""
  from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
  from jaxkv.engine.engine import Engine, Request
  hf = _peft_model("llama", ("q", "v"), tmp_path)
  model, _, lw = _ours(tmp_path)
  eng = Engine(model, (), CacheConfig(num_pages=64, page_size=4, max_seq_len=96),
               EngineConfig(max_batch=4, prefill_chunk=8, decode_steps=4, prefix_cache=True),
               lora=lw)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, _BASE["vocab_size"], n).tolist() for n in (11, 5, 17, 9, 13)]
  adapters = [2, 0, 1, -1, 0]
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=6), adapter=a)
          for i, (p, a) in enumerate(zip(prompts, adapters))]
  got = {r.id: r for r in eng.run(reqs)}

  def hf_greedy(p, a):
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    with torch.no_grad():
      if a < 0:
        with hf.disable_adapter():
          out = hf.generate(input_ids=torch.tensor([p]), **kw)
      else:
        hf.set_adapter(NAMES[a])
        out = hf.generate(input_ids=torch.tensor([p]), **kw)
    return out[0, len(p):].tolist()

  refs = [hf_greedy(p, a) for p, a in zip(prompts, adapters)]
  for i, ref in enumerate(refs):
    assert got[str(i)].tokens == ref, (i, adapters[i])
  assert len({tuple(refs[1]), tuple(hf_greedy(prompts[1], -1))}) == 2   # adapters matter
  again = {r.id: r for r in eng.run([
      Request("b", prompts[3], SamplingConfig(max_tokens=6)),
      Request("a", prompts[1], SamplingConfig(max_tokens=6), adapter=0),
      Request("other", prompts[1], SamplingConfig(max_tokens=6), adapter=1),
      Request("base", prompts[4], SamplingConfig(max_tokens=6))])}
  assert again["b"].cached_tokens == len(prompts[3]) - 1 and again["b"].tokens == refs[3]
  assert again["a"].cached_tokens == len(prompts[1]) - 1 and again["a"].tokens == refs[1]
  assert again["other"].cached_tokens == 0 and again["other"].tokens == hf_greedy(prompts[1], 1)
  assert again["base"].cached_tokens == 0 and again["base"].tokens == hf_greedy(prompts[4], -1)
  bad = next(iter(eng.run([Request("x", prompts[0], adapter=3)])))
  assert bad.finish_reason == "error" and "adapter 3" in bad.error
  eng.allocator.check()
  for tree in eng.caches:
    tree.check()
  assert len(eng.caches) == 4
