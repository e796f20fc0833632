"""``dflash2 serve`` on the demo's export (SmolLM2-135M-Instruct + the packaged drafter), a real server process on a
free loopback port, driven by the official ``openai`` client: chat and completions, streaming and not, equal to
``Generator.generate`` at T = 0 (speculative cycles asserted to have run); stop strings; bad requests get a 400
with OpenAI's error object and never reach the batch; the API key; a client that goes away mid-stream (or before
a whole answer) frees its slot within one batch step (the server's ``dflash2_cancel_steps``); 16 concurrent
streaming clients with mixed lengths, some cancelling, every completed response equal to its own single-request
output; 100 mixed clients (stop strings, EOS, max_tokens, leaving early) and finished{reason} moving by exactly
what they saw; a full queue gets 429 with Retry-After; SIGTERM drains what is in flight and exits 0, and what still
decodes at --drain-timeout ends with finish_reason "abort" and [DONE]. The stop-string cut is also checked alone
against random splits of random text. (tests/test_serve_inputs.py: what clients send, in process.)"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
pytest.importorskip("starlette", reason="the serve extra")

import dflash2_trt  # noqa: E402
from dflash2_trt.serving.http.protocol import StopText  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-serve"
NAME = "smol"
PROMPTS = ["Count from one to ten.", "Write a haiku about the sea.", "What is the capital of France?",
           "Explain recursion to a child.", "Name three prime numbers.", "Write a Python function that adds two numbers.",
           "Say hello in French.", "List the days of the week.", "Why is the sky blue?",
           "Give me a short motto for a bakery."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``dflash2 serve`` in a subprocess; its stderr goes to a file (read by the tests)."""

    def __init__(self, export: Path, tmp: Path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash2_trt.cli", "serve", str(export), "--port", str(self.port), "--threads", "1",
             "--model-name", NAME, *args], stdout=subprocess.DEVNULL, stderr=self.log.open("w"), cwd=ROOT,
            env=dict(os.environ, DFLASH2_ORT_SPINNING="0"))
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()[-2000:]
            time.sleep(0.3)

    def client(self, key: str | None = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples: name{label="v",...} -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 30, until=lambda m: True) -> dict[str, float]:  # noqa: ANN001
        """The metrics once no request is in flight and ``until(metrics)`` holds (the forwarding thread and the
        event loop record a request's end separately: a scrape may fall between the two)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["dflash2_requests_running"] == 0 and m["dflash2_requests_waiting"] == 0 and until(m):
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _post(url: str, body, key: str | None = KEY) -> tuple[int, dict, dict]:
    """A raw POST (bodies the openai client would not send) -> (status, JSON body, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture(scope="module")
def export():
    from dflash2_trt.bench.exports import demo_export

    return demo_export()


@pytest.fixture(scope="module")
def gen(export):
    """The same export in process: the references."""
    with dflash2_trt.load(export, "ort", threads=1) as g:
        yield g


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):
    s = _Server(export, tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-batch", "8", "--max-queue", "8")
    yield s
    s.stop()


def _ref(gen, prompt, max_tokens: int, chat: bool) -> dflash2_trt.Result:
    msgs = [{"role": "user", "content": prompt}]
    return gen.generate(msgs if chat else prompt, max_tokens, temperature=0.0, chat=chat)


def test_chat_and_completions_equal_generate(server, gen):
    """Non-streaming and streaming, both routes, greedy: the text is Generator.generate's, usage counts its tokens,
    the stream's pieces add up to it and end with finish_reason then [DONE]; speculative cycles ran and accepted
    drafts (the dflash2 extension field and the pooled τ metric); /v1/models names the model; the server listens
    on loopback without --host."""
    c = server.client()
    assert [m.id for m in c.models.list().data] == [NAME] and c.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")
    assert f"Uvicorn running on http://127.0.0.1:{server.port}" in server.log.read_text()
    accepted = multi = 0
    for i, (prompt, n) in enumerate(zip(PROMPTS[:3], (24, 17, 30))):
        for chat in (True, False):
            ref = _ref(gen, prompt, n, chat)
            multi += len(ref.tokens) > 1
            if chat:
                r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=n, temperature=0)
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
                assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
            else:
                r = c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0)
                text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert text == ref.text, (prompt, chat)
            assert r.usage.completion_tokens == len(ref.tokens) and r.usage.prompt_tokens == len(ref.prompt_tokens)
            assert finish == ("stop" if ref.finish_reason == "stop" else "length")
            accepted += r.model_extra["dflash2"]["accepted_drafts"]

            kw = dict(model=NAME, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True})
            if chat:
                events = list(c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw))
                assert events[0].choices[0].delta.role == "assistant"
                pieces = [e.choices[0].delta.content or "" for e in events if e.choices]
            else:
                events = list(c.completions.create(prompt=prompt, **kw))
                pieces = [e.choices[0].text for e in events if e.choices]
            assert "".join(pieces) == ref.text, (prompt, chat)
            assert len([p for p in pieces if p]) >= min(2, len(ref.text))  # it streamed, not all at the end
            finishes = [e.choices[0].finish_reason for e in events if e.choices]
            assert finishes[-1] == finish and not any(finishes[:-1])
            assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(ref.tokens)
    assert accepted > 0  # the drafter's proposals were accepted on the way: the speculative path ran
    m = server.metrics()
    assert m["dflash2_tau"] > 1 and 0 < m["dflash2_acceptance_rate"] <= 1
    assert m["dflash2_time_to_first_token_seconds_count"] == 12  # this test's requests, each one observation
    assert m["dflash2_time_per_output_token_seconds_count"] == 2 * multi  # those of more than one token
    assert m['dflash2_requests_finished_total{reason="length"}'] + m.get('dflash2_requests_finished_total{reason="stop"}',
                                                                         0) == 12


