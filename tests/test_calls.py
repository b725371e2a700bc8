"""Generated tool calls: parsing both templates' forms, JSON-normalised matching, Wilson."""

import math

import numpy as np
import pytest

from jaxkv.data import calls
from jaxkv.data.traces import ToolCall

GOLD = (ToolCall("get_reservation_details", {"reservation_id": "NO6JO3", "n": 2}),)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_reservation_details", "arguments": {"n": 2.0, '
    '"reservation_id": "NO6JO3"}}\n</tool_call><|im_end|>',
    'Thought: look it up.\nAction: get_reservation_details\n'
    'Action Input: {"n": 2,   "reservation_id": "NO6JO3"}',
    '<tool_call>{"name": "get_reservation_details", "arguments": '
    '"{\\"reservation_id\\": \\"NO6JO3\\", \\"n\\": 2}"}',          # unterminated, string args
    '```json\n{"name": "get_reservation_details", "arguments": {"reservation_id": "NO6JO3", '
    '"n": 2}}\n```',                                                  # bare JSON in a fence
    'Next I will call it {sic}.\n{"name": "get_reservation_details", "arguments": '
    '{"n": 2, "reservation_id": "NO6JO3"}}',                            # bare JSON after text
    '<tool_call>\n{"name": "get_reservation_details", "arguments": {"reservation_id": '
    '"NO6JO3", "n": 2}}\n{"name": "get_reservation_details", "arguments": {',  # runs on
])
def test_both_forms_parse_and_match_regardless_of_order_and_spacing(text):
  assert calls.match(calls.parse_calls(text), GOLD) == (True, True)


def test_name_only_and_misses():
  wrong_arg = ('<tool_call>{"name": "get_reservation_details", '
               '"arguments": {"reservation_id": "NO6JO4", "n": 2}}</tool_call>')
  assert calls.match(calls.parse_calls(wrong_arg), GOLD) == (False, True)
  assert calls.match(calls.parse_calls("Action: cancel\nAction Input: {}"), GOLD) == (False, False)
  for junk in ("I cannot help with that.", "<tool_call>{not json</tool_call>",
               "Action Input: {\"a\": 1}", '{"name": "x", "note": 1}',
               '{"name": "get_reservation_details", "arguments": {"reservation_id": "NO'):
    assert calls.parse_calls(junk) == ()
    assert calls.match(calls.parse_calls(junk), GOLD) == (False, False)
  raw = (ToolCall("t", {"_raw": "abc"}),)
  assert calls.match(calls.parse_calls("Action: t\nAction Input:  abc \n"), raw) == (True, True)
  with pytest.raises(ValueError, match="no tool call"):
    calls.match(GOLD, ())


def test_argument_hits_count_values_under_the_same_key():
  two = '{"name": "update", "arguments": {"reservation_id": "NO6JO3", "n": 3}}'
  assert calls.argument_hits(calls.parse_calls(two), GOLD) == (1, 2)    # wrong tool, one ID
  assert calls.argument_hits(calls.parse_calls("no call"), GOLD) == (0, 2)
  assert calls.argument_hits(GOLD, GOLD) == (2, 2)
  raw = (ToolCall("t", {"_raw": "abc"}),)
  assert calls.argument_hits(raw, raw) == (1, 1) and calls.argument_hits(GOLD, raw) == (0, 1)
  assert calls.argument_hits(GOLD, (ToolCall("t", {}),)) == (0, 0)


def test_argument_mentions_read_values_after_their_key_in_raw_text():
  cut = ' {"n": 2.0, "x": [1, 2], "reservation_id":"NO6JO3", "flights": [{"flight_nu'
  assert calls.argument_mentions(cut, GOLD) == (2, 2)       # parse_calls finds no call here
  assert calls.parse_calls(cut) == ()
  assert calls.argument_mentions('{"reservation_id": "NO6JO", "n": 3}', GOLD) == (0, 2)
  assert calls.argument_mentions('"reservation_id": "NO6JO3" and "reservation_id": 1', GOLD) \
      == (1, 2)
  nested = (ToolCall("t", {"p": {"a": 1, "b": [2]}}),)
  assert calls.argument_mentions('{"p": {"b": [2], "a": 1.0}}', nested) == (1, 1)
  assert calls.argument_mentions('{"p": {"b": [2], "a": 1', nested) == (0, 1)   # cut inside
  raw = (ToolCall("t", {"_raw": "abc"}),)
  assert calls.argument_mentions("xx abc", raw) == (1, 1)
  assert calls.argument_mentions("", raw) == (0, 1)
  with pytest.raises(ValueError, match="no tool call"):
    calls.argument_mentions("x", ())


def test_completed_call_takes_the_first_json_value_after_a_forced_head():
  # a Hermes turn forced up to `"arguments": ` stops once the object is whole: the
  # outer object is still open, so parsing head + text would find no call
  head = '<tool_call>\n{"name": "get_reservation_details", "arguments": '
  text = '{"n": 2, "reservation_id": "NO6JO3"}}\n</tool_call>'
  assert calls.parse_calls(head + '{"n": 2, "reservation_id": "NO6JO3"}') == ()
  assert calls.match(calls.completed_call(GOLD[0].name, text), GOLD) == (True, True)
  assert calls.match(calls.completed_call(GOLD[0].name, ' {"n": 3}'), GOLD) == (False, True)
  assert calls.completed_call("t", ' "abc" trailing') == (ToolCall("t", {"_raw": "abc"}),)
  for junk in ("", '{"n": 2, "reserv', "I will look it up."):
    assert calls.completed_call("t", junk) == ()


