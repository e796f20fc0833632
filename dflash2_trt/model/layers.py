"""Building blocks of the drafter (docs/design.md): RMSNorm, RoPE, KV-injection attention, SwiGLU MLP and the
dynamic two-tap grouped convolution.

Written once for eager use, training and ONNX tracing alike (the exported graphs trace these modules): no
data-dependent control flow, head dims as Python ints, no Expand of traced shapes, no K/V concatenation.

Shape letters: nb blocks, bs block rows, n context rows, H hidden, nh / kvh query / key-value heads,
d head dim, G conv groups, kc taps (2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dflash2_trt.config import DFlash2Config

PRE, POST = 0, 1  # conv sides: index 0 of base_kernel / dyn is applied before the sublayer

# config.HIDDEN_ACTS -> function (transformers' ACT2FN semantics; gelu_new is the tanh approximation)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


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


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., d]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope_inv_freq(cfg: "DFlash2Config", device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq [d/2] fp32 and the cos/sin scale of the config's RoPE (default, linear, yarn, llama3).

    Same formulas as transformers' ROPE_INIT_FUNCTIONS (which z-lab's drafter uses through
    Qwen3RotaryEmbedding); the config has already refused every other rope_type.
    """
    d, base = cfg.head_dim, float(cfg.rope_theta)
    assert d is not None
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    s = cfg.rope_scaling or {}
    rtype = s.get("rope_type", "default")
    if rtype == "default":
        return inv, 1.0
    factor = float(s["factor"])
    if rtype == "linear":
        return inv / factor, 1.0
    orig = float(s["original_max_position_embeddings"])
    if rtype == "llama3":
        low_f, high_f = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > orig / low_f, inv / factor, inv)
        smooth = (orig / wavelen - low_f) / (high_f - low_f)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < orig / high_f) * ~(wavelen > orig / low_f)
        return torch.where(medium, smoothed, out), 1.0
    assert rtype == "yarn", rtype

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = s.get("attention_factor")
    if att is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # share of the unscaled frequency per dimension pair
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(att)


