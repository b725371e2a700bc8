"""IntentKV Phase-2 training: frozen-model features, the eq. 8 loss, the Optax loop.

`features` extracts and caches per-row features, `loss` holds each term of
eq. 8, `train` runs AdamW + MultiSteps with Orbax checkpoints; `load_head`
reads a trained head back as (graphdef, state). The runs' configs are in
`config` (no JAX), so `from jaxkv.training import PrunerTrainConfig` stays light:
`load_head` and `save_head` import the trainer (and JAX) on first use.
"""

from __future__ import annotations

import importlib
import typing

from jaxkv.training.config import PrunerTrainConfig

if typing.TYPE_CHECKING:   # imported on first use (below)
  from jaxkv.training.train import load_head, save_head

__all__ = ["PrunerTrainConfig", "load_head", "save_head"]


def __getattr__(name: str):
  """`load_head` / `save_head` on first use (PEP 562); submodules as usual."""
  if name in ("load_head", "save_head"):
    value = getattr(importlib.import_module("jaxkv.training.train"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'jaxkv.training' has no attribute {name!r}")
