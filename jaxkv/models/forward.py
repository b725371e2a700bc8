"""The forward contract: what the model takes besides tokens, and what it returns.

Every caller (the driver's chunk step and decode scan, LoRA training, tests)
talks to `Transformer.__call__` through these small pytrees instead of a
growing list of keyword arguments. Each option is a registered dataclass;
fields that change the traced program (modes, layer indices) are static
(`metadata=dict(static=True)`), so a jitted caller recompiles only when one of
them changes, and arrays travel as ordinary pytree leaves.

- `LoraInputs`: shared-A multi-LoRA weights, each row's adapter, the value-cache
  mode (LRAgent) and where the low-rank values go.
- `LayerWindow`: run only layers [start, stop), optionally from a given hidden
  state (DroidSpeak's layer-selective recompute).
- `Capture`: what to hand back besides the output (post-RoPE queries for the
  pruning scorers, the hidden state entering a layer for DroidSpeak's E-cache).
- `Recompute`: selective recompute (CacheBlend / SemShareKV / seed 002): at
  layer l only the chunk tokens listed in `index[l]` are recomputed, attention
  still reads the whole slot map, and the other tokens keep the K/V already in
  the pool at that layer (spliced in from elsewhere).
- `ForwardOutput`: hidden states, the new pool, and the captures asked for.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxkv.kv import state as kv_state
from jaxkv.models import lora as lora_lib

LORA_MODES = ("full", "decoupled")


def _static(default=dataclasses.MISSING):
  return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraInputs:
  """Shared-A multi-LoRA for one call.

  mode: "full": every target's delta is added to its projection, so the pool
    holds the writing adapter's full K/V (NonShared / FullShared);
    "decoupled" (LRAgent BaseShared / BaseLRShared): the pool's v holds the base
    value x W_v, `kv.vlr` the rank-r value x A_v * scale, and attention expands
    each row's own B_v inside Flash-LoRA-Attention.
  """
  weights: lora_lib.LoraWeights
  adapter_ids: jax.Array                     # [B] int32; -1 selects the base model
  lr_write_slots: jax.Array | None = None    # [B, C] low-rank value slots (None: the
                                             # K/V write slots); BaseShared writes its
                                             # own LR values where the base is shared
  mode: str = _static("full")

  def __post_init__(self):
    if self.mode not in LORA_MODES:
      raise ValueError(f"lora mode must be one of {LORA_MODES}, got {self.mode!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWindow:
  """Run only layers start <= l < stop (their KV is written, the other layers'
  pool entries are untouched). The final norm is applied only if stop = L."""
  hidden_in: jax.Array | None = None   # [B, C, D] input of layer `start` (None: embeddings)
  start: int = _static(0)
  stop: int | None = _static(None)     # None: the last layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Capture:
  """What the forward pass hands back besides its output (all static)."""
  q: bool = _static(False)              # every run layer's post-RoPE q, as attention reads it
                                        # (under Recompute: the recomputed rows [.., R, ..]
                                        # in index order; padding rows are meaningless)
  hidden_at: int | None = _static(None)  # the hidden state entering this layer
  # the hidden states entering each listed layer, start <= l <= stop (l = stop: the
  # window's output before any final norm); segment reuse's multicut boundaries
  hidden_cuts: tuple[int, ...] = _static(())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Recompute:
  """Selective recompute: per layer, which chunk tokens are recomputed.

  index[l, b, r] is a token index into the chunk (0 <= i < C), or -1 for
  padding (R is a static, bucketed width). At layer l the listed tokens get new
  hidden states and write their K/V; attention reads the full slot map, so the
  other tokens contribute whatever K/V the pool holds for them (spliced rows).
  A token left out of layer l keeps the hidden state it last had: with nested
  sets (S_{l+1} within S_l, CacheBlend) that is never read again; with
  arbitrary sets a token re-entering later resumes from its stale state, as
  in SemShareKV's per-layer recompute sets. The final hidden state of a token
  is therefore meaningful only if it is in the last layer's set.
  """
  index: jax.Array   # [L, B, R] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
  """What one forward pass returns. Logits: `Transformer.logits(out.hidden)`."""
  hidden: jax.Array                  # [B, C, D]; final-normed when the last layer ran
  kv: kv_state.KVPool | None         # the updated pool (None when run without a cache)
  q: jax.Array | None = None         # [L', B, C or R, Hq, D] post-RoPE queries (Capture.q)
  hidden_at: jax.Array | None = None  # [B, C, D] input of layer Capture.hidden_at
  hidden_cuts: jax.Array | None = None  # [K, B, C, D] inputs of Capture.hidden_cuts
