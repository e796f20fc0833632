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

Export: not implemented for this family (:func:`check_exportable` says so); the PyTorch adapter decodes it.
"""

from __future__ import annotations

from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.recorded import MAX_ROLLBACK_ROWS, before_forward, new_cache, rollback

__all__ = ["MODEL_TYPES", "MAX_ROLLBACK_ROWS", "before_forward", "check_exportable", "layer_kinds", "new_cache",
           "rollback"]

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
_KINDS = {"full_attention": "attention", "linear_attention": "linear"}


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the config's ``layer_types``."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != int(config.num_hidden_layers) or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layer_types must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


def check_exportable(hf_model: Any) -> None:
    """The exporter has no graphs for this family yet."""
    raise DFlash2Error(f"dflash2 export does not support {hf_model.config.model_type!r} targets yet (hybrid Gated "
                       f"DeltaNet models decode with the PyTorch reference: dflash2 generate --target ... --drafter ...)")
