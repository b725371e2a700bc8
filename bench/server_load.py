"""Load on the OpenAI-compatible server: throughput and latency vs concurrency.

    python bench/server_load.py [--config=configs/smollm2.py] [--concurrency=1,4,16,64]
        [--requests=0] [--max_tokens=32] [--max_s=600] [--url=] [--out=results.json]
        [--plot=docs/plots/server_load.png]

Starts the server in this process on a free loopback port (`--url` points at a
running one instead), warms the compiled shapes up, then for each concurrency
level c runs `--requests` streamed chat requests (default max(2c, 8)) with at
most c in flight: c client tasks each send their next request as soon as the
last one finished. Prompts are the chat questions of examples/requests.jsonl
plus a few more, cycled; greedy; every request asks for exactly `--max_tokens`
(`ignore_eos` is not in the API, so a request that meets a stop token ends early;
tokens are counted from `usage`).

Per level: requests/s and completion tokens/s over the level's wall time, p50 /
p99 TTFT (request sent -> first content chunk, queueing in the server
included), p50 / p99 inter-token latency (per request, (last chunk - first
chunk) / (completion tokens - 1); streamed deltas arrive once per engine step of
up to `engine.decode_steps` tokens, so this is a per-token average, not a chunk
gap), and the throughput over the c=1 level's (the gain continuous batching
gives). A level stops sending once `--max_s` has passed and reports what finished.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXTRA = ["Name three primary colors.", "What is 12 times 12?", "Say hello in French.",
         "What do bees make?", "Why is the sky blue?", "Give a synonym for fast.",
         "What is the boiling point of water?", "Write one sentence about the sea."]

FLAGS = flags.FLAGS


def define_flags():
  config_flags.DEFINE_config_file("config", str(ROOT / "configs/smollm2.py"), "server config",
                                  lock_config=True)
  flags.DEFINE_string("concurrency", "1,4,16,64", "concurrency levels")
  flags.DEFINE_integer("requests", 0, "requests per level (0: max(2c, 8))")
  flags.DEFINE_integer("max_tokens", 32, "completion tokens per request")
  flags.DEFINE_float("max_s", 600.0, "per level: stop sending after this many seconds")
  flags.DEFINE_string("url", "", "a running server's base URL (default: start one here)")
  flags.DEFINE_string("out", None, "JSON rows")
  flags.DEFINE_string("plot", None, "PNG of throughput and latency vs concurrency")

def prompts() -> list[str]:
  out = []
  for line in (ROOT / "examples/requests.jsonl").read_text().splitlines():
    rec = json.loads(line)
    if "messages" in rec and not rec.get("tools"):
      out.append(rec["messages"][-1]["content"])
  return out + EXTRA


async def one(client, model: str, prompt: str, max_tokens: int) -> dict:
  t0 = time.perf_counter()
  first = last = None
  usage = None
  stream = await client.chat.completions.create(
      model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
      stream=True, stream_options={"include_usage": True})
  async for ch in stream:
    if ch.usage is not None:
      usage = ch.usage
    elif ch.choices and ch.choices[0].delta.content:
      now = time.perf_counter()
      first = first or now
      last = now
  n = usage.completion_tokens if usage else 0
  return {"ttft_s": (first or time.perf_counter()) - t0, "tokens": n,
          "itl_s": (last - first) / (n - 1) if first and n > 1 else None}


async def level(url: str, model: str, c: int, n: int, max_tokens: int, max_s: float,
                texts: list[str]) -> dict:
  import openai
  client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                              timeout=max_s + 60)
  todo = list(range(n))
  done: list[dict] = []
  t0 = time.perf_counter()

  async def worker():
    while todo and time.perf_counter() - t0 < max_s:
      i = todo.pop(0)
      done.append(await one(client, model, texts[i % len(texts)], max_tokens))

  await asyncio.gather(*[worker() for _ in range(c)])
  wall = time.perf_counter() - t0
  ttft = [d["ttft_s"] for d in done]
  itl = [d["itl_s"] for d in done if d["itl_s"] is not None]
  q = lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
  return {"concurrency": c, "requests": len(done), "wall_s": wall,
          "req_per_s": len(done) / wall, "tok_per_s": sum(d["tokens"] for d in done) / wall,
          "completion_tokens": sum(d["tokens"] for d in done),
          "ttft_p50_s": q(ttft, 50), "ttft_p99_s": q(ttft, 99),
          "itl_p50_s": q(itl, 50), "itl_p99_s": q(itl, 99), "max_tokens": max_tokens}


def table(rows: list[dict]) -> common.Table:
  base = next((r["tok_per_s"] for r in rows if r["concurrency"] == 1), None)
  lines = [[str(r["concurrency"]), str(r["requests"]), f"{r['req_per_s']:.2f}",
            f"{r['tok_per_s']:.1f}", f"{r['tok_per_s'] / base:.2f}" if base else "-",
            f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
            f"{1e3 * r['itl_p50_s']:.0f}", f"{1e3 * r['itl_p99_s']:.0f}"] for r in rows]
  dev = rows[0].get("device", "") if rows else ""
  return common.Table(
      f"server under load ({dev}; {rows[0]['max_tokens'] if rows else '-'} tokens per request)",
      ["concurrency", "requests", "req/s", "tok/s", "tok/s vs c=1", "TTFT p50 s",
       "TTFT p99 s", "ITL p50 ms", "ITL p99 ms"], lines)


def tables(rows: list[dict]) -> list[common.Table]:
  return [table(rows)]


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cs = [r["concurrency"] for r in rows]
  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
  a.plot(cs, [r["tok_per_s"] for r in rows], "o-")
  a.set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens / s",
        title="throughput")
  for key, style in (("ttft_p50_s", "o-"), ("ttft_p99_s", "o--")):
    b.plot(cs, [r[key] for r in rows], style, label=key.replace("_s", "").replace("_", " "))
  b.plot(cs, [r["itl_p50_s"] for r in rows], "s-", label="inter-token p50")
  b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="seconds",
        title="latency")
  b.legend(fontsize=8)
  fig.tight_layout()
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def main(argv):
  del argv
  import logging

  for name in ("httpx", "openai", "absl"):
    logging.getLogger(name).setLevel(logging.WARNING)

  levels = [int(x) for x in FLAGS.concurrency.split(",")]
  texts = prompts()
  rows: list[dict] = []
  import openai
  try:
    run_levels(levels, texts, rows)
  except openai.APIConnectionError as e:
    sys.exit(f"server_load.py: error: cannot reach the server ({FLAGS.url or 'in-process'}): {e}")
  common.print_tables(tables(rows))
  if FLAGS.plot:
    plot(rows, FLAGS.plot)


def run_levels(levels: list[int], texts: list[str], rows: list[dict]) -> None:
  import jax
  with Target() as (url, model, device):
    warm = max(levels)
    print(f"warm-up: {warm} requests at concurrency {min(warm, 16)}", file=sys.stderr)
    asyncio.run(level(url, model, min(warm, 16), warm, FLAGS.max_tokens, FLAGS.max_s, texts))
    asyncio.run(level(url, model, 1, 2, FLAGS.max_tokens, FLAGS.max_s, texts))
    for c in levels:
      n = FLAGS.requests or max(2 * c, 8)
      r = asyncio.run(level(url, model, c, n, FLAGS.max_tokens, FLAGS.max_s, texts))
      r.update(device=device, jax=jax.__version__)
      rows.append(r)
      print(f"c={c}: {r['requests']} requests, {r['tok_per_s']:.1f} tok/s, "
            f"TTFT p50 {r['ttft_p50_s']:.2f} s", file=sys.stderr, flush=True)
      common.write_rows(FLAGS.out, rows)


class Target:
  """Context manager -> (url, model id, device words): --url as given, or a server started here."""

  def __enter__(self):
    import jax

    from jaxkv import cli
    from jaxkv.config import ServeConfig
    cfg = cli.load_config(ServeConfig, FLAGS.config)
    model = cfg.server.model_name or cfg.model
    if FLAGS.url:
      self._cm = None
      return FLAGS.url.rstrip("/"), model, "remote server"
    from jaxkv.server.app import create_app, serve_in_thread
    llm = cli.load_llm(cfg)
    self._cm = serve_in_thread(create_app(llm, cfg))
    server = self._cm.__enter__()
    dev = jax.devices()[0]
    words = f"{dev.device_kind} ({dev.platform}), max_batch {cfg.engine.max_batch}, {cfg.model}"
    return server.url, model, words

  def __exit__(self, *exc):
    return self._cm.__exit__(*exc) if self._cm else False


if __name__ == "__main__":
  define_flags()
  app.run(main)
