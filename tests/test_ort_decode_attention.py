"""dflash2.DecodeAttention (plugins/ortDecodeAttention, loaded into ONNX Runtime) and the fused target that runs it:
the op vs its NumPy twin on fresh random inputs (edge sizes: no past, one row, a capacity that is not a multiple
of 8, a head size without the vector path, shared and unshared KV buffers); the fused target with it vs with ORT's
GroupQueryAttention; every row of a k-row call vs k 1-row calls (the lossless verify: same argmax, logits within
1e-4 relative, bit-equal with this op); speculative = autoregressive decoding on the accepting pair with drafts
accepted. The library is built by scripts/setup.sh test (scripts/build_ort_ops.sh); where it is missing these
tests fail, saying so."""

from __future__ import annotations

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


def _op_session(nh: int, kvh: int, d: int, rope_rows: int, scale: float):  # noqa: ANN202
    import onnxruntime as ort
    from onnx import TensorProto, helper

    F = TensorProto.FLOAT
    node = helper.make_node("DecodeAttention", ["qkv", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
                            ["out", "present_key", "present_value"], domain=DA.OP_DOMAIN, num_heads=nh,
                            kv_num_heads=kvh, scale=scale)
    g = helper.make_graph([node], "t", [
        helper.make_tensor_value_info("qkv", F, [1, "S", (nh + 2 * kvh) * d]),
        helper.make_tensor_value_info("past_key", F, [1, kvh, "C", d]),
        helper.make_tensor_value_info("past_value", F, [1, kvh, "C", d]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("cos", F, [rope_rows, d // 2]),
        helper.make_tensor_value_info("sin", F, [rope_rows, d // 2])],
        [helper.make_tensor_value_info("out", F, None), helper.make_tensor_value_info("present_key", F, None),
         helper.make_tensor_value_info("present_value", F, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DA.OP_DOMAIN, 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(DA.find_library()))
    return ort, ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("nh,kvh,d,cap,past,S", [(9, 3, 64, 256, 200, 4), (9, 3, 64, 256, 0, 7), (4, 2, 16, 13, 9, 1),
                                                 (4, 4, 12, 21, 17, 3), (6, 2, 32, 40, 31, 9), (2, 1, 8, 8, 0, 8)])
def test_op_vs_numpy_twin(nh, kvh, d, cap, past, S):
    """Plain runs (present is a new buffer: slots 0..past-1 copied) and IOBinding with past == present (in place)."""
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
    io = sess.io_binding()
    io.bind_output("out")  # first: get_outputs() follows the binding order
    for name in ("qkv", "seqlens_k", "total", "cos", "sin"):
        io.bind_cpu_input(name, feed[name])
    for name, arr in (("key", kb), ("value", vb)):
        val = ort.OrtValue.ortvalue_from_numpy(arr)
        io.bind_ortvalue_input(f"past_{name}", val)
        io.bind_ortvalue_output(f"present_{name}", val)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(io.get_outputs()[0].numpy(), out)
    np.testing.assert_array_equal(kb[0, :, :n], k[0, :, :n])
    np.testing.assert_array_equal(kb[0, :, n:], pk[0, :, n:])


def test_op_refuses_bad_lengths():
    ort, sess = _op_session(2, 1, 8, 4, 0.3)
    feed = {"qkv": np.zeros((1, 3, 32), np.float32), "past_key": np.zeros((1, 1, 8, 8), np.float32),
            "past_value": np.zeros((1, 1, 8, 8), np.float32), "seqlens_k": np.array([5], np.int32),
            "total": np.array(6, np.int32), "cos": np.zeros((4, 4), np.float32), "sin": np.zeros((4, 4), np.float32)}
    with pytest.raises(Exception, match="seqlens_k out of range"):
        sess.run(None, feed)


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
    from helpers import assert_accepts
    from dflash2_trt.runtime import decoder as D
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(acc_export, attention="decode")
    target, drafter = be.target_runner(), be.draft_runner("greedy")
    rng = np.random.default_rng(11)
    accepted = []
    for _ in range(6):
        p = rng.integers(4, target.vocab_size, int(rng.integers(3, 40))).tolist()
        spec = D.speculative_generate(target, drafter, p, 40, eos_ids=set())
        assert spec.tokens == D.target_generate(target, p, 40, eos_ids=set()).tokens
        accepted += spec.accepted
    assert_accepts(accepted, drafter.block_size - 1, "(DecodeAttention)")


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
