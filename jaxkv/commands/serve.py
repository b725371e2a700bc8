r"""Batch inference: JSONL requests in, JSONL results out (written as each finishes).

    jaxkv-serve --config=configs/smollm2.py \
        --input=examples/requests.jsonl --output=results.jsonl \
        [--config.sampling.max_tokens=64] [--config.engine.max_batch=4]

(`python scripts/serve.py ...` from a clone runs the same command.)

Rerunning the same command resumes: ids already answered in --output are
skipped. See jaxkv/engine/batch.py for the line formats. Compiled steps are kept
between runs in --xla_cache (default ~/.cache/jaxkv/xla, or $JAX_COMPILATION_CACHE_DIR;
--xla_cache= turns it off), so a rerun skips most of the compilation.

A line may name the KV mechanism it runs on (`"kind": "pruned" | "memart" | "reuse" |
"semshare" | "agents"`, the server's session kinds; `"user"` names a pruned, memart or
agents line's session, an agents line its role adapter with `"role"`); lines that name
none run on the config's mode=reuse / semshare / memart, or as plain requests. Every
kind runs in the same batch engine as a request of that mechanism
(`jaxkv.engine.mechanisms`), so they batch, sample and stream like plain ones, mixed in
one file. Requests are admitted in file order and the mechanisms' prefills run in
admission order within an engine step, so a request sees the segments, references and
session history the requests before it stored or wrote (a radix prefix is matched at
admission, so one admitted in the same step as an earlier request with that prefix
computes it again, as with the plain prefix cache). Every record adds
what its mechanism did (the server's `usage["jaxkv"]`):

- Segment reuse (`--config=configs/smollm2_reuse.py`, or `--config.mode=reuse`): each
  prompt is prefilled reusing the K/V of segments earlier prompts contained
  (`--config.reuse.method=tiered|cacheblend|epic|naive|prefix`, the segment-reuse
  paper); records add cached / reused / prefilled tokens and each match's tier.
- SemShareKV (`--config=configs/smollm2_semshare.py`, or `--config.mode=semshare`): a
  prompt whose LSH similarity to an earlier prompt reaches
  `--config.semshare.threshold` reuses that prompt's K/V through token-level matching,
  others are prefilled and kept as references; records add the similarity, whether it
  was reused and the recomputed share.
- MemArt memory (`--config=configs/smollm2_memart.py`, or `--config.mode=memart`): chat
  requests; `"user"` names the session (default: the request id). Every message
  before the last is the session's history, written as KV blocks into its memory the
  first time it is seen; the last (user) message alone is prefilled over the blocks
  retrieved for it; records add the blocks retrieved, the session's memory size and
  the prefilled / probe token counts.
- LRAgent agents (`--config.server.role_adapters=shipped`, the scheme
  `--config.server.agent_scheme`): `{"kind": "agents", "role": "plan", "user": <session>}`
  lines extend their session's one trajectory, each role reading the KV the others
  computed (base_lr_shared) instead of prefilling it; sessions open on their first line,
  with no cap (an idle session's trajectory gives way when the pool needs room);
  records add the role, the computed and shared prompt tokens and the KV bytes.
- Compositions (`"kind": ["agents", "pruned", "memart", "reuse"]` or any list the server's
  `POST /v1/sessions` takes; `jaxkv.engine.compose_request`): the kinds act on one
  session as in the server, what does not combine is the line's error saying why. A
  composed session's lines run one at a time in file order (a line waits for the
  session's line before it: with memart, a line that opens a new conversation first
  writes the last one, its reply included, into the session's memory); records add
  every part's figures.

Agent sessions (`--config=configs/smollm2_sessions.py`, or `--config.mode=sessions`):
--input is a ToolBench-format trace file (jaxkv/data/traces.py, e.g. from
scripts/make_traces.py); every session is replayed turn by turn with the
configured pruning policy and layout (`--config.pruning.method=intentkv
--config.pruning.layout=dead_slot --config.pruning.budget=3584`) and written as
one line `{"id", "turns": [per-turn metrics], "summary"}`; a malformed trace
entry becomes an error line naming its index and the run goes on.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import tempfile
import time

from absl import flags
from ml_collections import config_flags

from jaxkv import cli
from jaxkv.config import ServeConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py", lock_config=True)
_INPUT = flags.DEFINE_string("input", None, "JSONL file of requests")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL file of results (one record per input "
                              "line; a rerun resumes)")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "start a fresh output instead of resuming")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")
_XLA_CACHE = flags.DEFINE_string("xla_cache", None, "persistent compilation cache directory "
                                 "(default $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxkv/xla; "
                                 "empty: off)")


def _check_paths(src: pathlib.Path, dst: pathlib.Path, mode: str) -> None:
  """Refuses unusable --input / --output before anything loads."""
  if not src.exists():
    from jaxkv.data.traces import MAKE_TRACES_HINT
    cli.fail(f"--input {src} does not exist" +
             (f"; {MAKE_TRACES_HINT}" if mode == "sessions" else ""))
  if src.is_dir():
    cli.fail(f"--input {src} is a directory, not a JSONL file")
  if dst.is_dir():
    cli.fail(f"--output {dst} is a directory; give a file path")
  for parent in dst.parents:
    if parent.exists() and not parent.is_dir():
      cli.fail(f"--output {dst}: {parent} is a file, not a directory")
    if parent.exists():
      break


def _scan(src: pathlib.Path, cfg, done: set[str]) -> tuple[list[str], list, int, set]:
  """One pass over the input without the model: the record key of every line in
  order, the unusable lines' errors, how many usable lines are still to run, and the
  mechanism kinds those lines name."""
  from jaxkv.engine import batch
  order: list[str] = []
  errors: list = []
  kinds = [p.kind for p, _ in batch.read_requests(src, lambda prompt, tools: [], cfg.sampling,
                                                  done, errors.append, order, parsed=True)]
  return order, errors, len(kinds), set(kinds) - {None}


def _multi_process(dst: pathlib.Path) -> bool:
  """Joins a multi-process run when JAXKV_COORDINATOR is set (scripts/launch.py).

  Every process reads the same input and runs the same steps (SPMD); results are
  resumed from --output only in single-process runs, so all processes start from
  the same state."""
  from jaxkv import distributed
  if not distributed.requested():
    return False
  try:
    multi = distributed.initialize()
  except ValueError as e:
    cli.fail(str(e))
  # only process 0 looks: it alone writes --output, and may already have created it
  # by the time a follower would look
  if multi and distributed.is_leader() and dst.exists() and not _OVERWRITE.value:
    cli.fail(f"--output={dst} exists: a multi-process run starts fresh (add --overwrite, "
             "or resume it in a single process)")
  return multi


def _summary(rows: list[tuple[str, str]], m: dict) -> None:
  print("\nmetrics (first use of each shape includes compilation)")
  for k, v in rows:
    print(f"  {k:<18} {v}")
  print("METRICS " + json.dumps(m))


def _main(argv):
  del argv
  import tqdm

  from jaxkv.engine import batch

  cli.require({"--config": _CONFIG.value, "--input": _INPUT.value, "--output": _OUTPUT.value},
              "--config=configs/smollm2.py --input=examples/requests.jsonl "
              "--output=results.jsonl")
  cfg = cli.load_config(ServeConfig, _CONFIG.value)
  src, dst = pathlib.Path(_INPUT.value), pathlib.Path(_OUTPUT.value)
  if _multi_process(dst):   # every process computes; only process 0 writes --output
    from jaxkv import distributed
    if not distributed.is_leader():
      dst = pathlib.Path(tempfile.mkdtemp(prefix="jaxkv_follower_")) / dst.name
  _check_paths(src, dst, cfg.mode)
  out = batch.ResultFile(dst, overwrite=_OVERWRITE.value)
  cli.compilation_cache(_XLA_CACHE.value)
  if cfg.mode == "sessions":
    return serve_sessions(cfg, src, out)
  order, errors, todo, kinds = _scan(src, cfg, out.done)
  if (cfg.mode in ("reuse", "semshare", "memart") or kinds) and todo:
    return serve_mechanism(cfg, src, out, todo, kinds)
  total = len(order)
  answered = total - todo - len(errors)   # every input line is one of the three
  if total == 0:
    out.finish([])
    print(f"nothing to do: {src} holds no requests", file=sys.stderr)
    return
  if todo == 0:                 # only unusable lines left: their errors, no model
    for e in errors:
      print(f"error: {e}", file=sys.stderr)
      out.add(e.record())
    n = out.finish(order)
    print(f"nothing to run: every usable request of {src} is answered in {dst} "
          f"({n} records, one per input line)", file=sys.stderr)
    return

  t0 = time.perf_counter()
  llm = cli.load_llm(cfg)
  print(f"loaded {cfg.model}: {llm.config.architecture}, {llm.config.num_layers} layers, "
        f"d_kv={llm.config.d_kv} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
  print(f"{src}: {total} requests: {todo} to run, {answered} already answered in {dst}"
        + (f", {len(errors)} unusable (errors below)" if errors else ""), file=sys.stderr)

  # one step per input line: answered ones start the bar, a request or an error
  # record advances it, so it ends at total
  bar = tqdm.tqdm(total=total, initial=answered, unit="req",
                  disable=not _PROGRESS.value, file=sys.stderr)
  line_errors = request_errors = 0

  def on_error(e: batch.RequestError) -> None:
    nonlocal line_errors
    line_errors += 1
    bar.write(f"error: {e}", file=sys.stderr)
    out.add(e.record())
    bar.update(1)

  def encode(prompt, tools):
    if isinstance(prompt, list) and cfg.system_prompt and prompt[0].get("role") != "system":
      prompt = [{"role": "system", "content": cfg.system_prompt}, *prompt]
    return llm.encode(prompt, tools=tools)

  order: list[str] = []
  requests = batch.read_requests(src, encode, cfg.sampling, out.done, on_error, order,
                                 grammar=_grammar_of(llm))
  for completion in llm.stream(requests):
    if completion.finish_reason == "error":
      request_errors += 1
      bar.write(f"error: request {completion.id!r}: {completion.error}", file=sys.stderr)
    out.add(completion.to_json())
    bar.update(1)
    m = llm.engine.metrics
    if m.decode_s > 0:
      bar.set_postfix_str(f"decode {m.decode_tokens / m.decode_s:.1f} tok/s", refresh=False)
  bar.close()
  n = out.finish(order)

  m = llm.engine.metrics.summary()
  m["errors"] = line_errors + request_errors     # every error record this run wrote
  m["line_errors"], m["request_errors"] = line_errors, request_errors
  m["records"] = n
  _summary([("requests run", f"{m['requests']}"),
            ("errors", f"{m['errors']} ({line_errors} unusable lines, {request_errors} "
                       f"refused requests)"),
            ("prefill tokens/s", f"{m['prefill_tok_s']:.1f} ({m['prefill_tokens']} tokens)"),
            ("decode tokens/s", f"{m['decode_tok_s']:.1f} ({m['decode_tokens']} tokens)"),
            ("median TTFT s", f"{m['median_ttft_s']:.3f}"),
            ("median latency s", f"{m['median_latency_s']:.3f}"),
            ("peak KV bytes", f"{m['peak_kv_bytes']:,} ({m['peak_live_slots']} live slots)"),
            ("wall s", f"{m['wall_s']:.1f}"),
            ("output", f"{dst} ({n} records, one per input line)")], m)


def _grammar_of(llm):
  """ParsedLine -> the structured-output matcher of its response_format / tool_choice /
  parallel_tool_calls (None without them), as the server builds it; ValueError for
  fields that are wrong."""
  from jaxkv.engine.grammar import Grammars
  from jaxkv.server import structured
  grammars = Grammars(llm.tokenizer, llm.config.vocab_size)

  def build(p):
    if not p.structured:
      return None
    tools = []
    for t in p.tools or ():
      fn = t.get("function", t) if isinstance(t, dict) else None
      if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("with structured output, 'tools' must be function schemas "
                         "({'name': ..., 'parameters': ...}, or OpenAI's tool objects)")
      tools.append({"type": "function", "function": fn})
    return structured.request_grammar(p.structured, tools or None, grammars)
  return build


def _mechanism(kind: str, cfg, llm):
  """The engine mechanism `kind` (pruned / reuse / semshare / memart / agents) on the
  LLM's engine, and a line saying what it is."""
  kv, impl = llm.engine.kv_manager, cfg.engine.attention_impl
  if kind == "agents":
    from jaxkv.engine.mechanisms.agents import Agents
    if llm.lora is None:
      raise ValueError("agents lines run role adapters: set --config.server.role_adapters")
    mech = Agents(llm.engine, cfg.server.agent_scheme, names=llm.adapters,
                  max_tokens=cfg.server.agent_max_tokens, max_sessions=1 << 62)
    what = (f"agents {cfg.server.agent_scheme} (roles {', '.join(llm.adapters)}, "
            f"trajectories up to {cfg.server.agent_max_tokens} tokens)")
  elif kind == "pruned":
    from jaxkv import artifacts
    from jaxkv.engine.mechanisms.pruned import Pruned
    p = cfg.pruning
    head = (artifacts.load_pruner_head(p.head_path, model_name=cfg.model)
            if p.method == "intentkv" and p.intent_mode == "learnable" else None)
    mech = Pruned(llm.tokenizer, llm.config, kv, p, head=head)
    what = f"pruned {p.method} (budget {p.budget}, {p.layout})"
  elif kind == "reuse":
    from jaxkv.engine.mechanisms.reuse import Reuse
    from jaxkv.engine.reuse import ReuseRunner
    mech = Reuse(ReuseRunner(llm, cfg.reuse, cache=cfg.cache, attn_impl=impl, kv=kv))
    what = (f"reuse {cfg.reuse.method} ({cfg.reuse.storage}, "
            f"{cfg.reuse.byte_budget >> 20} MiB store)")
  elif kind == "semshare":
    from jaxkv.engine.mechanisms.semshare import SemShare
    from jaxkv.engine.semshare import SemShareRunner
    mech = SemShare(SemShareRunner(llm, cfg.semshare, cache=cfg.cache, attn_impl=impl, kv=kv))
    what = (f"semshare {cfg.semshare.method} (threshold {cfg.semshare.threshold}, "
            f"{cfg.semshare.byte_budget >> 20} MiB of references)")
  else:
    from jaxkv.engine.mechanisms.memart import MemArt
    from jaxkv.engine.memart import MemArtSessions
    mech = MemArt(MemArtSessions(llm, cfg.memart, cfg.cache, system_prompt=cfg.system_prompt,
                                 attn_impl=impl, kv=kv))
    what = (f"memart top-k {cfg.memart.top_k} x {cfg.memart.block_size}-token blocks, "
            f"{cfg.memart.norm}-{cfg.memart.agg}")
  return llm.engine.add_mechanism(mech), what


