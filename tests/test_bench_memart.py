"""bench/memart.py's record plumbing (no model): reusing an earlier run's records,
F1 vs full paired by question, the paired recall table with several R, --rerank,
the one evidence rule (on SmolLM2's tokenizer), conversation-level intervals and
the pairing with plaintext."""

import pathlib
import sys

import numpy as np
import pytest
from absl import app, flags

from flag_util import script_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import memart as bench
import memart_layout
import memart_tables
from jaxkv.data import conversations as C
from jaxkv.models import presets
from jaxkv.tokens import Tokenizer

FLAGS = flags.FLAGS


@pytest.fixture
def parsed():
  """The script's flags, parsed, for this test only (other bench tests define theirs)."""
  with script_flags(bench.define_flags,
                    ["memart", "--block_sizes=8", "--top_k=64", "--rerank=16,4"]) as f:
    yield f


def rec(method, q, f1, conv="c0", answer=None):
  return dict(conv=conv, q=q, method=method, f1=f1, answer=answer or f"a{q}", synthetic=False,
              recall=1.0, bleu1=f1, nll=1.0, prefill_tokens=10, probe_tokens=0,
              decode_kv_len=10, latency_s=0.1, ttft_s=0.05, memory_bytes=1)


def test_merge_takes_this_conversations_questions_and_refuses_other_data(parsed):
  earlier = [rec("full", 0, 0.5), rec("full", 1, 0.2), rec("full", 0, 0.4, conv="c1"),
             rec("memart_rerank", 0, 0.1)]
  FLAGS.reuse_records = None
  assert bench._reused(["memart_rerank"]) == []
  mine = [rec("memart_rerank", 0, 0.3)]                  # this run: q0 of c0 only
  got = bench._merge([r for r in earlier if r["method"] != "memart_rerank"], mine, "c0")
  assert [(r["conv"], r["q"], r["method"]) for r in got] == [("c0", 0, "full")]
  with pytest.raises(app.UsageError, match="not the same questions"):
    bench._merge(earlier[:1], [rec("memart_rerank", 0, 0.3, answer="other")], "c0")


def test_f1_vs_full_pairs_questions(parsed):
  recs = [rec("full", q, f) for q, f in enumerate([0.5, 0.4, 0.2, 0.6])]
  recs += [rec("memart_rerank", q, f) for q, f in enumerate([0.25, 0.2, 0.1, 0.3])]
  recs += [rec("recent", 0, 0.5), rec("recent", 0, 0.1, conv="c1")]   # one paired: no CI
  rows = {r["method"]: r for r in bench._rows(recs, []) if r["kind"] == "method"}
  assert rows["memart_rerank"]["f1_vs_full"] == pytest.approx(0.5)
  assert rows["memart_rerank"]["f1_vs_full_ci"] == pytest.approx([0.5, 0.5])   # x = y / 2
  assert rows["memart_rerank"]["strategy"] == "rerank16x softmax-max"     # the first R
  assert rows["recent"]["n_vs_full"] == 1 and np.isnan(rows["recent"]["f1_vs_full_ci"][0])
  cell = memart_tables._ratio_cell(rows["recent"], rows["full"])
  assert cell == "100% (n 1)"


def test_paired_table_has_every_rerank():
  abl = []
  for strat, hit in (("rerank4x softmax-max", [True, False]), ("rerank16x softmax-max",
                     [True, True]), ("plaintext", [False, True])):
    abl.append(dict(conv="c0", q=0, block_size=8, box_keys="raw", strategy=strat, top_k=64,
                    tokens=512, hits=sum(hit), hit=hit, n=2))
  out = {(r["first"], r["second"]): r for r in memart_tables.paired(abl, 8)}
  assert set(out) == {("rerank4x softmax-max", "plaintext"),
                      ("rerank16x softmax-max", "plaintext")}
  assert (out[("rerank4x softmax-max", "plaintext")]["first_only"],
          out[("rerank4x softmax-max", "plaintext")]["second_only"]) == (1, 1)
  assert out[("rerank16x softmax-max", "plaintext")]["first_only"] == 1


def test_rerank_flag_is_checked(parsed):
  assert bench._reranks() == [16, 4]
  FLAGS.rerank = ["0"]
  assert bench._reranks() == []
  FLAGS.rerank = ["x"]
  with pytest.raises(app.UsageError, match="integers"):
    bench._reranks()
  FLAGS.rerank = ["-2"]
  with pytest.raises(app.UsageError, match=">= 0"):
    bench._reranks()


def test_engine_runs_refuse_warm(parsed):
  """--via=engine records no timings, so --warm (untimed first runs) is a usage error,
  raised before any data or weights load."""
  FLAGS.conversations, FLAGS.via, FLAGS.warm = "no_such_file.json", "engine", True
  with pytest.raises(app.UsageError, match="--warm"):
    bench.main([])


def _conversation():
  turns = (C.Turn("Jon", "D1:1", "Hey, how was the hike on Sunday? I heard it rained."),
           C.Turn("Gina", "D1:2", "My locker code at the gym is 4172, I keep forgetting it.",
                  True),
           C.Turn("Jon", "D1:3", "Ha, write it down somewhere safe then."))
  qa = (C.QA("What is Gina's gym locker code?", "4172", ("D1:2",), 4, True),
        C.QA("What did Jon say right after Gina said the code?",
             "Ha, write it down somewhere safe then.", ("D1:3",), 4),
        C.QA("Where is it?", "nowhere", ("D9:9",), 4))
  return C.Conversation("c0", "Jon", "Gina", (C.Session(1, "1:00 pm on 2 May, 2023", turns),),
                        qa)


