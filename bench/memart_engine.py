"""bench/memart.py `--via=engine`: every method's answers through the batch engine.

Per conversation one engine on one pool, with the `memart` mechanism built on the
run's runner (`MemArt(runner=)`: the bench's own held head, LoCoMo's instruction in
it). The runner writes the memories on the engine's KV manager as the batch-1 path
does (the history per session for MemArt and the recent window, as one span for
full context, each question's picked turns for plaintext); then each method's
questions go to the engine together (`jaxkv.evaluation.memart.serve_questions`), so
their answers decode batched. The records are the runner path's (same fields, the
same evidence rule) with `via: "engine"` and no timings (`ttft_s`, `latency_s`
None: a row's TTFT in a batch includes its wait behind other rows; time with
`--via=runner`).
"""

from __future__ import annotations

import time

import numpy as np

from jaxkv.config import CacheConfig, EngineConfig, MemArtConfig
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.memart import MemArtRunner
from jaxkv.evaluation import memart as evaluation
from memart_layout import answer_ids, blocks_hit, full_bytes, recent, record, tail_ids, turns_hit
from memart_tables import strategy_label


def engine(llm, c, need: int, names, *, block_size: int, top_k: int, gen: int,
           dtype: str) -> tuple[Engine, MemArtRunner]:
  """An engine whose pool holds the conversation's memory twice (MemArt's and full
  context's), a plaintext memory per question and every row's question and answer;
  and the runner on its KV manager."""
  cfg = EngineConfig()
  tail = max(tail_ids(llm.tokenizer, c.lay, q.question)[0].size for q in c.qas)
  per_row = -(-(tail + gen) // block_size) + 4
  pages = 2 * (need // block_size) + 64 + 2 * cfg.max_batch * per_row
  if "plaintext" in names:
    pages += len(c.qas) * (top_k + 2)
  cache = CacheConfig(num_pages=pages, page_size=block_size, max_seq_len=need + 64,
                      dtype=dtype)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, cache, cfg)
  runner = MemArtRunner(llm, MemArtConfig(block_size=block_size, top_k=top_k), c.lay.head,
                        cache=cache, kv=eng.kv_manager)
  eng.add_mechanism(MemArt(runner=runner))
  return eng, runner


def answers(llm, eng, r, mem, c, names, minilm, *, gen: int, top_k: int, block_size: int,
            rerank: int, neighbors: int, voters: str) -> list[dict]:
  """Every question with every method in `names` through `eng` (module docstring);
  `mem`: the conversation's memory (one span per session), written by `r`. Records in
  the runner path's order (question by question, methods in `names` order)."""
  tok, lay = llm.tokenizer, c.lay
  hist = lay.history()
  full_mem = r.new_memory()
  full_rows = r.write(full_mem, hist, tag=-1) if "full" in names else None
  by_method = {}
  for name in names:
    t0 = time.perf_counter()
    qs, side, owned = [], [], []
    for qa in c.qas:
      tail, vote = tail_ids(tok, lay, qa.question, voters)
      ans = answer_ids(tok, qa)
      if name == "full":
        q = evaluation.Question(full_mem, tail, ans, blocks=full_rows)
        side.append(dict(pre_tokens=lay.head.size + hist.size + tail.size,
                         memory_bytes=full_bytes(full_mem, r.slot_bytes)))
      elif name == "recent":
        q = evaluation.Question(mem, tail, ans, blocks=recent(mem, top_k))
        side.append(dict(memory_bytes=mem.nbytes))
      elif name in ("memart", "memart_rerank"):
        rr = rerank if name == "memart_rerank" else 0
        q = evaluation.Question(mem, tail, ans, voters=vote, rerank=rr, neighbors=neighbors)
        side.append(dict(memory_bytes=mem.nbytes, strategy=strategy_label(rr, neighbors)))
      else:                                          # plaintext: its picked turns, written
        chosen, ids = c.plain(minilm, qa.question, top_k * block_size)
        m = r.new_memory()
        owned.append(m)
        q = evaluation.Question(m, tail, ans,
                                blocks=r.write(m, ids) if ids.size else np.zeros(0, np.int32))
        side.append(dict(pre_tokens=ids.size + tail.size, memory_bytes=c.plain_bytes(),
                         chosen=chosen))
      qs.append(q)
    served = evaluation.serve_questions(eng, qs, gen)
    for m in owned:
      r.forget(m)
    by_method[name] = [_record(c, qi, name, q, s, x, tok)
                       for qi, (q, s, x) in enumerate(zip(qs, served, side))]
    f1 = np.mean([x["f1"] for x in by_method[name]])
    rec = np.mean([x["recall"] for x in by_method[name]])
    print(f"  {c.conv.sample_id} {name}: {len(qs)} questions in {time.perf_counter() - t0:.1f} s "
          f"(engine), f1={f1:.2f} recall={rec:.2f}", flush=True)
  r.forget(full_mem)
  return [by_method[name][qi] for qi in range(len(c.qas)) for name in names]


def _record(c, qi: int, name: str, q, s, side: dict, tok) -> dict:
  """The runner path's record of question `qi` answered by `name` (`s`: its `Served`)."""
  if name == "full":
    hit = [True] * len(c.targets[qi])
  elif name == "plaintext":
    hit = turns_hit(c, side["chosen"], c.targets[qi])
  else:
    hit = blocks_hit(q.memory, s.pre.blocks, c.targets[qi])
  return record(c, qi, name, tok, hit=hit, nll=s.nll,
                prefill_tokens=side.get("pre_tokens", s.usage["prefill_tokens"]),
                probe_tokens=s.usage["probe_tokens"], decode_kv_len=s.usage["decode_kv_len"],
                latency_s=None, ttft_s=None, memory_bytes=side["memory_bytes"],
                tokens=s.tokens, strategy=side.get("strategy"), via="engine")
