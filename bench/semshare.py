r"""SemShareKV (seed 001) side by side with full recompute, its Table 2 ablations
and CacheBlend's rule on the same fuzzy match, over a prompt-pairs file.

    python bench/semshare.py --pairs=data_local/semshare_pairs.jsonl \
        [--methods=full,semshare,fuzzy_full,zero,random,blend] [--model=smollm2-135m] \
        [--gen=32] [--max_pairs=0] [--out=bench/results_semshare.json] \
        [--plot=docs/plots/semshare.png] [--threshold=0] [--retention=layer0]
    python bench/semshare.py --pairs=... --shift_probe=0,1,2,5,10,30,100,300

Per pair and method, on one runner: the reference prompt is prefilled in full
and stored, then the target is served (reused when the LSH similarity reaches
the threshold). Each pair runs twice and the second run is timed (the first
compiles every shape it needs), so TTFT excludes compiles. Quality against
`full` on the same target: ROUGE-L (rouge-score) of the greedy output vs full
recompute's output and vs the target text, greedy agreement (position-wise over
--gen tokens, Wilson 95% interval), and, where the pair has an answer, its
teacher-forced NLL (delta vs full, nats per token). Memory: the pool bytes the
target owns (`kv_bytes`), the layer x token entries it keeps
(`kv_bytes_live`) and of those the ones aliased to the reference
(`kv_bytes_shared`). Rows per (method, prompt length bucket) and per (method,
similarity bin); a rerun skips the methods already in --out.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

import jax
import numpy as np
from absl import app, flags

import common
import jaxkv
from jaxkv.config import SEMSHARE_METHODS, CacheConfig, SemShareConfig
from jaxkv.data import calls
from jaxkv.data import semshare_pairs as SP
from jaxkv.engine.semshare import SemShareRunner
from jaxkv.policies.reuse import semshare as semshare_lib

FLAGS = flags.FLAGS
SIM_BINS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


def define_flags():
  flags.DEFINE_string("pairs", None, "pairs JSONL (scripts/make_pairs.py, or your own)")
  flags.DEFINE_string("methods", ",".join(SEMSHARE_METHODS), "comma list of "
                      f"{','.join(SEMSHARE_METHODS)}")
  flags.DEFINE_string("model", "smollm2-135m", "preset or weights path")
  flags.DEFINE_integer("gen", 32, "greedy tokens generated per target")
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


def serve_pair(runner: SemShareRunner, tok, ref_ids, tgt_ids, answer_ids) -> dict:
  """Reference (stored), then the target; returns the target's outcome."""
  runner.reset()
  runner.release(runner.prefill(ref_ids).seq)
  pre = runner.prefill(tgt_ids)
  toks, _ = runner.decode(pre, FLAGS.gen)
  out = dict(pre=pre, tokens=toks, text=tok.decode(toks.tolist()))
  if answer_ids is not None:
    _, lp = runner.decode(pre, answer_ids.size, forced=answer_ids)
    out["nll"] = float(-np.mean(lp))
  runner.release(pre.seq)
  return out


