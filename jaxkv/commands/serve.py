r"""Batch inference: JSONL requests in, JSONL results out (written as each finishes).

    jaxkv-serve --config=configs/smollm2.py \
        --input=examples/requests.jsonl --output=results.jsonl \
        [--config.sampling.max_tokens=64] [--config.engine.max_batch=4]

(`python scripts/serve.py ...` from a clone runs the same command.)

Rerunning the same command resumes: ids already answered in --output are
skipped. See jaxkv/engine/batch.py for the line formats. Compiled steps are kept
between runs in --xla_cache (default ~/.cache/jaxkv/xla, or $JAX_COMPILATION_CACHE_DIR;
--xla_cache= turns it off), so a rerun skips most of the compilation.

Segment reuse (`--config=configs/smollm2_reuse.py`, or `--config.mode=reuse`): the
same JSONL requests, one at a time, each prefilled reusing the K/V of segments
earlier prompts contained (`--config.reuse.method=tiered|cacheblend|epic|naive|prefix`,
the segment-reuse paper); greedy decoding; records add cached / reused tokens and each match's tier.

SemShareKV (`--config=configs/smollm2_semshare.py`, or `--config.mode=semshare`): the
same JSONL requests, one at a time; a prompt whose LSH similarity to an earlier
prompt reaches `--config.semshare.threshold` reuses that prompt's K/V through
token-level matching (SemShareKV), others are prefilled and kept as references;
records add the similarity, whether it was reused and the recomputed share.

MemArt memory (`--config=configs/smollm2_memart.py`, or `--config.mode=memart`): chat
requests one at a time; `"user"` names the session (default: the request id). Every
message before the last is the session's history, written as KV blocks into its
memory the first time it is seen; the last (user) message alone is prefilled over
the blocks retrieved for it (MemArt); records add the blocks retrieved, the
session's memory size and the prefill / probe token counts.

Agent sessions (`--config=configs/smollm2_sessions.py`, or `--config.mode=sessions`):
--input is a ToolBench-format trace file (jaxkv/data/traces.py, e.g. from
scripts/make_traces.py); every session is replayed turn by turn with the
configured pruning policy and layout (`--config.pruning.method=intentkv
--config.pruning.layout=dead_slot --config.pruning.budget=3584`) and written as
one line `{"id", "turns": [per-turn metrics], "summary"}`; a malformed trace
entry becomes an error line naming its index and the run goes on.
"""

from __future__ import annotations

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


def _scan(src: pathlib.Path, cfg, done: set[str]) -> tuple[list[str], list, int]:
  """One pass over the input without the model: the record key of every line in
  order, the unusable lines' errors, and how many usable lines are still to run."""
  from jaxkv.engine import batch
  order: list[str] = []
  errors: list = []
  todo = sum(1 for _ in batch.read_requests(src, lambda prompt, tools: [], cfg.sampling, done,
                                            errors.append, order))
  return order, errors, todo


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
  order, errors, todo = _scan(src, cfg, out.done)
  if cfg.mode in ("reuse", "semshare") and todo:
    return serve_sequential(cfg, src, out, todo)
  if cfg.mode == "memart" and todo:
    return serve_memart(cfg, src, out, todo)
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
  requests = batch.read_requests(src, encode, cfg.sampling, out.done, on_error, order)
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


