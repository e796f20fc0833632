"""trt.plugins.DFlash2PathSelector run by the custom-op library (plugins/ortDecodeAttention): the selector's plugin
node = the selector's CPU twin and the NumPy reference's paths, mixed input types refused, and an export's plugin
head graph = its decomposed head. The library is built by scripts/setup.sh test (scripts/build_ort_ops.sh); where it
is missing these tests fail, saying so."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.runtime.ort import decode_attention as DA
from helpers import ort_ops_built  # noqa: F401 - autouse: the custom-op library is built, else every test fails


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
