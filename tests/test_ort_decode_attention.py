"""dflash2.DecodeAttention (plugins/ortDecodeAttention, loaded into ONNX Runtime) and the fused target that runs it: the
op vs its NumPy twin on fresh random inputs (edge sizes: no past, one row, a capacity that is not a multiple of 8, a
head size without the vector path, shared and unshared KV buffers); batches with ragged cached lengths and ragged new
rows (``past_seqlens``: padding rows are zeros and write nothing, a sequence of no rows takes no part) vs the twin,
and every sequence of a batch bit-equal to its own batch-1 call (GroupQueryAttention's inputs: B = 1 unchanged); the
fused target with it vs with ORT's GroupQueryAttention; every row of a k-row call vs k 1-row calls (the lossless
verify: same argmax, logits within 1e-4 relative, bit-equal with this op); speculative = autoregressive decoding on
the accepting pair with drafts accepted. The library's other ops: test_ort_panel_matmul.py (PanelMatMul, weight
codes, kernels per ISA), test_ort_selector_op.py, test_ort_drafter_layer.py. The library is built by
scripts/setup.sh test (scripts/build_ort_ops.sh); where it is missing these tests fail, saying so."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.runtime.ort import decode_attention as DA
from helpers import ort_ops_built  # noqa: F401 - autouse: the custom-op library is built, else every test fails
from helpers import speculative_equals_autoregressive


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
                                                 (4, 4, 12, 21, 17, 3), (6, 2, 32, 40, 31, 9), (2, 1, 8, 8, 0, 8),
                                                 (9, 3, 64, 560, 485, 40), (4, 2, 128, 160, 70, 33)])
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


def _pair_case():  # noqa: ANN202
    """A prefill-sized call (40 rows over 485 cached, d = 64): its rows take whole key blocks two at a time."""
    rng = np.random.default_rng(5)
    nh, kvh, d, cap, past, S = 9, 3, 64, 560, 485, 40
    f = rng.standard_normal((cap, d // 2))
    cos, sin = np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)
    qkv = rng.standard_normal((1, S, (nh + 2 * kvh) * d)).astype(np.float32)
    pk = rng.standard_normal((1, kvh, cap, d)).astype(np.float32)
    pv = rng.standard_normal((1, kvh, cap, d)).astype(np.float32)
    return nh, kvh, d, cap, past, S, cos, sin, qkv, pk, pv


def test_op_rows_in_pairs_equal_single_rows():
    """The kernel takes a whole block of keys for two rows at once (each key and value read once for both): every
    row of a 40-row call is bit-equal to that row's own 1-row call over the same cache, and close to the twin."""
    nh, kvh, d, cap, past, S, cos, sin, qkv, pk, pv = _pair_case()
    scale = float(1 / np.sqrt(d))
    ort, sess = _op_session(nh, kvh, d, cap, scale)
    kb, vb = pk.copy(), pv.copy()
    feed = {"qkv": qkv, "past_key": pk, "past_value": pv, "seqlens_k": np.array([past + S - 1], np.int32),
            "total": np.array(past + S, np.int32), "cos": cos, "sin": sin}
    out = _bind_in_place(ort, sess, feed, kb, vb)[0]  # kb / vb now hold all past + S rows
    want, _, _ = twin(qkv[0], pk[0], pv[0], past, nh, kvh, cos, sin, scale)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    for r in (0, 1, 17, 38, 39):
        one = {**feed, "qkv": qkv[:, r:r + 1], "past_key": kb, "past_value": vb,
               "seqlens_k": np.array([past + r], np.int32), "total": np.array(past + r + 1, np.int32)}
        np.testing.assert_array_equal(sess.run(["out"], one)[0][0, 0], out[r], err_msg=f"row {r}")