def rope_tables(positions: torch.Tensor, cfg: "DFlash2Config", dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int64 -> cos, sin [..., d] for the config's RoPE (incl. yarn's cos/sin scale)."""
    inv, scale = rope_inv_freq(cfg, positions.device)
    return _cos_sin(positions, inv, scale, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """x [..., rows, d]; cos/sin broadcastable to x. ``d`` is a Python int: a traced ``x.shape[-1] // 2`` makes
    the TorchScript exporter emit the following Concat on the wrong axis."""
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def shift_rows(y: torch.Tensor, o: int) -> torch.Tensor:
    """y [nb, bs, H] -> y_{t-o} along block rows, zeros before row 0: taps never cross the block start."""
    if o == 0:
        return y
    return torch.cat([y[:, :o] * 0, y[:, :-o]], dim=1)


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
        # [G, H] 0/1: channel c belongs to group c // group (expands per-group taps with one exact MatMul)
        gm = (torch.arange(self.groups).unsqueeze(1) == (torch.arange(hidden) // group_size).unsqueeze(0)).float()
        self.register_buffer("group_matrix", gm, persistent=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0, :] = 1.0
        self.kernel_projection.weight.zero_()

    def dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """x [nb, bs, H] -> dyn [nb, bs, 2, kc, G]."""
        return self.kernel_projection(x).view(x.shape[0], x.shape[1], 2, self.kc, self.groups)

    def mix(self, y: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        """y [nb, bs, H], dyn [nb, bs, 2, kc, G] -> [nb, bs, H]. Taps never cross the block start."""
        gm = self.group_matrix.to(y.dtype)
        out = (self.base_kernel[side, 0] + torch.matmul(dyn[:, :, side, 0], gm)) * y  # [nb, bs, H]
        for o in range(1, self.kc):
            out = out + (self.base_kernel[side, o] + torch.matmul(dyn[:, :, side, o], gm)) * shift_rows(y, o)
        return out


class Attention(nn.Module):
    """KV-injection attention: queries from block rows; keys/values = [context rows | block rows]."""

    def __init__(self, hidden: int, nh: int, kvh: int, d: int, eps: float, bias: bool = False) -> None:
        super().__init__()
        self.nh, self.kvh, self.d = nh, kvh, d
        self.q_proj = nn.Linear(hidden, nh * d, bias=bias)
        self.k_proj = nn.Linear(hidden, kvh * d, bias=bias)
        self.v_proj = nn.Linear(hidden, kvh * d, bias=bias)
        self.o_proj = nn.Linear(nh * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, eps)
        self.k_norm = RMSNorm(d, eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., m, H] -> k, v [..., kvh, m, d] (k normed + RoPE). Used for context and block rows."""
        shp = x.shape[:-1]
        k = self.k_norm(self.k_proj(x).view(*shp, self.kvh, self.d)).transpose(-2, -3)  # [..., kvh, m, d]
        v = self.v_proj(x).view(*shp, self.kvh, self.d).transpose(-2, -3)  # [..., kvh, m, d]
        return apply_rope(k, cos.unsqueeze(-3), sin.unsqueeze(-3), self.d), v

    def forward(
        self,
        x: torch.Tensor,  # [nb, bs, H] block rows (after the pre-conv)
        cos: torch.Tensor,  # [nb, bs, d]
        sin: torch.Tensor,  # [nb, bs, d]
        ctx_k: torch.Tensor,  # [nb or 1, kvh, n, d] context keys (normed + RoPE)
        ctx_v: torch.Tensor,  # [nb or 1, kvh, n, d]
        ctx_bias: torch.Tensor,  # [nb, 1, rep*bs, n] additive (0 = may attend, -inf = masked)
        blk_bias: torch.Tensor,  # [nb, 1, rep*bs, bs]
    ) -> torch.Tensor:
        """Softmax over [context keys | block keys] as two score blocks joined before one softmax (K/V are
        never concatenated); grouped-query heads h = kv * rep + r are folded into rows instead of repeating
        K/V. Biases come from :func:`attention_biases`."""
        nb, bs = x.shape[0], x.shape[1]
        q = self.q_norm(self.q_proj(x).view(nb, bs, self.nh, self.d)).transpose(1, 2)  # [nb, nh, bs, d]
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1), self.d)
        kb, vb = self.kv(x, cos, sin)  # [nb, kvh, bs, d]
        qg = q.reshape(nb, self.kvh, (self.nh // self.kvh) * bs, self.d)  # [nb, kvh, rep*bs, d]
        scale = self.d ** -0.5
        s1 = torch.matmul(qg, ctx_k.transpose(2, 3)) * scale + ctx_bias  # [nb, kvh, rep*bs, n]
        s2 = torch.matmul(qg, kb.transpose(2, 3)) * scale + blk_bias  # [nb, kvh, rep*bs, bs]
        n = ctx_k.shape[2]
        p = torch.softmax(torch.cat([s1, s2], dim=3).float(), dim=3).to(q.dtype)
        o = torch.matmul(p[:, :, :, :n], ctx_v) + torch.matmul(p[:, :, :, n:], vb)  # [nb, kvh, rep*bs, d]
        o = o.reshape(nb, self.nh, bs, self.d)
        return self.o_proj(o.transpose(1, 2).reshape(nb, bs, self.nh * self.d))


def attention_biases(ok_ctx: torch.Tensor, ok_blk: torch.Tensor, rep: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks ok_ctx [nb, bs, n], ok_blk [nb, bs, bs] (True = may attend) -> the additive biases of
    :meth:`Attention.forward`, [nb, 1, rep*bs, n] and [nb, 1, rep*bs, bs] (rows repeated per folded head)."""
    neg = torch.tensor(float("-inf"), dtype=dtype)
    zero = torch.tensor(0.0, dtype=dtype)

    def bias(ok: torch.Tensor) -> torch.Tensor:
        return torch.where(ok, zero, neg).repeat(1, rep, 1).unsqueeze(1)

    return bias(ok_ctx), bias(ok_blk)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); ``act`` one of config.HIDDEN_ACTS (SwiGLU for silu)."""

    def __init__(self, hidden: int, inter: int, act: str = "silu") -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
