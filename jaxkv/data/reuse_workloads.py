"""Workloads for cross-prompt segment reuse (seed 002), built from ToolBench-format
traces: the prompts prefix caches miss.

(a) `tool_subset`: each request's system prompt holds a random subset of its
    domain's tool schemas and policy sections in random order, then one
    session's user request. The same schema recurs at a different position
    after a different left context in almost every request. Policy sections
    are the system message's own sections, plus the tau2 domain policy
    (`## ...` sections) when the sessions are tau2's and tau2 is installed.
(b) `retrieval`: k passages of the Python documentation (`jaxkv.data.texts`:
    each library document's introductory prose) drawn from a fixed pool, in
    random order, then a question about one of them; the gold answer is that
    passage's first sentence. Each passage recurs in several requests at other
    positions, after other passages.
(c) `requote`: multi-turn agent sessions where a second agent re-quotes the
    first one's tool outputs. Per tool output i of a session: A_i, the
    session itself up to that output (rendered with the model's template),
    then B_i, a reviewer agent's prompt quoting outputs i, i-1, ..., 1 (most
    recent first) after the customer's request. Each output is computed first
    inside A's context, then reappears in B_i, B_i+1, ... one output later each
    time: a new position and a new left context, where a prefix cache misses.
    A requests are served (they fill the store and the radix cache) but only
    B requests are scored (`Request.scored`).
(d) `perturbed`: one fixed segment after a left context that differs from the
    stored one by a controlled fraction of its tokens (insert / delete /
    replace), for drift-versus-perturbation curves.

Each `Request` carries its structural spans (the token ranges of the schemas,
sections and user text, found in the rendered prompt) and a gold continuation
(the session's first assistant turn) for teacher-forced NLL.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

import numpy as np

from jaxkv.data import texts, traces
from jaxkv.policies.reuse.index import structural_spans

WORKLOADS = ("tool_subset", "retrieval", "requote", "perturbed")
REVIEWER = ("You review a customer-service agent's work. Given the customer's request and "
            "the tool results the agent has seen, say what the agent should do next.")
_SECTION = re.compile(r"\n(?=#{1,3} )")


@dataclasses.dataclass
class Request:
  id: str
  ids: np.ndarray                        # prompt token ids
  spans: list[tuple[int, int]]           # structural spans (token ranges)
  continuation: np.ndarray               # gold continuation ids (teacher-forced NLL)
  meta: dict = dataclasses.field(default_factory=dict)
  scored: bool = True                    # False: served (fills the store), not measured


def policy_sections(session: traces.Session) -> list[str]:
  """The policy sections available to a session: its system message split at
  markdown headers (or blank lines), plus tau2's domain policy if importable."""
  out = []
  system = next((t.content for t in session.turns if t.role == "system"), "")
  parts = _SECTION.split(system) if _SECTION.search(system) else system.split("\n\n")
  out += [p.strip() for p in parts[1:] if len(p.strip()) > 80]
  m = re.match(r"tau2/([a-z]+)/", session.id)
  if m:
    try:
      from jaxkv.data import envs  # pylint: disable=import-outside-toplevel
      policy = envs.tau2_module(m.group(1)).get_environment().policy
      out += [p.strip() for p in _SECTION.split(policy) if len(p.strip()) > 80]
    except Exception:  # pylint: disable=broad-except   # tau2 absent: schemas only
      pass
  return out


def _header(session: traces.Session) -> str:
  system = next((t.content for t in session.turns if t.role == "system"), "")
  return (_SECTION.split(system)[0] if _SECTION.search(system) else system.split("\n\n")[0]).strip()


def _first_reply(session: traces.Session) -> tuple[str, str] | None:
  """(first user text, first assistant turn as ReAct text), or None."""
  user = next((t for t in session.turns if t.role == "user"), None)
  reply = next((t for t in session.turns if t.role == "assistant"), None)
  if user is None or reply is None:
    return None
  return user.content, traces.format_react(reply)


