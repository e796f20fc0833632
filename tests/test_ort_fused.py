"""The fused ONNX Runtime flavour (target_ort.onnx: GroupQueryAttention, SkipSimplifiedLayerNormalization,
packed QKV) and weight-only quantized exports (MatMulNBits), on make-tiny models: the graph vs PyTorch
through the runtime's shared KV buffers with crops, the backend's choice of graphs, lossless decoding with
respect to the quantized target with drafts actually accepted, manifest and bad input."""

from __future__ import annotations

import json
import onnx

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.protocol import Draft
from helpers import req

MAX_NEW = 24


def _graph(folder, key):
    import onnx

    m = json.loads((folder / "manifest.json").read_text())
    return onnx.load(str(folder / m["graphs"][key]["file"]), load_external_data=False), m


def test_fused_graph_ops_and_manifest(tiny_export, tiny_target):
    fused, m = _graph(tiny_export, "target_ort")
    std, _ = _graph(tiny_export, "target")
    nl = tiny_target.num_layers
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("GroupQueryAttention") == nl and ops.count("SkipSimplifiedLayerNormalization") == 2 * nl
    assert ops.count("MatMul") == 5 * nl + 1  # packed QKV, o, gate, up, down per layer + LM head
    assert not {"Softmax", "Pow", "ReduceMean", "Neg", "MatMulNBits"} & set(ops)
    gqa = next(n for n in fused.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute if a.name in ("do_rotary", "num_heads", "kv_num_heads")} == \
        {"do_rotary": 1, "num_heads": 4, "kv_num_heads": 2}
    # the TensorRT flavour keeps standard ONNX only
    assert not [n for n in std.graph.node if n.domain == "com.microsoft"]
    assert m["graphs"]["target_ort"]["flavour"] == "ort" and m["graphs"]["target"].get("flavour") is None
    assert m["quantization"]["kind"] == "none"
    assert m["verification"]["target_ort.argmax_match"] == 1.0 and m["verification"]["target_ort.logits"] < 1e-4


