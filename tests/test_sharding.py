"""Sharding (issue 17): the rules table, and sharded runs equal to one device.

The mesh runs need 8 devices, fixed when JAX starts, so they run
`tests/sharding_worker.py` in a fresh process with
XLA_FLAGS=--xla_force_host_platform_device_count=8; it prints one JSON line per
mesh shape.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest
from jax.sharding import PartitionSpec as P

from jaxkv import sharding
from jaxkv.config import MeshConfig, ModelConfig, ServeConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mesh(data, model):
  """Stands in for a Mesh where only the axis sizes matter (`sharding.spec`)."""
  return types.SimpleNamespace(shape={"data": data, "model": model})


def test_rules_shard_whole_units_and_replicate_the_rest():
  smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64)
  units = sharding.Units.of(smol, num_slots=4096)
  m = _mesh(2, 4)
  # 9 query heads and 3 KV heads do not divide by 4: whole heads stay together
  assert sharding.spec(("embed", "q_heads"), (576, 576), m, units) == P(None, None)
  assert sharding.spec(("embed", "kv_heads"), (576, 192), m, units) == P(None, None)
  # MLP units and the vocabulary do; the layer axis is replicated
  assert sharding.spec(("embed", "mlp"), (30, 576, 1536), m, units) == P(None, None, "model")
  assert sharding.spec(("vocab", "embed"), (49152, 576), m, units) == P("model", None)
  # the pool: slots on data, KV heads replicated (3 on 4), head_dim replicated
  assert sharding.spec(sharding.POOL_AXES["k"], (30, 4096, 3, 64), m, units) == \
      P(None, "data", None, None)
  # 3 KV heads on a model axis of 3: sharded
  assert sharding.spec(sharding.POOL_AXES["k"], (30, 4096, 3, 64), _mesh(1, 3), units) == \
      P(None, None, "model", None)
  # a size-1 axis never appears in a spec
  assert sharding.spec(("embed", "mlp"), (576, 1536), _mesh(8, 1), units) == P(None, None)


def test_collisions_and_unknown_axes_are_refused():
  with pytest.raises(ValueError, match="collide"):
    sharding.check_rules(sharding.RULES, {"bad": ("q_heads", "mlp")})
  with pytest.raises(ValueError, match="no rule"):
    sharding.check_rules(sharding.RULES, {"bad": ("embed", "experts")})
  with pytest.raises(ValueError, match="collide"):
    sharding.spec(("q_heads", "mlp"), (8, 8), _mesh(1, 2))
  with pytest.raises(ValueError, match="logical axes"):
    sharding.spec(("embed", "mlp"), (8,), _mesh(1, 2))


def test_every_parameter_of_every_architecture_has_axes():
  """No weight of Llama / Qwen2 (biases) / Qwen3 (qk norm) falls through the table."""
  import jax
  from flax import nnx

  from jaxkv.models.llama import Transformer
  for extra in ({}, {"qkv_bias": True}, {"qk_norm": True}, {"tie_embeddings": False}):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, **extra)
    for scan in (True, False):
      _, weights = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)).relayout(scan_layers=scan))
      for path, _ in jax.tree_util.tree_flatten_with_path(weights)[0]:
        assert sharding._leaf_name(path) in sharding.PARAM_AXES, jax.tree_util.keystr(path)


def test_mesh_config_checks():
  with pytest.raises(ValueError, match=">= 1"):
    MeshConfig(data=0)
  with pytest.raises(ValueError, match="mode=requests"):
    ServeConfig(mode="sessions", mesh=MeshConfig(data=2))
  with pytest.raises(ValueError, match="XLA_FLAGS"):
    sharding.make_mesh(2, 4)       # this process sees one CPU device


def _tails(proc, processes: int, lines: int = 12) -> str:
  """Each process's first Python exception line and last output lines: process 0's
  output is stdout, the others' stderr prefixed [pN] (scripts/launch.py). The process
  that failed first is often not the one that printed last."""
  if not processes:
    return proc.stderr[-3000:]
  err = [x for x in proc.stderr.splitlines() if "[Gloo]" not in x]
  mine = [[x for x in proc.stdout.splitlines() if not x.startswith("{") and "[Gloo]" not in x]]
  mine += [[x for x in err if x.startswith(f"[p{i}]")] for i in range(1, processes)]
  out = []
  for i, xs in enumerate(mine):
    first = [x for x in xs if re.match(r"(\[p\d+\] )?[\w.]+(Error|Exception): ", x)][:1]
    out += [f"--- process {i} ---", *first, "...", *xs[-lines:]]
  return "\n".join(out + [x for x in err if x.startswith("launch:")])


def _worker(*args, timeout, processes=0):
  """The worker's JSON lines; with `processes`, as that many processes of 8 /
  processes CPU devices each, through scripts/launch.py."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXKV_")}
  env["PYTHONPATH"] = str(ROOT)
  cmd = [sys.executable, str(ROOT / "tests" / "sharding_worker.py"), *args]
  if processes:
    cmd = [sys.executable, str(ROOT / "scripts" / "launch.py"), f"--processes={processes}",
           f"--devices_per_process={8 // processes}", f"--timeout={timeout - 30}", "--", *cmd]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
  assert proc.returncode == 0, _tails(proc, processes)
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_meshes_equal_one_device_tiny_model():
  """1x8, 2x4, 4x2, 8x1: greedy tokens identical (also with every other row under a
  structured-output token mask), every logit within 1e-5, the
  pool and weights really spread over the 8 devices, the allocator consistent and
  shard-aware: one page range per data shard, exactly the pool slots that shard's
  devices hold, and every row's fresh slots in its own shard's range."""
  rows = _worker("--model=tiny", "--meshes=1x8,2x4,4x2,8x1", timeout=600)
  assert [r["mesh"] for r in rows] == [[1, 8], [2, 4], [4, 2], [8, 1]]
  for r in rows:
    assert r["tokens_equal"], r
    assert r["max_logit_diff"] <= 1e-5, r
    assert r["masked_equal"] and r["masked_even"] and r["unmasked_rows_equal"], r
    assert r["pool_devices"] == 8 and r["allocator_check"]
    d = r["mesh"][0]
    slots = 64 * 16 // d                       # CACHE: 64 pages of 16
    assert r["alloc_shards"] == d and r["rows_local"], r
    assert r["pool_slot_blocks"] == [[k * slots, (k + 1) * slots] for k in range(d)], r
    assert r["shards_used"] == list(range(d)), r   # 8 prompts spread over every shard
  specs = {tuple(r["mesh"]): r for r in rows}
  assert specs[(4, 2)]["pool_k_spec"] == "P(None, 'data', 'model')"
  assert specs[(2, 4)]["pool_k_spec"] == "P(None, 'data')"   # 2 KV heads on 4
  assert specs[(8, 1)]["wq_spec"] == "P(None, None)"
  assert specs[(1, 8)]["wq_spec"] == "P('model', None)"   # wq_t: [out, in]


