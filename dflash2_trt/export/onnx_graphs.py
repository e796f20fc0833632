"""Export-only PyTorch modules: what each ONNX graph computes, written for tracing.

They take and return explicit tensors (no cache classes, no data-dependent control flow, no If/Loop),
read the weights of the HF target / the PyTorch drafter in place, and are checked against those reference
models (``dflash2_trt.export.verify``) before an export reports success.

KV-cache convention (target and drafter context) — a *capacity buffer* of C slots per layer::

    past  [B, kvh, C, d]   slots 0..n-1 hold positions 0..n-1; slots >= n are stale (masked out)
    mask  [B, C (+S)]      int64, 1 = slot valid (then, for the target, 1 per new row)
    new   [B, kvh, S, d]   only the K/V of the S new rows are returned; the runtime writes them into
                           slots n..n+S-1 of its buffer, and "crops" by lowering n (no copy)

so one call costs O(C * S) (attention) + O(S) (cache write): nothing in a cycle grows with the square of
the sequence length, shapes stay fixed within a capacity bucket (CUDA graphs) and no cache is ever
concatenated or copied. Attention against the buffer and against the new rows is computed as two score
blocks joined before one softmax; grouped-query heads are folded into the row dimension instead of
repeating K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model.drafter import DFlash2Drafter
from dflash2_trt.model.layers import rope_cos_sin

SUPPORTED_TARGETS = ("llama", "qwen2", "qwen3", "mistral")


# ----------------------------------------------------------------------------------------------------
# Target
# ----------------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: statistics in fp32, scale in the weight's dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """x [B, heads, rows, d]. ``d`` is a Python int: a traced ``x.shape[-1] // 2`` makes the TorchScript
    exporter emit the following Concat on the wrong axis."""
    half = d // 2
    return x * cos + torch.cat([-x[:, :, :, half:], x[:, :, :, :half]], dim=3) * sin


def check_target_supported(hf_model) -> None:  # noqa: ANN001
    cfg = hf_model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_TARGETS:
        raise DFlash2Error(f"target model_type {mt!r} is not supported by the exporter; supported: "
                           f"{', '.join(SUPPORTED_TARGETS)} (Llama / Qwen2 / Qwen3 decoder families)")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise DFlash2Error(f"target hidden_act {act!r} is not supported (silu only)")
    if getattr(cfg, "use_sliding_window", False) or (mt == "mistral" and getattr(cfg, "sliding_window", None)):
        raise DFlash2Error("targets with sliding-window attention are not supported by the exporter")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rtype not in ("default", "linear", "llama3", "yarn"):
        raise DFlash2Error(f"target rope_type {rtype!r} is not supported (static RoPE variants only)")


class TargetGraph(nn.Module):
    """HF Llama/Qwen2/Qwen3 causal LM with an explicit capacity-buffer KV cache and context-feature taps.

    forward(input_ids [B, S] int64, position_ids [B, S] int64, attention_mask [B, C + S] int64,
            *past (2 per layer: key, value [B, kvh, C, d]))
    -> logits [B, S, V] fp32, context_features [B, S, len(layer_ids) * H], *present (2 per layer, the
       K/V of the S new rows [B, kvh, S, d]).
    New rows attend to valid buffer slots and causally to each other (the mask's last S entries must be 1).
    """

    def __init__(self, hf_model, layer_ids: list[int]) -> None:  # noqa: ANN001
        super().__init__()
        check_target_supported(hf_model)
        cfg = hf_model.config
        base = hf_model.model
        self.embed = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.layer_ids = list(layer_ids)
        self.nh = int(cfg.num_attention_heads)
        self.kvh = int(cfg.num_key_value_heads)
        attn0 = base.layers[0].self_attn
        self.d = int(attn0.head_dim)
        self.scaling = float(attn0.scaling)
        self.eps = float(cfg.rms_norm_eps)
        rot = base.rotary_emb
        self.register_buffer("inv_freq", rot.inv_freq.detach().float().clone(), persistent=False)  # [d/2]
        self.attention_scaling = float(getattr(rot, "attention_scaling", 1.0))

    def forward(self, input_ids, position_ids, attention_mask, *past):  # noqa: ANN001, ANN201
        B, S = input_ids.shape
        h = self.embed(input_ids)  # [B, S, H]
        dtype = h.dtype
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq  # [B, S, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(1)  # [B, 1, S, d]
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(1)
        C = past[0].shape[2]
        rep = self.nh // self.kvh
        neg = torch.tensor(float("-inf"), dtype=dtype)
        zero = torch.tensor(0.0, dtype=dtype)
        past_ok = attention_mask[:, :C] > 0  # [B, C]
        new_ok = attention_mask[:, C:] > 0  # [B, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=h.device).tril()  # [S, S]
        past_bias = torch.where(past_ok, zero, neg)[:, None, None, :]  # [B, 1, 1, C] (same for every row)
        new_bias = torch.where(causal[None] & new_ok[:, None, :], zero, neg)  # [B, S, S]
        new_bias = new_bias.unsqueeze(1).repeat(1, 1, rep, 1)  # [B, 1, rep*S, S]
        taps = {}
        present = []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = _rms(h, layer.input_layernorm.weight, self.eps)
            q = a.q_proj(x).view(B, S, self.nh, self.d)
            k = a.k_proj(x).view(B, S, self.kvh, self.d)
            v = a.v_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2)  # [B, kvh, S, d]
            if hasattr(a, "q_norm"):
                q = _rms(q, a.q_norm.weight, a.q_norm.variance_epsilon)
                k = _rms(k, a.k_norm.weight, a.k_norm.variance_epsilon)
            q = _rope(q.transpose(1, 2), cos, sin, self.d)  # [B, nh, S, d]
            k = _rope(k.transpose(1, 2), cos, sin, self.d)  # [B, kvh, S, d]
            o = _grouped_attention(q, past[2 * i], past[2 * i + 1], k, v, past_bias, new_bias, self.scaling, self.nh,
                                   self.kvh, self.d)
            h = h + a.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * self.d))
            x = _rms(h, layer.post_attention_layernorm.weight, self.eps)
            m = layer.mlp
            h = h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
            present += [k, v]
            taps[i] = h  # decoder layer i's output == HF hidden_states[i + 1]
        logits = self.lm_head(_rms(h, self.norm.weight, self.eps)).float()  # [B, S, V]
        ctx = torch.cat([taps[j] for j in self.layer_ids], dim=-1)  # [B, S, n*H]
        return (logits, ctx, *present)


# ----------------------------------------------------------------------------------------------------
# Drafter: (a) context-KV update, (b) block pass, (c) head (+ selector)
# ----------------------------------------------------------------------------------------------------


class DrafterContextGraph(nn.Module):
    """(a) context_features [B, m, n*H_t], position_ids [B, m] -> per layer context K, V [B, kvh, m, d]."""

    def __init__(self, drafter: DFlash2Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, context_features, position_ids):  # noqa: ANN001, ANN201
        d = self.drafter
        cfg = d.config
        c = d.fuse_context(context_features)  # [B, m, H]
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, c.dtype)  # [B, m, hd]
        out = []
        for layer in d.layers:
            k, v = _kv(layer.self_attn, c, cos.unsqueeze(1), sin.unsqueeze(1), cfg)
            out += [k, v]
        return tuple(out)


def _kv(attn, x, cos, sin, cfg):  # noqa: ANN001, ANN202
    """x [B, m, H] -> k (normed + RoPE), v [B, kvh, m, hd] (same math as layers.Attention.kv)."""
    B, m = x.shape[0], x.shape[1]
    k = attn.k_norm(attn.k_proj(x).view(B, m, attn.kvh, attn.d)).transpose(1, 2)
    v = attn.v_proj(x).view(B, m, attn.kvh, attn.d).transpose(1, 2)
    return _rope(k, cos, sin, cfg.head_dim), v


def _group_matrix(conv) -> torch.Tensor:  # noqa: ANN001
    """[G, H] 0/1: channel c belongs to group c // group (expands per-group taps with a MatMul)."""
    H = conv.base_kernel.shape[-1]
    g = torch.arange(H) // conv.group
    return (torch.arange(conv.groups).unsqueeze(1) == g.unsqueeze(0)).to(conv.base_kernel.dtype)


def _shift(y: torch.Tensor, o: int) -> torch.Tensor:
    """y_{t-o} along block rows (dim 1), zeros before row 0: taps never cross the block start."""
    if o == 0:
        return y
    return torch.cat([y[:, :o] * 0, y[:, :-o]], dim=1)


class _ConvTaps:
    """dyn taps of one DynamicConv for a block: w[side][o] = base[side, o] + dyn[side, o] per channel."""

    def __init__(self, conv, x: torch.Tensor, group_matrix: torch.Tensor) -> None:  # noqa: ANN001
        B, bs = x.shape[0], x.shape[1]
        dyn = conv.kernel_projection(x).view(B, bs, 2, conv.kc, conv.groups)  # [B, bs, 2, kc, G]
        self.w = [[conv.base_kernel[side, o] + torch.matmul(dyn[:, :, side, o], group_matrix)  # [B, bs, H]
                   for o in range(conv.kc)] for side in range(2)]

    def mix(self, y: torch.Tensor, side: int) -> torch.Tensor:
        out = self.w[side][0] * y
        for o in range(1, len(self.w[side])):
            out = out + self.w[side][o] * _shift(y, o)
        return out


def _grouped_attention(q, k1, v1, k2, v2, bias1, bias2, scale: float, nh: int, kvh: int, d: int):  # noqa: ANN001, ANN202
    """softmax over [keys1 | keys2] without concatenating K/V; q [B, nh, S, d], k/v [B, kvh, *, d],
    biases [B, 1, rep*S, *] (additive, -inf = masked). Heads h = kv * rep + r share kv head kv, so grouped
    queries are folded into rows instead of repeating K/V."""
    B, S = q.shape[0], q.shape[2]
    qg = q.reshape(B, kvh, (nh // kvh) * S, d)
    s1 = torch.matmul(qg, k1.transpose(2, 3)) * scale + bias1
    s2 = torch.matmul(qg, k2.transpose(2, 3)) * scale + bias2
    n1 = k1.shape[2]
    p = torch.softmax(torch.cat([s1, s2], dim=3).float(), dim=3).to(q.dtype)
    o = torch.matmul(p[:, :, :, :n1], v1) + torch.matmul(p[:, :, :, n1:], v2)
    return o.reshape(B, nh, S, d)


class DrafterBlockGraph(nn.Module):
    """(b) the one-shot block pass.

    anchor_ids [B] int64, anchor_position [B] int64, context_mask [B, C] int64 (1 = valid slot; slot j
    holds position j), *context (key, value [B, kvh, C, d] per layer) -> hidden [B, bs, H] (final-normed).
    """

    def __init__(self, drafter: DFlash2Drafter) -> None:
        super().__init__()
        self.drafter = drafter
        cfg = drafter.config
        self.bs = cfg.block_size
        self.register_buffer("mask_ids", torch.full((1, cfg.block_size - 1), cfg.mask_token_id, dtype=torch.long),
                             persistent=False)
        conv = getattr(drafter.layers[0], "attention_conv", None) if len(drafter.layers) else None
        gm = _group_matrix(conv).to(drafter.fc.weight.dtype) if conv is not None else torch.zeros(0)
        self.register_buffer("groups_matrix", gm, persistent=False)  # [G, H]

    def forward(self, anchor_ids, anchor_position, context_mask, *context):  # noqa: ANN001, ANN201
        d = self.drafter
        cfg = d.config
        B = anchor_ids.shape[0]
        ids = torch.cat([anchor_ids.view(B, 1), self.mask_ids + 0 * anchor_ids.view(B, 1)], dim=1)  # [B, bs]
        x = d.embed_weight[ids]  # [B, bs, H]
        if cfg.learned_mask_embedding:
            x = torch.cat([x[:, :1], d.mask_embedding + 0 * x[:, 1:]], dim=1)
        if cfg.input_embedding_scale is not None:
            x = x * cfg.input_embedding_scale
        h = x.to(d.fc.weight.dtype)
        block_pos = anchor_position.view(B, 1) + torch.arange(self.bs, device=ids.device)  # [B, bs]
        cos, sin = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta, h.dtype)
        C = context[0].shape[2]
        ctx_pos = torch.arange(C, device=ids.device).view(1, 1, -1)  # [1, 1, C] slot j holds position j
        qp = block_pos.unsqueeze(-1)  # [B, bs, 1]
        kp = block_pos.unsqueeze(1)  # [B, 1, bs]
        # same rules as DFlash2Drafter._mask, written with broadcasting only (no Expand of traced shapes)
        ctx_ok = (ctx_pos < anchor_position.view(B, 1, 1)) & (context_mask > 0).unsqueeze(1) & (qp >= 0)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        neg = torch.tensor(float("-inf"), dtype=h.dtype)
        zero = torch.tensor(0.0, dtype=h.dtype)
        cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, bs, hd]
        biases = {}
        for i, layer in enumerate(d.layers):
            key = (cfg.layer_is_causal(i), cfg.layer_window(i))
            if key not in biases:
                c_ok = ctx_ok
                b_ok = kp <= qp if key[0] else (kp >= 0) & (qp >= 0)  # [B, bs, bs]
                if key[1] is not None:
                    c_ok = c_ok & (qp - ctx_pos < key[1])
                    b_ok = b_ok & (qp - kp < key[1])
                biases[key] = tuple(torch.where(ok, zero, neg).repeat(1, rep, 1).unsqueeze(1)  # [B, 1, rep*bs, *]
                                    for ok in (c_ok, b_ok))
            h = self._layer(layer, h, cos4, sin4, context[2 * i], context[2 * i + 1], *biases[key])
        return d.norm(h)

    def _layer(self, layer, h, cos, sin, ck, cv, ctx_bias, blk_bias):  # noqa: ANN001, ANN202
        """One drafter layer (same math as model.drafter.DrafterLayer): h [B, bs, H] -> [B, bs, H]."""
        d = self.drafter
        cfg = d.config
        a = layer.self_attn
        B, bs = h.shape[0], self.bs
        x = layer.input_layernorm(h)
        if d.use_conv:
            taps = _ConvTaps(layer.attention_conv, x, self.groups_matrix)
            x = taps.mix(x, 0)
        q = a.q_norm(a.q_proj(x).view(B, bs, a.nh, a.d)).transpose(1, 2)  # [B, nh, bs, hd]
        q = _rope(q, cos, sin, cfg.head_dim)
        kb, vb = _kv(a, x, cos, sin, cfg)  # [B, kvh, bs, hd]
        o = _grouped_attention(q, ck, cv, kb, vb, ctx_bias, blk_bias, a.d ** -0.5, a.nh, a.kvh, a.d)
        o = a.o_proj(o.transpose(1, 2).reshape(B, bs, a.nh * a.d))
        if d.use_conv:
            o = taps.mix(o, 1)
        h = h + o
        x = layer.post_attention_layernorm(h)
        if d.use_conv:
            taps = _ConvTaps(layer.mlp_conv, x, self.groups_matrix)
            x = taps.mix(x, 0)
        m = layer.mlp(x)
        if d.use_conv:
            m = taps.mix(m, 1)
        return h + m


class DrafterHeadBase(nn.Module):
    """(c, first half) hidden [B, bs, H] -> cand_ids [B, L, K] int32, unary [B, L, K] fp32,
    hidden_proj [B, L, r] (codebook dtype): LM head, multiplier / soft-cap, TopK, hidden_projection."""

    def __init__(self, drafter: DFlash2Drafter) -> None:
        super().__init__()
        if not drafter.use_selector:
            raise DFlash2Error("exporting a drafter without the candidate selector (DFlash v1 / --no-selector) "
                               "is not supported; export a DFlash 2 drafter")
        self.drafter = drafter
        self.k = drafter.config.selector_top_k

    def forward(self, hidden):  # noqa: ANN001, ANN201
        rows = hidden[:, 1:]  # [B, L, H]
        logits = self.drafter.logits(rows).float()  # [B, L, V]
        unary, cand = torch.topk(logits, self.k, dim=-1, sorted=True)  # [B, L, K]
        g = self.drafter.candidate_selector.hidden_projection(rows)  # [B, L, r]
        return cand.to(torch.int32), unary, g


class DrafterHeadLogits(nn.Module):
    """hidden [B, bs, H] -> logits [B, L, V] fp32 of the draft rows (LM head, multiplier / soft-cap): the head
    of ``drafter_head_independent`` — no selector (DFlash v1 drafters, and the selector-off ablation of DFlash 2
    drafters). The runtime takes the argmax / top-K / sample of each row itself (NumPy)."""

    def __init__(self, drafter: DFlash2Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, hidden):  # noqa: ANN001, ANN201
        return self.drafter.logits(hidden[:, 1:]).float()


# ----------------------------------------------------------------------------------------------------
# Decomposed selector (standard ONNX ops) — the twin of the DFlash2PathSelector plugin
# ----------------------------------------------------------------------------------------------------


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, K], u [B] -> min{j : cdf[j] > u} clamped to K-1 [B] int64."""
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


class DecomposedSelector(nn.Module):
    """SPEC §3 path selection as plain tensor ops, unrolled over the L static rows (no Loop/If).

    Inputs and outputs are those of the plugin contract (``selector_contract``): cand_ids [B, L, K] int32,
    unary [B, L, K] fp32, hidden_proj [B, L, r], anchor_ids [B] int32, temperature [B] fp32,
    uniforms [B, L] fp32 -> path_ids [B, L] int32, proposal_probs [B, L, K] fp32. The codebooks are
    parameters (initializers). Per sequence, T <= 0 takes the argmax path and T > 0 samples; both are
    computed and one is chosen with Where, so the graph has no control flow.
    """

    def __init__(self, pred_codebook: torch.Tensor, succ_codebook: torch.Tensor, mode: str) -> None:
        super().__init__()
        if mode not in ("greedy", "viterbi"):
            raise DFlash2Error(f"selector mode must be 'greedy' or 'viterbi', got {mode!r}")
        self.mode = mode
        self.pred_codebook = nn.Parameter(pred_codebook.detach().clone(), requires_grad=False)  # [V, r]
        self.succ_codebook = nn.Parameter(succ_codebook.detach().clone(), requires_grad=False)  # [V, r]

    def lattice(self, cand, unary, g, anchor):  # noqa: ANN001, ANN201
        B, L, K = cand.shape
        prev = torch.cat([anchor.view(B, 1, 1).expand(B, 1, K), cand[:, :-1]], dim=1)  # [B, L, K]
        a = self.pred_codebook[prev].float()  # [B, L, K, r]
        b = self.succ_codebook[cand].float() * g.float().unsqueeze(2)  # [B, L, K, r]
        return unary.unsqueeze(2) + torch.matmul(a, b.transpose(-1, -2))  # [B, L, K_prev, K_cur]

    def forward(self, cand_ids, unary, hidden_proj, anchor_ids, temperature, uniforms):  # noqa: ANN001, ANN201
        cand = cand_ids.long()
        B, L, K = cand.shape
        S = self.lattice(cand, unary, hidden_proj, anchor_ids.long())
        sampling = temperature > 0  # [B]
        t = torch.where(sampling, temperature, torch.ones_like(temperature)).view(-1, 1)  # [B, 1]
        if self.mode == "greedy":
            idx, q = self._greedy(S, sampling, t, uniforms)
        else:
            idx, q = self._viterbi(S, sampling, t, uniforms)
        path = torch.gather(cand, 2, idx.unsqueeze(-1))[..., 0]  # [B, L]
        return path.to(torch.int32), q

    @staticmethod
    def _greedy(S, sampling, t, uniforms):  # noqa: ANN001, ANN205
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

    @staticmethod
    def _viterbi(S, sampling, t, uniforms):  # noqa: ANN001, ANN205
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