def test_a_conversation_reuses_its_history(server, export):
    """Turn 2 of a chat resends turn 1 and its answer: the prefix cache restores them (OpenAI's
    usage.prompt_tokens_details.cached_tokens, the Prometheus series) and the answer is the one computed from an
    empty cache."""
    c = server.client()
    before = server.metrics()
    msgs = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": PROMPTS[2]}]
    r1 = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": PROMPTS[0]}]
    r2 = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens / 2  # (the template's opening)
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens  # turn 1's prompt at least: the history
    with dflash2_trt.load(export, "ort", threads=1, prefix_cache_bytes=0) as cold:
        assert r2.choices[0].message.content == cold.generate(msgs, 12, temperature=0.0).text
    after = server.metrics()
    assert _delta(after, before, "dflash2_prefix_cache_hit_tokens_total") >= cached
    assert _delta(after, before, "dflash2_prefix_cache_computed_tokens_total") > 0
    assert 0 < after["dflash2_prefix_cache_bytes"] <= after["dflash2_prefix_cache_budget_bytes"]


def test_raw_sse_framing(server):
    """The wire format itself: `data: {json}` events separated by a blank line, `data: [DONE]` last."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 5,
                                                         "temperature": 0, "stream": True}),
                 {"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = r.read().decode().split("\n\n")
    conn.close()
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    bodies = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(b["object"] == "text_completion" for b in bodies) and bodies[-1]["choices"][0]["finish_reason"]


def test_stop_strings_cut_the_text(server, gen):
    """A stop string taken from the middle of the greedy output: the answer ends right before its first
    occurrence, finish_reason "stop", streamed or not; usage counts the tokens up to the one completing it."""
    c = server.client()
    prompt = PROMPTS[3]
    ref = _ref(gen, prompt, 40, True)
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    cut = ref.text[:ref.text.find(stop)]
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=40,
                                  temperature=0, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    n = r.usage.completion_tokens
    assert n < len(ref.tokens) and stop in gen.decode(ref.tokens[:n]) and stop not in gen.decode(ref.tokens[:n - 1])
    events = list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(e.choices[0].delta.content or "" for e in events) == cut
    assert events[-1].choices[0].finish_reason == "stop"


def test_stop_text_matches_the_whole_string_cut():
    """StopText fed in random pieces sends exactly the text before the first stop string (or all of it)."""
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        hits = [text.find(s) for s in stops if s in text]
        want = text[:min(hits)] if hits else text
        cut, sent, i = StopText(stops), "", 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            sent += cut.add(text[i:j])
            i = j
        if not cut.hit:
            sent += cut.flush()
        assert sent == want and cut.hit == bool(hits), (text, stops)


def test_serve_without_the_extra_is_one_line():
    code = ("import sys; sys.modules['uvicorn'] = None; from dflash2_trt.cli import main; "
            "sys.exit(main(['serve', 'no-such-export']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip() == ("dflash2: error: dflash2 serve needs the serve extra (uvicorn "
                                                      "is missing): pip install 'dflash2-trt[serve]'"), r.stderr


BAD = [  # (body changes, param named in the error)
    ({"n": 0}, "n"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"seed": -1}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": "hello"}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0]"),
    ({"max_tokens": 2048}, "messages"),  # prompt + max_tokens beyond the export's 2048 positions
]


def test_bad_requests_get_400_and_never_reach_the_batch(server, gen):
    base = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    before = server.metrics()
    c = server.client()
    for change, param in BAD:
        st, body, _ = _post(server.url + "/v1/chat/completions", {**base, **change})
        assert st == 400, (change, body)
        err = body["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (change, err)
    with pytest.raises(openai.BadRequestError) as e:  # the official client sees the same
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], n=17)
    assert e.value.body["param"] == "n"
    long_prompt = [1] * gen.max_positions  # completions: token ids, one more than fits with a token to generate
    for body, param in [({"model": NAME, "prompt": long_prompt, "max_tokens": 1}, "prompt"),
                        ({"model": NAME, "prompt": [10**9], "max_tokens": 1}, "prompt"),  # id out of the vocabulary
                        ({"model": NAME, "prompt": ["a"] * 33}, "prompt"),
                        ({"model": NAME, "prompt": "", "max_tokens": 1}, "prompt"),
                        ({"model": NAME, "prompt": "Hi", "echo": "yes"}, "echo")]:
        st, out, _ = _post(server.url + "/v1/completions", body)
        assert st == 400 and out["error"]["param"] == param, (body if len(str(body)) < 200 else param, out)
    assert "context length" in _post(server.url + "/v1/completions", {"model": NAME, "prompt": long_prompt})[1][
        "error"]["message"]
    st, out, _ = _post(server.url + "/v1/chat/completions", b"{not json")
    assert st == 400 and out["error"]["code"] == "invalid_json"
    st, out, _ = _post(server.url + "/v1/chat/completions", {**base, "model": "other"})
    assert st == 404 and out["error"]["code"] == "model_not_found"
    st, out, _ = _post(server.url + "/v1/embeddings", {"model": NAME, "input": "x"})  # a route we do not have
    assert st == 404 and out["error"]["code"] == "not_found"
    st, out, _ = _post(server.url + "/health", {})
    assert st == 405 and out["error"]["message"]
    after = server.metrics()
    assert _delta(after, before, "dflash2_requests_submitted_total") == 0
    assert _delta(after, before, "dflash2_generation_tokens_total") == 0


def test_api_key(server):
    for key in (None, "wrong"):
        with pytest.raises(openai.AuthenticationError) as e:
            server.client(key).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            server.client(key).models.list()
    assert _post(server.url + "/v1/completions", {"model": NAME, "prompt": "Hi"}, key=None)[0] == 401
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:  # open for load balancers and scrapers
        assert r.status == 200


def test_a_client_that_goes_away_frees_its_slot_within_one_step(server):
    """A stream closed after three events and a whole answer whose socket closes while it decodes: each request
    leaves the batch (running and waiting back to 0) within one batch step of the server seeing the disconnect, long
    before its 400 tokens; finished{reason="cancelled"} counts both."""
    c = server.client()
    server.wait_idle()
    before = server.metrics()
    stream = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=400, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    mid = server.wait_idle(until=lambda m: _delta(m, before, "dflash2_cancel_steps_count") >= 1)
    assert _delta(mid, before, "dflash2_cancel_steps_count") == 1
    assert _delta(mid, before, "dflash2_cancel_steps_sum") <= 1  # the step under way, at most
    assert _delta(mid, before, 'dflash2_requests_finished_total{reason="cancelled"}') == 1
    assert _delta(mid, before, "dflash2_generation_tokens_total") < 100

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "Tell me a story", "max_tokens": 400,
                                                         "temperature": 0, "ignore_eos": True}),
                 {"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 30
    while server.metrics()["dflash2_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = server.wait_idle(until=lambda m: _delta(m, mid, "dflash2_cancel_steps_count") >= 1)
    assert _delta(after, mid, "dflash2_cancel_steps_count") == 1 and _delta(after, mid, "dflash2_cancel_steps_sum") <= 1
    assert _delta(after, mid, 'dflash2_requests_finished_total{reason="cancelled"}') == 1
    assert _delta(after, mid, "dflash2_generation_tokens_total") < 100


def test_sixteen_concurrent_streams(server, gen):
    """16 streaming clients at once into 8 slots (the rest wait): chat and completions, 6..40 tokens, four closing
    their stream after two events. Every completed stream equals its own request decoded alone by
    Generator.generate (nothing lost or mixed); the cancelled ones leave; steps decoded several sequences at once;
    the server's counts add up."""
    rng = random.Random(7)
    jobs = [(PROMPTS[i % len(PROMPTS)] + (" Please." if i >= len(PROMPTS) else ""), rng.randint(6, 40), i % 2 == 0,
             i % 4 == 3) for i in range(16)]
    refs = [None if cancel else _ref(gen, p, n, chat) for p, n, chat, cancel in jobs]
    server.wait_idle()
    before = server.metrics()
    out: list = [None] * 16
    go = threading.Barrier(16)

    def client(i: int) -> None:
        p, n, chat, cancel = jobs[i]
        c = server.client()
        go.wait()
        # a cancelling client asks for 60 more tokens than it reads, EOS or not: it cannot finish first
        kw = dict(model=NAME, max_tokens=n + 60 * cancel, temperature=0, stream=True,
                  extra_body={"ignore_eos": True} if cancel else None)
        if chat:
            s = c.chat.completions.create(messages=[{"role": "user", "content": p}], **kw)
        else:
            s = c.completions.create(prompt=p, **kw)
        events = []
        for e in s:
            events.append(e)
            if cancel and len(events) == 2:
                s.close()
                break
        out[i] = events

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = server.wait_idle(until=lambda m: _delta(m, before, 'dflash2_requests_finished_total{reason="cancelled"}')
                             + _delta(m, before, 'dflash2_requests_finished_total{reason="stop"}')
                             + _delta(m, before, 'dflash2_requests_finished_total{reason="length"}') >= 16)
    ids = set()
    for i, ((p, n, chat, cancel), ref, events) in enumerate(zip(jobs, refs, out)):
        assert events, i
        ids.add(events[0].id)
        assert all(e.id == events[0].id for e in events)
        if cancel:
            continue
        text = "".join((e.choices[0].delta.content or "") if chat else e.choices[0].text for e in events if e.choices)
        assert text == ref.text, (i, p, n)
        assert events[-1].choices[0].finish_reason == ("stop" if ref.finish_reason == "stop" else "length")
    assert len(ids) == 16
    assert _delta(after, before, "dflash2_requests_submitted_total") == 16
    done = sum(_delta(after, before, f'dflash2_requests_finished_total{{reason="{r}"}}') for r in ("stop", "length"))
    assert done == 12 and _delta(after, before, 'dflash2_requests_finished_total{reason="cancelled"}') == 4
    assert _delta(after, before, "dflash2_generation_tokens_total") >= sum(len(r.tokens) for r in refs if r)
    shared = sum(_delta(after, before, f'dflash2_batch_steps_total{{size="{k}"}}') for k in range(2, 9))
    assert shared > 0 and after.get('dflash2_batch_steps_total{size="9"}', 0) == 0  # never beyond max batch