def test_fused_target_vs_pytorch_with_crops(tiny_export, tiny_target):
    """Fresh random chunks (prefill, 1-row steps, multi-row verifies) with random garbage rows cropped away,
    through shared buffers that grow (capacity step 8 -> rebinding) vs one HF pass over the kept tokens."""
    import onnxruntime as ort

    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    be = OrtBackend(tiny_export)
    cfg = tiny_target.model.config
    run = OrtFusedTargetRunner(be.session("target_ort").sess, ort, tiny_target.num_layers, cfg.num_key_value_heads,
                         cfg.hidden_size // cfg.num_attention_heads, tiny_target.vocab_size, 512, set(), step=8)
    rng = np.random.default_rng(1234)
    for trial in range(3):
        run.reset()
        kept, logits, feats = [], [], []
        while len(kept) < 60:
            chunk = rng.integers(0, tiny_target.vocab_size, int(rng.choice([1, 1, 3, 8, 13]))).tolist()
            lg, ft = run.forward(chunk)
            keep = int(rng.integers(1, len(chunk) + 1))  # verification keeps a prefix, crops the rest
            run.crop(len(kept) + keep)
            kept += chunk[:keep]
            logits.append(lg[:keep])
            feats.append(ft[:keep])
        assert run.cache_length == len(kept) and run.kv.capacity >= len(kept)
        tiny_target.reset([0, 2])
        want_l, want_f = tiny_target.forward(torch.tensor(kept))
        np.testing.assert_allclose(np.concatenate(logits), want_l.numpy(), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(np.concatenate(feats), want_f.numpy(), atol=2e-4, rtol=1e-4)


def test_backend_picks_fused_graphs(tiny_export, tiny_target):
    from torch_ref import ref_autoregressive
    from dflash2_trt.runtime.ort.backend import OrtBackend, OrtTargetRunner
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    fused, std = OrtBackend(tiny_export), OrtBackend(tiny_export, flavour="standard")
    assert isinstance(fused.target_runner(), OrtFusedTargetRunner) and isinstance(std.target_runner(), OrtTargetRunner)
    assert (fused.graphs_note, std.graphs_note) == ("fused", "standard")
    p = np.random.default_rng(3).integers(4, 500, 17).tolist()
    want = ref_autoregressive(tiny_target, p, MAX_NEW, eos_ids=set()).tokens
    for be in (fused, std):
        assert D.target_generate(be.target_runner(), p, req(MAX_NEW, eos_ids=set())).tokens == want
    with pytest.raises(DFlash2Error, match="flavour"):
        OrtBackend(tiny_export, flavour="fast")


@pytest.fixture(scope="module")
def quantized(tiny_dir, tmp_path_factory):
    """kind -> export folder: int4 (LM head quantized too) and int8 (LM head kept fp32), block size 16; and
    "drafter-int8": an fp32 target with an int8 drafter (export --drafter-quantize int8 alone)."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.export.quantize import QuantSpec

    out = {}
    for kind, lm_head in (("int4", True), ("int8", False)):
        out[kind] = tmp_path_factory.mktemp("export") / kind
        export_model(tiny_dir / "target", tiny_dir / "drafter", out[kind], progress=False, max_seq_len=512,
                     block_size=4, quantization=QuantSpec(kind, block_size=16, lm_head=lm_head))
    out["drafter-int8"] = tmp_path_factory.mktemp("export") / "drafter-int8"
    export_model(tiny_dir / "target", tiny_dir / "drafter", out["drafter-int8"], progress=False, max_seq_len=512,
                 block_size=4, drafter_quantization="int8")
    return out


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_graphs_and_manifest(quantized, kind):
    m = json.loads((quantized[kind] / "manifest.json").read_text())
    lm_head = kind == "int4"
    assert m["quantization"] == {"kind": kind, "block_size": 16, "accuracy_level": 0, "lm_head": lm_head,
                                 "symmetric": True}
    # the drafter follows the target's kind, at accuracy level 4 (int8 activations)
    assert m["drafter_quantization"] == {**m["quantization"], "accuracy_level": 4}
    assert 0 < m["verification"]["target_ort.quantized.argmax_match"] <= 1
    for key in ("target_ort", "drafter_context_ort", "drafter_block_ort", "drafter_head_greedy_ort",
                "drafter_head_independent_ort"):
        if key == "drafter_head_independent_ort" and not lm_head:  # only the fp32 LM head: no ORT variant
            assert key not in m["graphs"]
            continue
        g, _ = _graph(quantized[kind], key)
        nbits = [n for n in g.graph.node if n.op_type == "MatMulNBits"]
        assert nbits, key
        for n in nbits:
            attrs = {a.name: a.i for a in n.attribute}
            level = 0 if key == "target_ort" else 4  # the drafter always takes the fast int8-activation kernels
            assert attrs["bits"] == int(kind[3:]) and attrs["block_size"] == 16 and attrs.get("accuracy_level", 0) == level
        # the LM head ([H, V] weight) is quantized only when asked
        vocab = m["target"]["vocab_size"]
        lm = [n for n in nbits if {a.name: a.i for a in n.attribute}["N"] == vocab]
        plain_lm = [n for n in g.graph.node if n.op_type == "MatMul" and n.input[1] in
                    {t.name for t in g.graph.initializer if list(t.dims)[-1:] == [vocab]}]
        if key.startswith(("target", "drafter_head")):
            assert (len(lm), len(plain_lm)) == ((1, 0) if lm_head else (0, 1)), key
    # the standard (TensorRT) graphs stay unquantized
    for key in ("target", "drafter_block", "drafter_head_greedy_plugin"):
        g, _ = _graph(quantized[kind], key)
        assert not [n for n in g.graph.node if n.domain == "com.microsoft"]
    # ... and the TensorRT flavour of the target carries the quantization as explicit Q/DQ weights
    assert m["graphs"]["target_qdq"]["flavour"] == "qdq"
    assert m["verification"]["target_qdq.dequantized_weights"] > 0
    assert m["verification"]["target_qdq.max_error_in_steps"] <= 1.0
    g, _ = _graph(quantized[kind], "target_qdq")
    inits = {t.name: t for t in g.graph.initializer}
    dq = [n for n in g.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and not [n for n in g.graph.node if n.domain == "com.microsoft"]
    for n in dq:
        attrs = {a.name: a.i for a in n.attribute}
        assert len(n.input) == 2  # symmetric: no zero point (TensorRT's INT4 DequantizeLinear takes none)
        if kind == "int4":
            assert inits[n.input[0]].data_type == onnx.TensorProto.INT4
            assert attrs == {"axis": 0, "block_size": 16}
        else:
            assert inits[n.input[0]].data_type == onnx.TensorProto.INT8 and attrs == {"axis": 1}
    float_mm = [n for n in g.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    vocab = m["target"]["vocab_size"]
    assert [list(inits[n.input[1]].dims) for n in float_mm] == ([] if lm_head else [[m["target"]["hidden_size"], vocab]])
    opset = next(o.version for o in g.opset_import if o.domain == "")
    assert opset >= 21 if kind == "int4" else opset == m["opset"]  # int8: the export's opset (Jetson, TensorRT 10.3)


def test_drafter_quantized_alone(quantized, tiny_target):
    """export --drafter-quantize int8 on an fp32 export: the ONNX Runtime drafter graphs take int8 MatMulNBits
    weights (level 4), the target stays fp32 (no quantized target, no Q/DQ flavour), and speculative decoding
    with the quantized drafter — its drafts accepted — gives the fp32 target's own greedy tokens."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    folder = quantized["drafter-int8"]
    m = json.loads((folder / "manifest.json").read_text())
    assert m["quantization"] == {"kind": "none", "block_size": None, "accuracy_level": None, "lm_head": False,
                                 "symmetric": True}
    assert m["drafter_quantization"] == {"kind": "int8", "block_size": 32, "accuracy_level": 4, "lm_head": True,
                                         "symmetric": True}
    assert "target_qdq" not in m["graphs"]
    g, _ = _graph(folder, "target_ort")
    assert not [n for n in g.graph.node if n.op_type == "MatMulNBits"]
    for key in ("drafter_context_ort", "drafter_block_ort", "drafter_head_greedy_ort", "drafter_head_viterbi_ort"):
        g, _ = _graph(folder, key)
        nbits = [{a.name: a.i for a in n.attribute} for n in g.graph.node if n.op_type == "MatMulNBits"]
        assert nbits and all(a["bits"] == 8 and a["accuracy_level"] == 4 for a in nbits), key
    be = OrtBackend(folder)
    target = be.target_runner()
    assert be.session("drafter_block").path.endswith("drafter_block_ort.onnx")
    rng = np.random.default_rng(3)
    accepted = []
    for i in range(4):
        p = rng.integers(4, 500, int(rng.integers(2, 30))).tolist()
        ar = D.target_generate(target, p, req(MAX_NEW, eos_ids=set())).tokens
        assert D.speculative_generate(target, be.draft_runner(), p,
                                      req(MAX_NEW, eos_ids=set())).tokens == ar
        res = D.speculative_generate(target, AcceptingDrafter(be.draft_runner(), p, ar, rng), p,
                                     req(MAX_NEW, eos_ids=set()))
        assert res.tokens == ar
        accepted += res.accepted
    assert sum(accepted) > 0  # drafts were accepted: the quantized drafter's cycles ran, not plain steps


def test_qdq_check_catches_a_wrong_dequantization(quantized):
    """verify_qdq (the export check of target_qdq) fails when a dequantized weight is not the original's."""
    from onnx import numpy_helper

    from dflash2_trt.export.quantize import verify_qdq

    m = json.loads((quantized["int8"] / "manifest.json").read_text())
    g, ref = (onnx.load(str(quantized["int8"] / m["graphs"][k]["file"])) for k in ("target_qdq", "target"))
    assert verify_qdq(g, ref)["target_qdq.dequantized_weights"] > 0
    scale = next(t for t in g.graph.initializer if t.name.endswith("_DQ_scales"))
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 3, scale.name))
    with pytest.raises(DFlash2Error, match="dequantizes .* away from the weight"):
        verify_qdq(g, ref)


