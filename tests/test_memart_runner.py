"""MemArtRunner on a random 3-layer model with SmolLM2's real tokenizer: splicing
every block in order reproduces a full-context prefill (layer-0 K exactly, the
whole forward for one span), the byte budget holds with least-retrieved
eviction and no leaked slot, an empty memory still answers. Quality on real
weights is bench/memart.py's job. Tolerances: 1e-5 on layer-0 keys (fp32
rotation), 1e-4 on logits."""

import jax.numpy as jnp
import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, MemArtConfig
from jaxkv.engine.driver import chunk_step
from jaxkv.engine.memart import MemArtRunner
from jaxkv.engine.prefill_work import drain, run_chunk
from jaxkv.kv import plan as plan_lib
from jaxkv.kv import state as kv_state
from jaxkv.kv.splice import rerotate
from jaxkv.kv.state import SENTINEL
from jaxkv.policies.memory import memart

CACHE = CacheConfig(num_pages=128, page_size=16, max_seq_len=1024)


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer(num_layers=3)


def _ids(llm, text):
  return np.asarray(llm.tokenizer.encode(text, add_bos=False), np.int32)


def _full(llm, ids):
  """Full prefill of ids at 0..n-1 into a fresh pool: (last logits, pool, slots)."""
  pool = kv_state.init_pool(llm.config, CACHE)
  n = ids.size
  c, w = plan_lib.chunk_len(n), plan_lib.width(n)
  slots = 16 + np.arange(n, dtype=np.int32)
  pos = np.where(np.arange(c) < n, np.arange(c), -1).astype(np.int32)
  out, pool = chunk_step(llm.graphdef, llm.weights, pool,
                         jnp.asarray(np.pad(ids, (0, c - n))[None]), jnp.asarray(pos[None]),
                         jnp.asarray(plan_lib.slot_rows([slots], w)),
                         read=jnp.asarray([[n - 1]], np.int32), attn_impl="reference",
                         return_logits=True)
  return np.asarray(out.logits[0, 0]), pool, slots


