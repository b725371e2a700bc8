"""Tool environments for closed-loop agent evaluation (IntentKV's Compl / Raw / True Acc).

An `Environment` is what `jaxkv.engine.agent_loop.run_episode` drives:

    tasks()              -> task ids, in a fixed order
    reset(task)          -> (messages, tools): the opening chat (system + user) and the
                            tool schemas (OpenAI `function` objects)
    step(tool_calls)     -> tool messages, one `{"role": "tool", "name", "content"}` per
                            call, in order (an unknown tool or bad arguments is an error
                            message the agent reads, never an exception)
    score(messages)      -> bool: did the episode solve the task? `messages` is the whole
                            transcript (assistant texts included, which some checks read)
    user_reply(text)     -> optional: the user's next message after an agent turn without
                            a call, or None (the turn is the final answer)
    gold_calls(task)     -> optional: the calls a solving agent makes (sizes max_tokens)

`score` takes the transcript rather than nothing (the issue's sketch) because both
benchmarks grade what the agent *said* as well as what it did: tau2's COMMUNICATE
check and AgentDojo's utility functions read the assistant's answer.

Two are built in, both graded offline by the benchmarks' own code:

- `Tau2Env` (airline, retail): a fresh domain environment per task; tool calls run
  against its database; `score` is tau2's reward over the offline components of the
  task's reward basis: DB (the final database hash equals the one after replaying the
  gold actions), ENV_ASSERTION and COMMUNICATE (every `communicate_info` string in an
  assistant text, tau2's own matching). NL_ASSERTION needs an LLM judge and is left
  out (stated in `score`'s result via `Tau2Env.last_checks`). There is no LLM user
  simulator: the user's opening message is the task's instructions (as in
  `scripts/make_traces.py`); with `confirmations` > 0 a scripted user answers that
  many of the agent's questions with a yes (`user_reply`: tau2's policies make the
  agent ask for explicit confirmation before a write), otherwise a question ends the
  episode, so a task that needs a later user turn is harder than in tau2 proper.
- `AgentDojoEnv` (workspace, travel, banking, slack; injection-free): the suite's
  default environment, the task's `init_environment`, calls through its
  `FunctionsRuntime`; `score` is the task's own `utility_from_traces` or `utility`
  over the last assistant text and the pre/post environments.

Any other environment plugs in by name: `load_env("my.module:MyEnv", **kwargs)`.
The system prompts are the ones `scripts/make_traces.py` writes into the traces, so
next-call (replayed) and closed-loop (free) accuracy see the same prompt.
"""

from __future__ import annotations

import copy
import importlib
import importlib.resources
import re
import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from jaxkv.data.traces import ToolCall

TAU2_DOMAINS = ("airline", "retail", "telecom")
CONFIRM = "Yes, I confirm. Please go ahead."   # the scripted tau2 user's answer
AGENTDOJO_SUITES = ("workspace", "travel", "banking", "slack")
AGENTDOJO_VERSION = "v1.2.1"


@runtime_checkable
class Environment(Protocol):
  """What the agent loop needs from a tool environment (see the module docstring)."""

  def tasks(self) -> list[str]: ...

  def reset(self, task: str) -> tuple[list[dict], list[dict]]: ...

  def step(self, tool_calls: Sequence[ToolCall]) -> list[dict]: ...

  def score(self, messages: Sequence[dict]) -> bool: ...


def load_env(spec: str, **kwargs) -> Environment:
  """`tau2`, `agentdojo`, or `module:Class` (constructed with `kwargs`)."""
  if spec == "tau2":
    return Tau2Env(**kwargs)
  if spec == "agentdojo":
    return AgentDojoEnv(**kwargs)
  if ":" not in spec:
    raise ValueError(f"unknown environment {spec!r}: use tau2, agentdojo or module:Class")
  module, _, name = spec.partition(":")
  try:
    cls = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"cannot load environment {spec!r}: {e}") from e
  env = cls(**kwargs)
  missing = [m for m in ("tasks", "reset", "step", "score") if not callable(getattr(env, m, None))]
  if missing:
    raise ValueError(f"{spec} is not an Environment: it lacks {', '.join(missing)}")
  return env


def tool_messages(tool_calls: Sequence[ToolCall], execute, error: str = "Error") -> list[dict]:
  """One tool message per call: `execute(name, arguments) -> text`, or an error text
  when the model wrote arguments that are not a JSON object."""
  out = []
  for call in tool_calls:
    if set(call.arguments) == {"_raw"}:
      content = f"{error}: the arguments of {call.name} are not a JSON object"
    else:
      content = execute(call.name, dict(call.arguments))
    out.append({"role": "tool", "name": call.name, "content": content})
  return out