def test_one_evidence_rule_needs_the_answer_tokens_for_every_method():
  tok = Tokenizer.load(presets.smollm2_gguf())
  conv = _conversation()
  lay = memart_layout.layout(tok, conv, "head")
  ids, spans = lay.sessions[0]
  fact, recall, missing = (memart_layout.answer_spans(tok, lay, conv, qa)[0] for qa in conv.qa)
  si, lo, hi = fact
  assert si == 0 and spans["D1:2"][0] < lo < hi < spans["D1:2"][1]
  assert tok.decode(ids[lo:hi].tolist()).strip() == "4172"       # the value's tokens only
  t_lo, t_hi = spans["D1:3"]
  assert recall[0] == 0 and t_lo < recall[1] < recall[2] <= t_hi   # the quoted turn text
  assert "write it down" in tok.decode(ids[recall[1]:recall[2]].tolist())
  assert missing == (-1, 0, 1) and not memart_layout.credited({0: [(0, ids.size)]}, missing)
  # a block straddling the value's first token is no longer credited (the old overlap
  # rule credited it); blocks covering all of it are, whatever else they hold
  assert not memart_layout.credited({0: [(lo - 8, lo + 1)]}, fact)
  assert memart_layout.credited({0: [(lo - 8, lo + 1), (lo + 1, hi + 8)]}, fact)
  assert memart_layout.credited({0: [(lo - 3, hi)]}, fact)
  assert not memart_layout.credited({1: [(lo, hi)]}, fact)
  # plaintext's whole turns go through the same rule
  turn_rows = [(0, t) for t in conv.sessions[0].turns]
  assert memart_layout.credited(memart_layout.turn_tokens([1], turn_rows, [spans]), fact)
  assert not memart_layout.credited(memart_layout.turn_tokens([0, 2], turn_rows, [spans]), fact)


def test_rows_resample_conversations_and_pair_with_plaintext(parsed):
  recs = []
  for c in range(6):
    for q in range(5):
      full = rec("full", q, 0.6, conv=f"c{c}")
      plain = dict(rec("plaintext", q, 0.3 + 0.1 * (c % 2), conv=f"c{c}"), hit=[q < 2],
                   recall=float(q < 2))
      mem = dict(rec("memart", q, 0.3, conv=f"c{c}"), hit=[q < 4], recall=float(q < 4))
      recs += [full, plain, mem]
  rows = {r["method"]: r for r in bench._rows(recs, []) if r["kind"] == "method"}
  m = rows["memart"]
  assert m["n_conversations"] == 6 and m["recall_ci_unit"] == "conversations"
  assert m["only_vs_plaintext"] == [12, 0] and m["p_vs_plaintext"] < 0.001
  assert m["recall_vs_plaintext"] == pytest.approx(0.4)
  assert m["recall_vs_plaintext_ci"] == pytest.approx([0.4, 0.4])   # same in every conversation
  assert m["recall_ci"] == pytest.approx([0.8, 0.8])
  assert "p_vs_plaintext" not in rows["plaintext"]
  # plaintext's F1 varies between conversations only: its ratio's interval is wide
  lo, hi = rows["plaintext"]["f1_vs_full_ci"]
  assert lo < rows["plaintext"]["f1_vs_full"] < hi and hi - lo > 0.1
  assert "(0 / 0" not in memart_tables._plain_cell(m) and "p " in memart_tables._plain_cell(m)


def test_planted_value_said_pairs_with_full(parsed):
  recs = []
  for c in range(4):
    for q in range(3):
      said = lambda ok: "It is 4172, I think." if ok else "I do not know."
      base = dict(synthetic=True, answer="4172")
      recs += [dict(rec("full", q, 0.5, conv=f"c{c}"), **base, pred=said(True)),
               dict(rec("memart", q, 0.5, conv=f"c{c}"), **base, pred=said(q == 0))]
  recs.append(dict(rec("memart", 9, 0.1, conv="c0"), pred="4172"))   # not planted: not counted
  rows = {r["method"]: r for r in bench._rows(recs, []) if r["kind"] == "method"}
  assert rows["full"]["contains_planted"] == 1.0 and rows["full"]["n_planted"] == 12
  m = rows["memart"]
  assert m["contains_planted"] == pytest.approx(1 / 3) and m["n_planted"] == 12
  assert m["contains_vs_full"] == [0, 8] and m["p_contains_vs_full"] == pytest.approx(2 / 256)
  assert memart_tables._contains_cell(m).startswith("0.33 [0.33, 0.33] (0 / 8, p 0.00781")


def test_table_gains_the_protocol_columns_only_where_rows_have_them(parsed):
  old = [dict(r, kind="method") for r in ({"method": "full", "f1": 0.1},)]
  for r in old:
    r.update(strategy="-", n_questions=3, bleu1=0.1, f1_recall=0.1, f1_planted=0.1,
             answer_nll=1.0, evidence_recall=1.0, recall_ci=[0.5, 1.0], prefill_tokens=9,
             probe_tokens=0, decode_kv_len=9, ttft_s=0.1, latency_s=0.1, memory_bytes=1)
  t2 = memart_tables.tables(old)[0]
  assert t2.header[2] == "questions" and len(t2.header) == 10 and t2.lines[0][2] == "3"
  recs = [dict(rec(m, q, 0.5, conv=f"c{c}"), hit=[True], synthetic=True, pred="4172",
               answer="4172") for m in ("full", "memart", "plaintext") for c in range(2)
          for q in range(2)]
  t2 = memart_tables.tables(bench._rows(recs, []))[0]
  assert t2.header[2] == "questions (conv.)" and len(t2.header) == 12
  assert {len(line) for line in t2.lines} == {12} and t2.lines[0][2] == "4 (2)"
