"""Soak: the server under a mixed, partly hostile load for a fixed time, then the books.

    python bench/soak.py [--config=configs/smollm2_agents.py] [--duration_s=600]
        [--clients=4] [--max_tokens=12] [--out=bench/results_soak.json]

Starts the server in this process on a free loopback port with every session kind
on (the config's pools and budgets), and `--clients` client tasks send requests back
to back until `--duration_s` has passed. Each request is drawn (seeded) from:

    chat        a plain chat completion, half of them streamed
    session     a session of a random kind (pruned, memart, reuse, semshare, agents,
                agents+pruned, pruned+reuse, agents+pruned+reuse, pruned+memart,
                agents+pruned+memart+reuse, prefix) opened, 1-3 turns, deleted; with
                memart in a composition a later turn opens a new conversation half of
                the time (the last one is written to memory, blocks recalled)
    cancel      a stream the client drops after its first chunk
    bad         a malformed request: invalid JSON, a lone surrogate, nesting 100 deep,
                an unknown model, a prompt over the cache, a bad session kind list

Then the server drains, every session is deleted, and the run reports: requests by
kind and status, the wall time of answered chats and session turns by kind (p50 / p99:
queueing, a composed call's recall, prefill and decode), each engine mechanism's
counters (composed sessions' calls, MemArt's blocks written and retrieved), 5xx
responses (must be 0: no fault is injected), RSS and the compiled variants of the
engine's jitted steps (and how often `server.max_compiled` made the loop drop them
all: `jaxkv.engine.executables`) at the start (after a warm-up round), at --marks
points over the run, and the KV books: sessions left, sequences left, live slots (=
tokens the radix trees cache + slots held by `retain`: SemShareKV's references,
MemArt's shared chat head, when no sequence is left), and `KVManager.check()`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import pathlib
import random
import resource
import sys
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
KINDS = ("pruned", "memart", "reuse", "semshare", "agents", ["agents", "pruned"],
         ["pruned", "reuse"], ["agents", "pruned", "reuse"], ["pruned", "memart"],
         ["agents", "pruned", "memart", "reuse"], "prefix")
FLAGS = flags.FLAGS


def define_flags():
  config_flags.DEFINE_config_file("config", str(ROOT / "configs/smollm2_agents.py"),
                                  "server config", lock_config=True)
  flags.DEFINE_float("duration_s", 600.0, "seconds of load")
  flags.DEFINE_integer("clients", 4, "client tasks sending back to back")
  flags.DEFINE_integer("max_tokens", 12, "completion tokens per request")
  flags.DEFINE_integer("seed", 0, "draws of the request mix")
  flags.DEFINE_integer("marks", 2, "RSS and compiled variants are read this many times "
                       "over the run (after the warm-up: start)")
  flags.DEFINE_string("out", None, "JSON summary")


def rss_mb() -> float:
  """Resident set size now (Linux /proc), MB."""
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compiled() -> int:
  """Compiled variants of the jitted steps every request runs through (the ones
  `server.max_compiled` bounds)."""
  from jaxkv.engine import executables
  return executables.count()


async def client(url: str, rng: random.Random, deadline: float, counts, statuses,
                 max_tokens: int, name: str, latency=None) -> None:
  """One client's mix until `deadline`; the wall time of each answered (200) plain chat
  and session turn goes to `latency[kind]` (a session's kinds joined by "+")."""
  import httpx
  chat_url = url + "/v1/chat/completions"
  async with httpx.AsyncClient(timeout=600) as http:

    async def post(what, path, body=None, raw=None, kind=None):
      t0 = time.monotonic()
      r = await http.post(url + path, json=body, content=raw,
                          headers={"Content-Type": "application/json"})
      counts[what] += 1
      statuses[r.status_code] += 1
      if kind is not None and latency is not None and r.status_code == 200:
        latency[kind].append(time.monotonic() - t0)
      return r

    n = 0
    while time.monotonic() < deadline:
      n += 1
      msg = [{"role": "user", "content": f"{name} request {n}: name a colour and a city."}]
      pick = rng.random()
      if pick < 0.3:
        await post("chat", "/v1/chat/completions", {"model": MODEL, "messages": msg,
                                                     "max_tokens": max_tokens,
                                                     "stream": rng.random() < 0.5}, kind="chat")
      elif pick < 0.65:
        kind = rng.choice(KINDS)
        role = "agents" in kind            # a kind or a list of kinds
        r = await post("session_open", "/v1/sessions", {"kind": kind})
        if r.status_code != 200:
          continue
        sid = r.json()["id"]
        chat = list(msg)
        for turn in range(rng.randint(1, 3)):
          if turn and "memart" in kind and not isinstance(kind, str) and rng.random() < 0.5:
            chat = [{"role": "user", "content": f"{name} new topic {n}.{turn}: which city "
                                                "did I name before?"}]
          model = MODEL + (":" + ("plan", "action", "reflect")[turn] if role else "")
          r = await post("session_turn", "/v1/chat/completions", {
              "model": model, "messages": chat, "max_tokens": max_tokens,
              "session_id": sid, "stream": rng.random() < 0.3},
              kind=kind if isinstance(kind, str) else "+".join(kind))
          if r.status_code != 200:
            break
          text = "ok" if r.headers.get("content-type", "").startswith("text/event-stream") \
              else r.json()["choices"][0]["message"]["content"] or "ok"
          chat += [{"role": "assistant", "content": text},
                   {"role": "user", "content": f"Tool result: step {turn} done."}]
        d = await http.delete(f"{url}/v1/sessions/{sid}")
        counts["session_delete"] += 1
        statuses[d.status_code] += 1
      elif pick < 0.8:
        async with http.stream("POST", chat_url, json={"model": MODEL, "messages": msg,
                                                       "max_tokens": 64, "stream": True}) as r:
          statuses[r.status_code] += 1
          async for _ in r.aiter_lines():
            break                               # the client leaves mid-stream
        counts["cancel"] += 1
      else:
        bad = rng.choice([
            ("raw", b"{not json"),
            ("raw", b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", '
                    b'"content": "\\ud800"}]}'),
            ("raw", b"[" * 100 + b"]" * 100),
            ("json", {"model": "no-such-model", "messages": msg}),
            ("json", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 40000}]}),
        ])
        if rng.random() < 0.2:
          await post("bad", "/v1/sessions", {"kind": ["memart", "reuse"]})
        elif bad[0] == "raw":
          await post("bad", "/v1/chat/completions", raw=bad[1])
        else:
          await post("bad", "/v1/chat/completions", bad[1])


