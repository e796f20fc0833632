"""The sampling transforms and logprobs (runtime/sampling.py) under speculation: the law against transformers' logits
processors, greedy speculative = plain decoding with each transform, logprobs at T = 0 against the target's own
rows, the law of the first two tokens by chi-square with drafts accepted (the single and the batched loop, a selector
path and independent drafts drawn again from the transformed law), and the negative control: drafts drawn from the
transformed law but the untransformed q fed to the acceptance ratio."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.runtime import batch as BT
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime import sampling as S
from dflash2_trt.runtime.protocol import Draft
from dflash2_trt.runtime.request import GenerationRequest
from helpers import req, transformed_logprobs, transformed_two_token_law, two_token_p_value

# one strong setting per transform (each changes the law of the accepting pair's target at T = 3)
TRANSFORMS = {
    "logit_bias": {"logit_bias": {7: 9.0, 18: -30.0}},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "presence_penalty": {"presence_penalty": 2.0},
    "frequency_penalty": {"frequency_penalty": 1.5},
    "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.1},
}


@pytest.fixture(scope="module")
def be(acc_export):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(acc_export, threads=1) as b:
        yield b


def _prompt(be, n=24, seed=17):
    return np.random.default_rng(seed).integers(0, be.manifest.target.vocab_size, n).tolist()


def _batch(be, mode="greedy", slots=8):
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    return BT.BatchDecoder(OrtBatchedTargetRunner.from_backend(be, slots), lambda: be.draft_runner(mode),
                           BT.SpeculationRule(adaptive=False))


@pytest.mark.parametrize("kw", [TRANSFORMS[k] for k in TRANSFORMS] + [
    {"temperature": 0.7, "top_k": 5, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.2,
     "presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": {3: 1.5}}], ids=[*TRANSFORMS, "all"])
def test_law_is_transformers(kw):
    """Sampler.logits + Sampler.law = transformers' processors with the bias and presence / frequency by hand, on
    random rows with ties, each verify row seeing the drafts before it; the drafts' counts reach the next rows."""
    rng = np.random.default_rng(0)
    V, prompt, drafts = 40, [1, 2, 2, 5, 9], [5, 7, 7]
    rows = rng.standard_normal((4, V)).astype(np.float32) * 2  # [n + 1, V]
    rows[:, 10:13] = rows[:, 10:11]  # ties
    r = GenerationRequest(**{"seed": 0, **kw})
    kw = dict(kw)
    T = kw.pop("temperature", 1.0)
    s = S.Sampler(r, prompt, V)
    got = s.law(s.logits(rows, drafts), T)
    want = np.exp(transformed_logprobs(rows, [prompt + drafts[:i] for i in range(4)], T, **kw))
    np.testing.assert_allclose(got, want, atol=1e-9)
    assert np.abs(got - np.exp(transformed_logprobs(rows, [[]] * 4, T))).max() > 1e-3  # the transform acts


@pytest.mark.parametrize("name", [*TRANSFORMS])
def test_greedy_speculative_equals_plain(be, name):
    """T = 0 with each transform: the single loop (greedy selector and independent drafts) and the batched loop give
    plain decoding's tokens, which are the argmax of the transformed rows; drafts accepted. Bias and penalties change
    the greedy output (top-k / top-p / min-p keep the argmax, so they do not)."""
    kw = TRANSFORMS[name]
    t = be.target_runner()
    prompts = [_prompt(be, 24, seed) for seed in (17, 18)]
    dec = _batch(be)
    ids = [dec.submit(p, req(24, eos_ids=set(), **kw)) for p in prompts]
    while dec.busy:
        dec.step()
    changed, accepted = 0, 0
    for p, i in zip(prompts, ids):
        want = D.target_generate(t, p, req(24, eos_ids=set(), **kw)).tokens
        changed += want != D.target_generate(t, p, req(24, eos_ids=set())).tokens
        for mode in ("greedy", "independent"):
            got = D.speculative_generate(t, be.draft_runner(mode), p, req(24, eos_ids=set(), draft_mode=mode, **kw))
            assert got.tokens == want, (name, mode)
            accepted += sum(got.accepted)
        assert dec.results[i].tokens == want, name
        accepted += sum(dec.results[i].accepted)
    assert accepted > 0
    assert changed == 0 if name in ("top_k", "top_p", "min_p") else changed > 0, name


