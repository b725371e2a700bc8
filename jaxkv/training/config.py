"""The training runs' frozen configs: the IntentKV Phase-2 head and the LRAgent role adapters.

Frozen dataclasses like those of `jaxkv.config`, so `to_config_dict` /
`from_config_dict` and `--config.<field>=<value>` overrides work. They live
apart from the trainers (`jaxkv.training.features`, `jaxkv.training.lora_train`,
which import JAX) so that `configs/*.py` and the commands' `--help` load without
JAX. Each field's trailing comment (continued on aligned comment lines) is its
description in `--help` and the docs (`jaxkv.cli.fields`).
"""

from __future__ import annotations

import dataclasses

from jaxkv.config import LoraConfig


@dataclasses.dataclass(frozen=True)
class PrunerTrainConfig:
  """Phase-2 residual-head training run (section 3.5, 4.1 Training, appendix A).

  Paper values: AdamW lr 1e-3, weight decay 0.01, grad-accum 8, seed 42, two
  epochs of reservoir-sampled examples (3,000 per epoch for Qwen3-8B), rho =
  0.05, gamma = 0.01, eta = 0.001, BCE positive-rate clip [0.02, 0.5], top-64
  hard negatives, lambda = 0.5, five-call lookahead. Knobs the paper leaves
  open (chunking, caps, the recall budget C*) are documented per field. Its
  feature fields hash into the feature cache's key (`features.feature_key`).
  """
  model: str = "smollm2-135m"          # Model whose KV the head learns to prune: a preset
                                       # name, or the path of a .gguf file or a Hugging Face
                                       # model directory.
  dtype: str = "float32"               # Data type of the frozen model and of its KV pool.
  train_traces: str = "data_local/tau2_train.json"  # ToolBench-format trace file the head
                                                    # trains on (scripts/make_traces.py
                                                    # makes it).
  val_traces: str = "data_local/tau2_heldout.json"  # Held-out trace file the validation
                                                    # metrics are measured on.
  cache_dir: str = "data_local/pruner_features"   # Folder of the on-disk feature cache:
                                                  # features are extracted once per model,
                                                  # trace file and feature settings.
  out_dir: str = "data_local/runs/pruner_smollm2"  # Folder of the run's checkpoints, logs
                                                   # and final head.
  # --- feature extraction (frozen model)
  chunk_tokens: int = 1024             # Tokens per history prefill chunk while features are
                                       # extracted (at most max_chunk).
  max_chunk: int = 4096                # Longest chunk of any prefill, in tokens (the paper's
                                       # 4,096).
  max_prompt_tokens: int = 8192        # A turn whose prompt is longer than this ends its
                                       # session's replay (the model's context length).
  max_train_sessions: int = 0          # Sessions read from train_traces; 0 reads them all.
  max_val_sessions: int = 0            # Sessions read from val_traces; 0 reads them all.
  decay: float = 0.5                   # How fast the session's query memory forgets (lambda
                                       # of eq. 2), as in serving (pruning.intent_decay).
  normalize_query: bool = True         # Scale each query's encoding to unit length before it
                                       # enters the memory, as serving does.
  lookahead: int = 5                   # Future tool calls scanned to label which history
                                       # tokens are evidence.
  n_q: int = 4096                      # Most key rows of the query span the head reads, the
                                       # span's last ones (the rows of K_bar^q); equal to
                                       # max_chunk it reads them all, as serving does.
  attn_impl: str = "auto"              # Attention kernel of the frozen model: auto, reference,
                                       # pallas or interpret (as engine.attention_impl).
  # --- optimisation
  epochs: int = 2                      # Passes over the sampled training examples.
  examples_per_epoch: int = 3000       # Examples drawn per epoch by reservoir sampling (at
                                       # most the rows there are).
  lr: float = 1e-3                     # AdamW learning rate.
  weight_decay: float = 0.01           # AdamW weight decay.
  grad_accum: int = 8                  # Examples whose gradients are summed into one
                                       # optimiser update.
  seed: int = 42                       # Seed of the head's initialisation and of the example
                                       # sampling.
  # --- loss (eq. 8)
  rho: float = 0.05                    # Weight of the ranking loss (rho in eq. 8).
  gamma: float = 0.01                  # Weight of the keep penalty, the mean sigmoid score
                                       # (gamma in eq. 8).
  eta: float = 0.001                   # Weight of the memory-norm term (eta in eq. 8).
  pos_clip: tuple = (0.02, 0.5)        # Range (low, high) a row's share of positive tokens is
                                       # clipped to before it weights the positives in the
                                       # binary cross-entropy.
  hard_negatives: int = 64             # Highest-scoring negatives each positive is ranked
                                       # against in the ranking loss.
  # --- validation / bookkeeping
  recall_budget: int = 256             # Candidates kept when validation measures recall
                                       # (C*).
  ckpt_every: int = 0                  # Optimiser updates between checkpoints; 0 saves one
                                       # per epoch.
  max_to_keep: int = 3                 # Checkpoints kept on disk; older ones are deleted.
  progress: bool = True                # Show progress bars.

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


