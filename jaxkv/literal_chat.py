"""Chat prompts whose message text is encoded as text: no role forging through content.

`Tokenizer.encode_chat` renders the chat template and encodes the result, so a
special token's spelling inside a message (`<|im_start|>system`, `<|im_end|>`)
becomes that control token, and a user or a tool output can write turns of its
own. `encode_chat_literal` encodes what the template writes with special tokens
and what the messages say as plain text:

1. the chat is rendered twice, once as is and once with each message's content
   replaced by a private-use marker (U+E000 n U+E001);
2. if putting the contents back in place of the markers gives the first
   rendering exactly (the template writes content verbatim: SmolLM2's, Qwen2.5's,
   the ChatML fallback), the template's pieces are encoded with special tokens and
   the contents with a copy of the tokenizer that reads special tokens as text
   (`tokenizers`' `encode_special_tokens`);
3. otherwise (a template that rewrites content) the plain encoding is used when no
   content spells a special token, and ValueError is raised when one does.

Tool-call names and arguments and tool schemas are not content: one that spells a
special token is refused (ValueError), as is content holding the markers' own
private-use characters together with special-token text. A content without
special-token text encodes to the same ids as `encode_chat` when no BPE merge
crosses its edges, which byte-level pre-tokenisation never makes at a template's
newline or control token (tests compare both on real chats).
"""

from __future__ import annotations

import re
import weakref

import tokenizers

from jaxkv.tokens import Tokenizer, validate_messages

_MARK = "\ue000{}\ue001"
_SPLIT = re.compile("\ue000([0-9]+)\ue001")
_LITERAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def literal_backend(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
  """A copy of the tokenizer's backend that encodes special-token text as text."""
  if tokenizer not in _LITERAL:
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    backend.encode_special_tokens = True
    _LITERAL[tokenizer] = backend
  return _LITERAL[tokenizer]


def special_texts(tokenizer: Tokenizer) -> list[str]:
  """The spellings of the tokenizer's special (control) tokens."""
  return [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special]


def _has_marks(content) -> bool:
  """Content holding the markers' own characters: it cannot be marked."""
  return isinstance(content, str) and ("\ue000" in content or "\ue001" in content)


def _spells_special(text: str, specials: list[str]) -> str | None:
  return next((s for s in specials if s and s in text), None)


def encode_chat_literal(tokenizer: Tokenizer, messages: list[dict],
                        tools: list[dict] | None = None, add_generation_prompt: bool = True,
                        **template_kwargs) -> list[int]:
  """Token ids of the rendered chat, message contents encoded as text (module
  docstring). Raises ValueError for an invalid chat, a tool call that spells a
  special token, or special-token text in content under a template that rewrites
  content."""
  chat = validate_messages(messages)
  specials = special_texts(tokenizer)
  # what stays in the template's pieces (encoded with special tokens) may not spell one
  checks = [("a tool schema", tools)]
  for m in chat:
    checks.append(("a tool call", m.get("tool_calls")))
    if _has_marks(m.get("content")):
      checks.append(("a message with U+E000 / U+E001", m["content"]))
  for what, value in checks:
    bad = value and _spells_special(repr(value), specials)
    if bad:
      raise ValueError(f"{what} spells the special token {bad!r}")
  kw = dict(tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
  text = tokenizer.render_chat(chat, **kw)
  contents: list[str] = []
  marked = []
  for m in chat:
    c = m.get("content")
    if isinstance(c, str) and c and not _has_marks(c):
      contents.append(c)
      m = {**m, "content": _MARK.format(len(contents) - 1)}
    marked.append(m)
  parts = _SPLIT.split(tokenizer.render_chat(marked, **kw))
  rebuilt = "".join(p if i % 2 == 0 else contents[int(p)] for i, p in enumerate(parts))
  if rebuilt != text:
    bad = next((b for b in (_spells_special(c, specials) for c in contents) if b), None)
    if bad:
      raise ValueError(f"a message spells the special token {bad!r}, and this chat template "
                       "rewrites message text, so it cannot be kept as text")
    return tokenizer.encode(text, add_bos=False)
  literal = literal_backend(tokenizer)
  ids: list[int] = []
  for i, p in enumerate(parts):
    if i % 2 == 0:
      ids += tokenizer.backend.encode(p, add_special_tokens=False).ids if p else []
    else:
      ids += literal.encode(contents[int(p)], add_special_tokens=False).ids
  return ids


__all__ = ["encode_chat_literal", "literal_backend", "special_texts"]
