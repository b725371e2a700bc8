r"""Every KV mechanism of one jaxkv server, driven by the `openai` client.

    python scripts/server.py --config=configs/smollm2_agents.py --port=8000 &
    python examples/agent_sessions.py --base_url=http://127.0.0.1:8000/v1

One agent workflow: a planner on the "plan" role adapter, then an LRAgent
session where the plan and action roles extend one trajectory (the action role
reads the KV the plan role computed), an executor session whose growing history
(tool schemas, tool results) is pruned by IntentKV, a memory session that
answers from MemArt blocks, and a second executor whose prompt repeats the first
one's tool schemas in another order (segment reuse). Then a composed session
(`{"kind": ["agents", "pruned", "memart", "reuse"]}`): the plan, action and reflect
roles extend one trajectory whose history IntentKV prunes, each role reading the
pruned KV the others computed; a new conversation in that session recalls the first
from MemArt memory (written when it closed, its blocks for the new question copied
into the prompt instead of prefilled); a reviewer in a second such session, whose history carries
the same tool results, splices them from the segments the first session's roles
stored (computed with the roles' adapters; its new question, IntentKV's query span,
is computed).
Prints what `usage["jaxkv"]` says each mechanism did, then the server's
mechanism counters from /metrics.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import urllib.request

from openai import OpenAI

ROOT = pathlib.Path(__file__).resolve().parent
ORDER = {"order_id": "#W2378156", "status": "pending", "items": [
    {"item_id": f"10{i:02d}", "name": name, "price": 20 + 7 * i, "options": {"size": "M"}}
    for i, name in enumerate(["water bottle", "hiking boots", "rain jacket", "tent",
                              "sleeping bag", "headlamp", "camp stove", "trekking poles"])],
         "payment_history": [{"method": "credit_card_4421", "amount": 512.0}],
         "address": {"city": "Denver", "zip": "80202"}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--max_tokens", type=int, default=32)
  args = ap.parse_args()
  client = OpenAI(base_url=args.base_url, api_key="unused")
  rows = []

  def ask(label, messages, model=args.model, session=None, kind=None):
    if kind is not None:   # open the session on its kind first
      req = urllib.request.Request(args.base_url + "/sessions", method="POST",
                                   data=json.dumps({"session_id": session, "kind": kind}).encode(),
                                   headers={"Content-Type": "application/json"})
      urllib.request.urlopen(req).read()
    r = client.chat.completions.create(model=model, messages=messages,
                                       max_tokens=args.max_tokens, temperature=0,
                                       extra_body={"session_id": session} if session else None)
    u = r.usage
    rows.append((label, u.prompt_tokens, u.prompt_tokens_details.cached_tokens,
                 json.dumps((u.model_extra or {}).get("jaxkv", {}))))
    return r.choices[0].message.content or ""

  requests = [json.loads(x) for x in (ROOT / "reuse_requests.jsonl").read_text().splitlines()]
  system = requests[0]["messages"][0]["content"]
  plan = ask("planner (role adapter)", [{"role": "user", "content":
                                         "Plan the steps to cancel order #W2378156."}],
             model=f"{args.model}:plan")
  team = [{"role": "user", "content": "Plan the steps to cancel order #W2378156."}]
  for role in ("plan", "action"):   # two roles, one shared trajectory
    said = ask(f"{role} role (agents)", team, model=f"{args.model}:{role}", session="team",
               kind="agents" if role == "plan" else None)
    team += [{"role": "assistant", "content": said},
             {"role": "user", "content": "Carry out the first step."}]
  chat = [{"role": "system", "content": system},
          {"role": "user", "content": "Please cancel order #W2378156, I ordered it by mistake."}]
  for turn in range(3):   # the executor: tool results make the history grow
    reply = ask(f"executor turn {turn + 1} (pruned)", chat, session="executor", kind=(
        "pruned" if turn == 0 else None))
    chat += [{"role": "assistant", "content": reply},
             {"role": "user", "content": "Tool result: " + json.dumps(ORDER)}]
  crew = chat[:2]          # composed: three roles share one trajectory that IntentKV
  four = ["agents", "pruned", "memart", "reuse"]    # prunes and reuse splices; MemArt
  for turn, role in enumerate(("plan", "action", "reflect")):   # keeps what is closed
    said = ask(f"{role} role (4 composed)", crew, model=f"{args.model}:{role}",
               session="crew", kind=four if turn == 0 else None)
    crew += [{"role": "assistant", "content": said},
             {"role": "user", "content": "Tool result: " + json.dumps(ORDER)}]
  ask("plan role, new conversation (recall)",   # the last one is written to memory and
      [{"role": "system", "content": system},   # its blocks for this question spliced
       {"role": "user", "content": "Which card paid for order #W2378156?"}],
      model=f"{args.model}:plan", session="crew")
  ask("reviewer, new session (agents+pruned+reuse)",
      crew + [{"role": "assistant", "content": "Done."},
              {"role": "user", "content": "Review the steps taken so far."}],
      model=f"{args.model}:reflect", session="review", kind=["agents", "pruned", "reuse"])
  notes = [{"role": "user", "content": f"Plan: {plan}"}, {"role": "assistant", "content": "Ok."},
           {"role": "user", "content": "Order #W2378156 was bought with credit_card_4421."},
           {"role": "assistant", "content": "Noted."},
           {"role": "user", "content": "Which card paid for order #W2378156?"}]
  ask("memory question (memart)", notes, session="memory", kind="memart")
  for i, req in enumerate(requests[:2]):   # the same schemas, another order
    ask(f"executor B request {i + 1} (reuse)", req["messages"], session="executor-b",
        kind="reuse" if i == 0 else None)

  print(f"{'request':38} {'prompt':>6} {'cached':>6}  usage.jaxkv")
  for label, n, cached, extra in rows:
    print(f"{label:38} {n:6d} {cached:6d}  {extra}")
  metrics = urllib.request.urlopen(args.base_url.rsplit("/v1", 1)[0] + "/metrics").read()
  print("\n".join(line for line in metrics.decode().splitlines()
                  if line.startswith(("jaxkv_pruned", "jaxkv_pruning", "jaxkv_memart",
                                      "jaxkv_reuse", "jaxkv_adapter", "jaxkv_lora",
                                      "jaxkv_agents",
                                      "jaxkv_session"))))


if __name__ == "__main__":
  main()
