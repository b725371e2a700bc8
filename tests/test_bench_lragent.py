"""bench/lragent.py's paired records and table without a model: per-token differences
and per-call exactness against non_shared, and the schemes tested against each other
(a minus b, bootstrap over trajectories, exact McNemar per call)."""

import pathlib
import sys
import types

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import lragent as bench
from jaxkv.engine.agents import CallResult, RunResult


def _run(scheme, logprobs, argmaxes, roles):
  calls, start = [], 0
  for lp, am, role in zip(logprobs, argmaxes, roles):
    calls.append(CallResult(role, start, start + len(lp), 0, 0, 0.0, 0.0,
                            np.asarray(lp, np.float32), np.asarray(am, np.int32)))
    start += len(lp)
  return RunResult(scheme, start, calls, 0, None)


def test_per_token_records_pair_with_the_reference():
  traj = types.SimpleNamespace(ids=np.array([5, 6, 7, 8, 9]))
  ref = _run("non_shared", [[-1.0, -2.0], [-0.5, -0.5, -1.0]], [[5, 6], [7, 8, 9]], [1, 2])
  mine = _run("full_shared", [[-1.5, -2.0], [-0.5, -1.0, -1.0]], [[5, 0], [7, 8, 9]], [1, 2])
  got = bench.per_token(mine, ref, traj)
  np.testing.assert_allclose(got["token_dlp"], [0.5, 0.0, 0.0, 0.5, 0.0])
  assert got["token_agree"] == [1, 0, 1, 1, 1]
  assert got["call_exact"] == [[1, 0], [2, 1]]           # the action call misses a token


def _row(scheme, trace, dlp, agree, calls):
  return dict(scheme=scheme, trace=trace, token_dlp=dlp, token_agree=agree, call_exact=calls)


def test_paired_table_tests_a_minus_b_per_token_and_per_call():
  rows = []
  for t in ("t1", "t2", "t3"):
    rows += [_row("non_shared", t, [0.0] * 4, [1] * 4, [[1, 1], [1, 1], [2, 1]]),
             _row("full_shared", t, [0.4] * 4, [1, 1, 0, 0], [[1, 0], [1, 0], [2, 1]]),
             _row("base_lr_shared", t, [0.1] * 4, [1, 1, 1, 0], [[1, 1], [1, 0], [2, 1]])]
  table = bench.paired_table("real-qv", rows, ["non_shared", "full_shared", "base_lr_shared"])
  got = {(line[0], line[1]): line for line in table.lines}
  assert set(got) == {("full_shared", "non_shared"), ("base_lr_shared", "non_shared"),
                      ("base_lr_shared", "full_shared")}
  full = got["full_shared", "non_shared"]
  assert full[2:4] == ["3", "12"]
  assert full[4].startswith("+0.4000") and full[5].startswith("-0.500")
  assert full[6] == "0 / 6 of 6" and full[7] == "0.031 (0-6)"     # 6 calls only b writes
  assert full[8] == "3 / 3 of 3" and full[9] == "1.000 (0-0)"
  better = got["base_lr_shared", "full_shared"]
  assert better[4].startswith("-0.3000") and better[5].startswith("+0.250")
  assert better[6] == "3 / 0 of 6" and better[7] == "0.250 (3-0)"


def test_rows_name_their_adapters_and_resume_per_adapter_set(tmp_path):
  """A row records the adapters that measured it: the digest of their weight and
  config files, equal for a copy elsewhere and different once a weight changes. A
  trajectory already measured with other adapters (or none on record) is run again,
  and the tables keep each adapter set apart."""
  import shutil

  from jaxkv import artifacts
  shipped = bench.provenance(artifacts.ROLE_ADAPTERS)
  copy = tmp_path / "copy"
  shutil.copytree(artifacts.resolve(artifacts.ROLE_ADAPTERS), copy)
  (copy / "log.csv").write_text("not a weight\n")           # logs do not count
  assert bench.provenance(str(copy))["sha256"] == shipped["sha256"]
  w = copy / "plan" / "adapter_model.safetensors"
  w.write_bytes(w.read_bytes()[:-1] + b"\0")
  assert bench.provenance(str(copy))["sha256"] != shipped["sha256"]

  trajs = [types.SimpleNamespace(session=s) for s in ("t1", "t2")]
  old = dict(kind="emulated-qv", targets="q,v", trace="t1", scheme="non_shared")
  new = dict(old, trace="t2", adapters=shipped)
  todo = bench._todo([old, new], trajs, "emulated-qv", "q,v", shipped)
  assert [(t.session, m) for t, m in todo] == [("t1", ["non_shared"])]   # t1's names none
  assert bench._todo([old, new], trajs, "emulated-qv", "q,v", None) == [(trajs[1],
                                                                         ["non_shared"])]
  # a run of other schemes adds them where they lack (an engine run served three of five)
  later = bench._todo([old, new, dict(new, scheme="full_shared")], trajs, "emulated-qv",
                      "q,v", shipped, ("non_shared", "full_shared", "droidspeak"))
  assert [(t.session, m) for t, m in later] == [
      ("t1", ["non_shared", "full_shared", "droidspeak"]), ("t2", ["droidspeak"])]

  def row(scheme, adapters):
    return dict(scheme=scheme, kind="real-qv", trace="t1", context_tokens=100, kv_bytes=0,
                ttft_s=None, tokens_per_s=None, delta_nll=0.0, greedy_agreement=1.0,
                computed_tokens=1, recomputed_tokens=0, **({"adapters": adapters}
                                                           if adapters else {}))
  # schemes measured on different trajectory counts (a run not finished) say so per scheme
  fid = [t for t in bench.tables([row("non_shared", shipped), dict(row("non_shared", shipped),
                                                                   trace="t2"),
                                   row("droidspeak", shipped)]) if "fidelity" in t.title]
  assert "each scheme's trajectories" in fid[0].title
  assert [line[-1] for line in fid[0].lines] == ["2", "1"]
  titles = [t.title for t in bench.tables([row("non_shared", shipped), row("non_shared", None)])]
  assert any("adapters not recorded" in t for t in titles)
  assert any(f"sha256 {shipped['sha256']}" in t for t in titles)
