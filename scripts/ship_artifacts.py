r"""Copies a finished training run into artifacts/ with its manifest (jaxkv.artifacts).

    python scripts/ship_artifacts.py --kind=role_adapters --config=configs/lora_smollm2.py \
        [--config.steps=240 ...: the overrides the training run used]
    python scripts/ship_artifacts.py --kind=pruner_head --config=configs/pruner_smollm2.py \
        [--config.max_train_sessions=64 ...]

Give the same --config and overrides as the training command: the run is read
from config.out_dir, and the manifest records that command, the trace files'
sha256, the commit (from out_dir/run.json, which the training scripts write when they
start), the run's final held-out evaluation and a check metric on the first held-out
sessions (recomputed from the copied files; tests/test_artifacts.py recomputes it).
"""

from __future__ import annotations

import shlex
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxkv import cli

_KIND = flags.DEFINE_enum("kind", None, ["role_adapters", "pruner_head"], "what to ship")
_DEST = flags.DEFINE_string("dest", None, "artifact folder (default: jaxkv.artifacts' path)")
_COMMIT = flags.DEFINE_string("commit", None, "commit the run trained with (default: the "
                              "run's run.json, written when training starts, else HEAD)")
_CONFIG = config_flags.DEFINE_config_file("config", None, "the training run's configs/<name>.py",
                                          lock_config=True)
SCRIPTS = {"role_adapters": "scripts/train_lora.py", "pruner_head": "scripts/train_pruner.py"}


def main(argv):
  del argv
  from jaxkv.training import PrunerTrainConfig, shipping
  from jaxkv.training.lora_train import LoraTrainConfig

  if _KIND.value is None or _CONFIG.value is None:
    raise app.UsageError("--kind and --config are required")
  logging.set_verbosity(logging.WARNING)
  cls = LoraTrainConfig if _KIND.value == "role_adapters" else PrunerTrainConfig
  cfg = cli.load_config(cls, _CONFIG.value)
  train_args = [a for a in sys.argv[1:] if a.startswith("--config")]
  command = shlex.join(["python", SCRIPTS[_KIND.value], *train_args])   # pastes into a shell
  shipping.ship(_KIND.value, cfg, command, dest=_DEST.value, commit=_COMMIT.value,
                log=lambda m: print(m, file=sys.stderr, flush=True))


if __name__ == "__main__":
  cli.run(main)
