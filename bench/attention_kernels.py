"""Attention kernels: the floor (FLOPs, bytes), then measured time, side by side.

    python bench/attention_kernels.py [--contexts=1024,8192,32768] [--batches=1,8,64]
        [--groups=3,7] [--dead=0,0.5,0.9] [--lora_contexts=4096,...,65536]
        [--tune | --knobs=block_k=128,...] [--split_probe=16,32,64] [--interpret]
        [--out=rows.json]

One layer of attention with 8 KV heads of dimension 128 and G = Hq / Hkv query
heads per KV head (GQA 3 and 7), page size 16, over a paged pool whose pages
are laid end to end (what a fresh sequence gets). Rows, one run, same inputs:

- decode (one query per row) at every context x batch x G x dead fraction:
  jaxkv's Pallas kernel (its plan, compaction + live-block tables, built in every
  call) | the same with the plan built once outside the timed loop, as a forward
  pass shares it across layers | jaxkv's Mosaic GPU kernel (whole pages by TMA,
  `--mosaic`), per call and planned | the kernel with every block on the gather path
  (`contiguous=False`) | the XLA reference (gather + masked softmax) |
  materialise-then-attend (gather K/V dense, then `jax.nn.dot_product_attention`)
  | JAX's own `pallas.ops.gpu.paged_attention` (block tables over
  [Hkv, pages, 16, D]). Dead tokens are evicted at random (`tokens`: IntentKV
  holes, every 64-key block stays live) or a page at a time (`pages`: whole
  blocks die and are skipped). JAX's kernel and the dense baselines cannot skip
  dead tokens, so on a GPU they run only at dead 0, where every method reads the
  same bytes (on a CPU the reference, the only timed row, runs at every fraction).
- prefill, batch 1, a 512-token chunk at the end of the context: Pallas | Mosaic |
  reference.
- Flash-LoRA decode, batch 8, a different adapter per row, r = 8: Flash-LoRA |
  the same planned | Flash-LoRA on Mosaic GPU (`--mosaic`) | materialise
  V_base + V_lr B_i then the paged kernel | the XLA reference.

Timing: each call runs `--iters` times inside one jitted `fori_loop`, each time
on another layer of a stacked pool (the kernels read layer l in place), with
enough layers that the bytes cycled exceed 4x the L2 cache, so no call is served
from L2; the median of 5 such runs over `--iters` is the time per call. "bw %" is
live bytes moved per second (K/V of live tokens read once, q read, o written, slot
ids) over the measured device
copy bandwidth (a 4 GiB float32 array incremented in place 20 times in one
jitted loop, bytes read + written); the floor is
max(bytes / bandwidth, FLOPs / measured matmul peak).

`--tune` first times a few (block_k, num_warps, num_stages, k_splits) settings
at 32k x batch 8 x G 7 and runs the sweep with the fastest; Flash-LoRA is tuned on
its own at 16k x batch 8 (on an H100, paged attention's best, block_k 128, made
Flash-LoRA 12x slower than block_k 64; its default is 32). `--split_probe` times
batch-1 decode at the largest context with the plan built once and each k_splits. On
a CPU-only machine the Pallas kernels cannot run natively (the interpreter is a correctness tool):
only the reference rows are timed and the table says so.
"""

from __future__ import annotations

import functools
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

import common
from pallas_kernels import flash_lora_attention as fla
from pallas_kernels import flash_lora_mosaic as flm
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_attention_mosaic as pm

HKV, D, RANK, PAGE = 8, 128, 8, 16
LORA_G = 4             # Flash-LoRA rows: Llama-3-8B heads (32 / 8), as LRAgent's models
L2_BYTES = 60 << 20    # H200 L2 (H100: 50 MB); the pool cycles through >= 4x this per loop
TUNE = [dict(block_k=64, num_warps=4, num_stages=2), dict(block_k=128, num_warps=4, num_stages=2),
        dict(block_k=64, num_warps=4, num_stages=3), dict(block_k=128, num_warps=8, num_stages=3),
        dict(block_k=32, num_warps=4, num_stages=4), dict(block_k=64, num_warps=8, num_stages=2),
        dict(block_k=64, num_warps=4, num_stages=2, k_splits=32),
        dict(block_k=128, num_warps=4, num_stages=3, k_splits=32)]
