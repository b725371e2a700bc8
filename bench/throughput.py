"""jaxkv vs HF transformers `generate`: prefill and decode throughput, side by side.

    python bench/throughput.py [--batches=1,8] [--new_tokens=128] [--reps=3] [--out=results.json]

Same model (SmolLM2-135M-Instruct, both dequantized from the same GGUF to fp32),
same chat prompts, greedy, exactly `new_tokens` tokens per row (stop tokens off
on both sides), batch 1 and 8, in one run. Each system is warmed up on the same
shapes first (compilation / first-call overhead excluded); the timed runs
alternate between the systems and the median of `--reps` is reported.

- HF prefill tokens/s: prompt tokens / time of one forward over the padded batch;
  HF decode tokens/s: B x (N - 1) / (time of generate(N) - time of generate(1)).
- jaxkv: the engine's own split (prefill steps vs decode `lax.scan` calls).
- Roofline: a decode step must read every weight once plus the live KV of every
  row; bytes / measured memory bandwidth (the faster of a large elementwise copy
  and a large fp32 mat-vec read) is the floor on step time, reported as a tokens/s
  ceiling and the share of it achieved.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import common

from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.llm import load
from jaxkv.models import presets

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
  list(eng.run(reqs))                   # warm-up: compiles every shape used below

  def once():
    eng.metrics = type(eng.metrics)(bytes_per_slot=eng.metrics.bytes_per_slot)
    out = list(eng.run(reqs))
    assert all(len(r.tokens) == new_tokens for r in out)
    m = eng.metrics.summary()
    return m["prefill_tok_s"], m["decode_tok_s"], {r.id: r.tokens for r in out}
  return once


def hf_runner(hf, prompts, batch, new_tokens, pad_id):
  """Warms HF generate up; returns a function timing one run."""
  import torch
  width = max(len(p) for p in prompts)
  ids = torch.full((batch, width), pad_id, dtype=torch.long)
  mask = torch.zeros((batch, width), dtype=torch.long)
  for i, p in enumerate(prompts):     # left padding, as HF generate expects
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=pad_id)

  def gen(n):
    t0 = time.perf_counter()
    with torch.no_grad():
      out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    return time.perf_counter() - t0, out

  gen(2)                                # warm-up

  def once():
    with torch.no_grad():
      t0 = time.perf_counter()
      hf(input_ids=ids, attention_mask=mask)
      t_prefill = time.perf_counter() - t0
    t1, _ = gen(1)
    tn, out = gen(new_tokens)
    prompt_tokens = sum(len(p) for p in prompts)
    toks = {str(i): out[i, width:].tolist() for i in range(batch)}
    return prompt_tokens / t_prefill, batch * (new_tokens - 1) / (tn - t1), toks
  return once


def _median_runs(runners, reps):
  """Runs the systems alternately `reps` times (so drift in a shared machine hits
  both alike); per system the median prefill and decode rate and the last tokens."""
  runs = [[] for _ in runners]
  for _ in range(reps):
    for r, once in zip(runs, runners):
      r.append(once())
  return [(float(np.median([x[0] for x in r])), float(np.median([x[1] for x in r])), r[-1][2])
          for r in runs]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
  ap.add_argument("--reps", type=int, default=3,
                  help="timed runs per system, alternating; the median is reported")
  ap.add_argument("--out", default=None, help="write JSON rows here")
  args = ap.parse_args()

  import torch
  import transformers
  if args.threads:
    torch.set_num_threads(args.threads)
  llm = load(presets.SMOLLM2)
  path = presets.smollm2_gguf()
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  tok = llm.tokenizer
  chats = [llm.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
  cfg = llm.config
  weight_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(llm.weights))
  # The floor uses the faster of two probes: an elementwise copy (one thread on
  # XLA:CPU) and a large fp32 mat-vec (all cores, the decode step's own pattern).
  bw_copy, bw_gemv = common.copy_bandwidth_gbs(), common.matvec_bandwidth_gbs()
  bw = max(bw_copy, bw_gemv)
  rows, table = [], []
  for batch in [int(b) for b in args.batches.split(",")]:
    prompts = [chats[i % len(chats)] for i in range(batch)]
    (j_pre, j_dec, j_tok), (h_pre, h_dec, h_tok) = _median_runs(
        [jaxkv_runner(llm, prompts, batch, args.new_tokens),
         hf_runner(hf, prompts, batch, args.new_tokens, tok.pad_id or 0)], args.reps)
    agree = np.mean([np.mean(np.array(j_tok[k][:16]) == np.array(h_tok[k][:16]))
                     for k in j_tok])
    mean_ctx = np.mean([len(p) for p in prompts]) + args.new_tokens / 2
    step_bytes = weight_bytes + batch * mean_ctx * cfg.kv_bytes_per_token(4)
    ceiling = batch / (step_bytes / (bw * 1e9))
    for system, pre, dec in (("jaxkv", j_pre, j_dec), ("hf", h_pre, h_dec)):
      rows.append({"system": system, "batch": batch, "prefill_tok_s": round(pre, 1),
                   "decode_tok_s": round(dec, 1)})
    table.append((batch, j_pre, h_pre, j_dec, h_dec, ceiling, agree))

  print(f"\nSmolLM2-135M fp32, greedy, {args.new_tokens} new tokens, median of {args.reps} "
        f"alternating runs, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); measured bandwidth {bw:.1f} GB/s (copy "
        f"{bw_copy:.1f}, mat-vec read {bw_gemv:.1f}); "
        f"weights {weight_bytes / 1e6:.0f} MB")
  hdr = ("batch", "prefill jaxkv", "prefill HF", "ratio", "decode jaxkv", "decode HF",
         "ratio", "roofline tok/s", "% of roof", "greedy agree@16")
  common.print_table(hdr, [
      (str(b), f"{jp:.0f}", f"{hp:.0f}", f"{jp / hp:.2f}x", f"{jd:.1f}", f"{hd:.1f}",
       f"{jd / hd:.2f}x", f"{ceil:.0f}", f"{100 * jd / ceil:.0f}%", f"{agree:.2f}")
      for b, jp, hp, jd, hd, ceil, agree in table])
  common.write_rows(args.out, rows)


if __name__ == "__main__":
  main()
