"""Batched decoding: the batched fused target runner against B = 1 calls (ragged rows, right padding,
idle and free slots, crops, capacity growth, joins into freed slots) with dflash2.DecodeAttention (ragged calls:
verifies and prefills of several sequences in one call, counted) and with GroupQueryAttention (one-row calls
batched, the rest alone); how the runner groups slots into calls; the batch loop's greedy output against each
sequence's own B = 1 output on both attention ops (different prompt lengths and max tokens, one joining mid-way,
one leaving early, T > 0 requests mixed in; batched verifies counted), the sampling law of T > 0 sequences drafting
in a batch (chi-square), the load-adaptive speculation rule switching, and ``Generator.generate_batch``."""

from __future__ import annotations

import numpy as np
import pytest

import dflash2_trt
from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import batch as BT
from dflash2_trt.runtime import decoder as D
from helpers import req, two_token_law, two_token_p_value
from dflash2_trt.runtime.request import GenerationRequest


@pytest.fixture(scope="module", params=["decode", "gqa"])
def be(request, acc_export):
    """The accepting pair's ORT backend with dflash2.DecodeAttention (ragged batched calls) or GroupQueryAttention."""
    from dflash2_trt.runtime.ort import decode_attention as DA
    from dflash2_trt.runtime.ort.backend import OrtBackend

    if request.param == "decode":
        assert DA.available()[0], DA.available()[1]
    with OrtBackend(acc_export, attention=request.param, threads=1) as b:
        assert b.attention_op == {"decode": "DecodeAttention", "gqa": "GroupQueryAttention"}[request.param]
        yield b


def _runners(be, slots, step=8):
    """(batched runner over slots, factory of B = 1 runners), both on be's fused target session."""
    import onnxruntime as ort

    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    t = be.manifest.target
    sess = be.session("target_ort").sess
    batched = OrtBatchedTargetRunner(sess, ort, t.num_layers, t.num_key_value_heads, t.head_dim, t.vocab_size, 512,
                                     set(), slots, step=step)

    def single():
        return OrtFusedTargetRunner(sess, ort, t.num_layers, t.num_key_value_heads, t.head_dim, t.vocab_size, 512,
                                    set(), step=step)

    return batched, single


def test_ragged_rows_equal_b1_calls(be):
    """Every slot's logits and features equal a B = 1 runner fed the same rows, over random ragged calls (1, 2 or
    7 rows, some slots idle), crops, capacity growth (step 8), a slot leaving and a new sequence joining its slot.
    With DecodeAttention (past_seqlens) slots of several rows share calls; with GroupQueryAttention they run
    alone."""
    run, single = _runners(be, slots=4)
    assert run.ragged == (be.attention_op == "DecodeAttention")
    # the forward's cost in rows (12 a call): ragged, one padded call; GroupQueryAttention, the verify alone
    assert run.cost_units({0: 1, 1: 1, 2: 3}) == (12 + 3 * 3 if run.ragged else 12 + 2 + 12 + 3)
    _check_ragged(run, single, be.manifest.target.vocab_size)
    if run.ragged:
        assert run.multirow_calls >= 3  # several multi-row slots in one call
    else:
        assert run.multirow_calls == 0


def test_plan_calls():
    """The runner's grouping of ragged rows into calls (cost: call_rows per call + padded rows of the bound range)."""
    from dflash2_trt.runtime.ort.batched_target import plan_calls

    assert plan_calls({b: 1 for b in range(8)}) == [list(range(8))]  # plain steps: one call
    assert plan_calls({0: 1, 1: 1, 2: 3, 3: 1}) == [[0, 1, 2, 3]]  # a verify shares the plain steps' call
    assert plan_calls({0: 3, 1: 3, 2: 2, 3: 3}) == [[0, 1, 2, 3]]  # verifies, one a final partial block
    assert plan_calls({0: 1, 1: 1, 2: 100, 3: 1}) == [[0, 1, 3], [2]]  # a prefill does not pad the plain steps
    assert plan_calls({0: 40, 1: 45, 2: 300}) == [[0, 1], [2]]
    assert plan_calls({0: 40, 1: 45}, max_rows=80) == [[0], [1]]  # padded rows capped
    assert plan_calls({0: 2000}, max_rows=80) == [[0]]  # one slot always fits
    assert plan_calls({0: 1, 5: 1}, call_rows=2) == [[0], [5]]  # six bound slots cost more than two calls


