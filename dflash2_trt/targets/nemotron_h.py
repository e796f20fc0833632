"""The Nemotron-H family: NVIDIA's hybrid Mamba-2 models (transformers ``nemotron_h``: Nemotron-H, Nemotron-3 Nano,
Nemotron-3.5). Each decoder layer is one mixer behind an RMS norm and a residual: a Mamba-2 layer, a full-attention
layer without position embeddings, a routed mixture of experts (non-gated ReLU² experts, sigmoid group routing,
a shared expert) or a plain MLP.

A Mamba-2 layer's state is not a cache of positions: a causal depthwise convolution keeps its last
``conv_kernel - 1`` inputs [conv_dim, K - 1], and the selective state-space scan keeps one state per head
[head_dim, ssm_state_size] (fp32), both overwritten by every row (``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``).
After a verify of k rows accepts j < k drafts, the state must be the one after exactly j + 1 rows: the same
problem as the Gated DeltaNet layers of the hybrid family, with another update rule, so the same machinery solves
it -- transformers' past recording (:mod:`~dflash2_trt.targets.recorded`): a call that may be rolled back records
the convolution's inputs of the whole call and the scan state after each of its rows (transformers runs those rows
one at a time), and :func:`rollback` picks the state of the accepted length; attention layers crop their KV; MoE and
MLP layers keep nothing. Calls of more than ``MAX_ROLLBACK_ROWS`` rows (a long prompt) are never rolled back and
run transformers' chunked scan.

Layer kinds: Mamba-2 ``linear`` (its state shapes in :func:`linear_state_shapes`, the hybrid family's names: heads,
``key_dim`` = the head dim, ``value_dim`` = the SSM state size), attention ``attention``, MoE / MLP ``mlp`` (no state).

Export: :class:`TargetGraph` carries every Mamba-2 layer's state as graph inputs and outputs with the hybrid family's
names and layout (``past_conv.{i}`` / ``past_recurrent.{i}`` in, ``present_conv.{i}`` -- the call's convolution
inputs -- and ``present_recurrent.{i}`` -- the scan state after each row of ``state_rows`` -- out), so the runtime's
linear-state handling (:mod:`dflash2_trt.runtime.linear_state`) keeps the state of any accepted prefix by slicing.
The scan of one call is computed in closed form (:func:`_ssd`: with a scalar decay per head and row there is no
triangular solve, only the decay-weighted sums), so the graph has no loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.dense import _grouped_attention, attention_biases, context_features
from dflash2_trt.targets.recorded import MAX_ROLLBACK_ROWS, before_forward, new_cache, rollback

__all__ = ["MAX_CALL_ROWS", "MAX_ROLLBACK_ROWS", "MODEL_TYPES", "TargetGraph", "before_forward", "check_exportable",
           "graph_io", "layer_kinds", "linear_state_shapes", "new_cache", "rollback"]

MODEL_TYPES = ("nemotron_h",)
MAX_CALL_ROWS = 64  # rows of one graph call: the runtime feeds a longer prompt in calls of at most this many
_KINDS = {"linear_attention": "linear", "full_attention": "attention", "moe": "mlp", "mlp": "mlp"}


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the config's ``layers_block_type``."""
    types = list(getattr(config, "layers_block_type", None) or [])
    if not types or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layers_block_type must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


def linear_state_shapes(config: Any) -> dict[str, int]:
    """The per-layer state of a Mamba-2 layer: the convolution's last ``conv_kernel - 1`` inputs [conv_dim, K - 1]
    (conv_dim = heads * head_dim + 2 * n_groups * ssm_state_size: x | B | C) and the scan state of each head
    [num_heads, key_dim = head_dim, value_dim = ssm_state_size] (fp32)."""
    heads, hd, n = int(config.mamba_num_heads), int(config.mamba_head_dim), int(config.ssm_state_size)
    return {"conv_dim": heads * hd + 2 * int(config.n_groups) * n, "conv_kernel": int(config.conv_kernel),
            "num_heads": heads, "key_dim": hd, "value_dim": n, "max_rows_per_call": MAX_CALL_ROWS}