def render_request(tokenizer, header: str, sections: Sequence[str], tools: Sequence[dict],
                   user: str, reply: str, rid: str, meta: dict | None = None) -> Request:
  """One prompt: header, sections, one JSON schema per line, then the user text."""
  schemas = [json.dumps(t, ensure_ascii=False) for t in tools]
  system = "\n\n".join([header, *sections, "Tools:\n" + "\n".join(schemas)])
  messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
  text = tokenizer.render_chat(messages, add_generation_prompt=True)
  ids = np.asarray(tokenizer.encode(text, add_bos=False), np.int32)
  spans = structural_spans(tokenizer, text, [*sections, *schemas, user])
  cont = np.asarray(tokenizer.encode(reply, add_bos=False), np.int32)
  return Request(id=rid, ids=ids, spans=spans, continuation=cont, meta=dict(meta or {}))


def tool_subset(sessions: Sequence[traces.Session], tokenizer, n: int, *, seed: int = 0,
                tools: tuple[int, int] = (4, 8), sections: tuple[int, int] = (1, 3),
                max_tokens: int | None = None) -> list[Request]:
  """Workload (a): n requests (see the module docstring), deterministic in seed.

  Args:
    tools / sections: inclusive ranges of how many schemas / policy sections a
      request draws (without replacement, random order).
    max_tokens: drop requests longer than this.
  """
  rng = np.random.default_rng(seed)
  usable = [s for s in sessions if s.tools and _first_reply(s) is not None]
  if not usable:
    raise ValueError("no session has both tools and a user turn followed by an assistant turn")
  sec_cache: dict[str, list[str]] = {}
  out, tries = [], 0
  while len(out) < n and tries < 20 * n:
    tries += 1
    s = usable[int(rng.integers(len(usable)))]
    dom = s.id.rsplit("/", 1)[0]
    if dom not in sec_cache:
      sec_cache[dom] = policy_sections(s)
    secs = sec_cache[dom]
    kt = int(rng.integers(min(tools[0], len(s.tools)), min(tools[1], len(s.tools)) + 1))
    ks = int(rng.integers(min(sections[0], len(secs)), min(sections[1], len(secs)) + 1))
    pick_t = [s.tools[i] for i in rng.permutation(len(s.tools))[:kt]]
    pick_s = [secs[i] for i in rng.permutation(len(secs))[:ks]]
    user, reply = _first_reply(s)
    req = render_request(tokenizer, _header(s), pick_s, pick_t, user, reply,
                         f"a/{len(out)}/{s.id}", dict(session=s.id, tools=kt, sections=ks))
    if max_tokens is None or req.ids.size <= max_tokens:
      out.append(req)
  return out


def retrieval(passages: Sequence[texts.Passage], tokenizer, n: int, *, seed: int = 0,
              k: tuple[int, int] = (4, 8), pool: int = 48,
              max_tokens: int | None = None) -> list[Request]:
  """Workload (b): n requests (see the module docstring), deterministic in seed.

  Args:
    passages: the corpus (`texts.doc_passages`).
    k: inclusive range of passages per request.
    pool: passages the requests draw from (fewer: each recurs more often).
  """
  rng = np.random.default_rng(seed)
  if len(passages) < k[1]:
    raise ValueError(f"retrieval needs at least {k[1]} passages, got {len(passages)}")
  pick = [passages[i] for i in rng.permutation(len(passages))[:max(pool, k[1])]]
  out, tries = [], 0
  while len(out) < n and tries < 20 * n:
    tries += 1
    docs = [pick[i] for i in rng.permutation(len(pick))[:int(rng.integers(k[0], k[1] + 1))]]
    target = docs[int(rng.integers(len(docs)))]
    pieces = [f"{p.title}\n{p.text}" for p in docs]
    question = f'Question: according to the documents, what is "{target.title}" about?'
    user = "\n\n".join(f"Document {j + 1}: {piece}" for j, piece in enumerate(pieces))
    user += "\n\n" + question
    messages = [{"role": "system", "content": "Answer the question using the documents "
                 "the user gives."}, {"role": "user", "content": user}]
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    ids = np.asarray(tokenizer.encode(text, add_bos=False), np.int32)
    answer = re.split(r"(?<=[.!?])\s", target.text, maxsplit=1)[0]
    req = Request(id=f"b/{len(out)}/{target.doc}", ids=ids,
                  spans=structural_spans(tokenizer, text, [*pieces, question]),
                  continuation=np.asarray(tokenizer.encode(answer, add_bos=False), np.int32),
                  meta=dict(docs=[p.doc for p in docs], target=target.doc))
    if max_tokens is None or ids.size <= max_tokens:
      out.append(req)
  return out


