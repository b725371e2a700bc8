"""jaxkv.functional: pure paged inference a user can jit, vmap and differentiate.

Greedy generation equals HF `generate` on a tiny random Llama; vmap over prompts
equals the batched call; prefill + decode steps equal generate; the gradient of
a loss with respect to LoRA parameters through the paged forward equals the
gradient through the cache-free forward and is not zero.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import hf_util
from jaxkv import functional as F
from jaxkv.config import LoraConfig
from jaxkv.models import lora as lora_lib
from jaxkv.models.forward import LoraInputs

VOCAB = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  hf, model = hf_util.tiny_llama(tmp_path_factory.mktemp("tiny"), VOCAB)
  graphdef, ws = nnx.split(model)
  return hf, model, graphdef, ws


def _padded(prompts):
  c = max(len(p) for p in prompts)
  toks = np.zeros((len(prompts), c), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
  return jnp.asarray(toks), jnp.asarray([len(p) for p in prompts], jnp.int32)


def test_jitted_generate_matches_hf_and_the_step_api(tiny):
  hf, model, graphdef, ws = tiny
  rng = np.random.default_rng()
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (7, 19)]
  toks, lens = _padded(prompts)
  run = F.jit(F.generate, static_argnames=("graphdef", "num_tokens"), donate_argnames=("state",))
  state = F.init_state(model.cfg, batch=2, max_len=48, page_size=4)
  got, state = run(graphdef, ws, state, toks, lens, num_tokens=9)
  for p, row in zip(prompts, np.asarray(got)):
    with torch.no_grad():
      want = hf.generate(torch.tensor([p]), max_new_tokens=9, min_new_tokens=9,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    assert row.tolist() == want[0, len(p):].tolist()
  np.testing.assert_array_equal(np.asarray(state.lengths), np.asarray(lens) + 8)
  # the step API: prefill, then feed the argmax back one token at a time
  state = F.init_state(model.cfg, batch=2, max_len=48, page_size=4)
  logits, state = jax.jit(F.prefill, static_argnames="graphdef")(graphdef, ws, state, toks, lens)
  step = jax.jit(F.decode, static_argnames="graphdef")
  out = [jnp.argmax(logits, -1)]
  for _ in range(8):
    logits, state = step(graphdef, ws, state, out[-1].astype(jnp.int32))
    out.append(jnp.argmax(logits, -1))
  np.testing.assert_array_equal(np.stack(out, 1), np.asarray(got))


def test_vmap_over_prompts_equals_the_batched_call(tiny):
  _, model, graphdef, ws = tiny
  rng = np.random.default_rng()
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (5, 12, 9)]
  toks, lens = _padded(prompts)

  def one(t, n):
    state = F.init_state(model.cfg, batch=1, max_len=32, page_size=8)
    out, _ = F.generate(graphdef, ws, state, t[None], n[None], num_tokens=6)
    return out[0]

  mapped = jax.jit(jax.vmap(one))(toks, lens)
  batched, _ = F.generate(graphdef, ws, F.init_state(model.cfg, batch=3, max_len=32, page_size=8),
                          toks, lens, num_tokens=6)
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(batched))


def test_grad_wrt_lora_through_the_paged_forward(tiny):
  _, model, graphdef, ws = tiny
  lcfg = LoraConfig(rank=4, targets=("q", "v"), names=("a", "b"))
  params = nnx.to_pure_dict(nnx.state(lora_lib.MultiLoRA(model.cfg, lcfg, rngs=nnx.Rngs(3))))
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape),
                        params)                                   # B != 0: a real gradient
  rng = np.random.default_rng()
  toks = jnp.asarray(rng.integers(1, VOCAB, (2, 12)), jnp.int32)
  lens = jnp.asarray([12, 9], jnp.int32)
  adapters = jnp.asarray([0, 1], jnp.int32)

  def paged_loss(p):
    lora = LoraInputs(lora_lib.from_params(p, lcfg), adapters)
    state = F.init_state(model.cfg, batch=2, max_len=16, page_size=4)
    logits, _ = F.prefill(graphdef, ws, state, toks, lens, lora=lora)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, 7])

  def free_loss(p):
    lora = LoraInputs(lora_lib.from_params(p, lcfg), adapters)
    m = nnx.merge(graphdef, ws)
    pos = jnp.where(jnp.arange(12)[None] < lens[:, None], jnp.arange(12)[None], -1)
    h = m(toks, pos, lora=lora).hidden
    last = jnp.take_along_axis(h, (lens - 1)[:, None, None], axis=1)[:, 0]
    return -jnp.mean(jax.nn.log_softmax(m.logits(last))[:, 7])

  g = F.jit(jax.grad(paged_loss))(params)
  ref = jax.jit(jax.grad(free_loss))(params)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)
  assert all(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g))


def test_state_too_short_is_a_clear_error(tiny):
  _, model, graphdef, ws = tiny
  state = F.init_state(model.cfg, batch=1, max_len=16)
  with pytest.raises(ValueError, match="do not fit"):
    F.generate(graphdef, ws, state, jnp.ones((1, 10), jnp.int32), jnp.asarray([10]),
               num_tokens=8)
  with pytest.raises(ValueError, match="max_len"):
    F.init_state(model.cfg, batch=1, max_len=0)
