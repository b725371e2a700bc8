r"""OpenAI-compatible HTTP server: continuous batching over one engine loop.

    jaxkv-server --config=configs/smollm2.py [--host=127.0.0.1] [--port=8000]

(`python scripts/server.py ...` from a clone runs the same command.)

Then point any OpenAI client at it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="smollm2-135m",
                                   messages=[{"role": "user", "content": "Hi"}])

Endpoints: POST /v1/chat/completions and /v1/completions (with "stream": true as
server-sent events), GET /v1/models, /health, /metrics (Prometheus text). The
model id is `--config.server.model_name` (default: `--config.model`). Every
concurrent request joins the same decode batch (`--config.engine.max_batch`
rows); past `--config.server.max_pending` queued + running requests the server
answers 429. Sampling defaults come from `--config.sampling.*` and each request
may override temperature, top_p, top_k, seed, max_tokens and stop. Ctrl-C / SIGTERM
answers new requests 503, lets running ones finish for up to --graceful_s, then
cancels the rest and answers them 503 JSON (a stream: an error chunk, then [DONE]).
See jaxkv/server/app.py for what is not served yet.

Every KV mechanism in one server: `--config=configs/smollm2_agents.py` (role
adapters by model name, and agent sessions pruned by IntentKV, kept in MemArt
memory, or reusing earlier prompts' segments; `examples/agent_sessions.py` drives
them all and prints what each did).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from absl import flags
from ml_collections import config_flags

from jaxkv import cli
from jaxkv.config import ServeConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py", lock_config=True)
_HOST = flags.DEFINE_string("host", None, "address to bind (default --config.server.host)")
_PORT = flags.DEFINE_integer("port", None, "port (default --config.server.port)")
_GRACEFUL = flags.DEFINE_float("graceful_s", 30.0, "on shutdown, seconds running requests "
                               "may take before they are cancelled")
_XLA_CACHE = flags.DEFINE_string("xla_cache", None, "persistent compilation cache directory "
                                 "(default $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxkv/xla; "
                                 "empty: off)")


def _main(argv):
  del argv
  from jaxkv.server.app import create_app, make_server

  cli.require({"--config": _CONFIG.value}, "--config=configs/smollm2.py")
  cfg = cli.load_config(ServeConfig, _CONFIG.value)
  if cfg.mode != "requests":
    cli.fail(f"the server runs --config.mode=requests (continuous batching); "
             f"mode={cfg.mode!r} is served by scripts/serve.py only so far")
  cli.compilation_cache(_XLA_CACHE.value)
  t0 = time.perf_counter()
  llm = cli.load_llm(cfg)
  host = _HOST.value or cfg.server.host
  port = cfg.server.port if _PORT.value is None else _PORT.value
  print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s; serving "
        f"'{cfg.server.model_name or cfg.model}' on http://{host}:{port}/v1", file=sys.stderr)
  cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, host=host))
  make_server(create_app(llm, cfg), host=host, port=port, log_level="info",
              graceful_s=_GRACEFUL.value).run()


def main() -> None:
  """The `jaxkv-server` command (and `python scripts/server.py`)."""
  cli.run(_main, ServeConfig, doc=__doc__)


if __name__ == "__main__":
  main()
