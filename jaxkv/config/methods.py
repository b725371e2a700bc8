"""The KV mechanisms' configs: pruning (IntentKV and its baselines), segment reuse,
SemShareKV and MemArt. Each is a frozen dataclass validated on construction; the
field comments are the `--config.*` help text (`jaxkv.cli`).
"""

from __future__ import annotations

import dataclasses

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
  intent_pool: int = 1          # IntentKV: width of a max-pooling over its scores among the
                                # candidates, as SnapKV's kernel (1: off), so a kept token
                                # keeps its neighbours (meant to keep a copied ID whole).
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
    if self.sink < 0 or self.snap_window < 1 or self.snap_kernel < 1 or self.intent_pool < 1:
      raise ValueError("pruning.sink >= 0, snap_window >= 1, snap_kernel >= 1 and "
                       f"intent_pool >= 1 required, got {self.sink}, {self.snap_window}, "
                       f"{self.snap_kernel} and {self.intent_pool}")


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
