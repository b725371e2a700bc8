"""MemArt inside a composition (`jaxkv.engine.mechanisms.memart_region`): a pruned
session's earlier conversations become its memory, a new conversation's first call
recalls blocks for its question, and its row copies them into the region its prompt
carries. With pruning made a no-op the region's first answer equals MemArt's own
(the blocks aliased and key-shifted on read) on the same blocks and tail, token for
token; with no
memory the composition equals pruning alone; a later call of the conversation adopts
the region from the session's cache; what MemArt cannot do in a composition is
refused with the reason.

A random 3-layer model with SmolLM2's real tokenizer and chat template (as
tests/test_mechanism_memart.py)."""

import numpy as np
import pytest

import hf_util
from jaxkv.config import CacheConfig, EngineConfig, MemArtConfig, PruningConfig, SamplingConfig
from jaxkv.engine.engine import Engine, Request
from jaxkv.engine.mechanisms import composed
from jaxkv.engine.mechanisms import memart_region as region
from jaxkv.engine.mechanisms.memart import MemArt
from jaxkv.engine.mechanisms.pruned import Pruned
from jaxkv.engine.memart import MemArtSessions
from mechanism_util import clip

CACHE = CacheConfig(num_pages=512, page_size=16, max_seq_len=2048)
MAX = 10
SYSTEM = "You are a helpful assistant who remembers earlier conversations."
FIRST = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "My sister Ana lives in Lisbon and teaches piano. "
                                     "The spare key is under the blue flower pot."},
         {"role": "assistant", "content": "Noted: Ana in Lisbon, key under the blue pot."},
         {"role": "user", "content": "I adopted a grey cat called Biscuit last spring."}]
SECOND = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Where is the spare key?"}]
PAIR = "pruned+memart"


@pytest.fixture(scope="module")
def llm():
  return hf_util.random_llm_with_real_tokenizer(num_layers=3)


def _engine(llm, budget=4096, top_k=2, write_turns="all"):
  eng = Engine(llm.model, llm.tokenizer.stop_ids, CACHE,
               EngineConfig(max_batch=4, prefill_chunk=64, decode_steps=4))
  pr = eng.add_mechanism(Pruned(llm.tokenizer, llm.config, eng.kv_manager,
                                PruningConfig(method="intentkv", budget=budget)))
  sessions = MemArtSessions(llm, MemArtConfig(block_size=16, top_k=top_k,
                                                       write_turns=write_turns), CACHE,
                            system_prompt=SYSTEM, attn_impl="reference", kv=eng.kv_manager)
  ma = eng.add_mechanism(MemArt(sessions))
  eng.add_mechanism(composed.Composed([pr, ma]))
  return eng, pr, ma


def _recalled(eng, pr, ma, session, msgs):
  """(prompt, context, recall result) of a new conversation's first call, its recall run."""
  prompt, ctx = pr.context(session, msgs)
  todo = ma.turn(session, msgs, None, prompt, ctx)
  (rc,) = list(eng.run([Request("r", prompt[-1:], SamplingConfig(max_tokens=1),
                                mechanism="memart", context=todo)]))
  prompt, ctx = ma.turn(session, msgs, None, prompt, ctx, rc.extra["recall"])
  return prompt, ctx, rc.extra["recall"]


def _call(eng, pr, ma, session, msgs, rid):
  """One composed call as the server makes it: a recall first when it opens a new
  conversation with memory to write or read (`SessionBackends.engine_request`)."""
  prompt, ctx = pr.context(session, msgs)
  got = ma.turn(session, msgs, None, prompt, ctx)
  recall = None
  if isinstance(got, dict):
    (recall,) = list(eng.run([Request(f"{rid}-recall", prompt[-1:], SamplingConfig(max_tokens=1),
                                      mechanism="memart", context=got)]))
    assert recall.finish_reason in ("stop", "length"), recall.error
    got = ma.turn(session, msgs, None, prompt, ctx, recall.extra["recall"])
  prompt, ctx = got
  (res,) = list(eng.run([Request(rid, prompt, SamplingConfig(max_tokens=MAX), mechanism=PAIR,
                                 context=ctx)]))
  assert res.finish_reason in ("stop", "length"), res.error
  return res, prompt, ctx, recall


