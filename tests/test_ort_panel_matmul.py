"""dflash2.PanelMatMul / PanelMatMulQ4 (plugins/ortDecodeAttention) and the exact weight codes: the ops vs NumPy on
fresh random inputs, every row of a call bit-equal to the row alone; the load-time swap of the fused target's MatMuls
and its switch; the codes (4-bit affine, 8-bit, fp16, bf16) taken only where every weight is reproduced bit for bit
(near misses refused, every position of a block checked), with the fp32 kernels' numbers; SmolLM2's logits with and
without the codes; the kernel choice per CPU and the AVX-512, AVX2 and portable (aarch64 under qemu) kernels giving
the same bytes; a Q8_0-rounded drafter read as 8-bit codes. The library is built by scripts/setup.sh test
(scripts/build_ort_ops.sh); where it is missing these tests fail, saying so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime.ort import decode_attention as DA
from helpers import ort_ops_built  # noqa: F401 - autouse: the custom-op library is built, else every test fails
from helpers import speculative_equals_autoregressive


@pytest.mark.slow
def test_smollm2_codes_give_the_fp32_numbers(monkeypatch):
    """The demo's export: SmolLM2-135M-Instruct, converted from its Q4_1 GGUF, holds 4-bit weights in fp32. Every
    linear layer's PanelMatMul finds the affine 4-bit code (GGUF's Q4_1), the tied LM head the 8-bit one (Q8_0), and
    the target's logits (a 300-token prompt, then calls of 1..4 rows) equal the fp32 kernels' bit for bit. The
    panels are switched on (DFLASH2_ORT_PANELS=1), so this runs the kernels this CPU gets (kernel_isa)."""
    from dflash2_trt.bench.exports import demo_export
    from dflash2_trt.runtime.ort.backend import OrtBackend

    folder = demo_export()
    monkeypatch.setenv(DA.PANELS_ENV, "1")
    targets, counts = [], [DA.panel_codes()]
    for flag in ("0", "1"):
        monkeypatch.setenv(DA.CODES_ENV, flag)
        targets.append(OrtBackend(folder, threads=2, attention="decode").target_runner())
        counts.append(DA.panel_codes())
    fp32 = {c: counts[1][c] - counts[0][c] for c in DA.PANEL_CODES}
    coded = {c: counts[2][c] - counts[1][c] for c in DA.PANEL_CODES}
    n = fp32["none"]
    assert n > 100 and coded == {"none": 0, "affine4": n - 1, "scaled8": 1, "bf16": 0, "fp16": 0}
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, targets[0].vocab_size, 300).tolist()
    steps = [rng.integers(0, targets[0].vocab_size, k).tolist() for k in (1, 2, 3, 4, 1)]
    outs = []
    for t in targets:
        t.reset()
        outs.append([t.forward(prompt)[0]] + [t.forward(rows)[0] for rows in steps])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def _matmul_session(K: int, N: int, w: np.ndarray, swap: bool):  # noqa: ANN202
    """x [B, S, K] @ a constant w [K, N]: ORT's MatMul, or the rewrite's Reshape + Transpose + PanelMatMul."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    g = helper.make_graph([node], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", N])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DA.OP_DOMAIN, 1)])
    if swap:
        assert DA._swap_matmuls(m) == 1
        assert [n.op_type for n in m.graph.node] == ["Reshape", "Transpose", DA.MATMUL_OP_TYPE]
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(DA.find_library()))
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("B,S,K,N", [(1, 1, 48, 32), (1, 3, 64, 48), (2, 5, 576, 160), (1, 13, 40, 16),
                                     (3, 10, 33, 64), (1, 1, 7, 16)])
