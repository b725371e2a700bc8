"""Which sessions an agent benchmark scores, and at which budgets.

Three rules keep bench/agent_eval.py's next-call tables honest:

- **A trace spec may name a slice**: `data_local/tau2_train.json[30:]` is the file's
  sessions from the 31st on, in file order, before any length filter. So a split is
  stated on the command line and in the results, not implied by `--max_sessions`.
- **A Phase-2 head is never scored on the sessions it trained on.** Its manifest
  names the training file (with its sha256) and how many of its first sessions were
  read (`max_train_sessions`, 0 = all); when that file is among the specs and the head
  is scored, the overlap is refused with the slice that avoids it.
- **Budgets are picked on a dev split by a tokenizer-only rule**: for each target
  share s, the C at which a share s of the dev split's tool calls have a prompt (or,
  with `--scope=history`, a history: among the calls that have one) longer than C, so
  prune, rounded down to a page.
  No model runs and no outcome is seen, so the budgets are frozen before any method
  is scored. `--check=C,...` says how many calls of a split prune at given budgets and
  how many of those leave the scorers room to choose (C above the forced system
  prompt + query: below it every scorer keeps the same tokens).

Run as a script it prints the budgets of a dev split:

  python bench/agent_splits.py --traces=data_local/tau2_train.json[:30] \
      --model=qwen2.5-coder-0.5b --scope=history --shares=0.9,0.7,0.5
"""

from __future__ import annotations

import math
import os
import re

from absl import app, flags

from jaxkv import artifacts
from jaxkv.data import labels, traces

SPEC = re.compile(r"^(?P<path>.+?)\[(?P<a>-?\d*):(?P<b>-?\d*)\]$")
PAGE = 16


def parse_spec(spec: str) -> tuple[str, slice]:
  """(path, slice) of `path` or `path[a:b]` (Python slice bounds, either optional)."""
  m = SPEC.match(spec.strip())
  if m is None:
    return spec.strip(), slice(None)
  to_int = lambda s: int(s) if s else None
  return m["path"], slice(to_int(m["a"]), to_int(m["b"]))


def load_spec(spec: str) -> list[traces.Session]:
  """The sessions a spec names (file order); a clear error for a missing file."""
  path, part = parse_spec(spec)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist; make it with scripts/make_traces.py "
                            "--source=tau2 --domains=airline,retail --out=data_local/"
                            "tau2_train.json --held_out=data_local/tau2_heldout.json (or "
                            "--source=agentdojo)")
  return traces.load_toolbench(path)[part]


def _trained_prefix(head: str, path: str) -> int | None:
  """How many of trace file `path`'s first sessions the head under `head` trained on
  (0: all of them); None when its manifest names another file or none."""
  try:
    manifest = artifacts.read_manifest(head)
  except FileNotFoundError:
    return None
  digest = manifest.get("data", {}).get("train", {}).get("sha256")
  if not digest or not os.path.exists(path) or artifacts.sha256(path) != digest:
    return None
  return int(manifest.get("config", {}).get("max_train_sessions", 0) or 0)


def head_trained_ids(head: str, path: str) -> set[str]:
  """Ids of the sessions of trace file `path` that the head under `head` trained on
  (empty when its manifest names another file or none)."""
  cap = _trained_prefix(head, path)
  if cap is None:
    return set()
  sessions = traces.load_toolbench(path, strict=False)
  return {s.id for s in (sessions[:cap] if cap else sessions)}


def check_unseen(head: str, specs: list[str]) -> None:
  """Raises ValueError when a spec holds sessions the head trained on."""
  for spec in specs:
    path, part = parse_spec(spec)
    cap = _trained_prefix(head, path)
    if cap is None:
      continue
    ids = [s.id for s in traces.load_toolbench(path, strict=False)]
    first_unseen = cap or len(ids)
    trained = set(ids[:first_unseen])
    overlap = [i for i in ids[part] if i in trained]
    if overlap:
      raise ValueError(
          f"{len(overlap)} sessions of {spec} trained the Phase-2 head {head} (its "
          f"manifest: the first {first_unseen} of {path}); score the head on sessions it "
          f"never saw, e.g. {path}[{first_unseen}:], or drop the learnable methods")


def call_turns(session: traces.Session) -> list[int]:
  """Message indices of the assistant turns that make a tool call (after the first message)."""
  return [i for i, t in enumerate(session.turns) if i > 0 and t.role == "assistant"
          and t.tool_calls]


def call_spans(sessions, tokenizer, max_prompt: int) -> list[tuple[int, int, int]]:
  """(prompt tokens n, protected system prompt sys_len, query start qs) before every
  tool-call turn of the sessions whose whole chat fits `max_prompt` (the sessions
  bench/agent_eval.py replays); the history a pruning can take is [sys_len, qs)."""
  out = []
  for s in sessions:
    msgs, tools = traces.session_chat(s, tokenizer)
    if len(tokenizer.encode_chat(msgs, tools=tools, add_generation_prompt=False)) > max_prompt:
      continue
    for i in call_turns(s):
      p = labels.prepare_turn(tokenizer, msgs, tools, i, reply=False)
      out.append((len(p["ids"]), p["sys_len"], p["qs"]))
  return out


