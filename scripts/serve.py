"""Batch inference: JSONL requests in, JSONL results out (written as each finishes).

    python scripts/serve.py --config=configs/smollm2.py \
        --input=examples/requests.jsonl --output=results.jsonl \
        [--config.sampling.max_tokens=64] [--config.engine.max_batch=4]

Rerunning the same command resumes: ids already answered in --output are
skipped. See jaxkv/engine/batch.py for the line formats. Set
JAX_COMPILATION_CACHE_DIR=<dir> to keep compiled steps between runs (a rerun
then starts in about half the time).

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
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py", lock_config=True)
_INPUT = flags.DEFINE_string("input", None, "JSONL file of requests")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL file of results (appended; resumable)")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "start a fresh output instead of resuming")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")


def _count_lines(path: pathlib.Path) -> int:
  with open(path) as f:
    return sum(1 for line in f if line.strip())


def main(argv):
  del argv
  import tqdm

  import jaxkv
  from jaxkv.config import ServeConfig, from_config_dict
  from jaxkv.engine import batch

  if _CONFIG.value is None or _INPUT.value is None or _OUTPUT.value is None:
    raise app.UsageError("--config, --input and --output are required")
  cfg = from_config_dict(ServeConfig, _CONFIG.value)
  src, dst = pathlib.Path(_INPUT.value), pathlib.Path(_OUTPUT.value)
  if not src.exists():
    raise app.UsageError(f"--input {src} does not exist")
  if _OVERWRITE.value and dst.exists():
    dst.unlink()
  done = batch.finished_ids(dst)
  if cfg.mode == "sessions":
    return serve_sessions(cfg, src, dst, done)
  total = _count_lines(src)

  t0 = time.perf_counter()
  llm = jaxkv.load(cfg.model, dtype=cfg.dtype, cache=cfg.cache, engine=cfg.engine)
  print(f"loaded {cfg.model}: {llm.config.architecture}, {llm.config.num_layers} layers, "
        f"d_kv={llm.config.d_kv} in {time.perf_counter() - t0:.1f}s; "
        f"{len(done)} ids already in {dst}", file=sys.stderr)

  dst.parent.mkdir(parents=True, exist_ok=True)
  bar = tqdm.tqdm(total=total, initial=len(done), unit="req", disable=not _PROGRESS.value,
                  file=sys.stderr)
  errors = 0
  with open(dst, "a") as out:
    def write(record: dict) -> None:
      out.write(json.dumps(record, ensure_ascii=False) + "\n")
      out.flush()
      bar.update(1)

    def on_error(e: batch.RequestError) -> None:
      nonlocal errors
      errors += 1
      print(f"skipping {e}", file=sys.stderr)
      write(e.record())

    def encode(prompt, tools):
      if isinstance(prompt, list) and cfg.system_prompt and prompt[0].get("role") != "system":
        prompt = [{"role": "system", "content": cfg.system_prompt}, *prompt]
      return llm.encode(prompt, tools=tools)

    requests = batch.read_requests(src, encode, cfg.sampling, done, on_error)
    for completion in llm.stream(requests):
      errors += completion.finish_reason == "error"
      write(completion.to_json())
  bar.close()

  m = llm.engine.metrics.summary()
  m["line_errors"] = errors
  rows = [("requests run", f"{m['requests']}"), ("errors", f"{errors}"),
          ("prefill tokens/s", f"{m['prefill_tok_s']:.1f} ({m['prefill_tokens']} tokens)"),
          ("decode tokens/s", f"{m['decode_tok_s']:.1f} ({m['decode_tokens']} tokens)"),
          ("median TTFT s", f"{m['median_ttft_s']:.3f}"),
          ("median latency s", f"{m['median_latency_s']:.3f}"),
          ("peak KV bytes", f"{m['peak_kv_bytes']:,} ({m['peak_live_slots']} live slots)"),
          ("wall s", f"{m['wall_s']:.1f}")]
  print("\nmetrics (first use of each shape includes compilation)")
  for k, v in rows:
    print(f"  {k:<18} {v}")
  print("METRICS " + json.dumps(m))


def serve_sessions(cfg, src: pathlib.Path, dst: pathlib.Path, done: set) -> None:
  """Replays (or generates) every session of a ToolBench-format file with pruning."""
  import tqdm

  import jaxkv
  from jaxkv.data import traces
  from jaxkv.engine.sessions import SessionRunner

  errors: list = []
  sessions = traces.load_toolbench(src, strict=False, errors=errors)
  todo = [s for s in sessions if s.id not in done]
  print(f"{len(sessions)} sessions in {src} ({len(errors)} malformed), {len(done)} already "
        f"in {dst}; pruning {cfg.pruning.method}/{cfg.pruning.layout} C={cfg.pruning.budget}",
        file=sys.stderr)
  head = None
  if cfg.pruning.method == "intentkv" and cfg.pruning.intent_mode == "learnable":
    if not cfg.pruning.head_path:
      raise app.UsageError("pruning.intent_mode=learnable needs --config.pruning.head_path="
                           "<head saved by scripts/train_pruner.py>")
    from jaxkv.training import load_head
    head = load_head(cfg.pruning.head_path)
  runner = None
  if todo:  # a finished run resumes without loading the model
    t0 = time.perf_counter()
    llm = jaxkv.load(cfg.model, dtype=cfg.dtype, cache=cfg.cache, engine=cfg.engine)
    print(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    runner = SessionRunner(llm, cfg.pruning, cache=cfg.cache,
                           prefill_chunk=cfg.engine.prefill_chunk,
                           attn_impl=cfg.engine.attention_impl, head=head)
  dst.parent.mkdir(parents=True, exist_ok=True)
  with open(dst, "a") as out:
    def write(record):
      out.write(json.dumps(record, ensure_ascii=False) + "\n")
      out.flush()
    for e in errors:
      key = f"entry-{e.index}" if e.entry_id is None else str(e.entry_id)
      if key not in done:
        write({"id": key, "error": str(e), "finish_reason": "error"})
    for s in tqdm.tqdm(todo, unit="session", disable=not _PROGRESS.value, file=sys.stderr):
      try:
        turns = runner.run_session(s.id, *traces.session_chat(s, runner.tok),
                                   generate=cfg.session_generate,
                                   max_tokens=cfg.sampling.max_tokens)
      except (ValueError, RuntimeError) as e:   # e.g. longer than the pool: record, go on
        write({"id": s.id, "error": str(e), "finish_reason": "error"})
        continue
      rows = [t.to_json() for t in turns]
      ev = sum(t.evidence for t in turns)
      write({"id": s.id, "turns": rows, "summary": {
          "turns": len(turns), "pt": max((t.pt for t in turns), default=0),
          "eff_live_kv": max((t.eff_live_kv for t in turns), default=0),
          "raw_reads": sum(t.raw_reads for t in turns),
          "eff_reads": sum(t.eff_reads for t in turns),
          "hit_tokens": sum(t.hit_tokens for t in turns),
          "prompt_tokens": sum(t.prompt_tokens for t in turns),
          "future_evidence_recall": (sum(t.evidence_kept for t in turns) / ev) if ev else None,
          "wall_s": round(sum(t.wall_s for t in turns), 3)}})
  st = runner.radix.stats if runner is not None and runner.radix is not None else None
  print("METRICS " + json.dumps({"sessions": len(todo), "malformed": len(errors),
                                 "prefix_hit_rate": st.hit_rate if st else None}))


if __name__ == "__main__":
  app.run(main)
