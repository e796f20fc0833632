"""The project's vocabulary: every set of names that more than one module speaks.

Defined once here and imported everywhere; a literal tuple of these names anywhere else is a bug.
Only the standard library is needed.
"""

from __future__ import annotations

from dflash2_trt.errors import DFlash2Error

# Path selection over the candidate lattice (docs/design.md); the default first.
SELECTOR_MODES = ("greedy", "viterbi")
# No selector: each draft row's own argmax / sample (DFlash v1 drafters, the selector-off ablation).
INDEPENDENT = "independent"
# What a draft runner can be asked for.
DRAFT_MODES = (*SELECTOR_MODES, INDEPENDENT)

# Pair-score precision of the PyTorch selector: fp32 (the reference) | bf16 (z-lab's vLLM rounding).
SELECTOR_PRECISIONS = ("fp32", "bf16")

# Runtime backends; "auto" = TensorRT when it can run here, else ONNX Runtime.
BACKENDS = ("ort", "trt", "torch")
BACKEND_CHOICES = ("auto", "ort", "trt")  # what the export-folder CLIs accept (torch runs --target/--drafter)

# Who proposes a speculative cycle's drafts: the DFlash 2 drafter, prompt lookup (n-gram continuation of the
# context, no model), or per cycle whichever the measured acceptance favours (runtime/ngram.py).
PROPOSERS = ("dflash2", "ngram", "auto")
# the API's, CLI's and Triton model's default: side by side on a quiet machine `auto` was 1.43x / 1.10x / 1.27x
# the drafter alone on HumanEval / MT-Bench / long code, and never below it (docs/benchmarks.md)
DEFAULT_PROPOSER = "auto"
# How a server's batch loop drafts (the Triton model's ``speculation``): only while the load-adaptive rule of
# runtime/batch.py says it pays | every step | never (batched plain decoding).
SPECULATION_MODES = ("adaptive", "always", "off")
# A Triton instance's ONNX Runtime thread-pool spinning (parameter ``ort_spinning``, load(spinning=...)):
# load's default (None) | True | False.
ORT_SPINNING = {"auto": None, "on": True, "off": False}
# The fused ONNX Runtime target's attention op: auto (DecodeAttention when its library is built) | the custom op |
# ORT's GroupQueryAttention (runtime/ort/decode_attention.py).
ORT_ATTENTIONS = ("auto", "decode", "gqa")

# Export precisions and weight-only quantization kinds.
DTYPES = ("fp32", "fp16", "bf16")
QUANTIZATIONS = ("none", "int8", "int4")
# The drafter's (export --drafter-quantize): MatMulNBits as above, or its own weights rounded onto GGUF Q8_0's grid in
# fp32 graphs (export/quantize.py: round_q8_0), which the ONNX Runtime custom-op library reads as 8-bit codes.
Q8_0 = "q8_0"
DRAFTER_QUANTIZATIONS = (*QUANTIZATIONS, Q8_0)
# Graph flavours beside standard ONNX: ONNX Runtime only (com.microsoft ops) | TensorRT Q/DQ (quantized target)
GRAPH_FLAVOURS = ("ort", "qdq")

# `make-tiny --arch`: the tiny target's architecture (dense Llama; hybrid Gated DeltaNet, + MoE MLPs; Qwen3-MoE;
# sliding-window gpt-oss, Muse Glimmer; Nemotron-H Mamba-2 + MoE + attention; Gemma 4), each with a copying target for
# `make-tiny --accepting`
TINY_ARCHS = ("llama", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "gpt_oss", "muse_glimmer", "nemotron_h", "gemma4")
# Kinds of target decoder layers: full (or grouped-query) attention; a linear-attention layer (Gated DeltaNet or
# Mamba-2: a convolution state and a recurrent state); sliding-window attention; a layer with no state (Nemotron-H's
# MoE and MLP layers). An export's manifest lists its target's (dflash2_trt.targets: the families).
LAYER_KINDS = ("attention", "linear", "sliding", "mlp")

# How the path selector is built into the drafter head graph / engine.
SELECTOR_IMPLS = ("decomposed", "plugin")  # standard ONNX ops | the DFlash2PathSelector TensorRT plugin node
ENGINE_SELECTORS = (*SELECTOR_IMPLS, "both")  # `build-engines --selector`


def head_key(mode: str, plugin: bool = False) -> str:
    """Graph key of the drafter head for a draft mode: ``drafter_head_{mode}[_plugin]``."""
    return f"drafter_head_{mode}" + ("_plugin" if plugin else "")


def check_draft_mode(mode: str, available: tuple[str, ...], holder: str) -> str:
    """``mode`` when it is one of ``available`` (the draft modes ``holder`` can run: an export, a drafter), else
    DFlash2Error: an unknown name, or a selector mode of a model without the candidate selector."""
    if mode not in DRAFT_MODES:
        raise DFlash2Error(f"draft mode must be one of {', '.join(DRAFT_MODES)}, got {mode!r}")
    if mode not in available:
        raise DFlash2Error(f"{holder} has no {mode!r} draft head: the drafter has no candidate selector "
                           f"(DFlash v1); use --no-selector")
    return mode
