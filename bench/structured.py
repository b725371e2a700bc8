"""What structured output costs the batch: decode throughput with 0, 1 or every row
under a grammar, side by side in one run.

    python bench/structured.py [--model=smollm2-135m] [--batch=8] [--new_tokens=128]
        [--reps=5] [--out=bench/results_structured.json]

A constrained row needs its next mask from the token just chosen, so while one is
live every decode call of its batch is one token long (`jaxkv.engine.grammar`); the
unconstrained batch runs `--decode_steps` tokens per `lax.scan` call. To time only
that, every constrained row decodes under a grammar that allows every token and never
ends (`always_allow`), so it writes what the model writes anyway: all three
configurations write the same tokens (checked), so the difference is the call
length, the per-token host round trip and the mask work (llguidance's mask per
constrained row per token, the bitmask upload, the masked logits). Greedy, stop
tokens off (every row writes exactly `--new_tokens`), the same chat prompts; the
median of `--reps` timed runs after a warm-up run of each configuration, the
configurations alternating. Rows: decode tok/s, its ratio to the unconstrained
batch, and the host seconds spent in the matchers.
"""

from __future__ import annotations

import statistics
import time
import types

import llguidance
from absl import app, flags

import common
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
from jaxkv.engine import grammar as G
from jaxkv.engine.engine import Request
from jaxkv.engine.llm import load
from jaxkv.models import presets

FLAGS = flags.FLAGS
PROMPTS = ("What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
           "Say hello in Spanish.", "What do bees make?", "Which planet is red?",
           "What is water made of?", "Give me a synonym for happy.")


def define_flags():
  flags.DEFINE_string("model", presets.SMOLLM2, "preset name, .gguf file or HF directory")
  flags.DEFINE_integer("batch", 8, "rows decoding together")
  flags.DEFINE_integer("new_tokens", 64, "tokens generated per row")
  flags.DEFINE_integer("decode_steps", 16, "EngineConfig.decode_steps")
  flags.DEFINE_integer("reps", 3, "timed runs per configuration (median)")
  flags.DEFINE_string("out", None, "write JSON rows here")


class _Timed:
  """Matcher wrapper that adds up the host time its masks and tokens take."""

  def __init__(self, m, clock):
    self.m, self.clock = m, clock

  def fill(self, out):
    t0 = time.perf_counter()
    self.m.fill(out)
    self.clock[0] += time.perf_counter() - t0

  def consume(self, token):
    t0 = time.perf_counter()
    self.m.consume(token)
    self.clock[0] += time.perf_counter() - t0

  @property
  def done(self):
    return self.m.done


def always_allow(tok, vocab: int) -> tuple[G.Grammars, str]:
  """Grammars and a grammar that allows every token at every step and never ends: the
  stop tokens are plain tokens to it (its end-of-sequence is a special token the model
  never writes, left out of the grammar), so a row under it writes what an
  unconstrained row with stop tokens off writes."""
  specials = sorted(i for i, t in tok.backend.get_added_tokens_decoder().items()
                    if t.special and i not in tok.stop_ids and i != tok.bos_id)
  never = specials[-1]
  shim = types.SimpleNamespace(backend=tok.backend, stop_ids=frozenset({never}))
  ranges = [f"<[{a}-{b}]>" for a, b in ((0, never - 1), (never + 1, vocab - 1)) if a <= b]
  return G.Grammars(shim, vocab), llguidance.LLMatcher.grammar_from_lark(
      "start: anytok*\nanytok: " + " | ".join(ranges))


def run(llm, gs, text: str, n_constrained: int) -> tuple[float, float, list]:
  """(decode tok/s, host seconds in the matchers, tokens) of one batch."""
  eng = llm.engine
  clock = [0.0]
  reqs = []
  for i in range(FLAGS.batch):
    ids = llm.encode([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
    g = _Timed(gs.compile(text), clock) if i < n_constrained else None
    reqs.append(Request(str(i), ids, SamplingConfig(max_tokens=FLAGS.new_tokens),
                        grammar=g, until=lambda toks: False))
  eng.stop_ids = []                       # every row writes exactly new_tokens
  before = (eng.metrics.decode_tokens, eng.metrics.decode_s)
  out = {r.id: r.tokens for r in eng.run(reqs)}
  toks = eng.metrics.decode_tokens - before[0]
  secs = eng.metrics.decode_s - before[1]
  return toks / secs, clock[0], [out[str(i)] for i in range(FLAGS.batch)]


def main(argv):
  del argv
  llm = load(FLAGS.model, cache=CacheConfig(num_pages=256, page_size=16, max_seq_len=1024),
             engine=EngineConfig(max_batch=FLAGS.batch, decode_steps=FLAGS.decode_steps))
  gs, text = always_allow(llm.tokenizer, llm.config.vocab_size)
  configs = [("none", 0), ("one row", 1), ("every row", FLAGS.batch)]
  for _, k in configs:                     # warm-up: compiles each configuration's steps
    run(llm, gs, text, k)
  reps = {name: [] for name, _ in configs}
  for _ in range(FLAGS.reps):              # alternating, so drift hits every configuration
    for name, k in configs:
      reps[name].append(run(llm, gs, text, k))
  ref = reps["none"][0][2]
  rows = []
  for name, k in configs:
    if any(r[2] != ref for r in reps[name]):
      raise RuntimeError(f"{name}: the always-allow grammar changed the tokens")
    rows.append(dict(config=name, constrained_rows=k, batch=FLAGS.batch,
                     new_tokens=FLAGS.new_tokens, decode_steps=FLAGS.decode_steps,
                     decode_tok_s=statistics.median(r[0] for r in reps[name]),
                     matcher_s=statistics.median(r[1] for r in reps[name]),
                     runs=[r[0] for r in reps[name]]))
  base = rows[0]["decode_tok_s"]
  for r in rows:
    r["ratio"] = r["decode_tok_s"] / base
  common.print_tables([common.Table(
      f"structured output's cost ({FLAGS.model}, batch {FLAGS.batch}, {FLAGS.new_tokens} "
      f"tokens per row, decode_steps {FLAGS.decode_steps}; median of {FLAGS.reps})",
      ("constrained rows", "decode tok/s", "vs none", "matcher host s"),
      [(r["config"], f"{r['decode_tok_s']:.1f}", f"{r['ratio']:.2f}x",
        f"{r['matcher_s']:.3f}") for r in rows])])
  common.write_rows(FLAGS.out, rows)


if __name__ == "__main__":
  define_flags()
  app.run(main)
