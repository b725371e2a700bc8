"""jaxkv vs HF transformers `generate`: prefill and decode throughput, side by side.

    python bench/throughput.py [--batches=1,8] [--new_tokens=128] [--reps=3]
        [--layouts=unrolled,scan] [--out=results.json]

Same model (`--model`, default SmolLM2-135M-Instruct; both systems load the same
GGUF dequantized to fp32, or the same HF directory),
same chat prompts, greedy, exactly `new_tokens` tokens per row (stop tokens off
on both sides), batch 1 and 8, in one run. jaxkv runs in each layer layout of
`--layouts` (unrolled: one set of weights per layer, projections stored [out, in],
the serving default; unrolled_in_out: the same with [in, out] projections; scan:
stacked weights under `lax.scan`). Each system is warmed up on the same shapes
first (its warm-up time, compilation included, is reported); the timed runs
alternate between the systems and the median of `--reps` is reported.

- HF prefill tokens/s: prompt tokens / time of one forward over the padded batch;
  HF decode tokens/s: B x (N - 1) / (time of generate(N) - time of generate(1)).
- jaxkv: the engine's own split (prefill steps vs decode `lax.scan` calls).
- A prefill is one short step (~0.1 s at batch 1), so each timed run also takes
  4 prefill-only samples per system (the engine with max_tokens=1; HF forwards)
  and reports their median.
- Decode floor: a step must read every weight once plus the live KV of every
  row; bytes / measured memory bandwidth (the faster of a large elementwise copy
  and a large fp32 mat-vec read) bounds tokens/s from above.
- Prefill floor: the larger of the weight bytes / bandwidth and the prompt's
  FLOPs (2 x parameters x tokens, plus attention) / the measured peak of a large
  fp32 matmul, as tokens/s; "% of roof" is the share of it achieved.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from absl import app, flags

import common
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.llm import LLM, load
from jaxkv.models import presets

FLAGS = flags.FLAGS
# --layouts: name -> (scan_layers, projections stored [out, in]) (`jaxkv.models.llama`)
LAYOUTS = {"unrolled": (False, True), "unrolled_in_out": (False, False), "scan": (True, False)}


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this
  module next to other absl scripts never clashes)."""
  flags.DEFINE_string("model", presets.SMOLLM2, "preset name, .gguf file or HF directory "
                      "(e.g. bench/random_checkpoint.py's, to time an architecture whose "
                      "weights cannot be moved to the timing machine)")
  flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
  flags.DEFINE_integer("new_tokens", 128, "tokens generated per row")
  flags.DEFINE_integer("threads", 0, "torch threads (0: torch default)")
  flags.DEFINE_integer("reps", 3,
                       "timed runs per system, alternating; the median is reported")
  flags.DEFINE_list("layouts", ["unrolled", "scan"], "jaxkv layer layouts to run: unrolled "
                    "(the serving default: projections [out, in]), unrolled_in_out (the "
                    "same, [in, out]), scan (stacked under lax.scan, [in, out])")
  flags.DEFINE_string("hf_device", None, "torch device for HF (default: cuda when JAX's "
                      "backend is a GPU and torch sees one, else cpu)")
  flags.DEFINE_string("out", None, "write JSON rows here")


QUESTIONS = [
    "What is the capital of France?",
    "Explain what a KV cache is in one paragraph.",
    "Write a Python function that checks whether a number is prime.",
    "List three uses of a hash map.",
    "Why is the sky blue?",
    "Summarise the plot of Pride and Prejudice in two sentences.",
    "What does the HTTP status code 404 mean?",
    "Give me a recipe for a simple tomato soup.",
]