def test_with_pruning_a_no_op_a_new_conversation_answers_as_memart(llm):
  """The second conversation's first call: a recall writes the first conversation
  (its last reply included) and retrieves 2 blocks for the question; the composed
  row copies them into its region (every region token spliced, none prefilled) and
  gives what MemArt's own layout gives on the same blocks and tail (aliased,
  key-shifted on read): teacher-forced log-probabilities within 1e-5 and the same
  greedy tokens (a repeat of the call, its region adopted from the cache)."""
  eng, pr, ma = _engine(llm)
  _call(eng, pr, ma, "s", FIRST[:2], "a0")
  _call(eng, pr, ma, "s", FIRST, "a1")
  prompt, ctx, got = _recalled(eng, pr, ma, "s", SECOND)
  assert got["written_tokens"] > 0 and len(got["blocks"]) == 2 and got["memory_blocks"] > 2
  at, n = ctx["memart"]["at"], ctx["memart"]["n"]
  assert n == len(got["ids"]) > 16 and prompt[at:at + n] == got["ids"]
  runner, mem = ma.runner, ma.sessions.sessions["s"][0]
  assert prompt[:at] == runner.head.tolist()          # MemArt's head: system + user opening
  tail, blocks = np.asarray(prompt[at + n:], np.int32), np.asarray(got["blocks"])
  ref = runner.answer(mem, tail, MAX, blocks=blocks)
  forced = runner.answer(mem, tail, MAX, blocks=blocks, forced=ref.tokens)
  (tf,) = list(eng.run([Request("f", prompt, SamplingConfig(max_tokens=MAX), mechanism=PAIR,
                                context=ctx, forced=ref.tokens.tolist())]))
  assert tf.finish_reason == "length", tf.error
  assert tf.extra["mechanisms"] == ["pruned", "memart"] and not tf.extra["pruned"]
  assert tf.extra["memory_spliced_tokens"] == n and tf.extra["memory_written_tokens"] > 0
  np.testing.assert_allclose(tf.logprob, forced.logprobs, atol=1e-5)
  assert tf.argmax == ref.tokens.tolist()
  res, _, ctx2, recall = _call(eng, pr, ma, "s", SECOND, "b0")
  assert recall is None and ctx2["memart"] == dict(ctx["memart"], recall={})
  assert res.extra["memory_spliced_tokens"] == 0 and res.cached_tokens >= at + n
  assert res.tokens == clip(ref.tokens.tolist(), set(llm.tokenizer.stop_ids))
  eng.kv_manager.check()


def test_a_later_call_adopts_the_region_and_pruning_sees_it_as_history(llm):
  """The conversation's next call extends it: no recall, the region comes from the
  session's cache (nothing spliced, the prompt up to the new turn adopted); with a
  tight budget IntentKV prunes the history the region is part of."""
  eng, pr, ma = _engine(llm, budget=48)
  _call(eng, pr, ma, "s", FIRST, "a1")
  first, _, ctx, recall = _call(eng, pr, ma, "s", SECOND, "b0")
  assert recall is not None and first.extra["memory_spliced_tokens"] > 0
  reply = llm.tokenizer.decode(first.tokens)
  more = SECOND + [{"role": "assistant", "content": reply},
                   {"role": "user", "content": "And who teaches piano?"}]
  res, prompt, ctx2, recall2 = _call(eng, pr, ma, "s", more, "b1")
  assert recall2 is None and ctx2["memart"]["blocks"] == ctx["memart"]["blocks"]
  assert res.extra["memory_spliced_tokens"] == 0
  assert res.cached_tokens >= ctx2["memart"]["at"] + ctx2["memart"]["n"]
  assert ctx2["qs"] > ctx2["memart"]["at"] + ctx2["memart"]["n"]
  assert res.extra["pruned"]
  # a prompt that does not start with the template's rendering up to the first user
  # message (here one token more in front) has nowhere for the region: none, and said
  p, c = pr.context("s", more)
  p2, c2 = ma.turn("s", more, None, [0, *p], c)
  assert p2 == [0, *p] and c2["memart"]["n"] == 0 and c2["memart"]["recall"]["region_skipped"]
  eng.kv_manager.check()


