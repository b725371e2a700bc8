"""bench/memart.py's result rows and tables: per-method rows (F1 vs full paired by
question with a bootstrap interval), the recall@k ablation grid, paired evidence
comparisons (exact McNemar), Tables 2 / 3's shapes and the recall-vs-k plot. Pure
over the records the bench writes (<out>_records.json); scripts/report.py renders
the README blocks from the rows."""

from __future__ import annotations

import numpy as np

import common
from jaxkv.data import calls
from jaxkv.data import conversations as C


def strategy_label(rerank: int = 0, neighbors: int = 0) -> str:
  """A MemArt method's retrieval: Softmax-Max over the bound, re-ranked R x k
  (`rerank`), in windows of 2n + 1 blocks (`neighbors`)."""
  return (f"rerank{rerank}x " if rerank else "") + "softmax-max" + (
      f" +{neighbors}nb" if neighbors else "")


def rows_of(recs: list[dict], abl: list[dict], *, block_size: int, top_k: int,
            rerank: int) -> list[dict]:
  """Result rows of a run's records: one per method (the generation runs' block
  size and top_k label them; a MemArt method's strategy is its records' own,
  older records without one: this run's R), one per ablation cell, and the
  paired comparisons (`paired`)."""
  rows = []
  full_f1 = {(r["conv"], r["q"]): r["f1"] for r in recs if r["method"] == "full"}
  plain = {(r["conv"], r["q"]): r for r in recs if r["method"] == "plaintext"}
  full_pred = {(r["conv"], r["q"]): r for r in recs if r["method"] == "full" and "pred" in r}
  for name in dict.fromkeys(r["method"] for r in recs):
    rs = [r for r in recs if r["method"] == name]
    mean = lambda f, sel=rs: _mean([r[f] for r in sel])
    rows.append(dict(
        kind="method", method=name, strategy=rs[0].get("strategy") or {
            "memart": strategy_label(), "memart_rerank": strategy_label(rerank)}.get(name, "-"),
        block_size=block_size, top_k=top_k, evidence_recall=mean("recall"),
        **_recall_ci(rs), f1=mean("f1"), bleu1=mean("bleu1"),
        f1_recall=mean("f1", [r for r in rs if not r["synthetic"]]),
        f1_planted=mean("f1", [r for r in rs if r["synthetic"]]), answer_nll=mean("nll"),
        prefill_tokens=mean("prefill_tokens"), probe_tokens=mean("probe_tokens"),
        decode_kv_len=mean("decode_kv_len"), latency_s=mean("latency_s"), ttft_s=mean("ttft_s"),
        memory_bytes=mean("memory_bytes"), n_questions=len(rs),
        n_conversations=len({r["conv"] for r in rs}), **_vs_full(rs, full_f1),
        **(_vs_plaintext(rs, plain) if name not in ("plaintext", "full") else {}),
        **_contains(rs, full_pred)))
  keys = sorted({(a["strategy"], a["block_size"], a["box_keys"], a["tokens"]) for a in abl})
  for strat, bs, box, tokens in keys:
    sel = [a for a in abl if (a["strategy"], a["block_size"], a["box_keys"], a["tokens"]) ==
           (strat, bs, box, tokens)]
    hits, n = sum(a["hits"] for a in sel), sum(a["n"] for a in sel)
    rows.append(dict(kind="ablation", method=strat if strat in ("recent", "plaintext") else
                     "memart",
                     strategy=strat, block_size=bs, box_keys=box, top_k=sel[0]["top_k"],
                     tokens=tokens, evidence_recall=hits / max(n, 1),
                     recall_ci=list(calls.wilson(hits, n)), n_questions=len(sel)))
  return rows + paired(abl, block_size)


def _mean(xs: list) -> float:
  """Mean of the values present (None: not measured, e.g. an engine run's timings)."""
  xs = [x for x in xs if x is not None]
  return float(np.mean(xs)) if xs else float("nan")


def _groups(rs: list[dict]):
  """Bootstrap units: the conversations when the records span two or more (they
  vary; questions of one conversation do not vary apart), else the questions."""
  convs = [r["conv"] for r in rs]
  return convs if len(set(convs)) > 1 else None


