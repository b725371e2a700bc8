"""jaxkv.tokens.Tokenizer against HF transformers on the two GGUF presets.

Exact token lists and exact rendered strings are compared with
`AutoTokenizer.from_pretrained(dir, gguf_file=name)`: `encode` vs
`encode(add_special_tokens=False)`, `render_chat` vs
`apply_chat_template(tokenize=False)`, and the `save_pretrained` round trip
through `Tokenizer.from_hf_dir`. Each tokenizer is loaded once per module.
"""

import copy
import json
import re

import gguf
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.models import presets
from jaxkv.tokens import Tokenizer

TEXTS = [
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog. It's, they're, we'll, I'd.",
    "12345 3.14159 1,000,000 2024-01-31 0x1F 007",
    "def f(x):\n\tif x > 0:\n        return x  # comment\n\treturn -x\n",
    "    indented\n\t\ttabs\t and\ttrailing   \n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}, "ok": true}',
    "unicode: café naïve Straße — “quotes” … ½ ©",
    "emoji 🎉🚀👍🏽 and CJK 你好，世界 こんにちは 안녕하세요",  # noqa: RUF001 (the CJK comma is the point)
    "a  b   c    d\n\n\ne\r\nf \n \n",
    "a  1 x  22  \n 42",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_start|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "",
    " ",
    "\n",
]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}]

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "no_system": [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about café owners 🎉."},
    ],
    "agent": [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "What's the weather in Paris and Tōkyō?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Tōkyō"}}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "call_0",
         "content": '{"temp": 21, "sky": "clear"}'},
        {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": '{"temp": 9}'},
        {"role": "assistant", "content": "Paris: 21°C, clear. Tōkyō: 9°C."},
        {"role": "user", "content": "Thanks!"},
    ],
}
STOP_IDS = {"smollm2": {0, 2}, "qwen": {151643, 151645}}


def _load(path):
  return (Tokenizer.from_gguf(path),
          transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


@pytest.fixture(scope="module")
def smollm2():
  return _load(presets.smollm2_gguf())


@pytest.fixture(scope="module")
def qwen():
  return _load(presets.qwen25_coder_gguf())


@pytest.fixture(params=["smollm2", "qwen"])
def pair(request):
  return request.param, *request.getfixturevalue(request.param)


def _mismatches(ours, ref, texts):
  return [(t, ours.encode(t), ref.encode(t, add_special_tokens=False)) for t in texts
          if ours.encode(t) != ref.encode(t, add_special_tokens=False)]


def test_encode_matches_transformers(pair):
  _, ours, ref = pair
  assert _mismatches(ours, ref, TEXTS) == []
  ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == ours.token_to_id("<|im_start|>") and ids[-1] == ours.token_to_id("<|im_end|>")


def test_decode_round_trip(pair):
  _, ours, ref = pair
  for text in TEXTS:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
  assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_backend_pipeline_matches_transformers(pair):
  _, ours, ref = pair
  assert json.loads(ours.backend.to_str()) == json.loads(ref.backend_tokenizer.to_str())


def test_special_ids(pair):
  name, ours, ref = pair
  assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
      ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
  assert ours.vocab_size == len(ref)
  assert ours.stop_ids == STOP_IDS[name]
  assert not ours.add_bos and ours.encode("hi") == ours.encode("hi", add_bos=False)
  assert ours.encode("hi", add_bos=True) == [ours.bos_id, *ours.encode("hi")]
  assert ours.id_to_token(ours.token_to_id("<|im_end|>")) == "<|im_end|>"
  assert ours.token_to_id("no such token, surely") is None


def _byte_symbols_in_vocab(tok, text):
  # SmolLM2's vocabulary lacks 21 of the 256 byte symbols (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d,
  # 0xc0, 0xc1, 0xf1, 0xf2, 0xf5-0xff); BPE (no unk) drops those bytes, in transformers too.
  spelling = {b: chr(c) for b, c in zip(*_byte_table())}
  return all(tok.token_to_id(spelling[b]) is not None for b in text.encode("utf-8"))


def _byte_table():
  bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
  rest = [b for b in range(256) if b not in bs]
  return bs + rest, bs + [256 + i for i in range(len(rest))]


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_encode_random_text_smollm2(smollm2, text):
  ours, ref = smollm2
  ids = ours.encode(text)
  assert ids == ref.encode(text, add_special_tokens=False)
  decoded = ours.decode(ids, skip_special_tokens=False)
  assert decoded == ref.decode(ids, skip_special_tokens=False)
  if _byte_symbols_in_vocab(ours, text):
    assert decoded == text


def test_smollm2_vocab_drops_some_bytes(smollm2):
  ours, ref = smollm2
  text = "a\x04b\U00040000c"  # 0x04 and the 0xf1 lead byte have no token
  assert not _byte_symbols_in_vocab(ours, text)
  assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text, add_special_tokens=False))
  assert ours.decode(ours.encode(text)) != text


PIECES = [" ", "  ", "\n", "\t", "1", "23", "456", "a", "Hello", "'s", "é", "🎉", "你", ".",
          "<|im_end|>", "<|im_start|>", "{", "\"", "\r\n"]


