"""The NumPy twin against brute force: Viterbi = exhaustive max, sampling proposals = exact chain law."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash2_trt import acceptance
from dflash2_trt import reference as R
from selector_oracles import brute_force_best_path, chain_distribution


def _rand_lattice(rng, L, K, r=5, V=40):
    cand = np.stack([rng.choice(V, K, replace=False) for _ in range(L)])  # [L, K]
    unary = -np.sort(-rng.normal(size=(L, K)), axis=-1)  # sorted descending like top-k
    g = rng.normal(size=(L, r))
    A, B = rng.normal(size=(V, r)), rng.normal(size=(V, r))
    anchor = int(rng.integers(V))
    return cand, unary, g, anchor, A, B


@pytest.mark.parametrize("L,K", [(1, 3), (2, 2), (3, 4), (4, 3), (5, 2)])
def test_viterbi_equals_brute_force(L, K):
    rng = np.random.default_rng(100 + L * 10 + K)
    for _ in range(20):
        S = R.lattice(*_rand_lattice(rng, L, K))
        idx, q = R.walk_one(S, "viterbi", 0.0, None)
        best, score = brute_force_best_path(S)
        assert idx.tolist() == best.tolist()
        np.testing.assert_array_equal(q.argmax(-1), idx)


def test_lattice_matches_definition():
    rng = np.random.default_rng(1)
    cand, unary, g, anchor, A, B = _rand_lattice(rng, 3, 4)
    S = R.lattice(cand, unary, g, anchor, A, B)
    for t, i, j in itertools.product(range(3), range(4), range(4)):
        pred = anchor if t == 0 else cand[t - 1, i]
        want = unary[t, j] + sum(A[pred, k] * g[t, k] * B[cand[t, j], k] for k in range(g.shape[1]))
        assert abs(S[t, i, j] - want) < 1e-12


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
def test_sampling_proposals_are_the_chain_law(mode):
    """The product of the recorded proposals along a chain is that chain's probability."""
    rng = np.random.default_rng(7)
    L, K, T = 3, 3, 0.7
    S = R.lattice(*_rand_lattice(rng, L, K))
    exact = chain_distribution(S, T)
    total = 0.0
    # enumerate chains by steering the uniforms into each cell of the inverse CDF
    for combo in itertools.product(range(K), repeat=L):
        u = np.zeros(L)
        prev = 0
        p_chain = 1.0
        for t in range(L):
            if mode == "greedy":
                q = np.exp(S[t, prev] / T - np.max(S[t, prev] / T)); q /= q.sum()
            else:
                q = None
            # find a uniform that selects combo[t] under the walk's own proposal
            idx, props = R.walk_one(S, mode, T, np.where(np.arange(L) < t, u, 0.0))
            q = props[t] if q is None else q
            cdf = np.concatenate([[0.0], np.cumsum(q)])
            u[t] = (cdf[combo[t]] + cdf[combo[t] + 1]) / 2
            p_chain *= q[combo[t]]
            prev = combo[t]
        idx, props = R.walk_one(S, mode, T, u)
        assert tuple(idx.tolist()) == combo
        assert abs(np.prod(props[np.arange(L), idx]) - p_chain) < 1e-12
        total += p_chain
        if mode == "viterbi":
            assert abs(p_chain - exact[combo]) < 1e-9
    assert abs(total - 1.0) < 1e-9


def test_ties_lowest_index():
    S = np.zeros((3, 4, 4))
    for mode in ("greedy", "viterbi"):
        idx, q = R.walk_one(S, mode, 0.0, None)
        assert idx.tolist() == [0, 0, 0]


def test_greedy_walk_follows_predecessor():
    # row 1 prefers candidate 2 when the predecessor is index 1, candidate 0 otherwise
    S = np.zeros((2, 3, 3))
    S[0, :, 1] = 1.0
    S[1, 1, 2] = 5.0
    idx, _ = R.walk_one(S, "greedy", 0.0, None)
    assert idx.tolist() == [1, 2]


def test_acceptance_stats_definitions():
    s = acceptance.acceptance_stats([0, 3, 1, 3], [3, 3, 3, 2])
    # r_1: cycles with >=1 accepted among eligible (all 4): 3/4
    assert s["per_position_cumulative"][0] == pytest.approx(3 / 4)
    assert s["per_position_cumulative"][2] == pytest.approx(1 / 3)  # only 3 cycles had a 3rd row
    assert s["tau"] == pytest.approx(np.mean([1, 4, 2, 4]))
    c = s["per_position_conditional"]
    assert c[1] == pytest.approx(s["per_position_cumulative"][1] / s["per_position_cumulative"][0])


def test_accept_greedy():
    logits = np.eye(5)[[1, 2, 4, 0]]  # target argmax per row: 1, 2, 4, 0
    assert acceptance.accept_greedy(np.array([1, 2, 3]), logits) == (2, 4)
    assert acceptance.accept_greedy(np.array([1, 2, 4]), logits) == (3, 0)
    assert acceptance.accept_greedy(np.array([3, 2, 4]), logits) == (0, 1)
