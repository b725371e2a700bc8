"""Traced agent sessions replayed through the serving engine, many sessions batched.

Each assistant turn of a session is one engine request through the `pruned`
mechanism (`jaxkv.engine.mechanisms.pruned`), exactly as a server runs it: radix
match through the session's holes, chunked prefill batched with every other row,
the pruning event after the prefill, decode over the pruned slot map, the turn
cached for the next one. A turn is either teacher-forced (`Request.forced`: the
gold reply from the trace is fed and its log-probabilities come back, so NLL needs
no second pass) or free (greedy, up to `max_tokens`, optionally stopped by a host
check once the call it writes is complete). The turns of one session run in order
(each turn's cache is the previous turn's); different sessions run side by side in
the engine's batch, which is what makes an evaluation of hundreds of turns cheap.

The metrics are `TurnMetrics`, the same fields as `SessionRunner.run_turn` reports
(IntentKV section 4.1, NLL, future-evidence recall), read from the engine's result
and the prompt positions the mechanism kept. Differences from the batch-1
`SessionRunner` (which still runs the `compact` layout, a layout serving does not
use): a teacher-forced reply is prefilled in the engine's chunks beside other rows
(`jaxkv.engine.forced`), so logits and a later pruning event's scores can differ in
the last bits; `wall_s` is the turn's latency inside the batch (`timed`: the replay's
elapsed time spread over its turns); and a free turn's `until` is checked after every
token instead of every 16.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from jaxkv.config import CacheConfig, EngineConfig, PruningConfig, SamplingConfig
from jaxkv.data import labels
from jaxkv.engine import executables
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.request import Request, Result
from jaxkv.engine.sessions import TurnMetrics
from jaxkv.kv import plan
from jaxkv.kv.state import SENTINEL


@dataclasses.dataclass
class Turn:
  """One assistant turn to replay: the prompt is the session's messages[:i]."""
  i: int
  generate: bool = False        # free (greedy) turn; False: teacher-forced gold reply
  max_tokens: int = 128         # free turns: the reply's token cap
  forced_reply: int = 0         # free turns: the gold reply's first tokens join the prompt
  until: Callable[[list[int]], bool] | None = None   # free turns: stop once True
  # this turn's messages when the client sent the session another history than the
  # session's own (e.g. old tool outputs cleared); None: the session's messages
  messages: list[dict] | None = None


@dataclasses.dataclass
class Session:
  id: str
  messages: list[dict]
  tools: list | None
  turns: list[Turn]
  meta: dict = dataclasses.field(default_factory=dict)   # the caller's, per turn (unread)


