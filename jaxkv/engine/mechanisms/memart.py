"""MemArt as an engine mechanism: chat sessions whose history lives in KV memory.

A request named `mechanism="memart"` carries its session id and chat messages
(`Request.context`); its prompt is the chat's token ids (what the client sent, for
the usage counts), but the row's sequence is laid out by the mechanism
(`Match.defer`): in `prefill`, `MemArtSessions.prepare` writes the history the
session's memory has not seen (its own sequences, held as memory blocks), then
`MemArtRunner.prefill_into` lays the row out as the held chat head, the retrieved
blocks (aliased, no copy) and the question, and prefills only the question with the
key shift that moves the blocks' keys to their new positions. The row's `n` becomes
that sequence's length and `cached` the adopted head + blocks. The engine samples the
first token and decodes the row with the batch; its decode view (`decode_view`) is
the same key shift (zeros for the tokens it generates).

The prefill is a generator of prefill work (`jaxkv.engine.prefill_work`): the
history's write, the retrieval probe and the question, each packed with the other
prefilling rows' work into one batched call, one engine chunk of each per step. The
rows decoding beside it wait for one chunk at a time, never for a whole history; the
probe and the question's prefill (short) follow the history's last chunk in the same
step. The engine reserves the chat prompt + max_tokens
pages for the row, which bounds the question and the answer; memory blocks are
session state on the same pool (`owner` "memart"), kept until the session closes.

Evaluation (bench/memart.py `--via=engine`, `jaxkv.evaluation.memart`; a server
never sends it) answers over a memory the caller wrote with the runner
(`MemArtRunner.write` on the engine's KV manager) instead of a session's: the
request's prompt is the tail to answer (question and template), and its context
{"memory": the runner's `Memory`, "blocks": rows to splice (None: retrieve),
"voters": [n] bool (the tail tokens whose queries score blocks), "rerank",
"neighbors": the runner's overrides, "evaluate": True (the row's `TailPrefill` in
`Result.extra["prefill"]`)}. A mechanism built on a runner alone (`MemArt(runner=)`,
whose held head is the evaluation's own) serves only such requests.

In a composition (`composed`) MemArt joins another mechanism's row: a session's
earlier conversations are its memory, and a new conversation's prompt carries the
blocks retrieved for it as a region its row copies from memory (`memart_region`).
A *recall* request ({"session", "recall": {"close": lines, "query": ids}}, one
placeholder token) writes a closed conversation and retrieves the new one's blocks
(`Result.extra["recall"]`) before the composed request runs.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxkv.engine.mechanisms import Match, Mechanism
from jaxkv.engine.mechanisms import memart_region as region


@dataclasses.dataclass
class _Turn:
  session: str | None = None    # None: an evaluation request (its memory in the context)
  pre: object = None            # the runner's `TailPrefill`
  info: dict | None = None      # memory blocks, blocks written, memory bytes
  recall: dict | None = None    # a recall request's retrieval (`recall_steps`)


class MemArt(Mechanism):
  """MemArt chat sessions in the engine (module docstring). `sessions`: a
  `MemArtSessions` on the engine's KV manager (`kv=engine.kv_manager`); or `runner`
  alone, a `MemArtRunner` there: evaluation requests only."""

  name = "memart"
  owns_prefill = True
  metrics = (
      ("jaxkv_memart_blocks_written_total", "blocks_written", "memory blocks written"),
      ("jaxkv_memart_blocks_retrieved_total", "blocks_retrieved",
       "memory blocks spliced into answers"),
      ("jaxkv_memart_prefill_tokens_total", "prefill_tokens", "tokens memart requests prefilled"),
      ("jaxkv_memart_chat_tokens_total", "chat_tokens",
       "tokens the same chats hold as plain prompts"))

  def __init__(self, sessions=None, *, runner=None):
    if (sessions is None) == (runner is None):
      raise ValueError("MemArt takes a MemArtSessions or (evaluation only) a MemArtRunner")
    self.sessions = sessions
    self.runner = sessions.runner if sessions is not None else runner
    self._writing: set[str] = set()      # sessions whose history a row is writing
    self._inflight: collections.Counter = collections.Counter()   # session -> rows
    self._closing: set[str] = set()      # closed while a turn was in flight
    self.conversations: dict[str, region.Conversation] = {}   # composed sessions'
    # counters for /metrics (one writer: the engine's thread)
    self.stats = {"requests": 0, "blocks_written": 0, "blocks_retrieved": 0,
                  "prefill_tokens": 0, "chat_tokens": 0}

  def context(self, session: str, messages: list[dict]) -> dict:
    """`Request.context` of a turn; raises ValueError for messages the session cannot
    take (checked again when the row runs: the session may move on in between)."""
    self._sessions().check(session, messages)
    return {"session": session, "messages": messages}

  def _sessions(self):
    if self.sessions is None:
      raise ValueError("this memart mechanism serves evaluation requests only (built on a "
                       "runner, without sessions)")
    return self.sessions

  def match(self, req) -> Match:
    ctx = req.context or {}
    if "memory" in ctx:                                # evaluation: the prompt is the tail
      return Match(0, np.zeros(0, np.int32), _Turn(), defer=True, reserve=len(req.prompt))
    if "recall" in ctx:                                # a composed session's recall
      self._sessions()
      self._inflight[ctx["session"]] += 1
      return Match(0, np.zeros(0, np.int32), _Turn(ctx["session"]), defer=True, reserve=1)
    if "session" not in ctx or "messages" not in ctx:
      raise ValueError("a memart request's context names its session and messages")
    tail, _ = self._sessions().tail(ctx["messages"])  # what the row will prefill
    self._inflight[ctx["session"]] += 1
    return Match(0, np.zeros(0, np.int32), _Turn(ctx["session"]), defer=True,
                 reserve=int(tail.size))

  def unmatch(self, match: Match) -> None:
    if match.state.session is not None:
      self._leave(match.state.session)

  def _leave(self, session: str) -> None:
    """A turn of `session` is done (or waits again); a session closed while turns were
    in flight is freed with its last one."""
    self._inflight[session] -= 1
    if self._inflight[session] <= 0:
      del self._inflight[session]
      if session in self._closing:
        self._closing.discard(session)
        if session in self.sessions.sessions:
          self.sessions.close(session)

  def prefill(self, row):
    ctx = row.req.context
    if "memory" in ctx:
      return (yield from self._evaluate(row, ctx))
    if "recall" in ctx:
      return (yield from self._recall(row, ctx))
    mem, tail, voters, info = yield from self._writer(
        ctx["session"], self.sessions.prepare_steps(ctx["session"], ctx["messages"]))
    pre = yield from self.runner.prefill_into_steps(row.seq, mem, tail,
                                                    row.req.sampling.max_tokens,
                                                    voters=voters, owner="engine")
    row.state.pre, row.state.info = pre, info
    row.n, row.cached = pre.n, pre.start
    # usage's cached tokens: the chat's tokens this request did not prefill (neither as
    # newly written history nor as the question)
    row.served = max(0, len(row.req.prompt) - info["written_tokens"] - (pre.n - pre.start))
    return pre.logits

  def _evaluate(self, row, ctx):
    """An evaluation request's prefill (module docstring): the tail over the given
    memory, its blocks spliced or retrieved."""
    mem = ctx["memory"]
    blocks, voters = ctx.get("blocks"), ctx.get("voters")
    pre = yield from self.runner.prefill_into_steps(
        row.seq, mem, np.asarray(row.req.prompt, np.int32), row.req.sampling.max_tokens,
        blocks=None if blocks is None else np.asarray(blocks, np.int32),
        voters=None if voters is None else np.asarray(voters, bool),
        rerank=ctx.get("rerank"), neighbors=ctx.get("neighbors"), owner="engine")
    row.state.pre = pre
    row.state.info = dict(memory_blocks=mem.num_blocks, blocks_written=0, written_tokens=0,
                          memory_bytes=mem.nbytes)
    row.n, row.cached, row.served = pre.n, pre.start, 0
    return pre.logits

  def _writer(self, session: str, steps):
    """Runs the prefill-work generator `steps` that writes `session`'s memory once no
    other row of the session is writing it (one writer per memory); its result."""
    while session in self._writing:
      yield
    self._writing.add(session)
    try:
      return (yield from steps)
    finally:
      self._writing.discard(session)

  def _recall(self, row, ctx):
    """A composed session's recall: writes the closed conversation's lines, retrieves
    the blocks for the new one's question; logits zero (its one token is no answer)."""
    session, rc = ctx["session"], ctx["recall"]
    mem, _ = self.sessions.sessions.get(session) or (self.runner.new_memory(), [])
    self.sessions.sessions[session] = (mem, [])
    written = 0
    if rc.get("close"):
      span = self.sessions.encode("\n".join(rc["close"]) + "\n", literal=True)
      rows = yield from self._writer(session, self.runner.write_steps(mem, span, tag=mem.writes))
      written = int(span.size)
      self.stats["blocks_written"] += int(rows.size)
    blocks, probe = np.zeros(0, np.int32), 0
    if mem.num_blocks:
      q = self.sessions.encode(rc["query"], literal=True)[-self.runner.prefill_chunk:]
      probe = q.size if self.runner.needs_probe(mem) else 0
      blocks = yield from self.runner.retrieve_steps(mem, q)
      mem.hits[blocks] += 1
    ids, _, _ = region.region_of(mem, blocks)
    row.state.recall = {"blocks": np.asarray(blocks).tolist(), "ids": ids.tolist(),
                        "written_tokens": written, "probe_tokens": probe,
                        "memory_blocks": mem.num_blocks, "memory_bytes": mem.nbytes}
    row.n = row.cached = row.served = 0
    return np.zeros(self.runner.mcfg.vocab_size, np.float32)

  # ------------------------------------------------------------ in a composition
  def conversation(self, session: str, messages: list[dict], recalled: dict | None = None):
    """A composed session's request: its conversation (`memart_region.Conversation`),
    or, when it opens a new one and there is memory to write or read, the recall
    request's context to run first (then call again with its `recall` result)."""
    conv = self.conversations.get(session)
    if conv is not None and region.extends(messages, conv.messages):
      conv.messages = list(messages)
      return conv
    if recalled is None:
      close = [] if conv is None else region.lines(conv.messages, conv.reply,
                                                   self.runner.cfg.write_turns)
      mem = self._sessions().sessions.get(session)
      if close or (mem is not None and mem[0].num_blocks):
        user = [m for m in messages if m.get("role") == "user"]
        query = user[-1].get("content") if user else ""
        return {"session": session,
                "recall": {"close": close, "query": query if isinstance(query, str) else ""}}
      recalled = {"blocks": [], "ids": []}
    conv = region.Conversation(list(messages), np.asarray(recalled["blocks"], np.int32),
                               np.asarray(recalled["ids"], np.int32),
                               {k: v for k, v in recalled.items() if k not in ("blocks", "ids")})
    self.conversations[session] = conv
    return conv

  def turn(self, session: str, messages: list[dict], tools, prompt, ctx: dict,
           recalled: dict | None = None):
    """A composed request's (prompt, context) with its conversation's memory region
    at the first user message's content (`memart_region.insert`), or the context of
    the recall request to run first (`conversation`)."""
    conv = self.conversation(session, messages, recalled)
    if isinstance(conv, dict):
      return conv
    recall = conv.recall if recalled is not None else {}     # reported once, by its call
    at = region.head_length(self.sessions.tok, messages, tools, prompt) if conv.ids.size else None
    if at is None:                       # nothing retrieved, or nowhere to put it
      if conv.ids.size:                  # said in the call's usage (memory_region_skipped)
        recall = dict(recall, region_skipped=True)
      return list(prompt), dict(ctx, memart={"session": session, "at": 0, "blocks": [],
                                             "n": 0, "recall": recall})
    return region.insert(prompt, ctx, at, conv, session, recall)

  def join(self, req) -> region.Fill:
    ctx = (req.context or {}).get("memart")
    if ctx is None:
      raise ValueError("a composed request with memart names its region (context['memart'])")
    return region.Fill(ctx["session"], ctx["at"], np.asarray(ctx["blocks"], np.int32),
                       ctx["n"], ctx.get("recall") or {})

  def fill(self, row) -> int:
    f = row.state
    mem = self.sessions.sessions.get(f.session) if self.sessions is not None else None
    start = row.cached
    k = region.fill(self.runner, None if mem is None else mem[0], row, f)
    if k:   # private from the fill on; a part adopted from the cache keeps its path's
      row.private_from = start if row.private_from is None else min(row.private_from, start)
    return k   # keys (the layout's own `private_from` when its session's path was private)

  def leave(self, row, cache: bool) -> dict | None:
    f = row.state
    conv = self.conversations.get(f.session)
    if cache and conv is not None and row.generated:
      conv.reply = self.sessions.tok.decode([int(t) for t in row.generated
                                             if t not in self.sessions.tok.stop_ids])
    s = self.stats
    s["requests"] += 1
    s["blocks_retrieved"] += int(f.blocks.size)
    # region tokens among the row's cached ones (spliced or adopted): not the client's
    cached = max(0, min(row.cached, f.at + f.n) - f.at) if f.n else 0
    return {"memory_region_tokens": f.n, "memory_spliced_tokens": f.spliced,
            "memory_cached_tokens": cached,
            "memory_blocks_retrieved": int(f.blocks.size), **{
                f"memory_{k}" if not k.startswith("memory") else k: v
                for k, v in f.recall.items()}}

  def decode_view(self, row, width: int):
    if isinstance(row.state, region.Fill):   # joined: the region is the row's own KV
      return None, None
    shift = row.state.pre.shift
    if shift is None:
      return None, None
    out = np.zeros(width, np.int32)
    m = min(width, shift.size)
    out[:m] = shift[:m]
    return None, out

  def finish(self, row, cache: bool) -> dict | None:
    del cache
    t = row.state
    if t.session is not None:
      self._leave(t.session)
    if t.recall is not None:
      return {"recall": t.recall}
    if t.pre is None:
      return None
    pre, info = t.pre, t.info
    s = self.stats
    s["requests"] += 1
    s["blocks_written"] += info["blocks_written"]
    s["blocks_retrieved"] += int(pre.blocks.size)
    s["prefill_tokens"] += pre.n - pre.start
    s["chat_tokens"] += len(row.req.prompt)
    kv_len = self.runner.kv_len(row.seq, pre.n) + len(row.generated)
    out = {"prefill_tokens": pre.n - pre.start, "probe_tokens": pre.probe_tokens,
           "retrieved_blocks": int(pre.blocks.size), "decode_kv_len": kv_len, **info}
    if (row.req.context or {}).get("evaluate"):
      out["prefill"] = pre
    return out

  def close(self, session: str) -> bool:
    """Frees a session's memory (with its last turn in flight, when that one ends);
    False when it has none and no turn in flight."""
    self.conversations.pop(session, None)
    if self._inflight[session] > 0:
      self._closing.add(session)
      return True
    self._inflight.pop(session, None)
    if self.sessions is None or session not in self.sessions.sessions:
      return False
    self.sessions.close(session)
    return True
