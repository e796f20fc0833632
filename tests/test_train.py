"""Self-distillation data and trainer (docs/training.md) on the tiny pair: make-data captures exactly what a second
pass would give, labels are the generated chain, anchors sit in responses, RoPE θ comes from the target or
fails loudly, sampled softmax / selector candidates, loss decreases, exact --resume, the benchmark filter,
and the offline τ equals the τ of real greedy speculative decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.train import data as D
from helpers import req

PROMPTS = [{"src": "t", "chat": True, "text": t} for t in (
    "Return the sum of a list.", "Hello world!", "The quick brown fox jumps over the lazy dog again and again.",
    "Write a function", "os.path.join", "Explain itertools.chain with an example please.", "Sort a dict by value",
    "What is a closure?", "json dumps indent", "collections Counter most common elements", "textwrap dedent",
    "functools partial")] + [{"src": "t", "chat": False, "text": "def f(x):\n    \"\"\"Return x.\"\"\"\n"}]


@pytest.fixture(scope="module")
def tiny_data(tiny_dir, tmp_path_factory):
    """make-data on the tiny target: 13 prompts, batch 4, shards of 4 (4 shards), every 2nd batch T = 1."""
    from dflash2_trt.train.make_data import MakeDataConfig, make_data

    out = tmp_path_factory.mktemp("data") / "d"
    cfg = MakeDataConfig(target=str(tiny_dir / "target"), out=str(out), max_new_tokens=20, batch=4,
                         shard_size=4, sample_every=2, n_self=0, target_layer_ids=[0, 2], topk=4)
    make_data(cfg, progress=False, prompts=PROMPTS)
    return out, cfg


def test_make_data_rows_equal_a_second_pass(tiny_data, tiny_target):
    """Left-padded batched generation with a KV cache: every row's ids, tap features and top-k equal one
    unpadded forward over the finished row; greedy rows are the target's argmax chain; rows stop at EOS."""
    out, _ = tiny_data
    data = D.GeneratedData(out)
    assert len(data) == len(PROMPTS) and len(data.shards) == 4
    eos = tiny_target.eos_ids()
    temps, stopped = set(), 0
    for i in range(len(data)):
        r = data.row(i)
        temps.add(r.temperature)
        n = r.tokens.shape[0]
        with torch.no_grad():
            o = tiny_target.model(input_ids=torch.from_numpy(r.tokens.astype(np.int64))[None], output_hidden_states=True)
        ref = torch.cat([o.hidden_states[j + 1][0] for j in (0, 2)], -1).numpy()  # [n, 2H]
        np.testing.assert_allclose(np.asarray(r.feats[: n - 1], np.float32), ref[: n - 1], atol=2e-2, rtol=2e-2)
        assert not np.asarray(r.feats[n - 1]).any()  # the last token was never fed
        am = o.logits[0].argmax(-1).numpy()  # [n]
        P = r.prompt_len
        assert np.array_equal(np.asarray(r.topk_ids[P - 1: n - 1, 0]), am[P - 1: n - 1])
        if r.temperature == 0:
            assert np.array_equal(r.tokens[P:], am[P - 1: n - 1])  # the target's own greedy chain
        body = r.tokens[P:-1].tolist()
        assert not (set(body) & eos)  # nothing generated after an EOS
        stopped += int(r.tokens[-1]) in eos
    assert temps == {0.0, 1.0}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["target_layer_ids"] == [0, 2] and meta["n_prompts"] == len(PROMPTS)
    assert stopped + sum(data.row(i).tokens.shape[0] - data.row(i).prompt_len == 20 for i in range(len(data))) \
        == len(PROMPTS)


def test_make_data_resumes_to_identical_shards(tiny_data):
    import shutil

    from dflash2_trt.train.make_data import make_data

    out, cfg = tiny_data
    before = {p.name: (out / "shard-00002" / p.name).read_bytes() for p in (out / "shard-00002").iterdir()}
    shutil.rmtree(out / "shard-00002")
    make_data(cfg, progress=False, prompts=PROMPTS)
    after = {p.name: (out / "shard-00002" / p.name).read_bytes() for p in (out / "shard-00002").iterdir()}
    assert before == after


