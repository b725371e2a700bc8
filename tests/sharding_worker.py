"""Runs one model on a single device and on (data, model) meshes of 8 CPU devices;
prints one JSON line per mesh. Started by tests/test_sharding.py in a fresh
process, because the device count is fixed when JAX starts.

    python tests/sharding_worker.py [--model=tiny|smollm2] [--meshes=1x8,2x4,4x2,8x1]
        [--mode=mechanisms]     # a mixed batch of KV mechanisms instead
        [--skew=S]              # tiny/smollm2: process 1 reaches the meshes S s late
    python scripts/launch.py --processes=2 --devices_per_process=4 -- \
        python tests/sharding_worker.py --meshes=2x4      # the mesh spans 2 processes

Under scripts/launch.py (JAXKV_* set) the meshes span every process's devices,
the single-device baseline runs on each process's own first device, and only
process 0 prints.
"""

from __future__ import annotations

import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from flax import nnx

from jaxkv import distributed, sharding
from jaxkv.config import CacheConfig, EngineConfig, ModelConfig, SamplingConfig
from jaxkv.engine.driver import Driver
from jaxkv.engine.engine import Engine, Request
from jaxkv.kv import plan
from jaxkv.kv import state as kv_state
from jaxkv.models.llama import Transformer

CACHE = CacheConfig(num_pages=64, page_size=16, max_seq_len=128)


def tiny_model():
  """8 query heads over 2 KV heads: KV heads shard on model = 2 and are replicated on
  model = 4 and 8 (the fallback); biases on, as Qwen2."""
  cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=8, num_kv_heads=2, head_dim=16, qkv_bias=True)
  return Transformer(cfg, rngs=nnx.Rngs(0)).relayout(scan_layers=False)


class EvenTokens:
  """A grammar in the engine's matcher protocol (`jaxkv.engine.grammar.Matcher`): only
  even token ids, so the token mask's path runs on a mesh without a tokenizer."""

  done = False

  def fill(self, out):
    out[:] = np.int32(0x55555555)          # bits 0, 2, ..., 30 of every word

  def consume(self, token):
    if token % 2:
      raise ValueError(f"odd token {token} under the even-token mask")


def greedy(model, prompts, mesh, max_tokens, masked=False):
  """Greedy tokens of every prompt (with `masked`, every other row under EvenTokens);
  the engine records, for every allocation, the sequence's data shard and the shards
  of the slots it got (`eng.placed`)."""
  eng = Engine(model, [], CACHE, EngineConfig(max_batch=8, prefill_chunk=32, decode_steps=8),
               mesh=mesh)
  alloc, extend, eng.placed = eng.allocator, eng.allocator.extend, []

  def placed_extend(seq, n):
    slots = extend(seq, n)
    eng.placed.append((alloc._seqs[seq].shard, sorted(set(alloc.shard_of(slots).tolist()))))
    return slots
  alloc.extend = placed_extend
  reqs = [Request(str(i), p, SamplingConfig(max_tokens=max_tokens),
                  grammar=EvenTokens() if masked and i % 2 else None)
          for i, p in enumerate(prompts)]
  out = {r.id: r.tokens for r in eng.run(reqs)}
  return [out[str(i)] for i in range(len(prompts))], eng


def slot_blocks(kv) -> list[tuple[int, int]]:
  """The distinct [start, stop) ranges of pool slots the devices hold."""
  idx = kv.k.sharding.devices_indices_map(kv.k.shape).values()
  return sorted({(i[1].start or 0, i[1].stop or kv.k.shape[1]) for i in idx})


