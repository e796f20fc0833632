"""The ONNX Runtime flavour of the target graph: ORT's fused contrib ops (``com.microsoft``), written
directly from the HF weights with ``onnx.helper`` (no tracing).

Per decoder layer: ``SkipSimplifiedLayerNormalization`` (residual add + RMSNorm in one node; its fourth
output is the residual stream, i.e. the previous layer's output, which is where the context-feature taps
are read), one packed QKV ``MatMul``, ``GroupQueryAttention`` with RoPE fused (``do_rotary``), the output
projection, gate / up / down ``MatMul`` with SiLU. The standard-ONNX ``target.onnx`` (TensorRT's parser
knows no ``com.microsoft`` op) stays as it is; this graph is ``target_ort.onnx``.

I/O and KV-cache convention (differs from ``target.onnx``: the cache is a *shared* past/present buffer)::

    input_ids               [B, S] int64      the S new tokens (positions P..P+S-1)
    seqlens_k               [B] int32          P + S - 1 (GroupQueryAttention's "total length - 1")
    total_sequence_length   [] int32           P + S
    past_key_values.{i}.key / .value [B, kvh, C, d]   capacity buffer: slots 0..P-1 valid
    -> logits [B, S, V] fp32, context_features [B, S, n*H],
       present.{i}.key / .value [B, kvh, C, d]  the same buffer with slots P..P+S-1 written

The runtime binds ``past`` and ``present`` to the *same* OrtValue (IOBinding), so GroupQueryAttention
writes the new rows in place and copies nothing; new rows attend causally to each other and to slots
< P. Cropping rejected draft rows costs nothing: the next call passes a smaller ``seqlens_k`` /
``total_sequence_length`` and overwrites the stale slots (documented GroupQueryAttention behaviour).
Run without buffer sharing (a plain ``InferenceSession.run``) the graph returns a present buffer of
max(C, P + S) slots holding slots 0..P+S-1.

Supported targets: the dense family's (:func:`dflash2_trt.targets.dense.check_exportable`); q/k RMS norms (Qwen3)
are applied outside the attention node (the CPU kernel ignores GroupQueryAttention's norm inputs); biases
(Qwen2) are an Add after the packed projection.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dflash2_trt.manifest import ORT_SUFFIX, TARGET_ORT, target_kv_names, target_present_names

ORT_DOMAIN = "com.microsoft"


class _Builder:
    """A flat list of nodes + initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0

    def init(self, name: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, name: str | None = None,
           outputs: list[str] | None = None, domain: str = "", **attrs: Any) -> list[str]:
        from onnx import helper

        self._n += 1
        base = name or f"{op_type}_{self._n}"
        outs = outputs if outputs is not None else [f"{base}/out{j}" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain, **attrs))
        return outs


def _np(t) -> np.ndarray:  # noqa: ANN001
    return t.detach().float().cpu().numpy()


def rope_tables(hf_model, n_positions: int) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """cos, sin [n_positions, d/2] fp32 from the HF rotary module (its inv_freq already holds linear /
    llama3 / yarn scaling; attention_scaling multiplies both, as HF does)."""
    rot = hf_model.model.rotary_emb
    inv = _np(rot.inv_freq).astype(np.float64)  # [d/2]
    scale = float(getattr(rot, "attention_scaling", 1.0))
    f = np.arange(n_positions, dtype=np.float64)[:, None] * inv[None]  # [P, d/2]
    return (np.cos(f) * scale).astype(np.float32), (np.sin(f) * scale).astype(np.float32)


