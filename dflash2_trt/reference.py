"""NumPy reference of the candidate path selector (docs/design.md). The executable spec.

Every other implementation — the PyTorch selector, the decomposed ONNX graph, the CUDA kernel and its
host twin in ``plugins/`` — is tested against these functions on fresh random inputs.

Conventions (shared by all implementations):

* ``L`` draft rows, ``K`` candidates per row, ``r`` selector rank, ``V`` vocab.
* Scores are computed in float64 here (the exact math); implementations use fp32 accumulation, so tests
  compare *decisions* only where the winning margin exceeds a small tolerance, and exercise exact ties
  with small-integer/dyadic inputs that fp32 represents and sums exactly.
* Lattice ``S[t, i, j] = U[t, j] + sum_r A[pred, r] * g[t, r] * B[cand[t, j], r]`` where ``pred`` is
  ``cand[t-1, i]`` for ``t > 0`` and the anchor for ``t == 0`` (row 0 repeats the anchor in every ``i``).
* Tie rule: the lowest index wins (``np.argmax`` semantics) — in the greedy walk, in Viterbi's
  back-pointers and in Viterbi's final argmax. Because top-k is sorted, lowest index = highest unary.
* Temperature ``T <= 0`` means argmax decoding; proposals are then one-hot at the chosen index.
* Sampling uses one uniform ``u in [0, 1)`` per row, by inverse CDF over the K candidates:
  ``j = min{j : cdf[j] > u}``, clamped to ``K - 1`` (guards a last cdf entry rounded below 1).
* Greedy sampling: ``q_t = softmax(S[t, prev, :] / T)``; Viterbi sampling draws the chain exactly from
  ``P(path) ∝ exp(sum_t S[t, j_{t-1}, j_t] / T)`` with backward log-messages
  ``b[L-1] = 0``, ``b[t, i] = logsumexp_j(S[t+1, i, j] / T + b[t+1, j])`` and then
  ``q_t(j | prev) ∝ exp(S[t, prev, j] / T + b[t, j])`` — the proposal recorded for row t.
"""

from __future__ import annotations

import numpy as np

from dflash2_trt.vocabulary import SELECTOR_MODES



def lattice(
    cand_ids: np.ndarray,  # [L, K] int
    unary: np.ndarray,  # [L, K] float
    g: np.ndarray,  # [L, r] float (hidden_projection(h_t))
    anchor: int,
    pred_codebook: np.ndarray,  # [V, r]  (A)
    succ_codebook: np.ndarray,  # [V, r]  (B)
) -> np.ndarray:
    """Pair scores of one sequence: [L, K_prev, K_cur] float64 (row 0 repeats the anchor row)."""
    L, K = cand_ids.shape
    A = pred_codebook.astype(np.float64)
    Bc = succ_codebook.astype(np.float64)
    g64 = g.astype(np.float64)
    prev = np.empty((L, K), dtype=np.int64)  # [L, K] predecessor token per (t, i)
    prev[0, :] = anchor
    prev[1:] = cand_ids[:-1]
    a = A[prev]  # [L, K, r]
    b = Bc[cand_ids] * g64[:, None, :]  # [L, K, r]
    pair = np.einsum("tir,tjr->tij", a, b)  # [L, K, K]
    return unary.astype(np.float64)[:, None, :] + pair


def _sample_index(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: min{j : cdf[j] > u}, clamped to len-1."""
    cdf = np.cumsum(probs)
    j = int(np.searchsorted(cdf, u, side="right"))
    return min(j, probs.shape[0] - 1)


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    e = np.exp(x - m)
    return e / e.sum()


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def walk_one(
    S: np.ndarray,  # [L, K, K] float64 lattice
    mode: str,
    temperature: float,
    uniforms: np.ndarray | None,  # [L] float, needed when temperature > 0
) -> tuple[np.ndarray, np.ndarray]:
    """Walk one lattice. Returns (chosen indices [L] int64, proposals [L, K] float64)."""
    if mode not in SELECTOR_MODES:
        raise ValueError(f"mode must be one of {SELECTOR_MODES}, got {mode!r}")
    L, K, _ = S.shape
    idx = np.zeros(L, dtype=np.int64)
    q = np.zeros((L, K), dtype=np.float64)
    sampling = temperature > 0
    if sampling and uniforms is None:
        raise ValueError("temperature > 0 needs uniforms [L]")

    if mode == "greedy":
        prev = 0  # row 0: every i is the anchor
        for t in range(L):
            row = S[t, prev]  # [K]
            if sampling:
                q[t] = _softmax(row / temperature)
                idx[t] = _sample_index(q[t], float(uniforms[t]))
            else:
                idx[t] = int(np.argmax(row))
                q[t, idx[t]] = 1.0
            prev = idx[t]
        return idx, q

    # viterbi
    if not sampling:
        delta = S[0, 0].copy()  # [K]
        back = np.zeros((L, K), dtype=np.int64)
        for t in range(1, L):
            cand = delta[:, None] + S[t]  # [K_prev, K_cur]
            back[t] = np.argmax(cand, axis=0)  # lowest i on ties
            delta = cand[back[t], np.arange(K)]
        idx[L - 1] = int(np.argmax(delta))
        for t in range(L - 1, 0, -1):
            idx[t - 1] = back[t, idx[t]]
        q[np.arange(L), idx] = 1.0
        return idx, q

    # viterbi sampling: exact chain sampling with backward log-messages
    X = S / temperature  # [L, K, K]
    b = np.zeros((L, K), dtype=np.float64)
    for t in range(L - 2, -1, -1):
        b[t] = _logsumexp(X[t + 1] + b[t + 1][None, :], axis=1)
    prev = 0
    for t in range(L):
        q[t] = _softmax(X[t, prev] + b[t])
        idx[t] = _sample_index(q[t], float(uniforms[t]))
        prev = idx[t]
    return idx, q


def select_paths(
    cand_ids: np.ndarray,  # [B, L, K] int
    unary: np.ndarray,  # [B, L, K] float
    g: np.ndarray,  # [B, L, r] float
    anchor: np.ndarray,  # [B] int
    pred_codebook: np.ndarray,  # [V, r]
    succ_codebook: np.ndarray,  # [V, r]
    mode: str = "greedy",
    temperature: np.ndarray | float = 0.0,  # scalar or [B]
    uniforms: np.ndarray | None = None,  # [B, L] in [0, 1)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batched path selection.

    Returns ``(path_ids [B, L] int32, path_idx [B, L] int64, proposals [B, L, K] float32)`` where
    ``path_ids[b, t] = cand_ids[b, t, path_idx[b, t]]``.
    """
    cand_ids = np.asarray(cand_ids)
    Bsz, L, K = cand_ids.shape
    temps = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (Bsz,))
    path_idx = np.zeros((Bsz, L), dtype=np.int64)
    props = np.zeros((Bsz, L, K), dtype=np.float32)
    for bi in range(Bsz):
        S = lattice(cand_ids[bi], unary[bi], g[bi], int(anchor[bi]), pred_codebook, succ_codebook)
        u = None if uniforms is None else np.asarray(uniforms)[bi]
        idx, q = walk_one(S, mode, float(temps[bi]), u)
        path_idx[bi] = idx
        props[bi] = q
    path_ids = np.take_along_axis(cand_ids, path_idx[..., None], axis=-1)[..., 0].astype(np.int32)
    return path_ids, path_idx, props
