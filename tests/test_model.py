"""Drafter model: v1 equivalence at identity init, convolution formula, masking, checkpoints."""

from __future__ import annotations

import numpy as np

import json

import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.config import ARCH_V1, DFlash2Config
from dflash2_trt.model import DFlash2Drafter, DraftContext, load_drafter, save_drafter
from dflash2_trt.model.layers import POST, PRE, DynamicConv

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, vocab_size=97, num_target_layers=6, target_layer_ids=[1, 3],
           block_size=6, mask_token_id=96, selector_rank=10, selector_top_k=8, conv_group_size=8)


def _drafter(seed=0, identity=True, **over):
    torch.manual_seed(seed)
    d = DFlash2Drafter(DFlash2Config(**{**CFG, **over}))
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "conv" not in n and not n.endswith("norm.weight"):
                p.normal_(0, 0.3)
    if not identity:
        with torch.no_grad():
            for n, p in d.named_parameters():
                if "conv" in n:
                    p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(seed + 1)
    d.bind_target(torch.randn(97, 32, generator=g), torch.randn(97, 32, generator=g))
    return d.eval()


def _run(d, n_ctx=7, anchor=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    ctx = DraftContext()
    d.extend_context(ctx, torch.randn(n_ctx, d.config.context_in_features, generator=g), 0)
    h = d.block_forward(torch.tensor([anchor]), torch.tensor([n_ctx]), ctx.k, ctx.v)
    return h, d.draft_from_hidden(h, torch.tensor([anchor]))


def _v1_from(d2):
    v1 = DFlash2Drafter(d2.config.replace(architecture=ARCH_V1, use_conv=False, use_selector=False))
    sd = {k: v for k, v in d2.state_dict().items() if "conv" not in k and "candidate_selector" not in k}
    v1.load_state_dict(sd, strict=True)
    v1.bind_target(d2.embed_weight, d2.lm_head_weight)
    return v1.eval()


def test_identity_init_equals_v1_exactly():
    d2 = _drafter()
    v1 = _v1_from(d2)
    h2, _ = _run(d2)
    h1, dr1 = _run(v1)
    assert torch.equal(h2, h1)  # bit-exact: identity taps are exact in floating point
    d2.set_ablation(use_selector=False)
    assert torch.equal(_run(d2)[1].tokens, dr1.tokens)
    # a selector with zero codebooks scores only the unary term: independent argmax again
    d2.set_ablation(use_selector=True)
    with torch.no_grad():
        d2.candidate_selector.predecessor_codebook.zero_()
    for mode in ("greedy", "viterbi"):
        h, _ = _run(d2)
        assert torch.equal(d2.draft_from_hidden(h, torch.tensor([5]), mode).tokens, dr1.tokens)


def test_trained_convs_change_the_output_and_no_conv_switch_restores_v1():
    d2 = _drafter(identity=False)
    v1 = _v1_from(d2)
    assert not torch.equal(_run(d2)[0], _run(v1)[0])
    d2.set_ablation(use_conv=False)
    assert torch.equal(_run(d2)[0], _run(v1)[0])


def test_conv_matches_formula():
    torch.manual_seed(0)
    conv = DynamicConv(16, 2, 4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 5, 16)
    y = torch.randn(2, 5, 16)
    with torch.no_grad():  # values only: no graph for the scalar comparisons below
        dyn = conv.dynamic(x)  # [2, 5, 2, 2, 4]
        raw = conv.kernel_projection(x)
        for side in (PRE, POST):
            out = conv.mix(y, dyn, side)
            for b in range(2):
                for t in range(5):
                    d = raw[b, t].view(2, 2, 4)
                    for c in range(16):
                        want = sum((conv.base_kernel[side, o, c] + d[side, o, c // 4]) * y[b, t - o, c]
                                   for o in range(2) if t - o >= 0)
                        assert abs(float(out[b, t, c] - want)) < 1e-5


def test_conv_taps_never_look_ahead():
    torch.manual_seed(1)
    conv = DynamicConv(8, 2, 4)
    with torch.no_grad():
        conv.base_kernel.normal_()
    y = torch.randn(1, 4, 8)
    dyn = torch.randn(1, 4, 2, 2, 2)
    out = conv.mix(y, dyn, PRE)
    y2 = y.clone()
    y2[:, 2:] += 5.0
    assert torch.equal(conv.mix(y2, dyn, PRE)[:, :2], out[:, :2])


def test_context_strictly_before_anchor_and_incremental_cache():
    d = _drafter(identity=False)
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(9, d.config.context_in_features, generator=g)
    full = DraftContext()
    d.extend_context(full, feats, 0)
    inc = DraftContext()
    d.extend_context(inc, feats[:4], 0)
    d.extend_context(inc, feats[4:], 4)
    for a, b in zip(full.k, inc.k):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a block anchored at 6 must ignore context rows 6..8 (training-style call with the whole context)
    h_all = d.block_forward(torch.tensor([3]), torch.tensor([6]), full.k, full.v)
    short = DraftContext()
    d.extend_context(short, feats[:6], 0)
    h_short = d.block_forward(torch.tensor([3]), torch.tensor([6]), short.k, short.v)
    torch.testing.assert_close(h_all, h_short, rtol=1e-5, atol=1e-5)
    with pytest.raises(DFlash2Error, match="position"):
        d.extend_context(inc, feats[:1], 3)


def test_head_options():
    d = _drafter(output_multiplier=0.5, final_logit_softcapping=2.0)
    h = torch.randn(3, 32)
    raw = h @ d.lm_head_weight.t()
    torch.testing.assert_close(d.logits(h), torch.tanh(raw * 0.5 / 2.0) * 2.0)
    d = _drafter(input_embedding_scale=3.0, learned_mask_embedding=True)
    with torch.no_grad():
        d.mask_embedding.fill_(0.25)
    x = d.block_embeddings(torch.tensor([4]))
    torch.testing.assert_close(x[0, 0], d.embed_weight[4] * 3.0)
    torch.testing.assert_close(x[0, 1:], torch.full((5, 32), 0.75))


def _spec_names(cfg: DFlash2Config) -> dict[str, tuple]:
    """Tensor names and shapes written out from z-lab's checkpoint format (independent of the model code)."""
    H, V, r, n = cfg.hidden_size, cfg.vocab_size, cfg.selector_rank, len(cfg.target_layer_ids)
    nh, kvh, hd, I = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    G = H // cfg.conv_group_size
    names = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
             "candidate_selector.hidden_projection.weight": (r, H),
             "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        names.update({p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (kvh * hd, H),
                      p + "self_attn.v_proj.weight": (kvh * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                      p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                      p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                      p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                      p + "mlp.down_proj.weight": (H, I)})
        for c in ("attention_conv", "mlp_conv"):
            names[p + c + ".base_kernel"] = (2, 2, H)
            names[p + c + ".kernel_projection.weight"] = (2 * 2 * G, H)
    return names


def test_zlab_names_load(tmp_path):
    from safetensors.torch import save_file

    cfg = DFlash2Config(**CFG)
    names = _spec_names(cfg)
    assert set(names) == set(DFlash2Drafter(cfg).state_dict())
    torch.manual_seed(3)
    tensors = {k: torch.randn(*s).to(torch.bfloat16) for k, s in names.items()}
    cfg.save(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    d = load_drafter(tmp_path)
    for k, v in tensors.items():
        assert torch.equal(d.state_dict()[k], v.float())


def test_v1_checkpoint_loads(tmp_path):
    from safetensors.torch import save_file

    cfg = DFlash2Config(**CFG)
    names = {k: s for k, s in _spec_names(cfg).items() if "conv" not in k and "candidate_selector" not in k}
    d = cfg.to_dict()
    d["architectures"] = ["DFlashDraftModel"]
    d["block_size"] = d["dflash_config"].pop("block_size")
    (tmp_path / "config.json").write_text(json.dumps(d))
    save_file({k: torch.randn(*s) for k, s in names.items()}, str(tmp_path / "model.safetensors"))
    v1 = load_drafter(tmp_path)
    assert v1.config.architecture == ARCH_V1 and not v1.use_conv and not v1.use_selector
    with pytest.raises(DFlash2Error, match="no candidate selector"):
        v1.set_ablation(use_selector=True)


def test_round_trip(tmp_path):
    d = _drafter(identity=False)
    save_drafter(d, tmp_path / "ck")
    e = load_drafter(tmp_path / "ck")
    e.bind_target(d.embed_weight, d.lm_head_weight)
    for k, v in d.state_dict().items():
        assert torch.equal(e.state_dict()[k], v)
    assert torch.equal(_run(d)[1].tokens, _run(e)[1].tokens)
    save_drafter(d, tmp_path / "ck")  # overwrite in place is atomic and leaves no temp folders
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_checkpoint_errors(tmp_path):
    from safetensors.torch import save_file

    d = _drafter()
    save_drafter(d, tmp_path / "ok")
    sd = {k: v.clone() for k, v in d.state_dict().items()}

    def write(name, tensors):
        p = tmp_path / name
        d.config.save(p)
        save_file(tensors, str(p / "model.safetensors"))
        return p

    missing = dict(sd)
    missing.pop("layers.1.mlp_conv.base_kernel")
    with pytest.raises(DFlash2Error, match=r"missing tensor 'layers.1.mlp_conv.base_kernel' \(shape \(2, 2, 32\)\)"):
        load_drafter(write("missing", missing))
    with pytest.raises(DFlash2Error, match="unexpected tensor 'extra.weight'"):
        load_drafter(write("unexpected", {**sd, "extra.weight": torch.zeros(2)}))
    bad = dict(sd)
    bad["fc.weight"] = torch.zeros(32, 10)
    with pytest.raises(DFlash2Error, match=r"'fc.weight' has shape \(32, 10\), the config expects \(32, 64\)"):
        load_drafter(write("shape", bad))
    # truncated / corrupt file
    p = tmp_path / "trunc"
    import shutil

    shutil.copytree(tmp_path / "ok", p)
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlash2Error, match="corrupt or truncated"):
        load_drafter(p)
    # pickle only
    q = tmp_path / "pickle"
    d.config.save(q)
    torch.save(sd, q / "pytorch_model.bin")
    with pytest.raises(DFlash2Error, match="pickle checkpoints are not loaded"):
        load_drafter(q)
    with pytest.raises(DFlash2Error, match="not found"):
        load_drafter(tmp_path / "nope")
    with pytest.raises(DFlash2Error, match="not bound"):
        DFlash2Drafter(d.config).block_embeddings(torch.tensor([1]))


def test_window_mask_is_two_sided_on_non_causal_layers():
    """z-lab: a window hides keys `win` or more behind the query and, off causal layers, block rows that
    far ahead too; context rows stay strictly before the anchor."""
    win = 3
    for causal in (False, True):
        d = _drafter(layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=win,
                     is_causal=causal)
        n, bs = 7, d.config.block_size
        cfg = d.config
        m = torch.cat(d.visibility(torch.tensor([n]), n + 2, cfg.layer_is_causal(0), cfg.layer_window(0)),
                      dim=-1)[0]  # [bs, n + 2 + bs]; slots n, n+1 lie at or after the anchor
        m = torch.cat([m[:, :n], m[:, n + 2:]], dim=-1)  # [bs, n + bs]
        assert not bool(d.visibility(torch.tensor([n]), n + 2, causal, win)[0][0, :, n:].any())
        for qi in range(bs):
            q = n + qi
            for kj in range(n + bs):
                k = kj if kj < n else n + (kj - n)
                want = q - k < win and (k < n or not causal or k <= q)
                if not causal:
                    want = want and k - q < win
                if kj < n:
                    want = want and k < n
                assert bool(m[qi, kj]) == want, (causal, qi, kj)
        # the row-ahead rule is really exercised: block row 0 sees row win-1 but not row win when non-causal
        assert bool(m[0, n + win - 1]) == (not causal) and not bool(m[0, n + win])


def test_use_sliding_window_false_keeps_sliding_layers_causal_without_window():
    d = _drafter(layer_types=["sliding_attention"] * 2, use_sliding_window=False, sliding_window=2)
    n, bs = 9, d.config.block_size
    cfg = d.config
    m = torch.cat(d.visibility(torch.tensor([n]), n, cfg.layer_is_causal(0), cfg.layer_window(0)), dim=-1)[0]
    assert bool(m[:, :n].all())  # no window over the context
    assert torch.equal(m[:, n:], torch.ones(bs, bs, dtype=torch.bool).tril())  # causal, no window


def test_context_buffer_grows_amortised_and_views_match():
    d = _drafter(identity=False)
    g = torch.Generator().manual_seed(9)
    feats = torch.randn(150, d.config.context_in_features, generator=g)
    ctx = DraftContext()
    caps = []
    pos = 0
    for m in [5, 1, 3] * 16 + [2]:
        d.extend_context(ctx, feats[pos:pos + m], pos)
        pos += m
        caps.append(ctx.capacity)
    assert ctx.length == pos == 146 and ctx.k[0].shape[2] == pos
    assert sorted(set(caps)) == [64, 128, 256]  # doubling: 2 re-allocations for 49 appends
    whole = DraftContext()
    d.extend_context(whole, feats[:pos], 0)
    for a, b in zip(ctx.k + ctx.v, whole.k + whole.v):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(rope):
    """Twin: transformers' ROPE_INIT_FUNCTIONS (what z-lab's Qwen3RotaryEmbedding calls)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dflash2_trt.model.layers import rope_inv_freq

    cfg = DFlash2Config(**{**CFG, "head_dim": 32, "rope_theta": 50000.0, "rope_scaling": rope})
    hf = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=32, max_position_embeddings=256,
                     rope_parameters={"rope_theta": 50000.0, **rope})
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, torch.device("cpu"))
    inv, scale = rope_inv_freq(cfg)
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)
    assert not torch.allclose(inv, rope_inv_freq(cfg.replace(rope_scaling=None))[0])  # scaling did something


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "swish"])
def test_activation_and_bias_options(act):
    from transformers.activations import ACT2FN

    d = _drafter(hidden_act=act, attention_bias=True)
    assert d.layers[0].self_attn.q_proj.bias is not None and d.layers[0].self_attn.o_proj.bias is not None
    x = torch.randn(5, 32)
    mlp = d.layers[0].mlp
    torch.testing.assert_close(mlp(x), mlp.down_proj(ACT2FN[act](mlp.gate_proj(x)) * mlp.up_proj(x)),
                               rtol=1e-5, atol=1e-6)
    names = set(d.state_dict())
    assert {"layers.0.self_attn.q_proj.bias", "layers.1.self_attn.o_proj.bias"} <= names


# -- pinned review findings, each failed before its fix ---------------------------------------------------
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_partial_block_walks_the_verified_rows(temp):
    """A final partial block verifies n < L rows: the drafter (``verified_rows=n``) gives the rows past n zero
    hidden states, and its first n drafts and proposals are then the reference Viterbi walk (argmax, or the
    exactly sampled chain) of the n-row lattice. Strong pair terms make the full-length path differ for some
    n, so this fails on a drafter that ignores ``verified_rows``."""
    import dflash2_trt.reference as ref
    from dflash2_trt.config import DFlash2Config
    from dflash2_trt.model import DFlash2Drafter

    torch.manual_seed(0)
    rng = np.random.default_rng(17)
    V, H, bs, K = 64, 32, 8, 8
    L = bs - 1
    d = DFlash2Drafter(DFlash2Config(hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                     target_layer_ids=[1], selector_rank=8, selector_top_k=K, block_size=bs))
    d.bind_target(torch.randn(V, H), torch.randn(V, H))
    cs = d.candidate_selector
    with torch.no_grad():
        cs.predecessor_codebook.normal_(0, 1.0)
        cs.successor_codebook.normal_(0, 1.0)
    A, Bc = cs.predecessor_codebook.detach().numpy(), cs.successor_codebook.detach().numpy()
    differs = 0
    with torch.no_grad():
        for _ in range(12):
            h = torch.randn(1, bs, H)
            a = torch.tensor([int(rng.integers(V))])
            u = torch.from_numpy(rng.random((1, L), dtype=np.float32)) if temp > 0 else None
            full = d.draft_from_hidden(h, a, "viterbi", temp, u)
            unary, cand = torch.topk(d.logits(h[:, 1:]).float(), K, dim=-1)
            g = cs.hidden_projection(h[:, 1:]).float()
            assert torch.equal(d.draft_from_hidden(h, a, "viterbi", temp, u, verified_rows=L).tokens, full.tokens)
            for n in range(1, L):
                got = d.draft_from_hidden(h, a, "viterbi", temp, u, verified_rows=n)
                Sn = ref.lattice(cand[0, :n].numpy(), unary[0, :n].numpy(), g[0, :n].numpy(), int(a), A, Bc)
                idx, q = ref.walk_one(Sn, "viterbi", temp, None if u is None else u[0, :n].numpy())
                assert got.tokens[0, :n].tolist() == cand[0, np.arange(n), idx].tolist(), n
                np.testing.assert_allclose(got.proposal[0, :n].gather(-1, cand[0, :n]).numpy(), q, atol=1e-5)
                differs += got.tokens[0, :n].tolist() != full.tokens[0, :n].tolist()
    assert differs > 0
