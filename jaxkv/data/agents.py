"""Multi-agent trajectories (LRAgent): plan / action / reflect over one token stream.

LRAgent's agents are LoRA roles of one base model that take turns extending
ONE accumulating trajectory (seed 000): the plan agent reasons and picks the
next tool, the action agent writes the tool call's parameters, the tool's
result is appended, and at the end the reflect agent judges whether the final
answer follows from the trajectory. `build` turns a ToolBench-format session
(`jaxkv.data.traces`, e.g. replayed tau2 / agentdojo ground truth) into that
stream: the chat-rendered text of the session's ReAct messages, with the
character spans each agent generates.

    assistant turn with a call:  "Thought: ...\\nAction: NAME" -> plan
                                 "\\nAction Input: "            -> context (the framework's cue)
                                 "{...json arguments...}"       -> action
    final assistant answer:      its text                       -> plan (the plan agent finishes)
    reflection:                  user turn REFLECT_REQUEST       -> context
                                 "Reflect[right]" / "[wrong]"   -> reflect

Everything else (system prompt, user request, tool results, chat-template
markup) is context, i.e. new tokens for whichever agent runs next. A turn
with several calls gives the plan agent everything before the first cue and
the action agent the rest. Spans cover message content only; the end-of-turn
marker that follows is context (agents are scored teacher-forced, so where
generation would stop does not matter here).

Reflect labels: `wrong_answer` replaces the final answer with another
session's (a negative: "Reflect[wrong]"); otherwise the session's own answer
is judged "Reflect[right]". `negatives` picks them deterministically.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import numpy as np

from jaxkv.data import traces

ROLES = ("plan", "action", "reflect")
CONTEXT = -1
ACTION_CUE = "\nAction Input: "
REFLECT_REQUEST = ("Please reflect your answer: does it follow from the trajectory above? "
                   "Reply Reflect[right] or Reflect[wrong].")


@dataclasses.dataclass(frozen=True)
class Call:
  """One agent call: `role` generates tokens [start, end) of the trajectory."""
  role: int
  start: int
  end: int


@dataclasses.dataclass
class Trajectory:
  """A session as one multi-agent token stream."""
  session: str
  text: str
  ids: np.ndarray          # [N] int32 token ids of `text`
  token_role: np.ndarray   # [N] int8 generating role per token (CONTEXT = -1)
  calls: list[Call]        # agent calls in stream order
  reflect_right: bool | None   # label of the reflection (None: no reflect call)

  def __len__(self) -> int:
    return int(self.ids.size)


def _final_answer_index(messages: Sequence[dict]) -> int | None:
  i = len(messages) - 1
  if i >= 0 and messages[i]["role"] == "assistant" and "Action:" not in messages[i]["content"]:
    return i
  return None


def final_answer(session: traces.Session, tokenizer) -> str | None:
  """The session's final assistant answer (None when it ends on a tool call)."""
  messages, _ = traces.session_chat(session, tokenizer)
  i = _final_answer_index(messages)
  return None if i is None else messages[i]["content"]


def build(session: traces.Session, tokenizer, *, reflect: bool = True,
          wrong_answer: str | None = None) -> Trajectory:
  """The session's plan / action / reflect stream (see the module docstring).

  Raises ValueError if the chat template is not prefix-stable (an agent's
  output could then not be appended to the shared stream).
  """
  messages, tools = traces.session_chat(session, tokenizer)
  messages = [dict(m) for m in messages]
  fin = _final_answer_index(messages)
  right = None
  if reflect and fin is not None:
    right = wrong_answer is None
    if not right:
      messages[fin]["content"] = wrong_answer
    messages += [{"role": "user", "content": REFLECT_REQUEST},
                 {"role": "assistant", "content": f"Reflect[{'right' if right else 'wrong'}]"}]
  text = tokenizer.render_chat(messages, tools=tools, add_generation_prompt=False)
  spans = []                                              # (char start, char end, role)
  for i, m in enumerate(messages):
    if m["role"] != "assistant" or i == 0:
      continue
    head = tokenizer.render_chat(messages[:i], tools=tools, add_generation_prompt=True)
    a, content = len(head), m["content"]
    if not text.startswith(head) or text[a:a + len(content)] != content:
      raise ValueError(f"session {session.id}: chat template is not prefix-stable at "
                       f"message {i}")
    b = a + len(content)
    if content.startswith("Reflect[") and i == len(messages) - 1 and right is not None:
      spans.append((a, b, 2))
    elif ACTION_CUE in content:
      cut = a + content.index(ACTION_CUE)
      spans += [(a, cut, 0), (cut + len(ACTION_CUE), b, 1)]
    else:
      spans.append((a, b, 0))
  ids, offsets = tokenizer.encode_with_offsets(text)
  ends = np.array([max(e - 1, s) for s, e in offsets])     # last character of each token
  role = np.full(len(ids), CONTEXT, np.int8)
  calls = []
  for a, b, r in spans:
    toks = np.nonzero((ends >= a) & (ends < b))[0]
    if toks.size:
      role[toks] = r
      calls.append(Call(r, int(toks[0]), int(toks[-1]) + 1))
  return Trajectory(session=session.id, text=text, ids=np.asarray(ids, np.int32),
                    token_role=role, calls=calls, reflect_right=right)


def negatives(sessions: Sequence[traces.Session], tokenizer, *, rate: float = 0.5,
              seed: int = 0) -> dict[str, str]:
  """{session id: a wrong final answer} for a `rate` share of sessions with a final
  answer: another session's answer that differs from its own (deterministic)."""
  answers = {s.id: final_answer(s, tokenizer) for s in sessions}
  pool = [a for a in answers.values() if a]
  rng = random.Random(seed)
  out = {}
  for sid, ans in answers.items():
    if ans is None or rng.random() >= rate:
      continue
    others = [a for a in pool if a != ans]
    if others:
      out[sid] = rng.choice(others)
  return out


def build_all(sessions: Sequence[traces.Session], tokenizer, *, negative_rate: float = 0.5,
              seed: int = 0) -> list[Trajectory]:
  """Trajectories of every session, a `negative_rate` share with a wrong answer to reflect on."""
  wrong = negatives(sessions, tokenizer, rate=negative_rate, seed=seed)
  return [build(s, tokenizer, wrong_answer=wrong.get(s.id)) for s in sessions]
