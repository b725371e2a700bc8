"""The OpenAI-compatible HTTP app (FastAPI): routes over one `EngineLoop`.

    app = create_app(llm, serve_config)      # jaxkv.load(...) and a ServeConfig
    uvicorn.run(app, host=..., port=...)     # scripts/server.py does this

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as
server-sent events with `"stream": true`), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text format). With `--config.engine.prefix_cache`
a prompt adopts its longest cached prefix and
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens it did
not prefill. Errors are OpenAI's error JSON: 400 for a malformed body or a
prompt that does not fit, 404 for an unknown model, 429 when
`server.max_pending` requests are already queued or running, 500 when the
engine failed the request, 503 while shutting down.

A client that disconnects (mid-stream, or while a non-streamed request runs) has
its request cancelled; the next engine step frees its KV slots. The engine loop
starts with the app and, on shutdown, cancels what is left and stops.

Agent sessions: `POST /v1/sessions` opens one (`{"kind": ...}` picks how its KV
is kept, `jaxkv.server.backends`: prefix cache holds, pruning with IntentKV's
QueryMemory, MemArt memory, segment reuse, LRAgent roles sharing one trajectory;
or a request's `session_id` / `user` opens one of the default kind), `DELETE
/v1/sessions/{id}` closes it, `GET /v1/sessions` lists them with their kind and
the tokens each keeps cached; a session idle for `server.session_idle_s` is
closed by the loop. Session-runner requests count toward `server.max_pending`. What a mechanism
did comes back in `usage["jaxkv"]` (session kind, pruned tokens, QueryMemory
cosine, retrieved blocks, reused tokens, role adapter) and sums up in `/metrics`.

Role adapters (`server.role_adapters`): the model id `<model>:<role>` selects an
LRAgent role adapter (shared A, per-row B, one batch mixes roles; `GET /v1/models`
lists them), so a multi-agent framework points each agent at its role's name.

One config turns every mechanism on (`configs/smollm2_agents.py`): role adapters
in the batch engine, and a session kind each for pruning, MemArt, reuse and LRAgent
sharing, each an engine mechanism batched with every other request; a session may
compose agents, pruned and reuse (`{"kind": ["agents", "pruned"]}`: the roles share
one pruned trajectory; `["pruned", "reuse"]`: a pruned session whose prompts splice
stored segments; `["agents", "reuse"]`, `["agents", "pruned", "reuse"]`: reuse runs
each role's adapter on the roles' own segments). Not yet here: MemArt or SemShareKV
composed with another kind (they lay out sequences of their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from jaxkv.config import ServeConfig
from jaxkv.engine import executables
from jaxkv.engine.engine import Request
from jaxkv.engine.grammar import Grammars
from jaxkv.server import guard, protocol
from jaxkv.server.backends import Recall, SessionBackends
from jaxkv.server.loop import EngineLoop, QueueFull
from jaxkv.server.protocol import APIError

log = logging.getLogger("jaxkv.server")
DISCONNECT_POLL_S = 0.25   # how often a waiting non-streamed request checks its client


class _ClientGone(Exception):
  pass


def _error(e: APIError) -> JSONResponse:
  headers = {"Retry-After": "5"} if e.status == 503 else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


def engine_error(res) -> APIError:
  """The HTTP answer to a request the engine failed: 400 when it can never run here
  (`too_large`), 503 with Retry-After when the pool is held by sessions now
  (`pool_busy`), 500 for a failure of the engine's own."""
  msg = res.error or "the engine failed this request"
  if res.error_code == "too_large":
    return APIError(400, msg, code="kv_pool_too_small")
  if res.error_code == "pool_busy":
    return APIError(503, msg, type="server_error", code="kv_pool_busy")
  return APIError(500, msg, type="server_error")


SHUTDOWN = APIError(503, "the server is shutting down; retry on another replica or later",
                    type="server_error", code="shutting_down")