class Recorder(Pruned):
  """The `pruned` mechanism, also recording each row's kept prompt positions (what
  evidence recall reads); serving runs `Pruned` itself."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.kept: dict[str, np.ndarray] = {}

  def match(self, req):
    found = super().match(req)
    ahead = req.context.get("lookahead", 0)     # the runner's width: prompt + reply
    if ahead:
      found.state.width = plan.width(len(req.prompt) + req.sampling.max_tokens - ahead)
    return found

  def after_prefill(self, row) -> None:
    super().after_prefill(row)
    n = len(row.req.prompt)
    self.kept[row.req.id] = self.kv.allocator.slot_map(row.seq)[:n] != SENTINEL

  def finish(self, row, cache: bool) -> dict | None:
    out = super().finish(row, cache)
    ahead = row.req.context.get("lookahead", 0)   # fed past the reply: not processed
    if cache and ahead and row.req.context["session"] in self.state.seen:
      self.state.seen[row.req.context["session"]] -= ahead
    return out


def engine_for(llm, pruning: PruningConfig, cache: CacheConfig, *, max_batch: int = 8,
               prefill_chunk: int = 256, decode_steps: int = 16, head=None,
               attn_impl: str = "auto") -> tuple[Engine, Recorder]:
  """An engine with only the recording `pruned` mechanism (no plain prefix cache: the
  mechanism's radix tree caches the sessions)."""
  eng = Engine(llm.model, llm.tokenizer.stop_ids, cache,
               EngineConfig(max_batch=max_batch, prefill_chunk=prefill_chunk,
                            decode_steps=decode_steps, attention_impl=attn_impl))
  rec = eng.add_mechanism(Recorder(llm.tokenizer, llm.config, eng.kv_manager, pruning,
                                   head=head))
  return eng, rec


def warm(engine: Engine, mech: Pruned, prefixes) -> None:
  """Prefills (no pruning, one token generated) each of `prefixes` (token sequences:
  the system prompts an environment's sessions share) that the mechanism's radix tree
  does not hold whole, so an evaluation starts from a server that has served the
  domain before. Call it under the "none" policy, before setting the one evaluated."""
  cold = [list(p) for p in prefixes
          if mech.tree.match_prefix(np.asarray(p[:-1], np.int64)).n_matched < len(p) - 1]
  reqs = [Request(f"warm/{k}", p, SamplingConfig(max_tokens=1), mechanism=mech.name,
                  context={"session": f"warm/{k}", "qs": len(p) - 1, "sys_len": len(p)})
          for k, p in enumerate(cold)]
  for res in engine.run(reqs):
    if res.finish_reason not in ("stop", "length"):
      engine.abort("warming failed")
      raise RuntimeError(f"warming the shared system prompts: {res.error}")
  for k in range(len(cold)):
    mech.close(f"warm/{k}")


_ids = itertools.count()


def _prepare(rec: Recorder, s: Session, t: Turn) -> dict:
  """The turn's prompt, gold reply, spans and evidence labels (`labels.prepare_turn`)."""
  msgs = s.messages if t.messages is None else t.messages
  if not 0 < t.i <= len(msgs) - (0 if t.generate and not t.forced_reply else 1):
    raise ValueError(f"turn {t.i} of a {len(msgs)}-message session: the prompt is "
                     "messages[:i] and a gold reply needs messages[i]")
  return labels.prepare_turn(rec.tok, msgs, s.tools, t.i, reply=t.i < len(msgs))


def _request(rec: Recorder, s: Session, t: Turn, p: dict, after=None,
             limit: int | None = None, mechanism: str | None = None
             ) -> tuple[Request, dict]:
  """The engine request of turn t (prepared as p) and the labels its metrics read.

  A teacher-forced turn also feeds the token that follows its reply in `after`, the
  next turn's prompt, without scoring it (when it fits `limit`, the cache's longest
  sequence): the reply's last token then has its KV written and cached like the
  rest, as a prefill of the reply would leave it."""
  prompt, gold = [int(x) for x in p["ids"]], [int(x) for x in p.get("gold", [])]
  evidence = np.asarray(p["evidence"], bool)
  if t.forced_reply:
    if not t.generate or not 0 < t.forced_reply < len(gold):
      raise ValueError(f"forced_reply needs generate and 0 < forced_reply < {len(gold)} "
                       f"(the gold reply's tokens), got {t.forced_reply}")
    prompt += gold[:t.forced_reply]
    evidence = np.concatenate([evidence, np.zeros(t.forced_reply, bool)])
  ctx = {"session": s.id, "qs": p["qs"], "sys_len": p["sys_len"]}
  rid = f"{s.id}/{t.i}/{next(_ids)}"
  mechanism = mechanism or rec.name
  if t.generate:
    req = Request(rid, prompt, SamplingConfig(max_tokens=t.max_tokens), mechanism=mechanism,
                  context=ctx, until=t.until)
  else:
    whole = prompt + gold
    extra = ([int(after[len(whole)])] if after is not None and len(after) > len(whole)
             and list(after[:len(whole)]) == whole
             and (limit is None or len(whole) < limit) else [])
    req = Request(rid, prompt, SamplingConfig(max_tokens=len(gold) + len(extra)),
                  mechanism=mechanism, context=dict(ctx, lookahead=len(extra)),
                  forced=gold + extra)
  return req, {"evidence": evidence, "sys_len": p["sys_len"], "reply": len(gold)}


def turn_metrics(s: Session, t: Turn, res: Result, kept: np.ndarray, prep: dict,
                 tokenizer) -> TurnMetrics:
  """`SessionRunner.run_turn`'s metrics from the engine's result of the turn."""
  n, x = res.prompt_tokens, res.extra
  g = len(res.tokens) if t.generate else prep["reply"]
  steps = max(g - 1, 0)
  tri = steps * (steps + 1) // 2
  ev, sys_len = prep["evidence"], prep["sys_len"]
  nll = math.nan if t.generate else -float(np.sum(res.logprob[:g])) / max(g, 1)
  return TurnMetrics(
      session=s.id, turn=t.i, prompt_tokens=n, reply_tokens=g, hit_tokens=res.cached_tokens,
      live_before=x["kv_live_before"], live_after=x["kv_live_after"], pruned=x["pruned"],
      pt=n + steps, eff_live_kv=x["kv_live_after"] + steps, raw_reads=steps * n + tri,
      eff_reads=steps * x["kv_live_after"] + tri, nll=nll, evidence=int(ev.sum()),
      evidence_kept=int((ev & kept).sum()),
      evidence_candidates=int(ev[sys_len:].sum()),
      evidence_candidates_kept=int((ev & kept)[sys_len:].sum()), wall_s=res.latency_s,
      text=tokenizer.decode(res.tokens) if t.generate else "",
      memory_cos=x.get("query_memory_cos", math.nan), kept=kept,
      reply_ids=list(res.tokens) if t.generate else None)


def replay(engine: Engine, rec: Recorder, sessions: Sequence[Session], *, desc: str = "",
           mechanism: str | None = None,
           on_result: Callable[[int, Turn, Result, TurnMetrics], None] | None = None
           ) -> list[list[TurnMetrics]]:
  """Every listed turn of every session through `engine` (sessions side by side in its
  batch, each session's turns in order); the metrics per session, in turn order.

  `mechanism`: the engine mechanism the turns name (default `rec`'s own; e.g. a
  composition `rec` lays out, "pruned+reuse"); `on_result(session index, turn, result,
  metrics)` sees each turn's engine `Result` beside its metrics (what `TurnMetrics` does
  not keep: usage, TTFT, the greedy tokens of a teacher-forced reply).

  Of the sessions that open with the same system prompt the first starts alone, and
  the others start together once its first turn has cached that prompt: they find it
  in the radix tree, as they would one after another (otherwise a batch of a
  domain's sessions would each prefill the domain's tool schemas, thousands of
  tokens, side by side).

  Raises:
    RuntimeError: a turn failed in the engine (its error, e.g. a prompt longer than
      the cache); the engine is left idle (every request in it aborted).
    ValueError: two sessions share an id (they would share pruning state).
  """
  ids = [s.id for s in sessions]
  if len(set(ids)) != len(ids):
    dup = sorted({i for i in ids if ids.count(i) > 1})
    raise ValueError(f"session ids must be unique; repeated: {dup[:5]}")
  out: list[list[TurnMetrics]] = [[] for _ in sessions]
  nxt = [0] * len(sessions)
  inflight: dict[str, tuple[int, Turn, dict]] = {}
  prepared: dict[int, dict] = {}      # each session's next turn, prepared ahead

  def submit(k: int) -> None:
    turns = sessions[k].turns
    p = prepared.pop(k, None) or _prepare(rec, sessions[k], turns[nxt[k]])
    after = None
    if nxt[k] + 1 < len(turns):
      prepared[k] = _prepare(rec, sessions[k], turns[nxt[k] + 1])
      after = prepared[k]["ids"]
    req, prep = _request(rec, sessions[k], turns[nxt[k]], p, after,
                         engine.cache_cfg.max_seq_len, mechanism)
    inflight[req.id] = (k, turns[nxt[k]], prep)
    engine.submit(req)

  # sessions waiting for the first of their system prompt's group to cache it
  waiting: dict[tuple, list[int]] = {}
  for k, s in enumerate(sessions):
    if s.turns:
      p = prepared[k] = _prepare(rec, s, s.turns[0])
      waiting.setdefault(tuple(p["ids"][:p["sys_len"]]) or ("solo", k), []).append(k)
  leaders = {group[0]: key for key, group in waiting.items()}

  total = sum(len(s.turns) for s in sessions)
  with tqdm(total=total, desc=desc, leave=False, disable=not desc) as bar:
    try:
      for k in leaders:
        submit(k)
      while inflight:
        for res in executables.step(engine):
          if res.id not in inflight:
            continue
          k, t, prep = inflight.pop(res.id)
          kept = rec.kept.pop(res.id, None)
          if res.finish_reason in ("error", "cancelled") or kept is None:
            raise RuntimeError(f"session {sessions[k].id!r} turn {t.i}: "
                               f"{res.error or res.finish_reason}")
          out[k].append(turn_metrics(sessions[k], t, res, kept, prep, rec.tok))
          if on_result is not None:
            on_result(k, t, res, out[k][-1])
          bar.update()
          if nxt[k] == 0 and k in leaders:         # its system prompt is cached now
            for other in waiting[leaders[k]][1:]:
              submit(other)
          nxt[k] += 1
          if nxt[k] < len(sessions[k].turns):
            submit(k)
    except BaseException:
      engine.abort("the replay stopped")     # fails and frees everything it holds
      rec.kept.clear()
      raise
  return out


def timed(engine: Engine, rec: Recorder, sessions: Sequence[Session], *, desc: str = ""
          ) -> list[list[TurnMetrics]]:
  """`replay`, with each turn's `wall_s` the replay's elapsed time spread evenly over
  its turns: sessions overlap in the batch, so a turn's latency counts its neighbours'
  work too, while these sum per session to the machine time a session cost (what the
  batch-1 runner's wall times are, one session after another)."""
  t0 = time.perf_counter()
  out = replay(engine, rec, sessions, desc=desc)
  per = (time.perf_counter() - t0) / max(1, sum(len(ts) for ts in out))
  for ts in out:
    for t in ts:
      t.wall_s = per
  return out


def all_turns(messages: Sequence[dict]) -> list[Turn]:
  """Every assistant turn after the first message, teacher-forced
  (`SessionRunner.run_session`'s turns)."""
  return [Turn(i) for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
