r"""MemArt (seed 003) side by side with full context, plaintext retrieval memory
(Mem0-style) and a recent window, on LoCoMo-format conversations.

    python bench/memart.py --conversations=data_local/conversations.json \
        [--methods=full,memart,plaintext,recent] [--top_k=32] [--gen=24] \
        [--ks=4,8,16,32,64] [--block_sizes=16,8] [--box_keys=raw,rope] \
        [--prompt=head|tail] [--nogenerate] [--noablation] [--model=smollm2-135m] \
        [--rerank=4[,8,...]] [--neighbors=0] [--dtype=float32] [--warm] [--max_questions=0] \
        [--reuse_records=EARLIER_records.json] [--via=runner|engine] \
        [--out=bench/results_memart.json] [--plot=docs/plots/memart_recall.png]

--via=engine answers through the batch engine's `memart` mechanism, each method's
questions together (bench/memart_engine.py): the runner's answers, no timings.

Rows are rewritten after each conversation, and every question's record goes to
<out>_records.json as it is scored; a rerun skips the conversations already there.
--rows_from_records rebuilds <out> from those records (newer table code, no compute).
--reuse_records compares a new setting with an earlier run's other methods (e.g. full
context) on the same questions without recomputing them. On a GPU: --dtype=bfloat16
--warm (bench/gpu_suite.sh, stage memart).

Prompt (--prompt): `head` (default) holds LoCoMo's QA instruction in the head
before the history, prefilled once like a system prompt, so a request is
"Question: ... Short answer:" and the template (the paper's 32-37-token requests);
`tail` puts the whole LoCoMo prompt after the history (the earlier runs' layout).
Long spans are prefilled in 2,048-token chunks (`MemArtRunner(prefill_chunk=)`).

Per conversation the history is written once: `full` as one span (the whole
history after the chat head, what full-context inference computes), `memart`
and `recent` one span per session (MemArt's memory blocks, written after each
session). Per question:
- full: the history's KV and the question (prefill tokens counted as the paper
  does: head + history + question; TTFT and latency include the history prefill);
- memart: probe, retrieval of --top_k blocks (--block_sizes[0] tokens), splice
  without copies, prefill of the question only;
- memart_rerank: the same with `MemArtConfig.rerank` = --rerank (the bound's top
  rerank x top_k blocks re-scored by their keys' exact content-only max q.k);
  --neighbors=N (both): windows of 2N + 1 blocks around the best (`MemArtConfig.
  neighbors`); each record names its strategy;
- recent: the --top_k most recent blocks of the same memory (no retrieval);
- plaintext: turns embedded by all-MiniLM-L6-v2 (mean pooling, unit norm), the
  best turns by cosine until top_k x BS tokens, in chronological order,
  re-prefilled as text before the question (Mem0's shape).
Equal decode KV lengths: every method but full reads about top_k x BS history
tokens. Scores: LoCoMo's F1 and BLEU-1 of the greedy answer (--gen tokens,
stopping at the end of turn; F1 vs full paired by question), the gold answer's
NLL (teacher-forced, nats per token), evidence recall under one rule for every
method (`answer_spans`, `credited`: an evidence turn counts as retrieved when
every one of its answer-bearing tokens is among the retrieved history tokens:
the gold answer's tokens where the turn states it, else the whole turn; MemArt
and recent retrieve blocks, plaintext whole turns). Intervals are 95% bootstraps
over conversations (the unit that varies), and each method is paired with
plaintext on the same evidence (exact McNemar). --split=dev|test takes the first
--dev_conversations conversations or the rest: settings are chosen on dev and
reported on test. The retrieval ablation (no
generation): recall@k for Table 1's four strategies x block sizes x boxes over
raw (de-rotated) or post-RoPE keys (+pooled: one box per layer over all KV heads),
plus plaintext at the same token budgets (first
block size); a paired table counts the evidence turns only one of two methods
retrieved (exact McNemar p). --nogenerate runs that ablation alone.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags

import common
import jaxkv
import memart_engine
from jaxkv.config import CacheConfig, MemArtConfig
from jaxkv.data import conversations as C
from jaxkv.engine.memart import MemArtRunner
from memart_layout import (
  Layout,
  MiniLM,
  answer_ids,
  blocks_hit,
  full_bytes,
  plain_pick,
  prepare,
  recent,
  record,
  tail_ids,
  turns_hit,
)
from memart_tables import plot, rows_of, strategy_label, tables

FLAGS = flags.FLAGS
METHODS = ("full", "memart", "memart_rerank", "plaintext", "recent")
STRATEGIES = (("softmax", "max"), ("softmax", "sum"), ("rr", "max"), ("rr", "sum"))


def define_flags():
  flags.DEFINE_string("conversations", None, "LoCoMo-format JSON (scripts/make_conversations.py)")
  flags.DEFINE_string("methods", ",".join(METHODS), f"comma list of {','.join(METHODS)}")
  flags.DEFINE_string("model", "smollm2-135m", "preset or weights path")
  flags.DEFINE_integer("top_k", 32, "blocks retrieved (the paper: 128 of ~1,400; ~10%)")
  flags.DEFINE_integer("gen", 24, "greedy answer tokens at most")
  flags.DEFINE_list("ks", ["4", "8", "16", "32", "64"], "k of the recall@k ablation")
  flags.DEFINE_list("block_sizes", ["16", "8"], "block sizes (the first: generation runs)")
  flags.DEFINE_list("box_keys", ["raw", "rope"], "boxes over de-rotated / stored keys, "
                    "per layer and KV head; +pooled (e.g. raw+pooled): one box per layer "
                    "over every KV head's keys (MemArtConfig.box_heads)")
  flags.DEFINE_list("rerank", ["4"], "R of memart_rerank (the first) and of the ablation "
                    "rows 'rerank' (each: the top R x k blocks by the bound, re-scored "
                    "exactly), with a row 'exact' (every block scored by its keys' exact "
                    "content-only max q.k, the quantity eq. 3 bounds); 0: neither")
  flags.DEFINE_integer("neighbors", 0, "MemArtConfig.neighbors of memart and memart_rerank: "
                       "each block scored by the best within N blocks of it, so top_k "
                       "takes windows of 2N + 1 blocks (0: the paper's blocks alone)")
  flags.DEFINE_enum("via", "runner", ["runner", "engine"], "runner: one question at a time "
                    "on the batch-1 MemArtRunner (timed); engine: each method's questions "
                    "through the batch engine together (bench/memart_engine.py; quality "
                    "only, no timings)")
  flags.DEFINE_bool("warm", False, "run every question, and the full-context history "
                    "prefill, once untimed first: a GPU's compile times would swamp its "
                    "millisecond TTFTs (default: question 0 alone is repeated)")
  flags.DEFINE_bool("ablation", True, "run the retrieval ablation after the answers")
  flags.DEFINE_string("dtype", "float32", "compute and KV pool dtype (bfloat16 on a GPU)")
  flags.DEFINE_string("reuse_records", None, "an earlier run's <out>_records.json: answers "
                      "of methods this run does not compute (e.g. full context) are taken "
                      "from it for the conversations and questions both runs hold, so a "
                      "new setting is compared on the same questions without recomputing "
                      "them (same model, data and --prompt)")
  flags.DEFINE_enum("voters", "question", ["question", "tail"], "whose queries score blocks: "
                    "the question's tokens, or the whole tail (instruction + template too)")
  flags.DEFINE_enum("prompt", "head", ["head", "tail"], "where LoCoMo's QA instruction "
                    "goes: the held head before the history (a request is the question "
                    "alone, as the paper's) or after the history with the question")
  flags.DEFINE_bool("generate", True, "answer with every method; --nogenerate runs the "
                    "retrieval ablation alone (recall@k, plaintext included)")
  flags.DEFINE_integer("max_questions", 0, "first N questions per conversation (0: all)")
  flags.DEFINE_enum("split", "all", ["all", "dev", "test"], "which conversations: the "
                    "first --dev_conversations of the file (dev: choose settings there), the "
                    "rest (test: report there, settings frozen), or all")
  flags.DEFINE_integer("dev_conversations", 4, "conversations of the dev split")
  flags.DEFINE_string("out", None, "results JSON (rows; resumable by conversation)")
  flags.DEFINE_string("plot", "docs/plots/memart_recall.png", "recall-vs-k plot")
  flags.DEFINE_string("tables_from", None, "print the tables of an existing results JSON")
  flags.DEFINE_bool("rows_from_records", False, "rebuild --out from its <out>_records.json "
                    "(give the run's own --top_k, --block_sizes, --rerank) and print its "
                    "tables, computing nothing: for a newer table code over older runs")


def _reranks() -> list[int]:
  """--rerank as ints, zeros dropped (0: no re-ranking rows)."""
  try:
    rr = [int(x) for x in FLAGS.rerank]
  except ValueError as e:
    raise app.UsageError(f"--rerank: comma list of integers, got {FLAGS.rerank}") from e
  if any(r < 0 for r in rr):
    raise app.UsageError(f"--rerank: need R >= 0, got {FLAGS.rerank}")
  return [r for r in rr if r]


def _reused(names) -> list[dict]:
  """--reuse_records: the earlier run's records of the methods this run skips."""
  if not FLAGS.reuse_records:
    return []
  try:
    with open(FLAGS.reuse_records) as f:
      recs = json.load(f)["recs"]
  except (OSError, ValueError, KeyError) as e:
    raise app.UsageError(f"--reuse_records={FLAGS.reuse_records}: not a records file "
                         f"(<out>_records.json): {e}") from e
  return [dict(r, reused_from=FLAGS.reuse_records) for r in recs if r["method"] not in names]