def test_benchmark_overlap_filter():
    from dflash2_trt.train.prompts import benchmark_texts, ngrams, overlap_filter

    bench = benchmark_texts()
    he = next(t for t in bench if "def " in t)  # a HumanEval prompt
    mt = bench[-1]  # an MT-Bench turn
    w_he = " ".join(list(next(iter(ngrams(he)))))
    w_mt = mt.split()
    seven = " ".join(w_mt[:7])  # 7 words: shorter than the window, must pass
    prompts = [f"Please help: {w_he} thanks", "Tell me about " + " ".join(w_mt[:8]) + ".",
               "Totally unrelated request about gardening tomatoes in spring", seven]
    kept, dropped = overlap_filter(prompts, bench)
    assert dropped == prompts[:2] and kept == prompts[2:]


def test_exclude_skips_the_prompts_of_earlier_folders(tiny_data, tiny_target, monkeypatch):
    """`make-data --exclude DATA`: a prompt an earlier folder already answered is never drawn again."""
    from dflash2_trt.train import prompts as P
    from dflash2_trt.train.make_data import MakeDataConfig, build_prompt_list

    out, cfg = tiny_data
    old = [p["text"] for p in PROMPTS]
    new = ["Name three birds that cannot fly.", "How do tides work?", "def area(r):\n    \"\"\"Circle area.\"\"\"\n"]
    monkeypatch.setattr(P, "sharegpt_first_turns", lambda: old[:12] + new[:2])
    monkeypatch.setattr(P, "stdlib_completion_prompts", lambda: old[12:] + new[2:])
    c = MakeDataConfig(target=cfg.target, out="unused", n_prompts=6, mix=(0.5, 0.5, 0.0), seed=3)
    plist, _ = build_prompt_list(c, tiny_target, [])
    assert len(plist) == 5 and {p["text"] for p in plist} & set(old)  # without --exclude old prompts come back
    c.exclude = (str(out),)
    plist, counts = build_prompt_list(c, tiny_target, [])
    assert sorted(p["text"] for p in plist) == sorted(new)
    assert counts["sharegpt"]["excluded_seen"] == 12 and counts["code"]["excluded_seen"] == 1
    # a drafter's trained_prompts.txt (hashes of every prompt it was trained on) excludes the same prompts
    hashes = out.parent / "drafter" / "trained_prompts.txt"
    hashes.parent.mkdir(exist_ok=True)
    hashes.write_text("# prompts\n" + "".join(P.prompt_hash(t) + "\n" for t in old))
    for ex in (hashes.parent, hashes):
        c.exclude = (str(ex),)
        assert sorted(p["text"] for p in build_prompt_list(c, tiny_target, [])[0]) == sorted(new)
    c.exclude = (str(out.parent),)
    with pytest.raises(DFlash2Error, match="neither a make-data folder"):
        build_prompt_list(c, tiny_target, [])
    hashes.write_text("not-a-hash\n")
    c.exclude = (str(hashes),)
    with pytest.raises(DFlash2Error, match="not a prompt hash"):
        build_prompt_list(c, tiny_target, [])


def test_several_folders_train_together(tiny_dir, tiny_data, tmp_path, capsys):
    """`train --data A B`: rows of both folders, the last shard of each held out (A's rows first); folders
    made with other taps are refused with one line."""
    from dflash2_trt.cli import main
    from dflash2_trt.train.make_data import MakeDataConfig, make_data

    out, cfg = tiny_data
    more = [{"src": "t", "chat": True, "text": t} for t in
            ("Name three birds that cannot fly.", "How do tides work?", "Why is the sky blue?", "Count to five.",
             "What is a prime number?", "Give me a haiku about rain.")]
    b = make_data(MakeDataConfig(**{**cfg.__dict__, "out": str(tmp_path / "b")}), progress=False, prompts=more)
    a_data, both = D.GeneratedData(out), D.GeneratedData([out, b])
    assert len(both) == len(a_data) + len(more) and len(both.shards) == 4 + 2
    tr, held = both.split(1)
    a_tr, a_held = a_data.split(1)
    assert held.tolist() == a_held.tolist() + [len(a_data) + 4, len(a_data) + 5]  # b: shards of 4 + 2 rows
    assert tr.tolist() == a_tr.tolist() + list(range(len(a_data), len(a_data) + 4))
    with pytest.raises(DFlash2Error, match="leaves no training shard"):
        both.split(2)  # b has two shards only
    run = tmp_path / "run"
    rc = main(["train", "--target", cfg.target, "--data", str(out), str(b), "--out", str(run), "--block-size", "4",
               "--steps", "2", "--eval-rows", "2", "--sampled-softmax", "0", "--threads", "1"])
    assert rc == 0
    log = json.loads((run / "train_log.jsonl").read_text().splitlines()[0])
    assert log["train_rows"] == tr.size and log["heldout_rows"] == held.size
    other = make_data(MakeDataConfig(**{**cfg.__dict__, "out": str(tmp_path / "c"), "target_layer_ids": [0, 1]}),
                      progress=False, prompts=more[:4])
    capsys.readouterr()
    rc = main(["eval-tau", "--target", cfg.target, "--drafter", str(run), "--data", str(out), str(other)])
    err = capsys.readouterr().err
    assert rc == 1 and "target_layer_ids" in err and err.count("\n") == 1


