"""Structured outputs and tool calls through ``dflash2 serve`` (server/tools) with the official openai client on the
demo export (SmolLM2: no tool template, so the generic format): a strict json_schema answer validates and equals
plain constrained decoding (``speculative=False`` in process) at temperature 0, streamed = whole; a named tool
call's arguments validate against its parameters, streamed deltas reassemble to the whole answer's call; a tool
conversation replays. In process: each family's parser on its own format; the streamed deltas (name once, then
argument fragments) and the negative control — a delta split mid-JSON whose tail is lost — caught by the
reassembly check.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
pytest.importorskip("starlette", reason="the serve extra")
pytest.importorskip("llguidance", reason="the grammar extra")
jsonschema = pytest.importorskip("jsonschema")

import dflash2_trt  # noqa: E402
from dflash2_trt.runtime.grammar import GrammarSpec  # noqa: E402
from dflash2_trt.runtime.request import GenerationRequest  # noqa: E402
from dflash2_trt.serving.http import tools  # noqa: E402
from test_serve import KEY, NAME, _Server  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "integer"}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time of a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.fixture(scope="module")
def export():
    from dflash2_trt.bench.exports import demo_export

    return demo_export()


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    s = _Server(export, tmp_path_factory.mktemp("serve_tools"), "--api-key", KEY, "--max-batch", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gen(export):
    with dflash2_trt.load(export, "ort", threads=1) as g:
        yield g


def _reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """A client's view of streamed deltas: (content, [(name, arguments)]), as the openai SDK accumulates them."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls") or []:
            slot = calls.setdefault(c["index"], ["", ""])
            f = c.get("function") or {}
            slot[0] += f.get("name") or ""
            slot[1] += f.get("arguments") or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _delta(chunk) -> dict:
    d = chunk.choices[0].delta if chunk.choices else None
    if d is None:
        return {}
    return {"content": d.content, "tool_calls": [{"index": c.index, "function": {
        "name": c.function.name if c.function else None,
        "arguments": c.function.arguments if c.function else None}} for c in d.tool_calls or []]}


def test_json_schema_validates_equals_plain_and_streams_whole(server, gen):
    c = server.client()
    msgs = [{"role": "user", "content": "Give the largest city of Japan as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    whole = c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=48, response_format=rf)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    ref = gen.generate(msgs, request=GenerationRequest(max_new_tokens=48, grammar=GrammarSpec(
        "json_schema", json.dumps(SCHEMA)), speculative=False))
    assert text == ref.text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=NAME, messages=msgs, temperature=0, max_tokens=48, response_format=rf, stream=True) if ch.choices)
    assert streamed == text
    obj = c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=48,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_named_tool_call_validates_and_streams_as_the_whole(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What's the weather like in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=64, tools=[WEATHER, TIME],
                                      tool_choice=choice, parallel_tool_calls=False)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [_delta(x) for x in c.chat.completions.create(
        model=NAME, messages=msgs, temperature=0, max_tokens=64, tools=[WEATHER, TIME], tool_choice=choice,
        parallel_tool_calls=False, stream=True)]
    names = [d for d in deltas for t in d.get("tool_calls") or [] if t["function"]["name"]]
    assert len(names) == 1  # the name once, then argument fragments
    assert _reassemble(deltas)[1] == [("get_weather", call.function.arguments)]
    # the conversation goes on with the call and its result in the history
    follow = c.chat.completions.create(model=NAME, temperature=0, max_tokens=16, tools=[WEATHER], messages=msgs + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    required = c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=64,
                                         tools=[WEATHER, TIME], tool_choice="required")
    assert required.choices[0].message.tool_calls
    for t in required.choices[0].message.tool_calls:
        params = {"get_weather": WEATHER, "get_time": TIME}[t.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(t.function.arguments), params)


def test_bad_tools_and_formats_are_400(server):
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    for kw in ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
               {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
               {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
               {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
               {"extra_body": {"guided_regex": "(unclosed"}}):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, **kw)


@pytest.mark.parametrize("family,text,calls,content", [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [("f", {"a": 1})], "Sure."),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})], None),
    ("gpt_oss", '<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.f '
                '<|constrain|>json<|message|>{"a": 1}<|call|>', [("f", '{"a": 1}')], None),
    ("qwen3_coder", '<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>',
     [("f", {"a": 1})], None),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}', [("f", {"a": 1})], None),
    ("generic", '{"response": "hello"}', [], "hello"),
])
def test_each_family_parses_its_format(family, text, calls, content):
    p = tools.PARSERS[family](text)
    assert p.calls == calls and p.content == content
    if family == "gpt_oss":
        assert p.reasoning == "think"


