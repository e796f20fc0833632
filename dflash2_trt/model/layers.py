"""Building blocks of the drafter (SPEC §2): RMSNorm, RoPE, KV-injection attention, SwiGLU MLP and the
dynamic two-tap grouped convolution.

Shape letters: nb blocks, bs block rows, n context rows, H hidden, nh / kvh query / key-value heads,
d head dim, G conv groups, kc taps (2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PRE, POST = 0, 1  # conv sides: index 0 of base_kernel / dyn is applied before the sublayer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int64 -> cos, sin [..., d] (Llama/Qwen 'rotate_half' layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
                                / head_dim))  # [d/2]
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., rows, d]; cos/sin broadcastable to x."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class DynamicConv(nn.Module):
    """Dynamic grouped two-tap convolution along block rows (``attention_conv`` / ``mlp_conv``).

    ``dyn = kernel_projection(x).view(2, kc, G)`` per row; side s applied to a sequence y gives
    ``out_t[c] = sum_o (base[s, o, c] + dyn_t[s, o, c // group]) * y_{t-o}[c]`` with zeros for t-o < 0.
    Identity init (base[:, 0] = 1, rest 0, projection 0) makes both sides the identity, exactly.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kc = kernel_size
        self.group = group_size
        self.groups = hidden // group_size  # G
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))  # [2, kc, H]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)  # H -> 2*kc*G
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0, :] = 1.0
        self.kernel_projection.weight.zero_()

    def dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """x [nb, bs, H] -> dyn [nb, bs, 2, kc, G]."""
        nb, bs, _ = x.shape
        return self.kernel_projection(x).view(nb, bs, 2, self.kc, self.groups)

    def mix(self, y: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        """y [nb, bs, H], dyn [nb, bs, 2, kc, G] -> [nb, bs, H]. Taps never cross the block start."""
        out = None
        for o in range(self.kc):
            w = self.base_kernel[side, o] + dyn[:, :, side, o].repeat_interleave(self.group, dim=-1)  # [nb,bs,H]
            ys = y if o == 0 else F.pad(y, (0, 0, o, 0))[:, : y.shape[1]]  # y_{t-o}, zeros before row 0
            term = w * ys
            out = term if out is None else out + term
        assert out is not None
        return out


class Attention(nn.Module):
    """KV-injection attention: queries from block rows; keys/values = [context rows | block rows]."""

    def __init__(self, hidden: int, nh: int, kvh: int, d: int, eps: float) -> None:
        super().__init__()
        self.nh, self.kvh, self.d = nh, kvh, d
        self.q_proj = nn.Linear(hidden, nh * d, bias=False)
        self.k_proj = nn.Linear(hidden, kvh * d, bias=False)
        self.v_proj = nn.Linear(hidden, kvh * d, bias=False)
        self.o_proj = nn.Linear(nh * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, eps)
        self.k_norm = RMSNorm(d, eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., m, H] -> k, v [..., kvh, m, d] (k normed + RoPE). Used for context and block rows."""
        shp = x.shape[:-1]
        k = self.k_norm(self.k_proj(x).view(*shp, self.kvh, self.d)).transpose(-2, -3)  # [..., kvh, m, d]
        v = self.v_proj(x).view(*shp, self.kvh, self.d).transpose(-2, -3)  # [..., kvh, m, d]
        return apply_rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3)), v

    def forward(
        self,
        x: torch.Tensor,  # [nb, bs, H] block rows (after the pre-conv)
        cos: torch.Tensor,  # [nb, bs, d]
        sin: torch.Tensor,  # [nb, bs, d]
        ctx_k: torch.Tensor,  # [nb, kvh, n, d] (may be an expanded view)
        ctx_v: torch.Tensor,  # [nb, kvh, n, d]
        mask: torch.Tensor,  # [nb, bs, n + bs] bool, True = may attend
    ) -> torch.Tensor:
        nb, bs, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(nb, bs, self.nh, self.d)).transpose(1, 2)  # [nb, nh, bs, d]
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kb, vb = self.kv(x, cos, sin)  # [nb, kvh, bs, d]
        k = torch.cat([ctx_k, kb], dim=2)  # [nb, kvh, n + bs, d]
        v = torch.cat([ctx_v, vb], dim=2)
        rep = self.nh // self.kvh
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)  # [nb, nh, n + bs, d]
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))  # [nb, nh, bs, d]
        return self.o_proj(o.transpose(1, 2).reshape(nb, bs, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
