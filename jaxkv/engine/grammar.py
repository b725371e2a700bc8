"""Structured output: grammars compiled with llguidance, applied as a token bitmask.

Constrained decoding as vLLM and SGLang run it: each constrained request carries a
host-side matcher (`Matcher`, over llguidance's `LLMatcher`) that gives, before each
token, the bitmask of tokens its grammar allows; the engine hands the batch's
bitmasks to the jitted step inside `SamplingParams.token_mask`, where
`sampling.apply_token_mask` sets the logits of disallowed tokens to -inf before the
greedy or sampled choice, and feeds the chosen token back (`Matcher.consume`).

Decisions:
- llguidance, not xgrammar: both are what vLLM and SGLang use, but xgrammar's wheel
  requires torch and triton, while llguidance has no Python dependency and reads the
  tokenizer's own `tokenizers` JSON (the library jaxkv already tokenizes with).
- One token per decode call while a constrained row is live: the next mask depends on
  the token just chosen, so the engine runs `decode_steps = 1` calls then (the other
  rows of the batch take one step per call too; unconstrained batches keep
  `EngineConfig.decode_steps`). The first token (the prefill's readout) is masked too.
- JSON is compact (`{"a": 1, "b": [2, 3]}`: ", " and ": " separators, no other
  whitespace), the form models write and the traces hold; flexible whitespace lets a
  small model pad forever with newlines.
- The grammar ends the reply: a row whose matcher has finished (no token but a stop
  token could follow) stops there ("stop"); a stop token is allowed exactly where the
  grammar may end.

Grammar builders (`json_schema`, `json_object`, `tool_calls`, `any_text`) return
llguidance grammar strings; `Grammars.compile` checks one against the tokenizer and
makes a fresh `Matcher` for each request. Tool calls are written in the form the
model's chat template writes them (`style`): "hermes" (Qwen2.5: `<tool_call>\\n{"name":
..., "arguments": ...}\\n</tool_call>` blocks, or the bare JSON object that Qwen2.5-Coder
often writes instead; one per line) or "react" (SmolLM2 and the ToolBench traces:
`Action: NAME\\nAction Input: {...}`), the forms `jaxkv.data.calls.parse_calls` reads
back.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import llguidance
import numpy as np

from jaxkv.data import traces
from jaxkv.data.calls import CALL_OPENERS

STYLES = ("hermes", "react")
# JSON as the models write it: compact, ", " and ": " separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON as Qwen2.5-Coder writes it in a ```json fence: indented, whitespace bounded per gap
PRETTY_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": "[ \\t\\n]{0,24}"}


def _schema_text(schema: dict, options: dict = JSON_OPTIONS) -> str:
  return json.dumps(dict(schema, **{"x-guidance": options}))


def json_schema(schema: dict) -> str:
  """A grammar for one JSON value valid under `schema` (a JSON Schema object)."""
  if not isinstance(schema, dict):
    raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
  return llguidance.LLMatcher.grammar_from_json_schema(_schema_text(schema))


def json_object() -> str:
  """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
  return json_schema({"type": "object"})


def any_text() -> str:
  """Every text, ended anywhere: a grammar that allows what the model would write
  anyway (tests: greedy output under it equals unconstrained output)."""
  return llguidance.LLMatcher.grammar_from_lark("start: /(?s:.*)/")


def _lark_str(s: str) -> str:
  return json.dumps(s)          # a JSON string literal is a valid lark string literal


def _call_schema(name: str, parameters: dict | None, style: str) -> dict:
  params = parameters if isinstance(parameters, dict) and parameters else {"type": "object"}
  if style == "react":
    return params
  # the arguments sit under the call object: definitions their "#/$defs/..." references
  # name (pydantic writes them: tau2's tools) move up to the new root
  defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
  params = {k: v for k, v in params.items() if k not in defs}
  return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
          "required": ["name", "arguments"], "additionalProperties": False, **defs}


