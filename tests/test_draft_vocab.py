"""``export --draft-vocab N``: the drafter's LM head keeps only its N most frequent token ids.

The restricted head is a PyTorch behaviour first (``DFlash2Drafter.restrict_vocab``), the exported graphs are
verified against it, and decoding through ONNX Runtime stays lossless, with drafts accepted and every drafted
token inside the draft vocabulary."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers import assert_accepts, req
from dflash2_trt import DFlash2Error
from dflash2_trt.model.checkpoint import TOKEN_COUNTS_NAME, draft_vocabulary, load_drafter
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.backends import open_backend
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner

N = 256  # the accepting pair's vocabulary is 512: keep ids 0..255 (the counts below rank them first)
MAX_NEW = 24


@pytest.fixture(scope="module")
def counted_drafter(acc_dir, tmp_path_factory):
    """The accepting drafter with a token_counts.npy that ranks ids 0..N-1 first (descending counts)."""
    d = tmp_path_factory.mktemp("dv") / "drafter"
    shutil.copytree(acc_dir / "drafter", d)
    V = json.loads((d / "config.json").read_text())["vocab_size"]
    np.save(d / TOKEN_COUNTS_NAME, np.arange(V, 0, -1, dtype=np.int64))
    return d


@pytest.fixture(scope="module")
def dv_export(acc_dir, counted_drafter, tmp_path_factory):
    from dflash2_trt.export.exporter import export_model

    out = tmp_path_factory.mktemp("export") / "dv"
    export_model(acc_dir / "target", counted_drafter, out, progress=False, max_seq_len=512, block_size=8,
                 draft_vocab=N)  # verify=True: the graphs are compared with the restricted PyTorch drafter
    return out


def _restricted(path, target, bs=None):
    d = load_drafter(path)
    d.bind_target(target.embed_weight, target.lm_head_weight)
    if bs is not None:
        d = d.at_block_size(bs)
    d.restrict_vocab(torch.from_numpy(draft_vocabulary(d, N)))
    return d.eval()


def test_restricted_head_matches_full_head_on_its_ids(counted_drafter, acc_target):
    """Logits on kept ids equal the full head's; other ids get the lowest logit and are never drafted, in every
    mode, greedy and sampled; token_counts.npy survives save/load."""
    full = load_drafter(counted_drafter)
    assert full.token_counts is not None and full.token_counts[0] > full.token_counts[-1]
    full.bind_target(acc_target.embed_weight, acc_target.lm_head_weight)
    d = _restricted(counted_drafter, acc_target)
    keep = torch.from_numpy(draft_vocabulary(d, N))
    assert keep.tolist() == list(range(N))
    g = torch.Generator().manual_seed(np.random.SeedSequence().entropy % 2**31)
    h = torch.randn(3, d.config.block_size, d.config.hidden_size, generator=g)
    lf, lr = full.logits(h), d.logits(h)
    torch.testing.assert_close(lr[..., keep], lf[..., keep])
    out = torch.ones(lr.shape[-1], dtype=torch.bool)
    out[keep] = False
    assert (lr[..., out] == torch.finfo(lr.dtype).min).all()
    anchors = torch.randint(0, 512, (3,), generator=g)
    for mode in ("greedy", "viterbi", "independent"):
        for T in (0.0, 1.0):
            u = torch.rand(3, d.config.num_draft_rows, generator=g) if T > 0 else None
            dr = d.draft_from_hidden(h, anchors, mode, T, u)
            assert bool((dr.tokens < N).all()), (mode, T)
            assert float(dr.proposal[..., N:].detach().abs().sum()) == 0.0
    # unrestricted greedy drafts outside the kept ids exist for these hidden states (the restriction mattered)
    assert bool((full.draft_from_hidden(h, anchors, "independent").tokens >= N).any())


def test_top_candidates_are_the_full_heads_top_k(counted_drafter, acc_target):
    """``top_candidates`` (what the exported head computes: the top-K among the restricted head's own logits, mapped
    to ids) = the top-K of the full-vocabulary logits, values and ids, for a restricted head whose ids were given
    unsorted (kept ascending, so the order of ids is the full head's) and for the unrestricted head."""
    d = _restricted(counted_drafter, acc_target)
    g = torch.Generator().manual_seed(np.random.SeedSequence().entropy % 2**31)
    ids = torch.randperm(512, generator=g)[:100]  # unsorted
    d.restrict_vocab(ids)
    assert d.draft_vocab.tolist() == sorted(ids.tolist())
    K = d.config.selector_top_k
    h = torch.randn(3, d.config.num_draft_rows, d.config.hidden_size, generator=g)
    full = load_drafter(counted_drafter)
    full.bind_target(acc_target.embed_weight, acc_target.lm_head_weight)
    for m in (d, full):
        unary, cand = m.top_candidates(h, K)
        ref_unary, ref_cand = torch.topk(m.logits(h).float(), K, dim=-1, sorted=True)
        assert torch.equal(unary, ref_unary) and torch.equal(cand, ref_cand)
    assert set(d.top_candidates(h, K)[1].flatten().tolist()) <= set(ids.tolist())


class _Recording:
    """A draft runner that records every proposed token (the path under test)."""

    def __init__(self, runner):
        self.runner, self.tokens = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def propose(self, *args, **kw):
        draft = self.runner.propose(*args, **kw)
        self.tokens += np.asarray(draft.tokens).ravel().tolist()
        return draft


@pytest.mark.parametrize("mode", ["greedy", "viterbi", "independent"])
def test_export_decodes_losslessly_with_drafts_inside_the_vocabulary(dv_export, counted_drafter, acc_target, mode):
    import onnx

    m = json.loads((dv_export / "manifest.json").read_text())
    assert m["draft_vocab"] == N and "skipped" not in m["verification"]
    H, V = m["drafter"]["hidden_size"], m["target"]["vocab_size"]
    for g in ("drafter_head_independent", f"drafter_head_{mode}"):
        head = onnx.load(dv_export / m["graphs"][g]["file"], load_external_data=False)
        shapes = {tuple(i.dims) for i in head.graph.initializer}
        assert (H, N) in shapes and (H, V) not in shapes and (V, H) not in shapes  # the head really is smaller
    be, _ = open_backend(dv_export, "ort")
    target = be.target_runner()
    ref_d = _restricted(counted_drafter, acc_target, bs=8)
    rng = np.random.default_rng(7)
    accepted, drafted = [], []
    for i in range(4):
        hi = N if i < 3 else 512  # the last prompt copies ids the head cannot propose
        p = rng.integers(4, hi, size=int(rng.integers(8, 30))).tolist()
        rec = _Recording(be.draft_runner(mode))
        got = D.speculative_generate(target, rec, p, req(MAX_NEW, eos_ids=set()))
        want = D.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), TorchDraftRunner(ref_d, mode), p,
                                      req(MAX_NEW, eos_ids=set()))
        assert got.tokens == want.tokens and got.accepted == want.accepted  # = the restricted PyTorch drafter
        assert got.tokens == D.target_generate(target, p, req(MAX_NEW, eos_ids=set())).tokens  # lossless
        drafted += rec.tokens
        if i < 3:
            accepted += got.accepted
    assert drafted and max(drafted) < N
    assert_accepts(accepted, 7, mode)


def test_draft_vocab_errors(acc_dir, counted_drafter, acc_target, tmp_path, capsys):
    from dflash2_trt.cli import main

    d = load_drafter(acc_dir / "drafter")  # make-tiny writes no token counts
    with pytest.raises(DFlash2Error, match="token_counts.npy"):
        draft_vocabulary(d, N)
    bad = tmp_path / "bad"
    shutil.copytree(counted_drafter, bad)
    np.save(bad / TOKEN_COUNTS_NAME, np.ones(7))
    with pytest.raises(DFlash2Error, match="non-negative integer counts"):
        load_drafter(bad)
    K = d.config.selector_top_k
    rc = main(["export", "--target", str(acc_dir / "target"), "--drafter", str(counted_drafter), "--out",
               str(tmp_path / "x"), "--draft-vocab", str(K - 1), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "--draft-vocab must be in" in err[0]
    assert not (tmp_path / "x").exists()