def logits(model, prompts, mesh):
  """Every position's logits of a one-chunk prefill of all prompts (ragged rows)."""
  graphdef, weights = nnx.split(model)
  if mesh is None:
    kv = kv_state.init_pool(model.cfg, CACHE)
  else:
    weights = sharding.shard_weights(weights, mesh, model.cfg)
    kv = sharding.init_pool(model.cfg, CACHE, mesh)
  drv = Driver(graphdef, weights, kv, mesh=mesh)
  width = max(len(p) for p in prompts)
  rows = [plan.Row(np.asarray(p, np.int32), 0) for p in prompts]
  smap = (CACHE.page_size + np.arange(len(prompts) * width, dtype=np.int32)).reshape(-1, width)
  out = []
  for _, o in drv.prefill(rows, chunk=width, slot_map=smap, read="all",
                          options=lambda ch: {"return_logits": True}):
    out.append(distributed.fetch(o.logits))
  return np.concatenate(out, axis=1), drv


def composed_session(llm, eng) -> dict:
  """Three turns of one ["agents", "pruned", "reuse"] session on the mixed engine's
  mechanisms (test_sessions' tool chat, roles 0, 1, 0; IntentKV at 64 tokens, segment
  reuse on the role adapter), then a second session's first call on the third turn's
  chat, which splices what the first stored: id -> (tokens, extra, finish reason)."""
  from jaxkv.config import SamplingConfig
  from jaxkv.engine.engine import Request
  from jaxkv.engine.mechanisms import composed
  from test_sessions import MESSAGES
  ms = eng.mechanisms
  eng.add_mechanism(composed.Composed([ms["agents"], ms["pruned"], ms["reuse"]]))
  turns = [i for i, msg in enumerate(MESSAGES) if msg["role"] == "assistant"][:3]
  out = {}
  for session, i, role in [("crew", t, r) for t, r in zip(turns, (0, 1, 0), strict=True)] + [
      ("mate", turns[2], 1)]:
    if session not in ms["agents"].sessions:
      ms["agents"].open(session)
    prompt, ctx = ms["pruned"].context(session, MESSAGES[:i])
    (r,) = list(eng.run([Request(f"{session}-{i}", prompt, SamplingConfig(max_tokens=8),
                                 adapter=role, mechanism="agents+pruned+reuse",
                                 context={"session": session, **ctx})]))
    out[r.id] = (r.tokens, r.extra, r.finish_reason)
  for session in ("crew", "mate"):
    ms["agents"].close(session)
  return out


def composed_diff(got: dict, want: dict) -> list:
  """[id, what differs] per call of `composed_session` whose tokens, finish or counts
  differ from `want`'s; floats (QueryMemory's cosine: a reduction whose order the mesh
  changes) within 1e-5."""
  out = []
  for k, (tokens, extra, finish) in got.items():
    w_tokens, w_extra, w_finish = want[k]
    if (tokens, finish) != (w_tokens, w_finish):
      out.append([k, "tokens"])
      continue
    bad = sorted(f for f in extra.keys() | w_extra.keys()
                 if not (isinstance(extra.get(f), float) and isinstance(w_extra.get(f), float)
                         and abs(extra[f] - w_extra[f]) <= 1e-5)
                 and extra.get(f) != w_extra.get(f))
    if bad:
      out.append([k, bad])
  return out