def test_all_blocks_in_order_reproduce_full_context(llm):
  head = _ids(llm, "<|im_start|>user\n")
  spans = [_ids(llm, t) for t in ("Alice said the train leaves at nine from platform four.",
                                  " Bob said he would bring the tickets and two umbrellas.",
                                  " Carol asked whether the museum opens on Mondays in May.")]
  tail = _ids(llm, " When does the train leave?<|im_end|>\n<|im_start|>assistant\n")
  r = MemArtRunner(llm, MemArtConfig(), head, cache=CACHE, attn_impl="reference")
  mem = r.new_memory(capacity=2)                       # grows as spans arrive
  rows = [r.write(mem, s, tag=i) for i, s in enumerate(spans)]
  assert [mem.tags[x] for x in np.concatenate(rows)] == [
      i for i, s in enumerate(spans) for _ in range(-(-s.size // 16))]
  # layer 0: the spliced keys, rotated by their shifts, equal a full prefill's
  hist = np.concatenate(spans)
  _, pool, slots = _full(llm, np.concatenate([head, hist, tail]))
  allrows = np.concatenate(rows)
  ok = mem.slots[allrows] != SENTINEL
  mslots, mpos = mem.slots[allrows][ok], mem.positions[allrows][ok]
  new_pos = head.size + np.arange(mslots.size, dtype=np.int32)
  k_mem = rerotate(r.driver.kv.k[:1, mslots], jnp.asarray(mpos), jnp.asarray(new_pos), r.inv_freq)
  k_full = pool.k[:1, slots[head.size:head.size + hist.size]]
  np.testing.assert_allclose(np.asarray(k_mem), np.asarray(k_full), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(r.driver.kv.v[0, mslots]),     # chunk shapes differ:
                             np.asarray(pool.v[0, slots[head.size:head.size + hist.size]]),
                             atol=1e-6, rtol=1e-6)                   # matmul blocking only
  # one span: the whole forward (spliced at its own positions, shift 0) = full prefill
  r2 = MemArtRunner(llm, MemArtConfig(), head, cache=CACHE, attn_impl="reference")
  mem2 = r2.new_memory()
  rows2 = r2.write(mem2, hist)
  want, _, _ = _full(llm, np.concatenate([head, hist, tail]))
  got = r2.answer(mem2, tail, 4, blocks=rows2)
  np.testing.assert_allclose(got.logits, want, atol=1e-4, rtol=1e-4)
  assert got.prefill_tokens == tail.size and got.probe_tokens == 0
  assert int(got.tokens[0]) == int(np.argmax(want))
  assert got.decode_kv_len == head.size + hist.size + tail.size + got.tokens.size
  # an aliased splice re-positioned: the same span written twice, the second copy
  # spliced alone lands at the first's positions; logits equal the single-span run
  rows3 = r2.write(mem2, hist)
  again = r2.answer(mem2, tail, 4, blocks=rows3)
  np.testing.assert_array_equal(again.tokens, got.tokens)
  r.alloc.check()
  r2.alloc.check()


def test_chunked_prefill_equals_one_chunk(llm):
  """A long span written (and a tail prefilled) in chunks of 7 tokens, chunk edges off
  the 16-token pages: the same logits and tokens as one chunk; a probe longer than a
  chunk is refused."""
  head = _ids(llm, "<|im_start|>user\n")
  hist = _ids(llm, "Alice said the train leaves at nine from platform four. Bob said he "
                   "would bring the tickets and two umbrellas. Carol asked about May.")
  tail = _ids(llm, " When does the train leave?<|im_end|>\n<|im_start|>assistant\n")
  want, _, _ = _full(llm, np.concatenate([head, hist, tail]))
  r = MemArtRunner(llm, MemArtConfig(), head, cache=CACHE, attn_impl="reference",
                   prefill_chunk=7)
  mem = r.new_memory()
  rows = r.write(mem, hist)
  np.testing.assert_array_equal(mem.positions[rows][mem.slots[rows] != SENTINEL],
                                head.size + np.arange(hist.size))
  got = r.answer(mem, tail, 4, blocks=rows)
  np.testing.assert_allclose(got.logits, want, atol=1e-4, rtol=1e-4)
  assert int(got.tokens[0]) == int(np.argmax(want))
  with pytest.raises(ValueError, match="prefill_chunk"):
    r.answer(mem, tail, 4, top_k=1)                   # more blocks than k: a probe
  r.forget(mem)
  r.close()
  r.alloc.check()
  assert r.alloc.num_used_pages == 0                  # the refused probe held nothing
  with pytest.raises(ValueError, match="prefill_chunk"):
    MemArtRunner(llm, MemArtConfig(), head, cache=CACHE, prefill_chunk=0)


def test_prefill_work_chunked_or_packed_equals_alone(llm):
  """The engine's side of a runner's prefill work (`prefill_work.run_chunk`): a probe
  run in chunks of 5 tokens gives its one-chunk queries (valid tokens within 1e-5, the
  same positions), and two probes and a question packed into one call per round equal
  each run alone (logits and queries within 1e-5)."""
  r, mem, rng = _random_memory(llm, MemArtConfig(), spans=3, dead=1)
  tails = [rng.integers(100, 40000, n).astype(np.int32) for n in (12, 9)]
  q1, p1 = r.probe(tails[0])
  q5, p5 = drain(r.probe_steps(tails[0]), r.driver, 5)
  assert q5.shape[2] == 16 and np.all(p5[12:] == -1)         # joined, padded to 2^k
  np.testing.assert_array_equal(p5[:12], p1[:12])
  np.testing.assert_allclose(np.asarray(q5[:, :, :12]), np.asarray(q1[:, :, :12]),
                             atol=1e-5, rtol=0)
  seqs = [r.alloc.new_sequence() for _ in range(2)]
  try:
    alone = [r.probe(t) for t in tails]
    want = r.prefill_into(seqs[0], mem, tails[1], 4, top_k=2)
    gens = [r.probe_steps(t) for t in tails] + [
        r.prefill_into_steps(seqs[1], mem, tails[1], 4, top_k=2)]
    works = [next(g) for g in gens]
    got = [None] * 3
    while any(w is not None for w in works):
      live = [i for i, w in enumerate(works) if w is not None]
      for i, done in zip(live, run_chunk(r.driver, [works[i] for i in live], 4)):
        if done is None:
          continue
        try:
          works[i] = gens[i].send(done)
        except StopIteration as end:
          works[i], got[i] = None, end.value
    for (q, p), (qa, pa) in zip(got[:2], alone):
      n = int((pa >= 0).sum())
      np.testing.assert_array_equal(p[:n], pa[:n])
      np.testing.assert_allclose(np.asarray(q[:, :, :n]), np.asarray(qa[:, :, :n]),
                                 atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got[2].blocks, want.blocks)
    np.testing.assert_allclose(got[2].logits, want.logits, atol=1e-5, rtol=0)
  finally:
    for seq in seqs:
      r.alloc.free_sequence(seq)
  r.alloc.check()


def test_budget_holds_least_retrieved_go_first_and_nothing_leaks(llm):
  head = _ids(llm, "<|im_start|>user\n")
  r = MemArtRunner(llm, MemArtConfig(byte_budget=0), head, cache=CACHE, attn_impl="reference")
  budget = 6 * r.block_nbytes()
  r.cfg = MemArtConfig(byte_budget=budget)
  mem = r.new_memory()
  rng = np.random.default_rng()
  spans = [rng.integers(100, 40000, 32).astype(np.int32) for _ in range(3)]   # 2 blocks each
  first = r.write(mem, spans[0], tag=0)
  second = r.write(mem, spans[1], tag=1)
  r.answer(mem, spans[2][:8], 2, blocks=first)        # the first span is retrieved once
  r.write(mem, spans[2], tag=2)
  assert mem.nbytes <= budget and mem.num_blocks == 6
  r.write(mem, spans[0], tag=3)                       # 2 blocks must go: the unretrieved 2nd
  assert mem.nbytes <= budget
  live_tags = sorted(mem.tags[i] for i in np.flatnonzero(mem.live))
  assert live_tags == [0, 0, 2, 2, 3, 3]               # rows of tag 1 freed (and reused)
  assert mem.live[first].all() and [mem.tags[i] for i in second] == [3, 3]
  r.alloc.check()
  with pytest.raises(ValueError, match="byte_budget"):
    r.write(mem, rng.integers(100, 40000, 200).astype(np.int32))
  r.forget(mem)
  r.close()
  r.alloc.check()
  assert r.alloc.num_used_pages == 0


def test_empty_memory_still_answers(llm):
  head = _ids(llm, "<|im_start|>user\n")
  r = MemArtRunner(llm, MemArtConfig(), head, cache=CACHE, attn_impl="reference")
  mem = r.new_memory()
  out = r.answer(mem, _ids(llm, " Hello?<|im_end|>\n<|im_start|>assistant\n"), 5)
  assert out.blocks.size == 0 and out.tokens.size == 5 and out.probe_tokens == 0
  r.alloc.check()


def _random_memory(llm, cfg, *, spans: int, dead: int):
  """A runner whose memory holds `spans` random spans of 20-60 tokens, row `dead`
  evicted (a dead row in the middle): (runner, memory, rng)."""
  r = MemArtRunner(llm, cfg, _ids(llm, "<|im_start|>user\n"), cache=CACHE,
                   attn_impl="reference")
  mem = r.new_memory()
  rng = np.random.default_rng()
  for i in range(spans):
    r.write(mem, rng.integers(100, 40000, int(rng.integers(20, 60))).astype(np.int32), tag=i)
  r.evict(mem, dead)
  return r, mem, rng


def test_host_select_equals_jitted_rank(llm):
  """The bench's host top-k (`select` over `scores`) = the jitted `rank` for
  every strategy and several k."""
  r, mem, rng = _random_memory(llm, MemArtConfig(), spans=4, dead=2)
  pr = r.probe(rng.integers(100, 40000, 12).astype(np.int32))
  for norm, agg in (("softmax", "max"), ("softmax", "sum"), ("rr", "max"), ("rr", "sum")):
    sc = r.scores(mem, pr, norm=norm, agg=agg)
    for k in (1, 3, 50):
      np.testing.assert_array_equal(r.select(mem, sc, k), r.rank(mem, pr, k, norm=norm, agg=agg))


@pytest.mark.parametrize("rerank,neighbors", [(0, 0), (4, 0), (0, 1)])
def test_a_memory_within_top_k_is_retrieved_whole_without_a_probe(llm, rerank, neighbors):
  """With at most top_k live blocks retrieval returns them all, chronological, without
  running the probe (probe_tokens 0): what the scored path (`rank` of a probe) returns
  for the same memory, for plain, re-ranked and windowed retrieval."""
  r, mem, rng = _random_memory(llm, MemArtConfig(rerank=rerank, neighbors=neighbors),
                               spans=4, dead=2)
  live, tail = mem.num_blocks, rng.integers(100, 40000, 12).astype(np.int32)
  assert not r.needs_probe(mem, live) and r.needs_probe(mem, live - 1)
  calls = []
  probe = r.probe_steps
  r.probe_steps = lambda *a: calls.append(1) or (yield from probe(*a))
  got = r.retrieve(mem, tail, live)
  assert calls == []
  np.testing.assert_array_equal(got, r.rank(mem, r.probe(tail), live))
  assert np.all(np.diff(mem.time[got]) > 0) and got.size == live
  seq = r.alloc.new_sequence()
  try:
    assert r.prefill_into(seq, mem, tail, 4, top_k=live).probe_tokens == 0
  finally:
    r.alloc.free_sequence(seq)
  seq = r.alloc.new_sequence()
  try:
    assert r.prefill_into(seq, mem, tail, 4, top_k=live - 1).probe_tokens == tail.size
  finally:
    r.alloc.free_sequence(seq)
  r.alloc.check()


def test_bench_layout_spans_hold_each_turn(llm):
  """bench/memart.py's layout: each turn's token span decodes to its rendered
  line, sessions concatenate to the history, and the blocks holding a turn are
  credited with it (the evidence rule), a part of them is not."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
  import memart_layout as bench  # pylint: disable=import-outside-toplevel
  from jaxkv.data import conversations as C  # pylint: disable=import-outside-toplevel
  conv = C.parse_locomo(json_sample())[0]
  tok = llm.tokenizer
  lay = bench.layout(tok, conv)
  for (ids, spans), s in zip(lay.sessions, conv.sessions):
    for t in s.turns:
      lo, hi = spans[t.dia_id]
      assert tok.decode(ids[lo:hi].tolist()).strip() == C.render_turn(t)
  assert lay.history().size == sum(ids.size for ids, _ in lay.sessions)
  ids, voters = bench.tail_ids(tok, lay, "Where is it?")
  assert "Question: Where is it?" in tok.decode(ids.tolist())
  assert tok.decode(ids[voters].tolist()).strip() == "Where is it?"
  head = bench.layout(tok, conv, "head")                 # the instruction held in the head
  assert "conversations below" in tok.decode(head.head.tolist())
  np.testing.assert_array_equal(head.history(), lay.history())
  h_ids, h_voters = bench.tail_ids(tok, head, "Where is it?")
  assert "Based on" not in tok.decode(h_ids.tolist()) and h_ids.size < ids.size - 20
  assert tok.decode(h_ids[h_voters].tolist()).strip() == "Where is it?"
  r = MemArtRunner(llm, MemArtConfig(), lay.head, cache=CACHE, attn_impl="reference")
  mem = r.new_memory()
  rows = np.concatenate([r.write(mem, ids, tag=i) for i, (ids, _) in enumerate(lay.sessions)])
  spans = [sp for _, sp in lay.sessions]
  lo, hi = spans[1]["D2:1"]
  hit = [x for x in rows if mem.tags[x] == 1 and mem.spans[x][0] < hi and lo < mem.spans[x][1]]
  other = [x for x in rows if mem.tags[x] == 0]
  qa = C.QA("What did Ann say?", "not in the turn", ("D2:1",), 4)   # credit: the whole turn
  (span,) = bench.answer_spans(tok, lay, conv, qa)
  assert span == (1, lo, hi)
  assert bench.credited(bench.block_tokens(mem, hit), span)
  assert not bench.credited(bench.block_tokens(mem, other), span)
  assert not bench.credited(bench.block_tokens(mem, hit[1:]), span)   # first block missing


def json_sample():
  turns = lambda s, n: [{"speaker": "Ann" if j % 2 else "Bob", "dia_id": f"D{s}:{j + 1}",
                         "text": f"Session {s} line {j} about the blue kettle."} for j in range(n)]
  return [{"sample_id": "x", "conversation": {
      "speaker_a": "Ann", "speaker_b": "Bob", "session_1": turns(1, 5),
      "session_1_date_time": "1:00 pm on 1 May, 2023", "session_2": turns(2, 4),
      "session_2_date_time": "2:00 pm on 2 May, 2023"}, "qa": []}]


def test_exact_scores_equal_the_bound_for_one_token_blocks(llm):
  """With 1-token blocks a box is its key (lo = hi = k), so eq. 3's bound is the
  exact content-only q.k: `exact_scores` (every block's keys read) must equal
  `scores` (boxes only); with 16-token blocks the bound's scores differ."""
  head = _ids(llm, "<|im_start|>user\n")
  rng = np.random.default_rng()
  for bs in (1, 16):
    r = MemArtRunner(llm, MemArtConfig(block_size=bs), head,
                     cache=CacheConfig(num_pages=1024 // bs, page_size=bs, max_seq_len=1024),
                     attn_impl="reference")
    mem = r.new_memory()
    for i, n in enumerate((37, 52)):
      r.write(mem, rng.integers(100, 40000, n).astype(np.int32), tag=i)
    pr = r.probe(rng.integers(100, 40000, 9).astype(np.int32))
    for agg in ("max", "sum"):
      exact, bound = r.exact_scores(mem, pr, agg=agg), r.scores(mem, pr, agg=agg)
      live = mem.live
      assert np.all(np.isinf(exact[~live])) and np.all(np.isfinite(exact[live]))
      if bs == 1:
        np.testing.assert_allclose(exact[live], bound[live], rtol=1e-5, atol=1e-7)
      else:
        assert not np.allclose(exact[live], bound[live], rtol=1e-3)


def test_rerank_rescores_the_bounds_candidates_exactly(llm):
  """`rerank=R`: the result lies in the bound's top R x k; when R x k covers every
  live block it is the exact-score top k (`select` over `exact_scores`), for each
  strategy; answering with it splices those blocks and leaks nothing."""
  r, mem, rng = _random_memory(llm, MemArtConfig(rerank=2, top_k=3), spans=5, dead=3)
  pr = r.probe(rng.integers(100, 40000, 10).astype(np.int32))
  live = int(mem.live.sum())
  for norm, agg in (("softmax", "max"), ("rr", "sum")):
    exact = r.exact_scores(mem, pr, norm=norm, agg=agg)
    for k in (1, 2, 4):
      got = r.rank(mem, pr, k, norm=norm, agg=agg, rerank=live)      # every block a candidate
      np.testing.assert_array_equal(got, r.select(mem, exact, k))
  cand = set(r.rank(mem, pr, 6, rerank=0).tolist())
  got = r.rank(mem, pr)                                # the config: rerank 2 x top_k 3
  assert got.size == 3 and set(got.tolist()) <= cand
  assert (np.diff(mem.time[got]) > 0).all()           # chronological
  tail = rng.integers(100, 40000, 10).astype(np.int32)
  out = r.answer(mem, tail, 3)
  np.testing.assert_array_equal(out.blocks, r.retrieve(mem, tail))
  r.forget(mem)
  r.alloc.check()


def test_neighbors_through_the_runner(llm):
  """`neighbors=1` in `rank`: the bound's scores (or, re-ranked over every live
  block, the exact ones) `dilate`d over the memory's spans, then top-k, the
  window's best block first; the picks come in windows (each next to another
  pick of its span, or a window cut to one block by k or an edge)."""
  r, mem, rng = _random_memory(llm, MemArtConfig(top_k=5, neighbors=1), spans=4, dead=2)
  pr = r.probe(rng.integers(100, 40000, 10).astype(np.int32))
  live = int(mem.live.sum())

  def want(scores, k):
    d = memart.dilate(jnp.asarray(scores), jnp.asarray(mem.live), jnp.asarray(mem.time),
                      jnp.asarray(mem.segment), 1)
    got = np.asarray(memart.select_blocks(d, jnp.asarray(mem.live), jnp.asarray(mem.time), k,
                                          tie=jnp.asarray(scores)))
    return got[got >= 0]

  for k in (2, 5, 9):
    np.testing.assert_array_equal(r.rank(mem, pr, k), want(r.scores(mem, pr), k))
    np.testing.assert_array_equal(r.rank(mem, pr, k, rerank=live),
                                  want(r.exact_scores(mem, pr), k))
  np.testing.assert_array_equal(r.rank(mem, pr), want(r.scores(mem, pr), 5))  # the config
  out = r.answer(mem, rng.integers(100, 40000, 10).astype(np.int32), 2)
  assert out.blocks.size == 5 and (np.diff(mem.time[out.blocks]) > 0).all()
  r.forget(mem)
  r.alloc.check()
