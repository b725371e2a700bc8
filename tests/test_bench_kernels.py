"""bench/kernels.py compares like with like: JAX's dense-layout paged attention on
our pool converted to its layout, and the materialise-then-attend LoRA baseline,
give the same result as our references (run by the Pallas interpreter here)."""

import functools
import pathlib
import sys

import jax
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import paged_attention as pa

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import kernels as bench  # noqa: E402


def test_jax_dense_layout_matches_our_reference():
  a = bench.make_inputs(2, 256, 1, np.float32, seed=np.random.randint(1 << 30))
  want = pa.paged_attention_reference(**a)[:, 0]
  got = jax.jit(functools.partial(jax_pa.paged_attention, pages_per_compute_block=4,
                                  interpret=True))(*bench.jax_dense_paged(a))
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_materialize_then_attend_matches_flash_lora_reference():
  a = bench.make_inputs(2, 96, 1, np.float32, rank=bench.RANK, seed=np.random.randint(1 << 30))
  want = fla.flash_lora_attention_reference(**a)
  got = bench.materialize_then_attend(**a, interpret=True)
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_bench_runs_and_writes_rows(tmp_path):
  from absl import flags
  out = tmp_path / "rows.json"
  before = set(flags.FLAGS)
  bench.define_flags()
  added = set(flags.FLAGS) - before
  try:                          # the script's flags exist only for this call
    flags.FLAGS(["kernels.py", "--contexts=128", "--lora_contexts=128", "--batch=2",
                 f"--out={out}"])
    bench.main([])
  finally:
    for name in added:
      delattr(flags.FLAGS, name)
  import json
  rows = json.loads(out.read_text())
  assert {r["bench"] for r in rows} == {"decode", "prefill", "flash_lora"}
  assert all(r["time_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
