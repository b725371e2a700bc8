"""The layer layouts of `jaxkv.models.llama` compute the same function.

Stacked weights run under `lax.scan`; unrolled weights (one set per layer, so
no per-layer slice copies) run in a Python loop; either stores its projections
[in, out] or [out, in] (`out_in`). The stacked [in, out] model is the reference
for the other three layouts. Every forward option goes
through both: LoRA (full and decoupled value cache), a layer window with a
hidden-state capture, query capture, selective recompute with a per-layer slot
map, and the driver's decode scan. Tolerance: fp32, atol 1e-5 (the two are
different XLA programs, so fusion may round differently); tokens identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.config import LoraConfig, ModelConfig, RopeConfig
from jaxkv.engine import driver
from jaxkv.kv import state as kv_state
from jaxkv.models import lora
from jaxkv.models.forward import Capture, LayerWindow, LoraInputs, Recompute
from jaxkv.models.llama import Transformer

ATOL = 1e-5
L = 3


@pytest.fixture(scope="module", params=[(False, None), (False, False), (True, True)],
                ids=["unrolled-out_in", "unrolled-in_out", "stacked-out_in"])
def models(request):
  scan, out_in = request.param
  cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=L,
                    num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=True,
                    rope=RopeConfig(kind="llama3", theta=500000.0, factor=8.0,
                                    original_max_position=64))
  stacked = Transformer(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
  return stacked, stacked.relayout(scan_layers=scan, out_in=out_in)


def _lora(cfg, mode):
  w = lora.MultiLoRA(cfg, LoraConfig(rank=4, targets=("q", "k", "v", "o")),
                     rngs=nnx.Rngs(1)).weights()
  key = jax.random.key(2)
  w = lora.LoraWeights(a=w.a, b={t: 0.1 * jax.random.normal(jax.random.fold_in(key, i), v.shape)
                                 for i, (t, v) in enumerate(sorted(w.b.items()))},
                       scale=w.scale)
  return LoraInputs(w, jnp.asarray([0, 2], jnp.int32), mode=mode)


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=ATOL, rtol=0)


def test_relayout_round_trip_keeps_every_parameter(models):
  stacked, other = models
  assert stacked.layers.is_stacked and not stacked.layers.out_in
  a = stacked.params()
  for b in (other.params(), other.relayout(scan_layers=True, out_in=False).params()):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
  assert stacked.relayout(scan_layers=True) is stacked
  assert other.relayout(other.layers.is_stacked, other.layers.out_in) is other
  w = other.layers.stacked() if other.layers.is_stacked else other.layers.layer(0)
  cfg = stacked.cfg
  if other.layers.out_in:      # torch's [out, in]: q's rows are its output features
    assert "wq" not in w and w["wq_t"].shape[-2:] == (cfg.num_heads * cfg.head_dim,
                                                      cfg.hidden_size)
  else:
    assert "wq_t" not in w and w["wq"].shape[-2:] == (cfg.hidden_size,
                                                      cfg.num_heads * cfg.head_dim)
  if other.layers.is_stacked:
    return
  # one jit argument per layer and weight: nothing to slice out of a stack
  n_layer = len([k for k in a if k.startswith("layers.")])
  assert len(jax.tree.leaves(nnx.state(other))) == len(a) - n_layer + L * n_layer
  with pytest.raises(ValueError, match="unrolled"):
    other.layers.stacked()


@pytest.mark.parametrize("mode", ["full", "decoupled"])
def test_every_forward_option_agrees(models, mode):
  stacked, unrolled = models
  cfg = stacked.cfg
  rng = np.random.default_rng()
  b, c = 2, 12
  tokens = jnp.asarray(rng.integers(0, 97, (b, c)))
  pos = jnp.asarray(np.broadcast_to(np.arange(c, dtype=np.int32), (b, c)))
  smap = jnp.asarray(1 + np.arange(b * c, dtype=np.int32).reshape(b, c))
  pool = kv_state.init_slots(cfg, 1 + b * c, jnp.float32, lr_rank=4 if mode == "decoupled" else 0)
  li = _lora(cfg, mode)

  def both(**kw):
    return [m(tokens, pos, pool, slot_map=smap, lora=li, **kw) for m in (stacked, unrolled)]

  full_s, full_u = both(capture=Capture(q=True, hidden_at=1))
  _close(full_s, full_u)
  assert full_u.q.shape[0] == L and full_u.hidden_at is not None
  # a window from the captured hidden state
  win_s, win_u = both(window=LayerWindow(full_s.hidden_at, 1, L))
  _close(win_s, win_u)
  # selective recompute (random per-layer subsets) over a per-layer slot map
  idx = np.full((L, b, c), -1, np.int32)
  for l in range(L):
    for r in range(b):
      keep = np.sort(rng.choice(c, rng.integers(1, c + 1), replace=False))
      idx[l, r, :len(keep)] = keep
  ws = smap
  rec_s, rec_u = both(recompute=Recompute(jnp.asarray(idx)), write_slots=ws)
  _close(rec_s, rec_u)
  per_layer = jnp.broadcast_to(smap, (L, b, c))
  pl_s, pl_u = [m(tokens, pos, pool, slot_map=per_layer, write_slots=ws, lora=li)
                for m in (stacked, unrolled)]
  _close(pl_s, pl_u)


def test_decode_scan_tokens_agree(models):
  """The jitted decode scan (the engine's hot loop) under both layouts."""
  rng = np.random.default_rng()
  b, t, n = 2, 16, 8
  outs = []
  for m in models:
    graphdef, weights = nnx.split(m)
    pool = kv_state.init_slots(m.cfg, 1 + b * (t + n), jnp.float32)
    smap = jnp.asarray(1 + np.arange(b * (t + n), dtype=np.int32).reshape(b, t + n))
    toks = jnp.asarray(rng.integers(0, 97, (b, t))) if not outs else outs[0][0]
    pos = jnp.asarray(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)))
    step, pool = driver.chunk_step(graphdef, weights, pool, toks, pos, smap,
                                   read=jnp.full((b, 1), t - 1, jnp.int32))
    res, pool = driver.decode_scan(graphdef, weights, pool, step.token,
                                   jnp.full((b,), t, jnp.int32), smap,
                                   jnp.full((b,), n, jnp.int32), num_steps=n)
    outs.append((toks, np.asarray(step.token), np.asarray(res.tokens)))
  np.testing.assert_array_equal(outs[0][1], outs[1][1])
  np.testing.assert_array_equal(outs[0][2], outs[1][2])