def serve_sequential(cfg, src: pathlib.Path, out, todo: int) -> None:
  """JSONL requests one at a time through a runner that reuses earlier prompts'
  K/V, then greedy decoding. mode=reuse: ReuseRunner (segments, config.reuse);
  records add `reused_tokens`, `cached_tokens` (radix prefix) and `runs` (tier
  per match). mode=semshare: SemShareRunner (the most similar earlier prompt,
  config.semshare); records add `similarity`, `reused` and `recomputed_share`."""
  import numpy as np
  import tqdm

  from jaxkv.engine import batch

  t0 = time.perf_counter()
  llm = cli.load_llm(cfg)
  if cfg.mode == "reuse":
    from jaxkv.engine.reuse import ReuseRunner
    runner = ReuseRunner(llm, cfg.reuse, cache=cfg.cache, attn_impl=cfg.engine.attention_impl)
    what = (f"reuse {cfg.reuse.method} ({cfg.reuse.storage}, "
            f"{cfg.reuse.byte_budget >> 20} MiB store)")
  else:
    from jaxkv.engine.semshare import SemShareRunner
    runner = SemShareRunner(llm, cfg.semshare, cache=cfg.cache,
                            attn_impl=cfg.engine.attention_impl)
    what = (f"semshare {cfg.semshare.method} (threshold {cfg.semshare.threshold}, "
            f"{cfg.semshare.byte_budget >> 20} MiB of references)")
  print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s; {what}", file=sys.stderr)
  order: list[str] = []
  errors = 0

  def on_error(e) -> None:
    nonlocal errors
    errors += 1
    print(f"error: {e}", file=sys.stderr)
    out.add(e.record())

  def refuse(rid: str, why: str) -> None:
    nonlocal errors
    errors += 1
    print(f"error: request {rid!r}: {why}", file=sys.stderr)
    out.add({"id": rid, "error": why, "finish_reason": "error"})

  def encode(prompt, tools):
    if isinstance(prompt, list) and cfg.system_prompt and prompt[0].get("role") != "system":
      prompt = [{"role": "system", "content": cfg.system_prompt}, *prompt]
    return llm.encode(prompt, tools=tools)

  ttfts, reused, total = [], 0, 0
  for req in tqdm.tqdm(batch.read_requests(src, encode, cfg.sampling, out.done, on_error, order),
                       total=todo, unit="req", disable=not _PROGRESS.value, file=sys.stderr):
    if req.sampling.temperature > 0:
      refuse(req.id, f"{cfg.mode} mode decodes greedily (no sampling): this request asks "
                     f"for temperature {req.sampling.temperature:g}; drop it or send 0")
      continue
    t1 = time.perf_counter()
    try:
      pre = runner.prefill(np.asarray(req.prompt))
      toks, _ = runner.decode(pre, req.sampling.max_tokens, stop_ids=llm.tokenizer.stop_ids)
    except ValueError as e:        # e.g. longer than the cache: record it, go on
      refuse(req.id, str(e))
      continue
    runner.release(pre.seq)
    done = bool(toks.size) and int(toks[-1]) in llm.tokenizer.stop_ids
    rec = {"id": req.id, "text": llm.tokenizer.decode(toks.tolist()),
           "prompt_tokens": int(pre.ids.size), "completion_tokens": int(toks.size)}
    if cfg.mode == "reuse":
      n_reused = sum(r.n for r in pre.runs if r.tier != "reject")
      rec.update({"cached_tokens": pre.prefix_hit, "reused_tokens": int(n_reused),
                  "prefill_tokens": round(pre.prefill_tokens, 1),
                  "runs": [{"at": r.p_lo, "n": r.n, "tier": r.tier, "reason": r.reason}
                           for r in pre.runs]})
    else:
      n_reused = pre.ids.size if pre.reused else 0
      rec.update({"similarity": round(pre.similarity, 4), "reused": pre.reused,
                  "recomputed_share": round(pre.recomputed_share, 4),
                  "shared_entries": pre.shared_entries, "live_entries": pre.live_entries})
    ttfts.append(pre.ttft_s)
    reused += n_reused
    total += pre.ids.size
    rec.update({"ttft_s": round(pre.ttft_s, 6), "latency_s": round(time.perf_counter() - t1, 6),
                "finish_reason": "stop" if done else "length"})
    out.add(rec)
  n = out.finish(order)
  m = {"requests": len(ttfts), "errors": errors, "records": n,
       "median_ttft_s": float(np.median(ttfts)) if ttfts else None,
       "reused_share": reused / total if total else None}
  if cfg.mode == "reuse":
    m.update(segments=len(runner.store), store_bytes=runner.store.nbytes)
    store = f"{m['segments']} segments, {m['store_bytes'] / 2 ** 20:.1f} MiB"
  else:
    m.update(references=len(runner.refs), store_bytes=runner.nbytes)
    store = f"{m['references']} reference prompts, {m['store_bytes'] / 2 ** 20:.1f} MiB"
  _summary([("requests run", str(m["requests"])), ("errors", str(errors)),
            ("median TTFT s", f"{m['median_ttft_s']:.3f}" if ttfts else "-"),
            ("prompt tokens reused", f"{reused} of {total}"), ("store", store),
            ("output", f"{out.path} ({n} records, one per input line)")], m)


