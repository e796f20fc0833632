"""The sliding-window family: gpt-oss (transformers ``gpt_oss``: sliding and full attention layers alternating,
attention sinks, MoE MLPs) and Muse Glimmer (``muse_glimmer``: three sliding-window layers per full (NoPE) one,
gated attention, a soft-capped LM head). A sliding layer keeps only the keys and values of its window, so a verify
that may be rolled back records the whole call (:mod:`~dflash2_trt.targets.recorded`) and the rollback cuts it back
to the accepted length before the window is restored; full attention layers crop their KV.

Muse Glimmer is released as a vision-language model only: its folder loads as ``MuseGlimmerForConditionalGeneration``,
whose text path (token ids in, logits out) is the target (:func:`load_model`).

Export: :func:`TargetGraph` (:class:`MuseGlimmerGraph`, :class:`GptOssGraph`) keeps a full layer's keys and values in
the dense family's capacity buffers, and a sliding layer's in a ring buffer of ``ring_slots`` slots (the manifest's
``target.sliding_window``: the window plus the most rows a verify takes, so that a verify overwrites no key a
rollback into it needs; :class:`~dflash2_trt.runtime.kv.WindowRing` keeps it), whose ``window_positions`` input
says which position each slot holds: memory per sliding layer is bounded by the ring, whatever the context.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets import dense
from dflash2_trt.targets.dense import _grouped_attention, _rope, attention_biases, context_features, rope_tables
from dflash2_trt.targets.recorded import before_forward, new_cache, rollback

MODEL_TYPES = ("gpt_oss", "muse_glimmer")
_KINDS = {"full_attention": "attention", "sliding_attention": "sliding"}

__all__ = ["MODEL_TYPES", "TargetGraph", "before_forward", "check_exportable", "graph_io", "layer_kinds", "load_model",
           "new_cache", "rollback", "sliding_window_spec"]

# rows a verify may take beyond the window without a rollback into it losing a key (at least the block size)
VERIFY_ROWS = 16


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the (text) config's ``layer_types``."""
    cfg = _text_config(config)
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != int(cfg.num_hidden_layers) or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layer_types must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


def sliding_window_spec(config: Any, block_size: int) -> dict[str, int]:
    """The manifest's ``target.sliding_window``: the window, and ring slots for it plus the rows of a verify (the
    larger of :data:`VERIFY_ROWS` and ``block_size``)."""
    window = int(_text_config(config).sliding_window)
    return {"window": window, "ring_slots": window + max(VERIFY_ROWS, int(block_size))}


def graph_io(hf_model: Any, batch: int, dtype: Any) -> tuple[tuple, list[str], list[str], dict]:
    """The dense graph's inputs (:func:`dflash2_trt.targets.dense.graph_io`) with ``window_positions`` [B, R] after
    the mask, and a sliding layer's past K/V over the R ring slots (traced with R = 5 beside a capacity of 4)."""
    from dflash2_trt.manifest import TARGET_WINDOW_POSITIONS

    args, inputs, outputs, dyn = dense.graph_io(hf_model, batch, dtype)
    kinds = layer_kinds(hf_model.config)
    past = list(args[3:])
    for i, kind in enumerate(kinds):
        if kind == "sliding":
            past[2 * i: 2 * i + 2] = [torch.zeros(batch, *x.shape[1:2], 5, x.shape[3], dtype=dtype)
                                      for x in past[2 * i: 2 * i + 2]]
            for name in inputs[3 + 2 * i: 5 + 2 * i]:
                dyn[name] = {0: "batch", 2: "ring_slots"}
    ring = torch.tensor([[2, 3, -1, 0, 1]]).repeat(batch, 1)  # positions 0..3 in a ring, one slot empty
    dyn[TARGET_WINDOW_POSITIONS] = {0: "batch", 1: "ring_slots"}
    return ((*args[:3], ring, *past), [*inputs[:3], TARGET_WINDOW_POSITIONS, *inputs[3:]], outputs, dyn)