def _merge(reuse: list[dict], recs: list[dict], conv: str) -> list[dict]:
  """The reused records of this conversation's questions; a question whose gold
  answer differs between the runs (other data) stops the run."""
  if not reuse:
    return []
  mine = {r["q"]: r["answer"] for r in recs if r["conv"] == conv}
  out = [r for r in reuse if r["conv"] == conv and r["q"] in mine]
  for r in out:
    if r["answer"] != mine[r["q"]]:
      raise app.UsageError(f"--reuse_records: {conv} q{r['q']} answers {r['answer']!r} "
                           f"there, {mine[r['q']]!r} here: not the same questions")
  print(f"  reused {len(out)} records ({sorted({r['method'] for r in out})})", flush=True)
  return out


def _rows(recs: list[dict], abl: list[dict]) -> list[dict]:
  """`memart_tables.rows_of` labelled with this run's flags."""
  return rows_of(recs, abl, block_size=int(FLAGS.block_sizes[0]), top_k=FLAGS.top_k,
                 rerank=(_reranks() or [0])[0])


def _box(box: str) -> dict:
  """A --box_keys item as MemArtConfig fields: raw | rope, optionally +pooled."""
  keys, plus, heads = box.partition("+")
  return dict(box_keys=keys, box_heads=heads if plus else "each")