def test_finished_reasons_equal_what_100_clients_saw(server):
    """100 requests from 12 clients at once, mixed: streams ending on a stop string, on EOS or max_tokens, whole
    answers with and without stop strings, streams the client closes after its first event. The server's
    dflash2_requests_finished_total{reason} moves by exactly what the clients saw: the finish_reason each got, or
    "cancelled" for those that left (a stream ended by a stop string was counted "cancelled" when the client's
    disconnect after [DONE] reached the server first)."""
    rng = random.Random(11)
    jobs = [(i % 5, PROMPTS[i % len(PROMPTS)], rng.randint(3, 12)) for i in range(100)]
    seen: list = [None] * len(jobs)
    server.wait_idle()
    before = server.metrics()
    todo = iter(range(len(jobs)))
    lock = threading.Lock()

    def client() -> None:
        c = server.client()
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            kind, prompt, n = jobs[i]
            msgs = [{"role": "user", "content": prompt}]
            if kind == 0:  # a stream that a stop string ends (a space comes early in any answer)
                events = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=n + 20, temperature=0,
                                                        stop=[" ", "."], stream=True))
                seen[i] = events[-1].choices[0].finish_reason
            elif kind == 1:  # a stream to EOS or max_tokens
                events = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=n, temperature=0,
                                                        stream=True))
                seen[i] = events[-1].choices[0].finish_reason
            elif kind == 2:  # a whole answer, a stop string half of the time
                r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=n, temperature=0,
                                              stop=" " if i % 2 else None)
                seen[i] = r.choices[0].finish_reason
            elif kind == 3:  # a completions stream to max_tokens
                events = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
                seen[i] = events[-1].choices[0].finish_reason
            else:  # a stream left after its first token: it cannot have finished (200 more tokens, no EOS)
                s = c.completions.create(model=NAME, prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
                next(iter(s))
                s.close()
                seen[i] = "cancelled"

    threads = [threading.Thread(target=client) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(seen), [i for i, x in enumerate(seen) if x is None]
    reasons = ("stop", "length", "cancelled", "abort", "error")
    after = server.wait_idle(until=lambda m: sum(_delta(m, before, f'dflash2_requests_finished_total{{reason="{r}"}}')
                                                 for r in reasons) >= len(jobs))
    counted = {r: _delta(after, before, f'dflash2_requests_finished_total{{reason="{r}"}}') for r in reasons}
    want = {r: sum(x == r for x in seen) for r in reasons}
    assert counted == want and want["stop"] >= 20 and want["length"] >= 20 and want["cancelled"] == 20, (counted,
                                                                                                          want)


def test_drain_timeout_ends_what_still_decodes_with_abort(export, tmp_path):
    """SIGTERM with two long streams and a whole answer in flight and --drain-timeout 1: after a second each stream
    gets a last chunk with finish_reason "abort" then [DONE], the whole answer its text so far with "abort"; the
    process exits 0 without a traceback or uvicorn's cancel of the connections (the metrics cannot be scraped
    while draining: the listener is closed)."""
    s = _Server(export, tmp_path, "--max-batch", "4", "--drain-timeout", "1")
    try:
        c = s.client(None)
        streams = [c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=1500, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}) for i in range(2)]
        out: list = [[], [], None]

        def read(i: int) -> None:
            out[i] = list(streams[i])

        def whole() -> None:
            out[2] = _post(s.url + "/v1/completions", {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 1500,
                                                       "temperature": 0, "ignore_eos": True}, key=None)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(2)] + [threading.Thread(target=whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while s.metrics()["dflash2_requests_running"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
    for events in out[:2]:
        assert events and events[-1].choices[0].finish_reason == "abort" and not any(
            e.choices[0].finish_reason for e in events[:-1])
        assert 0 < sum(len(e.choices[0].text) for e in events)
    st, body, _ = out[2]
    assert st == 200 and body["choices"][0]["finish_reason"] == "abort" and body["usage"]["completion_tokens"] < 1500
    log = s.log.read_text()
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]


@pytest.fixture
def small(export, tmp_path):
    """One slot, one queue place: the third request in flight is over the bound."""
    s = _Server(export, tmp_path, "--max-batch", "1", "--max-queue", "1", "--drain-timeout", "60")
    yield s
    s.stop()


def test_full_queue_gets_429_then_sigterm_drains(small, gen):
    """Two long streams hold the slot and the queue place: a third request gets 429 with Retry-After (the openai
    client's RateLimitError), and is not submitted. Then SIGTERM while both stream: the listener closes at once,
    both streams finish whole (equal to generate), the process exits 0."""
    c = small.client(None)
    streams, out = [], [[], []]
    for i in range(2):
        streams.append(c.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=60, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    deadline = time.monotonic() + 30
    while (m := small.metrics())["dflash2_requests_running"] + m["dflash2_requests_waiting"] < 2:
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert small.metrics()["dflash2_requests_submitted_total"] == 2

    def read(i: int) -> None:
        out[i] = list(streams[i])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    small.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # the listening socket closes at once; new connections are refused
        try:
            socket.create_connection(("127.0.0.1", small.port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for t in readers:
        t.join(timeout=120)
    assert small.proc.wait(60) == 0
    for i in range(2):
        ref = gen.generate(PROMPTS[i], 60, temperature=0.0, chat=False, eos_ids=set())
        assert "".join(e.choices[0].text for e in out[i]) == ref.text
        assert out[i][-1].choices[0].finish_reason == "length"
