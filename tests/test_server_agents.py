"""One server config with every KV mechanism on (configs/smollm2_agents.py): role
adapters, pruned (IntentKV) sessions, MemArt sessions, reuse sessions and LRAgent
sessions whose roles share one trajectory, each reporting what it did in
`usage["jaxkv"]` and `/metrics`.

Real SmolLM2 weights and the shipped role adapters; the config's pools and budgets
are shrunk so the short chats here get pruned and fit a small pool. The pruned
session's first reply is checked against a `SessionRunner` of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import runpy
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from jaxkv import cli  # noqa: E402
from jaxkv.config import CacheConfig, ServeConfig, from_config_dict  # noqa: E402
from jaxkv.engine.sessions import SessionRunner  # noqa: E402
from jaxkv.policies.pruning import intentkv  # noqa: E402
from jaxkv.server.app import create_app, serve_in_thread  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
SYSTEM = "You are a travel agent. Answer briefly."
DETAILS = ("My booking: reservation 8JX2QK, flight HA204 from Honolulu to Seattle on May 14, "
           "seat 31C, one checked bag, basic economy fare.")
TURNS = ["Can I move my flight to May 16 and keep seat 31C?",
         "What does the change cost on a basic economy fare?"]


def composed_config() -> ServeConfig:
  cd = runpy.run_path(str(ROOT / "configs/smollm2_agents.py"))["get_config"]()
  cfg = from_config_dict(ServeConfig, cd)
  return dataclasses.replace(      # one pool for every kind: 384 pages of 16 slots
      cfg, cache=CacheConfig(num_pages=384, page_size=16, max_seq_len=1024),
      server=dataclasses.replace(cfg.server, agent_max_tokens=512),
      engine=dataclasses.replace(cfg.engine, max_batch=4, prefill_chunk=128, decode_steps=8),
      pruning=dataclasses.replace(cfg.pruning, budget=48),
      memart=dataclasses.replace(cfg.memart, top_k=4))


@pytest.fixture(scope="module")
def served():
  cfg = composed_config()
  llm = cli.load_llm(cfg)
  app = create_app(llm, cfg)
  with serve_in_thread(app) as server:
    server.cfg, server.llm, server.app_backends = cfg, llm, app.state.backends
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield server


def metric(url: str, name: str, **labels) -> float:
  text = httpx.get(url + "/metrics").text
  lab = ",".join([f'model="{MODEL}"'] + [f'{k}="{v}"' for k, v in labels.items()])
  m = re.search(rf"^{name}{{{re.escape(lab)}}} (\S+)$", text, re.M)
  return float(m.group(1)) if m else 0.0


def usage(r) -> dict:
  return r.usage.model_extra["jaxkv"]


def test_every_kind_shares_one_pool(served):
  """The engine and every session kind's runner allocate from one KV manager: one
  pool, reported in /metrics with its bytes; its allocator and trees stay clean."""
  backends = served.app_backends
  kv = served.llm.engine.kv_manager
  assert backends.pruned.kv is kv and backends.reuse.runner.kv is kv
  assert backends.semshare.runner.kv is kv
  assert kv.driver is served.llm.engine.driver or served.llm.engine.driver is None
  assert backends.memart.runner.kv is kv
  assert backends.kv_managers == [kv]
  assert kv.lr_rank == served.llm.lora.rank            # the agents' low-rank value cache
  assert metric(served.url, "jaxkv_kv_pools") == 1
  assert metric(served.url, "jaxkv_kv_pool_bytes") == kv.nbytes
  kv.check()


@pytest.mark.slow
def test_role_adapter_reports_itself(served):
  r = served.client.chat.completions.create(
      model=f"{MODEL}:plan", messages=[{"role": "user", "content": "Plan a trip."}], max_tokens=4)
  assert usage(r) == {"adapter": "plan"}
  assert metric(served.url, "jaxkv_adapter_requests_total", adapter="plan") == 1
  assert metric(served.url, "jaxkv_lora_shared_a_saved_bytes") > 0


@pytest.mark.slow
def test_pruned_session_keeps_query_memory_across_turns(served):
  """The default kind: turn 1 is pruned to the budget and equals a SessionRunner of
  its own; turn 2 adopts turn 1 from the radix cache and its QueryMemory carries
  turn 1's queries (cosine < 1 against its own); closing forgets the memory."""
  client, cfg = served.client, served.cfg
  msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DETAILS},
          {"role": "assistant", "content": "Noted."}, {"role": "user", "content": TURNS[0]}]
  r1 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, user="agent-1")
  u1 = usage(r1)
  assert u1["session_kind"] == "pruned" and u1["pruning"] == "intentkv" and u1["pruned"]
  assert u1["kv_live_after"] < u1["kv_live_before"] == r1.usage.prompt_tokens
  assert r1.usage.prompt_tokens_details.cached_tokens == 0
  assert math.isclose(u1["query_memory_cos"], 1.0, abs_tol=1e-5)   # M_1 = Enc(q_1)
  ref = SessionRunner(served.llm, cfg.pruning, cache=cfg.cache, prefill_chunk=128)
  t = ref.run_turn("ref", msgs, None, len(msgs), generate=True, max_tokens=12)
  assert r1.choices[0].message.content == served.llm.tokenizer.decode(
      [i for i in t.reply_ids if i not in served.llm.tokenizer.stop_ids])
  assert (t.live_before, t.live_after) == (u1["kv_live_before"], u1["kv_live_after"])

  msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
           {"role": "user", "content": TURNS[1]}]
  r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, user="agent-1")
  u2 = usage(r2)
  assert r2.usage.prompt_tokens_details.cached_tokens > 0           # turn 1's path, holes kept
  assert u2["pruned"] and 0 < u2["query_memory_cos"] < 0.9999      # M_2 mixes turn 1's queries
  key = intentkv.session_key(session_id="agent-1")
  backends = served.app_backends
  assert key in backends.pruned.memories
  listed = {d["id"]: d["kind"] for d in httpx.get(served.url + "/v1/sessions").json()["data"]}
  assert listed["agent-1"] == "pruned"
  assert httpx.delete(served.url + "/v1/sessions/agent-1").json()["deleted"]
  assert key not in backends.pruned.memories
  assert metric(served.url, "jaxkv_pruning_events_total") >= 2
  assert metric(served.url, "jaxkv_pruned_tokens_total") >= (
      u1["kv_live_before"] - u1["kv_live_after"])
  # streamed, and refusals: sampling, role adapters
  s = client.chat.completions.create(model=MODEL, messages=msgs[:4], max_tokens=12,
                                     user="agent-2", stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == (
      r1.choices[0].message.content)
  # pruned sessions run in the batch engine: sampling is served, role adapters are not
  hot = httpx.post(served.url + "/v1/chat/completions", json={
      "model": MODEL, "messages": msgs[:4], "user": "agent-2", "temperature": 0.7, "seed": 3,
      "max_tokens": 6}, timeout=300)            # a sampling step compiles on first use
  assert hot.status_code == 200 and hot.json()["usage"]["jaxkv"]["session_kind"] == "pruned"
  bad = httpx.post(served.url + "/v1/chat/completions", json={
      "model": f"{MODEL}:plan", "messages": msgs[:4], "user": "agent-2"})
  assert bad.status_code == 400, bad.text
  # a plain chat (no system prompt, no history) is served too
  plain = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "Hi there."}], max_tokens=4,
      user="agent-3")
  assert usage(plain)["session_kind"] == "pruned" and plain.choices[0].message.content
  backends.kv.check()


