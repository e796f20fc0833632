"""dflash2.DrafterLayer (plugins/ortDecodeAttention): one drafter decoder layer in one node = the PyTorch layer, and
the export's layers block graph = its standard block graph. The library is built by scripts/setup.sh test
(scripts/build_ort_ops.sh); where it is missing these tests fail, saying so."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.runtime.ort import decode_attention as DA
from helpers import ort_ops_built  # noqa: F401 - autouse: the custom-op library is built, else every test fails


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