def tool_calls(tools: Sequence[dict], *, style: str, mode: str = "required",
               parallel: bool = True, text_opener: bool = True, answer: str | None = None) -> str:
  """A grammar for tool calls in the chat template's `style`.

  Args:
    tools: OpenAI function definitions ({"name", "parameters", ...}: the "function"
      member of a tool); a call's arguments follow its `parameters` schema (any
      object when it has none).
    mode: "required": the reply is one or more calls; "auto": text that does not
      open a call, then optionally calls (what strict tools need when the model may
      also answer in text).
    parallel: more than one call (one per line) or exactly one.
    text_opener: hermes only: whether `<tool_call>` is written as text (the
      tokenizer has no such token) instead of the template's special token.
    answer: with mode "auto", a grammar text (lark rule body) the non-call reply must
      follow instead of free text (e.g. a response_format schema).
  """
  if style not in STYLES:
    raise ValueError(f"tool-call style must be one of {STYLES}, got {style!r}")
  if mode not in ("required", "auto"):
    raise ValueError(f"mode must be 'required' or 'auto', got {mode!r}")
  if not tools:
    raise ValueError("tool_calls needs at least one tool")
  rules = []
  alts = []
  for i, fn in enumerate(tools):
    name = fn.get("name")
    if not isinstance(name, str) or not name:
      raise ValueError("every tool needs a non-empty string name")
    call = _call_schema(name, fn.get("parameters"), style)
    schema = _schema_text(call)
    if style == "hermes":
      rules.append(f"call_{i}: %json {schema}")
      rules.append(f"pretty_{i}: %json {_schema_text(call, PRETTY_OPTIONS)}")
    else:
      head = _lark_str(f"Action: {name}\nAction Input: ")
      rules.append(f"call_{i}: {head} %json {schema}")
    alts.append(f"call_{i}")
  if style == "hermes":
    opener, closer = ((_lark_str("<tool_call>"), _lark_str("</tool_call>")) if text_opener
                      else ("<tool_call>", "</tool_call>"))
    # the template's block, or the bare JSON call, or an indented one in a ```json
    # fence (Qwen2.5-Coder often writes those; parse_calls reads all three), its schema
    # enforced either way
    fence = _lark_str("```json\n")
    rules.append(f"block: {opener} \"\\n\" body \"\\n\" {closer} | body "
                 f"| {fence} pretty \"\\n```\"")
    rules.append("body: " + " | ".join(alts))
    rules.append("pretty: " + " | ".join(a.replace("call_", "pretty_") for a in alts))
  else:
    rules.append("block: " + " | ".join(alts))
  # calls one per line; a newline after the last may end the reply (Qwen2.5 writes one)
  calls = "block (\"\\n\" block)* \"\\n\"?" if parallel else "block"
  if mode == "required":
    start = f"start: {calls}"
  elif answer is not None:
    start = f"start: answer | {calls}"
    rules.append(f"answer: {answer}")
  else:
    # text lines that spell no call opener the parser reads (a loose call in the text
    # would come back as a call that skipped its schema), then optionally the calls;
    # lines end at "\n", so a call may start on any line without backtracking the lexer
    # and that do not start like a bare or fenced JSON call ("{", "`"): llguidance's
    # lexer does not back up over a finished lexeme, so a line and a call may not both
    # match the same opening bytes
    openers = "|".join(_regex_escape(o) for o in CALL_OPENERS)
    bad = f"~/(?s:.*({openers}).*)/"
    rules.append(f"LINE: /([^\\n{{`][^\\n]*)?\\n/ & {bad}")
    rules.append(f"LAST: /[^\\n{{`][^\\n]*/ & {bad}")
    start = f"start: LINE* LAST? | LINE* {calls}"
  return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]))


def schema_rule(schema: dict) -> str:
  """A lark rule body for one JSON value under `schema` (`tool_calls(answer=...)`)."""
  return f"%json {_schema_text(schema)}"


def _regex_escape(s: str) -> str:
  return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in s)


class Matcher:
  """One request's grammar state: the allowed-token bitmask before each token,
  advanced by each token the request takes. Not thread-safe (the engine thread owns
  it while the request runs)."""

  def __init__(self, matcher: llguidance.LLMatcher, words: int, vocab_words: int):
    self._m, self.words, self._vocab_words = matcher, words, vocab_words

  def fill(self, out: np.ndarray) -> None:
    """Writes the allowed-token bitmask into `out` ([words] int32: bit t % 32 of
    word t // 32 for token t; tokens past the tokenizer's vocabulary stay 0)."""
    if out.shape != (self.words,) or out.dtype != np.int32 or not out.flags["C_CONTIGUOUS"]:
      raise ValueError(f"mask row must be a contiguous int32 [{self.words}] array")
    out[:] = 0
    self._m.unsafe_compute_mask_ptr(out.ctypes.data, self._vocab_words * 4)

  def consume(self, token: int) -> None:
    """Advances past `token`; ValueError if the grammar does not allow it."""
    if not self._m.consume_token(int(token)):
      raise ValueError(f"the grammar does not allow token {int(token)}: "
                       f"{self._m.get_error() or 'rejected'}")

  @property
  def done(self) -> bool:
    """Whether the grammar has ended (no token but a stop token may follow)."""
    return self._m.is_stopped()

  @property
  def accepting(self) -> bool:
    return self._m.is_accepting()


