"""DFlash2Config: every field of SPEC §2, read/written as a HF ``config.json``.

Two on-disk layouts are understood:

* DFlash 2 (``architectures: ["DFlash2DraftModel"]``): Qwen3-style fields plus a ``dflash_config`` block.
* DFlash v1 (``architectures: ["DFlashDraftModel"]``): same, ``block_size`` may sit at top level, no
  convolution/selector tensors (``use_conv`` and ``use_selector`` are then False).

Validation raises :class:`DFlash2Error` naming the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error

ARCH_V2 = "DFlash2DraftModel"
ARCH_V1 = "DFlashDraftModel"

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
    "rope_theta",
    "vocab_size",
    "layer_types",
    "sliding_window",
    "is_causal",
    "num_target_layers",
    "target_hidden_size",
)


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """SPEC §2 default: ``n`` ids spread evenly from layer 1 to ``num_target_layers - 3``."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if n == 1:
        return [lo]
    return [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


@dataclass
class DFlash2Config:
    """Drafter configuration (SPEC §2). Sizes: H hidden, V vocab, bs block size, L = bs - 1, K top-k, r rank."""

    hidden_size: int = 576  # H (== target hidden size in public checkpoints)
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None  # derived: H // heads when absent
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 49152  # V
    layer_types: list[str] | None = None  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: bidirectional in-block unless a sliding layer
    num_target_layers: int = 30
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
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            n = min(5, max(1, self.num_target_layers - 3))
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, n)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
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
        assert self.layer_types is not None
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        assert self.layer_types is not None
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(name: str, msg: str) -> DFlash2Error:
            return DFlash2Error(f"invalid drafter config: {name} {msg}")

        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "num_target_layers", "conv_kernel_size",
                     "conv_group_size", "selector_rank", "selector_top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, f"must be a positive integer, got {v!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise bad("block_size", f"must be an integer >= 2, got {self.block_size!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide "
                      f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim is None or self.head_dim < 2 or self.head_dim % 2:
            raise bad("head_dim", f"must be an even integer >= 2 (RoPE), got {self.head_dim!r}")
        if self.hidden_size % self.conv_group_size:
            raise bad("conv_group_size", f"({self.conv_group_size}) must divide hidden_size "
                      f"({self.hidden_size}); allowed: a divisor of hidden_size")
        if self.conv_kernel_size != 2:
            raise bad("conv_kernel_size", f"must be 2 (two-tap convolutions), got {self.conv_kernel_size}")
        if self.selector_top_k > 16:
            raise bad("selector_top_k", f"must be <= 16 (plugin limit), got {self.selector_top_k}")
        if self.selector_top_k > self.vocab_size:
            raise bad("selector_top_k", f"({self.selector_top_k}) must be <= vocab_size ({self.vocab_size})")
        if not (0 <= self.mask_token_id < self.vocab_size):
            raise bad("mask_token_id", f"({self.mask_token_id}) must be in [0, vocab_size={self.vocab_size})")
        assert self.target_layer_ids is not None and self.layer_types is not None
        if not self.target_layer_ids:
            raise bad("target_layer_ids", "must list at least one target layer")
        for i in self.target_layer_ids:
            if not (0 <= i < self.num_target_layers):
                raise bad("target_layer_ids", f"entry {i} out of range [0, num_target_layers="
                          f"{self.num_target_layers})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"has {len(self.layer_types)} entries, expected num_hidden_layers="
                      f"{self.num_hidden_layers}")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise bad("layer_types", f"entry {t!r} not in ('full_attention', 'sliding_attention')")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise bad("sliding_window", "must be set (> 0) when a layer is 'sliding_attention'")
        if self.architecture not in (ARCH_V1, ARCH_V2):
            raise bad("architectures", f"must be [{ARCH_V2!r}] or [{ARCH_V1!r}], got {self.architecture!r}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise bad("final_logit_softcapping", f"must be > 0 when set, got {self.final_logit_softcapping}")

    # ------------------------------------------------------------------ HF json
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlash2Config":
        d = dict(d)
        archs = d.pop("architectures", None) or [ARCH_V2]
        arch = archs[0] if isinstance(archs, list) and archs else archs
        dcfg = dict(d.pop("dflash_config", {}) or {})
        kw: dict[str, Any] = {"architecture": arch}
        if arch == ARCH_V1:
            kw["use_conv"] = False
            kw["use_selector"] = False
        for k in _TOP_KEYS:
            if k in d:
                kw[k] = d.pop(k)
        # v1 checkpoints may carry block_size (and friends) at top level
        for k in _DFLASH_KEYS:
            if k in d:
                kw[k] = d.pop(k)
        for k in _DFLASH_KEYS:
            if k in dcfg:
                kw[k] = dcfg.pop(k)
        extra = {k: v for k, v in d.items() if k not in ("model_type", "torch_dtype", "dtype",
                                                           "transformers_version")}
        if dcfg:
            extra["dflash_config"] = dcfg
        kw["extra"] = extra
        try:
            return cls(**kw)
        except TypeError as e:  # wrong value types reaching __post_init__ arithmetic
            raise DFlash2Error(f"invalid drafter config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"architectures": [self.architecture], "model_type": "dflash2"}
        for k in _TOP_KEYS:
            d[k] = getattr(self, k)
        dc = {k: getattr(self, k) for k in _DFLASH_KEYS}
        extra = dict(self.extra)
        dc.update(extra.pop("dflash_config", {}))
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
        return cls.from_dict(d)

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "DFlash2Config":
        return dataclasses.replace(self, **changes)
