"""IntentKV Phase-2 residual-head training for SmolLM2-135M on the tau2 traces.

    python scripts/train_pruner.py --config=configs/pruner_smollm2.py \
        [--config.max_train_sessions=20] [--config.epochs=2] [--config.out_dir=data_local/runs/x]

Paper settings (section 4.1, appendix A): AdamW lr 1e-3, wd 0.01, grad-accum 8,
seed 42, two epochs, rho/gamma/eta = 0.05/0.01/0.001, clip [0.02, 0.5], top-64
hard negatives. The tau2 train file has ~710 assistant-turn rows (fewer after
dropping rows without evidence), so examples_per_epoch = 3000 means every row
each epoch. Recall is measured at C* = 256 candidates.
"""

from jaxkv.config import to_config_dict
from jaxkv.training import PrunerTrainConfig


def get_config():
  return to_config_dict(PrunerTrainConfig(
      model="smollm2-135m",
      train_traces="data_local/tau2_train.json",
      val_traces="data_local/tau2_heldout.json",
      cache_dir="data_local/pruner_features",
      out_dir="data_local/runs/pruner_smollm2",
      chunk_tokens=1024,
      max_prompt_tokens=8192,
      examples_per_epoch=3000,
      epochs=2,
      recall_budget=256,
  ))
