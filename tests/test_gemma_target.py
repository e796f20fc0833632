"""The Gemma 4 family (``gemma``) on tiny random configurations of transformers' own model (sliding and global layers
with their own head sizes and RoPE, keys = values in the global layers, the last layers sharing earlier layers' keys
and values, logit soft-capping, sqrt(hidden) embedding scale): the PyTorch adapter against transformers on prompts of
1-300 tokens, a verify's rows = one-row steps, a rollback to every accepted length = a fresh run of the accepted prefix
(every cached key and value compared; the family's kinds and lossless greedy decoding with drafts accepted and
rejected at every length are checked with the other families' in tests/test_target_families.py), the multimodal folder loaded as its text model, ``make-tiny --arch gemma4 --accepting`` (drafts accepted, some
partially), the pair exported and decoded on ONNX Runtime and its batched loop, the drafter side (the target's
embedding scale and soft cap applied, as z-lab's Gemma 4 drafters do; RoPE from the drafter's own config), and
three planted bugs caught: a shared layer attending over its own rows instead of its source layer's cache (PyTorch)
or over an unwritten buffer of its own (the graph), and a drafter without the soft cap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch.backend import TorchTargetRunner
from dflash2_trt.targets import gemma
from helpers import GEMMA4_TEXT, NoisyOracle, assert_accepts, bound_drafter, req

_TEXT = GEMMA4_TEXT


def _text_model():  # noqa: ANN202
    import transformers

    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**_TEXT)).eval()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dflash2_trt.targets.adapter import TargetModel

    folder = tmp_path_factory.mktemp("gemma4_text")
    _text_model().save_pretrained(str(folder))
    return TargetModel.load(folder)


def test_shared_layers_sources(target):
    """Each shared layer's source is the layer transformers stores for it (the last unshared one of its type), every
    other layer its own (the family and layer kinds: tests/test_target_families.py)."""
    cfg = target.model.config
    src, modes = gemma.kv_sources(cfg), cfg.kv_sharing_modes
    assert src == [0, 1, 2, 1, 1, 2]
    assert all((modes[i] == "reuse") == (s != i) and (s == i or modes[s] == "store") for i, s in enumerate(src))


def _chunks(target, ids: list[int], sizes: list[int]) -> torch.Tensor:  # noqa: ANN001
    target.reset([0, 2])
    out, at = [], 0
    for n in sizes:
        out.append(target.forward(torch.tensor(ids[at:at + n]))[0])
        at += n
    return torch.cat(out)


def test_logits_equal_transformers_on_1_to_300_tokens(target):
    """Prompts of 1, 2, 9, 40 and 300 tokens: the adapter's prefill = transformers' whole-sequence forward within
    1e-4 (relative), and 300 tokens fed as a prefill, one-row steps and verify-sized chunks = the same."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 9, 40, 300):
        ids = rng.integers(2, 512, n).tolist()
        with torch.no_grad():
            want = target.model(input_ids=torch.tensor([ids])).logits[0].float()
        tol = dict(rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        torch.testing.assert_close(_chunks(target, ids, [n]), want, **tol)
        if n == 300:
            torch.testing.assert_close(_chunks(target, ids, [150] + [1] * 6 + [8, 3, 16, 5] * 4 + [8, 8]),
                                       want, **tol)


def _states(target) -> list[torch.Tensor]:  # noqa: ANN001
    """Every key and value a next call reads: a sliding layer's last window - 1, a full layer's all."""
    w = int(target.model.config.sliding_window)
    out = []
    for layer, kind in zip(target.cache.layers, gemma.layer_kinds(target.model.config)):
        if getattr(layer, "keys", None) is None:  # a shared layer: transformers keeps no cache for it
            continue
        for x in (layer.keys, layer.values):
            out.append(x[:, :, -(w - 1):] if kind == "sliding" else x)
    return out


def test_verify_rows_and_rollback_to_every_accepted_length(target):
    """An 8-row verify's rows = one-row steps; rolled back to each accepted length j + 1, every cached key and value
    equals a fresh run of the accepted prefix's, and so does the next row's logits."""
    ids = np.random.default_rng(1).integers(2, 512, 40).tolist()
    steps = [_chunks(target, ids, [20])] + [target.forward(torch.tensor([ids[20 + i]]))[0] for i in range(9)]
    for j in range(8):
        target.reset([0, 2])
        target.forward(torch.tensor(ids[:20]))
        rows = target.forward(torch.tensor(ids[20:28]))[0]
        torch.testing.assert_close(rows, torch.cat(steps[1:9]), rtol=1e-4, atol=3e-5 * float(rows.abs().max()))
        target.crop(21 + j)
        got = _states(target)
        _chunks(target, ids, [21 + j])
        want = _states(target)
        assert len(got) == len(want) == 6
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        target.reset([0, 2])
        target.forward(torch.tensor(ids[:20]))
        target.forward(torch.tensor(ids[20:28]))
        target.crop(21 + j)
        nxt = target.forward(torch.tensor([ids[21 + j]]))[0]
        torch.testing.assert_close(nxt, steps[j + 2], rtol=1e-4, atol=1e-4 * float(nxt.abs().max()))


def _own_rows_only(forward):  # noqa: ANN001, ANN202
    """The planted bug: a shared layer attends causally over the keys and values of its own call's rows (what a cache
    of its own, never written by its source layer, would give it) instead of its source layer's whole cache."""
    def planted(self, hidden_states, position_embeddings, attention_mask, shared_kv_states,  # noqa: ANN001, ANN202
                cache=None, **kw):  # noqa: ANN001
        if self.is_kv_shared_layer:
            S = hidden_states.shape[1]
            k, v = shared_kv_states[self.layer_type]
            shared_kv_states = {self.layer_type: (k[:, :, -S:], v[:, :, -S:])}
            attention_mask = None if S > 1 else attention_mask[..., -1:] if attention_mask is not None else None
        return forward(self, hidden_states, position_embeddings, attention_mask, shared_kv_states, cache, **kw)

    return planted


def test_a_shared_layer_reading_its_own_rows_is_caught(target, monkeypatch):
    """Negative control: with shared layers attending over their own rows, a prefill + steps differs from
    transformers' whole-sequence forward by far more than the tolerance of the comparisons above."""
    from transformers.models.gemma4 import modeling_gemma4 as mg

    ids = np.random.default_rng(0).integers(2, 512, 40).tolist()
    with torch.no_grad():
        want = target.model(input_ids=torch.tensor([ids])).logits[0].float()
    monkeypatch.setattr(mg.Gemma4TextAttention, "forward", _own_rows_only(mg.Gemma4TextAttention.forward))
    got = _chunks(target, ids, [20] + [1] * 20)
    assert (got - want).abs().max() > 1e-2 * float(want.abs().max())


def test_the_multimodal_folder_loads_its_text_model(tmp_path):
    """A Gemma4ForConditionalGeneration folder (as released) loads as Gemma4ForCausalLM with the language model's
    weights: its logits = the multimodal model's on text; a folder missing a language weight is refused."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    from dflash2_trt.targets.adapter import TargetModel

    torch.manual_seed(1)
    text = {k: v for k, v in _TEXT.items() if k not in ("tie_word_embeddings",)}
    mm = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text, audio_config=None, tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16))).eval()
    mm.save_pretrained(str(tmp_path / "mm"))
    t = TargetModel.load(tmp_path / "mm")
    assert type(t.model).__name__ == "Gemma4ForCausalLM" and t.family is gemma
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"] == "gemma4"
    ids = torch.tensor([np.random.default_rng(4).integers(2, 512, 30).tolist()])
    with torch.no_grad():
        want = mm(input_ids=ids).logits[0]
    t.reset([0])
    torch.testing.assert_close(t.forward(ids[0])[0], want, rtol=1e-5, atol=1e-5)
    sd = load_file(str(tmp_path / "mm" / "model.safetensors"))
    del sd["model.language_model.layers.2.self_attn.k_proj.weight"]
    save_file(sd, str(tmp_path / "mm" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlash2Error, match="layers.2.self_attn.k_proj.weight"):
        TargetModel.load(tmp_path / "mm")


@pytest.fixture(scope="module")
def accepting(tmp_path_factory):
    """``make-tiny --arch gemma4 --accepting --block-size 8``: (pair folder, target, bound drafter)."""
    from dflash2_trt.cli import main
    from dflash2_trt.targets.adapter import TargetModel

    pair = tmp_path_factory.mktemp("gemma4_pair")
    assert main(["make-tiny", "--out", str(pair), "--arch", "gemma4", "--accepting", "--block-size", "8"]) == 0
    t = TargetModel.load(pair / "target")
    d = bound_drafter(pair, t)
    t.check_drafter(d.config)
    return pair, t, d


def _decode(t, d, n_prompts: int = 4) -> tuple[int, list[int]]:  # noqa: ANN001
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner

    rng = np.random.default_rng(11)
    bad, accepted = 0, []
    for _ in range(n_prompts):
        p = rng.integers(2, 512, int(rng.integers(3, 20))).tolist()
        want = D.target_generate(TorchTargetRunner(t), p, req(32, eos_ids=set())).tokens
        r = D.speculative_generate(TorchTargetRunner(t, d.config.target_layer_ids), TorchDraftRunner(d), p,
                                   req(32, eos_ids=set()))
        bad += r.tokens != want
        accepted += r.accepted
    return bad, accepted


def test_make_tiny_accepting_pair_is_lossless_with_drafts_accepted(accepting):
    """The copying Gemma 4 target and its drafter: speculative greedy = autoregressive on 4 prompts x 32 tokens, most
    drafts accepted and some cycles stopping mid-block (the target's departures)."""
    _, t, d = accepting
    assert t.model.config.model_type == "gemma4_text" and t.family is gemma
    bad, accepted = _decode(t, d)
    assert bad == 0
    assert np.mean(accepted) >= 3 and any(0 < a < 7 for a in accepted), np.bincount(accepted, minlength=8)


def test_the_drafter_applies_the_targets_embedding_scale_and_soft_cap(accepting):
    """A drafter sharing a Gemma 4 target's embedding and LM head takes the target's sqrt(hidden) scale and soft cap
    (written into its config when it leaves them unset): its block embeddings = transformers' scaled embedding of
    [anchor, MASK...], its logits = transformers' soft cap of the LM head's products. A drafter config setting
    another cap is refused."""
    _, t, d = accepting
    assert d.config.input_embedding_scale == pytest.approx(8.0) and d.config.final_logit_softcapping == 10.0
    anchors = torch.tensor([5, 77])
    ids = torch.cat([anchors[:, None], torch.full((2, 7), d.config.mask_token_id)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(d.block_embeddings(anchors), t.model.model.embed_tokens(ids))
        h = torch.randn(3, 64) * 4
        cap = t.model.config.final_logit_softcapping
        want = torch.tanh(t.model.lm_head(h) / cap) * cap  # Gemma4ForCausalLM.forward's soft cap
        torch.testing.assert_close(d.logits(h), want)
    bad = d.config.replace(final_logit_softcapping=30.0)
    with pytest.raises(DFlash2Error, match="final_logit_softcapping 30.0 != the target's 10.0"):
        t.check_drafter(bad)


def test_a_drafter_without_the_soft_cap_is_caught(accepting, monkeypatch):
    """Negative control: the family's drafter fields dropped (a drafter bound without the soft cap and embedding
    scale) -> the drafter's logits are not the target's capped ones (the test above fails)."""
    from dflash2_trt.model import load_drafter

    pair, t, _ = accepting
    monkeypatch.setattr(gemma, "drafter_fields", lambda config: {})
    d = load_drafter(pair / "drafter")
    t.check_drafter(d.config)
    d.bind_target(t.embed_weight, t.lm_head_weight)
    assert d.config.final_logit_softcapping is None and d.config.input_embedding_scale is None
    h = torch.randn(3, 64) * 4
    with torch.no_grad():
        cap = t.model.config.final_logit_softcapping
        assert (d.logits(h) - torch.tanh(t.model.lm_head(h) / cap) * cap).abs().max() > 1.0


def test_the_drafter_rope_comes_from_its_own_config(accepting, tmp_path):
    """The drafter's RoPE is read from its own config only: a target whose config declares the interleaved layout
    (is_neox_style false, as GLM's) leaves the neox drafter's draft unchanged; a drafter config declaring the
    interleaved layout is refused in one line (only neox is implemented); a Gemma 4 target's per-layer-type RoPE
    gives a drafter the full layers' θ (proportional RoPE without its partial factor: default)."""
    from dflash2_trt.config import DFlash2Config, rope_from_hf
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner

    _, t, d = accepting
    rng = np.random.default_rng(2)
    p = rng.integers(2, 512, 24).tolist()

    def draft() -> list[int]:
        r = D.speculative_generate(TorchTargetRunner(t, d.config.target_layer_ids), TorchDraftRunner(d), p,
                                   req(16, eos_ids=set()))
        return r.tokens + r.accepted

    before = draft()
    t.model.config.is_neox_style = False
    try:
        assert draft() == before
    finally:
        del t.model.config.is_neox_style
    raw = d.config.to_dict()
    assert DFlash2Config.from_dict({**raw, "is_neox_style": True}).rope_theta == d.config.rope_theta
    with pytest.raises(DFlash2Error, match="is_neox_style is False: only the neox"):
        DFlash2Config.from_dict({**raw, "is_neox_style": False})
    assert rope_from_hf(t.model.config) == {"rope_theta": 1e8, "rope_scaling": None}
    per_type = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "proportional", "factor": 8.0,
                                                       "partial_rotary_factor": 0.25, "rope_theta": 1e6}}}
    assert rope_from_hf(per_type) == {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


def test_muse_glimmer_assistant_is_refused_in_one_line(accepting):
    from dflash2_trt.config import DFlash2Config

    raw = {**accepting[2].config.to_dict(), "model_type": "muse_glimmer_assistant"}
    with pytest.raises(DFlash2Error, match="muse_glimmer_assistant") as e:
        DFlash2Config.from_dict(raw)
    assert "\n" not in str(e.value)



@pytest.fixture(scope="module")
def exported(accepting, tmp_path_factory):
    """The accepting pair exported (max 128 positions; rings of 8 + 16 slots)."""
    from dflash2_trt.export.exporter import export_model

    out = tmp_path_factory.mktemp("gemma4_export") / "e"
    export_model(accepting[0] / "target", accepting[0] / "drafter", out, progress=False, max_seq_len=128)
    return out


def test_export_and_decode_on_ort(accepting, exported):
    """``dflash2 export`` of the copying Gemma 4 pair (the export check ran: a prompt wrapping the rings, a verify cut
    back): every node in TensorRT's parser table; the graph's logits within 1e-4 (relative) of transformers' over a
    prompt and one-row steps, a verify's rows = one-row calls; greedy speculative decoding on ONNX Runtime = its
    autoregressive output on 40 prompts (= transformers' greedy output on 6 of them), drafts accepted (some
    partially)."""
    import onnx

    from dflash2_trt.export.onnx_utils import trt_parser_refusals
    from dflash2_trt.runtime.ort.backend import OrtBackend

    _, t, d = accepting
    be = OrtBackend(exported)
    m = be.manifest
    assert m.target.model_type == "gemma4_text" and m.target.layer_kinds == ("sliding", "attention") * 2
    assert (m.target.num_key_value_heads, m.target.head_dim) == gemma.kv_layout(t.model.config) == (1, 32)
    assert m.target.sliding_window.ring_slots == 24
    assert trt_parser_refusals(onnx.load(str(exported / "target.onnx"), load_external_data=False)) == []
    ids = np.random.default_rng(2).integers(2, 512, 40).tolist()
    with torch.no_grad():
        want = t.model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    r = be.target_runner()
    got = np.concatenate([r.forward(ids[:30])[0]] + [r.forward([x])[0] for x in ids[30:]])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    r.reset()
    r.forward(ids[:30])
    assert np.abs(r.forward(ids[30:38])[0] - got[30:38]).max() <= 1e-5 * np.abs(want).max()
    rng = np.random.default_rng(11)
    bad, accepted = 0, []
    for i in range(40):
        p = rng.integers(2, 512, int(rng.integers(3, 20))).tolist()
        ar = D.target_generate(be.target_runner(), p, req(32, eos_ids=set())).tokens
        if i < 6:  # transformers' own greedy decoding (the PyTorch reference is slower: a few prompts)
            assert ar == D.target_generate(TorchTargetRunner(t), p, req(32, eos_ids=set())).tokens
        sp = D.speculative_generate(be.target_runner(), be.draft_runner("greedy"), p, req(32, eos_ids=set()))
        bad += sp.tokens != ar
        accepted += sp.accepted
    assert bad == 0
    assert_accepts(accepted, 7, "Gemma 4 on ONNX Runtime")  # ~2.5 drafts accepted per cycle, every count seen
    assert np.mean(accepted) >= 2 and any(0 < a < 7 for a in accepted), np.bincount(accepted, minlength=8)


def test_ort_lossless_at_block_sizes_2_4_8_on_40_prompts(exported):
    """The exported Gemma 4 target on ONNX Runtime with the noisy oracle drafter at block sizes 2, 4 and 8 over 40
    prompts each: speculative greedy = autoregressive, drafts accepted and rejected at every length (so every layer
    kind's buffer, shared ones included, was cropped at every depth)."""
    from dflash2_trt.runtime.ort.backend import OrtBackend

    be = OrtBackend(exported)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 512, int(rng.integers(3, 20))).tolist() for _ in range(40)]
    wants = [D.target_generate(be.target_runner(), p, req(24, eos_ids=set())).tokens for p in prompts]
    for bs in (2, 4, 8):
        oracle = type("Oracle", (NoisyOracle,), {"block_size": bs, "num_draft_rows": bs - 1})
        bad, accepted = 0, []
        for p, want in zip(prompts, wants):
            r = D.speculative_generate(be.target_runner(), oracle(p + want), p, req(24, eos_ids=set()))
            bad += r.tokens != want
            accepted += r.accepted
        assert bad == 0 and set(range(bs)) <= set(accepted), (bs, sorted(set(accepted)))