def mechanisms(meshes) -> None:
  """--mode=mechanisms: a plain request and a pruned, a reuse, a SemShareKV, a MemArt and
  an agents request (a role adapter, replicated on the mesh) in one batch
  (tests/test_mechanisms_mixed.py's) on each mesh, against one device: tokens and what
  each mechanism did; then three turns of one composed agents + pruned + reuse session
  (`composed_session`) on the same engine, likewise."""
  import hf_util
  import test_mechanisms_mixed as mixed
  llm = hf_util.random_llm_with_real_tokenizer()

  def run(mesh):
    eng = mixed._engine(llm, mesh=mesh, max_batch=8)
    got = {r.id: r for r in eng.run(mixed._requests(llm, eng))}
    eng.kv_manager.check()
    eng.mechanisms["agents"].close("team")     # the session's trajectory: its state
    crew = composed_session(llm, eng)
    eng.kv_manager.check()
    return ({k: r.tokens for k, r in got.items()}, {k: r.extra for k, r in got.items()},
            {k: r.finish_reason for k, r in got.items()}, crew, eng)

  want_tok, want_extra, _, want_crew, _ = run(None)
  for d, m in meshes:
    tok, extra, finish, crew, eng = run(sharding.make_mesh(d, m))
    if distributed.is_leader():
      print(json.dumps({"mesh": [d, m], "processes": jax.process_count(),
                        "tokens_equal": tok == want_tok, "extra_equal": extra == want_extra,
                        "finish": finish, "alloc_shards": eng.shards,
                        "pool_devices": len(eng.kv.k.sharding.device_set),
                        "sequences_left": len(eng.allocator.sequences()),
                        "composed_diff": composed_diff(crew, want_crew),
                        "composed_finish": [c[2] for c in crew.values()],
                        "composed_pruned": sum(bool(c[1]["pruned"]) for c in crew.values()),
                        "composed_reused": sum(c[1]["reused_tokens"] for c in crew.values()),
                        "composed_shared": sum(c[1]["shared_tokens"]
                                               for c in crew.values())}), flush=True)


def main():
  distributed.initialize()
  args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
  which = args.get("model", "tiny")
  meshes = [tuple(int(x) for x in m.split("x"))
            for m in args.get("meshes", "1x8,2x4,4x2,8x1").split(",")]
  if args.get("mode") == "mechanisms":
    return mechanisms(meshes)
  rng = np.random.default_rng(0)
  if which == "tiny":
    model = tiny_model()
    prompts = [rng.integers(1, 512, 5 + 7 * i).tolist() for i in range(8)]
    max_tokens = 8
  else:
    import jaxkv
    llm = jaxkv.load(which)
    model = llm.model
    prompts = [llm.encode([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Name three prime numbers.",
                "Why is the sky blue?", "What is a KV cache?") * 2]
    max_tokens = 6
  want_tok, _ = greedy(model, prompts, None, max_tokens)
  want_masked, _ = greedy(model, prompts, None, max_tokens, masked=True)
  want_logits, _ = logits(model, prompts, None)
  if jax.process_index() == 1:   # --skew: one process reaches the mesh late (slow weights)
    time.sleep(float(args.get("skew", 0)))
  for d, m in meshes:
    mesh = sharding.make_mesh(d, m)
    tok, eng = greedy(model, prompts, mesh, max_tokens)
    masked, _ = greedy(model, prompts, mesh, max_tokens, masked=True)
    got, drv = logits(model, prompts, mesh)
    wq = jax.tree_util.tree_flatten_with_path(eng.weights)[0]
    if not distributed.is_leader():
      continue
    print(json.dumps({
        "processes": jax.process_count(), "devices": jax.device_count(),
        "mesh": [d, m], "tokens_equal": tok == want_tok, "tokens": tok,
        # structured output's token mask on the mesh: rows under it equal one device's
        # and write only allowed (even) tokens; the rows beside them are unchanged
        "masked_equal": masked == want_masked,
        "masked_even": all(t % 2 == 0 for row in masked[1::2] for t in row),
        "unmasked_rows_equal": masked[0::2] == tok[0::2],
        "max_logit_diff": float(np.abs(got - want_logits).max()),
        "logit_scale": float(np.abs(want_logits).max()),
        "pool_k_spec": str(drv.kv.k.sharding.spec),
        "pool_devices": len(drv.kv.k.sharding.device_set),
        "wq_spec": str(next(x.sharding.spec for p, x in wq
                            if sharding._leaf_name(p) == "wq_t")),   # [out, in]
        "allocator_check": eng.allocator.check() is None,
        "alloc_shards": eng.shards,
        "rows_local": all(got == [own] for own, got in eng.placed if got),
        "shards_used": sorted({own for own, _ in eng.placed}),
        "pool_slot_blocks": slot_blocks(eng.kv),
    }), flush=True)


if __name__ == "__main__":
  main()
