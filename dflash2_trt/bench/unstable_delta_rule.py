"""The delta rule's row updates solved as a Neumann series (evaluation, not runtime): the form the hybrid target
graph must NOT use, kept as the baseline of ``benchmarks/hybrid_delta_rule_cost.py`` and as the planted bug of
``tests/test_hybrid_delta_rule.py``.

It computes (I + A)^-1 = prod_i (I + N^(2^i)), N = -A, by repeated squaring — exact in exact arithmetic for the
nilpotent A of :func:`dflash2_trt.targets.hybrid._delta_rule`, but an alternating series whose terms grow like
C(S, j): aligned keys (repeated tokens), no decay and beta near 1 make it cancel catastrophically in fp32 (relative
error ~1e10 at 64 rows against a float64 recurrence). Same signature and shapes as ``_delta_rule``.
"""

from __future__ import annotations


def doubling_delta_rule(q, k, v, g, beta, s0, rows):  # noqa: ANN001, ANN201
    import torch

    S = q.shape[2]
    G = torch.cumsum(g, dim=2)  # [B, H, S]
    idx = torch.arange(S, device=q.device)
    lower, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    D = torch.exp(torch.where(lower, G[..., :, None] - G[..., None, :], torch.tensor(float("-inf"), dtype=q.dtype)))
    gamma = torch.exp(G)[..., None]  # [B, H, S, 1]
    n = torch.where(strict, -(beta[..., None] * D * torch.matmul(k, k.transpose(2, 3))), torch.zeros((), dtype=q.dtype))
    x = beta[..., None] * (v - gamma * torch.matmul(k, s0))  # [B, H, S, dv]
    for i in range(6):  # 2^6 = 64 rows, a call's most
        x = x + torch.matmul(n, x)
        if i < 5:
            n = torch.matmul(n, n)
    out = gamma * torch.matmul(q, s0) + torch.matmul(D * torch.matmul(q, k.transpose(2, 3)), x)
    d_rows = torch.index_select(D, 2, rows)  # [B, H, R, S]
    g_rows = torch.index_select(gamma, 2, rows)[..., None]  # [B, H, R, 1, 1]
    states = g_rows * s0[:, :, None] + torch.matmul(k.transpose(2, 3)[:, :, None], d_rows[..., None] * x[:, :, None])
    return out, states.transpose(1, 2)