def _check_ragged(run, single, V):
    rng = np.random.default_rng(7)
    refs: dict[int, object] = {}

    def join(*lengths, last=False):
        """Sequences join and prefill in one forward (``last``: the last row's logits only)."""
        prompts = {run.join(): rng.integers(0, V, n).tolist() for n in lengths}
        got = run.forward(prompts, last_logits=last)
        for b, prompt in prompts.items():
            refs[b] = single()
            want = refs[b].forward(prompt)
            np.testing.assert_allclose(got[b][0], want[0][-1:] if last else want[0], atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(got[b][1], want[1], atol=1e-4, rtol=1e-4)
        return list(prompts)

    join(3, 11, 20, last=True)  # a batched prefill
    for it in range(14):
        if it == 6:  # slot 1 leaves; a new sequence takes it
            run.leave(1)
            del refs[1]
            assert join(5) == [1]
        rows = {b: rng.integers(0, V, int(rng.choice([1, 1, 1, 2, 7]))).tolist() for b in refs if rng.random() < 0.8}
        if not rows:
            continue
        got = run.forward(rows)
        for b, r in rows.items():
            want = refs[b].forward(r)
            np.testing.assert_allclose(got[b][0], want[0], atol=1e-4, rtol=1e-4, err_msg=f"slot {b} step {it}")
            np.testing.assert_allclose(got[b][1], want[1], atol=1e-4, rtol=1e-4)
            keep = int(rng.integers(1, len(r) + 1))  # a verify keeps a prefix
            run.crop(b, refs[b].cache_length - len(r) + keep)
            refs[b].crop(refs[b].cache_length - len(r) + keep)
        assert all(run.lengths[b] == refs[b].cache_length for b in refs)
    assert run.capacity > 8  # grew (rebinding) along the way
    assert run.batched_calls + run.multirow_calls >= 3 and run.single_calls >= 3  # shared and lone calls ran


def test_runner_refuses_bad_use(be):
    run, _ = _runners(be, slots=2)
    a, b = run.join(), run.join()
    with pytest.raises(DFlash2Error, match="slots are in use"):
        run.join()
    run.leave(b)
    with pytest.raises(DFlash2Error, match="not active"):
        run.forward({b: [1]})
    with pytest.raises(DFlash2Error, match="out of range"):
        run.forward({a: [10**6]})


# -- the batch loop --------------------------------------------------------------------------------------------

def _decoder(be, slots, rule=None, draft=True):
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    target = OrtBatchedTargetRunner.from_backend(be, slots)
    return BT.BatchDecoder(target, (lambda: be.draft_runner("greedy")) if draft else None, rule)


def _prompts(be, lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, be.manifest.target.vocab_size, n).tolist() for n in lengths]


def test_greedy_batch_equals_b1_with_joins_and_leaves(be):
    """4 sequences in 3 slots (the 4th joins when the first leaves), different prompt lengths and max tokens, a
    5th submitted mid-way and one cancelled early: every finished sequence's greedy tokens == its B = 1 plain
    output; drafting cycles ran and accepted drafts (the accepting pair)."""
    from helpers import assert_accepts

    prompts = _prompts(be, [5, 13, 8, 21, 9])
    max_new = [40, 12, 33, 25, 30]
    dec = _decoder(be, 3, BT.SpeculationRule(adaptive=False))
    ids = [dec.submit(p, GenerationRequest(max_new_tokens=m)) for p, m in zip(prompts[:4], max_new[:4])]
    victim = dec.submit(prompts[0], GenerationRequest(max_new_tokens=100))  # cancelled once it has a few tokens
    for _ in range(4):
        dec.step()
    ids.append(dec.submit(prompts[4], GenerationRequest(max_new_tokens=max_new[4])))  # joins mid-way
    cancelled = False
    while dec.busy:
        dec.step()
        if not cancelled and victim in dec._active and len(dec._active[victim].res.tokens) >= 5:
            dec.cancel(victim)
            cancelled = True
    assert cancelled
    tgt = be.target_runner()
    for i, p, m in zip(ids, prompts, max_new):
        want = D.target_generate(tgt, p, req(m)).tokens
        assert dec.results[i].tokens == want, f"request {i}"
    assert 5 <= len(dec.results[victim].tokens) < 100
    assert_accepts([a for i in ids for a in dec.results[i].accepted], 15, "(batched cycles)")
    assert dec.target.free_slots == 3
    if dec.target.ragged:  # the verifies (and the first prefills) of several sequences shared calls
        assert dec.target.multirow_calls >= 10, dec.target.multirow_calls
    else:
        assert dec.target.multirow_calls == 0


