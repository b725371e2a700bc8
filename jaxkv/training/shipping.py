"""Turning a training run into a shipped artifact, and the check that it still works.

`ship(kind, cfg, ...)` copies a finished run's outputs (role adapters or the
Phase-2 head, plus the run's log.csv and metrics.jsonl) into the artifact folder
(`jaxkv.artifacts`), computes the check metric on the first `CHECK_SESSIONS`
held-out sessions from the copied files, and writes the manifest.
`tests/test_artifacts.py` replays those sessions from tau2, confirms their digest
and recomputes the check with the same functions:

  role_adapters  `lora_check`: the 4 x 3 held-out NLL matrix (base model and each
                 adapter x each role's calls), up to 4 calls per role.
  pruner_head    `head_check`: held-out recall@C* of the Phase-1 rule and of the
                 Phase-2 head, and the eq. 8 validation loss, on the sessions'
                 features (extracted from the frozen model, as in training).

The manifest's `held_out` block is the run's own final evaluation on the whole
held-out file (metrics.jsonl), the figure the README quotes.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shutil

import numpy as np

from jaxkv import artifacts
from jaxkv.data import agents, traces

CHECK_SESSIONS = 2            # role adapters: the first two held-out sessions
CHECK_CALLS_PER_ROLE = 4
CHECK_HEAD_ROWS = 8            # head: the first held-out sessions giving this many rows
CHECK_HEAD_SESSIONS = 6        # ... but at most this many sessions
KINDS = {"role_adapters": artifacts.ROLE_ADAPTERS, "pruner_head": artifacts.PRUNER_HEAD}
# |recomputed - manifest| allowed by the test: float reassociation across CPUs
# moves an NLL by ~1e-6 and can reorder near-tied scores at the recall cut.
CHECK_ATOL = {"nll": 1e-3, "recall": 0.02, "val_loss": 1e-3}


def lora_check(llm, lcfg, lora_w, sessions, cfg) -> dict:
  """{"nll": {"base" | role: {role: mean NLL}}} of `sessions`' agent calls.

  Trajectories are built as training builds its held-out set (`cfg`:
  LoraTrainConfig; seed + 1 for the negative answers), over these sessions only.
  """
  from jaxkv.training import lora_train  # pylint: disable=import-outside-toplevel

  trajs = agents.build_all(sessions, llm.tokenizer, negative_rate=cfg.negative_rate,
                           seed=cfg.seed + 1)
  ex = lora_train.examples(trajs, cfg.max_context, cfg.max_target)
  val = lora_train.split_by_role(ex, CHECK_CALLS_PER_ROLE)
  params = {f"{ab}_{t}": getattr(lora_w, ab)[t] for t in lcfg.targets for ab in ("a", "b")}
  out = lora_train.evaluate(params, llm.weights, val, lcfg=lcfg, graphdef=llm.graphdef,
                            attn_impl=cfg.attn_impl)
  out["calls"] = {agents.ROLES[r]: len(v) for r, v in val.items()}
  return out


def session_rows(extractor, session, n_q: int) -> list:
  """Phase-2 rows of one session, extracted fresh (not from the feature cache)."""
  from jaxkv.training import features  # pylint: disable=import-outside-toplevel
  return features.unpack_rows(session.id, features.pack_session(extractor.session(session)), n_q)


def head_check(llm, head, sessions, cfg, rows=None) -> dict:
  """Held-out recall / loss of a Phase-2 head (`cfg`: PrunerTrainConfig) on the rows
  of `sessions` (extracted in order by one `Extractor`, unless given)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from jaxkv.training import features, train  # pylint: disable=import-outside-toplevel

  if rows is None:
    ex = features.Extractor(llm, cfg)
    rows = [r for s in sessions for r in session_rows(ex, s, cfg.n_q)]
  graphdef, state = head
  m = train.evaluate(graphdef, nnx.to_pure_dict(state), rows, cfg)
  keep = ("val_rows", "val_loss", "recall_budget", "recall_phase1", "recall_phase2", "alpha")
  return {k: m[k] for k in keep}


def compare(got: dict, want: dict, path: str = "") -> list[str]:
  """Differences beyond CHECK_ATOL between two check results (nested dicts)."""
  bad = []
  for k, w in want.items():
    g, name = got.get(k), f"{path}{k}"
    if isinstance(w, dict):
      bad += compare(g or {}, w, name + ".")
    elif isinstance(w, float):
      tol = next((v for key, v in CHECK_ATOL.items() if key in name), 1e-6)
      if g is None or not abs(g - w) <= tol:
        bad.append(f"{name}: {g} vs {w} (atol {tol})")
    elif g != w:
      bad.append(f"{name}: {g!r} vs {w!r}")
  return bad