def _recall_ci(rs: list[dict]) -> dict:
  """Evidence recall's 95% interval: a bootstrap over conversations of the
  per-question recall; one conversation: Wilson over the evidence turns."""
  rs = [r for r in rs if not np.isnan(r["recall"])]
  if _groups(rs) is None:
    hit = int(round(sum(r["recall"] for r in rs)))
    return dict(recall_ci=list(calls.wilson(hit, len(rs))), recall_ci_unit="questions")
  _, lo, hi = calls.mean_ci([r["recall"] for r in rs], groups=_groups(rs))
  return dict(recall_ci=[lo, hi], recall_ci_unit="conversations")


def _vs_full(rs: list[dict], full_f1: dict) -> dict:
  """Mean F1 over full context's on the questions both answered, with a paired
  bootstrap 95% interval (`calls.ratio_ci`; conversations resampled when there
  are two or more, else questions)."""
  both = [(r["f1"], full_f1[(r["conv"], r["q"])], r) for r in rs
          if (r["conv"], r["q"]) in full_f1]
  if not both:
    return {}
  x, y, sel = zip(*both)
  ratio, lo, hi = calls.ratio_ci(x, y, groups=_groups(sel))
  return dict(f1_vs_full=ratio, f1_vs_full_ci=[lo, hi], n_vs_full=len(both))


def _contains(rs: list[dict], full: dict) -> dict:
  """Planted questions answered with the value said (`conversations.contains`): the
  rate with its interval (conversations resampled), and against full context on the
  same questions (only this method / only full, exact McNemar p)."""
  rs = [r for r in rs if r["synthetic"] and "pred" in r]
  if not rs:
    return {}
  got = [C.contains(r["pred"], r["answer"]) for r in rs]
  rate, lo, hi = calls.mean_ci(np.asarray(got, float), groups=_groups(rs))
  out = dict(contains_planted=rate, contains_planted_ci=[lo, hi], n_planted=len(rs))
  pairs = [(g, C.contains(full[(r["conv"], r["q"])]["pred"], r["answer"]))
           for g, r in zip(got, rs) if (r["conv"], r["q"]) in full]
  if pairs:
    b, c = sum(x and not y for x, y in pairs), sum(y and not x for x, y in pairs)
    out.update(contains_vs_full=[b, c], p_contains_vs_full=calls.mcnemar(b, c))
  return out


def _vs_plaintext(rs: list[dict], plain: dict) -> dict:
  """Evidence recall paired with plaintext's on the same questions, under the
  records' one rule: evidence turns only this method / only plaintext retrieved
  (exact McNemar p), and the recall difference with a conversation bootstrap.
  Empty for records without per-evidence hits (older runs)."""
  pairs = [(r, plain[(r["conv"], r["q"])]) for r in rs
           if "hit" in r and "hit" in plain.get((r["conv"], r["q"]), {})]
  if not pairs:
    return {}
  b = sum(u and not v for r, p in pairs for u, v in zip(r["hit"], p["hit"]))
  c = sum(v and not u for r, p in pairs for u, v in zip(r["hit"], p["hit"]))
  d, lo, hi = calls.mean_ci([r["recall"] for r, _ in pairs], [p["recall"] for _, p in pairs],
                            groups=_groups([r for r, _ in pairs]))
  return dict(only_vs_plaintext=[b, c], p_vs_plaintext=calls.mcnemar(b, c),
              recall_vs_plaintext=d, recall_vs_plaintext_ci=[lo, hi])