def main(argv):
  del argv
  import httpx

  from jaxkv import cli
  from jaxkv.config import ServeConfig
  from jaxkv.server.app import create_app, serve_in_thread
  cfg = cli.load_config(ServeConfig, FLAGS.config)
  llm = cli.load_llm(cfg)
  rng = random.Random(FLAGS.seed)
  counts, statuses = collections.Counter(), collections.Counter()
  latency = collections.defaultdict(list)
  marks = {}
  app_ = create_app(llm, cfg)
  backends, releases = app_.state.backends, lambda: app_.state.loop.compiled.clears
  with serve_in_thread(app_) as server:
    url = server.url

    async def load(seconds: float):
      deadline = time.monotonic() + seconds
      await asyncio.gather(*[client(url, random.Random(rng.random()), deadline, counts,
                                    statuses, FLAGS.max_tokens, f"c{i}", latency)
                             for i in range(FLAGS.clients)])

    print("warm-up round (compiles)...", file=sys.stderr, flush=True)
    asyncio.run(load(min(120.0, FLAGS.duration_s / 4)))
    marks["start"] = (rss_mb(), compiled(), time.monotonic(), releases())
    counts.clear()
    statuses.clear()
    latency.clear()
    part = FLAGS.duration_s / FLAGS.marks
    for k in range(1, FLAGS.marks + 1):
      print(f"load for {part:.0f} s ({k}/{FLAGS.marks})...", file=sys.stderr, flush=True)
      asyncio.run(load(part))
      marks["end" if k == FLAGS.marks else f"{100 * k // FLAGS.marks}%"] = (
          rss_mb(), compiled(), time.monotonic(), releases())
    for sid in [d["id"] for d in httpx.get(url + "/v1/sessions").json()["data"]]:
      httpx.delete(f"{url}/v1/sessions/{sid}")
    engine = llm.engine
    deadline = time.monotonic() + 60
    while engine.busy and time.monotonic() < deadline:
      time.sleep(0.1)
    left = httpx.get(url + "/v1/sessions").json()["data"]
    kv = engine.kv_manager
    kv.check()
    books = {"sessions_left": len(left), "engine_busy": engine.busy,
             "sequences": len(kv.allocator.sequences()),
             "live_slots": kv.allocator.num_live_slots,
             "cached_tokens": sum(t.num_cached_tokens for t in kv.trees()),
             # slots held by `retain` (SemShareKV's references, MemArt's shared head)
             "held_slots": sum(kv.allocator.holds(s) > 0
                               for s in range(1, kv.allocator.num_slots)),
             "memart_sessions": len(backends.memart.sessions.sessions) if backends.memart else 0,
             "agents_sessions": len(backends.agents.sessions) if backends.agents else 0,
             "check": "clean"}
  out = {"duration_s": marks["end"][2] - marks["start"][2], "clients": FLAGS.clients,
         "requests": dict(counts), "statuses": {str(k): v for k, v in sorted(statuses.items())},
         "server_errors": sum(v for k, v in statuses.items() if k >= 500),
         "rss_mb": {k: round(v[0], 1) for k, v in marks.items()},
         "compiled_steps": {k: v[1] for k, v in marks.items()},
         "compiled_releases": {k: v[3] for k, v in marks.items()},
         "max_compiled": cfg.server.max_compiled, "books": books,
         # wall seconds of each answered plain chat / session turn, by kind (a session's
         # whole request: queueing, a composed call's recall, prefill and decode)
         "latency_s": {k: {"n": len(v), "p50": round(float(np.percentile(v, 50)), 3),
                           "p99": round(float(np.percentile(v, 99)), 3)}
                       for k, v in sorted(latency.items())},
         # each engine mechanism's counters over the whole run, warm-up included (a
         # composition's requests; MemArt's blocks written by recalls and retrieved)
         "mechanisms": {k: dict(m.stats) for k, m in llm.engine.mechanisms.items()}}
  print(json.dumps(out, indent=1))
  common.print_tables([common.Table(
      f"soak: {out['duration_s']:.0f} s, {FLAGS.clients} clients, {sum(counts.values())} "
      "requests", ["", *marks],
      [["RSS MB", *(f"{v[0]:.0f}" for v in marks.values())],
       ["compiled step variants", *(str(v[1]) for v in marks.values())],
       [f"releases (max_compiled {cfg.server.max_compiled})",
        *(str(v[3]) for v in marks.values())]]),
      common.Table("answered requests' wall time by kind (s)", ["kind", "n", "p50", "p99"],
                   [[k, str(v["n"]), f"{v['p50']:.2f}", f"{v['p99']:.2f}"]
                    for k, v in out["latency_s"].items()])])
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(out, indent=1) + "\n")
  if out["server_errors"] or books["sessions_left"] or books["engine_busy"]:
    sys.exit(f"soak: failed: {out['server_errors']} 5xx, {books['sessions_left']} sessions "
             f"left, engine busy {books['engine_busy']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
