"""scripts/serve.py end to end on real SmolLM2: a JSONL with a malformed line,
results written per request, and resume on rerun."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _serve(inp, out, *extra):
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"), f"--config={ROOT}/configs/smollm2.py",
         f"--input={inp}", f"--output={out}", "--config.sampling.max_tokens=8",
         "--config.cache.num_pages=64", "--config.engine.max_batch=2", "--noprogress", *extra]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _records(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_serve_malformed_line_and_resume(tmp_path):
  inp = tmp_path / "in.jsonl"
  lines = [
      json.dumps({"id": "a", "messages": [{"role": "user", "content": "Say hi."}]}),
      '{"id": "broken", "prompt": ',                                  # malformed JSON
      json.dumps({"id": "b", "prompt": "The sky is", "max_tokens": 4}),
      json.dumps({"id": "c", "prompt": "x", "max_token": 4}),         # unknown field
      json.dumps({"id": 7, "messages": [{"role": "user", "content": "Count to three."}]}),
  ]
  inp.write_text("\n".join(lines) + "\n")
  out = tmp_path / "out.jsonl"
  proc = _serve(inp, out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert set(recs) == {"a", "line:2", "b", "c", "7"}
  assert recs["line:2"]["finish_reason"] == "error" and "line 2" in recs["line:2"]["error"]
  assert "max_token" in recs["c"]["error"]
  for rid in ("a", "b", "7"):
    r = recs[rid]
    assert set(r) >= {"id", "text", "prompt_tokens", "completion_tokens", "ttft_s",
                      "latency_s", "finish_reason"}
    assert r["finish_reason"] in ("stop", "length") and r["prompt_tokens"] > 0
  assert recs["b"]["completion_tokens"] <= 4
  assert "METRICS" in proc.stdout
  metrics = json.loads(proc.stdout.split("METRICS ", 1)[1])
  assert metrics["decode_tokens"] > 0 and metrics["peak_kv_bytes"] > 0

  # Resume: nothing finished is run again; a newly appended request is.
  with open(inp, "a") as f:
    f.write(json.dumps({"id": "d", "prompt": "One, two,", "max_tokens": 3}) + "\n")
  proc = _serve(inp, out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  ids = [r["id"] for r in _records(out) if r["finish_reason"] != "error"]
  assert sorted(ids) == ["7", "a", "b", "d"]


def test_serve_rejects_unknown_config_field(tmp_path):
  inp = tmp_path / "in.jsonl"
  inp.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
  proc = _serve(inp, tmp_path / "out.jsonl", "--config.cache.bogus=3")
  assert proc.returncode != 0
  assert "bogus" in proc.stderr
