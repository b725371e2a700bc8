r"""Regenerates the results tables of the docs, the configuration reference and the plots.

    python scripts/report.py [--plots=docs/plots] [--check]

Writes, from files only (nothing is measured here):
  - the results blocks of README.md and of every page under docs/ (tables from the
    result files below);
  - docs/configuration.md: every `--config.*` field of the commands, from the config
    dataclasses (`jaxkv.cli.fields`), so the page cannot drift from the code;
  - the PNG plots in docs/plots/.

Sources (nothing is measured here; rerun a benchmark to change a figure):
  bench/results_cpu.json           bench/throughput.py      throughput table, throughput vs batch
  bench/results_cpu_layouts.json   bench/throughput.py      the same by projection storage
  bench/results_layouts_cpu.json   bench/layouts.py         projection storage A/B (GEMMs, steps)
  bench/results_pruning_tau2.json  bench/pruning.py         teacher-forced tables and recall /
                                                            dNLL vs budget (none in the docs
                                                            now: Tables 2 / 7 come from
                                                            next-call accuracy)
  bench/results_table4_tau2.json   bench/pruning.py --head  Table 4 shape
  bench/results_pruner_head_recall.json bench/pruner_head_recall.py  the shipped heads'
                                                            recall@k with chance, intervals
  bench/results_lragent_heldout.json bench/lragent.py       every held-out trajectory through
                                                            the engine, paired vs non_shared
  bench/results_lragent.json       bench/lragent.py         TTFT / throughput / KV / fidelity /
                                                            call accuracy tables, TTFT and
                                                            throughput vs context
  bench/results_agent_eval_*.json  bench/agent_eval.py      next-call accuracy in Table 2 / 7;
                                                            paired tests on discriminative calls
                                                            shapes (qwen, smollm2) and
                                                            closed-loop (tau2, agentdojo)
                                                            tables
  bench/results_reuse.json         bench/reuse.py           segment reuse side by side per
                                                            workload, drift vs perturbation
                                                            (tables and curves)
  bench/results_reuse_chance.json  bench/reuse.py           the same against chance baselines,
                                                            int8 and float32 stores (bootstrap
                                                            over requests, paired)
  bench/results_reuse_pool.json    bench/reuse.py           the exact tier on a small pool
  bench/results_reuse_gated.json   bench/reuse.py           the gates calibrated on dev
                                                            (bench/reuse_gates.py), held out
  bench/results_reuse_qwen.json    bench/reuse.py           workload (a) on Qwen2.5-Coder-0.5B
                                                            through the engine, with chance
  bench/results_reuse_qwen_ttft.json bench/reuse.py         the same workload's TTFT (runner,
                                                            timed pass)
  bench/results_reuse_regime_b_ttft.json bench/reuse.py     workload (a)'s TTFT with the store
                                                            in regime B (SmolLM2, timed)
  bench/results_semshare*.json     bench/semshare.py        SemShareKV by similarity and by
                                                            prompt length (tables, curves)
  bench/results_semshare_admission.json bench/semshare_gate.py  the gate on natural edits
  bench/results_memart.json        bench/memart.py          MemArt vs baselines (Tables 2 /
                                                            3), recall@k ablation and curve
  bench/results_memart_exact.json  bench/memart.py          recall@k: eq. 3 bound vs exact
                                                            block maxima vs re-ranking
  bench/results_memart_qwen.json   bench/memart.py          question-only requests over
                                                            24k-token histories (Qwen)
  bench/results_memart_recall.json bench/memart.py          recall@k with plaintext and
                                                            paired tests (140 questions)
  bench/results_memart_h100.json   bench/memart.py (GPU)    TTFT / latency over a 25k-token
                                                            history on an H100 (timings only)
  bench/results_memart_qwen_r16.json bench/memart.py        re-ranking R = 4 / 8 / 16 over
                                                            24k-token histories (Qwen)
  bench/results_memart_recall_f1.json bench/memart.py       answers (F1 vs full, paired) on
                                                            the 5-6k recall conversations
  bench/results_memart_planted*.json bench/memart.py        planted facts under one evidence
                                                            rule: dev (settings chosen), test
  bench/results_memart_qwen_planted.json bench/memart.py    the frozen setting on Qwen at 24k
  bench/results_kernels_h200*.json bench/attention_kernels.py (GPU)   attention kernels side by side
  bench/results_throughput_h200.json bench/throughput.py    engine vs HF on the same GPU
  bench/results_composed.json      bench/composed.py        agents / pruning / reuse /
                                                            MemArt alone and composed
                                                            (agent calls)
  bench/results_compaction.json    bench/compaction.py      pruning / reuse alone and
                                                            composed (cleared histories)
  bench/results_composed_memory.json bench/composed_memory.py MemArt / pruning alone and
                                                            composed (planted facts)
  artifacts/smollm2-135m/*/        scripts/train_lora.py,   held-out NLL matrix, Phase-2
   (metrics.jsonl, log.csv)        scripts/train_pruner.py  epoch table, training curves

Each generated block sits between `<!-- report:NAME -->` and
`<!-- /report:NAME -->` in a markdown page; text outside the markers (the prose,
the commands) is left alone. A block whose source file is missing is left as it
is, with a warning. --check exits 1 when a page is not what this would write (the
tests use it to keep the docs in step with the files and the config classes).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "scripts")]

import agent_stats  # noqa: E402  (bench/)
import agent_tables  # noqa: E402
import attention_kernels as kernels_bench  # noqa: E402
import common  # noqa: E402
import compaction as compaction_bench  # noqa: E402
import composed as composed_bench  # noqa: E402
import composed_memory  # noqa: E402
import config_reference  # noqa: E402  (scripts/)
import layouts  # noqa: E402
import lragent as lragent_bench  # noqa: E402
import memart_tables as memart_bench  # noqa: E402
import plot_training  # noqa: E402
import pruner_head_recall  # noqa: E402
import pruning  # noqa: E402
import reuse_tables as reuse_bench  # noqa: E402
import semshare as semshare_bench  # noqa: E402
import semshare_gate  # noqa: E402
import server_load  # noqa: E402
import throughput  # noqa: E402
from jaxkv import artifacts  # noqa: E402
from jaxkv.data import agents  # noqa: E402

FLAGS = flags.FLAGS
CONFIG_PAGE = "docs/configuration.md"
BLOCK = re.compile(r"(<!-- report:([\w-]+) -->\n)(.*?)(<!-- /report:\2 -->)", re.S)
SOURCES = {
    "throughput": "bench/results_cpu.json",
    "pruning": "bench/results_pruning_tau2.json",
    "table4": "bench/results_table4_tau2.json",
    "lragent": "bench/results_lragent.json",
    "lragent-heldout": "bench/results_lragent_heldout.json",
    "pruner-head-recall": "bench/results_pruner_head_recall.json",
    "agent-eval-qwen-free": "bench/results_agent_eval_qwen_free.json",
    "agent-eval-qwen": "bench/results_agent_eval_qwen.json",
    "agent-eval-smollm2": "bench/results_agent_eval_smollm2.json",
    "agent-eval-disc": "bench/results_agent_eval_disc.json",
    "agent-eval-disc-all": "bench/results_agent_eval_disc_all.json",
    "agent-eval-disc-bfcl": "bench/results_agent_eval_disc_bfcl.json",
    "agent-eval-disc-bfcl-head": "bench/results_agent_eval_disc_bfcl_head.json",
    "closed-loop-tau2": "bench/results_closed_loop_tau2.json",
    "closed-loop-agentdojo": "bench/results_closed_loop_agentdojo.json",
    "reuse": "bench/results_reuse.json",
    "reuse-chance": "bench/results_reuse_chance.json",
    "reuse-pool": "bench/results_reuse_pool.json",
    "reuse-gated": "bench/results_reuse_gated.json",
    "reuse-qwen": "bench/results_reuse_qwen.json",
    "reuse-qwen-ttft": "bench/results_reuse_qwen_ttft.json",
    "reuse-regime-b-ttft": "bench/results_reuse_regime_b_ttft.json",
    "semshare": "bench/results_semshare.json",
    "semshare-lengths": "bench/results_semshare_lengths.json",
    "semshare-curve": "bench/results_semshare_curve.json",
    "semshare-lengths45": "bench/results_semshare_lengths45.json",
    "semshare-gate500": "bench/results_semshare_gate500.json",
    "semshare-gate2000": "bench/results_semshare_gate2000.json",
    "semshare-gate4000": "bench/results_semshare_gate4000.json",
    "semshare-admission": "bench/results_semshare_admission.json",
    "semshare-gold": "bench/results_semshare_gold.json",
    "memart": "bench/results_memart.json",
    "memart-exact": "bench/results_memart_exact.json",
    "memart-rerank": "bench/results_memart_rerank.json",
    "memart-qwen": "bench/results_memart_qwen.json",
    "memart-recall": "bench/results_memart_recall.json",
    "memart-h100": "bench/results_memart_h100.json",
    "memart-qwen-r16": "bench/results_memart_qwen_r16.json",
    "memart-recall-f1": "bench/results_memart_recall_f1.json",
    "memart-nb1": "bench/results_memart_nb1.json",
    "memart-qwen-nb1": "bench/results_memart_qwen_nb1.json",
    "memart-pooled": "bench/results_memart_pooled.json",
    "memart-planted-dev": "bench/results_memart_planted_dev.json",
    "memart-planted-dev-nb1": "bench/results_memart_planted_dev_nb1.json",
    "memart-planted": "bench/results_memart_planted.json",
    "memart-qwen-planted": "bench/results_memart_qwen_planted.json",
    "kernels-h200": "bench/results_kernels_h200.json",
    "kernels-h200-grid": "bench/results_kernels_h200_grid.json",
    "kernels-h200-mosaic": "bench/results_kernels_h200_mosaic.json",
    "kernels-h100": "bench/results_kernels_h100.json",
    "kernels-h100-plan": "bench/results_kernels_h100_plan.json",
    "kernels-h100-splits": "bench/results_kernels_h100_splits.json",
    "throughput-h100": "bench/results_throughput_h100.json",
    "throughput-layouts": "bench/results_cpu_layouts.json",
    "layouts": "bench/results_layouts_cpu.json",
    "throughput-h200": "bench/results_throughput_h200.json",
    "server-load": "bench/results_server_load.json",
    "server-load-kinds": "bench/results_server_load_kinds.json",
    "composed": "bench/results_composed.json",
    "compaction": "bench/results_compaction.json",
    "composed-memory": "bench/results_composed_memory.json",
    "role-adapters": f"{artifacts.ROLE_ADAPTERS}/metrics.jsonl",
    "role-adapters-qkvo": f"{artifacts.ROLE_ADAPTERS_QKVO}/metrics.jsonl",
    "pruner-epochs": f"{artifacts.PRUNER_HEAD}/metrics.jsonl",
}


def define_flags():
  flags.DEFINE_string("plots", str(ROOT / "docs" / "plots"), "folder for the PNG plots")
  flags.DEFINE_bool("check", False, "only check that the pages are up to date (exit 1 if not)")


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """The markdown pages that may hold results blocks: README.md and docs/**/*.md."""
  return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _rows(root: pathlib.Path, name: str):
  path = root / SOURCES[name]
  if not path.is_file():
    return None
  if path.suffix == ".jsonl":
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
  return json.loads(path.read_text())


def _render(tables: list[common.Table], titles: bool = True) -> str:
  parts = []
  for t in tables:
    parts.append((f"{t.title}:\n\n" if titles and t.title else "") + t.markdown())
  return "\n\n".join(parts) + "\n"


def role_adapter_table(metrics: list[dict]) -> common.Table:
  """Held-out NLL matrix of the last evaluation: rows = weights, columns = role scored."""
  nll = metrics[-1]["nll"]
  lines = []
  for w in ("base", *agents.ROLES):
    row = nll[w]
    best = {r: min(nll[x][r] for x in nll) for r in agents.ROLES}
    cells = [f"**{row[r]:.3f}**" if row[r] == best[r] else f"{row[r]:.3f}" for r in agents.ROLES]
    lines.append(["base model" if w == "base" else f"{w} adapter", *cells])
  return common.Table(f"held-out token NLL after step {metrics[-1]['step']} (rows: weights, "
                      "columns: the role scored)", ["weights", *agents.ROLES], lines)


def pruner_epoch_table(metrics: list[dict]) -> common.Table:
  """Validation per epoch: recall@C* of the rule and of Phase-2, loss, alpha."""
  ms = [m for m in metrics if "recall_phase1" in m]
  b = ms[0]["recall_budget"]
  rows = [(f"Phase-1 rule (eq. 3), recall@{b}", "recall_phase1", "{:.3f}"),
          (f"Phase-2 (rule + alpha MLP), recall@{b}", "recall_phase2", "{:.3f}"),
          (f"Phase-1 rule, recall@{ms[0]['half_budget']}", "half_recall_phase1", "{:.3f}"),
          (f"Phase-2, recall@{ms[0]['half_budget']}", "half_recall_phase2", "{:.3f}"),
          ("val loss (eq. 8)", "val_loss", "{:.2f}"), ("alpha", "alpha", "{:.3f}")]
  if all("recall_random" in m for m in ms):        # runs logged since the chance line
    rows[2:2] = [(f"random top-{b} (chance), recall@{b}", "recall_random", "{:.3f}")]
    rows[5:5] = [(f"random (chance), recall@{ms[0]['half_budget']}", "half_recall_random",
                  "{:.3f}")]
  return common.Table(f"validation ({ms[0]['val_rows']} held-out rows with evidence)",
                      ["", *(f"epoch {m['epoch']}" for m in ms)],
                      [[label, *(fmt.format(m[key]) for m in ms)] for label, key, fmt in rows])


def blocks(root: pathlib.Path = ROOT) -> dict[str, str | None]:
  """{block name: markdown} (None where the source file is missing)."""
  out: dict[str, str | None] = {}
  rows = {name: _rows(root, name) for name in SOURCES}
  out["throughput"] = rows["throughput"] and _render([throughput.table(rows["throughput"])],
                                                     titles=False)
  out["pruning"] = rows["pruning"] and _render(pruning.tables(rows["pruning"], everything=False))
  out["table4"] = rows["table4"] and _render(pruning.tables(rows["table4"], everything=False),
                                             titles=False)
  out["lragent"] = rows["lragent"] and _render(lragent_bench.tables(rows["lragent"]))
  out["lragent-heldout"] = rows["lragent-heldout"] and _render(
      lragent_bench.tables(rows["lragent-heldout"]))
  out["pruner-head-recall"] = rows["pruner-head-recall"] and _render(
      pruner_head_recall.tables(rows["pruner-head-recall"]))
  # the stopped free-generation grid: one flat table (every row is 0-5%)
  out["agent-eval-qwen-free"] = rows["agent-eval-qwen-free"] and _render(
      [agent_tables.table(rows["agent-eval-qwen-free"])])
  # every split and budget: the paired table and the contrasts the readings cite
  # (--tables_from prints the Table 2 / 7 shapes per budget too)
  disc, bfcl = rows["agent-eval-disc-all"], rows["agent-eval-disc-bfcl"]
  for name, rs in (("agent-eval-disc-all", disc), ("agent-eval-disc-bfcl", bfcl),
                   # the same grid over both session sets, one row per configuration
                   ("agent-eval-disc-pooled", disc and bfcl and agent_stats.pool([disc, bfcl]))):
    out[name] = rs and _render(agent_stats.tables(rs))
  # a head trained on BFCL, scored on the BFCL sessions it never saw, against the grid
  head = rows["agent-eval-disc-bfcl-head"]
  out["agent-eval-disc-bfcl-head"] = head and bfcl and _render(
      [t for t in (agent_stats.table(head), agent_stats.versus(head, bfcl)) if t is not None])
  for name in ("agent-eval-qwen", "agent-eval-smollm2", "agent-eval-disc", "closed-loop-tau2",
               "closed-loop-agentdojo"):
    out[name] = rows[name] and _render(agent_tables.tables(rows[name], everything=False))
  for name in ("reuse", "reuse-chance", "reuse-pool", "reuse-gated", "reuse-qwen",
               "reuse-qwen-ttft", "reuse-regime-b-ttft"):
    out[name] = rows[name] and _render(reuse_bench.tables(rows[name]))
  out["semshare"] = rows["semshare"] and _render(
      [t for t in semshare_bench.tables(rows["semshare"]) if "similarity" in t.title])
  out["semshare-lengths"] = rows["semshare-lengths"] and _render(
      [t for t in semshare_bench.tables(rows["semshare-lengths"]) if "length" in t.title])
  out["semshare-lengths45"] = rows["semshare-lengths45"] and _render(
      [t for t in semshare_bench.tables(rows["semshare-lengths45"]) if "length" in t.title])
  out["semshare-curve"] = rows["semshare-curve"] and _render(
      [t for t in semshare_bench.tables(rows["semshare-curve"]) if "length" not in t.title])
  for name in ("semshare-gate500", "semshare-gate2000", "semshare-gate4000"):   # admitted
    out[name] = rows[name] and _render(
        [t for t in semshare_bench.tables(rows[name]) if "every pair" in t.title
         or "how the reference" in t.title])
  out["semshare-gold"] = rows["semshare-gold"] and _render(   # by length, against gold
      [t for t in semshare_bench.tables(rows["semshare-gold"]) if "every pair" in t.title
       or "length" in t.title])
  out["semshare-admission"] = rows["semshare-admission"] and _render(
      semshare_gate.tables(rows["semshare-admission"]))
  out["memart"] = rows["memart"] and _render(memart_bench.tables(rows["memart"]))
  for name in ("memart-exact", "memart-pooled"):           # the recall@k grid alone
    out[name] = rows[name] and _render(
        [t for t in memart_bench.tables(rows[name]) if "ablation" in t.title])
  out["memart-h100"] = rows["memart-h100"] and _render(      # random weights: timings only
      [t for t in memart_bench.tables(rows["memart-h100"]) if "Efficiency" in t.title])
  for name in ("memart-rerank", "memart-qwen", "memart-recall", "memart-qwen-r16",
               "memart-recall-f1", "memart-planted-dev"):
    out[name] = rows[name] and _render(memart_bench.tables(rows[name]))
  for name in ("memart-nb1", "memart-qwen-nb1", "memart-planted-dev-nb1"):   # answers only
    out[name] = rows[name] and _render(
        [t for t in memart_bench.tables(rows[name]) if "Table 2" in t.title])
  for name in ("memart-planted", "memart-qwen-planted"):            # answers and efficiency
    out[name] = rows[name] and _render(
        [t for t in memart_bench.tables(rows[name]) if "ablation" not in t.title])
  for name in ("kernels-h100", "kernels-h100-plan", "kernels-h100-splits", "kernels-h200",
               "kernels-h200-grid", "kernels-h200-mosaic"):
    out[name] = rows[name] and _render(kernels_bench.tables(rows[name]))
  out["server-load"] = rows["server-load"] and _render(server_load.tables(rows["server-load"]))
  out["server-load-kinds"] = rows["server-load-kinds"] and _render(
      [server_load.batching_table(rows["server-load-kinds"])])
  # the README's: each mechanism of agents / pruning / reuse alone and composed; the
  # MemArt compositions (continued sessions, their chance line) in the docs'
  alone = composed_bench.ALONE_AND_COMPOSED
  readme = [r for r in rows["composed"] or [] if r["method"] in alone]
  memart = [r for r in rows["composed"] or []
            if r["method"] == "agents" or r["method"] not in alone]
  out["composed"] = readme and _render([composed_bench.table(readme)])
  out["composed-memart"] = memart and _render(composed_bench.tables(memart))
  out["compaction"] = rows["compaction"] and _render(compaction_bench.tables(rows["compaction"]))
  out["composed-memory"] = rows["composed-memory"] and _render(
      composed_memory.tables(rows["composed-memory"]))
  out["layouts"] = rows["layouts"] and _render([layouts.table(rows["layouts"])],
                                               titles=False)
  out["throughput-layouts"] = rows["throughput-layouts"] and _render(
      [throughput.table(rows["throughput-layouts"])], titles=False)
  out["throughput-h200"] = rows["throughput-h200"] and _render(
      [throughput.table(rows["throughput-h200"])], titles=False)
  out["throughput-h100"] = rows["throughput-h100"] and _render([
      throughput.table([r for r in rows["throughput-h100"] if r["model"] == m], title=m)
      for m in dict.fromkeys(r["model"] for r in rows["throughput-h100"])])
  for name in ("role-adapters", "role-adapters-qkvo"):
    out[name] = rows[name] and _render([role_adapter_table(rows[name])])
  out["pruner-epochs"] = rows["pruner-epochs"] and _render(
      [pruner_epoch_table(rows["pruner-epochs"])])
  return out


def update(text: str, new: dict[str, str | None], log=print) -> str:
  """A page's text with every known block replaced (unknown or missing ones kept)."""
  def repl(m):
    name = m.group(2)
    if name not in new:
      log(f"warning: block {name!r} has no generator; kept")
      return m.group(0)
    if new[name] is None:
      log(f"warning: {SOURCES[name]} missing; block {name!r} kept")
      return m.group(0)
    return m.group(1) + new[name] + m.group(4)
  return BLOCK.sub(repl, text)


