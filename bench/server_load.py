"""Load on the OpenAI-compatible server: throughput and latency vs concurrency.

    python bench/server_load.py [--config=configs/smollm2.py] [--concurrency=1,4,16,64]
        [--prefix_cache=off,on] [--kind=] [--requests=0] [--max_tokens=16]
        [--system_chars=600] [--max_s=600] [--url=] [--out=results.json]
        [--plot=docs/plots/server_load.png]

`--kind=pruned` (or another session kind the config can serve) sends every request
in a session of that kind (one session per request: `user` names it, and the
server's `server.sessions` is set to that kind alone), so the level measures how
that mechanism's requests batch; e.g. `--kind=pruned --config.pruning.method=intentkv
--config.pruning.budget=64` prunes every request. A list (`--kind=pruned,reuse,semshare`)
measures each kind in turn on its own server (the weights loaded once); `-` in the
list is the plain engine (no session). `--kind=agents` sends every request to the
plan role adapter (`<model>:plan`) in a session of its own (the config's role
adapters and `server.agent_scheme`).

For each `--prefix_cache` setting (`engine.prefix_cache` off / on), starts the
server in this process on a free loopback port (`--url` points at a running one
instead, once), warms the compiled shapes up (2c requests at c = 1, 2, 4, ..., 16:
each prefill batch size the engine packs rows into), then for each concurrency level c
runs `--requests` streamed chat requests (default max(c, 8)) with at most c in
flight: c client tasks each send their next request as soon as the last one
finished. Every request is an agent-style chat: one shared system prompt (the
first `--system_chars` characters of docs/architecture.md, standing in for an
agent's instructions and tool documentation: ~150 tokens by default) and a user
message "Request <n>: <question>" (the chat questions of examples/requests.jsonl
plus a few more, cycled; n counts every request of the run, so requests share
the system prompt and chat header, no more); greedy; each asks for `--max_tokens`
(`ignore_eos` is not in the API, so a request that meets a stop token ends early;
tokens are counted from `usage`, and so are the prompt tokens the prefix cache served).

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
import contextlib
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
  flags.DEFINE_string("prefix_cache", "off,on", "engine.prefix_cache settings to compare")
  flags.DEFINE_string("kind", "", "session kind(s) of every request, comma-separated (empty "
                      "or -: no session)")
  flags.DEFINE_integer("requests", 0, "requests per level (0: max(c, 8))")
  flags.DEFINE_integer("max_tokens", 16, "completion tokens per request")
  flags.DEFINE_integer("system_chars", 600, "characters of the shared system prompt")
  flags.DEFINE_float("max_s", 600.0, "per level: stop sending after this many seconds")
  flags.DEFINE_string("url", "", "a running server's base URL (default: start one here)")
  flags.DEFINE_string("out", None, "JSON rows")
  flags.DEFINE_bool("append", False, "keep --out's rows of the kinds this run does not measure")
  flags.DEFINE_string("plot", None, "PNG of throughput and latency vs concurrency")

def prompts() -> list[str]:
  out = []
  for line in (ROOT / "examples/requests.jsonl").read_text().splitlines():
    rec = json.loads(line)
    if "messages" in rec and not rec.get("tools"):
      out.append(rec["messages"][-1]["content"])
  return out + EXTRA


def system_prompt(chars: int) -> str:
  return (ROOT / "docs/architecture.md").read_text()[:chars] if chars else ""


async def one(client, model: str, prompt: str, max_tokens: int, system: str = "",
              session: str | None = None) -> dict:
  t0 = time.perf_counter()
  first = last = None
  usage = None
  messages = [{"role": "user", "content": prompt}]
  if system:
    messages.insert(0, {"role": "system", "content": system})
  stream = await client.chat.completions.create(
      model=model, messages=messages, max_tokens=max_tokens,
      stream=True, stream_options={"include_usage": True},
      **({"user": session} if session else {}))
  async for ch in stream:
    if ch.usage is not None:
      usage = ch.usage
    elif ch.choices and ch.choices[0].delta.content:
      now = time.perf_counter()
      first = first or now
      last = now
  n = usage.completion_tokens if usage else 0
  details = usage and usage.prompt_tokens_details
  return {"ttft_s": (first or time.perf_counter()) - t0, "tokens": n,
          "prompt_tokens": usage.prompt_tokens if usage else 0,
          "cached_tokens": (details.cached_tokens or 0) if details else 0,
          "itl_s": (last - first) / (n - 1) if first and n > 1 else None}


async def level(url: str, model: str, c: int, n: int, max_tokens: int, max_s: float,
                texts: list[str], system: str = "", first_id: int = 0,
                kind: str = "") -> dict:
  """n requests, at most c in flight. Request i asks "Request {first_id + i}: <text>",
  so no two requests of a run share more than the system prompt and chat header."""
  import openai
  client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                              timeout=max_s + 60)
  todo = list(range(n))
  done: list[dict] = []
  t0 = time.perf_counter()

  async def worker():
    while todo and time.perf_counter() - t0 < max_s:
      i = todo.pop(0)
      done.append(await one(client, model, f"Request {first_id + i}: {texts[i % len(texts)]}",
                            max_tokens, system,
                            session=f"{kind}-{first_id + i}" if kind else None))

  await asyncio.gather(*[worker() for _ in range(c)])
  wall = time.perf_counter() - t0
  await client.close()     # inside this event loop (asyncio.run closes it next)
  ttft = [d["ttft_s"] for d in done]
  itl = [d["itl_s"] for d in done if d["itl_s"] is not None]
  q = lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan")
  return {"concurrency": c, "requests": len(done), "wall_s": wall,
          "req_per_s": len(done) / wall, "tok_per_s": sum(d["tokens"] for d in done) / wall,
          "completion_tokens": sum(d["tokens"] for d in done),
          "prompt_tokens": sum(d["prompt_tokens"] for d in done),
          "cached_tokens": sum(d["cached_tokens"] for d in done),
          "ttft_p50_s": q(ttft, 50), "ttft_p99_s": q(ttft, 99),
          "itl_p50_s": q(itl, 50), "itl_p99_s": q(itl, 99), "max_tokens": max_tokens}


def table(rows: list[dict]) -> common.Table:
  """One line per (session kind, prefix cache, concurrency); ratios against the single
  client and against the same concurrency without the prefix cache."""
  def find(kind, pc, c):
    return next((r for r in rows if r.get("kind", "") == kind
                 and r.get("prefix_cache", False) == pc and r["concurrency"] == c), None)
  lines = []
  for r in rows:
    pc, kind = r.get("prefix_cache", False), r.get("kind", "")
    one_client, off = find(kind, pc, 1), find(kind, False, r["concurrency"])
    lines.append([kind or "-",
        "on" if pc else "off", str(r["concurrency"]), str(r["requests"]),
        f"{100 * r.get('cached_tokens', 0) / max(r.get('prompt_tokens', 0), 1):.0f}%",
        f"{r['req_per_s']:.2f}", f"{r['tok_per_s']:.1f}",
        f"{r['tok_per_s'] / one_client['tok_per_s']:.2f}" if one_client else "-",
        f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
        f"{off['ttft_p50_s'] / r['ttft_p50_s']:.2f}" if off else "-",
        f"{1e3 * r['itl_p50_s']:.0f}", f"{1e3 * r['itl_p99_s']:.0f}"])
  dev = rows[0].get("device", "") if rows else ""
  return common.Table(
      f"server under load ({dev}; {rows[0]['max_tokens'] if rows else '-'} tokens per request; "
      "prompt not prefilled: usage cached_tokens, read from the engine's prefix cache or, "
      "with it off too, from a session kind's own reuse: a pruned session's earlier turns, "
      "segment reuse's radix tree)",
      ["session kind", "prefix cache", "concurrency", "requests", "prompt not prefilled", "req/s",
       "tok/s",
       "tok/s vs c=1", "TTFT p50 s", "TTFT p99 s", "TTFT gain vs off", "ITL p50 ms",
       "ITL p99 ms"], lines)


def batching_table(rows: list[dict], c: int = 8) -> common.Table:
  """One line per session kind (prefix cache off): tok/s at each concurrency, the
  ratio at `c` against one client, TTFT p50 / p99 at `c`, and the streamed tokens'
  spacing (ITL p50) at 1 and `c`: how much slower one decode step of `c` rows is than
  one of a single row, which bounds what batching gains once prefill is done."""
  rows = [r for r in rows if not r.get("prefix_cache", False)]
  kinds = list(dict.fromkeys(r.get("kind", "") for r in rows))
  levels = sorted({r["concurrency"] for r in rows})
  lines = []
  for kind in kinds:
    by_c = {r["concurrency"]: r for r in rows if r.get("kind", "") == kind}
    one, top = by_c.get(1), by_c.get(c)
    lines.append([kind or "- (plain)", *(f"{by_c[x]['tok_per_s']:.1f}" if x in by_c else "-"
                                        for x in levels),
                  f"{top['tok_per_s'] / one['tok_per_s']:.2f}x" if one and top else "-",
                  f"{top['ttft_p50_s']:.2f} / {top['ttft_p99_s']:.2f}" if top else "-",
                  f"{1e3 * one['itl_p50_s']:.0f} / {1e3 * top['itl_p50_s']:.0f}"
                  if one and top else "-"])
  dev = rows[0].get("device", "") if rows else ""
  mt = rows[0]["max_tokens"] if rows else "-"
  return common.Table(
      f"continuous batching per session kind ({dev}; {mt} tokens per request)",
      ["session kind", *(f"tok/s c={x}" for x in levels), f"c={c} vs c=1",
       f"TTFT p50 / p99 s, c={c}", f"ITL p50 ms, c=1 / c={c}"], lines)


def tables(rows: list[dict]) -> list[common.Table]:
  return [table(rows)]


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.6))
  kinds = list(dict.fromkeys(r.get("kind", "") for r in rows))
  colors = iter(["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                 "tab:pink", "tab:gray"])
  for kind, pc in [(k, pc) for k in kinds for pc in (False, True)]:
    rs = [r for r in rows if r.get("prefix_cache", False) == pc and r.get("kind", "") == kind]
    if not rs:
      continue
    color = next(colors)
    cs = [r["concurrency"] for r in rs]
    tag = (f"{kind}, " if len(kinds) > 1 else "") + f"prefix cache {'on' if pc else 'off'}"
    a.plot(cs, [r["tok_per_s"] for r in rs], "o-", color=color, label=tag)
    b.plot(cs, [r["ttft_p50_s"] for r in rs], "o-", color=color, label=f"TTFT p50, {tag}")
    b.plot(cs, [r["ttft_p99_s"] for r in rs], "o--", color=color, label=f"TTFT p99, {tag}")
    b.plot(cs, [r["itl_p50_s"] for r in rs], "s:", color=color, label=f"inter-token p50, {tag}")
  a.set(xscale="log", xlabel="concurrent clients", ylabel="completion tokens / s",
        title="throughput")
  a.legend(fontsize=8)
  b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="seconds",
        title="latency")
  b.legend(fontsize=7)
  fig.tight_layout()
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def main(argv):
  del argv
  import logging

  import openai
  from absl import logging as absl_logging

  from jaxkv import cli
  from jaxkv.config import ServeConfig
  absl_logging.set_verbosity(absl_logging.WARNING)   # no line per HTTP request
  for name in ("httpx", "openai"):
    logging.getLogger(name).setLevel(logging.WARNING)
  levels = [int(x) for x in FLAGS.concurrency.split(",")]
  settings = [{"off": False, "on": True}[x] for x in FLAGS.prefix_cache.split(",")]
  cfg = cli.load_config(ServeConfig, FLAGS.config)
  base = None if FLAGS.url else cli.load_llm(cfg)
  kinds = [k.strip() for k in FLAGS.kind.split(",")] if FLAGS.kind else [""]
  rows: list[dict] = []
  if FLAGS.append and FLAGS.out and pathlib.Path(FLAGS.out).exists():
    measured = {"" if k == "-" else k for k in kinds}
    rows = [r for r in json.loads(pathlib.Path(FLAGS.out).read_text())
            if r.get("kind", "") not in measured]
  try:
    for kind in kinds:
      for pc in settings[:1] if FLAGS.url else settings:
        run_levels(base, cfg, pc, levels, rows, "" if kind == "-" else kind)
  except openai.APIConnectionError as e:
    sys.exit(f"server_load.py: error: cannot reach the server ({FLAGS.url or 'in-process'}): {e}")
  common.print_tables(tables(rows))
  if FLAGS.plot:
    plot(rows, FLAGS.plot)


def run_levels(base, cfg, prefix_cache: bool, levels: list[int], rows: list[dict],
               kind: str = "") -> None:
  """Every level on one server whose engine has `prefix_cache` (a fresh engine over
  `base`'s weights) and serves session `kind` only (empty: plain requests), or on
  --url (then `prefix_cache` is only a label)."""
  import dataclasses

  import jax

  import jaxkv
  from jaxkv.server.app import create_app, serve_in_thread
  texts, system = prompts(), system_prompt(FLAGS.system_chars)
  model = cfg.server.model_name or cfg.model
  # the server serves this kind alone (plain requests: "prefix", the engine's own)
  # (agents: every request on the plan role, one session each, so as many sessions as
  # requests may be open)
  cfg = dataclasses.replace(cfg, server=dataclasses.replace(
      cfg.server, sessions=kind or "prefix", agent_sessions=max(cfg.server.agent_sessions,
                                                                1 << 20)))
  if kind == "agents":
    model += ":plan"
  if FLAGS.url:
    target, device = contextlib.nullcontext(None), "remote server"
  else:
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine,
                                                              prefix_cache=prefix_cache))
    llm = jaxkv.LLM(base.model, base.tokenizer, cfg.cache, cfg.engine,
                    lora=base.lora, adapters=base.adapters)
    llm.kv_lr_rank = base.kv_lr_rank if kind == "agents" else 0
    target = serve_in_thread(create_app(llm, cfg))
    dev = jax.devices()[0]
    device = f"{dev.device_kind} ({dev.platform}), max_batch {cfg.engine.max_batch}, {cfg.model}"
  with target as server:
    url = FLAGS.url.rstrip("/") if FLAGS.url else server.url
    sent = 0

    def run(c, n):
      nonlocal sent
      sent += n
      return asyncio.run(level(url, model, c, n, FLAGS.max_tokens, FLAGS.max_s, texts,
                               system, first_id=sent - n, kind=kind))

    # prefill packs the rows with prompt left into a batch of 1, 2, 4, ... rows, so every
    # such batch size meets its first (compiling) call here, not inside a level
    sizes = [k for k in (1, 2, 4, 8, 16) if k <= min(max(levels), 16)]
    print(f"{kind or 'plain'}, prefix cache {prefix_cache}: warm-up, 2 x c requests at "
          f"concurrency c = {', '.join(map(str, sizes))}", file=sys.stderr)
    for k in sizes:
      run(k, 2 * k)
    for c in levels:
      r = run(c, FLAGS.requests or max(c, 8))
      r.update(device=device, jax=jax.__version__, prefix_cache=prefix_cache, kind=kind)
      rows.append(r)
      print(f"{kind or 'plain'}, prefix cache {prefix_cache}, c={c}: "
            f"{r['requests']} requests, "
            f"{r['tok_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.2f} s, cached "
            f"{r['cached_tokens']} of {r['prompt_tokens']} prompt tokens",
            file=sys.stderr, flush=True)
      common.write_rows(FLAGS.out, rows)


if __name__ == "__main__":
  define_flags()
  app.run(main)