def load_model(folder: str, dtype: Any) -> Any:
    """The target model of a folder: gpt-oss as a causal LM; Muse Glimmer as its vision-language model (transformers
    has no text-only causal LM for it), decoding token ids through its language model."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    if cfg.model_type == "muse_glimmer":
        return transformers.MuseGlimmerForConditionalGeneration.from_pretrained(folder, dtype=dtype,
                                                                              use_safetensors=True)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)


def check_exportable(hf_model: Any) -> None:
    """The exporter's graph computes this target exactly, else DFlash2Error saying what it does not."""
    cfg = _text_config(hf_model.config)
    layer_kinds(cfg)
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    ropes = ("default", "yarn") if hf_model.config.model_type == "gpt_oss" else ("default",)
    if act != "silu" or rope not in ropes:
        raise DFlash2Error(f"target activation {act!r} / rope_type {rope!r} is not supported for "
                           f"{hf_model.config.model_type!r} (silu; {', '.join(ropes)})")


class _WindowedGraph(nn.Module):
    """What the sliding family's graphs share: the interface (:func:`graph_io`: the dense graph's, with the sliding
    layers' keys in rings whose slots hold the positions ``window_positions`` gives), RoPE tables, and the additive
    attention biases of full layers and of sliding layers, whose keys are limited to the last ``sliding_window``
    positions of each row.

    forward(input_ids [B, S], position_ids [B, S], attention_mask [B, C + S] (the full layers' slots and the new
            rows), window_positions [B, R] int64 (-1: an empty slot), *past (2 per layer: full [B, kvh, C, d], sliding
            [B, kvh, R, d]))
    -> logits [B, S, V] fp32, context_features, *present (the S new rows' K/V of every layer [B, kvh, S, d])."""

    def __init__(self, hf_model: Any, layer_ids: list[int]) -> None:
        super().__init__()
        check_exportable(hf_model)
        cfg = _text_config(hf_model.config)
        lm = hf_model.get_decoder()
        self.embed, self.layers, self.norm, self.lm_head = lm.embed_tokens, lm.layers, lm.norm, hf_model.lm_head
        self.layer_ids = list(layer_ids)
        self.sliding = [k == "sliding" for k in layer_kinds(cfg)]
        self.window = int(cfg.sliding_window)
        self.nh, self.kvh, self.d = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.head_dim)
        rot = lm.rotary_emb
        self.register_buffer("inv_freq", rot.inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = float(getattr(rot, "attention_scaling", 1.0))

    def _tables(self, h, position_ids, attention_mask, window_positions):  # noqa: ANN001, ANN202
        """(cos, sin [B, 1, S, d]), biases of full layers, biases of sliding layers (each: past [B, 1, rows, C or R],
        new [B, 1, rep * S, S]; grouped heads folded into rows as :func:`dflash2_trt.targets.dense._grouped_attention`
        takes them)."""
        rep, C = self.nh // self.kvh, attention_mask.shape[1] - h.shape[1]
        return (rope_tables(position_ids, self.inv_freq, self.attention_scaling, h.dtype),
                attention_biases(attention_mask, C, rep, h.dtype),
                attention_biases(attention_mask, C, rep, h.dtype, position_ids, self.window, window_positions))

    def forward(self, input_ids, position_ids, attention_mask, window_positions, *past):  # noqa: ANN001, ANN201
        h = self.embed(input_ids)
        rope, full, window = self._tables(h, position_ids, attention_mask, window_positions)
        taps, present = {}, []
        for i, layer in enumerate(self.layers):
            h, k, v = self._layer(i, layer, h, rope, window if self.sliding[i] else full, past[2 * i], past[2 * i + 1])
            present += [k, v]
            taps[i] = h
        h = self.norm(h)
        return (self._logits(h), context_features(taps, h, self.layer_ids), *present)


class MuseGlimmerGraph(_WindowedGraph):
    """Muse Glimmer's text path: normed embeddings; per layer q/k RMS-normed without scale (q times
    ``qk_scale_factor``), RoPE on the layers whose ``layer_rope_theta`` is non-zero, the attention output gated by a
    sigmoid of its own projection, norms after attention and MLP as well as before; the final norm and the LM head's
    logits soft-capped: ``cap * tanh(logits * output_multiplier / cap)``."""

    def __init__(self, hf_model: Any, layer_ids: list[int]) -> None:
        super().__init__(hf_model, layer_ids)
        cfg = _text_config(hf_model.config)
        self.rope_on = [bool(t) for t in cfg.layer_rope_theta]
        self.mult, self.cap = float(cfg.output_multiplier), float(cfg.final_logit_softcapping)

    def _layer(self, i, layer, h, rope, bias, pk, pv):  # noqa: ANN001, ANN202
        B, S = h.shape[0], h.shape[1]
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.qk_norm(a.q_proj(x).view(B, S, self.nh, self.d).transpose(1, 2)) * a.qk_scale_factor
        k = a.qk_norm(a.k_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2))
        v = a.v_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2)
        if self.rope_on[i]:
            q, k = _rope(q, *rope, self.d), _rope(k, *rope, self.d)
        o = _grouped_attention(q, pk, pv, k, v, *bias, float(a.scaling), self.nh, self.kvh, self.d)
        o = o.transpose(1, 2).reshape(B, S, self.nh * self.d) * torch.sigmoid(a.gate_proj(x))
        h = h + layer.post_attention_layernorm(a.o_proj(o))
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h))), k, v

    def _logits(self, h):  # noqa: ANN001, ANN202
        return torch.tanh(self.lm_head(h).float() * self.mult / self.cap) * self.cap


