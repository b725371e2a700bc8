"""scripts/report.py: the results blocks of README.md and docs/ are what the result
files say, docs/configuration.md is what the config classes say, and blocks / plots
regenerate from any set of result files."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
  spec = importlib.util.spec_from_file_location("report", ROOT / "scripts" / "report.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_docs_blocks_match_result_files(report):
  """Every block of every page equals its regeneration: a result file changed without
  `python scripts/report.py` (or a hand edit inside a block) fails here. Every source
  the blocks name exists, and every block appears on exactly one page."""
  names = []
  for page in report.pages(ROOT):
    names += [m.group(2) for m in report.BLOCK.finditer(page.read_text())]
  assert {"throughput", "table4", "lragent", "agent-eval-qwen", "agent-eval-smollm2",
          "closed-loop-tau2", "closed-loop-agentdojo", "reuse", "memart",
          "server-load"} <= set(names)
  assert len(names) == len(set(names)), "a results block appears on two pages"
  new = report.blocks(ROOT)
  for name in names:
    assert new[name] is not None, f"{report.SOURCES[name]} missing"
  stale = [str(p.relative_to(ROOT)) for p, (old, text) in report.regenerate(ROOT).items()
           if old != text]
  assert not stale, f"out of date (run python scripts/report.py): {stale}"


def test_configuration_page_lists_every_field(report):
  """docs/configuration.md names every --config field of every command, with its default."""
  from jaxkv import cli
  text = (ROOT / report.CONFIG_PAGE).read_text()
  for _, cls, _, _ in report.config_reference.COMMANDS:
    for f in cli.fields(cls):
      assert f"| `--{f.path}` |" in text, f.path


def test_update_replaces_known_blocks_and_keeps_the_rest(report):
  text = ("intro\n<!-- report:throughput -->\nold table\n<!-- /report:throughput -->\n"
          "middle\n<!-- report:unknown -->\nkept\n<!-- /report:unknown -->\n"
          "<!-- report:lragent -->\nstale\n<!-- /report:lragent -->\nend\n")
  logs = []
  out = report.update(text, {"throughput": "| new |\n", "lragent": None}, log=logs.append)
  assert "intro\n<!-- report:throughput -->\n| new |\n<!-- /report:throughput -->\nmiddle" in out
  assert "<!-- report:unknown -->\nkept\n" in out            # no generator: untouched
  assert "<!-- report:lragent -->\nstale\n" in out           # source missing: untouched
  assert len(logs) == 2 and "unknown" in logs[0] and "missing" in logs[1]
  assert report.update(out, {"throughput": "| new |\n"}, log=logs.append).count("| new |") == 1


def _tiny_results(root: pathlib.Path):
  (root / "bench").mkdir()
  tp = [dict(system=s, batch=b, prefill_tok_s=100.0 * b * k, decode_tok_s=10.0 * b * k,
             prefill_ratio=k, decode_ratio=k, prefill_roof_tok_s=900, decode_roof_tok_s=50 * b,
             greedy_agree16=None if s == "hf" else 1.0, warmup_s=None if s == "hf" else 3.0)
        for b in (1, 2, 8) for s, k in (("jaxkv unrolled", 2.0), ("hf", 1.0))]
  (root / "bench/results_cpu.json").write_text(json.dumps(tp))
  pr = [dict(method=m, layout=l, budget=b, pt=100.0, eff_live_kv=90.0, raw_reads=10.0,
             eff_reads=9.0, prefix_hit_rate=0.5, wall_s=1.0, delta_nll=0.1 * (m != "full"),
             future_evidence_recall=0.5 + b / 1e4, candidate_evidence_recall=0.1,
             evidence_tokens=10, candidate_evidence_tokens=5, pruned_share=0.5, n_sessions=2,
             n_turns=4)
        for m, l, b in (("full", "-", 0), ("snapkv", "dead_slot", 512),
                        ("snapkv", "dead_slot", 1024), ("snapkv", "compact", 512))]
  (root / "bench/results_pruning_tau2.json").write_text(json.dumps(pr))


def test_blocks_and_plots_from_other_result_files(report, tmp_path):
  _tiny_results(tmp_path)
  new = report.blocks(tmp_path)
  assert new["lragent"] is None and new["role-adapters"] is None
  assert "| 2 | jaxkv unrolled | 400 | 2.00x |" in new["throughput"]
  assert "Table 2 shape, C=512" in new["pruning"] and "Table 7 shape, C=512" in new["pruning"]
  assert "Table 7 shape, C=1024" not in new["pruning"]   # one layout at 1024
  logs = []
  made = report.plots(tmp_path, tmp_path / "plots", log=logs.append)
  assert sorted(p.name for p in made) == ["pruning_vs_budget.png", "throughput_vs_batch.png"]
  for p in made:
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
  assert any("results_lragent.json missing" in m for m in logs)


def test_training_tables(report):
  m = [{"step": 0, "nll": {w: dict.fromkeys(("plan", "action", "reflect"), 2.0)
                          for w in ("base", "plan", "action", "reflect")}},
       {"step": 8, "nll": {"base": {"plan": 3.0, "action": 1.0, "reflect": 0.7},
                           "plan": {"plan": 1.3, "action": 1.4, "reflect": 1.8},
                           "action": {"plan": 3.9, "action": 0.9, "reflect": 1.0},
                           "reflect": {"plan": 3.4, "action": 1.3, "reflect": 0.1}}}]
  t = report.role_adapter_table(m)
  assert "step 8" in t.title
  assert t.lines[1] == ["plan adapter", "**1.300**", "1.400", "1.800"]
  assert t.lines[3][3] == "**0.100**" and t.lines[0][1] == "3.000"
  e = [dict(epoch=k, recall_budget=256, half_budget=128, val_rows=62, recall_phase1=0.2,
            recall_phase2=0.2 + 0.1 * k, half_recall_phase1=0.1, half_recall_phase2=0.1,
            val_loss=1.0, alpha=1.0) for k in (0, 1, 2)]
  t = report.pruner_epoch_table(e)
  assert t.header == ["", "epoch 0", "epoch 1", "epoch 2"]
  assert t.lines[1] == ["Phase-2 (rule + alpha MLP), recall@256", "0.200", "0.300", "0.400"]