def _data(path: str) -> dict:
  sessions = traces.load_toolbench(path, strict=False)
  return dict(path=path, sha256=artifacts.sha256(path), sessions=len(sessions),
              made_by=traces.made_by(sessions))


def _last_metrics(run: pathlib.Path) -> dict:
  lines = (run / "metrics.jsonl").read_text().splitlines()
  return json.loads(lines[-1])


def _train_seconds(run: pathlib.Path, column: str) -> float | None:
  """Sum of a per-step time column of log.csv (None if the log has none)."""
  with open(run / "log.csv", newline="") as f:
    vals = [float(r[column]) for r in csv.DictReader(f) if r.get(column)]
  return round(sum(vals), 1) if vals else None


def ship(kind: str, cfg, command: str, *, dest: str | None = None, llm=None,
         commit: str | None = None, log=print) -> pathlib.Path:
  """Copies run `cfg.out_dir` into the artifact folder and writes its manifest.

  The manifest's commit is, in order: `commit`, the run's run.json (written by the
  training scripts when they start), the repository's HEAD."""
  import jaxkv  # pylint: disable=import-outside-toplevel

  if kind not in KINDS:
    raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
  run = pathlib.Path(cfg.out_dir)
  src = run / ("adapters" if kind == "role_adapters" else "head")
  if not src.is_dir() or not (run / "metrics.jsonl").is_file():
    raise FileNotFoundError(f"{run}: no finished run here ({src.name}/ and metrics.jsonl); "
                            f"train first: {command}")
  out = pathlib.Path(dest or KINDS[kind])
  if out.exists():
    shutil.rmtree(out)
  shutil.copytree(src, out)
  for name in ("log.csv", "metrics.jsonl"):
    shutil.copy2(run / name, out / name)
  llm = llm or jaxkv.load(cfg.model, dtype=cfg.dtype, scan_layers=True)
  held = traces.load_toolbench(cfg.val_traces, strict=False)
  if kind == "role_adapters":
    sessions = held[:CHECK_SESSIONS]
    lcfg, w = artifacts.load_role_adapters(llm.config, out)
    metric = lora_check(llm, lcfg, w, sessions, cfg)
    secs = _train_seconds(run, "sec")
  else:
    from jaxkv.training import features  # pylint: disable=import-outside-toplevel
    ex, sessions, rows = features.Extractor(llm, cfg), [], []
    for s in held[:CHECK_HEAD_SESSIONS]:
      sessions.append(s)
      rows += session_rows(ex, s, cfg.n_q)
      if len(rows) >= CHECK_HEAD_ROWS:
        break
    metric = head_check(llm, artifacts.load_pruner_head(out), sessions, cfg, rows=rows)
    secs = _last_metrics(run).get("train_s")
  log(f"check on {[s.id for s in sessions]}: {json.dumps(_plain(metric))}")
  manifest = dict(
      kind=kind, model=cfg.model, command=command, commit=commit or _run_commit(run),
      config=dataclasses.asdict(cfg),
      data=dict(train=_data(cfg.train_traces), held_out=_data(cfg.val_traces)),
      held_out=_last_metrics(run),
      check=dict(sessions=[s.id for s in sessions],
                 sessions_sha256=artifacts.sessions_digest(sessions),
                 atol=CHECK_ATOL, metric=_plain(metric)),
      trained=dict(date=datetime.date.today().isoformat(), train_s=secs,
                   machine=f"{platform.machine()} CPU, {_cores()} cores", jax=_jax_version()))
  path = artifacts.write_manifest(out, manifest)
  log(f"wrote {path}")
  return out


def write_run_info(out_dir: str | pathlib.Path, argv) -> None:
  """out_dir/run.json: the commit and command a training run started with (the first
  start; a resumed run keeps it), for the manifest."""
  path = pathlib.Path(out_dir) / "run.json"
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(commit=artifacts.git_commit(), argv=list(argv),
                                    started=datetime.datetime.now().isoformat(timespec="seconds"))))


def _run_commit(run: pathlib.Path) -> str:
  info = run / "run.json"
  return json.loads(info.read_text())["commit"] if info.is_file() else artifacts.git_commit()


def _cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _jax_version() -> str:
  import jax  # pylint: disable=import-outside-toplevel
  return f"jax {jax.__version__} {jax.default_backend()}"


def _plain(tree):
  """JSON-clean copy (numpy scalars -> float / int)."""
  if isinstance(tree, dict):
    return {k: _plain(v) for k, v in tree.items()}
  if isinstance(tree, (np.floating, np.integer)):
    return tree.item()
  return tree
