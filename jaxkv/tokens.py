"""Tokenizer: byte-level BPE from GGUF metadata or an HF directory, plus chat templates.

`Tokenizer` wraps an HF `tokenizers.Tokenizer` (the Rust library, not
`transformers`) and adds special token ids, the stop set and the model's jinja2
chat template. `Tokenizer.from_gguf` rebuilds the tokenizer from a GGUF file's
`tokenizer.*` metadata (read with `jaxkv.models.gguf_file`; no tensor is read) exactly
as transformers' GGUF converter does
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`);
`Tokenizer.from_hf_dir` reads a `save_pretrained` directory. `render_chat`
reproduces `transformers.apply_chat_template(..., tokenize=False)`
(`transformers/utils/chat_template_utils.py`): a sandboxed jinja2 environment
with `trim_blocks`/`lstrip_blocks`, a non-HTML-escaping `tojson`,
`raise_exception`, `strftime_now`, `loopcontrols` and `{% generation %}`.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

_CONTROL = 3        # llama.cpp token types
_USER_DEFINED = 4
ROLES = ("system", "user", "assistant", "tool")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
# Named special tokens, as transformers passes them to chat templates.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_GGUF_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                     "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Split regexes per `tokenizer.ggml.pre`, copied from transformers' GGUF converter.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# `pre` values that transformers leaves on GPT-2's own ByteLevel regex. For
# 'smollm' (and the other StarCoder-style entries) llama.cpp and the original
# tokenizer.json also split every digit apart first; transformers does not, and
# we follow transformers (see `from_gguf`).
GPT2_REGEX_PRES = frozenset(("default", "gpt-2", "gpt2", "smollm", "starcoder", "refact",
                             "codeshell", "phi-2", "mpt", "olmo"))

# Used when a tokenizer has no chat template: ChatML, with Qwen2.5-style tools.
CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": ' + tool_call.function.name | tojson + ', "arguments": ' }}
{{- tool_call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""  # noqa: E501 (the template is ChatML's, line for line)


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders its body (transformers marks it)."""
  tags: ClassVar[set[str]] = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _check_name(name):
  if isinstance(name, str) and name.startswith("_"):
    raise jinja2.exceptions.SecurityError(
        f"chat templates cannot set underscore attributes on a namespace: {name!r}")