def test_labels_are_the_generated_chain_and_anchors_in_responses():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50, size=30)
    P, bs = 11, 6
    for _ in range(20):
        a = D.response_anchors(rng, 30, P, 5)
        assert a.size == 5 and np.all(a >= P) and np.all(a <= 28) and np.all(np.diff(a) > 0)
        lab = D.block_labels(toks, a, bs)
        for b, x in enumerate(a):
            for k in range(bs):
                want = -100 if k == 0 or x + k >= 30 else toks[x + k]
                assert lab[b, k] == want
    assert D.response_anchors(rng, 12, 11, 4).size == 0  # one response token: no label, no anchor
    w = D.slot_weights(16)
    assert w[0] == 0 and w[1] == 1.0 and abs(w[8] - np.exp(-1.0)) < 1e-12


def test_chain_labels_stop_where_the_text_leaves_the_target_chain():
    """Teacher-forced text: slot k = the target's greedy token after a + k - 1 while the text agrees with the
    chain (only the first disagreeing slot differs from the text); anchors only where the text is on the chain."""
    #                 0  1  2  3  4  5  6  7
    tokens = np.array([5, 6, 7, 8, 9, 1, 2, 3])
    greedy = np.array([6, 7, 4, 9, 1, 0, 3, 4])  # greedy[p]: the target's next token after position p
    lab = D.chain_labels(tokens, greedy, np.array([1, 3, 6]), 4)
    I = D.IGNORE
    # a=1: text 7 == greedy[1] (on), text 8 != greedy[2]=4 -> slots 1, 2 labelled; slot 2 = 4 (not the text's 8)
    # a=3: text 9, 1 on the chain, text 2 != greedy[5]=0 -> slots 1..3 = 9, 1, 0
    # a=6: slot 1 = greedy[6] = 3, slot 2 = greedy[7] = 4, slot 3 past the end
    assert lab.tolist() == [[I, 7, 4, I], [I, 9, 1, 0], [I, 3, 4, I]]
    a = D.chain_anchors(np.random.default_rng(0), tokens, greedy, 1, 100)
    assert a.tolist() == [1, 2, 4, 5, 7]  # tokens[a] == greedy[a - 1]


