"""bench/memart.py's record plumbing (no model): reusing an earlier run's records,
F1 vs full paired by question, the paired recall table with several R, --rerank."""

import pathlib
import sys

import numpy as np
import pytest
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import memart as bench
import memart_tables

FLAGS = flags.FLAGS


@pytest.fixture
def parsed():
  """The script's flags, parsed, for this test only (other bench tests define theirs)."""
  before = set(FLAGS)
  bench.define_flags()
  added = set(FLAGS) - before
  try:
    FLAGS(["memart", "--block_sizes=8", "--top_k=64", "--rerank=16,4"])
    yield
  finally:
    for name in added:
      delattr(FLAGS, name)


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
