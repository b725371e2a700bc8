"""Tool-use agent traces in ToolBench's released conversation format.

The interchange format is ToolBench's JSON: a list of

    {"id": str, "conversations": [{"from": "system"|"user"|"assistant"|"function",
                                   "value": str}, ...]}

(JSONL, one conversation per line, is read too). Assistant values are ReAct
text::

    Thought: I should look up the user first.
    Action: get_user_details
    Action Input: {"user_id": "raj_sanchez_7340"}

an assistant value without an `Action:` line is a final answer, and each
function value is the output of the preceding action (text or JSON). Two
additions stay readable by ToolBench's own tools: an optional `"task"` key (the
grouping key of `split_by_task`; defaults to the id) and the tool schemas in
the system value, as a JSON list on the lines after `TOOLS_MARKER`. ToolBench's
own system prompts ("... you have access to the following APIs: [...]") are
also searched for a schema list, which then leaves the system text (so that a
template's tool list or a workload's sections do not carry it twice) and is written
back in place, as JSON, when the session is dumped or rendered with its tools.

In memory a conversation is a `Session` of `Turn`s with chat roles
(system/user/assistant/tool); `to_messages` gives the HF/OpenAI chat messages
that `jaxkv.tokens.Tokenizer.render_chat` renders, and `render_session` picks
the form a model's template can show (structured tool calls for templates that
render `tool_calls`, e.g. Qwen2.5; the ReAct text for plain ChatML ones, e.g.
SmolLM2, whose template would drop the calls).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import random
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TOOLS_MARKER = "Tools (JSON schemas):"
_TOOLBENCH_APIS = "you have access to the following apis:"
# ToolBench / ShareGPT spellings of the roles -> chat roles.
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
          "gpt": "assistant", "function": "tool", "tool": "tool", "observation": "tool"}
_FROM = {"system": "system", "user": "user", "assistant": "assistant", "tool": "function"}
_ACTION = re.compile(r"^[ \t]*Action:[ \t]*(.*?)[ \t]*$", re.M)
_ACTION_INPUT = re.compile(r"^[ \t]*Action Input:[ \t]*", re.M)
_THOUGHT = re.compile(r"^\s*Thought:[ \t]*")
_MARKER_LINE = re.compile(r"^" + re.escape(TOOLS_MARKER) + r"[ \t]*$", re.M)


class TraceFormatError(ValueError):
  """A malformed conversation; `index` is its position in the file (0-based)."""

  def __init__(self, index: int, reason: str, entry_id: str | None = None):
    self.index, self.reason, self.entry_id = index, reason, entry_id
    where = f"entry {index}" + (f" (id {entry_id!r})" if entry_id is not None else "")
    super().__init__(f"{where}: {reason}")


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One tool invocation; `arguments` is `{"_raw": text}` when the input was not a JSON object."""
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class Turn:
  """One message. `role` is a chat role: system, user, assistant or tool.

  An assistant turn's `content` is its thought (tool-call turns) or the final
  answer (no `tool_calls`); a tool turn's `name` is the tool whose output it is.
  """
  role: str
  content: str
  tool_calls: tuple[ToolCall, ...] = ()
  name: str | None = None


@dataclasses.dataclass(frozen=True)
class Session:
  """One conversation; `task` groups sessions for `split_by_task` (e.g. "airline/12")."""
  id: str
  task: str
  turns: tuple[Turn, ...]
  tools: tuple[dict, ...] = ()


# --- parsing ---------------------------------------------------------------------


def _parse_arguments(text: str) -> dict:
  text = text.strip()
  if not text:
    return {}
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return {"_raw": text}
  return value if isinstance(value, dict) else {"_raw": text}


def _arguments_text(arguments: Mapping) -> str:
  if set(arguments) == {"_raw"} and isinstance(arguments["_raw"], str):
    return arguments["_raw"]
  return json.dumps(arguments, ensure_ascii=False)


def parse_react(value: str) -> tuple[str, tuple[ToolCall, ...]]:
  """Splits an assistant value into (thought or final answer, tool calls).

  Raises:
    ValueError: an `Action:` line with no tool name, or `Action Input:` with no `Action:`.
  """
  actions = list(_ACTION.finditer(value))
  if not actions:
    if _ACTION_INPUT.search(value):
      raise ValueError("assistant value has 'Action Input:' but no 'Action:' line")
    return value.strip(), ()
  thought = _THOUGHT.sub("", value[:actions[0].start()], count=1).strip()
  calls = []
  for i, m in enumerate(actions):
    if not m.group(1):
      raise ValueError(f"assistant value has an 'Action:' line with no tool name (action {i})")
    end = actions[i + 1].start() if i + 1 < len(actions) else len(value)
    block = value[m.end():end]
    arg = _ACTION_INPUT.search(block)
    calls.append(ToolCall(m.group(1), _parse_arguments(block[arg.end():] if arg else "")))
  return thought, tuple(calls)


