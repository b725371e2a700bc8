r"""Trains the IntentKV Phase-2 residual head (sections 3.3, 3.5; appendix A/H).

    jaxkv-train-pruner --config=configs/pruner_smollm2.py \
        [--config.max_train_sessions=20 --config.max_val_sessions=8] \
        [--config.out_dir=data_local/runs/pruner_smollm2] [--config.epochs=2]

1. features: the frozen model replays every train / val session (cached on
   disk under cache_dir, keyed by model + trace file + settings; a rerun or an
   interrupted extraction skips what is stored);
2. training: AdamW + MultiSteps on the residual head only, per-step loss and
   alpha in out_dir/log.csv, per-epoch validation (loss, recall@C* of the
   Phase-1 rule vs Phase-2) in out_dir/metrics.jsonl, Orbax checkpoints in
   out_dir/ckpt (rerunning the same command resumes from the latest);
3. the final head is saved to out_dir/head (`jaxkv.training.load_head`) and
   its path printed.

(`python scripts/train_pruner.py ...` from a clone runs the same command.)
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import logging
from ml_collections import config_flags

from jaxkv import cli
from jaxkv.training.config import PrunerTrainConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py", lock_config=True)


def _main(argv):
  del argv
  from jaxkv.training import features, train

  cli.require({"--config": _CONFIG.value}, "--config=configs/pruner_smollm2.py")
  logging.set_verbosity(logging.WARNING)      # Orbax logs every save at INFO
  cfg = cli.load_config(PrunerTrainConfig, _CONFIG.value)
  # compiled frozen-model steps persist across runs (one per chunk/width bucket)
  import jax
  jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(cfg.cache_dir) / "xla"))

  def log(msg):
    print(msg, file=sys.stderr, flush=True)

  from jaxkv.training import shipping
  shipping.write_run_info(cfg.out_dir, sys.argv)   # commit + command, for the manifest

  t0 = time.perf_counter()
  llm = None
  if not features.all_cached(cfg):
    import jaxkv
    llm = jaxkv.load(cfg.model, dtype=cfg.dtype, scan_layers=True)   # training: lax.scan
  tr = features.load_or_extract(cfg, cfg.train_traces, cfg.max_train_sessions, llm=llm,
                                progress=cfg.progress, log=log)
  va = features.load_or_extract(cfg, cfg.val_traces, cfg.max_val_sessions, llm=llm,
                                progress=cfg.progress, log=log)
  t_feat = time.perf_counter() - t0
  val_rows = [r for rows in va.values() for r in rows]
  tr = {k: v for k, v in tr.items() if v}
  log(f"features ready in {t_feat:.1f}s")
  res = train.train(cfg, tr, val_rows, log=log)
  summary = dict(features_s=round(t_feat, 1), train_s=round(res["train_s"], 1),
                 total_s=round(time.perf_counter() - t0, 1), head=res["head"],
                 final=res["history"][-1] if res["history"] else None)
  print("SUMMARY " + json.dumps(summary))
  print(f"final head: {res['head']}")


def main() -> None:
  """The `jaxkv-train-pruner` command (and `python scripts/train_pruner.py`)."""
  cli.run(_main, PrunerTrainConfig, doc=__doc__)


if __name__ == "__main__":
  main()