@dataclasses.dataclass(frozen=True)
class LoraTrainConfig:
  """Joint shared-A role-adapter training (see `jaxkv.training.lora_train`)."""
  model: str = "smollm2-135m"          # Base model the adapters are trained on: a preset name,
                                       # or the path of a .gguf file or a Hugging Face model
                                       # directory.
  dtype: str = "float32"               # Data type of the frozen base model.
  train_traces: str = "data_local/tau2_train.json"  # ToolBench-format trace file whose
                                                    # sessions become the training
                                                    # trajectories (scripts/make_traces.py).
  val_traces: str = "data_local/tau2_heldout.json"  # Held-out trace file of the evaluations.
  out_dir: str = "data_local/runs/lora_smollm2"  # Folder of the run's log, metrics,
                                                 # checkpoints and adapters.
  max_train_sessions: int = 0          # Sessions read from train_traces; 0 reads them all.
  max_val_sessions: int = 0            # Sessions read from val_traces; 0 reads them all.
  rank: int = 8                        # Rank of the adapters (the width of the shared A).
  alpha: float = 16.0                  # LoRA scale: an adapter's update is multiplied by
                                       # alpha / rank.
  targets: tuple = ("q", "v")          # Attention projections that get adapters, from q, k, v
                                       # and o (LRAgent's default: q and v; all four for the
                                       # ablation).
  max_context: int = 512               # Tokens of trajectory before an agent call that the
                                       # model sees (the last ones).
  max_target: int = 64                 # Gold output tokens scored per agent call (the first
                                       # ones).
  steps: int = 480                     # Training micro-steps, one agent call each.
  grad_accum: int = 4                  # Micro-steps whose gradients are summed into one
                                       # optimiser update.
  lr: float = 5e-4                     # AdamW learning rate after the warm-up.
  warmup: int = 20                     # Optimiser updates of linear learning-rate warm-up.
  weight_decay: float = 0.0            # AdamW weight decay.
  seed: int = 42                       # Seed of the adapters' initialisation and of the
                                       # example stream.
  negative_rate: float = 0.5           # Share of trajectories that end on a wrong answer, for
                                       # the reflect role to judge.
  val_examples_per_role: int = 12      # Held-out agent calls per role in each evaluation.
  eval_every: int = 0                  # Micro-steps between evaluations; 0 evaluates at the
                                       # start and at the end only.
  ckpt_every: int = 100                # Micro-steps between checkpoints.
  attn_impl: str = "auto"              # Attention kernel: auto, reference, pallas or
                                       # interpret (as engine.attention_impl).
  progress: bool = True                # Show a progress bar.

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    LoraConfig(rank=self.rank, alpha=self.alpha, targets=self.targets)   # validates
    if self.max_context < 16 or self.max_target < 1 or self.steps < 1 or self.grad_accum < 1:
      raise ValueError("need max_context >= 16, max_target >= 1, steps >= 1, grad_accum >= 1")

  def lora_config(self) -> LoraConfig:
    """The adapters' LoraConfig: one adapter per agent role."""
    from jaxkv.data import agents  # pylint: disable=import-outside-toplevel
    return LoraConfig(rank=self.rank, alpha=self.alpha, targets=self.targets, names=agents.ROLES)