def format_react(turn: Turn) -> str:
  """The ToolBench value of an assistant turn (inverse of `parse_react`)."""
  if _ACTION.search(turn.content) or _ACTION_INPUT.search(turn.content):
    raise ValueError(f"assistant content must not contain 'Action:' lines: {turn.content[:80]!r}")
  if not turn.tool_calls:
    return turn.content
  parts = [f"Thought: {turn.content}"] if turn.content else []
  for call in turn.tool_calls:
    parts.append(f"Action: {call.name}\nAction Input: {_arguments_text(call.arguments)}")
  return "\n".join(parts)


def _native_tools(text: str) -> tuple[list[dict], int, int] | None:
  """The API list of a ToolBench system prompt (JSON or Python literal) and where it
  lies in `text` ([start, end)), if any."""
  at = text.lower().find(_TOOLBENCH_APIS)
  if at < 0:
    return None
  start = text.find("[", at)
  if start < 0:
    return None
  try:
    value, end = json.JSONDecoder().raw_decode(text, start)
  except json.JSONDecodeError:
    end = text.rfind("]") + 1
    try:
      value = ast.literal_eval(text[start:end])
    except (ValueError, SyntaxError, MemoryError, RecursionError):
      return None
  if isinstance(value, list) and all(isinstance(t, dict) for t in value):
    return value, start, end
  return None


def _split_system(value: str) -> tuple[str, tuple[dict, ...]]:
  """System value -> (content, tools). Raises ValueError on a bad list after the marker."""
  m = _MARKER_LINE.search(value)
  if m is None:
    native = _native_tools(value)
    if native is None:
      return value, ()
    # ToolBench's own prompt: the API list becomes the tools and leaves the text (else
    # a chat template's tool list or a workload's sections would carry it a second
    # time); `system_value` writes it back after "...the following APIs:".
    tools, start, end = native
    return value[:start].rstrip(" ") + value[end:], tuple(tools)
  head = value[:m.start()]
  content = head[:-2] if head.endswith("\n\n") else head.rstrip("\n")
  try:
    tools = json.loads(value[m.end():])
  except json.JSONDecodeError as e:
    raise ValueError(f"text after {TOOLS_MARKER!r} is not valid JSON: {e}") from None
  if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
    raise ValueError(f"text after {TOOLS_MARKER!r} must be a JSON list of objects")
  return content, tuple(tools)


def system_value(content: str, tools: Sequence[dict]) -> str:
  """The ToolBench system value: `content`, then the tool list after `TOOLS_MARKER`; a
  ToolBench prompt ("...you have access to the following APIs:") gets it back in
  place, as JSON."""
  if not tools:
    return content
  native = _native_tools(content)
  if native is not None and native[0] == list(tools):      # the text still holds it
    return content
  at = content.lower().find(_TOOLBENCH_APIS)
  if at >= 0 and native is None:
    at += len(_TOOLBENCH_APIS)
    return f"{content[:at]} {json.dumps(list(tools), ensure_ascii=False)}{content[at:]}"
  listing = f"{TOOLS_MARKER}\n{json.dumps(list(tools), ensure_ascii=False)}"
  return f"{content}\n\n{listing}" if content else listing


def parse_entry(entry: Any, index: int = 0) -> Session:
  """One ToolBench conversation dict -> `Session`.

  Raises:
    TraceFormatError: naming `index` and what is wrong.
  """
  if not isinstance(entry, Mapping):
    raise TraceFormatError(index, f"expected an object, got {type(entry).__name__}")
  sid = entry.get("id")
  if not isinstance(sid, str) or not sid:
    raise TraceFormatError(index, f"'id' must be a non-empty string, got {sid!r}")
  task = entry.get("task", sid)
  if not isinstance(task, str) or not task:
    raise TraceFormatError(index, f"'task' must be a non-empty string, got {task!r}", sid)
  convs = entry.get("conversations")
  if not isinstance(convs, list) or not convs:
    raise TraceFormatError(index, "'conversations' must be a non-empty list", sid)
  turns, tools, pending = [], (), []
  for j, c in enumerate(convs):
    where = f"conversations[{j}]"
    if not isinstance(c, Mapping):
      raise TraceFormatError(index, f"{where} must be an object", sid)
    who, value = c.get("from"), c.get("value")
    if who not in _ROLES:
      raise TraceFormatError(index, f"{where} has unknown 'from' {who!r}; expected one of "
                             f"system/user/assistant/function", sid)
    if not isinstance(value, str):
      raise TraceFormatError(index, f"{where} 'value' must be a string, got "
                             f"{type(value).__name__}", sid)
    role = _ROLES[who]
    if role == "system":
      if j != 0:
        raise TraceFormatError(index, f"{where}: a system turn must come first", sid)
      try:
        content, tools = _split_system(value)
      except ValueError as e:
        raise TraceFormatError(index, f"{where}: {e}", sid) from None
      turns.append(Turn("system", content))
    elif role == "assistant":
      try:
        content, calls = parse_react(value)
      except ValueError as e:
        raise TraceFormatError(index, f"{where}: {e}", sid) from None
      turns.append(Turn("assistant", content, calls))
      pending = [call.name for call in calls]
    elif role == "tool":
      if not pending:
        raise TraceFormatError(index, f"{where}: function output without a pending Action", sid)
      turns.append(Turn("tool", value, name=pending.pop(0)))
    else:
      turns.append(Turn("user", value))
      pending = []
  return Session(sid, task, tuple(turns), tools)


