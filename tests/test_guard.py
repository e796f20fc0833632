"""The acceptance guard and the confidence-adapted verify length (dflash2_trt.runtime.guard) in the decoder loop:
lossless at T = 0 (token for token the target's own greedy output), exact in law at T > 0, and the paths
taken (switched to plain steps, probed back, fewer rows verified). NumPy only: a Markov toy target and
drafters that know it; no torch, no export (about 5 s)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.acceptance import softmax_t
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.protocol import Draft
from dflash2_trt.runtime.guard import AcceptanceGuard, GuardConfig, verify_rows
from helpers import req


class MarkovTarget:
    """TargetRunner whose next-token logits depend on the current token only: logits row = W[token]."""

    def __init__(self, W: np.ndarray) -> None:
        self.W = W  # [V, V]
        self.vocab_size = W.shape[0]
        self.max_positions = 10_000
        self.eos_ids: set[int] = set()
        self.toks: list[int] = []
        self.forwards: list[int] = []  # rows per forward call

    def reset(self) -> None:
        self.toks = []

    @property
    def cache_length(self) -> int:
        return len(self.toks)

    def forward(self, ids: list[int], last_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
        self.toks += list(ids)
        self.forwards.append(len(ids))
        feats = np.eye(self.vocab_size, dtype=np.float32)[ids]  # [m, V]
        logits = self.W[ids].astype(np.float32)  # [m, V]
        return (logits[-1:] if last_logits else logits), feats

    def crop(self, length: int) -> None:
        self.toks = self.toks[:length]


class ScheduledOracleDrafter:
    """DraftRunner proposing the target's greedy continuation for ``good(pos)`` rows, then wrong tokens;
    confidence 0.9 on right rows and 0.2 on wrong ones (so a threshold cuts the block where it goes wrong)."""

    def __init__(self, W: np.ndarray, block_size: int, good) -> None:  # noqa: ANN001
        self.W, self.block_size, self.good = W, block_size, good
        self.num_draft_rows = block_size - 1  # a hand-made runner: its L is given here
        self.ctx = 0

    def reset(self) -> None:
        self.ctx = 0

    def add_context(self, feats: np.ndarray, start: int) -> None:
        assert start == self.ctx, (start, self.ctx)  # the decoder hands over every position exactly once
        self.ctx += feats.shape[0]

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms) -> Draft:  # noqa: ANN001
        assert pos == self.ctx
        L, V = self.num_draft_rows, self.W.shape[0]
        k = self.good(pos)
        toks, t = [], anchor
        for i in range(L):
            t = int(self.W[t].argmax())
            toks.append(t if i < k else (t + 1) % V)
        toks = np.asarray(toks, dtype=np.int64)
        conf = np.where(np.arange(L) < k, 0.9, 0.2).astype(np.float32)
        return Draft(tokens=toks, proposal=np.ones((L, 1), np.float32), cand=toks[:, None], confidence=conf)


def _toy(V: int = 50, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(V, V)).astype(np.float32) * 3


def test_guard_switches_to_plain_and_probes_back_losslessly():
    W = _toy()
    target = MarkovTarget(W)
    # the drafter is useless for the first 40 positions, then perfect
    drafter = ScheduledOracleDrafter(W, 8, lambda pos: 0 if pos < 45 else 7)
    prompt = [3, 1, 4]
    want = D.target_generate(target, prompt, req(120)).tokens
    guard = AcceptanceGuard(GuardConfig(window=2, min_cycles=2, backoff=4, max_backoff=16, cost_ratio=2.0))
    target.forwards = []
    res = D.speculative_generate(target, drafter, prompt, req(120), D.DecodeHooks(guard=guard))
    assert res.tokens == want
    assert res.guard_switches >= 1 and res.guard_probes >= 1 and res.plain_steps > 0
    # failed probes doubled the backoff, the passed one reset it; the late cycles are full blocks
    assert guard.backoff == guard.cfg.backoff
    assert res.accepted[-3:] == res.proposed[-3:] and res.proposed[-3] == 7  # the last may be a partial block
    s = res.stats()
    assert s["spec_cycles"] == len(res.accepted) and s["plain_steps"] == res.plain_steps
    assert len(res.tokens) == 1 + res.plain_steps + sum(a + 1 for a in res.accepted)
    # a plain step is one target row: the forwards are prefill, cycles (8 rows) and plain steps (1 row)
    fw = target.forwards[1:]  # after the prefill
    assert fw.count(1) == res.plain_steps and fw.count(8) >= len(res.accepted) - 1


def test_guard_stays_speculative_when_drafts_pay():
    W = _toy(seed=1)
    target = MarkovTarget(W)
    drafter = ScheduledOracleDrafter(W, 8, lambda pos: 7)
    want = D.target_generate(target, [5], req(80)).tokens
    res = D.speculative_generate(target, drafter, [5], req(80),
                                 D.DecodeHooks(guard=AcceptanceGuard(GuardConfig(cost_ratio=2.0))))
    assert res.tokens == want
    assert res.plain_steps == 0 and res.guard_switches == 0


def test_guard_measured_cost_calibrates_then_decides():
    g = AcceptanceGuard(GuardConfig(window=3, min_cycles=3, probe_window=2, backoff=3, max_backoff=6))
    assert g.plain_next() and g.calibrating and g.break_even() is None  # the first step is a timed plain one
    g.record_step(1.0)  # t_step = 1 s
    assert not g.plain_next() and g.probes == 0
    g.record_cycle(2, 3.0)
    g.record_cycle(2, 3.0)
    assert not g.plain_next() and g.break_even() == pytest.approx(3.0)  # judged after min_cycles only
    g.record_cycle(2, 3.0)  # (2, 2, 2): bound 2 < 3, plain steps
    assert g.switches == 1 and g.plain_left == 3 and g.backoff == 6
    for _ in range(3):
        g.record_step(1.0)
    assert g.probes == 1 and not g.plain_next() and len(g.window) == 3  # the evidence is kept
    g.record_cycle(5, 3.0)
    assert not g.plain_next()
    g.record_cycle(4, 3.0)  # the probe's 2 cycles: window (2, 5, 4), bound 3.67 + 1.53/√3 >= 3, backoff reset
    assert g.switches == 1 and g.backoff == 3 and not g.plain_next()
    g.record_cycle(1, 3.0)  # (5, 4, 1): mean 3.33
    g.record_cycle(2, 3.0)  # (4, 1, 2): the mean 2.33 is below 3, the bound 2.33 + 1.53/√3 = 3.22 is not
    assert not g.plain_next() and g.switches == 1
    g.record_cycle(1, 3.0)  # (1, 2, 1): bound 1.67
    assert g.switches == 2 and g.plain_left == 3


def test_guard_step_time_is_a_running_mean_of_varying_and_outlier_times():
    """The plain step's time is the mean of the steps timed so far (for the first 16), then an exponential mean
    weighting the newest 1/16: fresh random times with outliers (one step 20x slower, as a page fault or another
    process makes) move it by their share, not to their value, and the break-even is the window's mean cycle time
    over it. A decision that the last step's time would flip: a drafter whose cycles pay against the mean step
    stays on after one slow step, and one that does not pay is switched off after one fast step."""
    rng = np.random.default_rng(7)
    times = rng.uniform(0.008, 0.012, 40)
    times[[5, 23]] = 0.2  # outliers
    times[31] = 0.0005
    g = AcceptanceGuard(GuardConfig(window=8, min_cycles=8, backoff=1, max_backoff=4))
    for n, t in enumerate(times, 1):
        g.record_step(float(t))
        if n <= 16:
            assert g.t_step == pytest.approx(float(times[:n].mean()), rel=1e-12)
    want = float(times[:16].mean())
    for t in times[16:]:
        want += (float(t) - want) / 16
    assert g.t_step == pytest.approx(want, rel=1e-12)
    g.plain_left = 0
    cycles = rng.uniform(0.015, 0.025, 8)  # [8] seconds per cycle
    for c in cycles:
        g.record_cycle(3, float(c))
    assert g.break_even() == pytest.approx(float(cycles.mean()) / want, rel=1e-12)

    def guard_after(steps: list[float], tokens: int) -> AcceptanceGuard:
        g = AcceptanceGuard(GuardConfig(window=4, min_cycles=4, probe_window=4, z=0.0, min_spread=0.0))
        for t in steps:
            g.plain_left = 1
            g.record_step(t)
        for _ in range(4):
            g.record_cycle(tokens, 0.02)
        return g

    # mean step 0.01 + (0.2 - 0.01) / 4 = 0.0575 s with the outlier: break-even 0.35, 1-token cycles pay
    assert guard_after([0.01, 0.01, 0.01, 0.2], 1).switches == 0
    # steps 0.01 then one of 0.001: mean 0.00775 s, break-even 2.58 -- 3-token cycles pay, 2-token ones do not
    assert guard_after([0.01, 0.01, 0.01, 0.001], 3).switches == 0
    assert guard_after([0.01, 0.01, 0.01, 0.001], 2).switches == 1
    # the last step alone (0.001 s) would put the break-even at 20 and switch the 3-token drafter off


def test_guard_switches_on_evidence_not_on_an_unlucky_stretch():
    """z = 0 is the plain mean rule; with the default z = 1 a stretch of 1-token cycles around a mean that may
    still pay does not switch the drafter off, while cycles that all commit one token do."""
    rules = {z: AcceptanceGuard(GuardConfig(window=4, min_cycles=4, z=z, cost_ratio=1.5)) for z in (0.0, 1.0)}
    for t in (3, 1, 1, 2, 1):  # windows (3, 1, 1, 2): mean 1.75; then (1, 1, 2, 1): mean 1.25, bound 1.5
        for g in rules.values():
            g.record_cycle(t, 1.0)
    assert rules[0.0].switches == 1 and rules[1.0].switches == 0
    g = rules[1.0]
    for t in (1, 1, 1):  # ... then (1, 1, 1, 1): every cycle commits one token
        g.record_cycle(t, 1.0)
    assert g.switches == 1 and g.plain_next()


def test_guard_a_few_equal_cycles_are_no_proof():
    """Three 1-token cycles have s = 0: without the spread floor they switched a drafter that pays off at once; with
    it (0.5) the bound 1 + 0.5/√n falls below a break-even of 1.25 only after 5 such cycles."""
    floor, bare = (AcceptanceGuard(GuardConfig(cost_ratio=1.25, min_spread=m)) for m in (0.5, 0.0))
    for _ in range(3):
        floor.record_cycle(1, 1.0)
        bare.record_cycle(1, 1.0)
    assert bare.switches == 1 and floor.switches == 0 and not floor.plain_next()
    floor.record_cycle(1, 1.0)  # n = 4: bound 1.25, not below
    assert floor.switches == 0
    floor.record_cycle(1, 1.0)  # n = 5: bound 1.22
    assert floor.switches == 1 and floor.plain_next()


def test_guard_config_rejects_bad_values():
    for kw in ({"window": 0}, {"probe_window": 0}, {"window": 2, "probe_window": 3}, {"backoff": 0},
               {"backoff": 9, "max_backoff": 8}, {"cost_ratio": 0.0}, {"min_cycles": 0},
               {"window": 2, "min_cycles": 3}, {"z": -1.0}, {"z": float("nan")}, {"z": float("inf")}, {"min_spread": -0.1},
               {"min_spread": float("nan")}):
        with pytest.raises(DFlash2Error):
            GuardConfig(**kw)


def test_verify_rows_cumulative_threshold():
    conf = np.array([0.9, 0.9, 0.5, 0.9], np.float32)  # cumulative 0.9, 0.81, 0.405, 0.36
    assert verify_rows(conf, 4, 0.8) == 2
    assert verify_rows(conf, 4, 0.4) == 3
    assert verify_rows(conf, 2, 0.1) == 2
    assert verify_rows(conf, 4, 0.95) == 0
    assert verify_rows(None, 4, 0.5) == 4 and verify_rows(conf, 4, 0.0) == 4


@pytest.mark.parametrize("guard", [False, True])
def test_confidence_verify_length_lossless_greedy(guard):
    W = _toy(seed=2)
    target = MarkovTarget(W)
    rng = np.random.default_rng(0)
    ks = {}
    drafter = ScheduledOracleDrafter(W, 8, lambda pos: ks.setdefault(pos, int(rng.integers(0, 8))))
    want = D.target_generate(target, [7, 8], req(100)).tokens
    g = AcceptanceGuard(GuardConfig(window=2, min_cycles=2, backoff=2, cost_ratio=1.5)) if guard else None
    target.forwards = []
    res = D.speculative_generate(target, drafter, [7, 8], req(100, min_confidence=0.5),
                                 D.DecodeHooks(guard=g))
    assert res.tokens == want
    # the cut fell where the drafter's confidence fell: every verified row was a right one
    assert all(a == n for a, n in zip(res.accepted, res.proposed))
    assert any(n < 7 for n in res.proposed[:-1]) and max(res.proposed) >= 4
    # fewer rows verified = smaller target passes
    assert sorted(target.forwards[1:])[: len(res.accepted)] != [8] * len(res.accepted)
    if guard:
        assert res.plain_steps > 0 and res.guard_probes > 0


class SamplingDrafter:
    """DraftRunner sampling a Markov proposal chain Q[prev] (a full-vocabulary proposal, like DFlash v1) by
    inverse CDF with the decoder's uniforms; each row's law depends on the row before, so the confidence of
    row i (max of its proposal) depends on the drafts of rows < i."""

    def __init__(self, Q: np.ndarray, block_size: int) -> None:
        self.Q, self.block_size = Q, block_size
        self.num_draft_rows = block_size - 1  # a hand-made runner: its L is given here

    def reset(self) -> None:
        pass

    def add_context(self, feats: np.ndarray, start: int) -> None:
        pass

    def propose(self, anchor: int, pos: int, rows: int, temperature: float, uniforms) -> Draft:  # noqa: ANN001
        L, V = self.num_draft_rows, self.Q.shape[0]
        toks, qs, t = [], [], anchor
        for i in range(L):
            q = self.Q[t]
            t = int(min((np.cumsum(q) <= uniforms[0, i]).sum(), V - 1))
            toks.append(t)
            qs.append(q)
        q = np.asarray(qs, np.float32)  # [L, V]
        return Draft(tokens=np.asarray(toks, np.int64), proposal=q, cand=np.tile(np.arange(V), (L, 1)),
                     vocab_proposal=q)


def test_guard_and_confidence_exact_in_law_at_t1():
    """T = 1: the joint law of the first 4 tokens equals the target's own (chi-square over all 3^4 outcomes),
    with the guard switching and the verify length cut by confidence — both paths asserted taken."""
    V, n_tok, N = 3, 4, 6000
    rng = np.random.default_rng(4)
    W = rng.normal(size=(V, V)).astype(np.float32) * 1.5
    Q = rng.dirichlet(np.ones(V) * 0.7, size=V).astype(np.float32)  # proposals unlike the target
    P = softmax_t(W, 1.0).astype(np.float64)  # [V, V] target transition law
    prompt = [0]
    counts: dict[tuple, int] = {}
    cut = switched = 0
    for seed in range(N):
        target = MarkovTarget(W)
        g = AcceptanceGuard(GuardConfig(window=1, min_cycles=1, probe_window=1, backoff=1, max_backoff=2, cost_ratio=2.0))
        r = D.speculative_generate(target, SamplingDrafter(Q, 4), prompt,
                                   req(n_tok, temperature=1.0, seed=seed, min_confidence=0.35),
                                   D.DecodeHooks(guard=g))
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        cut += any(n < min(3, n_tok - 1) for n in r.proposed[:1])
        switched += r.plain_steps > 0
    assert cut > N // 10 and switched > N // 10
    outcomes = list(itertools.product(range(V), repeat=n_tok))
    exp = []
    for o in outcomes:
        p, prev = 1.0, prompt[-1]
        for t in o:
            p *= P[prev, t]
            prev = t
        exp.append(p * N)
    obs = [counts.get(o, 0) for o in outcomes]
    assert sum(obs) == N
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_guard_measured_cost_in_the_loop(monkeypatch):
    """The default guard (cost measured online): a fake clock that a target pass advances by 1 + 0.25 per row
    (a 16-row verify costs 4 plain steps) — a drafter accepting ~2 drafts per cycle (τ 3) does not pay, one
    accepting all 15 (τ 16) does; the guard must find both from its own timings."""
    clock = [0.0]

    class TimedTarget(MarkovTarget):
        def forward(self, ids, last_logits=False):  # noqa: ANN001, ANN201
            clock[0] += 1.0 + 0.25 * len(ids)
            return super().forward(ids, last_logits)

    monkeypatch.setattr(D, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    W = _toy(seed=3)
    target = TimedTarget(W)
    want = D.target_generate(target, [2], req(400)).tokens
    drafter = ScheduledOracleDrafter(W, 16, lambda pos: 2 if pos < 150 else 15)
    g = AcceptanceGuard()
    res = D.speculative_generate(target, drafter, [2], req(400), D.DecodeHooks(guard=g))
    assert res.tokens == want
    # measured: a plain step 1.25 s, a full cycle (16 rows) 5 s -> break-even τ 4, between the two drafters' τ
    assert g.t_step == pytest.approx(1.25) and (16, pytest.approx(5.0)) in g.window
    assert res.guard_switches >= 1 and res.guard_probes >= 1 and res.plain_steps >= g.cfg.backoff
    assert res.accepted[-2] == 15 and res.elapsed_s < D.target_generate(target, [2], req(400)).elapsed_s