# Flash-LoRA tiles hold a third accumulator and the [block_k, 16] V_lr gather, so
# its best tiling differs from paged attention's: it is tuned on its own (at 16k).
LORA_TUNE = [dict(block_k=64, num_warps=4, num_stages=2),
             dict(block_k=32, num_warps=4, num_stages=2),
             dict(block_k=64, num_warps=4, num_stages=3),
             dict(block_k=64, num_warps=8, num_stages=2),
             dict(block_k=128, num_warps=8, num_stages=2),
             dict(block_k=128, num_warps=4, num_stages=2)]
LORA_KEYS = ("q", "k_pool", "v_pool", "vlr_pool", "lora_b", "slot_map", "q_positions")
KEYS = ("q", "k_pool", "v_pool", "slot_map", "q_positions")
# The Mosaic GPU kernel's tiling: pages (of 16 keys) per pipeline step, steps in flight.
# K + V of one step take 2 * 16 * pages_per_step * D * 2 bytes of shared memory
# (32 KB at 4 pages, D 128); an H100 / H200 block has 227 KB with the q and o tiles.
# stage_starts=False: each step reads its page starts from global memory (the default
# stages them in shared memory once per program).
MOSAIC_TUNE = [dict(pages_per_step=4, stages=3), dict(pages_per_step=4, stages=3,
                                                     stage_starts=False),
               dict(pages_per_step=4, stages=2), dict(pages_per_step=4, stages=2,
                                                     stage_starts=False),
               dict(pages_per_step=4, stages=4), dict(pages_per_step=4, stages=6),
               dict(pages_per_step=8, stages=2), dict(pages_per_step=8, stages=3)]