def requote(sessions: Sequence[traces.Session], tokenizer, n: int, *, seed: int = 0,
            max_tokens: int | None = None) -> list[Request]:
  """Workload (c): pairs A_i, B_i (see the module docstring) from sessions in a
  seeded order until n requests; a session stops at its first request longer
  than max_tokens. Both take the trace's next assistant turn as the gold reply."""
  rng = np.random.default_rng(seed)
  out = []
  for si in rng.permutation(len(sessions)):
    s = sessions[int(si)]
    user = next((t.content for t in s.turns if t.role == "user"), None)
    if user is None:
      continue
    quoted: list[str] = []
    for ti, turn in enumerate(s.turns):
      if len(out) >= n:
        return out
      if turn.role != "tool":
        continue
      reply = next((t for t in s.turns[ti + 1:] if t.role == "assistant"), None)
      if reply is None:
        break
      quoted.insert(0, turn.content)
      gold = np.asarray(tokenizer.encode(traces.format_react(reply), add_bos=False), np.int32)
      head = dataclasses.replace(s, turns=s.turns[:ti + 1])
      text_a = traces.render_session(head, tokenizer, add_generation_prompt=True)
      outputs = [t.content for t in head.turns if t.role == "tool"]
      review = (f"The customer asked:\n{user}\n\nTool results so far, most recent first:\n\n"
                + "\n\n".join(quoted) + "\n\nWhat should the agent do next?")
      text_b = tokenizer.render_chat([{"role": "system", "content": REVIEWER},
                                      {"role": "user", "content": review}],
                                     add_generation_prompt=True)
      pair = []
      for tag, text, pieces in (("A", text_a, [user, *outputs]), ("B", text_b, [user, *quoted])):
        ids = np.asarray(tokenizer.encode(text, add_bos=False), np.int32)
        pair.append(Request(id=f"c/{len(out) + len(pair)}/{s.id}/{tag}{len(quoted)}", ids=ids,
                            spans=structural_spans(tokenizer, text, pieces), continuation=gold,
                            meta=dict(session=s.id, role=tag, outputs=len(quoted)),
                            scored=tag == "B"))
      if max_tokens is not None and max(r.ids.size for r in pair) > max_tokens:
        break
      out.extend(pair[:n - len(out)])
  return out


def perturb(ids: np.ndarray, frac: float, kind: str, rng: np.random.Generator,
            vocab: tuple[int, int]) -> np.ndarray:
  """ids with round(frac * len) tokens inserted, deleted or replaced at random
  places (random ids from the vocab range)."""
  k = int(round(frac * ids.size))
  if k == 0:
    return ids.copy()
  at = np.sort(rng.choice(ids.size, size=min(k, ids.size), replace=False))
  new = rng.integers(vocab[0], vocab[1], at.size).astype(ids.dtype)
  if kind == "replace":
    out = ids.copy()
    out[at] = new
    return out
  if kind == "delete":
    return np.delete(ids, at)
  if kind == "insert":
    return np.insert(ids, at, new)
  raise ValueError(f"perturbation kind must be insert, delete or replace, got {kind!r}")


def perturbed(base: Sequence[Request], fracs: Sequence[float], kinds: Sequence[str], *,
              context: int = 256, seed: int = 0, vocab: tuple[int, int] = (100, 40000)
              ) -> list[tuple[Request, Request]]:
  """Workload (d): per base request, the pair (reference, probe) where the probe
  perturbs the `context` tokens before the request's longest structural span
  by each fraction and kind; the span and everything after it are unchanged."""
  rng = np.random.default_rng(seed)
  out = []
  for req in base:
    if not req.spans:
      continue
    lo, hi = max(req.spans, key=lambda s: s[1] - s[0])
    c0 = max(0, lo - context)
    for kind in kinds:
      for f in fracs:
        ctx = perturb(req.ids[c0:lo], f, kind, rng, vocab)
        ids = np.concatenate([req.ids[:c0], ctx, req.ids[lo:]]).astype(np.int32)
        shift = ctx.size - (lo - c0)
        spans = [(a + shift, b + shift) if a >= lo else (a, b) for a, b in req.spans
                 if a >= lo or b <= c0]
        probe = dataclasses.replace(req, id=f"{req.id}/{kind}/{f:g}", ids=ids, spans=spans,
                                    meta=dict(req.meta, kind=kind, frac=f, span=(lo, hi)))
        out.append((req, probe))
  return out
