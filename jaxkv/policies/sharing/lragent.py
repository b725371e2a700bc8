"""LRAgent KV-sharing schemes (seed 000): what each agent reads, writes and recomputes.

N agents (LoRA roles of one base model) extend one trajectory. The schemes
differ in which caches exist and who computes what:

  non_shared      every agent keeps its own full cache (K, V = V_base + V_lr B_i)
                  and prefills every token it has not seen with its own hidden
                  states. Memory N x, compute N x. The fidelity reference.
  full_shared     one full cache; whoever computes a token first writes its K/V
                  (with its own adapter) and everyone reuses it as is.
  droidspeak      full_shared plus layer-selective recompute: for tokens another
                  agent wrote, an agent recomputes the critical layers [l0, l1)
                  from the writer's hidden state entering l0 (the E-cache) with
                  its own adapter, into its own copy of those layers.
  base_shared     one shared base cache (K and x W_v, from whoever computed the
                  token first) and one rank-r LR cache (x A_v s) PER AGENT,
                  computed on the agent's own hidden states: every agent still
                  runs every new token (compute N x) but stores r numbers per
                  token and layer (memory ~1 x).
  base_lr_shared  base and LR caches both shared (A is shared, so x A_v is
                  adapter-independent given the hidden state); each agent applies
                  its own B_i inside Flash-LoRA-Attention. Compute 1 x, memory ~1 x.

The pure helpers here (DroidSpeak's per-layer view and
critical-layer choice, KV-byte accounting) are used by
`jaxkv.engine.agents.AgentRunner`, which holds the host-side state.

Decisions where LRAgent / DroidSpeak are silent or differ from this setting:
  * DroidSpeak's critical layers are one contiguous window of `n_critical`
    layers with the largest summed per-layer K/V deviation between agents
    (`critical_window`), measured on a profiling trajectory
    (`layer_deviation`); DroidSpeak profiles per model pair the same way.
  * KV bytes are counted from what each scheme must keep for the whole
    trajectory (d_kv accounting, DESIGN.md invariant 6), not from the pool's
    allocation: base + LR (r per token and layer) + DroidSpeak's recomputed
    layers and E-cache (D per token).
"""

from __future__ import annotations

import numpy as np

SCHEMES = ("non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared")
DECOUPLED = ("base_shared", "base_lr_shared")


def check_scheme(scheme: str) -> str:
  if scheme not in SCHEMES:
    raise ValueError(f"unknown sharing scheme {scheme!r}; expected one of {SCHEMES}")
  return scheme


def num_regions(scheme: str, num_agents: int) -> int:
  """Slot regions of one trajectory length each: a full cache per agent for
  non_shared, the shared cache + one recompute copy per agent for droidspeak."""
  return {"non_shared": num_agents, "droidspeak": 1 + num_agents}.get(scheme, 1)


def droidspeak_view(shared_row: np.ndarray, own_row: np.ndarray, recomputed: np.ndarray,
                    window: tuple[int, int], num_layers: int) -> np.ndarray:
  """Per-layer slot map [L, T]: layers in the window read the agent's own recomputed
  copy where `recomputed` [T], everything else reads the shared cache."""
  view = np.broadcast_to(shared_row, (num_layers, shared_row.size)).copy()
  l0, l1 = window
  view[l0:l1] = np.where(recomputed[None, :], own_row[None, :], shared_row[None, :])
  return view


def layer_deviation(k: np.ndarray, v: np.ndarray) -> np.ndarray:
  """Per-layer K/V deviation between agents' caches of the same tokens.

  k, v: [A, L, T, ...] each agent's own (non-shared) cache. Returns [L]: the
  mean over agent pairs of ||K_a - K_b|| / ||K_b|| + ||V_a - V_b|| / ||V_b||.
  """
  a = k.shape[0]
  out = np.zeros(k.shape[1])
  pairs = [(i, j) for i in range(a) for j in range(a) if i != j]
  for i, j in pairs:
    for x in (k, v):
      d = (x[i] - x[j]).reshape(x.shape[1], -1)
      ref = x[j].reshape(x.shape[1], -1)
      out += np.linalg.norm(d, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-12)
  return out / max(len(pairs), 1)


def critical_window(deviation: np.ndarray, n_critical: int) -> tuple[int, int]:
  """The contiguous n_critical layers with the largest summed deviation."""
  dev = np.asarray(deviation, np.float64)
  n = int(np.clip(n_critical, 1, dev.size))
  sums = np.convolve(dev, np.ones(n), mode="valid")
  l0 = int(np.argmax(sums))
  return l0, l0 + n


def model_kv_bytes(scheme: str, tokens: int, model_cfg, lora, bytes_per_elem: int,
                   **kw) -> int:
  """`kv_bytes` for a model config (num_layers, d_kv, hidden_size) and its shared-A
  adapters (rank, num_adapters); `kw`: DroidSpeak's recomputed_tokens and window."""
  return kv_bytes(scheme, tokens, num_layers=model_cfg.num_layers, d_kv=model_cfg.d_kv,
                  hidden=model_cfg.hidden_size, rank=lora.rank, num_agents=lora.num_adapters,
                  bytes_per_elem=bytes_per_elem, **kw)


def kv_bytes(scheme: str, tokens: int, *, num_layers: int, d_kv: int, hidden: int, rank: int,
             num_agents: int, recomputed_tokens: int = 0, window: tuple[int, int] = (0, 0),
             bytes_per_elem: int = 4) -> int:
  """KV bytes a scheme keeps for a trajectory of `tokens` (see the module docstring).

  recomputed_tokens: DroidSpeak's recomputed (token, agent) pairs, whose window
  layers each agent stores again.
  """
  full = 2 * num_layers * d_kv * bytes_per_elem                    # per token, K + V
  lr = num_layers * rank * bytes_per_elem
  if scheme == "non_shared":
    return num_agents * tokens * full
  if scheme == "full_shared":
    return tokens * full
  if scheme == "base_lr_shared":
    return tokens * (full + lr)
  if scheme == "base_shared":
    return tokens * full + num_agents * tokens * lr
  if scheme == "droidspeak":
    n = window[1] - window[0]
    return (tokens * full + recomputed_tokens * 2 * n * d_kv * bytes_per_elem
            + tokens * hidden * bytes_per_elem)
  raise ValueError(check_scheme(scheme))
