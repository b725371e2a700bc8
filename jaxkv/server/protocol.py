"""The OpenAI API's request and response shapes, checked and built as plain dicts.

`parse(body, ...)` turns the JSON of `/v1/chat/completions` or `/v1/completions`
into a `Parsed` request (prompt token ids, sampling, stream options) or raises
`APIError`, whose `body()` is OpenAI's error JSON. The builders below write the
responses and stream chunks the `openai` client reads.

Decisions where the API leaves room:
- fields this server does not implement are refused with 400 when they would
  change the output (`n` > 1, `logprobs`, `logit_bias`, non-zero penalties); unknown extra
  fields are ignored, as OpenAI-compatible servers do, so clients that send
  their own extensions keep working;
- `max_tokens` (or `max_completion_tokens`) defaults to the config's
  `sampling.max_tokens`, clipped to the cache room left after the prompt; a
  prompt that leaves no room, or an explicit `max_tokens` that does not fit, is
  400 `context_length_exceeded`;
- `session_id` (an extra body field) or else `user` names an agent session: with
  the engine's prefix cache on, the session's latest turn stays cached between
  turns (see `jaxkv.server.loop`); without it `user` is only a label and
  `session_id` is refused;
- message text is encoded as text (`jaxkv.literal_chat`): a special token's
  spelling in content stays text, so a user or a tool output cannot write turns
  of its own; a tool call or schema that spells one is refused;
- tools go through the model's chat template when it renders tool calls
  (Qwen2.5); otherwise (SmolLM2) the tool list is written into the system
  message and earlier calls as ReAct text, the form the traces use
  (`jaxkv.data.traces.session_chat`). Calls the model writes (Hermes
  `<tool_call>` blocks, ReAct `Action:` lines or bare JSON, `jaxkv.data.calls`)
  come back as `tool_calls` with finish_reason "tool_calls";
- structured output (`response_format` json_object / json_schema, `tool_choice`
  "required" or a named function, `strict` tools) is a grammar the engine decodes
  under (`jaxkv.server.structured`, `jaxkv.engine.grammar`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from jaxkv.config import SEED_MAX, SEED_MIN, SamplingConfig
from jaxkv.data import calls as calls_lib
from jaxkv.data import traces
from jaxkv.data.calls import CALL_OPENERS
from jaxkv.literal_chat import encode_chat_literal
from jaxkv.server import structured
from jaxkv.tokens import validate_messages


class APIError(Exception):
  """An HTTP error with OpenAI's error body."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass
class Parsed:
  """One checked request."""
  kind: str                      # "chat" | "completion"
  model: str
  prompt: list[int]
  sampling: SamplingConfig
  stream: bool = False
  include_usage: bool = False
  stop: tuple[str, ...] = ()
  tools: bool = False            # tool calls in the output are parsed into `tool_calls`
  user: str | None = None
  session: str | None = None     # "session_id" (extra field), else "user"
  adapter: int = -1              # role adapter the model name selects (-1: base)
  chat: tuple | None = None      # (messages, tools) as the template takes them (chat kind)
  grammar: object = None         # structured output: a fresh grammar Matcher, or None


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
  return APIError(400, message, param=param, code=code)


