r"""Trains LRAgent's plan / action / reflect adapters (shared-A multi-LoRA, jointly).

    jaxkv-train-lora --config=configs/lora_smollm2.py \
        [--config.steps=480] [--config.targets='("q","k","v","o")' --config.rank=4] \
        [--config.out_dir=data_local/runs/lora_smollm2]

1. trajectories: each ToolBench-format session of train_traces / val_traces
   becomes one plan -> action -> tool -> ... -> reflect stream
   (`jaxkv.data.agents`; half of them end on a wrong answer to reflect on);
2. training: every micro-step one agent call, teacher-forced, through its own
   adapter (shared A, per-role B); log.csv per step, Orbax checkpoints in
   out_dir/ckpt (rerunning the same command resumes);
3. evaluation: held-out NLL per role under the base model and each adapter
   (metrics.jsonl), and the adapters in PEFT format in out_dir/adapters/<role>.

(`python scripts/train_lora.py ...` from a clone runs the same command.)
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from absl import logging
from ml_collections import config_flags

from jaxkv import cli
from jaxkv.training.config import LoraTrainConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py", lock_config=True)


def _main(argv):
  del argv
  import jax

  import jaxkv
  from jaxkv.data import agents, traces
  from jaxkv.training import lora_train

  cli.require({"--config": _CONFIG.value}, "--config=configs/lora_smollm2.py")
  logging.set_verbosity(logging.WARNING)
  cfg = cli.load_config(LoraTrainConfig, _CONFIG.value)

  def log(msg):
    print(msg, file=sys.stderr, flush=True)

  from jaxkv.training import shipping
  shipping.write_run_info(cfg.out_dir, sys.argv)   # commit + command, for the manifest

  t0 = time.perf_counter()
  # Compiled steps persist across reruns and resumes (one shape per length bucket).
  jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(cfg.out_dir) / "xla"))
  llm = jaxkv.load(cfg.model, dtype=cfg.dtype, scan_layers=True)   # training: lax.scan
  sets = []
  for path, cap, seed in ((cfg.train_traces, cfg.max_train_sessions, cfg.seed),
                          (cfg.val_traces, cfg.max_val_sessions, cfg.seed + 1)):
    errors: list = []
    sessions = traces.load_toolbench(path, strict=False, errors=errors)[:cap or None]
    trajs = agents.build_all(sessions, llm.tokenizer, negative_rate=cfg.negative_rate, seed=seed)
    ex = lora_train.examples(trajs, cfg.max_context, cfg.max_target)
    log(f"{path}: {len(sessions)} sessions ({len(errors)} malformed skipped), {len(ex)} calls "
        + json.dumps({r: sum(e.role == i for e in ex) for i, r in enumerate(agents.ROLES)}))
    sets.append(ex)
  res = lora_train.train(cfg, llm, sets[0], sets[1], log=log)
  final = res["history"][-1] if res["history"] else None
  print("SUMMARY " + json.dumps(dict(train_s=round(res["train_s"], 1),
                                     total_s=round(time.perf_counter() - t0, 1),
                                     adapters=res["adapters"], final=final)))


def main() -> None:
  """The `jaxkv-train-lora` command (and `python scripts/train_lora.py`)."""
  cli.run(_main, LoraTrainConfig, doc=__doc__)


if __name__ == "__main__":
  main()
