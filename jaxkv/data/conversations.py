"""Long multi-session conversations for KV-native memory (MemArt, seed 003),
in LoCoMo's JSON format, and LoCoMo's answer scores.

Format (LoCoMo, Maharana et al. 2024; `load_locomo` reads the released file
as is, `dump_locomo` writes the same shape):
  [{"sample_id": str,
    "conversation": {"speaker_a": str, "speaker_b": str,
                     "session_1": [{"speaker", "dia_id": "D1:1", "text"}, ...],
                     "session_1_date_time": "1:56 pm on 8 May, 2023", ...},
    "qa": [{"question", "answer", "evidence": ["D1:3"], "category": int}, ...]}, ...]
Other keys (observations, summaries, image urls) are ignored; a turn's
`blip_caption` is appended as LoCoMo's own prompts do ("[shares ...]");
adversarial questions (category 5) carry no `answer` and are skipped, as the
MemArt paper does. Our extra field `"synthetic": true` marks planted turns and
their questions.

Development data (`build_from_chitchat`): LoCoMo is not available offline, so
real human dialogue from the `chitchat-dataset` package (7,168 conversations)
is concatenated, one chitchat conversation per session, into histories of a
target token count, senders relabelled to two names. Questions:
- recall (real): "What did B say right after A said: "<cue>"?", answered by
  the utterance that followed, evidence its dia_id; cues and answers are
  utterances of 6-40 / 4-30 words that occur once in the history.
- planted (synthetic): a fact turn inserted into a random session ("By the way,
  my sister's dog is called Biscuit.") and a question about it.

Scores (LoCoMo's task_eval): token F1 after normalising (lowercase, commas,
articles and "and", punctuation) with Porter stems; BLEU-1 as Mem0 reports it
(nltk's sentence_bleu, unigram weights, smoothing method 1) over a regex word
tokenisation (nltk's word_tokenize needs a download).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import itertools
import json
import os
import re
import string
from collections.abc import Callable, Sequence

import numpy as np

RECALL, PLANTED = "recall", "planted"
_SESSION = re.compile(r"^session_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Turn:
  speaker: str
  dia_id: str
  text: str
  synthetic: bool = False


@dataclasses.dataclass(frozen=True)
class Session:
  index: int
  date_time: str
  turns: tuple[Turn, ...]


@dataclasses.dataclass(frozen=True)
class QA:
  question: str
  answer: str
  evidence: tuple[str, ...]
  category: int
  synthetic: bool = False


@dataclasses.dataclass(frozen=True)
class Conversation:
  sample_id: str
  speaker_a: str
  speaker_b: str
  sessions: tuple[Session, ...]
  qa: tuple[QA, ...]

  def turns(self) -> list[Turn]:
    return [t for s in self.sessions for t in s.turns]


class ConversationFormatError(ValueError):
  """A conversations file not in LoCoMo's format (the message says where)."""


def _need(obj, key, kind, where):
  if key not in obj:
    raise ConversationFormatError(f"{where}: missing {key!r}")
  if not isinstance(obj[key], kind):
    raise ConversationFormatError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, "
                                  f"got {type(obj[key]).__name__}")
  return obj[key]