class _OracleDrafter:
    """A draft runner that proposes the target's own greedy continuation ``want`` of ``prompt`` (every draft is
    accepted), over a real runner's context bookkeeping."""

    def __init__(self, inner, prompt: list[int], want: list[int]) -> None:  # noqa: ANN001
        self.inner, self.full = inner, list(prompt) + list(want)

    def __getattr__(self, name):  # noqa: ANN001, ANN204 - block_size, top_k, reset, add_context
        return getattr(self.inner, name)

    def propose(self, anchor, pos, rows, temperature, uniforms):  # noqa: ANN001, ANN202
        from dflash2_trt.runtime.ngram import lookup_draft

        assert self.full[pos] == anchor
        return lookup_draft(self.full[pos + 1: pos + 1 + rows])


@pytest.mark.parametrize("k", [5, 16, 20])
def test_an_accepted_eos_ends_the_count(be, k):
    """A request whose EOS is the k-th token of its greedy output, drafted by an oracle (every draft right): the
    cycle that accepts the EOS counts the drafts up to it, EOS included (not the block's drafts after it), in the
    batch loop and in the B = 1 loop alike; the tokens end at the EOS. k = 5 and 20: the EOS is a draft of the first
    and the second cycle (block size 16); k = 16: it is the first cycle's bonus token."""
    for seed in range(100):  # a prompt whose output's k-th token appears there first (the target copies)
        prompt = _prompts(be, [7], seed=seed)[0]
        want = D.target_generate(be.target_runner(), prompt, req(40, eos_ids=set())).tokens
        if want[k] not in want[:k]:
            break
    eos = want[k]
    assert eos not in want[:k], "no prompt found"
    L = be.manifest.num_draft_rows
    expected, pos = [], 1  # want[0] comes from the prompt's forward; each cycle drafts want[pos: pos + L]
    while True:
        if k < pos + L:
            expected.append(k - pos + 1)
            break
        expected.append(L)
        if k == pos + L:
            break
        pos += L + 1
    dec = BT.BatchDecoder(_decoder(be, 1).target, lambda: _OracleDrafter(be.draft_runner("greedy"), prompt, want),
                          BT.SpeculationRule(adaptive=False))
    rid = dec.submit(prompt, GenerationRequest(max_new_tokens=40, eos_ids={eos}))
    while dec.busy:
        dec.step()
    res = dec.results[rid]
    b1 = D.speculative_generate(be.target_runner(), _OracleDrafter(be.draft_runner("greedy"), prompt, want), prompt,
                                req(40, eos_ids={eos}))
    for r in (res, b1):
        assert r.tokens == want[: k + 1] and r.accepted == expected, (r.accepted, expected)


def test_rule_estimate_of_a_final_partial_block(be):
    """The rule's τ̂ of a drafter proposal that verifies only n < L rows (the request's last tokens) is its share of a
    full block's expected gain, 1 + (τ̂_full - 1) n / L, not the full block's; lookups and full blocks unchanged."""
    from dflash2_trt.runtime.ngram import DFLASH2

    dec = _decoder(be, 1, BT.SpeculationRule(adaptive=False))
    rid = dec.submit(_prompts(be, [9], seed=5)[0], GenerationRequest(max_new_tokens=60))
    for _ in range(4):
        dec.step()
    s = dec._active[rid]
    L = be.manifest.num_draft_rows
    n_full, tau_full = dec._estimate(s, DFLASH2, [])
    assert n_full == L and tau_full > 1.5, tau_full  # drafts were accepted: the share is not trivially 1
    for n in (1, 4, L - 1):
        s.limit = len(s.res.tokens) + 1 + n
        rows, tau = dec._estimate(s, DFLASH2, [])
        assert rows == n and tau == pytest.approx(1 + (tau_full - 1) * n / L, rel=1e-12)