# --- tau2 ----------------------------------------------------------------------------


def tau2_system(domain: str, policy: str | None = None) -> str:
  """The agent's system prompt (the traces' and the closed loop's)."""
  system = (f"You are a customer service agent for the {domain} domain. Help the user by calling "
            f"the tools listed below, one per step, in the ReAct format (Thought / Action / "
            f"Action Input), then give a final answer.")
  if policy:
    system += "\n\n<policy>\n" + policy.strip() + "\n</policy>"
  return system


def tau2_user_text(task) -> str:
  """The user's opening message: the scenario's instructions."""
  instructions = task.user_scenario.instructions
  if isinstance(instructions, str):
    return instructions
  parts = [instructions.reason_for_call, instructions.known_info, instructions.unknown_info,
           instructions.task_instructions]
  return "\n\n".join(p.strip() for p in parts if p and p.strip())


def tau2_module(domain: str):
  """tau2's environment module for a domain, with its per-call DEBUG logging silenced."""
  if domain not in TAU2_DOMAINS:
    raise ValueError(f"unknown tau2 domain {domain!r}; expected one of {TAU2_DOMAINS}")
  from loguru import logger  # pylint: disable=import-outside-toplevel
  logger.remove()
  logger.add(sys.stderr, level="ERROR")
  return importlib.import_module(f"tau2.domains.{domain}.environment")


def tau2_tasks(module) -> list:
  try:
    return module.get_tasks(None)
  except TypeError:  # a domain whose get_tasks takes no split
    return module.get_tasks()


def tau2_fresh_env(module, task):
  """A domain environment in the task's initial state."""
  env = module.get_environment()
  init = task.initial_state
  env.set_state(init.initialization_data if init else None,
                init.initialization_actions if init else None,
                (init.message_history or []) if init else [])
  return env


class Tau2Env:
  """tau2-bench domains, graded offline (see the module docstring)."""

  def __init__(self, domains: Sequence[str] = ("airline", "retail"), include_policy: bool = False,
               confirmations: int = 0):
    self.include_policy = include_policy
    # a scripted user: answers up to this many questions of the agent with a yes (tau2's
    # policies make the agent ask for explicit confirmation before a write)
    self.confirmations = confirmations
    self._confirmed = 0
    self._tasks: dict[str, tuple[Any, Any, str]] = {}
    for domain in domains:
      module = tau2_module(domain)
      for task in tau2_tasks(module):
        self._tasks[f"tau2/{domain}/{task.id}"] = (module, task, domain)
    self._env = self._task = None
    self._id = 0
    self.last_checks: dict[str, bool] = {}

  def tasks(self) -> list[str]:
    return list(self._tasks)

  def reset(self, task: str) -> tuple[list[dict], list[dict]]:
    if task not in self._tasks:
      raise KeyError(f"no tau2 task {task!r}")
    module, self._task, domain = self._tasks[task]
    self._module, self._id, self._confirmed = module, 0, 0
    self._env = tau2_fresh_env(module, self._task)
    tools = [t.openai_schema["function"] for t in self._env.get_tools()]
    policy = self._env.get_policy() if self.include_policy else None
    return ([{"role": "system", "content": tau2_system(domain, policy)},
             {"role": "user", "content": tau2_user_text(self._task)}], tools)

  def step(self, tool_calls: Sequence[ToolCall]) -> list[dict]:
    from tau2.data_model.message import ToolCall as TauCall  # pylint: disable=import-outside-toplevel

    def execute(name, args):
      self._id += 1
      return self._env.get_response(TauCall(id=f"call_{self._id}", name=name, arguments=args,
                                            requestor="assistant")).content
    return tool_messages(tool_calls, execute)

  def gold_calls(self, task: str) -> list[ToolCall]:
    """The agent's calls in the task's gold actions (what a solving episode writes)."""
    crit = self._tasks[task][1].evaluation_criteria
    if crit is None:
      return []
    return [ToolCall(a.name, dict(a.arguments)) for a in crit.actions or []
            if a.requestor == "assistant"]

  def user_reply(self, text: str) -> str | None:
    """The scripted user's answer to an agent turn without a call: a confirmation when
    the turn asks a question and confirmations are left, else None (the episode ends)."""
    if "?" not in text or self._confirmed >= self.confirmations:
      return None
    self._confirmed += 1
    return CONFIRM

  def score(self, messages: Sequence[dict]) -> bool:
    from tau2.data_model.tasks import RewardType  # pylint: disable=import-outside-toplevel
    crit = self._task.evaluation_criteria
    if crit is None:
      self.last_checks = {}
      return True
    basis = set(crit.reward_basis or ())
    checks = {}
    if RewardType.DB in basis:
      gold = tau2_fresh_env(self._module, self._task)
      for action in crit.actions or []:
        try:
          gold.make_tool_call(tool_name=action.name, requestor=action.requestor,
                              **action.arguments)
        except Exception:  # pylint: disable=broad-except  (tau2 itself only warns)
          pass
      checks["db"] = (gold.get_db_hash() == self._env.get_db_hash()
                      and gold.get_user_db_hash() == self._env.get_user_db_hash())
    if RewardType.ENV_ASSERTION in basis:
      checks["env_assertions"] = all(
          self._env.run_env_assertion(a, raise_assertion_error=False)
          for a in crit.env_assertions or [])
    if RewardType.COMMUNICATE in basis:
      texts = [str(m.get("content") or "").lower().replace(",", "") for m in messages
               if m.get("role") == "assistant"]
      checks["communicate"] = all(any(str(i).lower() in t for t in texts)
                                  for i in crit.communicate_info or [])
    self.last_checks = checks
    return all(checks.values())


