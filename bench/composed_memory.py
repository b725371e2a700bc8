r"""MemArt composed with IntentKV pruning in one session, beside each alone and full
context, on multi-session conversations with planted facts.

    python bench/composed_memory.py --conversations=data_local/conversations_planted.json \
        --out=bench/results_composed_memory.json [--split=test] [--dev_conversations=4]
        [--methods=full,pruned,memart,pruned+memart] [--budget=640] [--gen=24]
        [--max_conversations=0]

A conversation's sessions are what an agent's user said earlier; its planted-fact
questions are asked after them. Each method serves them through the batch engine as
a server would (system prompt: answer in a short phrase with the conversations' words):

    full           one prompt: every session's text, then the question (prefix cache:
                   the history is prefilled once per conversation)
    pruned         a pruned session (IntentKV at --budget): the sessions as user turns
                   ("Noted." between), then each question as the next turn; the history
                   is pruned on the first question and stays pruned
    memart         a MemArt session: the same messages; the history written as memory
                   on the first question, each question answered over retrieved blocks
    pruned+memart  composed sessions (`["pruned", "memart"]`) on MemArt's protocol: the
                   first question's recall writes the history (its messages' lines,
                   as MemArt writes them), and every question is the first call of a
                   new conversation over that memory (a session of its own sharing
                   it), so a recall retrieves its blocks, which the row copies into
                   its prompt's region; IntentKV at --budget prunes that conversation
    pruned+memart/random  the chance line: pruned+memart with the retrieved blocks
                   replaced by as many live memory blocks drawn at random (in memory
                   order; seeded by question)
    pruned+memart/seq  one composed session as an agent would use it: each history
                   session is a conversation of its own (one call), then the
                   questions one after another, each a new conversation whose recall
                   writes the last one (a session, or the previous question and its
                   answer) into the memory before retrieving
    pruned+memart/seq-inputs  /seq with `memart.write_turns="inputs"`: the model's
                   replies are not written (the questions are)
    pruned+memart/sessions  the history written as /seq writes it (a conversation per
                   session), then each question a conversation of its own over that
                   memory, as pruned+memart: what /seq costs by writing session by
                   session, without the earlier questions and answers

The composed methods' engine first serves one plain pruned call ("Hello."), so the system
prompt and the user opening are cached as on a running server (a region can only be
copied after a cached prefix; the first request of a server computes it).
MemArt's setting is the one frozen on the dev split in docs/results/memart.md (blocks of 8
tokens, top 64, re-ranking 4, windows of 3 blocks, boxes over raw keys); --budget
defaults to about what MemArt reads (64 x 8 history tokens + the question).

Per question: LoCoMo F1 and "value said" (the gold answer in the reply) of the greedy
answer (--gen tokens), the prompt tokens the question's call prefilled (its memory
region and cached prefix not counted), TTFT inside the engine (a composed call's
includes its recall, which runs first: MemArt alone writes and retrieves inside its own),
the KV entries it decoded over. Per method: means with 95% bootstrap intervals over
conversations (the unit that varies), "value said" paired by question against full and
against memart (exact McNemar). Rows go to --out after every conversation; a rerun skips the
conversations already there. --tables_from=FILE reprints the tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

import common
import jaxkv
from jaxkv.config import CacheConfig, EngineConfig, MemArtConfig, PruningConfig, SamplingConfig
from jaxkv.data import calls as calls_lib
from jaxkv.data import conversations as C
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms import memart_region as region
from jaxkv.engine.mechanisms.composed import Composed
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.memart import MemArtSessions

METHODS = ("full", "pruned", "memart", "pruned+memart", "pruned+memart/random",
           "pruned+memart/seq", "pruned+memart/seq-inputs", "pruned+memart/sessions")
SYSTEM = ("You answer questions about the user's earlier conversations with a short "
          "phrase, using exact words from those conversations whenever possible.")
QUESTION = "Question: {} Short answer:"
MEMART = MemArtConfig(block_size=8, top_k=64, rerank=4, neighbors=1, box_keys="raw")


def define_flags():
  flags.DEFINE_string("conversations", None, "LoCoMo-format conversations with planted facts")
  flags.DEFINE_string("out", None, "JSON rows, one per question")
  flags.DEFINE_string("methods", ",".join(METHODS), "methods to run, comma-separated")
  flags.DEFINE_integer("budget", 640, "IntentKV budget C (live prompt KV entries)")
  flags.DEFINE_integer("gen", 24, "answer tokens (greedy, stopping at the end of turn)")
  flags.DEFINE_enum("split", "test", ["dev", "test", "all"], "conversations: the first "
                    "--dev_conversations (dev), the rest (test) or all")
  flags.DEFINE_integer("dev_conversations", 4, "conversations in the dev split")
  flags.DEFINE_integer("max_conversations", 0, "first N conversations of the split (0: all)")
  flags.DEFINE_string("model", "smollm2-135m", "model preset")
  flags.DEFINE_string("tables_from", None, "reprint the tables of a results file")


def session_text(s: C.Session) -> str:
  return C.render_session(s)


def engine(llm, method: str, need: int, budget: int):
  """The method's engine and the mechanism its requests name (None: plain requests)."""
  cache = CacheConfig(num_pages=4 * need // MEMART.block_size + 512,
                      page_size=MEMART.block_size, max_seq_len=need + 256)
  eng = Engine(llm.model, llm.tokenizer.stop_ids, cache,
               EngineConfig(max_batch=1, prefill_chunk=512, decode_steps=8,
                            prefix_cache=method == "full"))
  parts = []
  if "pruned" in method:
    parts.append(eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager,
                                          PruningConfig(method="intentkv", budget=budget))))
  if "memart" in method:
    cfg = MEMART
    if method.endswith("-inputs"):
      cfg = dataclasses.replace(MEMART, write_turns="inputs")
    parts.append(eng.add_mechanism(MemArt(MemArtSessions(
        llm, cfg, cache, system_prompt=SYSTEM,
        kv=eng.kv_manager))))
  if len(parts) > 1:
    eng.add_mechanism(Composed(parts))      # named "pruned+memart" (every variant)
  return eng, parts


