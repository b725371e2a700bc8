"""bench/attention_kernels.py compares like with like: JAX's dense-layout paged attention on
our pool converted to its layout, and the materialise-then-attend LoRA baseline,
give the same result as our references (run by the Pallas interpreter here)."""

import functools
import pathlib
import sys

import jax
import numpy as np
import pytest

from flag_util import script_flags
from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import paged_attention as pa

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import attention_kernels as bench


def test_jax_dense_layout_matches_our_reference():
  a = bench.make_inputs(2, 256, 1, 3, np.float32, layers=2, seed=np.random.randint(1 << 30))
  x = bench.jax_dense_paged(a)
  for layer in (0, 1):   # the timed loop cycles layers through offset block tables
    want = pa.paged_attention_reference(**a, layer=layer)[:, 0]
    got = jax.jit(functools.partial(bench.jax_paged_call, interpret=True))(x, layer)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.slow
def test_mosaic_rows_run_on_page_aligned_pools_and_match_the_reference():
  """The bench's pools sit on the 16-slot page grid (Mosaic tiles the pool by 8 rows):
  both Mosaic rows (plan per call, plan built once) take the paged path and agree with
  the reference within bf16 rounding (Mosaic GPU's interpreter here)."""
  import jax.numpy as jnp

  from pallas_kernels import paged_attention_mosaic as pm
  a = bench.make_inputs(2, 256, 1, 3, jnp.bfloat16, layers=2, seed=np.random.randint(1 << 30))
  assert a["k_pool"].shape[1] % pm.PAGE == 0
  assert bool(pm.page_table(a["slot_map"], a["k_pool"].shape[1])[2])
  up = {k: a[k].astype(jnp.float32) if a[k].dtype == jnp.bfloat16 else a[k] for k in bench.KEYS}
  want = np.asarray(pa.paged_attention_reference(**up, layer=1), np.float32)
  impls = {n: (prep, fn) for n, prep, fn, _ in bench.decode_impls(True, {"interpret": True}, {})}
  for name in ("jaxkv_mosaic", "jaxkv_mosaic_planned"):
    prep, fn = impls[name]
    got = np.asarray(fn(prep(a), 1), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2, err_msg=name)   # bf16 P and inputs


def test_dense_then_attend_matches_reference():
  a = bench.make_inputs(2, 128, 1, 7, np.float32, layers=2, dead=0.5,
                        seed=np.random.randint(1 << 30))
  want = pa.paged_attention_reference(**a, layer=1)
  np.testing.assert_allclose(bench.dense_then_attend(**a, layer=1), want, atol=2e-5)


def test_dead_layouts_evict_the_asked_share():
  rng = np.random.default_rng(0)
  for layout in ("tokens", "pages"):
    sm = bench.slot_map_for(4, 4096, 0.5, layout, rng)
    assert abs((sm == 0).mean() - 0.5) < 0.03 and (sm[:, -1] != 0).all()
    if layout == "pages":   # whole pages die together
      per_page = (sm.reshape(4, -1, bench.PAGE) == 0).sum(-1)
      assert set(np.unique(per_page)) <= {0, bench.PAGE, bench.PAGE - 1}


def test_materialize_then_attend_matches_flash_lora_reference():
  a = bench.make_inputs(2, 96, 1, 4, np.float32, layers=2, rank=bench.RANK,
                        seed=np.random.randint(1 << 30))
  want = fla.flash_lora_attention_reference(**a, layer=1)
  got = bench.materialize_then_attend(**a, layer=1, interpret=True)
  np.testing.assert_allclose(got, want, atol=2e-5)


def _run_bench(tmp_path, *argv) -> list[dict]:
  """bench.main on argv; the script's flags exist only for this call. Its rows."""
  import json

  out = tmp_path / "rows.json"
  with script_flags(bench.define_flags, ["attention_kernels.py", *argv, f"--out={out}"]):
    bench.main([])
  return json.loads(out.read_text())


def test_bench_runs_and_writes_rows(tmp_path):
  rows = _run_bench(tmp_path, "--contexts=128", "--batches=2", "--groups=3", "--dead=0,0.5",
                    "--prefill_contexts=512", "--lora_contexts=128", "--lora_batch=2",
                    "--iters=2")
  assert {r["bench"] for r in rows} == {"decode", "prefill", "flash_lora"}
  assert all(r["time_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
  decode = [r for r in rows if r["bench"] == "decode"]
  # dense baselines only where nothing is dead; the dead rows count live bytes only
  assert {(r["dead"], r["layout"]) for r in decode} == {(0.0, "-"), (0.5, "tokens"),
                                                        (0.5, "pages")}
  dense = next(r for r in decode if r["dead"] == 0 and r["impl"] == "xla_reference")
  assert all(r["bytes"] < 0.9 * dense["bytes"] for r in decode if r["dead"])


@pytest.mark.slow
def test_pallas_rows_run_in_the_interpreter(tmp_path):
  """Every GPU row of the script (per-call and planned kernels, JAX's kernel, the
  split probe, Flash-LoRA planned) runs through the interpreter, so a GPU run
  does not meet them for the first time."""
  rows = _run_bench(tmp_path, "--interpret", "--contexts=256", "--batches=1", "--groups=3",
                    "--dead=0", "--prefill_contexts=", "--lora_contexts=64", "--lora_batch=2",
                    "--iters=1", "--split_probe=1,2", "--knobs=block_k=16,num_warps=4")
  impls = {(r["bench"], r["impl"]) for r in rows}
  assert {("decode", "jaxkv_pallas"), ("decode", "jaxkv_planned"),
          ("decode", "jax_pallas_ops_gpu"), ("splits", "jaxkv_k1"), ("splits", "jaxkv_k2"),
          ("flash_lora", "jaxkv_flash_lora_planned")} <= impls, impls
  assert bench.parse_knobs("block_k=128,num_stages=2") == {"block_k": 128, "num_stages": 2}
