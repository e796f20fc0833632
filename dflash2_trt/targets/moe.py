"""The dense mixture-of-experts family: Qwen3-MoE (transformers ``qwen3_moe``). Full attention in every layer (a
KV cache, cropped after a rejected draft, as the dense family's) and routed experts in the MLPs: top-k routing per
token, exactly transformers' own. Export: not implemented for this family (:func:`check_exportable` says so); the
PyTorch adapter decodes it.
"""

from __future__ import annotations

from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.dense import before_forward, layer_kinds, new_cache, rollback

MODEL_TYPES = ("qwen3_moe",)

__all__ = ["MODEL_TYPES", "before_forward", "check_exportable", "layer_kinds", "new_cache", "rollback"]


def check_exportable(hf_model: Any) -> None:
    """The exporter has no graphs for mixture-of-experts MLPs yet."""
    raise DFlash2Error(f"dflash2 export does not support {hf_model.config.model_type!r} targets yet (mixture-of-experts "
                       f"MLPs; they decode with the PyTorch reference: dflash2 generate --target ... --drafter ...)")
