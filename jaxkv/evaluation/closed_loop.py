"""Closed-loop agent episodes through the batch engine: many tasks at once.

`run_episodes(engine, pruned, envs, tasks)` runs IntentKV's evaluation loop
(`jaxkv.engine.agent_loop`: the model acts in a tool environment until it answers)
for every task, each assistant turn one request of the `pruned` mechanism, exactly as a
server runs an agent session (radix match through the session's holes, one pruning
event per request, the turn cached for the next), with as many episodes in the
engine's batch as there are environments (each environment holds one episode's
state). What the batch-1 loop (`agent_loop.run_episode` over `SessionRunner`) lacked
for a loop that can score (issue 39):

- constrained calls (`grammars`): each turn decodes under `jaxkv.engine.grammar`'s
  "auto" tool grammar: free text that opens no call, or calls whose names are the
  environment's tools and whose arguments follow their schemas (a schema llguidance
  cannot compile falls back to any object); an unconstrained model wrote
  `read_webpage` for `get_webpage` and repeated it to the turn cap;
- a call of an unknown tool is answered with the tool list (unconstrained runs);
- an episode ends ("repeat", not completed) when a turn repeats the previous turn's
  calls exactly and gets the same answers: nothing changed, and greedy decoding will
  write the same turn again until the turn cap;
- a scripted user: an environment with `user_reply(text)` (tau2's, when it is given
  confirmations) answers a question the agent asks instead of ending the episode;
- every episode keeps its transcript (`Episode.messages`, written by `to_json`).

Outcomes as `agent_loop.OUTCOMES` (answer, turn_cap, overflow, empty, cut_off, repeat).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import numpy as np

from jaxkv.config import SamplingConfig
from jaxkv.data import calls
from jaxkv.data.envs import Environment
from jaxkv.engine import agent_loop, executables
from jaxkv.engine import grammar as G
from jaxkv.engine.request import Request

OUTCOMES = agent_loop.OUTCOMES


@dataclasses.dataclass
class TurnRecord:
  """One assistant turn: what the engine reported for its request."""
  prompt_tokens: int
  cached_tokens: int        # prompt tokens the pruned tree served (prefix hit)
  completion_tokens: int
  finish: str
  pruned: bool = False
  kv_live: int = 0          # live prompt KV after the turn's pruning event
  latency_s: float = 0.0

  # IntentKV section 4.1's per-turn counts, exactly as `SessionRunner`'s TurnMetrics:
  # the reply's tokens after the first are decode steps over the prompt's live KV
  @property
  def _steps(self) -> int:
    return max(self.completion_tokens - 1, 0)

  @property
  def _tri(self) -> int:           # decode reads of the reply's own tokens
    return self._steps * (self._steps + 1) // 2

  @property
  def pt(self) -> int:             # |R_t|
    return self.prompt_tokens + self._steps

  @property
  def eff_live_kv(self) -> int:    # |K_t|
    return self.kv_live + self._steps

  @property
  def raw_reads(self) -> int:
    return self._steps * self.prompt_tokens + self._tri

  @property
  def eff_reads(self) -> int:
    return self._steps * self.kv_live + self._tri


def efficiency(episodes: Sequence[agent_loop.Episode]) -> dict:
  """Per-episode means of PT (max_t |R_t|), Eff. live (max_t |K_t|), raw and effective
  reads (sums over turns), wall time; the share of pruned turns and the prefix hit rate
  over every turn."""
  per = [e.turns for e in episodes if e.turns]
  flat = [t for ts in per for t in ts]
  mean = lambda xs: float(np.mean(xs)) if xs else math.nan
  return dict(pt=mean([max(t.pt for t in ts) for ts in per]),
              eff_live_kv=mean([max(t.eff_live_kv for t in ts) for ts in per]),
              raw_reads=mean([sum(t.raw_reads for t in ts) for ts in per]),
              eff_reads=mean([sum(t.eff_reads for t in ts) for ts in per]),
              wall_s=mean([sum(t.latency_s for t in ts) for ts in per]),
              pruned_share=mean([t.pruned for t in flat]) if flat else 0.0,
              prefix_hit_rate=sum(t.cached_tokens for t in flat)
              / max(1, sum(t.prompt_tokens for t in flat)),
              n_turns=len(flat))


def tool_grammar(grammars: G.Grammars, tools: Sequence[dict]) -> str:
  """The "auto" tool grammar of an environment's tools (module docstring). Arguments
  take only the parameters a tool declares (the environments reject others: tau2
  answered an extra `total_baggages` with an error), as OpenAI's strict mode has it."""
  return grammars.tool_calls([grammars.enforceable(fn, closed=True) for fn in tools],
                             mode="auto")


def _key(made) -> tuple:
  return tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in made)


def _execute(env: Environment, made, names: set[str]) -> list[dict]:
  """Tool messages for the calls, in order: the environment's answer, or for a tool it
  does not have an error naming the ones it has."""
  out = []
  for c in made:
    if c.name in names:
      out.extend(env.step([c]))
    else:
      out.append({"role": "tool", "name": c.name, "content":
                  f"Error: there is no tool named {c.name!r}; the tools are: "
                  f"{', '.join(sorted(names))}"})
  return out


@dataclasses.dataclass
class _Live:
  task: str
  env: Environment
  sid: str
  messages: list[dict]
  tools: list | None
  names: set[str]
  grammar: str | None
  turns: list = dataclasses.field(default_factory=list)
  n_calls: int = 0
  last: tuple = ()
  outcome: str | None = None


