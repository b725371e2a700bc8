"""Helpers shared by the bench/ scripts: timing, bandwidth probe, table and JSON output.

Scripts run as `python bench/<name>.py`, so `bench/` is on sys.path and they
`import common`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import jsonl


def timeit(fn, *args, reps: int = 10, **kwargs) -> float:
  """Median wall seconds of a call (compiled and warmed first), outputs awaited."""
  jax.block_until_ready(fn(*args, **kwargs))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args, **kwargs))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def copy_bandwidth_gbs(nbytes: int = 1 << 29, reps: int = 5, iters: int | None = None) -> float:
  """Device copy bandwidth in GB/s, bytes read + written: a float32 array of `nbytes`
  incremented in place `iters` times in one jitted loop (default 20 on a GPU, where
  one wall-clocked call would charge launch and dispatch gaps to the copy; 1 on a
  CPU), median of `reps`."""
  if iters is None:
    iters = 20 if jax.default_backend() == "gpu" else 1
  step = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda i, y: y + 1.0, x),
                 donate_argnums=0)
  x = step(jax.random.normal(jax.random.key(1), (nbytes // 4,), jnp.float32))
  times = []
  for _ in range(reps):
    jax.block_until_ready(x)
    t0 = time.perf_counter()
    x = jax.block_until_ready(step(x))
    times.append(time.perf_counter() - t0)
  return 2 * nbytes * iters / float(np.median(times)) / 1e9


def matvec_bandwidth_gbs(nbytes: int = 1 << 29, reps: int = 5) -> float:
  """Read bandwidth of a large fp32 matrix-vector product (the access pattern of a
  decode step's weight reads; XLA:CPU runs it on all cores), in GB/s."""
  x = jnp.ones((nbytes // 4 // 1024, 1024), jnp.float32)
  v = jnp.ones((1024,), jnp.float32)
  return nbytes / timeit(jax.jit(lambda a, b: a @ b), x, v, reps=reps) / 1e9


class Table(NamedTuple):
  """A results table: what scripts print and `scripts/report.py` writes into the README."""
  title: str
  header: Sequence[str]
  lines: Sequence[Sequence[str]]

  def markdown(self) -> str:
    out = ["| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
    return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in self.lines])


def print_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> None:
  """A markdown table (pasteable into the README)."""
  print(Table("", header, lines).markdown())


def print_tables(tables: Sequence[Table]) -> None:
  for t in tables:
    print(f"\n{t.title}" if t.title else "")
    print(t.markdown())


def method_names(csv: str, known, hint: str = "") -> list[str]:
  """The comma list of a --methods flag, or a usage error naming the unknown ones."""
  from absl import app
  names = csv.split(",")
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise app.UsageError(f"unknown methods {unknown}{hint}; known: {sorted(known)}")
  return names


def print_tables_from(path: str, tables) -> None:
  """Prints `tables(rows)` of a results JSON written by `write_rows` (--tables_from)."""
  with open(path) as f:
    print_tables(tables(json.load(f)))


def cluster_bootstrap(per: dict, stat, reps: int = 2000, seed: int = 0
                      ) -> tuple[float, float, float]:
  """stat over the units of `per` (unit -> its data: a session, a trajectory) and its
  95% bootstrap interval, the units resampled with replacement."""
  keys = sorted(per)
  rng = np.random.default_rng(seed)
  draws = [stat([per[keys[i]] for i in rng.integers(0, len(keys), len(keys))])
           for _ in range(reps)]
  return stat([per[k] for k in keys]), *np.percentile(draws, [2.5, 97.5])


def write_rows(path: str | None, rows: list[dict]) -> None:
  if path:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
      json.dump(rows, f, indent=1)
    print(f"wrote {path}")


class Journal:
  """Work items of a long configuration appended as they finish (JSON lines at
  `path`), so a killed run loses at most the chunk in flight: `done(key)` gives what
  an earlier run finished under `key` (a truncated or malformed line, as a kill
  mid-write leaves, is skipped with a message), `add` appends one item, `drop`
  forgets a key once its row is written. path None: nothing is kept."""

  def __init__(self, path: str | None):
    self.path = path

  def _lines(self) -> list[dict]:
    if not self.path or not os.path.exists(self.path):
      return []
    out = []
    with open(self.path) as f:
      for n, line in enumerate(f, 1):
        try:
          rec = json.loads(line)
          out.append(rec if isinstance(rec, dict) and {"key", "item", "value"} <= rec.keys()
                     else None)
        except json.JSONDecodeError:
          out.append(None)
        if out[-1] is None and line.strip():
          print(f"{self.path}:{n}: skipping a malformed line (that item runs again)")
    return [r for r in out if r is not None]

  def done(self, key: str) -> dict:
    return {r["item"]: r["value"] for r in self._lines() if r["key"] == key}

  def add(self, key: str, item: str, value) -> None:
    if self.path:
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      jsonl.append(self.path, dict(key=key, item=item, value=value))

  def drop(self, key: str) -> None:
    if not self.path or not os.path.exists(self.path):
      return
    keep = [r for r in self._lines() if r["key"] != key]
    if keep:
      with open(self.path, "wb") as f:
        f.writelines(jsonl.encode(r) for r in keep)
    else:
      os.remove(self.path)


def save_figure(fig, plt, path: str) -> str:
  """Lays out, writes (creating its folder) and closes a matplotlib figure; returns path."""
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def matmul_gflops(n: int = 1024, reps: int = 5, dtype=jnp.float32) -> float:
  """Achieved FLOP/s of a large square matmul on random data (the compute peak a
  prefill can hope for on this device, with jaxkv's compiler options), in GFLOP/s."""
  from jaxkv.config import COMPILER_OPTIONS
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y, compiler_options=COMPILER_OPTIONS)
  return 2 * n ** 3 / timeit(f, a, a, reps=reps) / 1e9


def define_replay_flags(flags, length: str) -> None:
  """--num_pages, --batch and --replay of the session-replay benchmarks (`length`: the
  flag bounding a session's tokens)."""
  flags.DEFINE_integer("num_pages", 2048, "KV pool pages (with the engine replay: at "
                       f"least --batch sessions of --{length})")
  flags.DEFINE_integer("batch", 8, "sessions replayed side by side in the engine")
  flags.DEFINE_enum("replay", "engine", ["engine", "runner"],
                    "engine: dead-slot layouts and the full cache through the serving "
                    "engine (batched); runner: every layout through the batch-1 "
                    "SessionRunner")


def replay_pages(num_pages: int, batch: int, replay: str, max_len: int) -> int:
  """Pool pages for a replay: the engine's holds --batch whole sessions of max_len, and
  a quarter more (shared system prompts, a page per adopting row) so no cached path
  is evicted under pressure, which would change the prefix hits."""
  return (max(num_pages, batch * -(-max_len // 16) * 5 // 4) if replay == "engine"
          else num_pages)
