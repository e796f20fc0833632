"""Proposers in the batch loop (runtime/batch.py with prompt lookup beside the drafter): on the accepting
pair, sequences of different proposers (ngram, auto, dflash2), lengths and temperatures joining mid-way each make
exactly their own B = 1 ``speculative_generate`` cycles — the same proposer, accepted and verified drafts per cycle,
plain steps and tokens — with lookup cycles accepted and the drafter's context contiguous across them; the
sampling law of a T > 0 sequence verifying lookup drafts (chi-square); at one sequence under fixed costs the
adaptive rule with ``auto`` decides as the B = 1 loop does (a drafter that pays: every cycle as without a guard; one
that never pays: lookups only, as through the guard's plain stretches); under load lookups run beside batched
plain steps while the drafter does not pay; the rule's cost of a lookup (no drafter time) and its fallback; the
proposer through ``Generator.generate_batch``."""

from __future__ import annotations

import numpy as np
import pytest

import dflash2_trt
from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import batch as BT
from dflash2_trt.runtime import decoder as D
from helpers import RecordingDrafter, assert_accepts, req, two_token_law, two_token_p_value
from dflash2_trt.runtime.request import GenerationRequest


@pytest.fixture(scope="module")
def be(acc_export):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(acc_export, threads=1) as b:
        yield b


def _decoder(be, slots, rule=None, drafters=None):  # noqa: ANN001, ANN202
    """A batch loop over ``slots``; ``drafters``: a list collecting the slots' recording drafters (None: no drafter)."""
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    def make() -> RecordingDrafter:
        d = RecordingDrafter(be.draft_runner("greedy"))
        drafters.append(d)
        return d

    return BT.BatchDecoder(OrtBatchedTargetRunner.from_backend(be, slots), None if drafters is None else make, rule)