@pytest.mark.slow
def test_memart_session_prefills_only_the_question(served):
  url = served.url
  sid = httpx.post(url + "/v1/sessions", json={"kind": "memart"}).json()["id"]
  history = []
  for fact in ["My sister Ana lives in Lisbon and teaches piano.",
               "I adopted a grey cat called Biscuit last spring.",
               "Our team ships the billing service every Tuesday.",
               "The spare key is under the blue flower pot."]:
    history += [{"role": "user", "content": fact}, {"role": "assistant", "content": "Noted."}]
  msgs = history + [{"role": "user", "content": "Where is the spare key?"}]
  r = served.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                            extra_body={"session_id": sid})
  u = usage(r)
  assert u["session_kind"] == "memart" and u["blocks_written"] > 0
  assert 0 < u["retrieved_blocks"] <= 4 and u["memory_blocks"] == u["blocks_written"]
  assert u["prefill_tokens"] < r.usage.prompt_tokens / 3
  assert metric(url, "jaxkv_memart_blocks_retrieved_total") == u["retrieved_blocks"]
  assert metric(url, "jaxkv_memart_chat_tokens_total") == r.usage.prompt_tokens
  # memart requests run in the batch engine: the same turn again, streamed token by token
  chunks = list(served.client.chat.completions.create(
      model=MODEL, messages=msgs, max_tokens=8, stream=True,
      stream_options={"include_usage": True}, extra_body={"session_id": sid}))
  deltas = [c.choices[0].delta.content for c in chunks if c.choices and
            c.choices[0].delta.content]
  assert "".join(deltas) == r.choices[0].message.content and len(deltas) > 1
  assert chunks[-1].usage.model_extra["jaxkv"]["blocks_written"] == 0   # nothing new
  assert httpx.post(url + "/v1/sessions", json={"session_id": sid, "kind": "pruned"}
                    ).status_code == 400                        # open as memart already
  assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
  assert sid not in served.app_backends.memart.sessions.sessions


