"""The hybrid family: Qwen3.5 / Qwen3.6 / Qwen3.8 (transformers ``qwen3_5``, ``qwen3_5_moe``) and Qwen3-Next
(``qwen3_next``): Gated DeltaNet linear-attention layers interleaved with gated full-attention layers (the MoE
variants with routed and shared experts in the MLP).

A linear layer's state is not a cache of positions: a short causal depthwise convolution keeps its last
``conv_kernel - 1`` inputs, and the delta rule keeps one recurrent matrix per head, both overwritten by every row.
After a verify of k rows accepts j < k drafts, the state must be the state after exactly j + 1 rows, so a call
that may be rolled back records the state after each of its rows (transformers' past recording:
``DynamicCache.activate_past_recording`` with the number of recurrent states to keep, computed row by row, and
the convolution's inputs of the whole call) and :func:`rollback` picks the one of the accepted length; the
attention layers crop their KV as the dense family does. Calls of more than :data:`MAX_ROLLBACK_ROWS` rows (a
long prompt) are never rolled back and run transformers' chunked kernel.

Export: not implemented for this family (:func:`check_exportable` says so); the PyTorch adapter decodes it.
"""

from __future__ import annotations

from typing import Any

from dflash2_trt.errors import DFlash2Error

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MAX_ROLLBACK_ROWS = 64  # rows of a call whose every intermediate state is kept (a verify: block size <= 64)
_KINDS = {"full_attention": "attention", "linear_attention": "linear"}


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the config's ``layer_types``."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != int(config.num_hidden_layers) or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layer_types must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


def new_cache(model: Any) -> Any:
    """An empty per-request cache that records the states a rollback of the last call needs."""
    from transformers import DynamicCache

    if not hasattr(DynamicCache, "activate_past_recording"):
        raise DFlash2Error("hybrid targets need a transformers that records linear-attention states for rollback "
                           "(DynamicCache.activate_past_recording; transformers >= 5.25)")
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording(recurrent_states_to_keep=MAX_ROLLBACK_ROWS)
    cache.dflash2_kept = 0  # rows of the last call whose states were recorded
    return cache


def before_forward(cache: Any, rows: int) -> None:
    """Settle the last call (keep only the states the next call reads) and record every state of a call of ``rows``
    rows when it may be rolled back."""
    if cache.get_seq_length() > 0:
        cache.crop(0)  # drops the last call's recorded history; conv states back to the kernel's length
    keep = rows if rows <= MAX_ROLLBACK_ROWS else 0
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states_to_keep"):
            layer.recurrent_states_to_keep = keep
    cache.dflash2_kept = keep


def rollback(cache: Any, length: int) -> None:
    """Return every layer's state to the first ``length`` positions (at most the last call's rows removed)."""
    remove = int(cache.get_seq_length()) - length
    if remove <= 0:
        return
    if remove > cache.dflash2_kept:
        raise DFlash2Error(f"cannot roll back {remove} rows: the last call recorded the states of "
                           f"{cache.dflash2_kept} (calls of more than {MAX_ROLLBACK_ROWS} rows are not recorded)")
    cache.crop(-remove)
    cache.dflash2_kept = 0


def check_exportable(hf_model: Any) -> None:
    """The exporter has no graphs for this family yet."""
    raise DFlash2Error(f"dflash2 export does not support {hf_model.config.model_type!r} targets yet (hybrid Gated "
                       f"DeltaNet models decode with the PyTorch reference: dflash2 generate --target ... --drafter ...)")
