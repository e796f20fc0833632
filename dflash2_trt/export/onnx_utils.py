"""ONNX plumbing for the exporter: tracing, graph merging, the plugin selector graph, shared weights,
graph I/O descriptions and checksums. ``onnx`` / ``torch`` are imported lazily."""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error

WEIGHTS_FILE = "weights.bin"
_ALIGN = 4096  # external-data offsets are page aligned (lets ONNX Runtime map them)
_EXTERNAL_MIN_BYTES = 1024


def trace(module, args: tuple, input_names: list[str], output_names: list[str],
          dynamic_axes: dict[str, dict[int, str]], opset: int):  # noqa: ANN001, ANN201
    """Trace ``module`` with the TorchScript ONNX exporter into an in-memory ``ModelProto``."""
    import onnx
    import torch

    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(module, args, buf, input_names=input_names, output_names=output_names,
                              dynamic_axes=dynamic_axes, opset_version=opset, do_constant_folding=True,
                              dynamo=False)
        except Exception as e:  # the exporter raises many types
            raise DFlash2Error(f"ONNX export of {type(module).__name__} failed at opset {opset}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    model = onnx.load_from_string(buf.getvalue())
    _constants_to_initializers(model)
    flow = sorted({n.op_type for n in model.graph.node if n.op_type in ("If", "Loop", "Scan")})
    if flow:  # graphs must stay capturable (docs/tensorrt.md)
        raise DFlash2Error(f"ONNX export of {type(module).__name__} produced control flow ({', '.join(flow)})")
    return model


def _constants_to_initializers(model) -> None:  # noqa: ANN001
    """Large Constant nodes (captured buffers such as the shared embedding) become initializers, so they
    are stored once in the shared weights file like every parameter."""
    keep = []
    for node in model.graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value" \
                and len(node.attribute[0].t.SerializeToString()) >= _EXTERNAL_MIN_BYTES:
            t = node.attribute[0].t
            t.name = node.output[0]
            model.graph.initializer.append(t)
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)


def merge_selector(head, selector):  # noqa: ANN001, ANN201
    """Join a head graph (outputs cand_ids, unary, hidden_proj) and a selector graph (contract inputs)
    into one graph with outputs cand_ids, path_ids, proposal_probs. Selector-internal names get a
    ``selector/`` prefix so nothing collides."""
    import onnx

    from dflash2_trt.export import selector_contract as sc

    head = _copy(head)
    selector = _copy(selector)
    io_names = {n for n, _, _ in sc.INPUTS} | {n for n, _, _ in sc.OUTPUTS}
    init_names = {t.name for t in selector.graph.initializer}
    keep = io_names  # contract names (codebooks included) stay unprefixed

    def ren(name: str) -> str:
        return name if (not name or name in keep) else f"selector/{name}"

    g = selector.graph
    for node in g.node:
        node.name = f"selector/{node.name}"
        node.input[:] = [ren(n) for n in node.input]
        node.output[:] = [ren(n) for n in node.output]
    for t in g.initializer:
        t.name = ren(t.name)
    for vi in g.value_info:
        vi.name = ren(vi.name)
    hg = head.graph
    linked = {"cand_ids", "unary", "hidden_proj"}
    hg.node.extend(g.node)
    hg.initializer.extend(g.initializer)
    hg.value_info.extend(g.value_info)
    hg.input.extend([i for i in g.input if i.name not in linked and i.name not in init_names])
    outs = {o.name: o for o in hg.output}
    outs.update({o.name: o for o in g.output})
    del hg.output[:]
    hg.output.extend([outs["cand_ids"], outs["path_ids"], outs["proposal_probs"]])
    domains = {o.domain: o.version for o in head.opset_import}
    for o in selector.opset_import:
        domains[o.domain] = max(domains.get(o.domain, 0), o.version)
    del head.opset_import[:]
    head.opset_import.extend([onnx.helper.make_opsetid(d, v) for d, v in domains.items()])
    head.ir_version = max(head.ir_version, selector.ir_version)
    return head


