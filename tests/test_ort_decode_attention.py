"""dflash2.DecodeAttention (plugins/ortDecodeAttention, loaded into ONNX Runtime) and the fused target that runs it: the
op vs its NumPy twin on fresh random inputs (edge sizes: no past, one row, a capacity that is not a multiple of 8, a
head size without the vector path, shared and unshared KV buffers); batches with ragged cached lengths and ragged new
rows (``past_seqlens``: padding rows are zeros and write nothing, a sequence of no rows takes no part) vs the twin,
and every sequence of a batch bit-equal to its own batch-1 call (GroupQueryAttention's inputs: B = 1 unchanged); the
fused target with it vs with ORT's GroupQueryAttention; every row of a k-row call vs k 1-row calls (the lossless
verify: same argmax, logits within 1e-4 relative, bit-equal with this op); speculative = autoregressive decoding on
the accepting pair with drafts accepted; the selector's plugin node run by the library = the selector's CPU twin and
the decomposed head; dflash2.DrafterLayer = the PyTorch layer, the export's layers block = its standard block. The library is built by scripts/setup.sh test (scripts/build_ort_ops.sh); where it is missing
these tests fail, saying so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash2_trt.runtime.ort import decode_attention as DA


@pytest.fixture(autouse=True)
def _op_built() -> None:
    ok, why = DA.available()
    if not ok:
        pytest.fail(f"{why} (scripts/build_ort_ops.sh)")


def twin(qkv, past_k, past_v, past, nh, kvh, cos, sin, scale):  # noqa: ANN001, ANN201
    """NumPy spec: qkv [S, (nh + 2 kvh) d]; past_* [kvh, C, d] -> out [S, nh d], K/V with rows past.. written."""
    S = qkv.shape[0]
    d = past_k.shape[-1]
    q = qkv[:, : nh * d].reshape(S, nh, d).astype(np.float64)
    k = qkv[:, nh * d: (nh + kvh) * d].reshape(S, kvh, d).astype(np.float64)
    v = qkv[:, (nh + kvh) * d:].reshape(S, kvh, d)
    pos = past + np.arange(S)

    def rot(x):  # noqa: ANN001, ANN202  x [S, heads, d], rotate_half
        c, s_ = cos[pos][:, None].astype(np.float64), sin[pos][:, None].astype(np.float64)
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * c - b * s_, b * c + a * s_], -1)

    K, V = past_k.astype(np.float64).copy(), past_v.astype(np.float64).copy()
    K[:, pos] = rot(k).transpose(1, 0, 2)
    V[:, pos] = v.transpose(1, 0, 2)
    q = rot(q)
    out = np.zeros((S, nh, d))
    for h in range(nh):
        g = h // (nh // kvh)
        for r in range(S):
            n = past + r + 1
            sc = K[g, :n] @ q[r, h] * scale
            p = np.exp(sc - sc.max())
            out[r, h] = (p / p.sum()) @ V[g, :n]
    return out.reshape(S, nh * d), K, V


def twin_batch(qkv, past_k, past_v, past, rows, nh, kvh, cos, sin, scale):  # noqa: ANN001, ANN201
    """NumPy spec of a batch: qkv [B, S, W]; past_* [B, kvh, C, d]; past [B] cached lengths P_b; rows [B] real new
    rows S_b (right-padded to S) -> out [B, S, nh d] (padding rows 0), K/V with each sequence's rows written."""
    B, S = qkv.shape[:2]
    out = np.zeros((B, S, nh * past_k.shape[-1]))
    K, V = past_k.astype(np.float64).copy(), past_v.astype(np.float64).copy()
    for b in range(B):
        if rows[b]:
            out[b, : rows[b]], K[b], V[b] = twin(qkv[b, : rows[b]], past_k[b], past_v[b], int(past[b]), nh, kvh,
                                                 cos, sin, scale)
    return out, K, V


