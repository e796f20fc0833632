"""Export-only PyTorch modules of the drafter graphs: what each ONNX graph computes, written for tracing (the
target's graph is its family's: :mod:`dflash2_trt.targets`).

They take and return explicit tensors (no cache classes, no data-dependent control flow, no If/Loop),
read the weights of the HF target / the PyTorch drafter in place, and are checked against those reference
models (``dflash2_trt.export.verify``) before an export reports success.

KV-cache convention of the drafter's context (the dense target graph's is the same) — a *capacity buffer* of C
slots per layer::

    past  [B, kvh, C, d]   slots 0..n-1 hold positions 0..n-1; slots >= n are stale (masked out)
    mask  [B, C]           int64, 1 = slot valid
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
from torch import nn

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.model import selector as sel
from dflash2_trt.model.drafter import DFlash2Drafter
from dflash2_trt.vocabulary import SELECTOR_MODES

# ----------------------------------------------------------------------------------------------------
# Drafter: (a) context-KV update, (b) block pass, (c) head (+ selector)
# ----------------------------------------------------------------------------------------------------


class DrafterContextGraph(nn.Module):
    """(a) context_features [B, m, n*H_t], position_ids [B, m] -> per layer context K, V [B, kvh, m, d]:
    the drafter's own :meth:`~dflash2_trt.model.DFlash2Drafter.fuse_context` + ``context_kv``."""

    def __init__(self, drafter: DFlash2Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, context_features, position_ids):  # noqa: ANN001, ANN201
        d = self.drafter
        return tuple(t for kv in d.context_kv(d.fuse_context(context_features), position_ids) for t in kv)


class DrafterBlockGraph(nn.Module):
    """(b) the one-shot block pass: the drafter's own :meth:`~dflash2_trt.model.DFlash2Drafter.block_forward`
    over capacity buffers.

    anchor_ids [B] int64, anchor_position [B] int64, context_mask [B, C] int64 (1 = valid slot; slot j
    holds position j), *context (key, value [B, kvh, C, d] per layer) -> hidden [B, bs, H] (final-normed).
    """

    def __init__(self, drafter: DFlash2Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, anchor_ids, anchor_position, context_mask, *context):  # noqa: ANN001, ANN201
        return self.drafter.block_forward(anchor_ids, anchor_position, list(context[0::2]), list(context[1::2]),
                                          context_mask > 0)


# ONNX Runtime flavour of the block: each decoder layer one dflash2.DrafterLayer node (the custom-op library's
# plugins/ortDecodeAttention/ortDrafterLayerOp.cpp: its inputs, weights in MatMul layout, and attributes)
DRAFTER_LAYER_OP = "dflash2::DrafterLayer"
_LAYER_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                      "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def fused_layers_unsupported(drafter: DFlash2Drafter) -> str | None:
    """Why the drafter's layers cannot be one dflash2.DrafterLayer node each, or None when they can."""
    cfg = drafter.config
    if cfg.attention_bias:
        return "attention biases"
    if cfg.hidden_act not in _LAYER_ACTIVATIONS:
        return f"activation {cfg.hidden_act!r}"
    d = cfg.head_dim or 0
    if d % 2 or d > 512:
        return f"head size {d}"
    layer = drafter.layers[0]
    outs = [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.hidden_size, cfg.intermediate_size]
    if drafter.use_conv:
        outs.append(layer.attention_conv.kernel_projection.out_features)
    if any(n % 16 for n in outs):
        return "a projection whose output size is not a multiple of 16"
    return None


class _DrafterLayerNode(torch.autograd.Function):
    """One drafter layer as a ``dflash2::DrafterLayer`` node when traced. Eager calls run the layer; while tracing
    only the output's shape matters (nothing after a layer branches on values), and the tracer cannot follow the
    layer's own parameters inside a Function, so the traced forward returns a placeholder of that shape."""

    @staticmethod
    def forward(ctx, layer, use_conv, act, h, cos, sin, ck, cv, cb, bb, *weights):  # noqa: ANN001, ANN205
        if torch.jit.is_tracing():
            return h.clone()
        return layer(h, cos, sin, ck, cv, cb, bb, use_conv)

    @staticmethod
    def symbolic(g, layer, use_conv, act, h, cos, sin, ck, cv, cb, bb, *weights):  # noqa: ANN001, ANN205
        a = layer.self_attn
        conv = layer.attention_conv if use_conv else None
        out = g.op(DRAFTER_LAYER_OP, h, cos, sin, ck, cv, cb, bb, *weights, num_heads_i=a.nh, kv_num_heads_i=a.kvh,
                   epsilon_f=layer.input_layernorm.eps, activation_s=act,
                   conv_group_size_i=conv.group if conv is not None else 0,
                   conv_kernel_size_i=conv.kc if conv is not None else 0)
        out.setType(h.type())
        return out