def test_generate_batch_equals_single_requests(exported):
    """generate_batch over 6 prompts (the batched loop over the standard graph: per-slot rings wrapping, every shared
    layer's buffer written with its source's keys) = each prompt's own generate, token for token."""
    import dflash2_trt

    g = dflash2_trt.load(exported, backend="ort")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(2, 512, int(rng.integers(3, 30))).tolist() for _ in range(6)]
    singles = [g.generate(p, 32, chat=False, eos_ids=set(), proposer="dflash2", guard=False) for p in prompts]
    batch = g.generate_batch(prompts, 32, chat=False, eos_ids=set(), proposer="dflash2", max_batch=4, adaptive=False)
    assert [r.tokens for r in batch] == [r.tokens for r in singles]
    assert_accepts([a for r in batch for a in r.stats.accepted], 7, "generate_batch")


def _shared_presents_zeroed(forward):  # noqa: ANN001, ANN202
    """The planted graph bug: a shared layer's own buffer is never written with its source layer's keys and values
    (its ``present`` is zeros), so it attends over an empty cache of its own."""
    def planted(self, *args):  # noqa: ANN001, ANN202
        out = list(forward(self, *args))
        for i, src in enumerate(self.sources):
            if src != i:
                out[2 + 2 * i], out[3 + 2 * i] = torch.zeros_like(out[2 + 2 * i]), torch.zeros_like(out[3 + 2 * i])
        return tuple(out)

    return planted