def test_greedy_logprobs_are_the_transformed_targets(be):
    """logprobs at T = 0 (a bias and penalties on): each chosen token is its row's top-1, and its logprob is the
    logsoftmax of the target's transformed logits computed here from fresh B = 1 forwards (the speculative single and
    batched loops as plain decoding); prompt logprobs likewise from the prompt's rows."""
    kw = {"logit_bias": {7: 2.0}, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    t = be.target_runner()
    p = _prompt(be, 20)
    r = req(12, eos_ids=set(), logprobs=True, top_logprobs=3, prompt_logprobs=True, **kw)
    plain = D.target_generate(t, p, r)
    spec = D.speculative_generate(t, be.draft_runner("greedy"), p, r)
    dec = _batch(be)
    i = dec.submit(p, r)
    while dec.busy:
        dec.step()
    batched = dec.results[i]
    assert sum(spec.accepted) > 0 and sum(batched.accepted) > 0
    t.reset()
    rows = t.forward(p + plain.tokens[:-1])[0][len(p) - 1:]  # [12, V]: row j predicts token j
    want = transformed_logprobs(rows, [p + plain.tokens[:j] for j in range(len(plain.tokens))], **kw)
    for res in (plain, spec, batched):
        assert res.tokens == plain.tokens and len(res.logprobs) == len(res.tokens)
        for j, lp in enumerate(res.logprobs):
            assert lp.token == res.tokens[j] == lp.top[0][0] and len(lp.top) == 3
            assert lp.logprob == lp.top[0][1]
            assert lp.logprob == pytest.approx(want[j, lp.token], abs=1e-4)
            assert [tk for tk, _ in lp.top] == list(np.argsort(-want[j], kind="stable")[:3])
    t.reset()
    prow = t.forward(p)[0]
    pwant = transformed_logprobs(prow[:-1], [p[: i + 1] for i in range(len(p) - 1)], **kw)
    for res in (plain, spec, batched):
        assert [lp.token for lp in res.prompt_logprobs] == p[1:]
        got = np.array([lp.logprob for lp in res.prompt_logprobs])
        np.testing.assert_allclose(got, pwant[np.arange(len(p) - 1), p[1:]], atol=1e-4)
    assert D.target_generate(t, p, req(12, eos_ids=set(), **kw)).logprobs == []  # only when asked


class SpreadDrafter:
    """Independent drafts of a spread proposal: the accepting drafter's own (nearly one-hot) q mixed 60 / 40 with the
    uniform law, drawn by inverse CDF with the loop's uniforms (so top-p cuts a large part of it)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner

    def __getattr__(self, name):  # noqa: ANN001, ANN204 - block_size, num_draft_rows, reset, add_context
        return getattr(self.inner, name)

    def propose(self, anchor, pos, rows, temperature, uniforms):  # noqa: ANN001, ANN201
        from dflash2_trt.runtime.protocol import independent_draft

        q = self.inner.propose(anchor, pos, rows, temperature, uniforms).vocab_proposal.astype(np.float64)
        spread = 0.6 * q + 0.4 / q.shape[-1]  # [L, V]
        return independent_draft((np.log(spread) * temperature).astype(np.float32), temperature, uniforms, 8)


def _first_two(be, kw, n, mode="greedy", loop="single"):
    T = 3.0
    p = _prompt(be, 6) * 3  # a first cycle's row 0 is often accepted after it: the second token is a verified draft
    spread = mode == "spread"
    mode = "independent" if spread else mode
    reqs = [req(6, eos_ids=set(), temperature=T, seed=1000 + k, draft_mode=mode, **kw) for k in range(n)]
    if loop == "single":
        t, d = be.target_runner(), be.draft_runner(mode)
        d = SpreadDrafter(d) if spread else d
        res = [D.speculative_generate(t, d, p, r) for r in reqs]
    else:
        dec = _batch(be, mode, slots=16)
        ids = [dec.submit(p, r) for r in reqs]
        while dec.busy:
            dec.step()
        res = [dec.results[i] for i in ids]
    assert sum(sum(r.accepted) for r in res) > n // 4, "drafts accepted"
    return two_token_p_value(transformed_two_token_law(be.target_runner(), p, T, **kw),
                             [(r.tokens[0], r.tokens[1]) for r in res])


@pytest.mark.parametrize("name, mode, loop", [
    ("top_p", "greedy", "single"), ("top_k", "greedy", "single"), ("min_p", "greedy", "single"),
    ("presence_penalty", "greedy", "single"), ("logit_bias", "independent", "single"),
    ("top_p", "independent", "single"), ("top_p", "spread", "single"), ("top_k", "spread", "single"),
    ("top_p", "independent", "batch"), ("presence_penalty", "greedy", "batch")])
def test_sampling_law_under_speculation(be, name, mode, loop):
    """T = 3 with a transform: the joint law of a sequence's first two tokens (the second from a verified draft
    chain, drafts accepted) is the transformed target's, chi-square against transformers' processors on B = 1
    forwards. ``spread``: independent drafts of a spread proposal (:class:`SpreadDrafter`), drawn again from it under
    the transform."""
    assert _first_two(be, TRANSFORMS[name], 400, mode, loop) > 1e-3


def test_redraw_draws_from_the_transformed_law(be):
    """Independent drafts under top-p are drawn again from the drafter's proposal truncated the same way: the
    returned draft's tokens lie in its proposal's support and that proposal is what it carries."""
    t, d = be.target_runner(), be.draft_runner("independent")
    p = _prompt(be)
    t.reset()
    d.reset()
    _, feats = t.forward(p)
    d.add_context(feats, 0)
    u = np.random.default_rng(0).random((1, d.num_draft_rows), dtype=np.float32)
    raw = d.propose(p[-1], len(p), d.num_draft_rows, 3.0, u)
    s = S.Sampler(req(8, temperature=3.0, top_p=0.7), p, be.manifest.target.vocab_size)
    new = s.redraw(raw, u, d.num_draft_rows)
    want = S.truncate(raw.vocab_proposal, 0, 0.7, 0.0)
    np.testing.assert_allclose(new.vocab_proposal, want, atol=1e-6)
    assert all(want[i, tok] > 0 for i, tok in enumerate(new.tokens))
    assert (want > 0).sum() < (raw.vocab_proposal > 0).sum()  # the truncation cut tokens


def test_untransformed_q_is_caught(be, monkeypatch):
    """Negative control: drafts drawn from the transformed law (independent drafts of a spread proposal under top-p)
    but the drafter's untransformed q fed to the acceptance ratio — the chi-square test of the law fails."""
    real = S.Sampler.redraw

    def stale_q(self, draft, uniforms, n_rows):  # noqa: ANN001, ANN202 - the new tokens, the old proposal
        new = real(self, draft, uniforms, n_rows)
        return Draft(tokens=new.tokens, proposal=draft.proposal, cand=draft.cand, vocab_proposal=draft.vocab_proposal)

    monkeypatch.setattr(S.Sampler, "redraw", stale_q)
    assert _first_two(be, TRANSFORMS["top_p"], 400, "spread", "single") < 1e-3


