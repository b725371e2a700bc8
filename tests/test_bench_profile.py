"""bench/profile_decode.py: HLO op names map to categories, and a trace of a
small jitted function attributes its time to the ops that ran."""

import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import ops
from jaxkv.config import COMPILER_OPTIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import profile_decode


def test_categories():
  c = profile_decode.category
  assert c("jit(f)/while/body/attention/paged_attention_reference/dot_general") == "attention"
  assert c("jit(f)/while/body/jit(dynamic_index_in_dim)/dynamic_slice") == "weight slice"
  assert c("jit(f)/while/body/mlp/dot_general") == "matmul"
  assert c("jit(f)/while/body/scatter") == "KV write"
  assert c("jit(f)/while/body/rsqrt") == "other"


def test_trace_attributes_time_to_ops():
  rng = np.random.default_rng()
  x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
  pool = jnp.asarray(rng.standard_normal((65, 2, 64)), jnp.float32)
  slot_map = jnp.arange(1, 65, dtype=jnp.int32).reshape(2, 32)

  def f(x, w, pool):
    q = (x @ w).reshape(2, 32, 4, 64)
    return ops.paged_attention(q, pool, pool, slot_map,
                               jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (2, 32)),
                               impl="reference").sum()

  jf = jax.jit(f, compiler_options=COMPILER_OPTIONS).lower(x, w, pool).compile()
  names = profile_decode.op_names(jf.as_text())
  assert names and all(isinstance(v, str) for v in names.values())
  cats = {profile_decode.category(v) for v in names.values()}
  assert {"matmul", "attention"} <= cats, cats
  jax.block_until_ready(jf(x, w, pool))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(3):
        jax.block_until_ready(jf(x, w, pool))
    times = profile_decode.op_times(d, names)
  assert times and set(times) <= set(names)
  assert all(t > 0 for t in times.values())
  assert "attention" in {profile_decode.category(names[n]) for n in times}
