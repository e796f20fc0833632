"""z-lab compatibility: released DFlash 2 checkpoints read, load and decode as z-lab's own code does.

Data in ``tests/data/zlab`` (see its PROVENANCE.md):

* ``dflash2-config.json`` / ``dflash2-safetensors-header.json``: the config and the safetensors header of a
  released checkpoint, as z-lab keeps them for their tests (facts: names, dtypes, shapes).
* ``released`` / ``window_yarn`` / ``causal_llama3``: small seeded drafters saved by z-lab's reference
  ``DFlash2DraftModel.save_pretrained`` (their checkpoint format, codebooks as ``.weight``), with the
  golden vectors that reference produced (``golden.safetensors``) and ``target.safetensors`` (the target
  embedding and LM head they used). Nothing here is produced by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash2_trt.config import DFlash2Config
from dflash2_trt.model import DFlash2Drafter, DraftContext, load_drafter, save_drafter

DATA = Path(__file__).parent / "data" / "zlab"
VARIANTS = ("released", "window_yarn", "causal_llama3")
TOL = dict(rtol=1e-4, atol=2e-5)  # fp32, different summation orders (z-lab: grouped views; ours: repeat_interleave)


def _golden(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(DATA / "golden" / f"{name}.safetensors"))


def _drafter(name: str) -> DFlash2Drafter:
    from safetensors.torch import load_file

    d = load_drafter(DATA / name)
    t = load_file(str(DATA / "target.safetensors"))
    d.bind_target(t["embed_tokens.weight"], t["lm_head.weight"])
    return d


# ---------------------------------------------------------------------------------------- released facts
def test_released_fixture_config_and_header_match_a_meta_model():
    cfg = DFlash2Config.from_json_file(DATA / "dflash2-config.json")
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None  # θ only in rope_parameters
    assert cfg.use_sliding_window and cfg.sliding_window == 2048 and cfg.is_causal is False
    assert [cfg.layer_window(i) for i in range(5)] == [2048] * 5
    assert not any(cfg.layer_is_causal(i) for i in range(5))
    assert cfg.final_logit_softcapping == 20.0 and cfg.output_multiplier == pytest.approx(0.196116135)
    assert cfg.target_layer_ids == [1, 13, 25, 37, 49] and cfg.block_size == 16 and cfg.mask_token_id == 201818
    header = json.loads((DATA / "dflash2-safetensors-header.json").read_text())
    with torch.device("meta"):
        model = DFlash2Drafter(cfg)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: v["shape"] for k, v in header.items()}
    assert len(theirs) == 81
    assert ours == theirs


def test_saved_config_is_what_zlab_loaders_read(tmp_path):
    """Round trip of the fixture: one θ field, z-lab's model_type, no nulls where z-lab calls float()."""
    from transformers import Qwen3Config

    cfg = DFlash2Config.from_json_file(DATA / "dflash2-config.json")
    cfg.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["DFlash2DraftModel"]
    assert "rope_theta" not in saved and "rope_scaling" not in saved
    assert saved["rope_parameters"] == {"rope_theta": 500000.0, "rope_type": "default"}
    null_keys = [k for k, v in {**saved, **saved["dflash_config"]}.items() if v is None]
    assert null_keys == []
    # every field of the released config survives with its value (the file-only ones excepted)
    original = json.loads((DATA / "dflash2-config.json").read_text())
    for k, v in original.items():
        if k not in ("dtype", "transformers_version"):
            assert saved[k] == v, k
    # what z-lab's loader sees: transformers' Qwen3Config + dflash_config lookups with float()
    hf = Qwen3Config(**{k: v for k, v in saved.items() if k not in ("architectures", "model_type")})
    assert hf.rope_parameters["rope_theta"] == 500000.0 and hf.sliding_window == 2048
    assert hf.layer_types == cfg.layer_types and hf.head_dim == 128 and hf.rms_norm_eps == 1e-5
    dc = saved["dflash_config"]
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        float(dc.get(key, getattr(hf, key, default)))  # z-lab's _draft_value + float(): must not raise
    assert DFlash2Config.from_json_file(tmp_path) == cfg


