"""Batch inference over JSONL files: parsing, resume, streaming results.

Input lines (one JSON object each):
    {"id": ..., "messages": [{"role": ..., "content": ...}, ...], "tools": [...]}
    {"id": ..., "prompt": "raw text"}
with optional "max_tokens", "temperature", "top_p", "top_k", "seed" overriding the
config's sampling defaults, "user" (OpenAI's end-user id: the session a request belongs
to for the pruned, memart and agents kinds; ignored elsewhere), "kind" (the KV mechanism
the request runs on: "pruned", "memart", "reuse", "semshare" or "agents", the server's
session kinds, or a list of them composed in one session as the server's
`{"kind": [...]}`, e.g. ["pruned", "memart"]; default: the config's mode, plain
requests for mode=requests) and "role"
(an agents line's role adapter, e.g. "plan": the server's `<model>:<role>`), and
"response_format" / "tool_choice" / "parallel_tool_calls" (structured output, as the
server's `jaxkv.server.structured` reads them; a reply under a grammar is its text,
tool calls included, unparsed). Unknown keys are rejected (a misspelt "max_token"
must not be silently ignored).

Output lines, written and flushed as each request finishes:
    {"id", "text", "prompt_tokens", "completion_tokens", "ttft_s", "latency_s",
     "finish_reason"}            finish_reason: "stop" | "length" | "error"
A line that cannot be used (bad JSON, missing id, bad field, duplicate id,
prompt longer than the cache) yields {"id", "error", "finish_reason": "error",
"line"} naming the 1-based line number, and the run goes on.

Resume (`ResultFile`): ids that already have a non-error record in the output
are skipped, so rerunning the same command finishes an interrupted run; error
records are retried (e.g. after enlarging the cache). Records are appended and
flushed as they come (an interrupted run keeps them); at the end of a run the
file is rewritten atomically (temp file + rename) to exactly one record per
input line, in input order: its answer, or this run's error. Error records that
no longer match an input line (a line since fixed) are dropped; answers for ids
no longer in the input are kept, after the rest.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Iterator

from jaxkv import jsonl
from jaxkv.config import SamplingConfig
from jaxkv.engine import compose_request
from jaxkv.engine.engine import Request

_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
# structured output, as the server takes it (checked by the runner's grammar builder)
STRUCTURED_KEYS = ("response_format", "tool_choice", "parallel_tool_calls")
_KEYS = {"id", "messages", "prompt", "tools", "user", "kind", "role", *_SAMPLING_KEYS,
         *STRUCTURED_KEYS}
KINDS = ("pruned", "memart", "reuse", "semshare", "agents")   # a line's "kind": a mechanism


class RequestError(ValueError):
  """A request line that cannot be run; carries the line number and id."""

  def __init__(self, line: int, message: str, rid: str | None = None):
    super().__init__(f"line {line}: {message}")
    self.line = line
    self.rid = rid if rid is not None else f"line:{line}"

  def record(self) -> dict:
    return {"id": self.rid, "error": str(self), "finish_reason": "error", "line": self.line}


@dataclasses.dataclass
class ParsedLine:
  id: str
  line: int
  prompt: str | list[dict]
  tools: list[dict] | None
  sampling: SamplingConfig
  user: str | None = None
  kind: str | None = None
  role: str | None = None       # an agents line's role adapter
  structured: dict = dataclasses.field(default_factory=dict)   # STRUCTURED_KEYS given


def parse_line(text: str, line: int, defaults: SamplingConfig) -> ParsedLine:
  """One JSONL line -> ParsedLine, or RequestError with a precise message (an invalid
  line names the column of the file's line where its JSON goes wrong)."""
  text = text.rstrip("\r\n")    # parsed with its newline, every error would be at column 1
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise RequestError(line, f"invalid JSON at column {e.colno}: {e.msg}") from None
  if not isinstance(obj, dict):
    raise RequestError(line, f"expected a JSON object, got {type(obj).__name__}")
  rid = obj.get("id")
  if rid is None or isinstance(rid, (dict, list, bool)):
    raise RequestError(line, "missing or invalid 'id' (a string or number is required)")
  rid = str(rid)
  unknown = sorted(set(obj) - _KEYS)
  if unknown:
    raise RequestError(line, f"unknown field(s) {unknown}; allowed: {sorted(_KEYS)}", rid)
  has_msgs, has_prompt = "messages" in obj, "prompt" in obj
  if has_msgs == has_prompt:
    raise RequestError(line, "give exactly one of 'messages' or 'prompt'", rid)
  if has_prompt:
    prompt = obj["prompt"]
    if not isinstance(prompt, str) or not prompt:
      raise RequestError(line, "'prompt' must be a non-empty string", rid)
  else:
    prompt = obj["messages"]
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(m, dict) and "role" in m for m in prompt):
      raise RequestError(line, "'messages' must be a non-empty list of {role, content} "
                               "objects", rid)
  tools = obj.get("tools")
  if tools is not None and not isinstance(tools, list):
    raise RequestError(line, "'tools' must be a list of JSON schemas", rid)
  overrides = {k: obj[k] for k in _SAMPLING_KEYS if k in obj}
  try:
    for k, v in overrides.items():
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{k} must be a number, got {v!r}")
    for k in ("max_tokens", "top_k", "seed"):
      if k in overrides and int(overrides[k]) != overrides[k]:
        raise ValueError(f"{k} must be an integer, got {overrides[k]!r}")
      if k in overrides:
        overrides[k] = int(overrides[k])
    sampling = dataclasses.replace(defaults, **overrides)
  except ValueError as e:
    raise RequestError(line, str(e), rid) from None
  user = obj.get("user")
  if user is not None and not isinstance(user, str):
    raise RequestError(line, "'user' must be a string (the session id)", rid)
  kind = obj.get("kind")
  if isinstance(kind, list) and kind and all(k in KINDS for k in kind):
    kind = compose_request.name(kind)   # a composition, e.g. "pruned+memart"
  elif kind is not None and kind not in KINDS:
    raise RequestError(line, f"'kind' must be one of {', '.join(KINDS)} or a list of them, "
                             f"got {kind!r}", rid)
  role = obj.get("role")
  agents = kind is not None and "agents" in kind.split("+")
  if (role is not None) != agents:
    raise RequestError(line, "an agents line names its role adapter ('role', e.g. \"plan\")"
                       if agents else "'role' runs a role adapter in an agents "
                       "session: give \"kind\": \"agents\"", rid)
  if role is not None and (not isinstance(role, str) or not role):
    raise RequestError(line, "'role' must be a role adapter's name", rid)
  structured = {k: obj[k] for k in STRUCTURED_KEYS if obj.get(k) is not None}
  return ParsedLine(rid, line, prompt, tools, sampling, user, kind, role, structured)


