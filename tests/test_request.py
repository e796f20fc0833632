"""The one request record (dflash2_trt/runtime/request.py): GenerationRequest's field checks (made once, when it is
built), its limits step (``validate``: once per request, whichever entry point), the defaults the Python API
repeats, the entry points that build it (API, server, Triton model, CLI) and the accept step both loops share."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import dflash2_trt
from dflash2_trt import DFlash2Error
from dflash2_trt.api import Generator
from dflash2_trt.runtime import request as R
from dflash2_trt.runtime.request import GenerationRequest, Limits
from helpers import req

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dflash2_trt"


@pytest.mark.parametrize("field, value, message", [
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("max_new_tokens", 2.0, "max_new_tokens must be an integer >= 1"),
    ("max_new_tokens", True, "max_new_tokens must be an integer >= 1"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0"),
    ("temperature", "0.7", "temperature must be a finite number >= 0"),
    ("seed", -1, "seed must be an integer >= 0 or None"),
    ("seed", 1.5, "seed must be an integer >= 0 or None"),
    ("draft_mode", "bogus", "draft mode must be one of greedy, viterbi, independent, got 'bogus'"),
    ("proposer", "lookahead", "proposer must be one of dflash2, ngram, auto, got 'lookahead'"),
    ("ngram_rows", 0, "ngram_rows must be an integer >= 1 or None"),
    ("min_confidence", 1.5, "min_confidence must be in [0, 1]"),
    ("min_confidence", float("nan"), "min_confidence must be in [0, 1]"),
    ("eos_ids", [1, "2"], "eos_ids must be a collection of token ids"),
    ("eos_ids", 7, "eos_ids must be a collection of token ids"),
])
def test_building_the_record_checks_each_field(field, value, message):
    with pytest.raises(DFlash2Error, match=re.escape(message)):
        GenerationRequest(**{field: value})


def test_the_record_is_frozen_normalised_and_draws_a_seed_once():
    r = GenerationRequest(max_new_tokens=np.int64(5), temperature=1, eos_ids=[3, np.int32(4)], seed=None)
    assert r.max_new_tokens == 5 and type(r.max_new_tokens) is int and r.temperature == 1.0
    assert r.eos_ids == frozenset({3, 4}) and isinstance(r.seed, int) and 0 <= r.seed < 2**63
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.temperature = 0.5  # type: ignore[misc]
    assert dataclasses.replace(r, guard=False).seed == r.seed  # a copy keeps the drawn stream
    assert len({GenerationRequest().seed for _ in range(8)}) == 8  # None: a fresh stream per record
    with pytest.raises(TypeError):
        GenerationRequest(64)  # type: ignore[misc]  # keyword-only: a field is named where it is set


def test_validate_checks_the_prompt_against_the_limits_and_resolves_max_new_tokens():
    lim = Limits(vocab_size=100, max_positions=16, draft_modes=("greedy",))
    for prompt, message in [([], "empty prompt"), ([1, 100], r"prompt token id 100 out of range \[0, 100\)"),
                            ([1] * 16, "prompt of 16 tokens does not fit the 16 positions")]:
        with pytest.raises(DFlash2Error, match=message):
            GenerationRequest().validate(prompt, lim)
    with pytest.raises(DFlash2Error, match="has no 'viterbi' draft head"):
        GenerationRequest(draft_mode="viterbi").validate([1, 2], lim)
    confident = GenerationRequest(min_confidence=0.5).validate([1, 2], lim)  # B = 1 verifies fewer rows
    with pytest.raises(DFlash2Error, match="min_confidence must be 0 for the batched loop"):
        confident.validate([1, 2], Limits(100, 16, whole_blocks=True))  # stamped for B = 1, checked for batching
    assert GenerationRequest(max_new_tokens=None).validate([1, 2, 3], lim).max_new_tokens == 13  # the room left
    r = GenerationRequest(max_new_tokens=4).validate([1, 2], lim)
    assert r.validate([1, 2], lim) is r  # stamped: not checked again for this prompt and these limits
    assert r.validate([1, 2], Limits(100, 16)) is r  # nor by a loop, which checks no draft modes
    with pytest.raises(DFlash2Error, match="out of range"):
        r.validate([1, 200], lim)  # another prompt: checked


def test_the_apis_option_arguments_repeat_the_records_defaults():
    """One default per option: the API's arguments name the record's fields (``selector`` is ``draft_mode``) and
    default to its values, so an entry point that passes nothing gets what the record says."""
    fields = {f.name: f.default for f in dataclasses.fields(GenerationRequest) if f.init}
    for method in (Generator.generate, Generator.stream, Generator.submit, Generator.generate_batch):
        params = inspect.signature(method).parameters
        for name, p in params.items():
            field = "draft_mode" if name == "selector" else name
            if field in fields:
                assert p.default == fields[field], (method.__name__, name, p.default, fields[field])
        assert method is Generator.generate_batch or "request" in params  # a record built elsewhere goes in whole
    assert fields["max_new_tokens"] == 128 and fields["proposer"] == "auto" and fields["seed"] is None


@pytest.fixture(scope="module")
def gen(acc_export):
    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        yield g


def _count_checks(monkeypatch) -> list:  # noqa: ANN001
    calls: list = []
    real = R.check_limits

    def counting(request, prompt, limits):  # noqa: ANN001, ANN202
        calls.append(tuple(prompt))
        return real(request, prompt, limits)

    monkeypatch.setattr(R, "check_limits", counting)
    return calls


def _entry_points(gen) -> dict:  # noqa: ANN001
    p = [3, 4, 5, 6]
    return {
        "generate": lambda: gen.generate(p, max_new_tokens=6, guard=False),
        "generate plain": lambda: gen.generate(p, max_new_tokens=6, speculative=False),
        "stream": lambda: list(gen.stream(p, max_new_tokens=6, guard=False)),
        "submit": lambda: gen.submit(p, max_new_tokens=6).result(),
        "generate request=": lambda: gen.generate(p, request=GenerationRequest(max_new_tokens=6, seed=1)),
    }


def test_each_entry_point_checks_a_request_once(gen, monkeypatch):
    """The API validates the record it built (or was given) once; the loops it hands it to (B = 1 speculative and
    plain, the batch loop behind submit) find it stamped and do not check it again."""
    assert gen._backend.batching  # submit goes through the batched loop's BatchDecoder.submit
    calls = _count_checks(monkeypatch)
    for name, run in _entry_points(gen).items():
        calls.clear()
        run()
        assert calls == [(3, 4, 5, 6)], (name, calls)


def test_a_loop_given_an_unchecked_record_checks_it_and_a_lost_stamp_is_caught(gen, monkeypatch):
    """Negative control: a validate that forgets its stamp makes every loop check the request a second time, which
    the count above catches; a loop called directly with an unchecked record checks it once itself."""
    from dflash2_trt.runtime import decoder as D

    calls = _count_checks(monkeypatch)
    D.speculative_generate(gen._runner(), gen._drafter("greedy"), [3, 4, 5], req(4))
    assert calls == [(3, 4, 5)]
    real = GenerationRequest.validate

    def forgetful(self, prompt, limits):  # noqa: ANN001, ANN202
        out = real(self, prompt, limits)
        object.__setattr__(out, "_checked", None)
        return out

    monkeypatch.setattr(GenerationRequest, "validate", forgetful)
    for name, run in _entry_points(gen).items():
        calls.clear()
        run()
        assert len(calls) == 2, (name, calls)


def test_the_api_takes_options_or_a_record_not_both(gen):
    with pytest.raises(DFlash2Error, match=r"not both \(max_new_tokens, temperature\)"):
        gen.generate([3, 4], max_new_tokens=5, temperature=0.5, request=GenerationRequest())
    with pytest.raises(DFlash2Error, match="request must be a GenerationRequest"):
        gen.generate([3, 4], request={"max_new_tokens": 5})
    with pytest.raises(DFlash2Error, match="max_new_tokens must be an integer >= 1"):
        gen.submit([3, 4], max_new_tokens=0)  # refused at submit, nothing queued
    with pytest.raises(DFlash2Error, match="min_confidence must be 0 for the batched loop"):
        gen.submit([3, 4], request=GenerationRequest(min_confidence=0.5))


def _calls_to(path: Path, methods: set[str]) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in methods and ast.unparse(n.func.value) in ("self.gen", "gen")]


def test_the_server_the_triton_model_and_the_cli_only_build_the_record():
    """They hand the API a GenerationRequest (``request=``), never option arguments of their own; the server's
    parser returns one in its parsed request."""
    from dflash2_trt.serving.http import protocol as P

    entry = {PKG / "serving" / "http" / "app.py": {"submit"},
             PKG / "serving" / "triton" / "templates" / "dflash2_model.py": {"submit"},
             PKG / "cli.py": {"generate", "stream"}}
    for path, methods in entry.items():
        calls = _calls_to(path, methods)
        assert calls, path
        for c in calls:
            kws = {k.arg for k in c.keywords}
            assert "request" in kws and kws <= {"request", "chat", "oracle"} and len(c.args) == 1, ast.unparse(c)
    call = P.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
                         "seed": 3, "ignore_eos": True})
    assert call.request == GenerationRequest(max_new_tokens=None, temperature=0.5, seed=3, eos_ids=frozenset())


def test_field_checks_live_in_the_record_alone():
    """The phrases of the field checks appear in one module: no entry point or loop checks a field again."""
    phrases = ["max_new_tokens must be", "temperature must be", "seed must be an integer", "proposer must be one of",
               "ngram_rows must be", "min_confidence must be", "empty prompt", "prompt token id {"]
    for path in PKG.rglob("*.py"):
        if path == PKG / "runtime" / "request.py":
            continue
        text = path.read_text()
        found = [ph for ph in phrases if ph in text]
        assert not found, (path.relative_to(ROOT), found)


def test_both_loops_accept_through_the_one_accept_step(acc_export, monkeypatch):
    """The single and the batched loop call runtime/accept.accept_drafts (no acceptance of their own): a rule
    planted in it (accept nothing) reaches both, so every cycle of either accepts 0 drafts."""
    from dflash2_trt.runtime import accept as A
    from dflash2_trt.runtime import batch as BT
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    assert D.accept_drafts is BT.accept_drafts is A.accept_drafts  # one function, imported by both loops
    for mod in (D, BT):
        src = Path(mod.__file__).read_text()
        assert "accept_greedy" not in src and "accept_rejection" not in src, mod  # no acceptance of their own

    def reject_all(draft, drafts, v_logits, temperature, rng, sampler=None):  # noqa: ANN001, ANN202
        return 0, int(np.argmax(v_logits[0]))

    be = OrtBackend(acc_export)
    p = [3, 4, 5, 6, 3, 4, 5, 6]
    good = D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p, req(24, eos_ids=set()))
    dec = BT.BatchDecoder(OrtBatchedTargetRunner.from_backend(be, 2), lambda: be.draft_runner("greedy"),
                          BT.SpeculationRule(adaptive=False))
    good_b = dec.run([(p, req(24, eos_ids=set()))])[0]
    assert max(good.accepted) > 0 and max(good_b.accepted) > 0  # the real step accepts drafts here
    monkeypatch.setattr(D, "accept_drafts", reject_all)
    monkeypatch.setattr(BT, "accept_drafts", reject_all)
    bad = D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p, req(24, eos_ids=set()))
    dec = BT.BatchDecoder(OrtBatchedTargetRunner.from_backend(be, 2), lambda: be.draft_runner("greedy"),
                          BT.SpeculationRule(adaptive=False))
    bad_b = dec.run([(p, req(24, eos_ids=set()))])[0]
    assert bad.accepted and set(bad.accepted) == {0} and bad_b.accepted and set(bad_b.accepted) == {0}
    assert bad.tokens == good.tokens == bad_b.tokens  # greedy: the bonus token is the target's own either way


@pytest.mark.parametrize("parse, body, param, code", [
    ("parse_chat", {"messages": [{"role": "user", "content": "hi"}]}, "model", "missing_required_parameter"),
    ("parse_chat", {"model": 3, "messages": [{"role": "user", "content": "hi"}]}, "model", "invalid_type"),
    ("parse_chat", {"model": "m"}, "messages", "missing_required_parameter"),
    ("parse_chat", {"model": "m", "messages": {"role": "user"}}, "messages", "invalid_type"),
    ("parse_completion", {"model": "m"}, "prompt", "missing_required_parameter"),
    ("parse_completion", {"prompt": "hi", "model": None}, "model", "missing_required_parameter"),
])
def test_the_server_names_a_missing_or_mistyped_required_field(parse, body, param, code):
    """model, messages and prompt: absent (or null) -> missing_required_parameter, of the wrong type -> invalid_type;
    OpenAI's error object names the field either way."""
    from dflash2_trt.serving.http import protocol as P

    with pytest.raises(P.RequestError) as e:
        getattr(P, parse)(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), str(e.value)
    assert param in str(e.value)