def _number(body: dict, key: str, lo: float, hi: float, default, integer: bool = False):
  v = body.get(key)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
    raise _bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
  if not lo <= v <= hi:
    raise _bad(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
  return v


def _stop(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = [stop]
  if (not isinstance(stop, list) or len(stop) > 4
      or not all(isinstance(s, str) and s for s in stop)):
    raise _bad("'stop' must be a non-empty string or a list of at most 4 of them", "stop")
  return tuple(stop)


MAX_DEPTH = 64   # JSON nesting a request body may have


def load_body(raw: bytes) -> Any:
  """A request body's JSON; APIError 400 for what is not valid JSON, nests deeper
  than MAX_DEPTH, holds an integer too long to read, or a string that is not
  Unicode text (a lone surrogate escape such as "\\ud800", which cannot be
  encoded, echoed or logged)."""
  try:
    body = json.loads(raw)
  except RecursionError:
    raise _bad(f"the request body nests deeper than {MAX_DEPTH} levels") from None
  except ValueError as e:          # JSONDecodeError, UnicodeDecodeError, over-long integers
    raise _bad(f"the request body is not valid JSON: {e}") from None
  todo = [(body, 1)]
  while todo:
    x, depth = todo.pop()
    if isinstance(x, (dict, list)):
      if depth > MAX_DEPTH:
        raise _bad(f"the request body nests deeper than {MAX_DEPTH} levels")
      items = list(x.items()) if isinstance(x, dict) else [(None, v) for v in x]
      for k, v in items:
        todo.append((v, depth + 1))
        if k is not None:
          todo.append((k, depth))
    elif isinstance(x, str):
      try:
        x.encode("utf-8")
      except UnicodeEncodeError:
        raise _bad("the request body holds a string that is not valid Unicode (a lone "
                   "surrogate escape)") from None
  return body


def _unsupported(body: dict) -> None:
  if body.get("n") not in (None, 1):
    raise _bad("only n=1 is supported", "n")
  if body.get("logit_bias"):
    raise _bad("'logit_bias' is not supported (send {} or leave it out)", "logit_bias")
  if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
    raise _bad("logprobs / echo are not supported", "logprobs")
  for key in ("presence_penalty", "frequency_penalty"):
    if body.get(key):
      raise _bad(f"'{key}' is not supported (send 0 or leave it out)", key)


def _tools(body: dict) -> list[dict] | None:
  """The request's tools as offered to the model (None: none, or tool_choice "none");
  `jaxkv.server.structured` checks tool_choice itself."""
  tools = body.get("tools")
  if tools is None:
    return None
  if not isinstance(tools, list) or not all(
      isinstance(t, dict) and t.get("type", "function") == "function"
      and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
      for t in tools):
    raise _bad("'tools' must be a list of {'type': 'function', 'function': {'name': ...}}",
               "tools")
  if body.get("tool_choice") == "none":
    return None
  return tools or None


def _grammar(body: dict, tools: list[dict] | None, grammars):
  try:
    return structured.request_grammar(body, tools, grammars)
  except structured.FieldError as e:
    raise _bad(str(e), e.param) from None


def chat_prompt(tokenizer, messages: Any, tools: list[dict] | None) -> list[int]:
  """Token ids of an OpenAI chat in the form the model's template renders."""
  msgs, native = chat_messages(tokenizer, messages, tools)
  return encode_chat_literal(tokenizer, msgs, tools=native, add_generation_prompt=True)


def chat_messages(tokenizer, messages: Any,
                  tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
  """(messages, tools) of an OpenAI chat as the model's template takes them: the
  request's own when the template renders tool calls, else the traces module's
  rendering of calls and schemas into text (raises ValueError on a malformed chat)."""
  chat = validate_messages(messages)
  if tools is None or traces.template_renders_tool_calls(tokenizer):
    return chat, tools
  turns = [] if chat[0]["role"] == "system" else [traces.Turn("system", "")]
  for m in chat:
    made = tuple(traces.ToolCall(c["function"]["name"], dict(c["function"]["arguments"]))
                 for c in m.get("tool_calls", ()))
    turns.append(traces.Turn(m["role"], str(m.get("content") or ""), made, m.get("name")))
  session = traces.Session("request", "request",
                           tuple(turns), tuple(t["function"] for t in tools))
  return traces.session_chat(session, tokenizer)


def parse(body: Any, kind: str, *, models: Callable[[str], int | None], tokenizer,
          defaults: SamplingConfig, max_seq_len: int, max_prompt_slots: int,
          grammars=None) -> Parsed:
  """Checks a request body; raises APIError (400, or 404 for an unknown model).
  `models(name)` is the adapter index a served model name selects (-1: the base
  model), None for a name not served. `grammars` (`jaxkv.engine.grammar.Grammars`)
  compiles structured-output requests (None: they are refused)."""
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str):
    raise _bad("'model' is required (a string)", "model")
  adapter = models(model)
  if adapter is None:
    raise APIError(404, f"The model '{model}' does not exist (GET /v1/models lists them)",
                   param="model", code="model_not_found")
  _unsupported(body)
  stream = body.get("stream")
  stream = False if stream is None else stream
  if not isinstance(stream, bool):
    raise _bad("'stream' must be a boolean", "stream")
  opts = body.get("stream_options") or {}
  if not isinstance(opts, dict):
    raise _bad("'stream_options' must be an object", "stream_options")
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise _bad("'user' must be a string", "user")
  session = body.get("session_id")
  if session is not None and (not isinstance(session, str) or not session):
    raise _bad("'session_id' must be a non-empty string", "session_id")
  tools = chat = None
  try:
    if kind == "chat":
      tools = _tools(body)
      chat = chat_messages(tokenizer, body.get("messages"), tools)
      prompt = encode_chat_literal(tokenizer, chat[0], tools=chat[1], add_generation_prompt=True)
    else:
      prompt = _completion_prompt(tokenizer, body.get("prompt"))
  except ValueError as e:
    raise _bad(str(e), "messages" if kind == "chat" else "prompt") from e
  grammar = _grammar(body, tools, grammars)
  n = len(prompt)
  room = min(max_seq_len, max_prompt_slots) - n
  if room < 1:
    raise _bad(f"This model's maximum context length is {min(max_seq_len, max_prompt_slots)} "
               f"tokens; your prompt has {n} tokens, leaving no room for a completion",
               "messages" if kind == "chat" else "prompt", "context_length_exceeded")
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = _number(body, key, 1, 1 << 30, None, integer=True)
  if max_tokens is not None and max_tokens > room:
    raise _bad(f"This model's maximum context length is {min(max_seq_len, max_prompt_slots)} "
               f"tokens; your prompt has {n} tokens and {key}={max_tokens}", key,
               "context_length_exceeded")
  sampling = SamplingConfig(
      temperature=float(_number(body, "temperature", 0.0, 2.0, defaults.temperature)),
      top_p=float(_number(body, "top_p", 1e-9, 1.0, defaults.top_p)),
      top_k=int(_number(body, "top_k", 0, 1 << 20, defaults.top_k, integer=True)),
      seed=int(_number(body, "seed", SEED_MIN, SEED_MAX, defaults.seed, integer=True)),
      max_tokens=max_tokens or min(defaults.max_tokens, room))
  return Parsed(kind=kind, model=model, prompt=prompt, sampling=sampling, stream=stream,
                include_usage=bool(opts.get("include_usage")), stop=_stop(body),
                tools=tools is not None, user=user, session=session or user, adapter=adapter,
                chat=chat, grammar=grammar)


def _completion_prompt(tokenizer, prompt: Any) -> list[int]:
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]
  if isinstance(prompt, str) and prompt:
    return tokenizer.encode(prompt)
  if (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in prompt)):
    if not all(0 <= t < tokenizer.vocab_size for t in prompt):
      raise ValueError(f"token ids must be in [0, {tokenizer.vocab_size})")
    return list(prompt)
  raise ValueError("'prompt' must be a non-empty string or token-id list (one prompt per "
                   "request)")


