"""bench/reuse.py's method names (no model): `name@field=value` settings become the
row's ReuseConfig (the sweeps' knobs and the store's regime), and a bad setting is a
usage error naming what is wrong, before any model loads."""

import pathlib
import sys

import pytest
from absl import app

from flag_util import script_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import reuse as bench
from jaxkv.config import ReuseConfig


@pytest.fixture
def parsed():
  """The script's flags, parsed, for this test only (other bench tests define theirs)."""
  with script_flags(bench.define_flags, ["reuse", "--storage=float16"]) as f:
    yield f


def test_settings_become_the_rows_config(parsed):
  cfg = bench.method_config("tiered@regime=B@reuse_layers=8")
  assert (cfg.method, cfg.regime, cfg.reuse_layers) == ("tiered", "B", 8)
  assert cfg.tiers == ReuseConfig().tiers and cfg.storage == "float16"   # the flag's store
  cfg = bench.method_config("cacheblend@blend_ratio=0.75")
  assert (cfg.method, cfg.blend_ratio, cfg.regime) == ("cacheblend", 0.75, "A")
  assert bench.method_config("blend_random").select == "random"


@pytest.mark.parametrize("name, says", [
    ("tiered@regime=C", "regime must be 'A' or 'B'"),
    ("tiered@reuse_layers=eight", "reuse_layers takes a int"),
    ("tiered@window=64", "is not field=value of one of"),
    ("tiered@regime=", "is not field=value of one of"),
    ("fancy", "unknown method 'fancy'"),
])
def test_bad_settings_are_usage_errors(parsed, name, says):
  with pytest.raises(app.UsageError, match=says):
    bench.method_config(name)


def test_rows_keep_each_requests_ttft_when_timed():
  """A timed row keeps every request's TTFT beside its drift (paired TTFT ratios with
  intervals over requests); a quality-only row has none to keep."""
  per = [dict(kl=0.01 * i, dnll=0.0, agree=1.0, first_diff=32, ttft=1.5 + i) for i in range(4)]
  row = bench.quality(per, timed=True)
  assert row["per_request"]["ttft"] == [1.5, 2.5, 3.5, 4.5]
  assert row["per_request"]["kl"] == [0.0, 0.01, 0.02, 0.03]
  assert "ttft" not in bench.quality(per)["per_request"]   # quality only: TTFT has compiles
