"""Frozen dataclass configs for models, the KV cache, sampling and serving.

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


PRUNING_METHODS = ("none", "random", "streaming_llm", "snapkv", "h2o", "intentkv")
PRUNING_LAYOUTS = ("dead_slot", "compact")
BUDGET_SCOPES = ("prompt", "history")


@dataclasses.dataclass(frozen=True)
class PruningConfig:
  """KV pruning once per request after prefill (IntentKV section 3.1, appendix H).

  `budget` is C, the retention budget applied to the compressible history: a
  request whose live prompt has N <= C tokens is not pruned; otherwise the
  forced set F (protected system prefix + actionable query span + the method's
  own always-kept tokens) is kept and the best C* = max(0, C - |F|) others.
  """
  method: str = "none"          # Which prompt tokens' KV a request drops after its prefill:
                                # none, random (drawn at random: a chance control),
                                # streaming_llm, snapkv, h2o or intentkv.
  layout: str = "dead_slot"     # How dropped tokens leave the pool: dead_slot (their slots
                                # stay in place, masked out, as IntentKV does) or compact
                                # (the kept tokens are moved together, as the published
                                # baselines do).
  budget: int = 1024            # Retention budget (C): a prompt of at most this many tokens
                                # is not pruned; a longer one keeps its forced tokens (the
                                # system prompt, the current query, the method's own) and
                                # the best-scored others, up to this many in all.
  budget_scope: str = "prompt"  # What C counts: prompt (the whole prompt, IntentKV's C) or
                                # history (only the tokens outside the protected system
                                # prompt and the current query: a request keeps those and
                                # up to C others, pruning whenever its history is longer,
                                # so scorers choose among the history whatever the system
                                # prompt's length).
  protect_system: bool = True   # Always keep the chat template's system prompt.
  sink: int = 4                 # StreamingLLM: the first tokens, always kept (the
                                # attention sinks).
  snap_window: int = 32         # SnapKV: the last prompt tokens, whose attention scores
                                # the others (the observation window, W); they are always
                                # kept.
  snap_kernel: int = 7          # SnapKV: width of the max-pooling that smooths the scores,
                                # so a high-scoring token's neighbours are kept with it.
  h2o_recent_ratio: float = 0.5  # H2O: share of the budget left after the forced tokens
                                 # (C* = C - |F|) kept for the most recent tokens; the rest
                                 # goes to the most attended ones.
  intent_mode: str = "memory"   # IntentKV's scorer: query (the current query alone), memory
                                # (the session's query memory, which keeps earlier queries
                                # with decaying weight) or learnable (the memory plus the
                                # trained Phase-2 head at head_path).
  head_path: str = "artifacts/smollm2-135m/pruner_head"  # Folder of the Phase-2 head that
                                                         # intent_mode=learnable uses; the
                                                         # default is the shipped one.
  ablate_memory: bool = False   # Ablation of the learnable scorer: the query memory (M_t)
                                # replaced by the current query's encoding (Enc(q_t)).
  ablate_xattn: bool = False    # Ablation of the learnable scorer: the head's
                                # cross-attention term (c_j) set to zero.
  ablate_residual: bool = False  # Ablation of the learnable scorer: the head's residual
                                 # weight (alpha) set to zero, which leaves the Phase-1
                                 # rule.
  intent_decay: float = 0.5     # How fast the query memory forgets (lambda of eq. 2): each
                                # new query is added to the earlier memory weighted by
                                # exp(-intent_decay), 0.61 at 0.5.
  intent_normalize_query: bool = True  # Scale each query's encoding (Enc(q_t)) to unit
                                       # length before it enters the memory
                                       # (jaxkv/policies/pruning/intentkv.py says why).
  session_prefix: int = 256     # First prompt tokens hashed into the session key of a
                                # request that names no session (P, appendix A).
  memory_capacity: int = 1024   # Sessions whose query memory is kept; past this the least
                                # recently used one is dropped.
  random_seed: int = 0          # Seed of method=random's draws (one draw per pruning
                                # event).

  def __post_init__(self):
    if self.method not in PRUNING_METHODS:
      raise ValueError(f"pruning.method must be one of {PRUNING_METHODS}, got {self.method!r}")
    if self.layout not in PRUNING_LAYOUTS:
      raise ValueError(f"pruning.layout must be one of {PRUNING_LAYOUTS}, got {self.layout!r}")
    if self.budget < 1:
      raise ValueError(f"pruning.budget must be >= 1, got {self.budget}")
    if self.budget_scope not in BUDGET_SCOPES:
      raise ValueError(f"pruning.budget_scope must be one of {BUDGET_SCOPES}, "
                       f"got {self.budget_scope!r}")
    if self.intent_mode not in ("query", "memory", "learnable"):
      raise ValueError(f"pruning.intent_mode must be query, memory or learnable, "
                       f"got {self.intent_mode!r}")
    if not 0.0 <= self.h2o_recent_ratio <= 1.0:
      raise ValueError(f"pruning.h2o_recent_ratio must be in [0, 1], got {self.h2o_recent_ratio}")
    if self.sink < 0 or self.snap_window < 1 or self.snap_kernel < 1:
      raise ValueError("pruning.sink >= 0, snap_window >= 1 and snap_kernel >= 1 required")


REUSE_METHODS = ("none", "prefix", "naive", "epic", "cacheblend", "tiered")
REUSE_TIERS = ("exact", "approx", "blend")
REUSE_STORAGE = ("int8", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class ReuseConfig:
  """Cross-prompt segment reuse with delta-RoPE re-indexing.

  method: none (prefill everything) | prefix (radix prefix cache only) | naive
    (splice every matched segment, no guard) | epic (splice, recompute each
    segment's first `epic_tokens`) | cacheblend (splice, recompute at every layer
    after the probe the `blend_ratio` of tokens whose K deviates most at
    `blend_layer`) | tiered (the paper's tiers: exact, then depth-guarded approximate, then
    blend, else reject; `tiers` picks which are on). Every method but none also
    uses the radix prefix cache.
  Regime A stores every layer's K/V; B stores layers below `reuse_layers` only.
  Both store the hidden state at every `cut_every`-th layer boundary (multicut),
  from which the approximate tier recomputes the layers its guard refuses.
  """
  method: str = "tiered"        # How a prompt reuses stored segments: none (prefill it all),
                                # prefix (the radix prefix cache only), naive (splice every
                                # matched segment, no guard), epic (splice, recompute each
                                # segment's first epic_tokens), cacheblend (splice, then
                                # recompute the tokens whose keys moved most) or tiered
                                # (exact, then depth-guarded approximate, then blend, else
                                # reject).
  tiers: tuple[str, ...] = REUSE_TIERS  # The tiers method=tiered tries, in this order, from
                                        # exact, approx and blend.
  window: int = 96              # Length in tokens of the windows a prompt is cut into to
                                # find reusable segments.
  stride: int = 48              # Mean distance in tokens between window starts (chosen by
                                # content, so the same text gets the same windows anywhere
                                # in a prompt).
  min_tokens: int = 32          # Shortest run of tokens spliced in or stored as a segment.
  shingle: int = 8              # Tokens per shingle (k) of the MinHash signatures that find
                                # similar segments.
  num_perm: int = 128           # MinHash permutations per signature: more estimate the
                                # similarity more finely and cost more.
  seg_threshold: float = 0.8    # Jaccard similarity a window needs with a stored segment to
                                # be a candidate in the LSH index (tau_seg).
  ctx_window: int = 128         # Tokens of left context before a match compared with the
                                # stored segment's own (W_ctx); their similarity is
                                # recorded with the match.
  ctx_threshold: float = 0.0    # Tiered: a run whose W_ctx left context has a MinHash
                                # Jaccard similarity below this with the stored one's
                                # (tau_ctx) is not reused approximately (exact reuse
                                # still applies); 0 admits every context. Calibrated on
                                # dev data by bench/reuse_gates.py (no signal found yet:
                                # docs/results/segment-reuse.md).
  storage: str = "int8"         # Precision of the stored keys and values: int8 (a scale per
                                # group of values), float16 or float32.
  group_size: int = 32          # Values sharing one int8 scale, along the head dimension
                                # (the hidden dimension for stored hidden states).
  byte_budget: int = 512 << 20  # Host memory of the segment store, in bytes; past it the
                                # least recently used segments are dropped.
  regime: str = "A"             # What a segment stores: A, every layer's keys and values;
                                # B, only the layers below reuse_layers.
  reuse_layers: int = 0         # Regime B: the layers stored (L_reuse); 0 stores up to the
                                # deepest stored hidden state.
  cut_every: int = 4            # Layers between a segment's stored hidden states
                                # (multicut); the approximate tier resumes computing from
                                # one of them.
  guard_base: int = 64          # Depth guard of the approximate tier: a token reuses layer
                                # 1 after this many identical tokens before it, twice as
                                # many every cut_every layers deeper (W_exact(l) =
                                # guard_base x 2^((l - 1) // cut_every); layer 0 needs none).
  guard_schedule: str = "doubling"  # The approximate tier's W_exact(l): doubling (the rule
                                    # above) or seed (the seed's: 128 x 2^(l // 4), so
                                    # W(0) = 128 and W(8) = 512, and the whole prefix from
                                    # layer 16 on).
  blend_ratio: float = 0.15     # Blend tier and cacheblend: share of a segment's tokens
                                # recomputed at every layer after the probe, those whose
                                # keys moved most.
  blend_layer: int = 1          # Blend tier and cacheblend: the probe, the layers up to
                                # this one recomputed to measure how far the cached keys
                                # are from fresh ones.
  probe_reject: float = 0.0     # Blend tier: a segment whose mean relative key deviation at
                                # the probe layer exceeds this is recomputed in full
                                # instead; 0 rejects none.
  epic_tokens: int = 16         # EPIC: each spliced segment's first tokens, recomputed at
                                # every layer.
  max_passes: int = 4           # Most layer windows a prefill is split into, each with its
                                # own set of recomputed tokens (the guard's sets grow with
                                # depth).
  select: str = "model"         # Which tokens EPIC and the blend tier recompute: model (EPIC:
                                # each segment's first epic_tokens; blend: the keys that
                                # moved most) or random (as many tokens, drawn uniformly
                                # from the segment: the chance baseline of either).
  rerope: bool = True           # Re-rotate spliced keys to their new positions (delta-RoPE);
                                # False keeps the rotation of the positions they were
                                # stored at (the chance baseline of the re-indexing).
  seed: int = 0                 # Seed of select=random's draws (per segment, also mixed
                                # with its position in the prompt).
  reject_random: float = 0.0    # The gates' chance baseline: each run that would be
                                # spliced (not exact) is recomputed in full instead with
                                # this probability, seeded as select=random; 0: never.

  def __post_init__(self):
    if self.method not in REUSE_METHODS:
      raise ValueError(f"reuse.method must be one of {REUSE_METHODS}, got {self.method!r}")
    bad = [t for t in self.tiers if t not in REUSE_TIERS]
    if bad or not self.tiers:
      raise ValueError(f"reuse.tiers must be a non-empty subset of {REUSE_TIERS}, got "
                       f"{self.tiers!r}")
    if self.storage not in REUSE_STORAGE:
      raise ValueError(f"reuse.storage must be one of {REUSE_STORAGE}, got {self.storage!r}")
    if self.regime not in ("A", "B"):
      raise ValueError(f"reuse.regime must be 'A' or 'B', got {self.regime!r}")
    if not 0 < self.stride <= self.window or self.min_tokens < 1 or self.shingle < 1:
      raise ValueError("reuse needs 0 < stride <= window, min_tokens >= 1, shingle >= 1")
    if not 0.0 < self.seg_threshold <= 1.0 or not 0.0 <= self.blend_ratio <= 1.0:
      raise ValueError("reuse.seg_threshold must be in (0, 1], blend_ratio in [0, 1]")
    if not 0.0 <= self.reject_random <= 1.0:
      raise ValueError(f"reuse.reject_random must be in [0, 1], got {self.reject_random}")
    if not 0.0 <= self.ctx_threshold <= 1.0:
      raise ValueError(f"reuse.ctx_threshold must be in [0, 1], got {self.ctx_threshold}")
    if self.cut_every < 1 or self.guard_base < 1 or self.blend_layer < 0 or self.epic_tokens < 0:
      raise ValueError("reuse needs cut_every >= 1, guard_base >= 1, blend_layer >= 0, "
                       "epic_tokens >= 0")
    if self.max_passes < 1:
      raise ValueError(f"reuse.max_passes must be >= 1, got {self.max_passes}")
    if self.select not in ("model", "random"):
      raise ValueError(f"reuse.select must be model or random, got {self.select!r}")
    if self.guard_schedule not in ("doubling", "seed"):
      raise ValueError(f"reuse.guard_schedule must be doubling or seed, got "
                       f"{self.guard_schedule!r}")
    if self.byte_budget < 0 or self.group_size < 1 or self.num_perm < 16:
      raise ValueError("reuse needs byte_budget >= 0, group_size >= 1, num_perm >= 16")

  def guard_window(self, layer: int) -> int | None:
    """W_exact(layer): identical left-context tokens needed before a segment to
    reuse its K/V at `layer`; None: the whole prefix. doubling: layer 0's K/V depend
    on token and position only, so W(0) = 0; deeper layers mix in more context, so
    the window doubles every `cut_every` layers. seed: the seed's schedule (W(0) =
    128, W(8) = 512, W(16) = the whole prefix), 128 x 2^(l // 4) below layer 16."""
    if self.guard_schedule == "seed":
      return None if layer >= 16 else 128 * 2 ** (layer // 4)
    return 0 if layer == 0 else self.guard_base * 2 ** ((layer - 1) // self.cut_every)


SEMSHARE_METHODS = ("full", "semshare", "fuzzy_full", "zero", "random", "blend", "snapkv",
                    "pyramidkv", "h2o", "evict_random")


@dataclasses.dataclass(frozen=True)
class SemShareConfig:
  """SemShareKV: reuse of a semantically similar reference prompt's KV.

  method: full (prefill everything; every prompt is stored as a reference) |
    semshare (the paper) | fuzzy_full (fuzzy match and recompute, no retention:
    Table 2's "Fuzzy + Full Cache") | zero / random (Table 2's ablations: the
    matched KV replaced by zeros / by randomly chosen reference tokens) | blend
    (CacheBlend's rule on the same fuzzy match: layer 0 probes, then the
    `blend_ratio` most deviating tokens at every later layer, no retention) |
    snapkv / pyramidkv / h2o (Table 1's compression baselines: a full prefill,
    then each layer keeps its own tokens, `policies.pruning.layerwise`; SnapKV
    and PyramidKV keep `compress_keep` of the prompt on average, H2O compresses
    10% per layer) | evict_random (their chance line: random eviction at SnapKV's
    budget). `SemShareRunner.layer_budgets` overrides the baselines' per-layer
    budgets (bench/semshare.py gives them SemShareKV's own, pair by pair).
  Paper values are the defaults. Where the paper gives none (the LSH width,
  the per-layer recompute ratios alpha_recomp, the retention decay) the choice
  is written beside the field.
  """
  method: str = "semshare"      # How a prompt reuses a reference: full (prefill every
                                # prompt; each is kept as a reference), semshare (the
                                # paper), fuzzy_full (fuzzy match, then recompute it all),
                                # zero or random (ablations: the matched KV replaced by
                                # zeros or by random reference tokens), blend (CacheBlend's
                                # rule on the same match), or snapkv, pyramidkv or h2o
                                # (compression baselines after a full prefill), or
                                # evict_random (their chance line).
  threshold: float = 0.8        # Similarity to its nearest reference at or above which a
                                # prompt reuses that reference's KV (section 5.4).
  max_dist: float = 170.0       # LSH distance at which similarity reaches 0 (similarity =
                                # clip(1 - distance / max_dist, 0, 1), A.3). The paper's 30
                                # goes with an LSH width it does not state. Calibrated with
                                # `align` on 48 SmolLM2 pairs of 1k and 2k tokens (Austen and
                                # the Python docs): 20-40% of the sentences deleted or
                                # replaced lie 12-32 bits apart (mean nearest distance),
                                # unrelated texts 76-80, so at 170 the gate (0.8) admits
                                # edits up to about 40% and unrelated texts score about
                                # 0.53. Without `align` unrelated texts lie 80-82 bits apart
                                # and so do those edits (55-86): no value separates them.
  align: bool = True            # Match each target token at its position in the
                                # reference's frame (offset of the nearest exact 4-gram both
                                # share, `policies.reuse.semshare.aligned_positions`), so a
                                # deleted or inserted sentence does not move the codes of
                                # every later token; False: the paper's own positions.
  nbits: int = 256              # LSH sign bits per token (the paper gives none): with 10%
                                # of the sentences deleted, 0.47-0.65 of the tokens matched
                                # the same token id at 32 bits, 0.66-0.83 at 128 and
                                # 0.79-0.88 at 256.
  lsh_seed: int = 0             # Seed of the LSH's random rotation.
  e_rope_theta: float = 10000.0  # Base of the position rotation applied to the token
                                 # embeddings that are matched (the E cache: theta_k =
                                 # base^(-2k/d), A.1).
  hot_threshold: float = 0.55   # Share of the attention the hot tokens hold: the fewest
                                # most-attended tokens holding it are hot (attention
                                # recovery, eq. 1).
  w_cold: float = 0.1           # Share of the cold tokens layer 1 recomputes, the most
                                # deviating ones (4.3.3).
  w_hot: float = 0.5            # Share of the hot tokens layer 1 recomputes, the most
                                # deviating ones (4.3.3).
  recomp_alpha_first: float = 0.9   # Share of the previous layer's recomputed tokens that
                                    # layer 2 recomputes again (alpha_recomp), rising
                                    # linearly to recomp_alpha_last (A.5; values not given).
  recomp_alpha_last: float = 1.0    # That share at the last layer (A.5: small in shallow
                                    # layers, large in deep ones).
  retain_first: float = 0.8     # Least share of the prompt layer 0 retains: it keeps the
                                # larger of this and the hot share (r_dynamic, 4.3.4).
  retain_alpha: float = 0.98    # Decay of the retained share with depth: layer l keeps
                                # layer 0's share x alpha^l (A.6). The paper gives no value;
                                # 0.98 over 30 layers keeps about 60% on average, near its
                                # 42% memory saving.
  retention: str = "layer"      # Which tokens each layer retains: layer (ranked by the
                                # attention they receive at that layer from the tokens it
                                # computed; layer 0 from every token; evicted for decode) or
                                # layer0 (every layer ranked by layer 0's attention, nested,
                                # evicted before the pass).
  recent: int = 16              # Last prompt tokens, always recomputed and retained (the
                                # readout and the instruction's end).
  blend_ratio: float = 0.15     # With method=blend, the share of tokens recomputed at
                                # every layer after the probe (CacheBlend's recompute
                                # share).
  compress_keep: float = 0.6    # With method snapkv or pyramidkv, the mean share of the
                                # prompt kept per layer (about what semshare's retention
                                # keeps: 0.8 x 0.98^l over 30 layers).
  h2o_keep: float = 0.9         # With method=h2o, the share of the cache each layer keeps
                                # (SemShareKV's "compressing 10% of the cache per layer").
  byte_budget: int = 1 << 30    # Memory of the reference prompts in bytes (their pool slots
                                # and E-cache codes); past it the least recently used are
                                # dropped.
  store_reused: bool = False    # Also keep prompts that reused a reference's KV as
                                # references (their KV is approximate).

  def __post_init__(self):
    if self.method not in SEMSHARE_METHODS:
      raise ValueError(f"semshare.method must be one of {SEMSHARE_METHODS}, got "
                       f"{self.method!r}")
    if not 0.0 <= self.threshold <= 1.0 or self.max_dist <= 0:
      raise ValueError("semshare.threshold must be in [0, 1] and max_dist > 0")
    if self.retention not in ("layer", "layer0"):
      raise ValueError(f"semshare.retention must be 'layer' or 'layer0', got "
                       f"{self.retention!r}")
    if self.nbits < 32 or self.nbits % 32:
      raise ValueError(f"semshare.nbits must be a positive multiple of 32, got {self.nbits}")
    fracs = (self.hot_threshold, self.w_cold, self.w_hot, self.recomp_alpha_first,
             self.recomp_alpha_last, self.retain_first, self.retain_alpha, self.blend_ratio,
             self.compress_keep, self.h2o_keep)
    if not all(0.0 <= f <= 1.0 for f in fracs):
      raise ValueError("semshare ratios (hot_threshold, w_cold, w_hot, recomp_alpha_*, "
                       "retain_*, blend_ratio, compress_keep, h2o_keep) must be in [0, 1]")
    if self.recent < 1 or self.byte_budget < 0:
      raise ValueError("semshare needs recent >= 1 and byte_budget >= 0")


MEMART_NORMS = ("softmax", "rr")      # Table 1: per-token normalisation over blocks
MEMART_AGGS = ("max", "sum")          # Table 1: aggregation over query tokens
MEMART_BOX_KEYS = ("raw", "rope")     # box the de-rotated keys R(-p)k, or the stored ones
MEMART_BOX_HEADS = ("each", "pooled")  # a box per layer and KV head, or per layer (all heads)
MEMART_WRITE_TURNS = ("all", "inputs")  # a closed conversation's turns a composed session writes


@dataclasses.dataclass(frozen=True)
class MemArtConfig:
  """MemArt: conversation history kept as KV blocks, retrieved by attention.

  Paper values are the defaults (LLaMA-3.1-8B's setting: BS 16, top-k 128,
  Softmax-Max); where the paper gives none the choice is written beside the field.
  """
  block_size: int = 16          # Tokens per memory block (BS); it must equal the pool's
                                # page size.
  top_k: int = 128              # Memory blocks retrieved for each request (4.2).
  norm: str = "softmax"         # How each query token's block scores are normalised before
                                # they are combined: softmax, or rr (reciprocal rank; Table
                                # 1).
  agg: str = "max"              # How the normalised scores are combined over query tokens,
                                # heads and layers: max or sum (Table 1).
  rr_c: float = 60.0            # Reciprocal-rank constant (c): a block ranked r (from 1)
                                # scores 1 / (r + c). The paper gives no value; 60 is
                                # Cormack et al.'s, the paper's reference for reciprocal
                                # rank.
  softmax_scale: float = 0.0    # Scale of the query-key scores inside the softmax; 0 uses 1
                                # / sqrt(head_dim), the attention's own scale (the paper's
                                # scores are the unscaled q.k).
  box_keys: str = "raw"         # Keys a block's bounding box covers: raw (the keys with the
                                # position rotation taken out, R(-p)k; boxes over rotated
                                # keys spanning 16 positions are loose in the fast-rotating
                                # dimensions) or rope (the stored keys; the ablation).
  box_heads: str = "each"       # Boxes per layer: each (one per KV head; a query head
                                # reads its KV head's) or pooled (one over every KV head's
                                # keys: 1 / Hkv of the box bytes; the ablation, see README
                                # MemArt).
  byte_budget: int = 1 << 30    # Memory of the blocks in bytes (keys, values and boxes);
                                # past it the least-retrieved blocks are evicted, the oldest
                                # first among equals.
  rerank: int = 0               # Re-ranking: 0 lets the boxes' bound (eq. 3) pick the
                                # top_k blocks, as the paper does; R > 0 lets it pick R x
                                # top_k candidates, re-scored by their keys' exact
                                # content-only max q.k (what the bound bounds; README
                                # MemArt), and keeps the best top_k.
  neighbors: int = 0            # Windows of blocks: 0 retrieves the top_k blocks alone, as
                                # the paper; n > 0 scores each block as the best within n
                                # blocks of it in its span, so retrieval takes windows of
                                # 2n + 1 blocks and a block cut mid-sentence comes with its
                                # context (policies.memory.memart.dilate; README MemArt).
  write_turns: str = "all"      # Turns of a closed conversation a composed session writes
                                # into memory: all (user, tool and assistant turns, the last
                                # reply included) or inputs (the user's and tools' turns;
                                # the model's own replies left out). MemArt alone writes
                                # the history it is sent.

  def __post_init__(self):
    if self.write_turns not in MEMART_WRITE_TURNS:
      raise ValueError(f"memart.write_turns must be one of {MEMART_WRITE_TURNS}, got "
                       f"{self.write_turns!r}")
    if self.norm not in MEMART_NORMS or self.agg not in MEMART_AGGS:
      raise ValueError(f"memart.norm must be one of {MEMART_NORMS} and memart.agg one of "
                       f"{MEMART_AGGS}, got {self.norm!r} / {self.agg!r}")
    if self.box_keys not in MEMART_BOX_KEYS:
      raise ValueError(f"memart.box_keys must be one of {MEMART_BOX_KEYS}, got "
                       f"{self.box_keys!r}")
    if self.box_heads not in MEMART_BOX_HEADS:
      raise ValueError(f"memart.box_heads must be one of {MEMART_BOX_HEADS}, got "
                       f"{self.box_heads!r}")
    if self.block_size < 1 or self.top_k < 1:
      raise ValueError(f"memart needs block_size >= 1 and top_k >= 1, got "
                       f"{self.block_size} / {self.top_k}")
    if (self.rr_c < 0 or self.softmax_scale < 0 or self.byte_budget < 0 or self.rerank < 0
        or self.neighbors < 0):
      raise ValueError("memart needs rr_c >= 0, softmax_scale >= 0, byte_budget >= 0, "
                       "rerank >= 0 and neighbors >= 0")


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


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """The OpenAI-compatible HTTP server (`scripts/server.py`, `jaxkv.server`).

  One engine loop batches every concurrent request (mode=requests). A request
  beyond `max_pending` queued-or-running ones gets 429; a completion's
  `max_tokens` defaults to `ServeConfig.sampling.max_tokens`, clipped to what the
  cache has room for after the prompt.
  """
  host: str = "127.0.0.1"       # Address the HTTP server binds to (the --host flag
                                # overrides it).
  port: int = 8000              # Port the HTTP server listens on (the --port flag overrides
                                # it).
  model_name: str = ""          # Model id clients send as "model"; empty serves the
                                # config's model name.
  max_pending: int = 256        # Most requests queued or running at once; more are answered
                                # with HTTP 429.
  session_idle_s: float = 600.0  # Seconds an agent session may stay unused before it is
                                 # closed and its KV freed.
  role_adapters: str = ""       # LRAgent role adapters, served as the models
                                # "<model>:plan", "<model>:action" and "<model>:reflect":
                                # empty for none, shipped for the ones in artifacts/ for the
                                # model, or a folder of PEFT adapters (scripts/train_lora.py).
                                # One batch mixes them (shared A, per-row B).
  sessions: str = "prefix"      # Session kinds served, comma-separated; the first is the
                                # default of a session that names none. prefix: the batch
                                # engine's prefix cache (needs engine.prefix_cache); pruned:
                                # pruning with IntentKV's query memory kept per session
                                # (pruning); memart: history in MemArt memory (memart);
                                # reuse: segment reuse across prompts (reuse); semshare:
                                # a similar earlier prompt's KV reused (semshare); agents:
                                # LRAgent role adapters sharing one trajectory's KV (needs
                                # role_adapters). E.g. "pruned,memart,reuse,semshare,agents,prefix".
  agent_scheme: str = "base_lr_shared"  # How an agents session's role adapters share KV
                                        # (LRAgent): non_shared, full_shared or
                                        # base_lr_shared.
  agent_max_tokens: int = 4096  # Longest trajectory of an agents session, in tokens (it
                                # holds this many slots of the pool while open).
  agent_sessions: int = 4       # Agents sessions open at once.
  max_sessions: int = 256       # Sessions open at once, every kind together (one first
                                # seen in a request included); one more is a 400 until a
                                # session closes or idles out.
  max_body_bytes: int = 4 << 20  # Largest request body; a larger one is answered 413
                                 # before it is read in full.
  body_timeout_s: float = 30.0  # Seconds a client may take to send its request body; a
                                # slower one is answered 408.
  header_timeout_s: float = 10.0  # Seconds a connection may take to send a request's
                                  # headers (from opening, or from its previous
                                  # response); a slower one is closed.
  max_connections: int = 512    # Open connections at most; a request past them is
                                # answered 503 at once.
  api_key: str = ""             # API keys clients must send (Authorization: Bearer <key>),
                                # comma-separated; empty: $JAXKV_API_KEY, else no auth. With
                                # keys a session belongs to the key that opened it.
  max_compiled: int = 64        # Compiled variants of the engine's steps kept in memory
                                # (each a padded shape; ~40 MB of host memory apiece for
                                # SmolLM2 on a CPU); past it all are dropped between steps
                                # and reload from the persistent compilation cache when
                                # used again (jaxkv.engine.executables). 0: no bound.
  allowed_hosts: str = ""       # Host names a request's Host / Origin header may name,
                                # comma-separated, * for any; empty: the loopback names when
                                # the server binds a loopback address, any otherwise.

  def __post_init__(self):
    session_kinds(self.sessions)
    if self.max_compiled < 0:
      raise ValueError(f"server.max_compiled must be >= 0 (0: no bound), got "
                       f"{self.max_compiled}")
    if self.max_body_bytes < 1024:
      raise ValueError(f"server.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
    if self.body_timeout_s <= 0 or self.header_timeout_s <= 0 or self.max_connections < 1:
      raise ValueError("server.body_timeout_s and server.header_timeout_s must be > 0 and "
                       "server.max_connections >= 1")
    if self.agent_scheme not in ("non_shared", "full_shared", "base_lr_shared"):
      raise ValueError("server.agent_scheme must be non_shared, full_shared or base_lr_shared "
                       "(base_shared keeps a low-rank value pool per agent, which the server's "
                       "one KV pool cannot hold; droidspeak needs a profiled window), got "
                       f"{self.agent_scheme!r}")
    if self.max_sessions < 1:
      raise ValueError(f"server.max_sessions must be >= 1, got {self.max_sessions}")
    if self.agent_max_tokens < 16 or self.agent_sessions < 1:
      raise ValueError("server.agent_max_tokens must be >= 16 and server.agent_sessions >= 1")
    if not 0 <= self.port < 65536:
      raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
    if self.max_pending < 1:
      raise ValueError(f"server.max_pending must be >= 1, got {self.max_pending}")
    if self.session_idle_s <= 0:
      raise ValueError(f"server.session_idle_s must be > 0, got {self.session_idle_s}")


SESSION_KINDS = ("prefix", "pruned", "memart", "reuse", "semshare", "agents")


def session_kinds(spec: str) -> tuple[str, ...]:
  """`server.sessions` ("pruned,memart,...") -> kinds, the default first."""
  kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
  bad = [k for k in kinds if k not in SESSION_KINDS]
  if not kinds or bad or len(set(kinds)) != len(kinds):
    raise ValueError(f"server.sessions must list distinct kinds of {', '.join(SESSION_KINDS)} "
                     f"(the first is the default), got {spec!r}")
  return kinds


SERVE_MODES = ("requests", "sessions", "reuse", "semshare", "memart")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """What `scripts/serve.py` runs."""
  model: str = "smollm2-135m"   # Model to load: a preset name (smollm2-135m,
                                # qwen2.5-coder-0.5b), or the path of a .gguf file or a
                                # Hugging Face model directory.
  dtype: str = "float32"        # Data type of the weights and of the computation (e.g.
                                # float32 or bfloat16).
  scan_layers: bool = False     # Run the layers as one lax.scan over stacked weights: the
                                # compile time does not grow with depth, the steps are a
                                # little slower than with unrolled layers.
  cache: CacheConfig = CacheConfig()
  engine: EngineConfig = EngineConfig()
  sampling: SamplingConfig = SamplingConfig()
  system_prompt: str = ""       # System message put before chat requests that have none of
                                # their own.
  mode: str = "requests"        # What serve.py runs: requests (JSONL requests, batched),
                                # sessions (a ToolBench-format trace file replayed turn by
                                # turn, pruned by `pruning`), reuse (JSONL requests reusing
                                # earlier prompts' segments by `reuse`), semshare (reusing a
                                # similar earlier prompt's KV by `semshare`) or memart (chat
                                # requests whose history lives in MemArt memory, `memart`).
                                # The last three run batched too, as requests of that
                                # mechanism in the same engine.
  pruning: PruningConfig = PruningConfig()
  session_generate: bool = False  # In mode=sessions, generate each assistant turn instead
                                  # of replaying the trace's.
  reuse: ReuseConfig = ReuseConfig()
  semshare: SemShareConfig = SemShareConfig()
  memart: MemArtConfig = MemArtConfig()
  # Devices: mode=requests runs on a (data, model) mesh when mesh.data x mesh.model > 1.
  mesh: MeshConfig = MeshConfig()
  server: ServerConfig = ServerConfig()   # scripts/server.py

  def __post_init__(self):
    if self.mode not in SERVE_MODES:
      raise ValueError(f"mode must be one of {SERVE_MODES}, got {self.mode!r}")
    if self.mesh.size > 1 and self.mode != "requests":
      raise ValueError(f"mesh ({self.mesh.data} x {self.mesh.model}) runs mode=requests "
                       f"only so far, not mode={self.mode!r}")


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
    sub = _dataclass_type(hint)
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


def _dataclass_type(hint) -> type | None:
  if dataclasses.is_dataclass(hint):
    return hint
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    for a in typing.get_args(hint):
      if dataclasses.is_dataclass(a):
        return a
  return None