# --- AgentDojo ---------------------------------------------------------------------


def agentdojo_system() -> str:
  """AgentDojo's default system message (the traces' and the closed loop's)."""
  import yaml  # pylint: disable=import-outside-toplevel
  path = importlib.resources.files("agentdojo") / "data" / "system_messages.yaml"
  text = yaml.safe_load(path.read_text())["default"].strip()
  return text.replace(" \\\n", " ")  # a YAML line continuation kept literally in the file


def agentdojo_tools(suite) -> list[dict]:
  return [{"name": f.name, "description": f.description,
           "parameters": f.parameters.model_json_schema()} for f in suite.tools]


def task_number(name: str) -> int:
  m = re.search(r"(\d+)$", name)
  return int(m.group(1)) if m else 0


class AgentDojoEnv:
  """AgentDojo user tasks without injections, graded by their own utility checks."""

  def __init__(self, suites: Sequence[str] = AGENTDOJO_SUITES, version: str = AGENTDOJO_VERSION):
    from agentdojo.task_suite.load_suites import get_suites  # pylint: disable=import-outside-toplevel
    available = get_suites(version)
    self._tasks: dict[str, tuple[Any, Any]] = {}
    for name in suites:
      if name not in available:
        raise ValueError(f"unknown agentdojo suite {name!r}; expected one of {sorted(available)}")
      suite = available[name]
      for task_id, task in sorted(suite.user_tasks.items(), key=lambda kv: task_number(kv[0])):
        self._tasks[f"agentdojo/{name}/{task_id}"] = (suite, task)
    self._system = agentdojo_system()

  def tasks(self) -> list[str]:
    return list(self._tasks)

  def reset(self, task: str) -> tuple[list[dict], list[dict]]:
    from agentdojo.functions_runtime import FunctionsRuntime  # pylint: disable=import-outside-toplevel
    if task not in self._tasks:
      raise KeyError(f"no agentdojo task {task!r}")
    suite, self._task = self._tasks[task]
    self._runtime = FunctionsRuntime(suite.tools)
    self._env = self._task.init_environment(suite.load_and_inject_default_environment({}))
    self._pre = self._env.model_copy(deep=True)
    self._trace = []
    return ([{"role": "system", "content": self._system},
             {"role": "user", "content": self._task.PROMPT}], agentdojo_tools(suite))

  def gold_calls(self, task: str) -> list[ToolCall]:
    """The calls of the task's ground truth on its initial environment."""
    suite, t = self._tasks[task]
    pre = t.init_environment(suite.load_and_inject_default_environment({}))
    return [ToolCall(c.function, dict(c.args)) for c in t.ground_truth(pre)]

  def step(self, tool_calls: Sequence[ToolCall]) -> list[dict]:
    from agentdojo.agent_pipeline.tool_execution import tool_result_to_str  # pylint: disable=import-outside-toplevel
    from agentdojo.functions_runtime import FunctionCall  # pylint: disable=import-outside-toplevel
    def execute(name, args):
      self._trace.append(FunctionCall(function=name, args=copy.deepcopy(args)))
      try:
        result, error = self._runtime.run_function(self._env, name, args)
      except Exception as e:  # pylint: disable=broad-except  (validation errors and the like)
        result, error = None, f"{type(e).__name__}: {e}"
      return tool_result_to_str(result) if error is None else error
    return tool_messages(tool_calls, execute, error="ValueError")

  def score(self, messages: Sequence[dict]) -> bool:
    answer = next((str(m.get("content") or "") for m in reversed(messages)
                   if m.get("role") == "assistant"), "")
    by_traces = self._task.utility_from_traces(answer, self._pre, self._env, self._trace)
    if by_traces is not None:
      return bool(by_traces)
    return bool(self._task.utility(answer, self._pre, self._env))
