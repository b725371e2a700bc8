"""LRAgent's five KV-sharing schemes on a tiny random Llama (SmolLM2 tokenizer and
template) with random shared-A adapters: the equivalences that must hold exactly
(fp32 rounding, atol 1e-5 on logprobs) and the differences that must show."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_util
from jaxkv.config import LoraConfig
from jaxkv.data import agents
from jaxkv.engine.agents import AgentRunner, fidelity, profile_window
from jaxkv.models import lora as lora_lib
from jaxkv.policies.sharing import lragent
from test_lora_train import _session

TOL = 1e-5


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_agents"))


def _lora(llm, n=3, same=False, targets=("q", "v"), seed=0):
  ml = lora_lib.MultiLoRA(llm.config, LoraConfig(rank=4, targets=targets,
                                                 names=agents.ROLES[:n] if n <= 3 else
                                                 tuple(f"a{i}" for i in range(n))),
                          rngs=nnx.Rngs(seed))
  w = ml.weights()
  b = {}
  for i, (t, v) in enumerate(sorted(w.b.items())):
    r = jax.random.normal(jax.random.key(seed + 10 + i), v.shape) * 0.3
    b[t] = jnp.broadcast_to(r[:, :1], v.shape) if same else r
  return lora_lib.LoraWeights(a=w.a, b=b, scale=w.scale)


@pytest.fixture(scope="module")
def traj(llm):
  return agents.build(_session(), llm.tokenizer)


@pytest.fixture(scope="module")
def distinct(llm, traj):
  """Random distinct adapters and their non_shared reference run (shared by tests)."""
  w = _lora(llm)
  return w, _run(llm, w, "non_shared", traj)


def _run(llm, w, scheme, traj, **kw):
  return AgentRunner(llm, w, scheme, max_tokens=len(traj) + 8, chunk=64, **kw).run(traj)


def _lp(res):
  return np.concatenate([c.logprob for c in res.calls])


@pytest.mark.slow
def test_single_agent_every_scheme_equals_non_shared(llm, traj):
  one = dataclasses.replace(traj, calls=[dataclasses.replace(c, role=0) for c in traj.calls])
  w = _lora(llm, n=1)
  ref = _run(llm, w, "non_shared", one)
  for scheme in lragent.SCHEMES[1:]:
    res = _run(llm, w, scheme, one, window=(0, 1))
    np.testing.assert_allclose(_lp(res), _lp(ref), atol=TOL, rtol=0, err_msg=scheme)
    assert fidelity(res, ref)["greedy_agreement"] == 1.0
    assert sum(c.recomputed for c in res.calls) == 0
  # one agent runs each token once (up to the last call's final, unfed token)
  assert sum(c.computed + c.end - c.start - 1 for c in ref.calls) == one.calls[-1].end - 1


@pytest.mark.slow
def test_identical_adapters_make_sharing_exact(llm, traj):
  """Identical hidden states across agents (same B for all): BaseShared, and every
  other scheme, reproduce NonShared."""
  w = _lora(llm, same=True)
  ref = _run(llm, w, "non_shared", traj)
  for scheme in lragent.SCHEMES[1:]:
    res = _run(llm, w, scheme, traj, window=(0, 1))
    np.testing.assert_allclose(_lp(res), _lp(ref), atol=TOL, rtol=0, err_msg=scheme)


@pytest.mark.slow
def test_distinct_adapters_separate_the_schemes(llm, traj, distinct):
  w, ref = distinct
  res = {s: _run(llm, w, s, traj, window=(0, 1)) for s in lragent.SCHEMES[1:]}
  for s, r in res.items():                     # sharing approximates, it is not exact here
    assert abs(fidelity(r, ref)["delta_nll"]) > 1e-4, s
  # computation: non_shared and base_shared run every token for every agent that reads
  # it; full_shared / base_lr_shared / droidspeak run each token once (+ recompute)
  comp = {s: sum(c.computed for c in r.calls) for s, r in {**res, "non_shared": ref}.items()}
  assert comp["non_shared"] == comp["base_shared"] > comp["full_shared"] == comp["base_lr_shared"]
  assert sum(c.recomputed for c in res["droidspeak"].calls) > 0
  b = {s: r.kv_bytes for s, r in {**res, "non_shared": ref}.items()}
  assert b["non_shared"] == 3 * b["full_shared"]
  assert b["full_shared"] < b["base_lr_shared"] < b["base_shared"] < b["non_shared"]


@pytest.mark.slow
def test_droidspeak_recomputing_every_layer_is_non_shared(llm, traj, distinct):
  """A window over all layers recomputes every reused token from its embedding
  with the agent's own adapter: exactly the agent's own cache."""
  w, ref = distinct
  res = _run(llm, w, "droidspeak", traj, window=(0, llm.config.num_layers))
  np.testing.assert_allclose(_lp(res), _lp(ref), atol=TOL, rtol=0)


@pytest.mark.slow
def test_base_lr_shared_through_the_flash_lora_kernel(llm, traj):
  """BaseLRShared attention through Flash-LoRA-Attention (Pallas, interpreted)
  equals the materialise-then-attend reference."""
  w = _lora(llm)
  short = dataclasses.replace(traj, calls=traj.calls[:2])
  ref = _run(llm, w, "base_lr_shared", short, attn_impl="reference")
  fla = _run(llm, w, "base_lr_shared", short, attn_impl="interpret")
  np.testing.assert_allclose(_lp(fla), _lp(ref), atol=TOL, rtol=0)


def test_profile_window_and_errors(llm, traj):
  w = _lora(llm)
  (l0, l1), dev = profile_window(llm, w, traj.ids[:48], 1)
  assert dev.shape == (llm.config.num_layers,) and (dev > 0).all() and l1 - l0 == 1
  assert l0 == int(np.argmax(dev))
  assert lragent.critical_window(np.array([0., 5, 1, 4, 4]), 2) == (3, 5)
  with pytest.raises(ValueError, match="window"):
    AgentRunner(llm, w, "droidspeak", max_tokens=64)
  with pytest.raises(ValueError, match="needs a LoRA on v"):
    AgentRunner(llm, _lora(llm, targets=("q",)), "base_shared", max_tokens=64)
  with pytest.raises(ValueError, match="unknown sharing scheme"):
    AgentRunner(llm, w, "shared", max_tokens=64)
  with pytest.raises(ValueError, match="max_tokens"):
    AgentRunner(llm, w, "full_shared", max_tokens=16).run(traj)


def test_bench_emulation_traces_hit_their_lengths(llm):
  """bench/lragent.py's controlled traces: compact system prompt, tool results padded
  with real text to about the requested length; agent calls unchanged."""
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
  import lragent as bench

  s = _session()
  filler = "reservations: NO6JO3 (BOS), AIXC01 (LAX). flight HAT136 JFK to BOS. " * 200
  base = agents.build(s, llm.tokenizer)
  for target in (400, 1200):
    t = agents.build(bench.emulate(s, filler, target, llm.tokenizer), llm.tokenizer)
    assert abs(len(t) - target) <= 0.1 * target, (len(t), target)
    assert [c.role for c in t.calls] == [c.role for c in base.calls]
    assert "Tools: cancel_reservation, get_user_details" in t.text


def test_bench_tables_take_untimed_rows():
  """--notiming rows (timing fields null) print "-" in the timing tables, and the
  real-trajectory call accuracy pools calls over trajectories with Wilson intervals."""
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
  import lragent as bench

  def row(scheme, kind, trace, exact):
    return dict(scheme=scheme, kind=kind, trace=trace, context_tokens=1000, kv_bytes=2**20,
                ttft_s=None, tokens_per_s=None, delta_nll=0.0, greedy_agreement=1.0,
                computed_tokens=10, recomputed_tokens=0, action_exact=exact, action_n=2,
                reflect_exact=1, reflect_n=1)
  rows = [row(s, k, t, int(s == "non_shared") + (t == "b")) for s in ("non_shared", "full_shared")
          for k in ("emulated-qv", "real-qv") for t in ("a", "b")]
  tables = {t.title: t for t in bench.tables(rows)}
  ttft = next(t for title, t in tables.items()
              if title.startswith("emulated-qv, adapters not recorded: TTFT"))
  assert all(cells[1] == "-" for cells in ttft.lines)
  acc = next(t for title, t in tables.items() if "call accuracy" in title)
  assert "2 trajectories" in acc.title
  assert acc.lines[0][:2] == ["non_shared", "0.750"] and acc.lines[0][3] == "4"   # 3 of 4
  assert acc.lines[1][:2] == ["full_shared", "0.250"]
  assert [cells[-1] for cells in acc.lines] == ["2", "2"]    # each scheme's trajectories


def test_base_shared_keeps_one_lr_cache_per_agent(llm, traj):
  """BaseShared: each agent's LR cache comes from its OWN hidden states (they differ
  between agents over the tokens both processed); base_lr_shared keeps one."""
  w = _lora(llm)
  r = AgentRunner(llm, w, "base_shared", max_tokens=len(traj) + 8, chunk=64)
  r.run(traj)
  n = min(r.seen)                                   # tokens every agent has run
  lr = [np.asarray(v[:, 16:16 + n]) for v in r.own_vlr]
  assert n > 100 and all(np.abs(x).max() > 0 for x in lr)
  assert np.abs(lr[0] - lr[1]).max() > 1e-3 and np.abs(lr[1] - lr[2]).max() > 1e-3
  # layer 0 reads the embeddings, the same for every agent: equal there
  np.testing.assert_allclose(lr[0][0], lr[1][0], atol=1e-6)


def test_agent_steps_compile_once_per_shape(llm, traj):
  """A fresh runner on a trajectory of the same call lengths but other tokens reuses
  every compiled step (no per-runner or per-token-value recompiles)."""
  from jaxkv.engine import driver
  w = _lora(llm)
  _run(llm, w, "droidspeak", traj, window=(0, 1))
  sizes = driver.chunk_step._cache_size(), driver.decode_scan._cache_size()
  rng = np.random.default_rng()
  other = dataclasses.replace(traj, ids=rng.integers(1, 1000, len(traj)).astype(traj.ids.dtype))
  res = _run(llm, w, "droidspeak", other, window=(0, 1))
  assert sum(c.recomputed for c in res.calls) > 0
  assert (driver.chunk_step._cache_size(), driver.decode_scan._cache_size()) == sizes


def test_call_accuracy_counts_calls_greedy_reproduces(llm, traj, distinct):
  """Per role, a call counts when the greedy token equals the gold one at every step
  (free greedy generation then writes exactly the gold call)."""
  from jaxkv.engine.agents import call_accuracy
  _, ref = distinct
  n_action = sum(c.role == 1 for c in traj.calls)
  n_reflect = sum(c.role == 2 for c in traj.calls)
  assert n_action >= 2 and n_reflect == 1
  acc = call_accuracy(ref, traj)
  assert acc["action_n"] == n_action and acc["reflect_n"] == n_reflect
  assert acc["action_exact"] == 0            # a tiny random model writes no gold call
  calls = [dataclasses.replace(c, argmax=traj.ids[c.start:c.end].copy()) for c in ref.calls]
  calls[next(i for i, c in enumerate(calls) if c.role == 1)].argmax[-1] += 1   # one miss
  acc = call_accuracy(dataclasses.replace(ref, calls=calls), traj)
  assert acc == dict(action_exact=n_action - 1, action_n=n_action, reflect_exact=1,
                     reflect_n=1)


@pytest.mark.parametrize("scheme", ["non_shared", "base_lr_shared"])
def test_respond_serves_a_live_trajectory(llm, scheme):
  """start / respond (the server's "agents" sessions): every reply under non_shared,
  and the first under base_lr_shared, equals the engine's greedy run of that adapter
  on the same prompt (a role's own cached prefix is reused exactly); under
  base_lr_shared a later role reads the KV an earlier one wrote (shared tokens), and
  a prompt that leaves the trajectory rolls the caches back to where it left."""
  from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig
  from jaxkv.engine.engine import Request
  from jaxkv.engine.llm import LLM
  w = _lora(llm)
  eng = LLM(llm.model, llm.tokenizer, CacheConfig(num_pages=128, page_size=16, max_seq_len=512),
            EngineConfig(max_batch=1, prefill_chunk=64), lora=w, adapters=agents.ROLES)
  tok, stops = llm.tokenizer, llm.tokenizer.stop_ids

  def ref(ids, role):
    return next(eng.stream([Request("r", list(ids), SamplingConfig(max_tokens=8),
                                    adapter=role)])).tokens

  r = AgentRunner(llm, w, scheme, max_tokens=256, chunk=64)
  r.start()
  chat = [{"role": "user", "content": "Plan a trip to Lisbon in three steps."}]
  got = []
  for turn, role in enumerate((0, 1, 0)):
    ids = tok.encode_chat(chat, add_generation_prompt=True)
    reply, info = r.respond(ids, role, 8, stops)
    got.append((len(ids), info))
    assert info["computed"] + info["shared"] == len(ids)
    if scheme == "non_shared" or turn == 0:
      assert reply.tolist() == ref(ids, role), (scheme, turn)
    text = tok.decode([t for t in reply.tolist() if t not in stops])
    chat = chat + [{"role": "assistant", "content": text},
                   {"role": "user", "content": f"Now step {turn + 2}, briefly."}]
  (n0, i0), (n1, i1), (n2, i2) = got
  assert i0["shared"] == 0
  if scheme == "non_shared":   # role 1 runs everything; role 0 only what is new to it
    assert i1["shared"] == 0 and 0 < i2["computed"] < n2 - n0 + 16
  else:                        # role 1 reads role 0's turn
    assert i1["shared"] >= n0 and i2["shared"] >= n1
  other = tok.encode_chat([{"role": "user", "content": "Something else entirely."}],
                          add_generation_prompt=True)
  lcp = next(i for i, (a, b) in enumerate(zip(other, ids)) if a != b)   # the template head
  held = r.held.size
  _, back = r.respond(other, 2, 4, stops)
  assert back["shared"] == (0 if scheme == "non_shared" else lcp) and lcp < held
  assert r.held[:len(other)].tolist() == other


def test_a_shared_pool_too_small_for_a_trajectory_leaks_nothing(llm):
  """AgentRunner on a shared KV manager: regions come from its allocator; when the
  pool cannot hold them, start() fails and gives back whatever it had taken."""
  from jaxkv.config import CacheConfig
  from jaxkv.engine.kv_manager import KVManager
  w = _lora(llm)
  kv = KVManager(llm.config, CacheConfig(num_pages=10, page_size=16, max_seq_len=256),
                 llm.graphdef, llm.weights)
  runner = AgentRunner(llm, w, "non_shared", max_tokens=64, kv=kv)   # 3 regions x 4 pages
  with pytest.raises(Exception, match="KV pool exhausted"):
    runner.start()
  assert kv.allocator.sequences() == [] and kv.allocator.num_live_slots == 0
  kv.check()
  with pytest.raises(ValueError, match="base_shared"):
    AgentRunner(llm, w, "base_shared", max_tokens=64, kv=kv)


@pytest.mark.slow   # an engine and three runner schemes: ~40-80 s on 2 cores
def test_bench_runner_adds_the_schemes_an_engine_run_lacks(llm, traj, distinct):
  """bench/lragent.py: the engine serves three schemes; a later runner run of
  droidspeak on the same rows adds only its rows (non_shared reruns as the reference,
  its row not repeated), paired against the same non_shared, and a rerun adds none."""
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
  import lragent as bench

  w, ref = distinct
  rows = []
  bench.run_engine(llm, w, [traj], ["non_shared", "full_shared"], 64, "real-qv", rows, None,
                   max_batch=2)
  assert [r["scheme"] for r in rows] == ["non_shared", "full_shared"]
  for _ in range(2):                                   # the second run finds nothing to do
    bench.run_all(llm, w, [traj], ["non_shared", "droidspeak"], (1, 2), 64, "real-qv", rows,
                  None, timing=False)
    assert [r["scheme"] for r in rows] == ["non_shared", "full_shared", "droidspeak"]
  ds = rows[-1]
  own = _run(llm, w, "droidspeak", traj, window=(1, 2))
  np.testing.assert_allclose(ds["token_dlp"], _lp(ref) - _lp(own), atol=TOL)
  assert ds["window"] == [1, 2] and ds["delta_nll"] > 0     # distinct adapters: it differs
  paired = bench.paired_table("real-qv", rows, ["non_shared", "full_shared", "droidspeak"])
  assert [line[:3] for line in paired.lines] == [["full_shared", "non_shared", "1"],
                                                 ["droidspeak", "non_shared", "1"]]