@pytest.mark.parametrize("plant", ["DFLASH2_PLANT_ATTENTION_PAIR", "DFLASH2_PLANT_ATTENTION_CUT"])
def test_op_planted_pair_bug_caught(plant):
    """Negative controls: with DFLASH2_PLANT_ATTENTION_PAIR=1 (a pair's second row rescaled by the first row's
    factor) or DFLASH2_PLANT_ATTENTION_CUT=1 (a work item that starts inside a head's rows counts its rows from its
    own start) the comparison with the twin above fails; the same script passes without them. The second shows that
    the 40-row call was cut between rows of a head: B = 1 with 3 key/value heads gives the parallel loop two pieces
    of equal cost per group of 3 query heads (120 queries, cut inside the second head)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys; sys.path.insert(0, {!r}); import test_ort_decode_attention as t; "
              "t.test_op_rows_in_pairs_equal_single_rows()").format(str(Path(__file__).parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH2_PLANT_ATTENTION")}
    clean = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr[-2000:]
    planted = subprocess.run([sys.executable, "-c", script], env={**env, plant: "1"},
                             capture_output=True, text=True)
    assert planted.returncode != 0 and "Not equal to tolerance" in planted.stderr, planted.stderr[-2000:]


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



@pytest.mark.slow
def test_smollm2_k_rows_equal_k_steps():
    """The demo's export (SmolLM2-135M-Instruct fp32, fused): rows of 2..4-row calls vs 1-row calls at 256 and 1000
    cached positions, DecodeAttention (bit-equal) and GroupQueryAttention (within 1e-4 relative, same argmax)."""
    from dflash2_trt.bench.exports import demo_export
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


_ISA_SCRIPT = """
import itertools, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_ort_decode_attention as t
from dflash2_trt.runtime.ort import decode_attention as DA
rng = np.random.default_rng(11)
out = {}
for (nh, kvh), d, past, S in itertools.product([(9, 3), (4, 1)], [24, 32, 64, 128], [0, 33, 485], [1, 2, 5, 40]):
    cap = past + S + 3
    f = rng.standard_normal((cap, d // 2))
    cos, sin = np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)
    B = 2 if S == 5 else 1  # a ragged batch: the second sequence 2 rows fewer, 7 cached fewer
    qkv = rng.standard_normal((B, S, (nh + 2 * kvh) * d)).astype(np.float32)
    pk, pv = (rng.standard_normal((B, kvh, cap, d)).astype(np.float32) for _ in range(2))
    pasts = np.array([past, max(0, past - 7)][:B], np.int32)
    rows = np.array([S, S - 2][:B], np.int32)
    _, sess = t._op_session(nh, kvh, d, cap, 0.0, ragged=True)
    out[f"{nh}_{kvh}_{d}_{past}_{S}"] = sess.run(["out"], {
        "qkv": qkv, "past_key": pk, "past_value": pv, "seqlens_k": (pasts + rows - 1).astype(np.int32),
        "total": np.array(cap, np.int32), "cos": cos, "sin": sin, "past_seqlens": pasts})[0]
np.savez(sys.argv[2], **out)
print(json.dumps(DA.kernel_isa()))
"""


def _outputs_per_isa(tmp_path, extra_env: dict | None = None) -> dict:  # noqa: ANN001
    """The op's outputs over 96 shapes (d 64/128: the blocked kernel with d known at compile time and rows in pairs,
    24/32: with a run-time d; 1..40 rows over
    0..485 cached, a ragged batch) in a process with the AVX-512 build allowed ('wide') and one with
    DFLASH2_ORT_PANELS_AVX512=0 ('base'; the library chooses once per process) -> {run: (kernel_isa, outputs)}."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    runs = {}
    base = {k: v for k, v in os.environ.items() if k != DA.ISA_ENV and not k.startswith("DFLASH2_PLANT_ATTENTION")}
    for name, env in (("wide", {**base, **(extra_env or {})}), ("base", {**base, DA.ISA_ENV: "0"})):
        npz = tmp_path / f"{name}.npz"
        done = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(Path(__file__).parent), str(npz)], env=env,
                              check=True, capture_output=True, text=True)
        with np.load(npz) as z:
            runs[name] = (json.loads(done.stdout.strip().splitlines()[-1]), {k: z[k] for k in z.files})
    return runs


def test_op_isa_builds_agree_bit_for_bit(tmp_path):
    """The blocked kernel's x86-64-v4 (AVX-512) build, which the library takes exactly where its panel kernels run
    AVX-512, gives the baseline (AVX2 + FMA) build's outputs bit for bit. On a CPU without AVX-512 both processes
    run the baseline: the test checks the choice and says (a warning) that the AVX-512 build was not compared."""
    import platform
    import warnings

    runs = _outputs_per_isa(tmp_path)
    flags = set(open("/proc/cpuinfo").read().split()) if platform.machine() == "x86_64" else set()
    want = "avx512" if "avx512f" in flags else "avx2" if platform.machine() == "x86_64" else "portable"
    assert runs["wide"][0] == want and runs["base"][0] == ("portable" if want == "portable" else "avx2")
    assert runs["wide"][1].keys() == runs["base"][1].keys() and len(runs["base"][1]) == 96
    for key, base in runs["base"][1].items():
        assert runs["wide"][1][key].tobytes() == base.tobytes(), f"{key}: the two builds differ"
    if want != "avx512":
        warnings.warn(f"this CPU runs the {want} kernels only: DecodeAttention's AVX-512 build was not compared")


def test_op_planted_isa_bug_caught(tmp_path):
    """Negative control: DFLASH2_PLANT_ATTENTION_WIDE=1 calls the AVX-512 build with a softmax scale one ulp off;
    the bit-for-bit comparison above catches it (on a CPU with AVX-512: elsewhere that build never runs, and the test
    says so)."""
    import warnings

    runs = _outputs_per_isa(tmp_path, {"DFLASH2_PLANT_ATTENTION_WIDE": "1"})
    differ = [k for k, base in runs["base"][1].items() if runs["wide"][1][k].tobytes() != base.tobytes()]
    if runs["wide"][0] != "avx512":
        assert not differ
        warnings.warn("this CPU has no AVX-512: the planted AVX-512 bug cannot run here")
        return
    # most shapes differ (not those whose every row attends to one key: softmax 1 whatever the scale), all within
    # the twin's tolerance
    assert len(differ) > 80
    for k in differ:
        np.testing.assert_allclose(runs["wide"][1][k], runs["base"][1][k], atol=2e-5, rtol=1e-4)
