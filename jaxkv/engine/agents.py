"""LRAgent multi-agent runner: LoRA agents extend one trajectory under a KV-sharing scheme.

`AgentRunner.run(trajectory)` walks a `jaxkv.data.agents.Trajectory` call by
call. For a call of agent a generating tokens [start, end):

  1. context phase: the tokens before `start` that the scheme makes agent a
     compute (`jaxkv.policies.sharing.lragent` says which) are prefilled in
     chunks with a's adapter; the last one yields the logits of the first
     generated token. Its wall time is the call's TTFT.
  2. generation: the gold tokens [start, end) are fed back one per step
     (teacher-forced decode, `lax.scan`), scoring each gold token's logprob and
     the greedy argmax under the scheme; their KV is written as agent a's
     output, as real generation would. The last generated token is left for
     the next call to process (as after real sampling).

Fidelity is measured against `non_shared` on the same trajectory (Delta-NLL
of the gold tokens, greedy agreement); tokens/s is generated tokens over the
trajectory's wall time (TTFT + decode of every call), LRAgent's end-to-end
system throughput. One trajectory per runner; batch size 1.

Both phases run on the one driver (`jaxkv.engine.driver`): the context phase
is its chunked prefill, generation its teacher-forced `decode_scan`. Shapes
are bucketed by `jaxkv.kv.plan`, so a warm-up pass compiles what a timed pass
runs.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import artifacts
from jaxkv.config import PAGE_SIZE, CacheConfig
from jaxkv.data.agents import Trajectory
from jaxkv.engine.driver import Driver
from jaxkv.engine.kv_manager import KVManager
from jaxkv.kv import plan
from jaxkv.models.forward import Capture, LayerWindow, LoraInputs
from jaxkv.models.lora import LoraWeights
from jaxkv.policies.sharing import lragent


@dataclasses.dataclass
class CallResult:
  """One agent call under a scheme."""
  role: int
  start: int
  end: int
  computed: int          # tokens run through the full model in the context phase
  recomputed: int        # DroidSpeak: tokens whose critical layers were recomputed
  ttft_s: float
  decode_s: float
  logprob: np.ndarray    # [end - start] logprob of each gold token
  argmax: np.ndarray     # [end - start] greedy token at each step


@dataclasses.dataclass
class RunResult:
  scheme: str
  tokens: int
  calls: list[CallResult]
  kv_bytes: int
  window: tuple[int, int] | None

  @property
  def generated(self) -> int:
    return sum(c.end - c.start for c in self.calls)

  @property
  def wall_s(self) -> float:
    return sum(c.ttft_s + c.decode_s for c in self.calls)

  def nll(self) -> float:
    return float(-np.mean(np.concatenate([c.logprob for c in self.calls])))


_OWNER = "agents"    # this runner's name in the KV manager (its allocations)


# ----------------------------------------------------------------------------- runner
class AgentRunner:
  """Runs trajectories of role agents under one sharing scheme (see module docstring).

  Args:
    llm: the base model (`jaxkv.load`).
    lora: shared-A multi-LoRA weights, adapter i = role i (`load_peft`); None: the
      shipped SmolLM2-135M role adapters (`jaxkv.artifacts.load_role_adapters`).
    scheme: one of `lragent.SCHEMES`.
    max_tokens: longest trajectory this runner takes.
    window: DroidSpeak's critical layers (l0, l1) (`profile_window`).
    chunk: prefill chunk length.
    kv: a `KVManager` to take the trajectory's slots from (a server's, shared with
      its engine and other runners; decoupled schemes need its pool's low-rank value
      cache of the adapters' rank), or None: a fresh pool of its own per trajectory.
      base_shared keeps one low-rank value pool per agent, which a shared pool
      cannot hold: it runs on a pool of its own only.
  """

  def __init__(self, llm, lora: LoraWeights | None, scheme: str, *, max_tokens: int,
               window: tuple[int, int] | None = None, chunk: int = 256,
               attn_impl: str = "auto", kv: KVManager | None = None):
    self.scheme = lragent.check_scheme(scheme)
    if lora is None:
      lora = artifacts.load_role_adapters(llm.config)[1]   # shapes checked against llm
    if scheme == "droidspeak" and window is None:
      raise ValueError("droidspeak needs its critical-layer window (profile_window)")
    if scheme in lragent.DECOUPLED and "v" not in lora.targets:
      raise ValueError(f"{scheme} shares the value cache as base + low rank: needs a LoRA on v")
    self.cfg, self.lora, self.window = llm.config, lora, window
    self.graphdef, self.weights, self.dtype = llm.graphdef, llm.weights, llm.dtype
    self.n_agents, self.chunk, self.attn_impl = lora.num_adapters, chunk, attn_impl
    self.size = -(-max_tokens // PAGE_SIZE) * PAGE_SIZE
    self.mode = "decoupled" if scheme in lragent.DECOUPLED else "full"
    regions = lragent.num_regions(scheme, self.n_agents)
    self.cache = CacheConfig(num_pages=1 + regions * self.size // PAGE_SIZE,
                             page_size=PAGE_SIZE, max_seq_len=self.size, dtype=str(self.dtype))
    self.max_tokens = max_tokens
    self.lr_rank = self.lora.rank if self.mode == "decoupled" else 0
    self.shared_kv = kv
    if kv is not None and self.scheme == "base_shared":
      raise ValueError("base_shared keeps one low-rank value pool per agent, which a shared "
                       "KV pool cannot hold: run it with a pool of its own (kv=None)")
    if kv is not None and self.lr_rank and kv.lr_rank != self.lr_rank:
      raise ValueError(f"{self.scheme} shares the value cache as base + low rank: the KV "
                       f"manager's pool needs a low-rank value cache of rank {self.lr_rank}, "
                       f"it has {kv.lr_rank}")
    self.kv: KVManager | None = kv
    self.regions: list[int] = []           # the allocator sequence of each slot region
    self.region_slots: list[np.ndarray] = []

  @property
  def driver(self) -> Driver:
    """The KV manager's driver (the pool every step runs on)."""
    return self.kv.driver

  # -- host-side maps: region r holds positions [0, size) in its own allocator sequence
  def _slots(self, region, positions):
    return self.region_slots[region][np.asarray(positions)]

  def _region(self, agent: int) -> int:
    return agent if self.scheme == "non_shared" else 0

  def _view(self, agent: int, width: int) -> np.ndarray:
    row = np.zeros(width, np.int32)
    n = min(width, self.size)
    row[:n] = self._slots(self._region(agent), np.arange(n))
    if self.scheme != "droidspeak":
      return row[None]
    own = np.zeros(width, np.int32)
    own[:n] = self._slots(1 + agent, np.arange(n))
    rec = np.zeros(width, bool)
    rec[:n] = self.recomputed[agent][:n]
    return lragent.droidspeak_view(row, own, rec, self.window, self.cfg.num_layers)[:, None]

  def _lora(self, agent: int, lr_write=None) -> LoraInputs:
    return LoraInputs(self.lora, jnp.asarray([agent], jnp.int32), lr_write, mode=self.mode)

  def _reset(self):
    """Fresh caches: the regions' slots (a new pool of its own, or fresh sequences of
    the shared KV manager's pool)."""
    self.release()
    if self.shared_kv is None:
      self.kv = KVManager(self.cfg, self.cache, self.graphdef, self.weights,
                          lr_rank=self.lr_rank, attn_impl=self.attn_impl)
    alloc = self.kv.allocator
    try:
      for _ in range(lragent.num_regions(self.scheme, self.n_agents)):
        seq = alloc.new_sequence()
        self.regions.append(seq)
        self.kv.extend(seq, self.size, owner=_OWNER)
        self.region_slots.append(alloc.slot_map(seq))
    except BaseException:        # e.g. the pool is short: give back what was taken
      self.release()
      raise
    self.written, self.seen = 0, [0] * self.n_agents
    if self.scheme == "base_shared":
      vlr = self.driver.kv.vlr
      self.own_vlr = [vlr] + [jnp.zeros_like(vlr) for _ in range(self.n_agents - 1)]
    if self.scheme == "droidspeak":
      self.recomputed = [np.zeros(self.size, bool) for _ in range(self.n_agents)]
      self.ecache = np.zeros((self.size, self.cfg.hidden_size), np.float32)

  def _swap_in(self, agent):
    if self.scheme == "base_shared":
      self.driver.kv = dataclasses.replace(self.driver.kv, vlr=self.own_vlr[agent])

  def _swap_out(self, agent):
    if self.scheme == "base_shared":
      self.own_vlr[agent] = self.driver.kv.vlr

  # -- phases
  def _prefill(self, ids, agent, lo, hi, *, recompute=False):
    """Runs positions [lo, hi); returns (logprob, argmax) of ids[hi] after the last chunk."""
    s = self.driver.kv.num_slots
    region = 1 + agent if recompute else self._region(agent)
    capture = Capture(hidden_at=self.window[0] if self.scheme == "droidspeak" and not recompute
                      else None)

    def options(ch: plan.Chunk) -> dict:
      pos, n = ch.positions[0], int(ch.count[0])
      write = np.full(pos.size, s, np.int32)
      write[:n] = self._slots(region, pos[:n])
      lr_write = None
      if self.scheme == "base_shared":             # base only where nobody wrote it yet
        lr_write = jnp.asarray(write[None])
        write = np.where(pos >= self.written, write, s).astype(np.int32)
      window = None
      if recompute:
        hidden_in = np.zeros((1, pos.size, self.cfg.hidden_size), np.float32)
        c0 = int(pos[0])
        hidden_in[0, :n] = self.ecache[c0:c0 + n]
        window = LayerWindow(jnp.asarray(hidden_in, self.dtype), *self.window)
      return dict(write_slots=jnp.asarray(write[None]), lora=self._lora(agent, lr_write),
                  window=window, capture=capture)

    lp = am = None
    for ch, out in self.driver.prefill(
        [plan.Row(ids[lo:hi], lo)], chunk=self.chunk, slot_map=lambda w: self._view(agent, w),
        read=None if recompute else "last", targets=[np.append(ids, 0)[lo + 1:hi + 1]],
        options=options):
      if out.hidden_at is not None:
        c0, n = int(ch.positions[0, 0]), int(ch.count[0])
        self.ecache[c0:c0 + n] = np.asarray(out.hidden_at[0, :n], np.float32)
      if not recompute:
        lp, am = out.logprob[0, 0], out.argmax[0, 0]
    return lp, am

  def _generate(self, ids, agent, start, end):
    """Feeds gold tokens [start, end - 1); returns logprob/argmax of ids[start + 1:end]."""
    n = end - 1 - start
    if n <= 0:
      return np.zeros(0, np.float32), np.zeros(0, np.int32)
    nb = plan.bucket(n, 8, plan.CHUNK_FINE)   # decode steps: short calls (reflect) pad less
    forced = np.zeros((nb, 1), np.int32)
    forced[:n, 0] = ids[start + 1:end]
    width = plan.width(end)
    own = self._slots(self._region(agent), np.arange(min(width, self.size)))
    capture = Capture(hidden_at=self.window[0] if self.scheme == "droidspeak" else None)
    out = self.driver.decode(
        [ids[start]], [start], self._view(agent, width), [n], num_steps=nb,
        forced=jnp.asarray(forced), write_map=jnp.asarray(plan.slot_rows([own], width)),
        lora=self._lora(agent), capture=capture)
    if out.hidden_at is not None:
      self.ecache[start:end - 1] = np.asarray(out.hidden_at[:n, 0], np.float32)
    return np.asarray(out.logprob[:n, 0]), np.asarray(out.tokens[:n, 0])

  def _call(self, ids, c) -> CallResult:
    a, start, end = c.role, c.start, c.end
    shared = self.scheme != "non_shared"
    own_cache = self.scheme in ("non_shared", "base_shared", "droidspeak")
    lo = self.seen[a] if own_cache else self.written
    t0 = time.perf_counter()
    self._swap_in(a)
    recomputed = 0
    if self.scheme == "droidspeak":
      hi = min(self.written, start)
      if hi > lo:                                   # tokens another agent wrote: recompute
        self.recomputed[a][lo:hi] = True            # (the view reads the copy being written)
        self._prefill(ids, a, lo, hi, recompute=True)
        recomputed = hi - lo
      lo = max(lo, self.written)
    lo = min(lo, start - 1)
    lp0, am0 = self._prefill(ids, a, lo, start)
    lp0, am0 = float(lp0), int(am0)
    t1 = time.perf_counter()
    lp, am = self._generate(ids, a, start, end)
    self._swap_out(a)
    t2 = time.perf_counter()
    self.seen[a] = end - 1
    if shared:
      self.written = max(self.written, end - 1)
    computed = start - lo
    return CallResult(a, start, end, computed, recomputed, t1 - t0, t2 - t1,
                      np.concatenate([[lp0], lp]).astype(np.float32),
                      np.concatenate([[am0], am]).astype(np.int32))

  def run(self, traj: Trajectory) -> RunResult:
    """All calls of one trajectory on fresh caches."""
    if len(traj) > self.max_tokens:
      raise ValueError(f"trajectory {traj.session} has {len(traj)} tokens > max_tokens "
                       f"{self.max_tokens}")
    if traj.calls and traj.calls[0].start < 1:
      raise ValueError("the first agent call needs context before it")
    self._reset()
    calls = [self._call(traj.ids, c) for c in traj.calls]
    jax.block_until_ready(self.driver.kv)
    rec = sum(c.recomputed for c in calls)
    kvb = lragent.model_kv_bytes(self.scheme, len(traj), self.cfg, self.lora,
                                 jnp.dtype(self.dtype).itemsize, recomputed_tokens=rec,
                                 window=self.window or (0, 0))
    return RunResult(self.scheme, len(traj), calls, kvb, self.window)

  def release(self) -> None:
    """Gives the trajectory's slots back to the pool (a closed session)."""
    for seq in self.regions:
      self.kv.allocator.free_sequence(seq)
    self.regions, self.region_slots = [], []

  # -- serving: one live trajectory that requests extend (jaxkv.server.backends)
  def start(self) -> None:
    """Fresh caches for a live trajectory, extended request by request (`respond`)."""
    if self.scheme == "droidspeak":
      raise ValueError("droidspeak needs a profiled critical-layer window per model: "
                       "serve one of the other schemes")
    self._reset()
    self.held = np.zeros(0, np.int32)      # the tokens whose KV the caches hold, in order

  def respond(self, ids, role: int, max_tokens: int, stop_ids) -> tuple[np.ndarray, dict]:
    """Role `role` answers the prompt `ids` (the whole trajectory so far) greedily,
    its reply joining the trajectory every role reads under the scheme.

    Tokens the caches hold for a prefix of `ids` are not recomputed: under a shared
    scheme whoever wrote them first (any role), under non_shared / base_shared this
    role's own earlier work. A prompt that leaves the held trajectory (an edited
    message, a reply re-tokenised differently) rolls every cache back to where it
    left. Returns (reply tokens, ending with a stop token if one came; what it cost:
    `computed` prompt tokens this role ran, `shared` prompt tokens it read without
    running, `ttft_s`)."""
    ids = np.asarray(ids, np.int32)
    n = ids.size
    if not 0 <= role < self.n_agents:
      raise ValueError(f"role {role} of {self.n_agents} role adapters")
    if n < 1 or n + max_tokens > self.size:
      raise ValueError(f"{n} prompt + {max_tokens} reply tokens exceed the trajectory "
                       f"cap {self.size}")
    m = min(n, self.held.size)
    same = np.flatnonzero(ids[:m] != self.held[:m])
    keep = int(same[0]) if same.size else m
    self.written, self.seen = min(self.written, keep), [min(x, keep) for x in self.seen]
    lo = self.seen[role] if self.scheme in ("non_shared", "base_shared") else self.written
    lo = min(lo, n - 1)
    t0 = time.perf_counter()
    self._swap_in(role)
    _, first = self._prefill(ids, role, lo, n)
    reply = [int(first)]
    ttft = time.perf_counter() - t0
    stops = np.asarray(sorted(stop_ids) or [-1], np.int32)
    if reply[0] not in stop_ids and max_tokens > 1:
      steps = max_tokens - 1
      width = plan.width(n + max_tokens)
      own = self._slots(self._region(role), np.arange(min(width, self.size)))
      out = self.driver.decode(
          [reply[0]], [n], self._view(role, width), [steps],
          num_steps=plan.bucket(steps, 8, plan.CHUNK_FINE), stop_ids=jnp.asarray(stops),
          write_map=jnp.asarray(plan.slot_rows([own], width)), lora=self._lora(role))
      reply += np.asarray(out.tokens)[np.asarray(out.emitted)[:, 0], 0].tolist()
    self._swap_out(role)
    reply = np.asarray(reply, np.int32)
    held = n + reply.size - 1              # the last reply token has no KV yet
    self.held = np.concatenate([ids, reply[:-1]])
    self.seen[role] = held
    if self.scheme != "non_shared":
      self.written = max(self.written, held)
    return reply, dict(computed=n - lo, shared=lo, ttft_s=ttft)


