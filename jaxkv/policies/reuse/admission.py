"""Admission of a matched segment (seed 002, section 3.4): which tier reuses it,
how deep, and why, or why not.

Tiers (`ReuseConfig.method="tiered"`, tried in this order among `tiers`):
- exact: the segment's ids and the whole left context are identical to its
  exemplar's, so positions coincide and every stored layer is exact (up to the
  storage rounding). A radix prefix hit is this case when the pool still holds
  it; the store serves it once the pool has evicted it.
- approx (depth-guarded): a token with w identical tokens right before it may
  reuse layer l when w >= W_exact(l) (`ReuseConfig.guard_window`, W(0) = 0).
  Runs are maximal (`index.align`), so the context identical before a run is
  usually short (m, often 0) and grows inside it: token j has w = m + j. Each
  token reuses up to the deepest stored boundary b with W_exact(b - 1) <= w
  and is recomputed from there from the stored hidden state entering b
  (multicut): the critique's validity condition (a boundary state is only as
  good as the lower layers it came from), applied per token.
- blend: every layer spliced, then an online probe recomputes the segment at
  layers <= `blend_layer`, measures how far the fresh keys moved from the
  cached ones, and recomputes the `blend_ratio` most deviating tokens at every
  later layer (CacheBlend). Needs the full stack (regime A). `probe_reject` > 0
  turns a segment whose mean deviation exceeds it into a full recompute.
- reject: none applies (each tier's reason is recorded). A run whose left context
  is less similar to the stored one's than `ctx_threshold` (MinHash Jaccard over
  `ctx_window` tokens, the seed's tau_ctx) gets no approximate tier.

The baselines are one-tier methods: naive (splice every stored layer, no guard),
epic (naive plus each segment's first `epic_tokens` recomputed at every layer)
and cacheblend (the blend tier alone). Their chance baselines: `select="random"`
recomputes as many tokens drawn uniformly from the segment (EPIC's k, the blend's
`blend_ratio`), and `rerope=False` splices keys without re-rotating them to their new
positions.

Every method: a run spliced at position 0 that is not exact recomputes its first
token at every layer (`sink_first`). Position 0 is the attention sink; the stored
K/V of the same token computed with context before it are far from a sink's (real
SmolLM2, one prompt whose segment lost its left context: naive's first-token KL
1.27 -> 0.33).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.config import ReuseConfig
from jaxkv.policies.reuse.index import Match
from jaxkv.policies.reuse.store import Segment


@dataclasses.dataclass(frozen=True)
class Decision:
  """How a match is reused.

  Each token of the run keeps the spliced K/V of layers < `resume` and is
  recomputed from layer `resume` on, starting from the stored hidden state
  entering `resume` (resume = L: never recomputed). `epic` first tokens are
  recomputed at every layer; `blend` runs the probe.
  """
  tier: str                  # exact | approx | blend | naive | epic | reject
  reason: str
  resume: int = 0
  epic: int = 0
  blend: bool = False
  per_token: np.ndarray | None = None   # approx: each token's resume (`guarded_resume`)

  @property
  def accepted(self) -> bool:
    return self.tier != "reject"

  def resume_of(self, n: int) -> np.ndarray:
    """[n] the layer each token of the run is recomputed from (0: every layer)."""
    r = np.full(n, self.resume, np.int64) if self.per_token is None else self.per_token.copy()
    r[:min(self.epic, n)] = 0
    return r


def full_stack_resume(seg: Segment, num_layers: int) -> tuple[int, str]:
  """(resume layer, note) for reusing everything stored: every layer (A), or the
  layers below L_reuse and the stored boundary state there (B)."""
  if seg.kv_layers >= num_layers:
    return num_layers, "every layer"
  b = seg.kv_layers
  if b not in seg.hidden:
    return 0, f"no boundary state at L_reuse = {b}"
  return b, f"layers < {b}, boundary state at {b}"


def boundaries(seg: Segment, num_layers: int) -> list[int]:
  """Layers a reused token can resume from: stored boundary states, and L (never
  recomputed) when every layer's K/V is stored."""
  bounds = sorted(b for b in seg.hidden if 0 < b <= seg.kv_layers)
  if seg.kv_layers >= num_layers:
    bounds.append(num_layers)
  return bounds


def guarded_resume(seg: Segment, m: int, n: int, cfg: ReuseConfig,
                   num_layers: int, p_lo: int | None = None) -> np.ndarray:
  """Per token of a run of n, the deepest boundary b whose layers < b all pass
  the guard (0: recompute everything). Token j of a run has m + j identical
  tokens before it (the run's own first j tokens are identical too), so
  reuse deepens along the run: W_exact(b - 1) <= m + j. A layer that needs the
  whole prefix (W None) passes when the run's whole left context is identical
  (m == p_lo, the run at prompt position p_lo)."""
  bounds = np.asarray(boundaries(seg, num_layers), np.int64)
  if not bounds.size:
    return np.zeros(n, np.int64)
  whole = p_lo is not None and m >= p_lo
  big = np.iinfo(np.int64).max
  need = np.asarray([w if w is not None else (0 if whole else big)
                     for w in (cfg.guard_window(b - 1) for b in bounds)], np.int64)
  have = m + np.arange(n)
  ok = need[None, :] <= have[:, None]                       # [n, B]
  return np.where(ok.any(1), bounds[np.maximum(ok.shape[1] - 1 - np.argmax(ok[:, ::-1], 1), 0)],
                  0)


