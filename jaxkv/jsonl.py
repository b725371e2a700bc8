"""Appending JSON lines to a file a run writes as it goes and a rerun resumes from.

A process killed mid-write leaves a torn last line (no newline). A plain append would
glue the next record onto it, and the reader would skip both. `open_append` ends such a
line first, so only the torn record is lost (and runs again). Used by serve's
`--output` (`jaxkv.engine.batch.ResultFile`), the pruner trainer's metrics.jsonl and
the benchmarks' partial journals (`bench/common.py`).
"""

from __future__ import annotations

import json
import os
from typing import BinaryIO


def open_append(path) -> BinaryIO:
  """A binary append handle on `path` (created if missing), after any torn last line."""
  f = open(path, "a+b")   # noqa: SIM115  (the caller closes it)
  if f.seek(0, os.SEEK_END) > 0:
    f.seek(-1, os.SEEK_END)
    if f.read(1) != b"\n":
      f.write(b"\n")
  return f


def encode(rec) -> bytes:
  """One record as a JSON line (UTF-8, non-ASCII kept)."""
  return (json.dumps(rec, ensure_ascii=False) + "\n").encode()


def append(path, rec) -> None:
  """Appends one record to `path` as a JSON line (`open_append`)."""
  with open_append(path) as f:
    f.write(encode(rec))