@pytest.mark.slow
def test_reuse_session_splices_segments_of_earlier_prompts(served):
  url = served.url
  lines = (ROOT / "examples/reuse_requests.jsonl").read_text().splitlines()[:2]
  sid = httpx.post(url + "/v1/sessions", json={"kind": "reuse"}).json()["id"]
  got = []
  for line in lines:
    req = json.loads(line)
    r = served.client.chat.completions.create(model=MODEL, messages=req["messages"],
                                              max_tokens=8, extra_body={"session_id": sid})
    got.append(usage(r))
  assert got[0]["session_kind"] == "reuse" and got[0]["reused_tokens"] == 0
  assert got[1]["reused_tokens"] > 32 and got[1]["prefill_tokens"] < r.usage.prompt_tokens
  assert metric(url, "jaxkv_reuse_reused_tokens_total") == got[1]["reused_tokens"]
  assert metric(url, "jaxkv_session_requests_total", kind="reuse") == 2
  bad = httpx.post(url + "/v1/sessions", json={"kind": "bogus"})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "kind"
  served.app_backends.reuse.runner.alloc.check()
  assert np.isfinite(metric(url, "jaxkv_sessions_open"))


@pytest.mark.slow
def test_semshare_session_reuses_a_similar_prompt(served):
  """SemShareKV in the server: the first prompt is prefilled and kept as a reference;
  the second, similar one (examples/semshare_requests.jsonl) reuses its KV on the one
  pool; usage and /metrics say so."""
  url = served.url
  reqs = [json.loads(x) for x in
          (ROOT / "examples/semshare_requests.jsonl").read_text().splitlines()[:2]]
  sid = httpx.post(url + "/v1/sessions", json={"kind": "semshare"}).json()["id"]
  got = [usage(served.client.chat.completions.create(
      model=MODEL, messages=r["messages"], max_tokens=6, extra_body={"session_id": sid}))
      for r in reqs]
  assert got[0]["session_kind"] == "semshare" and not got[0]["reused"]
  assert got[1]["reused"] and got[1]["similarity"] >= served.cfg.semshare.threshold
  assert 0 < got[1]["shared_entries"] <= got[1]["live_entries"]
  assert metric(url, "jaxkv_semshare_reused_requests_total") == 1
  assert served.app_backends.semshare.runner.kv is served.app_backends.kv
  served.app_backends.kv.check()