def check_exportable(hf_model: Any) -> None:
    """The exporter's graph computes this target exactly, else DFlash2Error saying what it does not."""
    cfg = hf_model.config
    kinds = layer_kinds(cfg)
    if "attention" not in kinds:
        raise DFlash2Error("target has no full-attention layer: a Nemotron-H target needs at least one")
    for what, value, ok in (("mamba_hidden_act", getattr(cfg, "mamba_hidden_act", "silu"), ("silu",)),
                            ("mlp_hidden_act", getattr(cfg, "mlp_hidden_act", "relu2"), ("relu2",))):
        if value not in ok:
            raise DFlash2Error(f"target {what} {value!r} is not supported for nemotron_h ({', '.join(ok)} only)")
    if tuple(float(x) for x in cfg.time_step_limit) != (0.0, float("inf")):
        raise DFlash2Error(f"target time_step_limit {tuple(cfg.time_step_limit)} is not supported (no limit only)")
    if getattr(cfg, "moe_latent_size", None) is not None:
        raise DFlash2Error("target moe_latent_size is not supported (experts on the hidden size only)")


# ----------------------------------------------------------------------------------------------------
# The target graph (standard ONNX: TensorRT's, and what ONNX Runtime runs for this family)
# ----------------------------------------------------------------------------------------------------


def _ssd(x, dt, A, Bm, Cm, s0, rows):  # noqa: ANN001, ANN202
    """The Mamba-2 scan over one call of S rows in closed form (no loop over rows), fp32.

    x [B, H, S, P] (the convolution's x part per head), dt [B, H, S] (after softplus), A [H] (negative), Bm, Cm
    [B, H, S, N] (each group's B / C repeated over its heads), s0 [B, H, P, N] the state before the call; rows [R]
    int64 -> (scan outputs without the D skip [B, H, S, P], states after each of ``rows`` [B, R, H, P, N]).
    With G the cumulative log decay (G_t = sum_{s<=t} dt_s A) and L[t, s] = exp(G_t - G_s) for s <= t (else 0, never
    above 1; its exponent summed over the segment s < r <= t): S_t = exp(G_t) s0 + sum_{s<=t} L[t, s] dt_s x_s B_s^T
    and y_t = S_t C_t -- transformers' row-by-row recurrence (``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``) summed
    in another order (equal to fp32 rounding)."""
    S = x.shape[2]
    a = dt * A[None, :, None]  # [B, H, S] each row's log decay (<= 0)
    idx = torch.arange(S, device=x.device)
    lower = idx[:, None] >= idx[None, :]  # [S, S] (t, s): s <= t
    zero, neg = torch.zeros((), dtype=x.dtype), torch.tensor(float("-inf"), dtype=x.dtype)
    # G_t - G_s as the sum of a over s < r <= t (transformers' segment_sum): a difference of two cumulative sums would
    # lose the small decays of recent rows to the rounding of long sums
    seg = torch.cumsum(torch.where(idx[:, None] > idx[None, :], a[..., :, None], zero), dim=2)  # [B, H, S, S]
    L = torch.exp(torch.where(lower, seg, neg))  # [B, H, S, S]
    gamma = torch.exp(torch.cumsum(a, dim=2))[..., None]  # [B, H, S, 1]
    xdt = x * dt[..., None]  # [B, H, S, P]
    y = gamma * torch.matmul(Cm, s0.transpose(2, 3)) + torch.matmul(L * torch.matmul(Cm, Bm.transpose(2, 3)), xdt)
    l_rows = torch.index_select(L, 2, rows)  # [B, H, R, S]
    g_rows = torch.index_select(gamma, 2, rows)[..., None]  # [B, H, R, 1, 1]
    states = g_rows * s0[:, :, None] + torch.matmul(xdt.transpose(2, 3)[:, :, None] * l_rows[:, :, :, None, :],
                                                    Bm[:, :, None])  # [B, H, R, P, N]
    return y, states.transpose(1, 2)


def graph_io(hf_model: Any, batch: int, dtype: Any) -> tuple[tuple, list[str], list[str], dict]:
    """What the exporter traces :class:`TargetGraph` with (the hybrid family's
    :func:`~dflash2_trt.targets.hybrid.state_graph_io`, its ``mlp`` layers without state)."""
    from dflash2_trt.targets.hybrid import state_graph_io

    cfg = hf_model.config
    return state_graph_io(cfg, layer_kinds(cfg), linear_state_shapes(cfg), batch, dtype)


