"""The hybrid family: Qwen3.5 / Qwen3.6 / Qwen3.8 (transformers ``qwen3_5``, ``qwen3_5_moe``) and Qwen3-Next
(``qwen3_next``): Gated DeltaNet linear-attention layers interleaved with gated full-attention layers (the MoE
variants with routed and shared experts in the MLP).

A linear layer's state is not a cache of positions: a short causal depthwise convolution keeps its last
``conv_kernel - 1`` inputs, and the delta rule keeps one recurrent matrix per head, both overwritten by every row.
After a verify of k rows accepts j < k drafts, the state must be the state after exactly j + 1 rows, so a call
that may be rolled back records the state after each of its rows (transformers' past recording:
``DynamicCache.activate_past_recording`` with the number of recurrent states to keep, computed row by row, and
the convolution's inputs of the whole call) and :func:`rollback` picks the one of the accepted length; the
attention layers crop their KV as the dense family does (:mod:`~dflash2_trt.targets.recorded`). Calls of more than
``MAX_ROLLBACK_ROWS`` rows (a long prompt) are never rolled back and run transformers' chunked kernel.

Export: :class:`TargetGraph` carries every linear layer's state as graph inputs and outputs: a call returns the
convolution's new inputs and the recurrent state after each row the runtime asks for (:func:`_delta_rule` computes
the rows of one call in closed form by a stable blocked triangular inverse, so the graph has no loop), from which
the runtime keeps the state of the accepted prefix. Qwen3-Next's fused input projections (``in_proj_qkvz``, ``in_proj_ba``, laid out per key head) are
split in the graph into the q / k / v / z / b / a parts that Qwen3.5's separate projections give, so both run the
same layer; the convolution's channels (q | k | v) and the state shapes are the same for both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.dense import _grouped_attention, attention_biases, context_features, rope_tables
from dflash2_trt.targets.moe import routed_mlp
from dflash2_trt.targets.recorded import MAX_ROLLBACK_ROWS, before_forward, new_cache, rollback

__all__ = ["MAX_CALL_ROWS", "MAX_ROLLBACK_ROWS", "MODEL_TYPES", "TargetGraph", "before_forward", "check_exportable",
           "graph_io", "layer_kinds", "linear_state_shapes", "new_cache", "rollback", "state_graph_io"]

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
_KINDS = {"full_attention": "attention", "linear_attention": "linear"}


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the config's ``layer_types``."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != int(config.num_hidden_layers) or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layer_types must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


def check_exportable(hf_model: Any) -> None:
    """The exporter's graph computes this target exactly, else DFlash2Error saying what it does not."""
    cfg = hf_model.config
    layer_kinds(cfg)
    for what, value, ok in (("hidden_act", getattr(cfg, "hidden_act", "silu"), ("silu",)),
                            ("rope_type", (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default"),
                             ("default",))):
        if value not in ok:
            raise DFlash2Error(f"target {what} {value!r} is not supported for {cfg.model_type!r} ({', '.join(ok)} only)")
    if int(cfg.linear_num_value_heads) % int(cfg.linear_num_key_heads):
        raise DFlash2Error("target linear_num_value_heads must be a multiple of linear_num_key_heads")


# ----------------------------------------------------------------------------------------------------
# The target graph (standard ONNX: TensorRT's, and what ONNX Runtime runs for this family)
# ----------------------------------------------------------------------------------------------------

MAX_CALL_ROWS = 64  # rows of one graph call: the runtime feeds a longer prompt in calls of at most this many
_LEVELS = (MAX_CALL_ROWS - 1).bit_length()  # block sizes 1, 2, ..., 32 of the triangular inverse: 2^_LEVELS >= 64 rows


def linear_state_shapes(config: Any) -> dict[str, int]:
    """The per-layer state of a linear layer: the convolution's last ``conv_kernel - 1`` inputs [conv_dim, kernel - 1]
    and the recurrent matrix of each value head [num_heads, key_dim, value_dim] (fp32), and the rows of one call."""
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    return {"conv_dim": 2 * hk * dk + hv * dv, "conv_kernel": int(config.linear_conv_kernel_dim), "num_heads": hv,
            "key_dim": dk, "value_dim": dv, "max_rows_per_call": MAX_CALL_ROWS}


def _delta_rule(q, k, v, g, beta, s0, rows):  # noqa: ANN001, ANN202
    """The gated delta rule over one call of S <= MAX_CALL_ROWS rows in closed form (no loop over rows), fp32.

    q, k [B, H, S, dk] (l2-normalised, q scaled), v [B, H, S, dv], g (log decay), beta [B, H, S], s0 [B, H, dk, dv]
    the state before the call; rows [R] int64 -> (outputs [B, H, S, dv], states after each of ``rows`` [B, R, H, dk,
    dv]). With G the cumulative log decay and D[t, s] = exp(G_t - G_s) for s <= t (never above 1), the row updates
    delta solve (I + A) delta = beta (v - exp(G) k s0) with A[t, s] = beta_t D[t, s] k_t.k_s strictly below the
    diagonal; then o_t = exp(G_t) q_t s0 + sum_{s<=t} D[t, s] (q_t.k_s) delta_s and
    S_t = exp(G_t) s0 + sum_{s<=t} D[t, s] k_s delta_s^T: the same sums as transformers' row-by-row recurrence, in
    another order (equal to fp32 rounding).

    T = (I + A)^-1 is built by blocked inversion, the block size doubling: with T_b the inverse of the b-row diagonal
    blocks, T_2b = T_b - T_b (E_b * A) T_b, E_b selecting in each 2b-row block the rows of its second half and the
    columns of its first (the block inverse [[T_lo, 0], [-T_hi A_21 T_lo, T_hi]]; a last block cut short by S is
    still exact). Every factor is an inverse of a principal block — the recurrence run over those rows from a zero
    state, bounded because each row's update (I - beta k k^T, |k| = 1, 0 <= beta <= 1) contracts — so no product
    grows: repeated tokens (aligned keys, no decay, beta near 1) stay within fp32 rounding of a float64 recurrence,
    where a Neumann series sum_j (-A)^j, exact in exact arithmetic, alternates with terms of size C(S, j) and
    cancels catastrophically."""
    S = q.shape[2]
    G = torch.cumsum(g, dim=2)  # [B, H, S]
    idx = torch.arange(S, device=q.device)
    lower = idx[:, None] >= idx[None, :]  # [S, S] (t, s): s <= t
    strict = idx[:, None] > idx[None, :]
    zero, neg = torch.zeros((), dtype=q.dtype), torch.tensor(float("-inf"), dtype=q.dtype)
    D = torch.exp(torch.where(lower, G[..., :, None] - G[..., None, :], neg))  # [B, H, S, S]
    gamma = torch.exp(G)[..., None]  # [B, H, S, 1]
    a = torch.where(strict, beta[..., None] * D * torch.matmul(k, k.transpose(2, 3)), zero)  # [B, H, S, S]
    blk = idx[None, :] // (2 ** torch.arange(_LEVELS, device=q.device))[:, None]  # [L, S] a row's b-block, b = 2^l
    half = blk - 2 * (blk // 2)  # [L, S] 1: the second half of its 2b-block
    hi_lo = (blk[:, :, None] // 2 == blk[:, None, :] // 2) & (half[:, :, None] > half[:, None, :])  # [L, S, S] E_b
    t = (idx[:, None] == idx[None, :]).to(q.dtype) - torch.where(hi_lo[0], a, zero)  # T_2: 1-row blocks invert to 1
    for level in range(1, _LEVELS):
        t = t - torch.matmul(t, torch.matmul(torch.where(hi_lo[level], a, zero), t))
    x = torch.matmul(t, beta[..., None] * (v - gamma * torch.matmul(k, s0)))  # [B, H, S, dv] the row updates
    out = gamma * torch.matmul(q, s0) + torch.matmul(D * torch.matmul(q, k.transpose(2, 3)), x)
    d_rows = torch.index_select(D, 2, rows)  # [B, H, R, S]
    g_rows = torch.index_select(gamma, 2, rows)[..., None]  # [B, H, R, 1, 1]
    states = g_rows * s0[:, :, None] + torch.matmul(k.transpose(2, 3)[:, :, None], d_rows[..., None] * x[:, :, None])
    return out, states.transpose(1, 2)


def _rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """RoPE on the first ``rot`` dims of x [B, heads, S, d] (transformers' partial rotary), the rest passed through."""
    half = rot // 2
    r, rest = x[..., :rot], x[..., rot:]
    return torch.cat([r * cos + torch.cat([-r[..., half:], r[..., :half]], dim=-1) * sin, rest], dim=-1)


def graph_io(hf_model: Any, batch: int, dtype: Any) -> tuple[tuple, list[str], list[str], dict]:
    """What the exporter traces :class:`TargetGraph` with (:func:`state_graph_io`)."""
    cfg = hf_model.config
    return state_graph_io(cfg, layer_kinds(cfg), linear_state_shapes(cfg), batch, dtype)


def state_graph_io(cfg: Any, kinds: list[str], st: dict[str, int], batch: int, dtype: Any
                   ) -> tuple[tuple, list[str], list[str], dict]:
    """A target graph with linear-layer states (this family's, Nemotron-H's): example inputs (``batch`` rows of 3 new
    tokens over a KV capacity of 4, the states of rows 0 and 2 asked for), input and output names, dynamic axes.
    ``kinds``: the layers' kinds (an ``mlp`` layer has no state inputs or outputs); ``st``: the linear state's
    shapes."""
    from dflash2_trt.manifest import TARGET_STATE_ROWS, target_state_names

    kvh, d = int(cfg.num_key_value_heads), int(cfg.head_dim)
    past, present = target_state_names(kinds), target_state_names(kinds, "present")
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
           "attention_mask": {0: "batch", 1: "capacity_plus_sequence"}, TARGET_STATE_ROWS: {0: "state_rows"},
           "logits": {0: "batch", 1: "sequence"}, "context_features": {0: "batch", 1: "sequence"}}
    args: list = [torch.randint(0, int(cfg.vocab_size), (batch, 3)), torch.arange(3).repeat(batch, 1),
                  torch.ones(batch, 4 + 3, dtype=torch.long), torch.tensor([0, 2])]
    for j, kind in enumerate(k for k in kinds if k != "mlp"):
        ins, outs = past[2 * j:2 * j + 2], present[2 * j:2 * j + 2]  # the layer's two state inputs and outputs
        if kind == "linear":  # conv, recurrent
            args += [torch.zeros(batch, st["conv_dim"], st["conv_kernel"] - 1, dtype=dtype),
                     torch.zeros(batch, st["num_heads"], st["key_dim"], st["value_dim"])]
            dyn.update({ins[0]: {0: "batch"}, ins[1]: {0: "batch"}, outs[0]: {0: "batch", 2: "sequence"},
                        outs[1]: {0: "batch", 1: "state_rows"}})
        else:  # key, value
            args += [torch.zeros(batch, kvh, 4, d, dtype=dtype) for _ in range(2)]
            dyn.update({n: {0: "batch", 2: "capacity"} for n in ins})
            dyn.update({n: {0: "batch", 2: "sequence"} for n in outs})
    names = ["input_ids", "position_ids", "attention_mask", TARGET_STATE_ROWS, *past]
    return tuple(args), names, ["logits", "context_features", *present], dyn


class TargetGraph(nn.Module):
    """A hybrid-family causal LM (Qwen3.5 or Qwen3-Next) with explicit state: capacity-buffer KV for the attention layers (the dense
    family's convention, :mod:`dflash2_trt.targets.dense`) and, for each linear layer, its convolution and recurrent
    state, returned so that the runtime can keep the state after any accepted prefix of the call.

    forward(input_ids [B, S], position_ids [B, S], attention_mask [B, C + S] int64, state_rows [R] int64,
            *past — per layer in order: attention ``key, value [B, kvh, C, d]``; linear ``conv [B, conv_dim, K - 1],
            recurrent [B, heads, dk, dv] fp32``)
    -> logits [B, S, V] fp32, context_features [B, S, n * H], *present — per layer: attention the K/V of the S new
       rows [B, kvh, S, d]; linear the convolution's inputs of the S rows [B, conv_dim, S] (the state after row j
       is the last K - 1 columns of [conv | inputs[:, :, :j + 1]]) and the recurrent state after each row of
       ``state_rows`` [B, R, heads, dk, dv] (a verify asks for every row, a prompt chunk for its last).
    S <= MAX_CALL_ROWS; rows of a sequence past its valid ones (a batch's padding) come last and touch no valid row.
    """

    def __init__(self, hf_model: Any, layer_ids: list[int]) -> None:
        super().__init__()
        check_exportable(hf_model)
        cfg = hf_model.config
        base = hf_model.model
        self.kinds = layer_kinds(cfg)
        self.embed, self.layers, self.norm, self.lm_head = base.embed_tokens, base.layers, base.norm, hf_model.lm_head
        self.layer_ids = list(layer_ids)
        self.nh, self.kvh = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.d = int(cfg.head_dim)
        rot = base.rotary_emb
        self.register_buffer("inv_freq", rot.inv_freq.detach().float().clone(), persistent=False)  # [rot / 2]
        self.rot = 2 * int(rot.inv_freq.numel())
        self.attention_scaling = float(getattr(rot, "attention_scaling", 1.0))
        st = linear_state_shapes(cfg)
        self.hk, self.hv = int(cfg.linear_num_key_heads), st["num_heads"]
        self.dk, self.dv = st["key_dim"], st["value_dim"]

    def forward(self, input_ids, position_ids, attention_mask, state_rows, *past):  # noqa: ANN001, ANN201
        B, S = input_ids.shape
        h = self.embed(input_ids)
        cos, sin = rope_tables(position_ids, self.inv_freq, self.attention_scaling, h.dtype)  # [B, 1, S, rot]
        C = past[2 * self.kinds.index("attention")].shape[2]
        past_bias, new_bias = attention_biases(attention_mask, C, self.nh // self.kvh, h.dtype)
        taps, present = {}, []
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            if self.kinds[i] == "attention":
                out, new = self._attention(layer.self_attn, x, cos, sin, past[2 * i], past[2 * i + 1], past_bias,
                                           new_bias)
            else:
                out, new = self._linear(layer.linear_attn, x, past[2 * i], past[2 * i + 1], state_rows)
            h = h + out
            mlp = layer.mlp
            x = layer.post_attention_layernorm(h)
            h = h + (routed_mlp(mlp, x) if hasattr(mlp, "experts") else mlp(x))
            present += new
            taps[i] = h
        h = self.norm(h)
        logits = self.lm_head(h).float()
        return (logits, context_features(taps, h, self.layer_ids), *present)

    def _attention(self, a, x, cos, sin, pk, pv, past_bias, new_bias):  # noqa: ANN001, ANN202
        """Gated full attention: the query projection's second half gates the output through a sigmoid."""
        B, S = x.shape[0], x.shape[1]
        qg = a.q_proj(x).view(B, S, self.nh, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d:].reshape(B, S, self.nh * self.d)
        q = _rope_part(a.q_norm(q).transpose(1, 2), cos, sin, self.rot)
        k = _rope_part(a.k_norm(a.k_proj(x).view(B, S, self.kvh, self.d)).transpose(1, 2), cos, sin, self.rot)
        v = a.v_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2)
        o = _grouped_attention(q, pk, pv, k, v, past_bias, new_bias, float(a.scaling), self.nh, self.kvh, self.d)
        o = o.transpose(1, 2).reshape(B, S, self.nh * self.d) * torch.sigmoid(gate)
        return a.o_proj(o), [k, v]

    def _projections(self, la, x):  # noqa: ANN001, ANN202
        """A Gated DeltaNet layer's input projections: (q | k | v [B, S, conv_dim] — the convolution's channels —,
        z [B, S, hv * dv], b, a [B, S, hv]). Qwen3.5 has one projection per part; Qwen3-Next fuses them into
        ``in_proj_qkvz`` and ``in_proj_ba``, laid out per key head ([q (dk) | k (dk) | v | z (rep * dv each)] and
        [b | a (rep each)] for each of the hk key heads, rep = hv / hk value heads per key head), split here into the
        same parts (transformers' ``fix_query_key_value_ordering``)."""
        if not hasattr(la, "in_proj_qkvz"):
            return la.in_proj_qkv(x), la.in_proj_z(x), la.in_proj_b(x), la.in_proj_a(x)
        B, S = x.shape[0], x.shape[1]
        dk, rv, rep = self.dk, (self.hv // self.hk) * self.dv, self.hv // self.hk
        qkvz = la.in_proj_qkvz(x).view(B, S, self.hk, 2 * dk + 2 * rv)
        ba = la.in_proj_ba(x).view(B, S, self.hk, 2 * rep)
        q, k = qkvz[..., :dk].reshape(B, S, self.hk * dk), qkvz[..., dk: 2 * dk].reshape(B, S, self.hk * dk)
        mixed = torch.cat([q, k, qkvz[..., 2 * dk: 2 * dk + rv].reshape(B, S, self.hv * self.dv)], dim=-1)
        z = qkvz[..., 2 * dk + rv:].reshape(B, S, self.hv * self.dv)
        return mixed, z, ba[..., :rep].reshape(B, S, self.hv), ba[..., rep:].reshape(B, S, self.hv)

    def _linear(self, la, x, conv, s0, state_rows):  # noqa: ANN001, ANN202
        """A Gated DeltaNet layer from its convolution and recurrent state."""
        B, S = x.shape[0], x.shape[1]
        mixed, z, b, a = self._projections(la, x)
        mixed = mixed.transpose(1, 2)  # [B, conv_dim, S]
        y = F.silu(F.conv1d(torch.cat([conv, mixed], dim=2), la.conv1d.weight, None, groups=mixed.shape[1]))
        y = y.transpose(1, 2)
        kd = self.hk * self.dk
        rep = self.hv // self.hk
        q = y[..., :kd].reshape(B, S, self.hk, 1, self.dk).expand(B, S, self.hk, rep, self.dk)
        k = y[..., kd: 2 * kd].reshape(B, S, self.hk, 1, self.dk).expand(B, S, self.hk, rep, self.dk)
        q = q.reshape(B, S, self.hv, self.dk).transpose(1, 2).float()
        k = k.reshape(B, S, self.hv, self.dk).transpose(1, 2).float()
        v = y[..., 2 * kd:].reshape(B, S, self.hv, self.dv).transpose(1, 2).float()
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / (self.dk ** 0.5)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(b).float().transpose(1, 2)  # [B, H, S]
        g = (-la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias)).transpose(1, 2)
        core, states = _delta_rule(q, k, v, g, beta, s0.float(), state_rows)
        core = core.transpose(1, 2).to(x.dtype).reshape(-1, self.dv)
        z = z.reshape(-1, self.dv)
        o = la.norm(core, z).reshape(B, S, self.hv * self.dv)
        return la.out_proj(o), [mixed, states]