def _tokens(event: tuple) -> tuple[list[int], int]:
  """(generated tokens, cached prompt tokens) of a "tokens" or "done" event."""
  if event[0] == "done":
    return event[1].tokens, event[1].cached_tokens
  return event[1], event[2]


def _finish(reason: str) -> str:
  return {"stop": "stop", "length": "length", "cancelled": "stop"}.get(reason, reason)


def create_app(llm, cfg: ServeConfig) -> FastAPI:
  """The app for `llm` (a `jaxkv.LLM`) with `cfg.server`, `cfg.sampling` defaults."""
  engine = llm.engine
  model_name = cfg.server.model_name or cfg.model
  created = int(time.time())
  backends = SessionBackends(llm, cfg)
  loop = EngineLoop(engine, cfg.server.max_pending, cfg.server.session_idle_s,
                    expire=backends.expire, max_compiled=cfg.server.max_compiled)
  sessions_on = engine.radix is not None or backends.kinds != ("prefix",)
  # served ids: the base model, and "<model>:<role>" for each role adapter
  names = {model_name: -1, **{f"{model_name}:{a}": i for i, a in enumerate(llm.adapters)}}
  tokenizer = llm.tokenizer
  cache = llm.cache_config
  prompt_slots = (cache.num_pages - 1) * cache.page_size
  grammars = Grammars(tokenizer, engine.model_cfg.vocab_size)   # structured output

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    loop.start()
    yield
    await asyncio.to_thread(loop.stop)

  app = FastAPI(title="jaxkv", lifespan=lifespan)
  app.state.loop, app.state.backends = loop, backends
  app.state.max_connections = cfg.server.max_connections
  app.state.header_timeout_s = cfg.server.header_timeout_s
  keys = guard.api_keys(cfg.server)
  app.add_middleware(guard.Guard, keys=keys, hosts=guard.allowed_hosts(cfg.server))
  owners = guard.Owners(bool(keys))

  def key_of(request: HTTPRequest) -> str:
    return getattr(request.state, "api_key", "")

  def not_found(sid: str) -> APIError:
    return APIError(404, f"no open session '{sid}'", param="session_id",
                    code="session_not_found")

  max_body = cfg.server.max_body_bytes

  async def body_of(request: HTTPRequest, empty=None):
    """The body's JSON (`protocol.load_body`), read up to server.max_body_bytes: a
    larger one is 413 as soon as its length says so or its bytes pass the limit.
    `empty`: what a blank body stands for (None: a blank body is an error)."""
    too_big = APIError(413, f"the request body is larger than server.max_body_bytes="
                       f"{max_body}", code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body:
      raise too_big
    raw = bytearray()
    try:
      async with asyncio.timeout(cfg.server.body_timeout_s):
        async for part in request.stream():
          raw += part
          if len(raw) > max_body:
            raise too_big
    except TimeoutError:
      raise APIError(408, f"the request body did not arrive within server.body_timeout_s="
                     f"{cfg.server.body_timeout_s:g} s", code="body_timeout") from None
    if empty is not None and not raw.strip():
      return empty
    return protocol.load_body(bytes(raw))

  async def next_event(queue: asyncio.Queue, request: HTTPRequest, rid: str):
    """The next engine event; cancels the request if its client disconnected."""
    while True:
      try:
        return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
      except TimeoutError:
        if await request.is_disconnected():
          loop.cancel(rid)
          raise _ClientGone() from None

  async def recall(req: Request, request: HTTPRequest) -> dict | APIError:
    """Runs a composed session's recall request (`backends.Recall`) to its end: its
    `Result.extra["recall"]`, or the error to answer with."""
    queue = loop.submit(req)
    while (event := await next_event(queue, request, req.id))[0] != "done":
      pass
    return failed(event) or event[1].extra["recall"]

  def failed(event) -> APIError | None:
    """The error a "done" event answers with: the engine failed the request
    (`engine_error`), or cancelled it because the server is shutting down
    (`make_server`); None for any other event."""
    if event[0] != "done":
      return None
    if event[1].finish_reason == "error":
      return engine_error(event[1])
    if event[1].finish_reason == "cancelled" and not loop.alive:
      return SHUTDOWN
    return None

  def decode(tokens: list[int]) -> str:
    return tokenizer.decode(tokens) if tokens else ""

  async def handle(request: HTTPRequest, kind: str):
    try:
      body = await body_of(request)
      # tokenising and rendering the template take a worker thread: a long prompt
      # must not stall the event loop (and every other client's stream, /health)
      p = await asyncio.to_thread(
          protocol.parse, body, kind, models=names.get, tokenizer=tokenizer,
          defaults=cfg.sampling, max_seq_len=cache.max_seq_len, max_prompt_slots=prompt_slots,
          grammars=grammars)
    except APIError as e:
      return _error(e)
    if not sessions_on and p.session is not None and p.session != p.user:
      return _error(APIError(400, "sessions keep KV in the prefix cache: start the server "
                             "with --config.engine.prefix_cache=true", param="session_id"))
    if sessions_on and p.session is not None and not owners.claim(p.session, key_of(request)):
      return _error(not_found(p.session))       # another key's session
    rid = protocol.new_id(kind)
    t_created = int(time.time())
    skind = (backends.kind_of(p.session, role=p.adapter >= 0)
             if sessions_on and p.session is not None else None)
    try:
      if skind not in (None, "prefix"):     # a mechanism's request: built on the loop
        recalled = None
        while True:
          try:
            req = await asyncio.wrap_future(loop.call(
                lambda: backends.engine_request(skind, p.session, p, rid, recalled)))
          except ValueError as e:
            return _error(APIError(400, str(e), param="session_id"))
          if not isinstance(req, Recall):
            break
          try:                         # a new conversation's memory recall (memart)
            recalled = await recall(req.request, request)
          except _ClientGone:
            return JSONResponse({}, status_code=499)
          if isinstance(recalled, APIError):
            return _error(recalled)
        queue = loop.submit(req)
      else:
        if skind == "prefix" and p.session not in backends.engine.sessions:
          try:                                 # a new session: counted against the cap
            await asyncio.wrap_future(loop.call(lambda: backends.open(p.session, "prefix")))
          except ValueError as e:
            return _error(APIError(400, str(e), param="session_id"))
        queue = loop.submit(Request(id=rid, prompt=p.prompt, sampling=p.sampling,
                                    session=p.session if skind == "prefix" else None,
                                    adapter=p.adapter, grammar=p.grammar))
    except QueueFull as e:
      if not loop.alive:
        return _error(APIError(503, str(e), type="server_error", code="shutting_down"))
      return _error(APIError(429, str(e), type="rate_limit_error", code="queue_full"))
    if p.adapter >= 0 and skind != "agents":
      backends.stats.adapter_requests[llm.adapters[p.adapter]] += 1
    stream = protocol.TextStream(p.stop, hold_calls=p.tools)
    try:
      first = await next_event(queue, request, rid)
    except _ClientGone:
      return JSONResponse({}, status_code=499)
    if (err := failed(first)) is not None:
      return _error(err)
    if p.stream:
      return StreamingResponse(sse(p, rid, t_created, queue, first, stream, skind),
                               media_type="text/event-stream")
    event = first
    try:
      while event[0] != "done":
        # the text so far matters only to stop strings: decode it only then
        if p.stop and stream.update(decode(event[1]), final=False)[1]:
          loop.cancel(rid)
          break
        event = await next_event(queue, request, rid)
    except _ClientGone:
      return JSONResponse({}, status_code=499)
    if (err := failed(event)) is not None:
      return _error(err)
    tokens, cached = _tokens(event)
    _, stopped = stream.update(decode(tokens), final=True)
    finish = "stop" if stopped else _finish(event[1].finish_reason)
    return JSONResponse(protocol.response(p, rid, t_created, stream.text, finish,
                                          usage(p, event, tokens, cached, skind)))

  def usage(p, event, tokens, cached, skind) -> dict:
    """OpenAI usage, plus what the KV mechanisms did as "jaxkv" (the session kind,
    `Result.extra` of a session runner, the role adapter) when any took part."""
    extra = {} if skind is None else {"session_kind": skind}
    if event[0] == "done":
      extra.update(event[1].extra or {})
    # a memory region (memart in a composition) is the mechanism's, not the client's
    out = protocol.usage(len(p.prompt), len(tokens),
                         cached - extra.get("memory_cached_tokens", 0))
    if p.adapter >= 0:
      extra["adapter"] = llm.adapters[p.adapter]
    if extra:
      out["jaxkv"] = extra
    return out

  async def sse(p, rid, t_created, queue, event, stream, skind):
    done = False

    def data(obj) -> str:
      return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
      if p.kind == "chat":
        yield data(protocol.chunk(p, rid, t_created, role=True, text=""))
      while True:
        final = event[0] == "done"
        tokens, cached = _tokens(event)
        delta, stopped = stream.update(decode(tokens), final=final)
        if delta:
          yield data(protocol.chunk(p, rid, t_created, text=delta))
        if stopped and not final:
          loop.cancel(rid)
        if final or stopped:
          break
        event = await queue.get()
      if (err := failed(event)) is not None:   # an error chunk, then the end of the stream
        yield data(err.body())
        yield "data: [DONE]\n\n"
        done = True
        return
      reason = "stop" if stopped else _finish(event[1].finish_reason)
      made = []
      if p.tools:
        content, made = protocol.split_tool_calls(stream.rest())
        if made:
          reason = "tool_calls"
        elif content:
          yield data(protocol.chunk(p, rid, t_created, text=content))
      yield data(protocol.chunk(p, rid, t_created, tool_calls=made or None, finish=reason))
      if p.include_usage:
        yield data(protocol.chunk(p, rid, t_created, use=usage(p, event, tokens, cached, skind)))
      yield "data: [DONE]\n\n"
      done = True
    finally:
      if not done:       # the client went away mid-stream (or the server is stopping)
        loop.cancel(rid)

  @app.exception_handler(APIError)
  async def api_error(_request, e: APIError):
    return _error(e)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: HTTPRequest):
    return await handle(request, "chat")

  @app.post("/v1/completions")
  async def completions(request: HTTPRequest):
    return await handle(request, "completion")

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "jaxkv",
         "max_model_len": cache.max_seq_len, "root": model_name,
         "parent": None if i < 0 else model_name} for name, i in names.items()]}

  def need_sessions():
    if not sessions_on:
      raise APIError(400, "sessions keep KV in the prefix cache: start the server with "
                     "--config.engine.prefix_cache=true (or list session kinds in "
                     "--config.server.sessions)")

  @app.post("/v1/sessions")
  async def open_session(request: HTTPRequest):
    """Opens a session ({"session_id": optional, "kind": optional, one of
    server.sessions or a list of them composed, e.g. ["agents", "pruned"]}); its id
    goes in later requests' "session_id" (or "user")."""
    need_sessions()
    body = await body_of(request, empty={})
    if not isinstance(body, dict):
      raise APIError(400, "the request body must be a JSON object")
    sid, want = body.get("session_id"), body.get("kind")
    if sid is not None and (not isinstance(sid, str) or not sid):
      raise APIError(400, "'session_id' must be a non-empty string", param="session_id")
    if isinstance(want, list) and want and all(isinstance(k, str) for k in want):
      pass                                        # a composition: checked by backends
    elif want is not None and want not in backends.kinds:
      raise APIError(400, f"'kind' must be one of {', '.join(backends.kinds)} "
                     "(server.sessions), or a list of them to compose", param="kind")
    sid = sid or f"sess-{uuid.uuid4().hex[:24]}"
    if not owners.claim(sid, key_of(request)):
      raise APIError(409, f"session id '{sid}' is taken", param="session_id",
                     code="session_exists")
    try:
      got = await asyncio.wrap_future(loop.call(lambda: backends.open(sid, want)))
    except ValueError as e:
      raise APIError(400, str(e), param="kind") from e
    return {"id": sid, "object": "session", "kind": got}

  @app.get("/v1/sessions")
  async def list_sessions(request: HTTPRequest):
    """The caller's open sessions (with API keys: those of the caller's key)."""
    need_sessions()
    held = await asyncio.wrap_future(loop.call(lambda: backends.sessions))
    owners.forget_all_but(held)
    return {"object": "list", "data": [
        {"id": k, "object": "session", "kind": kd, "held_tokens": n}
        for k, (kd, n) in sorted(held.items()) if owners.owns(k, key_of(request))]}

  @app.delete("/v1/sessions/{sid:path}")     # :path: an id may hold "/"
  async def close_session(sid: str, request: HTTPRequest):
    """Closes a session: its hold on the cached KV is released (LRU evictable) and
    its runner forgets it (QueryMemory, MemArt memory)."""
    need_sessions()
    if not owners.owns(sid, key_of(request)):
      raise not_found(sid)
    if await asyncio.wrap_future(loop.call(lambda: backends.close(sid))) is None:
      raise not_found(sid)
    return {"id": sid, "object": "session", "deleted": True}

  @app.get("/health")
  async def health():
    if not loop.alive:
      return JSONResponse({"status": "stopping"}, status_code=503)
    return {"status": "ok", "pending": loop.pending}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(prometheus(loop, model_name, backends),
                             media_type="text/plain; version=0.0.4")

  return app


