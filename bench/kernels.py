"""Attention kernels: the floor (FLOPs, bytes), then measured time, side by side.

    python bench/kernels.py [--contexts=2048,8192,32768] [--lora_contexts=2048,...,65536]
                            [--dtype=bfloat16] [--out=results.json]

One layer of a Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head
dim 128) over a paged pool whose slot map is dense (every token live), so the
jaxkv kernel and JAX's own dense-layout `pallas.ops.gpu.paged_attention`
read the same bytes.

Rows (one run, same inputs):
- decode, batch 8, one query per row: jaxkv Pallas kernel | XLA reference
  (gather + masked softmax) | jax.experimental.pallas.ops.gpu.paged_attention
  (block tables over [Hkv, pages, page_size, D], page size 16);
- prefill, batch 1, a 512-token chunk at the end of the context: Pallas | reference;
- Flash-LoRA decode, batch 8 with a different adapter per row, r = 8:
  Flash-LoRA kernel | materialise V_base + V_lr B_i then the paged kernel |
  the XLA reference.

Floor = max(FLOPs / peak, bytes / bandwidth), bytes = K/V (and V_lr) read once
plus q read and o written; "bw %" is achieved bytes/s over the measured
device copy bandwidth (read + write of a large array). Peak FLOP/s is the
measured rate of a large matmul in the bench dtype. On a CPU-only machine the
Pallas kernels cannot run natively (the interpreter is a correctness tool,
not a speed one): only the reference rows are timed and the table says so.
"""

from __future__ import annotations

import functools

import jax
from absl import app, flags
import jax.numpy as jnp
import numpy as np

import common

from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import paged_attention as pa

HQ, HKV, D, RANK, PAGE = 32, 8, 128, 8, 16


def matmul_tflops(dtype, n: int) -> float:
  a = jnp.ones((n, n), dtype)
  return 2 * n ** 3 / common.timeit(jax.jit(lambda x: x @ x), a, reps=5) / 1e12


def make_inputs(batch: int, context: int, q_len: int, dtype, rank: int | None = None, seed=0):
  """Dense paged layout: row b holds slots 1 + b*context ... (slot 0 = SENTINEL)."""
  key = jax.random.split(jax.random.key(seed), 5)
  slots = 1 + batch * context
  k_pool = jax.random.normal(key[0], (slots, HKV, D), dtype).at[0].set(0)
  v_pool = jax.random.normal(key[1], (slots, HKV, D), dtype).at[0].set(0)
  slot_map = (1 + jnp.arange(batch * context, dtype=jnp.int32)).reshape(batch, context)
  q = jax.random.normal(key[2], (batch, q_len, HQ, D), dtype)
  q_pos = jnp.broadcast_to(context - q_len + jnp.arange(q_len, dtype=jnp.int32), (batch, q_len))
  out = dict(q=q, k_pool=k_pool, v_pool=v_pool, slot_map=slot_map, q_positions=q_pos)
  if rank:
    out["vlr_pool"] = jax.random.normal(key[3], (slots, rank), dtype).at[0].set(0)
    out["lora_b"] = 0.1 * jax.random.normal(key[4], (batch, rank, HKV, D), dtype)
  return out


