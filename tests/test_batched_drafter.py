"""The batched drafter: :class:`~dflash2_trt.runtime.ort.batched_drafter.OrtBatchedDraftRunner` against
one B = 1 :class:`~dflash2_trt.runtime.ort.backend.OrtDraftRunner` per sequence on fresh random context features —
ragged context updates in one call, ragged lengths, capacity growth, slots reset and re-joined, final partial
blocks, T = 0 and T > 0 sequences in one call, every draft mode, a slot range bound in place (idle slots inside)
and a gathered call — with one block call and one head call per batched proposal; its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime.request import GenerationRequest
from helpers import req


@pytest.fixture(scope="module")
def be(acc_export):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    with OrtBackend(acc_export, threads=1) as b:
        yield b


def _runner(be, mode, slots, step=8):
    from dflash2_trt.runtime.ort.batched_drafter import OrtBatchedDraftRunner

    return OrtBatchedDraftRunner(be, mode, slots, step=step)


def _same_draft(got, want, what):
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"tokens {what}")
    np.testing.assert_array_equal(got.cand, want.cand, err_msg=f"cand {what}")
    np.testing.assert_allclose(got.proposal, want.proposal, rtol=1e-5, atol=1e-7, err_msg=f"proposal {what}")
    for name in ("vocab_proposal", "confidence"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), f"{name} {what}"
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=f"{name} {what}")


@pytest.mark.parametrize("mode", ["greedy", "viterbi", "independent"])
def test_propose_batch_equals_b1(be, mode):
    """6 slots over 10 steps: random slots take ragged context (a prompt of up to 40 rows, then 1..9 rows) in one
    context call, random slots propose together (random anchors, verified rows, T in {0, 0.7, 1.3}) in one block and
    one head call; every draft == its sequence's own B = 1 runner's. Slot 1 is reset and re-joined mid-way; capacity
    (step 8) grows; one step proposes for slots 0 and 5 alone (a gathered call), others bind a range with idle slots."""
    rng = np.random.default_rng({"greedy": 1, "viterbi": 2, "independent": 3}[mode])
    cfg = be.manifest.drafter_config
    F, L, V = cfg.context_in_features, cfg.num_draft_rows, be.manifest.target.vocab_size
    slots = 6
    run = _runner(be, mode, slots)
    refs = {b: be.draft_runner(mode) for b in range(slots)}
    proposed = idle_in_range = 0
    for it in range(10):
        if it == 5:  # slot 1's sequence leaves; a new one joins its slot
            run.reset(1)
            refs[1] = be.draft_runner(mode)
        new = {}
        for b in range(slots):
            if it == 0 or rng.random() < 0.6:
                m = int(rng.integers(5, 41)) if run.lengths[b] == 0 else int(rng.integers(1, 10))
                new[b] = (rng.standard_normal((m, F)).astype(np.float32), int(run.lengths[b]))
        calls = run.context_calls
        run.add_contexts(new)
        assert run.context_calls == calls + 1
        for b, (f, start) in new.items():
            refs[b].add_context(f, start)
        assert all(run.lengths[b] == refs[b].kv.length for b in range(slots))
        drafting = [b for b in range(slots) if run.lengths[b] > 0 and rng.random() < 0.7] or [2]
        if it == 7:
            drafting = [5, 0]  # range 6 > 2 x 2: the two slots' caches gathered
        n = len(drafting)
        anchors = rng.integers(0, V, n).tolist()
        rows = rng.integers(1, L + 1, n).tolist()
        temps = rng.choice([0.0, 0.0, 0.7, 1.3], n).tolist()
        uniforms = [rng.random((1, L), dtype=np.float32) if t > 0 else None for t in temps]
        pos = [int(run.lengths[b]) for b in drafting]
        calls = run.block_calls, run.head_calls
        idle_in_range += max(drafting) - min(drafting) + 1 > n and it != 7
        got = run.propose_batch(drafting, anchors, pos, rows, temps, uniforms)
        assert (run.block_calls, run.head_calls) == (calls[0] + 1, calls[1] + 1)
        for i, b in enumerate(drafting):
            want = refs[b].propose(anchors[i], pos[i], rows[i], temps[i], uniforms[i])
            _same_draft(got[i], want, f"slot {b} step {it} T {temps[i]} rows {rows[i]}")
            proposed += 1
    assert run.capacity > 8 and run.gathered_calls == 1 and idle_in_range >= 2 and proposed >= 25


def test_slot_view_and_refusals(be):
    """A slot's B = 1 view proposes what a B = 1 runner does; bad positions, slots and lengths are refused."""
    cfg = be.manifest.drafter_config
    rng = np.random.default_rng(5)
    f = rng.standard_normal((7, cfg.context_in_features)).astype(np.float32)
    run = _runner(be, "greedy", 2)
    view, ref = run.slot(1), be.draft_runner("greedy")
    assert view.block_size == ref.block_size
    view.add_context(f, 0)
    ref.add_context(f, 0)
    _same_draft(view.propose(3, 7, 4, 0.0, None), ref.propose(3, 7, 4, 0.0, None), "view")
    assert run.lengths.tolist() == [0, 7]
    with pytest.raises(DFlash2Error, match="anchor is at 6"):
        run.propose_batch([1], [3], [6], [4], [0.0], [None])
    with pytest.raises(DFlash2Error, match="got features for position 3"):
        run.add_context(0, f, 3)
    with pytest.raises(DFlash2Error, match="appears twice"):
        run.propose_batch([1, 1], [3, 3], [7, 7], [4, 4], [0.0, 0.0], [None, None])
    with pytest.raises(DFlash2Error, match="out of range"):
        run.slot(2)
    with pytest.raises(DFlash2Error, match="differ in length"):
        run.propose_batch([1], [3, 4], [7], [4], [0.0], [None])
    assert run.propose_batch([], [], [], [], [], []) == []


