"""Caches that record every row of a call so that the call can be rolled back to any accepted length: what
transformers calls past recording (``DynamicCache.activate_past_recording``). A linear-attention layer keeps the
convolution's inputs of the whole call and the recurrent state after each of its last ``recurrent_states_to_keep``
rows; a sliding-window layer keeps the keys and values of the whole call beyond its window. :func:`before_forward`
settles the last call (only what the next call reads is kept), :func:`rollback` picks the state of the accepted
length. Shared by the families whose layers are not a plain cache of positions (hybrid, sliding).
"""

from __future__ import annotations

from typing import Any

from dflash2_trt.errors import DFlash2Error

MAX_ROLLBACK_ROWS = 64  # rows of a call whose every intermediate state is kept (a verify: block size <= 64)


def new_cache(model: Any) -> Any:
    """An empty per-request cache that records the states a rollback of the last call needs."""
    from transformers import DynamicCache

    if not hasattr(DynamicCache, "activate_past_recording"):
        raise DFlash2Error("this target needs a transformers that records its states for rollback "
                           "(DynamicCache.activate_past_recording; transformers >= 5.25)")
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording(recurrent_states_to_keep=MAX_ROLLBACK_ROWS)
    cache.dflash2_kept = 0  # rows of the last call whose states were recorded
    return cache


def before_forward(cache: Any, rows: int) -> None:
    """Settle the last call (keep only the states the next call reads) and record every state of a call of ``rows``
    rows when it may be rolled back."""
    if cache.get_seq_length() > 0:
        cache.crop(0)  # drops the last call's recorded history: conv states to the kernel, windows to the window
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