def run(eng, req: Request):
  (res,) = list(eng.run([req]))
  if res.finish_reason not in ("stop", "length"):
    raise RuntimeError(f"{req.id}: {res.error}")
  return res


def history(conv: C.Conversation) -> list[dict]:
  out = []
  for s in conv.sessions:
    out += [{"role": "user", "content": session_text(s)},
            {"role": "assistant", "content": "Noted."}]
  return out


def need_tokens(tok, convs) -> int:
  """Positions a conversation's longest prompt may take (every engine of a run gets one
  pool shape, so the compiled steps are shared: one pool per conversation compiled its
  own and ran the process out of memory mappings)."""
  return max(len(tok.encode(tok.render_chat([{"role": "system", "content": SYSTEM}]
                                            + history(c)))) for c in convs) + 512


def serve_conversation(llm, method: str, conv: C.Conversation, budget: int, gen: int,
                       need: int | None = None):
  """(question, result, prefilled, kv tokens) for each of the conversation's questions."""
  tok = llm.tokenizer
  sys_msg = {"role": "system", "content": SYSTEM}
  hist = history(conv)
  eng, parts = engine(llm, method, need or need_tokens(tok, [conv]), budget)
  samp = SamplingConfig(max_tokens=gen)
  out = []
  if "+" in method:      # a running server has the system prompt cached (shared keys):
    run(eng, Request("warm", _warm(tok, parts[0], sys_msg), SamplingConfig(max_tokens=1),
                     mechanism="pruned", context=parts[0].context("warm", [
                         sys_msg, {"role": "user", "content": "Hello."}])[1]))
  per_session = method.startswith("pruned+memart/seq") or method.endswith("/sessions")
  if per_session:
    pr, ma = parts
    for i, s in enumerate(conv.sessions):          # each session: a conversation of its own
      _composed(eng, pr, ma, "s", [sys_msg, {"role": "user", "content": session_text(s)}],
                f"s{i}", SamplingConfig(max_tokens=1))
  for j, qa in enumerate(conv.qa):
    q = {"role": "user", "content": QUESTION.format(qa.question)}
    if method == "full":
      body = "\n\n".join(session_text(s) for s in conv.sessions)
      msgs = [sys_msg, {"role": "user", "content": body + "\n\n" + q["content"]}]
      res = run(eng, Request(f"q{j}", tok.encode(tok.render_chat(msgs, add_generation_prompt=True)),
                             samp))
      out.append((qa, res, res.prompt_tokens - res.cached_tokens, res.prompt_tokens))
    elif method == "pruned":
      prompt, ctx = parts[0].context(conv.sample_id, [sys_msg] + hist + [q])
      res = run(eng, Request(f"q{j}", prompt, samp, mechanism="pruned", context=ctx))
      out.append((qa, res, res.prompt_tokens - res.cached_tokens, res.extra["kv_live_after"]))
    elif method == "memart":
      msgs = hist + [q]
      res = run(eng, Request(f"q{j}", tok.encode(tok.render_chat(msgs, add_generation_prompt=True)),
                             samp, mechanism="memart",
                             context=parts[0].context(conv.sample_id, msgs)))
      out.append((qa, res, res.extra["prefill_tokens"], res.extra["decode_kv_len"]))
    else:
      sid = "s"
      if method.endswith("/sessions") and j:        # the history's memory, not written to
        sid = f"q{j}"
        ma.sessions.sessions[sid] = ma.sessions.sessions["s"]
      elif not per_session:                         # a session per question, one memory
        sid, pr, ma = f"q{j}", *parts
        if j:
          ma.sessions.sessions[sid] = ma.sessions.sessions["q0"]
        else:
          ma.conversations[sid] = region.Conversation(hist, np.zeros(0, np.int32),
                                                      np.zeros(0, np.int32), {})
      rng = np.random.default_rng(j) if method.endswith("/random") else None
      res = _composed(eng, *parts, sid, [sys_msg, q], f"q{j}", samp, rng)
      out.append((qa, res, res.prompt_tokens - res.cached_tokens, res.extra["kv_live_after"]))
  eng.kv_manager.check()
  return out