def run_method(llm, name: str, pairs, ref) -> tuple[list[dict], list[dict]]:
  """Every pair with one method: (rows, per-pair records)."""
  tok = llm.tokenizer
  need = max(max(p["ref"].size, p["tgt"].size) for p in pairs) + FLAGS.gen + 64
  pages = 2 * (2 * need // 16 + 4) + 64
  cfg = SemShareConfig(method=name)
  if FLAGS.threshold is not None:
    cfg = dataclasses.replace(cfg, threshold=FLAGS.threshold)
  if FLAGS.retention is not None:
    cfg = dataclasses.replace(cfg, retention=FLAGS.retention)
  runner = SemShareRunner(llm, cfg,
                          cache=CacheConfig(num_pages=pages, page_size=16,
                                            max_seq_len=need + 16))
  slot_bytes = runner.slot_bytes
  entry_bytes = slot_bytes // llm.config.num_layers
  recs = []
  for i, p in enumerate(pairs):
    serve_pair(runner, tok, p["ref"], p["tgt"], p["answer"])            # compiles
    out = serve_pair(runner, tok, p["ref"], p["tgt"], p["answer"])      # timed
    pre = out["pre"]
    base = out if ref is None else ref[i]
    rec = dict(id=p["id"], prompt_tokens=int(pre.ids.size), similarity=p["similarity"],
               reused=pre.reused, ttft_s=pre.ttft_s, match_s=pre.match_s,
               kv_bytes=pre.kv_slots * slot_bytes, kv_bytes_live=pre.live_entries * entry_bytes,
               kv_bytes_shared=pre.shared_entries * entry_bytes,
               recomputed_share=pre.recomputed_share, flops=pre.flops,
               matched_similarity=pre.similarity,
               rouge_l_vs_full=rouge_l(out["text"], base["text"]),
               rouge_l_vs_text=rouge_l(out["text"], p["target"]),
               agree=int(np.sum(out["tokens"] == np.asarray(base["tokens"]))),
               dnll=(out["nll"] - base["nll"]) if "nll" in out else None,
               text=out["text"], tokens=out["tokens"].tolist(), nll=out.get("nll"),
               meta=p["meta"])
    recs.append(rec)
    print(f"  {name} {i + 1}/{len(pairs)} {rec['prompt_tokens']} tok sim={rec['similarity']:.2f} "
          f"{'reused' if rec['reused'] else 'full'} ttft={rec['ttft_s']:.2f}s "
          f"rougeL/full={rec['rouge_l_vs_full']:.2f}", flush=True)
  jax.clear_caches()
  return rows_of(_label(name), recs), recs


def _label(name: str) -> str:
  """The method's row name: with --retention, e.g. semshare/layer0."""
  return name if FLAGS.retention is None or name == "full" else f"{name}/{FLAGS.retention}"


def _bucket(n: int) -> int:
  return int(round(n / 500.0) * 500) or 500


def rows_of(name: str, recs: list[dict]) -> list[dict]:
  groups = collections.defaultdict(list)
  for r in recs:
    groups[("length", _bucket(r["prompt_tokens"]))].append(r)
    k = int(np.searchsorted(SIM_BINS, r["similarity"], side="right")) - 1
    groups[("similarity", SIM_BINS[k])].append(r)
    kind = (r.get("meta") or {}).get("kind")
    if kind:
      groups[("kind", kind)].append(r)
  rows = []
  for (group, key), rs in sorted(groups.items()):
    k, n = sum(r["agree"] for r in rs), FLAGS.gen * len(rs)
    dn = [r["dnll"] for r in rs if r["dnll"] is not None]
    mean = lambda f: float(np.mean([r[f] for r in rs]))
    rows.append(dict(
        method=name, group=group, key=key, prompt_tokens=mean("prompt_tokens"),
        similarity=mean("similarity"), reused_share=mean("reused"), ttft_s=mean("ttft_s"),
        match_s=mean("match_s"), kv_bytes=mean("kv_bytes"), kv_bytes_live=mean("kv_bytes_live"),
        kv_bytes_shared=mean("kv_bytes_shared"), rouge_l_vs_full=mean("rouge_l_vs_full"),
        rouge_l_vs_text=mean("rouge_l_vs_text"), delta_nll=float(np.mean(dn)) if dn else None,
        n_answers=len(dn), greedy_agreement=k / n, greedy_ci=list(calls.wilson(k, n)),
        recomputed_share=mean("recomputed_share"), flops=mean("flops"), n_pairs=len(rs)))
  return rows


def tables(rows: list[dict]) -> list[common.Table]:
  out = []
  for group, title in (("length", "by prompt length (tokens, bucket of 500)"),
                       ("similarity", "by LSH similarity of the pair (bin lower edge)"),
                       ("kind", "by how the reference was made from the target")):
    rs = [r for r in rows if r["group"] == group]
    if not rs:
      continue
    full = {r["key"]: r for r in rs if r["method"] == "full"}
    lines = []
    for r in sorted(rs, key=lambda r: (r["key"], r["method"])):
      f = full.get(r["key"])
      lines.append((
          f"{r['key']:g}" if group != "kind" else r["key"], r["method"], str(r["n_pairs"]),
          f"{r['prompt_tokens']:.0f}",
          f"{r['similarity']:.2f}", f"{r['reused_share']:.2f}", f"{1000 * r['ttft_s']:.0f}",
          "-" if not f else f"{f['ttft_s'] / r['ttft_s']:.2f}x",
          f"{r['kv_bytes'] / 2 ** 20:.1f}", f"{r['kv_bytes_live'] / 2 ** 20:.1f}",
          f"{r['kv_bytes_shared'] / 2 ** 20:.1f}", f"{r['recomputed_share']:.3f}",
          f"{100 * r['rouge_l_vs_full']:.1f}", f"{100 * r['rouge_l_vs_text']:.1f}",
          "-" if r["delta_nll"] is None else f"{r['delta_nll']:+.3f}",
          f"{r['greedy_agreement']:.2f} [{r['greedy_ci'][0]:.2f}, {r['greedy_ci'][1]:.2f}]"))
    out.append(common.Table(
        f"SemShareKV {title}; TTFT compiled; vs full = how many times faster; KV MiB owned / "
        "kept (layer entries) / shared with the reference; ROUGE-L x 100",
        ("bin", "method", "pairs", "prompt tok", "similarity", "reused", "TTFT ms", "vs full",
         "KV owned", "KV kept", "KV shared", "recomputed", "ROUGE-L vs full",
         "ROUGE-L vs text", "dNLL answer", "greedy agree [95% CI]"), lines))
  return out


def plot(rows: list[dict], path: str) -> str:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for m in dict.fromkeys(r["method"] for r in rows):
    ln = sorted((r for r in rows if r["method"] == m and r["group"] == "length"),
                key=lambda r: r["key"])
    ax[0].plot([r["prompt_tokens"] for r in ln], [r["ttft_s"] for r in ln], "o-", label=m)
    sm = sorted((r for r in rows if r["method"] == m and r["group"] == "similarity"),
                key=lambda r: r["key"])
    if m != "full":
      ax[1].plot([r["similarity"] for r in sm], [100 * r["rouge_l_vs_full"] for r in sm],
                 "o-", label=m)
  ax[0].set(xlabel="prompt tokens", ylabel="TTFT (s)", title="TTFT by prompt length")
  ax[1].set(xlabel="LSH similarity of the pair", ylabel="ROUGE-L vs full recompute",
            title="quality vs similarity")
  ax[1].axvline(0.8, color="k", lw=0.8, ls="--")
  for a in ax:
    a.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


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


def main(argv):
  del argv
  if FLAGS.tables_from:
    common.print_tables_from(FLAGS.tables_from, tables)
    return
  if not FLAGS.pairs:
    raise app.UsageError("give --pairs (a JSONL of pairs; make one with scripts/make_pairs.py)")
  names = common.method_names(FLAGS.methods, SEMSHARE_METHODS)
  try:
    pairs = SP.load_pairs(FLAGS.pairs)
  except (SP.PairFormatError, OSError) as e:
    raise app.UsageError(str(e)) from e
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
    rendered.append(dict(id=p.id, ref=ref, tgt=tgt, answer=ans, target=p.target, meta=p.meta))
  if not rendered:
    raise app.UsageError(f"no pair of {FLAGS.pairs} fits --max_prompt={FLAGS.max_prompt}")
  if FLAGS.shift_probe:
    common.print_tables([shift_probe(llm, rendered[0]["tgt"], FLAGS.shift_probe)])
    return
  # every method's rows are binned by the pair's A.3 similarity (full never matches)
  probe = SemShareRunner(llm, SemShareConfig(), cache=CacheConfig(num_pages=8, page_size=16,
                                                                  max_seq_len=64))
  for p in rendered:
    p["similarity"] = probe.similarity(p["ref"], p["tgt"])
  del probe
  print(f"{len(rendered)} pairs, target {np.mean([p['tgt'].size for p in rendered]):.0f} "
        "tokens on average", flush=True)
  rows = []
  if FLAGS.out and os.path.exists(FLAGS.out):
    with open(FLAGS.out) as f:
      rows = json.load(f)
  have = {r["method"] for r in rows}
  ref = None
  for name in ["full"] + [m for m in names if m != "full"]:    # full: every quality reference
    if _label(name) in have and name != "full":
      continue
    new, recs = run_method(llm, name, rendered, ref)
    if name == "full":
      ref = recs
    if _label(name) not in have and name in names:
      rows += new
      common.write_rows(FLAGS.out, rows)
  if FLAGS.plot:
    print(f"wrote {plot(rows, FLAGS.plot)}")
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