def layers_for(nbytes: int, cap_bytes: int) -> int:
  """Layers of the stacked pool: enough that one timed loop cycles >= 4x L2."""
  return int(max(1, min(64, math.ceil(4 * L2_BYTES / max(nbytes, 1)),
                        cap_bytes // max(nbytes, 1))))


def slot_map_for(batch: int, context: int, dead: float, layout: str, rng) -> np.ndarray:
  """Row b holds slots PAGE + b*context ... (pages end to end on the page grid, as the
  allocator lays a sequence out; page 0 holds SENTINEL and is never handed out); a `dead`
  share of tokens (`tokens`) or of pages (`pages`) is evicted. Every row keeps its last
  token (the query's own)."""
  sm = (PAGE + np.arange(batch * context, dtype=np.int32)).reshape(batch, context)
  if dead:
    if layout == "tokens":
      kill = rng.random(sm.shape) < dead
    else:
      kill = np.repeat(rng.random((batch, context // PAGE)) < dead, PAGE, axis=1)
    kill[:, -1] = False
    sm[kill] = 0
  return sm


def make_inputs(batch: int, context: int, q_len: int, groups: int, dtype, *, layers: int = 1,
                rank: int | None = None, dead: float = 0.0, layout: str = "tokens", seed=0):
  """Random stacked pools [layers, PAGE + batch*context, Hkv, D] and a slot map."""
  key = jax.random.split(jax.random.key(seed), 5)
  slots = PAGE + batch * context
  sm = slot_map_for(batch, context, dead, layout, np.random.default_rng(seed))

  def pool(k, *shape):
    return jax.random.normal(k, (layers, slots, *shape), dtype).at[:, 0].set(0)

  q_pos = np.broadcast_to(context - q_len + np.arange(q_len, dtype=np.int32), (batch, q_len))
  out = dict(q=jax.random.normal(key[2], (batch, q_len, HKV * groups, D), dtype),
             k_pool=pool(key[0], HKV, D), v_pool=pool(key[1], HKV, D),
             slot_map=jnp.asarray(sm), q_positions=jnp.asarray(q_pos))
  if rank:
    out["vlr_pool"] = pool(key[3], rank)
    out["lora_b"] = 0.1 * jax.random.normal(key[4], (batch, rank, HKV, D), dtype)
  return out


def jax_dense_paged(a):
  """Our dense pool as JAX's layout, converted once outside the timed loop:
  (q, k_pages [Hkv, layers * pages, page, D], v_pages, block tables of layer 0,
  lengths). JAX's kernel applies no softmax scale, so q is pre-scaled."""
  b, t = a["slot_map"].shape
  k_pool, v_pool = a["k_pool"], a["v_pool"]
  if k_pool.ndim == 3:
    k_pool, v_pool = k_pool[None], v_pool[None]
  layers = k_pool.shape[0]

  def pages(pool):   # each layer's slots PAGE.. -> pages; layers stacked along pages
    return pool[:, PAGE:].reshape(layers * b * t // PAGE, PAGE, HKV, D).transpose(2, 0, 1, 3)

  tables = jnp.arange(b * t // PAGE, dtype=jnp.int32).reshape(b, t // PAGE)
  lengths = jnp.full((b,), t, jnp.int32)
  q = (a["q"][:, 0] * D ** -0.5).astype(a["q"].dtype)
  return q, pages(k_pool), pages(v_pool), tables, lengths


def jax_paged_call(x, layer, **kw):
  """JAX's kernel on layer `layer` of `jax_dense_paged`'s output (tables offset)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
  q, k_pages, v_pages, tables, lengths = x
  tables = tables + layer * tables.size
  return jax_pa.paged_attention(q, k_pages, v_pages, tables, lengths,
                                pages_per_compute_block=4, **kw)


def dense_then_attend(q, k_pool, v_pool, slot_map, q_positions, *, layer=0):
  """Materialise-then-attend: gather the row's K/V into dense [B, T, Hkv, D], then
  jax.nn.dot_product_attention with the visibility mask."""
  k, v = k_pool[layer][slot_map], v_pool[layer][slot_map]
  mask = pa.attention_mask(slot_map, q_positions)[:, None]          # [B, 1, Tq, T]
  return jax.nn.dot_product_attention(q, k, v, mask=mask)


def materialize_then_attend(q, k_pool, v_pool, vlr_pool, lora_b, slot_map, q_positions, *,
                            layer=0, **kernel_kw):
  """The naive LRAgent path: build V_i = V_base + V_lr B_i for every token, then attend."""
  if k_pool.ndim == 3:
    k_pool, v_pool, vlr_pool = k_pool[None], v_pool[None], vlr_pool[None]
  b, t = slot_map.shape
  v = (v_pool[layer][slot_map].astype(jnp.float32)
       + jnp.einsum("btr,brhd->bthd", vlr_pool[layer][slot_map].astype(jnp.float32),
                    lora_b.astype(jnp.float32))).astype(v_pool.dtype)
  k = k_pool[layer][slot_map]
  dense = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) + 1   # slot 0 stays dead
  pad = lambda x: jnp.concatenate([jnp.zeros((1, HKV, D), x.dtype), x.reshape(b * t, HKV, D)])
  return pa.paged_attention(q, pad(k), pad(v), dense, q_positions, **kernel_kw)


_LOOPS: dict = {}


def per_call_seconds(fn, a, layers: int, iters: int) -> float:
  """Seconds per call of fn(a, layer): `iters` calls in one jitted fori_loop, layer
  cycling through the stacked pool; median of 5 runs (compiled and warmed first).
  The jitted loop is kept per (fn, layers, iters), so inputs of the same shapes
  (another dead fraction) reuse its compilation."""
  key = (fn, layers, iters)
  if key not in _LOOPS:
    def loop(a):
      def body(i, acc):
        return acc + fn(a, i % layers).reshape(-1)[0].astype(jnp.float32)
      return lax.fori_loop(0, iters, body, jnp.float32(0))
    _LOOPS[key] = jax.jit(loop)
  return common.timeit(_LOOPS[key], a, reps=5) / iters


def floor_s(cost, bw_gbs, tflops):
  return max(cost["bytes"] / (bw_gbs * 1e9), cost["flops"] / (tflops * 1e12))


PLAN_KNOBS = ("block_r", "block_k", "k_splits", "contiguous")


def split_knobs(knobs: dict) -> tuple[dict, dict]:
  """Tiling knobs -> (make_plan's, the kernel call's own: num_warps, num_stages)."""
  return ({k: v for k, v in knobs.items() if k in PLAN_KNOBS},
          {k: v for k, v in knobs.items() if k not in PLAN_KNOBS})


def planned(a, make=pa.make_plan, **plan_kw):
  """a + the plan its slot map needs, built once (untimed): what a forward pass
  does for all of its layers that share one slot map."""
  plan = jax.jit(functools.partial(make, num_heads=a["q"].shape[2],
                                   num_kv_heads=a["k_pool"].shape[-2], **plan_kw))(
                                       a["slot_map"], a["q_positions"])
  return {**a, "plan": plan}


def with_shift(a, seed=0):
  """a + a key shift for every key (timed as if each were in a MemArt block read at a
  new position: the kernels' cost does not depend on which keys are shifted) and
  RoPE's delta frequencies (theta 10,000)."""
  shift = jax.random.randint(jax.random.key(seed), a["slot_map"].shape, -4096, 4096, jnp.int32)
  freq = 10000.0 ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
  return {**a, "key_shift": shift, "shift_freq": freq}


def mosaic_call(a, layer, **kw):
  """The Mosaic GPU kernel on layer `layer` (its plan from `a` when planned)."""
  return pm.paged_attention(*(a[k] for k in KEYS), layer=layer, plan=a.get("plan"), **kw)


def decode_impls(kernels: bool, knobs: dict, mosaic_knobs: dict | None = None,
                 shifted: bool = False):
  """(name, prepare(a) -> x (untimed), fn(x, layer) (timed), dense only) per decode row.

  jaxkv_pallas builds its plan (compaction + live-block tables) in every call, as
  one layer alone would; jaxkv_planned takes it built once, as the layers of one
  forward pass share it (`ops.attention_plan`). jaxkv_mosaic(_planned): the Mosaic
  GPU kernel (pallas_kernels/paged_attention_mosaic.py) the same two ways. With
  `shifted`, *_shifted rows: the same planned kernels rotating every key on read
  (`with_shift`), with nothing dead."""
  keys = ("q", "k_pool", "v_pool", "slot_map", "q_positions")
  same = lambda a: a
  ours = lambda **kw: lambda a, l: pa.paged_attention(*(a[k] for k in keys), layer=l, **kw)
  plan_kw, call_kw = split_knobs(knobs)
  impls = [("xla_reference", same,
            lambda a, l: pa.paged_attention_reference(*(a[k] for k in keys), layer=l), kernels),
           ("materialise_then_attend", same,
            lambda a, l: dense_then_attend(*(a[k] for k in keys), layer=l), True)]
  if kernels:
    impls = [("jaxkv_pallas", same, ours(**knobs), False),
             ("jaxkv_planned", functools.partial(planned, **plan_kw),
              lambda a, l: pa.paged_attention(*(a[k] for k in keys), layer=l, plan=a["plan"],
                                              **call_kw), False),
             ("jaxkv_gather_only", same, ours(**knobs, contiguous=False), True),
             ("jax_pallas_ops_gpu", jax_dense_paged,
              functools.partial(jax_paged_call, interpret=knobs.get("interpret", False)),
              True)] + impls
  interp = {"interpret": True} if knobs.get("interpret") else {}
  if kernels and mosaic_knobs is not None:
    impls[2:2] = [("jaxkv_mosaic", same,
                   functools.partial(mosaic_call, **mosaic_knobs, **interp), False),
                  ("jaxkv_mosaic_planned", lambda a: planned(
                      a, make=pm.make_page_plan, num_slots=a["k_pool"].shape[-3],
                      **mosaic_knobs),
                   functools.partial(mosaic_call, **interp), False)]
  if kernels and shifted:
    shift_kw = lambda a: dict(key_shift=a["key_shift"], shift_freq=a["shift_freq"])

    def planned_shifted(a, **kw):
      x = with_shift(a)
      return planned(x, key_shift=x["key_shift"], **kw)
    impls.append(("jaxkv_planned_shifted", lambda a: planned_shifted(a, **plan_kw),
                  lambda a, l: pa.paged_attention(*(a[k] for k in keys), layer=l,
                                                  plan=a["plan"], **shift_kw(a), **call_kw),
                  True))
    if mosaic_knobs is not None:
      impls.append(("jaxkv_mosaic_shifted", lambda a: planned_shifted(
          a, make=pm.make_page_plan, num_slots=a["k_pool"].shape[-3], **mosaic_knobs),
                    lambda a, l: mosaic_call(a, l, **shift_kw(a), **interp), True))
  return impls


def add_ratios(rows):
  """'time / jaxkv': each row's time over the jaxkv kernel's on the same shape with
  nothing dead (so the dead-fraction rows read as the share of the dense time they
  take); over the group's first row where no jaxkv kernel ran, as on a CPU."""
  groups = {}
  for r in rows:
    if r["bench"] == "tune":
      continue
    groups.setdefault((r["bench"], r["batch"], r["context"], r["groups"]), []).append(r)
  for group in groups.values():
    base = next((r for r in group if r["impl"] in ("jaxkv_pallas", "jaxkv_flash_lora", "jaxkv_k16")
                 and not r["dead"]), group[0])
    for r in group:
      r["vs_jaxkv"] = r["time_ms"] / base["time_ms"]
  return rows


FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this
  module next to other absl scripts never clashes)."""
  flags.DEFINE_string("contexts", None, "decode contexts (default by backend)")
  flags.DEFINE_string("batches", None, "decode batches (default by backend)")
  flags.DEFINE_string("groups", "3,7", "query heads per KV head (GQA)")
  flags.DEFINE_string("dead", None, "dead fractions (default 0,0.5,0.9 on GPU, 0,0.5 on CPU)")
  flags.DEFINE_string("dead_layouts", "tokens,pages", "how dead tokens fall: tokens | pages")
  flags.DEFINE_string("prefill_contexts", None, "prefill contexts (default by backend)")
  flags.DEFINE_string("lora_contexts", None, "Flash-LoRA contexts (default by backend)")
  flags.DEFINE_integer("lora_batch", 8, "Flash-LoRA decode batch")
  flags.DEFINE_integer("iters", 20, "calls per timed loop")
  flags.DEFINE_boolean("tune", False, "pick the kernel's tiling at 32k x 8 x G7 first")
  flags.DEFINE_boolean("mosaic", True, "time the Mosaic GPU paged-attention kernel too "
                       "(decode and prefill rows jaxkv_mosaic*)")
  flags.DEFINE_boolean("lora", True, "the Flash-LoRA rows")
  flags.DEFINE_boolean("shifted", True, "decode rows with every key rotated on read "
                       "(jaxkv_planned_shifted, jaxkv_mosaic_shifted; nothing dead)")
  flags.DEFINE_string("knobs", None, "paged-attention tiling instead of tuning, e.g. "
                      "block_k=128,num_warps=4,num_stages=2")
  flags.DEFINE_string("split_probe", None, "batch-1 decode at the largest context with "
                      "these k_splits (plan built once), e.g. 16,32,64,128 (default: none)")
  flags.DEFINE_string("dtype", None, "default bfloat16 on GPU, float32 on CPU")
  flags.DEFINE_boolean("interpret", False, "run the Pallas rows in the interpreter (checks "
                       "the script's kernel paths on a CPU; its times mean nothing)")
  flags.DEFINE_string("out", None, "write JSON rows here")


def _ints(csv, default):
  """'1,2' -> [1, 2]; None -> the default; '' -> [] (skip that part)."""
  csv = default if csv is None else csv
  return [int(c) for c in csv.split(",") if c]


def parse_knobs(text: str | None) -> dict:
  """'block_k=128,num_warps=4' -> {'block_k': 128, 'num_warps': 4}."""
  out = {}
  for item in filter(None, (text or "").split(",")):
    k, _, v = item.partition("=")
    if k not in PLAN_KNOBS + ("num_warps", "num_stages") or not v.lstrip("-").isdigit():
      raise app.UsageError(f"--knobs: bad item {item!r}")
    out[k] = int(v)
  return out


def main(argv):
  del argv
  args = FLAGS
  gpu = jax.default_backend() == "gpu"
  kernels_on = gpu or args.interpret     # Pallas rows: compiled on a GPU, else interpreted
  dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
  contexts = _ints(args.contexts, "1024,8192,32768" if gpu else "256,1024")
  batches = _ints(args.batches, "1,8,64" if gpu else "1,2")
  groups = _ints(args.groups, "3,7")
  deads = [float(x) for x in (args.dead or ("0,0.5,0.9" if gpu else "0,0.5")).split(",")]
  layouts = args.dead_layouts.split(",")
  prefill_contexts = _ints(args.prefill_contexts, "4096,16384" if gpu else "1024")
  lora_contexts = _ints(args.lora_contexts, "4096,8192,16384,32768,65536" if gpu else "256,1024")
  bw = common.copy_bandwidth_gbs(4 << 30 if gpu else 1 << 26)
  tflops = common.matmul_gflops(8192 if gpu else 512, dtype=dtype) / 1e3
  cap = (24 << 30) if gpu else (256 << 20)     # pool bytes per input set
  isz = dtype.itemsize
  device = jax.devices()[0].device_kind
  rows = []

  def record(bench, impl, batch, context, q_len, g, dead, layout, cost, secs, **kw):
    rows.append({"bench": bench, "impl": impl, "batch": batch, "context": context,
                 "q_len": q_len, "groups": g, "dead": dead, "layout": layout,
                 "flops": cost["flops"], "bytes": cost["bytes"],
                 "floor_ms": 1e3 * floor_s(cost, bw, tflops), "time_ms": 1e3 * secs,
                 "achieved_gbs": cost["bytes"] / secs / 1e9,
                 "bw_pct": 100 * cost["bytes"] / secs / 1e9 / bw, "copy_gbs": bw,
                 "device": device,
                 "dtype": dtype.name, "jax": jax.__version__, **kw})

  def flush():   # rows so far, so a run cut short keeps what it measured
    if args.out:
      with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)

  def timed(fn, a, layers):
    try:
      return per_call_seconds(fn, a, layers, args.iters)
    except Exception as e:  # one failing method must not lose the rest of the sweep
      print(f"  FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
      return None

  def tune(name, call, a, layers, settings):
    """The fastest of `settings` for `call(a, layer, **knobs)`; {} if all fail."""
    best = None
    for kn in settings:
      t = timed(lambda a, l, kn=kn: call(a, l, **kn), a, layers)
      print(f"tune {name} {kn}: {'failed' if t is None else f'{1e3 * t:.3f} ms'}", flush=True)
      rows.append({"bench": "tune", "kernel": name, **kn, "time_ms": t and 1e3 * t,
                   "device": device})
      if t and (best is None or t < best[0]):
        best = (t, kn)
    print(f"tuned {name}: {best[1] if best else 'defaults'}", flush=True)
    return best[1] if best else {}

  knobs, lora_knobs = parse_knobs(args.knobs), {}
  if args.interpret:
    knobs, lora_knobs = {**knobs, "interpret": True}, {"interpret": True}
  if args.tune and gpu and not knobs:
    a = make_inputs(8, 32768, 1, 7, dtype, layers=2)
    knobs = tune("paged_attention", lambda a, l, **kn: pa.paged_attention(
        a["q"], a["k_pool"], a["v_pool"], a["slot_map"], a["q_positions"], layer=l, **kn),
                 a, 2, TUNE)
    del a
    if lora_contexts:
      a = make_inputs(args.lora_batch, 16384, 1, LORA_G, dtype, layers=2, rank=RANK)
      lora_knobs = tune("flash_lora", lambda a, l, **kn: fla.flash_lora_attention(
          *(a[k] for k in LORA_KEYS), layer=l, **kn), a, 2, LORA_TUNE)
      del a

  mosaic_knobs = {} if args.mosaic else None
  if args.tune and gpu and args.mosaic:
    a = make_inputs(8, 32768, 1, 7, dtype, layers=2)
    mosaic_knobs = tune("mosaic", lambda a, l, **kn: mosaic_call(a, l, **kn), a, 2, MOSAIC_TUNE)
    del a
  impls = decode_impls(kernels_on, knobs, mosaic_knobs, args.shifted)
  for ctx, batch, g in itertools.product(contexts, batches, groups):
    one = 2 * batch * ctx * HKV * D * isz
    layers = layers_for(one, cap)
    for dead, layout in [(0.0, "-")] + [(d, lay) for d in deads if d for lay in layouts]:
      a = make_inputs(batch, ctx, 1, g, dtype, layers=layers, dead=dead, layout=layout)
      live = int((np.asarray(a["slot_map"]) != 0).sum()) // batch
      cost = pa.cost(batch, 1, live, HKV * g, HKV, D, isz, isz)
      for name, prepare, fn, dense_only in impls:
        if dense_only and dead:
          continue
        x = prepare(a)
        t = timed(fn, x, layers)
        del x
        if t is not None:
          record("decode", name, batch, ctx, 1, g, dead, layout, cost, t)
          r = rows[-1]
          print(f"decode {name} ctx={ctx} B={batch} G={g} dead={dead} {layout}: "
                f"{r['time_ms']:.4f} ms, {r['bw_pct']:.0f}% bw", flush=True)
      flush()
      del a

  if args.split_probe and kernels_on:
    ctx, g = max(contexts), 7
    plan_kw, call_kw = split_knobs(knobs)
    a = make_inputs(1, ctx, 1, g, dtype, layers=layers_for(2 * ctx * HKV * D * isz, cap))
    layers = a["k_pool"].shape[0]
    cost = pa.cost(1, 1, ctx, HKV * g, HKV, D, isz, isz)
    keys = ("q", "k_pool", "v_pool", "slot_map", "q_positions")
    for ks in _ints(args.split_probe, ""):
      x = planned(a, **{**plan_kw, "k_splits": ks})
      t = timed(lambda a, l: pa.paged_attention(*(a[k] for k in keys), layer=l,
                                                plan=a["plan"], **call_kw), x, layers)
      if t:
        record("splits", f"jaxkv_k{ks}", 1, ctx, 1, g, 0.0, "-", cost, t, k_splits=ks)
        print(f"splits k={ks} ctx={ctx} B=1: {1e3 * t:.4f} ms", flush=True)
      flush()
    del a

  for ctx in prefill_contexts:
    g = 7
    a = make_inputs(1, ctx, 512, g, dtype, layers=layers_for(2 * ctx * HKV * D * isz, cap))
    layers = a["k_pool"].shape[0]
    cost = pa.cost(1, 512, ctx, HKV * g, HKV, D, isz, isz)
    keys = ("q", "k_pool", "v_pool", "slot_map", "q_positions")
    t_ref = timed(lambda a, l: pa.paged_attention_reference(*(a[k] for k in keys), layer=l),
                  a, layers)
    if kernels_on:
      t = timed(lambda a, l: pa.paged_attention(*(a[k] for k in keys), layer=l, **knobs),
                a, layers)
      if t:
        record("prefill", "jaxkv_pallas", 1, ctx, 512, g, 0.0, "-", cost, t)
      if mosaic_knobs is not None:
        interp = {"interpret": True} if args.interpret else {}
        t = timed(functools.partial(mosaic_call, **mosaic_knobs, **interp), a, layers)
        if t:
          record("prefill", "jaxkv_mosaic", 1, ctx, 512, g, 0.0, "-", cost, t)
    if t_ref:
      record("prefill", "xla_reference", 1, ctx, 512, g, 0.0, "-", cost, t_ref)
    print(f"prefill ctx={ctx} done", flush=True)
    flush()
    del a

  for ctx in lora_contexts if args.lora else ():
    b = args.lora_batch
    one = b * ctx * (2 * HKV * D + RANK) * isz
    a = make_inputs(b, ctx, 1, LORA_G, dtype, layers=layers_for(one, cap), rank=RANK)
    layers = a["k_pool"].shape[0]
    cost = fla.cost(b, 1, ctx, HKV * LORA_G, HKV, D, RANK, isz, isz)
    methods = [("xla_reference", lambda a, l: fla.flash_lora_attention_reference(
        *(a[k] for k in LORA_KEYS), layer=l), a)]
    if kernels_on:
      lplan_kw, lcall_kw = split_knobs(lora_knobs)
      methods = [("jaxkv_flash_lora", lambda a, l: fla.flash_lora_attention(
                      *(a[k] for k in LORA_KEYS), layer=l, **lora_knobs), a),
                 ("jaxkv_flash_lora_planned", lambda a, l: fla.flash_lora_attention(
                      *(a[k] for k in LORA_KEYS), layer=l, plan=a["plan"], **lcall_kw),
                  planned(a, make=fla.make_plan, **lplan_kw)),
                 ("materialise_then_attend", lambda a, l: materialize_then_attend(
                      *(a[k] for k in LORA_KEYS), layer=l, **knobs), a)] + methods
      if mosaic_knobs is not None:     # Flash-LoRA on Mosaic GPU, on the same page plan
        interp = {"interpret": True} if args.interpret else {}
        methods[2:2] = [("jaxkv_flash_lora_mosaic", lambda a, l: flm.flash_lora_attention(
            *(a[k] for k in LORA_KEYS), layer=l, **mosaic_knobs, **interp), a)]
    for name, fn, x in methods:
      t = timed(fn, x, layers)
      if t:
        record("flash_lora", name, b, ctx, 1, LORA_G, 0.0, "-", cost, t)
    del methods
    print(f"flash_lora ctx={ctx}: " + ", ".join(
        f"{r['impl']} {r['time_ms']:.4f} ms" for r in rows if r["bench"] == "flash_lora"
        and r["context"] == ctx), flush=True)
    flush()
    del a

  print(f"\n{device} ({jax.default_backend()}), jax {jax.__version__}, {dtype.name}; "
        f"measured copy bandwidth {bw:.0f} GB/s, matmul {tflops:.1f} TFLOP/s; "
        f"Hkv={HKV} D={D} page={PAGE} r={RANK}; paged-attention knobs {knobs or 'defaults'}, "
        f"Flash-LoRA knobs {lora_knobs or 'defaults'}, Mosaic knobs "
        f"{mosaic_knobs or 'defaults'}")
  if not kernels_on:
    print("No GPU: Pallas kernels were not timed (interpret mode is not a speed path); "
          "reference rows only.")
  common.print_table(*table(add_ratios(rows)))
  common.write_rows(args.out, rows)


def table(rows):
  """(header, lines) of the measured rows (after `add_ratios`)."""
  hdr = ("bench", "impl", "B", "ctx", "G", "dead", "GB moved", "floor ms", "time ms",
         "GB/s", "bw %", "time / jaxkv")
  lines = [(r["bench"], r["impl"], str(r["batch"]), str(r["context"]), str(r["groups"]),
            f"{r['dead']:g} {r['layout']}".strip(" -"), f"{r['bytes'] / 1e9:.3f}",
            f"{r['floor_ms']:.3f}", f"{r['time_ms']:.3f}", f"{r['achieved_gbs']:.0f}",
            f"{r['bw_pct']:.0f}%", f"{r['vs_jaxkv']:.2f}")
           for r in rows if r["bench"] != "tune"]
  return hdr, lines


def tables(rows) -> list[common.Table]:
  """One README table per bench (decode, prefill, flash_lora), device in the title."""
  rows = add_ratios([r for r in rows if r["bench"] != "tune"])
  hdr, lines = table(rows)
  out = []
  for bench in dict.fromkeys(r["bench"] for r in rows):
    r0 = next(r for r in rows if r["bench"] == bench)
    title = (f"{bench} ({r0['device']}, jax {r0.get('jax', '?')}, {r0['dtype']}, "
             f"bw % of {r0['copy_gbs']:.0f} GB/s measured copy)")
    out.append(common.Table(title, hdr[1:], [l[1:] for l in lines if l[0] == bench]))
  return out


if __name__ == "__main__":
  define_flags()
  app.run(main)
