"""bench/pruner_head_recall.py without a model: recall@k micro-averaged over rows,
the chance line, and session-bootstrap intervals and paired differences."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import pruner_head_recall as bench
from jaxkv.training import loss


def _rec(session, window, positives, rule, head):
  labels = np.r_[np.ones(positives), np.zeros(window - positives)]
  return {"session": session, "turn": 0, "window": window, "positives": positives,
          "rule@4": rule, "head@4": head, "random@4": loss.random_kept_at(labels, 4)}


def test_recall_is_micro_averaged_with_the_chance_line():
  recs = [_rec("a", 8, 4, 1, 3), _rec("a", 16, 2, 0, 2), _rec("b", 3, 2, 2, 2),
          _rec("c", 10, 2, 1, 1)]
  by_scope = {r["scope"]: r for r in bench.summarize("m", recs, [4])}
  every, over = by_scope["all"], by_scope["over k"]
  assert (every["rows"], every["sessions"], every["positives"]) == (4, 3, 10)
  assert np.isclose(every["rule"][0], 4 / 10) and np.isclose(every["head"][0], 8 / 10)
  # random keeps k / window of each window's positives; a window <= k keeps them all
  assert np.isclose(every["random"][0], (4 * 4 / 8 + 2 * 4 / 16 + 2 + 2 * 4 / 10) / 10)
  assert np.isclose(every["head_minus_rule"][0], 0.4)
  lo, hi = every["head_minus_rule"][1:]
  assert lo <= 0.4 <= hi
  # over k: the 3-token window (no choice made) is left out
  assert (over["rows"], over["positives"]) == (3, 8)
  assert np.isclose(over["head"][0], 6 / 8)
  (table,) = bench.tables(bench.summarize("m", recs, [4]))
  assert [line[2] for line in table.lines] == ["all", "over k"]
  assert table.lines[0][7].startswith("0.800 [")