def build_target(hf_model, layer_ids: list[int], n_positions: int, opset: int = 17):  # noqa: ANN001, ANN201
    """The fused target graph (fp32) as an in-memory ``ModelProto``; ``n_positions`` = rows of the RoPE
    tables (the largest position + 1 the runtime may feed)."""
    from onnx import TensorProto, helper

    from dflash2_trt.targets import dense

    dense.check_exportable(hf_model)
    cfg = hf_model.config
    base = hf_model.model
    nl = len(base.layers)
    a0 = base.layers[0].self_attn
    nh, kvh = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    d = int(a0.head_dim)
    H = int(cfg.hidden_size)
    eps = float(cfg.rms_norm_eps)
    g = _Builder()
    cos, sin = rope_tables(hf_model, n_positions)
    g.init("rope_cos", cos)
    g.init("rope_sin", sin)
    embed = g.init("embed_tokens", _np(base.embed_tokens.weight))  # [V, H]
    res = g.op("Gather", [embed, "input_ids"], name="embed")[0]  # [B, S, H]
    x = g.op("SimplifiedLayerNormalization", [res, g.init("layers.0.input_norm", _np(base.layers[0].input_layernorm.weight))],
             name="layers.0/input_norm", axis=-1, epsilon=eps)[0]
    taps: dict[int, str] = {}
    past, present = target_kv_names(nl), target_present_names(nl)
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        p = f"layers.{i}"
        wq, wk, wv = _np(a.q_proj.weight), _np(a.k_proj.weight), _np(a.v_proj.weight)  # [out, H]
        qkv = g.op("MatMul", [x, g.init(f"{p}.qkv_proj", np.concatenate([wq, wk, wv]).T)], name=f"{p}/qkv_proj")[0]
        if a.q_proj.bias is not None:
            bias = np.concatenate([_np(a.q_proj.bias), _np(a.k_proj.bias), _np(a.v_proj.bias)])
            qkv = g.op("Add", [qkv, g.init(f"{p}.qkv_bias", bias)], name=f"{p}/qkv_bias")[0]
        if hasattr(a, "q_norm"):  # Qwen3: per-head RMS norm on q and k before RoPE
            split = g.init(f"{p}.qkv_split", np.array([nh * d, kvh * d, kvh * d], dtype=np.int64))
            q, k, v = g.op("Split", [qkv, split], n_out=3, name=f"{p}/qkv_split", axis=-1)
            q = _head_norm(g, q, nh, d, _np(a.q_norm.weight), float(a.q_norm.variance_epsilon), f"{p}/q_norm")
            k = _head_norm(g, k, kvh, d, _np(a.k_norm.weight), float(a.k_norm.variance_epsilon), f"{p}/k_norm")
            attn_in = [q, k, v]
        else:
            attn_in = [qkv, "", ""]  # packed QKV
        o = g.op("GroupQueryAttention",
                 [*attn_in, *past[2 * i: 2 * i + 2], "seqlens_k",
                  "total_sequence_length", "rope_cos", "rope_sin"],
                 outputs=[f"{p}/attn_out", *present[2 * i: 2 * i + 2]], name=f"{p}/attn",
                 domain=ORT_DOMAIN, num_heads=nh, kv_num_heads=kvh, scale=float(a.scaling), do_rotary=1,
                 rotary_interleaved=0, local_window_size=-1)[0]  # [B, S, nh*d]
        o = g.op("MatMul", [o, g.init(f"{p}.o_proj", _np(a.o_proj.weight).T)], name=f"{p}/o_proj")[0]
        x, res = _skip_norm(g, o, res, _np(layer.post_attention_layernorm.weight), eps, f"{p}/post_attention_norm")
        m = layer.mlp
        gate = g.op("MatMul", [x, g.init(f"{p}.gate_proj", _np(m.gate_proj.weight).T)], name=f"{p}/gate_proj")[0]
        up = g.op("MatMul", [x, g.init(f"{p}.up_proj", _np(m.up_proj.weight).T)], name=f"{p}/up_proj")[0]
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], name=f"{p}/sigmoid")[0]], name=f"{p}/silu")[0]
        act = g.op("Mul", [act, up], name=f"{p}/gate_up")[0]
        down = g.op("MatMul", [act, g.init(f"{p}.down_proj", _np(m.down_proj.weight).T)], name=f"{p}/down_proj")[0]
        nxt = base.layers[i + 1].input_layernorm.weight if i + 1 < nl else base.norm.weight
        x, res = _skip_norm(g, down, res, _np(nxt), eps, f"layers.{i + 1}/input_norm" if i + 1 < nl else "final_norm")
        # the residual stream after layer i == HF hidden_states[i + 1]; the last entry is after the final norm
        taps[i] = res if i + 1 < nl else x
    lm = _np(hf_model.lm_head.weight).T  # [H, V]
    g.op("MatMul", [x, g.init("lm_head", lm)], outputs=["logits"], name="lm_head")
    if layer_ids:
        g.op("Concat", [taps[j] for j in layer_ids], outputs=["context_features"], name="context_features", axis=-1)
    else:
        raise ValueError("the fused target graph needs at least one tapped layer")

    F = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("logits", F, ["batch", "sequence", int(lm.shape[1])]),
               helper.make_tensor_value_info("context_features", F, ["batch", "sequence", len(layer_ids) * H])]
    for name in past:
        inputs.append(helper.make_tensor_value_info(name, F, ["batch", kvh, "capacity", d]))
    for name in present:
        outputs.append(helper.make_tensor_value_info(name, F, ["batch", kvh, "present_capacity", d]))
    graph = helper.make_graph(g.nodes, "dflash2_target_ort", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(ORT_DOMAIN, 1)],
                              producer_name="dflash2_trt")
    model.ir_version = min(model.ir_version, 10)
    return model


