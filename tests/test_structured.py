"""Structured output: the token mask in the jitted step, the grammars, the engine and the
server's OpenAI fields (response_format, tool_choice, strict tools).

The mask is checked against llguidance's own numpy reference on fresh random
inputs; grammars against the shipped models' real tokenizers (SmolLM2's ReAct calls,
Qwen2.5's Hermes blocks); the server with the official `openai` client on real
SmolLM2 weights, 20 requests per mode, every reply validated against its schema.
"""

from __future__ import annotations

import asyncio
import json

import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
llg_numpy = pytest.importorskip("llguidance.numpy")

import jaxkv  # noqa: E402
from jaxkv.config import CacheConfig, EngineConfig, SamplingConfig, ServeConfig  # noqa: E402
from jaxkv.data import calls as calls_lib  # noqa: E402
from jaxkv.engine import grammar as G  # noqa: E402
from jaxkv.engine.request import Request  # noqa: E402
from jaxkv.engine.sampling import SamplingParams, apply_token_mask, sample  # noqa: E402
from jaxkv.models import presets  # noqa: E402
from jaxkv.server.app import create_app, serve_in_thread  # noqa: E402
from jaxkv.tokens import Tokenizer  # noqa: E402

MODEL = "smollm2-135m"
CACHE = CacheConfig(num_pages=256, page_size=16, max_seq_len=512)
ENGINE = EngineConfig(max_batch=8, prefill_chunk=128, decode_steps=8)
PARAMS = {"type": "object", "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": dict(PARAMS, properties={"city": {"type": "string", "maxLength": 24}},
                           required=["city"])}},
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a flight between two airports",
        "parameters": dict(PARAMS, properties={
            "origin": {"type": "string", "maxLength": 12},
            "destination": {"type": "string", "maxLength": 12},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            required=["origin", "destination", "passengers"])}},
]
SUBJECTS = ["a cat", "a dog", "a city", "a car", "a book", "a movie", "a song", "a planet",
            "a tree", "a river", "a chair", "a phone", "a cake", "a horse", "a ship",
            "a mountain", "a bird", "a shoe", "a lamp", "a school"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Rome", "Quito", "Seoul", "Dakar", "Hanoi"]


# ----------------------------------------------------------------- the mask
@pytest.mark.parametrize("vocab,extra_words", [(33, 0), (1000, 0), (4099, 3)])
def test_token_mask_equals_llguidance_reference(vocab, extra_words):
  rng = np.random.default_rng(vocab)
  b, words = 5, (vocab + 31) // 32 + extra_words
  logits = rng.normal(size=(b, vocab)).astype(np.float32)
  mask = rng.integers(-2**31, 2**31, size=(b, words), dtype=np.int64).astype(np.int32)
  mask[0] = -1                                   # an unconstrained row
  mask[1] = 0
  mask[1, 0] = 1 << 5                            # one allowed token
  ref = logits.copy()
  llg_numpy.apply_token_bitmask_inplace(ref, mask[:, :(vocab + 31) // 32].copy())
  got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
  np.testing.assert_array_equal(got, ref)        # exact: a select, no arithmetic
  params, _ = SamplingParams.from_configs([SamplingConfig()] * b, b, mask)
  greedy = np.asarray(sample(jnp.asarray(logits), params, jnp.zeros(b, jnp.int32),
                             greedy_only=True))
  np.testing.assert_array_equal(greedy, ref.argmax(-1))
  assert greedy[1] == 5
  hot = [SamplingConfig(temperature=1.5, seed=s) for s in range(b)]
  allowed = np.isfinite(ref)
  for pos in range(20):                          # sampled tokens are allowed ones
    params, _ = SamplingParams.from_configs(hot, b, mask)
    tok = np.asarray(sample(jnp.asarray(logits), params, jnp.full(b, pos, jnp.int32),
                            greedy_only=False))
    assert allowed[np.arange(b), tok].all()


def test_a_mask_narrower_than_the_logits_is_refused():
  with pytest.raises(ValueError, match="narrower"):
    apply_token_mask(jnp.zeros((1, 65)), jnp.zeros((1, 2), jnp.int32))


# ------------------------------------------------------------- the grammars
@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def grammars(request):
  path = (presets.smollm2_gguf() if request.param == "smollm2" else
          presets.qwen25_coder_gguf())
  tok = Tokenizer.load(path)
  return G.Grammars(tok, tok.vocab_size)


def _runs(gs: G.Grammars, text: str, tokens: list[int]) -> G.Matcher | None:
  """The matcher after `tokens`, or None when the grammar refuses one of them."""
  m = gs.compile(text)
  try:
    for t in tokens:
      m.consume(t)
  except ValueError:
    return None
  return m


def _call_text(gs, name, args, style):
  body = json.dumps(args)
  if style == "react":
    return f"Action: {name}\nAction Input: {body}"
  return f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'


def test_tool_call_grammars_take_the_template_form(grammars):
  gs, enc = grammars, grammars.tokenizer.encode
  style = "hermes" if gs.has_token("<tool_call>") else "react"
  fns = [t["function"] for t in TOOLS]
  text = G.tool_calls(fns, style=style, text_opener=not gs.has_token("<tool_call>"))
  good = _call_text(gs, "get_weather", {"city": "Paris"}, style)
  m = _runs(gs, text, enc(good))
  assert m is not None and m.accepting
  parsed = calls_lib.parse_calls(good)
  assert [(c.name, c.arguments) for c in parsed] == [("get_weather", {"city": "Paris"})]
  if style == "hermes":                      # the bare JSON call Qwen2.5-Coder writes
    assert _runs(gs, text, enc('{"name": "get_weather", "arguments": {"city": "Oslo"}}'))
  two = good + "\n" + _call_text(gs, "book_flight", {"origin": "CDG", "destination": "LIM",
                                                     "passengers": 2}, style)
  assert _runs(gs, text, enc(two)).accepting
  one = G.tool_calls(fns, style=style, parallel=False,
                     text_opener=not gs.has_token("<tool_call>"))
  assert _runs(gs, one, enc(good)).done and _runs(gs, one, enc(two)) is None
  for bad in (_call_text(gs, "get_wether", {"city": "Paris"}, style),    # unknown tool
              _call_text(gs, "get_weather", {"city": 3}, style),          # wrong type
              _call_text(gs, "get_weather", {"town": "Paris"}, style),    # extra key
              "Sure! " + good):                                            # text first
    assert _runs(gs, text, enc(bad)) is None, bad


def test_argument_schemas_with_definitions(grammars):
  """pydantic's schemas (tau2's tools) reference "#/$defs/..." from their root; they
  still resolve once the arguments sit inside the call object."""
  gs, enc = grammars, grammars.tokenizer.encode
  style = "hermes" if gs.has_token("<tool_call>") else "react"
  fn = {"name": "book", "parameters": {
      "$defs": {"Pax": {"type": "object", "properties": {"name": {"type": "string"}},
                        "required": ["name"], "additionalProperties": False}},
      "type": "object", "properties": {"pax": {"type": "array",
                                               "items": {"$ref": "#/$defs/Pax"}}},
      "required": ["pax"], "additionalProperties": False}}
  text = G.tool_calls([fn], style=style, text_opener=not gs.has_token("<tool_call>"))
  assert _runs(gs, text, enc(_call_text(gs, "book", {"pax": [{"name": "Ann"}]}, style)))
  assert _runs(gs, text, enc(_call_text(gs, "book", {"pax": [{"nam": "Ann"}]}, style))) is None


def test_auto_grammar_allows_text_but_not_a_loose_call(grammars):
  gs, enc = grammars, grammars.tokenizer.encode
  style = "hermes" if gs.has_token("<tool_call>") else "react"
  fns = [t["function"] for t in TOOLS]
  text = G.tool_calls(fns, style=style, mode="auto",
                      text_opener=not gs.has_token("<tool_call>"))
  assert _runs(gs, text, enc("It is sunny in Paris today.")).accepting
  assert _runs(gs, text, enc("Let me check.\n" + _call_text(
      gs, "get_weather", {"city": "Paris"}, style))).accepting
  opener = "<tool_call>" if style == "hermes" else "Action:"
  loose = f"I will call {opener} get_weather with a city"          # opener spelled in text
  assert _runs(gs, text, enc(loose)) is None
  bare = 'Sure.\n{"name": "Joke", "arguments": {}}'                 # parse_calls reads it
  assert _runs(gs, text, enc(bare)) is None
  after = _call_text(gs, "get_weather", {"city": "Paris"}, style) + "\n"
  assert _runs(gs, text, enc(after)).accepting                       # a closing newline
  if style == "hermes":         # Qwen2.5-Coder's other forms: bare, and fenced + indented
    assert _runs(gs, text, enc('{"name": "get_weather", "arguments": {"city": "Rome"}}'))
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Rome"}\n}\n```'
    assert _runs(gs, text, enc(fenced)).accepting
    assert calls_lib.parse_calls(fenced)[0].arguments == {"city": "Rome"}


def test_a_model_narrower_than_the_tokenizer_is_refused(grammars):
  narrow = G.Grammars(grammars.tokenizer, 1000)
  for _ in range(2):                             # refused every time, not only the first
    with pytest.raises(ValueError, match="more than the model's 1000 logits"):
      narrow.compile(G.any_text())


def test_json_schema_grammar_and_compile_errors(grammars):
  gs, enc = grammars, grammars.tokenizer.encode
  schema = dict(PARAMS, properties={"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
                required=["n", "tag"])
  g = G.json_schema(schema)
  assert _runs(gs, g, enc('{"n": 12, "tag": "b"}')).done
  assert _runs(gs, g, enc('{"n": 1.5, "tag": "b"}')) is None
  assert _runs(gs, g, enc('{"n": 1,  "tag": "b"}')) is None    # compact JSON only
  assert _runs(gs, G.json_object(), enc('{"any": [1, {"x": null}]}')).done
  with pytest.raises(ValueError, match="does not compile"):
    gs.compile(G.json_schema({"type": "bogus"}))


# ----------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def base():
  return jaxkv.load(MODEL, cache=CACHE, engine=ENGINE)


def test_always_allow_grammar_keeps_greedy_output(base):
  """A grammar that allows every text changes nothing: rows under it (one token per
  decode call) and rows beside them give their solo, unconstrained tokens."""
  gs = G.Grammars(base.tokenizer, base.engine.model_cfg.vocab_size)
  prompts = [base.encode([{"role": "user", "content": q}]) for q in
             ("What is the capital of France?", "Name a primary color.",
              "Say hello in Spanish.", "What do bees make?")]
  s = SamplingConfig(max_tokens=24)
  solo = [next(base.engine.run([Request(str(i), p, s)])).tokens for i, p in enumerate(prompts)]
  reqs = [Request(str(i), p, s, grammar=gs.compile(G.any_text()) if i % 2 else None)
          for i, p in enumerate(prompts)]
  mixed = {r.id: r.tokens for r in base.engine.run(reqs)}
  assert [mixed[str(i)] for i in range(len(prompts))] == solo


def test_teacher_forced_request_with_a_grammar_is_an_error(base):
  gs = G.Grammars(base.tokenizer, base.engine.model_cfg.vocab_size)
  res = next(base.engine.run([Request("f", [1, 2, 3], forced=[4, 5],
                                      grammar=gs.compile(G.any_text()))]))
  assert res.finish_reason == "error" and "grammar" in res.error


# ----------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(base):
  llm = jaxkv.LLM(base.model, base.tokenizer, CACHE, ENGINE)
  cfg = ServeConfig(model=MODEL, cache=CACHE, engine=ENGINE,
                    sampling=SamplingConfig(max_tokens=64))
  with serve_in_thread(create_app(llm, cfg)) as srv:
    srv.llm = llm
    yield srv


def _all(srv, bodies: list[dict]) -> list:
  """Every request at once (the engine batches them), through the async client."""
  async def every():
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                  max_retries=0, timeout=600) as client:
      return await asyncio.gather(*(client.chat.completions.create(**{"model": MODEL, **b})
                                    for b in bodies))
  return asyncio.run(every())


def _user(text):
  return [{"role": "user", "content": text}]


@pytest.mark.slow
def test_json_modes_give_valid_json(server):
  """20 requests per mode: every reply is JSON valid under its schema."""
  schema = dict(PARAMS, properties={"name": {"type": "string", "maxLength": 20},
                                    "size": {"enum": ["small", "medium", "large"]}},
                required=["name", "size"])
  fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                "strict": True}}
  objs = _all(server, [dict(messages=_user(f'Give {s} a name. Reply with only a JSON object '
                                           f'with one key, "name".'),
                            response_format={"type": "json_object"}) for s in SUBJECTS])
  typed = _all(server, [dict(messages=_user(f"Describe {s}: its name and size."),
                             response_format=fmt) for s in SUBJECTS])
  for r in objs:
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
  for r in typed:
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def _check_calls(r, names: set[str], most: int | None = None):
  choice = r.choices[0]
  assert choice.finish_reason == "tool_calls", choice
  calls = choice.message.tool_calls
  assert calls and (most is None or len(calls) <= most)
  by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  for c in calls:
    assert c.function.name in names
    jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name])