def _warm(tok, pr, sys_msg) -> list[int]:
  return pr.context("warm", [sys_msg, {"role": "user", "content": "Hello."}])[0]


def _composed(eng, pr, ma, sid, msgs, rid, samp, rng=None):
  """One call of composed session `sid`, as the server makes it (a recall first when it
  opens a conversation and there is memory to write or read); with `rng` the recall's
  blocks are swapped for random ones (`random_blocks`)."""
  prompt, ctx = pr.context(sid, msgs)
  got, rc = ma.turn(sid, msgs, None, prompt, ctx), None
  if isinstance(got, dict):
    rc = run(eng, Request(f"{rid}-recall", prompt[-1:], SamplingConfig(max_tokens=1),
                          mechanism="memart", context=got))
    recall = rc.extra["recall"]
    if rng is not None:
      recall = random_blocks(ma.sessions.sessions[sid][0], recall, rng)
    got = ma.turn(sid, msgs, None, prompt, ctx, recall)
  prompt, ctx = got
  res = run(eng, Request(rid, prompt, samp, mechanism="pruned+memart", context=ctx))
  if rc is not None:          # the recall runs before the answer starts: its time is the
    res.ttft_s += rc.latency_s   # call's (MemArt alone writes and retrieves inside its TTFT)
  return res


def random_blocks(mem, recall: dict, rng) -> dict:
  """`recall` with its blocks replaced by as many live blocks of `mem` drawn uniformly
  without replacement, in chronological order (as retrieval returns them), and their
  token ids."""
  live = np.flatnonzero(mem.live)
  pick = rng.choice(live, size=min(len(recall["blocks"]), live.size), replace=False)
  blocks = pick[np.argsort(mem.time[pick])].astype(np.int32)
  ids, _, _ = region.region_of(mem, blocks)
  return dict(recall, blocks=blocks.tolist(), ids=ids.tolist())


