"""Where a decode step's time goes: a traced `decode_scan`, broken down by category.

  python bench/profile_decode.py [--preset=smollm2-135m] [--batch=8] [--context=256]

Runs jaxkv's jitted multi-step decode (`lax.scan` over steps, `lax.scan` over
layers) on real weights, traces it with `jax.profiler`, and sums the device or
host-thread time of every XLA op per step. Each op is put in a category from
the `op_name` metadata the compiled HLO carries for it:

  matmul            dot_general outside attention (Eigen on CPU, cuBLAS on GPU)
  weight slice      per-layer dynamic-slice of the stacked [L, ...] weights
  attention         everything under jaxkv.ops.paged_attention (reference or Pallas)
  KV write          the scatters into the pool
  other             norms, RoPE, residuals, sampling, loop bookkeeping

On CPU, XLA runs independent ops of a step concurrently on its threads, so the
summed op time can exceed the wall time; and Eigen runs the matmuls' work on a
pool the trace does not see, so their op time is undercounted. Tracing slows
the run, so the untraced wall time is printed too. The shares still say what
to attack. The table lists the top ops with their HLO names and op_names, so a
finding can be traced back to the jaxpr.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import common
from jaxkv.config import PAGE_SIZE, CacheConfig
from jaxkv.engine import driver
from jaxkv.engine.llm import load
from jaxkv.engine.sampling import SamplingParams
from jaxkv.kv import plan
from jaxkv.kv import state as kv_state

CATEGORIES = (  # first match wins, tested against the op_name metadata
    ("attention", re.compile(r"paged_attention|flash_lora_attention")),
    ("weight slice", re.compile(r"dynamic_index_in_dim|dynamic_slice")),
    ("matmul", re.compile(r"dot_general|matmul|einsum")),
    ("KV write", re.compile(r"scatter")),
)


def op_names(hlo_text: str) -> dict[str, str]:
  """Instruction name -> op_name metadata, from compiled HLO text."""
  pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"")
  return {m.group(1): m.group(2) for m in map(pat.match, hlo_text.splitlines()) if m}


def category(op_name: str) -> str:
  for name, pat in CATEGORIES:
    if pat.search(op_name):
      return name
  return "other"


def op_times(trace_dir: str, names: dict[str, str]) -> dict[str, float]:
  """Summed duration (s) of every traced event that is an HLO instruction."""
  from jax.profiler import ProfileData
  (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  out = collections.Counter()
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      for ev in line.events:
        if ev.name in names:
          out[ev.name] += ev.duration_ns * 1e-9
  return out


def decode_inputs(llm, batch: int, context: int, num_steps: int):
  """A pool, a slot map and row states for `batch` rows with `context` tokens cached."""
  page = PAGE_SIZE
  width = plan.width(context + num_steps)             # as the engine sizes it
  pages_per_row = -(-width // page)
  cache = CacheConfig(num_pages=1 + batch * pages_per_row, page_size=page,
                      max_seq_len=width)
  kv = kv_state.init_pool(llm.model.cfg, cache)
  slot_map = page + np.arange(batch * pages_per_row * page).reshape(batch, -1)[:, :width]
  sampling = SamplingParams.greedy(batch)
  return dict(kv=kv, tokens=jnp.ones(batch, jnp.int32),
              positions=jnp.full(batch, context - 1, jnp.int32),
              slot_map=jnp.asarray(slot_map, jnp.int32),
              remaining=jnp.full(batch, 1 << 20, jnp.int32),
              stop_ids=jnp.asarray([-1], jnp.int32), sampling=sampling)


FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this
  module next to other absl scripts never clashes)."""
  flags.DEFINE_string("preset", "smollm2-135m", "model preset")
  flags.DEFINE_integer("batch", 8, "decode batch")
  flags.DEFINE_integer("context", 256,
                       "tokens already cached per row (slot map bucketed as the engine does)")
  flags.DEFINE_integer("steps", 16, "decode steps per call")
  flags.DEFINE_integer("reps", 3, "traced calls")
  flags.DEFINE_integer("top", 12, "ops listed individually")
  flags.DEFINE_string("attn_impl", "auto", "jaxkv.ops implementation")
  flags.DEFINE_bool("scan_layers", False,
                    "stacked weights under lax.scan (default: unrolled layers, as serving)")


def main(argv):
  del argv
  args = FLAGS

  llm = load(args.preset, scan_layers=args.scan_layers)
  graphdef, weights = llm.graphdef, llm.weights
  a = decode_inputs(llm, args.batch, args.context, args.steps)
  kw = dict(num_steps=args.steps, attn_impl=args.attn_impl, greedy_only=True)
  rest = [a[k] for k in ("tokens", "positions", "slot_map", "remaining")]
  dyn = dict(stop_ids=a["stop_ids"], sampling=a["sampling"])
  # One compile: its HLO names the traced ops, and it is the executable timed.
  # (graphdef is static, so the compiled call takes only the array arguments.)
  compiled = driver.decode_scan.lower(graphdef, weights, a["kv"], *rest, **dyn, **kw).compile()
  names = op_names(compiled.as_text())
  kv = a["kv"]
  out, kv = compiled(weights, kv, *rest, **dyn)                 # warm
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(args.reps):
    out, kv = compiled(weights, kv, *rest, **dyn)
    jax.block_until_ready(out)
  untraced = (time.perf_counter() - t0) / (args.reps * args.steps)
  with tempfile.TemporaryDirectory() as d:
    t0 = time.perf_counter()
    with jax.profiler.trace(d):
      for _ in range(args.reps):
        out, kv = compiled(weights, kv, *rest, **dyn)
        jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / (args.reps * args.steps)
    times = op_times(d, names)
  if not times:
    raise SystemExit("the trace holds no HLO op events on this backend")
  per_step = 1e3 / (args.reps * args.steps)
  total = sum(times.values())
  by_cat = collections.Counter()
  for n, t in times.items():
    by_cat[category(names[n])] += t
  print(f"{args.preset} decode, batch {args.batch}, {args.context} cached tokens per row, "
        f"{jax.default_backend()}: wall {untraced * 1e3:.1f} ms/step "
        f"({wall * 1e3:.1f} traced), "
        f"op time {total * per_step:.1f} ms/step")
  common.print_table(["category", "op ms/step", "share"],
                     [[c, f"{t * per_step:.1f}", f"{t / total:.0%}"]
                      for c, t in by_cat.most_common()])
  print()
  common.print_table(["op", "category", "ms/step", "op_name"],
                     [[n, category(names[n]), f"{t * per_step:.2f}", names[n][-70:]]
                      for n, t in times.most_common(args.top)])


if __name__ == "__main__":
  define_flags()
  app.run(main)