@pytest.mark.slow
def test_mesh_equals_one_device_smollm2():
  """The shipped SmolLM2 (9 / 3 heads: replicated on a model axis of 4; MLP and
  vocabulary sharded) on a 2 x 4 mesh: the same greedy chat answers."""
  (r,) = _worker("--model=smollm2-135m", "--meshes=2x4", timeout=900)
  assert r["tokens_equal"], r
  # 1e-5 of the largest logit (|logit| reaches ~40; seen 1.5e-4 absolute)
  assert r["max_logit_diff"] <= 1e-5 * max(1.0, r["logit_scale"]), r


def _serve(tmp_path, *overrides, devices=None):
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  if devices:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  out = tmp_path / "results.jsonl"
  proc = subprocess.run([sys.executable, "scripts/serve.py", "--config=configs/smollm2.py",
                         "--input=examples/requests.jsonl", f"--output={out}", *overrides],
                        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  return proc, out


def test_serve_refuses_a_mesh_larger_than_the_devices(tmp_path):
  proc, out = _serve(tmp_path, "--config.mesh.data=2", "--config.mesh.model=4")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "XLA_FLAGS" in proc.stderr and "8 devices" in proc.stderr


@pytest.mark.slow
def test_serve_on_a_mesh(tmp_path):
  """serve.py --config.mesh.data=2 --config.mesh.model=4 on 8 CPU devices answers
  every request of the shipped example file."""
  proc, out = _serve(tmp_path, "--config.mesh.data=2", "--config.mesh.model=4", devices=8)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert len(rows) == 6 and not any("error" in r for r in rows.values())
  assert "Paris" in rows["capital"]["text"]


@pytest.mark.slow
def test_two_processes_equal_one_device():
  """scripts/launch.py: 2 processes x 4 CPU devices (gloo collectives), one mesh over
  all 8; greedy tokens and logits equal the single-device run, within a bounded time."""
  rows = _worker("--model=tiny", "--meshes=2x4,4x2", "--skew=45", timeout=420, processes=2)
  assert [r["mesh"] for r in rows] == [[2, 4], [4, 2]]
  for r in rows:
    assert r["processes"] == 2 and r["devices"] == 8 and r["pool_devices"] == 8, r
    assert r["tokens_equal"] and r["max_logit_diff"] <= 1e-5, r
    assert r["masked_equal"] and r["masked_even"], r      # the token mask across processes


@pytest.mark.slow
def test_mechanisms_on_meshes_equal_one_device():
  """A plain request and a pruned, a reuse, a SemShareKV, a MemArt and an agents
  request (role adapters) in one batch on the (data, model) meshes of 8 CPU devices:
  every row's tokens and what its mechanism did equal the single-device run, and
  nothing is left allocated once the agents session closes. Then three turns of one
  composed agents + pruned + reuse session and a second session's call equal the
  single-device calls (tokens and counts; QueryMemory's cosine within 1e-5), sharing
  the trajectory, pruning it and splicing segments."""
  rows = _worker("--mode=mechanisms", "--meshes=1x8,2x4,4x2,8x1", timeout=900)
  assert [r["mesh"] for r in rows] == [[1, 8], [2, 4], [4, 2], [8, 1]]
  for r in rows:
    assert r["tokens_equal"] and r["extra_equal"], r
    assert r["composed_diff"] == [] and set(r["composed_finish"]) <= {"stop", "length"}, r
    assert r["composed_shared"] > 0 and r["composed_pruned"] >= 1, r
    assert r["composed_reused"] > 0, r
    assert set(r["finish"].values()) <= {"stop", "length"}, r
    assert r["pool_devices"] == 8 and r["sequences_left"] == 0, r
  assert [r["alloc_shards"] for r in rows] == [1, 2, 4, 8]


@pytest.mark.slow
def test_mechanisms_on_two_processes_equal_one_device():
  """The same mixed batch (plain, pruned, reuse, SemShareKV, MemArt, agents on a role
  adapter) on one 2 x 4 mesh over 2 processes x 4 CPU devices (scripts/launch.py):
  tokens and what each mechanism did equal the single-device run, and so do three
  turns of a composed agents + pruned + reuse session."""
  (r,) = _worker("--mode=mechanisms", "--meshes=2x4", timeout=600, processes=2)
  assert r["mesh"] == [2, 4] and r["processes"] == 2 and r["pool_devices"] == 8, r
  assert r["tokens_equal"] and r["extra_equal"], r
  assert r["composed_diff"] == [] and r["composed_shared"] > 0, r
  assert set(r["finish"]) == {"plain", "pruned", "reuse", "semshare", "memart", "agents"}
  assert set(r["finish"].values()) <= {"stop", "length"} and r["sequences_left"] == 0, r


def test_launcher_ends_every_process_when_one_fails():
  t0 = __import__("time").monotonic()
  code = "import os, sys, time; pid = int(os.environ['JAXKV_PROCESS_ID']); " \
         "sys.exit(3) if pid == 1 else time.sleep(60)"
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--processes=3",
                         "--timeout=50", "--", sys.executable, "-c", code],
                        capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert proc.returncode == 3 and __import__("time").monotonic() - t0 < 30


