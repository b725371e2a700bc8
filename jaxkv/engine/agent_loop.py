"""Closed-loop agent episodes: the model acts in a tool environment over a pruned cache.

`run_episode(runner, env, task)` is IntentKV's evaluation loop in the form the
shipped models allow (section 4.1: at most 32 tool-use turns, greedy decoding):

    messages, tools = env.reset(task)
    repeat up to max_turns:
        the model writes the next assistant turn freely (`SessionRunner.run_turn`,
        generate=True: radix prefix cache on, one pruning event per request, the
        session's QueryMemory advancing, exactly as in serving)
        its tool calls (`jaxkv.data.calls.parse_calls`: Hermes blocks or ReAct) run in
        the environment and their outputs are appended as tool messages
        a turn with no tool call is the final answer: the episode is complete
    correct = env.score(messages)

The assistant message keeps the generated text verbatim, so the next request's
prompt renders what the model wrote and the radix cache serves it.

Outcomes follow the paper's accounting: an episode is *completed* when it ends in a
non-empty final answer; it is not when it hits the turn cap, overflows the cache
(`prompt + max_tokens > cache.max_seq_len`), writes an empty turn, or is cut off: a
turn that ran to `max_tokens` with no call parsed but a call begun in it (a
`<tool_call>`, `"name"` or `Action:` opener: the call was truncated, it is no answer;
Qwen2.5-Coder-0.5B wrote a 96-token JSON call that way on tau2/airline/16). Only completed
episodes are scored; `summarize` gives Compl (completed / total), Raw (correct /
completed) and True Acc (correct / total, non-completion counted as wrong), each
with n and a Wilson 95% interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv.data import calls, labels, traces
from jaxkv.data.envs import Environment
from jaxkv.engine.sessions import SessionRunner, TurnMetrics

MAX_TURNS = 32
# "repeat": a turn repeated the last turn's calls and got the same answers (the batch
# engine's loop, `jaxkv.evaluation.closed_loop`, ends an episode there)
OUTCOMES = ("answer", "turn_cap", "overflow", "empty", "cut_off", "repeat")


@dataclasses.dataclass
class Episode:
  """One task's run. `outcome` is one of OUTCOMES; `correct` is False unless completed."""
  task: str
  outcome: str
  correct: bool
  n_calls: int
  messages: list[dict]
  turns: list[TurnMetrics]
  checks: dict = dataclasses.field(default_factory=dict)

  @property
  def completed(self) -> bool:
    return self.outcome == "answer"

  def to_json(self) -> dict:
    return dict(task=self.task, outcome=self.outcome, correct=self.correct,
                n_calls=self.n_calls, n_turns=len(self.turns), checks=self.checks,
                answer=self.messages[-1].get("content", "") if self.completed else "",
                messages=self.messages)


def strip_stop(text: str, stop_texts: Sequence[str]) -> str:
  for s in stop_texts:
    if s and text.endswith(s):
      return text[:-len(s)]
  return text


def chat_form(tokenizer, messages: Sequence[dict], tools) -> tuple[list[dict], list | None]:
  """The opening messages and tool schemas in the form the model's template renders,
  exactly as the replayed traces have them (`traces.session_chat`): structured tools
  for a template that renders tool calls, else the tool list in the system message
  and ReAct turns."""
  turns = tuple(traces.Turn(m["role"], str(m.get("content") or "")) for m in messages)
  tools = tuple(t.get("function", t) for t in tools or ())
  return traces.session_chat(traces.Session("episode", "episode", turns, tools), tokenizer)


def system_prefix(tokenizer, messages: Sequence[dict], tools) -> list[int]:
  """Token ids of the system prompt (with its tools) that every task of an environment
  shares, in the form `chat_form` gives: what a server keeps cached across sessions."""
  msgs, tools = chat_form(tokenizer, messages, tools)
  p = labels.prepare_turn(tokenizer, msgs + [{"role": "assistant", "content": ""}], tools,
                          len(msgs), reply=False)
  return list(p["ids"][:p["sys_len"]])


def run_episode(runner: SessionRunner, env: Environment, task: str, *,
                max_turns: int = MAX_TURNS, max_tokens: int = 128,
                session_id: str | None = None) -> Episode:
  """Runs `task` in `env` with the runner's model, cache and pruning policy."""
  if max_turns < 1:
    raise ValueError(f"max_turns must be >= 1, got {max_turns}")
  sid = session_id or task
  messages, tools = chat_form(runner.tok, *env.reset(task))
  stop_texts = [runner.tok.decode([t]) for t in runner.tok.stop_ids]
  turns: list[TurnMetrics] = []
  n_calls, outcome = 0, "turn_cap"
  for _ in range(max_turns):
    i = len(messages)
    pending = messages + [{"role": "assistant", "content": ""}]   # the slot run_turn fills
    try:
      t = runner.run_turn(sid, pending, tools, i, generate=True, max_tokens=max_tokens)
    except ValueError as e:
      if "exceed cache.max_seq_len" not in str(e):
        raise
      outcome = "overflow"
      break
    turns.append(t)
    text = strip_stop(t.text, stop_texts).strip()
    if not text:
      outcome = "empty"
      break
    messages.append({"role": "assistant", "content": text})
    made = calls.parse_calls(text)
    if not made:
      cut = t.reply_tokens >= max_tokens and any(o in text for o in calls.CALL_OPENERS)
      outcome = "cut_off" if cut else "answer"
      break
    n_calls += len(made)
    messages.extend(env.step(made))
  correct = outcome == "answer" and bool(env.score(messages))
  return Episode(task, outcome, correct, n_calls, messages, turns,
                 dict(getattr(env, "last_checks", {}) or {}))


def summarize(episodes: Sequence[Episode]) -> dict:
  """Compl, Raw and True Acc with their Wilson 95% intervals, and the outcome counts."""
  n = len(episodes)
  done = sum(e.completed for e in episodes)
  right = sum(e.correct for e in episodes)
  nan = float("nan")
  out = dict(n_tasks=n, n_completed=done, n_correct=right,
             compl=done / n if n else nan, compl_ci=list(calls.wilson(done, n)),
             raw_acc=right / done if done else nan, raw_acc_ci=list(calls.wilson(right, done)),
             true_acc=right / n if n else nan, true_acc_ci=list(calls.wilson(right, n)),
             mean_turns=sum(len(e.turns) for e in episodes) / n if n else nan)
  out.update({f"n_{o}": sum(e.outcome == o for e in episodes) for o in OUTCOMES})
  return out