@settings(max_examples=50, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=20).map("".join))
def test_encode_whitespace_digit_mixes(smollm2, qwen, text):
  for ours, ref in (smollm2, qwen):
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_render_chat_matches_transformers(pair, conv, add_generation_prompt):
  _, ours, ref = pair
  messages = CONVERSATIONS[conv]
  tools = TOOLS if conv == "agent" else None
  before = copy.deepcopy(messages)
  want = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                 tokenize=False)
  gen = add_generation_prompt
  assert ours.render_chat(messages, tools=tools, add_generation_prompt=gen) == want
  assert ours.encode_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt) == (
      ref.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                              tokenize=True, return_dict=False))
  assert messages == before


def test_tool_call_arguments_as_json_string(qwen):
  ours, ref = qwen
  messages = copy.deepcopy(CONVERSATIONS["agent"])
  want = ref.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
  for call in messages[2]["tool_calls"]:
    call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
  messages[2]["content"] = None  # OpenAI style: no content next to tool calls
  got = ours.render_chat(messages, tools=TOOLS)
  assert got == want
  assert '"arguments": {"city": "Paris", "unit": "celsius"}' in got


def test_chatml_fallback(qwen):
  ours, ref = qwen
  plain = Tokenizer(ours.backend, special_tokens=ours.special_tokens)
  assert plain.chat_template is None
  # With a system message, the fallback writes what Qwen2.5's own template writes.
  for conv, tools in (("system_user", None), ("agent", TOOLS), ("agent", None)):
    messages = CONVERSATIONS[conv]
    assert plain.render_chat(messages, tools=tools) == ref.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)
  assert plain.render_chat(CONVERSATIONS["no_system"][:1], add_generation_prompt=False) == (
      "<|im_start|>user\nHi there!<|im_end|>\n")
  agent = CONVERSATIONS["agent"]
  assert plain.render_chat(agent[1:5], add_generation_prompt=False) == (
      "<|im_start|>user\nWhat's the weather in Paris and Tōkyō?<|im_end|>\n"
      "<|im_start|>assistant\n"
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
      "</tool_call>\n"
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
      "<|im_end|>\n"
      "<|im_start|>user\n<tool_response>\n{\"temp\": 21, \"sky\": \"clear\"}\n</tool_response>\n"
      "<tool_response>\n{\"temp\": 9}\n</tool_response><|im_end|>\n")


def test_from_hf_dir_matches_gguf(pair, tmp_path):
  _, ours, ref = pair
  ref.save_pretrained(tmp_path)
  loaded = Tokenizer.load(tmp_path)
  assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.stop_ids, loaded.add_bos) == (
      ours.bos_id, ours.eos_id, ours.pad_id, ours.stop_ids, ours.add_bos)
  assert [loaded.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
  for conv, messages in CONVERSATIONS.items():
    tools = TOOLS if conv == "agent" else None
    assert loaded.render_chat(messages, tools=tools) == ours.render_chat(messages, tools=tools)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, ours.eos_id]}))
  assert Tokenizer.from_hf_dir(tmp_path).stop_ids == ours.stop_ids | {7}


def test_from_hf_dir_generation_config_eos(smollm2, tmp_path):
  ours, ref = smollm2
  ref.save_pretrained(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  del config["eos_token"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
  loaded = Tokenizer.from_hf_dir(tmp_path)
  assert loaded.eos_id == 2 and loaded.stop_ids == {0, 2}


def _tiny_gguf(path, model="gpt2", pre="default", add_bos=True):
  w = gguf.GGUFWriter(str(path), arch="llama")
  w.add_tokenizer_model(model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(["<s>", "</s>", "a", "b", "ab", "Ġ"])
  w.add_token_merges(["a b"])
  w.add_token_types([3, 3, 1, 1, 1, 1])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  w.add_add_bos_token(add_bos)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_gguf_add_bos_metadata(tmp_path):
  tok = Tokenizer.load(_tiny_gguf(tmp_path / "tiny.gguf"))
  assert tok.add_bos and tok.stop_ids == {1}
  assert tok.encode("ab b") == [0, 4, 5, 3]
  assert tok.encode("ab b", add_bos=False) == [4, 5, 3]
  assert tok.encode("<s>ab</s>", add_bos=False) == [0, 4, 1]
  assert tok.decode([0, 4, 5, 3, 1]) == "ab b"
  assert tok.decode([0, 4, 1], skip_special_tokens=False) == "<s>ab</s>"


@pytest.mark.parametrize("kwargs,word", [({"model": "llama"}, "'llama'"),
                                         ({"pre": "mystery-pre"}, "'mystery-pre'")])
def test_gguf_unknown_tokenizer_kind(tmp_path, kwargs, word):
  with pytest.raises(ValueError, match=word):
    Tokenizer.from_gguf(_tiny_gguf(tmp_path / "bad.gguf", **kwargs))


@pytest.mark.parametrize("messages,match", [
    ("hello", "must be a list"),
    ([], "empty"),
    (["hello"], "must be a dict"),
    ([{"content": "hi"}], "no 'role'"),
    ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
    ([{"role": "user"}], "no 'content'"),
    ([{"role": "user", "content": None}], "no 'content'"),
    ([{"role": "user", "content": 3}], "content must be"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], "function.name"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "only assistant"),
])
def test_render_chat_rejects_bad_messages(smollm2, messages, match):
  with pytest.raises(ValueError, match=match):
    smollm2[0].render_chat(messages)


def test_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match=re.escape("tokenizer.json")):
    Tokenizer.from_hf_dir(tmp_path)
  with pytest.raises(FileNotFoundError):
    Tokenizer.from_gguf(tmp_path / "missing.gguf")
  with pytest.raises(FileNotFoundError):
    Tokenizer.load(tmp_path / "missing.gguf")