def serve_mechanism(cfg, src: pathlib.Path, out, todo: int, kinds: set = frozenset()) -> None:
  """JSONL requests of KV mechanisms (a line's "kind", or the config's mode=reuse /
  semshare / memart for lines that name none; plain requests where neither does) in
  the batch engine (module docstring); records are the plain ones plus "kind" and what
  the mechanism did."""
  import numpy as np
  import tqdm

  from jaxkv.engine import batch, compose_request
  from jaxkv.engine.engine import Request

  t0 = time.perf_counter()
  llm = cli.load_llm(cfg, agents=any("agents" in k.split("+") for k in kinds))
  default = cfg.mode if cfg.mode in batch.KINDS else None
  mechs: dict[str, object] = {}
  refused: dict[str, str] = {}          # kind -> why this config cannot serve it

  def mechanism(kind):
    if kind not in mechs and kind not in refused:
      try:
        if "+" in kind:                  # a composition of the kinds it names
          parts = kind.split("+")
          for k in parts:
            if mechanism(k) is None:
              raise ValueError(refused[k])
          mechs[kind], what = compose_request.mechanism(llm.engine, kind), "composed"
        else:
          mechs[kind], what = _mechanism(kind, cfg, llm)
        tqdm.tqdm.write(f"{kind}: {what}", file=sys.stderr)
      except ValueError as e:
        refused[kind] = f"kind {kind!r} cannot run with this config: {e}"
    return mechs.get(kind)

  if default is not None and mechanism(default) is None:
    cli.fail(refused[default])
  print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
  order: list[str] = []
  errors, ttfts, sessions, kinds = 0, [], {}, {}
  bar = tqdm.tqdm(total=todo, unit="req", disable=not _PROGRESS.value, file=sys.stderr)

  def on_error(e) -> None:
    nonlocal errors
    errors += 1
    bar.write(f"error: {e}", file=sys.stderr)
    out.add(e.record())
    bar.update(1)

  grammar_of = _grammar_of(llm)

  def messages(prompt):
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt

  def with_system(msgs):
    if cfg.system_prompt and msgs[0].get("role") != "system":
      return [{"role": "system", "content": cfg.system_prompt}, *msgs]
    return msgs

  def role_of(p) -> int:
    if p.role not in llm.adapters:
      raise ValueError(f"role {p.role!r} is not one of the role adapters "
                       f"{', '.join(llm.adapters)}")
    return llm.adapters.index(p.role)

  def build(p, kind, recalled=None):
    """The engine request of line `p` on `kind`, or a composition's `Recall` to run
    first (ValueError: this line cannot)."""
    grammar = grammar_of(p)
    if kind is not None and "+" in kind:
      session = sessions[p.id] = p.user or p.id
      agents = "agents" in kind.split("+")
      msgs = with_system(messages(p.prompt))
      return compose_request.request(
          llm.engine.mechanisms, kind, session, msgs, p.tools, p.sampling, rid=p.id,
          encode=lambda: llm.encode(msgs, tools=p.tools), grammar=grammar,
          adapter=role_of(p) if agents else -1, recalled=recalled,
          opened=(lambda: mechs["agents"].open(session)) if agents else None)
    if kind is None or kind in ("reuse", "semshare"):
      prompt = with_system(p.prompt) if isinstance(p.prompt, list) else p.prompt
      return Request(p.id, llm.encode(prompt, tools=p.tools), p.sampling, mechanism=kind,
                     grammar=grammar)
    session = sessions[p.id] = p.user or p.id
    mech = mechs[kind]
    if kind == "agents":
      adapter = role_of(p)
      prompt = llm.encode(with_system(messages(p.prompt)), tools=p.tools)
      mech.check(len(prompt), p.sampling.max_tokens)
      mech.open(session)
      return Request(p.id, prompt, p.sampling, adapter=adapter,
                     mechanism="agents", context={"session": session}, grammar=grammar)
    if kind == "memart":                # the session's history + question, no tools
      if p.tools:
        raise ValueError("memart requests do not take tools")
      msgs = messages(p.prompt)
      ctx = mech.context(session, msgs)
      return Request(p.id, llm.encode(msgs), p.sampling, mechanism="memart", context=ctx,
                     grammar=grammar)
    prompt, ctx = mech.context(session, with_system(messages(p.prompt)), p.tools)   # pruned
    return Request(p.id, prompt, p.sampling, mechanism="pruned", context=ctx,
                   grammar=grammar)

  recalls: dict[str, tuple] = {}         # a recall's request id -> (line, kind)
  waiting: dict[str, collections.deque] = {}   # composed session -> lines behind its call

  def start(p, kind, recalled=None) -> Request | None:
    """Line p's engine request (a composition's recall first), or None after
    recording the line's error."""
    try:
      req = build(p, kind, recalled)
    except ValueError as e:            # e.g. an edited history, a bad chat message
      on_error(batch.RequestError(p.line, str(e), p.id))
      return None
    if isinstance(req, compose_request.Recall):
      recalls[req.request.id] = (p, kind)
      return req.request
    kinds[p.id] = kind
    return req

  def advance(session: str) -> Request | None:
    """The request of the composed session's next waiting line (None: none left)."""
    while waiting.get(session):
      p, kind = waiting[session].popleft()
      req = start(p, kind)
      if req is not None:
        return req
    waiting.pop(session, None)
    return None

  def requests():
    for p, _ in batch.read_requests(src, lambda prompt, tools: None, cfg.sampling, out.done,
                                    on_error, order, parsed=True):
      kind = p.kind or default
      if kind is not None and mechanism(kind) is None:
        on_error(batch.RequestError(p.line, refused[kind], p.id))
        continue
      if kind is not None and "+" in kind:        # one call of a composed session at a time
        session = p.user or p.id
        if session in waiting:
          waiting[session].append((p, kind))
          continue
        waiting[session] = collections.deque([(p, kind)])
        req = advance(session)
      else:
        req = start(p, kind)
      if req is not None:
        yield req

  for res in llm.engine.run(requests()):
    if res.id in recalls:                # a recall ran: its call is built and submitted
      p, kind = recalls.pop(res.id)
      if res.finish_reason == "error":
        on_error(batch.RequestError(p.line, f"the memory recall failed: {res.error}", p.id))
        nxt = advance(p.user or p.id)
      else:
        nxt = start(p, kind, res.extra["recall"]) or advance(p.user or p.id)
      if nxt is not None:
        llm.engine.submit(nxt)
      continue
    rec = llm.complete(res).to_json()
    kind = kinds.pop(res.id, None)
    if kind is not None and "+" in kind:         # the session's next line may start
      nxt = advance(sessions.get(res.id, res.id))
      if nxt is not None:
        llm.engine.submit(nxt)
    if res.finish_reason == "error":
      errors += 1
      bar.write(f"error: request {res.id!r}: {res.error}", file=sys.stderr)
    else:
      ttfts.append(res.ttft_s)
    if kind is not None:
      rec["kind"] = kind
    if kind is not None and (kind in ("pruned", "memart", "agents") or "+" in kind):
      rec["session"] = sessions.pop(res.id, res.id)
    out.add({**rec, **(res.extra or {})})
    bar.update(1)
  bar.close()
  n = out.finish(order)
  m = {"requests": len(ttfts), "errors": errors, "records": n,
       "median_ttft_s": float(np.median(ttfts)) if ttfts else None,
       "decode_tok_s": llm.engine.metrics.summary()["decode_tok_s"],
       **{f"{k}_{stat}": v for k, mech in mechs.items() for stat, v in mech.stats.items()}}
  rows = [("requests run", str(m["requests"])), ("errors", str(errors)),
          ("median TTFT s", f"{m['median_ttft_s']:.3f}" if ttfts else "-"),
          ("decode tokens/s", f"{m['decode_tok_s']:.1f}")]
  if "reuse" in mechs:
    store = mechs["reuse"].runner.store
    rows.append(("reuse store", f"{len(store)} segments, {store.nbytes / 2 ** 20:.1f} MiB; "
                                f"{m['reuse_reused_tokens']} prompt tokens reused"))
  if "semshare" in mechs:
    r = mechs["semshare"].runner
    rows.append(("semshare store", f"{len(r.refs)} reference prompts, "
                                   f"{r.nbytes / 2 ** 20:.1f} MiB; "
                                   f"{m['semshare_reused_requests']} requests reused one"))
  if "memart" in mechs:
    rows.append(("memart sessions", f"{len(mechs['memart'].sessions.sessions)} (memory "
                                    f"blocks written: {m['memart_blocks_written']})"))
  if "pruned" in mechs:
    rows.append(("pruned", f"{m['pruned_events']} requests pruned, "
                           f"{m['pruned_pruned_tokens']} KV entries dropped"))
  _summary(rows + [("output", f"{out.path} ({n} records, one per input line)")], m)