def fill_history(rows: list[dict], sessions, tokenizer) -> int:
  """Fills `history` (the prunable history, qs - sys_len, as `call_spans`) into the call
  records of rows written before it, from `sessions` (calls of other sessions are left
  alone); returns the records filled. A call whose history is at most C (history
  scope) prunes nothing, nor did any earlier turn of its session."""
  by_id, chats, known, done = {s.id: s for s in sessions}, {}, {}, 0
  for r in rows:
    for c in r.get("calls") or ():
      key = c["session"], c["turn"]      # every row holds the same calls: one prompt each
      if "history" in c or c["session"] not in by_id:
        continue
      if key not in known:
        if c["session"] not in chats:
          chats[c["session"]] = traces.session_chat(by_id[c["session"]], tokenizer)
        p = labels.prepare_turn(tokenizer, *chats[c["session"]], c["turn"], reply=False)
        known[key] = int(p["qs"] - p["sys_len"])
      c["history"] = known[key]
      done += 1
  return done


def lengths(spans, scope: str) -> list[int]:
  """What a budget of `scope` is compared with: the prompt, or its history alone."""
  return [n if scope == "prompt" else qs - sys_len for n, sys_len, qs in spans]


def room(spans, budget: int, scope: str) -> tuple[float, float]:
  """(share of calls that prune at this budget, share that prune with room to choose:
  C above the forced system prompt + query, so scorers can differ)."""
  pruned = with_room = 0
  for n, sys_len, qs in spans:
    if scope == "history":
      hit = qs - sys_len > budget
      pruned, with_room = pruned + hit, with_room + hit
    else:
      hit = n > budget
      pruned += hit
      with_room += hit and budget > sys_len + n - qs
  return pruned / max(len(spans), 1), with_room / max(len(spans), 1)


def pick_budgets(lengths: list[int], shares: list[float], page: int = PAGE) -> list[int]:
  """For each share s (0 < s < 1), the largest page multiple C such that at least a
  share s of `lengths` exceed C, i.e. that many calls would prune at budget C."""
  if not lengths:
    raise ValueError("no tool call to pick budgets from (is the dev split empty?)")
  xs = sorted(lengths)
  out = []
  for s in shares:
    if not 0 < s < 1:
      raise ValueError(f"a share of pruned calls must lie in (0, 1), got {s}")
    need = math.ceil(s * len(xs))            # calls that must exceed C
    c = xs[len(xs) - need] - 1               # the need-th longest prompt, minus one
    out.append(max(page, c // page * page))
  return out


FLAGS = flags.FLAGS


def main(argv):
  del argv
  from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
  from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel

  tok = Tokenizer.load(presets.resolve(FLAGS.model))
  try:
    sessions = [s for spec in FLAGS.traces for s in load_spec(spec)]
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from e
  spans = call_spans(sessions, tok, FLAGS.max_prompt - FLAGS.max_tokens)
  print(f"{len(spans)} tool calls in {len(sessions)} sessions of {','.join(FLAGS.traces)} "
        f"(prompt + {FLAGS.max_tokens} <= {FLAGS.max_prompt} tokens, {FLAGS.model} tokenizer); "
        f"budgets count the {FLAGS.scope}")
  if FLAGS.check:
    for c in (int(b) for b in FLAGS.check):
      p, r = room(spans, c, FLAGS.scope)
      print(f"C = {c}: {100 * p:.0f}% of the calls prune, {100 * r:.0f}% with room to choose "
            "(C above the system prompt + query)")
    return
  shares = [float(s) for s in FLAGS.shares]
  # with scope=history, over the calls that have history: no budget prunes the others
  xs = [x for x in lengths(spans, FLAGS.scope) if FLAGS.scope == "prompt" or x > 0]
  budgets = pick_budgets(xs, shares)
  for s, c in zip(shares, budgets):
    p, r = room(spans, c, FLAGS.scope)
    print(f"share {s:.2f}: C = {c} ({100 * p:.0f}% of the dev calls prune, {100 * r:.0f}% "
          "with room to choose)")
  print("--budgets=" + ",".join(str(c) for c in budgets))

if __name__ == "__main__":
  flags.DEFINE_list("traces", None, "dev split trace specs (path or path[a:b])")
  flags.DEFINE_string("model", "smollm2-135m", "preset or model path (its tokenizer only)")
  flags.DEFINE_list("shares", ["0.9", "0.7", "0.5"], "target shares of calls that prune")
  flags.DEFINE_integer("max_prompt", 7000, "as bench/agent_eval.py --max_prompt")
  flags.DEFINE_integer("max_tokens", 64, "as bench/agent_eval.py --max_tokens")
  flags.DEFINE_enum("scope", "prompt", ["prompt", "history"], "as bench/agent_eval.py "
                    "--budget_scope")
  flags.DEFINE_list("check", None, "instead of picking: how many calls of --traces prune "
                    "at these budgets, and how many with room to choose")
  flags.mark_flag_as_required("traces")
  app.run(main)
