"""LRAgent trajectories (plan / action / reflect spans) and joint role-adapter training
on a tiny random Llama with SmolLM2's real tokenizer and chat template."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import hf_util
from jaxkv.data import agents, traces
from jaxkv.models import lora
from jaxkv.training import lora_train


def _call(name, **a):
  return {"from": "assistant", "value": f"Thought: call {name}.\nAction: {name}\n"
                                        f"Action Input: {json.dumps(a)}"}


def _session(sid="s1", answer="Done: NO6JO3 is cancelled."):
  return traces.parse_entry({"id": sid, "conversations": [
      {"from": "system", "value": "You are a travel agent. Use the tools."},
      {"from": "user", "value": "I am mia_li_3668; cancel my Boston trip."},
      _call("get_user_details", user_id="mia_li_3668"),
      {"from": "function", "value": "reservations: NO6JO3 (BOS), AIXC01 (LAX)."},
      _call("cancel_reservation", reservation_id="NO6JO3"),
      {"from": "function", "value": "status: cancelled"},
      {"from": "assistant", "value": answer}]})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
  return hf_util.tiny_chat_llm(tmp_path_factory.mktemp("tiny_lora"))


def _text(llm, t, c):
  return llm.tokenizer.decode(t.ids[c.start:c.end].tolist(), skip_special_tokens=False)


def test_trajectory_spans(llm):
  t = agents.build(_session(), llm.tokenizer)
  assert [agents.ROLES[c.role] for c in t.calls] == ["plan", "action", "plan", "action", "plan",
                                                     "reflect"]
  got = [_text(llm, t, c).strip() for c in t.calls]
  assert got == ["Thought: call get_user_details.\nAction: get_user_details",
                 '{"user_id": "mia_li_3668"}',
                 "Thought: call cancel_reservation.\nAction: cancel_reservation",
                 '{"reservation_id": "NO6JO3"}', "Done: NO6JO3 is cancelled.", "Reflect[right]"]
  assert t.reflect_right is True and agents.REFLECT_REQUEST in t.text
  # token roles agree with the calls; everything else (tool output, cues, markup) is context
  role = np.full(len(t), agents.CONTEXT)
  for c in t.calls:
    role[c.start:c.end] = c.role
  np.testing.assert_array_equal(t.token_role, role)
  ctx = llm.tokenizer.decode(t.ids[t.token_role == agents.CONTEXT].tolist(),
                             skip_special_tokens=False)
  assert "reservations: NO6JO3" in ctx and "Action Input:" in ctx and "mia_li_3668;" in ctx
  # the stream is exactly the rendered session plus the reflection
  assert t.ids.tolist() == llm.tokenizer.encode(t.text, add_bos=False)


def test_wrong_answers_for_reflection(llm):
  sessions = [_session("a", "Done: NO6JO3 is cancelled."), _session("b", "Your trip is kept."),
              _session("c", "Refund issued.")]
  wrong = agents.negatives(sessions, llm.tokenizer, rate=1.0, seed=3)
  assert set(wrong) == {"a", "b", "c"}
  for sid, ans in wrong.items():
    own = agents.final_answer(next(s for s in sessions if s.id == sid), llm.tokenizer)
    assert ans != own
  t = agents.build(sessions[0], llm.tokenizer, wrong_answer=wrong["a"])
  assert t.reflect_right is False and wrong["a"] in t.text
  assert _text(llm, t, t.calls[-1]) == "Reflect[wrong]"
  assert agents.negatives(sessions, llm.tokenizer, rate=1.0, seed=3) == wrong   # deterministic
  assert agents.negatives(sessions, llm.tokenizer, rate=0.0) == {}


def test_examples_and_batches(llm):
  t = agents.build(_session(), llm.tokenizer)
  exs = lora_train.examples([t], max_context=20, max_target=5)
  assert len(exs) == len(t.calls)
  for ex, c in zip(exs, t.calls):
    assert ex.role == c.role and ex.prompt.size == min(20, c.start)
    np.testing.assert_array_equal(ex.prompt, t.ids[c.start - ex.prompt.size:c.start])
    np.testing.assert_array_equal(ex.target, t.ids[c.start:min(c.end, c.start + 5)])
  b = lora_train.make_batch(exs[1])
  p, g = exs[1].prompt.size, exs[1].target.size
  tok = b["tokens"][0]
  # hidden row index[j] sits one position before target j
  np.testing.assert_array_equal(tok[b["index"][0, :g] + 1], exs[1].target)
  assert b["mask"].sum() == g and (b["positions"][0, p + g:] == -1).all()
  assert lora_train.make_batch(exs[1], role=-1)["adapter"].tolist() == [-1]


@pytest.mark.slow
def test_training_lowers_loss_resumes_and_writes_peft(llm, tmp_path):
  sessions = [_session("a"), _session("b", "Your trip is kept.")]
  trajs = agents.build_all(sessions, llm.tokenizer, negative_rate=0.5, seed=0)
  exs = lora_train.examples(trajs, max_context=48, max_target=16)
  cfg = lora_train.LoraTrainConfig(out_dir=str(tmp_path / "run"), rank=4, steps=6,
                                   grad_accum=2, lr=1e-2, warmup=1, ckpt_every=2,
                                   val_examples_per_role=2, progress=False)
  res = lora_train.train(cfg, llm, exs, exs, log=lambda m: None)
  first, last = res["history"][0]["nll"], res["history"][-1]["nll"]
  assert set(first) == {"base", "plan", "action", "reflect"}
  for r in agents.ROLES:       # untrained adapters are the base model; trained ones fit better
    assert first[r][r] == pytest.approx(first["base"][r], abs=1e-6)
    assert last[r][r] < first[r][r]
  cfg_m, lw = lora.load_peft([tmp_path / "run" / "adapters" / r for r in agents.ROLES],
                             llm.config)
  assert cfg_m.names == agents.ROLES and cfg_m.rank == 4
  assert all(np.abs(np.asarray(lw.b[t])).max() > 0 for t in lw.targets)
  # resume: 3 more steps after the 6 above == an uninterrupted 9-step run
  cont = lora_train.train(dataclasses.replace(cfg, steps=9), llm, exs, exs, log=lambda m: None)
  fresh = lora_train.train(dataclasses.replace(cfg, steps=9, out_dir=str(tmp_path / "fresh")),
                           llm, exs, exs, log=lambda m: None)
  _, w1 = lora.load_peft([tmp_path / "run" / "adapters" / r for r in agents.ROLES], llm.config)
  _, w2 = lora.load_peft([tmp_path / "fresh" / "adapters" / r for r in agents.ROLES], llm.config)
  jax.tree.map(np.testing.assert_allclose, (w1.a, w1.b), (w2.a, w2.b))
  assert len((tmp_path / "run" / "log.csv").read_text().splitlines()) == 1 + 9
  assert cont["history"][-1]["step"] == fresh["history"][-1]["step"] == 9


def test_config_validation():
  with pytest.raises(ValueError, match="targets"):
    lora_train.LoraTrainConfig(targets=("q", "mlp"))
  with pytest.raises(ValueError, match="max_context"):
    lora_train.LoraTrainConfig(max_context=4)