def test_plain_batch_mixed_temperatures(be):
    """Plain batched decoding (no drafter: requests of the drafter step plain): greedy sequences unchanged by T > 0
    neighbours, and each T > 0 sequence draws target_generate's tokens for its seed (its own generator, the same
    draw order)."""
    prompts = _prompts(be, [6, 14, 9, 11], seed=5)
    temps, seeds = [0.0, 0.8, 0.0, 1.3], [0, 11, 0, 12]
    dec = _decoder(be, 4, draft=False)
    out = dec.run([(p, GenerationRequest(max_new_tokens=24, temperature=t, seed=s, proposer="dflash2"))
                   for p, t, s in zip(prompts, temps, seeds)])
    tgt = be.target_runner()
    for o, p, t, s in zip(out, prompts, temps, seeds):
        assert o.tokens == D.target_generate(tgt, p, req(24, temperature=t, seed=s)).tokens
        assert o.plain_steps == len(o.tokens) - 1 and not o.accepted
    assert dec.target.batched_calls > 0


def test_rule_switches_with_load():
    """The rule: a good drafter drafts alone; at 8 sequences the batched plain step wins; a useless drafter
    never drafts; unmeasured costs explore (plain first, then drafting)."""
    # a step's forward: 1 + 0.05 n; a drafting sequence adds 0.5 (its drafter) + 0.4 (its verify rows)
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.5, verify_s=0.4)
    rule = BT.SpeculationRule(costs=costs)
    assert rule.choose(1, {0: 4.0}) == {0}  # 4 / 1.95 > 1 / 1.05
    assert rule.choose(8, {i: 4.0 for i in range(8)}) == set()  # 8 / 1.4 beats 11 / 2.3, ..., 32 / 8.6
    assert rule.choose(2, {0: 6.0, 1: 1.2}) == {0}  # only the sequence that pays: 7 / 2.0
    assert rule.choose(1, {0: 1.5}) == set()
    fresh = BT.SpeculationRule()
    assert fresh.choose(3, {0: 2.0}) == set()  # t_plain unknown: plain first
    fresh.costs.record_plain(3, 0.01)
    assert fresh.choose(3, {0: 2.0, 1: 3.0}) == {1}  # draft costs unknown: the best candidate drafts to measure
    assert BT.SpeculationRule(adaptive=False, costs=costs).choose(8, {1: 1.0}) == {1}
    # measured costs with the runner's plan (units = calls x 12 + padded rows): a verify pads the plain rows of
    # the shared call to its 3, which at 8 sequences never pays; alone, its 2 extra rows do
    m = BT.SpeculationRule()
    m.costs.record_plain(8, 0.053)
    m.costs.record_plain(1, 0.035)
    m.costs.record_draft(0.008)
    assert m.choose(8, {i: 2.0 for i in range(8)}, lambda ids: 12 + 8 * (3 if ids else 1)) == set()
    assert m.choose(1, {0: 2.0}, lambda ids: 12 + (3 if ids else 1)) == {0}  # 2 / 48.4 ms > 1 / 35 ms
    assert m.choose(1, {0: 1.3}, lambda ids: 12 + (3 if ids else 1)) == set()