def _prompts(be, lengths, seed, repeat=()):  # noqa: ANN001, ANN202
    """Random prompts; those at the indices in ``repeat`` repeat their first COPY_PERIOD tokens, which the
    accepting pair's target goes on copying (lookups match and are accepted from the first cycle; the others'
    lookups match once the output repeats)."""
    from dflash2_trt.tiny import COPY_PERIOD

    rng = np.random.default_rng(seed)
    V = be.manifest.target.vocab_size
    out = []
    for i, n in enumerate(lengths):
        period = rng.integers(4, V, COPY_PERIOD).tolist()
        out.append((period * (n // COPY_PERIOD + 1))[:n] if i in repeat else rng.integers(4, V, n).tolist())
    return out


def _b1(be, prompt, request: GenerationRequest, hooks: D.DecodeHooks = D.DecodeHooks()):  # noqa: ANN001, ANN202
    return D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), prompt, request, hooks)


def _decisions(res) -> tuple[list, list, list, int]:  # noqa: ANN001
    """(proposers, accepted, verified, plain steps) per cycle. The B = 1 loop verifies a request's last token as a
    drafter cycle of 0 rows where the batch loop runs a plain step (a cycle needs a draft row): counted as one."""
    who, acc, rows, plain = list(res.proposers), list(res.accepted), list(res.proposed), res.plain_steps
    if rows and rows[-1] == 0:
        who, acc, rows, plain = who[:-1], acc[:-1], rows[:-1], plain + 1
    return who, acc, rows, plain


def _same_as_b1(got, want, temperature: float, what: object) -> None:  # noqa: ANN001
    assert _decisions(got) == _decisions(want), what
    # at T > 0 a 0-row B = 1 cycle draws the last token with other random numbers than a plain step
    last = len(want.tokens) - (1 if temperature > 0 and want.proposed and want.proposed[-1] == 0 else 0)
    assert got.tokens[:last] == want.tokens[:last] and len(got.tokens) == len(want.tokens), what


def test_mixed_proposers_batch_equal_their_b1_runs(be):
    """6 requests in 3 slots (the rest join as slots free, one submitted after 3 steps), proposers ngram / auto /
    dflash2, T = 0 and T > 0, every step drafting: each request's cycles (proposer, accepted and verified drafts),
    plain steps and tokens are its own B = 1 run's; greedy ones are the target's own tokens; lookup cycles ran and
    were accepted; auto requests switched between lookup and drafter, the drafter's context contiguous throughout."""
    prompts = _prompts(be, [7, 20, 12, 9, 26, 15], seed=1, repeat=(1, 4))
    proposers = ["ngram", "auto", "dflash2", "auto", "ngram", "auto"]
    temps = [0.0, 0.0, 0.0, 0.9, 0.0, 0.8]
    maxes = [60, 30, 35, 28, 50, 38]
    drafters: list[RecordingDrafter] = []
    dec = _decoder(be, 3, BT.SpeculationRule(adaptive=False), drafters)

    def submit(i: int) -> int:
        return dec.submit(prompts[i], GenerationRequest(max_new_tokens=maxes[i], temperature=temps[i], seed=10 + i,
                                                        eos_ids=set(), proposer=proposers[i]))

    ids = [submit(i) for i in range(5)]
    for _ in range(3):
        dec.step()
    ids.append(submit(5))  # joins mid-way
    while dec.busy:
        dec.step()
    tgt = be.target_runner()
    lookups: list[int] = []
    switched = 0
    for k, i in enumerate(ids):
        got = dec.results[i]
        want = _b1(be, prompts[k], req(maxes[k], temperature=temps[k], eos_ids=set(), seed=10 + k,
                                       proposer=proposers[k]))
        _same_as_b1(got, want, temps[k], (k, proposers[k]))
        if temps[k] == 0:
            assert got.tokens == D.target_generate(tgt, prompts[k], req(maxes[k], eos_ids=set())).tokens, k
            lookups += [a for a, w in zip(got.accepted, got.proposers) if w == "ngram"]
        allowed = {"ngram": {"ngram"}, "dflash2": {"dflash2"}, "auto": {"ngram", "dflash2"}}[proposers[k]]
        assert set(got.proposers) <= allowed, k
        switched += "ngram->dflash2" in {a + "->" + b for a, b in zip(got.proposers, got.proposers[1:])}
        s = got.stats()
        assert s["ngram_cycles"] + s["dflash2_cycles"] == s["spec_cycles"]
    assert_accepts(lookups, 4, "(batched lookup cycles)")
    assert switched >= 1  # features deferred by lookup cycles were flushed into a drafter pass
    assert sum(d.proposals for d in drafters) > 0


def test_lookup_only_batch_needs_no_drafter(be):
    """A batch loop without a drafter: ngram requests still speculate (4 lookup rows: the default without a
    drafter), the same cycles and tokens as B = 1 with 4 rows; a dflash2 request there steps plain."""
    prompts = _prompts(be, [10, 17], seed=2, repeat=(0,))
    dec = _decoder(be, 2, BT.SpeculationRule(adaptive=False))
    got = dec.run([(prompts[0], GenerationRequest(max_new_tokens=30, eos_ids=set(), proposer="ngram")),
                   (prompts[1], GenerationRequest(max_new_tokens=20, eos_ids=set(), proposer="dflash2"))])
    want = _b1(be, prompts[0], req(30, eos_ids=set(), proposer="ngram", ngram_rows=4))
    _same_as_b1(got[0], want, 0.0, "ngram")
    assert got[0].proposers and max(got[0].proposed) <= 4 and sum(got[0].accepted) > 0
    assert got[1].plain_steps == 19 and not got[1].accepted
    with pytest.raises(DFlash2Error, match="proposer must be one of"):
        dec.submit(prompts[0], GenerationRequest(max_new_tokens=5, proposer="lookahead"))


def test_lookup_drafts_keep_the_target_law(be):
    """T > 0 sequences verifying prompt-lookup drafts in the batch loop (a one-hot proposal: rejection sampling
    accepts draft d with probability p(d), else resamples the residual): the joint law of a sequence's first two
    tokens is the target's own — chi-square against the exact law from B = 1 forwards — with lookup drafts both
    accepted and rejected."""
    T, n = 1.0, 480
    # a period of 16 the copying target mostly continues (P(first token) <= 0.73; a lookup follows ~73 % of first
    # tokens and is accepted ~1 time in 3)
    prompt = _prompts(be, [40], seed=20, repeat=(0,))[0]
    tgt = be.target_runner()
    law = two_token_law(tgt, prompt, T)
    dec = _decoder(be, 8, BT.SpeculationRule(adaptive=False))
    ids = [dec.submit(prompt, GenerationRequest(max_new_tokens=4, temperature=T, seed=2000 + k, eos_ids=set(),
                                                proposer="ngram")) for k in range(n)]
    while dec.busy:
        dec.step()
    res = [dec.results[i] for i in ids]
    looked = [a for r in res for a, w in zip(r.accepted, r.proposers) if w == "ngram"]
    assert sum(a > 0 for a in looked) > n // 10 and sum(a == 0 for a in looked) > n // 20, (len(looked), sum(looked))
    p_value = two_token_p_value(law, [(r.tokens[0], r.tokens[1]) for r in res])
    assert p_value > 1e-3, p_value


class _DrafterOff:
    """A B = 1 guard that keeps the drafter off throughout (what the guard concludes of a drafter that never pays);
    a lookup still runs (its rate against an unmeasured plain step: it pays)."""

    t_step = None
    switches = probes = 0

    def plain_next(self) -> bool:
        return True

    def record_step(self, seconds: float) -> None: ...


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_one_sequence_auto_decides_as_b1(be, temperature):
    """One sequence, the adaptive rule with fixed costs, proposer auto: with a drafter that pays (cheap costs)
    every cycle is B = 1's without a guard (each cycle's proposer picked by the same ProposerChoice); with one
    that never pays the rule leaves every drafter proposal out and runs the lookups (the fallback), as B = 1 does
    through a guard that keeps the drafter off. Same cycles, plain steps and tokens (at T > 0 for the same seed)."""
    prompt = _prompts(be, [20], seed=4, repeat=(0,))[0]
    cheap = BT.FixedCosts(plain_fn=lambda n: 1.0, draft_s=1e-4, verify_s=1e-4)
    got = _decoder(be, 1, BT.SpeculationRule(costs=cheap), []).run(
        [(prompt, GenerationRequest(max_new_tokens=48, temperature=temperature, seed=7, eos_ids=set()))])[0]
    auto = req(48, temperature=temperature, eos_ids=set(), seed=7, proposer="auto")
    _same_as_b1(got, _b1(be, prompt, auto), temperature, "drafter pays")
    assert {"ngram", "dflash2"} <= set(got.proposers)
    dear = BT.FixedCosts(plain_fn=lambda n: 1.0, draft_s=100.0, verify_s=1e-4)
    drafters: list[RecordingDrafter] = []
    got = _decoder(be, 1, BT.SpeculationRule(costs=dear), drafters).run(
        [(prompt, GenerationRequest(max_new_tokens=48, temperature=temperature, seed=7, eos_ids=set()))])[0]
    _same_as_b1(got, _b1(be, prompt, auto, D.DecodeHooks(guard=_DrafterOff())), temperature, "drafter never pays")
    assert set(got.proposers) == {"ngram"} and got.plain_steps > 0 and sum(d.proposals for d in drafters) == 0


def test_lookups_run_beside_batched_plain_steps_under_load(be):
    """6 auto sequences under costs where the drafter never pays (5 s a proposal) and a lookup's verify is cheap:
    the drafter never runs, lookups verify beside the others' plain steps, greedy tokens exact."""
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=5.0, verify_s=0.05)
    prompts = _prompts(be, [7, 22, 12, 5, 18, 15], seed=9, repeat=(1, 4))
    drafters: list[RecordingDrafter] = []
    dec = _decoder(be, 6, BT.SpeculationRule(costs=costs), drafters)
    out = dec.run([(p, GenerationRequest(max_new_tokens=30, eos_ids=set())) for p in prompts])
    tgt = be.target_runner()
    for o, p in zip(out, prompts):
        assert o.tokens == D.target_generate(tgt, p, req(30, eos_ids=set())).tokens
        assert set(o.proposers) <= {"ngram"} and o.plain_steps > 0
    assert sum(d.proposals for d in drafters) == 0
    assert_accepts([a for o in out for a in o.accepted], 4, "(lookups under load)")


