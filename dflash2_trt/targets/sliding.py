"""The sliding-window family: gpt-oss (transformers ``gpt_oss``: sliding and full attention layers alternating,
attention sinks, MoE MLPs) and Muse Glimmer (``muse_glimmer``: three sliding-window layers per full (NoPE) one,
gated attention, a soft-capped LM head). A sliding layer keeps only the keys and values of its window, so a verify
that may be rolled back records the whole call (:mod:`~dflash2_trt.targets.recorded`) and the rollback cuts it back
to the accepted length before the window is restored; full attention layers crop their KV.

Muse Glimmer is released as a vision-language model only: its folder loads as ``MuseGlimmerForConditionalGeneration``,
whose text path (token ids in, logits out) is the target (:func:`load_model`). Export: not implemented for this
family (:func:`check_exportable` says so); the PyTorch adapter decodes it.
"""

from __future__ import annotations

from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.recorded import before_forward, new_cache, rollback

MODEL_TYPES = ("gpt_oss", "muse_glimmer")
_KINDS = {"full_attention": "attention", "sliding_attention": "sliding"}

__all__ = ["MODEL_TYPES", "before_forward", "check_exportable", "layer_kinds", "load_model", "new_cache", "rollback"]


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the (text) config's ``layer_types``."""
    cfg = _text_config(config)
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != int(cfg.num_hidden_layers) or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layer_types must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


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
    """The exporter has no graphs for sliding windows yet."""
    raise DFlash2Error(f"dflash2 export does not support {hf_model.config.model_type!r} targets yet (sliding-window "
                       f"attention; they decode with the PyTorch reference: dflash2 generate --target ... --drafter ...)")