def test_rule_one_cycle_is_no_proof():
    """τ̂ carries the spread floor from the first cycle, as the B = 1 guard: one 1-token cycle leaves a sequence
    drafting where the prior did, five such cycles stop it (break-even 1.4 here: plain 1.0, draft 0.1, verify 0.3).
    Without the floor one cycle gave (1.5 x 2 + 1) / 3 = 1.33 and stopped a single stream after its first cycle."""
    from collections import deque

    rule = BT.SpeculationRule(costs=BT.FixedCosts(plain_fn=lambda n: 1.0, draft_s=0.1, verify_s=0.3))
    assert rule.tau(deque()) == pytest.approx(1.5)
    assert rule.tau(deque([1])) == pytest.approx(4 / 3 + 0.5)
    assert rule.tau(deque([1, 3])) == pytest.approx(7 / 4 + np.sqrt(2) / np.sqrt(2))  # s = sqrt(2) > the floor
    assert rule.choose(1, {0: rule.tau(deque())}) == {0}
    assert rule.choose(1, {0: rule.tau(deque([1]))}) == {0}
    assert rule.choose(1, {0: rule.tau(deque([1] * 5))}) == set()


def test_rule_probes_a_sequence_kept_plain(be):
    """A sequence whose cycles fell below break-even is kept plain, and drafts again after probe_after plain steps
    (its τ̂ back to the prior)."""
    # break-even at one sequence: tau > (1.05 + 0.5 + 0.4) / 1.05 = 1.86; the prior 2.0 drafts, 1-token cycles do not
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.5, verify_s=0.4)
    rule = BT.SpeculationRule(costs=costs, prior_tau=2.0, prior_weight=1.0, probe_after=5)
    dec = _decoder(be, 1, rule)
    i = dec.submit(_prompts(be, [9])[0], GenerationRequest(max_new_tokens=60, eos_ids=set(), proposer="dflash2"))
    dec.step()  # admits and drafts (prior 2.0)
    s = dec._active[i]
    s.committed["dflash2"].extend([1, 1, 1, 1])  # as if its recent cycles committed 1 token: tau = 1.4
    picks = []
    for _ in range(12):
        picks.append(bool(dec._choose([s])))
    assert picks[:5] == [False] * 5 and picks[5]  # 5 plain, then the probe drafts
    assert s.plain_run == 0 and not s.committed["dflash2"]


def test_adaptive_loop_drafts_alone_and_goes_plain_under_load(be):
    """The loop follows the rule: one sequence of the accepting pair drafts (cycles); 6 sequences of the drafter
    under a cost model where drafting does not pay at that load decode in batched plain steps — and stay exact
    (lookups under load: test_batch_proposers.py)."""
    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.5, verify_s=0.4)
    prompts = _prompts(be, [7, 10, 12, 5, 9, 15], seed=9)
    one = _decoder(be, 1, BT.SpeculationRule(costs=costs)).run([(prompts[0], GenerationRequest(max_new_tokens=40))])[0]
    assert len(one.accepted) > 0
    dec = _decoder(be, 6, BT.SpeculationRule(costs=costs, prior_tau=4.0))
    many = dec.run([(p, GenerationRequest(max_new_tokens=20, proposer="dflash2")) for p in prompts])
    tgt = be.target_runner()
    assert one.tokens == D.target_generate(tgt, prompts[0], req(40)).tokens
    for o, p in zip(many, prompts):
        assert o.tokens == D.target_generate(tgt, p, req(20)).tokens
    # drafting starts only once the load fell: the first steps (6 sequences) are all plain
    assert all(o.plain_steps >= 5 for o in many)


def test_generate_batch_api(acc_export):
    with dflash2_trt.load(acc_export, backend="ort", threads=1) as g:
        prompts = _prompts(g._backend, [6, 17, 9], seed=21)
        want = [g.generate(p, max_new_tokens=m, guard=False) for p, m in zip(prompts, [30, 10, 20])]
        got = g.generate_batch(prompts, max_new_tokens=[30, 10, 20], max_batch=2)
        for w, r in zip(want, got):
            assert r.tokens == w.tokens and r.finish_reason == w.finish_reason and r.text == w.text
        plain = g.generate_batch(prompts[:2], max_new_tokens=8, speculative=False, temperature=[0.0, 0.7], seed=[0, 4])
        assert plain[0].tokens == want[0].tokens[:8] and plain[0].stats.plain_steps == 7
        assert plain[1].tokens == g.generate(prompts[1], 8, 0.7, seed=4, speculative=False).tokens
        assert g.generate_batch([]) == []
        with pytest.raises(DFlash2Error, match="max_batch"):
            g.generate_batch(prompts, max_batch=0)
        with pytest.raises(DFlash2Error, match="2 values for 3 prompts"):
            g.generate_batch(prompts, max_new_tokens=[1, 2])


