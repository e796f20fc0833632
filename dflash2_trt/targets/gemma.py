"""The Gemma 4 family (transformers ``gemma4`` / ``gemma4_text``): sliding-window layers (five per global one in the
released models) with their own head size and RoPE, global layers with a larger head size, a partial
("proportional") RoPE and, where ``attention_k_eq_v`` says so, keys that are also the values; the last
``num_kv_shared_layers`` layers compute no keys or values of their own but attend over those of the last earlier
layer of their type; q / k RMS-normed with scale, v without, attention unscaled (scaling 1); norms after attention
and MLP as well as before; the embedding multiplied by sqrt(hidden); the logits soft-capped
(``cap * tanh(logits / cap)``).

A module of its own rather than a third graph of :mod:`~dflash2_trt.targets.sliding`: the per-layer head sizes,
key/value sharing between layers and per-layer-type RoPE change what the graph's interface holds per layer, not
only the layer's arithmetic. The PyTorch cache is the one the sliding family keeps
(:mod:`~dflash2_trt.targets.recorded`: a sliding layer records the whole call beyond its window, so a verify rolls
back to any accepted length); a shared layer has no cache (transformers keeps a placeholder for it), it reads the
keys and values its source layer produced in the same call.

The multimodal folder (``Gemma4ForConditionalGeneration``) loads as its text model: :func:`load_model` maps the
language model's weights onto ``Gemma4ForCausalLM`` (the vision and audio towers are not loaded).

Export: :class:`TargetGraph` has the sliding family's interface (:func:`graph_io`: full layers' keys in capacity
buffers, sliding layers' in rings, ``window_positions``), with every layer's keys and values in one buffer shape
(:func:`kv_layout`: a layer's ``kvh * d`` values per position folded into ``[KVH, D]`` of the widest head, zero-padded),
so the runtimes' uniform KV buffers hold every layer. A shared layer outputs its source layer's new keys and values
as its own ``present`` and reads its own buffer, which the runtime therefore keeps equal to its source's (the memory
of a copy per shared layer, for an interface no runtime needed to change). MoE layers (the 26B-A4B's: an MLP and
routed experts side by side) route as graph ops (:func:`_feed_forward`). :func:`check_exportable` refuses what the
graph does not compute (per-layer-input embeddings, bidirectional attention) in one line; the PyTorch adapter
(transformers' own modules) runs those.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.dense import _grouped_attention, _rope, attention_biases, context_features, rope_tables
from dflash2_trt.targets.recorded import before_forward, new_cache, rollback
from dflash2_trt.targets.sliding import VERIFY_ROWS, _text_config, layer_kinds, sliding_window_spec

MODEL_TYPES = ("gemma4", "gemma4_text")
# the multimodal checkpoint's language model -> Gemma4ForCausalLM's decoder
_TEXT_PREFIX = {r"^model\.language_model\.": "model."}

__all__ = ["MODEL_TYPES", "VERIFY_ROWS", "TargetGraph", "before_forward", "check_exportable", "drafter_fields",
           "drafter_heads", "graph_io", "kv_layout", "kv_sources", "layer_kinds", "load_model", "new_cache", "rollback",
           "sliding_window_spec"]


def kv_sources(config: Any) -> list[int]:
    """For every layer, the layer whose keys and values it attends over: itself, or for a shared layer (one of the
    last ``num_kv_shared_layers``) the last earlier unshared layer of its type (transformers' ``kv_sharing_modes``:
    that layer "stores", the shared ones "reuse")."""
    cfg = _text_config(config)
    types, n = list(cfg.layer_types), int(cfg.num_hidden_layers)
    first_shared = n - int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    out = []
    for i in range(n):
        if i < first_shared:
            out.append(i)
            continue
        src = [j for j in range(first_shared) if types[j] == types[i]]
        if not src:
            raise DFlash2Error(f"target layer {i} ({types[i]}) shares the keys and values of an earlier layer of its "
                               f"type, and there is none before layer {first_shared}")
        out.append(src[-1])
    return out


def drafter_fields(config: Any) -> dict[str, float | None]:
    """What a drafter sharing this target's embedding and LM head must apply as the target does: the embedding's
    sqrt(hidden) scale and the logits' soft cap (z-lab's Gemma 4 drafters take both from the target)."""
    cfg = _text_config(config)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return {"input_embedding_scale": float(cfg.hidden_size) ** 0.5,
            "final_logit_softcapping": float(cap) if cap else None}


def drafter_heads(config: Any) -> tuple[int, int]:
    """(kv heads, head size) of a drafter trained here for this target: its sliding layers' (the first layer's)."""
    first = _text_config(config).per_layer_config[0]
    return int(first.num_key_value_heads), int(first.head_dim)


def load_model(folder: str, dtype: Any) -> Any:
    """The text model of a folder: ``Gemma4ForCausalLM``, from a text-only checkpoint or from the language model of a
    multimodal one (every text weight must be found: a missing one is refused, not left random)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    if cfg.model_type == "gemma4_text":
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    model, info = transformers.Gemma4ForCausalLM.from_pretrained(
        folder, config=cfg.text_config, dtype=dtype, use_safetensors=True, key_mapping=dict(_TEXT_PREFIX),
        output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing:
        raise DFlash2Error(f"target {folder}: the language model's weights {sorted(missing)[:4]} are missing "
                           f"({len(missing)} in all)")
    return model


def check_exportable(hf_model: Any) -> None:
    """The exporter's graph computes this target exactly, else DFlash2Error saying what it does not."""
    cfg = _text_config(hf_model.config)
    layer_kinds(cfg)
    kv_sources(cfg)
    off = [name for name, on in (("per-layer-input embeddings", getattr(cfg, "hidden_size_per_layer_input", 0)),
                                 ("bidirectional attention", getattr(cfg, "use_bidirectional_attention", None)))
           if on]
    ropes = {t: (p or {}).get("rope_type", "default") for t, p in (cfg.rope_parameters or {}).items()}
    if off or any(r not in ("default", "proportional") for r in ropes.values()):
        raise DFlash2Error(f"target {hf_model.config.model_type!r} is not exportable: the graph computes no "
                           f"{', '.join(off) or 'rope_type ' + str(ropes)} (the PyTorch reference runs it)")


def _heads(hf_model: Any) -> list[tuple[int, int]]:
    """(kv heads, head size) of every layer, as transformers built it."""
    nh = int(_text_config(hf_model.config).num_attention_heads)
    return [(nh // int(layer.self_attn.num_key_value_groups), int(layer.self_attn.head_dim))
            for layer in hf_model.get_decoder().layers]


def kv_layout(config: Any) -> tuple[int, int]:
    """(KVH, D) of the graph's KV buffers: D the widest head, KVH the fewest heads of D holding any layer's
    ``kvh * d`` values per position (each layer's from transformers' per-layer config)."""
    cfg = _text_config(config)
    layers = [cfg.per_layer_config[i] for i in range(int(cfg.num_hidden_layers))]
    D = max(int(c.head_dim) for c in layers)
    return -(-max(int(c.num_key_value_heads) * int(c.head_dim) for c in layers) // D), D


def _fold(x: torch.Tensor, KVH: int, D: int) -> torch.Tensor:
    """[B, kvh, n, d] -> [B, KVH, n, D]: each position's kvh * d values, zero-padded to KVH * D."""
    B, kvh, n, d = x.shape
    flat = x.transpose(1, 2).reshape(B, n, kvh * d)
    if kvh * d < KVH * D:
        flat = torch.cat([flat, torch.zeros(B, n, KVH * D - kvh * d, dtype=x.dtype)], dim=2)
    return flat.reshape(B, n, KVH, D).transpose(1, 2)


def _unfold(x: torch.Tensor, kvh: int, d: int) -> torch.Tensor:
    """[B, KVH, n, D] -> [B, kvh, n, d] (the first kvh * d values of each position)."""
    B, KVH, n, D = x.shape
    flat = x.transpose(1, 2).reshape(B, n, KVH * D)
    return flat[:, :, :kvh * d].reshape(B, n, kvh, d).transpose(1, 2)


def graph_io(hf_model: Any, batch: int, dtype: Any) -> tuple[tuple, list[str], list[str], dict]:
    """The sliding family's graph inputs (:func:`dflash2_trt.targets.sliding.graph_io`) with every layer's past in
    the :func:`kv_layout` shape: full layers [B, KVH, 4, D], sliding layers' rings [B, KVH, 5, D]."""
    from dflash2_trt.manifest import TARGET_WINDOW_POSITIONS, target_kv_names, target_present_names

    cfg = _text_config(hf_model.config)
    nl, kinds = int(cfg.num_hidden_layers), layer_kinds(cfg)
    KVH, D = kv_layout(cfg)
    kv_names, present = target_kv_names(nl), target_present_names(nl)
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
           "attention_mask": {0: "batch", 1: "capacity_plus_sequence"}, "logits": {0: "batch", 1: "sequence"},
           "context_features": {0: "batch", 1: "sequence"}, TARGET_WINDOW_POSITIONS: {0: "batch", 1: "ring_slots"}}
    for i, kind in enumerate(kinds):
        for name in kv_names[2 * i: 2 * i + 2]:
            dyn[name] = {0: "batch", 2: "ring_slots" if kind == "sliding" else "capacity"}
    dyn.update({n: {0: "batch", 2: "sequence"} for n in present})
    past = [torch.zeros(batch, KVH, 5 if kinds[i // 2] == "sliding" else 4, D, dtype=dtype) for i in range(2 * nl)]
    ring = torch.tensor([[2, 3, -1, 0, 1]]).repeat(batch, 1)  # positions 0..3 in a ring, one slot empty
    args = (torch.randint(0, int(cfg.vocab_size), (batch, 3)), torch.arange(3).repeat(batch, 1),
            torch.ones(batch, 4 + 3, dtype=torch.long), ring, *past)
    return (args, ["input_ids", "position_ids", "attention_mask", TARGET_WINDOW_POSITIONS, *kv_names],
            ["logits", "context_features", *present], dyn)


def _feed_forward(layer: Any, h: torch.Tensor) -> torch.Tensor:
    """A decoder layer's feed-forward output before its post-norm (transformers' Gemma4TextDecoderLayer): the MLP, and
    in a MoE layer (the 26B-A4B's) beside it the routed experts over the same residual -- the router (an unscaled
    RMS norm, its scale times hidden^-1/2, softmax, top k renormalised, times each chosen expert's scale) and the
    chosen experts' gated MLPs gathered (no loop over experts, no data-dependent shapes), each branch post-normed."""
    x = layer.mlp(layer.pre_feedforward_layernorm(h))  # [B, S, H]
    if not getattr(layer, "enable_moe_block", False):
        return x
    B, S, H = h.shape
    t = h.reshape(-1, H)  # [T, H]
    r, ex = layer.router, layer.experts
    z = r.norm(t) * r.scale * r.scalar_root_size
    probs = torch.softmax(r.proj(z).float(), dim=-1)  # [T, E]
    top, idx = torch.topk(probs, int(r.config.top_k_experts), dim=-1)  # [T, k]
    top = (top / top.sum(dim=-1, keepdim=True) * r.per_expert_scale[idx]).to(h.dtype)
    u = layer.pre_feedforward_layernorm_2(t)
    gu = torch.matmul(ex.gate_up_proj[idx], u[:, None, :, None])[..., 0]  # [T, k, 2I]
    inter = gu.shape[-1] // 2
    hidden = ex.act_fn(gu[..., :inter]) * gu[..., inter:]
    routed = (torch.matmul(ex.down_proj[idx], hidden[..., None])[..., 0] * top[..., None]).sum(dim=1)  # [T, H]
    return layer.post_feedforward_layernorm_1(x) + layer.post_feedforward_layernorm_2(routed.reshape(B, S, H))


class TargetGraph(nn.Module):
    """Gemma 4's text model with explicit caches (the interface of :func:`graph_io`).

    forward(input_ids [B, S], position_ids [B, S], attention_mask [B, C + S], window_positions [B, R] int64 (-1: an
            empty slot), *past (2 per layer, [B, KVH, C or R, D]: :func:`kv_layout`))
    -> logits [B, S, V] fp32 (soft-capped), context_features, *present (the S new rows' K/V of every layer
       [B, KVH, S, D]; a shared layer's are its source layer's)."""

    def __init__(self, hf_model: Any, layer_ids: list[int]) -> None:
        super().__init__()
        check_exportable(hf_model)
        cfg = _text_config(hf_model.config)
        lm = hf_model.get_decoder()
        self.embed, self.layers, self.norm, self.lm_head = lm.embed_tokens, lm.layers, lm.norm, hf_model.lm_head
        self.layer_ids = list(layer_ids)
        self.types = list(cfg.layer_types)
        self.sliding = [k == "sliding" for k in layer_kinds(cfg)]
        self.sources = kv_sources(cfg)
        self.heads = _heads(hf_model)
        self.kv = kv_layout(cfg)
        self.window, self.nh = int(cfg.sliding_window), int(cfg.num_attention_heads)
        cap = getattr(cfg, "final_logit_softcapping", None)
        self.cap = float(cap) if cap else None
        rot = lm.rotary_emb
        for t in sorted(set(self.types)):
            self.register_buffer(f"{t}_inv_freq", getattr(rot, f"{t}_inv_freq").detach().float().clone(),
                                 persistent=False)
        self.rope_scaling = {t: float(getattr(rot, f"{t}_attention_scaling", 1.0)) for t in set(self.types)}

    def forward(self, input_ids, position_ids, attention_mask, window_positions, *past):  # noqa: ANN001, ANN201
        B, S = input_ids.shape
        h = self.embed(input_ids)  # [B, S, H], scaled by sqrt(H)
        C = attention_mask.shape[1] - S
        rope = {t: rope_tables(position_ids, getattr(self, f"{t}_inv_freq"), self.rope_scaling[t], h.dtype)
                for t in set(self.types)}
        biases: dict = {}
        new: dict = {}
        taps, present = {}, []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            kvh, d = self.heads[i]
            rep = self.nh // kvh
            if (self.sliding[i], rep) not in biases:
                biases[(self.sliding[i], rep)] = attention_biases(
                    attention_mask, C, rep, h.dtype, position_ids, self.window, window_positions) \
                    if self.sliding[i] else attention_biases(attention_mask, C, rep, h.dtype)
            cos, sin = rope[self.types[i]]
            x = layer.input_layernorm(h)
            q = _rope(a.q_norm(a.q_proj(x).view(B, S, self.nh, d)).transpose(1, 2), cos, sin, d)
            if self.sources[i] == i:
                kr = a.k_proj(x).view(B, S, kvh, d)
                vr = a.v_proj(x).view(B, S, kvh, d) if a.v_proj is not None else kr  # keys = values
                new[i] = (_rope(a.k_norm(kr).transpose(1, 2), cos, sin, d), a.v_norm(vr).transpose(1, 2))
            k, v = new[self.sources[i]]
            pk, pv = _unfold(past[2 * i], kvh, d), _unfold(past[2 * i + 1], kvh, d)
            o = _grouped_attention(q, pk, pv, k, v, *biases[(self.sliding[i], rep)], 1.0, self.nh, kvh, d)
            h = h + layer.post_attention_layernorm(a.o_proj(o.transpose(1, 2).reshape(B, S, self.nh * d)))
            h = h + layer.post_feedforward_layernorm(_feed_forward(layer, h))
            h = h * layer.layer_scalar
            present += [_fold(k, *self.kv), _fold(v, *self.kv)]
            taps[i] = h
        h = self.norm(h)
        logits = self.lm_head(h).float()
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return (logits, context_features(taps, h, self.layer_ids), *present)
