"""The law of constrained sampling under speculation, end to end: requests with a grammar (and top-p / a presence
penalty) at T > 0 through the Python API's single loop (``generate``) and batched loop (``submit``) on the accepting
pair's export, drafts accepted and partial acceptances rolled back. The joint law of a sequence's first two tokens
(the second from a verified draft chain) is the masked, transformed target's: the grammar's masks computed here with
llguidance itself, the transforms by transformers' processors on B = 1 forwards (tests/helpers.py), compared by
chi-square as the plain sampling laws are.

Negative controls (each caught by the same chi-square): a draft redrawn from the masked proposal but the unmasked
proposal fed to the acceptance ratio; drafts drawn from the transformed law (top-p) but the untransformed q fed to
it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime import grammar
from dflash2_trt.runtime import sampling as S
from dflash2_trt.runtime.grammar import GrammarSpec
from dflash2_trt.runtime.protocol import Draft
from helpers import req, transformed_logprobs, two_token_p_value
from test_sampling import SpreadDrafter

llguidance = pytest.importorskip("llguidance")

T = 3.0
REGEX = "[a-z ]+"  # lower-case words: about a third of the tiny tokenizer's tokens, the copy continuation among them
N = 400


@pytest.fixture(scope="module")
def gen(acc_export):
    import dflash2_trt

    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        yield g


def _prompt(gen) -> list[int]:
    """Six random tokens the grammar allows, three times (the copying target continues them: drafts accepted)."""
    import re

    ok = [i for i in range(4, gen._runner().vocab_size)
          if re.fullmatch(REGEX, gen.decode([i])) and gen.encode(gen.decode([i]), chat=False) == [i]]
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.choice(ok, 6, replace=False)] * 3


def _mask(matcher, V: int) -> np.ndarray:
    """llguidance's own mask of the matcher's state -> [V] bool."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bits = allocate_token_bitmask(1, V)  # [1, ceil(V / 32)] int32
    fill_next_token_bitmask(matcher, bits, 0)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].astype(bool)


def masked_two_token_law(gen, target, prompt: list[int], **kw) -> dict:
    """The reference: the first two tokens' joint law of the target's rows with the grammar's refused tokens at
    -inf, then the sampling transforms ``kw`` at T (the penalties count the prompt, then the first token)."""
    V = target.vocab_size
    lltok = llguidance.LLTokenizer(gen.tokenizer.tok.to_str(), n_vocab=V, eos_token=sorted(target.eos_ids))
    spec = GrammarSpec("regex", REGEX)

    def law_after(ids: list[int], consumed: list[int]) -> np.ndarray:
        m = llguidance.LLMatcher(lltok, spec.engine_grammar(), log_level=0)
        assert all(m.consume_token(t) for t in consumed)
        target.reset()
        row = target.forward(ids)[0][-1:].astype(np.float64)  # [1, V]
        row[0, ~_mask(m, V)] = -np.inf
        return np.exp(transformed_logprobs(row, [list(ids)], T, **kw)[0])

    p1 = law_after(prompt, [])
    return {(int(a), int(b)): p1[a] * q for a in np.flatnonzero(p1 > 1e-4)
            for b, q in enumerate(law_after(prompt + [int(a)], [int(a)])) if q > 1e-6}


def _counting(monkeypatch) -> dict:
    """Counts of the grammar steps the loops take (constrain_draft, partial acceptances rolled back)."""
    seen = {"constrain": 0, "partial": 0}
    real_constrain, real_commit = grammar.constrain_draft, grammar.commit

    def constrain(*a, **k):  # noqa: ANN002, ANN003, ANN202
        seen["constrain"] += 1
        return real_constrain(*a, **k)

    def commit(c, n, acc, bonus):  # noqa: ANN001, ANN202
        seen["partial"] += acc < n
        return real_commit(c, n, acc, bonus)

    monkeypatch.setattr(grammar, "constrain_draft", constrain)
    monkeypatch.setattr(grammar, "commit", commit)
    return seen


def _request(k: int, mode: str, **kw):  # noqa: ANN202
    return req(6, eos_ids=set(), temperature=T, seed=2000 + k, draft_mode=mode,
               grammar=GrammarSpec("regex", REGEX), **kw)


