"""ONNX side of the ``trt.plugins::DFlash2PathSelector`` TensorRT plugin contract.

The contract lives in three places — ``plugins/pathSelector/dflash2PathSelector.yaml``,
this op schema, and the plugin creator's field list — and ``tests/test_plugin_selector.py`` pins them
together. Semantics are those of :func:`dflash2_trt.reference.select_paths` (docs/design.md).

Inputs (B dynamic; L, K, r, V static; C = float32 | float16 | bfloat16, one type for all three)::

    cand_ids       int32 [B, L, K]    top-k candidate ids, sorted by descending unary
    unary          float [B, L, K]    top-k logits
    hidden_proj    C     [B, L, r]    hidden_projection(h_t)
    anchor_ids     int32 [B]
    pred_codebook  C     [V, r]       A (an initializer)
    succ_codebook  C     [V, r]       B (an initializer)
    temperature    float [B]          <= 0: argmax decoding for that sequence
    uniforms       float [B, L]       one uniform in [0, 1) per row (used when temperature > 0)

Outputs: ``path_ids`` int32 [B, L], ``proposal_probs`` float [B, L, K].
Attributes: ``top_k`` (int, 1..16, == K), ``rank`` (int, == r), ``mode`` ("greedy" | "viterbi",
default "greedy"), plus ``plugin_version`` = "1" and ``plugin_namespace`` = "" for the TensorRT ONNX
parser (docs/tensorrt.md).

Usage (exporter)::

    from dflash2_trt.export.selector_contract import make_selector_node, register_schema, opset_import
    register_schema()                       # lets onnx.checker / shape inference know the op
    node = make_selector_node(inputs, outputs, top_k=16, rank=256, mode="greedy")
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17), opset_import()])

``onnx`` is imported lazily (inside the functions), so importing this module needs only the stdlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import SELECTOR_MODES as MODES  # the contract's `mode` attribute values

OP_TYPE = "DFlash2PathSelector"
DOMAIN = "trt.plugins"
SINCE_VERSION = 1
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""
MAX_TOP_K = 16
MAX_RANK = 1 << 16

CODEBOOK_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")

#: (name, type parameter, description) in input order; type parameters below.
INPUTS: tuple[tuple[str, str, str], ...] = (
    ("cand_ids", "I", "[B, L, K] top-k candidate ids, sorted by descending unary"),
    ("unary", "F", "[B, L, K] top-k logits"),
    ("hidden_proj", "C", "[B, L, r] hidden_projection(h_t)"),
    ("anchor_ids", "I", "[B] anchor token (predecessor of row 0)"),
    ("pred_codebook", "C", "[V, r] predecessor codebook A"),
    ("succ_codebook", "C", "[V, r] successor codebook B"),
    ("temperature", "F", "[B] <= 0: argmax decoding for that sequence"),
    ("uniforms", "F", "[B, L] one uniform in [0, 1) per row, used when temperature > 0"),
)
OUTPUTS: tuple[tuple[str, str, str], ...] = (
    ("path_ids", "I", "[B, L] chosen candidate id per row"),
    ("proposal_probs", "F", "[B, L, K] proposal q_t over the K candidates (one-hot at T <= 0)"),
)
TYPE_CONSTRAINTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("I", ("tensor(int32)",), "token ids"),
    ("F", ("tensor(float)",), "fp32 scores, temperatures, uniforms, probabilities"),
    ("C", CODEBOOK_TYPES, "hidden_proj and both codebooks share one type"),
)
#: (name, ONNX attribute type name, required, default)
ATTRIBUTES: tuple[tuple[str, str, bool, Any], ...] = (
    ("top_k", "INT", True, None),
    ("rank", "INT", True, None),
    ("mode", "STRING", False, "greedy"),
    ("plugin_version", "STRING", False, PLUGIN_VERSION),
    ("plugin_namespace", "STRING", False, PLUGIN_NAMESPACE),
)


def build_schema():
    """The ``onnx.defs.OpSchema`` of the op (not registered)."""
    import onnx
    from onnx import defs

    schema_inputs = [defs.OpSchema.FormalParameter(n, t, d) for n, t, d in INPUTS]
    schema_outputs = [defs.OpSchema.FormalParameter(n, t, d) for n, t, d in OUTPUTS]
    attributes = []
    for name, kind, required, default in ATTRIBUTES:
        attr_type = getattr(defs.OpSchema.AttrType, kind)
        if required:
            attributes.append(defs.OpSchema.Attribute(name, attr_type, name, required=True))
        else:
            attributes.append(defs.OpSchema.Attribute(name, onnx.helper.make_attribute(name, default), name))
    return defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        SINCE_VERSION,
        "DFlash 2 path selector (TensorRT plugin); semantics: dflash2_trt.reference.select_paths.",
        inputs=schema_inputs,
        outputs=schema_outputs,
        type_constraints=[(p, list(types), d) for p, types, d in TYPE_CONSTRAINTS],
        attributes=attributes,
    )


def register_schema():
    """Register the op schema with ``onnx.defs`` once per process; returns the registered schema."""
    from onnx import defs

    if not defs.has(OP_TYPE, SINCE_VERSION, DOMAIN):
        defs.register_schema(build_schema())
    return defs.get_schema(OP_TYPE, SINCE_VERSION, DOMAIN)


def opset_import():
    """``OperatorSetIdProto`` for the ``trt.plugins`` domain (add it to the model's opset imports)."""
    import onnx

    return onnx.helper.make_opsetid(DOMAIN, SINCE_VERSION)


def check_attributes(top_k: int, rank: int, mode: str) -> None:
    """Raise :class:`DFlash2Error` naming the attribute when a value is outside the contract."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise DFlash2Error(f"selector top_k must be an int in [1, {MAX_TOP_K}], got {top_k!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise DFlash2Error(f"selector rank must be an int in [1, {MAX_RANK}], got {rank!r}")
    if mode not in MODES:
        raise DFlash2Error(f"selector mode must be one of {MODES}, got {mode!r}")


def make_selector_node(
    inputs: Sequence[str],  # 8 tensor names, in the order of INPUTS
    outputs: Sequence[str],  # 2 tensor names: path_ids, proposal_probs
    *,
    top_k: int,
    rank: int,
    mode: str = "greedy",
    name: str | None = None,
):
    """An ``onnx.NodeProto`` for ``trt.plugins::DFlash2PathSelector`` with every attribute set."""
    import onnx

    check_attributes(top_k, rank, mode)
    if len(inputs) != len(INPUTS) or len(outputs) != len(OUTPUTS):
        raise DFlash2Error(
            f"DFlash2PathSelector takes {len(INPUTS)} inputs {[n for n, _, _ in INPUTS]} and "
            f"{len(OUTPUTS)} outputs {[n for n, _, _ in OUTPUTS]}, got {len(inputs)} and {len(outputs)}"
        )
    return onnx.helper.make_node(
        OP_TYPE,
        list(inputs),
        list(outputs),
        name=name,
        domain=DOMAIN,
        top_k=top_k,
        rank=rank,
        mode=mode,
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )
