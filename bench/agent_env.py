"""bench/agent_eval.py's closed loop: tasks, episodes through the engine, the table.

The dead-slot layout and the full cache run through the batch engine
(`jaxkv.evaluation.closed_loop`: --batch episodes at once, each with its own
environment; tool calls under the tool grammar unless --constrain=false; tau2's
scripted user confirms --confirm times); the compact layout, which serving does not
use, through the batch-1 `SessionRunner` loop (`agent_loop.run_episode`, unconstrained).
"""

from __future__ import annotations

import json

from tqdm import tqdm

import agent_stats
import common
import pruning
from jaxkv.config import PruningConfig
from jaxkv.data import traces
from jaxkv.engine import agent_loop
from jaxkv.engine import grammar as G
from jaxkv.evaluation import closed_loop, replay


def select_tasks(env, ids=None, max_tasks: int = 0) -> tuple[list[str], list[str]]:
  """(tasks to run, tasks skipped as trivial): a task that an agent doing nothing
  (no call, answer "Done.") already passes cannot tell methods apart, so it is left
  out. `ids` restricts to those task ids (a held-out traces file), in env order."""
  keep, trivial = [], []
  wanted = None if ids is None else set(ids)
  for t in env.tasks():
    if wanted is not None and t not in wanted:
      continue
    messages, _ = env.reset(t)
    (trivial if env.score(list(messages) + [{"role": "assistant", "content": "Done."}])
     else keep).append(t)
    if max_tasks and len(keep) == max_tasks:
      break
  return keep, trivial


def call_text(tokenizer, call: traces.ToolCall) -> str:
  """A call as the model writes it: a Hermes block, or ReAct lines."""
  if traces.template_renders_tool_calls(tokenizer):
    body = json.dumps({"name": call.name, "arguments": call.arguments})
    return f"<tool_call>\n{body}\n</tool_call>"
  return traces.format_react(traces.Turn("assistant", "", (call,)))


def longest_gold_call(env, tasks, tokenizer) -> int:
  """Tokens of the longest call a solving agent writes in `tasks` (0 when the
  environment does not tell its gold calls): what --max_tokens must fit."""
  gold = getattr(env, "gold_calls", None)
  if gold is None:
    return 0
  return max((len(tokenizer.encode(call_text(tokenizer, c))) for t in tasks for c in gold(t)),
             default=0)


class Loop:
  """The closed loop's engine, its pruned mechanism, one environment per batch row."""

  def __init__(self, engine, rec, make_env, *, batch: int, constrain: bool, runner=None):
    self.engine, self.rec, self.runner = engine, rec, runner
    self.envs = [make_env() for _ in range(batch)]
    self.grammars = (G.Grammars(rec.tok, engine.model_cfg.vocab_size) if constrain else None)

  def evaluate(self, tasks, cfg: PruningConfig, *, head=None, keep_prefixes=(),
               max_turns: int = agent_loop.MAX_TURNS, max_tokens: int = 96,
               max_prompt: int | None = None, desc: str = "") -> dict:
    """Every task once under `cfg`: Compl / Raw / True Acc, efficiency, transcripts."""
    head = head if cfg.method == "intentkv" and cfg.intent_mode == "learnable" else None
    bar = tqdm(total=len(tasks), desc=desc, leave=False)
    if cfg.layout == "compact":
      if self.runner is None:
        raise ValueError("the compact layout runs through a SessionRunner (give runner=)")
      self.runner.set_policy(cfg, head=head, keep_prefixes=keep_prefixes)
      episodes = []
      for t in tasks:
        episodes.append(agent_loop.run_episode(self.runner, self.envs[0], t,
                                               max_turns=max_turns, max_tokens=max_tokens))
        bar.update(1)
      turns = [e.turns for e in episodes]
      eff = pruning.summarize(turns, turns)
      keep = ("pt", "eff_live_kv", "raw_reads", "eff_reads", "prefix_hit_rate", "wall_s",
              "pruned_share", "n_turns")
      eff = {k: eff[k] for k in keep}
    else:         # from the same cache for every policy: the shared prompts, warm
      self.rec.set_policy(PruningConfig(method="none"), keep_prefixes=keep_prefixes)
      replay.warm(self.engine, self.rec, keep_prefixes)
      self.rec.set_policy(cfg, head=head, keep_prefixes=keep_prefixes)
      episodes = closed_loop.run_episodes(
          self.engine, self.rec, self.envs, tasks, max_turns=max_turns, max_tokens=max_tokens,
          max_prompt=max_prompt, grammars=self.grammars, progress=bar.update)
      eff = closed_loop.efficiency(episodes)
    bar.close()
    return dict(**agent_loop.summarize(episodes), **eff,
                constrained=self.grammars is not None and cfg.layout != "compact",
                episodes=[e.to_json() for e in episodes])


def _solved(row: dict) -> dict[str, bool]:
  return {e["task"]: bool(e["correct"]) for e in row.get("episodes", ())}


def annotate(rows: list[dict]) -> None:
  """Paired tests of closed-loop rows over their tasks: for each reference (random,
  SnapKV, H2O at the row's layout and budget; the full cache) the exact McNemar p of
  solved / not solved (`p_vs_*`) and the discordant split (`split_vs_*` = [tasks only
  this row solves, tasks only the reference solves]); None against itself or a
  reference not run."""
  env_rows = [r for r in rows if "true_acc" in r]

  def reference(row, name):
    return next((x for x in env_rows if x["method"] == name and (
        name == "full" or (x["layout"], x["budget"]) == (row["layout"], row["budget"]))), None)
  for r in env_rows:
    agent_stats.pair(r, _solved(r), lambda name, r=r: reference(r, name), _solved)


ENV_HEADER = ("method", "layout", "C", "Compl", "Raw", "True Acc", "95% CI", "n", "turns",
              "pruned %", "PT", "Eff. live", "Eff. reads", "hit %", "wall s", "p vs random",
              "p vs full")


def env_table(rows: list[dict]) -> common.Table:
  ci = lambda x: f"[{x[0]:.2f}, {x[1]:.2f}]"
  f = lambda x: "-" if x != x else f"{x:.3f}"     # nan: no completed episode
  return common.Table(
      "closed loop (Compl = completed / tasks, Raw = correct / completed, True = correct / "
      "tasks; Wilson 95% interval of True; exact McNemar p over tasks, split = tasks only "
      "this row solves - only the reference solves)",
      ENV_HEADER, [(r["method"], r["layout"], str(r["budget"]), f(r["compl"]), f(r["raw_acc"]),
                    f(r["true_acc"]), ci(r["true_acc_ci"]), str(r["n_tasks"]),
                    f"{r['mean_turns']:.1f}", f"{100 * r['pruned_share']:.0f}",
                    f"{r['pt']:.0f}", f"{r['eff_live_kv']:.0f}", f"{r['eff_reads']:.0f}",
                    f"{100 * r['prefix_hit_rate']:.0f}", f"{r['wall_s']:.1f}",
                    agent_stats.p_cell(r, "random"), agent_stats.p_cell(r, "full"))
                   for r in rows])
