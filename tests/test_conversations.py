"""LoCoMo-format conversations (MemArt's data): reading the released format as is,
clear errors on malformed files, the chitchat builder on the real package, and
LoCoMo's F1 / BLEU-1 on hand-computed cases."""

import json
import math
import re

import numpy as np
import pytest

from jaxkv.data import conversations as C

LOCOMO_SAMPLE = [{
    "sample_id": "conv-26",
    "conversation": {
        "speaker_a": "Caroline", "speaker_b": "Melanie",
        "session_2_date_time": "1:14 pm on 25 May, 2023",
        "session_2": [{"speaker": "Melanie", "dia_id": "D2:1", "text": "Hey!"}],
        "session_1_date_time": "1:56 pm on 8 May, 2023",
        "session_1": [
            {"speaker": "Caroline", "dia_id": "D1:1", "text": "Hey Mel! Good to see you!"},
            {"speaker": "Melanie", "dia_id": "D1:2", "text": "Look at this.",
             "img_url": ["http://x"], "blip_caption": "a photo of a dog"}],
    },
    "observation": {"session_1_observation": {}},
    "qa": [
        {"question": "When did Melanie say hey?", "answer": 2023, "evidence": ["D2:1"],
         "category": 2},
        {"question": "What did Melanie share?", "answer": "a dog photo",
         "evidence": ["D1:2", "D9:9"], "category": 4},
        {"question": "Adversarial?", "adversarial_answer": "x", "evidence": [], "category": 5},
    ],
}]


def test_reads_locomo_as_released(tmp_path):
  path = tmp_path / "locomo.json"
  path.write_text(json.dumps(LOCOMO_SAMPLE))
  (conv,) = C.load_locomo(str(path))
  assert [s.index for s in conv.sessions] == [1, 2]            # numeric order, not key order
  assert conv.sessions[0].date_time == "1:56 pm on 8 May, 2023"
  assert conv.sessions[0].turns[1].text == "Look at this. [shares a photo of a dog]"
  assert len(conv.qa) == 2                                     # the adversarial one is skipped
  assert conv.qa[0].answer == "2023" and conv.qa[0].category == 2
  assert conv.qa[1].evidence == ("D1:2",)                      # unknown dia_ids dropped
  # round trip through our writer
  C.dump_locomo([conv], str(tmp_path / "out.json"))
  assert C.load_locomo(str(tmp_path / "out.json")) == [conv]


@pytest.mark.parametrize("mutate,needle", [
    (lambda s: s.pop("conversation"), "sample 0: missing 'conversation'"),
    (lambda s: s["conversation"].__setitem__("session_1", "text"), "session_1: expected list"),
    (lambda s: s["conversation"]["session_1"][0].pop("dia_id"), "session_1[0]: missing 'dia_id'"),
    (lambda s: s["qa"][0].__setitem__("evidence", "D1:1"), "qa[0].evidence"),
])
def test_malformed_files_name_the_place(tmp_path, mutate, needle):
  data = json.loads(json.dumps(LOCOMO_SAMPLE))
  mutate(data[0])
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(data))
  with pytest.raises(C.ConversationFormatError, match=re.escape(needle)):
    C.load_locomo(str(path))
  path.write_text("{not json")
  with pytest.raises(C.ConversationFormatError, match="not JSON"):
    C.load_locomo(str(path))


def test_builds_from_real_chitchat_dialogue():
  path = C.chitchat_path()                                     # the package is a dependency
  with open(path) as f:
    dataset = json.load(f)
  words = lambda s: len(s.split())
  kw = dict(samples=2, target_tokens=3000, count_tokens=words, recall=8, planted=4, seed=3)
  convs = C.build_from_chitchat(dataset, **kw)
  assert convs == C.build_from_chitchat(dataset, **kw)         # deterministic under a seed
  assert convs[0].sessions != convs[1].sessions                # different dialogue per sample
  for c in convs:
    history = "\n\n".join(C.render_session(s) for s in c.sessions)
    assert words(history) >= 3000
    assert {t.speaker for t in c.turns()} == {c.speaker_a, c.speaker_b}
    by_id = {t.dia_id: t for t in c.turns()}
    assert len(by_id) == len(c.turns())                        # dia_ids unique
    recall = [q for q in c.qa if not q.synthetic]
    planted = [q for q in c.qa if q.synthetic]
    assert len(recall) == 8 and len(planted) == 4
    for q in recall:                                           # the answer is the evidence turn
      (ev,) = q.evidence
      assert by_id[ev].text == q.answer and not by_id[ev].synthetic
      s, i = ev[1:].split(":")
      prev = by_id[f"D{s}:{int(i) - 1}"]
      assert f'"{prev.text}"' in q.question and prev.speaker != by_id[ev].speaker
    for q in planted:
      (ev,) = q.evidence
      assert by_id[ev].synthetic and q.answer in by_id[ev].text
    assert sum(t.synthetic for t in c.turns()) == 4


def test_locomo_scores_on_hand_computed_cases():
  assert C.f1("The cat sat", "cat sat down") == pytest.approx(0.8)      # p 1, r 2/3
  assert C.f1("running dogs", "the dog runs") == pytest.approx(1.0)      # Porter stems
  assert C.f1("", "anything") == 0.0 and C.f1("x", "y") == 0.0
  assert C.bleu1("the cat", "the cat sat on the mat") == pytest.approx(math.exp(1 - 6 / 2))
  assert C.bleu1("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
  assert C.bleu1("a dog", "the cat") == 0.0                              # nltk: no unigram match


def test_contains_finds_the_whole_value_at_word_boundaries():
  assert C.contains("Her locker code is 4172, she keeps forgetting it.", "4172")
  assert C.contains("She has a Mustard-Yellow bike", "mustard yellow") is False  # hyphen kept
  assert C.contains("a mustard yellow one", "mustard yellow")
  assert not C.contains("41725", "4172") and not C.contains("cellos", "cello")
  assert not C.contains("anything", "") and not C.contains("", "pho")


def test_dates_render_like_locomo():
  assert C._date("2018-05-02T19:38:15Z") == "7:38 pm on 2 May, 2018"     # pylint: disable=protected-access
  assert C._date("2018-05-02T00:05:00Z") == "12:05 am on 2 May, 2018"    # pylint: disable=protected-access
  assert np.isfinite(C.f1("12 pm", "12 pm"))
