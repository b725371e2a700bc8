r"""Cross-prompt segment reuse (seed 002) side by side: no reuse, the radix prefix
cache, naive reuse, EPIC, CacheBlend and the tiers, on one workload built from
any ToolBench-format trace file (or, for retrieval, the Python documentation).

    python bench/reuse.py --traces=data_local/tau2_heldout.json \
        [--workload=tool_subset|retrieval|requote|perturbed] [--requests=24] \
        [--docs=data_local/texts] [--model=smollm2-135m] \
        [--methods=none,prefix,naive,epic,cacheblend,exact,approx,tiered] \
        [--storage=int8] [--out=bench/results_reuse.json] [--plot=docs/plots/reuse_drift.png]

Workloads (`jaxkv.data.reuse_workloads`): (a) tool_subset, (b) retrieval
(`--docs`: the folder scripts/fetch_texts.py made), (c) requote (only the
reviewer prompts B are scored; the producer prompts A are served in order and
fill the store), (d) perturbed: per base prompt of (a) and per perturbation
kind and fraction, a runner serves the reference, then the probe whose left
context before the longest span was perturbed; drift is measured on the probe
against no reuse, one row per (method, kind, fraction), and the curves go to
--plot (no TTFT: the pairs are not warmed).

Every method serves the same requests in the same order on its own runner (its
store starts empty and fills as it goes; `none` and `prefix` store nothing).
Per request: TTFT (prefill through the first token's logits, on the method's
second pass over the workload: a first pass on a throwaway runner compiles every
shape, and the compile time left in the timed pass, measured with
`jax.monitoring`, is reported as compile_s), the FLOPs spent and token-layers computed, and
drift against `none` on the same prompt: KL(p_none || p_method) at the first
generated token, the teacher-forced NLL of the session's gold first reply (its
first 64 tokens; delta, nats per token) and greedy agreement: the share of none's greedy
output (at most `--gen` tokens, ended at its stop token) the method reproduces position
by position, with the common prefix length (first diff). Each is a mean over the
requests with a bootstrap 95% interval over requests (the unit that varies), and the
per-request values are kept in the row (`per_request`). `--notimed` skips the warm-up
pass (quality only). Rows are written as each method finishes; a rerun skips the
methods already in --out.

Chance baselines (`reuse_tables.CHANCE`, first in the paired table, `PAIRS`): epic_random and
blend_random recompute as many tokens as EPIC / CacheBlend, drawn uniformly from each segment
(`ReuseConfig.select="random"`), and naive_norope splices without re-rotating the
keys to their new positions (`rerope=False`).

A method may carry settings, `name@field=value[@field=value]` (`method_config`:
the gates' and the sweeps' knobs, and the store's regime, e.g. `tiered@ctx_threshold=0.6`
or `tiered@regime=B@reuse_layers=8`); such a row is
paired with its base method in the paired table, and a gated row also with its base's
`@reject_random=p` row (each spliced run recomputed with probability p: the gates'
chance baseline at a matched rate). The gates are calibrated on a dev
trace file and reported on a held-out one (`scripts/calibrate_reuse_gates.py`).
"""

from __future__ import annotations

import collections
import json
import os
import time

import jax
import numpy as np
from absl import app, flags

import common
import jaxkv
import reuse_tables
from jaxkv.config import CacheConfig, EngineConfig, ReuseConfig
from jaxkv.data import calls, reuse_workloads, texts, traces
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.reuse import Reuse
from jaxkv.engine.reuse import ReuseRunner
from jaxkv.evaluation import reuse as evaluation
from jaxkv.policies.reuse import store as store_lib
from jaxkv.policies.reuse.passes import layer_flops

