"""The engine's own configs: model architecture, LoRA, the KV cache, sampling, the
engine's step shapes and the device mesh, and the ConfigDict round-trip every
command's config takes (`to_config_dict` / `from_config_dict`).

Configs are plain frozen dataclasses. `configs/*.py` return an
`ml_collections.ConfigDict` built from them with `to_config_dict` so that the
CLI can take `--config.field=value` overrides (ConfigDict rejects unknown
fields); `from_config_dict` turns the overridden dict back into the frozen,
validated dataclass.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding variant (HF `rope_scaling` semantics).

  kind: "default" | "linear" | "dynamic" | "llama3" | "yarn".
  """
  kind: str = "default"
  theta: float = 10000.0
  factor: float = 1.0
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  # yarn
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None  # None: 0.1 * ln(factor) + 1
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    kinds = ("default", "linear", "dynamic", "llama3", "yarn")
    if self.kind not in kinds:
      raise ValueError(f"unknown rope kind {self.kind!r}; expected one of {kinds}")
    if self.kind != "default" and self.factor <= 0:
      raise ValueError(f"rope factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer (Llama / Qwen2 / Qwen3 by flags)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope: RopeConfig = RopeConfig()
  rms_norm_eps: float = 1e-6
  max_position: int = 8192
  tie_embeddings: bool = False
  qkv_bias: bool = False     # Qwen2
  qk_norm: bool = False      # Qwen3: RMSNorm over head_dim on q and k
  architecture: str = "llama"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def d_kv(self) -> int:
    """Per-layer K (or V) width: n_kv_heads x head_dim (the segment-reuse paper's accounting)."""
    return self.num_kv_heads * self.head_dim

  def kv_bytes_per_token(self, bytes_per_elem: int) -> int:
    """2 (K and V) x L x d_kv x bytes."""
    return 2 * self.num_layers * self.d_kv * bytes_per_elem


LORA_TARGETS = ("q", "k", "v", "o")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Shared-A multi-LoRA (LRAgent): one down-projection A per target and layer,
  shared by every adapter, and one up-projection B_i per adapter.

  delta_t(x) = (x A_t) B_{t,i} * alpha / rank for each target projection t.
  `names` are the adapters (agent roles) in index order; a sequence selects one
  by index (-1: the base model).
  """
  rank: int = 8
  alpha: float = 16.0
  targets: tuple = ("q", "v")               # subset of q, k, v, o (LRAgent default: Q, V)
  names: tuple = ("plan", "action", "reflect")

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    object.__setattr__(self, "names", tuple(self.names))
    if self.rank < 1:
      raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if bad or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ValueError(f"LoRA targets must be distinct names from {LORA_TARGETS}, "
                       f"got {self.targets}")
    if not self.names or len(set(self.names)) != len(self.names):
      raise ValueError(f"LoRA adapter names must be distinct and non-empty, got {self.names}")

  @property
  def num_adapters(self) -> int:
    return len(self.names)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


# The one page size every runner uses unless its CacheConfig says otherwise:
# the allocation unit of the pool (pages of slots) and MemArt's block size.
PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Size of the paged KV pool (slot 0 is the sentinel, page 0 is reserved)."""
  num_pages: int = 512        # Pages in the KV pool (page 0 is reserved as the sentinel
                              # page).
  page_size: int = PAGE_SIZE  # Token slots per page: the unit in which sequences get pool
                              # memory.
  max_seq_len: int = 2048     # Longest sequence a request may reach, prompt and completion
                              # together, in tokens.
  dtype: str = "float32"      # Data type the pool stores keys and values in (e.g. float32
                              # or bfloat16).

  def __post_init__(self):
    if self.page_size < 1 or self.num_pages < 2:
      raise ValueError("need page_size >= 1 and num_pages >= 2 (page 0 is reserved)")

  @property
  def num_slots(self) -> int:
    return self.num_pages * self.page_size


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1   # a request's seed: an int64, each its own stream


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Per-request sampling; temperature 0 means greedy."""
  temperature: float = 0.0  # Sampling temperature; 0 decodes greedily (always the most
                            # likely token).
  top_k: int = 0            # Sample only among the k most likely tokens; 0 turns this
                            # limit off.
  top_p: float = 1.0        # Sample only among the most likely tokens whose probabilities
                            # add up to this share (nucleus sampling); 1.0 turns it off.
  seed: int = 0             # Seed of a request's random sampling: the same seed gives the
                            # same tokens.
  max_tokens: int = 128     # Most tokens a completion may have.

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not SEED_MIN <= self.seed <= SEED_MAX:
      raise ValueError(f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], "
                       f"got {self.seed}")
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


ATTENTION_IMPLS = ("auto", "reference", "pallas", "triton", "mosaic",  # == jaxkv.ops.IMPLS
                   "interpret")

# XLA compiler options of every jaxkv jit (pass them to your own `jax.jit` when
# you call jaxkv functions inside it, or use `jaxkv.functional.jit`). Empty
# today: XLA's defaults. History: on 2026-11-23 jax 0.10's YNNPACK library
# fusions on XLA:CPU ran this engine's steps slower (decode b8 1.20x, prefill
# 1.09-1.22x faster without them), so this turned them off with
# {"xla_cpu_experimental_ynn_fusion_type": ""}. After the attention rewrite and
# the unrolled layer layout the same A/B (one process, alternating, SmolLM2 fp32,
# 2026-11-24) went the other way: with YNNPACK, unrolled decode b1 / b8 1.01x /
# 1.09x (b8 at 1k context 1.08x), prefill b1 / b8 x 48 tokens 1.13x / 1.06x,
# 512 tokens 1.01x; scan layout 1.25x / 1.01x decode, 1.18x / 1.03x prefill.
# The mechanism stays so a later measurement can set options again; GPU and TPU
# compilers ignore CPU options.
COMPILER_OPTIONS: dict = {}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Batching and step shapes of the engine."""
  max_batch: int = 8          # Requests decoded together: the rows of every decode step.
  prefill_chunk: int = 256    # Prompt tokens a row prefills per step; a longer prompt
                              # takes several steps.
  decode_steps: int = 16      # Decode steps run in one compiled call (a lax.scan) before
                              # the engine returns to admit and finish requests.
  attention_impl: str = "auto"  # Attention kernels: auto (the Pallas Triton kernels on a
                                # GPU, the XLA reference elsewhere), reference, pallas (=
                                # triton), mosaic (paged attention on Mosaic GPU, Hopper,
                                # for a 16-bit model over a pool of the same dtype, e.g.
                                # cache.dtype=bfloat16; other calls and Flash-LoRA run
                                # Triton), or interpret (the Pallas interpreter: slow,
                                # for debugging).
  prefix_cache: bool = False  # Keep finished requests' KV in a radix prefix cache (SGLang's
                              # semantics, jaxkv.kv.radix): a prompt that starts like an
                              # earlier one adopts that prefix's KV and prefills only the
                              # rest. Cached pages are evicted least recently used first
                              # when the pool needs them.
  pack_prefill: str = "auto"  # How the prefill work of mechanisms that plan their own
                              # (MemArt's history write and question) runs: packed (every
                              # row's work in one batched call per round, as plain prompts
                              # are), rows (one call per row's work: a CPU's prefill is
                              # compute-bound, so packing only adds padding rows), or auto
                              # (rows on a CPU, packed on an accelerator).

  def __post_init__(self):
    if self.max_batch < 1 or self.prefill_chunk < 1 or self.decode_steps < 1:
      raise ValueError("max_batch, prefill_chunk and decode_steps must be >= 1")
    if self.pack_prefill not in ("auto", "packed", "rows"):
      raise ValueError(f"pack_prefill must be auto, packed or rows, got {self.pack_prefill!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                       f"got {self.attention_impl!r}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The ("data", "model") device mesh (jaxkv.sharding); 1 x 1 = one device.

  data x model must equal the visible device count (on CPU:
  XLA_FLAGS=--xla_force_host_platform_device_count=N). Weights are tensor
  parallel on "model" (KV heads replicated where they do not divide), the pool's
  slots and the batch rows split on "data".
  """
  data: int = 1                 # Devices along the mesh's data axis: the pool's slots and
                                # the batch's rows are split over them.
  model: int = 1                # Devices along the mesh's model axis: the weights are split
                                # over them (tensor parallel; KV heads are replicated where
                                # they do not divide).

  def __post_init__(self):
    if self.data < 1 or self.model < 1:
      raise ValueError(f"mesh.data and mesh.model must be >= 1, got {self.data}, {self.model}")

  @property
  def size(self) -> int:
    return self.data * self.model


def to_config_dict(cfg: Any) -> ml_collections.ConfigDict:
  """Frozen dataclass -> ConfigDict (nested), for `--config.x=y` overrides."""
  def conv(v):
    if dataclasses.is_dataclass(v):
      return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return v
  return ml_collections.ConfigDict(conv(cfg), type_safe=True)


def from_config_dict(cls: type, cd: Any, path: str = "config") -> Any:
  """ConfigDict / dict -> frozen dataclass `cls`, rejecting unknown fields."""
  if dataclasses.is_dataclass(cd):
    return cd
  d = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else dict(cd)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ValueError(f"unknown field(s) {unknown} in {path} for {cls.__name__}; "
                     f"known: {sorted(fields)}")
  kwargs = {}
  for name, value in d.items():
    hint = hints[name]
    sub = dataclass_type(hint)
    if sub is not None and isinstance(value, (dict, ml_collections.ConfigDict)):
      value = from_config_dict(sub, value, f"{path}.{name}")
    else:
      _check_type(value, hint, f"{path}.{name}")
    kwargs[name] = value
  try:
    return cls(**kwargs)
  except ValueError as e:               # a range or choice check: name the group
    raise ValueError(f"{path}: {e}") from None


_SIMPLE = {int: (int,), float: (int, float), str: (str,), bool: (bool,), tuple: (tuple, list)}


def _check_type(value: Any, hint: Any, path: str) -> None:
  """Refuses a value that is not of a simple field type (int, float, str, bool,
  tuple, or one of them | None); other annotations are not checked."""
  args = typing.get_args(hint)
  optional = type(None) in args
  if optional:
    if value is None:
      return
    rest = [a for a in args if a is not type(None)]
    hint = rest[0] if len(rest) == 1 else hint
  ok = _SIMPLE.get(hint)
  if ok is None:
    return
  if (isinstance(value, bool) and hint is not bool) or not isinstance(value, ok):
    raise ValueError(f"{path} expects {hint.__name__}{' or None' if optional else ''}, got "
                     f"{type(value).__name__} {value!r}")


def dataclass_type(hint) -> type | None:
  """The config dataclass a field's type hint names (`X` or `X | None`), else None:
  which fields are nested groups (`jaxkv.cli`, the config reference)."""
  if dataclasses.is_dataclass(hint):
    return hint
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    for a in typing.get_args(hint):
      if dataclasses.is_dataclass(a):
        return a
  return None
