"""PyTorch selector == NumPy twin (fresh random inputs, ties included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2_trt import reference as R
from dflash2_trt.model import selector as S


def _inputs(rng, B, L, K, r, V, integer=False):
    cand = np.stack([np.stack([rng.choice(V, K, replace=False) for _ in range(L)]) for _ in range(B)])
    if integer:  # small integers: every score is exact in fp32 and fp64, so ties are real ties
        unary = -np.sort(-rng.integers(-2, 3, size=(B, L, K)), axis=-1).astype(np.float32)
        g = rng.integers(-1, 2, size=(B, L, r)).astype(np.float32)
        A = rng.integers(-1, 2, size=(V, r)).astype(np.float32)
        Bc = rng.integers(-1, 2, size=(V, r)).astype(np.float32)
    else:
        unary = -np.sort(-rng.normal(size=(B, L, K)), axis=-1).astype(np.float32)
        g = rng.normal(size=(B, L, r)).astype(np.float32)
        A = (rng.normal(size=(V, r)) * 0.3).astype(np.float32)
        Bc = (rng.normal(size=(V, r)) * 0.3).astype(np.float32)
    anchor = rng.integers(V, size=B)
    return cand, unary, g, anchor, A, Bc


def _torch(cand, unary, g, anchor, A, Bc, mode, temp, u):
    out = S.select_paths(torch.from_numpy(cand), torch.from_numpy(unary), torch.from_numpy(g),
                         torch.from_numpy(anchor), torch.from_numpy(A), torch.from_numpy(Bc), mode,
                         torch.from_numpy(np.asarray(temp, dtype=np.float32)),
                         None if u is None else torch.from_numpy(u))
    return [o.numpy() for o in out]


def _margin_ok(Sb, idx, mode, temp, u):
    """True when no decision of the reference walk is within fp32 noise of flipping."""
    eps = 1e-3
    L, K, _ = Sb.shape
    if K == 1:
        return True  # a single candidate: no decision to flip
    if temp <= 0 and mode == "greedy":
        prev = 0
        for t in range(L):
            row = np.sort(Sb[t, prev])[::-1]
            if row[0] - row[1] < eps:
                return False
            prev = idx[t]
        return True
    if temp <= 0:  # viterbi: compare best path with the best of all others at the final argmax level
        delta = Sb[0, 0].copy()
        for t in range(1, L):
            cand = delta[:, None] + Sb[t]
            srt = np.sort(cand, axis=0)
            if np.any(srt[-1] - srt[-2] < eps):
                return False
            delta = srt[-1]
        srt = np.sort(delta)
        return srt[-1] - srt[-2] >= eps
    _, q = R.walk_one(Sb, mode, temp, u)
    cdf = np.cumsum(q, axis=-1)
    return bool(np.all(np.abs(cdf - u[:, None]) > 1e-4))


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_torch_selector_matches_numpy_twin(mode, temp):
    rng = np.random.default_rng(abs(hash((mode, temp))) % 2**32)
    checked = 0
    for trial in range(12):
        B, L, K, r = int(rng.integers(1, 4)), int(rng.integers(1, 16)), int(rng.integers(1, 17)), int(rng.integers(1, 40))
        V = K + int(rng.integers(0, 60))
        cand, unary, g, anchor, A, Bc = _inputs(rng, B, L, K, r, V)
        u = rng.random((B, L)).astype(np.float32) if temp > 0 else None
        ids_r, idx_r, q_r = R.select_paths(cand, unary, g, anchor, A, Bc, mode, temp, u)
        ids_t, idx_t, q_t = _torch(cand, unary, g, anchor, A, Bc, mode, [temp] * B, u)
        for b in range(B):
            Sb = R.lattice(cand[b], unary[b], g[b], int(anchor[b]), A, Bc)
            if not _margin_ok(Sb, idx_r[b], mode, temp, None if u is None else u[b]):
                continue
            checked += 1
            assert idx_t[b].tolist() == idx_r[b].tolist()
            assert ids_t[b].tolist() == ids_r[b].tolist()
            np.testing.assert_allclose(q_t[b], q_r[b], atol=1e-5)
    assert checked >= 10


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
def test_exact_ties(mode):
    rng = np.random.default_rng(3)
    n_ties = 0
    for _ in range(30):
        cand, unary, g, anchor, A, Bc = _inputs(rng, 2, 5, 4, 3, 12, integer=True)
        ids_r, idx_r, _ = R.select_paths(cand, unary, g, anchor, A, Bc, mode)
        ids_t, idx_t, q_t = _torch(cand, unary, g, anchor, A, Bc, mode, [0.0, 0.0], None)
        assert idx_t.tolist() == idx_r.tolist()
        np.testing.assert_array_equal(q_t.argmax(-1), idx_r)
        for b in range(2):
            Sb = R.lattice(cand[b], unary[b], g[b], int(anchor[b]), A, Bc)
            n_ties += int(np.any([np.sum(Sb[t, 0] == Sb[t, 0].max()) > 1 for t in range(5)]))
    assert n_ties > 5  # the inputs really contain ties


def test_mixed_temperatures_in_one_batch():
    rng = np.random.default_rng(11)
    cand, unary, g, anchor, A, Bc = _inputs(rng, 3, 6, 8, 16, 40)
    u = rng.random((3, 6)).astype(np.float32)
    temps = np.array([0.0, 1.0, 0.5], dtype=np.float32)
    for mode in ("greedy", "viterbi"):
        _, idx_r, q_r = R.select_paths(cand, unary, g, anchor, A, Bc, mode, temps, u)
        _, idx_t, q_t = _torch(cand, unary, g, anchor, A, Bc, mode, temps, u)
        assert idx_t.tolist() == idx_r.tolist()
        np.testing.assert_allclose(q_t, q_r, atol=1e-5)