def test_teacher_forced_data_and_training(tiny_dir, tiny_data, tiny_target, tmp_path):
    """make-data --teacher-forced: every row's features and top-k equal one unpadded forward over it, labels come
    from the target's chain, training takes both kinds of folder (every anchor, by epoch), offline τ skips
    teacher-forced rows, and the drafter's trained_prompts.txt lists every prompt and text, inherited ones too."""
    from dflash2_trt.train import prompts as P
    from dflash2_trt.train.make_data import TRAINED_PROMPTS
    from dflash2_trt.train.teacher_force import TeacherForcedConfig, make_teacher_forced
    from dflash2_trt.train.trainer import make_batch, offline_tau, train

    out = tmp_path / "tf"
    make_teacher_forced(TeacherForcedConfig(target=str(tiny_dir / "target"), out=str(out), n_texts=12, max_tokens=64,
                                            min_tokens=8, tokens_per_batch=200, shard_size=6, target_layer_ids=[0, 2],
                                            topk=4, packages=("attr",)))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mode"] == "teacher_forced" and meta["licences"]["pkgcode"]["attr"]["licence"] == "MIT"
    data = D.GeneratedData(out)
    assert len(data) == 12 and len(data.shards) == 2
    agree = []
    for i in range(len(data)):
        r = data.row(i)
        assert r.teacher_forced and r.temperature == 0
        with torch.no_grad():
            o = tiny_target.model(input_ids=torch.from_numpy(r.tokens.astype(np.int64))[None], output_hidden_states=True)
        ref = torch.cat([o.hidden_states[j + 1][0] for j in (0, 2)], -1).numpy()  # [n, 2H]
        np.testing.assert_allclose(np.asarray(r.feats, np.float32), ref, atol=2e-2, rtol=2e-2)
        assert np.array_equal(np.asarray(r.topk_ids[:, 0]), o.logits[0].argmax(-1).numpy())
        agree.append(np.mean(r.tokens[1:] == np.asarray(r.topk_ids[:-1, 0])))
    b = make_batch(0, 0, data, np.arange(len(data)), 4, 3, 0)
    assert (b.labels[:, 1] >= 0).all()  # slot 1 always labelled: the target's own next token
    with pytest.raises(DFlash2Error, match="permissive"):
        make_teacher_forced(TeacherForcedConfig(target=str(tiny_dir / "target"), out=str(tmp_path / "x"),
                                                packages=("tqdm",)))
    # training on generated + teacher-forced folders; the warm start's list is inherited
    init = tmp_path / "init"
    init.mkdir()
    for f in ("config.json", "model.safetensors"):
        (init / f).write_bytes((tiny_dir / "drafter" / f).read_bytes())
    (init / TRAINED_PROMPTS).write_text("# older stage\n0123456789abcdef\n")
    run = tmp_path / "run"
    tc = _tc(tiny_dir, tiny_data[0], run, init=str(init), layers=2, selector_rank=24, steps=1, epochs=0.5,
             anchors_per_seq=0, batch_seqs=4, heldout_shards=1)
    tc.data = [str(tiny_data[0]), str(out)]
    d = train(tc, progress=False)
    logs = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert logs[0]["train_config"]["steps"] == int(np.ceil(0.5 * logs[0]["train_rows"] / 4))  # 0.5 epoch
    listed = P.read_hash_list(run / TRAINED_PROMPTS)
    both = D.GeneratedData([tiny_data[0], out])
    assert listed == {P.prompt_hash(t) for t in both.prompt_texts()} | {"0123456789abcdef"}
    rs = [both.row(i) for i in range(len(both))]
    assert offline_tau(d, both, np.arange(len(both)))["rows"] == sum(
        1 for r in rs if not r.teacher_forced and r.temperature == 0 and r.tokens.shape[0] - r.prompt_len >= 2)


def test_rope_theta_from_rope_parameters_or_loud():
    """The trainer builds the drafter's RoPE with config.rope_from_hf (one reader of HF RoPE fields)."""
    from dflash2_trt.config import rope_from_hf

    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})["rope_theta"] == 1e5
    assert rope_from_hf({"rope_theta": 123.0})["rope_theta"] == 123.0  # transformers 4 layout
    assert rope_from_hf({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}})["rope_scaling"]
    with pytest.raises(DFlash2Error):
        rope_from_hf({})
    with pytest.raises(DFlash2Error):
        rope_from_hf({"rope_parameters": {"rope_theta": "x"}})


def test_smollm2_config_theta_is_read():
    """The real transformers-5 config of a Llama model keeps θ only in rope_parameters."""
    from transformers import LlamaConfig

    from dflash2_trt.config import rope_from_hf

    cfg = LlamaConfig(rope_theta=100000.0)
    assert rope_from_hf(cfg)["rope_theta"] == 100000.0


def _tc(tiny_dir, data, out, **kw):
    from dflash2_trt.train.trainer import TrainConfig

    base = dict(target=str(tiny_dir / "target"), data=str(data), out=str(out), block_size=8, layers=1,
                selector_rank=16, steps=30, batch_seqs=3, anchors_per_seq=8, lr=3e-3, checkpoint_every=10,
                log_every=1, init="random", sampled_softmax=0, eval_rows=4, heldout_shards=2)
    base.update(kw)
    return TrainConfig(**base)