# The commands that make the trace files of each source (data_local/<source>_train.json
# and _heldout.json), keyed by a session id's first part; tau2's is what the configs and
# README commands read.
MAKE_TRACES = {
    src: f"python scripts/make_traces.py --source={src}{extra} --out=data_local/{src}_train.json "
         f"--held_out=data_local/{src}_heldout.json"
    for src, extra in (("tau2", " --domains=airline,retail"), ("agentdojo", ""), ("bfcl", ""))}
MAKE_TRACES_HINT = f"make the tau2 traces with: {MAKE_TRACES['tau2']}"


def made_by(sessions) -> str | None:
  """The command that makes trace files of these sessions' source (their ids' first
  part, e.g. bfcl/base/0), None when the ids name no known source or several."""
  sources = {s.id.split("/", 1)[0] for s in sessions}
  return MAKE_TRACES[sources.pop()] if len(sources) == 1 and sources <= MAKE_TRACES.keys() else None


def load_toolbench(path: str | os.PathLike, strict: bool = True,
                   errors: list | None = None) -> list[Session]:
  """Reads a ToolBench JSON list (or JSONL, one conversation per line).

  Args:
    path: the file.
    strict: raise on the first malformed entry; otherwise skip it with a warning.
    errors: if given, every skipped entry's `TraceFormatError` is appended to it.

  Raises:
    TraceFormatError: a malformed entry (with `strict`), or a malformed file (index -1).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"trace file {path} not found; {MAKE_TRACES_HINT}")
  text = path.read_text(encoding="utf-8")
  stripped = text.lstrip()
  entries: list = []
  bad_lines: dict[int, str] = {}
  if stripped.startswith("["):
    try:
      entries = json.loads(text)
    except json.JSONDecodeError as e:
      raise TraceFormatError(-1, f"{path} is not valid JSON: {e}") from None
  else:
    for line in (ln for ln in text.splitlines() if ln.strip()):
      try:
        entries.append(json.loads(line))
      except json.JSONDecodeError as e:
        bad_lines[len(entries)] = f"line is not valid JSON: {e}"
        entries.append(None)
  sessions, skipped = [], 0
  for i, entry in enumerate(entries):
    try:
      if i in bad_lines:
        raise TraceFormatError(i, bad_lines[i])
      sessions.append(parse_entry(entry, i))
    except TraceFormatError as e:
      if strict:
        raise
      skipped += 1
      if errors is not None:
        errors.append(e)
      if skipped <= 5:
        warnings.warn(f"{path}: skipping malformed {e}", stacklevel=2)
  if skipped:
    warnings.warn(f"{path}: skipped {skipped} malformed of {len(entries)} entries", stacklevel=2)
  return sessions


def to_entry(session: Session) -> dict:
  """`Session` -> ToolBench conversation dict (inverse of `parse_entry`)."""
  convs = []
  for turn in session.turns:
    if turn.role == "system":
      value = system_value(turn.content, session.tools)
    elif turn.role == "assistant":
      value = format_react(turn)
    elif turn.role in ("user", "tool"):
      value = turn.content
    else:
      raise ValueError(f"session {session.id!r}: unknown role {turn.role!r}")
    convs.append({"from": _FROM[turn.role], "value": value})
  if session.tools and not (session.turns and session.turns[0].role == "system"):
    convs.insert(0, {"from": "system", "value": system_value("", session.tools)})
  entry = {"id": session.id}
  if session.task != session.id:
    entry["task"] = session.task
  entry["conversations"] = convs
  return entry


def dump_toolbench(sessions: Iterable[Session], path: str | os.PathLike) -> None:
  """Writes sessions as a ToolBench JSON list (JSONL when `path` ends in .jsonl)."""
  path = pathlib.Path(path)
  entries = [to_entry(s) for s in sessions]
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    if path.suffix == ".jsonl":
      for e in entries:
        f.write(json.dumps(e, ensure_ascii=False) + "\n")
    else:
      json.dump(entries, f, ensure_ascii=False, indent=1)
      f.write("\n")


# --- chat messages -----------------------------------------------------------------


def chat_tools(session: Session) -> list[dict] | None:
  """The session's tool schemas as `{"type": "function", "function": {...}}`, or None."""
  if not session.tools:
    return None
  out = []
  for t in session.tools:
    out.append(dict(t) if t.get("type") == "function" and "function" in t
               else {"type": "function", "function": dict(t)})
  return out