def serve_sessions(cfg, src: pathlib.Path, out) -> None:
  """Replays (or generates) every session of a ToolBench-format file with pruning."""
  import tqdm

  from jaxkv.data import traces
  from jaxkv.engine.sessions import SessionRunner

  errors: list = []
  sessions = traces.load_toolbench(src, strict=False, errors=errors)
  todo = [s for s in sessions if s.id not in out.done]
  print(f"{len(sessions)} sessions in {src} ({len(errors)} malformed), "
        f"{len(sessions) - len(todo)} already in {out.path}; pruning "
        f"{cfg.pruning.method}/{cfg.pruning.layout} C={cfg.pruning.budget}", file=sys.stderr)
  head = None
  if cfg.pruning.method == "intentkv" and cfg.pruning.intent_mode == "learnable":
    if not cfg.pruning.head_path:
      cli.fail("pruning.intent_mode=learnable needs --config.pruning.head_path="
               "<head saved by scripts/train_pruner.py> (default: the shipped one)")
    from jaxkv import artifacts
    try:
      head = artifacts.load_pruner_head(cfg.pruning.head_path, model_name=cfg.model)
    except (OSError, ValueError) as e:
      cli.fail(f"--config.pruning.head_path: {e}")
  runner = None
  if todo:  # a finished run resumes without loading the model
    t0 = time.perf_counter()
    llm = cli.load_llm(cfg)
    print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    runner = SessionRunner(llm, cfg.pruning, cache=cfg.cache,
                           prefill_chunk=cfg.engine.prefill_chunk,
                           attn_impl=cfg.engine.attention_impl, head=head)
  order = []
  for e in errors:
    key = f"entry-{e.index}" if e.entry_id is None else str(e.entry_id)
    print(f"error: {e}", file=sys.stderr)
    out.add({"id": key, "error": str(e), "finish_reason": "error"})
    order.append(key)
  order += [s.id for s in sessions]
  failed = 0
  for s in tqdm.tqdm(todo, unit="session", disable=not _PROGRESS.value, file=sys.stderr):
    try:
      turns = runner.run_session(s.id, *traces.session_chat(s, runner.tok),
                                 generate=cfg.session_generate,
                                 max_tokens=cfg.sampling.max_tokens)
    except (ValueError, RuntimeError) as e:   # e.g. longer than the pool: record, go on
      failed += 1
      print(f"error: session {s.id!r}: {e}", file=sys.stderr)
      out.add({"id": s.id, "error": str(e), "finish_reason": "error"})
      continue
    rows = [t.to_json() for t in turns]
    ev = sum(t.evidence for t in turns)
    out.add({"id": s.id, "turns": rows, "summary": {
        "turns": len(turns), "pt": max((t.pt for t in turns), default=0),
        "eff_live_kv": max((t.eff_live_kv for t in turns), default=0),
        "raw_reads": sum(t.raw_reads for t in turns),
        "eff_reads": sum(t.eff_reads for t in turns),
        "hit_tokens": sum(t.hit_tokens for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "future_evidence_recall": (sum(t.evidence_kept for t in turns) / ev) if ev else None,
        "wall_s": round(sum(t.wall_s for t in turns), 3)}})
  n = out.finish(order)
  st = runner.radix.stats if runner is not None and runner.radix is not None else None
  print("METRICS " + json.dumps({"sessions": len(todo), "malformed": len(errors),
                                 "errors": len(errors) + failed, "records": n,
                                 "prefix_hit_rate": st.hit_rate if st else None}))


def main() -> None:
  """The `jaxkv-serve` command (and `python scripts/serve.py`)."""
  cli.run(_main, ServeConfig, doc=__doc__)


if __name__ == "__main__":
  main()