def _layer_node(act: str, layer, h, cos, sin, ck, cv, cb, bb, use_conv):  # noqa: ANN001, ANN202
    a, m = layer.self_attn, layer.mlp
    weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, a.q_proj.weight.t(),
               a.k_proj.weight.t(), a.v_proj.weight.t(), a.o_proj.weight.t(), a.q_norm.weight, a.k_norm.weight,
               m.gate_proj.weight.t(), m.up_proj.weight.t(), m.down_proj.weight.t()]
    if use_conv:
        ac, mc = layer.attention_conv, layer.mlp_conv
        weights += [ac.kernel_projection.weight.t(), ac.base_kernel, mc.kernel_projection.weight.t(), mc.base_kernel]
    return _DrafterLayerNode.apply(layer, use_conv, act, h, cos, sin, ck, cv, cb, bb, *weights)


class DrafterBlockLayersGraph(DrafterBlockGraph):
    """:class:`DrafterBlockGraph` with each decoder layer one ``dflash2::DrafterLayer`` node in place of its ≈ 170
    small ones (ONNX Runtime with the dflash2 custom-op library; inside a decode loop the block costs 1.5–1.9 ms
    instead of 1.9 on SmolLM2's drafter, most of either being its weights read cold)."""

    def forward(self, anchor_ids, anchor_position, context_mask, *context):  # noqa: ANN001, ANN201
        act = _LAYER_ACTIVATIONS[self.drafter.config.hidden_act]
        node = lambda layer, *args: _layer_node(act, layer, *args)  # noqa: E731
        return self.drafter.block_forward(anchor_ids, anchor_position, list(context[0::2]), list(context[1::2]),
                                          context_mask > 0, layer_fn=node)


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
        unary, cand = self.drafter.top_candidates(rows, self.k)  # [B, L, K]
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


class DecomposedSelector(nn.Module):
    """Path selection (docs/design.md) as plain tensor ops: the drafter's own selector
    (:func:`dflash2_trt.model.selector.lattice` + :func:`~dflash2_trt.model.selector.walk`, unrolled over the L
    static rows, no Loop/If) with the codebooks as parameters (initializers).

    Inputs and outputs are those of the plugin contract (``selector_contract``): cand_ids [B, L, K] int32,
    unary [B, L, K] fp32, hidden_proj [B, L, r], anchor_ids [B] int32, temperature [B] fp32,
    uniforms [B, L] fp32 -> path_ids [B, L] int32, proposal_probs [B, L, K] fp32. Per sequence, T <= 0 takes
    the argmax path and T > 0 samples.
    """

    def __init__(self, pred_codebook: torch.Tensor, succ_codebook: torch.Tensor, mode: str) -> None:
        super().__init__()
        if mode not in SELECTOR_MODES:
            raise DFlash2Error(f"selector mode must be one of {', '.join(SELECTOR_MODES)}, got {mode!r}")
        self.mode = mode
        self.pred_codebook = nn.Parameter(pred_codebook.detach().clone(), requires_grad=False)  # [V, r]
        self.succ_codebook = nn.Parameter(succ_codebook.detach().clone(), requires_grad=False)  # [V, r]

    def forward(self, cand_ids, unary, hidden_proj, anchor_ids, temperature, uniforms):  # noqa: ANN001, ANN201
        cand = cand_ids.long()
        S = sel.lattice(cand, unary, hidden_proj, anchor_ids.long(), self.pred_codebook, self.succ_codebook)
        idx, q = sel.walk(S, self.mode, temperature, uniforms)
        path = torch.gather(cand, 2, idx.unsqueeze(-1))[..., 0]  # [B, L]
        return path.to(torch.int32), q
