"""Target families: one module per family of target architectures (``dense``: Llama / Mistral / Qwen2 / Qwen3;
``hybrid``: Gated DeltaNet, the Qwen3.5 family; ``moe``: Qwen3-MoE; ``sliding``: gpt-oss, Muse Glimmer;
``gemma``: Gemma 4; ``nemotron_h``: Mamba-2, MoE and attention layers, NVIDIA's Nemotron-H; and ``recorded``, the
past-recording cache the hybrid, sliding, gemma and nemotron_h families share),
chosen by the HF config's ``model_type`` (:func:`family_for`). Each family module holds what differs between
families, with transformers' own modules as the reference:

* ``MODEL_TYPES`` -- the HF ``model_type`` values it serves;
* ``layer_kinds(config)`` -- the kind of every decoder layer (:data:`LAYER_KINDS`);
* ``new_cache(model)``, ``before_forward(cache, rows)``, ``rollback(cache, length)`` -- the per-request
  state the PyTorch target adapter keeps, and how it returns to any accepted length of the last call (a KV crop for
  attention layers; for linear-attention layers the recorded convolution and recurrent states);
* ``check_exportable(hf_model)`` and the family's graphs -- what ``dflash2 export`` traces;
* optionally ``load_model(folder, dtype)`` -- where transformers has no causal LM class for the model type.

The PyTorch target adapter itself, ``adapter`` (:class:`~dflash2_trt.targets.adapter.TargetModel`: a local HF
causal LM or GGUF file of a supported family, logits + context features + cache), lives beside the families and
takes its family from :func:`family_for`.

Owns: the target adapter, the per-family adapter parts, state shapes and target graphs. May import torch and
transformers (lazily), ``errors``, ``vocabulary``, ``config`` and ``paths``; never the runtime, export, train or
bench packages (export imports the families, not the reverse).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import LAYER_KINDS

__all__ = ["LAYER_KINDS", "family_for", "supported_model_types"]


def _modules() -> dict[str, ModuleType]:
    from dflash2_trt.targets import dense, gemma, hybrid, moe, nemotron_h, sliding

    return {"dense": dense, "hybrid": hybrid, "moe": moe, "sliding": sliding, "gemma": gemma,
            "nemotron_h": nemotron_h}


def family_for(config: Any) -> ModuleType:
    """The family module of an HF config (by its ``model_type``), else DFlash2Error listing the supported types."""
    mt = getattr(config, "model_type", None)
    for mod in _modules().values():
        if mt in mod.MODEL_TYPES:
            return mod
    raise DFlash2Error(f"target model_type {mt!r} is not supported; supported: {', '.join(supported_model_types())}")


def supported_model_types() -> list[str]:
    """Every model_type some family serves, by family."""
    return [t for mod in _modules().values() for t in mod.MODEL_TYPES]
