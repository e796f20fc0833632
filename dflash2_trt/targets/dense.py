"""The dense decoder family: Llama, Mistral, Qwen2, Qwen3 (and SmolLM2, a Llama). Every layer is full attention,
so a request's state is its KV cache alone and a rollback to an accepted length is a crop of that cache.

What lives here: the model types, the exporter's check, the PyTorch cache a target adapter keeps (transformers'
``DynamicCache``) and its rollback, and :class:`TargetGraph`, the standard ONNX graph the exporter traces (the
TensorRT target engine's, and ONNX Runtime's where the fused flavour is not exported).

KV-cache convention of the graph -- a *capacity buffer* of C slots per layer::

    past  [B, kvh, C, d]   slots 0..n-1 hold positions 0..n-1; slots >= n are stale (masked out)
    mask  [B, C + S]       int64, 1 = slot valid (then 1 per new row)
    new   [B, kvh, S, d]   only the K/V of the S new rows are returned; the runtime writes them into
                           slots n..n+S-1 of its buffer, and "crops" by lowering n (no copy)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash2_trt.errors import DFlash2Error

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def layer_kinds(config: Any) -> list[str]:  # noqa: ARG001 - the same for every dense model
    """The kind of every decoder layer (:data:`dflash2_trt.targets.LAYER_KINDS`)."""
    return ["attention"] * int(config.num_hidden_layers)


def new_cache(model: Any) -> Any:
    """An empty per-request cache of ``model`` (a KV cache: :func:`rollback` crops it)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def before_forward(cache: Any, rows: int) -> None:  # noqa: ARG001 - nothing to settle in a KV cache
    """Nothing to do before a call: the cache holds positions, any of which a crop can drop."""