def plugin_selector_graph(pred_codebook, succ_codebook, L: int, K: int, r: int, mode: str,  # noqa: ANN001
                          codebook_dtype: str, opset: int):  # noqa: ANN201
    """A one-node graph: ``trt.plugins::DFlash2PathSelector`` with the codebooks as initializers."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from dflash2_trt.export import selector_contract as sc

    sc.register_schema()
    ctype = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[codebook_dtype]
    B = "batch"
    inputs = [
        helper.make_tensor_value_info("cand_ids", TensorProto.INT32, [B, L, K]),
        helper.make_tensor_value_info("unary", TensorProto.FLOAT, [B, L, K]),
        helper.make_tensor_value_info("hidden_proj", ctype, [B, L, r]),
        helper.make_tensor_value_info("anchor_ids", TensorProto.INT32, [B]),
        helper.make_tensor_value_info("temperature", TensorProto.FLOAT, [B]),
        helper.make_tensor_value_info("uniforms", TensorProto.FLOAT, [B, L]),
    ]
    outputs = [helper.make_tensor_value_info("path_ids", TensorProto.INT32, [B, L]),
               helper.make_tensor_value_info("proposal_probs", TensorProto.FLOAT, [B, L, K])]
    inits = []
    for name, w in (("pred_codebook", pred_codebook), ("succ_codebook", succ_codebook)):
        t = numpy_helper.from_array(np.ascontiguousarray(w), name)
        if ctype == TensorProto.BFLOAT16:  # numpy has no bf16: w arrives as the uint16 bit pattern
            t = helper.make_tensor(name, TensorProto.BFLOAT16, list(w.shape), w.tobytes(), raw=True)
        inits.append(t)
    node = sc.make_selector_node([n for n, _, _ in sc.INPUTS], [n for n, _, _ in sc.OUTPUTS],
                                 top_k=K, rank=r, mode=mode, name="DFlash2PathSelector")
    graph = helper.make_graph([node], f"dflash2_selector_{mode}_plugin", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), sc.opset_import()],
                             producer_name="dflash2_trt")


def _copy(model):  # noqa: ANN001, ANN202
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def save_with_shared_weights(models: dict[str, Any], out_dir: Path) -> None:
    """Save each ``ModelProto`` as ``out_dir/NAME`` with every initializer >= 1 KiB moved into one shared,
    content-deduplicated ``weights.bin`` (the target's embedding, the drafter's shared tensors and the head
    variants' LM head and codebooks are stored once)."""
    import onnx

    offsets: dict[str, tuple[int, int]] = {}
    with open(out_dir / WEIGHTS_FILE, "wb") as f:
        for name, model in models.items():
            for t in model.graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    continue
                raw = _raw_bytes(t)
                if len(raw) < _EXTERNAL_MIN_BYTES:
                    continue
                key = hashlib.sha256(raw).hexdigest()
                if key not in offsets:
                    pos = f.tell()
                    pad = (-pos) % _ALIGN
                    f.write(b"\0" * pad)
                    offsets[key] = (pos + pad, len(raw))
                    f.write(raw)
                off, length = offsets[key]
                _clear_data(t)
                del t.external_data[:]
                for k, v in (("location", WEIGHTS_FILE), ("offset", str(off)), ("length", str(length))):
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v
                t.data_location = onnx.TensorProto.EXTERNAL
            onnx.save_model(model, str(out_dir / name))


def fp32_twin(src: Path, dst: Path) -> Path:
    """The bf16 graph ``src`` (external data beside it) as fp32, saved at ``dst``: every bf16 tensor type,
    initializer, constant attribute and Cast target becomes fp32 — exactly, bf16 values are fp32 values — so
    ONNX Runtime's CPU provider, which has no bf16 kernels, runs the export's own structure and weights; only
    the arithmetic's rounding differs."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    bf16, fp32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    model = onnx.load(str(src))

    def tensor(t) -> None:  # noqa: ANN001
        if t.data_type == bf16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    g = model.graph
    for t in g.initializer:
        tensor(t)
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.type.tensor_type.elem_type == bf16:
            vi.type.tensor_type.elem_type = fp32
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                tensor(a.t)
            elif n.op_type == "Cast" and a.name == "to" and a.i == bf16:
                a.i = fp32
    onnx.save_model(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return dst


def _raw_bytes(t) -> bytes:  # noqa: ANN001
    from onnx import numpy_helper

    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.to_array(t).tobytes()


def _clear_data(t) -> None:  # noqa: ANN001
    for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(f)


_ELEM = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
         11: "float64", 16: "bfloat16"}


def describe_io(model) -> dict:  # noqa: ANN001
    """{"inputs": [{name, dtype, shape}], "outputs": [...]} with symbolic dims as strings."""

    def one(vi) -> dict:  # noqa: ANN001
        tt = vi.type.tensor_type
        shape = [d.dim_param if d.dim_param else int(d.dim_value) for d in tt.shape.dim]
        return {"name": vi.name, "dtype": _ELEM.get(tt.elem_type, str(tt.elem_type)), "shape": shape}

    inits = {t.name for t in model.graph.initializer}
    return {"inputs": [one(i) for i in model.graph.input if i.name not in inits],
            "outputs": [one(o) for o in model.graph.output]}


def check_graph(path: Path) -> None:
    """``onnx.checker`` (full check, shape inference) with the plugin op schema registered."""
    import onnx

    from dflash2_trt.export import selector_contract as sc

    sc.register_schema()
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # checker / inference errors
        raise DFlash2Error(f"onnx.checker rejected {path.name}: {type(e).__name__}: {e}") from None


TRT_OPS_FILE = Path(__file__).with_name("trt_onnx_ops.json")


def trt_parser_refusals(model, plugin_ops: tuple[tuple[str, str], ...] = ()) -> list[str]:  # noqa: ANN001
    """What TensorRT's ONNX parser would not import in ``model`` (:data:`TRT_OPS_FILE`: its operator table and
    opset range): an opset of the default domain outside the range, a default-domain node not in the table, a node
    of another domain that is not one of ``plugin_ops`` ((domain, op_type) of the plugins the engine loads) ->
    one line each (empty: every node imports)."""
    import json

    table = json.loads(TRT_OPS_FILE.read_text())
    ops, (lo, hi) = set(table["operators"]), table["opsets"]
    out = []
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and not lo <= o.version <= hi:
            out.append(f"opset {o.version} outside TensorRT {table['tensorrt']}'s {lo}..{hi}")
    for n in model.graph.node:
        if n.domain in ("", "ai.onnx"):
            if n.op_type not in ops:
                out.append(f"node {n.name or n.op_type}: {n.op_type} is not in TensorRT {table['tensorrt']}'s parser")
        elif (n.domain, n.op_type) not in plugin_ops:
            out.append(f"node {n.name or n.op_type}: {n.domain}.{n.op_type} is neither ONNX nor a plugin the engine loads")
    return out