# ----------------------------------------------------------------------------- plots
def _plt():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_throughput(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
  plt = _plt()
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for i, (key, roof, title) in enumerate((("prefill_tok_s", "prefill_roof_tok_s", "prefill"),
                                           ("decode_tok_s", "decode_roof_tok_s", "decode"))):
    for system in dict.fromkeys(r["system"] for r in rows):
      rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r["batch"])
      ax[i].plot([r["batch"] for r in rs], [r[key] for r in rs], "o-", label=system)
    rs = sorted({r["batch"]: r for r in rows}.values(), key=lambda r: r["batch"])
    ax[i].plot([r["batch"] for r in rs], [r[roof] for r in rs], "k--", lw=1, label="roofline")
    ax[i].set(xlabel="batch", ylabel="tokens/s", title=f"{title} (SmolLM2-135M fp32, CPU)")
    ax[i].set_xscale("log", base=2)
    ax[i].minorticks_off()
    ax[i].set_xticks([r["batch"] for r in rs], [str(r["batch"]) for r in rs])
    ax[i].legend(fontsize=8)
  return plot_training.save(fig, plt, "", out)


def plot_pruning(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
  plt = _plt()
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  pruned = [r for r in rows if r["method"] != "full" and r["layout"] == "dead_slot"]
  for m in dict.fromkeys(r["method"] for r in pruned):
    rs = sorted((r for r in pruned if r["method"] == m), key=lambda r: r["budget"])
    b = [r["budget"] for r in rs]
    ax[0].plot(b, [r["future_evidence_recall"] for r in rs], "o-", label=m)
    ax[1].plot(b, [r["delta_nll"] for r in rs], "o-", label=m)
  n = max((r["n_sessions"] for r in rows), default=0)
  ax[0].set(xlabel="budget C (tokens)", ylabel="future-evidence recall",
            title=f"recall vs budget (dead-slot, {n} sessions)")
  ax[1].set(xlabel="budget C (tokens)", ylabel="dNLL vs full cache (nats/token)",
            title="dNLL vs budget (lower is better)")
  ax[1].axhline(0, color="k", lw=0.8)
  for a in ax:
    a.legend(fontsize=8)
  return plot_training.save(fig, plt, "", out)


def plot_lragent(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
  plt = _plt()
  kinds = sorted({r["kind"] for r in rows if r["kind"].startswith("emulated")})
  kind = "emulated-qv" if "emulated-qv" in kinds else kinds[0]
  sub = [r for r in rows if r["kind"] == kind]
  last = lragent_bench.adapters_label(sub[-1])          # the latest adapter set measured
  sub = [r for r in sub if lragent_bench.adapters_label(r) == last]
  fig, ax = plt.subplots(1, 2, figsize=(11, 4))
  for s in [s for s in lragent_bench.lragent.SCHEMES if any(r["scheme"] == s for r in sub)]:
    rs = sorted((r for r in sub if r["scheme"] == s), key=lambda r: r["context_tokens"])
    n = [r["context_tokens"] for r in rs]
    ax[0].plot(n, [r["ttft_s"] for r in rs], "o-", label=s)
    ax[1].plot(n, [r["tokens_per_s"] for r in rs], "o-", label=s)
  ax[0].set(xlabel="trajectory length (tokens)", ylabel="TTFT (s, mean per call)",
            title=f"LRAgent TTFT vs context ({kind})")
  ax[1].set(xlabel="trajectory length (tokens)", ylabel="generated tokens/s",
            title="end-to-end throughput vs context")
  for a in ax:
    a.legend(fontsize=8)
  return plot_training.save(fig, plt, "", out)


def plots(root: pathlib.Path, folder: pathlib.Path, log=print) -> list[pathlib.Path]:
  """Every plot whose source exists; returns the files written."""
  made = []
  jobs = (("throughput", "throughput_vs_batch.png", plot_throughput),
          ("pruning", "pruning_vs_budget.png", plot_pruning),
          ("lragent", "lragent_vs_context.png", plot_lragent))
  jobs += (("reuse", "reuse_drift.png", lambda rows, path: pathlib.Path(
      reuse_bench.drift_plot(rows, str(path)))),
           ("semshare", "semshare.png", lambda rows, path: pathlib.Path(
               semshare_bench.plot(rows, str(path)))),
           ("semshare-lengths", "semshare_lengths.png", lambda rows, path: pathlib.Path(
               semshare_bench.plot(rows, str(path)))),
           ("semshare-curve", "semshare_curve.png", lambda rows, path: pathlib.Path(
               semshare_bench.plot(rows, str(path)))),
           ("memart", "memart_recall.png", lambda rows, path: pathlib.Path(
               memart_bench.plot(rows, str(path)))),
           ("agent-eval-disc-all", "agent_eval_vs_budget.png", lambda rows, path: pathlib.Path(
               agent_tables.plot(rows, str(path)))))
  for name, file, fn in jobs:
    rows = _rows(root, name)
    if rows is None:
      log(f"warning: {SOURCES[name]} missing; no {file}")
    elif name == "reuse" and not any(r["workload"] == "perturbed" for r in rows):
      log(f"warning: {SOURCES[name]} has no perturbed rows; no {file}")
    else:
      made.append(fn(rows, folder / file))
  for run, file in ((root / artifacts.ROLE_ADAPTERS, "training_role_adapters.png"),
                    (root / artifacts.ROLE_ADAPTERS_QKVO, "training_role_adapters_qkvo.png"),
                    (root / artifacts.PRUNER_HEAD, "training_pruner_head.png")):
    if (run / "log.csv").is_file():
      made.append(plot_training.plot(run, folder / file))
    else:
      log(f"warning: {run}/log.csv missing; no {file}")
  return made


def regenerate(root: pathlib.Path = ROOT, log=print) -> dict[pathlib.Path, tuple[str, str]]:
  """{page: (current text, regenerated text)} for every page with blocks, and the
  configuration page."""
  new = blocks(root)
  out = {}
  for page in pages(root):
    text = page.read_text()
    if BLOCK.search(text):
      out[page] = (text, update(text, new, log=log))
  conf = root / CONFIG_PAGE
  out[conf] = (conf.read_text() if conf.is_file() else "", config_reference.page())
  return out


def main(argv):
  del argv
  stale = []
  for page, (text, new) in regenerate(ROOT, log=lambda m: print(m, file=sys.stderr)).items():
    rel = page.relative_to(ROOT)
    if new == text:
      print(f"up to date: {rel}" if FLAGS.check else f"unchanged: {rel}")
    elif FLAGS.check:
      stale.append(rel)
    else:
      page.write_text(new)
      print(f"updated: {rel}")
  if FLAGS.check:
    if stale:
      print(f"out of date: {', '.join(map(str, stale))}: run python scripts/report.py",
            file=sys.stderr)
      sys.exit(1)
    return
  for p in plots(ROOT, pathlib.Path(FLAGS.plots), log=lambda m: print(m, file=sys.stderr)):
    print(f"wrote {p}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