def _op_session(nh: int, kvh: int, d: int, rope_rows: int, scale: float, ragged: bool = False):  # noqa: ANN202
    """A one-node graph; ``ragged``: with the optional past_seqlens input."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    F = TensorProto.FLOAT
    names = ["qkv", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"] + (["past_seqlens"] if ragged else [])
    node = helper.make_node("DecodeAttention", names, ["out", "present_key", "present_value"], domain=DA.OP_DOMAIN,
                            num_heads=nh, kv_num_heads=kvh, scale=scale)
    g = helper.make_graph([node], "t", [
        helper.make_tensor_value_info("qkv", F, ["B", "S", (nh + 2 * kvh) * d]),
        helper.make_tensor_value_info("past_key", F, ["B", kvh, "C", d]),
        helper.make_tensor_value_info("past_value", F, ["B", kvh, "C", d]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("cos", F, [rope_rows, d // 2]),
        helper.make_tensor_value_info("sin", F, [rope_rows, d // 2])]
        + ([helper.make_tensor_value_info("past_seqlens", TensorProto.INT32, ["B"])] if ragged else []),
        [helper.make_tensor_value_info("out", F, None), helper.make_tensor_value_info("present_key", F, None),
         helper.make_tensor_value_info("present_value", F, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DA.OP_DOMAIN, 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(DA.find_library()))
    return ort, ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _bind_in_place(ort, sess, feed: dict, kb: np.ndarray, vb: np.ndarray):  # noqa: ANN001, ANN202
    """IOBinding with present_* bound to the past buffers kb / vb (the runtime's way) -> out."""
    io = sess.io_binding()
    io.bind_output("out")  # first: get_outputs() follows the binding order
    for name, arr in feed.items():
        if name not in ("past_key", "past_value"):
            io.bind_cpu_input(name, arr)
    for name, arr in (("key", kb), ("value", vb)):
        val = ort.OrtValue.ortvalue_from_numpy(arr)
        io.bind_ortvalue_input(f"past_{name}", val)
        io.bind_ortvalue_output(f"present_{name}", val)
    sess.run_with_iobinding(io)
    return io.get_outputs()[0].numpy()


@pytest.mark.parametrize("nh,kvh,d,cap,past,S", [(9, 3, 64, 256, 200, 4), (9, 3, 64, 256, 0, 7), (4, 2, 16, 13, 9, 1),
                                                 (4, 4, 12, 21, 17, 3), (6, 2, 32, 40, 31, 9), (2, 1, 8, 8, 0, 8)])
def test_op_vs_numpy_twin(nh, kvh, d, cap, past, S):
    """Plain runs (present is a new buffer: slots 0..past-1 copied), IOBinding with past == present (in place), and
    past_seqlens given (bit-equal)."""
    rng = np.random.default_rng(nh * 1000 + d + past)
    rope_rows = past + S + 5
    f = rng.standard_normal((rope_rows, d // 2))
    cos, sin = np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)
    scale = float(1 / np.sqrt(d))
    ort, sess = _op_session(nh, kvh, d, rope_rows, scale)
    qkv = rng.standard_normal((1, S, (nh + 2 * kvh) * d)).astype(np.float32)
    pk = rng.standard_normal((1, kvh, cap, d)).astype(np.float32)
    pv = rng.standard_normal((1, kvh, cap, d)).astype(np.float32)
    want, wk, wv = twin(qkv[0], pk[0], pv[0], past, nh, kvh, cos, sin, scale)
    feed = {"qkv": qkv, "past_key": pk, "past_value": pv, "seqlens_k": np.array([past + S - 1], np.int32),
            "total": np.array(past + S, np.int32), "cos": cos, "sin": sin}
    out, k, v = sess.run(None, feed)
    np.testing.assert_allclose(out[0], want, atol=2e-5, rtol=1e-4)
    n = past + S
    assert k.shape == (1, kvh, max(cap, n), d)
    np.testing.assert_allclose(k[0, :, :n], wk[:, :n], atol=1e-5)
    np.testing.assert_array_equal(v[0, :, :n], wv[:, :n])
    # in place: present bound to the past buffers; slots >= past + S untouched
    kb, vb = pk.copy(), pv.copy()
    np.testing.assert_array_equal(_bind_in_place(ort, sess, feed, kb, vb), out)
    # past_seqlens = [past] (what the runtime's rewritten graph feeds at B = 1): the same bits
    _, rag = _op_session(nh, kvh, d, rope_rows, scale, ragged=True)
    np.testing.assert_array_equal(rag.run(["out"], {**feed, "past_seqlens": np.array([past], np.int32)})[0], out)
    np.testing.assert_array_equal(kb[0, :, :n], k[0, :, :n])
    np.testing.assert_array_equal(kb[0, :, n:], pk[0, :, n:])


@pytest.mark.parametrize("nh,kvh,d,cap,S,seed", [(9, 3, 64, 256, 4, 0), (4, 2, 16, 13, 3, 1), (4, 4, 12, 40, 7, 2),
                                                 (6, 2, 32, 57, 1, 3), (2, 1, 8, 24, 9, 4)])
def test_op_batch_ragged_vs_twin_and_b1(nh, kvh, d, cap, S, seed):
    """B = 5 sequences, each its own cached length P_b (0 .. cap - S_b) and its own real rows S_b (S, fewer,
    1, 0), padding right-aligned: outputs vs the NumPy twin (padding rows exactly 0), the cache with each
    sequence's rows written and every other slot untouched (in place and copied), and each sequence's real rows
    bit-equal to its own batch-1 call with GroupQueryAttention's inputs (no past_seqlens)."""
    rng = np.random.default_rng(1000 + seed)
    B, W = 5, (nh + 2 * kvh) * d
    rope_rows = cap + 3
    f = rng.standard_normal((rope_rows, d // 2))
    cos, sin = np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)
    scale = float(1 / np.sqrt(d))
    rows = np.array([S, max(0, S - 2), 1, 0, S])[rng.permutation(B)]
    past = np.array([int(rng.integers(0, cap - r + 1)) for r in rows])
    past[rng.integers(B)] = 0  # a sequence with no past
    qkv = rng.standard_normal((B, S, W)).astype(np.float32)
    pk = rng.standard_normal((B, kvh, cap, d)).astype(np.float32)
    pv = rng.standard_normal((B, kvh, cap, d)).astype(np.float32)
    ort, sess = _op_session(nh, kvh, d, rope_rows, scale, ragged=True)
    feed = {"qkv": qkv, "past_key": pk, "past_value": pv, "seqlens_k": (past + rows - 1).astype(np.int32),
            "total": np.array((past + rows).max(), np.int32), "cos": cos, "sin": sin,
            "past_seqlens": past.astype(np.int32)}
    want, wk, wv = twin_batch(qkv, pk, pv, past, rows, nh, kvh, cos, sin, scale)
    out, k, v = sess.run(None, feed)  # present in new buffers: slots 0..P_b-1 copied
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    assert k.shape == (B, kvh, cap, d)
    kb, vb = pk.copy(), pv.copy()
    out_io = _bind_in_place(ort, sess, feed, kb, vb)
    np.testing.assert_array_equal(out_io, out)
    _, b1 = _op_session(nh, kvh, d, rope_rows, scale)
    for b in range(B):
        n = past[b] + rows[b]
        assert not out[b, rows[b]:].any(), f"sequence {b}: padding rows are not zeros"
        np.testing.assert_allclose(k[b, :, :n], wk[b, :, :n], atol=1e-5)
        np.testing.assert_array_equal(v[b, :, :n], wv[b, :, :n])
        np.testing.assert_array_equal(kb[b, :, :n], k[b, :, :n])
        np.testing.assert_array_equal(kb[b, :, n:], pk[b, :, n:])  # padding wrote nothing
        np.testing.assert_array_equal(vb[b, :, n:], pv[b, :, n:])
        if not rows[b]:
            continue
        one = {"qkv": qkv[b:b + 1, : rows[b]], "past_key": pk[b:b + 1], "past_value": pv[b:b + 1],
               "seqlens_k": np.array([n - 1], np.int32), "total": np.array(n, np.int32), "cos": cos, "sin": sin}
        o1, k1, _ = b1.run(None, one)
        np.testing.assert_array_equal(out[b, : rows[b]], o1[0], err_msg=f"sequence {b} vs its batch-1 call")
        np.testing.assert_array_equal(k[b, :, :n], k1[0, :, :n])


def test_op_batch_without_past_seqlens():
    """GroupQueryAttention's convention at B > 1 (no past_seqlens): every sequence's S rows are new, at
    P_b = seqlens_k[b] + 1 - S."""
    rng = np.random.default_rng(42)
    nh, kvh, d, cap, S = 4, 2, 16, 30, 3
    rope_rows = cap
    f = rng.standard_normal((rope_rows, d // 2))
    cos, sin = np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)
    past = np.array([0, 11, 27, 5])
    qkv = rng.standard_normal((4, S, (nh + 2 * kvh) * d)).astype(np.float32)
    pk = rng.standard_normal((4, kvh, cap, d)).astype(np.float32)
    pv = rng.standard_normal((4, kvh, cap, d)).astype(np.float32)
    _, sess = _op_session(nh, kvh, d, rope_rows, 0.25)
    out, k, _ = sess.run(None, {"qkv": qkv, "past_key": pk, "past_value": pv,
                                "seqlens_k": (past + S - 1).astype(np.int32), "total": np.array(cap, np.int32),
                                "cos": cos, "sin": sin})
    want, wk, _ = twin_batch(qkv, pk, pv, past, [S] * 4, nh, kvh, cos, sin, 0.25)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    for b in range(4):  # a new present buffer: slots past P_b + S were never written
        np.testing.assert_allclose(k[b, :, : past[b] + S], wk[b, :, : past[b] + S], atol=1e-5)


def test_op_refuses_bad_lengths():
    ort, sess = _op_session(2, 1, 8, 4, 0.3)
    feed = {"qkv": np.zeros((1, 3, 32), np.float32), "past_key": np.zeros((1, 1, 8, 8), np.float32),
            "past_value": np.zeros((1, 1, 8, 8), np.float32), "seqlens_k": np.array([5], np.int32),
            "total": np.array(6, np.int32), "cos": np.zeros((4, 4), np.float32), "sin": np.zeros((4, 4), np.float32)}
    with pytest.raises(Exception, match="seqlens_k out of range"):
        sess.run(None, feed)
    _, rag = _op_session(2, 1, 8, 12, 0.3, ragged=True)
    feed = {**feed, "qkv": np.zeros((2, 3, 32), np.float32), "past_key": np.zeros((2, 1, 8, 8), np.float32),
            "past_value": np.zeros((2, 1, 8, 8), np.float32), "cos": np.zeros((12, 4), np.float32),
            "sin": np.zeros((12, 4), np.float32)}
    for past, seqlens, why in (([2, 2], [0, 3], "out of range for sequence 0"),  # S_b < 0
                               ([2, 2], [3, 5], "out of range for sequence 1"),  # S_b = 4 > S = 3
                               ([2, 9], [3, 9], "out of range for sequence 1"),  # P_b > capacity 8
                               ([2, 2, 2], [3, 3], "past_seqlens must hold one value per sequence")):
        with pytest.raises(Exception, match=why):
            rag.run(None, {**feed, "past_seqlens": np.array(past, np.int32), "seqlens_k": np.array(seqlens, np.int32)})


def _rows_vs_steps(target, prompt: list[int], rows: list[int]):  # noqa: ANN001, ANN202
    """logits of one len(rows)-row call after the prompt, and of len(rows) 1-row calls."""
    target.reset()
    target.forward(prompt)
    k_row, _ = target.forward(rows)
    target.crop(len(prompt))
    steps = np.stack([target.forward([t])[0][0] for t in rows])
    return k_row, steps


def _assert_rows_match(k_row: np.ndarray, steps: np.ndarray, exact: bool) -> None:
    scale = max(1.0, float(np.abs(steps).max()))
    assert float(np.abs(k_row - steps).max()) / scale <= 1e-4
    assert (k_row.argmax(-1) == steps.argmax(-1)).all()
    if exact:
        np.testing.assert_array_equal(k_row, steps)


@pytest.mark.parametrize("which", ["acc_export", "tiny_export"])
def test_k_rows_equal_k_steps_and_gqa(request, which):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    folder = request.getfixturevalue(which)
    dec, gqa = OrtBackend(folder, attention="decode"), OrtBackend(folder, attention="gqa")
    td, tg = dec.target_runner(), gqa.target_runner()
    assert (dec.attention_op, gqa.attention_op) == ("DecodeAttention", "GroupQueryAttention")
    rng = np.random.default_rng(7)
    vocab = td.vocab_size
    for n_prompt, k in ((5, 4), (37, 3), (120, 6), (1, 2)):
        prompt = rng.integers(0, vocab, n_prompt).tolist()
        rows = rng.integers(0, vocab, k).tolist()
        kd, sd = _rows_vs_steps(td, prompt, rows)
        _assert_rows_match(kd, sd, exact=True)
        kg, sg = _rows_vs_steps(tg, prompt, rows)
        _assert_rows_match(kg, sg, exact=False)
        _assert_rows_match(kd, kg, exact=False)


def test_attention_choice(tiny_export):
    from dflash2_trt import DFlash2Error
    from dflash2_trt.runtime.ort.backend import OrtBackend

    assert OrtBackend(tiny_export).attention_op == "DecodeAttention"  # auto: the op when the library is built
    assert OrtBackend(tiny_export, flavour="standard").attention_op is None
    with pytest.raises(DFlash2Error, match="attention"):
        OrtBackend(tiny_export, attention="flash")


def test_speculative_equals_autoregressive_with_decode_attention(acc_export):
    from dflash2_trt.runtime.ort.backend import OrtBackend

    speculative_equals_autoregressive(OrtBackend(acc_export, attention="decode"), 11, 6, 40, "(DecodeAttention)")


def speculative_equals_autoregressive(be, seed: int, prompts: int, n: int, what: str) -> None:  # noqa: ANN001
    """Greedy speculative decoding through ``be`` = its own autoregressive tokens on random prompts, drafts accepted."""
    from helpers import assert_accepts
    from dflash2_trt.runtime import decoder as D

    target, drafter = be.target_runner(), be.draft_runner("greedy")
    rng = np.random.default_rng(seed)
    accepted = []
    for _ in range(prompts):
        p = rng.integers(4, target.vocab_size, int(rng.integers(3, n))).tolist()
        spec = D.speculative_generate(target, drafter, p, n, eos_ids=set())
        assert spec.tokens == D.target_generate(target, p, n, eos_ids=set()).tokens
        accepted += spec.accepted
    assert_accepts(accepted, drafter.block_size - 1, what)


@pytest.mark.slow
def test_smollm2_k_rows_equal_k_steps():
    """The demo's export (SmolLM2-135M-Instruct fp32, fused): rows of 2..4-row calls vs 1-row calls at 256 and 1000
    cached positions, DecodeAttention (bit-equal) and GroupQueryAttention (within 1e-4 relative, same argmax)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from ort_op_profile import demo_export

    from dflash2_trt.runtime.ort.backend import OrtBackend

    folder = demo_export()
    td = OrtBackend(folder, threads=2, attention="decode").target_runner()
    tg = OrtBackend(folder, threads=2, attention="gqa").target_runner()
    rng = np.random.default_rng(3)
    for n_prompt in (256, 1000):
        prompt = rng.integers(0, td.vocab_size, n_prompt).tolist()
        for k in (2, 4):
            rows = rng.integers(0, td.vocab_size, k).tolist()
            kd, sd = _rows_vs_steps(td, prompt, rows)
            _assert_rows_match(kd, sd, exact=True)
            kg, sg = _rows_vs_steps(tg, prompt, rows)
            _assert_rows_match(kg, sg, exact=False)
            _assert_rows_match(kd, kg, exact=False)


@pytest.mark.slow
def test_smollm2_codes_give_the_fp32_numbers(monkeypatch):
    """The demo's export: SmolLM2-135M-Instruct, converted from its Q4_1 GGUF, holds 4-bit weights in fp32. Every
    linear layer's PanelMatMul finds the affine 4-bit code (GGUF's Q4_1), the tied LM head the 8-bit one (Q8_0), and
    the target's logits (a 300-token prompt, then calls of 1..4 rows) equal the fp32 kernels' bit for bit. The
    panels are switched on (DFLASH2_ORT_PANELS=1), so this runs the kernels this CPU gets (kernel_isa)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from ort_op_profile import demo_export

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
import test_ort_decode_attention as T
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


# -- trt.plugins.DFlash2PathSelector: the selector's plugin node run by the library -----------------------------------


def _selector_session(mode: str, K: int, r: int, ctype: int, pred_type: int | None = None):  # noqa: ANN202
    """A one-node graph: the plugin contract's node (selector_contract), codebooks as inputs (``pred_type``: the
    predecessor codebook's type when it is not ``ctype``)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dflash2_trt.export import selector_contract as sc

    I, F = TensorProto.INT32, TensorProto.FLOAT
    names = [n for n, _, _ in sc.INPUTS]
    types = {"cand_ids": I, "anchor_ids": I, "hidden_proj": ctype, "pred_codebook": pred_type or ctype,
             "succ_codebook": ctype}
    shapes = {"cand_ids": ["B", "L", K], "unary": ["B", "L", K], "hidden_proj": ["B", "L", r], "anchor_ids": ["B"],
              "pred_codebook": ["V", r], "succ_codebook": ["V", r], "temperature": ["B"], "uniforms": ["B", "L"]}
    node = sc.make_selector_node(names, ["path_ids", "proposal_probs"], top_k=K, rank=r, mode=mode)
    g = helper.make_graph([node], "t", [helper.make_tensor_value_info(n, types.get(n, F), shapes[n]) for n in names],
                          [helper.make_tensor_value_info("path_ids", I, ["B", "L"]),
                           helper.make_tensor_value_info("proposal_probs", F, ["B", "L", K])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), sc.opset_import()])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(DA.find_library()))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("mode", ["greedy", "viterbi"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_selector_op_is_the_twin_and_the_reference(mode, dtype):
    """The plugin node in ORT gives the selector's CPU twin's numbers bit for bit (the library's own
    dfl2SelectPathsHost through ctypes, whose agreement with the CUDA kernel and the NumPy reference
    tests/test_plugin_selector.py pins), a batch of argmax and sampling sequences in one call; at T = 0 the reference's
    paths."""
    import ctypes

    from onnx import TensorProto

    from dflash2_trt import reference as ref

    rng = np.random.default_rng(5)
    B, L, K, r, V = 4, 3, 8, 16, 50
    cand = rng.integers(0, V, (B, L, K)).astype(np.int32)
    unary = -np.sort(-2.0 * rng.standard_normal((B, L, K)), axis=-1).astype(np.float32)
    g = rng.standard_normal((B, L, r)).astype(dtype)
    A = (rng.standard_normal((V, r)) / 4).astype(dtype)
    Bc = rng.standard_normal((V, r)).astype(dtype)
    anchor = rng.integers(0, V, B).astype(np.int32)
    temps = np.array([0.0, 0.7, 0.0, 1.5], np.float32)
    u = rng.random((B, L)).astype(np.float32)
    sess = _selector_session(mode, K, r, TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16)
    ids, probs = sess.run(None, {"cand_ids": cand, "unary": unary, "hidden_proj": g, "anchor_ids": anchor,
                                 "pred_codebook": A, "succ_codebook": Bc, "temperature": temps, "uniforms": u})
    lib = ctypes.CDLL(str(DA.find_library()))
    P, I32 = ctypes.c_void_p, ctypes.c_int32
    lib.dfl2SelectPathsHost.restype = I32
    lib.dfl2SelectPathsHost.argtypes = [P] * 8 + [I32] * 7 + [P] * 3
    t_ids, t_probs = np.full((B, L), -7, np.int32), np.full((B, L, K), np.nan, np.float32)
    ptr = [a.ctypes.data_as(P) for a in (cand, unary, g, anchor, A, Bc, temps, u, t_ids, t_probs)]
    assert lib.dfl2SelectPathsHost(*ptr[:8], B, L, K, r, V, 0 if dtype == "float32" else 1,
                                   0 if mode == "greedy" else 1, *ptr[8:], None) == 0
    np.testing.assert_array_equal(ids, t_ids)
    np.testing.assert_array_equal(probs, t_probs)
    r_ids, _, r_probs = ref.select_paths(cand, unary, g.astype(np.float64), anchor, A.astype(np.float64),
                                         Bc.astype(np.float64), mode=mode, temperature=temps.astype(np.float64),
                                         uniforms=u)
    argmax = temps <= 0
    np.testing.assert_array_equal(ids[argmax], r_ids[argmax])
    np.testing.assert_array_equal(probs[argmax], r_probs[argmax])  # one-hot
    np.testing.assert_allclose(probs[~argmax], r_probs[~argmax], atol=1e-5)


def test_selector_op_refuses_mixed_types():
    from onnx import TensorProto

    sess = _selector_session("greedy", 2, 4, TensorProto.FLOAT, pred_type=TensorProto.FLOAT16)
    f = {"cand_ids": np.zeros((1, 2, 2), np.int32), "unary": np.zeros((1, 2, 2), np.float32),
         "hidden_proj": np.zeros((1, 2, 4), np.float32), "anchor_ids": np.zeros(1, np.int32),
         "pred_codebook": np.zeros((5, 4), np.float16), "succ_codebook": np.zeros((5, 4), np.float32),
         "temperature": np.zeros(1, np.float32), "uniforms": np.zeros((1, 2), np.float32)}
    with pytest.raises(Exception, match="must share one type"):
        sess.run(None, f)


def test_plugin_head_runs_and_equals_the_decomposed_head(acc_export):
    """With the library the runtime's drafter head is the ``.plugin.onnx`` graph (one selector node); its paths are
    the decomposed head's (an independent implementation: ~120 ONNX ops) on random hidden states, argmax and
    sampled rows, and its proposals within 1e-5. Without the library in use (attention 'gqa') the decomposed head
    runs."""
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.vocabulary import head_key

    be = OrtBackend(acc_export, attention="decode")
    for mode in ("greedy", "viterbi"):
        assert be.head_key(mode) == head_key(mode, plugin=True)
        assert OrtBackend(acc_export, attention="gqa").head_key(mode) == head_key(mode)
        plug, dec = be.session(head_key(mode, plugin=True)), be.session(head_key(mode))
        assert plug.path.endswith(".plugin.onnx") and not dec.path.endswith(".plugin.onnx")
        H = dec.sess.get_inputs()[0].shape[-1]
        rng = np.random.default_rng(3)
        sampled = 0
        for i in range(40):
            T = 0.0 if i % 2 else float(rng.uniform(0.5, 1.5))
            f = {"hidden": (rng.standard_normal((2, be.manifest.drafter_config.block_size, H)) * 3).astype(np.float32),
                 "anchor_ids": rng.integers(0, 64, 2).astype(np.int32), "temperature": np.array([T, 0.0], np.float32),
                 "uniforms": rng.random((2, be.manifest.drafter_config.num_draft_rows)).astype(np.float32)}
            (pc, pp, pq), (dc, dp, dq) = plug.run(f), dec.run(f)
            np.testing.assert_array_equal(pc, dc)
            np.testing.assert_array_equal(pp, dp)
            np.testing.assert_allclose(pq, dq, atol=1e-5)
            sampled += int(T > 0 and (pq[0] > 0).sum() > pq.shape[1])  # a sampled row's proposal is not one-hot
        assert sampled > 0


# -- dflash2.DrafterLayer: one drafter decoder layer in one node ----------------------------------------------------


def drafter_layer_session(layer, cfg, use_conv: bool):  # noqa: ANN001, ANN201
    """A one-node graph of ``layer`` (a DrafterLayer): its weights as constants in the op's order (MatMul layout)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    a, m = layer.self_attn, layer.mlp
    weights = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
               "q": a.q_proj.weight.t(), "k": a.k_proj.weight.t(), "v": a.v_proj.weight.t(), "o": a.o_proj.weight.t(),
               "q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight, "gate": m.gate_proj.weight.t(),
               "up": m.up_proj.weight.t(), "down": m.down_proj.weight.t()}
    group = taps = 0
    if use_conv:
        ac, mc = layer.attention_conv, layer.mlp_conv
        weights.update({"attn_kernel": ac.kernel_projection.weight.t(), "attn_base": ac.base_kernel,
                        "mlp_kernel": mc.kernel_projection.weight.t(), "mlp_base": mc.base_kernel})
        group, taps = ac.group, ac.kc
    inits = [numpy_helper.from_array(np.ascontiguousarray(w.detach().float().numpy()), n) for n, w in weights.items()]
    ins = ["h", "cos", "sin", "ctx_k", "ctx_v", "ctx_bias", "blk_bias"]
    F = TensorProto.FLOAT
    node = helper.make_node("DrafterLayer", ins + list(weights), ["out"], domain=DA.OP_DOMAIN,
                            num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads,
                            epsilon=cfg.rms_norm_eps, activation=cfg.hidden_act, conv_group_size=group,
                            conv_kernel_size=taps)
    g = helper.make_graph([node], "t", [helper.make_tensor_value_info(n, F, None) for n in ins],
                          [helper.make_tensor_value_info("out", F, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DA.OP_DOMAIN, 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(DA.find_library()))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("which", ["packaged", "accepting"])
@pytest.mark.parametrize("use_conv", [True, False])
def test_drafter_layer_op_vs_the_pytorch_layer(request, which, use_conv):
    """dflash2.DrafterLayer = DrafterLayer.forward within fp32 rounding (≤ 1e-5 of the output's scale) on fresh random
    hidden states, context keys / values and positions, with and without the convolutions: the packaged SmolLM2
    drafter's layer (its fp16 weights read as their exact code) and the accepting pair's; a batch of 3 sequences
    with ragged valid context (masked slots) and context shared by the batch (ctx [1, ...])."""
    import torch

    from dflash2_trt.model.checkpoint import load_drafter
    from dflash2_trt.model.layers import attention_biases, rope_tables

    if which == "packaged":
        from dflash2_trt.bench.demo import demo_drafter_path

        drafter = load_drafter(demo_drafter_path())
    else:
        drafter = load_drafter(request.getfixturevalue("acc_dir") / "drafter")
    cfg = drafter.config
    layer = drafter.layers[0]
    sess = drafter_layer_session(layer, cfg, use_conv)
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    B, S, C = 3, cfg.block_size, 37
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    for shared in (False, True):
        anchor = torch.randint(C // 2, C + 1, (B,), generator=g)
        h = torch.randn(B, S, cfg.hidden_size, generator=g) * 2
        cos, sin = rope_tables(anchor.view(B, 1) + torch.arange(S), cfg, torch.float32)
        ck, cv = (torch.randn(1 if shared else B, kvh, C, d, generator=g) for _ in range(2))
        valid = torch.rand(B, C, generator=g) > 0.2
        cb, bb = attention_biases(*drafter.visibility(anchor, C, cfg.layer_is_causal(0), cfg.layer_window(0), valid),
                                  cfg.num_attention_heads // kvh, torch.float32)
        with torch.no_grad():
            ref = layer(h, cos, sin, ck, cv, cb, bb, use_conv).numpy()
        out = sess.run(None, {"h": h.numpy(), "cos": cos.numpy(), "sin": sin.numpy(), "ctx_k": ck.numpy(),
                              "ctx_v": cv.numpy(), "ctx_bias": cb.numpy(), "blk_bias": bb.numpy()})[0]
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), (which, use_conv, shared)


def test_block_layers_graph_equals_the_block_graph(acc_export):
    """The export's ``drafter_block_layers`` (each layer one dflash2.DrafterLayer node) gives the standard block
    graph's hidden states within 1e-5 of their scale on random anchors, positions, masked context slots and
    batches of 1 and 3; the runtime's runners use it where the library runs (attention 'gqa': the standard graph)."""
    from dflash2_trt.manifest import BLOCK_LAYERS
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(acc_export, attention="decode")
    assert be.block_key() == BLOCK_LAYERS and OrtBackend(acc_export, attention="gqa").block_key() == "drafter_block"
    assert be.draft_runner("greedy").block_sess.path.endswith(f"{BLOCK_LAYERS}.onnx")
    std, lay = be.session("drafter_block"), be.session(BLOCK_LAYERS)
    cfg = be.manifest.drafter_config
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
    C = 70
    for nb in (1, 3):
        feed = {"anchor_ids": rng.integers(0, be.manifest.target.vocab_size, nb),
                "anchor_position": rng.integers(1, C, nb), "context_mask": (rng.random((nb, C)) > 0.2).astype(np.int64)}
        for name in be.manifest.drafter_context_names():
            feed[name] = rng.standard_normal((nb, cfg.num_key_value_heads, C, cfg.head_dim)).astype(np.float32)
        a, b = std.run(feed)[0], lay.run(feed)[0]
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), nb


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
    inc = Path(__file__).resolve().parents[1] / "build" / "ort-headers" / "x" / "usr" / "include" / "onnxruntime"
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