def test_rule_costs_a_lookup_without_drafter_time():
    """SpeculationRule.choose: a lookup (free) pays only its verify, so it is weighed by tokens per second of cost
    (before a drafter proposal of higher τ̂ that pays less); a sequence whose drafter proposal is left out verifies
    its lookup instead when that pays (the fallback); without free keys the rule is unchanged."""
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.5, verify_s=0.4)
    rule = BT.SpeculationRule(costs=costs)
    d, g = ("a", "dflash2"), ("b", "ngram")
    # 2 sequences: the lookup alone, 3 / 1.5 = 2.0 tokens/s, beats both (4.5 / 2.4) and the drafter alone
    assert rule.choose(2, {d: 2.5, g: 2.0}, free={g}) == {g}
    # ordered by τ̂ the drafter would come first and both run (4.5 / 2.4 = 1.875 > 2 / 1.1): the order matters
    assert rule.choose(2, {d: 2.5, ("b", "dflash2"): 2.0}) == set()  # two drafters: 3.5 / 2.0, 4.5 / 2.9 < 2 / 1.1
    # one sequence: its drafter (tau 1.5 < break-even 1.86) left out, its lookup (1.6 / 1.45 > 1 / 1.05) verifies
    fb = {d: (("a", "ngram"), 1.6)}
    assert rule.choose(1, {d: 1.5}, fallbacks=fb) == {("a", "ngram")}
    assert rule.choose(1, {d: 1.5}, fallbacks={d: (("a", "ngram"), 1.3)}) == set()  # 1.3 / 1.45 < 1 / 1.05
    assert rule.choose(1, {d: 3.0}, fallbacks=fb) == {d}  # the drafter pays: no fallback
    # measured costs: a lookup needs no drafter timing (nothing to explore once plain and verify are measured)
    m = BT.SpeculationRule()
    m.costs.record_plain(1, 1.0)
    m.costs.record_verify(0.1)
    assert m.choose(1, {g: 2.0}, free={g}) == {g} and m.choose(1, {d: 2.0, g: 1.5}, free={g}) == {d}  # explore