def serve_memart(cfg, src: pathlib.Path, out, todo: int) -> None:
  """Chat requests whose session history lives in MemArt memory (MemArtSessions)."""
  import numpy as np
  import tqdm

  from jaxkv.engine import batch
  from jaxkv.engine.memart import MemArtSessions

  t0 = time.perf_counter()
  llm = cli.load_llm(cfg)
  try:
    sessions = MemArtSessions(llm, cfg.memart, cfg.cache, system_prompt=cfg.system_prompt,
                              attn_impl=cfg.engine.attention_impl)
  except ValueError as e:
    cli.fail(str(e))
  print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s; memart top-k "
        f"{cfg.memart.top_k} x {cfg.memart.block_size}-token blocks, {cfg.memart.norm}-"
        f"{cfg.memart.agg}", file=sys.stderr)
  order: list[str] = []
  errors, ttfts = 0, []

  def on_error(e) -> None:
    nonlocal errors
    errors += 1
    print(f"error: {e}", file=sys.stderr)
    out.add(e.record())

  def as_messages(prompt, tools):
    if tools:
      raise ValueError("memart mode does not take tools")
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt

  for p, msgs in tqdm.tqdm(batch.read_requests(src, as_messages, cfg.sampling, out.done,
                                               on_error, order, parsed=True),
                           total=todo, unit="req", disable=not _PROGRESS.value, file=sys.stderr):
    if p.sampling.temperature > 0:
      on_error(batch.RequestError(
          p.line, f"memart mode decodes greedily (no sampling): this request asks for "
                  f"temperature {p.sampling.temperature:g}; drop it or send 0", p.id))
      continue
    try:
      ans, info = sessions.ask(p.user or p.id, msgs, p.sampling.max_tokens)
    except (ValueError, RuntimeError) as e:   # e.g. history changed, or the pool is full
      on_error(batch.RequestError(p.line, str(e), p.id))
      continue
    done = bool(ans.tokens.size) and int(ans.tokens[-1]) in llm.tokenizer.stop_ids
    ttfts.append(ans.ttft_s)
    out.add({"id": p.id, "session": p.user or p.id,
             "text": llm.tokenizer.decode(ans.tokens.tolist()),
             "prompt_tokens": int(ans.prefill_tokens), "probe_tokens": int(ans.probe_tokens),
             "completion_tokens": int(ans.tokens.size), "retrieved_blocks": int(ans.blocks.size),
             "decode_kv_len": ans.decode_kv_len, **info, "ttft_s": round(ans.ttft_s, 6),
             "latency_s": round(ans.latency_s, 6), "finish_reason": "stop" if done else "length"})
  n = out.finish(order)
  m = {"requests": len(ttfts), "errors": errors, "records": n,
       "sessions": len(sessions.sessions),
       "median_ttft_s": float(np.median(ttfts)) if ttfts else None}
  _summary([("requests run", str(m["requests"])), ("errors", str(errors)),
            ("sessions", str(m["sessions"])),
            ("median TTFT s", f"{m['median_ttft_s']:.3f}" if ttfts else "-"),
            ("output", f"{out.path} ({n} records, one per input line)")], m)


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