# --------------------------------------------------------------------- output


def new_id(kind: str) -> str:
  return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens,
          "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def call_start(text: str) -> int:
  """Where the first tool call may begin in `text` (len(text) if nowhere): the
  earliest opener, moved back over the `{` and a ```json fence of a bare-JSON call."""
  cut = min((i for i in (text.find(o) for o in CALL_OPENERS) if i >= 0), default=len(text))
  head = text[:cut].rstrip()
  if cut < len(text) and head.endswith("{"):
    head = head[:-1].rstrip()
    for fence in ("```json", "```"):
      if head.endswith(fence):
        head = head[:-len(fence)]
        break
    cut = len(head)
  return cut


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
  """(content before the first call or None, OpenAI `tool_calls`) of generated text."""
  made = calls_lib.parse_calls(text)
  if not made:
    return text, []
  content = text[:call_start(text)].strip() or None
  return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c.name,
                                 "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                   for c in made]


def response(p: Parsed, rid: str, created: int, text: str, finish: str, use: dict) -> dict:
  """The non-streamed body of a chat completion or a completion."""
  if p.kind == "completion":
    return {"id": rid, "object": "text_completion", "created": created, "model": p.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": use}
  message = {"role": "assistant", "content": text}
  if p.tools:
    content, made = split_tool_calls(text)
    if made:
      message = {"role": "assistant", "content": content, "tool_calls": made}
      finish = "tool_calls"
  return {"id": rid, "object": "chat.completion", "created": created, "model": p.model,
          "choices": [{"index": 0, "message": message, "finish_reason": finish,
                       "logprobs": None}],
          "usage": use}


def chunk(p: Parsed, rid: str, created: int, *, text: str | None = None, role: bool = False,
          tool_calls: list[dict] | None = None, finish: str | None = None,
          use: dict | None = None) -> dict:
  """One streamed chunk; `use` alone (no choices) is the include_usage chunk."""
  if p.kind == "completion":
    choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    out = {"id": rid, "object": "text_completion", "created": created, "model": p.model,
           "choices": choices}
  else:
    delta = {}
    if role:
      delta["role"] = "assistant"
    if text is not None:
      delta["content"] = text
    if tool_calls:
      delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": p.model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
  if use is not None:
    out["choices"], out["usage"] = [], use
  return out


_OPENING_TAIL = re.compile(r"(`{1,3}(j|js|jso|json)?)?\s*\{?\s*$")


class TextStream:
  """Decoded text, sent in safe pieces: what a streamed delta may carry now.

  Holds back a trailing partial UTF-8 character (U+FFFD), a tail that may be the
  start of a stop string, and, when tools are on, everything from the first
  tool-call opener (it is sent as `tool_calls` at the end). `update(text,
  final)` returns (delta, stopped); a stop string cuts the text there.
  """

  def __init__(self, stop: tuple[str, ...] = (), hold_calls: bool = False):
    self.stop, self.hold_calls = stop, hold_calls
    self.sent = 0
    self.text = ""

  def update(self, text: str, final: bool) -> tuple[str, bool]:
    cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
    stopped = bool(cuts)
    if stopped:
      text, final = text[:min(cuts)], True
    self.text = text
    safe = len(text)
    if not final:
      safe = len(text.rstrip("\ufffd"))
      held = self.stop + (CALL_OPENERS if self.hold_calls else ())
      head = text[:safe]
      safe -= max((k for h in held for k in range(min(len(h) - 1, safe), 0, -1)
                   if head.endswith(h[:k])), default=0)
      if self.hold_calls:   # a `{` or ```json fence that may open a bare-JSON call
        safe = len(_OPENING_TAIL.sub("", text[:safe]))
    if self.hold_calls:
      safe = min(safe, call_start(text))
    delta = text[self.sent:safe] if safe > self.sent else ""
    self.sent = max(self.sent, safe)
    return delta, stopped

  def rest(self) -> str:
    """What was held back (the tool-call part, at the end of a stream)."""
    return self.text[self.sent:]