def _p_value(gen, res: list, prompt: list[int], kw: dict) -> float:
    assert all(gen.decode(r.tokens[:2]).strip("abcdefghijklmnopqrstuvwxyz ") == "" for r in res)  # the grammar held
    accepted = [r.accepted if hasattr(r, "accepted") else r.stats.accepted for r in res]  # loop's | API Result
    assert sum(sum(a) for a in accepted) > len(res) // 4, "drafts accepted"
    return two_token_p_value(masked_two_token_law(gen, gen._runner(), prompt, **kw),
                             [(r.tokens[0], r.tokens[1]) for r in res])


@pytest.mark.parametrize("mode, loop, kw", [
    ("greedy", "single", {}), ("greedy", "batch", {}),
    ("greedy", "single", {"top_p": 0.8, "presence_penalty": 1.0}),
    ("independent", "batch", {"top_p": 0.8, "presence_penalty": 1.0})],
    ids=["selector", "batch", "selector-top_p-presence", "independent-batch-top_p-presence"])
def test_constrained_law_under_speculation(gen, monkeypatch, mode, loop, kw):
    """T = 3 with a regex (and top-p + a presence penalty): the first two tokens' joint law through the Python API
    (``generate``: the single loop; ``submit``: the batched loop) is the masked, transformed target's; the cycles ran
    constrained, with partial acceptances rolled back."""
    prompt = _prompt(gen)
    seen = _counting(monkeypatch)
    if loop == "single":
        res = [gen.generate(prompt, request=_request(k, mode, **kw)) for k in range(N)]
    else:
        gen.set_batching(max_batch=8, adaptive=False)  # every step drafts (the load-adaptive rule measures time)
        hs = [gen.submit(prompt, request=_request(k, mode, **kw)) for k in range(N)]
        res = [h.result() for h in hs]
    assert seen["constrain"] >= N and seen["partial"] > 0, seen
    assert _p_value(gen, res, prompt, kw) > 1e-3


def _spread_first_two(gen, monkeypatch, kw: dict) -> float:
    """Independent drafts of a spread proposal (test_sampling's SpreadDrafter: the accepting drafter's q mixed with
    the uniform law, so the grammar refuses and top-p cuts a large part of it) through the single loop."""
    prompt = _prompt(gen)
    target, drafter = gen._runner(), SpreadDrafter(gen._backend.draft_runner("independent"))
    gtok = gen.grammar_tokenizer()
    res = [D.speculative_generate(target, drafter, prompt, _request(k, "independent", **kw),
                                  D.DecodeHooks(grammar=gtok)) for k in range(N)]
    return _p_value(gen, res, prompt, kw)


def test_spread_drafts_hold_the_law(gen, monkeypatch):
    """The controls' positive twin (and the single loop's independent drafts): spread drafts, often refused by the
    grammar and cut by top-p, keep the law."""
    assert _spread_first_two(gen, monkeypatch, {"top_p": 0.6}) > 1e-3


def test_unmasked_q_is_caught(gen, monkeypatch):
    """Negative control: a refused draft redrawn from the masked proposal, but the unmasked proposal fed to the
    acceptance ratio — the chi-square test of the law fails."""
    real = grammar.constrain_draft

    def stale_q(c, draft, drafts, temperature, rng):  # noqa: ANN001, ANN202
        new, out, masks = real(c, draft, drafts, temperature, rng)
        return dataclasses.replace(new, vocab_proposal=draft.vocab_proposal, proposal=draft.proposal), out, masks

    monkeypatch.setattr(grammar, "constrain_draft", stale_q)
    assert _spread_first_two(gen, monkeypatch, {}) < 1e-3


def test_untransformed_q_is_caught_under_a_grammar(gen, monkeypatch):
    """Negative control: drafts drawn from the transformed law (top-p) but the drafter's untransformed q fed to the
    acceptance ratio, with the grammar on — the chi-square test fails."""
    real = S.Sampler.redraw

    def stale_q(self, draft, uniforms, n_rows):  # noqa: ANN001, ANN202 - the new tokens, the old proposal
        new = real(self, draft, uniforms, n_rows)
        return Draft(tokens=new.tokens, proposal=draft.proposal, cand=draft.cand, vocab_proposal=draft.vocab_proposal)

    monkeypatch.setattr(S.Sampler, "redraw", stale_q)
    assert _spread_first_two(gen, monkeypatch, {"top_p": 0.6}) < 1e-3