def make_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 0,
                graceful_s: float = 5.0, log_level: str = "warning", flush_s: float = 10.0):
  """A `uvicorn.Server` for `app` whose shutdown answers every request: new ones get
  503 `shutting_down` at once, running ones get `graceful_s` seconds to finish, and
  what is left is cancelled and answered at once (`EngineLoop.cancel_all`: a step still
  running is not waited for) with 503 JSON (a stream that began: an error chunk, then
  `[DONE]`) within `flush_s` before the connections close. Past the app's
  server.max_connections open connections uvicorn answers 503; a connection whose
  request headers take longer than server.header_timeout_s is closed."""
  import uvicorn

  engine_loop = app.state.loop

  class Server(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
      engine_loop.drain()
      deadline = time.monotonic() + graceful_s
      while engine_loop.pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
      if engine_loop.cancel_all():
        log.warning("shutdown: cancelled the requests still running after %.1f s", graceful_s)
      await super().shutdown(sockets)

  return Server(uvicorn.Config(
      app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=flush_s,
      limit_concurrency=app.state.max_connections,
      http=guard.header_deadline_protocol(app.state.header_timeout_s)))


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                    graceful_s: float = 5.0, start_timeout_s: float = 120.0):
  """Runs `app` under uvicorn in a daemon thread (port 0: a free one) and yields the
  `uvicorn.Server` (`make_server`), its base URL as `.url`; on exit it shuts down
  gracefully. For tests and the load benchmark: the caller keeps the engine in reach."""
  import threading

  server = make_server(app, host=host, port=port, graceful_s=graceful_s)
  thread = threading.Thread(target=server.run, name="jaxkv-uvicorn", daemon=True)
  thread.start()
  deadline = time.time() + start_timeout_s
  while not server.started:
    if time.time() > deadline or not thread.is_alive():
      raise RuntimeError("the server did not start")
    time.sleep(0.05)
  server.url = f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}"
  try:
    yield server
  finally:
    server.should_exit = True
    thread.join(60)
    if thread.is_alive():
      raise RuntimeError("the server did not shut down within 60 s")


