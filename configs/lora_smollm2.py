"""LRAgent role adapters on SmolLM2-135M over the tau2 traces (shared-A, Q/V, r = 8).

    python scripts/train_lora.py --config=configs/lora_smollm2.py

480 micro-steps (120 AdamW updates of 4), 512 tokens of context per call,
chosen to fit the one-hour CPU budget of issue 6: a micro-step takes ~6.3 s on a
2-core CPU and each held-out evaluation (start, end) ~4-6 min. The QKVO ablation of
LRAgent uses r = 4 on Q, K, V, O (same parameter count as r = 8 on Q, V):
    --config.targets='("q","k","v","o")' --config.rank=4 --config.out_dir=data_local/runs/lora_qkvo
"""

from jaxkv.config import to_config_dict
from jaxkv.training.config import LoraTrainConfig


def get_config():
  return to_config_dict(LoraTrainConfig(
      model="smollm2-135m",
      train_traces="data_local/tau2_train.json",
      val_traces="data_local/tau2_heldout.json",
      out_dir="data_local/runs/lora_smollm2",
      rank=8, alpha=16.0, targets=("q", "v"),
      max_context=512, max_target=64,
      steps=480, grad_accum=4, lr=5e-4, warmup=20,
  ))
