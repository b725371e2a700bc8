"""Prompt pairs for SemShareKV (seed 001): a reference prompt whose KV is reused
for a semantically similar target prompt.

File format (JSONL, one pair per line; anyone can feed their own):
  {"id": str, "reference": str, "target": str, "instruction": str,
   "answer": str (optional: its NLL is scored), "meta": {...} (optional)}
`load_pairs` names every malformed line (line number and what is wrong) and
refuses the file, or skips those lines with strict=False.

Builders from real text (section 5.4 / B.2 of the paper):
- `eliminate` / `replace`: a fraction of the sentences of the reference
  removed, or replaced by sentences from elsewhere in the corpus (10%..90%);
  the original is the target, the modified text the reference (the paper
  reuses "the cache from the modified reference prompt for the target").
- `paraphrase`: one contiguous run of sentences rewritten by a model (greedy),
  kept only when its token count is within 10% of the original (B.1).
Each builder takes a source: a list of paragraphs (a novel) or of documents (the
Python docs: a multi-document prompt, like MultiNews), cut into an excerpt of
about the requested number of tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence

import numpy as np

_SENT = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
SUMMARY = "Summarize the text above in a few sentences."
PAIR_FIELDS = ("id", "reference", "target", "instruction")


@dataclasses.dataclass(frozen=True)
class Pair:
  id: str
  reference: str
  target: str
  instruction: str
  answer: str | None = None
  meta: dict = dataclasses.field(default_factory=dict)


class PairFormatError(ValueError):
  """A pairs file with malformed lines (all of them named in the message)."""


def load_pairs(path: str, strict: bool = True) -> list[Pair]:
  """Pairs from a JSONL file. strict: any malformed line raises PairFormatError
  naming every bad line; otherwise bad lines are skipped (and listed in the
  error only if nothing is left)."""
  pairs, bad = [], []
  with open(path) as f:
    for no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        bad.append(f"line {no}: not JSON ({e.msg})")
        continue
      if not isinstance(obj, dict):
        bad.append(f"line {no}: not a JSON object")
        continue
      missing = [k for k in PAIR_FIELDS if not isinstance(obj.get(k), str) or not obj[k]]
      extra = sorted(set(obj) - set(PAIR_FIELDS) - {"answer", "meta"})
      if missing or extra:
        bad.append(f"line {no}: " + "; ".join(
            ([f"missing or empty string fields {missing}"] if missing else [])
            + ([f"unknown fields {extra}"] if extra else [])))
        continue
      if obj.get("answer") is not None and not isinstance(obj["answer"], str):
        bad.append(f"line {no}: answer must be a string")
        continue
      pairs.append(Pair(obj["id"], obj["reference"], obj["target"], obj["instruction"],
                        obj.get("answer"), dict(obj.get("meta") or {})))
  if bad and (strict or not pairs):
    raise PairFormatError(f"{path}: {len(bad)} malformed line(s): " + "; ".join(bad[:10])
                          + (" ..." if len(bad) > 10 else ""))
  return pairs


def dump_pairs(pairs: Sequence[Pair], path: str) -> None:
  with open(path, "w") as f:
    for p in pairs:
      obj = {k: getattr(p, k) for k in PAIR_FIELDS}
      if p.answer is not None:
        obj["answer"] = p.answer
      if p.meta:
        obj["meta"] = p.meta
      f.write(json.dumps(obj, ensure_ascii=False) + "\n")


def sentences(text: str) -> list[str]:
  """Sentences of a paragraph (split after . ! ? before a capital or digit)."""
  return [s.strip() for s in _SENT.split(text) if s.strip()]


def excerpt(blocks: Sequence[str], count: Callable[[str], int], n_tokens: int,
            rng: np.random.Generator) -> list[list[str]]:
  """A contiguous run of blocks (paragraphs / documents) from a random start,
  as lists of sentences, of about n_tokens (the last block is cut at a
  sentence boundary)."""
  start = int(rng.integers(0, max(1, len(blocks) - 1)))
  out, total = [], 0
  for b in list(blocks[start:]) + list(blocks[:start]):
    sents = []
    for s in sentences(b):
      n = count(s + " ")
      if total + n > n_tokens and (out or sents):
        break
      sents.append(s)
      total += n
    if sents:
      out.append(sents)
    if total >= 0.97 * n_tokens or len(sents) < len(sentences(b)):
      break
  return out


def join(paras: Sequence[Sequence[str]]) -> str:
  return "\n\n".join(" ".join(p) for p in paras if p)


def _positions(paras) -> list[tuple[int, int]]:
  return [(i, j) for i, p in enumerate(paras) for j in range(len(p))]


def eliminate(paras, frac: float, rng: np.random.Generator) -> list[list[str]]:
  """paras with round(frac x sentences) random sentences removed."""
  pos = _positions(paras)
  drop = {pos[i] for i in rng.choice(len(pos), int(round(frac * len(pos))), replace=False)}
  return [[s for j, s in enumerate(p) if (i, j) not in drop] for i, p in enumerate(paras)]


def replace(paras, frac: float, pool: Sequence[str], rng: np.random.Generator
            ) -> list[list[str]]:
  """paras with round(frac x sentences) random sentences replaced by sentences of
  `pool` (elsewhere in the corpus)."""
  pos = _positions(paras)
  swap = {pos[i] for i in rng.choice(len(pos), int(round(frac * len(pos))), replace=False)}
  return [[pool[int(rng.integers(len(pool)))] if (i, j) in swap else s
           for j, s in enumerate(p)] for i, p in enumerate(paras)]


def paraphrase(paras, frac: float, rewrite: Callable[[str], str], count: Callable[[str], int],
               rng: np.random.Generator, tolerance: float = 0.1) -> list[list[str]] | None:
  """paras with one contiguous run of about frac of the sentences rewritten by
  `rewrite` (a model), or None when the rewrite's token count is off by more
  than `tolerance` (B.1: within 10%)."""
  flat = [s for p in paras for s in p]
  k = max(1, int(round(frac * len(flat))))
  lo = int(rng.integers(0, len(flat) - k + 1))
  original = " ".join(flat[lo:lo + k])
  new = rewrite(original).strip()
  if not new or abs(count(new) - count(original)) > tolerance * count(original):
    return None
  out, at = [], 0
  for p in paras:
    q = []
    for s in p:
      if at == lo:
        q.append(new)
      elif not lo < at < lo + k:
        q.append(s)
      at += 1
    out.append(q)
  return out