# -- the batch loop over the batched drafter -------------------------------------------------------------------

def _loop(be, slots, batched, rule, made=None):
    """A batch loop over ``slots`` with the batched drafter (``made`` collects it) or one B = 1 drafter per slot."""
    from dflash2_trt.runtime import batch as BT
    from dflash2_trt.runtime.ort.batched_drafter import OrtBatchedDraftRunner
    from dflash2_trt.runtime.ort.batched_target import OrtBatchedTargetRunner

    target = OrtBatchedTargetRunner.from_backend(be, slots)
    if not batched:
        return BT.BatchDecoder(target, lambda: be.draft_runner("greedy"), rule)

    def make(n):
        made.append(OrtBatchedDraftRunner(be, "greedy", n))
        return made[-1]

    return BT.BatchDecoder(target, rule=rule, batched_drafter=make)


def test_batch_loop_drafts_in_one_call(be):
    """5 drafter requests in 3 slots (two join freed slots), T = 0 and T > 0, every sequence drafting every step:
    each step's proposals share ONE block and ONE head call, and every sequence's tokens and per-cycle counts equal
    the same loop's with one B = 1 drafter per slot (same seeds); the greedy ones are their B = 1 plain output."""
    from dflash2_trt.runtime import batch as BT
    from dflash2_trt.runtime import decoder as D
    from helpers import assert_accepts

    rng = np.random.default_rng(11)
    V = be.manifest.target.vocab_size
    prompts = [rng.integers(4, V, n).tolist() for n in (9, 24, 14, 30, 6)]
    spec = [(30, 0.0, 0), (20, 0.9, 5), (26, 0.0, 0), (18, 1.2, 7), (22, 0.0, 0)]
    out = {}
    made: list = []
    for batched in (False, True):
        dec = _loop(be, 3, batched, BT.SpeculationRule(adaptive=False), made)
        out[batched] = dec.run([(p, GenerationRequest(max_new_tokens=m, temperature=t, seed=s, eos_ids=set(),
                                                      proposer="dflash2")) for p, (m, t, s) in zip(prompts, spec)])
        steps = dec.drafting_steps
    run = made[0]
    assert run.block_calls == run.head_calls == steps  # one block + one head call per drafting step
    cycles = sum(len(r.accepted) for r in out[True])
    assert cycles > steps  # steps shared their call
    assert run.context_calls <= 2 * steps  # prompts (untimed) and cycles' rows: at most two calls a step
    for a, b in zip(out[False], out[True]):
        assert (a.tokens, a.accepted, a.proposed, a.plain_steps) == (b.tokens, b.accepted, b.proposed, b.plain_steps)
    tgt = be.target_runner()
    for r, p, (m, t, _) in zip(out[True], prompts, spec):
        if t == 0:
            assert r.tokens == D.target_generate(tgt, p, req(m, eos_ids=set())).tokens
    assert_accepts([a for r, (_, t, _) in zip(out[True], spec) if t == 0 for a in r.accepted], 15, "(greedy ones)")


def test_rule_charges_a_batched_proposal_once_per_step():
    """With a batched drafter t_draft is the step's one call for its k drafter proposals (measured per k), not k
    B = 1 proposals: where 8 separate proposals never pay, one shared call does."""
    from dflash2_trt.runtime import batch as BT

    costs = BT.FixedCosts(plain_fn=lambda n: 1.0 + 0.05 * n, draft_s=0.5, verify_s=0.4)
    cands = {i: 4.0 for i in range(8)}
    assert BT.SpeculationRule(costs=costs).choose(8, cands) == set()  # 8 / 1.4 beats 32 / 8.6
    assert BT.SpeculationRule(costs=costs).choose(8, cands, batched_draft=True) == set(range(8))  # 32 / 5.1
    m = BT.MeasuredCosts()
    assert m.draft() is None and m.draft(4) is None
    m.record_draft(0.010)  # one proposal alone
    m.record_draft(0.016, 4)  # a call of 4
    assert m.draft() == 0.010 and m.draft(4) == 0.016 and m.draft(8) == 0.016
    assert abs(m.draft(2) - 0.012) < 1e-12  # linear between measured counts
