r"""Which natural edits SemShareKV's similarity gate admits: the A.3 similarity of
every pair of one or more prompt-pair files, without serving any.

    python bench/semshare_gate.py \
        --pairs=data_local/semshare_gate_pairs.jsonl,data_local/semshare_4k.jsonl \
        [--model=smollm2-135m] [--out=bench/results_semshare_admission.json]

The issue behind it: a text of >= 1k tokens with 20-40% of its sentences deleted or
replaced (and its other tokens unchanged) should score above the gate once positions
shift, and an unrelated text should not. Per pair (`scripts/make_pairs.py` files:
`meta` names the source, nominal length, edit kind and fraction) the target is
matched against its own reference as `bench/semshare.py` does (chat-rendered, the
aligned matching of `SemShareConfig`'s defaults), and each summary pair's target also
against an unrelated reference: the next pair's of the same source and length whose
excerpt shares no 8-token run with this one (an overlapping excerpt is not unrelated).
Rows: one per (length, source, kind, fraction) cell and one per (length, source) of
unrelated texts, with the number admitted (similarity >= the threshold), the lowest
and median similarity and the mean nearest Hamming distance; the distances give the
similarity at any other `max_dist` (1 - d / max_dist). Docs pairs come twice (a
summary and a question on the same excerpt): both are counted, as bench/semshare.py
counts them.
"""

from __future__ import annotations

import collections

import numpy as np
from absl import app, flags

import common
import jaxkv
from jaxkv.config import CacheConfig, SemShareConfig
from jaxkv.data import semshare_pairs as SP
from jaxkv.engine.semshare import SemShareRunner
from jaxkv.policies.reuse import semshare as semshare_lib
from semshare import read_pairs, render

FLAGS = flags.FLAGS
SHARED_RUN = 8      # tokens: excerpts sharing a run this long are not unrelated


def define_flags():
  flags.DEFINE_list("pairs", None, "pairs JSONL files (scripts/make_pairs.py)")
  flags.DEFINE_string("model", "smollm2-135m", "preset or weights path")
  flags.DEFINE_string("out", None, "results JSON (rows)")
  flags.DEFINE_string("tables_from", None, "print the table of an existing results JSON")


def _runs(ids: np.ndarray) -> set:
  return {ids[i:i + SHARED_RUN].tobytes() for i in range(ids.size - SHARED_RUN + 1)}


def _unrelated(k: int, items: list[dict]) -> dict | None:
  """The first pair after item k (cyclically) of the same source and length, a
  summary pair whose target shares no SHARED_RUN-token run with k's."""
  me = items[k]
  for j in range(1, len(items)):
    o = items[(k + j) % len(items)]
    if (o["meta"]["source"], o["meta"]["length"]) == (me["meta"]["source"],
                                                       me["meta"]["length"]) \
        and not o["qa"] and not (o["runs"] & me["runs"]):
      return o
  return None


def measure(llm, pairs: list[SP.Pair]) -> list[dict]:
  """One record per pair (its similarity to its reference) and one per summary pair
  against an unrelated reference (`kind` 'unrelated')."""
  cfg = SemShareConfig()
  probe = SemShareRunner(llm, cfg, cache=CacheConfig(num_pages=8, page_size=16,
                                                     max_seq_len=64))
  tok = llm.tokenizer
  items = []
  for p in pairs:
    ref, tgt = render(tok, p.reference, p.instruction), render(tok, p.target, p.instruction)
    items.append(dict(id=p.id, meta=p.meta, ref=ref, tgt=tgt, qa=p.answer is not None,
                      runs=_runs(np.asarray(tok.encode(p.target, add_bos=False)))))
  out = []
  for k, it in enumerate(items):
    m = it["meta"]
    base = dict(source=m["source"], length=int(m["length"]), prompt_tokens=int(it["tgt"].size))
    d = float(np.mean(probe.match(it["ref"], it["tgt"])[1]))
    out.append(dict(base, id=it["id"], kind=m["kind"], frac=float(m["frac"]), distance=d,
                    similarity=semshare_lib.similarity(np.array([d]), cfg.max_dist)))
    other = None if it["qa"] else _unrelated(k, items)
    if other is not None:
      d = float(np.mean(probe.match(other["ref"], it["tgt"])[1]))
      out.append(dict(base, id=f"{it['id']}|{other['id']}", kind="unrelated", frac=1.0,
                      distance=d, similarity=semshare_lib.similarity(np.array([d]),
                                                                     cfg.max_dist)))
    if (k + 1) % 20 == 0:
      print(f"  {k + 1}/{len(items)} pairs", flush=True)
  for r in out:
    r.update(threshold=cfg.threshold, max_dist=cfg.max_dist)
  return out


def tables(rows: list[dict]) -> list[common.Table]:
  cells = collections.defaultdict(list)
  for r in rows:
    cells[(r["length"], r["source"], r["kind"] == "unrelated", r["kind"], r["frac"])].append(r)
  lines = []
  for (length, source, _, kind, frac), rs in sorted(cells.items()):
    sim = np.array([r["similarity"] for r in rs])
    thr = rs[0]["threshold"]
    lines.append((str(length), source, kind, "-" if kind == "unrelated" else f"{frac:g}",
                  str(len(rs)), str(int((sim >= thr).sum())), f"{sim.min():.3f}",
                  f"{np.median(sim):.3f}", f"{sim.max():.3f}",
                  f"{np.mean([r['distance'] for r in rs]):.1f}"))
  r0 = rows[0]
  admitted = lambda rs: sum(r["similarity"] >= r0["threshold"] for r in rs)
  edits = [r for r in rows if r["kind"] != "unrelated"]
  unrel = [r for r in rows if r["kind"] == "unrelated"]
  title = (f"the similarity gate on natural edits (threshold {r0['threshold']:g}, aligned "
           f"matching, max_dist {r0['max_dist']:g}): {admitted(edits)} of {len(edits)} "
           f"edited pairs admitted, {admitted(unrel)} of {len(unrel)} unrelated; length = "
           "the pair file's nominal target length in tokens; frac = share of the "
           "reference's sentences deleted or replaced; d = mean nearest Hamming distance "
           "(256 bits)")
  return [common.Table(title, ("length", "source", "edit", "frac", "pairs", "admitted",
                               "min sim", "median sim", "max sim", "d"), lines)]


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, tables)
    return
  if not FLAGS.pairs:
    raise app.UsageError("give --pairs (JSONL files of scripts/make_pairs.py)")
  files = {path: read_pairs(path) for path in FLAGS.pairs}   # every file checked first
  for path, pairs in files.items():
    bad = [p.id for p in pairs if not p.meta or not {"source", "length", "kind", "frac"}
           <= set(p.meta)]
    if bad:
      raise app.UsageError(f"{path}: pairs without make_pairs' meta (source, length, kind, "
                           f"frac), e.g. {bad[0]!r}")
  llm = jaxkv.load(FLAGS.model)
  rows = []
  for path, pairs in files.items():
    print(f"{path}: {len(pairs)} pairs", flush=True)
    rows += measure(llm, pairs)
  common.write_rows(FLAGS.out, rows)
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