def test_distributed_env_errors_name_the_variable(monkeypatch):
  from jaxkv import distributed
  monkeypatch.setenv("JAXKV_COORDINATOR", "127.0.0.1:1")
  monkeypatch.delenv("JAXKV_NUM_PROCESSES", raising=False)
  monkeypatch.setenv("JAXKV_PROCESS_ID", "0")
  with pytest.raises(ValueError, match="JAXKV_NUM_PROCESSES"):
    distributed.initialize()
  monkeypatch.setenv("JAXKV_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAXKV_PROCESS_ID", "5")
  with pytest.raises(ValueError, match="outside"):
    distributed.initialize()


@pytest.mark.slow
def test_serve_as_two_processes(tmp_path):
  """serve.py under scripts/launch.py (2 processes x 4 devices, mesh 2 x 4): process
  0 writes every answer once; the follower computes the same steps."""
  out = tmp_path / "results.jsonl"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXKV_")}
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.run(
      [sys.executable, "scripts/launch.py", "--processes=2", "--devices_per_process=4",
       "--timeout=840", "--", sys.executable, "scripts/serve.py", "--config=configs/smollm2.py",
       "--config.mesh.data=2", "--config.mesh.model=4", "--input=examples/requests.jsonl",
       f"--output={out}"], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  lines = (ROOT / "examples/requests.jsonl").read_text().splitlines()
  assert sorted(r["id"] for r in rows) == sorted(json.loads(line)["id"] for line in lines)
  assert not any("error" in r for r in rows)
  assert "Paris" in next(r["text"] for r in rows if r["id"] == "capital")