@pytest.mark.slow
def test_agents_session_shares_one_trajectory_across_roles(served):
  """LRAgent in the server: the plan role's first turn equals the engine's adapter
  run (it computes everything), the action role's turn reads the plan turn's KV
  (base_lr_shared) and says so; the base model is refused in such a session."""
  url, client = served.url, served.client
  sid = httpx.post(url + "/v1/sessions", json={"kind": "agents"}).json()["id"]
  msgs = [{"role": "user", "content": "Plan the steps to cancel order #W2378156."}]
  r1 = client.chat.completions.create(model=f"{MODEL}:plan", messages=msgs, max_tokens=12,
                                      extra_body={"session_id": sid})
  alone = client.chat.completions.create(model=f"{MODEL}:plan", messages=msgs, max_tokens=12)
  assert r1.choices[0].message.content == alone.choices[0].message.content
  u1 = usage(r1)
  assert u1["session_kind"] == "agents" and u1["scheme"] == "base_lr_shared"
  assert u1["role"] == "plan" and u1["shared_tokens"] == 0
  assert u1["kv_bytes"] < u1["kv_bytes_non_shared"]
  msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
           {"role": "user", "content": "Do the first step."}]
  r2 = client.chat.completions.create(model=f"{MODEL}:action", messages=msgs, max_tokens=8,
                                      extra_body={"session_id": sid})
  u2 = usage(r2)
  assert u2["role"] == "action" and u2["shared_tokens"] >= r1.usage.prompt_tokens
  assert r2.usage.prompt_tokens_details.cached_tokens == u2["shared_tokens"]
  assert u2["computed_tokens"] + u2["shared_tokens"] == r2.usage.prompt_tokens
  assert metric(url, "jaxkv_agents_shared_tokens_total") == u2["shared_tokens"]
  kv = served.app_backends.kv
  assert served.app_backends.agents.kv is kv               # its trajectory is in the one pool
  listed = {d["id"]: d for d in httpx.get(url + "/v1/sessions").json()["data"]}
  assert listed[sid]["kind"] == "agents"
  assert listed[sid]["held_tokens"] == u2["trajectory_tokens"]
  base = httpx.post(url + "/v1/chat/completions", json={
      "model": MODEL, "messages": msgs, "session_id": sid})
  assert base.status_code == 400 and "role model name" in base.json()["error"]["message"]
  # a role's turn samples and streams token by token like any engine request
  msgs += [{"role": "assistant", "content": r2.choices[0].message.content},
           {"role": "user", "content": "And the second step?"}]
  chunks = list(client.chat.completions.create(
      model=f"{MODEL}:reflect", messages=msgs, max_tokens=12, temperature=0.8, seed=3,
      stream=True, stream_options={"include_usage": True}, extra_body={"session_id": sid}))
  texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
  assert len(texts) >= 2                                    # more than one piece
  u3 = chunks[-1].usage.model_extra["jaxkv"]
  assert u3["role"] == "reflect" and u3["shared_tokens"] >= u2["trajectory_tokens"]
  held = kv.allocator.num_live_slots
  assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
  assert sid not in served.app_backends.agents.sessions
  # its trajectory's slots went back to the pool
  assert held - kv.allocator.num_live_slots == u3["trajectory_tokens"]
  kv.check()


@pytest.mark.slow
def test_a_session_turn_batches_and_is_cancelled_when_its_client_leaves(served):
  """Issue 38, defect 1: a long pruned-session turn no longer holds the server (a short
  plain chat is answered while it streams, in the same batch engine), and when its
  client leaves mid-stream the turn is cancelled and its row's slots go back."""
  url, alloc = served.url, served.llm.engine.allocator
  cancelled0 = metric(url, "jaxkv_requests_finished_total", finish_reason="cancelled")
  live0 = alloc.num_live_slots
  msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DETAILS},
          {"role": "assistant", "content": "Noted."},
          {"role": "user", "content": "Tell me a long story about this trip."}]
  state = {"chunks": 0, "plain_done_while_streaming": False}
  started, plain_done = threading.Event(), threading.Event()

  def long_turn():
    body = {"model": MODEL, "messages": msgs, "max_tokens": 400, "stream": True,
            "user": "leaver"}
    with httpx.Client(timeout=120) as http, http.stream(
        "POST", url + "/v1/chat/completions", json=body) as resp:
      for line in resp.iter_lines():
        if line.startswith("data: ") and '"content": "' in line:
          state["chunks"] += 1
          started.set()
          if plain_done.wait(0) and state["chunks"] >= 3:
            state["plain_done_while_streaming"] = True
            break                                   # the client leaves mid-stream
  t = threading.Thread(target=long_turn)
  t.start()
  assert started.wait(120)
  r = served.client.chat.completions.create(model=MODEL, max_tokens=4,
                                            messages=[{"role": "user", "content": "Hi!"}])
  assert r.choices[0].message.content is not None
  plain_done.set()
  t.join(120)
  assert state["plain_done_while_streaming"], state
  deadline = time.time() + 120
  while (metric(url, "jaxkv_requests_finished_total", finish_reason="cancelled")
         < cancelled0 + 1 or served.llm.engine.busy):
    assert time.time() < deadline, "the left turn was not cancelled"
    time.sleep(0.5)
  alloc.check()                                 # no row left: every slot accounted for
  assert served.llm.engine.allocator.num_live_slots < live0 + 400, (live0, alloc.num_live_slots)
  assert httpx.delete(url + "/v1/sessions/leaver").status_code in (200, 404)