def test_a_new_region_that_starts_like_the_last_one_adopts_that_part(llm):
  """A new conversation whose region begins with the last conversation's first block:
  the layout adopts that part of the region from the session's path (same tokens, same
  positions, the same copied K/V) and the row fills the rest; the whole region is cached
  as the session's private suffix again (its adopted part included), so the call ends
  cleanly and the conversation's next call adopts all of it."""
  eng, pr, ma = _engine(llm)
  _call(eng, pr, ma, "s", FIRST, "a1")
  _, _, ctx, _ = _call(eng, pr, ma, "s", SECOND, "b0")
  mem = ma.sessions.sessions["s"][0]
  last = ctx["memart"]["blocks"]
  others = [int(b) for b in np.flatnonzero(mem.live) if b not in last][:1]
  blocks = np.asarray(last[:1] + others, np.int32)
  third = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": "What is the cat called?"}]
  prompt, ctx3 = pr.context("s", third)
  ma.conversations.pop("s")            # as if this question had retrieved `blocks`
  prompt, ctx3 = ma.turn("s", third, None, prompt, ctx3, {
      "blocks": blocks.tolist(), "ids": region.region_of(mem, blocks)[0].tolist()})
  (res,) = list(eng.run([Request("c0", prompt, SamplingConfig(max_tokens=MAX), mechanism=PAIR,
                                 context=ctx3)]))
  assert res.finish_reason in ("stop", "length"), res.error
  n, at = ctx3["memart"]["n"], ctx3["memart"]["at"]
  assert 0 < res.extra["memory_spliced_tokens"] < n and res.cached_tokens >= at + n
  more = third + [{"role": "assistant", "content": llm.tokenizer.decode(res.tokens)},
                  {"role": "user", "content": "And its colour?"}]
  again, _, _, recall = _call(eng, pr, ma, "s", more, "c1")
  assert recall is None and again.extra["memory_spliced_tokens"] == 0
  assert again.cached_tokens >= at + n
  eng.kv_manager.check()


def test_a_region_prefix_computed_exactly_is_adopted_as_exact(llm):
  """A region prefilled as text (a block evicted since the recall) is exact KV and is
  cached under shared keys; another session whose region begins with the same block
  adopts that part as exact, fills the rest from memory and caches only the filled
  part as private (the call ends cleanly; with the region's start as the private bound
  the adopted slots would be cached twice)."""
  eng, pr, ma = _engine(llm)
  _call(eng, pr, ma, "s", FIRST, "a1")
  prompt, ctx, _ = _recalled(eng, pr, ma, "s", SECOND)
  mem = ma.sessions.sessions["s"][0]
  blocks = ctx["memart"]["blocks"]
  ma.runner.evict(mem, blocks[-1:])
  (res,) = list(eng.run([Request("b", prompt, SamplingConfig(max_tokens=MAX), mechanism=PAIR,
                                 context=ctx)]))
  assert res.extra["memory_spliced_tokens"] == 0          # computed: exact, shared keys
  ma.sessions.sessions["t"] = ma.sessions.sessions["s"]     # a session sharing the memory
  other = [int(b) for b in np.flatnonzero(mem.live) if b not in blocks][:1]
  mine = np.asarray(blocks[:1] + other, np.int32)
  prompt, ctx = pr.context("t", SECOND)
  prompt, ctx = ma.turn("t", SECOND, None, prompt, ctx, {
      "blocks": mine.tolist(), "ids": region.region_of(mem, mine)[0].tolist()})
  (res,) = list(eng.run([Request("t", prompt, SamplingConfig(max_tokens=MAX), mechanism=PAIR,
                                 context=ctx)]))
  assert res.finish_reason in ("stop", "length"), res.error
  assert 0 < res.extra["memory_spliced_tokens"] < ctx["memart"]["n"]
  eng.kv_manager.check()


