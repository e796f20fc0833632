"""Trainer: block labels/masks vs brute force, loss decreases, exact --resume, train -> generate lossless."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash2_trt.train import data as D


def test_labels_and_masks_equal_brute_force():
    rng = np.random.default_rng(0)
    T, bs = 12, 4
    preds = rng.integers(0, 50, size=T)
    anchors = D.sample_anchors(rng, T, bs, 5)
    lab = D.block_labels(preds, anchors, bs)
    mask = D.context_mask(T, anchors)
    for b, a in enumerate(anchors):
        assert 1 <= a <= T - bs + 1
        for k in range(bs):
            # slot k of the block anchored at a predicts the token at a + k: the target's prediction
            # made at position a + k - 1 (preds[p] is the target's guess for position p + 1)
            want = -100 if k == 0 else preds[a + k - 1]
            assert lab[b, k] == want
        for p in range(T):
            assert mask[b, p] == (p < a)
    assert len(set(anchors.tolist())) == len(anchors)
    w = D.slot_weights(16)
    assert w[0] == 0 and w[1] == 1.0 and abs(w[8] - np.exp(-1.0)) < 1e-12
    assert D.slot_weights(8)[5] == pytest.approx(np.exp(-1.0))


def test_blocks_see_only_context_before_their_anchor(tiny_drafter):
    """compute_loss's batched blocks equal one-at-a-time blocks with a context cut at the anchor."""
    from dflash2_trt.model import DraftContext
    from dflash2_trt.train.trainer import Batch

    d = tiny_drafter
    T = 20
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, T, d.config.context_in_features, generator=g)
    anchors = np.array([3, 9, 14])
    kv = d.context_kv(d.fuse_context(feats), torch.arange(T))
    sel = torch.zeros(3, dtype=torch.long)
    h = d.block_forward(torch.tensor([5, 6, 7]), torch.from_numpy(anchors), [k[sel] for k, _ in kv],
                        [v[sel] for _, v in kv])
    for b, a in enumerate(anchors):
        ctx = DraftContext()
        d.extend_context(ctx, feats[0, :a], 0)
        hb = d.block_forward(torch.tensor([5 + b]), torch.tensor([int(a)]), ctx.k, ctx.v)
        torch.testing.assert_close(h[b: b + 1], hb, rtol=1e-4, atol=1e-5)


def test_trainer_block_equals_what_the_runtime_feeds_the_drafter(acc_target, acc_drafter, tmp_path, monkeypatch):
    """Same text, same anchor: the block compute_loss builds (anchor id, positions, context strictly before the
    anchor from the cached target features, MASK rows) gives the drafter the hidden states the runtime's first
    cycle gives it; the labels are the target's own greedy chain (what verification accepts); slot 0 carries no
    loss. compute_loss runs for real (spied, not replaced)."""
    from dflash2_trt.runtime import decoder
    from dflash2_trt.runtime.torch_backend import TorchDraftSource, TorchTargetRunner
    from dflash2_trt.train.trainer import Batch, build_feature_cache, compute_loss
    from torch_ref import ref_autoregressive

    d, bs = acc_drafter, acc_drafter.config.block_size
    prompt = np.random.default_rng(4).integers(4, 500, 20).tolist()
    text = prompt + ref_autoregressive(acc_target, prompt, 40, eos_ids=set()).tokens  # target-generated text
    tokens = np.asarray([text], dtype=np.int64)  # [1, T]
    feats, preds = build_feature_cache(acc_target, tokens, [0, 2], tmp_path, batch=1, progress=False)
    a = 27  # anchor position (a response position)
    calls = []
    real = d.block_forward

    def spy(anchor_ids, anchor_pos, ctx_k, ctx_v):  # noqa: ANN001
        h = real(anchor_ids, anchor_pos, ctx_k, ctx_v)
        calls.append((anchor_ids.tolist(), anchor_pos.tolist(), h.detach().clone()))
        return h

    monkeypatch.setattr(d, "block_forward", spy)
    b = Batch(seq_rows=np.array([0]), blk_seq=np.array([0]), anchors=np.array([a]),
              labels=D.block_labels(np.asarray(preds[0]), np.array([a]), bs))
    w = torch.from_numpy(D.slot_weights(bs)).float()
    loss, m = compute_loss(d, tokens, feats, b, w)
    assert torch.isfinite(loss) and loss.requires_grad and len(calls) == 1
    (t_anchor, t_pos, t_h), = calls
    assert b.labels[0, 0] == -100 and w[0] == 0  # slot 0: no label, no weight
    assert b.labels[0, 1:].tolist() == text[a + 1: a + bs]  # labels lie on the target's greedy chain

    calls.clear()
    res = decoder.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), TorchDraftSource(d), text[:a], bs,
                                       eos_ids=set())
    r_anchor, r_pos, r_h = calls[0]  # the first cycle: anchor text[a] at position a, context = positions < a
    assert (t_anchor, t_pos) == (r_anchor, r_pos) == ([text[a]], [a])
    torch.testing.assert_close(t_h, r_h, rtol=2e-2, atol=2e-2)  # the trainer caches features in fp16
    assert res.tokens == text[a: a + bs]  # and what the runtime commits is the trainer's label chain