def test_a_shared_layer_reading_an_unwritten_cache_fails_the_export_check(accepting, tmp_path, monkeypatch):
    """Negative control: the graph with shared layers' buffers left unwritten differs from transformers once a call
    reads cached keys, and the export check refuses it."""
    from dflash2_trt.export.exporter import export_model

    monkeypatch.setattr(gemma.TargetGraph, "forward", _shared_presents_zeroed(gemma.TargetGraph.forward))
    with pytest.raises(DFlash2Error, match="differs from PyTorch"):
        export_model(accepting[0] / "target", accepting[0] / "drafter", tmp_path / "e", progress=False,
                     max_seq_len=64)


_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)  # the 26B-A4B's shape


@pytest.fixture
def one_thread():
    """torch on one thread for the test: tiny models' ops, where a second thread only waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_26b_a4b_shape_exports_losslessly(tmp_path, monkeypatch, one_thread):
    """The 26B-A4B's shape -- every layer an MLP beside 4 routed experts (2 per token, per-expert scales drawn away
    from 1), global layers whose keys are their values, shared layers -- with make-tiny's drafter: the PyTorch adapter
    = transformers over a prefill, steps and verify-sized chunks; exported, the graph's logits within 1e-4 (relative)
    of transformers' over a prompt and one-row steps (rows routed to different experts); greedy speculative decoding
    on ONNX Runtime = its autoregressive output with the noisy oracle at block sizes 2 and 8 (drafts accepted and
    rejected at every length) = transformers' greedy output. Negative control: the graph without its routed experts (the MLP alone)
    differs from transformers."""
    import json
    import shutil

    import transformers

    from dflash2_trt.export.exporter import export_model
    from dflash2_trt.runtime.ort.backend import OrtBackend
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.tiny import make_tiny

    torch.manual_seed(2)
    m = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**_TEXT, **_MOE})).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.router.per_expert_scale.uniform_(0.5, 1.5)
    assert all(layer.enable_moe_block for layer in m.model.layers)
    assert [layer.self_attn.v_proj is None for layer in m.model.layers[:3]] == [False, False, True]  # keys = values
    make_tiny(tmp_path / "pair", seed=0, block_size=8)
    m.save_pretrained(str(tmp_path / "t"))
    for f in (tmp_path / "pair" / "target").iterdir():  # the tokenizer
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, tmp_path / "t" / f.name)
    cfg = tmp_path / "pair" / "drafter" / "config.json"  # make-tiny's drafter, for a target of 6 layers
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "num_target_layers": 6}))
    t = TargetModel.load(tmp_path / "t")
    ids = np.random.default_rng(6).integers(2, 512, 60).tolist()
    with torch.no_grad():
        want = m(input_ids=torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_chunks(t, ids, [30] + [1] * 6 + [8] * 3), want, rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()))
    export_model(tmp_path / "t", tmp_path / "pair" / "drafter", tmp_path / "e", progress=False, max_seq_len=128)
    be = OrtBackend(tmp_path / "e")
    r = be.target_runner()
    got = np.concatenate([r.forward(ids[:30])[0]] + [r.forward([x])[0] for x in ids[30:40]])
    assert np.abs(got - want[:40].numpy()).max() <= 1e-4 * float(want.abs().max())
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 512, int(rng.integers(3, 20))).tolist() for _ in range(4)]
    wants = [D.target_generate(be.target_runner(), p, req(20, eos_ids=set())).tokens for p in prompts]
    assert wants[:2] == [D.target_generate(TorchTargetRunner(t), p, req(20, eos_ids=set())).tokens
                         for p in prompts[:2]]
    for bs in (2, 8):
        oracle = type("Oracle", (NoisyOracle,), {"block_size": bs, "num_draft_rows": bs - 1})
        runs = [D.speculative_generate(be.target_runner(), oracle(p + w), p, req(20, eos_ids=set()))
                for p, w in zip(prompts, wants)]
        accepted = [a for x in runs for a in x.accepted]
        assert [x.tokens for x in runs] == wants and {0, bs - 1} <= set(accepted), (bs, sorted(set(accepted)))

    def graph_logits() -> torch.Tensor:  # the exporter's graph module in PyTorch, over the first 40 tokens
        KVH, Dh = gemma.kv_layout(m.config)
        x = torch.tensor([ids[:40]])
        with torch.no_grad():
            return gemma.TargetGraph(m, [0, 2])(x, torch.arange(40)[None], torch.ones(1, 40, dtype=torch.long),
                                                torch.zeros(1, 0, dtype=torch.long),
                                                *[torch.zeros(1, KVH, 0, Dh)] * 12)[0][0]

    scale = float(want.abs().max())
    assert (graph_logits() - want[:40]).abs().max() <= 1e-4 * scale
    monkeypatch.setattr(gemma, "_feed_forward", lambda layer, h: layer.mlp(layer.pre_feedforward_layernorm(h)))
    assert (graph_logits() - want[:40]).abs().max() > 1e-2 * scale


def test_what_the_graph_does_not_compute_is_refused_in_one_line(tmp_path):
    """Per-layer-input embeddings (the small "E" Gemma 4 models) are refused by the export check in one line (the
    graph has no per-layer inputs); the PyTorch adapter runs them: its logits = transformers' over a prefill, steps and
    a verify-sized chunk."""
    import transformers

    from dflash2_trt.targets.adapter import TargetModel

    torch.manual_seed(0)
    m = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**_TEXT, "hidden_size_per_layer_input": 8}))
    with pytest.raises(DFlash2Error, match="per-layer-input embeddings") as e:
        gemma.check_exportable(m)
    assert "\n" not in str(e.value)
    ids = np.random.default_rng(0).integers(2, 512, 30).tolist()
    with torch.no_grad():
        want = m.eval()(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_chunks(TargetModel(m), ids, [20, 1, 1, 8]), want, rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()))
