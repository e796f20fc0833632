"""Weight-only quantization of the ONNX Runtime graphs (``dflash2-export --quantize {none,int8,int4}``).

Every ``MatMul`` with a constant weight becomes a ``com.microsoft::MatMulNBits`` node, made by ONNX
Runtime's own maintained quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``; round to nearest,
blockwise along K, one scale (+ zero point when asymmetric) per block). Activations stay fp32; the
``accuracy_level`` tells the CPU kernel what it may compute in (4 = int8 activations, the fast path).
``accuracy_level`` 0 (the default) keeps speculative decoding lossless; see ``DEFAULT_ACCURACY_LEVEL``. It is
the target's level: the drafter graphs always use level 4 (``ort_fused.DRAFTER_ACCURACY_LEVEL``).
The LM head (the target's and the drafter's: they are the same weight) is a separate choice
(``lm_head``); embeddings stay fp32 (a ``Gather`` reads one row per token, quantizing it saves memory,
not time). ``MatMulNBits`` exists only in ONNX Runtime: TensorRT graphs are never quantized here.

The manifest records :meth:`QuantSpec.manifest` as its ``quantization`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import QUANTIZATIONS

_BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32
# 0 (fp32 compute) by default: at level 4 (int8 activations, the fast CPU path) ONNX Runtime computes a
# 1-row and a multi-row call differently (SmolLM2-135M int4: logits differ by up to 0.7 between one
# 8-row verification and 8 single-row steps, 7e-5 at level 0), so speculative decoding would not reproduce
# the quantized target's own autoregressive output. Level 4 stays available (--quant-accuracy-level 4).
DEFAULT_ACCURACY_LEVEL = 0


@dataclass(frozen=True)
class QuantSpec:
    kind: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    lm_head: bool = True  # quantize the LM head MatMul too (the largest single weight of a small LM)
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.kind not in QUANTIZATIONS:
            raise DFlash2Error(f"--quantize must be one of {', '.join(QUANTIZATIONS)}, got {self.kind!r}")
        bs = self.block_size
        if bs < 16 or bs & (bs - 1):
            raise DFlash2Error(f"--quant-block-size must be a power of 2 >= 16 (MatMulNBits), got {bs}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise DFlash2Error(f"--quant-accuracy-level must be 0..4 (MatMulNBits), got {self.accuracy_level}")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def manifest(self) -> dict[str, Any]:
        if not self.enabled:
            return {"kind": "none", "block_size": None, "accuracy_level": None, "lm_head": False}
        return {"kind": self.kind, "block_size": self.block_size, "accuracy_level": self.accuracy_level,
                "lm_head": self.lm_head, "symmetric": self.symmetric}


def _lm_head_nodes(model, vocab_size: int) -> list[str]:  # noqa: ANN001
    """MatMul nodes whose constant weight has ``vocab_size`` output columns: the LM head."""
    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in inits:
            dims = list(inits[n.input[1]].dims)
            if len(dims) == 2 and dims[1] == vocab_size:
                out.append(n.name)
    return out


def quantize_graph(model, spec: QuantSpec, vocab_size: int):  # noqa: ANN001, ANN201
    """A quantized copy of ``model`` (an in-memory ``ModelProto`` with its weights inline); unchanged nodes
    where nothing qualifies (e.g. a head that is only the excluded LM head)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if not spec.enabled:
        return model
    work = onnx.ModelProto()
    work.CopyFrom(model)
    for n in work.graph.node:  # the quantizer matches nodes by name
        if not n.name:
            n.name = f"{n.op_type}_{id(n)}"
    exclude = [] if spec.lm_head else _lm_head_nodes(work, vocab_size)
    level = logging.getLogger("onnxruntime.quantization").level
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    try:
        q = MatMulNBitsQuantizer(work, bits=_BITS[spec.kind], block_size=spec.block_size,
                                 is_symmetric=spec.symmetric, accuracy_level=spec.accuracy_level,
                                 nodes_to_exclude=exclude, op_types_to_quantize=("MatMul",))
        q.process()
    finally:
        logging.getLogger("onnxruntime.quantization").setLevel(level)
    return q.model.model


def quantized_matmuls(model) -> int:  # noqa: ANN001
    return sum(n.op_type == "MatMulNBits" for n in model.graph.node)
