"""Candidate path selector (SPEC §3) in PyTorch, batched. Mirrors :mod:`dflash2_trt.reference` exactly
(same lattice, tie rule, inverse-CDF sampling); computed in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2_trt.vocabulary import SELECTOR_MODES as MODES


class CandidateSelector(nn.Module):
    """``hidden_projection`` Linear(H -> r) and the two codebooks A (predecessor), B (successor) [V, r]."""

    def __init__(self, hidden: int, rank: int, vocab: int) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)  # H -> r
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # [V, r]
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.successor_codebook, std=0.02)


def lattice(
    cand: torch.Tensor,  # [B, L, K] int64
    unary: torch.Tensor,  # [B, L, K] float
    g: torch.Tensor,  # [B, L, r]
    anchor: torch.Tensor,  # [B] int64
    pred_codebook: torch.Tensor,  # [V, r]
    succ_codebook: torch.Tensor,  # [V, r]
) -> torch.Tensor:
    """S [B, L, K_prev, K_cur] fp32; row 0 repeats the anchor as predecessor for every i."""
    B, L, K = cand.shape
    prev = torch.cat([anchor.view(B, 1, 1).expand(B, 1, K), cand[:, :-1]], dim=1)  # [B, L, K]
    a = pred_codebook.float()[prev]  # [B, L, K, r]
    b = succ_codebook.float()[cand] * g.float().unsqueeze(2)  # [B, L, K, r]
    return unary.float().unsqueeze(2) + a @ b.transpose(-1, -2)  # [B, L, K, K]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, K], u [B] -> min{j : cdf[j] > u} clamped to K-1, [B] int64."""
    cdf = probs.cumsum(-1)
    return (cdf <= u.unsqueeze(-1)).sum(-1).clamp(max=probs.shape[-1] - 1)


def walk(
    S: torch.Tensor,  # [B, L, K, K]
    mode: str,
    temperature: torch.Tensor,  # [B] float (<= 0: argmax)
    uniforms: torch.Tensor | None,  # [B, L]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (chosen index [B, L] int64, proposals [B, L, K] fp32)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    B, L, K, _ = S.shape
    dev = S.device
    temperature = temperature.to(dev, torch.float32).expand(B)
    sampling = temperature > 0  # [B]
    if bool(sampling.any()) and uniforms is None:
        raise ValueError("temperature > 0 needs uniforms [B, L]")
    safe_t = torch.where(sampling, temperature, torch.ones_like(temperature))  # [B]
    ar = torch.arange(B, device=dev)
    idx = torch.zeros(B, L, dtype=torch.long, device=dev)
    q = torch.zeros(B, L, K, dtype=torch.float32, device=dev)

    if mode == "greedy":
        prev = torch.zeros(B, dtype=torch.long, device=dev)
        for t in range(L):
            row = S[ar, t, prev]  # [B, K]
            am = row.argmax(-1)  # [B] first max on ties
            qs = torch.softmax(row / safe_t[:, None], dim=-1)
            sm = _inverse_cdf(qs, uniforms[:, t]) if uniforms is not None else am
            idx[:, t] = torch.where(sampling, sm, am)
            q[:, t] = torch.where(sampling[:, None], qs, nn.functional.one_hot(am, K).float())
            prev = idx[:, t]
        return idx, q

    # viterbi, argmax rows (computed for all; sampled rows overwritten below)
    delta = S[:, 0, 0].clone()  # [B, K]
    back = torch.zeros(B, L, K, dtype=torch.long, device=dev)
    for t in range(1, L):
        cand = delta.unsqueeze(-1) + S[:, t]  # [B, K_prev, K_cur]
        delta, back[:, t] = cand.max(dim=1)  # first max on ties
    vidx = torch.zeros(B, L, dtype=torch.long, device=dev)
    vidx[:, L - 1] = delta.argmax(-1)
    for t in range(L - 1, 0, -1):
        vidx[:, t - 1] = back[ar, t, vidx[:, t]]
    idx = vidx
    q = nn.functional.one_hot(vidx, K).float()
    if not bool(sampling.any()):
        return idx, q

    X = S / safe_t.view(B, 1, 1, 1)  # [B, L, K, K]
    bmsg = torch.zeros(B, L, K, dtype=torch.float32, device=dev)
    for t in range(L - 2, -1, -1):
        bmsg[:, t] = torch.logsumexp(X[:, t + 1] + bmsg[:, t + 1].unsqueeze(1), dim=-1)
    prev = torch.zeros(B, dtype=torch.long, device=dev)
    sidx = torch.zeros_like(idx)
    sq = torch.zeros_like(q)
    assert uniforms is not None
    for t in range(L):
        qs = torch.softmax(X[ar, t, prev] + bmsg[:, t], dim=-1)  # [B, K]
        sidx[:, t] = _inverse_cdf(qs, uniforms[:, t])
        sq[:, t] = qs
        prev = sidx[:, t]
    idx = torch.where(sampling[:, None], sidx, idx)
    q = torch.where(sampling[:, None, None], sq, q)
    return idx, q


def select_paths(
    cand: torch.Tensor,  # [B, L, K]
    unary: torch.Tensor,  # [B, L, K]
    g: torch.Tensor,  # [B, L, r]
    anchor: torch.Tensor,  # [B]
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    mode: str = "greedy",
    temperature: torch.Tensor | float = 0.0,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.select_paths``: (path_ids [B, L], path_idx [B, L], proposals [B, L, K])."""
    S = lattice(cand.long(), unary, g, anchor.long(), pred_codebook, succ_codebook)
    t = torch.as_tensor(temperature, dtype=torch.float32, device=S.device).reshape(-1)
    idx, q = walk(S, mode, t, uniforms)
    ids = cand.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return ids, idx, q
