"""Training curves of a Phase-2 head run or a role-adapter run as a PNG.

    python scripts/plot_training.py --run=data_local/runs/pruner_smollm2 \
        --out=docs/plots/training_pruner_head.png
    python scripts/plot_training.py --run=data_local/runs/lora_smollm2

`scripts/report.py` draws both from the shipped runs in artifacts/.

Phase-2 head (`jaxkv.training.train`: log.csv per micro-step with loss terms and
alpha, metrics.jsonl per epoch). Panels: (1) training loss per micro-step and
its moving average (window --smooth), with the per-epoch validation loss as
markers; (2) alpha per micro-step; (3) validation recall@C* of Phase-1 (the
rule) vs Phase-2 per epoch.

Role adapters (`jaxkv.training.lora_train`: log.csv has a role column,
metrics.jsonl the held-out NLL matrix per evaluation). Panels: (1) the moving
average of the training loss per role; (2) held-out NLL of each role under its
own adapter and under the base model, per evaluation.
Needs matplotlib (`pip install -e ".[bench]"`, done by scripts/setup.sh).
"""

from __future__ import annotations

import csv
import json
import pathlib

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this module
  next to other absl scripts never clashes)."""
  flags.DEFINE_string("run", None, "training run directory (out_dir of train_pruner.py or "
                      "train_lora.py)")
  flags.DEFINE_string("out", None, "PNG path (default: <run>/training.png)")
  flags.DEFINE_integer("smooth", 64, "moving-average window over micro-steps")


def read_run(run: pathlib.Path) -> tuple[dict, list[dict]]:
  """(columns of log.csv as float arrays, validation records of metrics.jsonl)."""
  log = run / "log.csv"
  if not log.is_file():
    raise FileNotFoundError(f"{log} not found: is {run} a train_pruner.py out_dir?")
  with log.open() as f:
    rows = list(csv.DictReader(f))
  if not rows:
    raise ValueError(f"{log} has no training steps yet")
  cols = {k: np.array([float(r[k]) for r in rows]) for k in ("micro", "loss", "alpha", "epoch")}
  cols["step"] = np.arange(len(rows))
  metrics = []
  mpath = run / "metrics.jsonl"
  if mpath.is_file():
    metrics = [json.loads(x) for x in mpath.read_text().splitlines() if x.strip()]
  return cols, metrics


def moving_average(x: np.ndarray, w: int) -> np.ndarray:
  """Trailing mean over the last min(w, i + 1) values (same length as x)."""
  c = np.cumsum(np.concatenate([[0.0], x]))
  i = np.arange(1, x.size + 1)
  lo = np.maximum(0, i - w)
  return (c[i] - c[lo]) / (i - lo)


def _is_lora_run(run: pathlib.Path) -> bool:
  with (run / "log.csv").open() as f:
    return "role" in f.readline().split(",")


def plot_lora(run: pathlib.Path, out: pathlib.Path, smooth: int = 32) -> pathlib.Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with (run / "log.csv").open() as f:
    rows = list(csv.DictReader(f))
  if not rows:
    raise ValueError(f"{run / 'log.csv'} has no training steps yet")
  metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
  roles = list(dict.fromkeys(r["role"] for r in rows))
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for role in roles:
    rs = [r for r in rows if r["role"] == role]
    ax[0].plot([int(r["step"]) for r in rs],
               moving_average(np.array([float(r["loss"]) for r in rs]), smooth), label=role)
  ax[0].set(xlabel="micro-step", ylabel="training NLL (nats/token)",
            title=f"training loss per role (moving average of {smooth} of its steps)")
  ax[0].legend(fontsize=8)
  steps = [m["step"] for m in metrics]
  for k, role in enumerate(roles):
    color = f"C{k}"
    ax[1].plot(steps, [m["nll"][role][role] for m in metrics], "o-", color=color,
               label=f"{role}: own adapter")
    ax[1].plot(steps, [m["nll"]["base"][role] for m in metrics], "s--", color=color, alpha=0.5,
               label=f"{role}: base model")
  ax[1].set(xlabel="micro-step", ylabel="held-out NLL (nats/token)",
            title="held-out NLL per role", xticks=steps)
  ax[1].legend(fontsize=7)
  return save(fig, plt, f"LRAgent role adapters: {run}", out)


def save(fig, plt, title: str, out: pathlib.Path) -> pathlib.Path:
  fig.suptitle(title)
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def plot(run: pathlib.Path, out: pathlib.Path, smooth: int = 64) -> pathlib.Path:
  """The run's curves (role-adapter or Phase-2 head run, told apart by log.csv)."""
  if (run / "log.csv").is_file() and _is_lora_run(run):
    return plot_lora(run, out)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cols, metrics = read_run(run)
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  ax[0].plot(cols["step"], cols["loss"], lw=0.4, alpha=0.35, label="loss (micro-step)")
  ax[0].plot(cols["step"], moving_average(cols["loss"], smooth), lw=1.5,
             label=f"moving average ({smooth})")
  # validation after e epochs sits after the micro-steps of epochs 1..e (log.csv counts from 1)
  val = [(int(np.sum(cols["epoch"] <= m["epoch"])), m["val_loss"]) for m in metrics
         if "val_loss" in m]
  if val:
    ax[0].plot(*zip(*val), "o-", color="k", label="validation loss (per epoch)")
  ax[0].set(xlabel="micro-step (one row each)", ylabel="eq. 8 loss", title="Loss")
  ax[0].legend(fontsize=8)
  ax[1].plot(cols["step"], cols["alpha"], color="tab:red")
  ax[1].set(xlabel="micro-step", ylabel="alpha", title="Residual scale alpha (init 1)")
  ep = [m["epoch"] for m in metrics if "recall_phase1" in m]
  if ep:
    ax[2].plot(ep, [m["recall_phase1"] for m in metrics if "recall_phase1" in m], "s--",
               label="Phase-1 rule")
    ax[2].plot(ep, [m["recall_phase2"] for m in metrics if "recall_phase1" in m], "o-",
               label="Phase-2 (rule + residual)")
    ax[2].set_xticks(ep)
    ax[2].legend(fontsize=8)
  ax[2].set(xlabel="epoch", ylabel="recall@C*", title="Validation future-evidence recall")
  return save(fig, plt, f"IntentKV Phase-2 training: {run}", out)


def main(argv):
  del argv
  if not FLAGS.run:
    raise app.UsageError("--run is required")
  run = pathlib.Path(FLAGS.run)
  out = pathlib.Path(FLAGS.out) if FLAGS.out else run / "training.png"
  print(plot(run, out, FLAGS.smooth))


if __name__ == "__main__":
  define_flags()
  app.run(main)
