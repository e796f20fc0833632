"""Candidate path selector (docs/design.md) in PyTorch, batched — the one PyTorch selector: training, the drafter
and the exported drafter head graph (:class:`dflash2_trt.export.onnx_graphs.DecomposedSelector`) all run
:func:`lattice` + :func:`walk`. Mirrors :mod:`dflash2_trt.reference` exactly (same lattice, tie rule,
inverse-CDF sampling); computed in fp32.

``precision="bf16"`` reproduces z-lab's vLLM selector instead: there the projection ``g``, the codebook rows,
their product and the rank contraction are bf16 tensors (the model dtype) while the unary scores are fp32,
so the pair term of every lattice entry is rounded to bf16 before the fp32 add (z-lab's own comment: such
rounding moves a row's argmax 0.81% of the time on real checkpoints). fp32 stays the default and the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2_trt.vocabulary import SELECTOR_MODES as MODES
from dflash2_trt.vocabulary import SELECTOR_PRECISIONS


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
    precision: str = "fp32",
) -> torch.Tensor:
    """S [B, L, K_prev, K_cur] fp32; row 0 repeats the anchor as predecessor for every i."""
    B, L, K = cand.shape
    prev = torch.cat([anchor.view(B, 1, 1).expand(B, 1, K), cand[:, :-1]], dim=1)  # [B, L, K]
    if precision == "bf16":
        # z-lab vLLM order: (A[prev] * g) in bf16, contracted with B[cand], result rounded to bf16
        bf = torch.bfloat16
        ag = (pred_codebook[prev].to(bf) * g.to(bf).unsqueeze(2)).float()  # [B, L, K, r] bf16 values
        pair = (ag @ succ_codebook[cand].to(bf).float().transpose(-1, -2)).to(bf).float()  # [B, L, K, K]
        return unary.float().unsqueeze(2) + pair
    if precision not in SELECTOR_PRECISIONS:
        raise ValueError(f"precision must be one of {SELECTOR_PRECISIONS}, got {precision!r}")
    a = pred_codebook[prev].float()  # [B, L, K, r] (gather, then cast: never the whole [V, r] table)
    b = succ_codebook[cand].float() * g.float().unsqueeze(2)  # [B, L, K, r]
    return unary.float().unsqueeze(2) + a @ b.transpose(-1, -2)  # [B, L, K, K]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, K], u [B] -> min{j : cdf[j] > u} clamped to K-1, [B] int64."""
    k = probs.shape[-1]
    return (probs.cumsum(-1) <= u.unsqueeze(-1)).long().sum(-1).clamp(max=k - 1)


def _one_hot(idx: torch.Tensor, k: int) -> torch.Tensor:
    return (torch.arange(k, device=idx.device) == idx.unsqueeze(-1)).float()


def _row(S_t: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """S_t [B, K, K], prev [B] -> S_t[b, prev[b], :] [B, K]."""
    K = S_t.shape[-1]
    return torch.gather(S_t, 1, prev.view(-1, 1, 1).expand(-1, 1, K))[:, 0]  # (squeeze would trace to If)


def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    m = x.max(dim=dim).values
    return m + torch.log(torch.exp(x - m.unsqueeze(dim)).sum(dim=dim))


def walk(
    S: torch.Tensor,  # [B, L, K, K]
    mode: str,
    temperature: torch.Tensor,  # [B] float (<= 0: argmax)
    uniforms: torch.Tensor | None,  # [B, L] in [0, 1); needed where temperature > 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the lattice: (chosen index [B, L] int64, proposals [B, L, K] fp32).

    Written for tracing as well as eager use (the exported drafter head runs exactly this): unrolled over
    the L static rows, no data-dependent control flow; per sequence the argmax path and the sampled path
    are both computed and one is chosen with ``where``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    B, L, K, _ = S.shape
    temperature = temperature.to(S.device, torch.float32).expand(B)
    sampling = temperature > 0  # [B]
    if uniforms is None:
        if not torch.jit.is_tracing() and bool(sampling.any()):
            raise ValueError("temperature > 0 needs uniforms [B, L]")
        uniforms = torch.zeros(B, L, device=S.device)
    t = torch.where(sampling, temperature, torch.ones_like(temperature)).view(-1, 1)  # [B, 1]
    if mode == "greedy":
        return _greedy(S, sampling, t, uniforms)
    return _viterbi(S, sampling, t, uniforms)


def _greedy(S, sampling, t, uniforms):  # noqa: ANN001, ANN202
    B, L, K, _ = S.shape
    prev = torch.zeros_like(S[:, 0, 0, 0], dtype=torch.long)  # [B] row 0: every i is the anchor
    idx, qs = [], []
    for r in range(L):
        row = _row(S[:, r], prev)  # [B, K]
        am = row.argmax(-1)  # first max on ties
        p = torch.softmax(row / t, dim=-1)
        j = torch.where(sampling, _inverse_cdf(p, uniforms[:, r]), am)
        qs.append(torch.where(sampling.view(-1, 1), p, _one_hot(am, K)))
        idx.append(j)
        prev = j
    return torch.stack(idx, 1), torch.stack(qs, 1)


def _viterbi(S, sampling, t, uniforms):  # noqa: ANN001, ANN202
    B, L, K, _ = S.shape
    # max-sum with back-pointers (argmax over predecessors: lowest index on ties)
    delta = S[:, 0, 0]  # [B, K]
    backs = []
    for r in range(1, L):
        c = delta.unsqueeze(-1) + S[:, r]  # [B, K_prev, K_cur]
        backs.append(c.argmax(1))  # [B, K]
        delta = c.max(1).values
    j = delta.argmax(-1)  # [B]
    best = [j]
    for r in range(L - 1, 0, -1):
        j = torch.gather(backs[r - 1], 1, j.view(-1, 1))[:, 0]
        best.append(j)
    best_idx = torch.stack(best[::-1], 1)  # [B, L]
    # exact chain sampling: backward log-messages, then forward draws
    X = S / t.view(-1, 1, 1, 1)
    msgs = [torch.zeros_like(delta)]  # b[L-1] = 0
    for r in range(L - 2, -1, -1):
        msgs.append(_logsumexp(X[:, r + 1] + msgs[-1].unsqueeze(1), dim=-1))
    msgs = msgs[::-1]  # msgs[r]: [B, K]
    prev = torch.zeros_like(best_idx[:, 0])
    sidx, sq = [], []
    for r in range(L):
        p = torch.softmax(_row(X[:, r], prev) + msgs[r], dim=-1)
        j = _inverse_cdf(p, uniforms[:, r])
        sidx.append(j)
        sq.append(p)
        prev = j
    idx = torch.where(sampling.view(-1, 1), torch.stack(sidx, 1), best_idx)
    q = torch.where(sampling.view(-1, 1, 1), torch.stack(sq, 1), _one_hot(best_idx, K))
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
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.select_paths``: (path_ids [B, L], path_idx [B, L], proposals [B, L, K])."""
    S = lattice(cand.long(), unary, g, anchor.long(), pred_codebook, succ_codebook, precision)
    t = torch.as_tensor(temperature, dtype=torch.float32, device=S.device).reshape(-1)
    idx, q = walk(S, mode, t, uniforms)
    ids = cand.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return ids, idx, q