def test_with_no_memory_it_equals_pruning_alone(llm):
  """One conversation: nothing to recall, no region; tokens and pruning's report
  equal the pruned mechanism's alone, turn by turn, at a budget that prunes."""
  a, b = _engine(llm, budget=48), _engine(llm, budget=48)
  for i in (2, 4):
    msgs = FIRST[:i]
    prompt, ctx = a[1].context("s", msgs)
    (solo,) = list(a[0].run([Request(f"p{i}", prompt, SamplingConfig(max_tokens=MAX),
                                     mechanism="pruned", context=ctx)]))
    both, _, _, recall = _call(*b, "s", msgs, f"c{i}")
    assert recall is None and both.tokens == solo.tokens, i
    assert {k: both.extra[k] for k in solo.extra} == solo.extra, i
    assert both.extra["memory_region_tokens"] == 0


def test_a_region_whose_blocks_went_is_computed_instead(llm):
  """A block evicted between the recall and the call: the region is prefilled as
  prompt text (exact, not saved) and the call still answers."""
  eng, pr, ma = _engine(llm)
  _call(eng, pr, ma, "s", FIRST, "a1")
  prompt, ctx, _ = _recalled(eng, pr, ma, "s", SECOND)
  mem = ma.sessions.sessions["s"][0]
  ma.runner.evict(mem, ctx["memart"]["blocks"][:1])
  (res,) = list(eng.run([Request("b", prompt, SamplingConfig(max_tokens=MAX), mechanism=PAIR,
                                 context=ctx)]))
  assert res.finish_reason in ("stop", "length"), res.error
  assert res.extra["memory_spliced_tokens"] == 0 and res.extra["memory_region_tokens"] > 0
  eng.kv_manager.check()


def test_memart_needs_a_layout(llm):
  """MemArt only joins a row: alone with a planner, or with SemShareKV, it is refused."""
  eng, pr, ma = _engine(llm)
  with pytest.raises(ValueError, match="lays out"):
    composed.check([ma, _Planner()])
  assert region.lines(FIRST, "ok")[-1] == "assistant: ok" and "system" not in "".join(
      region.lines(FIRST))


@pytest.mark.parametrize("turns", ["all", "inputs"])
def test_closed_conversation_lines_follow_write_turns(llm, turns):
  """Opening a new conversation closes the last: its recall writes the user's turns, and
  the model's (the earlier one sent back and the reply generated last) only under
  write_turns "all"."""
  eng, pr, ma = _engine(llm, write_turns=turns)
  res = _call(eng, pr, ma, "a", FIRST, "first")[0]
  prompt, ctx = pr.context("a", SECOND)
  todo = ma.turn("a", SECOND, None, prompt, ctx)
  close = todo["recall"]["close"]
  assert [line.split(":")[0] for line in close if not line.startswith("assistant")] == [
      "user", "user"] and todo["recall"]["query"] == "Where is the spare key?"
  said = [line for line in close if line.startswith("assistant: ")]
  reply = llm.tokenizer.decode([t for t in res.tokens if t not in llm.tokenizer.stop_ids])
  assert said == ([f"assistant: {FIRST[2]['content']}", f"assistant: {reply}"]
                  if turns == "all" else [])


def test_write_turns_is_all_or_inputs():
  with pytest.raises(ValueError, match="write_turns"):
    MemArtConfig(write_turns="replies")


class _Planner(MemArt.__mro__[1]):
  """A stand-in planner (plans the prefill, no layout)."""
  name = "plan"
  owns_prefill = True

  def plan_prefill(self, row, tail_from, reuse_from=0, adapter=None):
    raise AssertionError
