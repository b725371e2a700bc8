"""Artifacts the project trains itself and ships in `artifacts/` (see artifacts/README.md).

    artifacts/smollm2-135m/role_adapters/   LRAgent plan / action / reflect adapters (PEFT)
    artifacts/smollm2-135m/pruner_head/     IntentKV Phase-2 residual head (Orbax)

Each folder holds `manifest.json`: the training command, the trace data it read
(path, sha256, session count, the command that makes it), the git commit of the
code, the training config, the held-out metrics of the run's own final
evaluation, a `check` (a metric on a few named held-out sessions, with their
digest, that `tests/test_artifacts.py` recomputes from the shipped files) and the
sha256 of every shipped file. `scripts/ship_artifacts.py` writes them.

Defaults (`bench/lragent.py --adapters`, `PruningConfig.head_path`,
`AgentRunner(lora=None)`) point here. A relative path is looked up from the
working directory first, then from the repository root (a clone) or the
installed package's copy (a wheel; `jaxkv.shipped`), so the defaults work from
any directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess

from jaxkv import shipped

MODEL = "smollm2-135m"
ROOT = f"artifacts/{MODEL}"
ROLE_ADAPTERS = f"{ROOT}/role_adapters"
ROLE_ADAPTERS_QKVO = f"{ROOT}/role_adapters_qkvo"   # LRAgent's ablation: r 4 on Q, K, V, O
PRUNER_HEAD = f"{ROOT}/pruner_head"
MANIFEST = "manifest.json"
REPO = shipped.REPO


def resolve(path: str | os.PathLike) -> pathlib.Path:
  """`path` as given if it exists, else (relative paths) under the repository root
  or the installed package's copy (`jaxkv.shipped.resolve`)."""
  return shipped.resolve(path)


def sha256(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def file_digests(folder: str | os.PathLike) -> dict[str, str]:
  """{relative path: sha256} of every file under folder except the manifest."""
  root = pathlib.Path(folder)
  return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*"))
          if p.is_file() and p.name != MANIFEST}


def git_commit(repo: str | os.PathLike = REPO) -> str:
  """HEAD's commit (with "+dirty" when tracked files differ), or "unknown"."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def sessions_digest(sessions) -> str:
  """sha256 of sessions' ToolBench entries: names the exact data a check ran on."""
  from jaxkv.data import traces  # pylint: disable=import-outside-toplevel
  blob = json.dumps([traces.to_entry(s) for s in sessions], sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()


def write_manifest(folder: str | os.PathLike, manifest: dict) -> pathlib.Path:
  """Writes folder/manifest.json with `files` (sha256 of every file) added."""
  folder = pathlib.Path(folder)
  out = dict(manifest, files=file_digests(folder))
  path = folder / MANIFEST
  path.write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")
  return path


def read_manifest(folder: str | os.PathLike) -> dict:
  path = resolve(folder) / MANIFEST
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no manifest (artifacts are written by "
                            "scripts/ship_artifacts.py)")
  return json.loads(path.read_text())


def verify(folder: str | os.PathLike) -> dict:
  """The manifest, after checking every listed file exists with its sha256.

  Raises ValueError naming the missing or changed files (a Git LFS pointer or a
  partial checkout shows up here, not as a shape error later)."""
  folder = resolve(folder)
  manifest = read_manifest(folder)
  bad = []
  for rel, digest in manifest["files"].items():
    p = folder / rel
    if not p.is_file():
      bad.append(f"{rel} missing")
    elif sha256(p) != digest:
      bad.append(f"{rel} changed")
  if bad:
    raise ValueError(f"{folder}: files differ from {MANIFEST}: " + ", ".join(bad))
  return manifest


def _check_model(folder: pathlib.Path, manifest: dict, model_name: str | None) -> None:
  want = manifest.get("model")
  if model_name and want and model_name != want:
    raise ValueError(f"{folder} was trained for {want}, not {model_name}; train your own "
                     "(scripts/train_lora.py, scripts/train_pruner.py) and pass its path")


def load_role_adapters(model_cfg, path: str | os.PathLike = ROLE_ADAPTERS, *,
                       model_name: str | None = None):
  """(LoraConfig, LoraWeights) of the plan / action / reflect adapters under `path`
  (one PEFT folder per role, `scripts/train_lora.py`), files checked when the folder
  has a manifest."""
  from jaxkv.data import agents  # pylint: disable=import-outside-toplevel
  from jaxkv.models import lora as lora_lib  # pylint: disable=import-outside-toplevel

  folder = resolve(path)
  if not folder.is_dir():
    raise FileNotFoundError(f"{folder}: no role adapters here (make them with "
                            "scripts/train_lora.py --config=configs/lora_smollm2.py)")
  if (folder / MANIFEST).exists():
    _check_model(folder, verify(folder), model_name)
  return lora_lib.load_peft([folder / r for r in agents.ROLES], model_cfg, names=agents.ROLES)


def load_pruner_head(path: str | os.PathLike = PRUNER_HEAD, *, model_name: str | None = None):
  """(graphdef, state) of a Phase-2 head folder (`scripts/train_pruner.py`), files
  checked when the folder has a manifest."""
  from jaxkv.policies.pruning.residual import load_head

  folder = resolve(path)
  if not (folder / "head.json").is_file():
    raise FileNotFoundError(f"{folder}: no Phase-2 head here (make one with "
                            "scripts/train_pruner.py --config=configs/pruner_smollm2.py)")
  if (folder / MANIFEST).exists():
    _check_model(folder, verify(folder), model_name)
  return load_head(folder)