def jaxkv_runner(llm, prompts, batch, new_tokens):
  """Compiles and warms the engine; returns a function timing one run."""
  eng = Engine(llm.model, [], CacheConfig(num_pages=1 + batch * 32, page_size=16,
                                          max_seq_len=512),
               EngineConfig(max_batch=batch, prefill_chunk=256, decode_steps=16))
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=new_tokens))
          for i, p in enumerate(prompts)]
  t0 = time.perf_counter()
  list(eng.run(reqs))                   # warm-up: compiles every shape used below
  warmup_s = time.perf_counter() - t0

  one = [dataclasses.replace(r, sampling=SamplingConfig(max_tokens=1)) for r in reqs]

  def once():
    pre = []
    for _ in range(PREFILL_REPS):       # a prefill is one short step: sample it more
      eng.metrics = type(eng.metrics)(bytes_per_slot=eng.metrics.bytes_per_slot)
      list(eng.run(one))
      pre.append(eng.metrics.summary()["prefill_tok_s"])
    eng.metrics = type(eng.metrics)(bytes_per_slot=eng.metrics.bytes_per_slot)
    out = list(eng.run(reqs))
    assert all(len(r.tokens) == new_tokens for r in out)
    m = eng.metrics.summary()
    return float(np.median(pre + [m["prefill_tok_s"]])), m["decode_tok_s"], \
        {r.id: r.tokens for r in out}
  once.warmup_s = warmup_s
  return once


def hf_runner(hf, prompts, batch, new_tokens, pad_id):
  """Warms HF generate up; returns a function timing one run (on hf's device; a
  CUDA device is synchronised before every clock read)."""
  import torch
  device = next(hf.parameters()).device
  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
  width = max(len(p) for p in prompts)
  ids = torch.full((batch, width), pad_id, dtype=torch.long)
  mask = torch.zeros((batch, width), dtype=torch.long)
  for i, p in enumerate(prompts):     # left padding, as HF generate expects
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  ids, mask = ids.to(device), mask.to(device)
  kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=pad_id)

  def gen(n):
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
      out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    sync()
    return time.perf_counter() - t0, out

  gen(2)                                # warm-up

  def once():
    t_prefill = []
    with torch.no_grad():
      for _ in range(PREFILL_REPS + 1):
        sync()
        t0 = time.perf_counter()
        hf(input_ids=ids, attention_mask=mask)
        sync()
        t_prefill.append(time.perf_counter() - t0)
    t1, _ = gen(1)
    tn, out = gen(new_tokens)
    prompt_tokens = sum(len(p) for p in prompts)
    toks = {str(i): out[i, width:].tolist() for i in range(batch)}
    return prompt_tokens / float(np.median(t_prefill)), batch * (new_tokens - 1) / (tn - t1), toks
  return once


PREFILL_REPS = 4  # extra prefill-only samples per timed run (each system)
SETTLE_S = 1.0   # pause between systems: torch's OpenMP workers spin after a run and
                # would otherwise slow the next system's first (prefill) step


def _median_runs(runners, reps):
  """Runs the systems alternately `reps` times (so drift in a shared machine hits
  both alike); per system the median prefill and decode rate and the last tokens."""
  runs = [[] for _ in runners]
  for _ in range(reps):
    for r, once in zip(runs, runners):
      time.sleep(SETTLE_S)
      r.append(once())
  return [(float(np.median([x[0] for x in r])), float(np.median([x[1] for x in r])), r[-1][2])
          for r in runs]


def prefill_flops(cfg, n_params: int, lengths) -> float:
  """2 x (non-embedding) parameters per token + causal attention (QK and PV)."""
  attn = sum(2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
             for n in lengths)
  return 2.0 * n_params * sum(lengths) + attn


def table(rows: list[dict], title: str = "throughput") -> common.Table:
  """Prefill / decode tok/s, ratio to HF and % of the roofline, per batch and system."""
  hdr = ("batch", "system", "prefill tok/s", "vs HF", "% of roof", "decode tok/s", "vs HF",
         "% of roof", "warm-up s (compile)", "greedy agree@16")
  return common.Table(title, hdr, [
      (str(r["batch"]), r["system"], f"{r['prefill_tok_s']:.0f}", f"{r['prefill_ratio']:.2f}x",
       f"{100 * r['prefill_tok_s'] / r['prefill_roof_tok_s']:.0f}%",
       f"{r['decode_tok_s']:.1f}", f"{r['decode_ratio']:.2f}x",
       f"{100 * r['decode_tok_s'] / r['decode_roof_tok_s']:.0f}%",
       "" if r["warmup_s"] is None else f"{r['warmup_s']:.1f}",
       "" if r["greedy_agree16"] is None else f"{r['greedy_agree16']:.2f}")
      for r in rows])


