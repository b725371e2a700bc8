"""bench/semshare_gate.py without a model: the unrelated reference it pairs a target
with (same source and length, a summary pair, no shared 8-token run) and its table's
admission counts."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import semshare_gate as bench


def _item(i, source, length, ids, qa=False):
  return dict(id=str(i), meta=dict(source=source, length=length), qa=qa,
              runs=bench._runs(np.asarray(ids, np.int64)))


def test_unrelated_skips_overlaps_other_sources_and_questions():
  rng = np.random.default_rng(0)
  base = rng.integers(0, 50_000, 200)
  items = [
      _item(0, "docs", 2000, base),
      _item(1, "docs", 2000, np.r_[rng.integers(0, 50_000, 50), base[40:48]]),  # shares 8
      _item(2, "austen", 2000, rng.integers(0, 50_000, 200)),                 # other source
      _item(3, "docs", 1000, rng.integers(0, 50_000, 200)),                   # other length
      _item(4, "docs", 2000, rng.integers(0, 50_000, 200), qa=True),          # a question
      _item(5, "docs", 2000, np.r_[base[40:47], rng.integers(0, 50_000, 90)]),  # shares 7
  ]
  assert bench._unrelated(0, items)["id"] == "5"
  # cyclic: after the last item the search goes on from the first
  assert bench._unrelated(5, items)["id"] == "0"
  # nothing left that qualifies
  assert bench._unrelated(2, items) is None
  assert bench._unrelated(1, items[:2]) is None


def test_table_counts_what_the_gate_admits():
  row = lambda kind, frac, sim, length=500: dict(
      source="docs", length=length, kind=kind, frac=frac, similarity=sim,
      distance=(1 - sim) * 170, threshold=0.8, max_dist=170.0)
  rows = [row("eliminate", 0.4, 0.81), row("eliminate", 0.4, 0.79),
          row("eliminate", 0.2, 0.9), row("unrelated", 1.0, 0.55),
          row("unrelated", 1.0, 0.8), row("replace", 0.3, 0.85, 2000)]
  (table,) = bench.tables(rows)
  assert "3 of 4 edited pairs admitted" in table.title
  assert "1 of 2 unrelated" in table.title
  cells = {line[:4]: line[4:6] for line in table.lines}
  assert cells["500", "docs", "eliminate", "0.4"] == ("2", "1")
  assert cells["500", "docs", "unrelated", "-"] == ("2", "1")
  assert cells["2000", "docs", "replace", "0.3"] == ("1", "1")
  # unrelated texts sort after the edits of their (length, source)
  assert [line[2] for line in table.lines] == ["eliminate", "eliminate", "unrelated",
                                               "replace"]