def paired(abl: list[dict], block_size: int) -> list[dict]:
  """Evidence-level paired comparisons at equal retrieved tokens (first block size,
  raw boxes): turns one method retrieved and the other missed, both ways, and the
  exact McNemar p. Records from before per-evidence hits were kept are skipped."""
  hit = {}
  for a in abl:
    if "hit" in a and (a["block_size"], a["box_keys"]) == (block_size, "raw"):
      hit[(a["strategy"], a["tokens"], a["conv"], a["q"])] = a["hit"]
  strats = {k[0] for k in hit}
  reranks = sorted((x for x in strats if x.startswith("rerank")),
                   key=lambda x: int(x[6:x.index("x")]))
  pairs = [(x, y) for x, y in [(r, "plaintext") for r in reranks] +
           [("softmax-max", "plaintext")] + [(r, "softmax-max") for r in reranks] +
           [(r, "recent") for r in reranks] if x in strats and y in strats]
  out = []
  for x, y in pairs:
    for tokens in sorted({k[1] for k in hit if k[0] == x}):
      b = c = n = 0
      for (s_, t, conv, q), hx in hit.items():
        hy = hit.get((y, tokens, conv, q))
        if s_ != x or t != tokens or hy is None:
          continue
        n += len(hx)
        b += sum(u and not v for u, v in zip(hx, hy))
        c += sum(v and not u for u, v in zip(hx, hy))
      out.append(dict(kind="paired", first=x, second=y, tokens=tokens, n_evidence=n,
                      first_only=b, second_only=c, p_mcnemar=calls.mcnemar(b, c)))
  return out


def _secs(x: float) -> str:
  """Seconds: milliseconds kept below 1 s (a GPU's TTFTs); "-" when not measured."""
  if np.isnan(x):
    return "-"
  return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def _ratio_cell(r: dict, full: dict | None) -> str:
  """F1 vs full: paired over the questions both answered, with its bootstrap
  interval (and n when fewer than all); older files: the ratio of the means."""
  if "f1_vs_full" in r:
    lo, hi = r["f1_vs_full_ci"]
    cell = f"{100 * r['f1_vs_full']:.0f}%"
    if r["method"] != "full" and not np.isnan(lo):
      cell += f" [{100 * lo:.0f}, {100 * hi:.0f}]"
    return cell + (f" (n {r['n_vs_full']})" if r["n_vs_full"] != r["n_questions"] else "")
  return "-" if not full or not full["f1"] else f"{100 * r['f1'] / full['f1']:.0f}%"


def _pct(x: float) -> str:
  """A score x 100; '-' where no question of the kind was asked (nan)."""
  return "-" if np.isnan(x) else f"{100 * x:.1f}"


def _n_cell(r: dict) -> str:
  """Questions, and conversations where the row counts them."""
  return str(r["n_questions"]) + (f" ({r['n_conversations']})" if "n_conversations" in r else "")


def _plain_cell(r: dict) -> str:
  """Recall paired with plaintext's: the difference [interval] (evidence only
  this method / only plaintext retrieved, exact McNemar p); '-' where unpaired."""
  if "p_vs_plaintext" not in r:
    return "-"
  lo, hi = r["recall_vs_plaintext_ci"]
  b, c = r["only_vs_plaintext"]
  return (f"{r['recall_vs_plaintext']:+.2f} [{lo:+.2f}, {hi:+.2f}] "
          f"({b} / {c}, p {r['p_vs_plaintext']:.3g})")


def _paired_columns(header: tuple, lines: list, ms: list[dict]) -> tuple[tuple, list]:
  """Table 2's header and lines; the columns of the conversation-level protocol
  (conversations counted, paired with plaintext, the planted value said) only where
  some row has them (older runs' tables stay as they were)."""
  keep = [True] * len(header)
  keep += [any("p_vs_plaintext" in r for r in ms), any("contains_planted" in r for r in ms)]
  conv = any("n_conversations" in r for r in ms)
  header = header[:2] + ("questions (conv.)" if conv else "questions",) + header[3:] + (
      "recall - plaintext [95% CI] (only / only, p)",
      "planted value said [95% CI] (only / only full, p)")
  pick = lambda cells: tuple(c for c, k in zip(cells, keep) if k)
  return pick(header), [pick(cells) for cells in lines]


def _contains_cell(r: dict) -> str:
  """The planted value said: rate [interval], paired with full context."""
  if "contains_planted" not in r:
    return "-"
  lo, hi = r["contains_planted_ci"]
  cell = f"{r['contains_planted']:.2f} [{lo:.2f}, {hi:.2f}]"
  if "p_contains_vs_full" in r and r["method"] != "full":
    b, c = r["contains_vs_full"]
    cell += f" ({b} / {c}, p {r['p_contains_vs_full']:.3g})"
  return cell