def batch_mask(grammars: Sequence[Matcher | None], vocab_size: int) -> np.ndarray | None:
  """[B, ceil(vocab_size / 32)] int32 bitmask of a batch's rows: each row's matcher's
  mask as it stands (valid for its next token only), all ones for a row without one;
  None when no row has a grammar (the step then compiles without a mask)."""
  if all(g is None for g in grammars):
    return None
  mask = np.full((len(grammars), (vocab_size + 31) // 32), -1, np.int32)
  for i, g in enumerate(grammars):
    if g is not None:
      g.fill(mask[i])
  return mask


class Grammars:
  """Compiles grammars for one tokenizer and a model's logits width.

  Args:
    tokenizer: a `jaxkv.tokens.Tokenizer` (its `tokenizers` backend and stop ids).
    vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: the
      extra ids are never allowed).

  Building llguidance's tokenizer takes 0.2-1 s (SmolLM2 / Qwen2.5's 150k vocabulary),
  so it is built once, on first use, under a lock (servers compile off the event loop,
  from worker threads).
  """

  def __init__(self, tokenizer, vocab_size: int):
    self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
    self.words = (self.vocab_size + 31) // 32
    self._ll = None
    self._lock = threading.Lock()

  def _lltokenizer(self) -> llguidance.LLTokenizer:
    with self._lock:
      if self._ll is None:
        ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(),
                                    eos_token=sorted(self.tokenizer.stop_ids))
        if ll.vocab_size > self.vocab_size:
          raise ValueError(f"the tokenizer has {ll.vocab_size} tokens, more than the "
                           f"model's {self.vocab_size} logits")
        self._ll = ll
      return self._ll

  def has_token(self, text: str) -> bool:
    return self.tokenizer.backend.token_to_id(text) is not None

  def tool_calls(self, tools: Sequence[dict], **kw) -> str:
    """`tool_calls` in the form this tokenizer's chat template writes calls: "hermes"
    when it renders tool calls itself (`traces.template_renders_tool_calls`), else
    "react"; `<tool_call>` as its token when the tokenizer has one."""
    style = "hermes" if traces.template_renders_tool_calls(self.tokenizer) else "react"
    return tool_calls(tools, style=style, text_opener=not self.has_token("<tool_call>"), **kw)

  def enforceable(self, fn: dict, *, strict: bool = False, closed: bool = False) -> dict:
    """`fn` (a function definition) with `parameters` a matcher can enforce: its own
    schema when llguidance compiles it, else any JSON object (ValueError instead when
    `strict`). `closed`: an object schema that lists its properties and does not say
    otherwise takes only those (additionalProperties false, OpenAI's strict mode)."""
    params = fn.get("parameters")
    if params is None:
      return fn
    if not isinstance(params, dict):
      raise ValueError(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object")
    if closed and "properties" in params and "additionalProperties" not in params:
      params = dict(params, additionalProperties=False)
    try:
      self.check(json_schema(params))
    except ValueError as e:
      if strict:
        raise ValueError(f"tool {fn['name']!r} is strict but its parameters schema is not "
                         f"supported: {e}") from None
      params = {"type": "object"}
    return dict(fn, parameters=params)

  def check(self, grammar: str) -> None:
    """ValueError with llguidance's message if `grammar` does not compile."""
    err = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer())
    if err and not err.startswith("WARNING"):
      raise ValueError(f"the grammar does not compile: {err}")

  def compile(self, grammar: str) -> Matcher:
    """A fresh matcher at the start of `grammar` (ValueError if it does not compile)."""
    ll = self._lltokenizer()
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    if m.is_error():
      raise ValueError(f"the grammar does not compile: {m.get_error()}")
    return Matcher(m, self.words, (ll.vocab_size + 31) // 32)
