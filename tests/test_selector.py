"""PyTorch selector == NumPy twin (fresh random inputs, ties included)."""

from __future__ import annotations

import zlib

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
    rng = np.random.default_rng(zlib.crc32(f"{mode}/{temp}".encode()))  # same seed in every process
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


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round fp32 -> bf16 (nearest, ties to even) and back, by bit manipulation (twin of torch's cast)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def test_bf16_precision_lattice_matches_rounding_twin():
    """precision="bf16": pair term = bf16(sum_r bf16(bf16(A[prev]) * bf16(g)) * bf16(B[cand])), unary fp32."""
    rng = np.random.default_rng(21)
    cand, unary, g, anchor, A, Bc = _inputs(rng, 3, 7, 16, 32, 200)
    t = [torch.from_numpy(x) for x in (cand, unary, g, anchor, A, Bc)]
    S32 = S.lattice(*t).numpy()
    S16 = S.lattice(*t, precision="bf16").numpy()
    B_, L, K = cand.shape
    prev = np.concatenate([np.repeat(anchor[:, None, None], K, axis=2), cand[:, :-1]], axis=1)  # [B, L, K]
    ag = _bf16(_bf16(A)[prev] * _bf16(g)[:, :, None, :])  # [B, L, K, r]
    pair = _bf16(np.einsum("blpr,blcr->blpc", ag.astype(np.float64), _bf16(Bc)[cand].astype(np.float64)))
    want = unary[:, :, None, :] + pair
    ulp = np.abs(pair) * 2.0 ** -7  # one bf16 step: fp32 vs fp64 accumulation may round the other way
    assert np.all(np.abs(S16 - want) <= ulp + 1e-6)
    assert np.mean(S16 == want) > 0.95
    np.testing.assert_allclose(S32, unary[:, :, None, :] + np.einsum(
        "blpr,blcr->blpc", A[prev] * g[:, :, None, :], Bc[cand]), rtol=1e-5, atol=1e-5)
    assert np.any(S16 != S32)  # the bf16 path really rounds
    with pytest.raises(ValueError, match="precision"):
        S.lattice(*t, precision="fp16")


def test_drafter_selector_precision_switch():
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter

    torch.manual_seed(0)
    d = DFlash2Drafter(DFlash2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     target_layer_ids=[1], selector_rank=8, selector_top_k=8, block_size=5))
    d.bind_target(torch.randn(64, 32), torch.randn(64, 32))
    calls = []
    real = S.lattice

    def spy(*a, **k):
        calls.append(a[6] if len(a) > 6 else k.get("precision"))
        return real(*a, **k)

    h = torch.randn(2, 5, 32)
    S.lattice = spy
    try:
        d.draft_from_hidden(h, torch.tensor([1, 2]))
        d.selector_precision = "bf16"
        d.draft_from_hidden(h, torch.tensor([1, 2]))
    finally:
        S.lattice = real
    assert calls == ["fp32", "bf16"]