def parse_locomo(data) -> list[Conversation]:
  """LoCoMo JSON (already loaded) -> conversations; malformed input raises
  ConversationFormatError naming the sample and field."""
  if not isinstance(data, list):
    raise ConversationFormatError("expected a JSON list of samples")
  out = []
  for i, s in enumerate(data):
    where = f"sample {i}"
    if not isinstance(s, dict):
      raise ConversationFormatError(f"{where}: expected an object")
    c = _need(s, "conversation", dict, where)
    sessions = []
    for key in sorted((k for k in c if _SESSION.match(k)), key=lambda k: int(k.split("_")[1])):
      n = int(key.split("_")[1])
      turns = []
      for j, t in enumerate(_need(c, key, list, f"{where}.conversation")):
        tw = f"{where}.conversation.{key}[{j}]"
        if not isinstance(t, dict):
          raise ConversationFormatError(f"{tw}: expected an object")
        text = str(_need(t, "text", str, tw))
        if t.get("blip_caption"):
          text = f"{text} [shares {t['blip_caption']}]"
        turns.append(Turn(str(_need(t, "speaker", str, tw)), str(_need(t, "dia_id", str, tw)),
                          text, bool(t.get("synthetic", False))))
      sessions.append(Session(n, str(c.get(f"{key}_date_time", "")), tuple(turns)))
    if not sessions:
      raise ConversationFormatError(f"{where}.conversation: no session_N lists")
    ids = {t.dia_id for se in sessions for t in se.turns}
    qa = []
    for j, q in enumerate(s.get("qa", [])):
      qw = f"{where}.qa[{j}]"
      if not isinstance(q, dict):
        raise ConversationFormatError(f"{qw}: expected an object")
      if "answer" not in q:          # adversarial (category 5): no ground truth
        continue
      ev = q.get("evidence", [])
      if not isinstance(ev, list):
        raise ConversationFormatError(f"{qw}.evidence: expected a list of dia_ids")
      qa.append(QA(str(_need(q, "question", str, qw)), str(q["answer"]),
                   tuple(str(e) for e in ev if str(e) in ids), int(q.get("category", 0)),
                   bool(q.get("synthetic", False))))
    out.append(Conversation(str(s.get("sample_id", f"sample-{i}")),
                            str(_need(c, "speaker_a", str, f"{where}.conversation")),
                            str(_need(c, "speaker_b", str, f"{where}.conversation")),
                            tuple(sessions), tuple(qa)))
  return out


