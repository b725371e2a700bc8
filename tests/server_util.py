"""What the server tests share: the model and engine shapes, a server per test on
loopback (uvicorn in a thread, its own engine over the shared weights, so a test can
look at its allocator), single-request reference runs, and small HTTP helpers.
Used by tests/test_server.py (the OpenAI API) and tests/test_server_control.py
(admission, failures, shutdown, sessions, keys, role adapters).
"""

from __future__ import annotations

import re
import time

import httpx

import jaxkv
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig, ServeConfig, ServerConfig
from jaxkv.engine.engine import Request
from jaxkv.server.app import create_app, serve_in_thread

MODEL = "smollm2-135m"
CACHE = CacheConfig(num_pages=256, page_size=16, max_seq_len=512)
ENGINE = EngineConfig(max_batch=8, prefill_chunk=128, decode_steps=8)
PROMPTS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
           "Say hello in Spanish.", "What do bees make?", "Which planet is red?",
           "What is water made of?", "Give me a synonym for happy."]


def load_base() -> jaxkv.LLM:
  """The weights every server of a test module shares (one load per module)."""
  return jaxkv.load(MODEL, cache=CACHE, engine=ENGINE)


def fresh(base, engine=ENGINE, **server) -> tuple[jaxkv.LLM, ServeConfig]:
  """Another engine (own pool and allocator) over the same weights."""
  llm = jaxkv.LLM(base.model, base.tokenizer, CACHE, engine)
  cfg = ServeConfig(model=MODEL, cache=CACHE, engine=engine,
                    sampling=SamplingConfig(max_tokens=16), server=ServerConfig(**server))
  return llm, cfg


def serving(llm, cfg, graceful_s: float = 5.0):
  return serve_in_thread(create_app(llm, cfg), graceful_s=graceful_s)


def reference_runner(base):
  """Single-request greedy runs on an engine of their own: run(prompt, max_tokens) -> text."""
  ref = jaxkv.LLM(base.model, base.tokenizer, CACHE, ENGINE)
  memo = {}

  def run(prompt: str, max_tokens: int) -> str:
    if (prompt, max_tokens) not in memo:
      ids = ref.encode([{"role": "user", "content": prompt}])
      memo[prompt, max_tokens] = next(ref.stream([Request(
          "r", ids, SamplingConfig(max_tokens=max_tokens))])).text
    return memo[prompt, max_tokens]
  return run


def chat(prompt):
  return [{"role": "user", "content": prompt}]


def metric(url: str, name: str, **labels) -> float:
  text = httpx.get(url + "/metrics").text
  lab = ",".join([f'model="{MODEL}"'] + [f'{k}="{v}"' for k, v in labels.items()])
  m = re.search(rf"^{name}{{{re.escape(lab)}}} (\S+)$", text, re.M)
  return float(m.group(1)) if m else 0.0


def wait_idle(llm, timeout=120):
  deadline = time.time() + timeout
  while llm.engine.busy:
    assert time.time() < deadline, "engine still busy"
    time.sleep(0.1)
