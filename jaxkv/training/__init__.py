"""IntentKV Phase-2 training: frozen-model features, the eq. 8 loss, the Optax loop.

`features` extracts and caches per-row features, `loss` holds each term of
eq. 8, `train` runs AdamW + MultiSteps with Orbax checkpoints; `load_head`
reads a trained head back as (graphdef, state).
"""

from jaxkv.training.features import PrunerTrainConfig
from jaxkv.training.train import load_head, save_head

__all__ = ["PrunerTrainConfig", "load_head", "save_head"]