METHODS = {
    "none": dict(method="none"),
    "prefix": dict(method="prefix"),
    "naive": dict(method="naive"),
    "epic": dict(method="epic"),
    "cacheblend": dict(method="cacheblend"),
    "exact": dict(method="tiered", tiers=("exact",)),
    "approx": dict(method="tiered", tiers=("exact", "approx")),
    "tiered": dict(method="tiered"),
    "tiered_seed": dict(method="tiered", guard_schedule="seed"),   # the seed's W_exact(l)
    # chance baselines: as many tokens recomputed, drawn at random; no re-rotation
    "epic_random": dict(method="epic", select="random"),
    "blend_random": dict(method="cacheblend", select="random"),
    "naive_norope": dict(method="naive", rerope=False),
}
TIERS = ("exact", "approx", "blend", "naive", "epic", "reject")
OVERRIDABLE = ("ctx_threshold", "probe_reject", "reject_random", "guard_base", "blend_ratio",
               "epic_tokens", "blend_layer", "seg_threshold", "regime", "reuse_layers")
FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("traces", None, "ToolBench-format trace file the workload is built from")
  flags.DEFINE_enum("workload", "tool_subset", list(reuse_workloads.WORKLOADS),
                    "which workload (see jaxkv.data.reuse_workloads)")
  flags.DEFINE_string("docs", "data_local/texts", "retrieval: the Python docs folder "
                      f"({texts.FETCH_HINT})")
  flags.DEFINE_string("fracs", "0,0.05,0.1,0.25,0.5,1", "perturbed: context fractions")
  flags.DEFINE_string("kinds", "insert,delete,replace", "perturbed: perturbation kinds")
  flags.DEFINE_integer("bases", 3, "perturbed: base prompts (from tool_subset)")
  flags.DEFINE_string("plot", "docs/plots/reuse_drift.png", "perturbed: the drift curves PNG")
  flags.DEFINE_integer("requests", 24, "requests in the workload")
  flags.DEFINE_integer("seed", 0, "workload seed")
  flags.DEFINE_string("model", "smollm2-135m", "preset or weights path")
  flags.DEFINE_string("methods", ",".join(METHODS), f"comma list of {','.join(METHODS)}, "
                      "each optionally with @field=value settings (method_config)")
  flags.DEFINE_enum("storage", "int8", ["int8", "float16", "float32"], "segment storage")
  flags.DEFINE_integer("gen", 32, "greedy tokens compared with no reuse (at most: "
                       "each output ends at its stop token)")
  flags.DEFINE_integer("num_pages", 0, "KV pool pages (of 16 tokens) of each method's runner; "
                       "0: room for the whole workload. A small pool makes the radix cache "
                       "evict, so the store's exact tier serves what the prefix cache would")
  flags.DEFINE_enum("via", "runner", ["runner", "engine"], "runner: one request at a time "
                    "on the batch-1 ReuseRunner (timed); engine: through the batch engine's "
                    "reuse mechanism, replies decoded together (jaxkv.evaluation.reuse; "
                    "quality only, with --notimed)")
  flags.DEFINE_bool("timed", True, "a warm-up pass first, so TTFT excludes compiling "
                    "(--notimed: quality only, half the time; TTFT is not reported)")
  flags.DEFINE_integer("max_prompt", 4096, "drop longer requests")
  flags.DEFINE_string("out", None, "results JSON (rows; resumable)")
  flags.DEFINE_string("tables_from", None, "print the tables of an existing results JSON")


class CompileClock:
  """Seconds jax spent tracing, lowering and compiling since the last `take`."""

  EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    self.total = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event, duration, **_):
    if event in self.EVENTS:
      self.total += duration

  def take(self) -> float:
    t, self.total = self.total, 0.0
    return t


def _kl(p_logits, q_logits) -> float:
  lp = p_logits - np.logaddexp.reduce(p_logits)
  lq = q_logits - np.logaddexp.reduce(q_logits)
  return float(np.sum(np.exp(lp) * (lp - lq)))


GOLD = 64   # gold-reply tokens scored (padded to this many steps: one decode shape)