def decide(match: Match, seg: Segment, cfg: ReuseConfig, num_layers: int) -> Decision:
  """The tier (and depth) for one match under `cfg.method` (see the module doc). A run
  spliced at position 0 that is not exact recomputes its first token at every layer,
  whatever the method: position 0 is the attention sink, whose K/V differ most from
  those of the same token with context before it (`sink_first`)."""
  d = _decide(match, seg, cfg, num_layers)
  if cfg.reject_random and d.tier not in ("exact", "reject"):
    coin = _run_rng(match, cfg, stream=1).random()
    if coin < cfg.reject_random:
      return Decision("reject", f"random reject (p = {cfg.reject_random}: the gates' "
                      f"chance baseline) of {d.tier}")
  return sink_first(d) if match.p_lo == 0 else d


def sink_first(d: Decision) -> Decision:
  """`d` with the run's first token recomputed at every layer (an approximate run at
  position 0); exact and rejected decisions are kept."""
  if d.tier in ("exact", "reject") or d.epic >= 1:
    return d
  return dataclasses.replace(d, epic=1, reason=f"{d.reason}; position 0 recomputed")


def random_tokens(match: Match, cfg: ReuseConfig, k: int) -> np.ndarray:
  """min(k, n) distinct token indices of a run of n, drawn uniformly and seeded by
  `cfg.seed` and the run's place (`ReuseConfig.select="random"`: the chance baseline
  of EPIC's first tokens and of the blend tier's most-deviating ones; `reject_random`
  draws its coin from the same seed on another stream)."""
  return _run_rng(match, cfg).choice(match.n, min(k, match.n), replace=False)


def _run_rng(match: Match, cfg: ReuseConfig, stream: int | None = None) -> np.random.Generator:
  """The run's own generator: `cfg.seed` and the run's place (and a stream for a
  second, independent draw)."""
  key = [cfg.seed, match.p_lo, match.s_lo, match.n]
  return np.random.default_rng(key if stream is None else key + [stream])


def random_picks(match: Match, cfg: ReuseConfig, k: int, resume: int) -> np.ndarray:
  """[n] per-token resume of a run with `k` random tokens (`random_tokens`) recomputed
  at every layer (0) and the rest at `resume`: EPIC's chance baseline."""
  r = np.full(match.n, resume, np.int64)
  r[random_tokens(match, cfg, k)] = 0
  return r


def _decide(match: Match, seg: Segment, cfg: ReuseConfig, num_layers: int) -> Decision:
  method = cfg.method
  if method in ("naive", "epic"):
    resume, note = full_stack_resume(seg, num_layers)
    if resume == 0:
      return Decision("reject", note)
    if method == "epic" and cfg.select == "random":
      return Decision(method, f"epic (random tokens): {note}", resume=resume,
                      per_token=random_picks(match, cfg, cfg.epic_tokens, resume))
    return Decision(method, f"{method}: {note}", resume=resume,
                    epic=cfg.epic_tokens if method == "epic" else 0)
  if method == "cacheblend":
    if seg.kv_layers < num_layers:
      return Decision("reject", "blend needs every layer's K/V (regime A)")
    return Decision("blend", f"blend: probe at layer {cfg.blend_layer}, recompute "
                    f"{cfg.blend_ratio:.0%}", resume=num_layers, blend=True)
  if method != "tiered":
    return Decision("reject", f"method {method} splices nothing")
  why = []
  m = match.ctx_match
  if "exact" in cfg.tiers:
    whole = seg.left.size + match.s_lo
    if not seg.exact:
      why.append("exact: the stored K/V were computed over approximately reused ones")
    elif m == match.p_lo and whole == match.p_lo:
      resume, note = full_stack_resume(seg, num_layers)
      if resume:
        return Decision("exact", f"identical segment and left context ({m} tokens): {note}",
                        resume=resume)
      why.append(f"exact: {note}")
    else:
      why.append(f"exact: left context differs ({m} of {match.p_lo} tokens identical)")
  if match.ctx_jaccard < cfg.ctx_threshold:          # tau_ctx: no approximate tier
    why.append(f"context: Jaccard {match.ctx_jaccard:.2f} of the left context with the "
               f"stored one's < ctx_threshold {cfg.ctx_threshold}")
    return Decision("reject", "; ".join(why))
  if "approx" in cfg.tiers:
    resume = guarded_resume(seg, m, match.n, cfg, num_layers, match.p_lo)
    if resume.any():
      reused = int((resume > 0).sum())
      return Decision("approx", f"{m} identical context tokens before the run: {reused} of "
                      f"{match.n} tokens reuse layers < {int(resume.min())}..{int(resume.max())}",
                      resume=int(resume.max()), per_token=resume)
    first = min(boundaries(seg, num_layers), default=num_layers)
    w = cfg.guard_window(first - 1)
    why.append(f"approx: {m} + {match.n - 1} identical context tokens < W_exact({first - 1}) "
               f"= {'the whole prefix' if w is None else w}")
  if "blend" in cfg.tiers:
    if seg.kv_layers >= num_layers:
      return Decision("blend", f"blend after {'; '.join(why) or 'no other tier'}",
                      resume=num_layers, blend=True)
    why.append("blend: needs every layer's K/V (regime A)")
  return Decision("reject", "; ".join(why))
