"""dflash2-export on make-tiny models: graphs vs PyTorch, the decomposed selector vs the NumPy twin, the
plugin variant's node, shared weights, manifest, atomic export and bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error, reference as ref
from dflash2_trt.manifest import PluginSpec, TensorSpec
from dflash2_trt.export import selector_contract as sc
from dflash2_trt.bench.oracle import oracle_count
from helpers import req


def test_layout_manifest_and_checker(tiny_export):
    import onnx

    import jsonschema

    from dflash2_trt.manifest import SCHEMA_FILE, read_manifest

    jsonschema.validate(json.loads((tiny_export / "manifest.json").read_text()), json.loads(SCHEMA_FILE.read_text()))
    m = read_manifest(tiny_export)
    assert m.opset == 17 and m.dtype == "fp32" and m.block_size == 16 and m.max_seq_len == 512
    assert m.num_draft_rows == 15 and m.draft_modes == ("greedy", "viterbi", "independent")
    assert set(m.graphs) == {"target", "drafter_context", "drafter_block", "drafter_head_independent",
                                "drafter_head_greedy", "drafter_head_viterbi", "drafter_head_greedy_plugin",
                                "drafter_head_viterbi_plugin", "target_ort",  # target_ort: tests/test_ort_fused.py
                                "drafter_block_layers"}  # tests/test_ort_drafter_layer.py
    assert [o.name for o in m.graphs["drafter_head_independent"].outputs] == ["logits"]
    assert m.plugin == PluginSpec(op_type="DFlash2PathSelector", domain="trt.plugins", plugin_version="1",
                                  plugin_namespace="")
    assert {"tokenizer.json", "tokenizer_config.json", "weights.bin"} <= set(m.files)
    assert m.project_version and m.manifest_version == 2
    tio = m.graphs["target"]
    assert [i.name for i in tio.inputs[:3]] == ["input_ids", "position_ids", "attention_mask"]
    assert tio.inputs[3] == TensorSpec(name="past_key_values.0.key", dtype="float32", shape=("batch", 2, "capacity", 16))
    assert [i.name for i in tio.inputs[3:]] == m.target_kv_names()
    assert [o.name for o in tio.outputs[:3]] == ["logits", "context_features", "present.0.key"]
    assert [o.name for o in m.graphs["drafter_head_greedy"].outputs] == ["cand_ids", "path_ids", "proposal_probs"]
    sc.register_schema()
    for g in m.graphs.values():
        model = onnx.load(str(tiny_export / g.file), load_external_data=False)
        assert not {n.op_type for n in model.graph.node} & {"If", "Loop", "Scan"}  # capturable
        if g.flavour != "ort":  # onnx.checker has no com.microsoft schemas (ORT checks those)
            onnx.checker.check_model(str(tiny_export / g.file), full_check=True)
    # the shared weights file holds each tensor once: smaller than the parameters of all graphs together
    assert (tiny_export / "weights.bin").stat().st_size < 2_000_000
    assert all(v < 2e-3 for k, v in m.verification.items() if not k.endswith(("_match", "_compared")))
    assert all(v == 1.0 for k, v in m.verification.items() if k.endswith("_match"))  # fp32: decisions exact
    assert all(v == 15 for k, v in m.verification.items() if k.endswith("_compared"))  # every proposal row


def test_plugin_variant_has_exactly_the_contract_node(tiny_export):
    import onnx

    m = json.loads((tiny_export / "manifest.json").read_text())
    for mode in ("greedy", "viterbi"):
        plug = onnx.load(str(tiny_export / m["graphs"][f"drafter_head_{mode}_plugin"]["file"]), load_external_data=False)
        dec = onnx.load(str(tiny_export / m["graphs"][f"drafter_head_{mode}"]["file"]), load_external_data=False)
        nodes = [n for n in plug.graph.node if n.domain == sc.DOMAIN]
        assert len(nodes) == 1 and not [n for n in dec.graph.node if n.domain == sc.DOMAIN]
        node = nodes[0]
        assert node.op_type == sc.OP_TYPE
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"top_k": 16, "rank": 24, "mode": mode.encode(), "plugin_version": b"1", "plugin_namespace": b""}
        assert list(node.input) == [n for n, _, _ in sc.INPUTS] and list(node.output) == [n for n, _, _ in sc.OUTPUTS]
        inits = {t.name: t for t in plug.graph.initializer}
        assert {"pred_codebook", "succ_codebook"} <= set(inits)  # codebooks are inputs (initializers), not attributes
        assert list(inits["pred_codebook"].dims) == [512, 24]
        assert {o.domain: o.version for o in plug.opset_import} == {"": 17, sc.DOMAIN: 1}
        # everything but the selector is the same graph in both variants
        strip = lambda g: sorted(n.op_type for n in g.graph.node if not n.name.startswith("selector/"))  # noqa: E731
        assert strip(plug) == strip(dec)
        assert [i.name for i in plug.graph.input] == [i.name for i in dec.graph.input]


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
def test_decomposed_selector_equals_numpy_twin(tiny_drafter, mode, tmp_path):
    """The decomposed selector graph alone vs reference.select_paths on fresh random inputs, incl. ties."""
    from dflash2_trt.export import onnx_graphs, onnx_utils

    rng = np.random.default_rng(7)
    V, r, L, K, B = 40, 6, 5, 4, 6
    A = rng.standard_normal((V, r)).astype(np.float32)
    Bc = rng.standard_normal((V, r)).astype(np.float32)
    sel = onnx_graphs.DecomposedSelector(torch.from_numpy(A), torch.from_numpy(Bc), mode).eval()
    names = ["cand_ids", "unary", "hidden_proj", "anchor_ids", "temperature", "uniforms"]
    args = (torch.zeros(2, L, K, dtype=torch.int32), torch.zeros(2, L, K), torch.zeros(2, L, r),
            torch.zeros(2, dtype=torch.int32), torch.zeros(2), torch.zeros(2, L))
    model = onnx_utils.trace(sel, args, names, ["path_ids", "proposal_probs"],
                             {n: {0: "batch"} for n in [*names, "path_ids", "proposal_probs"]}, 17)
    s = _session_bytes(model)
    for trial in range(12):
        ties = trial % 3 == 0
        cand = np.stack([np.stack([rng.choice(V, K, replace=False) for _ in range(L)]) for _ in range(B)]).astype(np.int32)
        if ties:  # small integers: exact in fp32, so ties really are ties
            unary = -np.sort(-rng.integers(-2, 3, (B, L, K)).astype(np.float32), axis=-1)
            g = rng.integers(-1, 2, (B, L, r)).astype(np.float32)
            feedA, feedB = np.round(A), np.round(Bc)
            s_t = _session_bytes(onnx_utils.trace(onnx_graphs.DecomposedSelector(torch.from_numpy(feedA),
                                 torch.from_numpy(feedB), mode).eval(), args, names, ["path_ids", "proposal_probs"],
                                 {n: {0: "batch"} for n in [*names, "path_ids", "proposal_probs"]}, 17))
        else:
            unary = -np.sort(-rng.standard_normal((B, L, K)).astype(np.float32), axis=-1)
            g = rng.standard_normal((B, L, r)).astype(np.float32)
            feedA, feedB, s_t = A, Bc, s
        anchor = rng.integers(0, V, B).astype(np.int32)
        temp = np.where(rng.random(B) < 0.5, 0.0, rng.uniform(0.3, 2.0, B)).astype(np.float32)
        u = rng.random((B, L), dtype=np.float32)
        ids, q = s_t.run(None, {"cand_ids": cand, "unary": unary, "hidden_proj": g, "anchor_ids": anchor,
                                "temperature": temp, "uniforms": u})
        want_ids, _, want_q = ref.select_paths(cand, unary, g, anchor, feedA, feedB, mode, temp, u)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(q, want_q, atol=1e-5)


def _session_bytes(model):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_target_graph_matches_hf_logits(tiny_target):
    """The export-only target module vs the HF model (chunked through a capacity buffer with stale slots)."""
    from dflash2_trt.targets.dense import TargetGraph

    g = TargetGraph(tiny_target.model, [0, 2]).eval()
    ids = torch.randint(4, 500, (19,))
    tiny_target.reset([0, 2])
    want_logits, want_feats = tiny_target.forward(ids)
    C, past = 32, [torch.randn(1, 2, 32, 16) for _ in range(8)]  # garbage in unused slots must not matter
    logits, feats, n = [], [], 0
    with torch.no_grad():
        for chunk in (ids[:6], ids[6:7], ids[7:]):
            S = len(chunk)
            mask = torch.zeros(1, C + S, dtype=torch.long)
            mask[0, :n] = 1
            mask[0, C:] = 1
            out = g(chunk.view(1, -1), torch.arange(n, n + S).view(1, -1), mask, *past)
            for i, p in enumerate(out[2:]):
                past[i][:, :, n:n + S] = p
            logits.append(out[0][0])
            feats.append(out[1][0])
            n += S
    torch.testing.assert_close(torch.cat(logits), want_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(feats), want_feats, atol=1e-4, rtol=1e-4)


def test_graphs_match_pytorch_on_random_inputs(tiny_export, tiny_target, tiny_drafter):
    """Re-run the export-time checks with other seeds (target chunks, drafter context/block/heads)."""
    from dflash2_trt.export import verify as V

    m = json.loads((tiny_export / "manifest.json").read_text())
    for seed in (1, 2):
        rep = V.verify_target(tiny_export / "target.onnx", tiny_target, [0, 2], "fp32", np.float32, seed)
        assert rep["target.logits"] < 1e-4 and rep["target.argmax_match"] == 1.0
        rep = V.verify_drafter({k: tiny_export / g["file"] for k, g in m["graphs"].items()}, tiny_drafter, "fp32",
                               np.float32, seed)
        assert rep["drafter_block.hidden"] < 1e-4
        assert all(v == 1.0 for k, v in rep.items() if k.endswith("_match"))


def test_block_size_override_and_cli(tiny_dir, tmp_path, capsys):
    from dflash2_trt.cli import main as dflash2_main
    from dflash2_trt.cli import export_main as main

    out = tmp_path / "bs4"
    assert main(["--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"), "--out", str(out),
                 "--block-size", "4", "--opset", "18", "--max-seq-len", "256", "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert "block_size" not in m and m["opset"] == 18 and m["drafter"]["dflash_config"]["block_size"] == 4
    assert m["graphs"]["drafter_head_greedy"]["outputs"][1]["shape"] == ["batch", 3]
    assert "exported 10 graphs" in capsys.readouterr().out  # 8 + target_ort + drafter_block_layers
    # `dflash2 export` is the same command
    assert dflash2_main(["export", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"),
                         "--out", str(out), "--block-size", "4", "--max-seq-len", "256", "--quiet", "--no-verify"]) == 0
    assert "exported 10 graphs" in capsys.readouterr().out  # 8 + target_ort + drafter_block_layers


def test_export_is_atomic(tiny_dir, tiny_export, tmp_path, monkeypatch):
    """A failure in any step leaves no DIR and no temporary folder; an existing export stays untouched."""
    from dflash2_trt.export import exporter, onnx_utils

    def boom(*a, **k):
        raise DFlash2Error("injected failure")

    monkeypatch.setattr(onnx_utils, "check_graph", boom)
    out = tmp_path / "x"
    with pytest.raises(DFlash2Error, match="injected"):
        exporter.export_model(tiny_dir / "target", tiny_dir / "drafter", out, progress=False)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    shutil.copytree(tiny_export, out)  # a previous export in place
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    monkeypatch.setattr(onnx_utils, "save_with_shared_weights", boom)
    with pytest.raises(DFlash2Error):
        exporter.export_model(tiny_dir / "target", tiny_dir / "drafter", out, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_export_bad_input(tiny_dir, tmp_path, capsys):
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.cli import export_main as main
    from dflash2_trt.model import DFlash2Drafter, save_drafter

    def err(argv):
        assert main(argv + ["--quiet"]) == 1
        e = capsys.readouterr().err.strip()
        assert e.startswith("dflash2-export: error: ") and "\n" not in e
        return e

    t, d = str(tiny_dir / "target"), str(tiny_dir / "drafter")
    assert "drafter folder not found" in err(["--target", t, "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "target not found" in err(["--target", str(tmp_path / "nope"), "--drafter", d, "--out", str(tmp_path / "o")])
    cfg = DFlash2Config.from_json_file(tiny_dir / "drafter").replace(num_target_layers=6)
    save_drafter(DFlash2Drafter(cfg), tmp_path / "other")
    assert "num_target_layers 6 != target layers 4" in err(["--target", t, "--drafter", str(tmp_path / "other"),
                                                            "--out", str(tmp_path / "o")])
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_dir / "drafter", bad)
    (bad / "model.safetensors").write_bytes(b"\0" * 100)
    assert "corrupt" in err(["--target", t, "--drafter", str(bad), "--out", str(tmp_path / "o")])
    assert "--max-seq-len" in err(["--target", t, "--drafter", d, "--out", str(tmp_path / "o"), "--max-seq-len", "99999"])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert "refusing" in err(["--target", t, "--drafter", d, "--out", str(busy)])
    assert not (tmp_path / "o").exists() and (busy / "keep.txt").read_text() == "x"


def test_dflash_v1_drafter_exports_and_runs(acc_dir, acc_target, acc_drafter, tmp_path):
    """A DFlash v1 drafter (no convolutions, no selector) exports with the independent head only and the ORT
    runtime decodes like the PyTorch v1 drafter (the accepting drafter's weights without them), losslessly and
    with drafts accepted; the selector modes are refused clearly."""
    from helpers import assert_accepts
    from dflash2_trt.config import ARCH_V1
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner
    from torch_ref import ref_autoregressive, ref_speculative
    from dflash2_trt.model import DFlash2Drafter, save_drafter
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.backends import open_backend

    v1 = DFlash2Drafter(acc_drafter.config.replace(architecture=ARCH_V1, use_conv=False, use_selector=False))
    sd = {k: v for k, v in acc_drafter.state_dict().items() if k in v1.state_dict()}
    v1.load_state_dict(sd, strict=True)
    save_drafter(v1, tmp_path / "v1")
    out = tmp_path / "v1-export"
    m = export_model(acc_dir / "target", tmp_path / "v1", out, progress=False, max_seq_len=256)
    assert set(m.graphs) == {"target", "drafter_context", "drafter_block", "drafter_head_independent",
                             "target_ort", "drafter_block_layers"}  # the layers without convolutions
    assert m.verification["drafter_head_independent.argmax_match"] == 1.0 and m.draft_modes == ("independent",)
    be, _ = open_backend(out, "ort")
    with pytest.raises(DFlash2Error, match="no 'greedy' draft head.*--no-selector"):
        be.draft_runner("greedy")
    v1.bind_target(acc_target.embed_weight, acc_target.lm_head_weight)
    target, drafter = be.target_runner(), be.draft_runner("independent")
    rng = np.random.default_rng(21)
    accepted = []
    for _ in range(3):
        p = rng.integers(4, 500, size=int(rng.integers(1, 20))).tolist()
        want = ref_speculative(acc_target, TorchDraftRunner(v1.eval(), "independent"), p,
                               req(20, eos_ids=set()), layer_ids=[0, 2])
        got = D.speculative_generate(target, drafter, p, req(20, eos_ids=set()),
                                     D.DecodeHooks(oracle=oracle_count))
        assert got.tokens == want.tokens and got.stats() == want.stats()
        assert got.tokens == ref_autoregressive(acc_target, p, 20, eos_ids=set()).tokens
        accepted += got.accepted
    assert_accepts(accepted, 15, "DFlash v1 export")


def test_verification_is_exact_at_fp32_and_can_fail(acc_export, acc_target, acc_drafter, monkeypatch):
    """fp32: every decision equal and every proposal row compared (on the accepting pair, whose heads have
    near-ties only where its tie-break says); a head that picks another path fails the check."""
    from dflash2_trt.export import verify as V

    m = json.loads((acc_export / "manifest.json").read_text())
    paths = {k: acc_export / g["file"] for k, g in m["graphs"].items()}
    rep = V.verify_drafter(paths, acc_drafter, "fp32", np.float32, seed=3)
    assert all(v == 1.0 for k, v in rep.items() if k.endswith("_match"))
    assert {v for k, v in rep.items() if k.endswith("_compared")} == {15.0}
    real = V.session

    class OffByOnePath:  # the head's path_ids shifted by one row: a wrong selector
        def __init__(self, path):
            self.s = real(path)
            self.head = "drafter_head_greedy" in str(path)

        def run(self, names, feed):
            out = self.s.run(names, feed)
            if self.head:
                out[1] = np.roll(out[1], 1, axis=-1)
            return out

    monkeypatch.setattr(V, "session", OffByOnePath)
    with pytest.raises(DFlash2Error, match="path_ids agrees with PyTorch on only"):
        V.verify_drafter(paths, acc_drafter, "fp32", np.float32, seed=3)


def test_bf16_export_is_verified_through_fp32_twins(acc_dir, tmp_path, monkeypatch):
    """A bf16 export is checked, not skipped: the fp32 twins of its graphs (its bf16 weights in fp32
    arithmetic) equal the upcast PyTorch models at the fp32 bounds, every decision included; a twin with one
    wrong weight fails the export; the shipped graphs stay bf16."""
    import onnx

    from dflash2_trt.export import onnx_utils
    from dflash2_trt.export import verify as V
    from dflash2_trt.export.exporter import export_model

    m = export_model(acc_dir / "target", acc_dir / "drafter", tmp_path / "bf16", progress=False, max_seq_len=256,
                     dtype="bf16", block_size=4)
    rep = m.verification
    assert "skipped" not in rep and rep["bf16_checked_as"].startswith("fp32 twins")
    assert rep["target.logits"] <= V.TOL["fp32"] and rep["drafter_block.hidden"] <= V.TOL["fp32"]
    assert all(v == 1.0 for k, v in rep.items() if k.endswith("_match"))
    assert all(f"drafter_head_{mode}.T{t}.proposal_probs" in rep for mode in ("greedy", "viterbi") for t in (0.0, 0.8))
    block = onnx.load(str(tmp_path / "bf16" / "drafter_block.onnx"), load_external_data=False)
    assert onnx.TensorProto.BFLOAT16 in {t.data_type for t in block.graph.initializer}
    assert not list((tmp_path / "bf16").glob("*.data"))  # the twins never reach the export
    real = onnx_utils.fp32_twin

    def broken(src, dst):  # noqa: ANN001, ANN202
        real(src, dst)
        if dst.name == "drafter_block.onnx":  # the twin of a graph with wrong weights
            g = onnx.load(str(dst))
            for t in g.graph.initializer:
                if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2:
                    t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t)[::-1].copy(), t.name))
            onnx.save_model(g, str(dst), save_as_external_data=True, location=dst.name + ".data")
        return dst

    monkeypatch.setattr(onnx_utils, "fp32_twin", broken)
    with pytest.raises(DFlash2Error, match="drafter_block.hidden differs from PyTorch"):
        export_model(acc_dir / "target", acc_dir / "drafter", tmp_path / "bad", progress=False, max_seq_len=256,
                     dtype="bf16", block_size=4)
    assert not (tmp_path / "bad").exists()


def test_a_graph_ort_cannot_run_fails_the_export(tiny_dir, tmp_path, monkeypatch):
    """An exception while checking (here: ORT refusing a graph) is a failed export with a one-line error and
    nothing written — never a "skipped" check."""
    from dflash2_trt.export import verify as V
    from dflash2_trt.export.exporter import export_model

    def refuse(path):  # noqa: ANN001, ANN202
        raise RuntimeError(f"[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : no kernel for {path.name}\nsecond line")

    monkeypatch.setattr(V, "session", refuse)
    with pytest.raises(DFlash2Error) as e:
        export_model(tiny_dir / "target", tiny_dir / "drafter", tmp_path / "out", progress=False, max_seq_len=256)
    assert str(e.value).startswith("export check failed (fp32): RuntimeError: [ONNXRuntimeError]")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_fp16_export_is_verified(acc_dir, tmp_path):
    """fp16 graphs run under ONNX Runtime and are verified with the stated tolerances (TOL, MIN_MATCH), the
    proposals included."""
    from dflash2_trt.export import verify as V
    from dflash2_trt.export.exporter import export_model

    m = export_model(acc_dir / "target", acc_dir / "drafter", tmp_path / "fp16", progress=False, max_seq_len=256,
                     dtype="fp16", block_size=4)
    rep = m.verification
    assert "skipped" not in rep and rep["target.logits"] <= V.TOL["fp16"]
    assert all(v >= V.MIN_MATCH["fp16"][0] for k, v in rep.items() if k.endswith("_match"))
    assert all(f"drafter_head_{mode}.T{t}.proposal_probs" in rep for mode in ("greedy", "viterbi") for t in (0.0, 0.8))


def _dense_pair(out, head_dim: int, taps: list[int]):  # noqa: ANN001, ANN202
    """A tiny random Llama target (4 layers, heads of ``head_dim``) and a random DFlash 2 drafter tapping ``taps``,
    saved as make-tiny saves its pair -> (target folder, drafter folder)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter, save_drafter
    from dflash2_trt.tiny import build_tokenizer

    torch.manual_seed(3)
    tok = build_tokenizer()
    H = 4 * head_dim
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0, initializer_range=0.2)).eval()
    target.save_pretrained(str(out / "target"), safe_serialization=True)
    tok.save_pretrained(str(out / "target"))
    drafter = DFlash2Drafter(DFlash2Config(
        hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=H // 16, num_key_value_heads=2,
        head_dim=16, vocab_size=len(tok), num_target_layers=4, target_layer_ids=taps, block_size=4, mask_token_id=1,
        selector_rank=8, selector_top_k=8, rms_norm_eps=1e-6, rope_theta=10000.0))
    save_drafter(drafter, out / "drafter")
    return out / "target", out / "drafter"


