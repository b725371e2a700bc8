"""jaxkv.data.envs: the closed-loop environments grade like their benchmarks, offline.

A tau2 task replayed with its gold actions (and its communicate_info in the answer)
scores True; doing nothing scores False; tool errors come back as tool messages.
The same for AgentDojo with a user task's ground truth and its utility check.
`load_env` resolves `module:Class` and names what a non-environment lacks.
"""

import importlib.util

import pytest

from jaxkv.data import envs
from jaxkv.data.traces import ToolCall

needs_tau2 = pytest.mark.skipif(importlib.util.find_spec("tau2") is None,
                                reason="tau2 not installed (scripts/setup.sh installs it)")
needs_dojo = pytest.mark.skipif(importlib.util.find_spec("agentdojo") is None,
                                reason="agentdojo not installed (scripts/setup.sh installs it)")


class CountingEnv:
  """A user-written environment: the task is to call `add` until the total is 3."""

  def __init__(self, target: int = 3):
    self.target = target

  def tasks(self):
    return ["count/0"]

  def reset(self, task):
    self.total = 0
    return ([{"role": "system", "content": "Call add."},
             {"role": "user", "content": f"Reach {self.target}."}],
            [{"name": "add", "description": "adds one", "parameters": {"type": "object"}}])

  def step(self, tool_calls):
    out = []
    for c in tool_calls:
      self.total += c.name == "add"
      out.append({"role": "tool", "name": c.name, "content": str(self.total)})
    return out

  def score(self, messages):
    return self.total == self.target


def test_load_env_resolves_module_class_and_rejects_others():
  env = envs.load_env(f"{__name__}:CountingEnv", target=2)
  assert isinstance(env, envs.Environment) and env.target == 2
  with pytest.raises(ValueError, match="unknown environment"):
    envs.load_env("nope")
  with pytest.raises(ValueError, match="cannot load"):
    envs.load_env("no_such_module_xyz:Env")
  with pytest.raises(ValueError, match="lacks tasks, reset, step, score"):
    envs.load_env("collections:OrderedDict")


@needs_tau2
def test_tau2_gold_actions_pass_and_doing_nothing_fails():
  env = envs.Tau2Env(domains=("airline",))
  tid = "tau2/airline/23"
  assert tid in env.tasks()
  messages, tools = env.reset(tid)
  assert [m["role"] for m in messages] == ["system", "user"]
  assert {"get_user_details", "update_reservation_flights"} <= {t["name"] for t in tools}
  assert not env.score(messages + [{"role": "assistant", "content": "Done."}])
  assert env.last_checks == {"db": False, "communicate": False}

  crit = env._tasks[tid][1].evaluation_criteria
  out = env.step([ToolCall(a.name, dict(a.arguments)) for a in crit.actions])
  assert len(out) == len(crit.actions) and all(m["role"] == "tool" for m in out)
  answer = "The totals are " + ", ".join(crit.communicate_info) + "."
  assert env.score(messages + out + [{"role": "assistant", "content": answer}])
  assert env.last_checks == {"db": True, "communicate": True}
  # the right actions but not the information: tau2's COMMUNICATE check fails
  assert not env.score(messages + out + [{"role": "assistant", "content": "Done."}])

  errors = env.step([ToolCall("no_such_tool", {}), ToolCall("get_user_details", {"_raw": "x"})])
  assert "not found" in errors[0]["content"]
  assert "not a JSON object" in errors[1]["content"]
  env.reset(tid)                        # a fresh database: the gold writes are gone
  assert not env.score(messages + out + [{"role": "assistant", "content": answer}])


@needs_dojo
def test_agentdojo_ground_truth_passes_and_doing_nothing_fails():
  env = envs.AgentDojoEnv(suites=("banking",))
  tid = "agentdojo/banking/user_task_0"
  messages, tools = env.reset(tid)
  assert "bill-december-2023.txt" in messages[1]["content"]
  assert not env.score(messages + [{"role": "assistant", "content": "ok"}])
  suite, task = env._tasks[tid]
  gold = task.ground_truth(env._env.model_copy(deep=True))
  out = env.step([ToolCall(c.function, dict(c.args)) for c in gold])
  assert all(m["role"] == "tool" and m["content"] for m in out)
  assert env.score(messages + out + [{"role": "assistant", "content": "Paid."}])
  bad = env.step([ToolCall("send_money", {"recipient": 1})])    # schema violation
  assert "Error" in bad[0]["content"] or "error" in bad[0]["content"]