def test_generate_batch_proposers(acc_export):
    """Generator.generate_batch with one proposer per prompt: each stream's tokens and cycles are its own
    generate(guard=False) run's with that proposer; Stats.proposers name them; a bad proposer raises at submit."""
    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        prompts = _prompts(g._backend, [11, 18, 9], seed=21, repeat=(0, 1))
        proposers = ["ngram", "auto", "dflash2"]
        got = g.generate_batch(prompts, max_new_tokens=24, eos_ids=set(), max_batch=3, adaptive=False,
                               proposer=proposers)
        for r, p, w in zip(got, prompts, proposers):
            want = g.generate(p, 24, guard=False, eos_ids=set(), proposer=w)
            assert r.tokens == want.tokens and r.stats.proposers == _decisions(_as_res(want))[0], w
            assert r.stats.accepted == _decisions(_as_res(want))[1], w
        assert set(got[0].stats.proposers) == {"ngram"} and set(got[2].stats.proposers) == {"dflash2"}
        h = g.submit(prompts[0], 8, eos_ids=set(), proposer="ngram")
        assert h.result().tokens == got[0].tokens[:8]
        with pytest.raises(DFlash2Error, match="proposer must be one of"):
            g.submit(prompts[0], 8, proposer="lookahead")
        with pytest.raises(DFlash2Error, match="proposer: 2 values for 3 prompts"):
            g.generate_batch(prompts, proposer=["ngram", "auto"])


def _as_res(r):  # noqa: ANN001, ANN202 - an api.Result's per-cycle lists as a GenerationResult's
    return D.GenerationResult(prompt_tokens=r.prompt_tokens, tokens=r.tokens, accepted=r.stats.accepted,
                              proposed=r.stats.verified, plain_steps=r.stats.plain_steps,
                              proposers=r.stats.proposers)