def serve(runner: ReuseRunner, req, gen: int, clock: CompileClock, quality: bool = True) -> dict:
  """One request: prefill, then (quality) the gold reply's NLL and greedy tokens."""
  clock.take()
  pre = runner.prefill(req.ids, req.spans)
  compile_s = clock.take()            # ~0 after the warm-up pass; reported, not subtracted
  out = dict(pre=pre, ttft=pre.ttft_s, compile_s=compile_s)
  if quality:
    cont = req.continuation[:GOLD]
    forced = np.pad(cont, (0, GOLD - cont.size), mode="edge")
    _, lp = runner.decode(pre, GOLD, forced=forced)
    runner.alloc.truncate(pre.seq, pre.ids.size)
    out["greedy"], _ = runner.decode(pre, gen, stop_ids=runner.tok.stop_ids)
    out["nll"] = float(-lp[:cont.size].mean())
  runner.release(pre.seq)
  return out


def through_engine(llm, cfg: ReuseConfig, cache: CacheConfig, requests, clock: CompileClock):
  """The workload through the batch engine (`jaxkv.evaluation.reuse`): (the runner on
  the engine's KV manager, each request's outputs as `serve` returns them). Compiling
  cannot be told apart per request here: the run's whole compile time goes on the
  first request, so the row's sum is the measured total."""
  eng = Engine(llm.model, llm.tokenizer.stop_ids, cache, EngineConfig())
  runner = ReuseRunner(llm, cfg, kv=eng.kv_manager)
  eng.add_mechanism(Reuse(runner))
  prompts = [evaluation.Prompt(r.ids, r.spans, r.continuation[:GOLD] if r.scored else None)
             for r in requests]
  clock.take()
  got = evaluation.serve_all(eng, prompts, FLAGS.gen, progress=lambda d, n: print(
      f"  {cfg.method} {d}/{n}", flush=True) if d % 8 == 0 or d == n else None)
  compile_s = clock.take()
  return runner, [dict(pre=s.pre, ttft=s.pre.ttft_s, compile_s=compile_s if i == 0 else 0.0,
                       greedy=s.greedy, nll=s.nll) for i, s in enumerate(got)]


def method_config(name: str) -> ReuseConfig:
  """The ReuseConfig of a --methods entry: a METHODS name, optionally followed by
  `@field=value` settings of OVERRIDABLE fields (the gates' and the sweeps'
  knobs), e.g. `tiered@ctx_threshold=0.6@probe_reject=0.25`; the entry is the row's
  method name."""
  base, *sets = name.split("@")
  if base not in METHODS:
    raise app.UsageError(f"unknown method {base!r} in {name!r}; known: {sorted(METHODS)}")
  kw = dict(METHODS[base])
  for item in sets:
    field, _, value = item.partition("=")
    if field not in OVERRIDABLE or not value:
      raise app.UsageError(f"{name!r}: '@{item}' is not field=value of one of {OVERRIDABLE}")
    kind = type(getattr(ReuseConfig(), field))
    try:
      kw[field] = kind(value)
    except ValueError:
      raise app.UsageError(f"{name!r}: {field} takes a {kind.__name__}, got {value!r}") from None
  try:
    return ReuseConfig(storage=FLAGS.storage, **kw)
  except ValueError as e:
    raise app.UsageError(f"{name!r}: {e}") from None


