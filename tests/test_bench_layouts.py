"""bench/layouts.py: every projection storage computes the same function (on fresh
random inputs, fp32, rtol / atol 1e-5), and its table renders every row."""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxkv.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import layouts


def test_every_storage_computes_the_same_gemms():
  cfg = ModelConfig(vocab_size=32, hidden_size=48, intermediate_size=80, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=12)
  rng = np.random.default_rng()
  seed = int(rng.integers(1 << 30))
  x = jnp.asarray(rng.standard_normal((5, cfg.hidden_size), dtype=np.float32))
  fn = layouts.gemms(cfg)
  ws = {s: layouts.layer_weights(cfg, s, seed) for s in layouts.STORAGES}
  assert set(ws["out_in"][0]) == {"wq_t", "wk_t", "wv_t", "wo_t", "w_gate_t", "w_up_t",
                                  "w_down_t"}
  assert ws["out_in"][0]["wq_t"].shape == (48, 48) and ws["out_in"][0]["wk_t"].shape == (24, 48)
  assert ws["fused"][0]["wqkv"].shape == (48, 96) and ws["fused"][0]["wgu"].shape == (48, 160)
  ref = np.asarray(fn(ws["in_out"], x))
  for s in layouts.STORAGES[1:]:
    np.testing.assert_allclose(np.asarray(fn(ws[s], x)), ref, rtol=1e-5, atol=1e-5)
  # a different seed draws different weights (the comparison above is not vacuous)
  other = np.asarray(fn(layouts.layer_weights(cfg, "in_out", seed + 1), x))
  assert np.abs(other - ref).max() > 1e-3


def test_table_has_a_row_per_measurement():
  rows = [{"part": "gemms", "shape": "M = 8", "storage": s, "ms": 1.0 + i,
           "vs_in_out": 1.0 / (1.0 + i)} for i, s in enumerate(layouts.STORAGES)]
  t = layouts.table(rows)
  assert len(t.lines) == len(layouts.STORAGES)
  assert t.lines[1] == ("gemms", "M = 8", "out_in", "2.00", "0.50x")
