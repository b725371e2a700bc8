"""SemShareKV prompt pairs (jaxkv.data.semshare_pairs): the JSONL format with its
errors, and the elimination / replacement / paraphrase builders of B.1 / B.2."""

import json

import numpy as np
import pytest

from jaxkv.data import semshare_pairs as SP

TEXT = [" ".join(f"Sentence {p}.{i} says something about topic {p * 10 + i}." for i in range(6))
        for p in range(5)]


def test_pairs_round_trip_and_malformed_lines_are_named(tmp_path):
  pairs = [SP.Pair("a", "ref text", "target text", "Summarize.", meta={"kind": "x"}),
           SP.Pair("b", "r", "t", "Q?", answer="A.")]
  path = tmp_path / "p.jsonl"
  SP.dump_pairs(pairs, path)
  assert SP.load_pairs(path) == pairs
  with open(path, "a") as f:
    f.write("not json\n")
    f.write(json.dumps({"id": "c", "reference": "r", "target": ""}) + "\n")
    f.write(json.dumps({"id": "d", "reference": "r", "target": "t", "instruction": "i",
                        "extra": 1}) + "\n")
  with pytest.raises(SP.PairFormatError) as e:
    SP.load_pairs(path)
  msg = str(e.value)
  assert "3 malformed" in msg and "line 3: not JSON" in msg
  assert "line 4: missing or empty string fields ['target', 'instruction']" in msg
  assert "line 5: unknown fields ['extra']" in msg
  assert [p.id for p in SP.load_pairs(path, strict=False)] == ["a", "b"]


def test_sentences_split_after_terminal_punctuation():
  assert SP.sentences('He said "Go!" Then he left. 3 men came? Yes.') == [
      'He said "Go!"', "Then he left.", "3 men came?", "Yes."]


def test_elimination_and_replacement_change_the_fraction_of_sentences():
  rng = np.random.default_rng()
  paras = [SP.sentences(p) for p in TEXT]
  n = sum(map(len, paras))
  gone = SP.eliminate(paras, 0.3, rng)
  assert sum(map(len, gone)) == n - round(0.3 * n)
  kept = [s for p in gone for s in p]
  assert kept == [s for p in paras for s in p if s in set(kept)]        # order kept
  pool = [f"Replacement {i}." for i in range(50)]
  new = SP.replace(paras, 0.5, pool, rng)
  flat_old, flat_new = [s for p in paras for s in p], [s for p in new for s in p]
  assert len(flat_new) == n and sum(a != b for a, b in zip(flat_old, flat_new)) == round(0.5 * n)
  assert all(b in pool for a, b in zip(flat_old, flat_new) if a != b)


def test_excerpt_stops_near_the_token_budget():
  rng = np.random.default_rng(0)
  count = lambda s: len(s.split())
  ex = SP.excerpt(TEXT * 4, count, 60, rng)
  total = sum(count(s + " ") for p in ex for s in p)
  assert 50 <= total <= 60


def test_paraphrase_keeps_only_rewrites_of_similar_length():
  rng = np.random.default_rng(1)
  paras = [SP.sentences(p) for p in TEXT]
  count = lambda s: len(s.split())
  same = SP.paraphrase(paras, 0.2, lambda s: s.upper(), count, rng)
  flat = [s for p in same for s in p]
  n = sum(map(len, paras))
  assert len(flat) == n - round(0.2 * n) + 1                 # the run became one rewrite
  assert sum(s.isupper() for s in flat) == 1
  assert SP.paraphrase(paras, 0.2, lambda s: s + " and much more" * 5, count, rng) is None
