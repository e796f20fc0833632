"""DFlash2Config: every field of docs/design.md, read/written as a HF ``config.json``.

Two on-disk layouts are understood:

* DFlash 2 (``architectures: ["DFlash2DraftModel"]``): Qwen3-style fields plus a ``dflash_config`` block.
* DFlash v1 (``architectures: ["DFlashDraftModel"]``): same, ``block_size`` may sit at top level, no
  convolution/selector tensors (``use_conv`` and ``use_selector`` are then False).

Reading follows z-lab's loaders (their ``DFlash2DraftModel`` builds on transformers' ``Qwen3Config``): RoPE θ
from ``rope_parameters.rope_theta`` (transformers 5) or a top-level ``rope_theta`` (transformers 4, with an
optional ``rope_scaling``); ``use_sliding_window: false`` turns the window off; ``dflash_config`` values
win over top-level ones; ``final_logit_softcapping`` 0 means off. A field that changes the numbers and has
no value z-lab itself would agree on (θ, ``rms_norm_eps``, ``head_dim``, sizes, ``mask_token_id``, the
selector/convolution sizes) must be present: a missing or malformed one raises :class:`DFlash2Error`
naming it, never a silent default. Writing produces what z-lab's loaders accept: ``model_type: "qwen3"``,
one θ field (``rope_parameters``), no ``null`` where they expect a number.

Validation raises :class:`DFlash2Error` naming the field and the allowed values. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error

ARCH_V2 = "DFlash2DraftModel"
ARCH_V1 = "DFlashDraftModel"
MODEL_TYPE = "qwen3"  # what z-lab's checkpoints declare (their drafter config class is transformers' Qwen3Config)
# a drafter model_type refused in one line (Meta's Muse Glimmer drafter: another weight layout and attention mask)
REFUSED_MODEL_TYPE = "muse_glimmer_assistant"
LAYER_TYPES = ("full_attention", "sliding_attention")
# MLP activations (transformers' ACT2FN names) the drafter implements; anything else is refused.
HIDDEN_ACTS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# RoPE variants implemented (transformers' rope_type names); the others (dynamic, longrope, ...) are refused.
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# parameters each rope_type needs besides rope_theta (required: no silent default)
_ROPE_REQUIRED = {"default": (), "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_ROPE_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")}

# Fields stored inside the `dflash_config` block (the rest are top-level Qwen3 fields).
_DFLASH_KEYS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
    "use_conv",
    "use_selector",
    "learned_mask_embedding",
)
_TOP_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "hidden_act",
    "attention_bias",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "is_causal",
    "num_target_layers",
    "target_hidden_size",
)
# must be in a config.json: they change the numbers and z-lab's loaders have no agreed default for them
_REQUIRED_TOP = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size")
_REQUIRED_V2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# keys that only describe the file, dropped on read (to_dict writes its own)
_DROPPED = ("model_type", "torch_dtype", "dtype", "transformers_version")


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """z-lab's default (docs/design.md): ``n`` ids spread evenly from layer 1 to ``num_target_layers - 3``; a single
    id is the middle layer. z-lab takes ``n`` = the drafter's ``num_hidden_layers``."""
    if n == 1:
        return [num_target_layers // 2]
    lo, hi = 1, max(1, num_target_layers - 3)
    return [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def _bad(name: str, msg: str) -> DFlash2Error:
    return DFlash2Error(f"invalid drafter config: {name} {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Pop the RoPE fields of a config dict -> (theta, scaling or None). Scaling = rope_type + its parameters."""
    params = d.pop("rope_parameters", None)
    top_theta = d.pop("rope_theta", None)
    legacy = d.pop("rope_scaling", None)
    if params is not None:
        if not isinstance(params, dict):
            raise _bad("rope_parameters", f"must be an object, got {params!r}")
        if "full_attention" in params or "sliding_attention" in params:
            raise _bad("rope_parameters", "per-layer-type RoPE parameters are not supported")
        params = dict(params)
        theta = params.pop("rope_theta", None)
        if theta is None:
            raise _bad("rope_parameters", "has no rope_theta")
        if top_theta is not None and top_theta != theta:
            raise _bad("rope_theta", f"({top_theta!r}) disagrees with rope_parameters.rope_theta ({theta!r}); "
                       "keep one")
    else:
        if top_theta is None:
            raise _bad("rope_theta", "missing: give rope_parameters.rope_theta (transformers 5) or rope_theta; "
                       "there is no safe default (z-lab's loader would silently use 10000)")
        theta = top_theta
        if legacy is not None and not isinstance(legacy, dict):
            raise _bad("rope_scaling", f"must be an object or null, got {legacy!r}")
        params = dict(legacy or {})
    if not _is_number(theta):  # the range is checked by validate()
        raise _bad("rope_theta", f"must be a number, got {theta!r}")
    if "type" in params and "rope_type" not in params:  # older spelling
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    rtype = params.get("rope_type", "default")
    if rtype == "default":
        extra = set(params) - {"rope_type"}
        if extra:
            raise _bad("rope_parameters", f"has {sorted(extra)} but rope_type is 'default'")
        return theta, None
    return theta, params


_TARGET_ONLY_ROPE = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _full_layers_rope(per_type: dict[str, Any]) -> dict[str, Any]:
    """Per-layer-type RoPE parameters (Gemma 4) -> the full-attention layers' (a drafter attends over the whole
    context, as they do). Their ``proportional`` type is default RoPE over the rotated part with the frequencies
    divided by ``factor`` (transformers' definition): once the rotated part is the whole head, ``default`` or
    ``linear``."""
    full = per_type.get("full_attention")
    if not isinstance(full, dict):
        raise _bad("rope_parameters", f"per layer type has no full_attention entry: {per_type!r}")
    full = dict(full)
    if full.get("rope_type") == "proportional":
        factor = full.pop("factor", 1.0)
        full["rope_type"] = "default" if factor == 1 else "linear"
        if factor != 1:
            full["factor"] = factor
    return full


def rope_from_hf(hf_config: Any) -> dict[str, Any]:
    """RoPE of a transformers config (object or dict) as DFlash2Config fields ``{rope_theta, rope_scaling}``.

    transformers 5 keeps θ only in ``rope_parameters`` (``getattr(cfg, "rope_theta", 10000)`` silently
    gives 10000); transformers 4 in ``rope_theta`` (+ ``rope_scaling``). Missing or unsupported -> DFlash2Error.
    A target's partial rotation and multimodal sections are left out (:data:`_TARGET_ONLY_ROPE`); of per-layer-type
    parameters (Gemma 4), the full-attention layers' are taken (:func:`_full_layers_rope`).
    """
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    d = {k: d[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if d.get(k) is not None}
    if isinstance(d.get("rope_parameters"), dict) and any(t in d["rope_parameters"] for t in LAYER_TYPES):
        d["rope_parameters"] = _full_layers_rope(d["rope_parameters"])
    if isinstance(d.get("rope_parameters"), dict):
        # how much of a head the target rotates and its multimodal sections (Qwen3.5: partial_rotary_factor,
        # mrope_section) shape the target's attention, not the drafter's: a drafter rotates its whole head
        d["rope_parameters"] = {k: v for k, v in d["rope_parameters"].items() if k not in _TARGET_ONLY_ROPE}
    theta, scaling = _read_rope(d)
    return {"rope_theta": theta, "rope_scaling": scaling}


@dataclass
class DFlash2Config:
    """Drafter configuration (docs/design.md). Sizes: H hidden, V vocab, bs block size, L = bs - 1, K top-k, r rank."""

    hidden_size: int = 576  # H (== target hidden size in public checkpoints)
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None  # derived: H // heads when absent (constructor only; a config.json must say it)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling: {"rope_type": "linear"|"yarn"|"llama3", <its parameters>}; None = default RoPE
    rope_scaling: dict[str, Any] | None = None
    vocab_size: int = 49152  # V
    hidden_act: str = "silu"  # MLP activation (one of HIDDEN_ACTS)
    attention_bias: bool = False  # q/k/v/o projections carry biases
    layer_types: list[str] | None = None  # "full_attention" | "sliding_attention" per layer
    use_sliding_window: bool | None = None  # None: True iff sliding_window is set; False: window off (z-lab)
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: bidirectional in-block unless a sliding layer
    num_target_layers: int | None = 30  # None allowed when target_layer_ids are given
    target_hidden_size: int | None = None  # H_t; derived: == hidden_size when absent
    # dflash_config block
    block_size: int = 16  # bs
    mask_token_id: int = 0
    target_layer_ids: list[int] | None = None  # derived default when absent
    conv_kernel_size: int = 2  # kc
    conv_group_size: int = 16  # channels per group
    selector_rank: int = 256  # r
    selector_top_k: int = 16  # K
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    use_conv: bool = True  # False: DFlash v1 layers (no dynamic convolutions)
    use_selector: bool = True  # False: independent argmax per row (DFlash v1)
    learned_mask_embedding: bool = False  # [decision] extension: learned mask_embedding [H]
    architecture: str = ARCH_V2
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, written back unchanged

    def __post_init__(self) -> None:
        if self.head_dim is None and _is_int(self.num_attention_heads) and self.num_attention_heads > 0 \
                and _is_int(self.hidden_size):
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.layer_types is None and _is_int(self.num_hidden_layers):
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.use_sliding_window is None:
            self.use_sliding_window = self.sliding_window is not None
        if self.target_layer_ids is None:
            if not _is_int(self.num_target_layers) or not _is_int(self.num_hidden_layers):
                raise _bad("target_layer_ids", "missing, and num_target_layers is not set to derive them from")
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_draft_rows(self) -> int:
        """L = bs - 1."""
        return self.block_size - 1

    @property
    def conv_groups(self) -> int:
        """G = H / conv_group_size."""
        return self.hidden_size // self.conv_group_size

    @property
    def context_in_features(self) -> int:
        """n · H_t, the width of the concatenated target features."""
        assert self.target_hidden_size is not None and self.target_layer_ids is not None
        return len(self.target_layer_ids) * self.target_hidden_size

    def layer_is_causal(self, i: int) -> bool:
        """z-lab: ``is_causal`` when set, else causal exactly on sliding layers (even with the window off)."""
        assert self.layer_types is not None
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        """Window of layer i (None: unlimited). Off on every layer when ``use_sliding_window`` is false."""
        assert self.layer_types is not None
        if not self.use_sliding_window or self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        bad = _bad
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "conv_kernel_size", "conv_group_size",
                     "selector_rank", "selector_top_k", "target_hidden_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise bad(name, f"must be a positive integer, got {v!r}")
        if self.num_target_layers is not None and (not _is_int(self.num_target_layers) or self.num_target_layers < 1):
            raise bad("num_target_layers", f"must be a positive integer, got {self.num_target_layers!r}")
        if not _is_int(self.block_size) or self.block_size < 2:
            raise bad("block_size", f"must be an integer >= 2, got {self.block_size!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide "
                      f"num_attention_heads ({self.num_attention_heads})")
        if not _is_int(self.head_dim) or self.head_dim < 2 or self.head_dim % 2:
            raise bad("head_dim", f"must be an even integer >= 2 (RoPE), got {self.head_dim!r}")
        if not _is_number(self.rms_norm_eps) or not (0 < self.rms_norm_eps < 1):
            raise bad("rms_norm_eps", f"must be a number in (0, 1), got {self.rms_norm_eps!r}")
        if not _is_number(self.rope_theta) or self.rope_theta <= 1:
            raise bad("rope_theta", f"must be a number > 1, got {self.rope_theta!r}")
        self._validate_rope_scaling()
        if self.hidden_act not in HIDDEN_ACTS:
            raise bad("hidden_act", f"{self.hidden_act!r} is not supported; allowed: {', '.join(HIDDEN_ACTS)}")
        for name in ("attention_bias", "use_sliding_window", "use_conv", "use_selector", "learned_mask_embedding"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise bad("is_causal", f"must be true, false or absent, got {self.is_causal!r}")
        if self.hidden_size % self.conv_group_size:
            raise bad("conv_group_size", f"({self.conv_group_size}) must divide hidden_size "
                      f"({self.hidden_size}); allowed: a divisor of hidden_size")
        if self.conv_kernel_size != 2:
            raise bad("conv_kernel_size", f"must be 2 (two-tap convolutions), got {self.conv_kernel_size}")
        if self.selector_top_k > 16:
            raise bad("selector_top_k", f"must be <= 16 (plugin limit), got {self.selector_top_k}")
        if self.selector_top_k > self.vocab_size:
            raise bad("selector_top_k", f"({self.selector_top_k}) must be <= vocab_size ({self.vocab_size})")
        if not _is_int(self.mask_token_id) or not (0 <= self.mask_token_id < self.vocab_size):
            raise bad("mask_token_id", f"({self.mask_token_id!r}) must be an integer in [0, vocab_size="
                      f"{self.vocab_size})")
        ids = self.target_layer_ids
        if not isinstance(ids, list) or not ids:
            raise bad("target_layer_ids", f"must be a non-empty list of integers, got {ids!r}")
        for i in ids:
            if not _is_int(i):
                raise bad("target_layer_ids", f"entry {i!r} is not an integer")
            if i < 0 or (self.num_target_layers is not None and i >= self.num_target_layers):
                raise bad("target_layer_ids", f"entry {i} out of range [0, num_target_layers="
                          f"{self.num_target_layers})")
        lt = self.layer_types
        if not isinstance(lt, list) or len(lt) != self.num_hidden_layers:
            raise bad("layer_types", f"must list one entry per layer (num_hidden_layers={self.num_hidden_layers}), "
                      f"got {lt!r}")
        for t in lt:
            if t not in LAYER_TYPES:
                raise bad("layer_types", f"entry {t!r} not in {LAYER_TYPES}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1):
            raise bad("sliding_window", f"must be a positive integer or absent, got {self.sliding_window!r}")
        if self.use_sliding_window and "sliding_attention" in lt and self.sliding_window is None:
            raise bad("sliding_window", "must be set (> 0) when a layer is 'sliding_attention' and "
                      "use_sliding_window is true")
        if self.architecture not in (ARCH_V1, ARCH_V2):
            raise bad("architectures", f"must be [{ARCH_V2!r}] or [{ARCH_V1!r}], got {self.architecture!r}")
        for name in ("output_multiplier", "input_embedding_scale", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not _is_number(v):
                raise bad(name, f"must be a finite number or absent, got {v!r}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise bad("final_logit_softcapping", f"must be > 0 when set, got {self.final_logit_softcapping}")

    def _validate_rope_scaling(self) -> None:
        s = self.rope_scaling
        if s is None:
            return
        if not isinstance(s, dict):
            raise _bad("rope_parameters", f"must be an object, got {s!r}")
        rtype = s.get("rope_type", "default")
        if rtype not in ROPE_TYPES:
            raise _bad("rope_parameters.rope_type", f"{rtype!r} is not supported; allowed: {', '.join(ROPE_TYPES)}")
        for k in _ROPE_REQUIRED[rtype]:
            if not _is_number(s.get(k)) or s[k] <= 0:
                raise _bad(f"rope_parameters.{k}", f"must be a positive number for rope_type {rtype!r}, "
                           f"got {s.get(k)!r}")
        known = {"rope_type", *_ROPE_REQUIRED[rtype], *_ROPE_OPTIONAL.get(rtype, ())}
        unknown = sorted(set(s) - known)
        if unknown:  # e.g. partial_rotary_factor: would change the numbers, so refuse rather than ignore
            raise _bad("rope_parameters", f"keys {unknown} are not supported for rope_type {rtype!r}")
        for k in _ROPE_OPTIONAL.get(rtype, ()):
            v = s.get(k)
            if v is not None and k != "truncate" and not _is_number(v):
                raise _bad(f"rope_parameters.{k}", f"must be a number, got {v!r}")
        if "truncate" in s and not isinstance(s["truncate"], bool):
            raise _bad("rope_parameters.truncate", f"must be true or false, got {s['truncate']!r}")

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling.get("rope_type", "default"))

    # ------------------------------------------------------------------ HF json
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlash2Config":
        if not isinstance(d, dict):
            raise DFlash2Error(f"invalid drafter config: must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        if d.get("model_type") == REFUSED_MODEL_TYPE:
            raise DFlash2Error(f"drafter model_type {REFUSED_MODEL_TYPE!r} (Meta's Muse Glimmer assistant) is not "
                               "loaded: transformers' MuseGlimmerAssistantModel keeps its context projection under "
                               "other names (encoder.fc, encoder.output_norm_enc) and attends bidirectionally in "
                               "sliding layers, which z-lab's layout (the one read here) makes causal")
        if d.get("is_neox_style", True) is not True:  # the drafter's own RoPE layout, never its target's
            raise _bad("is_neox_style", f"is {d['is_neox_style']!r}: only the neox (rotate-half) RoPE layout is "
                       "implemented (absent or true)")
        archs = d.pop("architectures", None) or [ARCH_V2]
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise _bad("architectures", f"must be a list of names, got {archs!r}")
        arch = archs[0]
        dcfg = d.pop("dflash_config", None)
        if dcfg is None:
            dcfg = {}
        if not isinstance(dcfg, dict):
            raise _bad("dflash_config", f"must be an object, got {type(dcfg).__name__} {dcfg!r}")
        dcfg = dict(dcfg)
        kw: dict[str, Any] = {"architecture": arch}
        if arch == ARCH_V1:
            kw["use_conv"] = False
            kw["use_selector"] = False
        kw["rope_theta"], kw["rope_scaling"] = _read_rope(d)
        for k in _TOP_KEYS:
            if k in d:
                kw[k] = d.pop(k)
        # v1 checkpoints may carry block_size (and friends) at top level; dflash_config wins (as in z-lab)
        for k in _DFLASH_KEYS:
            if k in d:
                kw[k] = d.pop(k)
        for k in _DFLASH_KEYS:
            if k in dcfg:
                kw[k] = dcfg.pop(k)
        missing = [k for k in _REQUIRED_TOP + ("mask_token_id",) + (_REQUIRED_V2 if arch == ARCH_V2 else ())
                   if kw.get(k) is None]
        if missing:
            raise _bad(missing[0], "is missing (it changes the numbers; there is no safe default)"
                       + (f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""))
        if "num_target_layers" not in kw:
            kw["num_target_layers"] = None
        if kw.get("target_layer_ids") is None and kw["num_target_layers"] is None:
            raise _bad("target_layer_ids", "missing, and num_target_layers is not given to derive them from")
        if kw.get("target_layer_ids") is not None and not isinstance(kw["target_layer_ids"], list):
            raise _bad("target_layer_ids", f"must be a list of integers, got {kw['target_layer_ids']!r}")
        # Qwen3Config semantics: use_sliding_window (default false) switches the window on or off
        if "use_sliding_window" not in kw:
            if kw.get("sliding_window") is not None:
                raise _bad("use_sliding_window", "is missing while sliding_window is set: z-lab's loader "
                           "(Qwen3Config) turns the window off unless use_sliding_window is true; say which")
            kw["use_sliding_window"] = False
        if kw.get("layer_types") is None:
            n = kw["num_hidden_layers"]
            if kw["use_sliding_window"] and kw.get("sliding_window") is not None and _is_int(n):
                if "max_window_layers" not in d:
                    raise _bad("layer_types", "missing while use_sliding_window is true; give layer_types or "
                               "max_window_layers")
                mw = d["max_window_layers"]
                if not _is_int(mw):
                    raise _bad("max_window_layers", f"must be an integer, got {mw!r}")
                kw["layer_types"] = ["sliding_attention" if i >= mw else "full_attention" for i in range(n)]
        fls = kw.get("final_logit_softcapping")
        if _is_number(fls) and fls == 0:  # z-lab: a cap <= 0 means no cap
            kw["final_logit_softcapping"] = None
        extra = {k: v for k, v in d.items() if k not in _DROPPED}
        if dcfg:
            extra["dflash_config"] = dcfg
        kw["extra"] = extra
        try:
            return cls(**kw)
        except TypeError as e:  # wrong value types reaching __post_init__ arithmetic
            raise DFlash2Error(f"invalid drafter config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The config.json z-lab's loaders accept: their model_type, one θ field, no nulls for numbers."""
        d: dict[str, Any] = {"architectures": [self.architecture], "model_type": MODEL_TYPE}
        for k in _TOP_KEYS:
            v = getattr(self, k)
            if v is None:  # optional and off: absent is what the loaders read as "off"
                continue
            if k == "target_hidden_size" and v == self.hidden_size:
                continue
            d[k] = v
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        rope.update(self.rope_scaling or {})
        d["rope_parameters"] = rope
        dc = {k: getattr(self, k) for k in _DFLASH_KEYS if getattr(self, k) is not None}
        # our extension switches only when they say something the architecture does not imply
        implied = self.architecture == ARCH_V2
        for k, default in (("use_conv", implied), ("use_selector", implied), ("learned_mask_embedding", False)):
            if dc[k] == default:
                del dc[k]
        extra = dict(self.extra)
        dc.update(extra.pop("dflash_config", {}))
        for k in ("rope_theta", "rope_scaling", "rope_parameters"):  # only ever one θ field
            extra.pop(k, None)
        d.update(extra)
        d["dflash_config"] = dc
        if self.architecture == ARCH_V1:
            d["block_size"] = self.block_size
        return d

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DFlash2Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise DFlash2Error(f"drafter config not found: {path}")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DFlash2Error(f"drafter config {path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise DFlash2Error(f"drafter config {path} must hold a JSON object")
        try:
            return cls.from_dict(d)
        except DFlash2Error as e:
            raise DFlash2Error(f"{path}: {e}") from None

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``directory/config.json`` (temp file, then rename into place)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / ".config.json.tmp"
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, directory / "config.json")

    def replace(self, **changes: Any) -> "DFlash2Config":
        return dataclasses.replace(self, **changes)