def _tc(tiny_dir, out, **kw):
    from dflash2_trt.train.trainer import TrainConfig

    base = dict(target=str(tiny_dir / "target"), out=str(out), block_size=8, layers=1, selector_rank=16,
                sources=["stdlib"], max_tokens=40 * 64, seq_len=64, steps=30, batch_seqs=4, anchors_per_seq=8,
                lr=3e-3, checkpoint_every=10, log_every=1, cache_dir=str(out) + "-cache", init_from_target=False)
    base.update(kw)
    return TrainConfig(**base)


def test_few_steps_lower_the_loss(tiny_dir, tmp_path):
    from dflash2_trt.train.trainer import train

    train(_tc(tiny_dir, tmp_path / "run"), progress=False)
    logs = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    first = np.mean([m["loss"] for m in logs[:5]])
    last = np.mean([m["loss"] for m in logs[-5:]])
    assert last < first - 0.1, (first, last)
    assert {"loss_lm", "loss_sel", "topk_recall", "slot_loss", "rows_per_s"} <= set(logs[-1])


def test_resume_is_exact(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from dflash2_trt.train.trainer import train

    train(_tc(tiny_dir, tmp_path / "full", steps=6, checkpoint_every=3), progress=False)
    train(_tc(tiny_dir, tmp_path / "part", steps=6, checkpoint_every=3), progress=False, stop_after=3)
    state = json.loads((tmp_path / "part" / "train_state" / "state.json").read_text())
    assert state["step"] == 3
    train(_tc(tiny_dir, tmp_path / "part", steps=6, checkpoint_every=3), progress=False)  # resumes at 3
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c = load_file(str(tmp_path / "part" / "train_state" / "model.safetensors"))
    assert all(torch.equal(c[k], b[k]) for k in b)  # the resume state holds the same weights


def test_trained_checkpoint_decodes_losslessly(tiny_dir, tiny_target, tmp_path, capsys):
    from dflash2_trt.cli import main
    from dflash2_trt.train.trainer import train

    train(_tc(tiny_dir, tmp_path / "ck", steps=10), progress=False)
    rc = main(["generate", "--target", str(tiny_dir / "target"), "--drafter", str(tmp_path / "ck"),
               "--prompt", "def f(x):", "--max-new-tokens", "24", "--check-lossless", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["lossless"] is True


def test_train_cli_errors(tiny_dir, tmp_path, capsys):
    from dflash2_trt.cli import main

    rc = main(["train", "--target", str(tiny_dir / "target"), "--out", str(tmp_path / "x"), "--resume"])
    assert rc == 1 and "no checkpoint" in capsys.readouterr().err
    rc = main(["train", "--target", str(tiny_dir / "target"), "--out", str(tmp_path / "y"), "--data", "mtbench"])
    assert rc == 1 and "unknown data source 'mtbench'" in capsys.readouterr().err


def test_sampled_softmax_vocab_and_loss(tiny_dir, tmp_path):
    """--sampled-softmax: the step's vocabulary holds every label plus N fresh negatives (deterministic in
    (seed, step)); with the whole vocabulary as the subset the loss equals the full-vocab loss; a run with it
    still lowers the loss and resumes exactly."""
    from dflash2_trt.train import data as Dt
    from dflash2_trt.train.trainer import compute_loss, init_drafter, make_batch, prepare, softmax_vocab, train

    lv = np.array([3, 7, 50, 51], dtype=np.int64)
    a = softmax_vocab(5, 0, lv, 1000, 20)
    assert np.array_equal(a, softmax_vocab(5, 0, lv, 1000, 20)) and not np.array_equal(a, softmax_vocab(6, 0, lv, 1000, 20))
    assert set(lv) <= set(a.tolist()) and a.size == 24 and np.all(np.diff(a) > 0)

    tc = _tc(tiny_dir, tmp_path / "s")
    target, cfg, tokens, feats, preds = prepare(tc, progress=False)
    d = init_drafter(cfg, target, 0, False)
    b = make_batch(0, 0, preds, cfg.block_size, 2, 4)
    w = torch.from_numpy(Dt.slot_weights(cfg.block_size)).float()
    full, mf = compute_loss(d, tokens, feats, b, w)
    sub, ms = compute_loss(d, tokens, feats, b, w, np.arange(cfg.vocab_size))
    assert torch.allclose(full, sub, atol=1e-5) and mf["selector_acc"] == ms["selector_acc"]
    with pytest.raises(Exception, match="missing from the step's vocabulary"):
        compute_loss(d, tokens, feats, b, w, np.array([0, 1], dtype=np.int64))

    train(_tc(tiny_dir, tmp_path / "run", sampled_softmax=64), progress=False)
    logs = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert np.mean([m["loss"] for m in logs[-5:]]) < np.mean([m["loss"] for m in logs[:5]]) - 0.1


def test_sources_are_interleaved():
    """A --max-tokens budget must sample every source: texts alternate between sources, one at a time."""
    from itertools import islice

    from dflash2_trt.train.data import iter_pydocs, iter_stdlib, iter_texts

    s, p = list(islice(iter_stdlib(), 3)), list(islice(iter_pydocs(), 3))
    assert list(islice(iter_texts(["stdlib", "pydocs"]), 6)) == [s[0], p[0], s[1], p[1], s[2], p[2]]
    assert list(islice(iter_texts(["stdlib"]), 3)) == s
