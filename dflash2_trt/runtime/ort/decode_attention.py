"""The fused target with ``dflash2.DecodeAttention`` in place of ``com.microsoft.GroupQueryAttention``: the
custom-op library of ``plugins/ortDecodeAttention`` (built with CMake, loaded into the session) and the load-time
graph rewrite that swaps the op.

Why: ORT's CPU GroupQueryAttention runs Q x K' and P x V as small per-head GEMMs, and with more than one new row it
leaves the GEMV path and packs V per head per call: at 1024 cached positions a 2-row call's attention costs about
twice a 1-row call's (benchmarks/ort_op_profile.py). DecodeAttention walks each row's keys and values once, so k
rows cost k x their arithmetic, and a row's output does not depend on the number of rows in the call (row i of a
k-row verify equals the plain step at that position bit for bit; tests/test_ort_decode_attention.py).

The rewrite also gives the graph one more input, ``past_seqlens`` [B] int32 (each sequence's cached length P_b,
:data:`~dflash2_trt.manifest.TARGET_PAST_SEQLENS`), fed to every DecodeAttention node: with it a call carries a
different number of new rows per sequence (a batch of plain steps, verifies and prefills in one call): sequence b
has ``seqlens_k[b] + 1 - past_seqlens[b]`` real rows, right-padded to the call's S; padding rows return zeros and
write nothing (the op's contract: plugins/ortDecodeAttention/ortCustomOp.cpp). A B = 1 call feeds
``past_seqlens = [P]`` and computes exactly what it computed without it. And a third: ``logits_index`` [B, R, 1]
int64 (:data:`~dflash2_trt.manifest.TARGET_LOGITS_INDEX`) picks, per sequence, the R rows whose logits the LM
head computes (a GatherND before it): a prefill needs its last row's only, and on a CPU the LM head is a fifth of
a prompt's arithmetic (SmolLM2-135M: 28M of 135M weights). The runners feed all rows except for a batched
prefill; the context features stay every row's.

And a fourth: every MatMul by a constant weight becomes ``dflash2.PanelMatMul`` (same library) over the weight's
16-column panels, folded from the shared [K, N] weight when the session loads, and every exact int4 MatMulNBits
(an ``--quantize int4`` target at accuracy level 0) ``dflash2.PanelMatMulQ4`` over its 4-bit weights in the same
panels, where the CPU has AVX-512 (:func:`panels_wanted`): a k-row verify then reads the weights once, as a plain
step does, so its extra rows cost their arithmetic (plugins/ortDecodeAttention/README.md has the figures).
When the session loads, each PanelMatMul kernel also looks for an exact code of its weights (4-bit blocks with a
scale and a minimum, 8-bit blocks with a scale, fp16, bf16: what a target converted from a GGUF file or an fp16 /
bf16 checkpoint holds); where one reproduces every weight bit for bit the kernel reads the code instead (SmolLM2
from its Q4_1 GGUF: 0.75 bytes a weight instead of 4) and gives the fp32 kernel's numbers
(``load(weight_codes=False)``, or :data:`CODES_ENV` = 0 for the whole process, keeps the fp32 panels;
:func:`panel_codes` counts the codes).

The library also runs the path selector's TensorRT plugin node (``trt.plugins.DFlash2PathSelector``, the
selector's CPU twin: the CUDA kernel's numbers), so the drafter head's ``.plugin.onnx`` graph loads in ONNX Runtime,
and ``dflash2.DrafterLayer``, a whole drafter decoder layer in one node, which the export's
``drafter_block_layers.onnx`` holds (:func:`register`; the backend picks both,
:meth:`~dflash2_trt.runtime.ort.backend.OrtBackend.head_key` / ``block_key``).

The rewrite keeps every other node and the weights (read from the export folder's external data file, so the
weights are on disk and in memory once). It needs the ``onnx`` package to edit the graph and the built library;
without either, the runtime runs GroupQueryAttention as before (:func:`available` says why).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error

LIBRARY_ENV = "DFLASH2_ORT_OPS"  # path of libdflash2_ort_ops.so, overriding the search below
LIBRARY_NAME = "libdflash2_ort_ops.so"
PANELS_ENV = "DFLASH2_ORT_PANELS"  # 0: keep ORT's MatMul, 1: PanelMatMul (default: AVX-512 kernels; panels_wanted)
CODES_ENV = "DFLASH2_ORT_PANEL_CODES"  # 0: PanelMatMul computes from its fp32 weights even where an exact code fits
PANEL_CODES = ("none", "affine4", "scaled8", "bf16", "fp16")  # plugins/ortDecodeAttention/panelCodes.h, in its order
OP_DOMAIN = "dflash2"
OP_TYPE = "DecodeAttention"
MATMUL_OP_TYPE = "PanelMatMul"
MATMUL_Q4_OP_TYPE = "PanelMatMulQ4"
PANEL_WIDTH = 16  # columns per panel (plugins/ortDecodeAttention/panelMatMul.h)
_ROOT = Path(__file__).resolve().parents[3]


# what running without the library costs, said wherever the runtime names its path (Generator.note, /health)
WITHOUT_LIBRARY = "the plain ONNX Runtime graph, ~2x slower here; see docs/onnxruntime.md"


def find_library() -> Path | None:
    """$DFLASH2_ORT_OPS, else the package's lib/ (where ``pip install`` puts it, beside libdflash2:
    dflash2_trt.native), else the package folder, else the source tree's CMake build (build/ort_ops)."""
    from dflash2_trt.native import LIB_DIR

    env = os.environ.get(LIBRARY_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    for p in (LIB_DIR / LIBRARY_NAME, Path(__file__).resolve().parent / LIBRARY_NAME,
              _ROOT / "build" / "ort_ops" / LIBRARY_NAME):
        if p.is_file():
            return p
    return None


def available() -> tuple[bool, str]:
    """(usable, why not: one line that names what is missing and what running without it costs)."""
    if find_library() is None:
        return False, f"op library not found ({LIBRARY_NAME}; or set {LIBRARY_ENV}): {WITHOUT_LIBRARY}"
    try:
        import onnx  # noqa: F401
    except ImportError:
        return False, f"op library unused: the onnx package is not installed (pip install onnx): {WITHOUT_LIBRARY}"
    return True, ""


def onnx_model(serialized: bytes) -> Any:
    """A rewritten graph (:func:`rewrite`'s bytes) parsed again -> onnx.ModelProto (its weights stay on disk)."""
    import onnx

    return onnx.load_from_string(serialized)


def library_nodes(model: Any) -> dict[str, int]:
    """The nodes of an ONNX graph (onnx.ModelProto) that the library runs (its ``dflash2`` ops and the selector's
    ``trt.plugins`` node) -> {op type: count}."""
    out: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain in (OP_DOMAIN, "trt.plugins"):
            out[node.op_type] = out.get(node.op_type, 0) + 1
    return out


def _load_graph(path: Path) -> Any:
    """The ONNX graph at ``path`` without its external weights -> onnx.ModelProto; a file that does not parse (a
    truncated or corrupted graph, met when checksums are off) -> DFlash2Error naming it."""
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and onnx's own
        raise DFlash2Error(f"{path.name} is not a readable ONNX graph ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}): a truncated or corrupted "
                           f"file (re-export; checksums off let it through)") from None


def rewrite(path: Path, panels: bool | None = None, codes: bool = True) -> bytes | None:
    """target_ort.onnx (fp32, external weights left on disk) with every GroupQueryAttention node replaced by
    DecodeAttention (and the graph input ``past_seqlens`` [batch] int32 fed to each), and the LM head's input
    gathered by ``logits_index`` -> serialized model; None when the graph has no GroupQueryAttention or no LM head
    producing ``logits``, or its caches are not fp32. ``panels``, ``codes``: the MatMul swap
    (:func:`panels_wanted`, :func:`_swap_matmuls`)."""
    import onnx
    from onnx import helper

    from dflash2_trt.manifest import TARGET_LOGITS_INDEX, TARGET_PAST_SEQLENS

    model = _load_graph(path)
    kv = [i for i in model.graph.input if i.name.startswith("past_key_values")]
    if not kv or kv[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
        return None
    n_swapped = 0
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("do_rotary", 0) != 1 or attrs.get("rotary_interleaved", 0) != 0 or \
                attrs.get("local_window_size", -1) not in (-1, 0) or attrs.get("softcap", 0.0) != 0.0:
            return None  # a variant DecodeAttention does not implement
        ins = list(node.input)
        # qkv (packed; key/value inputs empty), past_key, past_value, seqlens_k, total_sequence_length, cos, sin
        if len(ins) < 9 or ins[1] or ins[2]:
            return None
        node.ClearField("input")
        node.input.extend([ins[0], *ins[3:9], TARGET_PAST_SEQLENS])
        node.ClearField("attribute")
        node.attribute.extend([helper.make_attribute("num_heads", int(attrs["num_heads"])),
                               helper.make_attribute("kv_num_heads", int(attrs["kv_num_heads"])),
                               helper.make_attribute("scale", float(attrs.get("scale", 0.0)))])
        node.op_type, node.domain = OP_TYPE, OP_DOMAIN
        n_swapped += 1
    head = [n for n in model.graph.node if list(n.output) == ["logits"]]
    if not n_swapped or len(head) != 1:
        return None
    # hidden [B, S, H] -> its rows logits_index [B, R, 1] -> [B, R, H] -> the LM head -> logits [B, R, V]
    rows = "lm_head/rows"
    gather = helper.make_node("GatherND", [head[0].input[0], TARGET_LOGITS_INDEX], [rows], name="lm_head/gather_rows",
                              batch_dims=1)
    head[0].input[0] = rows
    model.graph.node.insert(list(model.graph.node).index(head[0]), gather)
    for out in model.graph.output:
        if out.name == "logits":
            out.type.tensor_type.shape.dim[1].dim_param = "logits_rows"
    model.graph.input.append(helper.make_tensor_value_info(TARGET_PAST_SEQLENS, onnx.TensorProto.INT32, ["batch"]))
    model.graph.input.append(helper.make_tensor_value_info(TARGET_LOGITS_INDEX, onnx.TensorProto.INT64,
                                                           ["batch", "logits_rows", 1]))
    if panels_wanted(panels):
        _swap_matmuls(model, codes)
    model.opset_import.append(helper.make_opsetid(OP_DOMAIN, 1))
    return model.SerializeToString()


ISA_ENV = "DFLASH2_ORT_PANELS_AVX512"  # 0: the AVX2 kernels even where the CPU has AVX-512 (read by the library)
KERNEL_ISAS = {512: "avx512", 256: "avx2", 0: "portable"}  # dflash2OrtKernelIsa's answers (ortCustomOp.cpp)


def kernel_isa() -> str:
    """The instruction set this process's panel and attention kernels run, as the library chose it once
    (``avx512`` where the CPU has AVX-512F and :data:`ISA_ENV` is not 0; ``avx2`` on any other x86-64, the library's
    baseline; ``portable`` on another architecture) -> one of :data:`KERNEL_ISAS`' names. Without the library:
    ``portable``."""
    import ctypes

    lib = find_library()
    if lib is None:
        return "portable"
    isa = ctypes.CDLL(str(lib)).dflash2OrtKernelIsa
    isa.restype, isa.argtypes = ctypes.c_int32, []
    return KERNEL_ISAS[int(isa())]


def panels_wanted(panels: bool | None = None) -> bool:
    """Whether the rewrite swaps the MatMuls: ``panels`` (``load(panels=...)``) when given, else :data:`PANELS_ENV`,
    else where the kernels run AVX-512 (:func:`kernel_isa`): there PanelMatMul's many-row path (a prefill, a batch of
    16) keeps up with ONNX Runtime's packed GEMM; with AVX2 alone it takes twice as long, so those CPUs keep ORT's
    MatMul."""
    if panels is not None:
        return bool(panels)
    v = os.environ.get(PANELS_ENV)
    if v is not None:
        return v != "0"
    return kernel_isa() == "avx512"


def panel_codes() -> dict[str, int]:
    """The weight matrices this process's PanelMatMul and DrafterLayer kernels keep, by the exact code they fit
    (:data:`PANEL_CODES`; "none": the fp32 weights; plugins/ortDecodeAttention/panelCodes.h): the library's own
    count."""
    import ctypes

    count = ctypes.CDLL(str(find_library())).dflash2OrtPanelCodes
    count.restype, count.argtypes = ctypes.c_int64, [ctypes.c_int32]
    return {name: int(count(i)) for i, name in enumerate(PANEL_CODES)}


def _swap_matmuls(model: Any, codes: bool = True) -> int:
    """Every MatMul by a constant fp32 weight [K, N] (N a multiple of 16) -> PanelMatMul(x, the weight reshaped to
    [K, N/16, 16] and transposed to [N/16, K, 16]), and every int4 MatMulNBits that computes in fp32 (symmetric, no
    zero points, accuracy level 0: the lossless quantized target) -> PanelMatMulQ4(x, its packed weights and its
    scales in panels of 16 columns): constant nodes that ONNX Runtime folds when the session loads, so the session
    holds the panels in place of the weights (the file keeps the weights every graph shares) -> the number swapped.
    A MatMulNBits at accuracy level 4 (int8 activations: the user's choice of speed over exactness) stays as it is.
    ``codes=False``: each PanelMatMul node says ``codes=0``, its kernel computes from the fp32 panels even where an
    exact weight code fits (the same numbers; ``load(weight_codes=False)``)."""
    import onnx
    from onnx import helper, numpy_helper

    import numpy as np

    inits = {t.name: t for t in model.graph.initializer}
    nodes = list(model.graph.node)
    model.graph.ClearField("node")
    swapped = 0

    def panels(name: str, src: str, shape: list[int], perm: list[int]) -> str:
        """Constant ``src`` reshaped to ``shape``, transposed by ``perm`` (folded at load) -> its name."""
        s = numpy_helper.from_array(np.array(shape, dtype=np.int64), f"{name}_shape")
        model.graph.initializer.append(s)
        model.graph.node.extend([
            helper.make_node("Reshape", [src, s.name], [f"{name}_reshaped"], name=f"{name}/reshape"),
            helper.make_node("Transpose", [f"{name}_reshaped"], [name], name=f"{name}/transpose", perm=perm)])
        return name

    for node in nodes:
        name = node.name or f"matmul_{swapped}"
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is not None and len(w.dims) == 2 and w.data_type == onnx.TensorProto.FLOAT and \
                not w.dims[1] % PANEL_WIDTH:
            K, N = int(w.dims[0]), int(w.dims[1])
            packed = panels(f"{name}/panels", w.name, [K, N // PANEL_WIDTH, PANEL_WIDTH], [1, 0, 2])  # [N/16, K, 16]
            model.graph.node.append(helper.make_node(MATMUL_OP_TYPE, [node.input[0], packed], list(node.output),
                                                     name=name, domain=OP_DOMAIN, **({} if codes else {"codes": 0})))
        elif (q4 := _q4_shape(node, inits)) is not None:
            K, N, block = q4
            per = [N // PANEL_WIDTH, PANEL_WIDTH]  # [N, ...] -> [N/16, 16, cols] -> [N/16, cols, 16]
            packed = panels(f"{name}/q4_panels", node.input[1], per + [K // 2], [0, 2, 1])
            scales = panels(f"{name}/q4_scales", node.input[2], per + [K // block], [0, 2, 1])
            model.graph.node.append(helper.make_node(MATMUL_Q4_OP_TYPE, [node.input[0], packed, scales],
                                                     list(node.output), name=name, domain=OP_DOMAIN))
        else:
            model.graph.node.append(node)
            continue
        swapped += 1
    return swapped


def _q4_shape(node: Any, inits: dict) -> tuple[int, int, int] | None:
    """(K, N, block size) of a MatMulNBits node that PanelMatMulQ4 computes as specified: 4 bits, fp32 compute
    (accuracy level 0), symmetric (no zero points, g_idx or bias), constant weights and fp32 scales, N a multiple
    of 16 -> else None."""
    import math

    import onnx
    from onnx import helper

    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) < 3 or \
            any(node.input[3:]):
        return None
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    K, N, block = int(a.get("K", 0)), int(a.get("N", 0)), int(a.get("block_size", 0))
    b, s = inits.get(node.input[1]), inits.get(node.input[2])
    if a.get("bits", 4) != 4 or a.get("accuracy_level", 0) != 0 or b is None or s is None or \
            b.data_type != onnx.TensorProto.UINT8 or s.data_type != onnx.TensorProto.FLOAT or \
            block < 2 or block % 2 or K % block or N % PANEL_WIDTH or \
            list(b.dims) != [N, K // block, block // 2] or math.prod(s.dims) != N * (K // block):
        return None
    return K, N, block


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system after a session load that folded the panels: the folding
    frees every [K, N] weight, but glibc keeps freed heap chunks (SmolLM2: 1.0 GB resident after the load, 0.58 GB
    after this, as without the panels). A no-op where glibc is not the C library."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def prepare_panels(so: Any, path: Path, panels: bool | None = None,
                   codes: bool = True) -> bytes | None:  # so: onnxruntime.SessionOptions
    """A drafter graph with its MatMuls by constant weights swapped for PanelMatMul (the library registered on
    ``so``, weights from ``path``'s folder), or None (``so`` untouched) where the panels are not wanted
    (:func:`panels_wanted`) or nothing swaps."""
    from onnx import helper

    if not panels_wanted(panels):
        return None
    model = _load_graph(path)
    if not _swap_matmuls(model, codes):
        return None
    model.opset_import.append(helper.make_opsetid(OP_DOMAIN, 1))
    register(so, path)
    return model.SerializeToString()


def prepare(so: Any, path: Path, panels: bool | None = None,
            codes: bool = True) -> bytes | None:  # so: onnxruntime.SessionOptions
    """Register the library on ``so`` and return the rewritten model (weights from ``path``'s folder), or None
    (``so`` untouched) when the graph cannot take the op."""
    model = rewrite(path, panels, codes)
    if model is None:
        return None
    register(so, path)
    return model


def register(so: Any, path: Path) -> None:
    """The library on ``so`` (also for a graph holding the selector's plugin node, which the library runs); a
    rewritten graph's external weights read from ``path``'s folder."""
    lib = find_library()
    assert lib is not None
    so.register_custom_ops_library(str(lib))
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