def _runner(llm, lay: Layout, bs: int, box: str, need: int) -> MemArtRunner:
  pages = 2 * (need // bs) + 64
  cfg = MemArtConfig(block_size=bs, top_k=FLAGS.top_k, **_box(box))
  return MemArtRunner(llm, cfg, lay.head, cache=CacheConfig(
      num_pages=pages, page_size=bs, max_seq_len=need + 64, dtype=FLAGS.dtype))


def run_conversation(llm, conv, names, minilm, split: str = "all") -> list[dict]:
  """One conversation: its memory written, every question answered by every method
  (`--via`: the batch-1 runner, timed, or the batch engine), then the retrieval
  ablation; returns (records, ablation records)."""
  tok = llm.tokenizer
  c = prepare(tok, conv, minilm, prompt=FLAGS.prompt, max_questions=FLAGS.max_questions,
              split=split)
  need = c.need(tok, FLAGS.gen)
  bs0 = int(FLAGS.block_sizes[0])
  eng = None
  # ---- memory (memart, recent, ablation)
  if FLAGS.via == "engine":
    eng, r = memart_engine.engine(llm, c, need, names, block_size=bs0, top_k=FLAGS.top_k,
                                  gen=FLAGS.gen, dtype=FLAGS.dtype)
  else:
    r = _runner(llm, c.lay, bs0, "raw", need)
  mem = r.new_memory()
  t0 = time.perf_counter()
  for i, (ids, _) in enumerate(c.lay.sessions):
    r.write(mem, ids, tag=i)
  write_s = time.perf_counter() - t0
  print(f"  memory write {write_s:.1f} s ({mem.num_blocks} blocks)", flush=True)
  recs = []
  if FLAGS.generate and eng is not None:
    recs = memart_engine.answers(
        llm, eng, r, mem, c, names, minilm, gen=FLAGS.gen, top_k=FLAGS.top_k, block_size=bs0,
        rerank=(_reranks() or [0])[0], neighbors=FLAGS.neighbors, voters=FLAGS.voters)
  elif FLAGS.generate:
    recs = _answers_runner(llm, c, r, mem, names, minilm)
  abl = _ablation(llm, c, r, mem, minilm, need)
  r.forget(mem)
  return recs, abl


def _answers_runner(llm, c, r, mem, names, minilm) -> list[dict]:
  """Every question with every method on the batch-1 runner `r` (timed; question 0,
  or with --warm every question, runs twice, the first untimed)."""
  tok, lay, hist = llm.tokenizer, c.lay, c.lay.history()
  bs0 = int(FLAGS.block_sizes[0])
  reranks = _reranks()
  recs = []
  full_mem = r.new_memory()
  if "full" in names:
    if FLAGS.warm:                                     # compiles the chunk shapes untimed
      r.write(full_mem, hist, tag=-1)
      r.forget(full_mem)
      full_mem = r.new_memory()
    t0 = time.perf_counter()
    full_rows = r.write(full_mem, hist, tag=-1)
    full_write_s = time.perf_counter() - t0
    print(f"  full history prefill {full_write_s:.1f} s ({hist.size} tokens)", flush=True)
  for qi, qa in enumerate(c.qas):
    tail, voters = tail_ids(tok, lay, qa.question, FLAGS.voters)
    ans = answer_ids(tok, qa)
    for name in names:
      for _rep in range(2 if qi == 0 or FLAGS.warm else 1):   # compiles untimed
        extra = {}
        if name == "full":
          blocks, m, pre_tokens = full_rows, full_mem, lay.head.size + hist.size + tail.size
          out = r.answer(m, tail, FLAGS.gen, blocks=blocks, stop_ids=tok.stop_ids)
          latency, hit = full_write_s + out.latency_s, [True] * len(c.targets[qi])
          extra["ttft"] = full_write_s + out.ttft_s       # no prefix cache: the paper's count
          mem_bytes = full_bytes(full_mem, r.slot_bytes)
        elif name in ("memart", "memart_rerank", "recent"):
          m = mem
          if name == "recent":
            blocks = recent(mem, FLAGS.top_k)
            out = r.answer(m, tail, FLAGS.gen, blocks=blocks, stop_ids=tok.stop_ids)
          else:
            rr = reranks[0] if name == "memart_rerank" else 0
            out = r.answer(m, tail, FLAGS.gen, stop_ids=tok.stop_ids, voters=voters,
                           rerank=rr, neighbors=FLAGS.neighbors)
            blocks = out.blocks
            extra["strategy"] = strategy_label(rr, FLAGS.neighbors)
          pre_tokens, latency = out.prefill_tokens, out.latency_s
          hit = blocks_hit(m, blocks, c.targets[qi])
          mem_bytes = mem.nbytes
        else:                                          # plaintext retrieval, re-prefilled
          t0 = time.perf_counter()
          chosen, ids = c.plain(minilm, qa.question, FLAGS.top_k * bs0)
          m = r.new_memory()
          blocks = r.write(m, ids) if ids.size else np.zeros(0, np.int32)
          out = r.answer(m, tail, FLAGS.gen, blocks=blocks, stop_ids=tok.stop_ids)
          latency = time.perf_counter() - t0
          extra["ttft"] = latency - out.latency_s + out.ttft_s
          pre_tokens = ids.size + tail.size
          hit = turns_hit(c, chosen, c.targets[qi])
          mem_bytes = c.plain_bytes()
          extra["plain_mem"] = m
        forced = r.answer(m, tail, ans.size, blocks=blocks, forced=ans)
        if "plain_mem" in extra:
          r.forget(extra["plain_mem"])
      recs.append(record(c, qi, name, tok, hit=hit, nll=-np.mean(forced.logprobs),
                         prefill_tokens=pre_tokens, probe_tokens=out.probe_tokens,
                         decode_kv_len=out.decode_kv_len, latency_s=latency,
                         ttft_s=extra.get("ttft", out.ttft_s), memory_bytes=mem_bytes,
                         tokens=out.tokens, strategy=extra.get("strategy")))
    print(f"  {c.conv.sample_id} q{qi + 1}/{len(c.qas)} " + " ".join(
        f"{x['method']}:f1={x['f1']:.2f},rec={x['recall']:.2f}" for x in recs[-len(names):]),
          flush=True)
  r.forget(full_mem)
  return recs


def _ablation(llm, c, r, mem, minilm, need) -> list[dict]:
  """The retrieval ablation (no generation): recall@k per strategy x block size x
  boxes, plaintext at the same token budgets (`r`, `mem`: the first block size's
  runner and memory, raw boxes)."""
  tok, lay, qas, conv, split = llm.tokenizer, c.lay, c.qas, c.conv, c.split
  bs0 = int(FLAGS.block_sizes[0])
  reranks = _reranks()
  qvecs = minilm([qa.question for qa in qas]) if minilm else None
  abl = []
  ks = [int(k) for k in FLAGS.ks]
  for bs in (int(b) for b in (FLAGS.block_sizes if FLAGS.ablation else ())):
    for box in FLAGS.box_keys:
      first = (bs, box) == (bs0, "raw")
      ra = r if first else _runner(llm, lay, bs, box, need)
      ra.alloc.check()
      ma = mem if first else ra.new_memory()             # the generation runs' memory
      for i, (ids, _) in enumerate(lay.sessions if not first else ()):
        ra.write(ma, ids, tag=i)
      for qi, qa in enumerate(qas):
        pr = ra.probe(*tail_ids(tok, lay, qa.question, FLAGS.voters))
        picks = {}                                     # strategy -> k -> blocks
        for norm, agg in STRATEGIES:
          sc = ra.scores(ma, pr, norm=norm, agg=agg)
          picks[f"{norm}-{agg}"] = lambda kk, sc=sc: ra.select(ma, sc, kk)
        if reranks and box == "raw":                   # the config's softmax-max, exactly
          ex = ra.exact_scores(ma, pr)
          picks["exact softmax-max"] = lambda kk: ra.select(ma, ex, kk)
          for rr in reranks:        # the runner's option (MemArtConfig.rerank): R x k re-scored
            picks[f"rerank{rr}x softmax-max"] = lambda kk, rr=rr: ra.rank(ma, pr, kk, rerank=rr)
        picks["recent"] = lambda kk, ma=ma: recent(ma, kk)   # the recency baseline
        for strat, pick in picks.items():
          for k in ks:
            kk = max(1, k * bs0 // bs)                 # equal tokens across block sizes
            hit = blocks_hit(ma, pick(kk), c.targets[qi])
            abl.append(dict(conv=conv.sample_id, q=qi, block_size=bs, box_keys=box,
                            strategy=strat, top_k=kk, tokens=kk * bs, hits=sum(hit),
                            hit=hit, n=len(qa.evidence), split=split))
        if first and c.emb is not None:                # plaintext at the same token budgets
          for k in ks:
            hit = turns_hit(c, plain_pick(c.emb @ qvecs[qi], c.turn_rows, c.spans, k * bs0),
                            c.targets[qi])
            abl.append(dict(conv=conv.sample_id, q=qi, block_size=bs, box_keys=box,
                            strategy="plaintext", top_k=k, tokens=k * bs0, hits=sum(hit),
                            hit=hit, n=len(qa.evidence), split=split))
      if not first:
        ra.forget(ma)
  return abl


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, tables)
    return
  if FLAGS.rows_from_records:
    if not FLAGS.out:
      raise app.UsageError("--rows_from_records rebuilds --out: give --out")
    side = os.path.splitext(FLAGS.out)[0] + "_records.json"
    try:
      with open(side) as f:
        state = json.load(f)
    except (OSError, ValueError) as e:
      raise app.UsageError(f"--rows_from_records: cannot read {side}: {e}") from e
    rows = _rows(state["recs"], state["abl"])
    common.write_rows(FLAGS.out, rows)
    common.print_tables(tables(rows))
    return
  if not FLAGS.conversations:
    raise app.UsageError("give --conversations (LoCoMo-format JSON; "
                         "scripts/make_conversations.py builds one)")
  if FLAGS.via == "engine" and FLAGS.warm:
    raise app.UsageError("--warm prepares timed runs: --via=engine records no timings "
                         "(time with --via=runner)")
  names = common.method_names(FLAGS.methods, METHODS)
  try:
    convs = C.load_locomo(FLAGS.conversations)
  except (C.ConversationFormatError, OSError) as e:
    raise app.UsageError(str(e)) from e
  for box in FLAGS.box_keys:                           # bad flags fail before loading
    try:
      MemArtConfig(**_box(box))
    except ValueError as e:
      raise app.UsageError(f"--box_keys={box}: {e}") from e
  if "memart_rerank" in names and not _reranks():
    raise app.UsageError("memart_rerank needs --rerank R > 0")
  reuse = _reused(names)
  llm = jaxkv.load(FLAGS.model, dtype=FLAGS.dtype)
  minilm = MiniLM() if "plaintext" in names or FLAGS.ablation else None  # ablation: plaintext rows
  side = FLAGS.out and os.path.splitext(FLAGS.out)[0] + "_records.json"
  state = dict(recs=[], abl=[])
  if side and os.path.exists(side):
    with open(side) as f:
      state = json.load(f)
  done = {r["conv"] for r in state["recs"]}
  rows = _rows(state["recs"], state["abl"])
  if FLAGS.split != "all":
    if not 0 < FLAGS.dev_conversations < len(convs):
      raise app.UsageError(f"--dev_conversations={FLAGS.dev_conversations}: need 1.."
                           f"{len(convs) - 1} ({len(convs)} conversations in the file)")
    convs = convs[:FLAGS.dev_conversations] if FLAGS.split == "dev" \
        else convs[FLAGS.dev_conversations:]
  for conv in convs:
    if conv.sample_id in done:
      print(f"{conv.sample_id}: already in {side}, skipped")
      continue
    rc, ab = run_conversation(llm, conv, names, minilm, FLAGS.split)
    rc += _merge(reuse, rc, conv.sample_id)
    # Each compiled XLA:CPU executable holds memory mappings; one conversation's
    # shapes took ~44k of the 65,530 a process may hold (vm.max_map_count), and the
    # second conversation then died in LLVM ("Cannot allocate memory"). Free them.
    jax.clear_caches()
    state["recs"] += rc
    state["abl"] += ab
    rows = _rows(state["recs"], state["abl"])
    common.write_rows(FLAGS.out, rows)
    if side:
      with open(side, "w") as f:
        json.dump(state, f)
  if FLAGS.plot:
    print(f"wrote {plot(rows, FLAGS.plot)}")
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
