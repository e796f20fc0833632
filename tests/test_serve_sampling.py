"""``dflash2 serve`` with the sampling set and logprobs, driven by the official ``openai`` client on the demo's export:
chat logprobs at T = 0 (each chosen token its top-1, the values the Python API's, streamed = whole), completions'
legacy logprobs and ``echo`` (prompt logprobs, the first null), ``n = 2`` with ``top_p = 0.9`` (two choices), several
prompts in one completions request (choice i = prompt i's own answer), penalties and a logit bias changing the greedy
answer as the Python API does (and equal with ``--speculation off``), harmless keys ignored with a logged warning
and refused with ``--strict-params``, bad sampling values a 400."""

from __future__ import annotations

import pytest

from test_serve import KEY, NAME, _post, _Server, export, gen  # noqa: F401 - fixtures

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")

MSG = [{"role": "user", "content": "List the days of the week."}]


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):  # noqa: F811
    s = _Server(export, tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-batch", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(export, tmp_path_factory):  # noqa: F811
    s = _Server(export, tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--speculation", "off",
                "--strict-params")
    yield s
    s.stop()


def test_chat_logprobs_greedy(server, gen):  # noqa: F811
    """T = 0: logprobs.content has one entry per token, each the top-1 of its top_logprobs, and equal to the Python
    API's (the target's after the transforms); the stream's entries are the whole answer's; cycles ran."""
    c = server.client()
    r = c.chat.completions.create(model=NAME, messages=MSG, max_tokens=16, temperature=0, logprobs=True,
                                  top_logprobs=3, presence_penalty=0.5)
    content = r.choices[0].logprobs.content
    ref = gen.generate(MSG, 16, temperature=0.0, logprobs=True, top_logprobs=3, presence_penalty=0.5)
    assert r.choices[0].message.content == ref.text and len(content) == len(ref.tokens)
    assert r.model_extra["dflash2"]["cycles"] > 0
    for e, lp in zip(content, ref.logprobs):
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(lp.logprob, abs=1e-5)
        assert e.token == gen.decode([lp.token]) and bytes(e.bytes) == e.token.encode()
    streamed = [e for ch in c.chat.completions.create(model=NAME, messages=MSG, max_tokens=16, temperature=0,
                                                      logprobs=True, top_logprobs=3, presence_penalty=0.5,
                                                      stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completions_logprobs_echo_and_several_prompts(server, gen):  # noqa: F811
    """Completions: logprobs=2 gives tokens / token_logprobs / top_logprobs / text_offset; echo returns the prompt's
    text first with its tokens' logprobs (the first null, the rest the prompt rows' log-softmax, as the Python
    API's prompt_logprobs); two prompts in one request give two choices, each its own prompt's greedy answer."""
    c = server.client()
    prompts = ["The capital of France is", "One, two, three,"]
    r = c.completions.create(model=NAME, prompt=prompts[0], max_tokens=8, temperature=0, logprobs=2, echo=True)
    ch = r.choices[0]
    ref = gen.generate(prompts[0], 8, temperature=0.0, chat=False, logprobs=True, top_logprobs=2,
                       prompt_logprobs=True)
    assert ch.text == prompts[0] + ref.text
    lp = ch.logprobs
    n_prompt = len(ref.prompt_tokens)
    assert len(lp.tokens) == n_prompt + len(ref.tokens) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([x.logprob for x in ref.prompt_logprobs], abs=1e-5)
    assert lp.token_logprobs[n_prompt:] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(max(t.values()) == v for t, v in zip(lp.top_logprobs[n_prompt:], lp.token_logprobs[n_prompt:]))
    both = c.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0)
    assert [x.index for x in both.choices] == [0, 1]
    assert [x.text for x in both.choices] == [gen.generate(p, 8, temperature=0.0, chat=False).text for p in prompts]
    assert both.usage.prompt_tokens == sum(len(gen.encode(p, chat=False)) for p in prompts)


def test_n_choices_with_top_p(server):
    """n = 2 with top_p = 0.9 at T = 1: two choices (indices 0, 1), whole and streamed (the streamed chunks carry
    their choice's index, each choice ends with its own finish_reason). Tokens are not compared across runs: the
    load-adaptive rule drafts by measured time, so a seed fixes the law, not the tokens."""
    c = server.client()
    kw = dict(model=NAME, messages=MSG, max_tokens=12, temperature=1.0, top_p=0.9, n=2, seed=7)
    r = c.chat.completions.create(**kw)
    assert [x.index for x in r.choices] == [0, 1] and all(x.message.content for x in r.choices)
    assert r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens >= 2
    texts, finished, ids = {0: "", 1: ""}, {}, set()
    for ch in c.chat.completions.create(**kw, stream=True):
        ids.add(ch.id)
        for x in ch.choices:
            texts[x.index] += x.delta.content or ""
            if x.finish_reason:
                finished[x.index] = x.finish_reason
    assert texts[0] and texts[1] and sorted(finished) == [0, 1] and len(ids) == 1  # one answer, one id


def test_penalties_and_bias_equal_plain_decoding(server, plain, gen):  # noqa: F811
    """Greedy with penalties and a logit bias: the speculative server's answer = the --speculation off server's =
    the Python API's, and differs from the answer without them (the transforms reach the target)."""
    ref0 = gen.generate(MSG, 24, temperature=0.0)
    bias = {str(ref0.tokens[1]): -100}
    kw = dict(model=NAME, messages=MSG, max_tokens=24, temperature=0, frequency_penalty=1.0, logit_bias=bias,
              extra_body={"repetition_penalty": 1.2, "top_k": 5, "min_p": 0.05})
    a = server.client().chat.completions.create(**kw).choices[0].message.content
    b = plain.client().chat.completions.create(**kw).choices[0].message.content
    ref = gen.generate(MSG, 24, temperature=0.0, frequency_penalty=1.0, logit_bias=bias, repetition_penalty=1.2,
                       top_k=5, min_p=0.05)
    assert a == b == ref.text != ref0.text


def test_harmless_keys_and_bad_values(server, plain):
    """store / metadata / reasoning_effort / service_tier are ignored with one logged warning (refused as unknown
    with --strict-params); a bad sampling value is a 400 naming it."""
    kw = dict(model=NAME, messages=MSG, max_tokens=2, temperature=0, store=True, metadata={"k": "v"},
              service_tier="auto", extra_body={"reasoning_effort": "low"})
    assert server.client().chat.completions.create(**kw).choices[0].message.content
    assert "ignored metadata, reasoning_effort, service_tier, store" in server.log.read_text()
    with pytest.raises(openai.BadRequestError, match="metadata"):
        plain.client().chat.completions.create(**kw)
    for bad, name in [({"top_p": 1.5}, "top_p"), ({"top_logprobs": 3}, "top_logprobs"),
                      ({"logit_bias": {"1": 500}}, "logit_bias"), ({"n": 0}, "n")]:
        status, body, _ = _post(server.url + "/v1/chat/completions", {"model": NAME, "messages": MSG, **bad})
        assert status == 400 and name in body["error"]["message"] + str(body["error"]["param"]), (bad, body)


def test_streamed_completions_of_two_prompts_with_logprobs(server, gen):  # noqa: F811
    """Completions streamed for two prompts with logprobs = 1 and usage: chunks of both indices, each choice's text
    its own greedy answer, its chunks' logprobs one per token (text_offset following the text sent), one usage
    chunk counting both, one [DONE]."""
    c = server.client()
    prompts = ["The capital of France is", "One, two, three,"]
    texts, tokens, offsets, usage = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}, []
    for ch in c.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, logprobs=1,
                                   stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage.append(ch.usage)
        for x in ch.choices:
            texts[x.index] += x.text
            if x.logprobs:
                tokens[x.index] += x.logprobs.tokens
                offsets[x.index] += x.logprobs.text_offset
    refs = [gen.generate(p, 8, temperature=0.0, chat=False) for p in prompts]
    assert [texts[0], texts[1]] == [r.text for r in refs]
    assert [len(tokens[0]), len(tokens[1])] == [len(r.tokens) for r in refs]
    assert offsets[0][0] == 0 and offsets[0] == sorted(offsets[0])
    assert len(usage) == 1 and usage[0].completion_tokens == sum(len(r.tokens) for r in refs)