def fidelity(result: RunResult, reference: RunResult) -> dict:
  """Delta-NLL of the gold tokens and greedy agreement vs the reference (non_shared)."""
  lp = np.concatenate([c.logprob for c in result.calls])
  lp_ref = np.concatenate([c.logprob for c in reference.calls])
  am = np.concatenate([c.argmax for c in result.calls])
  am_ref = np.concatenate([c.argmax for c in reference.calls])
  return dict(delta_nll=float(np.mean(lp_ref) - np.mean(lp)),
              greedy_agreement=float(np.mean(am == am_ref)))


def call_accuracy(result: RunResult, traj: Trajectory) -> dict:
  """LRAgent's accuracy in the form these models allow: per role, how many of its calls
  greedy generation over the scheme's shared cache reproduces exactly.

  Free greedy generation writes a call's gold tokens exactly iff the greedy token
  equals the gold one at every step with the gold prefix fed (by induction over the
  steps), so the teacher-forced pass's argmax decides it with no second run. The
  action agent's calls are the tool-call arguments (an exact call: right values,
  nothing evicted or corrupted by sharing); the reflect agent's is its verdict
  "Reflect[right]" / "Reflect[wrong]". Token-exact is at most as lenient as
  JSON-normalised matching (a whitespace variant counts as a miss).

  Returns {"<role>_exact": calls reproduced, "<role>_n": calls} for action and reflect.
  """
  out = {}
  for role, name in ((1, "action"), (2, "reflect")):
    calls = [c for c in result.calls if c.role == role]
    out[f"{name}_exact"] = sum(bool(np.array_equal(c.argmax, traj.ids[c.start:c.end]))
                               for c in calls)
    out[f"{name}_n"] = len(calls)
  return out


def profile_window(llm, lora: LoraWeights, ids: np.ndarray, n_critical: int, *,
                   attn_impl: str = "auto") -> tuple[tuple[int, int], np.ndarray]:
  """DroidSpeak's critical layers: each agent prefills `ids` into its own cache
  (non_shared) and the window of n_critical layers whose K/V differ most across
  agents is chosen. Returns ((l0, l1), per-layer deviation [L])."""
  r = AgentRunner(llm, lora, "non_shared", max_tokens=len(ids) + 1, attn_impl=attn_impl)
  r._reset()
  n = len(ids)
  for a in range(r.n_agents):
    r._prefill(np.asarray(ids), a, 0, n)
  slots = np.stack([r._slots(a, np.arange(n)) for a in range(r.n_agents)])    # [A, T]
  k = np.asarray(r.driver.kv.k)[:, slots].transpose(1, 0, 2, 3, 4)           # [A, L, T, H, D]
  v = np.asarray(r.driver.kv.v)[:, slots].transpose(1, 0, 2, 3, 4)
  dev = lragent.layer_deviation(k, v)
  return lragent.critical_window(dev, n_critical), dev