def to_messages(session: Session, *, react: bool = False,
                tools_in_system: bool | None = None) -> list[dict]:
  """Chat messages in the HF/OpenAI convention (`render_chat` input).

  Args:
    session: the conversation.
    react: write assistant turns as their ReAct text (tool calls inline, no
      `tool_calls` key), for templates that do not render `tool_calls`.
    tools_in_system: append the tool list to the system message (as in the
      ToolBench value); defaults to `react`. Otherwise pass
      `chat_tools(session)` as `render_chat(..., tools=...)`.
  """
  if tools_in_system is None:
    tools_in_system = react
  messages = []
  for turn in session.turns:
    if turn.role == "system":
      content = system_value(turn.content, session.tools) if tools_in_system else turn.content
      messages.append({"role": "system", "content": content})
    elif turn.role == "assistant":
      if react or not turn.tool_calls:
        messages.append({"role": "assistant", "content": format_react(turn)})
      else:
        messages.append({"role": "assistant", "content": turn.content, "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in turn.tool_calls]})
    elif turn.role == "tool":
      msg = {"role": "tool", "content": turn.content}
      if turn.name is not None:
        msg["name"] = turn.name
      messages.append(msg)
    else:
      messages.append({"role": turn.role, "content": turn.content})
  return messages


def template_renders_tool_calls(tokenizer) -> bool:
  """Whether the tokenizer's chat template writes structured `tool_calls`."""
  template = tokenizer.chat_template
  if template is None:  # jaxkv.tokens.CHATML_TEMPLATE renders them
    return True
  if isinstance(template, Mapping):
    template = template.get("tool_use") or template.get("default") or ""
  return "tool_calls" in template


def render_session(session: Session, tokenizer, add_generation_prompt: bool = False) -> str:
  """Renders a whole session with the model's template so calls and tools stay visible.

  Templates that render `tool_calls` get structured calls and `tools=`;
  others get the ReAct text with the tool list in the system message.
  """
  if template_renders_tool_calls(tokenizer):
    return tokenizer.render_chat(to_messages(session), tools=chat_tools(session),
                                 add_generation_prompt=add_generation_prompt)
  return tokenizer.render_chat(to_messages(session, react=True),
                               add_generation_prompt=add_generation_prompt)


def session_chat(session: Session, tokenizer) -> tuple[list[dict], list[dict] | None]:
  """(messages, tools) for `tokenizer.render_chat`, in the form `render_session` uses."""
  if template_renders_tool_calls(tokenizer):
    return to_messages(session), chat_tools(session)
  return to_messages(session, react=True), None


# --- splits and statistics ---------------------------------------------------------


def split_by_task(sessions: Sequence[Session], held_out_fraction: float = 0.2,
                  seed: int = 0) -> tuple[list[Session], list[Session]]:
  """Splits by `task` (all sessions of a task on one side), deterministically.

  The sorted distinct tasks are shuffled with `seed` and the first
  `round(fraction * n_tasks)` are held out (at least one when the fraction is
  positive and there are two or more tasks; never all of them unless the
  fraction is 1). Sessions keep their input order on each side.
  """
  if not 0.0 <= held_out_fraction <= 1.0:
    raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
  tasks = sorted({s.task for s in sessions})
  random.Random(seed).shuffle(tasks)
  n = int(round(held_out_fraction * len(tasks)))
  if held_out_fraction > 0 and len(tasks) >= 2:
    n = max(n, 1)
  if held_out_fraction < 1:
    n = min(n, max(len(tasks) - 1, 0))
  held = set(tasks[:n])
  return ([s for s in sessions if s.task not in held], [s for s in sessions if s.task in held])


def tool_calls(session: Session) -> list[ToolCall]:
  """All tool calls of a session, in order."""
  return [c for t in session.turns for c in t.tool_calls]


def session_chars(session: Session) -> int:
  """Characters of the session's ToolBench values (system value with its tool list)."""
  return sum(len(c["value"]) for c in to_entry(session)["conversations"])