def test_sampled_softmax_vocab_and_selector_candidates(tiny_dir, tiny_data):
    """The step's vocabulary = frequent ids ∪ batch ids ∪ fresh random ids (deterministic per step); over the
    whole vocabulary the loss equals the full-vocab loss; the selector's full-top-K candidates are those of
    decoding (draft_from_hidden)."""
    from dflash2_trt.model.checkpoint import frequent_ids
    from dflash2_trt.train.trainer import (compute_loss, init_drafter, make_batch, prepare,
                                           softmax_vocab)

    counts = np.array([0, 5, 1, 9, 9, 0, 2])
    assert frequent_ids(counts, 3).tolist() == [1, 3, 4]
    fr = np.array([3, 7], dtype=np.int64)
    a = softmax_vocab(5, 0, fr, np.array([50, -100, 51]), 1000, 20)
    assert np.array_equal(a, softmax_vocab(5, 0, fr, np.array([50, -100, 51]), 1000, 20))
    assert not np.array_equal(a, softmax_vocab(6, 0, fr, np.array([50, -100, 51]), 1000, 20))
    assert {3, 7, 50, 51} <= set(a.tolist()) and a.size == 24 and np.all(np.diff(a) > 0)

    out, _ = tiny_data
    tc = _tc(tiny_dir, out, "unused")
    target, cfg, data = prepare(tc)
    d, _ = init_drafter(cfg, target, 0, "random")
    train_rows, _ = data.split(2)
    b = make_batch(0, 0, data, train_rows, cfg.block_size, 3, 4)
    assert np.all(b.anchors >= np.asarray([data.row(int(i)).prompt_len for i in train_rows])[0] * 0)
    w = torch.from_numpy(D.slot_weights(cfg.block_size)).float()
    full, mf = compute_loss(d, b, w, kl_weight=0.5)
    sub, ms = compute_loss(d, b, w, np.arange(cfg.vocab_size), kl_weight=0.5)
    assert torch.allclose(full, sub, atol=1e-5) and mf["selector_acc"] == ms["selector_acc"]
    assert mf["loss_kl"] == pytest.approx(ms["loss_kl"], abs=1e-5)
    with pytest.raises(DFlash2Error, match="missing from the step's vocabulary"):
        compute_loss(d, b, w, np.array([0, 1], dtype=np.int64))
    # a small vocabulary changes the candidates unless the full top-K is asked for
    small = np.union1d(b.labels[b.labels >= 0], np.arange(8))
    _, m_small = compute_loss(d, b, w, small)
    _, m_full = compute_loss(d, b, w, small, selector_full_topk=True)
    assert m_full["topk_recall"] == pytest.approx(mf["topk_recall"]) and m_small["topk_recall"] != mf["topk_recall"]


def _strided_3d_logits(d, nb: int, L: int):
    """The head product as it was: ``d.logits`` fed the strided [nb, L, H] view ``h[:, 1:]`` (a batched matmul),
    as a drop-in for the 2-D call ``logits(rows [nb*L, H]) -> [nb*L, V']``."""
    orig = type(d).logits.__get__(d)

    def logits(h, rows_of_head=None):
        H = h.shape[-1]
        full = torch.cat([h.new_zeros(nb, 1, H), h.reshape(nb, L, H)], 1)  # [nb, L + 1, H]
        return orig(full[:, 1:], rows_of_head).reshape(nb * L, -1)

    return logits


