"""Batch inference: JSONL requests in, JSONL results out (written as each finishes).

    python scripts/serve.py --config=configs/smollm2.py \
        --input=examples/requests.jsonl --output=results.jsonl \
        [--config.sampling.max_tokens=64] [--config.engine.max_batch=4]

Rerunning the same command resumes: ids already answered in --output are
skipped. See jaxkv/engine/batch.py for the line formats.
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


if __name__ == "__main__":
  app.run(main)