# ---------------------------------------------------------------------------------------- golden vectors
@pytest.mark.parametrize("name", VARIANTS)
def test_reproduces_zlab_reference(name):
    d = _drafter(name)
    gold = _golden(name)
    cfg = d.config
    if name == "window_yarn":  # the cases this variant exists for are really in play
        assert cfg.rope_type == "yarn" and cfg.layer_window(0) == 5 < cfg.block_size and cfg.attention_bias
        assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.input_embedding_scale == 1.5
    if name == "causal_llama3":
        assert cfg.rope_type == "llama3" and cfg.layer_window(0) is None and cfg.layer_is_causal(0)
    singles = sorted({k.split(".")[0] for k in gold if k.startswith("single")})
    assert len(singles) == 4
    with torch.no_grad():
        for s in singles:
            feats, anchor = gold[f"{s}.context"], gold[f"{s}.anchor"]  # [n, 3H], [1]
            n = feats.shape[0]
            ctx = DraftContext()
            d.extend_context(ctx, feats, 0)
            h = d.block_forward(anchor, torch.tensor([n]), ctx.k, ctx.v)[0]  # [bs, H]
            torch.testing.assert_close(h, gold[f"{s}.hidden"], **TOL)
            draft = d.draft_from_hidden(h[None], anchor)
            torch.testing.assert_close(draft.logits[0], gold[f"{s}.logits"], **TOL)
            # z-lab's top-K is unsorted: order theirs by score (no ties in these random fp32 logits)
            order = gold[f"{s}.unary"].argsort(dim=-1, descending=True)  # [L, K]
            cand_z = gold[f"{s}.cand"].gather(-1, order)
            assert torch.equal(draft.cand[0], cand_z)
            lat = gold[f"{s}.lattice"]  # [L, K_prev, K_cur] in z-lab's candidate order
            prev_order = torch.cat([torch.zeros(1, lat.shape[1], dtype=torch.long), order[:-1]])  # row 0: anchor
            lat_sorted = torch.stack([lat[t][prev_order[t]][:, order[t]] for t in range(lat.shape[0])])
            from dflash2_trt.model import selector as sel

            cs = d.candidate_selector
            unary = torch.topk(draft.logits[0], cfg.selector_top_k, dim=-1).values
            ours = sel.lattice(draft.cand, unary[None], cs.hidden_projection(h[None, 1:]), anchor,
                               cs.predecessor_codebook, cs.successor_codebook)[0]
            torch.testing.assert_close(ours, lat_sorted, **TOL)
            assert draft.tokens[0].tolist() == gold[f"{s}.path"].tolist()
        # a batch of blocks sharing one context length: greedy paths identical, block by block
        feats, anchors = gold["batch.context"], gold["batch.anchor"]  # [B, n, 3H], [B]
        B, n = feats.shape[:2]
        kv = d.context_kv(d.fuse_context(feats), torch.arange(n))
        h = d.block_forward(anchors, torch.full((B,), n), [k for k, _ in kv], [v for _, v in kv])
        torch.testing.assert_close(h, gold["batch.hidden"], **TOL)
        tokens = d.draft_from_hidden(h, anchors).tokens
        assert tokens.tolist() == gold["batch.path"].tolist()


def test_our_save_reloads_identically_with_released_names(tmp_path):
    """save_drafter writes the released bare codebook names; reloading gives the same drafts."""
    from safetensors import safe_open

    d = _drafter("released")
    save_drafter(d, tmp_path / "ck")
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "candidate_selector.predecessor_codebook" in names
    assert not any(k.endswith("codebook.weight") for k in names)
    e = load_drafter(tmp_path / "ck")
    e.bind_target(d.embed_weight, d.lm_head_weight)
    gold = _golden("released")
    feats, anchors = gold["batch.context"], gold["batch.anchor"]
    B, n = feats.shape[:2]
    with torch.no_grad():
        kv = e.context_kv(e.fuse_context(feats), torch.arange(n))
        h = e.block_forward(anchors, torch.full((B,), n), [k for k, _ in kv], [v for _, v in kv])
    assert e.draft_from_hidden(h, anchors).tokens.tolist() == gold["batch.path"].tolist()


def test_codebook_alias_both_names_refused(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash2_trt import DFlash2Error

    shutil.copytree(DATA / "released", tmp_path / "ck")
    t = load_file(str(tmp_path / "ck" / "model.safetensors"))
    t["candidate_selector.predecessor_codebook"] = t["candidate_selector.predecessor_codebook.weight"].clone()
    save_file(t, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(DFlash2Error, match="appears twice"):
        load_drafter(tmp_path / "ck")


@pytest.mark.parametrize("name", VARIANTS)
def test_export_graph_modules_reproduce_zlab_reference(name):
    """The ONNX drafter graphs (as torch modules, before export) give z-lab's block hidden states too."""
    from dflash2_trt.export.onnx_graphs import DrafterBlockGraph, DrafterContextGraph

    d = _drafter(name)
    gold = _golden(name)
    ctx_graph, block_graph = DrafterContextGraph(d), DrafterBlockGraph(d)
    with torch.no_grad():
        for j in (1, 3):
            feats, anchor = gold[f"single{j}.context"], gold[f"single{j}.anchor"]
            n, cap = feats.shape[0], feats.shape[0] + 5  # 5 unused slots that the mask must hide
            padded = torch.cat([feats, torch.randn(5, feats.shape[1])])[None]  # [1, cap, 3H]
            kv = ctx_graph(padded, torch.arange(cap)[None])
            mask = (torch.arange(cap) < n).long()[None]
            h = block_graph(anchor, torch.tensor([n]), mask, *kv)[0]
            torch.testing.assert_close(h, gold[f"single{j}.hidden"], **TOL)


def test_cli_selector_precision_reaches_the_selector(tiny_dir, monkeypatch, capsys):
    from dflash2_trt.cli import main
    from dflash2_trt.model import selector as sel

    seen = []
    real = sel.lattice

    def spy(*a, **k):
        seen.append(a[6] if len(a) > 6 else k.get("precision", "fp32"))
        return real(*a, **k)

    monkeypatch.setattr(sel, "lattice", spy)
    rc = main(["generate", "--target", str(tiny_dir / "target"), "--drafter", str(tiny_dir / "drafter"),
               "--prompt", "hello", "--max-new-tokens", "4", "--no-oracle", "--selector-precision", "bf16", "--json"])
    assert rc == 0 and seen and set(seen) == {"bf16"}
    # exported selector graphs are fp32: refused in one line, exit 1, not ignored
    assert main(["generate", "--model-dir", str(tiny_dir), "--prompt", "x", "--selector-precision", "bf16"]) == 1
    assert "--selector-precision applies to --target/--drafter" in capsys.readouterr().err