@functools.cache
def _crop_takes_a_count() -> bool:
    """transformers >= 5's ``crop`` takes a negative count of tokens to drop; 4.x took the new length."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def rollback(cache: Any, length: int) -> None:
    """Keep the K/V of positions < ``length`` only."""
    current = int(cache.get_seq_length())
    if length < current:
        cache.crop(length - current if _crop_takes_a_count() else length)


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


def _grouped_attention(q, k1, v1, k2, v2, bias1, bias2, scale: float, nh: int, kvh: int, d: int):  # noqa: ANN001, ANN202
    """softmax over [keys1 | keys2] without concatenating K/V; q [B, nh, S, d], k/v [B, kvh, *, d],
    biases [B, 1, rep*S, *] (additive, -inf = masked). Heads h = kv * rep + r share kv head kv, so grouped
    queries are folded into rows instead of repeating K/V (the drafter's Attention does the same)."""
    B, S = q.shape[0], q.shape[2]
    qg = q.reshape(B, kvh, (nh // kvh) * S, d)
    s1 = torch.matmul(qg, k1.transpose(2, 3)) * scale + bias1
    s2 = torch.matmul(qg, k2.transpose(2, 3)) * scale + bias2
    n1 = k1.shape[2]
    p = torch.softmax(torch.cat([s1, s2], dim=3).float(), dim=3).to(q.dtype)
    o = torch.matmul(p[:, :, :, :n1], v1) + torch.matmul(p[:, :, :, n1:], v2)
    return o.reshape(B, nh, S, d)


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, S] -> cos, sin [B, 1, S, 2 * len(inv_freq)] in the rotate_half layout (HF's tables)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, S, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype).unsqueeze(1), (emb.sin() * scaling).to(dtype).unsqueeze(1)


def attention_biases(attention_mask: torch.Tensor, C: int, rep: int, dtype: torch.dtype,
                     position_ids: torch.Tensor | None = None, window: int | None = None,
                     ring_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive biases (0 or -inf) of :func:`_grouped_attention` over a capacity buffer of C slots (slot j holds
    position j) and S new rows, from the mask [B, C + S]: past [B, 1, 1, C] (the same for every row) and new
    [B, 1, rep * S, S] (causal). With ``window`` (and the rows' ``position_ids``), keys are also limited to the last
    ``window`` positions of each row: past becomes [B, 1, rep * S, C]; with ``ring_positions`` [B, R] as well, the
    past keys are a ring of R slots instead, slot j holding position ``ring_positions[:, j]`` (-1: none)."""
    S = attention_mask.shape[1] - C
    neg, zero = torch.tensor(float("-inf"), dtype=dtype), torch.tensor(0.0, dtype=dtype)
    past_ok = attention_mask[:, :C] > 0  # [B, C]
    rows = torch.arange(S, device=attention_mask.device)
    own = (rows[:, None] == rows[None, :])[None]
    causal = torch.ones(S, S, dtype=torch.bool, device=attention_mask.device).tril()[None] & (
        (attention_mask[:, C:] > 0)[:, None, :] | own)  # [B, S, S]: new row s sees valid new rows <= s and itself
    # (itself always: a batch's padding row then has a key in every window, so no softmax is over nothing, whose NaN
    # would reach the valid rows through their zero weights on it)
    if window is None:
        return torch.where(past_ok, zero, neg)[:, None, None, :], \
            torch.where(causal, zero, neg).unsqueeze(1).repeat(1, 1, rep, 1)
    if ring_positions is None:
        slots = torch.arange(C, device=attention_mask.device)[None, None, :]
    else:
        past_ok, slots = ring_positions >= 0, ring_positions[:, None, :]
    near_past = position_ids[:, :, None] - slots < window  # [B, S, C or R]
    near_new = position_ids[:, :, None] - position_ids[:, None, :] < window  # [B, S, S]
    return (torch.where(past_ok[:, None, :] & near_past, zero, neg).unsqueeze(1).repeat(1, 1, rep, 1),
            torch.where(causal & near_new, zero, neg).unsqueeze(1).repeat(1, 1, rep, 1))


def context_features(taps: dict[int, torch.Tensor], normed: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """The graph's context_features [B, S, n * H]: the outputs of ``layer_ids`` concatenated, ``taps[i]`` decoder layer
    i's output (== HF hidden_states[i + 1]) for i < L - 1 and ``normed``, the final norm's output, for the last layer
    (HF's last hidden_states entry is after the final norm). Every family's graph ends with it."""
    taps[len(taps) - 1] = normed
    return torch.cat([taps[j] for j in layer_ids], dim=-1)


def check_exportable(hf_model) -> None:  # noqa: ANN001
    """The exporter's graphs compute this target exactly, else DFlash2Error saying what they do not."""
    cfg = hf_model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        raise DFlash2Error(f"target model_type {mt!r} is not supported by the exporter; supported: "
                           f"{', '.join(MODEL_TYPES)} (Llama / Qwen2 / Qwen3 decoder families)")
    check_attention_config(cfg)


def check_attention_config(cfg: Any) -> None:
    """What :class:`TargetGraph`'s attention and MLP compute (shared with the families built on it), else
    DFlash2Error saying what it does not."""
    mt = getattr(cfg, "model_type", None)
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise DFlash2Error(f"target hidden_act {act!r} is not supported (silu only)")
    if getattr(cfg, "use_sliding_window", False) or (mt == "mistral" and getattr(cfg, "sliding_window", None)):
        raise DFlash2Error("targets with sliding-window attention are not supported by the exporter")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rtype not in ("default", "linear", "llama3", "yarn"):
        raise DFlash2Error(f"target rope_type {rtype!r} is not supported (static RoPE variants only)")


def graph_io(hf_model: Any, batch: int, dtype: Any) -> tuple[tuple, list[str], list[str], dict]:
    """What the exporter traces :class:`TargetGraph` with (and the families whose graphs share its interface):
    example inputs (``batch`` rows of 3 new tokens over a KV capacity of 4), input and output names, dynamic axes."""
    from dflash2_trt.manifest import target_kv_names, target_present_names

    cfg = getattr(hf_model.config, "text_config", None) or hf_model.config  # a vision-language model: its LM's
    attn = next(layer.self_attn for layer in hf_model.get_decoder().layers)
    nl, kvh, d = int(cfg.num_hidden_layers), int(cfg.num_key_value_heads), int(attn.head_dim)
    kv_names, present = target_kv_names(nl), target_present_names(nl)
    dyn = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
           "attention_mask": {0: "batch", 1: "capacity_plus_sequence"}, "logits": {0: "batch", 1: "sequence"},
           "context_features": {0: "batch", 1: "sequence"}}
    dyn.update({n: {0: "batch", 2: "capacity"} for n in kv_names})
    dyn.update({n: {0: "batch", 2: "sequence"} for n in present})
    args = (torch.randint(0, int(cfg.vocab_size), (batch, 3)), torch.arange(3).repeat(batch, 1),
            torch.ones(batch, 4 + 3, dtype=torch.long), *[torch.zeros(batch, kvh, 4, d, dtype=dtype) for _ in kv_names])
    return args, ["input_ids", "position_ids", "attention_mask", *kv_names], ["logits", "context_features", *present], dyn


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
        self._check(hf_model)
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
        cos, sin = rope_tables(position_ids, self.inv_freq, self.attention_scaling, h.dtype)  # [B, 1, S, d]
        past_bias, new_bias = attention_biases(attention_mask, past[0].shape[2], self.nh // self.kvh, h.dtype)
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
            h = h + self._mlp(layer.mlp, x)
            present += [k, v]
            taps[i] = h  # decoder layer i's output == HF hidden_states[i + 1]
        h = _rms(h, self.norm.weight, self.eps)
        logits = self.lm_head(h).float()  # [B, S, V]
        return (logits, context_features(taps, h, self.layer_ids), *present)

    @staticmethod
    def _check(hf_model) -> None:  # noqa: ANN001
        """The family's export check (a family built on this graph overrides it with its own)."""
        check_exportable(hf_model)

    def _mlp(self, m, x):  # noqa: ANN001, ANN202
        """The layer's SwiGLU MLP (a family with other MLPs overrides it)."""
        return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