def test_family_of_templates():
    assert tools.family_of(None) == "generic"
    assert tools.family_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tools.family_of("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert tools.family_of("{% if tools %}<|channel|>{% endif %}") == "gpt_oss"
    assert tools.family_of("{% if tools %}<function={% endif %}") == "qwen3_coder"
    r, rest = tools.split_answer("<think>hmm</think>Hi", None, "<think>"), None
    assert (r.reasoning, r.content) == ("hmm", "Hi")


def test_streamed_deltas_reassemble_and_a_split_call_is_caught(monkeypatch):
    args = json.dumps({"city": "Paris", "unit": "celsius", "note": "x" * 40})
    p = tools.Parsed(content=None, calls=[("get_weather", args), ("get_time", {"city": "Oslo"})])
    deltas = tools.deltas(p)
    assert _reassemble(deltas)[1] == [("get_weather", args), ("get_time", '{"city": "Oslo"}')]
    assert sum(1 for d in deltas for c in d.get("tool_calls", []) if c["function"].get("name")) == 2
    assert max(len(d.get("tool_calls", [])) for d in deltas) == 1

    # negative control: a delta split mid-JSON whose tail never comes (a half-parsed call sent)
    monkeypatch.setattr(tools, "fragments", lambda a: [a[: len(a) // 2]])
    broken = _reassemble(tools.deltas(p))[1]
    with pytest.raises(ValueError):
        for _, a in broken:
            json.loads(a)


@pytest.mark.parametrize("choice", ["named", "required"])
@pytest.mark.parametrize("family", ["hermes", "llama3", "gpt_oss", "qwen3_coder"])
def test_forced_calls_of_each_family_validate(gen, family, choice):
    """Each family's forced call (tool_choice named / required: :func:`tools.tool_grammar`) decoded on the demo
    export at T = 0, speculative = plain token for token: the family's parser finds one call, naming an offered tool
    (the named one) with arguments that validate against its parameters."""
    tc = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    setup = tools.parse_tools({"tools": [WEATHER, TIME], "tool_choice": tc, "parallel_tool_calls": False})
    spec = tools.tool_grammar(setup, family, gen.tokenizer)
    assert spec is not None and spec.kind in ("lark", "json_schema")
    msgs = [{"role": "user", "content": "What is the weather in Paris? Answer in celsius."}]

    def run(speculative: bool):  # noqa: ANN202
        return gen.generate(msgs, request=GenerationRequest(max_new_tokens=96, grammar=spec, seed=0, guard=False,
                                                            speculative=speculative, proposer="dflash2"))

    r = run(True)
    assert r.finish_reason == "stop" and r.tokens == run(False).tokens, r.text
    p = tools.PARSERS[family](r.text, setup.tools)
    assert len(p.calls) == 1, r.text
    name, args = p.calls[0]
    assert name == "get_weather" if choice == "named" else name in ("get_weather", "get_time")
    params = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(args) if isinstance(args, str) else args, params)


def test_a_free_answer_is_no_call(gen):
    """Negative control for the forced calls: the demo's own answer to the same message without the grammar is no
    call in any family's format (what the test above finds, the grammar made)."""
    msgs = [{"role": "user", "content": "What is the weather in Paris? Answer in celsius."}]
    text = gen.generate(msgs, request=GenerationRequest(max_new_tokens=96, seed=0, guard=False)).text
    for family in ("hermes", "llama3", "gpt_oss", "qwen3_coder"):
        p = tools.PARSERS[family](text, (WEATHER, TIME))
        assert p.calls == [] and p.content == text, family


def test_gpt_oss_markers_are_special_tokens_where_the_tokenizer_has_them(gen):
    """gpt-oss's harmony markers: on a tokenizer where they are special tokens the forced-call grammar references
    them as such (a matcher over that tokenizer takes the marker ids and the call's text to an accepting state);
    on the demo's tokenizer (no such tokens) they are text; the server parses a gpt-oss answer decoded with its
    markers kept; a Qwen3-Coder string parameter keeps text that reads as JSON."""
    from tokenizers import Tokenizer

    from dflash2_trt.runtime.grammar import GrammarTokenizer

    tok = Tokenizer.from_str(gen.tokenizer.tok.to_str())
    tok.add_special_tokens(["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|start|>", "<|end|>"])

    class Harmony:
        tok = None

    Harmony.tok = tok
    setup = tools.parse_tools({"tools": [TIME], "tool_choice": "required"})
    spec = tools.tool_grammar(setup, "gpt_oss", Harmony())
    assert "<|channel|> (" in spec.text and '"<|channel|>"' in tools.tool_grammar(setup, "gpt_oss", gen.tokenizer).text
    ids = {m: tok.token_to_id(m) for m in ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")}
    seq = ([ids["<|channel|>"]] + tok.encode("commentary to=functions.get_time ", add_special_tokens=False).ids
           + [ids["<|constrain|>"]] + tok.encode("json", add_special_tokens=False).ids + [ids["<|message|>"]]
           + tok.encode('{"city": "Oslo"}', add_special_tokens=False).ids + [ids["<|call|>"]])
    m = GrammarTokenizer(tok.to_str(), tok.get_vocab_size(), [0]).matcher(spec)
    m.consume(seq)
    assert m.m.is_accepting()
    # the answer the server parses: decoded again with the markers kept (the chunks' text has them dropped)
    template = "{% if tools %}<|channel|>{% endif %}"

    class HarmonyText:
        chat_template = template

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    answer = ('<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary '
              'to=functions.get_time <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')
    answer_ids = tok.encode(answer, add_special_tokens=False).ids
    chunks_text = tok.decode(answer_ids)
    assert tools.split_answer(chunks_text, setup, template).calls == []  # why the answer is decoded again
    p = tools.split_answer(tools.answer_text(HarmonyText(), answer_ids, chunks_text), setup, template)
    assert p.calls == [("get_time", '{"city": "Oslo"}')] and p.reasoning == "think"
    assert tools.answer_text(gen.tokenizer, gen.encode("hi", chat=False), "hi") == "hi"  # other families: the text
    p = tools.PARSERS["qwen3_coder"]('<tool_call>\n<function=get_time>\n<parameter=city>\n42\n</parameter>\n'
                                     '</function>\n</tool_call>', (TIME,))
    assert p.calls == [("get_time", {"city": "42"})]
