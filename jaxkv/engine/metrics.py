"""Run metrics: prefill / decode throughput, latency, peak KV bytes (d_kv accounting)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

RECENT = 100_000   # requests whose TTFT / latency the medians are taken over


@dataclasses.dataclass
class EngineMetrics:
  """Accumulates over a run. Throughput counts host time around the device
  steps (dispatch + transfer + compile on first use of a shape)."""
  bytes_per_slot: int                 # 2 x L x d_kv x bytes_per_elem
  prefill_tokens: int = 0
  prefill_s: float = 0.0
  decode_tokens: int = 0
  decode_s: float = 0.0
  peak_live_slots: int = 0
  cached_tokens: int = 0              # prompt tokens adopted from the prefix cache
  wall_s: float = 0.0
  requests: int = 0
  errors: int = 0
  # the most recent RECENT requests' (a long-running server must not grow without bound)
  ttft_s: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=RECENT))
  latency_s: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=RECENT))

  def add_prefill(self, tokens: int, seconds: float) -> None:
    self.prefill_tokens += tokens
    self.prefill_s += seconds

  def add_decode(self, tokens: int, seconds: float) -> None:
    self.decode_tokens += tokens
    self.decode_s += seconds

  def observe_live_slots(self, n: int) -> None:
    self.peak_live_slots = max(self.peak_live_slots, int(n))

  def add_request(self, result) -> None:
    self.requests += 1
    if result.finish_reason == "error":
      self.errors += 1
      return
    self.ttft_s.append(result.ttft_s)
    self.latency_s.append(result.latency_s)

  @property
  def peak_kv_bytes(self) -> int:
    return self.peak_live_slots * self.bytes_per_slot

  def summary(self) -> dict:
    def rate(n, s):
      return n / s if s > 0 else 0.0
    med = lambda xs: float(np.median(xs)) if xs else 0.0
    return {
        "requests": self.requests,
        "errors": self.errors,
        "prefill_tokens": self.prefill_tokens,
        "cached_tokens": self.cached_tokens,
        "prefill_tok_s": rate(self.prefill_tokens, self.prefill_s),
        "decode_tokens": self.decode_tokens,
        "decode_tok_s": rate(self.decode_tokens, self.decode_s),
        "median_ttft_s": med(self.ttft_s),
        "median_latency_s": med(self.latency_s),
        "peak_live_slots": self.peak_live_slots,
        "peak_kv_bytes": self.peak_kv_bytes,
        "wall_s": self.wall_s,
    }
