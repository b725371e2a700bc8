"""IntentKV Phase-2 training: features, the eq. 8 loss, the optimiser loop, checkpoints.

The frozen model is a tiny random Llama with SmolLM2's real tokenizer and chat
template (as tests/test_sessions.py), so prompts, spans and labels are real.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_util
from jaxkv.config import CacheConfig
from jaxkv.data import traces
from jaxkv.engine.sessions import SessionRunner
from jaxkv.kv import state as kv_state
from jaxkv.models.forward import Capture
from jaxkv.policies.pruning import intentkv, residual
from jaxkv.training import PrunerTrainConfig, features, load_head, loss, train

IGNORE = -100


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_training"))


_entry = hf_util.tool_session_entry


CFG = PrunerTrainConfig(chunk_tokens=16, max_chunk=4096, max_prompt_tokens=1024, n_q=64,
                        progress=False)


# ----------------------------------------------------------------------------- features
@pytest.mark.parametrize("start,qs,n,chunk", [(0, 100, 130, 32), (90, 100, 130, 16),
                                              (120, 100, 130, 16), (0, 0, 50, 16),
                                              (0, 10, 5000, 1024)])
def test_plan_chunks_keeps_the_span_in_one_chunk(start, qs, n, chunk):
  plan, si = features.plan_chunks(start, qs, n, chunk, 4096)
  qs_eff = max(qs, n - 4096)
  assert plan[si] == (qs_eff, n) and si == len(plan) - 1
  assert plan[0][0] == min(start, qs_eff) and plan[-1][1] == n
  assert all(a[1] == b[0] for a, b in itertools.pairwise(plan))           # contiguous
  assert all(c1 - c0 <= chunk for c0, c1 in plan[:-1]) and n - qs_eff <= 4096


def test_prepare_row_matches_runner_and_masks_span_system_template(llm):
  s = traces.parse_entry(_entry())
  messages, tools = traces.session_chat(s, llm.tokenizer)
  runner = SessionRunner(llm, cache=CacheConfig(num_pages=8, page_size=4))
  for i in (4, 6):
    p = features.prepare_row(llm.tokenizer, messages, tools, i)
    ref = runner.prepare(messages, tools, i)
    np.testing.assert_array_equal(p["ids"], ref["ids"])
    assert (p["qs"], p["sys_len"]) == (ref["qs"], ref["sys_len"])
    lab = p["labels"]
    assert (lab[:p["sys_len"]] == IGNORE).all() and (lab[p["qs"]:] == IGNORE).all()
    special = np.isin(p["ids"], [1, 2])                     # <|im_start|>, <|im_end|>
    assert (lab[special] == IGNORE).all()
    mid = (lab != IGNORE)
    np.testing.assert_array_equal(lab[mid] == 1, ref["evidence"][mid])
    assert (lab == 1).sum() > 0


def _dense_qk(llm, ids):
  """One-chunk forward over a fresh pool: (q [L, 1, T, Hq, D], k [L, 1, T, Hkv, D])."""
  n = ids.size
  pool = kv_state.init_pool(llm.config, CacheConfig(num_pages=n // 4 + 2, page_size=4,
                                                    max_seq_len=n))
  smap = (4 + np.arange(n, dtype=np.int32))[None]
  pos = np.arange(n, dtype=np.int32)[None]

  @jax.jit
  def fwd(weights, pool):
    model = nnx.merge(llm.graphdef, weights)
    out = model(jnp.asarray(ids[None]), jnp.asarray(pos), pool, slot_map=jnp.asarray(smap),
                capture=Capture(q=True))
    return out.q, out.kv.k[:, smap]
  return fwd(llm.weights, pool)


@pytest.mark.slow
def test_features_match_a_dense_replay(llm):
  """Chunked, prefix-cached extraction == one dense forward of the last prompt (prompts
  extend each other, so its causal q / k rows are every earlier row's too)."""
  s = traces.parse_entry(_entry())
  ex = features.Extractor(llm, CFG)
  feat = ex.session(s)
  messages, tools = traces.session_chat(s, llm.tokenizer)
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  assert [r["turn"] for r in feat["rows"]] == turns
  assert max(len(p) for p in feat["chunks"]) > 2           # really chunked (16 tokens)
  last = features.prepare_row(llm.tokenizer, messages, tools, turns[-1])["ids"]
  q, k = _dense_qk(llm, last)
  memory = None
  for r, plan in zip(feat["rows"], feat["chunks"]):
    p = features.prepare_row(llm.tokenizer, messages, tools, r["turn"])
    n, qs, sl = p["ids"].size, p["qs"], p["sys_len"]
    np.testing.assert_array_equal(p["ids"], last[:n])
    assert plan[-1] == (qs, n)                                # span = one chunk
    valid = np.zeros((1, n), bool)
    valid[0, qs:] = True
    memory = intentkv.update_memory(memory, intentkv.encode_query(q[:, :, :n], valid), 0.5)
    cand = np.zeros((1, n), bool)
    cand[0, sl:qs] = True
    rule = np.asarray(intentkv.rule_scores(memory, k[:, :, :n], jnp.asarray(cand))[0])
    assert r["rule"].shape == (qs - sl,) and r["labels"].shape == (qs - sl,)
    np.testing.assert_allclose(r["rule"], rule[sl:qs], atol=2e-4)
    np.testing.assert_allclose(r["mbar"], np.asarray(jnp.mean(memory, axis=(0, 2))[0]),
                               atol=1e-5)
    np.testing.assert_allclose(r["mnorm"], 1.0, atol=1e-5)
    np.testing.assert_array_equal(r["labels"], p["labels"][sl:qs])
    if qs > sl:
      assert abs(r["rule"].sum() - llm.config.num_layers * llm.config.num_heads) < 1e-3
  assert feat["kbar"].shape == (last.size, llm.config.head_dim)
  np.testing.assert_allclose(feat["kbar"], np.asarray(residual.mean_keys(k))[0], atol=1e-5)


@pytest.mark.slow
def test_training_rows_equal_what_the_pruning_event_receives(llm, monkeypatch):
  """The row the extractor stores for a turn is what `select_kept` feeds the head when
  that turn prunes in serving: same rule scores, k_bar, m_bar (the memory advanced
  on every earlier, unpruned request) and K_bar^q."""
  from jaxkv.config import PruningConfig
  s = traces.parse_entry(_entry())
  rows = features.Extractor(llm, CFG).session(s)
  messages, tools = traces.session_chat(s, llm.tokenizer)
  (row,) = features.unpack_rows(s.id, features.pack_session(rows), CFG.n_q)[-1:]
  last = next(r for r in rows["rows"] if r["turn"] == row.turn)   # the last row with evidence
  seen = []
  real = residual.phase2_scores

  def spy(head, inputs, candidates, **kw):
    jax.debug.callback(lambda *a: seen.append([np.asarray(x) for x in a]), *inputs, candidates)
    return real(head, inputs, candidates, **kw)

  monkeypatch.setattr(residual, "phase2_scores", spy)
  # turns before it stay under the budget; memory_capacity=777 makes a fresh trace
  cfg = PruningConfig(method="intentkv", intent_mode="learnable", budget=last["n"] - 1,
                      memory_capacity=777)
  runner = SessionRunner(llm, cfg, cache=CacheConfig(num_pages=512, page_size=4,
                                                     max_seq_len=2048),
                         prefill_chunk=64, head=residual.ResidualHead(llm.config.head_dim,
                                                                     rngs=nnx.Rngs(0)))
  turns = runner.run_session(s.id, messages, tools)
  first = [t.pruned for t in turns].index(True)
  assert turns[first].turn == row.turn and first >= 2     # earlier requests advanced M only
  rule, kbar, mbar, kq, kq_valid, cand = seen[0]
  n, qs, sl = last["n"], last["qs"], last["sys_len"]
  assert np.nonzero(cand[0])[0].tolist() == list(range(sl, qs))
  np.testing.assert_allclose(rule[0, sl:qs], last["rule"], atol=2e-4)
  np.testing.assert_allclose(kbar[0, :n], rows["kbar"][:n], atol=1e-4)
  np.testing.assert_allclose(mbar[0], last["mbar"], atol=1e-5)
  np.testing.assert_allclose(kq[0][kq_valid[0]], row.kq, atol=1e-4)
  assert len(rows["rows"]) >= 3 and all(t.memory_cos < 0.99 for t in turns[1:])


def test_cache_roundtrip_and_drop_rows_without_positives(llm, tmp_path):
  path = tmp_path / "tr.json"
  path.write_text(json.dumps([_entry("a"), _entry("b")]))
  cfg = dataclasses.replace(CFG, cache_dir=str(tmp_path / "cache"))
  rows = features.load_or_extract(cfg, str(path), llm=llm, progress=False, log=lambda m: None)
  assert set(rows) == {"a", "b"} and features.all_cached(
      dataclasses.replace(cfg, train_traces=str(path), val_traces=str(path)))
  again = features.load_or_extract(cfg, str(path), llm=None, progress=False, log=lambda m: None)
  for sid in rows:
    assert rows[sid] and all((r.labels == 1).any() for r in rows[sid])
    for r1, r2 in zip(rows[sid], again[sid]):
      np.testing.assert_array_equal(r1.rule, r2.rule)
      assert r1.kbar.shape == (r1.rule.size, llm.config.head_dim)
      assert 0 < r1.kq.shape[0] <= cfg.n_q


# ----------------------------------------------------------------------------- loss
def _random_batch(seed=0, b=2, t=40):
  rng = np.random.default_rng(seed)
  s = rng.normal(size=(b, t)).astype(np.float32)
  y = (rng.random((b, t)) < 0.15).astype(np.int32)
  y[rng.random((b, t)) < 0.2] = IGNORE
  y[0, -5:] = IGNORE
  y[:, 0] = 1
  return s, y


def _sig(x):
  return 1 / (1 + np.exp(-x))


def test_loss_terms_match_direct_formulas():
  s, y = _random_batch()
  for b in range(s.shape[0]):
    v = y[b] != IGNORE
    pos, neg = np.where(v & (y[b] == 1))[0], np.where(v & (y[b] == 0))[0]
    p = np.clip(pos.size / v.sum(), 0.02, 0.5)
    w = (1 - p) / p
    bce = np.mean([-(w * np.log(_sig(s[b, j]))) if y[b, j] == 1 else -np.log(1 - _sig(s[b, j]))
                   for j in np.where(v)[0]])
    hard = neg[np.argsort(-s[b, neg])][:4]
    rank = np.mean([np.log1p(np.exp(s[b, j] - s[b, i])) for i in pos for j in hard])
    np.testing.assert_allclose(loss.bce_loss(s, y)[b], bce, rtol=1e-5)
    np.testing.assert_allclose(loss.rank_loss(s, y, k=4)[b], rank, rtol=1e-5)
    np.testing.assert_allclose(loss.keep_penalty(s, y)[b], _sig(s[b, v]).mean(), rtol=1e-5)
  mn = np.abs(np.random.default_rng(1).normal(1, 0.3, (2, 3, 4))).astype(np.float32)
  np.testing.assert_allclose(loss.memory_norm_penalty(mn), ((mn - 1) ** 2).mean(axis=(1, 2)),
                             rtol=1e-5)
  total, terms = loss.total_loss(s, y, mn, hard_negatives=4)
  direct = np.mean(loss.bce_loss(s, y) + 0.05 * loss.rank_loss(s, y, 4)
                   + 0.01 * loss.keep_penalty(s, y) + 0.001 * loss.memory_norm_penalty(mn))
  np.testing.assert_allclose(total, direct, rtol=1e-5)
  assert set(terms) == {"bce", "rank", "keep", "mem"}


def test_ignored_labels_do_not_matter_and_positive_rate_is_clipped():
  s, y = _random_batch(3)
  s2 = np.where(y == IGNORE, s + 100.0, s)
  for f in (loss.bce_loss, loss.rank_loss, loss.keep_penalty):
    np.testing.assert_allclose(f(s, y), f(s2, y), rtol=1e-6)
  y_rare = np.zeros((1, 1000), np.int32)
  y_rare[0, 0] = 1
  np.testing.assert_allclose(loss.positive_weight(y_rare), 0.98 / 0.02, rtol=1e-6)
  y_dense = np.ones((1, 10), np.int32)
  np.testing.assert_allclose(loss.positive_weight(y_dense), 1.0)


# ----------------------------------------------------------------------------- training
def _synthetic_rows(n=6, d=16, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    t = int(rng.integers(20, 60))
    lab = (rng.random(t) < 0.1).astype(np.int8)
    lab[0] = 1
    lab[-2:] = IGNORE
    out.append(features.Row(session=f"s{i // 3}", turn=2 * (i % 3) + 2,
                            rule=rng.random(t).astype(np.float32),
                            labels=lab, kbar=rng.normal(size=(t, d)).astype(np.float32),
                            kq=rng.normal(size=(7, d)).astype(np.float32),
                            mbar=rng.normal(size=d).astype(np.float32),
                            mnorm=np.ones((2, 4), np.float32)))
  return out


def test_features_from_batch_equal_token_features():
  rng = np.random.default_rng(0)
  k = rng.normal(size=(2, 1, 12, 2, 16)).astype(np.float32)
  mem = rng.normal(size=(2, 1, 4, 16)).astype(np.float32)
  cand = np.zeros((1, 12), bool)
  cand[0, 3:9] = True
  rule = np.asarray(intentkv.rule_scores(mem, k, cand))
  phi = residual.token_features(k, mem, rule, cand)
  batch = dict(kbar=np.asarray(residual.mean_keys(k))[:, 3:9], mbar=mem.mean(axis=(0, 2)),
               rule=rule[:, 3:9], cand=np.ones((1, 6), bool))
  np.testing.assert_allclose(train.features_from_batch(batch), phi[:, 3:9], atol=1e-6)


def test_one_step_decreases_the_loss_and_day_zero_is_the_rule():
  cfg = dataclasses.replace(CFG, grad_accum=1)
  rows = _synthetic_rows()
  batch = train.make_batch(rows[:3])
  graphdef, state = nnx.split(residual.ResidualHead(16, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  s0 = jax.jit(train.head_scores, static_argnums=0)(graphdef, params, batch)
  np.testing.assert_array_equal(s0, np.where(batch["cand"], batch["rule"], 0))  # fc2 = 0
  tx = train.make_optimizer(cfg)
  opt = tx.init(params)
  lc = train.loss_settings(cfg)
  before = float(train.eval_step(graphdef, params, batch, lc=lc)[0])
  params, opt, value, _ = train.train_step(graphdef, params, opt, batch, tx=tx, lc=lc)
  np.testing.assert_allclose(value, before, rtol=1e-6)
  after = float(train.eval_step(graphdef, params, batch, lc=lc)[0])
  assert after < before


def test_reservoir_sample_is_deterministic_and_in_replay_order():
  rows = {f"s{i}": [features.Row(f"s{i}", t, *([None] * 6)) for t in (2, 4, 6)]
          for i in range(10)}
  a = train.epoch_rows(rows, 12, 42, 0)
  b = train.epoch_rows(rows, 12, 42, 0)
  c = train.epoch_rows(rows, 12, 42, 1)
  assert len(a) == 12 and [(r.session, r.turn) for r in a] == [(r.session, r.turn) for r in b]
  assert [(r.session, r.turn) for r in a] != [(r.session, r.turn) for r in c]
  for x, y in itertools.pairwise(a):
    assert x.session != y.session or x.turn < y.turn
  assert len(train.epoch_rows(rows, 100, 42, 0)) == 30


@pytest.mark.slow
def test_checkpoint_roundtrip_and_resume(tmp_path):
  cfg = dataclasses.replace(CFG, out_dir=str(tmp_path / "run"), epochs=1, examples_per_epoch=4,
                            grad_accum=2, recall_budget=8)
  rows = _synthetic_rows()
  by_s = {}
  for r in rows:
    by_s.setdefault(r.session, []).append(r)
  res = train.train(cfg, by_s, rows[:2], log=lambda m: None)
  graphdef, state = load_head(res["head"])
  head = nnx.merge(graphdef, state)
  assert residual.num_params(head) > 0 and head.head_dim == 16
  rng = np.random.default_rng(0)                      # the inference path takes it as is
  k = rng.normal(size=(2, 1, 10, 2, 16)).astype(np.float32)
  mem = intentkv.unit_norm(rng.normal(size=(2, 1, 4, 16)).astype(np.float32))
  cand, span = np.zeros((1, 10), bool), np.zeros((1, 10), bool)
  cand[0, 2:7], span[0, 7:] = True, True
  sc = residual.learnable_scores((graphdef, state), k, mem, cand, span)
  assert sc.shape == (1, 10) and np.isfinite(np.asarray(sc)).all()
  mgr = train._manager(tmp_path / "run" / "ckpt", 3)
  p0 = nnx.to_pure_dict(state)
  tx = train.make_optimizer(cfg)
  got = train.restore_checkpoint(mgr, p0, tx.init(p0))
  assert got is not None and got[2] == {"epoch": 1, "micro": 0}
  jax.tree.map(np.testing.assert_array_equal, got[0], p0)       # final head == last ckpt
  # explicit save / restore round trip of params + optimiser state
  mgr2 = train._manager(tmp_path / "rt", 2)
  opt = jax.tree.map(lambda x: x + 1, tx.init(p0))
  train.save_checkpoint(mgr2, 7, p0, opt, {"epoch": 0, "micro": 3})
  back = train.restore_checkpoint(mgr2, jax.tree.map(jnp.zeros_like, p0), tx.init(p0))
  jax.tree.map(np.testing.assert_array_equal, back[0], p0)
  jax.tree.map(np.testing.assert_array_equal, back[1], opt)
  lines = (tmp_path / "run" / "log.csv").read_text().splitlines()
  assert len(lines) == 1 + 4
  assert lines[0].split(",")[:3] == ["epoch", "micro", "update"]
  assert [int(x.split(",")[2]) for x in lines[1:]] == [0, 1, 1, 2]   # grad-accum 2
  # rerun: resumes after the last epoch, trains nothing, same head
  res2 = train.train(cfg, by_s, rows[:2], log=lambda m: None)
  assert (tmp_path / "run" / "log.csv").read_text().splitlines() == lines
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(load_head(res2["head"])[1]), p0)
  assert res2["history"][-1]["epoch"] == 1
  metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert metrics[0]["epoch"] == 0 and metrics[-1]["epoch"] == 1
  assert metrics[0]["recall_phase1"] == metrics[0]["recall_phase2"]   # day zero = the rule
  assert {"val_loss", "recall_phase1", "recall_phase2", "alpha"} <= set(metrics[-1])
  # resuming into a second epoch == an uninterrupted two-epoch run (same sample, Adam state)
  cfg2 = dataclasses.replace(cfg, epochs=2)
  res3 = train.train(cfg2, by_s, rows[:2], log=lambda m: None)
  fresh = train.train(dataclasses.replace(cfg2, out_dir=str(tmp_path / "fresh")), by_s, rows[:2],
                      log=lambda m: None)
  assert len((tmp_path / "run" / "log.csv").read_text().splitlines()) == 1 + 8
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(load_head(res3["head"])[1]),
               nnx.to_pure_dict(load_head(fresh["head"])[1]))


def test_recall_at_budget_compares_rule_and_phase2():
  r = loss.RecallAtBudget(2)
  rule = np.array([5., 4., 3., 2., 1., 0.])
  labels = np.array([0, 0, IGNORE, 0, 1, 1], np.int8)
  r.add(rule, rule[::-1].copy(), labels)            # phase 2 ranks the positives first
  r.add(np.array([0., 1.]), np.array([1., 0.]), np.array([1, 0], np.int8))  # window <= C*
  m = r.summary()
  assert m["recall_phase1"] == pytest.approx(1 / 3) and m["recall_phase2"] == 1.0
  assert m["recall_phase1_over"] == 0.0 and m["rows_over_budget"] == 1
  # chance: a random 2 of the first window's 6 keeps 2 * 2/6 of its positives; the
  # second window fits the budget whole
  assert m["recall_random"] == pytest.approx((2 * 2 / 6 + 1) / 3)
  assert m["recall_random_over"] == pytest.approx(2 / 6)


def test_training_curve_png(tmp_path):
  """scripts/plot_training.py renders log.csv + metrics.jsonl of a real (tiny) run."""
  import importlib.util
  import pathlib
  spec = importlib.util.spec_from_file_location(
      "plot_training", pathlib.Path(__file__).resolve().parents[1] / "scripts/plot_training.py")
  plot_training = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(plot_training)
  np.testing.assert_allclose(plot_training.moving_average(np.array([1., 3, 5, 7]), 2),
                             [1, 2, 4, 6])
  cfg = dataclasses.replace(CFG, out_dir=str(tmp_path / "run"), epochs=2, examples_per_epoch=4,
                            grad_accum=2, recall_budget=8)
  rows = _synthetic_rows()
  train.train(cfg, {"s0": rows[:3], "s1": rows[3:]}, rows[:2], log=lambda m: None)
  cols, metrics = plot_training.read_run(tmp_path / "run")
  assert cols["loss"].size == 8 and [m["epoch"] for m in metrics] == [0, 1, 2]
  png = plot_training.plot(tmp_path / "run", tmp_path / "curve.png", smooth=2)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  with pytest.raises(FileNotFoundError, match=re.escape("log.csv")):
    plot_training.read_run(tmp_path)
