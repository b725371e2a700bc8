"""The public entry point: `jaxkv.load(...)` -> `LLM` with `generate(...)`.

    import jaxkv
    llm = jaxkv.load("smollm2-135m")
    out = llm.generate([[{"role": "user", "content": "What is the capital of France?"}]])
    print(out[0].text)

A prompt is either a string (raw completion, no template) or a list of chat
messages (rendered with the model's own chat template, tool calls included).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import runtime
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request, Result
from jaxkv.models import presets, weights
from jaxkv.models.llama import Transformer
from jaxkv.tokens import Tokenizer

Prompt = str | Sequence[dict]


@dataclasses.dataclass
class Completion:
  """A finished request with its decoded text."""
  id: str
  text: str
  tokens: list[int]
  prompt_tokens: int
  completion_tokens: int
  ttft_s: float
  latency_s: float
  finish_reason: str
  error: str | None = None

  def to_json(self) -> dict:
    d = {"id": self.id, "text": self.text, "prompt_tokens": self.prompt_tokens,
         "completion_tokens": self.completion_tokens, "ttft_s": round(self.ttft_s, 6),
         "latency_s": round(self.latency_s, 6), "finish_reason": self.finish_reason}
    if self.error is not None:
      d["error"] = self.error
    return d


class LLM:
  """A model and its tokenizer; the batch engine (and its KV manager: the pool, the
  allocator, the radix trees) is created on first use, so runners that bring pools
  of their own pay for none, and runners given `kv=llm.engine.kv_manager` share it.

  `graphdef` / `weights` are the model's `nnx.split`, the form every jitted
  step takes (weights are jit arguments, never closed over).
  """

  def __init__(self, model: Transformer, tokenizer: Tokenizer,
               cache: CacheConfig = CacheConfig(), engine: EngineConfig = EngineConfig(),
               mesh=None, lora=None, adapters: Sequence[str] = ()):
    """lora / adapters: a LoRA adapter stack for the batch engine and its names
    (`Request.adapter` indexes them)."""
    self.model = model
    self.lora, self.adapters = lora, tuple(adapters)
    self.tokenizer = tokenizer
    self.cache_config, self.engine_config = cache, engine
    self.mesh = mesh   # the batch engine's device mesh (jaxkv.sharding.make_mesh) or None
    self.graphdef, self.weights = nnx.split(model)
    self._engine: Engine | None = None
    # rank of the pool's LoRA low-rank value cache (0: none): set before the engine
    # is first used when runners sharing its KV manager need it (the server's
    # 'agents' sessions under a decoupled scheme)
    self.kv_lr_rank = 0
    # printed to stderr by the first `stream` / `generate` call (then cleared);
    # `jaxkv.load(verbose=True)` sets it
    self.progress: str | None = None

  @property
  def config(self):
    return self.model.cfg

  @property
  def engine(self) -> Engine:
    if self._engine is None:
      self._engine = Engine(self.model, self.tokenizer.stop_ids, self.cache_config,
                            self.engine_config, mesh=self.mesh, lora=self.lora,
                            lr_rank=self.kv_lr_rank)
    return self._engine

  @property
  def dtype(self):
    """Dtype of the weights (and of pools runners allocate for them)."""
    return jax.tree.leaves(self.weights)[0].dtype

  def encode(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a raw string or a chat (generation prompt appended)."""
    if isinstance(prompt, str):
      return self.tokenizer.encode(prompt)
    return self.tokenizer.encode_chat(list(prompt), tools=tools, add_generation_prompt=True)

  def complete(self, result: Result) -> Completion:
    text = self.tokenizer.decode(result.tokens) if result.tokens else ""
    return Completion(id=result.id, text=text, tokens=result.tokens,
                      prompt_tokens=result.prompt_tokens,
                      completion_tokens=result.completion_tokens, ttft_s=result.ttft_s,
                      latency_s=result.latency_s, finish_reason=result.finish_reason,
                      error=result.error)

  def stream(self, requests: Iterable[Request]) -> Iterator[Completion]:
    """Runs token-level requests; yields completions as each finishes."""
    if self.progress:
      print(self.progress, file=sys.stderr, flush=True)
      self.progress = None
    for result in self.engine.run(requests):
      yield self.complete(result)

  def generate(self, prompts: Prompt | Sequence[Prompt],
               sampling: SamplingConfig = SamplingConfig()) -> list[Completion]:
    """Generates for one prompt or a batch; results in input order."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
      prompts = [prompts]
    reqs = [Request(id=str(i), prompt=self.encode(p), sampling=sampling)
            for i, p in enumerate(prompts)]
    done = {c.id: c for c in self.stream(reqs)}
    return [done[r.id] for r in reqs]


def load(model: str = presets.SMOLLM2, *, dtype: str = "float32",
         cache: CacheConfig = CacheConfig(), engine: EngineConfig = EngineConfig(),
         scan_layers: bool = False, verbose: bool = True, mesh=None,
         compilation_cache: str | bool | None = None) -> LLM:
  """Loads a preset name, a .gguf file or an HF directory into an `LLM`.

  verbose: progress on stderr -- "loading <model> weights...", the time it took,
  and on the first `generate` / `stream` call a line saying the model's steps are
  being compiled (tens of seconds on a CPU the first time); False: silent.
  compilation_cache: JAX's persistent compilation cache, as the commands'
  `--xla_cache` (`jaxkv.runtime.compilation_cache`): None (default) keeps a
  directory JAX already has ($JAX_COMPILATION_CACHE_DIR or your own
  `jax.config` setting) and otherwise uses ~/.cache/jaxkv/xla, so a later run
  loads its compiled steps instead of compiling them again; a path uses that
  directory; False (or "") turns nothing on.

  scan_layers: the weights' layer layout (`jaxkv.models.llama`). False (default,
  inference): one set of weights per layer, unrolled: faster steps (SmolLM2 fp32
  on a 2-core CPU, five bench/throughput.py runs: decode 1.07-1.16x at batch 1,
  0.98-1.13x at batch 8; prefill within run-to-run noise), each step shape compiles
  in ~2-5 s instead of ~1-2 s. True: stacked and run with `lax.scan` (training, and runs
  that compile many shapes). `LLM.model.relayout` converts.
  mesh: a `jaxkv.sharding.make_mesh` mesh for the batch engine (None: one device).
  """
  xla_cache = runtime.compilation_cache(compilation_cache)
  path = presets.resolve(model)
  t0 = time.perf_counter()
  if verbose:
    print(f"loading {model} weights...", file=sys.stderr, flush=True)
  cfg, params = weights.load(path)
  net = Transformer.from_params(cfg, params, dtype=jnp.dtype(dtype), scan_layers=scan_layers)
  tok = Tokenizer.load(path)
  if verbose:
    print(f"loaded {model} ({cfg.architecture}, {cfg.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
  llm = LLM(net, tok, cache, engine, mesh=mesh)
  if verbose:
    llm.progress = ("compiling the model's steps on first use (tens of seconds on a CPU"
                    + (f"; kept in {xla_cache} for later runs)..." if xla_cache else ")..."))
  return llm