@pytest.mark.slow
def test_a_composed_session_prunes_the_trajectory_its_roles_share(served):
  """Issue 38, composition: a session of ["agents", "pruned"] through the openai client:
  the roles extend one trajectory (the second reads the first's KV), IntentKV prunes it
  past the budget (48 here), usage names both mechanisms' effects; kinds that do not
  combine are a 400 saying why."""
  url, client = served.url, served.client
  opened = httpx.post(url + "/v1/sessions", json={"kind": ["pruned", "agents"]}).json()
  sid = opened["id"]
  assert opened["kind"] == "agents+pruned"
  chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DETAILS}]
  got = []
  for role in ("plan", "action"):
    r = client.chat.completions.create(model=f"{MODEL}:{role}", messages=chat, max_tokens=8,
                                       extra_body={"session_id": sid})
    got.append(usage(r))
    chat += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": TURNS[0]}]
  u1, u2 = got
  assert u1["session_kind"] == "agents+pruned" and u1["mechanisms"] == ["agents", "pruned"]
  assert u1["role"] == "plan" and u2["role"] == "action" and u2["shared_tokens"] > 0
  assert u1["kv_live_before"] > 48 and u1["query_memory_cos"] == 1.0   # a new session
  # turn 2: the first user message is history now, and pruned away in part
  assert u2["pruned"] and u2["kv_live_after"] < u2["kv_live_before"]
  assert u2["query_memory_cos"] < 1.0                            # M_t carries turn 1
  listed = {d["id"]: d for d in httpx.get(url + "/v1/sessions").json()["data"]}
  assert listed[sid]["kind"] == "agents+pruned"
  for kinds, why in ((["semshare", "agents"], "plans its own prefill"),
                     (["memart", "reuse"], "lays out"),
                     (["prefix", "pruned"], "does not combine"),
                     (["agents", "bogus"], "not served here")):
    bad = httpx.post(url + "/v1/sessions", json={"kind": kinds})
    assert bad.status_code == 400 and why in bad.json()["error"]["message"], bad.text
  assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
  assert sid not in served.app_backends.agents.sessions
  assert sid not in served.app_backends.pruned.state.seen       # QueryMemory forgotten
  served.app_backends.kv.check()


@pytest.mark.slow
def test_four_mechanisms_compose_with_memory_of_earlier_conversations(served):
  """Issue 38, composition: a session of ["agents", "pruned", "memart", "reuse"]
  through the openai client. Its first conversation (plan, then action) is plain
  agents + pruning; a second conversation opens with a recall that writes the first
  into MemArt memory and retrieves blocks for the new question, which the row copies
  into its prompt's region (spliced, not prefilled) on the plan role; the next call of
  that conversation adopts the region from the trajectory; usage names all four."""
  url, client = served.url, served.client
  opened = httpx.post(url + "/v1/sessions", json={"kind": ["memart", "reuse", "agents",
                                                             "pruned"]}, timeout=120).json()
  sid, kind = opened["id"], "agents+pruned+memart+reuse"
  assert opened["kind"] == kind

  def call(role, chat):
    r = client.chat.completions.create(model=f"{MODEL}:{role}", messages=chat, max_tokens=8,
                                       extra_body={"session_id": sid})
    return r, usage(r)

  chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DETAILS}]
  r, u0 = call("plan", chat)
  assert u0["mechanisms"] == ["agents", "pruned", "memart", "reuse"]
  assert u0["memory_region_tokens"] == 0 and "memory_written_tokens" not in u0
  chat += [{"role": "assistant", "content": r.choices[0].message.content},
           {"role": "user", "content": TURNS[0]}]
  call("action", chat)
  new = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "Which seat and flight did I book before?"}]
  r, u1 = call("plan", new)
  assert u1["memory_written_tokens"] > 32 and u1["memory_blocks"] >= u1[
      "memory_blocks_retrieved"] > 0
  assert u1["memory_spliced_tokens"] == u1["memory_region_tokens"] > 0
  # usage counts the client's prompt; the trajectory holds the region beside it
  assert u1["trajectory_tokens"] >= r.usage.prompt_tokens + u1["memory_region_tokens"]
  assert u1["memory_cached_tokens"] == u1["memory_region_tokens"]
  assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
  new += [{"role": "assistant", "content": r.choices[0].message.content},
          {"role": "user", "content": TURNS[1]}]
  r, u2 = call("action", new)
  assert "memory_written_tokens" not in u2 and u2["memory_spliced_tokens"] == 0
  assert u2["memory_region_tokens"] == u1["memory_region_tokens"]
  assert u2["shared_tokens"] >= u1["memory_region_tokens"]      # the plan role's region
  assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
  assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
  assert sid not in served.app_backends.memart.conversations
  served.app_backends.kv.check()


