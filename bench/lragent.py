"""LRAgent: five KV-sharing schemes for multi-LoRA agents, side by side (TTFT, throughput).

    python bench/lragent.py --traces=data_local/tau2_heldout.json \\
        --out=bench/results_lragent.json \\
        [--adapters=artifacts/smollm2-135m/role_adapters: the shipped ones, the default] \\
        [--emulate=1024,2048,4096,8192] [--max_sessions=4] [--schemes=...] \\
        [--qkvo_adapters=data_local/runs/lora_qkvo/adapters] [--qkvo_emulate=1024,4096]

Trajectories (`jaxkv.data.agents`): plan -> action -> tool result -> ... ->
reflect over one token stream, from
  * real sessions of any ToolBench-format file (the first --max_sessions), and
  * controlled emulation traces (LRAgent's 1.9k..66k traces, scaled to this
    machine): the first session with its system prompt reduced to the tool
    names and its tool results padded with real tool output text of the other
    sessions until the stream has --emulate tokens (actual lengths reported).
Each scheme runs every trajectory twice on fresh caches; the first pass
compiles, the second is timed (--notiming: once, timing fields null). non_shared
is the fidelity reference.

JSON rows: scheme, trace, context_tokens, kv_bytes, ttft_s (mean per agent
call), tokens_per_s (generated tokens / wall of all calls), delta_nll (gold
agent outputs, vs non_shared), greedy_agreement, computed_tokens,
recomputed_tokens, targets, and LRAgent's accuracy: action_exact / action_n
(tool-call arguments that greedy generation over the scheme's shared cache writes
exactly; `jaxkv.engine.agents.call_accuracy`) and reflect_exact / reflect_n
(verdicts), pooled per scheme with Wilson 95% intervals in the tables, and
adapters (the folder and a digest of its weights, `provenance`: a rerun with other
adapters measures every trajectory again and the tables keep the two sets apart).
--tables_from=FILE reprints the tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

import common
import jaxkv
from jaxkv import artifacts
from jaxkv.data import agents, traces
from jaxkv.data import calls as calls_lib
from jaxkv.data.traces import Session
from jaxkv.engine.agents import (
  AgentRunner,
  CallResult,
  RunResult,
  call_accuracy,
  fidelity,
  profile_window,
)
from jaxkv.engine.mechanisms.agents import SERVED
from jaxkv.evaluation import agents as ev
from jaxkv.kv import plan
from jaxkv.policies.sharing import lragent


def emulate(session: Session, filler: str, target: int, tok) -> Session:
  """The session with a tool-name-only system prompt and tool results padded with
  `filler` text so the rendered trajectory has about `target` tokens."""
  tools = sorted({c.name for t in session.turns for c in t.tool_calls})
  turns = list(session.turns)
  if turns and turns[0].role == "system":
    turns[0] = dataclasses.replace(turns[0], content="You are a customer service agent. Call "
                                   "tools in the ReAct format. Tools: " + ", ".join(tools))
  tool_idx = [i for i, t in enumerate(turns) if t.role == "tool"]
  base = dataclasses.replace(session, turns=tuple(turns), tools=())
  n0 = len(agents.build(base, tok))
  if not tool_idx or target <= n0:
    return base
  chars_per_tok = max(2.0, len(filler[:20000]) / max(1, len(tok.encode(filler[:20000]))))
  per = int((target - n0) * chars_per_tok / len(tool_idx))
  off = 0
  for i in tool_idx:
    pad = filler[off:off + per]
    off = (off + per) % max(1, len(filler) - per)
    turns[i] = dataclasses.replace(turns[i], content=turns[i].content + "\n" + pad)
  return dataclasses.replace(base, id=f"{session.id}@{target}", turns=tuple(turns))


def per_token(r: RunResult, ref: RunResult, tr) -> dict:
  """The row's paired per-token and per-call records against the reference
  (non_shared) on the same trajectory: each scored gold token's log-probability
  difference (reference minus scheme: its share of dNLL) and whether the greedy
  tokens agree, and each call's role and whether greedy generation writes it exactly;
  the tables test schemes on these, paired, with trajectories as the bootstrap unit."""
  lp = np.concatenate([c.logprob for c in r.calls])
  lp_ref = np.concatenate([c.logprob for c in ref.calls])
  am = np.concatenate([c.argmax for c in r.calls])
  am_ref = np.concatenate([c.argmax for c in ref.calls])
  return dict(token_dlp=np.round(lp_ref - lp, 6).tolist(),
              token_agree=(am == am_ref).astype(int).tolist(),
              call_exact=[[int(c.role), int(np.array_equal(c.argmax, tr.ids[c.start:c.end]))]
                          for c in r.calls])


def provenance(path: str) -> dict:
  """Which adapters a row was measured with: the folder as given and a digest of its
  weight and config files (the same digest for the same adapters wherever they lie).
  Rows without this field predate it (see `adapters_label`)."""
  digests = artifacts.file_digests(artifacts.resolve(path))
  h = hashlib.sha256()
  for name, d in sorted(digests.items()):
    if name.endswith(("adapter_model.safetensors", "adapter_config.json")):
      h.update(f"{name}:{d}\n".encode())
  return {"path": str(path), "sha256": h.hexdigest()[:16]}


def adapters_label(r: dict) -> str:
  a = r.get("adapters")
  return f"adapters {a['path']} (sha256 {a['sha256']})" if a else "adapters not recorded"


def _todo(rows, trajs, label, targets, adapters, schemes=("non_shared",)):
  """The trajectories of `trajs` that lack a row of some of `schemes` for this kind and
  these adapters, each with the schemes it lacks: [(trajectory, [scheme])], in the
  order of `trajs` and `schemes` (a later run of other schemes adds their rows to the
  trajectories an earlier one measured)."""
  done = {(r["kind"], r["targets"], r["trace"], (r.get("adapters") or {}).get("sha256"),
           r["scheme"]) for r in rows}
  key = (label, targets)
  sha = (adapters or {}).get("sha256")
  out = []
  for tr in trajs:
    missing = [s for s in schemes if key + (tr.session, sha, s) not in done]
    if missing:
      out.append((tr, missing))
  return out


def run_all(llm, w, trajs, schemes, window, chunk, label, rows, out, timing=True,
            adapters=None):
  """Runs each scheme on each trajectory that has no row of it yet for these
  `adapters` (`provenance`); appends those rows and writes `out` after each trajectory
  (a rerun resumes). non_shared, the fidelity reference, runs on every trajectory run
  (its row is appended only where it lacks one). Without `timing` each scheme runs once
  (fidelity and call accuracy do not depend on the pass) and the timing fields are
  null."""
  targets = ",".join(w.targets)
  todo = _todo(rows, trajs, label, targets, adapters, schemes)
  with_ref = lambda missing: ["non_shared"] * ("non_shared" not in missing) + missing
  bar = tqdm(total=sum(len(with_ref(m)) for _, m in todo), desc=label)
  for tr, missing in todo:
    res = {}
    for s in with_ref(missing):
      bar.set_postfix(trace=tr.session, tokens=len(tr), scheme=s)
      # Pool sizes bucketed so trajectories of similar length share compiled steps.
      r = AgentRunner(llm, w, s, max_tokens=plan.bucket(len(tr) + 16, 1024, 1024),
                      window=window, chunk=chunk)
      res[s] = r.run(tr)                            # compiles
      if timing:
        res[s] = r.run(tr)                          # timed
      bar.update()
    ref = res["non_shared"]
    for s in missing:
      r = res[s]
      rows.append(dict(scheme=s, trace=tr.session, context_tokens=len(tr), kv_bytes=r.kv_bytes,
                       ttft_s=float(np.mean([c.ttft_s for c in r.calls])) if timing else None,
                       tokens_per_s=r.generated / r.wall_s if timing else None,
                       **fidelity(r, ref),
                       **call_accuracy(r, tr),
                       computed_tokens=sum(c.computed for c in r.calls),
                       recomputed_tokens=sum(c.recomputed for c in r.calls),
                       targets=targets, window=list(window), kind=label,
                       adapters=adapters, **per_token(r, ref, tr)))
    common.write_rows(out, rows)
    # Every runner compiles its pool's programs, and each compiled program keeps its
    # code mapped: over ~10 trajectories a process passed Linux's 65,530 mappings and
    # LLVM failed ("Cannot allocate memory"). Dropping them per trajectory keeps the
    # count flat (later ones load from the persistent compilation cache).
    jax.clear_caches()
  bar.close()


def run_engine(llm, w, trajs, schemes, chunk, label, rows, out, max_batch, adapters=None):
  """`run_all` through the batch engine (`jaxkv.evaluation.agents`): per group of
  `max_batch` trajectories not yet in `rows`, each scheme (one the engine serves) runs
  them as sessions of one engine, their calls batched; rows are written after each
  group (a rerun resumes). Timing fields are null (TTFT inside a batch waits behind
  other rows), the fidelity and accuracy fields are the runner's."""
  targets = ",".join(w.targets)
  missing = {tr.session: m
             for tr, m in _todo(rows, trajs, label, targets, adapters, schemes)}
  todo = [tr for tr in trajs if tr.session in missing]   # each runs every scheme
  if not todo:
    return
  max_tokens = plan.bucket(max(len(tr) for tr in trajs) + 16, 1024, 1024)
  bar = tqdm(total=sum(len(tr.calls) for tr in todo) * len(schemes), desc=label, unit="call")
  for g in range(0, len(todo), max_batch):
    group = todo[g:g + max_batch]
    res = {}
    for s in schemes:
      bar.set_postfix(scheme=s, trajectories=f"{g + 1}-{g + len(group)}")
      eng, ag = ev.engine(llm, w, s, max_tokens=max_tokens, max_batch=max_batch,
                          prefill_chunk=chunk, names=agents.ROLES)
      for served in ev.serve_trajectories(eng, ag, group, max_batch=max_batch,
                                          progress=bar.update):
        tr = group[served.index]
        calls = [CallResult(c.role, c.start, c.end, r.extra["computed_tokens"], 0, r.ttft_s, 0.0,
                            np.asarray(r.logprob, np.float32), np.asarray(r.argmax, np.int32))
                 for c, r in zip(tr.calls, served.calls)]
        kvb = lragent.model_kv_bytes(s, len(tr), llm.config, w, np.dtype(llm.dtype).itemsize)
        res[s, tr.session] = RunResult(s, len(tr), calls, kvb, None)
      eng.kv_manager.check()
      del eng, ag
    for tr in group:
      ref = res["non_shared", tr.session]
      for s in missing[tr.session]:
        r = res[s, tr.session]
        rows.append(dict(scheme=s, trace=tr.session, context_tokens=len(tr), kv_bytes=r.kv_bytes,
                         ttft_s=None, tokens_per_s=None, **fidelity(r, ref),
                         **call_accuracy(r, tr), computed_tokens=sum(c.computed for c in r.calls),
                         recomputed_tokens=0, targets=targets, window=None, kind=label,
                         via="engine", adapters=adapters, **per_token(r, ref, tr)))
    common.write_rows(out, rows)
  bar.close()


FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this
  module next to other absl scripts never clashes)."""
  flags.DEFINE_string("traces", None, "ToolBench-format trace file (scripts/make_traces.py)")
  flags.DEFINE_string("adapters", artifacts.ROLE_ADAPTERS,
                      "role adapters, one PEFT folder per role (default: the shipped ones; "
                      "scripts/train_lora.py makes others)")
  flags.DEFINE_string("qkvo_adapters", None, "LoRA-on-QKVO ablation adapters")
  flags.DEFINE_string("out", None, "write JSON rows here")
  flags.DEFINE_string("tables_from", None, "print the tables of an earlier --out JSON and exit")
  flags.DEFINE_string("model", "smollm2-135m", "preset or model path")
  flags.DEFINE_string("schemes", ",".join(lragent.SCHEMES), "sharing schemes to run")
  flags.DEFINE_integer("max_sessions", 4, "real trajectories to replay")
  flags.DEFINE_string("emulate", "1024,2048,4096,8192", "emulated trajectory lengths (tokens)")
  flags.DEFINE_string("qkvo_emulate", "1024,4096",
                      "emulated lengths of the QKVO ablation (a subset, to bound its cost)")
  flags.DEFINE_integer("qkvo_max_sessions", 2, "real trajectories for the QKVO ablation")
  flags.DEFINE_bool("timing", True, "run each scheme twice and time the second pass; "
                    "--notiming runs once (fidelity and call accuracy only, timing fields "
                    "null: half the CPU time)")
  flags.DEFINE_integer("n_critical", 0, "DroidSpeak layers (0: L / 4)")
  flags.DEFINE_integer("chunk", 512, "prefill chunk (tokens)")
  flags.DEFINE_enum("via", "runner", ["runner", "engine"], "runner: one trajectory at a time "
                    "(`AgentRunner`, every scheme, timed); engine: the trajectories as sessions "
                    f"of the batch engine, its schemes only ({', '.join(SERVED)}), quality "
                    "only (needs --notiming)")
  flags.DEFINE_integer("max_batch", 4, "--via=engine: trajectories in flight")
  flags.DEFINE_string("xla_cache", "data_local/xla_cache",
                      "persistent compilation cache: reruns skip the warm-up compiles")


def main(argv):
  del argv
  args = FLAGS
  if args.tables_from:
    with open(args.tables_from) as f:
      print_tables(json.load(f))
    return
  if not args.traces:
    raise app.UsageError("--traces is required")
  if not args.max_sessions and not args.emulate:
    raise app.UsageError("nothing to run: --max_sessions=0 and --emulate is empty")
  schemes = args.schemes.split(",")
  for s in schemes:
    lragent.check_scheme(s)
  if args.via == "engine":
    if args.timing:
      raise app.UsageError("--via=engine evaluates quality only (TTFT inside a batch waits "
                           "behind other rows): pass --notiming")
    if not FLAGS["schemes"].present:
      schemes = list(SERVED)
    elif set(schemes) - set(SERVED):
      raise app.UsageError(f"--via=engine runs the schemes {', '.join(SERVED)}; "
                           f"{sorted(set(schemes) - set(SERVED))} need the runner (--via=runner)")
  if "non_shared" not in schemes:
    schemes.insert(0, "non_shared")              # the fidelity reference
  if args.xla_cache:
    jax.config.update("jax_compilation_cache_dir", args.xla_cache)
  llm = jaxkv.load(args.model, scan_layers=True)   # many call shapes: lax.scan
  tok = llm.tokenizer
  sessions = traces.load_toolbench(args.traces)
  real = agents.build_all(sessions[:args.max_sessions], tok, negative_rate=0.5, seed=0)
  filler = "\n".join(t.content for s in sessions[1:] for t in s.turns if t.role == "tool")
  emu = {n: agents.build(emulate(sessions[0], filler, n, tok), tok)
         for n in {int(n) for n in (args.emulate + "," + args.qkvo_emulate).split(",") if n}}
  sets = {"qv": {"emulated": [emu[int(n)] for n in args.emulate.split(",") if n],
                 "real": real},
          "qkvo": {"emulated": [emu[int(n)] for n in args.qkvo_emulate.split(",") if n],
                   "real": real[:args.qkvo_max_sessions]}}
  rows = []
  if args.out and os.path.exists(args.out):
    with open(args.out) as f:
      rows = json.load(f)
  for name, path in (("qv", args.adapters), ("qkvo", args.qkvo_adapters)):
    if not path:
      continue
    _, w = artifacts.load_role_adapters(llm.config, path, model_name=args.model)
    tag = provenance(path)
    if args.via == "engine":
      for kind, trajs in sets[name].items():
        run_engine(llm, w, trajs, schemes, args.chunk, f"{kind}-{name}", rows, args.out,
                   args.max_batch, adapters=tag)
      continue
    n_crit = args.n_critical or max(1, llm.config.num_layers // 4)
    probe = (real or list(emu.values()))[0]     # --max_sessions=0: an emulated one
    window, dev = profile_window(llm, w, probe.ids[:512], n_crit)
    print(f"{name}: DroidSpeak window {window} (per-layer deviation "
          f"{np.round(dev, 3).tolist()})", flush=True)
    for kind, trajs in sets[name].items():
      run_all(llm, w, trajs, schemes, window, args.chunk, f"{kind}-{name}", rows, args.out,
              timing=args.timing, adapters=tag)
  print_tables(rows)


METRICS = (("ttft_s", "TTFT (s, mean per agent call)", "{:.3f}"),
           ("tokens_per_s", "throughput (generated tokens/s)", "{:.1f}"),
           ("kv_bytes", "KV MB", None))


def tables(rows) -> list[common.Table]:
  """Per kind of trajectory (real / emulated, per adapter set) and the adapters that
  measured it: TTFT, throughput and KV bytes by length (emulated), then fidelity vs
  non_shared."""
  out = []
  for group in sorted({(r["kind"], adapters_label(r)) for r in rows}):
    sub = [r for r in rows if (r["kind"], adapters_label(r)) == group]
    kind = ", ".join(group)
    schemes = [s for s in lragent.SCHEMES if any(r["scheme"] == s for r in sub)]
    if kind.startswith("emulated"):
      lens = sorted({r["context_tokens"] for r in sub})
      for metric, title, fmt in METRICS:
        lines = []
        for s in schemes:
          cells = [s]
          for n in lens:
            r = next(r for r in sub if r["scheme"] == s and r["context_tokens"] == n)
            ref = next(x for x in sub if x["scheme"] == "non_shared" and x["context_tokens"] == n)
            if metric == "kv_bytes":
              cells.append(f"{r[metric] / 2**20:.1f}")
            elif r[metric] is None or ref[metric] is None:     # --notiming rows
              cells.append("-")
            else:
              cells.append(fmt.format(r[metric]) + f" ({r[metric] / ref[metric]:.2f}x)")
          lines.append(cells)
        out.append(common.Table(f"{kind}: {title} by trajectory length (tokens)",
                                ["scheme"] + [str(n) for n in lens], lines))
    lines = []
    counts = {s: sum(r["scheme"] == s for r in sub) for s in schemes}
    uneven = len(set(counts.values())) > 1      # a run not finished, or schemes run apart
    for s in schemes:
      rs = [r for r in sub if r["scheme"] == s]
      lines.append([s, f"{np.mean([r['delta_nll'] for r in rs]):+.4f}",
                    f"{np.mean([r['greedy_agreement'] for r in rs]):.3f}",
                    f"{np.mean([r['computed_tokens'] for r in rs]):.0f}",
                    f"{np.mean([r['recomputed_tokens'] for r in rs]):.0f}"]
                   + [str(counts[s])] * uneven)
    over = ("each scheme's trajectories, n" if uneven else
            f"{len({r['trace'] for r in sub})} trajectories")
    out.append(common.Table(f"{kind}: fidelity vs non_shared (means over {over})",
                            ["scheme", "dNLL", "greedy agree", "computed tok", "recomputed tok"]
                            + ["n"] * uneven, lines))
    if kind.startswith("real") and all("action_n" in r for r in sub):
      out.append(accuracy_table(kind, sub, schemes))
    if kind.startswith("real") and all("token_dlp" in r for r in sub):
      out.append(paired_table(kind, sub, schemes))
  return out


def paired_table(kind: str, sub: list[dict], schemes) -> common.Table:
  """Schemes against each other on the same trajectories, paired: each against
  non_shared (the reference), then base_lr_shared against full_shared (LRAgent's
  claim: sharing the base cache plus a low-rank cache beats sharing one full cache).
  Per gold token the log-probability difference (dNLL, a minus b: positive when a is
  further from the gold tokens) and greedy agreement with non_shared, with a cluster
  bootstrap over trajectories (tokens of one trajectory are not independent); per
  call, exact McNemar on whether greedy generation writes it (split: calls only a
  writes - only b writes)."""
  by = {(r["scheme"], r["trace"]): r for r in sub}
  traces = sorted({r["trace"] for r in sub if r["scheme"] == "non_shared"})
  pairs = [(s, "non_shared") for s in schemes if s != "non_shared"]
  if {"base_lr_shared", "full_shared"} <= set(schemes):
    pairs.append(("base_lr_shared", "full_shared"))
  lines = []
  for a, b in pairs:
    both = [t for t in traces if (a, t) in by and (b, t) in by]
    groups = [t for t in both for _ in by[a, t]["token_dlp"]]
    # token_dlp = log p(non_shared) - log p(scheme): a's minus b's is log p(b) - log p(a)
    dnll = [x - y for t in both for x, y in zip(by[a, t]["token_dlp"], by[b, t]["token_dlp"])]
    dagree = [x - y for t in both
              for x, y in zip(by[a, t]["token_agree"], by[b, t]["token_agree"])]
    cells = [a, b, str(len(both)), str(len(dnll)),
             "{:+.4f} [{:+.4f}, {:+.4f}]".format(*calls_lib.mean_ci(dnll, groups=groups)),
             "{:+.3f} [{:+.3f}, {:+.3f}]".format(*calls_lib.mean_ci(dagree, groups=groups))]
    for role in (1, 2):                              # action, reflect
      mine = [(x[1], y[1]) for t in both
              for x, y in zip(by[a, t]["call_exact"], by[b, t]["call_exact"]) if x[0] == role]
      only_a = sum(x and not y for x, y in mine)
      only_b = sum(y and not x for x, y in mine)
      cells += [f"{sum(x for x, _ in mine)} / {sum(y for _, y in mine)} of {len(mine)}",
                f"{calls_lib.mcnemar(only_a, only_b):.3f} ({only_a}-{only_b})"]
    lines.append(cells)
  return common.Table(
      f"{kind}: schemes against each other on the trajectories both ran (of "
      f"{len(traces)} with non_shared; paired, a minus b; dNLL = mean over gold tokens "
      "of log p(b) - log p(a), positive when a fits the gold tokens worse; agreement = "
      "share of gold positions whose greedy token equals non_shared's; 95% bootstrap "
      "over trajectories; exact calls: a / b, exact McNemar p (split: only a - only b); "
      "reflect verdicts are right or wrong, chance 0.5)",
      ["a", "b", "trajectories", "tokens", "dNLL [95% CI]", "d agreement [95% CI]",
       "action exact", "p (split)", "reflect exact", "p (split)"], lines)


def accuracy_table(kind: str, sub: list[dict], schemes) -> common.Table:
  """Per scheme: calls whose gold tokens greedy generation reproduces exactly
  (`call_accuracy`), pooled over trajectories, with Wilson 95% intervals."""
  lines = []
  for s in schemes:
    rs = [r for r in sub if r["scheme"] == s]
    cells = [s]
    for role in ("action", "reflect"):
      k, n = sum(r[f"{role}_exact"] for r in rs), sum(r[f"{role}_n"] for r in rs)
      lo, hi = calls_lib.wilson(k, n)
      cells += [f"{k / n:.3f}" if n else "-", f"[{lo:.2f}, {hi:.2f}]" if n else "-", str(n)]
    lines.append(cells + [str(len({r["trace"] for r in rs}))])
  return common.Table(f"{kind}: call accuracy (greedy reproduces the gold call exactly; "
                      f"{len({r['trace'] for r in sub})} trajectories, each scheme's own "
                      "in the last column; Wilson 95%)",
                      ["scheme", "action exact", "95% CI", "n", "reflect exact", "95% CI", "n",
                       "trajectories"], lines)


def print_tables(rows):
  common.print_tables(tables(rows))


if __name__ == "__main__":
  define_flags()
  app.run(main)