class TargetGraph(nn.Module):
    """A Nemotron-H causal LM with explicit state: capacity-buffer KV for the attention layers (the dense family's
    convention, :mod:`dflash2_trt.targets.dense`) and, for each Mamba-2 layer, its convolution and scan state,
    returned so that the runtime can keep the state after any accepted prefix of the call.

    forward(input_ids [B, S], position_ids [B, S], attention_mask [B, C + S] int64, state_rows [R] int64,
            *past — per layer in order: attention ``key, value [B, kvh, C, d]``; Mamba-2 ``conv [B, conv_dim, K - 1],
            recurrent [B, heads, head_dim, ssm_state_size] fp32``; MoE / MLP nothing)
    -> logits [B, S, V] fp32, context_features [B, S, n * H], *present — per layer: attention the K/V of the S new
       rows [B, kvh, S, d]; Mamba-2 the convolution's inputs of the S rows [B, conv_dim, S] (the state after row j is
       the last K - 1 columns of [conv | inputs[:, :, :j + 1]]) and the scan state after each row of ``state_rows``
       [B, R, heads, head_dim, ssm_state_size].
    S <= MAX_CALL_ROWS; rows of a sequence past its valid ones (a batch's padding) come last and touch no valid row.
    No position embeddings: ``position_ids`` is the families' common input, read only so that it stays one.
    """

    def __init__(self, hf_model: Any, layer_ids: list[int]) -> None:
        super().__init__()
        check_exportable(hf_model)
        cfg = hf_model.config
        base = hf_model.model
        self.kinds = layer_kinds(cfg)
        self.embed, self.layers, self.norm, self.lm_head = base.embeddings, base.layers, base.norm_f, hf_model.lm_head
        self.layer_ids = list(layer_ids)
        self.nh, self.kvh, self.d = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.head_dim)
        st = linear_state_shapes(cfg)
        self.heads, self.hd, self.n = st["num_heads"], st["key_dim"], st["value_dim"]
        self.groups = int(cfg.n_groups)
        self.inter = self.heads * self.hd
        self.top_k, self.n_group, self.topk_group = int(cfg.num_experts_per_tok), int(cfg.n_group), int(cfg.topk_group)
        self.norm_topk, self.routed_scale = bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor)

    def forward(self, input_ids, position_ids, attention_mask, state_rows, *past):  # noqa: ANN001, ANN201
        h = self.embed(input_ids)  # [B, S, H]
        h = h + 0 * position_ids[..., None].to(h.dtype)  # keeps the common input in the graph (no effect)
        C = past[self.kinds[: self.kinds.index("attention")].count("linear") * 2].shape[2]
        past_bias, new_bias = attention_biases(attention_mask, C, self.nh // self.kvh, h.dtype)
        taps, present, it = {}, [], iter(past)
        for i, layer in enumerate(self.layers):
            x = layer.norm(h)
            kind, mx = self.kinds[i], layer.mixer
            if kind == "attention":
                out, new = self._attention(mx, x, next(it), next(it), past_bias, new_bias)
            elif kind == "linear":
                out, new = self._mamba(mx, x, next(it), next(it), state_rows)
            else:
                out, new = (self._moe(mx, x) if hasattr(mx, "experts") else self._mlp(mx, x)), []
            h = h + out
            present += new
            taps[i] = h
        h = self.norm(h)
        logits = self.lm_head(h).float()
        return (logits, context_features(taps, h, self.layer_ids), *present)

    def _attention(self, a, x, pk, pv, past_bias, new_bias):  # noqa: ANN001, ANN202
        """Grouped-query attention without position embeddings."""
        B, S = x.shape[0], x.shape[1]
        q = a.q_proj(x).view(B, S, self.nh, self.d).transpose(1, 2)
        k = a.k_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2)
        v = a.v_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2)
        o = _grouped_attention(q, pk, pv, k, v, past_bias, new_bias, float(a.scaling), self.nh, self.kvh, self.d)
        return a.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * self.d)), [k, v]

    def _mamba(self, mx, x, conv, s0, state_rows):  # noqa: ANN001, ANN202
        """A Mamba-2 layer from its convolution and scan state: in_proj -> gate | x, B, C | dt; the causal depthwise
        convolution (SiLU) over [state | the call's x, B, C]; the scan (:func:`_ssd`) plus the D skip; the gated group
        RMS norm; out_proj."""
        B, S = x.shape[0], x.shape[1]
        gn = self.groups * self.n
        proj = mx.in_proj(x)  # [B, S, inter + conv_dim + heads]
        gate, xbc, dt = proj[..., : self.inter], proj[..., self.inter: 2 * self.inter + 2 * gn], \
            proj[..., 2 * self.inter + 2 * gn:]
        xbc = xbc.transpose(1, 2)  # [B, conv_dim, S]
        y = F.silu(F.conv1d(torch.cat([conv, xbc], dim=2), mx.conv1d.weight, mx.conv1d.bias, groups=xbc.shape[1]))
        y = y.transpose(1, 2).float()  # [B, S, conv_dim]
        rep = self.heads // self.groups
        xs = y[..., : self.inter].reshape(B, S, self.heads, self.hd).transpose(1, 2)  # [B, H, S, P]
        bm = y[..., self.inter: self.inter + gn].reshape(B, S, self.groups, 1, self.n)
        cm = y[..., self.inter + gn:].reshape(B, S, self.groups, 1, self.n)
        bm = bm.expand(B, S, self.groups, rep, self.n).reshape(B, S, self.heads, self.n).transpose(1, 2)
        cm = cm.expand(B, S, self.groups, rep, self.n).reshape(B, S, self.heads, self.n).transpose(1, 2)
        dt = F.softplus(dt.float() + mx.dt_bias.float()).transpose(1, 2)  # [B, H, S]
        core, states = _ssd(xs, dt, -torch.exp(mx.A_log.float()), bm, cm, s0.float(), state_rows)
        core = core + mx.D.float()[None, :, None, None] * xs
        core = core.transpose(1, 2).reshape(B, S, self.inter)  # [B, S, inter] fp32
        g = core * F.silu(gate.float())
        g = g.reshape(B, S, self.groups, self.inter // self.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + mx.norm.variance_epsilon)
        o = mx.norm.weight * g.reshape(B, S, self.inter).to(x.dtype)
        return mx.out_proj(o), [xbc, states]

    @staticmethod
    def _mlp(m, x):  # noqa: ANN001, ANN205
        """A ReLU² MLP (a plain MLP layer, the MoE's shared expert)."""
        return m.down_proj(torch.square(F.relu(m.up_proj(x))))

    def _moe(self, m, x):  # noqa: ANN001, ANN202
        """transformers' Nemotron-H MoE with its routing as graph ops: sigmoid scores, the top groups by the sum of
        their two best (bias-corrected) scores, the top k experts within them, their raw scores as weights
        (renormalised where the router does, times the routed scaling factor); each token's chosen experts' weights
        gathered (no loop over experts, no data-dependent shapes); plus the shared expert."""
        B, S, H = x.shape
        t = x.reshape(-1, H)  # [T, H]
        r = m.gate
        scores = torch.sigmoid(F.linear(t.float(), r.weight.float()))  # [T, E]
        choice = scores + r.e_score_correction_bias
        E = choice.shape[-1]
        if self.n_group > 1:
            groups = choice.view(-1, self.n_group, E // self.n_group)
            group_scores = torch.topk(groups, 2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
            keep = group_scores >= torch.topk(group_scores, self.topk_group, dim=-1)[0][:, -1:]
            keep = keep[..., None].expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
            choice = torch.where(keep, choice, torch.tensor(float("-inf"), dtype=choice.dtype))
        idx = torch.topk(choice, self.top_k, dim=-1)[1]  # [T, k]
        w = torch.gather(scores, 1, idx)
        if self.norm_topk:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = (w * self.routed_scale).to(x.dtype)
        ex = m.experts
        hidden = torch.square(F.relu(torch.matmul(ex.up_proj[idx], t[:, None, :, None])))  # [T, k, I, 1]
        out = (torch.matmul(ex.down_proj[idx], hidden)[..., 0] * w[..., None]).sum(dim=1)  # [T, H]
        return out.reshape(B, S, H) + self._mlp(m.shared_experts, x)