def _records(path: pathlib.Path) -> Iterator[dict]:
  """The JSON object records of a JSONL file; a truncated or foreign line is skipped."""
  with open(path) as f:
    for text in f:
      try:
        rec = json.loads(text)
      except json.JSONDecodeError:
        continue
      if isinstance(rec, dict) and "id" in rec:
        yield rec


def is_error(rec: dict) -> bool:
  return rec.get("finish_reason") == "error"


class ResultFile:
  """An output JSONL file that a rerun resumes and leaves with one record per input.

  `add` appends a record and flushes it (crash-safe); `finish(order)` rewrites the
  file atomically with, for each key of `order` (the input's ids, or the error keys
  of its unusable lines, in line order), the latest record, then the answers of
  ids that are not in `order`. Stale error records are dropped.
  """

  def __init__(self, path: pathlib.Path, overwrite: bool = False):
    self.path = pathlib.Path(path)
    self.latest: dict[str, dict] = {}
    if self.path.exists() and not overwrite:
      for rec in _records(self.path):
        key = str(rec["id"])
        if not is_error(rec) or key not in self.latest or is_error(self.latest[key]):
          self.latest[key] = rec
    self.done = {k for k, r in self.latest.items() if not is_error(r)}
    self.path.parent.mkdir(parents=True, exist_ok=True)
    # open for the object's life: add() appends, finish() closes it
    self._f = open(self.path, "wb") if overwrite else jsonl.open_append(self.path)  # noqa: SIM115

  def add(self, rec: dict) -> None:
    self.latest[str(rec["id"])] = rec
    self._f.write(jsonl.encode(rec))
    self._f.flush()

  def finish(self, order: list[str]) -> int:
    """Rewrites the file (temp + rename); returns the number of records."""
    self._f.close()
    keys = list(dict.fromkeys(order))
    listed = set(keys)
    keys += [k for k, r in self.latest.items() if k not in listed and not is_error(r)]
    tmp = self.path.with_name(self.path.name + ".tmp")
    with open(tmp, "w") as f:
      for k in keys:
        if k in self.latest:
          f.write(json.dumps(self.latest[k], ensure_ascii=False) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    return sum(k in self.latest for k in keys)


def read_requests(path: pathlib.Path, encode, defaults: SamplingConfig, skip: set[str],
                  on_error, order: list[str] | None = None,
                  parsed: bool = False, grammar=None) -> Iterator[Request]:
  """Lazily yields engine Requests from a JSONL file (with `parsed`:
  (ParsedLine, encode's result) pairs, for runners that need the messages).

  Args:
    encode: (prompt, tools) -> token ids.
    skip: ids already finished (resume); they are not run again.
    on_error: called with a RequestError for every unusable line.
    order: if given, each non-blank line's record key is appended to it, in
      line order (the id, or the error key of an unusable line).
    grammar: ParsedLine -> the request's grammar matcher or None (structured output;
      ValueError: the line's structured fields are wrong). Not with `parsed`.
  """
  seen: set[str] = set()
  with open(path) as f:
    for line, text in enumerate(f, start=1):
      if not text.strip():
        continue
      listed = False
      try:
        p = parse_line(text, line, defaults)
        if p.id in seen:
          raise RequestError(line, f"duplicate id {p.id!r}", f"{p.id}@line:{line}")
        seen.add(p.id)
        listed = True
        if order is not None:
          order.append(p.id)
        if p.id in skip:
          continue
        try:
          tokens = encode(p.prompt, p.tools)
          matcher = None if grammar is None or parsed else grammar(p)
        except ValueError as e:   # e.g. a bad chat message, a bad response_format
          raise RequestError(line, str(e), p.id) from None
      except RequestError as e:
        if not listed:                  # the id of a refused line is taken too
          if e.rid in seen and not e.rid.endswith(f"@line:{line}"):
            e.rid = f"{e.rid}@line:{line}"
          seen.add(e.rid)
          if order is not None:
            order.append(e.rid)
        on_error(e)
        continue
      yield (p, tokens) if parsed else Request(id=p.id, prompt=tokens, sampling=p.sampling,
                                               grammar=matcher)