@pytest.mark.slow
def test_tool_choice_required_and_named_give_valid_calls(server):
  asks = ([f"What is the weather in {c}?" for c in CITIES]
          + [f"Book a flight from {a} to {b} for {i % 3 + 1} people."
             for i, (a, b) in enumerate(zip(CITIES, CITIES[1:] + CITIES[:1]))])
  required = _all(server, [dict(messages=_user(q), tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False) for q in asks])
  named = _all(server, [dict(messages=_user(q), tools=TOOLS, tool_choice={
      "type": "function", "function": {"name": "book_flight"}}) for q in asks])
  for r in required:
    _check_calls(r, {"get_weather", "book_flight"}, most=1)
  for r in named:
    _check_calls(r, {"book_flight"}, most=1)


# an earlier turn of the session with a call and its answer (SmolLM2-135M calls tools
# unprompted only after seeing one)
SHOT = [{"role": "user", "content": "What is the weather in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, cloudy"},
        {"role": "assistant", "content": "It is 18 C and cloudy in Lima."}]


@pytest.mark.slow
def test_strict_tools_under_auto_give_text_or_valid_calls(server):
  tools = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
  asks = ([f"What is the weather in {c}?" for c in CITIES]
          + [f"Tell me one fact about {s}." for s in SUBJECTS[:10]])
  replies = _all(server, [dict(messages=SHOT + _user(q), tools=tools) for q in asks])
  n_calls = 0
  for r in replies:
    if r.choices[0].finish_reason == "tool_calls":
      _check_calls(r, {"get_weather", "book_flight"})
      n_calls += 1
    else:                                    # text that never opens a call
      assert "Action:" not in (r.choices[0].message.content or "")
  assert 0 < n_calls < len(asks)             # both branches were taken


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "bogus"}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
])
def test_bad_structured_fields_are_400(server, extra, param):
  with pytest.raises(openai.BadRequestError) as e:
    _all(server, [dict(messages=_user("hi"), **extra)])
  assert e.value.body["param"] == param, e.value.body


@pytest.mark.slow
def test_qwen_hermes_calls_under_required_and_named():
  """Qwen2.5's template writes calls as `<tool_call>` blocks (special tokens): under
  tool_choice required and named, every reply is a valid call of a listed tool."""
  name = "qwen2.5-coder-0.5b"
  llm = jaxkv.load(name, cache=CACHE, engine=ENGINE)
  cfg = ServeConfig(model=name, cache=CACHE, engine=ENGINE,
                    sampling=SamplingConfig(max_tokens=64))
  asks = [f"What is the weather in {c}?" for c in CITIES[:4]] + [
      "Book a flight from Oslo to Rome for 2 people."]
  with serve_in_thread(create_app(llm, cfg)) as srv:
    required = _all(srv, [dict(model=name, messages=_user(q), tools=TOOLS,
                               tool_choice="required") for q in asks])
    named = _all(srv, [dict(model=name, messages=_user(q), tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}) for q in asks])
  for r in required:
    _check_calls(r, {"get_weather", "book_flight"})
  for r in named:
    _check_calls(r, {"get_weather"}, most=1)
  assert json.loads(named[0].choices[0].message.tool_calls[0].function.arguments) == {
      "city": CITIES[0]}