@pytest.mark.slow
def test_a_pruned_session_splices_segments_of_another(served):
  """Issue 38, composition: sessions of ["reuse", "pruned"] through the openai client.
  The second session's history carries the document the first one's prompt did (after
  another system prompt): it splices it (reused tokens) with the query span computed,
  and IntentKV prunes the history past the budget (48); on its next turn it adopts its
  own path, the spliced KV included; usage names both mechanisms."""
  url, client = served.url, served.client
  doc = json.loads((ROOT / "examples/reuse_requests.jsonl").read_text().splitlines()[0])
  doc = doc["messages"][0]["content"]                 # tool schemas, one per line
  chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc}],
           [{"role": "system", "content": "You answer questions about tools."},
            {"role": "user", "content": doc}, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Which tool cancels an order?"}]]
  got = []
  for chat in chats:
    sid = httpx.post(url + "/v1/sessions", json={"kind": ["reuse", "pruned"]}).json()["id"]
    r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8,
                                       extra_body={"session_id": sid})
    got.append(usage(r))
  u1, u2 = got
  assert u1["session_kind"] == "pruned+reuse" and u1["mechanisms"] == ["pruned", "reuse"]
  assert u2["reused_tokens"] > 32 and u2["prefill_tokens"] < r.usage.prompt_tokens
  assert u2["pruned"] and u2["kv_live_after"] < u2["kv_live_before"]
  chat += [{"role": "assistant", "content": r.choices[0].message.content},
           {"role": "user", "content": TURNS[0]}]
  r2 = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=8,
                                      extra_body={"session_id": sid})
  assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1
  assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
  served.app_backends.kv.check()


@pytest.mark.slow
def test_three_mechanisms_compose_in_one_session(served):
  """Issue 38, composition: sessions of ["agents", "pruned", "reuse"] through the
  openai client. The first, on the plan role, stores the document its prompt carries
  (computed with the roles' adapters); the second, on the action role, splices it into
  its history, computes IntentKV's query span and prunes past the budget (48); usage
  names the three mechanisms' effects."""
  url, client = served.url, served.client
  doc = json.loads((ROOT / "examples/reuse_requests.jsonl").read_text().splitlines()[0])
  doc = doc["messages"][0]["content"]
  chats = [("plan", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc}]),
           ("action", [{"role": "system", "content": "You answer questions about tools."},
                       {"role": "user", "content": doc}, {"role": "assistant", "content": "Ok."},
                       {"role": "user", "content": "Which tool cancels an order?"}])]
  got, sids = [], []
  for role, chat in chats:
    opened = httpx.post(url + "/v1/sessions", json={"kind": ["reuse", "agents", "pruned"]},
                        timeout=120)      # the loop thread may be in a step that compiles
    assert opened.json()["kind"] == "agents+pruned+reuse", opened.text
    sids.append(opened.json()["id"])
    r = client.chat.completions.create(model=f"{MODEL}:{role}", messages=chat, max_tokens=8,
                                       extra_body={"session_id": sids[-1]})
    got.append(usage(r))
  u1, u2 = got
  assert u1["mechanisms"] == ["agents", "pruned", "reuse"] and u1["role"] == "plan"
  assert u1["stored"] > 0 and u2["role"] == "action" and u2["scheme"] == "base_lr_shared"
  assert u2["reused_tokens"] > 32 and u2["prefill_tokens"] < r.usage.prompt_tokens
  assert u2["pruned"] and u2["kv_live_after"] < u2["kv_live_before"]
  for sid in sids:
    assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
  served.app_backends.kv.check()
