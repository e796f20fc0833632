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

Export: not yet. :func:`check_exportable` refuses every Gemma 4 target in one line, so ``dflash2 export`` stops before
tracing anything; the PyTorch adapter (transformers' own modules: per-layer-input embeddings and MoE blocks included)
is the only runtime.
"""

from __future__ import annotations

from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets.recorded import before_forward, new_cache, rollback

MODEL_TYPES = ("gemma4", "gemma4_text")
_KINDS = {"full_attention": "attention", "sliding_attention": "sliding"}
# the multimodal checkpoint's language model -> Gemma4ForCausalLM's decoder
_TEXT_PREFIX = {r"^model\.language_model\.": "model."}

__all__ = ["MODEL_TYPES", "before_forward", "check_exportable", "drafter_fields", "kv_sources", "layer_kinds",
           "load_model", "new_cache", "rollback"]


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer, from the (text) config's ``layer_types``."""
    cfg = _text_config(config)
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != int(cfg.num_hidden_layers) or any(t not in _KINDS for t in types):
        raise DFlash2Error(f"target layer_types must list one of {', '.join(_KINDS)} per layer, got {types}")
    return [_KINDS[t] for t in types]


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
    """Always DFlash2Error: no graph of this family is written yet (its per-layer head sizes and shared keys and values
    need an interface the runtimes' uniform KV buffers do not have)."""
    raise DFlash2Error(f"target model_type {hf_model.config.model_type!r} (Gemma 4) is not exportable yet: it runs on "
                       "the PyTorch reference only (dflash2 generate --target --drafter)")
