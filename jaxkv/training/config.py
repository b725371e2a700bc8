"""Configuration of IntentKV Phase-2 training (section 3.5, 4.1 Training, appendix A).

`PrunerTrainConfig` is a frozen dataclass like the ones in `jaxkv.config`;
`configs/pruner_smollm2.py` returns it through `jaxkv.config.to_config_dict`
and `scripts/train_pruner.py` reads it back with `from_config_dict`, so every
field can be overridden as `--config.<field>=<value>`.

Paper values: AdamW lr 1e-3, weight decay 0.01, grad-accum 8, seed 42, two
epochs of reservoir-sampled examples (3,000 per epoch for Qwen3-8B), rho =
0.05, gamma = 0.01, eta = 0.001, BCE positive-rate clip [0.02, 0.5], top-64
hard negatives, lambda = 0.5, five-call lookahead. Knobs the paper leaves
open (chunking, caps, the recall budget C*) are documented per field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json


@dataclasses.dataclass(frozen=True)
class PrunerTrainConfig:
  """Phase-2 residual-head training run."""
  model: str = "smollm2-135m"          # preset / .gguf / HF dir (jaxkv.load)
  dtype: str = "float32"               # frozen model + KV pool dtype
  train_traces: str = "data_local/tau2_train.json"
  val_traces: str = "data_local/tau2_heldout.json"
  cache_dir: str = "data_local/pruner_features"   # on-disk feature cache
  out_dir: str = "runs/pruner_smollm2"            # checkpoints, logs, final head
  # --- feature extraction (frozen model)
  chunk_tokens: int = 1024             # history prefill chunk (<= max_chunk)
  max_chunk: int = 4096                # hard cap on any chunk (paper: 4,096)
  max_prompt_tokens: int = 8192        # rows with longer prompts are skipped (model context)
  max_train_sessions: int = 0          # 0 = all sessions of train_traces
  max_val_sessions: int = 0            # 0 = all sessions of val_traces
  decay: float = 0.5                   # lambda of eq. 2
  lookahead: int = 5                   # future tool calls scanned for labels
  n_q: int = 512                       # cap on K_bar^q rows (last n_q span positions)
  attn_impl: str = "auto"
  # --- optimisation
  epochs: int = 2
  examples_per_epoch: int = 3000       # reservoir sample size (capped at #rows)
  lr: float = 1e-3
  weight_decay: float = 0.01
  grad_accum: int = 8                  # optax.MultiSteps every_k_schedule
  seed: int = 42
  # --- loss (eq. 8)
  rho: float = 0.05
  gamma: float = 0.01
  eta: float = 0.001
  pos_clip: tuple = (0.02, 0.5)
  hard_negatives: int = 64
  # --- validation / bookkeeping
  recall_budget: int = 256             # C*: candidates kept for recall@C*
  ckpt_every: int = 0                  # optimizer updates between checkpoints (0: per epoch)
  max_to_keep: int = 3
  progress: bool = True

  def __post_init__(self):
    object.__setattr__(self, "pos_clip", tuple(float(x) for x in self.pos_clip))
    if len(self.pos_clip) != 2 or not 0 < self.pos_clip[0] <= self.pos_clip[1] < 1:
      raise ValueError(f"pos_clip must be (lo, hi) with 0 < lo <= hi < 1, got {self.pos_clip}")
    if not 16 <= self.chunk_tokens <= self.max_chunk <= 4096:
      raise ValueError("need 16 <= chunk_tokens <= max_chunk <= 4096 (section 3.5)")
    if self.epochs < 1 or self.grad_accum < 1 or self.examples_per_epoch < 1:
      raise ValueError("epochs, grad_accum and examples_per_epoch must be >= 1")
    if self.hard_negatives < 1 or self.n_q < 1 or self.recall_budget < 1:
      raise ValueError("hard_negatives, n_q and recall_budget must be >= 1")


# Fields that change the extracted features (and so the cache key).
FEATURE_FIELDS = ("model", "dtype", "chunk_tokens", "max_chunk", "max_prompt_tokens", "decay",
                  "lookahead", "attn_impl")
FEATURE_VERSION = 1


def feature_key(cfg: PrunerTrainConfig, trace_path: str, trace_digest: str,
                max_sessions: int) -> str:
  """Cache key: hash of the model, the trace file (path + content digest) and settings."""
  blob = {f: getattr(cfg, f) for f in FEATURE_FIELDS}
  blob.update(trace=str(trace_path), digest=trace_digest, max_sessions=max_sessions,
              version=FEATURE_VERSION)
  return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
