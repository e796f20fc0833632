"""Exhaustive oracles for the path selector (tests only): the best chain and the exact chain law of one
lattice ``S [L, K, K]`` by enumerating all K**L chains."""

from __future__ import annotations

import itertools

import numpy as np


def brute_force_best_path(S: np.ndarray) -> tuple[np.ndarray, float]:
    """Exhaustive max over all K**L chains of one lattice (tests only). Ties: lexicographically lowest."""
    L, K, _ = S.shape
    best, best_idx = -np.inf, None
    for combo in itertools.product(range(K), repeat=L):
        s = S[0, 0, combo[0]] + sum(S[t, combo[t - 1], combo[t]] for t in range(1, L))
        if s > best:
            best, best_idx = s, combo
    return np.array(best_idx, dtype=np.int64), float(best)


def chain_distribution(S: np.ndarray, temperature: float) -> dict[tuple[int, ...], float]:
    """Exact probability of every chain under exp(score / T) (tests only)."""
    L, K, _ = S.shape
    logits = {}
    for combo in itertools.product(range(K), repeat=L):
        s = S[0, 0, combo[0]] + sum(S[t, combo[t - 1], combo[t]] for t in range(1, L))
        logits[combo] = s / temperature
    m = max(logits.values())
    z = sum(np.exp(v - m) for v in logits.values())
    return {c: float(np.exp(v - m) / z) for c, v in logits.items()}
