"""The trained artifacts shipped in artifacts/ (jaxkv.artifacts): files intact, loadable
by the runners' defaults, and reproducing their manifest's check metric."""

import importlib.util
import json
import pathlib
import re
import shutil

import jax
import pytest

from jaxkv import artifacts
from jaxkv.config import PruningConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"role_adapters": artifacts.ROLE_ADAPTERS, "pruner_head": artifacts.PRUNER_HEAD,
           "role_adapters_qkvo": artifacts.ROLE_ADAPTERS_QKVO}


def test_manifests_describe_their_files():
  for name, folder in FOLDERS.items():
    kind = name.removesuffix("_qkvo")
    m = artifacts.verify(folder)                     # every file present with its sha256
    assert m["kind"] == kind and m["model"] == artifacts.MODEL
    assert m["command"].startswith("python scripts/train_") and m["commit"] != "unknown"
    for split in ("train", "held_out"):
      assert len(m["data"][split]["sha256"]) == 64 and m["data"][split]["sessions"] > 0
    assert m["held_out"] and m["check"]["sessions"] and m["check"]["metric"]
    size = sum((ROOT / folder / f).stat().st_size for f in m["files"])
    assert size < 8 << 20, f"{folder}: {size} bytes"   # "a few MB"
  assert PruningConfig().head_path == artifacts.PRUNER_HEAD


def test_the_qkvo_ablation_adapters_match_the_qv_ones_in_size(scan_llm):
  """LRAgent's QKVO ablation: r 4 on Q, K, V, O, the same parameter count as the
  shipped r 8 on Q, V, trained on the same traces and steps (only targets and rank
  differ in the manifests)."""
  qv, qkvo = (artifacts.verify(f) for f in (artifacts.ROLE_ADAPTERS, artifacts.ROLE_ADAPTERS_QKVO))
  assert {k for k in qv["config"] if qv["config"][k] != qkvo["config"][k]} == \
      {"targets", "rank", "out_dir"}
  assert qv["data"] == qkvo["data"]
  sizes = []
  for folder, targets, rank in ((artifacts.ROLE_ADAPTERS, {"q", "v"}, 8),
                                (artifacts.ROLE_ADAPTERS_QKVO, {"q", "k", "v", "o"}, 4)):
    lcfg, w = artifacts.load_role_adapters(scan_llm.config, folder, model_name=artifacts.MODEL)
    assert set(lcfg.targets) == targets and lcfg.rank == rank and lcfg.num_adapters == 3
    sizes.append(sum(x.size for x in jax.tree.leaves(w)))
  assert sizes[0] == sizes[1], sizes


@pytest.mark.parametrize("folder", ["artifacts/qwen2.5-coder-0.5b/pruner_head",
                                    "artifacts/qwen2.5-coder-0.5b/pruner_head_bfcl"])
def test_the_qwen_heads_are_intact_and_refuse_smollm2(folder):
  """The Phase-2 heads trained on Qwen2.5-Coder-0.5B (on tau2: issue 13's Qwen tables;
  on BFCL: issue 39's in-domain head): files as the manifest lists them, trained on the
  traces its command names, and loading one for another model is refused."""
  m = artifacts.verify(folder)
  assert m["kind"] == "pruner_head" and m["model"] == "qwen2.5-coder-0.5b"
  src = m["data"]["train"]["path"].split("/")[-1].split("_")[0]
  assert f"--source={src}" in m["data"]["train"]["made_by"]
  assert m["held_out"]["recall_phase2"] > m["held_out"]["recall_phase1"]
  artifacts.load_pruner_head(folder, model_name="qwen2.5-coder-0.5b")
  with pytest.raises(ValueError, match=re.escape("qwen2.5-coder-0.5b")):
    artifacts.load_pruner_head(folder, model_name="smollm2-135m")


def test_verify_names_a_changed_or_missing_file(tmp_path):
  dst = tmp_path / "head"
  shutil.copytree(ROOT / artifacts.PRUNER_HEAD, dst)
  (dst / "head.json").write_text('{"head_dim": 128}')
  with pytest.raises(ValueError, match=re.escape("head.json changed")):
    artifacts.load_pruner_head(dst)
  (dst / "head.json").unlink()
  with pytest.raises(FileNotFoundError, match=re.escape("train_pruner.py")):
    artifacts.load_pruner_head(dst)
  with pytest.raises(FileNotFoundError, match=re.escape("train_lora.py")):
    artifacts.load_role_adapters(None, tmp_path / "nothing")


def test_defaults_resolve_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert artifacts.resolve(artifacts.PRUNER_HEAD) == ROOT / artifacts.PRUNER_HEAD
  graphdef, state = artifacts.load_pruner_head(model_name=artifacts.MODEL)
  assert graphdef is not None and state is not None
  with pytest.raises(ValueError, match="trained for smollm2-135m, not qwen"):
    artifacts.load_pruner_head(model_name="qwen2.5-coder-0.5b")


def _make_traces():
  spec = importlib.util.spec_from_file_location("make_traces", ROOT / "scripts" / "make_traces.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def scan_llm():
  import jaxkv
  return jaxkv.load(artifacts.MODEL, scan_layers=True)    # as training and shipping ran


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_shipped_artifact_reproduces_its_check(name, scan_llm):
  """Replays the manifest's held-out sessions from tau2 (same digest), loads the shipped
  files through the runners' loaders and recomputes the check metric."""
  if importlib.util.find_spec("tau2") is None:
    pytest.skip("tau2 not installed (scripts/setup.sh installs it)")
  from jaxkv.training import PrunerTrainConfig, shipping
  from jaxkv.training.lora_train import LoraTrainConfig

  m = artifacts.verify(FOLDERS[name])
  sessions = _make_traces().replay_tau2_ids(m["check"]["sessions"])
  assert artifacts.sessions_digest(sessions) == m["check"]["sessions_sha256"]
  if m["kind"] == "role_adapters":
    cfg = LoraTrainConfig(**m["config"])
    lcfg, w = artifacts.load_role_adapters(scan_llm.config, FOLDERS[name])
    got = shipping.lora_check(scan_llm, lcfg, w, sessions, cfg)
  else:
    cfg = PrunerTrainConfig(**m["config"])
    got = shipping.head_check(scan_llm, artifacts.load_pruner_head(), sessions, cfg)
  got = json.loads(json.dumps(shipping._plain(got)))
  diff = shipping.compare(got, m["check"]["metric"])
  assert not diff, diff


def test_runners_default_to_the_shipped_files(scan_llm):
  """SessionRunner in learnable mode and AgentRunner without adapters load the shipped
  head and role adapters (what serve.py, bench/pruning.py and bench/lragent.py use)."""
  from jaxkv.config import CacheConfig
  from jaxkv.engine.agents import AgentRunner
  from jaxkv.engine.sessions import SessionRunner

  cache = CacheConfig(num_pages=64, page_size=16, max_seq_len=512)
  runner = SessionRunner(scan_llm, PruningConfig(method="intentkv", intent_mode="learnable"),
                         cache=cache)
  assert runner.head[0] is not None
  agents = AgentRunner(scan_llm, None, "base_lr_shared", max_tokens=256)
  assert agents.lora.num_adapters == 3 and set(agents.lora.targets) == {"q", "v"}