class _TemplateNamespace(jinja2.utils.Namespace):
  """`namespace()` that refuses underscore attributes, as transformers' does."""

  def __init__(*args, **kwargs):  # pylint: disable=no-self-argument
    attrs = dict(*args[1:], **kwargs)
    for name in attrs:
      _check_name(name)
    jinja2.utils.Namespace.__init__(args[0], attrs)

  def __setitem__(self, name, value):
    _check_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  """jinja's `tojson` escapes HTML characters; transformers' (and ours) does not."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                     namespace=_TemplateNamespace)
  return env.from_string(source)


def _content_text(content: Any, where: str) -> str:
  """A message's content as a string; a list of text parts is concatenated."""
  if isinstance(content, str):
    return content
  if isinstance(content, (list, tuple)):
    parts = []
    for part in content:
      if not (isinstance(part, Mapping) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise ValueError(f"{where}: content parts must be {{'type': 'text', 'text': str}} "
                         f"(text only), got {part!r}")
      parts.append(part["text"])
    return "".join(parts)
  raise ValueError(f"{where}: content must be a string or a list of text parts, "
                   f"got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict:
  """An OpenAI-style tool call with `function.arguments` parsed to a dict."""
  if not isinstance(call, Mapping):
    raise ValueError(f"{where}: a tool call must be a dict, got {call!r}")
  call = copy.deepcopy(dict(call))
  fn = call.get("function", call if "name" in call else None)
  if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
    raise ValueError(f"{where}: a tool call needs function.name, got {call!r}")
  fn = dict(fn)
  args = fn.get("arguments", {})
  if isinstance(args, str):
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: arguments of {fn['name']!r} are not valid JSON: {e}") from e
  if not isinstance(args, Mapping):
    raise ValueError(f"{where}: arguments of {fn['name']!r} must be a JSON object, got {args!r}")
  fn["arguments"] = dict(args)
  if "function" not in call:  # bare {"name", "arguments"}: wrap it the OpenAI way
    call = {k: v for k, v in call.items() if k not in ("name", "arguments")}
  call.setdefault("type", "function")
  call["function"] = fn
  return call


def validate_messages(messages: Any) -> list[dict]:
  """Checks a chat and returns a normalized copy the templates can render.

  Keys whose value is None are dropped (as transformers does), content given as
  text parts is joined into one string, tool-call arguments given as a JSON
  string are parsed to a dict, and `reasoning`/`thinking` are aliased to
  `reasoning_content` (and back) like transformers.

  Args:
    messages: list of dicts with `role` in system/user/assistant/tool and
      `content`; an assistant message may carry `tool_calls` instead of content.

  Returns:
    A new list of new dicts; the caller's messages are not modified.

  Raises:
    ValueError: not a non-empty list of dicts, missing role/content, unknown
      role, or malformed tool calls.
  """
  if not isinstance(messages, (list, tuple)):
    raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
  if not messages:
    raise ValueError("messages is empty: a chat needs at least one message")
  out = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
      raise ValueError(f"{where} must be a dict, got {type(message).__name__}")
    msg = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
    role = msg.get("role")
    if role is None:
      raise ValueError(f"{where} has no 'role'")
    if role not in ROLES:
      raise ValueError(f"{where} has unknown role {role!r}; expected one of {ROLES}")
    calls = msg.get("tool_calls")
    if calls is not None:
      if role != "assistant":
        raise ValueError(f"{where}: only assistant messages may carry tool_calls")
      if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
      msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if "content" in msg:
      msg["content"] = _content_text(msg["content"], where)
    elif not (role == "assistant" and calls):
      raise ValueError(f"{where} (role {role!r}) has no 'content'")
    reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
    if reasoning is not None:
      msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    out.append(msg)
  return out


class Tokenizer:
  """Byte-level BPE tokenizer with special tokens, stop ids and a chat template.

  Encoding never adds EOS and adds BOS only when asked (default: `add_bos`, from
  the metadata). Special tokens written in the text (`<|im_start|>`) are matched
  as single tokens. `decode` is the backend's decode (transformers' clean-up of
  tokenization spaces is never applied; transformers skips it for BPE too).

  Attributes:
    backend: the wrapped `tokenizers.Tokenizer`.
    add_bos: whether `encode` prepends BOS by default.
    special_tokens: named special tokens (`bos_token`, `eos_token`, ...) -> text.
    chat_template: the model's template (a string, or name -> template), or None.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *,
               special_tokens: Mapping[str, str | None] | None = None, add_bos: bool = False,
               chat_template: str | Mapping[str, str] | None = None,
               extra_stop_ids: Iterable[int] = ()):
    """Wraps `backend`.

    Args:
      backend: a ready `tokenizers.Tokenizer`; named special tokens missing from
        its added tokens are added as special tokens (as transformers does).
      special_tokens: `bos_token`/`eos_token`/`unk_token`/`pad_token`/... -> text.
      add_bos: default of `encode(add_bos=None)`.
      chat_template: jinja2 source, a dict of named templates, or None for the
        built-in ChatML fallback (`CHATML_TEMPLATE`).
      extra_stop_ids: more ids that end generation (e.g. generation_config eos).
    """
    self.backend = backend
    self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, special=True) for t in dict.fromkeys(self.special_tokens.values())
               if t not in added]
    if missing:
      backend.add_special_tokens(missing)
    self.add_bos = bool(add_bos)
    self.chat_template = chat_template
    ids = {k: backend.token_to_id(v) for k, v in self.special_tokens.items()}
    extra = [int(i) for i in extra_stop_ids]
    self.bos_id, self.pad_id, self.unk_id = map(ids.get, ("bos_token", "pad_token", "unk_token"))
    self.eos_id = ids.get("eos_token") if ids.get("eos_token") is not None else (
        extra[0] if extra else None)
    stops = {i for i in [self.eos_id, *extra] if i is not None}
    stops.update(i for i in map(backend.token_to_id, STOP_TOKENS) if i is not None)
    self.stop_ids: frozenset[int] = frozenset(stops)

  def __repr__(self):
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"stop_ids={sorted(self.stop_ids)}, add_bos={self.add_bos})")

  # --- loading ---------------------------------------------------------------

  @classmethod
  def load(cls, path: str | os.PathLike) -> Tokenizer:
    """A `.gguf` file -> `from_gguf`; a directory -> `from_hf_dir`."""
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
      return cls.from_hf_dir(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
      return cls.from_gguf(p)
    if not p.exists():
      raise FileNotFoundError(f"no tokenizer at {p}: expected a .gguf file or an HF directory")
    raise ValueError(f"cannot load a tokenizer from {p}: expected a .gguf file or an HF directory")

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
    """Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.

    Mirrors transformers' GGUF converter: tokens outside the byte alphabet are
    respelled byte by byte, merges are split on a space, the pre-tokenizer is
    `Split(PRE_TOKENIZER_SPLITS[pre], isolated) + ByteLevel(use_regex=False)` or
    GPT-2's plain `ByteLevel` (for `pre` in `GPT2_REGEX_PRES`), no normalizer
    (Qwen2's original tokenizer.json has NFC; transformers' GGUF build does not),
    a ByteLevel decoder, control tokens spelled in the byte alphabet as special
    added tokens and user-defined tokens as non-special added tokens.

    Args:
      path: the .gguf file; only its metadata is read.

    Raises:
      FileNotFoundError: no such file.
      ValueError: `tokenizer.ggml.model` is not 'gpt2', `tokenizer.ggml.pre` is
        unknown, or the tokens/merges are missing.
    """
    from jaxkv.models import gguf_file  # pylint: disable=import-outside-toplevel

    path = pathlib.Path(path).expanduser()
    get = gguf_file.read(path).get

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
      raise ValueError(f"{path.name}: unsupported tokenizer.ggml.model {model!r}; only 'gpt2' "
                       f"(byte-level BPE) is supported")
    pre = get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZER_SPLITS and pre not in GPT2_REGEX_PRES:
      raise ValueError(f"{path.name}: unknown tokenizer.ggml.pre {pre!r}; supported: "
                       f"{sorted(PRE_TOKENIZER_SPLITS.keys() | GPT2_REGEX_PRES)}")
    tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges")
    if not tokens or merges is None:
      raise ValueError(f"{path.name}: a gpt2 tokenizer needs tokenizer.ggml.tokens and "
                       f"tokenizer.ggml.merges")
    types = get("tokenizer.ggml.token_type") or ()
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    if pre in PRE_TOKENIZER_SPLITS:
      backend.pre_tokenizer = pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
      backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel
    # (transformers skips it rather than grow the vocabulary).
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if int(k) == _CONTROL and set(t) <= alphabet]
    if control:
      backend.add_special_tokens(control)
    known = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if int(k) == _USER_DEFINED and t in known]
    if user:
      backend.add_tokens(user)
    special = {}
    for name, key in _GGUF_SPECIAL_IDS.items():
      i = get(f"tokenizer.ggml.{key}")
      if i is not None and 0 <= int(i) < len(tokens):
        special[name] = tokens[int(i)]
    tok = cls(backend, special_tokens=special,
              add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
              chat_template=get("tokenizer.chat_template"))
    # transformers' post-processor, for callers of `backend.encode(add_special_tokens=True)`.
    bos = special["bos_token"] if tok.add_bos and tok.bos_id is not None else None
    a, b = (f"{bos}:0 ", f"{bos}:1 ") if bos else ("", "")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{a}$A:0", pair=f"{a}$A:0 {b}$B:1",
        special_tokens=[(bos, tok.bos_id)] if bos else [])
    return tok

  @classmethod
  def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
    """Loads an HF tokenizer directory (as written by `save_pretrained`).

    Reads `tokenizer.json` (required), `tokenizer_config.json` (named special
    tokens, `added_tokens_decoder`, `add_bos_token`, `chat_template`),
    `chat_template.jinja` / `additional_chat_templates/*.jinja` /
    `chat_template.json` (these win over tokenizer_config, as in transformers)
    and `generation_config.json` (`eos_token_id`, an int or a list, joins the
    stop ids). Without `add_bos_token`, BOS is added by default when the
    tokenizer.json post-processor would add it.

    Raises:
      FileNotFoundError: the directory or its tokenizer.json is missing.
    """
    d = pathlib.Path(directory).expanduser()
    if not d.is_dir():
      raise FileNotFoundError(f"tokenizer directory not found: {d}")
    tj = d / "tokenizer.json"
    if not tj.is_file():
      raise FileNotFoundError(f"{tj} not found: from_hf_dir needs a `tokenizers` tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(str(tj))
    config = _read_json(d / "tokenizer_config.json")
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    for _, spec in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda x: int(x[0])):
      if isinstance(spec, Mapping) and spec.get("content") not in have:
        token = AddedToken(spec["content"], **{k: bool(spec[k]) for k in (
            "single_word", "lstrip", "rstrip", "normalized", "special") if k in spec})
        (backend.add_special_tokens if spec.get("special") else backend.add_tokens)([token])
    special = {}
    for name in _SPECIAL_NAMES:
      value = config.get(name)
      if isinstance(value, Mapping):
        value = value.get("content")
      if isinstance(value, str):
        special[name] = value
    template = config.get("chat_template")
    if isinstance(template, list):
      template = {t["name"]: t["template"] for t in template}
    if (d / "chat_template.json").is_file():
      template = _read_json(d / "chat_template.json").get("chat_template", template)
    files = {}
    if (d / "chat_template.jinja").is_file():
      files["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
      for f in sorted(extra.glob("*.jinja")):
        files[f.stem] = f.read_text(encoding="utf-8")
    if files:
      template = files["default"] if list(files) == ["default"] else files
    eos = _read_json(d / "generation_config.json").get("eos_token_id")
    extra_stop = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    add_bos = config.get("add_bos_token")
    if add_bos is None:
      bos = special.get("bos_token")
      bos_id = None if bos is None else backend.token_to_id(bos)
      add_bos = (bos_id is not None
                 and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id])
    return cls(backend, special_tokens=special, add_bos=add_bos, chat_template=template,
               extra_stop_ids=extra_stop)

  # --- tokens ----------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    """Id of a vocabulary entry in its byte-level spelling (`"Ġthe"`), or None."""
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    """Vocabulary entry (byte-level spelling, e.g. `"Ġthe"`) of an id, or None."""
    return self.backend.id_to_token(int(token_id))

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Text -> ids; special tokens written in `text` become single ids.

    Args:
      text: the string to encode.
      add_bos: prepend BOS; None uses `self.add_bos` (the model's metadata).

    Raises:
      TypeError: text is not a string.
      ValueError: BOS requested but the tokenizer has none.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode takes a str, got {type(text).__name__}")
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if self.add_bos if add_bos is None else add_bos:
      if self.bos_id is None:
        raise ValueError("add_bos requested but this tokenizer has no BOS token")
      ids = [self.bos_id, *ids]
    return ids

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids (no BOS) and each token's (start, end) character span in `text`."""
    enc = self.backend.encode(text, add_special_tokens=False)
    return enc.ids, [tuple(o) for o in enc.offsets]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Ids (any iterable of ints, numpy arrays included) -> text."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  # --- chat ------------------------------------------------------------------

  def _template(self, tools) -> str:
    template = self.chat_template
    if template is None:
      return CHATML_TEMPLATE
    if isinstance(template, Mapping):
      if tools is not None and "tool_use" in template:
        return template["tool_use"]
      if "default" in template:
        return template["default"]
      raise ValueError(f"tokenizer has several chat templates {sorted(template)} and no 'default'")
    return template

  def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                  add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """Renders a chat with the model's chat template, like transformers.

    Equals `apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=...)`. If the tokenizer has no template, a built-in
    ChatML template (`CHATML_TEMPLATE`) is used: `<|im_start|>{role}\\n{content}
    <|im_end|>\\n` per message and `<|im_start|>assistant\\n` as the generation
    prompt; tools are listed Qwen2.5-style in the system turn, tool calls are
    written `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` and
    consecutive tool results become one user turn of
    `<tool_response>\\n...\\n</tool_response>` blocks.

    Args:
      messages: see `validate_messages`; tool-call arguments may be a dict or a
        JSON string (parsed to a dict).
      tools: JSON schemas of the tools (`{"type": "function", "function":
        {...}}`), or None.
      add_generation_prompt: end with the header of a new assistant turn.
      **template_kwargs: extra template variables (e.g. `enable_thinking`).

    Raises:
      ValueError: invalid messages or tools, or the template raised an error.
    """
    chat = validate_messages(messages)
    if tools is not None:
      if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be a list of JSON-schema dicts")
      tools = [copy.deepcopy(dict(t)) for t in tools]
    template = _compile_template(self._template(tools))
    variables = {**self.special_tokens, **template_kwargs}
    try:
      return template.render(messages=chat, tools=tools, documents=None,
                             add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"chat template failed: {e}") from e

  def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                  add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
    """`encode(render_chat(...))` without adding BOS: the template writes it if
    the model wants it (transformers encodes with `add_special_tokens=False`)."""
    text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            **template_kwargs)
    return self.encode(text, add_bos=False)


def _read_json(path: pathlib.Path) -> dict:
  if not path.is_file():
    return {}
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  return data if isinstance(data, dict) else {}