def test_panel_matmul_vs_numpy_and_rows_alone(B, S, K, N):
    """dflash2.PanelMatMul on fresh random inputs (row counts across the register blocks of 1..12 rows, K not a
    multiple of 8) vs float64 NumPy and ORT's MatMul, and every row bit-equal to the same row computed alone: the
    property that makes a k-row verify decide what k plain steps would."""
    rng = np.random.default_rng(B * 1000 + S * 100 + K + N)
    w = rng.standard_normal((K, N)).astype(np.float32)
    x = rng.standard_normal((B, S, K)).astype(np.float32)
    panel, plain = _matmul_session(K, N, w, True), _matmul_session(K, N, w, False)
    y = panel.run(None, {"x": x})[0]
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (B, S, N)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(y, plain.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for b in range(B):
        for s in range(S):
            np.testing.assert_array_equal(panel.run(None, {"x": x[b: b + 1, s: s + 1]})[0][0, 0], y[b, s])


def test_panel_matmul_swap_follows_the_switch(tiny_export, monkeypatch):
    """The fused target's rewrite swaps every MatMul by a constant weight for PanelMatMul where panels_wanted()
    (AVX-512, or DFLASH2_ORT_PANELS=1) and none with DFLASH2_ORT_PANELS=0; weights stay the export file's. The
    drafter's graphs follow the same switch."""
    import onnx

    from dflash2_trt.runtime.ort.backend import OrtBackend

    path = tiny_export / "target_ort.onnx"
    mm = sum(n.op_type == "MatMul" for n in onnx.load(str(path), load_external_data=False).graph.node)
    for flag, want in (("1", mm), ("0", 0)):
        monkeypatch.setenv(DA.PANELS_ENV, flag)
        g = onnx.load_from_string(DA.rewrite(path))
        assert sum(n.op_type == DA.MATMUL_OP_TYPE for n in g.graph.node) == want > 0 or flag == "0"
        assert all(t.data_location == onnx.TensorProto.EXTERNAL or t.name.endswith("/panel_shape")
                   for t in g.graph.initializer if len(t.dims) == 2)
        be = OrtBackend(tiny_export)
        assert [be.session(k).rewritten for k in ("drafter_context", "drafter_block")] == [flag == "1"] * 2


def test_load_options_choose_the_panels_and_the_codes(acc_export, monkeypatch):
    """``load(panels=..., weight_codes=...)`` decide per Generator, over the environment: panels=True swaps the fused
    target's and the drafter's MatMuls with DFLASH2_ORT_PANELS=0 set, panels=False keeps ONNX Runtime's with =1 set;
    weight_codes=False keeps every panel kernel on its fp32 weights (PanelMatMul nodes say codes=0) where the
    default finds codes. The tokens are the same every way."""
    import dflash2_trt
    from dflash2_trt.manifest import TARGET_ORT

    def run(**opts):  # noqa: ANN003, ANN202
        with dflash2_trt.load(acc_export, backend="ort", threads=1, **opts) as g:
            toks = g.generate([5, 6, 7, 8, 9], 12, eos_ids=set()).tokens
            be = g._backend
            rewritten = [be.session(k).rewritten for k in (TARGET_ORT, "drafter_context")]
            matmul = {k: v for k, v in be.session(TARGET_ORT).panel_codes.items() if v}
            return toks, rewritten, matmul

    monkeypatch.setenv(DA.PANELS_ENV, "0")
    on, rewritten, coded = run(panels=True)
    assert rewritten == [True, True] and sum(coded.values()) > 0, coded
    monkeypatch.setenv(DA.PANELS_ENV, "1")
    off, rewritten_off, coded_off = run(panels=False)
    assert rewritten_off == [True, False] and coded_off == {}  # the target keeps DecodeAttention, not the panels
    monkeypatch.delenv(DA.PANELS_ENV)
    fp32, _, plain = run(panels=True, weight_codes=False)
    assert set(plain) == {"none"} and plain["none"] == sum(coded.values())
    assert on == off == fp32
    with pytest.raises(DFlash2Error, match="weight_codes must be True or False"):
        dflash2_trt.load(acc_export, backend="ort", weight_codes="no")
    with pytest.raises(DFlash2Error, match="panels must be True, False or None"):
        dflash2_trt.load(acc_export, backend="ort", panels=1)


def _q4_session(K: int, N: int, block: int, packed: np.ndarray, scales: np.ndarray, swap: bool,
                level: int = 0):  # noqa: ANN202
    """x [B, S, K] @ int4 weights: ORT's MatMulNBits (symmetric: no zero points), or the rewrite's PanelMatMulQ4."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], name="mm", domain="com.microsoft", K=K, N=N,
                            bits=4, block_size=block, accuracy_level=level)
    g = helper.make_graph([node], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", N])],
                          [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                            helper.make_opsetid(DA.OP_DOMAIN, 1)])
    if swap:
        assert DA._swap_matmuls(m) == 1
        assert [n.op_type for n in m.graph.node] == ["Reshape", "Transpose"] * 2 + [DA.MATMUL_Q4_OP_TYPE]
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(DA.find_library()))
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("B,S,K,N,block", [(1, 1, 64, 32, 32), (1, 3, 576, 48, 32), (2, 5, 96, 160, 16),
                                           (1, 9, 128, 16, 64), (3, 4, 32, 64, 32), (1, 1, 48, 16, 16)])
def test_panel_matmul_q4_vs_numpy_and_rows_alone(B, S, K, N, block):
    """dflash2.PanelMatMulQ4 on fresh random int4 weights and inputs (row counts across the register blocks of
    1..8 rows, several block sizes) vs the dequantized weights in float64 NumPy and vs ORT's MatMulNBits at
    accuracy level 0, and every row bit-equal to the same row computed alone (the lossless int4 verify)."""
    rng = np.random.default_rng(B * 1000 + S * 100 + K + N + block)
    packed = rng.integers(0, 256, (N, K // block, block // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (N, K // block)).astype(np.float32)
    x = rng.standard_normal((B, S, K)).astype(np.float32)
    flat = packed.reshape(N, K // 2)
    q = np.empty((N, K), dtype=np.int64)
    q[:, 0::2], q[:, 1::2] = flat & 15, flat >> 4  # low nibble first
    w = (q - 8) * np.repeat(scales.astype(np.float64), block, axis=1)  # [N, K]
    want = x.astype(np.float64) @ w.T
    panel = _q4_session(K, N, block, packed, scales, True)
    y = panel.run(None, {"x": x})[0]
    assert y.shape == (B, S, N)
    tol = 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=tol)
    np.testing.assert_allclose(y, _q4_session(K, N, block, packed, scales, False).run(None, {"x": x})[0],
                               rtol=1e-4, atol=tol)
    for b in range(B):
        for s in range(S):
            np.testing.assert_array_equal(panel.run(None, {"x": x[b: b + 1, s: s + 1]})[0][0, 0], y[b, s])


def test_panel_matmul_q4_swaps_only_exact_int4():
    """Only int4 MatMulNBits that compute in fp32 are swapped: accuracy level 4 (int8 activations, the user's
    speed-over-exactness choice) and 8-bit weights stay ORT's."""
    from onnx import TensorProto, helper, numpy_helper

    def model(bits: int, level: int):  # noqa: ANN202
        K, N, block = 64, 32, 32
        w = np.zeros((N, K // block, block * bits // 8), dtype=np.uint8)
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=bits,
                                block_size=block, accuracy_level=level)
        g = helper.make_graph([node], "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, N])],
                              [numpy_helper.from_array(w, "w"),
                               numpy_helper.from_array(np.ones((N, K // block), np.float32), "s")])
        return helper.make_model(g)

    assert DA._swap_matmuls(model(4, 0)) == 1
    assert DA._swap_matmuls(model(4, 4)) == 0
    assert DA._swap_matmuls(model(8, 0)) == 0


@pytest.mark.parametrize("op,feeds", [
    ("PanelMatMul", {"x": np.zeros((1, 30), np.float32), "w": np.zeros((2, 31, 16), np.float32)}),  # K 30 vs 31
    ("PanelMatMulQ4", {"x": np.zeros((1, 30), np.float32), "w": np.zeros((2, 16, 16), np.uint8),  # K 30 vs 2 x 16
                       "s": np.zeros((2, 1, 16), np.float32)}),
    ("PanelMatMulQ4", {"x": np.zeros((1, 30), np.float32), "w": np.zeros((2, 15, 16), np.uint8),  # B = 30 / 2: odd
                       "s": np.zeros((2, 2, 16), np.float32)}),
])
def test_panel_ops_refuse_bad_shapes(op, feeds):
    """Shapes that do not fit the op's layout come back as ONNX Runtime's error naming the op and its layout, not
    as out-of-bounds reads."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.uint8): TensorProto.UINT8}
    node = helper.make_node(op, list(feeds), ["y"], domain=DA.OP_DOMAIN)
    inputs = [helper.make_tensor_value_info(k, types[v.dtype], None) for k, v in feeds.items()]
    g = helper.make_graph([node], "t", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DA.OP_DOMAIN, 1)])
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.register_custom_ops_library(str(DA.find_library()))
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=f"dflash2.{op}: expects"):
        sess.run(None, feeds)


def coded_weights(code: str, K: int, N: int, rng: np.random.Generator) -> np.ndarray:
    """Fresh random fp32 weights [K, N] that the named exact code reproduces (panelCodes.h; "none": plain fp32):
    blocks of 32 k per column as GGUF's Q4_1 / Q8_0 quantize them (fp16 scales and minimums, the extremes at the
    extreme codes), one block of equal values (scale 0) in affine4; fp16 values (subnormals and both zeros among
    them); bf16 values; each weight computed as the kernel rebuilds it."""
    f32, B = np.float32, K // 32

    def half(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).astype(f32)

    if code == "affine4":
        q = rng.integers(0, 16, (B, 32, N)).astype(f32)
        q[:, 0], q[:, 1] = 0, 15  # as GGUF quantizes: the block's minimum is code 0, its maximum 15
        q[0, :, 0] = 3  # a block of one value
        s = half(rng.uniform(0.001, 0.05, (B, 1, N)))
        s[0, 0, 0] = 0
        m = half(rng.uniform(-0.4, 0.0, (B, 1, N)))
        return (q * s + m).reshape(K, N)  # q s exact in fp32, one rounding: fma(q, s, m)
    if code == "scaled8":
        q = rng.integers(-127, 128, (B, 32, N)).astype(f32)
        q[:, 0] = 127 * rng.choice([-1, 1], (B, N))  # the block's largest magnitude is code +-127
        return (q * half(rng.uniform(0.0005, 0.01, (B, 1, N)))).reshape(K, N)
    w = rng.standard_normal((K, N)).astype(f32)
    if code == "fp16":
        w = half(w)
        w[0, :4] = half(np.array([6e-8, -3e-6, 0.0, -0.0], f32))  # subnormal fp16 values and both zeros
    if code == "bf16":  # beyond fp16's range, so no fp16 code fits first
        w = (np.float32(2**20) * w).view(np.uint32) & np.uint32(0xFFFF0000)
        w = w.view(f32)
    return w


@pytest.mark.parametrize("code,N", [(c, 48) for c in DA.PANEL_CODES] + [("affine4", 128)])
def test_panel_codes_give_the_fp32_kernels_numbers(code, N, monkeypatch):
    """A PanelMatMul whose weights fit an exact code computes from the code (the library's count of coded kernels
    says so) and gives the fp32 kernel's numbers bit for bit (the same session built with DFLASH2_ORT_PANEL_CODES=0)
    at 1..13 rows, every row bit-equal alone, within fp32 rounding of float64 NumPy; plain fp32 weights find no
    code. N = 48 and 128: 3 and 8 panels of 16 columns."""
    rng = np.random.default_rng(DA.PANEL_CODES.index(code) + N)
    K = 96
    w = coded_weights(code, K, N, rng)
    monkeypatch.setenv(DA.CODES_ENV, "0")
    before = DA.panel_codes()
    fp32 = _matmul_session(K, N, w, True)
    monkeypatch.setenv(DA.CODES_ENV, "1")
    coded = _matmul_session(K, N, w, True)
    after = DA.panel_codes()
    assert {k: after[k] - before[k] for k in after} == {c: 2 if c == code == "none" else int(c in (code, "none"))
                                                        for c in DA.PANEL_CODES}
    for S in (1, 2, 3, 8, 9, 13):
        x = rng.standard_normal((1, S, K)).astype(np.float32)
        y = coded.run(None, {"x": x})[0]
        np.testing.assert_array_equal(y, fp32.run(None, {"x": x})[0])
        want = x.astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        for i in (0, S - 1):
            np.testing.assert_array_equal(coded.run(None, {"x": x[:, i: i + 1]})[0][0, 0], y[0, i])


def test_panel_codes_miss_near_misses():
    """Weights one bit away from a code keep the fp32 kernel: the search proves a code exact or uses none."""
    rng = np.random.default_rng(5)
    before = DA.panel_codes()
    for code in DA.PANEL_CODES[1:]:
        w = coded_weights(code, 64, 32, rng)
        w.view(np.uint32)[37, 20] ^= 1  # one weight's last bit
        _matmul_session(64, 32, w, True)
    after = DA.panel_codes()
    assert after["none"] - before["none"] == len(DA.PANEL_CODES) - 1
    assert all(after[c] == before[c] for c in DA.PANEL_CODES[1:])


def _near_miss_weights(code: str, cls: str, K: int, N: int, rng: np.random.Generator) -> np.ndarray:
    """Weights [K, N] that ``code`` reproduces exactly, in column class ``cls`` of the fitting code
    (panelCodes.cpp): affine4 "full" (codes 0..15: the vectorised first candidate fits) and "levels14" (codes
    0..14: only the per-column search's second level count fits), scaled8 "full" (largest code +-127), fp16
    "normal", bf16 "normal". Every block's extremes sit at k = 1 and 2 of the block, so a weight at its first or
    last position is an inner one, which only the per-weight check can find off the grid."""
    f32, B = np.float32, K // 32

    def half(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).astype(f32)

    if code == "affine4":
        top = 15 if cls == "full" else 14
        q = rng.integers(1, top, (B, 32, N)).astype(f32)  # inner codes everywhere but the extremes
        q[:, 1], q[:, 2] = 0, top
        return (q * half(rng.uniform(0.001, 0.05, (B, 1, N))) + half(rng.uniform(-0.4, 0.0, (B, 1, N)))).reshape(K, N)
    if code == "scaled8":
        q = rng.integers(-126, 127, (B, 32, N)).astype(f32)
        q[:, 1] = 127 * rng.choice([-1, 1], (B, N))
        return (q * half(rng.uniform(0.0005, 0.01, (B, 1, N)))).reshape(K, N)
    return coded_weights(code, K, N, rng)


_NEAR_MISS_CLASSES = [("affine4", "full"), ("affine4", "levels14"), ("scaled8", "full"), ("fp16", "normal"),
                      ("bf16", "normal")]


@pytest.mark.parametrize("code,cls", _NEAR_MISS_CLASSES)
def test_panel_codes_check_every_position_of_a_block(code, cls, monkeypatch):
    """A code is taken only where it reproduces every weight: in each column class the fitting code handles and
    for every code, fresh coded weights fit their code (control), and one weight moved off the grid -- by one ulp,
    or by a third of a quantisation step -- at the first or the last position of the first or the last block (a
    column of the second panel, or the last column) leaves the matrix uncoded, the outputs those of the fp32 kernel
    bit for bit. (Mutation check, done by hand: starting fitAffine4Block's check at k = 1 makes this fail.)"""
    K, N = 64, 32
    rng = np.random.default_rng(_NEAR_MISS_CLASSES.index((code, cls)))
    x = rng.standard_normal((1, 3, K)).astype(np.float32)

    def coded_as(w: np.ndarray) -> tuple[str, np.ndarray]:
        before = DA.panel_codes()
        monkeypatch.setenv(DA.CODES_ENV, "1")
        y = _matmul_session(K, N, w, True).run(None, {"x": x})[0]
        after = DA.panel_codes()
        monkeypatch.setenv(DA.CODES_ENV, "0")
        np.testing.assert_array_equal(y, _matmul_session(K, N, w, True).run(None, {"x": x})[0])
        (got,) = [c for c in DA.PANEL_CODES if after[c] != before[c]]
        return got, y

    w = _near_miss_weights(code, cls, K, N, rng)
    assert coded_as(w)[0] == code
    step = {"affine4": (w.max() - w.min()) / 15, "scaled8": np.abs(w).max() / 127}.get(code, 0.0)
    for k in (0, 31, 32, 63):
        for j in (20, 31):
            for off in ("ulp", "third"):
                v = w.copy()
                v[k, j] = np.nextafter(v[k, j], np.float32(np.inf)) if off == "ulp" or not step else \
                    v[k, j] + np.float32(step / 3)
                got, _ = coded_as(v)
                assert got == "none", (k, j, off, got)


_ISA_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_ort_panel_matmul as T
rng = np.random.default_rng(11)
out = {}
for S in (1, 2, 3, 4, 5, 13):
    w = rng.standard_normal((40, 48)).astype(np.float32)
    x = rng.standard_normal((1, S, 40)).astype(np.float32)
    out[f"fp32_{S}"] = T._matmul_session(40, 48, w, True).run(None, {"x": x})[0]
    packed = rng.integers(0, 256, (32, 4, 8), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (32, 4)).astype(np.float32)
    x = rng.standard_normal((1, S, 64)).astype(np.float32)
    out[f"q4_{S}"] = T._q4_session(64, 32, 16, packed, scales, True).run(None, {"x": x})[0]
    for code in T.DA.PANEL_CODES[1:]:
        w = T.coded_weights(code, 64, 32, rng)
        x = rng.standard_normal((1, S, 64)).astype(np.float32)
        out[f"{code}_{S}"] = T._matmul_session(64, 32, w, True).run(None, {"x": x})[0]
np.savez(sys.argv[2], **out)
"""


_ISA_CHOICE = """
import json, sys
from dflash2_trt.runtime.ort import decode_attention as DA
print(json.dumps([DA.kernel_isa(), DA.panels_wanted()]))
"""


@pytest.mark.parametrize("isa_flag,panels_flag", [(None, None), ("0", None), ("1", None), (None, "1"), ("0", "1"),
                                                  (None, "0")])
def test_kernel_isa_follows_the_cpu(isa_flag, panels_flag):
    """The CPU feature -> kernel choice, pinned: the library runs its AVX-512 kernels exactly where /proc/cpuinfo
    lists avx512f (and DFLASH2_ORT_PANELS_AVX512 is not 0), else the AVX2 + FMA ones (its x86-64 baseline); the
    rewrite swaps the MatMuls by default exactly where the AVX-512 kernels run, and DFLASH2_ORT_PANELS overrides
    that either way. So DFLASH2_ORT_PANELS_AVX512=0 makes an AVX-512 machine decide as an AVX2-only one does."""
    import json
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() != "x86_64":
        pytest.skip("the x86-64 kernels' choice")
    flags = set(open("/proc/cpuinfo").read().split())
    env = {k: v for k, v in os.environ.items() if k not in (DA.ISA_ENV, DA.PANELS_ENV)}
    env.update({k: v for k, v in ((DA.ISA_ENV, isa_flag), (DA.PANELS_ENV, panels_flag)) if v is not None})
    out = subprocess.run([sys.executable, "-c", _ISA_CHOICE], env=env, check=True, capture_output=True, text=True)
    isa, panels = json.loads(out.stdout)
    want_isa = "avx512" if "avx512f" in flags and isa_flag != "0" else "avx2"
    assert isa == want_isa
    assert panels == (panels_flag == "1" if panels_flag is not None else want_isa == "avx512")


def test_panel_kernels_agree_across_isas(tmp_path):
    """The AVX2 / portable kernels (DFLASH2_ORT_PANELS_AVX512=0; the library chooses once per process, so each
    choice runs in its own process) give the AVX-512 kernels' numbers bit for bit, fp32, int4 and every exact
    weight code, at 1..5 and 13 rows (register blocks of every kernel, full and partial; the AVX2 kernels take 1..4
    rows in one pass over a panel, more in two halves). On a CPU without AVX-512
    both runs take the same kernels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    runs = {}
    for flag in ("1", "0"):
        out = tmp_path / f"isa{flag}.npz"
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(Path(__file__).parent), str(out)], check=True,
                       env={**os.environ, "DFLASH2_ORT_PANELS_AVX512": flag})
        runs[flag] = np.load(out)
    assert sorted(runs["1"].files) == sorted(runs["0"].files) and len(runs["1"].files) == 36
    for k in runs["1"].files:
        np.testing.assert_array_equal(runs["1"][k], runs["0"][k], err_msg=k)



def q8_0_twin(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of export.quantize.round_q8_0: (rounded w, q, s) per block of 32 inputs of one output."""
    b = w.astype(np.float32).reshape(w.shape[0], -1, 32)
    raw = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    m, e = np.frexp(raw.astype(np.float64))  # raw = m 2^e, m in [0.5, 1)
    s = np.ldexp(np.floor(m * 2048 + 0.5) / 2048, e).astype(np.float32)  # 11 significant bits, ties away from 0
    q = np.clip(np.rint(np.divide(b, s, out=np.zeros_like(b), where=s > 0)), -127, 127)
    return (q * s).astype(np.float32).reshape(w.shape), q, s


def test_round_q8_0_is_its_numpy_twin():
    """round_q8_0 = its NumPy twin on fresh random matrices (rows of very different scales, a zero block, a block of
    one non-zero weight): integer codes within ±127 reaching 127 in each non-zero block, within half a step of the
    input, and the grid is a fixed point."""
    import torch

    from dflash2_trt.export.quantize import round_q8_0

    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
    w = (rng.standard_normal((24, 96)) * 10.0 ** rng.uniform(-30, 3, (24, 1))).astype(np.float32)
    w[3, 32:64] = 0
    w[5, :32] = 0
    w[5, 7] = -0.3
    got = round_q8_0(torch.from_numpy(w)).numpy()
    want, q, s = q8_0_twin(w)
    assert np.array_equal(got, want)
    nonzero = s[..., 0] > 0
    assert (np.abs(q) <= 127).all() and (np.abs(q).max(-1)[nonzero] == 127).all() and (~nonzero).sum() == 1
    assert (np.abs(got - w).reshape(q.shape) <= s / 2 * (1 + 1e-6)).all()
    assert np.array_equal(round_q8_0(torch.from_numpy(got)).numpy(), got)


def test_q8_0_drafter_runs_as_8bit_codes(acc_dir, acc_export, tmp_path):
    """export --drafter-quantize q8_0: the drafter's matrices are rounded onto Q8_0's grid before tracing (the
    export's checks against that PyTorch drafter pass), the graphs stay fp32 (no MatMulNBits, the layers block kept),
    the library reads every rounded matrix as 8-bit codes (Scaled8) and none of the target's, and speculative
    decoding with drafts accepted gives the target's own greedy tokens."""
    import json

    import jsonschema
    import onnx

    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.manifest import BLOCK_LAYERS, SCHEMA_FILE
    from dflash2_trt.runtime.ort.backend import OrtBackend

    out = tmp_path / "q8"
    export_model(acc_dir / "target", acc_dir / "drafter", out, progress=False, max_seq_len=256, block_size=4,
                 drafter_quantization="q8_0")
    m = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(m, json.loads(SCHEMA_FILE.read_text()))
    assert m["drafter_quantization"] == {"kind": "q8_0", "block_size": 32, "accuracy_level": None, "lm_head": False,
                                         "symmetric": True}
    rounded = m["verification"]["drafter.q8_0_matrices"]
    assert rounded == 2 * 9 + 2  # per layer q, k, v, o, gate, up, down and two kernel projections; fc; the selector's
    for g in m["graphs"].values():
        assert not [n for n in onnx.load(out / g["file"], load_external_data=False).graph.node
                    if n.op_type == "MatMulNBits"]
    be = OrtBackend(out, attention="decode")
    assert be.block_key() == BLOCK_LAYERS
    speculative_equals_autoregressive(be, 5, 4, 30, "(a Q8_0 drafter)")
    def codes(backend, keys):  # noqa: ANN001, ANN202
        out: dict[str, int] = {}
        for key in keys:
            for k, v in backend.session(key).panel_codes.items():
                out[k] = out.get(k, 0) + v
        return {k: v for k, v in out.items() if v}

    layers = ("drafter_context", BLOCK_LAYERS)
    rounded_codes, plain_codes = codes(be, layers), codes(OrtBackend(acc_export, attention="decode"), layers)
    # every matrix of the context and layer graphs coded (Scaled8, or Affine4 where a block has 16 even levels);
    # the pair's own fp32 drafter leaves some in fp32 / fp16
    assert "none" not in rounded_codes and rounded_codes.get("scaled8", 0) > 0, rounded_codes
    assert "scaled8" not in plain_codes and plain_codes.get("none", 0) > 0, plain_codes
    assert sum(rounded_codes.values()) == sum(plain_codes.values())


def _selftest_cases(path) -> dict[str, tuple[int, np.ndarray, np.ndarray, np.ndarray]]:  # noqa: ANN001
    """panelSelftest.cpp's file -> name -> (code found, x, weights or int4 bytes, y)."""
    data, out, i = Path(path).read_bytes(), {}, 0

    def take() -> bytes:
        nonlocal i
        n = int.from_bytes(data[i: i + 8], "little")
        i += 8 + n
        return data[i - n: i]

    while i < len(data):
        name = take().decode()
        code = int(np.frombuffer(take(), np.int32)[0])
        x = np.frombuffer(take(), np.float32)
        w = take()
        y = np.frombuffer(take(), np.float32)
        out[name] = (code, x, np.frombuffer(w, np.uint8 if name.startswith("q4/") else np.float32), y)
    return out


def test_panel_kernels_give_the_same_bytes_on_avx512_avx2_and_aarch64(tmp_path):
    """The panel kernels (fp32 panels, int4 panels, every exact code) built for x86-64 -- run with the AVX-512 and
    the AVX2 kernels -- and cross-built for aarch64 (NEON, the Jetson / Arm-server build) -- run under qemu-aarch64
    -- write the same bytes for 1..13 and 70 rows (plugins/ortDecodeAttention/panelSelftest.cpp); the code each
    matrix was found to fit is the one it was made for; the outputs are x @ W within fp32 rounding of float64. The
    whole op library cross-builds for aarch64."""
    import os
    import shutil
    import subprocess

    for tool in ("aarch64-linux-gnu-g++", "qemu-aarch64", "cmake"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: scripts/setup.sh test installs it (apt: g++-aarch64-linux-gnu qemu-user)")
    src = Path(__file__).resolve().parents[1] / "plugins" / "ortDecodeAttention"
    # the ONNX Runtime headers scripts/build_ort_ops.sh found: its download, else an installed libonnxruntime-dev
    inc = next((d for d in (Path(__file__).resolve().parents[1] / "build" / "ort-headers" / "x" / "usr" / "include"
                            / "onnxruntime", Path("/usr/include/onnxruntime")) if (d / "onnxruntime_c_api.h").is_file()),
               None)
    if inc is None:
        pytest.fail("ONNX Runtime's C API headers not found (scripts/build_ort_ops.sh)")
    runs = {}
    for arch, extra in (("x86", []), ("aarch64", [f"-DCMAKE_TOOLCHAIN_FILE={src.parents[1] / 'runtime' / 'cmake' / 'aarch64-linux-gnu.cmake'}"])):
        build = tmp_path / arch
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), f"-DORT_INCLUDE_DIR={inc}", *extra], check=True,
                       capture_output=True)
        subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "dflash2_panel_selftest",
                        *(["dflash2_ort_ops"] if arch == "aarch64" else [])], check=True, capture_output=True)
        exe = str(build / "dflash2_panel_selftest")
        if arch == "x86":
            for flag in ("1", "0"):
                subprocess.run([exe, str(tmp_path / f"x86-{flag}.bin")], check=True,
                               env={**os.environ, "DFLASH2_ORT_PANELS_AVX512": flag})
                runs[f"x86-{flag}"] = (tmp_path / f"x86-{flag}.bin").read_bytes()
        else:
            elf = subprocess.run(["readelf", "-h", str(build / "libdflash2_ort_ops.so")], capture_output=True,
                                 text=True, check=True).stdout
            assert "AArch64" in elf
            subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", exe, str(tmp_path / "arm.bin")], check=True)
            runs["aarch64"] = (tmp_path / "arm.bin").read_bytes()
    assert runs["x86-1"] == runs["x86-0"] == runs["aarch64"]
    cases = _selftest_cases(tmp_path / "arm.bin")
    want_code = {"none": 0, "affine4": DA.PANEL_CODES.index("affine4"), "scaled8": DA.PANEL_CODES.index("scaled8"),
                 "fp16": DA.PANEL_CODES.index("fp16"), "bf16": DA.PANEL_CODES.index("bf16"), "q4": -1}
    K, N = 96, 48
    assert len(cases) == 6 * 9
    for name, (code, x, w, y) in cases.items():
        kind, rows = name.split("/")
        assert code == want_code[kind], name
        if kind == "q4":  # its float64 twin is the op tests' through ONNX Runtime; here: the same bytes everywhere
            continue
        ref = x.astype(np.float64).reshape(int(rows), K) @ w.astype(np.float64).reshape(K, N)
        np.testing.assert_allclose(y.reshape(int(rows), N), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=name)