def jax_dense_paged(a):
  """Our dense pool as JAX's layout: k_pages [Hkv, pages, page, D], block tables.

  JAX's kernel applies no softmax scale, so q is pre-scaled by 1/sqrt(D).
  """
  b, t = a["slot_map"].shape
  def pages(pool):
    return pool[1:].reshape(b * t // PAGE, PAGE, HKV, D).transpose(2, 0, 1, 3)
  tables = jnp.arange(b * t // PAGE, dtype=jnp.int32).reshape(b, t // PAGE)
  lengths = jnp.full((b,), t, jnp.int32)
  q = (a["q"][:, 0] * D ** -0.5).astype(a["q"].dtype)
  return q, pages(a["k_pool"]), pages(a["v_pool"]), tables, lengths


def materialize_then_attend(q, k_pool, v_pool, vlr_pool, lora_b, slot_map, q_positions, *,
                            interpret=False):
  """The naive LRAgent path: build V_i = V_base + V_lr B_i for every token, then attend."""
  b, t = slot_map.shape
  v = (v_pool[slot_map].astype(jnp.float32)
       + jnp.einsum("btr,brhd->bthd", vlr_pool[slot_map].astype(jnp.float32),
                    lora_b.astype(jnp.float32))).astype(v_pool.dtype)
  k = k_pool[slot_map]
  dense = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) + 1   # slot 0 stays dead
  pad = lambda x: jnp.concatenate([jnp.zeros((1, HKV, D), x.dtype), x.reshape(b * t, HKV, D)])
  return pa.paged_attention(q, pad(k), pad(v), dense, q_positions, interpret=interpret)


def floor_s(cost, bw_gbs, tflops):
  return max(cost["bytes"] / (bw_gbs * 1e9), cost["flops"] / (tflops * 1e12))


FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this
  module next to other absl scripts never clashes)."""
  flags.DEFINE_string("contexts", None, "decode contexts (default by backend)")
  flags.DEFINE_string("lora_contexts", None, "Flash-LoRA contexts (default by backend)")
  flags.DEFINE_integer("batch", 8, "decode batch")
  flags.DEFINE_string("dtype", None, "default bfloat16 on GPU, float32 on CPU")
  flags.DEFINE_string("out", None, "write JSON rows here")


def main(argv):
  del argv
  args = FLAGS

  gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
  contexts = [int(c) for c in (args.contexts or
                               ("2048,8192,32768" if gpu else "2048,8192")).split(",")]
  lora_contexts = [int(c) for c in (args.lora_contexts or (
      "2048,4096,8192,16384,32768,65536" if gpu else "2048,8192")).split(",")]
  bw = common.copy_bandwidth_gbs(1 << 30 if gpu else 1 << 28)
  tflops = matmul_tflops(dtype, 8192 if gpu else 1024)
  isz = dtype.itemsize
  device = jax.devices()[0].device_kind
  rows = []

  def record(bench, impl, batch, context, q_len, cost, secs, ref_secs):
    rows.append({"bench": bench, "impl": impl, "batch": batch, "context": context,
                 "q_len": q_len, "flops": cost["flops"], "bytes": cost["bytes"],
                 "floor_ms": 1e3 * floor_s(cost, bw, tflops), "time_ms": 1e3 * secs,
                 "achieved_gbs": cost["bytes"] / secs / 1e9,
                 "bw_pct": 100 * cost["bytes"] / secs / 1e9 / bw,
                 "speedup_vs_baseline": ref_secs / secs, "device": device,
                 "dtype": dtype.name})

  ref = jax.jit(pa.paged_attention_reference)
  ker = jax.jit(pa.paged_attention)
  for bench, batch, q_len, ctxs in (("decode", args.batch, 1, contexts),
                                    ("prefill", 1, 512, contexts[:2])):
    for ctx in ctxs:
      a = make_inputs(batch, ctx, q_len, dtype)
      cost = pa.cost(batch, q_len, ctx, HQ, HKV, D, isz, isz)
      t_ref = common.timeit(ref, **a)
      record(bench, "xla_reference", batch, ctx, q_len, cost, t_ref, t_ref)
      if gpu:
        record(bench, "jaxkv_pallas", batch, ctx, q_len, cost, common.timeit(ker, **a), t_ref)
        if bench == "decode":
          from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
          jf = jax.jit(functools.partial(jax_pa.paged_attention, pages_per_compute_block=4))
          record(bench, "jax_pallas_ops_gpu", batch, ctx, q_len, cost,
                 common.timeit(jf, *jax_dense_paged(a)), t_ref)
      print(f"{bench} ctx={ctx} done", flush=True)

  lref = jax.jit(fla.flash_lora_attention_reference)
  for ctx in lora_contexts:
    a = make_inputs(args.batch, ctx, 1, dtype, rank=RANK)
    cost = fla.cost(args.batch, 1, ctx, HQ, HKV, D, RANK, isz, isz)
    t_ref = common.timeit(lref, **a)
    if gpu:
      t_mat = common.timeit(jax.jit(materialize_then_attend), **a)
      record("flash_lora", "materialize_then_attend", args.batch, ctx, 1, cost, t_mat, t_mat)
      record("flash_lora", "xla_reference", args.batch, ctx, 1, cost, t_ref, t_mat)
      record("flash_lora", "jaxkv_flash_lora", args.batch, ctx, 1, cost,
             common.timeit(jax.jit(fla.flash_lora_attention), **a), t_mat)
    else:
      record("flash_lora", "xla_reference", args.batch, ctx, 1, cost, t_ref, t_ref)
    print(f"flash_lora ctx={ctx} done", flush=True)

  print(f"\n{device} ({jax.default_backend()}), jax {jax.__version__}, {dtype.name}; "
        f"measured copy bandwidth {bw:.0f} GB/s, matmul {tflops:.1f} TFLOP/s; "
        f"Hq={HQ} Hkv={HKV} D={D} r={RANK}")
  if not gpu:
    print("No GPU: Pallas kernels were not timed (interpret mode is not a speed path); "
          "reference rows only.")
  hdr = ("bench", "impl", "batch", "context", "q_len", "GFLOP", "MB moved", "floor ms",
         "time ms", "GB/s", "bw %", "speedup vs baseline")
  common.print_table(hdr, [
      (r["bench"], r["impl"], str(r["batch"]), str(r["context"]), str(r["q_len"]),
       f"{r['flops'] / 1e9:.2f}", f"{r['bytes'] / 1e6:.1f}", f"{r['floor_ms']:.3f}",
       f"{r['time_ms']:.3f}", f"{r['achieved_gbs']:.1f}", f"{r['bw_pct']:.0f}%",
       f"{r['speedup_vs_baseline']:.2f}x") for r in rows])
  common.write_rows(args.out, rows)


if __name__ == "__main__":
  define_flags()
  app.run(main)
