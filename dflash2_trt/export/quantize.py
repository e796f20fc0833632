"""Weight-only quantization of the ONNX Runtime graphs (``dflash2-export --quantize {none,int8,int4}``).

Every ``MatMul`` with a constant weight becomes a ``com.microsoft::MatMulNBits`` node, made by ONNX
Runtime's own maintained quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``; round to nearest,
blockwise along K, one scale (+ zero point when asymmetric) per block). Activations stay fp32; the
``accuracy_level`` tells the CPU kernel what it may compute in (4 = int8 activations, the fast path).
``accuracy_level`` 0 (the default) keeps speculative decoding lossless; see ``DEFAULT_ACCURACY_LEVEL``. It is
the target's level: the drafter graphs always use level 4 (:data:`DRAFTER_ACCURACY_LEVEL`). The drafter's weights
are their own choice (``--drafter-quantize``, :func:`drafter_spec`; by default the target's kind): drafts are
verified, so an fp32 target with an int8 drafter still decodes exactly its own greedy tokens, and a drafter call is a
few ms of weight reads on the CPU (SmolLM2's demo drafter: 30 MB in fp32, read from memory every cycle).
``--drafter-quantize q8_0`` is the other route for the drafter (:func:`q8_0_drafter`): its own weights rounded onto GGUF
Q8_0's grid before anything is traced, so every graph holds an fp32 drafter that is exactly that Q8_0 drafter (the
export's checks against PyTorch stay exact) and the ONNX Runtime custom-op library reads each of its matrices as
8-bit codes (1.125 bytes a weight instead of 4: plugins/ortDecodeAttention/panelCodes.h); without the library the
graphs run as fp32. The LM head (the target's and the drafter's: they are the same weight) is a separate choice
(``lm_head``); embeddings stay fp32 (a ``Gather`` reads one row per token, quantizing it saves memory,
not time). ``MatMulNBits`` exists only in ONNX Runtime.

TensorRT flavour (:func:`qdq_graph`, ``target_qdq.onnx``): the same weight-only choice as explicit
``DequantizeLinear`` → ``MatMul`` pairs in standard ONNX, which TensorRT's builder turns into weight-only
quantized GEMMs — int4: blockwise along K, symmetric (TensorRT's ``IDequantizeLayer`` takes no zero point for
INT4), opset 21 (INT4 tensors and the ``block_size`` attribute; the graph is converted with
``onnx.version_converter``), made by ONNX Runtime's quantizer in its QDQ format; int8: one symmetric scale per
output channel (``axis`` 1, per-axis DequantizeLinear, opset 13+), left at the export's opset (17 by default):
the flavour the Jetson recipe uses, since no TensorRT 10.3 (JetPack 6.2) has been shown to parse opset 21.
:func:`verify_qdq` checks every dequantized weight (computed by ``onnx.reference``, an independent
implementation of the ONNX semantics TensorRT follows) lies within one quantization step of the original
(rounding costs half a step; ONNX Runtime's symmetric int4 maps a block's largest magnitude to -8 steps, so a
positive maximum clips at +7: one step).

The manifest records :meth:`QuantSpec.manifest` as its ``quantization`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import Quantization
from dflash2_trt.vocabulary import DRAFTER_QUANTIZATIONS, Q8_0, QUANTIZATIONS

_BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32
# 0 (fp32 compute) by default: at level 4 (int8 activations, the fast CPU path) ONNX Runtime computes a
# 1-row and a multi-row call differently (SmolLM2-135M int4: logits differ by up to 0.7 between one
# 8-row verification and 8 single-row steps, 7e-5 at level 0), so speculative decoding would not reproduce
# the quantized target's own autoregressive output. Level 4 stays available (--quant-accuracy-level 4).
DEFAULT_ACCURACY_LEVEL = 0
# drafts need not reproduce anything (verification decides), so the drafter always takes the fast int8-activation
# kernels (level 0 de-quantizes to an fp32 GEMM: the SmolLM2 demo drafter's call went from 3 ms to 19 ms)
DRAFTER_ACCURACY_LEVEL = 4


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

    def manifest(self) -> Quantization:
        """The manifest's typed ``quantization`` entry."""
        if not self.enabled:
            return Quantization()
        return Quantization(kind=self.kind, block_size=self.block_size, accuracy_level=self.accuracy_level,
                            lm_head=self.lm_head, symmetric=self.symmetric)


