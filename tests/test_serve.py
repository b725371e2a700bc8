"""scripts/serve.py end to end on real SmolLM2: a JSONL with a malformed line,
results written per request, and resume on rerun. One test (the shipped default
config, two short requests and four unusable lines) is in the fast set; the
others are marked slow."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxkv.data import calls

ROOT = pathlib.Path(__file__).resolve().parents[1]
_ENV: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _xla_cache(tmp_path_factory):
  """The serve.py processes of this module share one persistent XLA cache (JAX reads
  JAX_COMPILATION_CACHE_DIR), as a user's reruns would: a resume or a second
  sessions run loads its compiled steps instead of compiling them again (~2x)."""
  _ENV.update(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla")),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  yield
  _ENV.clear()


def _run(cmd):
  return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_ENV)


def _serve(inp, out, *extra):
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"), f"--config={ROOT}/configs/smollm2.py",
         f"--input={inp}", f"--output={out}", "--config.sampling.max_tokens=8",
         "--config.cache.num_pages=64", "--config.engine.max_batch=2", "--noprogress", *extra]
  return _run(cmd)


def _records(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_serve_default_config_with_unusable_lines(tmp_path):
  """The README's first command on its shipped config (not slow): two short
  requests among four unusable lines. One error line per unusable line with its
  line (and the JSON error's column), counts that add up, a progress bar that
  ends at 6/6, no libtpu line; a rerun has only the unusable lines left and
  reports them again without loading the model."""
  inp = tmp_path / "in.jsonl"
  inp.write_text("\n".join([
      json.dumps({"id": "hi", "messages": [{"role": "user", "content": "Say hi."}]}),
      '{"id": "broken", "prompt": ',                                  # cut short: column 28
      json.dumps({"id": "c", "prompt": "x", "max_token": 4}),         # misspelt field
      "[1, 2]",                                                       # not an object
      json.dumps({"id": "sky", "prompt": "The sky is"}),
      json.dumps({"prompt": "no id"}),
  ]) + "\n")
  out = tmp_path / "out.jsonl"
  env = {k: v for k, v in _ENV.items() if k != "JAX_PLATFORMS"}   # as a user runs it
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"), f"--config={ROOT}/configs/smollm2.py",
         f"--input={inp}", f"--output={out}", "--config.sampling.max_tokens=2"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stderr.replace("\r", "\n").splitlines()
  assert [x.split(":")[1] for x in lines if x.startswith("error:")] == [
      " line 2", " line 3", " line 4", " line 6"], proc.stderr
  assert "error: line 2: invalid JSON at column 28: Expecting value" in lines
  assert (f"{inp}: 6 requests: 2 to run, 0 already answered in {out}, 4 unusable "
          "(errors below)") in lines
  bars = [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) \[", proc.stderr)]
  assert bars and all(b == 6 and a <= 6 for a, b in bars) and bars[-1] == (6, 6), bars
  assert "libtpu" not in proc.stderr and "Traceback" not in proc.stderr
  recs = _records(out)
  assert [r["id"] for r in recs] == ["hi", "line:2", "c", "line:4", "sky", "line:6"]
  assert [r["finish_reason"] == "error" for r in recs] == [False, True, True, True, False, True]
  assert all(0 < r["completion_tokens"] <= 2 for r in recs if r["finish_reason"] != "error")
  metrics = json.loads(proc.stdout.split("METRICS ", 1)[1])
  assert (metrics["requests"], metrics["line_errors"], metrics["records"]) == (2, 4, 6)

  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env=env)
  assert proc.returncode == 0 and "loaded" not in proc.stderr, proc.stderr[-3000:]
  assert sum(x.startswith("error: line") for x in proc.stderr.splitlines()) == 4
  assert "nothing to run" in proc.stderr and _records(out) == recs


@pytest.mark.slow
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
  assert [r["id"] for r in _records(out)] == ["a", "line:2", "b", "c", "7"]   # input order
  assert recs["line:2"]["finish_reason"] == "error" and "line 2" in recs["line:2"]["error"]
  assert "max_token" in recs["c"]["error"]
  assert "error: line 2" in proc.stderr and "error: line 4" in proc.stderr
  for rid in ("a", "b", "7"):
    r = recs[rid]
    assert set(r) >= {"id", "text", "prompt_tokens", "completion_tokens", "ttft_s",
                      "latency_s", "finish_reason"}
    assert r["finish_reason"] in ("stop", "length") and r["prompt_tokens"] > 0
  assert recs["b"]["completion_tokens"] <= 4
  assert "METRICS" in proc.stdout
  metrics = json.loads(proc.stdout.split("METRICS ", 1)[1])
  assert metrics["decode_tokens"] > 0 and metrics["peak_kv_bytes"] > 0
  assert (metrics["errors"], metrics["line_errors"], metrics["request_errors"]) == (2, 2, 0)
  assert "errors             2 (2 unusable lines, 0 refused requests)" in proc.stdout

  # Resume after fixing line 2 and appending two requests, one too long for the
  # cache: only those run; one record per line, the stale "line:2" error is gone.
  lines[1] = json.dumps({"id": "broken", "prompt": "Hello", "max_tokens": 2})
  lines += [json.dumps({"id": "d", "prompt": "One, two,", "max_tokens": 3}),
            json.dumps({"id": "e", "prompt": "Tell me", "max_tokens": 5000})]
  inp.write_text("\n".join(lines) + "\n")
  before = {r["id"]: r for r in _records(out)}
  proc = _serve(inp, out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = _records(out)
  assert [r["id"] for r in recs] == ["a", "broken", "b", "c", "7", "d", "e"]
  by_id = {r["id"]: r for r in recs}
  assert all(by_id[k] == before[k] for k in ("a", "b", "7"))     # not run again
  assert by_id["broken"]["finish_reason"] in ("stop", "length")
  assert "exceeds cache.max_seq_len" in by_id["e"]["error"]
  assert "error: request 'e'" in proc.stderr
  metrics = json.loads(proc.stdout.split("METRICS ", 1)[1])
  assert (metrics["errors"], metrics["request_errors"], metrics["records"]) == (2, 1, 7)
  # a third run retries only the refused request; with it dropped from the input,
  # a fourth has nothing to run, loads no model, and keeps the other records
  proc = _serve(inp, out)
  assert proc.returncode == 0, proc.stderr[-3000:]   # the bad line "c" is not "answered"
  assert f"{inp}: 7 requests: 1 to run, 5 already answered in {out}, 1 unusable" in proc.stderr
  assert [r["id"] for r in _records(out)] == [r["id"] for r in recs]
  inp.write_text("\n".join(lines[:-1]) + "\n")
  proc = _serve(inp, out)
  assert proc.returncode == 0 and "nothing to run" in proc.stderr and "loaded" not in proc.stderr
  assert _records(out) == recs[:-1]


@pytest.mark.slow
def test_serve_rejects_unknown_config_field(tmp_path):
  inp = tmp_path / "in.jsonl"
  inp.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
  proc = _serve(inp, tmp_path / "out.jsonl", "--config.cache.bogus=3")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "--config.cache.bogus: unknown config field" in proc.stderr


def _react(name, args):
  return {"from": "assistant",
          "value": f"Thought: call {name}.\nAction: {name}\nAction Input: {json.dumps(args)}"}


@pytest.mark.slow
def test_serve_sessions_with_pruning_and_resume(tmp_path):
  """Sessions mode: a ToolBench-format file with a malformed entry, IntentKV pruning
  on the dead-slot layout, per-session lines with section 4.1 metrics, resume."""
  sys_msg = {"from": "system", "value": "You are a helpful travel agent."}
  conv = [sys_msg, {"from": "user", "value": "I am mia_li_3668. Cancel my Boston trip."},
          _react("get_user_details", {"user_id": "mia_li_3668"}),
          {"from": "function", "value": "reservations: NO6JO3 (BOS), AIXC01 (LAX). " * 6},
          _react("cancel_reservation", {"reservation_id": "NO6JO3"}),
          {"from": "function", "value": "cancelled"},
          {"from": "assistant", "value": "Your trip NO6JO3 is cancelled."}]
  data = [{"id": "s1", "conversations": conv},
          {"id": "bad", "conversations": [{"from": "wizard", "value": "?"}]},
          {"id": "s2", "conversations": conv[:4] + [conv[-1]]}]
  inp = tmp_path / "traces.json"
  inp.write_text(json.dumps(data))
  out = tmp_path / "sessions.jsonl"
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"),
         f"--config={ROOT}/configs/smollm2_sessions.py", f"--input={inp}", f"--output={out}",
         "--config.pruning.budget=60", "--config.cache.num_pages=128", "--noprogress"]
  proc = _run(cmd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert set(recs) == {"s1", "s2", "bad"}
  assert recs["bad"]["finish_reason"] == "error" and "entry 1" in recs["bad"]["error"]
  s1 = recs["s1"]
  assert [t["turn"] for t in s1["turns"]] == [2, 4, 6]
  assert any(t["pruned"] and t["live_after"] < t["live_before"] for t in s1["turns"])
  assert s1["turns"][1]["hit_tokens"] > 0
  assert s1["summary"]["eff_reads"] < s1["summary"]["raw_reads"]
  assert json.loads(proc.stdout.split("METRICS ", 1)[1])["prefix_hit_rate"] > 0
  proc = _run(cmd)   # everything done: resumes without loading the model
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(r["id"] for r in _records(out) if "turns" in r) == ["s1", "s2"]
  assert "loaded" not in proc.stderr.lower() and "2 already in" in proc.stderr
  assert [r["id"] for r in _records(out)] == ["bad", "s1", "s2"]   # one record each


@pytest.mark.slow
def test_serve_sessions_with_a_trained_head(tmp_path):
  """IntentKV learnable mode end to end: a residual head trained by the Phase-2
  loop (train.train on rows with SmolLM2's head_dim, so fc2 and alpha moved off
  their init) is saved, loaded by serve.py through pruning.head_path, and prunes.
  (A head for another head_dim is refused: tests/test_sessions.py.)"""
  import numpy as np

  from jaxkv.training import PrunerTrainConfig, features, load_head, train

  def rows(d):
    rng = np.random.default_rng(0)
    out = []
    for i in range(8):
      t = int(rng.integers(20, 60))
      lab = (rng.random(t) < 0.2).astype(np.int8)
      lab[0] = 1
      out.append(features.Row(session=f"s{i // 4}", turn=i % 4 + 2,
                              rule=rng.random(t).astype(np.float32), labels=lab,
                              kbar=rng.normal(size=(t, d)).astype(np.float32),
                              kq=rng.normal(size=(5, d)).astype(np.float32),
                              mbar=rng.normal(size=d).astype(np.float32),
                              mnorm=np.ones((30, 9), np.float32)))
    return out

  cfg = PrunerTrainConfig(out_dir=str(tmp_path / "run"), epochs=1, examples_per_epoch=8,
                          grad_accum=2, recall_budget=8, progress=False)
  r = rows(64)
  head_path = train.train(cfg, {"s0": r[:4], "s1": r[4:]}, r[:2], log=lambda m: None)["head"]
  graphdef, state = load_head(head_path)
  from flax import nnx
  head = nnx.merge(graphdef, state)
  assert float(head.alpha[...]) != 1.0 and np.abs(np.asarray(head.fc2.kernel[...])).max() > 0
  conv = [{"from": "system", "value": "You are a helpful travel agent."},
          {"from": "user", "value": "I am mia_li_3668. Cancel my Boston trip."},
          _react("get_user_details", {"user_id": "mia_li_3668"}),
          {"from": "function", "value": "reservations: NO6JO3 (BOS), AIXC01 (LAX). " * 6},
          _react("cancel_reservation", {"reservation_id": "NO6JO3"}),
          {"from": "function", "value": "cancelled"},
          {"from": "assistant", "value": "Your trip NO6JO3 is cancelled."}]
  inp = tmp_path / "traces.json"
  inp.write_text(json.dumps([{"id": "s1", "conversations": conv}]))

  def run(head_path, out):
    cmd = [sys.executable, str(ROOT / "scripts/serve.py"),
           f"--config={ROOT}/configs/smollm2_sessions.py", f"--input={inp}", f"--output={out}",
           "--config.pruning.budget=60", "--config.cache.num_pages=128", "--noprogress",
           "--config.pruning.intent_mode=learnable", f"--config.pruning.head_path={head_path}"]
    return _run(cmd)

  proc = run(head_path, tmp_path / "out.jsonl")
  assert proc.returncode == 0, proc.stderr[-3000:]
  (rec,) = _records(tmp_path / "out.jsonl")
  assert [t["turn"] for t in rec["turns"]] == [2, 4, 6]
  assert any(t["pruned"] and t["live_after"] < t["live_before"] for t in rec["turns"])


@pytest.mark.slow
def test_serve_reuse_mode_reuses_schemas_and_resumes(tmp_path):
  """configs/smollm2_reuse.py on the shipped example, through the batch engine: later
  prompts splice the tool schemas earlier ones stored, a sampled request is answered
  (seeded: the same text twice), a rerun resumes."""
  inp = tmp_path / "in.jsonl"
  lines = (ROOT / "examples/reuse_requests.jsonl").read_text().splitlines()
  extra = json.dumps({"id": "hot", "prompt": "Hello", "temperature": 0.7, "seed": 3})
  inp.write_text("\n".join(lines + [extra]) + "\n")
  out = tmp_path / "out.jsonl"
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"),
         f"--config={ROOT}/configs/smollm2_reuse.py", f"--input={inp}", f"--output={out}",
         "--config.sampling.max_tokens=4", "--config.cache.num_pages=256", "--noprogress"]
  proc = _run(cmd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert [r["id"] for r in _records(out)] == ["r0", "r1", "r2", "r3", "hot"]
  assert recs["r0"]["reused_tokens"] == 0 and recs["r0"]["runs"] == []
  later = [recs[k] for k in ("r1", "r2", "r3")]
  assert all(r["reused_tokens"] > 0 for r in later)             # the schemas, moved
  assert all(run["tier"] in ("exact", "approx", "blend", "reject") and run["reason"]
             for r in later for run in r["runs"])
  assert all(0 < r["prefill_tokens"] < r["prompt_tokens"] for r in later)
  assert recs["hot"]["finish_reason"] in ("stop", "length") and recs["hot"]["text"]
  proc = _run(cmd)                                              # everything answered
  assert proc.returncode == 0 and len(_records(out)) == 5
  again = tmp_path / "again.jsonl"
  proc = _run([*cmd[:4], f"--output={again}", *cmd[5:]])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {r["id"]: r["text"] for r in _records(again)} == {k: r["text"] for k, r in recs.items()}


@pytest.mark.slow
def test_serve_semshare_mode_reuses_a_similar_prompt(tmp_path):
  """configs/smollm2_semshare.py on the shipped example: the same notes with
  another question reuse the first prompt's KV, unrelated notes are prefilled
  in full (and stored), a rerun resumes."""
  out = tmp_path / "out.jsonl"
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"),
         f"--config={ROOT}/configs/smollm2_semshare.py",
         f"--input={ROOT / 'examples/semshare_requests.jsonl'}", f"--output={out}",
         "--config.sampling.max_tokens=4", "--config.cache.num_pages=256", "--noprogress"]
  proc = _run(cmd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert list(recs) == ["s0", "s1", "s2", "s3"]
  assert not recs["s0"]["reused"] and recs["s0"]["similarity"] == 0.0
  assert recs["s1"]["reused"] and recs["s1"]["similarity"] >= 0.8
  assert 0 < recs["s1"]["recomputed_share"] < 1 and recs["s1"]["shared_entries"] > 0
  assert not recs["s3"]["reused"] and recs["s3"]["similarity"] < 0.8
  assert all(r["completion_tokens"] == 4 or r["finish_reason"] == "stop" for r in recs.values())
  proc = _run(cmd)                                              # everything answered
  assert proc.returncode == 0 and len(_records(out)) == 4


@pytest.mark.slow
def test_serve_memart_mode_keeps_session_history_in_memory(tmp_path):
  """configs/smollm2_memart.py on the shipped example: a session's earlier
  messages are written to its memory once, only the new question is prefilled,
  sessions are separate, an edited history is refused, a sampled request is answered,
  a rerun resumes."""
  out = tmp_path / "out.jsonl"
  cmd = [sys.executable, str(ROOT / "scripts/serve.py"),
         f"--config={ROOT}/configs/smollm2_memart.py",
         f"--input={ROOT / 'examples/memart_requests.jsonl'}", f"--output={out}",
         "--config.sampling.max_tokens=4", "--config.cache.num_pages=256", "--noprogress"]
  proc = _run(cmd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert list(recs) == ["a1", "b1", "a2", "a3", "edited", "hot"]
  assert recs["a1"]["memory_blocks"] == 0 and recs["a1"]["retrieved_blocks"] == 0
  assert recs["a2"]["blocks_written"] > 0 and recs["a2"]["retrieved_blocks"] > 0
  assert recs["a3"]["memory_blocks"] == recs["a2"]["memory_blocks"] + recs["a3"]["blocks_written"]
  assert 0 < recs["a3"]["blocks_written"] < recs["a2"]["blocks_written"] + 2   # only new turns
  assert recs["b1"]["session"] == "bob" and recs["b1"]["memory_blocks"] == 0
  # only the question is prefilled (plus the template's assistant opening)
  assert recs["a2"]["prefill_tokens"] < 20 and recs["a3"]["prefill_tokens"] < 20, recs
  assert recs["a3"]["prompt_tokens"] > recs["a3"]["prefill_tokens"]   # the chat it stands for
  assert "no longer extends" in recs["edited"]["error"]
  assert recs["hot"]["finish_reason"] in ("stop", "length")
  proc = _run(cmd)                                              # answered ones are kept
  assert proc.returncode == 0 and len(_records(out)) == 6


def _serve_kinds(tmp_path, lines) -> dict:
  """serve.py on `lines` with configs/smollm2_agents.py (every kind served): the records
  by id, one per line in input order."""
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
  proc = _run([sys.executable, str(ROOT / "scripts/serve.py"),
               f"--config={ROOT}/configs/smollm2_agents.py", f"--input={inp}",
               f"--output={out}", "--config.sampling.max_tokens=4", "--noprogress"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert list(recs) == [x["id"] for x in lines]
  return recs


@pytest.mark.slow
def test_serve_mixes_mechanisms_by_line_kind(tmp_path):
  """One JSONL names a KV mechanism per line ("kind", the server's session kinds):
  plain, reuse, SemShareKV, MemArt, pruned and agents (role adapter) requests run in
  one batch engine (configs/smollm2_agents.py), each record saying its kind and what
  its mechanism did; an unknown kind, an unknown role and a role outside an agents
  line are that line's error."""
  reuse = [json.loads(x) for x in (ROOT / "examples/reuse_requests.jsonl").read_text()
           .splitlines()[:2]]
  sem = [json.loads(x) for x in (ROOT / "examples/semshare_requests.jsonl").read_text()
         .splitlines()[:2]]
  chat = [{"role": "user", "content": "The spare key is under the blue flower pot."},
          {"role": "assistant", "content": "Noted."},
          {"role": "user", "content": "Where is the spare key?"}]
  lines = [{"id": "plain", "prompt": "The capital of France is"},
           *({**r, "kind": "reuse"} for r in reuse), *({**r, "kind": "semshare"} for r in sem),
           {"id": "mem", "kind": "memart", "user": "m", "messages": chat},
           {"id": "prn", "kind": "pruned", "user": "p", "messages": chat},
           {"id": "ag", "kind": "agents", "role": "plan", "user": "t", "messages": chat},
           {"id": "bad", "kind": "bogus", "prompt": "Hi"},
           {"id": "boss", "kind": "agents", "role": "boss", "user": "t", "prompt": "Hi"},
           {"id": "norole", "role": "plan", "prompt": "Hi"}]
  recs = _serve_kinds(tmp_path, lines)
  assert "kind" not in recs["plain"] and recs["plain"]["finish_reason"] == "length"
  assert recs["r1"]["kind"] == "reuse" and recs["r1"]["reused_tokens"] > 0
  assert recs["s1"]["kind"] == "semshare" and recs["s1"]["reused"]
  assert recs["mem"]["session"] == "m" and recs["mem"]["blocks_written"] > 0
  assert recs["prn"]["kind"] == "pruned" and "kv_live_after" in recs["prn"]
  assert recs["ag"]["role"] == "plan" and recs["ag"]["session"] == "t"
  assert recs["ag"]["computed_tokens"] == recs["ag"]["prompt_tokens"]     # a new session
  assert recs["ag"]["kv_bytes"] < recs["ag"]["kv_bytes_non_shared"]
  assert "'kind' must be one of" in recs["bad"]["error"]
  assert "not one of the role adapters" in recs["boss"]["error"]
  assert "give \"kind\": \"agents\"" in recs["norole"]["error"]
  assert sum(r["finish_reason"] == "error" for r in recs.values()) == 3


@pytest.mark.slow
def test_serve_composes_mechanisms_in_one_session(tmp_path):
  """A line's "kind" may list kinds composed in one session, as the server's sessions:
  a pruned+memart session's second conversation first writes the first (its reply
  included) into the session's memory and recalls blocks for its question, which
  its prompt carries as a region (the session's lines run one after the other); all
  four kinds in one session; what does not combine is the line's error saying why."""
  first = [{"role": "user", "content": "The spare key is under the blue flower pot."},
           {"role": "assistant", "content": "Noted."},
           {"role": "user", "content": "My sister Ana teaches piano in Lisbon."}]
  second = [{"role": "user", "content": "Where is the spare key?"}]
  lines = [{"id": "c1", "kind": ["pruned", "memart"], "user": "u", "messages": first},
           {"id": "c2", "kind": ["memart", "pruned"], "user": "u", "messages": second},
           {"id": "all", "kind": ["agents", "pruned", "memart", "reuse"], "role": "plan",
            "user": "v", "messages": first},
           {"id": "nolayout", "kind": ["memart", "reuse"], "user": "w", "messages": first},
           {"id": "plain", "prompt": "The capital of France is"}]
  recs = _serve_kinds(tmp_path, lines)
  c1, c2 = recs["c1"], recs["c2"]
  assert c1["kind"] == c2["kind"] == "pruned+memart" and c1["session"] == "u"
  assert c1["memory_region_tokens"] == 0 and "memory_written_tokens" not in c1
  assert c2["memory_written_tokens"] > 0 and c2["memory_blocks"] > 0      # c1 written
  assert c2["memory_region_tokens"] > 0 and c2["memory_blocks_retrieved"] > 0
  assert c2["prompt_tokens"] > c2["memory_region_tokens"]
  a = recs["all"]
  assert a["kind"] == "agents+pruned+memart+reuse" and a["finish_reason"] in ("stop", "length")
  assert a["mechanisms"] == ["agents", "pruned", "memart", "reuse"]
  assert "lays out and caches" in recs["nolayout"]["error"]
  assert recs["plain"]["finish_reason"] == "length"


@pytest.mark.slow
def test_serve_structured_output_lines(tmp_path):
  """response_format / tool_choice on JSONL lines decode under the server's grammars,
  plain and on a mechanism (pruned); a wrong structured field is that line's error."""
  schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}},
            "required": ["name"], "additionalProperties": False}
  tool = {"name": "get_weather", "parameters": {
      "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
      "required": ["city"], "additionalProperties": False}}
  ask = [{"role": "user", "content": "Give a cat a name. Reply with a JSON object."}]
  lines = [
      {"id": "schema", "messages": ask, "response_format": {
          "type": "json_schema", "json_schema": {"name": "cat", "schema": schema}}},
      {"id": "object", "messages": ask, "response_format": {"type": "json_object"}},
      {"id": "call", "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
       "messages": [{"role": "user", "content": "Weather in Paris?"}]},
      {"id": "pruned", "kind": "pruned", "user": "u", "messages": ask,
       "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
      {"id": "bad", "messages": ask, "response_format": {"type": "xml"}}]
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
  proc = _serve(inp, out, "--config.sampling.max_tokens=48")
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = {r["id"]: r for r in _records(out)}
  assert list(recs) == [x["id"] for x in lines]
  for rid in ("schema", "pruned"):
    assert recs[rid]["finish_reason"] == "stop", recs[rid]
    assert set(json.loads(recs[rid]["text"])) == {"name"}
  assert isinstance(json.loads(recs["object"]["text"]), dict)
  call = calls.parse_calls(recs["call"]["text"])
  assert [c.name for c in call] == ["get_weather"] and set(call[0].arguments) == {"city"}
  assert recs["bad"]["finish_reason"] == "error" and "response_format" in recs["bad"]["error"]
