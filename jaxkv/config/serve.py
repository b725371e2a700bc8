"""What the commands serve: `ServerConfig` (the HTTP server, its session kinds) and
`ServeConfig`, the root config of `scripts/serve.py` and `scripts/server.py` that
holds every other group.
"""

from __future__ import annotations

import dataclasses

from jaxkv.config.core import CacheConfig, EngineConfig, MeshConfig, SamplingConfig
from jaxkv.config.methods import MemArtConfig, PruningConfig, ReuseConfig, SemShareConfig


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