@pytest.mark.parametrize("sampled", [False, True])
def test_head_product_is_one_2d_gemm_with_the_old_loss_and_gradients(tiny_dir, tiny_data, sampled):
    """compute_loss and draft_from_hidden feed the LM head one 2-D [rows, H] matrix (a GEMM; the strided 3-D
    view ran as a batched matmul at 1/9 the speed on a CPU), and the loss, the metrics and every gradient
    equal those of the old 3-D path, on fresh random weights and features."""
    from dflash2_trt.train.trainer import compute_loss, init_drafter, make_batch, prepare

    out, _ = tiny_data
    target, cfg, data = prepare(_tc(tiny_dir, out, "unused"))
    d, _ = init_drafter(cfg, target, int(np.random.default_rng().integers(1 << 30)), "random")
    train_rows, _ = data.split(2)
    b = make_batch(int(np.random.default_rng().integers(1 << 30)), 0, data, train_rows, cfg.block_size, 3, 5)
    b.feats = np.random.default_rng().standard_normal(b.feats.shape).astype(np.float32)
    w = torch.from_numpy(D.slot_weights(cfg.block_size)).float()
    vocab = np.union1d(b.labels[b.labels >= 0], np.arange(0, cfg.vocab_size, 3)) if sampled else None
    seen: list[int] = []
    orig = type(d).logits.__get__(d)
    d.logits = lambda h, rows_of_head=None: (seen.append(h.dim()), orig(h, rows_of_head))[1]
    new_loss, new_m = compute_loss(d, b, w, vocab, kl_weight=0.5 if not sampled else 0.0)
    d.zero_grad(set_to_none=True)
    new_loss.backward()
    new_g = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    assert seen and set(seen) == {2}
    d.logits = _strided_3d_logits(d, b.labels.shape[0], cfg.num_draft_rows)
    old_loss, old_m = compute_loss(d, b, w, vocab, kl_weight=0.5 if not sampled else 0.0)
    d.zero_grad(set_to_none=True)
    old_loss.backward()
    old_g = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    del d.logits
    assert float(new_loss.detach()) == pytest.approx(float(old_loss.detach()), rel=1e-5, abs=1e-6)
    assert new_m["slot_acc"] == old_m["slot_acc"] and new_m.get("selector_acc") == old_m.get("selector_acc")
    assert new_g.keys() == old_g.keys() and len(new_g) > 5
    for n in new_g:
        torch.testing.assert_close(new_g[n], old_g[n], rtol=1e-4, atol=1e-6, msg=n)
    # decoding's head (draft_from_hidden, hence offline τ) takes the same 2-D path, with the same logits
    h = torch.randn(4, cfg.block_size, cfg.hidden_size)
    seen.clear()
    d.logits = lambda x, rows_of_head=None: (seen.append(x.dim()), orig(x, rows_of_head))[1]
    dr = d.eval().draft_from_hidden(h, torch.tensor([1, 2, 3, 4]))
    del d.logits
    assert set(seen) == {2}
    torch.testing.assert_close(dr.logits, orig(h[:, 1:]).float(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained_tiny(tiny_dir, tiny_data, tmp_path_factory):
    """30 steps (KL on, sampled softmax) from the tiny drafter: a drafter that gets drafts accepted."""
    from dflash2_trt.train.trainer import train

    run = tmp_path_factory.mktemp("run") / "r"
    d = train(_tc(tiny_dir, tiny_data[0], run, kl_weight=0.5, sampled_softmax=64, random_negatives=16,
                  init=str(tiny_dir / "drafter"), layers=2, selector_rank=24), progress=False)
    return run, d


def test_few_steps_lower_the_loss_and_resume_is_exact(tiny_dir, tiny_data, trained_tiny, tmp_path):
    from safetensors.torch import load_file

    from dflash2_trt.train.trainer import train

    out, _ = tiny_data
    logs = [json.loads(x) for x in (trained_tiny[0] / "train_log.jsonl").read_text().splitlines()]
    steps = [m for m in logs if "step" in m]
    assert logs[0]["rope_theta"] == 10000.0 and logs[0]["heldout_rows"] == 5
    assert np.mean([m["loss"] for m in steps[-5:]]) < np.mean([m["loss"] for m in steps[:5]]) - 0.1
    assert {"loss_lm", "loss_sel", "loss_kl", "topk_recall", "slot_acc", "rows_per_s"} <= set(steps[-1])
    assert "tau" in logs[-1] and logs[-1]["eval_step"] == 30

    train(_tc(tiny_dir, out, tmp_path / "full", steps=6, checkpoint_every=3), progress=False)
    train(_tc(tiny_dir, out, tmp_path / "part", steps=6, checkpoint_every=3), progress=False, stop_after=3)
    assert json.loads((tmp_path / "part" / "train_state" / "state.json").read_text())["step"] == 3
    train(_tc(tiny_dir, out, tmp_path / "part", steps=6, checkpoint_every=3), progress=False)  # resumes at 3
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warm_start_and_v1_twin(tiny_dir, tiny_data, tmp_path):
    """--init DRAFTER copies every matching tensor (a v1 twin takes the DFlash 2 backbone); the MASK id
    of the warm-start drafter is kept."""
    from dflash2_trt.config import ARCH_V1
    from dflash2_trt.train.trainer import init_drafter, make_drafter_config, prepare

    out, _ = tiny_data
    src = str(tiny_dir / "drafter")
    tc = _tc(tiny_dir, out, "unused", init=src, layers=2, selector_rank=24, use_conv=False, use_selector=False)
    target, cfg, _ = prepare(tc)
    assert cfg.architecture == ARCH_V1 and cfg.mask_token_id == 1
    d, info = init_drafter(cfg, target, 0, src)
    from safetensors.torch import load_file

    ref = load_file(str(tiny_dir / "drafter" / "model.safetensors"))
    assert info["kept_init"] == [] and info["copied"] == len(d.state_dict())
    assert torch.equal(d.state_dict()["layers.0.self_attn.q_proj.weight"], ref["layers.0.self_attn.q_proj.weight"])
    with pytest.raises(DFlash2Error, match="--init-layers"):
        init_drafter(make_drafter_config(_tc(tiny_dir, out, "u"), target, [0, 2]), target, 0, "target", [7])


def test_offline_tau_equals_speculative_decoding(tiny_dir, tiny_data, tiny_target, trained_tiny):
    """The offline τ on generated greedy rows equals the τ (and oracle τ) of greedy speculative decoding of
    the same prompts for the same number of new tokens."""
    from dflash2_trt.bench.oracle import oracle_count
    from dflash2_trt.runtime.decoder import DecodeHooks, speculative_generate
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
    from dflash2_trt.train.data import GeneratedData
    from dflash2_trt.train.trainer import offline_tau

    data = GeneratedData(tiny_data[0])
    d = trained_tiny[1].eval()
    cfg = d.config
    rows = np.arange(len(data))
    greedy = [int(i) for i in rows if data.row(int(i)).temperature == 0 and
              data.row(int(i)).tokens.shape[0] - data.row(int(i)).prompt_len >= 2]
    est = offline_tau(d, data, np.asarray(greedy))
    taus, otaus = [], []
    for i in greedy:
        r = data.row(i)
        n_new = r.tokens.shape[0] - r.prompt_len
        res = speculative_generate(TorchTargetRunner(tiny_target, cfg.target_layer_ids), TorchDraftRunner(d),
                                   r.tokens[: r.prompt_len].tolist(), req(n_new, eos_ids=set()),
                                   DecodeHooks(oracle=oracle_count))
        assert res.tokens == r.tokens[r.prompt_len:].tolist()
        s = res.stats()
        taus.append(s["tau"])
        otaus.append(s["oracle_tau"])
    assert est["rows"] == len(greedy) and est["cycles"] > len(greedy)
    assert est["cum_accept"][0] > 0 and est["oracle_tau"] > est["tau"]  # not a trivial τ = 1 comparison
    assert est["tau"] == pytest.approx(float(np.mean(taus)), abs=0.05)
    assert est["oracle_tau"] == pytest.approx(float(np.mean(otaus)), abs=0.1)


def test_train_cli_errors(tiny_dir, tiny_data, tmp_path, capsys):
    from dflash2_trt.cli import main

    out, _ = tiny_data
    rc = main(["train", "--target", str(tiny_dir / "target"), "--data", str(out), "--out", str(tmp_path / "x"),
               "--resume"])
    assert rc == 1 and "no checkpoint" in capsys.readouterr().err
    rc = main(["train", "--target", str(tiny_dir / "target"), "--data", str(tmp_path), "--out", str(tmp_path / "y")])
    assert rc == 1 and "not a make-data folder" in capsys.readouterr().err
    rc = main(["make-data", "--target", str(tiny_dir / "target"), "--out", str(tmp_path / "z"), "--mix", "1,1,1"])
    assert rc == 1 and "--mix" in capsys.readouterr().err


def test_trainer_block_equals_what_the_runtime_feeds_the_drafter(acc_target, acc_drafter, monkeypatch):
    """Same text, same anchor: the block compute_loss builds (anchor id, positions, context strictly before the
    anchor from the target features, MASK rows) gives the drafter the hidden states the runtime's first cycle
    gives it; the labels are the target's own greedy chain (what verification accepts); slot 0 carries no
    loss. compute_loss runs for real (spied, not replaced)."""
    from torch_ref import ref_autoregressive

    from dflash2_trt.runtime import decoder
    from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
    from dflash2_trt.train.trainer import Batch, compute_loss

    d, bs = acc_drafter, acc_drafter.config.block_size
    prompt = np.random.default_rng(4).integers(4, 500, 20).tolist()
    text = prompt + ref_autoregressive(acc_target, prompt, 40, eos_ids=set()).tokens  # target-generated text
    tokens = np.asarray([text], dtype=np.int64)  # [1, T]
    with torch.no_grad():
        o = acc_target.model(input_ids=torch.from_numpy(tokens), output_hidden_states=True)
    feats = torch.cat([o.hidden_states[j + 1] for j in (0, 2)], -1).to(torch.float16).float().numpy()  # [1, T, F]
    a = 27  # anchor position (a response position)
    calls = []
    real = d.block_forward

    def spy(anchor_ids, anchor_pos, ctx_k, ctx_v):  # noqa: ANN001
        h = real(anchor_ids, anchor_pos, ctx_k, ctx_v)
        calls.append((anchor_ids.tolist(), anchor_pos.tolist(), h.detach().clone()))
        return h

    monkeypatch.setattr(d, "block_forward", spy)
    k = np.zeros((1, bs, 4), np.int64)
    b = Batch(tokens=tokens, feats=feats, blk_seq=np.array([0]), anchors=np.array([a]),
              labels=D.block_labels(tokens[0], np.array([a]), bs), kl_ids=k, kl_logp=k.astype(np.float32))
    w = torch.from_numpy(D.slot_weights(bs)).float()
    loss, m = compute_loss(d, b, w)
    assert torch.isfinite(loss) and loss.requires_grad and len(calls) == 1
    (t_anchor, t_pos, t_h), = calls
    assert b.labels[0, 0] == -100 and w[0] == 0  # slot 0: no label, no weight
    assert b.labels[0, 1:].tolist() == text[a + 1: a + bs]  # labels lie on the target's greedy chain

    calls.clear()
    res = decoder.speculative_generate(TorchTargetRunner(acc_target, [0, 2]), TorchDraftRunner(d), text[:a],
                                       req(bs, eos_ids=set()))
    r_anchor, r_pos, r_h = calls[0]  # the first cycle: anchor text[a] at position a, context = positions < a
    assert (t_anchor, t_pos) == (r_anchor, r_pos) == ([text[a]], [a])
    torch.testing.assert_close(t_h, r_h, rtol=2e-2, atol=2e-2)  # the data stores features in fp16
    assert res.tokens == text[a: a + bs]  # and what the runtime commits is the trainer's label chain


def test_one_gpu_recipe_runs_on_the_cpu_with_the_tiny_pair(tiny_dir, trained_tiny, tmp_path):
    """export/smollm2-drafter-1gpu.sh, every step on the CPU with the tiny pair (DEVICE=cpu, a few prompts, the
    warm start a trained 2-layer tiny drafter with its token counts): make-data --prompts-only writes the prompt
    file it reads (and no shard), held-out and generated data, the calibration run sets --steps, both drafters'
    offline τ on the same held-out rows (block sizes 3 and 4, and 3 with the restricted head), and the fp16 drafter
    comes back in pieces that reassemble into a loadable drafter at block size 3."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dflash2_trt.cli import main
    from dflash2_trt.model import load_drafter

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    assert main(["make-data", "--target", str(tiny_dir / "target"), "--out", str(tmp_path / "P"), "--prompt-file",
                 str(src), "--prompts", "13", "--prompts-only"]) == 0
    listed = [json.loads(line) for line in (tmp_path / "P" / "prompts.jsonl").read_text().splitlines()]
    assert [p["text"] for p in listed] == [p["text"] for p in PROMPTS] and not list((tmp_path / "P").glob("shard*"))
    work = tmp_path / "work"
    env = dict(os.environ, PROMPTS=str(tmp_path / "P" / "prompts.jsonl"), HELD_PROMPTS=str(src),
               TARGET=str(tiny_dir / "target"), INIT=str(trained_tiny[0]), WORK=str(work), DEVICE="cpu",
               N_PROMPTS="8", N_HELD="4", MAX_NEW="12", BATCH="4", BATCH_SEQS="2", ANCHORS="4", LAYERS="2",
               SELECTOR_RANK="24", DRAFT_VOCAB="64", TRAIN_SECONDS="1", DF=f"{sys.executable} -m dflash2_trt.cli")
    r = subprocess.run(["bash", str(root / "export" / "smollm2-drafter-1gpu.sh")], env=env, cwd=root,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    result = work / "result"
    steps = (result / "steps.log").read_text()
    assert all(f"] {i}." in steps for i in range(1, 7))
    n = int(steps.split("4. train: ")[1].split()[0])  # the budget over the calibration's time per step, >= 20
    assert n >= 20 and json.loads((result / "train_log.jsonl").read_text().splitlines()[-1])["step"] == n
    tau = (result / "tau.txt").read_text().splitlines()
    assert len(tau) == 6 and all('"tau"' in line for line in tau), tau
    assert sum('"draft_vocab": 64' in line for line in tau) == 2  # both drafters with the restricted head
    parts = sorted(result.glob("drafter.tgz.part*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    (tmp_path / "back.tgz").write_bytes(b"".join(p.read_bytes() for p in parts))
    subprocess.run(["tar", "-C", str(tmp_path), "-xzf", str(tmp_path / "back.tgz")], check=True)
    d = load_drafter(tmp_path / "fp16")
    assert d.config.block_size == 3 and (tmp_path / "fp16" / "trained_prompts.txt").is_file()