def test_api_passes_the_sampling_set_and_returns_logprobs(acc_export):
    """The Python API: the record's sampling and logprobs fields as keyword arguments of generate / stream / submit
    (no per-field code in api.py); Result.logprobs = the loop's, Chunk.logprobs = each chunk's (stream and
    submit), the same tokens as generate; prompt logprobs skip the prefix cache (a repeat of the prompt restores
    it otherwise); an unknown option is one DFlash2Error."""
    import dflash2_trt
    from dflash2_trt import DFlash2Error

    kw = {"presence_penalty": 0.5, "logit_bias": {"7": 2.0}, "logprobs": True, "top_logprobs": 2}
    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        p = _prompt_ids = np.random.default_rng(5).integers(0, 512, 20).tolist()
        r = g.generate(p, max_new_tokens=10, guard=False, proposer="dflash2", eos_ids=set(), **kw)
        assert len(r.logprobs) == 10 and [lp.token for lp in r.logprobs] == r.tokens
        assert all(lp.top[0][0] == lp.token for lp in r.logprobs)
        assert r.tokens != g.generate(p, max_new_tokens=10, eos_ids=set()).tokens  # the transforms act
        s = g.stream(p, max_new_tokens=10, guard=False, proposer="dflash2", eos_ids=set(), **kw)
        chunks = list(s)
        assert [lp for c in chunks for lp in c.logprobs] == r.logprobs
        assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
        h = g.submit(p, max_new_tokens=10, proposer="dflash2", eos_ids=set(), **kw)
        hc = list(h)
        assert h.result().tokens == r.tokens and [lp.token for c in hc for lp in c.logprobs] == r.tokens
        again = g.generate(_prompt_ids, max_new_tokens=4, eos_ids=set())
        assert again.stats.cached_tokens > 0
        echo = g.generate(_prompt_ids, max_new_tokens=4, eos_ids=set(), prompt_logprobs=True)
        assert echo.stats.cached_tokens == 0 and [lp.token for lp in echo.prompt_logprobs] == p[1:]
        with pytest.raises(DFlash2Error, match="unknown option 'top_q'"):
            g.generate(p, top_q=0.5)
        with pytest.raises(DFlash2Error, match="top_p must be"):
            g.submit(p, top_p=1.5)