class _Loop:
  def __init__(self, engine, pruned, *, max_turns, max_tokens, max_prompt, grammars):
    self.engine, self.pruned, self.grammars = engine, pruned, grammars
    self.max_turns, self.max_tokens, self.max_prompt = max_turns, max_tokens, max_prompt
    tok = pruned.tok
    self.stop_texts = [tok.decode([t]) for t in tok.stop_ids]
    self.by_id: dict[str, _Live] = {}
    self._grammars: dict[str, str] = {}
    self._n = 0

  def start(self, env: Environment, task: str) -> _Live:
    opening, env_tools = env.reset(task)
    fns = [t.get("function", t) for t in env_tools or ()]
    msgs, tools = agent_loop.chat_form(self.pruned.tok, opening, env_tools)
    grammar = None
    if self.grammars is not None and fns:      # one grammar per tool list, not per episode
      key = json.dumps(fns, sort_keys=True)
      if key not in self._grammars:
        self._grammars[key] = tool_grammar(self.grammars, fns)
      grammar = self._grammars[key]
    self._n += 1
    ep = _Live(task, env, f"episode/{self._n}/{task}", msgs, tools,
               {f["name"] for f in fns}, grammar)
    self.submit(ep)
    return ep

  def submit(self, ep: _Live) -> None:
    if len(ep.turns) >= self.max_turns:
      ep.outcome = "turn_cap"
      return
    prompt, ctx = self.pruned.context(ep.sid, ep.messages, ep.tools)
    if len(prompt) + self.max_tokens > self.max_prompt:
      ep.outcome = "overflow"
      return
    rid = f"{ep.sid}#{len(ep.turns)}"
    self.by_id[rid] = ep
    matcher = None if ep.grammar is None else self.grammars.compile(ep.grammar)
    self.engine.submit(Request(rid, prompt, SamplingConfig(max_tokens=self.max_tokens),
                               mechanism=self.pruned.name, context=ctx, grammar=matcher))

  def done(self, res) -> _Live:
    """Takes a finished turn; returns its episode (outcome set when it ended)."""
    ep = self.by_id.pop(res.id)
    if res.finish_reason == "error":
      raise RuntimeError(f"{ep.task}: turn {len(ep.turns)} failed: {res.error}")
    x = res.extra or {}
    ep.turns.append(TurnRecord(res.prompt_tokens, res.cached_tokens, res.completion_tokens,
                               res.finish_reason, bool(x.get("pruned")),
                               int(x.get("kv_live_after", res.prompt_tokens)), res.latency_s))
    text = agent_loop.strip_stop(self.pruned.tok.decode(res.tokens), self.stop_texts).strip()
    if not text:
      ep.outcome = "empty"
      return ep
    ep.messages.append({"role": "assistant", "content": text})
    made = calls.parse_calls(text)
    if not made:
      reply = getattr(ep.env, "user_reply", lambda _t: None)(text)
      if reply:                                       # the scripted user answers
        ep.messages.append({"role": "user", "content": reply})
        self.submit(ep)
        return ep
      cut = (res.completion_tokens >= self.max_tokens
             and any(o in text for o in calls.CALL_OPENERS))
      ep.outcome = "cut_off" if cut else "answer"
      return ep
    ep.n_calls += len(made)
    answers = _execute(ep.env, made, ep.names)
    ep.messages.extend(answers)
    key = (_key(made), tuple(m["content"] for m in answers))
    if key == ep.last:           # the same calls got the same answers: nothing moved
      ep.outcome = "repeat"
      return ep
    ep.last = key
    self.submit(ep)
    return ep


def run_episodes(engine, pruned, envs: Sequence[Environment], tasks: Sequence[str], *,
                 max_turns: int = agent_loop.MAX_TURNS, max_tokens: int = 128,
                 max_prompt: int | None = None, grammars: G.Grammars | None = None,
                 progress=None) -> list[agent_loop.Episode]:
  """Every task once, `len(envs)` episodes at a time in the engine's batch (module
  docstring). `pruned` is the engine's pruned mechanism with the policy to evaluate;
  `max_prompt` caps prompt + reply (default: the cache's max_seq_len); `progress(n)`
  is called as episodes end. Returns the episodes in task order."""
  if max_turns < 1:
    raise ValueError(f"max_turns must be >= 1, got {max_turns}")
  if not envs:
    raise ValueError("run_episodes needs at least one environment")
  loop = _Loop(engine, pruned, max_turns=max_turns, max_tokens=max_tokens,
               max_prompt=max_prompt or engine.cache_cfg.max_seq_len, grammars=grammars)
  todo, free = list(tasks), list(envs)
  live: list[_Live] = []
  out: dict[str, agent_loop.Episode] = {}

  def end(ep: _Live) -> None:
    correct = ep.outcome == "answer" and bool(ep.env.score(ep.messages))
    checks = dict(getattr(ep.env, "last_checks", {}) or {})
    out[ep.task] = agent_loop.Episode(ep.task, ep.outcome, correct, ep.n_calls, ep.messages,
                                      ep.turns, checks)
    pruned.close(ep.sid)
    free.append(ep.env)
    if progress is not None:
      progress(1)

  while todo or live:
    while todo and free:
      ep = loop.start(free.pop(), todo.pop(0))
      (end if ep.outcome else live.append)(ep)
    for res in executables.step(engine):
      ep = loop.done(res)
      if ep.outcome is not None:
        live.remove(ep)
        end(ep)
  return [out[t] for t in tasks]