def record(llm, method, conv, qa, res, prefilled, kv) -> dict:
  text = llm.tokenizer.decode(res.tokens)
  return dict(method=method, conversation=conv.sample_id, question=qa.question,
              answer=qa.answer, reply=text, f1=C.f1(text, qa.answer),
              said=C.contains(text, qa.answer), prefilled=int(prefilled), kv=int(kv),
              ttft_s=res.ttft_s, extra={k: v for k, v in (res.extra or {}).items()
                                        if isinstance(v, (int, float, str, bool))})


def tables(rows: list[dict]) -> list[common.Table]:
  present = {r["method"] for r in rows}
  methods = [m for m in METHODS if m in present]
  by = {m: {(r["conversation"], r["question"]): r for r in rows if r["method"] == m}
        for m in methods}
  lines = []
  for m in methods:
    per: dict = {}
    for r in by[m].values():
      per.setdefault(r["conversation"], []).append(r)
    flat = lambda key: (lambda units: float(np.mean([x[key] for u in units for x in u])))
    f1 = common.cluster_bootstrap(per, flat("f1"))
    said = common.cluster_bootstrap(per, flat("said"))

    def p_vs(ref):
      if ref not in by or ref == m:
        return "-"
      keys = [k for k in by[m] if k in by[ref]]
      b = sum(by[m][k]["said"] and not by[ref][k]["said"] for k in keys)
      c = sum(by[ref][k]["said"] and not by[m][k]["said"] for k in keys)
      return f"{b}-{c} p={calls_lib.mcnemar(b, c):.3f}"

    rs = list(by[m].values())
    lines.append([m, f"{len(rs)} ({len(per)})", f"{said[0]:.2f} [{said[1]:.2f}, {said[2]:.2f}]",
                  f"{f1[0]:.3f} [{f1[1]:.3f}, {f1[2]:.3f}]", p_vs("full"), p_vs("memart"),
                  f"{np.mean([r['prefilled'] for r in rs]):.0f}",
                  f"{np.median([r['ttft_s'] for r in rs]) * 1e3:.0f}",
                  f"{np.mean([r['kv'] for r in rs]):.0f}"])
  return [common.Table("MemArt composed with pruning (planted facts; intervals over "
                       "conversations)",
                       ["method", "n (conv)", "value said", "F1", "said vs full",
                        "said vs memart", "prefilled", "TTFT ms p50", "KV read"], lines)]


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, tables)
    return
  if not FLAGS.conversations:
    raise app.UsageError("give --conversations (scripts/make_conversations.py --planted)")
  methods = common.method_names(FLAGS.methods, METHODS)
  if FLAGS.budget < 64 or FLAGS.gen < 1:
    raise app.UsageError("need --budget >= 64 and --gen >= 1")
  convs = C.load_locomo(FLAGS.conversations)
  d = FLAGS.dev_conversations
  convs = {"dev": convs[:d], "test": convs[d:], "all": convs}[FLAGS.split]
  if FLAGS.max_conversations:
    convs = convs[:FLAGS.max_conversations]
  rows = []
  if FLAGS.out and os.path.exists(FLAGS.out):
    with open(FLAGS.out) as f:
      rows = json.load(f)
  done = {(r["method"], r["conversation"]) for r in rows}
  llm = jaxkv.load(FLAGS.model)
  todo = [(m, c) for m in methods for c in convs if (m, c.sample_id) not in done]
  need = need_tokens(llm.tokenizer, convs)
  for i, (m, conv) in enumerate(tqdm(todo, desc="conversations", unit="conv", file=sys.stderr)):
    for qa, res, pre, kv in serve_conversation(llm, m, conv, FLAGS.budget, FLAGS.gen, need):
      rows.append(record(llm, m, conv, qa, res, pre, kv))
    common.write_rows(FLAGS.out, rows)
    if i + 1 < len(todo) and todo[i + 1][0] != m:
      jax.clear_caches()                  # the next method compiles steps of its own
  common.print_tables(tables(rows))


FLAGS = flags.FLAGS

if __name__ == "__main__":
  define_flags()
  app.run(main)