@pytest.mark.parametrize("head_dim,taps", [(16, [0, 3]), (24, [0, 2])])
def test_dense_targets_with_a_last_layer_tap_or_an_odd_head_size(tmp_path, head_dim, taps):
    """A drafter tapping the target's last layer (HF's last hidden_states entry, after the final norm: the same
    tap in the standard graph, the fused graph and the PyTorch adapter the trainer uses) and a target whose head
    size is not a multiple of 16 (ONNX Runtime's GroupQueryAttention refuses it: no fused graph, ORT runs the
    standard one) export with every check passing and decode on ONNX Runtime to the target's own greedy output."""
    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.targets.adapter import TargetModel

    target_dir, drafter_dir = _dense_pair(tmp_path, head_dim, taps)
    export_model(target_dir, drafter_dir, tmp_path / "export", progress=False, max_seq_len=256)
    be = OrtBackend(tmp_path / "export", threads=1)
    m = be.manifest
    assert ("target_ort" in m.graphs) == (head_dim % 16 == 0)
    if head_dim % 16:
        assert "multiple of 16" in str(m.verification["target_ort"])
    else:
        assert m.verification["target_ort.context_features"] <= 1e-4
    hf = TargetModel.load(target_dir)
    rng = np.random.default_rng(0)
    for _ in range(3):
        prompt = rng.integers(2, m.target.vocab_size, int(rng.integers(3, 12))).tolist()
        want = D.target_generate(be.target_runner(), prompt, req(12)).tokens
        got = D.speculative_generate(be.target_runner(), be.draft_runner(), prompt, req(12))
        assert got.tokens == want
        ids = torch.tensor(prompt)
        hf.reset(taps)
        logits, feats = hf.forward(ids)
        t = be.target_runner()
        t.reset()
        o_logits, o_feats = t.forward(prompt)
        np.testing.assert_allclose(o_feats, feats.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(o_logits, logits.numpy(), rtol=1e-4, atol=1e-4)