def main(argv):
  del argv
  import torch
  import transformers
  if FLAGS.threads:
    torch.set_num_threads(FLAGS.threads)
  base = load(FLAGS.model)
  llms = {}
  for name in FLAGS.layouts:
    if name not in LAYOUTS:
      raise app.UsageError(f"--layouts takes {', '.join(LAYOUTS)}, got {name!r}")
    model = base.model.relayout(*LAYOUTS[name])
    llms[name] = LLM(model, base.tokenizer)
  path = presets.resolve(FLAGS.model)
  hf_device = FLAGS.hf_device or (
      "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu")
  where = dict(pretrained_model_name_or_path=str(path)) if path.is_dir() else dict(
      pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      **where, dtype=torch.float32).eval().to(hf_device)
  tok = base.tokenizer
  chats = [base.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
  cfg = base.config
  weight_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(base.weights))
  n_params = weight_bytes // 4 - cfg.vocab_size * cfg.hidden_size     # the embedding is a lookup
  # The floor uses the faster of two probes: an elementwise copy (one thread on
  # XLA:CPU) and a large fp32 mat-vec (all cores, the decode step's own pattern).
  bw_copy, bw_gemv = common.copy_bandwidth_gbs(), common.matvec_bandwidth_gbs()
  bw = max(bw_copy, bw_gemv)
  peak = common.matmul_gflops(8192 if jax.default_backend() == "gpu" else 1024)
  rows = []
  for batch in [int(b) for b in FLAGS.batches]:
    prompts = [chats[i % len(chats)] for i in range(batch)]
    runners = {f"jaxkv {n}": jaxkv_runner(m, prompts, batch, FLAGS.new_tokens)
               for n, m in llms.items()}
    runners["hf"] = hf_runner(hf, prompts, batch, FLAGS.new_tokens, tok.pad_id or 0)
    results = dict(zip(runners, _median_runs(list(runners.values()), FLAGS.reps)))
    h_pre, h_dec, h_tok = results["hf"]
    mean_ctx = np.mean([len(p) for p in prompts]) + FLAGS.new_tokens / 2
    step_bytes = weight_bytes + batch * mean_ctx * cfg.kv_bytes_per_token(4)
    dec_roof = batch / (step_bytes / (bw * 1e9))
    lengths = [len(p) for p in prompts]
    pre_s = max(weight_bytes / (bw * 1e9), prefill_flops(cfg, n_params, lengths) / (peak * 1e9))
    pre_roof = sum(lengths) / pre_s
    for system, (pre, dec, toks) in results.items():
      agree = None if system == "hf" else float(np.mean([   # HF vs itself: 1 by construction
          np.mean(np.array(toks[k][:16]) == np.array(h_tok[k][:16])) for k in toks]))
      warm = getattr(runners[system], "warmup_s", None)
      rows.append({"model": FLAGS.model, "system": system, "batch": batch,
                   "prefill_tok_s": round(pre, 1), "decode_tok_s": round(dec, 1),
                   "prefill_ratio": round(pre / h_pre, 3), "decode_ratio": round(dec / h_dec, 3),
                   "prefill_roof_tok_s": round(pre_roof),
                   "decode_roof_tok_s": round(dec_roof, 1), "greedy_agree16": agree,
                   "warmup_s": None if warm is None else round(warm, 1)})

  print(f"\n{FLAGS.model} ({cfg.architecture}, {cfg.num_layers} layers) fp32, greedy, "
        f"{FLAGS.new_tokens} new tokens, median of {FLAGS.reps} alternating runs, jax "
        f"{jax.__version__} on {jax.devices()[0].platform}, torch "
        f"{torch.__version__} on {hf_device} ({torch.get_num_threads()} threads); "
        f"{jax.devices()[0].device_kind}; measured bandwidth "
        f"{bw:.1f} GB/s (copy {bw_copy:.1f}, mat-vec read {bw_gemv:.1f}), fp32 matmul peak "
        f"{peak:.0f} GFLOP/s; weights {weight_bytes / 1e6:.0f} MB")
  print(table(rows).markdown())
  print("floors: decode = (weights + live KV) / bandwidth; prefill = max(weights / bandwidth, "
        "FLOPs / matmul peak)")
  common.write_rows(FLAGS.out, rows)


if __name__ == "__main__":
  define_flags()
  app.run(main)