def run_method(llm, name: str, requests, ref, clock: CompileClock,
               hardware: tuple[float, float]) -> tuple[dict, list[dict]]:
  """One method over the workload: (its row, each request's outputs). `ref`: the
  outputs of `none` (None: this is none); hardware: (FLOP/s, bytes/s) for break-even."""
  cfg = method_config(name)
  need = max(r.ids.size for r in requests) + max(FLAGS.gen, GOLD) + 16
  pages = max(1024, 4 * need // 16)
  if FLAGS.num_pages:
    if FLAGS.num_pages < need // 16 + 2:
      raise app.UsageError(f"--num_pages={FLAGS.num_pages} cannot hold the longest request "
                           f"and its decode ({need // 16 + 2} pages of 16 tokens)")
    pages = FLAGS.num_pages
  cache = CacheConfig(num_pages=pages, page_size=16,
                      max_seq_len=need + 16)
  # a warm-up pass on a throwaway runner compiles every shape the timed pass will
  # meet (the store evolves identically, so the shapes repeat)
  if FLAGS.timed:
    warm = ReuseRunner(llm, cfg, cache=cache)
    for req in requests:
      serve(warm, req, FLAGS.gen, clock, quality=False)
    del warm
  t0 = time.perf_counter()
  if FLAGS.via == "engine":
    runner, served = through_engine(llm, cfg, cache, requests, clock)
  else:
    runner = ReuseRunner(llm, cfg, cache=cache)
  tiers = collections.Counter()
  per, outs = [], []
  for i, req in enumerate(requests):
    out = (served[i] if FLAGS.via == "engine" else
           serve(runner, req, FLAGS.gen, clock, quality=req.scored))
    outs.append(out)
    if not req.scored:                         # served in order, not measured
      continue
    pre = out["pre"]
    for run in pre.runs:
      tiers[run.tier] += 1
    base = out if ref is None else ref[i]
    agree, first = calls.agreement(out["greedy"], base["greedy"])
    per.append(dict(
        ttft=out["ttft"], compile_s=out["compile_s"], tokens=pre.prefill_tokens,
        flops=pre.flops, full_flops=base["pre"].flops, hit=pre.prefix_hit,
        moved=pre.bytes_spliced, kl=_kl(base["pre"].logits, pre.logits),
        dnll=out["nll"] - base["nll"], agree=agree, first_diff=first,
        n=int(pre.ids.size), reused=int(sum(r.n for r in pre.runs if r.tier != "reject")),
        runs=_runs(pre)))
    print(f"  {name} {i + 1}/{len(requests)} ttft={out['ttft']:.2f}s "
          f"tok={pre.prefill_tokens:.0f}/{pre.ids.size} runs="
          f"{','.join(r.tier for r in pre.runs) or '-'}", flush=True)
  L = llm.config.num_layers
  be = []
  if len(runner.store):
    fl = layer_flops(llm.config, 1, 0)
    keys = runner.store.keys()   # a SegmentStore: no __iter__
    be = [store_lib.break_even(runner.store.peek(k), L, fl, flops_per_s=hardware[0],
                               bytes_per_s=hardware[1]).reuses for k in keys]
  mean = lambda key: float(np.mean([p[key] for p in per]))
  return dict(**quality(per, timed=FLAGS.timed), timed=FLAGS.timed, num_pages=pages,
      method=name, workload=FLAGS.workload, tier_accept={t: tiers[t] for t in TIERS if tiers[t]},
      prefill_tokens=mean("tokens"), prompt_tokens=mean("n"), reused_tokens=mean("reused"),
      prefill_flops=mean("flops"), flops_ratio=mean("flops") / mean("full_flops"),
      ttft_s=mean("ttft"), compile_s=float(sum(p["compile_s"] for p in per)),
      bytes_stored=int(runner.store.nbytes), bytes_moved=int(
          sum(p["moved"] for p in per)), segments=len(runner.store),
      break_even_median=float(np.median(be)) if be else None, n_requests=len(per),
      storage=FLAGS.storage, wall_s=time.perf_counter() - t0,
      none_ttft_s=mean("ttft") if ref is None else float(np.mean(
          [o["ttft"] for o, r in zip(ref, requests) if r.scored]))), outs


def quality(per: list[dict], timed: bool = False) -> dict:
  """A row's drift fields from its requests': means with bootstrap 95% intervals over
  the requests (the unit that varies; `calls.mean_ci`), and the per-request values
  the paired comparisons and the gates' calibration read (`per_request`; `runs`: each
  request's matched runs, `_runs`; `ttft` when `timed`: the second, compiled pass's,
  for TTFT ratios paired by request)."""
  out = {}
  for key, field in (("kl", "kl_first_token"), ("dnll", "delta_nll"),
                     ("agree", "greedy_agreement")):
    point, lo, hi = calls.mean_ci([p[key] for p in per])
    out[field], out[field + "_ci"] = point, [lo, hi]
  out["greedy_ci"] = out.pop("greedy_agreement_ci")
  out["first_diff"] = float(np.mean([p["first_diff"] for p in per]))
  out["per_request"] = {k: [round(float(p[k]), 6) for p in per]
                        for k in ("kl", "dnll", "agree", "first_diff")}
  if all("runs" in p for p in per):
    out["per_request"]["runs"] = [p["runs"] for p in per]
  if timed:
    out["per_request"]["ttft"] = [round(float(p["ttft"]), 6) for p in per]
  return out


def _runs(pre) -> list[list]:
  """A request's matched runs for the gates' calibration: [tier, tokens, left-context
  Jaccard, probe deviation (blend; None otherwise)] each."""
  return [[r.tier, int(r.n), round(float(r.ctx_jaccard), 4),
           None if r.deviation is None else round(float(r.deviation), 5)] for r in pre.runs]


def run_perturbed(llm, name: str, pairs, ref, clock: CompileClock) -> tuple[list[dict], list]:
  """One method over workload (d): per pair, the reference is served (and stored)
  then the probe is measured, and the runner forgets both. Rows per (kind, frac)."""
  cfg = method_config(name)
  need = max(p.ids.size for _, p in pairs) + max(FLAGS.gen, GOLD) + 16
  runner = ReuseRunner(llm, cfg, cache=CacheConfig(num_pages=max(1024, 4 * need // 16),
                                                   page_size=16, max_seq_len=need + 16))
  groups, outs = collections.defaultdict(list), []
  for i, (base, probe) in enumerate(pairs):
    if name != "none":
      serve(runner, base, FLAGS.gen, clock, quality=False)
    out = serve(runner, probe, FLAGS.gen, clock)
    runner.reset()
    outs.append(out)
    b, pre = (out if ref is None else ref[i]), out["pre"]
    agree, first = calls.agreement(out["greedy"], b["greedy"])
    groups[(probe.meta["kind"], probe.meta["frac"])].append(dict(
        kl=_kl(b["pre"].logits, pre.logits), dnll=out["nll"] - b["nll"],
        agree=agree, first_diff=first, flops=pre.flops,
        full=b["pre"].flops, tiers=[r.tier for r in pre.runs],
        reused=int(sum(r.n for r in pre.runs if r.tier != "reject"))))
    print(f"  {name} {i + 1}/{len(pairs)} {probe.meta['kind']} {probe.meta['frac']:g} "
          f"runs={','.join(r.tier for r in pre.runs) or '-'}", flush=True)
  rows = []
  for (kind, frac), ps in sorted(groups.items()):
    tiers = collections.Counter(t for p in ps for t in p["tiers"])
    rows.append(dict(
        method=name, workload="perturbed", kind=kind, frac=frac,
        tier_accept={t: tiers[t] for t in TIERS if tiers[t]}, **quality(ps),
        flops_ratio=float(np.mean([p["flops"] for p in ps]) / np.mean([p["full"] for p in ps])),
        reused_tokens=float(np.mean([p["reused"] for p in ps])), n_requests=len(ps),
        storage=FLAGS.storage))
  return rows, outs


def build_workload(tokenizer):
  """The requests of --workload (pairs for perturbed)."""
  wl, n = FLAGS.workload, FLAGS.requests
  if wl == "retrieval":
    try:
      passages = texts.doc_passages(FLAGS.docs + "/" + texts.PYTHON_DOCS
                                    if os.path.isdir(FLAGS.docs + "/" + texts.PYTHON_DOCS)
                                    else FLAGS.docs)
    except FileNotFoundError as e:
      raise app.UsageError(str(e)) from e
    reqs = reuse_workloads.retrieval(passages, tokenizer, n, seed=FLAGS.seed,
                                     max_tokens=FLAGS.max_prompt)
    source = FLAGS.docs
  else:
    if not FLAGS.traces:
      raise app.UsageError("give --traces (a ToolBench-format file; make one with "
                           "scripts/make_traces.py)")
    sessions = traces.load_toolbench(FLAGS.traces)
    source = FLAGS.traces
    if wl == "requote":
      reqs = reuse_workloads.requote(sessions, tokenizer, n, seed=FLAGS.seed,
                                     max_tokens=FLAGS.max_prompt)
    else:
      reqs = reuse_workloads.tool_subset(sessions, tokenizer, FLAGS.bases if wl == "perturbed"
                                         else n, seed=FLAGS.seed, max_tokens=FLAGS.max_prompt)
  if wl == "perturbed":
    pairs = reuse_workloads.perturbed(reqs, [float(f) for f in FLAGS.fracs.split(",")],
                                      FLAGS.kinds.split(","), seed=FLAGS.seed)
    print(f"{len(pairs)} perturbed pairs from {len(reqs)} tool_subset prompts", flush=True)
    return pairs
  if not reqs:
    raise app.UsageError(f"no {wl} request fits --max_prompt={FLAGS.max_prompt}")
  scored = [r for r in reqs if r.scored]
  print(f"{len(reqs)} {wl} requests from {source} ({len(scored)} scored): "
        f"{np.mean([r.ids.size for r in scored]):.0f} tokens on average", flush=True)
  return reqs


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, reuse_tables.tables)
    return
  names = FLAGS.methods.split(",")
  for name in names:
    method_config(name)                   # unknown methods or settings: a usage error now
  if FLAGS.via == "engine" and (FLAGS.timed or FLAGS.workload == "perturbed"):
    raise app.UsageError("--via=engine evaluates quality on a workload of requests (with "
                         "--notimed): timing and the perturbed pairs run through the runner, "
                         "one request at a time")
  llm = jaxkv.load(FLAGS.model)
  requests = build_workload(llm.tokenizer)
  rows = []
  if FLAGS.out and os.path.exists(FLAGS.out):
    with open(FLAGS.out) as f:
      rows = json.load(f)
  have = {(r["method"], r["workload"]) for r in rows}
  clock = CompileClock()
  order = ["none"] + [m for m in names if m != "none"]      # none is every drift's reference
  if FLAGS.workload == "perturbed":
    order = [m for m in order if m != "prefix"]               # no segments: as none
  else:
    hardware = (common.matmul_gflops() * 1e9, common.copy_bandwidth_gbs() * 1e9)
  ref = None
  for name in order:
    if (name, FLAGS.workload) in have and name != "none":
      continue
    if FLAGS.workload == "perturbed":
      new, outs = run_perturbed(llm, name, requests, ref, clock)
    else:
      row, outs = run_method(llm, name, requests, ref, clock, hardware)
      new = [row]
    jax.clear_caches()     # each method compiles its own shapes: free the executables
    if name == "none":
      ref = outs
    if (name, FLAGS.workload) not in have and name in names:
      rows += new
      for wl in {r["workload"] for r in rows} - {"perturbed"}:
        reuse_tables.add_speedups([r for r in rows if r["workload"] == wl])
      common.write_rows(FLAGS.out, rows)
  if FLAGS.workload == "perturbed" and FLAGS.plot:
    print(f"wrote {reuse_tables.drift_plot(rows, FLAGS.plot)}")
  common.print_tables(reuse_tables.tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