class GptOssGraph(_WindowedGraph):
    """gpt-oss: biased projections, RoPE (yarn) on every layer, attention sinks (one learned logit per head joining
    each row's softmax, its share dropped), and MoE MLPs routed as transformers does: top k of the router's biased
    logits, softmax over those k; each chosen expert's interleaved gate / up halves clamped to ``swiglu_limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``, biased down projection."""

    def _layer(self, i, layer, h, rope, bias, pk, pv):  # noqa: ANN001, ANN202
        B, S = h.shape[0], h.shape[1]
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = _rope(a.q_proj(x).view(B, S, self.nh, self.d).transpose(1, 2), *rope, self.d)
        k = _rope(a.k_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2), *rope, self.d)
        v = a.v_proj(x).view(B, S, self.kvh, self.d).transpose(1, 2)
        o = self._sink_attention(q, pk, pv, k, v, bias, a)
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * self.d))
        return h + self._experts(layer.mlp, layer.post_attention_layernorm(h)), k, v

    def _sink_attention(self, q, k1, v1, k2, v2, bias, a):  # noqa: ANN001, ANN202
        """:func:`~dflash2_trt.targets.dense._grouped_attention` with each head's sink logit as one more column of
        its softmax (dropped after it)."""
        B, S = q.shape[0], q.shape[2]
        rep = self.nh // self.kvh
        qg = q.reshape(B, self.kvh, rep * S, self.d)
        s1 = torch.matmul(qg, k1.transpose(2, 3)) * float(a.scaling) + bias[0]
        s2 = torch.matmul(qg, k2.transpose(2, 3)) * float(a.scaling) + bias[1]
        sink = a.sinks.to(q.dtype).view(1, self.kvh, rep, 1, 1).expand(B, self.kvh, rep, S, 1)
        sink = sink.reshape(B, self.kvh, rep * S, 1)
        n1 = k1.shape[2]
        p = torch.softmax(torch.cat([s1, s2, sink], dim=3), dim=3)
        o = torch.matmul(p[:, :, :, :n1], v1) + torch.matmul(p[:, :, :, n1:-1], v2)
        return o.reshape(B, self.nh, S, self.d)

    @staticmethod
    def _experts(mlp, x):  # noqa: ANN001, ANN205
        B, S, H = x.shape
        t = x.reshape(-1, H)
        r, ex = mlp.router, mlp.experts
        top, idx = torch.topk(torch.nn.functional.linear(t, r.weight, r.bias), r.top_k, dim=-1)  # [T, k]
        w = torch.softmax(top, dim=1)
        gu = torch.matmul(t[:, None, None, :], ex.gate_up_proj[idx])[:, :, 0] + ex.gate_up_proj_bias[idx]  # [T, k, 2I]
        gate = gu[..., 0::2].clamp(max=ex.limit)
        up = gu[..., 1::2].clamp(min=-ex.limit, max=ex.limit)
        hidden = (up + 1) * (gate * torch.sigmoid(gate * ex.alpha))
        out = torch.matmul(hidden[:, :, None, :], ex.down_proj[idx])[:, :, 0] + ex.down_proj_bias[idx]  # [T, k, H]
        return (out * w[..., None]).sum(dim=1).reshape(B, S, H)

    def _logits(self, h):  # noqa: ANN001, ANN202
        return self.lm_head(h).float()


def TargetGraph(hf_model: Any, layer_ids: list[int]) -> nn.Module:  # noqa: N802 - the family's graph, as in the others
    """The graph of this family's target (:class:`MuseGlimmerGraph` or :class:`GptOssGraph`)."""
    graph = MuseGlimmerGraph if hf_model.config.model_type == "muse_glimmer" else GptOssGraph
    return graph(hf_model, layer_ids)