def load_locomo(path: str) -> list[Conversation]:
  try:
    with open(path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ConversationFormatError(f"{path}: not JSON ({e})") from None
  try:
    return parse_locomo(data)
  except ConversationFormatError as e:
    raise ConversationFormatError(f"{path}: {e}") from None


def to_locomo(conv: Conversation) -> dict:
  c = {"speaker_a": conv.speaker_a, "speaker_b": conv.speaker_b}
  for s in conv.sessions:
    c[f"session_{s.index}"] = [
        dict(speaker=t.speaker, dia_id=t.dia_id, text=t.text, **({"synthetic": True}
                                                                  if t.synthetic else {}))
        for t in s.turns]
    c[f"session_{s.index}_date_time"] = s.date_time
  qa = [dict(question=q.question, answer=q.answer, evidence=list(q.evidence),
             category=q.category, **({"synthetic": True} if q.synthetic else {}))
        for q in conv.qa]
  return {"sample_id": conv.sample_id, "conversation": c, "qa": qa}


def dump_locomo(convs: Sequence[Conversation], path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump([to_locomo(c) for c in convs], f, indent=1)
  os.replace(tmp, path)


def render_turn(t: Turn) -> str:
  return f'{t.speaker} said, "{t.text}"'


def render_session(s: Session) -> str:
  """A session as LoCoMo's full-context prompts write it."""
  return "\n".join([f"DATE: {s.date_time}", "CONVERSATION:"] + [render_turn(t) for t in s.turns])


# ---------------------------------------------------------------- chitchat builder

_NAMES = ("Caroline", "Melanie", "Jon", "Gina", "John", "Maria", "Joanna", "Nate", "Tim",
          "Audrey", "Andrew", "Evan", "Sam", "Deborah", "Calvin", "Dave", "James", "Jolene")
# (fact said by the speaker, question about {who}, value pool); {v} is the planted value.
_FACTS = (
    ("By the way, my sister's dog is called {v}.", "What is the name of {who}'s sister's dog?",
     ("Biscuit", "Pepper", "Waffles", "Juniper", "Moose", "Clementine", "Pickles", "Nugget")),
    ("I just moved to {v} last month, still unpacking.", "Which city did {who} move to?",
     ("Tucson", "Halifax", "Lisbon", "Duluth", "Porto", "Boise", "Tallinn", "Savannah")),
    ("My locker code at the gym is {v}, I keep forgetting it.", "What is {who}'s gym locker code?",
     ("4172", "9305", "2864", "7719", "3058", "6241", "8420", "5137")),
    ("I finally bought a {v} bicycle yesterday.", "What color is the bicycle {who} bought?",
     ("teal", "maroon", "mustard yellow", "silver", "olive green", "coral", "navy", "lilac")),
    ("My favourite dish these days is {v}.", "What is {who}'s favourite dish these days?",
     ("shakshuka", "pad see ew", "mushroom risotto", "pierogi", "jollof rice", "bibimbap",
      "chicken tagine", "pho")),
    ("I started learning the {v} a few weeks ago.", "Which instrument did {who} start learning?",
     ("cello", "ukulele", "banjo", "oboe", "harmonica", "accordion", "mandolin", "trombone")),
)


def chitchat_path() -> str:
  """`chitchat_dataset/dataset.json` of the installed package (docs/data.md)."""
  try:
    import chitchat_dataset  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise FileNotFoundError("the chitchat-dataset package is not installed: "
                            "pip install chitchat-dataset==0.9.0 (see docs/data.md)") from e
  return os.path.join(os.path.dirname(chitchat_dataset.__file__), "dataset.json")


def _date(ts: str) -> str:
  d = dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ")
  h = d.hour % 12 or 12
  return f"{h}:{d.minute:02d} {'am' if d.hour < 12 else 'pm'} on {d.day} {d:%B}, {d.year}"


def _dialogues(dataset: dict, min_turns: int, min_words: int,
               max_words: int) -> list[tuple[str, list]]:
  """Two-sender chitchat conversations, each as (first timestamp, [(sender, text)])
  with a sender's consecutive messages joined into one turn."""
  out = []
  for key in sorted(dataset):
    turns = []
    for group in dataset[key]["messages"]:
      text = " ".join(m["text"].strip() for m in group if m["text"].strip())
      if text:
        turns.append((group[0]["sender"], text, group[0]["timestamp"]))
    if len({s for s, _, _ in turns}) != 2 or len(turns) < min_turns:
      continue
    if not min_words <= sum(len(t.split()) for _, t, _ in turns) <= max_words:
      continue
    out.append((turns[0][2], [(s, t) for s, t, _ in turns]))
  return out


def _number(sessions: list[tuple[str, list[tuple[str, str, bool]]]]) -> tuple[Session, ...]:
  return tuple(Session(i + 1, date, tuple(Turn(sp, f"D{i + 1}:{j + 1}", tx, syn)
                                          for j, (sp, tx, syn) in enumerate(turns)))
               for i, (date, turns) in enumerate(sessions))


def _recall_questions(sessions: tuple[Session, ...], n: int, rng) -> list[QA]:
  turns = [t for s in sessions for t in s.turns]
  counts = collections.Counter(normalize_answer(t.text) for t in turns)
  cands = []
  for prev, cur in itertools.pairwise(turns):
    if prev.speaker == cur.speaker or prev.synthetic or cur.synthetic:
      continue
    if not (6 <= len(prev.text.split()) <= 40 and 4 <= len(cur.text.split()) <= 30):
      continue
    if counts[normalize_answer(prev.text)] > 1 or counts[normalize_answer(cur.text)] > 1:
      continue
    if prev.dia_id.split(":")[0] != cur.dia_id.split(":")[0]:
      continue
    cands.append((prev, cur))
  pick = rng.choice(len(cands), size=min(n, len(cands)), replace=False) if cands else []
  return [QA(f'What did {cur.speaker} say right after {prev.speaker} said: "{prev.text}"?',
             cur.text, (cur.dia_id,), 4) for prev, cur in (cands[i] for i in sorted(pick))]


def build_from_chitchat(dataset: dict, *, samples: int, target_tokens: int,
                        count_tokens: Callable[[str], int], recall: int = 20, planted: int = 6,
                        seed: int = 0, min_turns: int = 8, min_words: int = 150,
                        max_words: int = 700) -> list[Conversation]:
  """Multi-session histories of about `target_tokens` (rendered as
  `render_session`) from real chitchat dialogue, each with `recall` real
  utterance-recall questions and `planted` synthetic fact questions."""
  rng = np.random.default_rng(seed)
  pool = _dialogues(dataset, min_turns, min_words, max_words)
  if not pool:
    raise ValueError("no two-speaker chitchat conversation is long enough")
  order = list(rng.permutation(len(pool)))
  out = []
  for k in range(samples):
    a, b = rng.choice(len(_NAMES), size=2, replace=False)
    names = (_NAMES[a], _NAMES[b])
    sessions, tokens = [], 0
    while tokens < target_tokens and order:
      ts, turns = pool[order.pop()]
      first = turns[0][0]
      rel = [(names[0] if s == first else names[1], t, False) for s, t in turns]
      sessions.append((_date(ts), rel))
      tokens += count_tokens(render_session(_number(sessions[-1:])[0]))
    if tokens < target_tokens:
      raise ValueError(f"chitchat ran out of conversations at sample {k} ({tokens} tokens)")
    sessions.sort(key=lambda s: dt.datetime.strptime(s[0], "%I:%M %p on %d %B, %Y"))
    facts = []
    for f in rng.choice(len(_FACTS), size=min(planted, len(_FACTS)), replace=False):
      said, asked, values = _FACTS[f]
      who = names[int(rng.integers(2))]
      value = values[int(rng.integers(len(values)))]
      si = int(rng.integers(len(sessions)))
      ti = int(rng.integers(len(sessions[si][1]) + 1))
      sessions[si][1].insert(ti, (who, said.format(v=value), True))
      facts.append((si, said.format(v=value), asked.format(who=who), value))
    numbered = _number(sessions)
    qa = _recall_questions(numbered, recall, rng)
    for si, said, asked, value in facts:
      ev = next(t.dia_id for t in numbered[si].turns if t.synthetic and t.text == said)
      qa.append(QA(asked, value, (ev,), 4, synthetic=True))
    out.append(Conversation(f"chitchat-{seed}-{k}", names[0], names[1], numbered, tuple(qa)))
  return out


# ---------------------------------------------------------------- LoCoMo's scores

def normalize_answer(s: str) -> str:
  s = str(s).replace(",", "")
  s = re.sub(r"\b(a|an|the|and)\b", " ", s, flags=re.IGNORECASE)
  s = "".join(ch for ch in s if ch not in set(string.punctuation))
  return " ".join(s.lower().split())


def f1(prediction: str, gold: str) -> float:
  """LoCoMo's token F1 (normalised, Porter-stemmed, multiset overlap)."""
  from nltk.stem import PorterStemmer  # pylint: disable=import-outside-toplevel
  ps = PorterStemmer()
  p = [ps.stem(w) for w in normalize_answer(prediction).split()]
  g = [ps.stem(w) for w in normalize_answer(gold).split()]
  same = sum((collections.Counter(p) & collections.Counter(g)).values())
  if not p or not g or same == 0:
    return 0.0
  prec, rec = same / len(p), same / len(g)
  return 2 * prec * rec / (prec + rec)


def contains(prediction: str, gold: str) -> bool:
  """Whether the answer holds the gold answer whole (both normalised as for F1, matched
  at word boundaries): a planted fact's value said, however verbose the reply. A
  secondary score beside F1, which a long correct reply lowers."""
  g = normalize_answer(gold)
  return bool(g) and f" {g} " in f" {normalize_answer(prediction)} "


def bleu1(prediction: str, gold: str) -> float:
  """BLEU-1 as Mem0's evaluation computes it (unigram, smoothing method 1)."""
  from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
  tok = lambda s: re.findall(r"\w+|[^\w\s]", str(s).lower())
  p, g = tok(prediction), tok(gold)
  if not p or not g:
    return 0.0
  return float(sentence_bleu([g], p, weights=(1, 0, 0, 0),
                             smoothing_function=SmoothingFunction().method1))
