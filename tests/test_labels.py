"""Future-evidence labels: argument leaves, the five-call lookahead, token overlap."""

import numpy as np

from jaxkv.data import labels


def test_argument_strings_are_scalar_leaves():
  args = {"user_id": "mia_li_3668", "n": 12345, "flag": True, "short": "ab",
          "nested": {"ids": ["NO6JO3", "NO6JO3", {"x": 2.5}]}, "none": None}
  assert labels.argument_strings(args) == ["mia_li_3668", "12345", "NO6JO3", "2.5"]
  assert labels.argument_strings('{"a": "xyz"}') == ["xyz"]
  assert labels.argument_strings("not json") == ["not json"]


def test_future_tool_arguments_reads_five_calls_of_both_forms():
  def call(i):
    return {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"k": f"id{i:03d}"}}}]}
  react = {"role": "assistant",
           "content": 'Thought: x\nAction: g\nAction Input: {"k": "react_id"}'}
  msgs = [{"role": "user", "content": "hi"}, call(0), react] + [call(i) for i in range(1, 6)]
  assert labels.future_tool_arguments(msgs, 1) == ["id000", "react_id", "id001", "id002",
                                                   "id003"]
  assert labels.future_tool_arguments(msgs, 3, lookahead=2) == ["id001", "id002"]


def test_evidence_mask_marks_overlapping_tokens_before_the_cut():
  text = "res NO6JO3 and NO6JO3 later NO6JO3"
  offsets = [(0, 3), (3, 6), (6, 10), (10, 14), (14, 18), (18, 21), (21, 27), (27, 34)]
  got = labels.evidence_mask(text, offsets, ["NO6JO3"], end_char=27)
  np.testing.assert_array_equal(got, [False, True, True, False, True, True, False, False])
  assert labels.evidence_mask(text, [], ["x"]).shape == (0,)