class AcceptingDrafter:
    """Wraps the real ORT draft runner; proposes the (quantized) target's own greedy continuation for a
    random number of rows, then wrong tokens — so drafts of every length are accepted and rejected and
    each rejected row is cropped from the shared KV buffers."""

    def __init__(self, inner, prompt, continuation, rng):
        self.inner, self.n_prompt, self.cont, self.rng = inner, len(prompt), continuation, rng
        self.block_size, self.num_draft_rows = inner.block_size, inner.num_draft_rows

    def reset(self):
        self.inner.reset()

    def add_context(self, feats, start):
        self.inner.add_context(feats, start)

    def propose(self, anchor, pos, rows, temperature, uniforms):
        d = self.inner.propose(anchor, pos, rows, temperature, uniforms)  # the real drafter runs every cycle
        L = self.num_draft_rows
        k = int(self.rng.integers(0, L + 1))
        truth = self.cont[pos - self.n_prompt + 1:][:L]
        toks = np.array([truth[t] if t < k and t < len(truth) else
                         ((truth[t] + 1) % 500 + 4 if t < len(truth) else 7) for t in range(L)], dtype=np.int64)
        cand = d.cand.copy()
        cand[:, -1] = np.where((cand == toks[:, None]).any(-1), cand[:, -1], toks)
        return Draft(tokens=toks, proposal=d.proposal, cand=cand)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_decoding_is_lossless_wrt_quantized_target(quantized, tiny_target, kind, monkeypatch):
    """With the panels on (DFLASH2_ORT_PANELS=1), the int4 target runs dflash2.PanelMatMulQ4 in place of every
    MatMulNBits (its 1-row steps and k-row verifies alike); int8 keeps ORT's MatMulNBits. Either way speculative
    output = the quantized target's own, with drafts accepted."""
    import onnx

    from torch_ref import ref_autoregressive
    from dflash2_trt.runtime.ort import decode_attention as DA
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.runtime.ort.fused_target import OrtFusedTargetRunner

    monkeypatch.setenv(DA.PANELS_ENV, "1")
    path = quantized[kind] / "target_ort.onnx"
    nbits = sum(n.op_type == "MatMulNBits" for n in onnx.load(str(path), load_external_data=False).graph.node)
    ops = [n.op_type for n in onnx.load_from_string(DA.rewrite(path)).graph.node]
    assert nbits > 0 and (ops.count(DA.MATMUL_Q4_OP_TYPE), ops.count("MatMulNBits")) == ((nbits, 0) if kind == "int4" else (0, nbits))
    be = OrtBackend(quantized[kind])
    target = be.target_runner()
    assert isinstance(target, OrtFusedTargetRunner) and be.session("drafter_block").path.endswith("drafter_block_ort.onnx")
    assert be.session("target").rewritten
    rng = np.random.default_rng(7)
    accepted, differs = [], 0
    for i in range(6):
        p = rng.integers(4, 500, int(rng.integers(2, 30))).tolist()
        ar = D.target_generate(target, p, req(MAX_NEW, eos_ids=set())).tokens  # the quantized target's own output
        differs += ar != ref_autoregressive(tiny_target, p, MAX_NEW, eos_ids=set()).tokens
        real = D.speculative_generate(target, be.draft_runner(("greedy", "viterbi")[i % 2]), p,
                                      req(MAX_NEW, eos_ids=set()))
        assert real.tokens == ar
        res = D.speculative_generate(target, AcceptingDrafter(be.draft_runner(), p, ar, rng), p,
                                     req(MAX_NEW, eos_ids=set()))
        assert res.tokens == ar
        accepted += res.accepted
    assert sum(accepted) > 0 and max(accepted) == be.manifest.num_draft_rows and 0 in accepted  # acceptance happened
    if kind == "int4":
        assert differs > 0  # the int4 target really is another model (on this tiny random model)