def drafter_spec(target: QuantSpec, kind: str | None = None) -> QuantSpec:
    """The ONNX Runtime drafter graphs' MatMulNBits quantization: ``kind`` (none|int8|int4; None: the target's kind;
    q8_0: none, the weights are rounded instead) at the target's block size and LM-head choice, accuracy level
    :data:`DRAFTER_ACCURACY_LEVEL`."""
    if kind is not None and kind not in DRAFTER_QUANTIZATIONS:
        raise DFlash2Error(f"--drafter-quantize must be one of {', '.join(DRAFTER_QUANTIZATIONS)}, got {kind!r}")
    if kind == Q8_0:
        return QuantSpec()
    spec = QuantSpec(target.kind if kind is None else kind, target.block_size, DRAFTER_ACCURACY_LEVEL, target.lm_head,
                     target.symmetric)
    return spec if spec.enabled else QuantSpec()


Q8_0_BLOCK = 32  # weights per scale, consecutive along a weight's input dimension (GGUF's block, kCodeBlock)
Q8_0_MANIFEST = Quantization(kind=Q8_0, block_size=Q8_0_BLOCK)


def round_q8_0(w):  # noqa: ANN001, ANN201
    """``w`` [out, in] fp32 (``in`` a multiple of :data:`Q8_0_BLOCK`) rounded onto Q8_0's grid: per block of 32
    inputs of one output w = q x s, q in -127..127, s = max|w| / 127 rounded to 11 significant bits (fp16's
    precision, where GGUF keeps it; fp32's exponent range). The block's largest magnitude lands on q = ±127 (s is
    within 2^-12 of max|w| / 127), so the library's code search (scale candidates from max|w| / 127) finds s again."""
    import torch

    out, n = w.shape
    b = w.detach().float().reshape(out, n // Q8_0_BLOCK, Q8_0_BLOCK)
    raw = (b.abs().amax(-1, keepdim=True) / 127).contiguous()
    s = ((raw.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)  # nearest 11-bit value (ties away)
    q = torch.where(s > 0, b / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-127, 127)
    return (q * s).reshape(out, n).to(w.dtype)


def q8_0_drafter(drafter) -> int:  # noqa: ANN001
    """Round the fp32 drafter's own matrices onto Q8_0's grid in place (:func:`round_q8_0`; every ``nn.Linear`` whose
    input dimension holds whole blocks, and the restricted LM head's copy of the target's rows; never the target's
    own weights, which a full-vocabulary head shares); returns how many."""
    import torch

    n = 0
    with torch.no_grad():
        for m in drafter.modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % Q8_0_BLOCK == 0:
                m.weight.copy_(round_q8_0(m.weight))
                n += 1
        head = drafter.draft_head_weight
        if head.numel() and head.shape[1] % Q8_0_BLOCK == 0:
            drafter.draft_head_weight = round_q8_0(head)
            n += 1
    return n


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


QDQ_OPSET = 21  # INT4 tensors and DequantizeLinear's block_size
QDQ_KEY, QDQ_FILE = "target_qdq", "target_qdq.onnx"  # the TensorRT flavour's quantized target


def qdq_graph(model, spec: QuantSpec, vocab_size: int):  # noqa: ANN001, ANN201
    """A TensorRT-flavour copy of ``model`` whose MatMul weights are int4 / int8 behind ``DequantizeLinear``."""
    import onnx
    from onnx import version_converter

    if spec.kind == "int4":
        work = version_converter.convert_version(model, max(QDQ_OPSET, _opset(model)))
        work.ir_version = max(work.ir_version, 10)  # INT4 needs IR 10
    else:  # int8 stays at the export's opset (>= 13: per-axis DequantizeLinear), which TensorRT 10.3 parses
        work = onnx.ModelProto()
        work.CopyFrom(model)
    for n in work.graph.node:
        if not n.name:
            n.name = f"{n.op_type}_{id(n)}"
    exclude = set() if spec.lm_head else set(_lm_head_nodes(work, vocab_size))
    if spec.kind == "int4":
        import logging

        from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                     MatMulNBitsQuantizer)
        from onnxruntime.quantization.quant_utils import QuantFormat

        cfg = DefaultWeightOnlyQuantConfig(block_size=spec.block_size, is_symmetric=True, bits=4,
                                           quant_format=QuantFormat.QDQ, op_types_to_quantize=("MatMul",))
        level = logging.getLogger("onnxruntime.quantization").level
        logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
        try:
            q = MatMulNBitsQuantizer(work, algo_config=cfg, nodes_to_exclude=sorted(exclude))
            q.process()
        finally:
            logging.getLogger("onnxruntime.quantization").setLevel(level)
        out = q.model.model
    else:
        out = _int8_per_channel(work, exclude)
    onnx.checker.check_model(out)
    return out


def _opset(model) -> int:  # noqa: ANN001
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _int8_per_channel(model, exclude: set[str]):  # noqa: ANN001, ANN202
    """MatMul(x, W[K, N]) -> MatMul(x, DequantizeLinear(W_q int8, scale[N], axis=1)), symmetric round to
    nearest (ONNX Runtime's weight-only quantizer writes int8 only as MatMulNBits, so this one is ours)."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    users: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            users[i] = users.get(i, 0) + 1
    new_nodes, made = [], set()
    for n in model.graph.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if w is None or len(w.dims) != 2 or n.name in exclude:
            new_nodes.append(n)
            continue
        q_name, s_name = f"{w.name}_DQ_Q8", f"{w.name}_DQ_scales"
        if w.name not in made:
            arr = numpy_helper.to_array(w)
            a32 = arr.astype(np.float32)
            scale = np.maximum(np.abs(a32).max(axis=0), 1e-12) / 127.0  # [N]
            qw = np.clip(np.rint(a32 / scale), -127, 127).astype(np.int8)
            model.graph.initializer.extend([numpy_helper.from_array(qw, q_name),
                                            numpy_helper.from_array(scale.astype(arr.dtype), s_name)])
            made.add(w.name)
        out = f"{n.name}_DQ_Q8_output"
        new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [out], name=f"{n.name}_DQ_Q8",
                                          axis=1))
        new_nodes.append(helper.make_node("MatMul", [n.input[0], out], list(n.output), name=n.name))
        users[w.name] -= 1
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    keep = [t for t in model.graph.initializer if users.get(t.name, 1) > 0]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return model


def verify_qdq(qdq, original) -> dict:  # noqa: ANN001
    """Every DequantizeLinear of ``qdq`` (evaluated by ``onnx.reference``) reproduces the weight it replaced in
    ``original`` within one quantization step; returns the report entries. Raises DFlash2Error otherwise."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    orig = {t.name: t for t in original.graph.initializer}
    inits = {t.name: t for t in qdq.graph.initializer}
    checked, worst = 0, 0.0
    for n in qdq.graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        wq = ReferenceEvaluator(_single_node_model(qdq, n, inits)).run(None, {})[0].astype(np.float32)
        src = orig.get(n.input[0].rsplit("_DQ_Q", 1)[0])  # both quantizers name the int weight W_DQ_Q{bits}
        if src is None:
            raise DFlash2Error(f"Q/DQ check: no original weight for {n.name}")
        w = numpy_helper.to_array(src).astype(np.float32)
        step = float(np.abs(numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)).max())
        err = float(np.abs(wq - w.reshape(wq.shape)).max())
        if not err <= step * (1 + 1e-3) + 1e-6:
            raise DFlash2Error(f"Q/DQ check: {n.name} dequantizes {err:.3g} away from the weight "
                               f"(one quantization step is {step:.3g})")
        checked += 1
        worst = max(worst, err / max(step, 1e-12))
    if not checked:
        raise DFlash2Error("Q/DQ check: the graph has no DequantizeLinear")
    return {"target_qdq.dequantized_weights": checked, "target_qdq.max_error_in_steps": round(worst, 4)}


def _single_node_model(model, node, inits):  # noqa: ANN001, ANN202
    from onnx import helper

    g = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info(node.output[0], 0, None)],
                          [inits[i] for i in node.input if i])
    # onnx.reference implements DequantizeLinear from opset 19 on; for int8 per-axis its meaning is opset 13's
    opset = helper.make_opsetid("", max(_opset(model), 19))
    return helper.make_model(g, opset_imports=[opset], ir_version=max(model.ir_version, 9))