def prometheus(loop: EngineLoop, model: str, backends: SessionBackends | None = None) -> str:
  """The engine's (and the session runners') counters and gauges in Prometheus'
  text format."""
  engine, m, s = loop.engine, loop.engine.metrics, loop.stats
  alloc = engine.allocator
  pools = [engine.kv_manager] if backends is None else backends.kv_managers
  lab = f'model="{model}"'
  rows = [
      ("jaxkv_requests_running", "gauge", "requests in the batch", engine.num_running),
      ("jaxkv_requests_waiting", "gauge", "requests queued for a row", engine.num_waiting),
      ("jaxkv_requests_rejected_total", "counter", "requests answered 429", s.rejected_full),
      ("jaxkv_engine_steps_total", "counter", "engine steps", s.steps),
      ("jaxkv_engine_step_errors_total", "counter", "steps that raised", s.step_errors),
      ("jaxkv_engine_busy_seconds_total", "counter", "time inside engine steps", s.busy_s),
      ("jaxkv_prompt_tokens_total", "counter", "prompt tokens prefilled", m.prefill_tokens),
      ("jaxkv_generation_tokens_total", "counter", "tokens decoded", m.decode_tokens),
      ("jaxkv_prefill_seconds_total", "counter", "time in prefill", m.prefill_s),
      ("jaxkv_decode_seconds_total", "counter", "time in decode", m.decode_s),
      ("jaxkv_kv_pool_bytes", "gauge", "device bytes of the KV pools (one, shared by every "
       "session kind)", sum(k.nbytes for k in pools)),
      ("jaxkv_kv_pools", "gauge", "KV pools this server holds", len(pools)),
      ("jaxkv_kv_reserved_pages", "gauge", "pages running requests may still take",
       engine.kv_manager.reserved(None)),
      ("jaxkv_kv_live_slots", "gauge", "KV slots in use", alloc.num_live_slots),
      ("jaxkv_kv_free_pages", "gauge", "free KV pages", alloc.num_free_pages),
      ("jaxkv_kv_peak_bytes", "gauge", "peak KV bytes in use", m.peak_kv_bytes),
      ("jaxkv_compiled_variants", "gauge", "compiled variants of the engine's steps in "
       "memory", executables.count()),
      ("jaxkv_compiled_releases_total", "counter", "times every compiled program was "
       "dropped at server.max_compiled", loop.compiled.clears),
  ]
  if engine.radix is not None:
    rows += [("jaxkv_prefix_cache_hit_tokens_total", "counter",
              "prompt tokens adopted from the prefix cache (not prefilled)", m.cached_tokens),
             ("jaxkv_prefix_cache_tokens", "gauge",
              "tokens held by the prefix cache (every adapter's tree)",
              sum(t.num_cached_tokens for t in engine.caches))]
  labelled = {"finish_reason": ("jaxkv_requests_finished_total", "finished requests by "
                                "finish reason", s.finished)}
  if backends is not None:
    held = backends.sessions   # read from the server thread: a snapshot, may be a step old
    b = backends.stats
    rows += [("jaxkv_sessions_open", "gauge", "open agent sessions", len(held)),
             ("jaxkv_session_held_tokens", "gauge", "tokens the open sessions keep cached",
              sum(n for _, n in held.values()))]
    for mech in engine.mechanisms.values():   # each KV mechanism's own counters
      rows += [(name, "counter", about, mech.stats[key]) for name, key, about in mech.metrics]
    if engine.lora is not None:   # LRAgent's shared A: one down-projection for every role
      a_bytes = sum(a.nbytes for a in engine.lora.a.values())
      rows += [("jaxkv_lora_adapters", "gauge", "role adapters served",
                engine.lora.num_adapters),
               ("jaxkv_lora_shared_a_saved_bytes", "gauge", "adapter bytes the shared A "
                "saves over one A per role", a_bytes * (engine.lora.num_adapters - 1))]
    labelled["kind"] = ("jaxkv_session_requests_total", "requests by session kind "
                        "(non-prefix kinds)", b.requests)
    labelled["adapter"] = ("jaxkv_adapter_requests_total", "batch-engine requests by role "
                           "adapter (agents sessions count under their kind)",
                           b.adapter_requests)
  out = []
  for name, kind, help_, value in rows:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {value}"]
  for key, (name, help_, counts) in labelled.items():
    out += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
    for v, n in sorted(counts.copy().items()):
      out.append(f'{name}{{{lab},{key}="{v}"}} {n}')
  return "\n".join(out) + "\n"