def test_quantize_bad_input(tiny_dir, tmp_path, capsys):
    from dflash2_trt.cli import export_main as main
    from dflash2_trt.export.quantize import QuantSpec, drafter_spec

    with pytest.raises(DFlash2Error, match="power of 2"):
        QuantSpec("int4", block_size=24)
    with pytest.raises(DFlash2Error, match="--quantize"):
        QuantSpec("int3")
    rc = main(["--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--out",
               str(tmp_path / "x"), "--dtype", "bf16", "--quantize", "int4", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "not bf16" in err[0] and not (tmp_path / "x").exists()
    for dq, extra, says in (("int8", ["--dtype", "fp16"], "not a fp16 export"),
                            ("q8_0", ["--no-ort-flavour"], "--no-ort-flavour")):
        rc = main(["--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--out",
                   str(tmp_path / "x"), "--drafter-quantize", dq, "--quiet", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and says in err[0] and not (tmp_path / "x").exists()
    with pytest.raises(DFlash2Error, match="--drafter-quantize"):
        drafter_spec(QuantSpec(), "int3")


def test_recommend_block_size_follows_cost():
    from dflash2_trt.bench.verify_cost import recommend_block_size

    def table(ms):
        return [{"cached": 256, "rows": r, "ms": m, "ratio": m / ms[0]} for r, m in zip((1, 4, 8, 16), ms)]

    flat, steep = table([10, 10, 10, 10]), table([10, 40, 80, 160])  # memory-bound vs compute-bound verify
    assert recommend_block_size(flat, alpha=0.9) == 16
    assert recommend_block_size(steep, alpha=0.5) == 2  # (1 + .5) / (20 + 10) beats (1.75) / (30 + 10)
    # brute force over the interpolated cost agrees for an in-between curve
    mid = table([10, 13, 18, 30])
    a = 0.7
    rates = {bs: sum(a ** i for i in range(bs)) / (np.interp(bs, [1, 4, 8, 16], [10, 13, 18, 30]) + 10)
             for bs in range(2, 17)}
    assert recommend_block_size(mid, alpha=a) == max(rates, key=rates.get)


def test_export_records_verify_cost(tiny_dir, tmp_path, capsys):
    """``dflash2 export --verify-cost``: the CLI times the written export (bench.verify_cost, handed to the export
    command by the top-level CLI) and stores the table and its recommendation in the manifest."""
    from dflash2_trt.cli import main
    from dflash2_trt.manifest import read_manifest

    assert main(["export", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"),
                 "--out", str(tmp_path / "vc"), "--max-seq-len", "300", "--no-verify", "--quiet",
                 "--verify-cost"]) == 0
    vc = read_manifest(tmp_path / "vc").verify_cost  # stored, checksums still valid
    assert vc is not None
    assert f"recommended block size on this machine: {vc.recommended_block_size} " in capsys.readouterr().out
    assert [(r.cached, r.rows) for r in vc.table] == [(256, r) for r in (1, 4, 8, 16)]
    assert all(r.ms > 0 for r in vc.table) and vc.table[0].ratio == 1.0
    assert 2 <= vc.recommended_block_size <= 16


@pytest.mark.parametrize("kind", ["fp32", "int4", "int8", "drafter-int8"])
def test_tensorrt_bound_graphs_use_only_what_the_parser_imports(tiny_export, quantized, kind):
    """Every node of every graph TensorRT builds an engine from (the standard flavour, the Q/DQ target; not the
    ONNX Runtime flavour) is an operator of TensorRT's ONNX parser table (export/trt_onnx_ops.json) or the path
    selector's plugin node, at an opset the parser reads -- fp32 and quantized exports alike. The check itself
    refuses a node the table lacks."""
    import onnx
    from onnx import helper

    from dflash2_trt.export import selector_contract as sc
    from dflash2_trt.export.onnx_utils import trt_parser_refusals
    from dflash2_trt.manifest import read_manifest

    folder = tiny_export if kind == "fp32" else quantized[kind]
    m = read_manifest(folder)
    bound = {k: g for k, g in m.graphs.items() if g.flavour in (None, "qdq")}
    assert {"target", "drafter_context", "drafter_block", "drafter_head_greedy_plugin"} <= set(bound)
    if kind in ("int4", "int8"):
        assert "target_qdq" in bound
    refusals = {}
    for key, g in bound.items():
        model = onnx.load(str(folder / g.file), load_external_data=False)
        refusals[key] = trt_parser_refusals(model, ((sc.DOMAIN, sc.OP_TYPE),))
    if kind == "int4":  # MatMulNBits-style 4-bit weights need DequantizeLinear of opset 21
        assert all(r == [] or all("opset 21" in x for x in r) for r in refusals.values()), refusals
    else:
        assert all(r == [] for r in refusals.values()), refusals
    bad = helper.make_model(helper.make_graph([helper.make_node("Unique", ["x"], ["y"], name="u"),
                                               helper.make_node("GroupQueryAttention", ["y"], ["z"], name="g",
                                                                domain="com.microsoft")], "g", [], []),
                            opset_imports=[helper.make_opsetid("", 21)])
    assert len(trt_parser_refusals(bad)) == 3
