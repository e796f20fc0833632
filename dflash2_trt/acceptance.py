"""The acceptance rules of the decoding loop's accept step (docs/design.md): greedy verification, rejection
sampling (lossless in distribution), the tempered softmax both use, and the metrics of accepted drafts. NumPy,
float64: what every runtime decides with (:mod:`dflash2_trt.runtime.accept` looks them up at call time) and what
the C core's twins (``runtime/src/core/decoder.cpp``: ``softmaxT``, ``acceptGreedy``, ``acceptRejection``,
``acceptanceStats``) are tested against with shared vectors."""

from __future__ import annotations

import numpy as np


def softmax_t(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / T) along the last axis, float64."""
    x = logits.astype(np.float64) / temperature
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def accept_greedy(drafts: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Greedy verification of one block.

    drafts: [n] draft tokens d_1..d_n; target_logits: [n + 1, V] (row i predicts the token after
    position i of ``[anchor, d_1..d_n]``). Returns ``(n_accepted, bonus_token)``.
    """
    target = np.argmax(target_logits, axis=-1)  # [n + 1]
    n = 0
    while n < drafts.shape[0] and int(drafts[n]) == int(target[n]):
        n += 1
    return n, int(target[n])


def accept_rejection(
    drafts: np.ndarray,  # [n]
    draft_probs: np.ndarray,  # [n, V] proposal q_t scattered into the vocab
    target_probs: np.ndarray,  # [n + 1, V] p_t
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Rejection sampling (Leviathan et al.): lossless in distribution. Returns (n_accepted, bonus)."""
    n_drafts = drafts.shape[0]
    for t in range(n_drafts):
        d = int(drafts[t])
        p, q = target_probs[t, d], draft_probs[t, d]
        if q > 0 and rng.random() < min(1.0, p / q):
            continue
        resid = np.maximum(target_probs[t] - draft_probs[t], 0.0)
        s = resid.sum()
        resid = target_probs[t] if s <= 0 else resid / s
        return t, int(rng.choice(resid.shape[0], p=resid))
    return n_drafts, int(rng.choice(target_probs.shape[1], p=target_probs[n_drafts]))


def acceptance_stats(accepted: list[int], block_rows: list[int]) -> dict:
    """docs/design.md metrics from per-cycle accepted-draft counts.

    accepted[c]: drafts accepted in cycle c; block_rows[c]: drafts proposed in cycle c (L, or fewer in
    a final partial block). Returns tau, per-position cumulative r_i and conditional c_i (i = 1..L_max).
    Positions beyond a cycle's proposed rows do not count for that cycle.
    """
    if not accepted:
        return {"tau": 0.0, "cycles": 0, "per_position_cumulative": [], "per_position_conditional": []}
    Lmax = max(block_rows)
    acc = np.asarray(accepted)
    rows = np.asarray(block_rows)
    cum, cond = [], []
    for i in range(1, Lmax + 1):
        eligible = rows >= i
        r_i = float(np.mean(acc[eligible] >= i)) if eligible.any() else 0.0
        cum.append(r_i)
        prev = 1.0 if i == 1 else cum[-2]
        cond.append(r_i / prev if prev > 0 else 0.0)
    return {
        "tau": float(np.mean(acc + 1)),
        "cycles": int(acc.shape[0]),
        "per_position_cumulative": cum,
        "per_position_conditional": cond,
    }
