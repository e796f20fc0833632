"""Prompt lookup beside the drafter (runtime/ngram.py): the lookup against a brute-force twin on fresh random
contexts (ties: the latest match wins; the longest n first), the proposer choice, and decoding with
``proposer`` = ngram / auto: the same tokens as autoregressive decoding (T = 0), lookups accepted on a repetitive
prompt, each proposer's acceptance in the stats."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime.ngram import ProposerChoice, lookup
from helpers import req


def lookup_twin(tokens: list[int], rows: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    T = len(tokens)
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        for s in range(T - n - 1, -1, -1):
            if tokens[s: s + n] == tokens[T - n:]:
                return tokens[s + n: s + n + rows]
    return []


def test_lookup_vs_twin():
    rng = np.random.default_rng(0)
    for _ in range(400):
        T = int(rng.integers(1, 60))
        toks = rng.integers(0, int(rng.choice([2, 3, 5, 50])), T).tolist()
        rows = int(rng.integers(1, 6))
        assert lookup(np.asarray(toks, dtype=np.int64), rows) == lookup_twin(toks, rows), toks
    assert lookup(np.array([7, 8, 9, 1, 7, 8]), 3) == [9, 1, 7]
    assert lookup(np.array([5]), 3) == [] and lookup(np.array([1, 2, 3, 4]), 2) == []


def test_choice():
    c = ProposerChoice("auto", [1, 2, 3, 1, 2], ngram_rows=4)
    assert c.ngram(10) == [3, 1, 2] and c.pick([3]) == "ngram" and c.pick([]) == "dflash2"
    for _ in range(10):
        c.record("ngram", 1)
    assert c.pick([3]) == "dflash2"  # lookups that keep failing lose to the drafter
    assert ProposerChoice("ngram", [1], 2).pick([]) is None  # no match: a plain step
    # a lookup runs only while its measured tokens per second reach a plain step's
    g = ProposerChoice("ngram", [1, 2, 1], 4)
    assert g.pick([2], t_plain=0.03) == "ngram"  # not timed yet: tried
    for _ in range(10):
        g.record("ngram", 1, 0.045)  # 1 token per 45 ms cycle against a 30 ms plain step
    assert not g.lookup_pays(0.03) and g.pick([2], t_plain=0.03) is None and g.pick([2]) == "ngram"
    for _ in range(10):
        g.record("ngram", 3, 0.045)
    assert g.lookup_pays(0.03) and g.pick([2], t_plain=0.03) == "ngram"
    # a lookup that stopped paying drifts back to the prior while it is not chosen, so it is tried again
    h = ProposerChoice("ngram", [1, 2, 1], 4)
    for _ in range(10):
        h.record("ngram", 1, 0.045)
    tries = [h.pick([2], t_plain=0.03) for _ in range(200)]
    assert tries[0] is None and "ngram" in tries
    a = ProposerChoice("auto", [1, 2, 1], 4)
    assert a.pick([2], drafter=False) == "ngram" and a.pick([], drafter=False) is None  # the guard's plain stretch
    assert ProposerChoice("dflash2", [1], 2).pick([], drafter=False) is None
    assert not ProposerChoice("ngram", [1], 2).uses_drafter
    with pytest.raises(DFlash2Error, match="proposer must be one of"):  # the request's check, made when it is built
        req(4, proposer="lookahead")


def test_a_lookup_not_chosen_drifts_back_to_the_prior():
    """A lookup that had drafts but was not chosen moves its measured rate a quarter of (1 - decay) of the way back to
    the optimistic prior 2.0 per step (a changed context gets another try): after k such steps from rate r the gap
    is (2 - r) x (1 - (1 - decay) / 4)^k; a chosen lookup, or one without drafts, does not drift."""
    for decay in (0.8, 0.5):
        c = ProposerChoice("auto", [1, 2, 3], 4, decay=decay)
        c.rate["ngram"] = 0.7
        for k in range(1, 9):
            c.settle([5, 6], "dflash2" if k % 2 else None)
            assert c.rate["ngram"] == pytest.approx(2.0 - 1.3 * (1 - (1 - decay) / 4) ** k, rel=1e-12)
        before = dict(c.rate)
        c.settle([5, 6], "ngram")
        c.settle([], "dflash2")
        assert c.rate == before
    # the drift is what brings a lookup back: from 1.0 against a drafter at 1.5, auto picks the lookup again after
    # exactly the steps the drift needs (rate >= the drafter's)
    c = ProposerChoice("auto", [1, 2, 3], 4)
    c.rate.update(ngram=1.0, dflash2=1.5)
    steps = 0
    while c.pick([5, 6]) != "ngram":
        steps += 1
    assert steps == int(np.ceil(np.log(0.5) / np.log(1 - 0.2 / 4)))


@pytest.mark.parametrize("proposer", ["ngram", "auto", "dflash2"])
def test_lossless_with_lookup(acc_export, proposer):
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(acc_export)
    target, drafter = be.target_runner(), be.draft_runner("greedy")
    rng = np.random.default_rng(5)
    used = []
    for i in range(5):
        base = rng.integers(4, target.vocab_size, int(rng.integers(3, 12))).tolist()
        p = base * 3 if i % 2 else base  # a repetitive prompt: lookups find matches
        spec = D.speculative_generate(target, drafter, p,
                                      req(32, eos_ids=set(), proposer=proposer, ngram_rows=4))
        assert spec.tokens == D.target_generate(target, p, req(32, eos_ids=set())).tokens
        s = spec.stats()
        assert s["ngram_cycles"] + s["dflash2_cycles"] == s["spec_cycles"]
        used += spec.proposers
        if proposer == "ngram":
            assert s["dflash2_cycles"] == 0
    if proposer != "dflash2":
        assert "ngram" in used
    spec = D.speculative_generate(target, drafter, [5, 6, 5, 6, 5],
                                  req(16, temperature=0.8, eos_ids=set(), proposer=proposer))
    assert len(spec.tokens) == 16


def test_draft_context_stays_contiguous_across_lookup_cycles(acc_export):
    """Prompt-lookup cycles and plain steps defer their positions' features; when the drafter runs again they join
    its context in one pass: before every proposal the context covers exactly positions 0 .. anchor - 1, each once."""
    from helpers import RecordingDrafter

    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(acc_export)
    target, drafter = be.target_runner(), RecordingDrafter(be.draft_runner("greedy"))
    rng = np.random.default_rng(11)
    whos: list[str] = []
    for _ in range(4):
        base = rng.integers(4, target.vocab_size, int(rng.integers(3, 9))).tolist()
        p = base * 3 + rng.integers(4, target.vocab_size, 5).tolist()  # matches, then a fresh tail
        spec = D.speculative_generate(target, drafter, p,
                                      req(40, eos_ids=set(), proposer="auto", ngram_rows=4))
        assert spec.tokens == D.target_generate(target, p, req(40, eos_ids=set())).tokens
        whos += [a + "->" + b for a, b in zip(spec.proposers, spec.proposers[1:])]
    assert "ngram->dflash2" in whos  # the deferred features were flushed into a drafter cycle
    assert drafter.proposals > 0


def test_guard_rules_the_drafter_and_a_paying_lookup_still_runs(acc_export):
    """A drafter that never pays (fixed break-even 100) is switched off by the guard; during its plain stretches
    prompt-lookup cycles still run (their drafts cost nothing), the guard never judges them, and the output is
    the target's own."""
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig
    from dflash2_trt.runtime.ort.backend import OrtBackend

    class Watching(AcceptanceGuard):
        said_plain = False
        judged = 0

        def plain_next(self) -> bool:
            self.said_plain = super().plain_next()
            return self.said_plain

        def record_cycle(self, tokens: int, seconds: float) -> None:
            self.judged += 1
            super().record_cycle(tokens, seconds)

    be = OrtBackend(acc_export)
    target, drafter = be.target_runner(), be.draft_runner("greedy")
    rng = np.random.default_rng(3)
    base = rng.integers(4, target.vocab_size, 6).tolist()
    p = base * 4
    guard = Watching(GuardConfig(cost_ratio=100.0))
    during_plain = []
    spec = D.speculative_generate(target, drafter, p, req(48, eos_ids=set(), proposer="auto"),
                                  D.DecodeHooks(on_cycle=lambda a, n: during_plain.append(guard.said_plain),
                                                guard=guard))
    assert spec.tokens == D.target_generate(target, p, req(48, eos_ids=set())).tokens
    assert spec.guard_switches >= 1 and spec.plain_steps > 0
    assert any(during_plain)  # lookup cycles while the guard kept the drafter off
    assert guard.judged == spec.proposers.count("dflash2") >= 3  # the guard saw drafter cycles only