def test_mcnemar_exact():
  # 8 vs 2 discordant pairs: 2 * P(X <= 2), X ~ Bin(10, 1/2) = 2 * 56 / 1024
  assert abs(calls.mcnemar(8, 2) - 112 / 1024) < 1e-12
  assert calls.mcnemar(2, 8) == calls.mcnemar(8, 2)
  assert calls.mcnemar(0, 0) == 1.0 and calls.mcnemar(3, 3) == 1.0
  assert abs(calls.mcnemar(12, 0) - 2 / 4096) < 1e-12
  with pytest.raises(ValueError):
    calls.mcnemar(-1, 2)


def test_ratio_ci_bootstrap():
  rng = np.random.default_rng(3)
  y = rng.uniform(0.2, 1.0, 400)
  point, lo, hi = calls.ratio_ci(0.8 * y, y)              # x = 0.8 y exactly: every resample
  assert point == pytest.approx(0.8) and lo == pytest.approx(0.8) and hi == pytest.approx(0.8)
  x = y + rng.normal(0, 0.3, y.size)                      # noisy: the interval holds the point
  point, lo, hi = calls.ratio_ci(x, y)
  assert lo < point < hi and hi - lo < 0.2
  assert calls.ratio_ci(x, y, seed=1) != calls.ratio_ci(x, y, seed=2)
  assert calls.ratio_ci(x, y) == calls.ratio_ci(x, y)     # fixed seed: reproducible
  p1, lo1, hi1 = calls.ratio_ci([1.0], [2.0])
  assert p1 == 0.5 and math.isnan(lo1) and math.isnan(hi1)
  assert math.isnan(calls.ratio_ci([1.0, 0.0], [0.0, 0.0])[0])
  with pytest.raises(ValueError):
    calls.ratio_ci([1.0, 2.0], [1.0])


def test_wilson_interval():
  lo, hi = calls.wilson(8, 10)
  assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
  assert calls.wilson(0, 20)[0] == 0.0 and 0.15 < calls.wilson(0, 20)[1] < 0.17
  assert calls.wilson(20, 20)[1] == 1.0
  assert all(math.isnan(x) for x in calls.wilson(0, 0))
  with pytest.raises(ValueError):
    calls.wilson(3, 2)


def test_mean_ci_bootstrap():
  rng = np.random.default_rng()
  x = rng.normal(0.5, 0.1, 200)
  point, lo, hi = calls.mean_ci(x)
  assert point == pytest.approx(x.mean()) and lo < point < hi
  assert hi - lo == pytest.approx(2 * 1.96 * x.std() / np.sqrt(200), rel=0.25)
  y = x - 0.2                                               # paired: every difference is 0.2
  assert calls.mean_ci(x, y) == pytest.approx((0.2, 0.2, 0.2))
  assert calls.mean_ci(x, seed=1) == calls.mean_ci(x, seed=1)
  assert math.isnan(calls.mean_ci([1.0])[1])
  with pytest.raises(ValueError, match="paired"):
    calls.mean_ci([1.0, 2.0], [1.0])


def test_cluster_bootstrap_resamples_whole_groups():
  rng = np.random.default_rng()
  per_group = rng.normal(0.5, 0.2, 10)
  x = np.repeat(per_group, 20)                              # 10 groups of 20 equal items
  groups = np.repeat([f"conv{g}" for g in range(10)], 20)
  _, lo_i, hi_i = calls.mean_ci(x)
  point, lo, hi = calls.mean_ci(x, groups=groups)
  assert point == pytest.approx(x.mean()) and lo < point < hi
  # the groups are the unit: the interval is that of 10 means, not of 200 items
  assert hi - lo > 3 * (hi_i - lo_i)
  assert hi - lo == pytest.approx(2 * 1.96 * per_group.std() / np.sqrt(10), rel=0.4)
  y = rng.uniform(0.5, 1.0, 200)
  assert calls.ratio_ci(x, y, groups=np.arange(200)) == calls.ratio_ci(x, y)  # singletons
  assert calls.mean_ci(x, groups=np.arange(200)) == calls.mean_ci(x)
  _, rlo, rhi = calls.ratio_ci(x, y, groups=groups)
  _, rlo_i, rhi_i = calls.ratio_ci(x, y)
  assert rhi - rlo > 2 * (rhi_i - rlo_i)
  assert math.isnan(calls.mean_ci(x, groups=["one"] * 200)[1])   # one group: no interval
  with pytest.raises(ValueError, match="group label per item"):
    calls.mean_ci(x, groups=groups[:10])


def test_agreement_counts_the_reference_tokens_up_to_its_stop():
  assert calls.agreement([5, 6, 7], [5, 6, 7]) == (1.0, 3)
  assert calls.agreement([5, 9, 7, 8], [5, 6, 7]) == (pytest.approx(2 / 3), 1)
  assert calls.agreement([5, 6], [5, 6, 7, 8]) == (0.5, 2)          # stopped early
  assert calls.agreement([5, 6, 7, 8, 9], [5, 6]) == (1.0, 2)       # its extra tokens: nothing
  assert calls.agreement([], []) == (0.0, 0)