def _skip_norm(g: _Builder, x: str, skip: str, weight: np.ndarray, eps: float, name: str) -> tuple[str, str]:
    """(normed(x + skip), x + skip)."""
    out = g.op("SkipSimplifiedLayerNormalization", [x, skip, g.init(f"{name}.weight", weight)],
               outputs=[f"{name}/out", "", "", f"{name}/sum"], name=name, domain=ORT_DOMAIN, epsilon=eps)
    return out[0], out[3]


def _head_norm(g: _Builder, x: str, heads: int, d: int, weight: np.ndarray, eps: float, name: str) -> str:
    """x [B, S, heads*d] -> RMSNorm over each head's d channels -> [B, S, heads*d]."""
    shp = g.init(f"{name}.shape", np.array([0, 0, heads, d], dtype=np.int64))
    flat = g.init(f"{name}.flat", np.array([0, 0, heads * d], dtype=np.int64))
    y = g.op("Reshape", [x, shp], name=f"{name}/split_heads")[0]
    y = g.op("SimplifiedLayerNormalization", [y, g.init(f"{name}.weight", weight)], name=name, axis=-1, epsilon=eps)[0]
    return g.op("Reshape", [y, flat], name=f"{name}/merge_heads")[0]


# ----------------------------------------------------------------------------------------------------
# Export-time: build, check against PyTorch, quantize
# ----------------------------------------------------------------------------------------------------

TARGET_ORT_FILE = "target_ort.onnx"