def tables(rows: list[dict]) -> list[common.Table]:
  ms = [r for r in rows if r["kind"] == "method"]
  full = next((r for r in ms if r["method"] == "full"), None)
  h2 = ("method", "strategy", "questions", "F1", "F1 vs full [95% CI]", "F1 recall q",
        "F1 planted q", "BLEU-1", "answer NLL", "evidence recall")
  t2 = [(r["method"], r["strategy"], _n_cell(r), f"{100 * r['f1']:.1f}",
         _ratio_cell(r, full),
         _pct(r["f1_recall"]), _pct(r["f1_planted"]), f"{100 * r['bleu1']:.1f}",
         f"{r['answer_nll']:.3f}",
         f"{r['evidence_recall']:.2f} [{r['recall_ci'][0]:.2f}, {r['recall_ci'][1]:.2f}]",
         _plain_cell(r), _contains_cell(r)) for r in ms]
  t3 = [(r["method"], f"{r['prefill_tokens']:.0f}", f"{r['probe_tokens']:.0f}",
         "-" if not full else f"{full['prefill_tokens'] / max(r['prefill_tokens'], 1):.0f}x",
         f"{r['decode_kv_len']:.0f}", _secs(r["ttft_s"]), _secs(r["latency_s"]),
         f"{r['memory_bytes'] / 2 ** 20:.1f}") for r in ms]
  ab = sorted((r for r in rows if r["kind"] == "ablation"),
              key=lambda r: (r["block_size"], r["box_keys"], r["strategy"], r["tokens"]))
  tok_cols = sorted({r["tokens"] for r in ab})
  grid = {}
  for r in ab:
    grid.setdefault((r["block_size"], r["box_keys"], r["strategy"]), {})[r["tokens"]] = r
  t4 = [(str(bs), box, strat) + tuple(
      f"{g[t]['evidence_recall']:.2f}" if t in g else "-" for t in tok_cols)
        for (bs, box, strat), g in grid.items()]
  return [t for t in [
      common.Table("MemArt vs baselines (Table 2's shape): LoCoMo F1 / BLEU-1 x 100 of the "
                   "greedy answer, answer NLL (nats/token), evidence recall [95% CI]",
                   *_paired_columns(h2, t2, ms)),
      common.Table("Efficiency (Table 3's shape): prefill tokens per request (+ MemArt's "
                   "retrieval probe), decode KV length, TTFT and latency (s), memory MiB",
                   ("method", "prefill tokens", "probe tokens", "fewer than full",
                    "decode KV len", "TTFT s", "latency s", "memory MiB"), t3),
      common.Table("Retrieval ablation: evidence recall@k by block size, boxes (raw = "
                   "de-rotated keys) and strategy; columns = retrieved history tokens",
                   ("BS", "boxes", "strategy") + tuple(str(t) for t in tok_cols), t4),
      common.Table("Paired evidence recall at equal retrieved tokens: evidence turns only "
                   "the first / only the second method retrieved, exact McNemar p",
                   ("first", "second", "tokens", "evidence", "first only", "second only",
                    "p"), [(r["first"], r["second"], str(r["tokens"]), str(r["n_evidence"]),
                            str(r["first_only"]), str(r["second_only"]),
                            f"{r['p_mcnemar']:.3g}") for r in rows if r["kind"] == "paired"])]
          if t.lines]                                  # --nogenerate / older files: no rows


def plot(rows: list[dict], path: str) -> str:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  ab = [r for r in rows if r["kind"] == "ablation"]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  strategies = sorted({r["strategy"] for r in ab})
  for key in sorted({(r["block_size"], r["box_keys"], r["strategy"]) for r in ab}):
    rs = sorted((r for r in ab if (r["block_size"], r["box_keys"], r["strategy"]) == key),
                key=lambda r: r["tokens"])
    ax.plot([r["tokens"] for r in rs], [r["evidence_recall"] for r in rs],
            color=f"C{strategies.index(key[2])}", ls="-" if key[0] == 16 else "--",
            marker="o" if key[1] == "raw" else "x", lw=1.5 if key[1] == "raw" else 0.8,
            label=f"BS{key[0]} {key[1]} {key[2]}")
  ax.set(xscale="log", xlabel="retrieved history tokens (k x BS)", ylabel="evidence recall",
         title="MemArt retrieval: recall vs k")
  ax.legend(fontsize=6, ncol=2)
  return common.save_figure(fig, plt, path)