@pytest.mark.slow
def test_smollm2_batch_equals_b1(identity_export):
    """SmolLM2-135M-Instruct: 3 chat prompts of different lengths in 2 slots (the third joins when one leaves),
    the adaptive rule choosing cycles or plain steps: greedy tokens == each prompt's B = 1 plain output on the
    same backend."""
    from helpers import SMOLLM2_PROMPTS

    with dflash2_trt.load(identity_export, backend="ort", threads=2) as g:
        prompts = [g.encode(p) for p in SMOLLM2_PROMPTS]
        want = [g.generate(p, max_new_tokens=24, speculative=False).tokens for p in prompts]
        got = g.generate_batch(prompts, max_new_tokens=24, max_batch=2)
        assert [r.tokens for r in got] == want


def test_batched_sampling_keeps_the_target_law(be):
    """T > 0 in the batch loop, drafting every step (each sequence its own rejection sampling and accepted length):
    the joint law of a sequence's first two tokens is the target's own — chi-square against the exact law from B = 1
    forwards — with greedy sequences in the same batches unchanged and drafts accepted."""
    T, n = 1.0, 480
    prompt = _prompts(be, [24], seed=17)[0]  # longer than the copy distance: the pair's drafts get accepted
    tgt = be.target_runner()
    law = two_token_law(tgt, prompt, T)
    greedy_want = D.target_generate(tgt, prompt, req(12)).tokens
    dec = _decoder(be, 8, BT.SpeculationRule(adaptive=False))
    sampled, greedy = [], []
    for k in range(n):
        if k % 120 == 0:
            greedy.append(dec.submit(prompt, GenerationRequest(max_new_tokens=12)))
        sampled.append(dec.submit(prompt, GenerationRequest(max_new_tokens=8, temperature=T, seed=1000 + k)))
    while dec.busy:
        dec.step()
    for i in greedy:
        assert dec.results[i].tokens == greedy_want
    res = [dec.results[i] for i in sampled]
    assert sum(len(r.accepted) for r in res) >= n and sum(sum(r.accepted) for r in res) > n // 10  # drafts verified
    p_value = two_token_p_value(law, [(r.tokens[0], r.tokens[1]) for r in res])
    assert p_value > 1e-3, p_value


def test_realized_check_compares_what_steps_made():
    """MeasuredCosts.holds_plain: plain steps at a batch size first (4); then the rule weighs while drafting is
    unmeasured and its last choice drafted, or while drafting steps made at least the plain ones' tokens per second;
    it holds the steps plain (every 16th weighed: a probe) while drafting made less, or after the rule chose plain;
    batch sizes are kept apart; given costs (FixedCosts) never hold."""
    P, M = BT.STEP_RATE_PROBE, BT.STEP_RATE_MIN_STEPS

    def weighed(c, n, steps):  # the indices of the weighed steps among `steps` asked
        return [i for i in range(steps) if not c.holds_plain(n)]

    c = BT.MeasuredCosts()
    assert c.holds_plain(4)  # nothing measured at 4: plain first
    for _ in range(M):
        c.record_step(4, False, 4, 0.010, weighed=False)  # 400 tokens/s
    assert not c.holds_plain(4)  # drafting not measured: the rule weighs
    c.record_step(4, True, 6, 0.020, weighed=True)
    assert not c.holds_plain(4)  # it drafted last: still weighed
    c.record_step(4, False, 4, 0.010, weighed=True)  # the rule chose plain: nothing changes until a probe
    assert weighed(c, 4, 2 * P) == [P - 1, 2 * P - 1]
    for _ in range(M):
        c.record_step(4, True, 6, 0.020, weighed=True)  # 300 tokens/s: drafting measured, it loses
    assert weighed(c, 4, P) == [P - 1]
    c.record_step(4, True, 6, 0.020, weighed=True)  # the probe drafted: held again
    assert c.holds_plain(4)
    assert c.holds_plain(2)  # another batch size: its own plain steps first
    for _ in range(BT.STEP_RATE_WINDOW):  # drafting steps that now pay (acceptance rose): weighed every step
        c.record_step(4, True, 12, 0.020, weighed=True)
    c.record_step(4, False, 4, 0.010, weighed=True)  # a plain choice among paying drafts: still weighed
    assert weighed(c, 4, P) == list(range(P))
    assert not BT.FixedCosts(plain_fn=lambda n: 1.0, draft_s=0.1, verify_s=0.1).holds_plain(4)