def session_from_model(model, threads: int | None = None):  # noqa: ANN001, ANN201
    """An ORT CPU session over an in-memory ModelProto (weights inline)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run_chunks(sess, target, ids: np.ndarray, n1: int, garbage: np.ndarray, capacity: int):  # noqa: ANN001
    """Plain ``session.run`` calls over capacity buffers holding stale slots (the graph, not the runtime's
    runner, is under test): ids[:n1], then ``garbage`` rows that are cropped away (their slots stay written and
    must be hidden by ``seqlens_k``), then ids[n1:]. -> logits, features of ids."""
    cfg = target.model.config
    d = int(target.model.model.layers[0].self_attn.head_dim)
    rng = np.random.default_rng(1)
    names = target_kv_names(target.num_layers)
    past = [rng.standard_normal((1, int(cfg.num_key_value_heads), capacity, d)).astype(np.float32) for _ in names]
    n = 0

    def run(chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nonlocal past, n
        S = len(chunk)
        feed = {"input_ids": chunk.reshape(1, -1).astype(np.int64),
                "seqlens_k": np.array([n + S - 1], dtype=np.int32),
                "total_sequence_length": np.array(n + S, dtype=np.int32), **dict(zip(names, past))}
        out = sess.run(None, feed)
        past = list(out[2:])  # present = past with slots n..n+S-1 written
        n += S
        return out[0][0], out[1][0]

    l1, f1 = run(ids[:n1])
    run(garbage)
    n = n1  # crop: the garbage rows' slots stay written, hidden by seqlens_k
    l2, f2 = run(ids[n1:])
    return np.concatenate([l1, l2]), np.concatenate([f1, f2])


def verify_target_ort(model, target, layer_ids: list[int], quantized=None, seed: int = 0) -> dict:  # noqa: ANN001
    """The fused graph vs the HF model (strict, like every graph), and — when given — the quantized graph vs
    the fused fp32 one (reported, not enforced: quantization changes the numbers by design)."""
    import torch

    from dflash2_trt.export.verify import TOL, _close, _decisions

    rng = np.random.default_rng(seed)
    n1, n2 = 7, 5
    ids = rng.integers(0, target.vocab_size, n1 + n2)
    garbage = rng.integers(0, target.vocab_size, 4)
    target.reset(layer_ids)
    want_logits, want_feats = target.forward(torch.from_numpy(ids))
    report: dict = {}
    logits, feats = _run_chunks(session_from_model(model), target, ids, n1, garbage, 64)
    _close("target_ort.logits", logits, want_logits.float().numpy(), TOL["fp32"], report)
    _close("target_ort.context_features", feats, want_feats.float().numpy(), TOL["fp32"], report)
    _decisions("target_ort.argmax", logits.argmax(-1), want_logits.argmax(-1).numpy(), report, 0.9)
    if quantized is not None:
        ql, _ = _run_chunks(session_from_model(quantized), target, ids, n1, garbage, 64)
        scale = max(1.0, float(np.abs(logits).max()))
        report["target_ort.quantized.logits_rel_err"] = float(np.abs(ql - logits).max()) / scale
        report["target_ort.quantized.argmax_match"] = float(np.mean(ql.argmax(-1) == logits.argmax(-1)))
    return report


def fused_target_unsupported(hf_model) -> str | None:  # noqa: ANN001
    """Why the fused target graph cannot hold ``hf_model`` (None: it can): ONNX Runtime's CPU GroupQueryAttention
    takes head sizes that are multiples of 16 only, and the fused graph is written for the dense family."""
    from dflash2_trt.targets import dense

    if getattr(hf_model.config, "model_type", None) not in dense.MODEL_TYPES:
        return f"the fused graph holds dense targets only, not {hf_model.config.model_type!r}"
    d = int(hf_model.model.layers[0].self_attn.head_dim)
    return None if d % 16 == 0 else f"GroupQueryAttention needs a head size that is a multiple of 16, this one is {d}"


def ort_flavour(models: dict, graphs: dict, target, layer_ids: list[int], n_positions: int, opset: int,  # noqa: ANN001
                quant, draft_quant, verify: bool) -> tuple[dict, dict, dict]:  # noqa: ANN001
    """``target_ort.onnx`` (weights quantized as ``quant`` says) and, with ``draft_quant`` enabled, ``*_ort.onnx``
    quantized variants of the drafter graphs that ONNX Runtime runs, beside the standard ``models`` / ``graphs``
    (graph key -> GraphSpec) -> the new (file -> ModelProto, key -> GraphSpec, verification report)."""
    from dflash2_trt.export.quantize import quantize_graph, quantized_matmuls
    from dflash2_trt.manifest import GraphSpec

    new_models: dict = {}
    new_graphs: dict = {}
    why = fused_target_unsupported(target.model)
    if why is None:
        fused = build_target(target.model, layer_ids, n_positions, opset)
        q = quantize_graph(fused, quant, target.vocab_size) if quant.enabled else None
        report = verify_target_ort(fused, target, layer_ids, q) if verify else {}
        new_models[TARGET_ORT_FILE] = q if q is not None else fused
        new_graphs[TARGET_ORT] = GraphSpec(file=TARGET_ORT_FILE, role="target", flavour="ort")
    else:  # ONNX Runtime runs the standard target graph (exact, without the fused graph's speed)
        report = {TARGET_ORT: f"not exported: {why}"}
    if draft_quant.enabled:
        for key, spec in graphs.items():
            if spec.role == "target" or spec.selector == "plugin" or spec.flavour == "ort":
                continue
            qm = quantize_graph(models[spec.file], draft_quant, target.vocab_size)
            if quantized_matmuls(qm):  # else the standard graph serves ORT too (e.g. an fp32 LM head alone)
                name = spec.file.replace(".onnx", f"{ORT_SUFFIX}.onnx")
                new_models[name] = qm
                new_graphs[key + ORT_SUFFIX] = dataclasses.replace(spec, file=name, flavour="ort")
    return new_models, new_graphs, report
