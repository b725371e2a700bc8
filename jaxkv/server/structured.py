"""OpenAI's structured-output fields -> one request's grammar (`jaxkv.engine.grammar`).

`request_grammar(body, tools, grammars)` reads `response_format`, `tool_choice`,
`parallel_tool_calls` and the tools' `strict` flags and returns a fresh matcher for the
request (None: unconstrained), or raises FieldError with what is wrong and the field
(the server answers 400 with it).

What each combination constrains (decisions where the API leaves room):
- `response_format` `{"type": "json_object"}`: one JSON object;
  `{"type": "json_schema", "json_schema": {"schema": ...}}`: one JSON value valid
  under the schema (`strict` or not: a schema asked for is a schema enforced, as vLLM
  does); `{"type": "text"}` or absent: nothing.
- `tool_choice` `"required"`: one or more calls of the listed tools (one when
  `parallel_tool_calls` is false); a named function (`{"type": "function",
  "function": {"name": ...}}`): exactly one call of that function; `"none"`: the tools
  are not offered and only `response_format` applies.
- `tool_choice` `"auto"` (the default): unconstrained, unless a tool is `strict` or a
  `response_format` asks for JSON: then the reply is either text (or the JSON the
  format asks for) that does not open a call, or calls whose arguments follow their
  schemas.
- Arguments follow the tool's `parameters` schema whenever it compiles; a `strict`
  tool whose schema does not compile is a 400, a non-strict one falls back to any
  JSON object (OpenAI guarantees argument schemas only under `strict`).
- Calls are written in the form the chat template writes them
  (`Grammars.tool_calls`): Hermes `<tool_call>` blocks
  (Qwen2.5) or ReAct `Action:` / `Action Input:` lines (SmolLM2), so
  `jaxkv.data.calls.parse_calls` reads them back into `tool_calls`.
"""

from __future__ import annotations

from jaxkv.engine import grammar as G

CHOICES = ("auto", "required", "none")


class FieldError(ValueError):
  """A structured-output field that is wrong: `param` names it (OpenAI's error param)."""

  def __init__(self, message: str, param: str):
    super().__init__(message)
    self.param = param


def response_schema(body: dict) -> dict | None:
  """The JSON schema `response_format` asks for (None: free text)."""
  fmt = body.get("response_format")
  if fmt is None:
    return None
  if not isinstance(fmt, dict):
    raise FieldError("'response_format' must be an object such as {'type': 'json_object'}",
                     "response_format")
  kind = fmt.get("type", "text")
  if kind == "text":
    return None
  if kind == "json_object":
    return {"type": "object"}
  if kind == "json_schema":
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
      raise FieldError("response_format json_schema needs {'json_schema': {'name': ..., "
                       "'schema': {...}}}", "response_format")
    return spec.get("schema") or {}
  raise FieldError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", "response_format")


def tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
  """'auto' | 'required' | 'none' | the named function's definition."""
  choice = body.get("tool_choice")
  if choice is None:                         # null: the default, as OpenAI
    return "auto"
  if isinstance(choice, str):
    if choice not in CHOICES:
      raise FieldError(f"tool_choice must be one of {CHOICES} or a named function, got "
                       f"{choice!r}", "tool_choice")
    if choice == "required" and not tools:
      raise FieldError("tool_choice 'required' needs a non-empty 'tools' list", "tool_choice")
    return choice
  name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
  if not isinstance(name, str) or choice.get("type", "function") != "function":
    raise FieldError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                       "tool_choice")
  for t in tools or ():
    if t["function"]["name"] == name:
      return t["function"]
  raise FieldError(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")


def request_grammar(body: dict, tools: list[dict] | None,
                    grammars: G.Grammars | None) -> G.Matcher | None:
  """A fresh `Matcher` for the request, or None (unconstrained). `tools` are the
  request's tools ({"type": "function", "function": ...}), None when it has none.
  FieldError for a request whose fields do not fit together."""
  schema = response_schema(body)
  choice = tool_choice(body, tools)
  parallel = body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool):
    raise FieldError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
  parallel = True if parallel is None else parallel
  fns = [t["function"] for t in tools or ()] if choice != "none" else []
  strict = any(fn.get("strict") for fn in fns)
  constrained = (schema is not None or choice == "required" or isinstance(choice, dict)
                 or strict)
  if not constrained:
    return None
  if grammars is None:
    raise FieldError("structured output (response_format, tool_choice 'required' or named, "
                     "strict tools) is not enabled on this server",
                     "response_format" if schema is not None else "tool_choice")
  if schema is not None:                      # a bad schema names itself, not the tools
    try:
      grammars.check(G.json_schema(schema))
    except ValueError as e:
      raise FieldError(f"response_format: {e}", "response_format") from None
  try:
    return _compile(grammars, schema, choice, fns, parallel)
  except FieldError:
    raise
  except ValueError as e:
    raise FieldError(str(e), "tools") from None


def _compile(grammars: G.Grammars, schema, choice, fns, parallel) -> G.Matcher:
  if isinstance(choice, dict):
    text = grammars.tool_calls([grammars.enforceable(choice, strict=choice.get("strict"))],
                               mode="required", parallel=False)
  elif choice == "required":
    text = grammars.tool_calls([grammars.enforceable(fn, strict=fn.get("strict"))
                                for fn in fns], mode="required", parallel=parallel)
  elif fns:                                  # auto, with strict tools or a JSON answer
    loose = [grammars.enforceable(fn, strict=True) if fn.get("strict")
             else dict(fn, parameters={"type": "object"}) for fn in fns]
    text = grammars.tool_calls(loose, mode="auto", parallel=parallel,
                               answer=None if schema is None else G.schema_rule(schema))
  else:
    text = G.json_schema(schema)
  return grammars.compile(text)
