r"""SemShareKV (seed 001) side by side with full recompute, its Table 2 ablations,
CacheBlend's rule on the same fuzzy match and the compression baselines, over a
prompt-pairs file.

    python bench/semshare.py --pairs=data_local/semshare_pairs.jsonl \
        [--methods=full,semshare,fuzzy_full,zero,random,blend,snapkv,h2o,evict_random] \
        [--model=smollm2-135m] [--gen=32] [--max_pairs=0] [--out=bench/results_semshare.json] \
        [--plot=docs/plots/semshare.png] [--threshold=0.8] [--noadmitted] [--notimed] \
        [--nomatch_budgets] [--retention=layer0]
    python bench/semshare.py --pairs=... --shift_probe=0,1,2,5,10,30,100,300

Pairs: only those the similarity gate admits (`--admitted`, default: the pairs
SemShareKV would really reuse; the count left out is printed). Per pair and method,
on that method's runner: the reference prompt is prefilled in full and stored, then
the target is served; a pair's methods run back to back (pair by pair, so a drift of
the machine's speed lands on every method alike). With `--timed` each pair runs twice
and the second run is timed (the first compiles every shape it needs), so TTFT
excludes compiles. `--via=engine` serves the pairs through the batch engine instead
(`jaxkv.evaluation.semshare`, quality only, method by method). Generation is greedy up to
EOS (at most --gen tokens). Quality, per pair (`semshare_tables`): ROUGE-L
(rouge-score) against the gold answer where the pair has one (Python-docs questions),
against full recompute's output and against the target text; agreement with full's
tokens up to its EOS and the common prefix length; the teacher-forced NLL of the gold
answer and of full's own continuation (deltas vs full, nats per token). Every
interval is a bootstrap over pairs. The compression baselines (snapkv, pyramidkv, h2o,
evict_random) keep SemShareKV's own per-layer entry counts on the same pair
(`--match_budgets`), so retention is compared at identical per-layer budgets. Memory:
the pool bytes the target owns (`kv_bytes`), the layer x token entries it keeps
(`kv_bytes_live`) and of those the ones aliased to the reference (`kv_bytes_shared`).
Per-pair records go to <out>_records.json (a rerun skips the methods already there);
rows per method over all pairs, per prompt-length bucket, similarity bin and edit kind.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from absl import app, flags

import common
import jaxkv
from jaxkv.config import SEMSHARE_METHODS, CacheConfig, EngineConfig, SemShareConfig
from jaxkv.data import calls
from jaxkv.data import semshare_pairs as SP
from jaxkv.engine.engine import Engine
from jaxkv.engine.mechanisms.semshare import SemShare
from jaxkv.engine.semshare import SemShareRunner
from jaxkv.evaluation import semshare as evaluation
from jaxkv.policies.pruning import layerwise
from jaxkv.policies.reuse import semshare as semshare_lib
from semshare_tables import plot, rows_of, tables

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("pairs", None, "pairs JSONL (scripts/make_pairs.py, or your own)")
  flags.DEFINE_string("methods", ",".join(SEMSHARE_METHODS), "comma list of "
                      f"{','.join(SEMSHARE_METHODS)}")
  flags.DEFINE_string("model", "smollm2-135m", "preset or weights path")
  flags.DEFINE_integer("gen", 32, "greedy tokens generated per target (at most: ends at EOS)")
  flags.DEFINE_bool("admitted", True, "keep only the pairs the similarity gate admits "
                    "(the pairs SemShareKV would really reuse)")
  flags.DEFINE_bool("match_budgets", True, "the compression baselines (snapkv, pyramidkv, "
                    "h2o, evict_random) keep SemShareKV's own per-layer counts, pair by pair")
  flags.DEFINE_bool("timed", True, "serve each pair twice and time the second (TTFT without "
                    "compiles); --notimed serves once (quality only, half the time)")
  flags.DEFINE_enum("via", "runner", ["runner", "engine"], "runner: one pair at a time on "
                    "the batch-1 SemShareRunner (timed); engine: through the batch engine's "
                    "semshare mechanism (jaxkv.evaluation.semshare: quality only, needs "
                    "--notimed; the pairs' decodes batched)")
  flags.DEFINE_float("threshold", None, "override the similarity threshold (0: always reuse, "
                     "for the similarity-vs-quality curve)")
  flags.DEFINE_integer("max_pairs", 0, "use the first N pairs (0: all)")
  flags.DEFINE_string("ids", None, "only the pairs whose ids this file lists (one per line, "
                      "# comments)")
  flags.DEFINE_integer("max_prompt", 6000, "skip pairs whose prompts are longer")
  flags.DEFINE_string("out", None, "results JSON (rows; resumable)")
  flags.DEFINE_string("plot", "docs/plots/semshare.png", "TTFT and quality plot")
  flags.DEFINE_string("tables_from", None, "print the tables of an existing results JSON")
  flags.DEFINE_enum("retention", None, ["layer", "layer0"], "override SemShareConfig."
                    "retention (rows then read e.g. semshare/layer0)")
  flags.DEFINE_list("shift_probe", [], "instead of the methods: the first pair's target "
                    "matched against itself placed these many positions later (e.g. "
                    "0,2,10,30,100): the A.3 similarity and the share of tokens matched to "
                    "their own twin, with the paper's RoPE E cache")


def render(tok, text: str, instruction: str) -> np.ndarray:
  msgs = [{"role": "user", "content": f"{text}\n\n{instruction}"}]
  return np.asarray(tok.encode(tok.render_chat(msgs, add_generation_prompt=True),
                               add_bos=False), np.int32)


def rouge_l(a: str, b: str) -> float:
  from rouge_score import rouge_scorer  # pylint: disable=import-outside-toplevel
  return float(rouge_scorer.RougeScorer(["rougeL"]).score(b, a)["rougeL"].fmeasure)


def serve_pair(runner: SemShareRunner, tok, p: dict, full: dict | None) -> dict:
  """Reference (stored), then the target; returns the target's outcome: greedy
  tokens up to EOS (at most --gen), the gold answer's teacher-forced NLL where the
  pair has one, and (with `full`: full recompute's outcome on the pair) the
  teacher-forced NLL of full's own continuation."""
  runner.reset()
  runner.release(runner.prefill(p["ref"]).seq)
  pre = runner.prefill(p["tgt"])
  toks, _ = runner.decode(pre, FLAGS.gen, stop_ids=tok.stop_ids)
  out = dict(pre=pre, tokens=toks, text=tok.decode(toks.tolist()))
  if p["answer"] is not None:
    _, lp = runner.decode(pre, p["answer"].size, forced=p["answer"])
    out["nll"] = float(-np.mean(lp))
  cont = out["tokens"] if full is None else np.asarray(full["tokens"], np.int32)
  _, lp = runner.decode(pre, cont.size, forced=cont)
  out["cont_nll"] = float(-np.mean(lp))
  runner.release(pre.seq)
  return out


def _config(name: str) -> SemShareConfig:
  cfg = SemShareConfig(method=name)
  if FLAGS.threshold is not None:
    cfg = dataclasses.replace(cfg, threshold=FLAGS.threshold)
  if FLAGS.retention is not None:
    cfg = dataclasses.replace(cfg, retention=FLAGS.retention)
  return cfg


def record(p: dict, out: dict, full: dict | None, slot_bytes: int, n_layers: int) -> dict:
  """One pair's record: `out` the method's outcome (pre, tokens, text, nll, cont_nll),
  `full` full recompute's record on the pair (None: this is full's)."""
  pre, entry_bytes = out["pre"], slot_bytes // n_layers
  base = out if full is None else full
  agree, first = calls.agreement(out["tokens"], np.asarray(base["tokens"]))
  return dict(id=p["id"], prompt_tokens=int(pre.ids.size), similarity=p["similarity"],
              reused=pre.reused, ttft_s=pre.ttft_s, match_s=pre.match_s,
              kv_bytes=pre.kv_slots * slot_bytes, kv_bytes_live=pre.live_entries * entry_bytes,
              kv_bytes_shared=pre.shared_entries * entry_bytes,
              layer_kept=pre.layer_kept.tolist(),
              recomputed_share=pre.recomputed_share, flops=pre.flops,
              matched_similarity=pre.similarity,
              rouge_l_vs_full=rouge_l(out["text"], base["text"]),
              rouge_l_vs_text=rouge_l(out["text"], p["target"]),
              rouge_l_vs_gold=(None if p["answer_text"] is None
                               else rouge_l(out["text"], p["answer_text"])),
              agreement=agree, first_diff=first,
              dnll=(out["nll"] - base["nll"]) if out.get("nll") is not None else None,
              cont_dnll=None if full is None else out["cont_nll"] - full["cont_nll"],
              text=out["text"], tokens=np.asarray(out["tokens"]).tolist(), nll=out.get("nll"),
              cont_nll=out["cont_nll"], meta=p["meta"])


def _cache(pairs) -> CacheConfig:
  """A pool for one pair at a time (the runner) or the engine's rows (engine)."""
  need = max(max(p["ref"].size, p["tgt"].size) for p in pairs) + 2 * FLAGS.gen + 64
  rows = 2 if FLAGS.via == "runner" else EngineConfig().max_batch + 2
  return CacheConfig(num_pages=rows * (2 * need // 16 + 4) + 64, page_size=16,
                     max_seq_len=need + 16)


def _report(name: str, i: int, total: int, rec: dict) -> None:
  print(f"  {name} {i + 1}/{total} {rec['prompt_tokens']} tok sim={rec['similarity']:.2f} "
        f"{'reused' if rec['reused'] else 'full'} ttft={rec['ttft_s']:.2f}s "
        f"rougeL/full={rec['rouge_l_vs_full']:.2f}", flush=True)


def run_pairs(llm, names: list[str], pairs, recs: dict, save) -> None:
  """Every pair with every method in `names` (full first, then semshare, then the
  baselines that take its per-layer budgets) on batch-1 runners, one per method,
  pair by pair: a pair's methods run back to back, so a drift of the machine's speed
  over a long run lands on every method alike. `recs`: label -> records so far
  (pairs already there are skipped; each new one is appended and `save`d at once, so
  a stopped run resumes pair by pair)."""
  tok = llm.tokenizer
  cache = _cache(pairs)
  runners = {}
  for i, p in enumerate(pairs):
    if i and i % 8 == 0:
      # every pair compiles shapes of its own (layer windows, recompute widths): drop
      # them now and then, or the executables exhaust the process's memory maps
      jax.clear_caches()
    for name in names:
      mine = recs.setdefault(_label(name), [])
      if any(r["id"] == p["id"] for r in mine):
        continue
      if name not in runners:
        runners[name] = SemShareRunner(llm, _config(name), cache=cache)
      runner = runners[name]
      full = None if name == "full" else _by_id(recs["full"])[p["id"]]
      runner.layer_budgets = _budgets(name, recs, p["id"])
      if FLAGS.timed:
        serve_pair(runner, tok, p, full)                      # compiles every shape
      out = serve_pair(runner, tok, p, full)                  # timed
      mine.append(record(p, out, full, runner.slot_bytes, llm.config.num_layers))
      save()
      _report(name, i, len(pairs), mine[-1])
  jax.clear_caches()


def _by_id(recs: list[dict]) -> dict:
  return {r["id"]: r for r in recs}


def _budgets(name: str, recs: dict, pid: str):
  """The per-layer counts a compression baseline keeps on pair `pid` (SemShareKV's own
  there, with --match_budgets), or None (its own rule)."""
  if not FLAGS.match_budgets or name not in layerwise.LAYERWISE_METHODS:
    return None
  sem = _by_id(recs.get(_label("semshare"), [])).get(pid)
  if sem is None:
    raise app.UsageError("--match_budgets: run semshare with the baselines")
  return np.asarray(sem["layer_kept"])


def run_method_engine(llm, name: str, pairs, recs: dict, save) -> None:
  """Every pair with one method through the batch engine (`jaxkv.evaluation.semshare`),
  eight pairs at a time (records saved after each block; a rerun skips the pairs
  already there). The methods run one after another (full first: every quality
  reference), as the engine serves one SemShareKV method."""
  tok = llm.tokenizer
  cache = _cache(pairs)
  eng = Engine(llm.model, tok.stop_ids, cache, EngineConfig())
  runner = SemShareRunner(llm, _config(name), cache=cache, kv=eng.kv_manager)
  eng.add_mechanism(SemShare(runner))
  mine = recs.setdefault(_label(name), [])
  done = {r["id"] for r in mine}
  todo = [(i, p) for i, p in enumerate(pairs) if p["id"] not in done]
  for b in range(0, len(todo), 8):
    block = todo[b:b + 8]
    fulls = [None if name == "full" else _by_id(recs["full"])[p["id"]] for _, p in block]
    got = evaluation.serve_pairs(eng, runner, [evaluation.Pair(
        p["ref"], p["tgt"], p["answer"],
        None if f is None else np.asarray(f["tokens"], np.int32),
        _budgets(name, recs, p["id"])) for (_, p), f in zip(block, fulls)], FLAGS.gen)
    for (i, p), f, s in zip(block, fulls, got):
      out = dict(pre=s.pre, tokens=s.tokens, text=tok.decode(s.tokens.tolist()), nll=s.nll,
                 cont_nll=s.cont_nll)
      mine.append(record(p, out, f, runner.slot_bytes, llm.config.num_layers))
      _report(name, i, len(pairs), mine[-1])
    save()
    jax.clear_caches()          # as the runner does: each pair compiles shapes of its own


def _label(name: str) -> str:
  """The method's row name: with --retention, e.g. semshare/layer0."""
  return name if FLAGS.retention is None or name == "full" else f"{name}/{FLAGS.retention}"


def shift_probe(llm, ids: np.ndarray, shifts) -> common.Table:
  """How position-sensitive the RoPE E cache makes matching: identical text,
  shifted, at the tokens' own positions (`align=False`, the paper's matching).
  `twin` = share of tokens matched to their own copy; `same id` = to any copy of the
  same token; `aligned` = the similarity with `SemShareConfig.align` (the default),
  which takes the shift back."""
  cache = CacheConfig(num_pages=8, page_size=16, max_seq_len=64)
  runner = SemShareRunner(llm, SemShareConfig(align=False, max_dist=80.0), cache=cache)
  aligned = SemShareRunner(llm, SemShareConfig(), cache=cache)
  lines = []
  for s in (int(x) for x in shifts):
    idx, dist = runner.match(ids, ids, offset=s)
    sim = semshare_lib.similarity(dist, runner.cfg.max_dist)
    shifted = np.r_[ids[:1].repeat(s), ids]          # the same text s tokens later
    lines.append((str(s), f"{sim:.2f}", f"{np.mean(dist):.1f}",
                  f"{np.mean(idx == np.arange(ids.size)):.2f}",
                  f"{np.mean(ids[idx] == ids):.2f}",
                  f"{aligned.similarity(shifted, ids):.2f}"))
  return common.Table(
      f"E-cache matching of a {ids.size}-token prompt against itself shifted "
      f"({runner.cfg.nbits} LSH bits, max_dist {runner.cfg.max_dist:g}; aligned: max_dist "
      f"{aligned.cfg.max_dist:g})",
      ("shift", "similarity", "mean distance", "twin", "same id", "aligned"), lines)


def read_pairs(path: str) -> list[SP.Pair]:
  """The pairs of a JSONL file, or a usage error saying what is wrong with it."""
  try:
    return SP.load_pairs(path)
  except (SP.PairFormatError, OSError) as e:
    raise app.UsageError(str(e)) from e


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, tables)
    return
  if not FLAGS.pairs:
    raise app.UsageError("give --pairs (a JSONL of pairs; make one with scripts/make_pairs.py)")
  if FLAGS.via == "engine" and FLAGS.timed:
    raise app.UsageError("--via=engine evaluates quality (a row's TTFT there includes its "
                         "wait behind the other rows): add --notimed, or time with "
                         "--via=runner")
  names = common.method_names(FLAGS.methods, SEMSHARE_METHODS)
  pairs = read_pairs(FLAGS.pairs)
  if FLAGS.ids:
    with open(FLAGS.ids) as f:
      wanted = {ln.strip() for ln in f if ln.strip() and not ln.startswith("#")}
    missing = wanted - {p.id for p in pairs}
    if missing:
      raise app.UsageError(f"{len(missing)} ids of {FLAGS.ids} are not in {FLAGS.pairs}, "
                           f"e.g. {sorted(missing)[0]!r}")
    pairs = [p for p in pairs if p.id in wanted]
  llm = jaxkv.load(FLAGS.model)
  tok = llm.tokenizer
  rendered = []
  for p in pairs[:FLAGS.max_pairs or None]:
    ref, tgt = render(tok, p.reference, p.instruction), render(tok, p.target, p.instruction)
    if max(ref.size, tgt.size) > FLAGS.max_prompt:
      continue
    ans = None if p.answer is None else np.asarray(tok.encode(p.answer, add_bos=False), np.int32)
    rendered.append(dict(id=p.id, ref=ref, tgt=tgt, answer=ans, answer_text=p.answer,
                         target=p.target, meta=p.meta))
  if not rendered:
    raise app.UsageError(f"no pair of {FLAGS.pairs} fits --max_prompt={FLAGS.max_prompt}")
  if FLAGS.shift_probe:
    common.print_tables([shift_probe(llm, rendered[0]["tgt"], FLAGS.shift_probe)])
    return
  # every method's rows are binned by the pair's A.3 similarity (full never matches)
  gate = SemShareConfig()
  if FLAGS.threshold is not None:
    gate = dataclasses.replace(gate, threshold=FLAGS.threshold)
  probe = SemShareRunner(llm, gate, cache=CacheConfig(num_pages=8, page_size=16,
                                                      max_seq_len=64))
  for p in rendered:
    p["similarity"] = probe.similarity(p["ref"], p["tgt"])
  del probe
  if FLAGS.admitted:
    n0 = len(rendered)
    rendered = [p for p in rendered if p["similarity"] >= gate.threshold]
    print(f"{len(rendered)} of {n0} pairs pass the gate ({gate.threshold:g}); the others "
          "would be prefilled in full and are left out (--noadmitted keeps them)")
    if not rendered:
      raise app.UsageError("no pair passes the similarity gate")
  print(f"{len(rendered)} pairs, target {np.mean([p['tgt'].size for p in rendered]):.0f} "
        "tokens on average", flush=True)
  if FLAGS.match_budgets and "pyramidkv" in names:
    # PyramidKV is SnapKV's scoring with a pyramid of budgets: given SemShareKV's
    # budgets instead, its rows equal SnapKV's by construction
    names = [m for m in names if m != "pyramidkv"]
    print("pyramidkv left out: with --match_budgets it is snapkv (its budgets are the "
          "only difference); --nomatch_budgets runs it with its own")
  path = None if not FLAGS.out else FLAGS.out.replace(".json", "") + "_records.json"
  recs = {}
  if path and os.path.exists(path):
    with open(path) as f:
      recs = json.load(f)
  # full first (every quality reference), semshare before the baselines that take its
  # per-layer budgets
  order = ["full"] + [m for m in ("semshare",) if m in names]
  order += [m for m in names if m not in order]
  def save():
    if path:
      with open(path, "w") as f:
        json.dump(recs, f)

  if FLAGS.via == "runner":
    run_pairs(llm, order, rendered, recs, save)
  else:
    for name in order:
      run_method_engine(llm, name, rendered, recs, save)
  ids = {p["id"] for p in rendered}                 # this run's pairs only
  kept = {m: [r for r in rs if r["id"] in ids] for m, rs in recs.items()}
  by_method = {m: {r["id"]: r for r in rs} for m, rs in kept.items()}
  rows = [row for m, rs in kept.items() if m.split("/")[0] in names
          for row in rows_of(m, rs, by_method, timed=FLAGS.timed)]
  common.write_rows(FLAGS.out, rows)
  if FLAGS.plot:
    print(f"wrote {plot(rows, FLAGS.plot)}")
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