def test_realized_check_ignores_steps_the_rule_did_not_weigh(be):
    """A prompt-lookup request whose context has no match offers the rule nothing: that plain step is no choice of
    the rule's, so the realized check does not hold the batch size plain for it, and the next step whose lookup
    matches is weighed (and drafts: a lookup is free of drafter time)."""
    dec = _decoder(be, 1, BT.SpeculationRule(), draft=False)
    i = dec.submit(_prompts(be, [6])[0], GenerationRequest(max_new_tokens=60, eos_ids=set(), proposer="ngram"))
    dec.step()
    s = dec._active[i]
    for _ in range(BT.STEP_RATE_MIN_STEPS):  # plain steps at one sequence measured: the check lets the rule weigh
        dec.rule.costs.record_step(1, False, 1, 0.01, weighed=False)
    dec.rule.costs.record_plain(1, 0.01)
    s.choice.tokens = np.arange(20, dtype=np.int64)  # no repeated n-gram: no lookup
    assert dec._choose([s]) == {} and not dec._weighed
    dec.rule.costs.record_step(1, False, 1, 0.01, dec._weighed)
    assert not dec.rule.costs.holds_plain(1)
    s.choice.tokens = np.array([5, 6, 7, 8, 9, 5, 6], dtype=np.int64)  # "5 6" seen before: drafts 7 8 9 5 ...
    plan = dec._choose([s])
    assert dec._weighed and plan == {i: ("ngram", s.choice.ngram(60))}, plan


@pytest.mark.parametrize("check", [True, False])
def test_realized_check_stops_drafting_that_loses(be, monkeypatch, check):
    """Two requests of the accepting pair one after another in one slot, on measured costs, where a verify costs far
    more than its rows (the clock is the test's: a step's forward 10 ms, 310 ms with verify rows; proposals free):
    the cost model, charging a verify by its rows, keeps drafting; the realized check stops it after its first
    drafting steps (then probes only), and the output stays the target's own. The negative control (check=False:
    the check planted out) keeps drafting, which fails the assertion the check passes."""
    now = [0.0]
    monkeypatch.setattr(BT, "COST_CLOCK", lambda: now[0])
    if not check:
        monkeypatch.setattr(BT.MeasuredCosts, "holds_plain", lambda self, n: False)
    dec = _decoder(be, 1, BT.SpeculationRule(prior_tau=3.0))
    forward = dec.target.forward

    def slow_verifies(rows, **kw):
        now[0] += 0.010 + (0.300 if any(len(r) > 1 for r in rows.values()) else 0.0)
        return forward(rows, **kw)

    dec.target.forward = slow_verifies
    prompts = _prompts(be, [7, 10], seed=11)
    out = dec.run([(p, GenerationRequest(max_new_tokens=64, eos_ids=set(), proposer="dflash2")) for p in prompts])
    tgt = be.target_runner()
    for o, p in zip(out, prompts):
        assert o.tokens == D.target_generate(tgt, p, req(64, eos_ids=set())).tokens
    drafted = sum(len(o.accepted) for o in out)  # cycles
    assert drafted >= BT.STEP_RATE_MIN_STEPS and sum(sum(o.accepted) for o in out) > 0  # the model drafted, accepted
    if check:
        assert drafted <= BT.STEP_RATE_MIN_STEPS + 4, drafted  # then probes only (every 16th step)
    else:
        assert drafted > BT.STEP_RATE_MIN_STEPS + 4, drafted
