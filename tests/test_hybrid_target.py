"""Hybrid Gated DeltaNet targets (transformers' qwen3_5 and qwen3_5_moe, the Qwen3.5 family): the PyTorch target
adapter against transformers itself, its rollback of the linear layers' convolution and recurrent states to any
accepted length, lossless speculative decoding with drafts accepted on the accepting hybrid pairs of
``make-tiny --arch ... --accepting``, the sampling law at T = 1, and two planted rollback bugs the suite must catch
(the linear layers' state kept after all k rows; the convolution state not rolled back)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
from dflash2_trt.targets import hybrid
from helpers import assert_accepts, bound_drafter, make_pair, req, two_token_law, two_token_p_value, with_block_size

ARCHS = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=ARCHS)
def random_target(request, tmp_path_factory):
    """A random tiny hybrid target (its linear layers at full strength: every state matters)."""
    from dflash2_trt.targets.adapter import TargetModel

    return TargetModel.load(make_pair(tmp_path_factory, f"hybrid_{request.param}", arch=request.param) / "target")


@pytest.fixture(scope="module", params=ARCHS)
def acc_pair(request, tmp_path_factory):
    """(target, drafter) of ``make-tiny --arch ARCH --accepting``."""
    from dflash2_trt.targets.adapter import TargetModel

    d = make_pair(tmp_path_factory, f"hybrid_acc_{request.param}", accepting=True, arch=request.param)
    t = TargetModel.load(d / "target")
    return t, bound_drafter(d, t)


def _hf_logits(t, ids: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence, no cache: logits [n, V]."""
    with torch.no_grad():
        return t.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def _states(t) -> list[torch.Tensor]:
    """Every tensor of the adapter's cache that the next call reads: KV of attention layers, the last
    conv_kernel inputs of the convolution and the recurrent state of linear layers."""
    out = []
    for layer in t.cache.layers:
        if hasattr(layer, "conv_states"):
            k = layer.conv_kernel_size[0]
            out += [layer.conv_states[0][..., -k:], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


def test_layer_kinds_and_family(random_target):
    t = random_target
    assert t.family is hybrid and t.model.config.model_type in hybrid.MODEL_TYPES
    assert hybrid.layer_kinds(t.model.config) == ["attention", "linear", "linear", "attention"]


def test_adapter_equals_transformers_and_verify_rows_equal_steps(random_target):
    """Prompts of 1..70 tokens (beyond MAX_ROLLBACK_ROWS: the chunked kernel) then calls of 1..8 rows: logits equal
    transformers' whole-sequence forward (1e-4 relative), and every row of a k-row call equals k one-row calls
    (argmax identical; logits within 3e-5 of the largest: PyTorch's k-row and one-row matrix products round
    differently)."""
    t = random_target
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5, 17, 70):
        ids = rng.integers(2, t.vocab_size, n + 8).tolist()
        t.reset([0, 2])
        logits = [t.forward(torch.tensor(ids[:n]))[0]]
        step = [t.forward(torch.tensor(ids[n + i: n + i + 1]))[0] for i in range(8)]
        want = _hf_logits(t, ids)
        got = torch.cat(logits + step)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        for k in (2, 4, 8):
            t.reset([0, 2])
            t.forward(torch.tensor(ids[:n]))
            rows = t.forward(torch.tensor(ids[n: n + k]))[0]
            one = torch.cat(step[:k])
            assert torch.equal(rows.argmax(-1), one.argmax(-1))
            torch.testing.assert_close(rows, one, rtol=1e-4, atol=3e-5 * float(one.abs().max()))


def test_rollback_to_every_accepted_length_equals_a_fresh_run(random_target):
    """After a k-row call (k = 4, 8) rolled back to j + 1 rows (every j < k), every state the next call reads -- the
    attention KV, the convolution's last inputs, the recurrent state -- equals a fresh run of the prompt and the same
    j + 1 rows as one-row calls (1e-5 relative), and so do the next call's logits (1e-4: differences of rounding grow
    through the random layers; a wrong state is off by O(1))."""
    t = random_target
    rng = np.random.default_rng(1)
    for n in (1, 6, 20):
        for k in (4, 8):
            ids = rng.integers(2, t.vocab_size, n + k + 1).tolist()
            for j in range(k):
                t.reset([0, 2])
                t.forward(torch.tensor(ids[:n]))
                t.forward(torch.tensor(ids[n: n + k]))
                t.crop(n + j + 1)
                assert t.cache_length == n + j + 1
                hybrid.before_forward(t.cache, 1)  # settle, as the next call does
                got = [s.clone() for s in _states(t)]
                nxt = t.forward(torch.tensor([ids[n + k]]))[0]
                t.reset([0, 2])
                t.forward(torch.tensor(ids[:n]))
                for i in range(j + 1):
                    t.forward(torch.tensor([ids[n + i]]))
                hybrid.before_forward(t.cache, 1)
                for a, b in zip(got, _states(t)):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
                fresh = t.forward(torch.tensor([ids[n + k]]))[0]
                torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4 * float(fresh.abs().max()))


def test_a_rollback_past_the_recorded_rows_is_refused(random_target):
    t = random_target
    t.reset([0, 2])
    t.forward(torch.arange(2, 2 + hybrid.MAX_ROLLBACK_ROWS + 6))  # a long prompt: not recorded
    with pytest.raises(DFlash2Error, match="cannot roll back"):
        t.crop(10)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


def _lossless_runs(t, d, prompts, refs, block_sizes=(2, 4, 8)):  # noqa: ANN001, ANN202
    """Speculative greedy decoding of every prompt at each block size -> (mismatches, accepted per block size)."""
    bad, accepted = 0, {}
    for bs in block_sizes:
        db = with_block_size(d, bs)
        acc = accepted.setdefault(bs, [])
        for p, want in zip(prompts, refs):
            r = D.speculative_generate(TorchTargetRunner(t, d.config.target_layer_ids), TorchDraftRunner(db), p,
                                       req(24, eos_ids=set()))
            bad += r.tokens != want
            acc += r.accepted
    return bad, accepted


@pytest.fixture(scope="module")
def acc_refs(acc_pair):
    t, _ = acc_pair
    prompts = _prompts(t.vocab_size, 40, 7)
    return prompts, [D.target_generate(TorchTargetRunner(t), p, req(24, eos_ids=set())).tokens for p in prompts]


def test_lossless_greedy_with_drafts_accepted(acc_pair, acc_refs):
    """40 prompts x block sizes 2, 4, 8 on the accepting hybrid pair: speculative greedy output = the target's own,
    token for token, with drafts accepted at every block size (so verifies were rolled back to every length)."""
    t, d = acc_pair
    prompts, refs = acc_refs
    bad, accepted = _lossless_runs(t, d, prompts, refs)
    assert bad == 0
    for bs, acc in accepted.items():
        assert_accepts(acc, bs - 1, f"block size {bs}")
        # rejected drafts: the linear layers' states were rolled back (to a partial block where bs > 2)
        assert any((0 < a or bs == 2) and a < bs - 1 for a in acc), f"no rollback at block size {bs}"


def _no_linear_rollback(cache, length):  # noqa: ANN001, ANN202
    """Planted bug: the attention KV is cropped, the linear layers keep their state after all k rows."""
    remove = int(cache.get_seq_length()) - length
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            layer.cumulative_length_linear.sub_(max(remove, 0))
            for i in range(layer.number_of_states):
                layer.conv_states[i] = layer.conv_states[i][..., -layer.conv_kernel_size[i]:]
                layer.recurrent_states_history[i] = []
        elif remove > 0:
            layer.crop(-remove)


def _no_conv_rollback(cache, length):  # noqa: ANN001, ANN202
    """Planted bug: KV and the recurrent state are rolled back, the convolution state is the one after all k rows."""
    remove = int(cache.get_seq_length()) - length
    if remove <= 0:
        return
    last = {i: layer.conv_states[0][..., -layer.conv_kernel_size[0]:].clone()
            for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states")}
    cache.crop(-remove)
    for i, conv in last.items():
        cache.layers[i].conv_states[0] = conv


@pytest.mark.parametrize("bug", [_no_linear_rollback, _no_conv_rollback], ids=["no_state_rollback", "no_conv_rollback"])
def test_planted_rollback_bugs_are_caught(acc_pair, acc_refs, bug, monkeypatch):
    """Negative controls: each planted rollback bug makes speculative output differ from the target's own on the
    accepting pair, so the lossless test above would fail on it."""
    t, d = acc_pair
    prompts, refs = acc_refs
    monkeypatch.setattr(hybrid, "rollback", bug)
    bad, _ = _lossless_runs(t, d, prompts[:20], refs[:20], block_sizes=(8,))
    assert bad > 0


def test_sampling_keeps_the_target_law(acc_pair):
    """T = 1 on the accepting hybrid pair: the joint law of the first two tokens (the second from a verified draft
    chain) is the target's own, chi-square against the exact law from one-row forwards; drafts accepted."""
    t, d = acc_pair

    class _Target(TorchTargetRunner):  # two_token_law's interface: reset(), forward(ids) -> (logits, ...)
        def forward(self, ids):  # noqa: ANN001, ANN202
            logits, feats = super().forward(ids)
            return np.asarray(logits), feats

    prompt = _prompts(t.vocab_size, 1, 23)[0] * 2  # a repeat: the copying drafter is right
    law = two_token_law(_Target(t, d.config.target_layer_ids), prompt, 1.0)
    db = with_block_size(d, 4)
    runs = [D.speculative_generate(TorchTargetRunner(t, d.config.target_layer_ids), TorchDraftRunner(db), prompt,
                                   req(6, temperature=1.0, eos_ids=set(), seed=s)) for s in range(400)]
    assert sum(sum(r.accepted) for r in runs) > 100
    assert two_token_p_value(law, [(r.tokens[0], r.tokens[1]) for r in runs]) > 1e-3


def test_make_tiny_arch_and_export_refusal(tmp_path, capsys):
    """``make-tiny --arch qwen3_5`` writes a qwen3_5 target; ``dflash2 export`` refuses a hybrid target at bf16 in one
    line (its graphs are verified at fp32 and fp16), exit 1, nothing written."""
    import json

    from dflash2_trt.cli import main

    assert main(["make-tiny", "--out", str(tmp_path / "p"), "--arch", "qwen3_5", "--block-size", "4"]) == 0
    cfg = json.loads((tmp_path / "p" / "target" / "config.json").read_text())
    assert cfg["model_type"] in hybrid.MODEL_TYPES and "linear_attention" in cfg["layer_types"]
    capsys.readouterr()
    assert main(["export", "--target", str(tmp_path / "p" / "target"), "--drafter", str(tmp_path / "p" / "drafter"),
                 "--out", str(tmp_path / "e"), "--quiet", "--dtype", "bf16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exports in fp32 or fp16 without --quantize only" in err[0] and not (tmp_path / "e").exists(), err


def test_training_on_a_hybrid_target(tmp_path):
    """make-data, train and the offline τ on the accepting qwen3_5 pair: left-padded batched generation through the
    linear layers gives every row's features and greedy chain as one unpadded forward does; a few steps from the
    copying drafter train, and its offline τ is the τ of greedy speculative decoding of the same prompts (within 5 %)."""
    from dflash2_trt.runtime.decoder import speculative_generate
    from dflash2_trt.targets.adapter import TargetModel
    from dflash2_trt.tiny import make_tiny
    from dflash2_trt.train.data import GeneratedData
    from dflash2_trt.train.make_data import MakeDataConfig, make_data
    from dflash2_trt.train.trainer import TrainConfig, offline_tau, train

    make_tiny(tmp_path / "p", block_size=8, accepting=True, arch="qwen3_5")
    target = TargetModel.load(tmp_path / "p" / "target")
    rng = np.random.default_rng(5)
    prompts = [{"src": "t", "chat": False, "text": " ".join(["ab cd", "ef gh", "ij"][int(i) % 3] for i in
                                                          rng.integers(0, 3, int(n)))} for n in rng.integers(2, 12, 9)]
    cfg = MakeDataConfig(target=str(tmp_path / "p" / "target"), out=str(tmp_path / "d"), max_new_tokens=24, batch=4,
                         shard_size=4, sample_every=0, n_self=0, target_layer_ids=[0, 2], topk=4)
    make_data(cfg, progress=False, prompts=prompts)
    data = GeneratedData(tmp_path / "d")
    assert len(data) == len(prompts)
    for i in range(len(data)):
        r = data.row(i)
        n = r.tokens.shape[0]
        with torch.no_grad():
            o = target.model(input_ids=torch.from_numpy(r.tokens.astype(np.int64))[None], output_hidden_states=True)
        ref = torch.cat([o.hidden_states[j + 1][0] for j in (0, 2)], -1).numpy()  # [n, 2H]
        np.testing.assert_allclose(np.asarray(r.feats[: n - 1], np.float32), ref[: n - 1], atol=2e-2, rtol=2e-2)
        P = r.prompt_len
        assert np.array_equal(r.tokens[P:], o.logits[0].argmax(-1).numpy()[P - 1: n - 1])
    run = tmp_path / "run"
    d = train(TrainConfig(target=str(tmp_path / "p" / "target"), data=str(tmp_path / "d"), out=str(run), block_size=8,
                          layers=2, selector_rank=24, steps=6, batch_seqs=3, anchors_per_seq=8, lr=1e-4,
                          checkpoint_every=6, log_every=1, init=str(tmp_path / "p" / "drafter"), sampled_softmax=0,
                          eval_rows=4, heldout_shards=1), progress=False).eval()
    assert (run / "model.safetensors").is_file()
    rows = [i for i in range(len(data)) if data.row(i).tokens.shape[0] - data.row(i).prompt_len >= 2]
    est = offline_tau(d, data, np.asarray(rows))
    taus = []
    for i in rows:
        r = data.row(i)
        res = speculative_generate(TorchTargetRunner(target, d.config.target_layer_ids), TorchDraftRunner(d),
                                   r.tokens[: r.prompt_len].tolist(),
                                   req(r.tokens.shape[0] - r.prompt_len, eos_ids=set()))
        assert res.tokens == r.tokens[r.prompt_len:].tolist()
        taus.append(res.stats()["tau"])
    # the offline τ reads make-data's fp16 features, decoding the exact ones: a few drafts differ
    assert est["tau"] > 1.5 and est["tau"] == pytest.approx(float(np.mean(taus)), rel=0.05)


_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def test_qwen3_next_rolls_back_as_qwen3_5(tmp_path):
    """A tiny random qwen3_next target (MoE MLPs, three linear layers per full one) is in the hybrid family: a
    verify's rows equal one-row steps and a rollback continues as the one-row run does; the exporter accepts it
    (tests/test_hybrid_export.py exports one and runs it)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from dflash2_trt.targets.adapter import TargetModel

    torch.manual_seed(0)
    Qwen3NextForCausalLM(Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, layer_types=["linear_attention"] * 3
                                         + ["full_attention"], **_TEXT)).save_pretrained(str(tmp_path / "t"))
    t = TargetModel.load(tmp_path / "t")
    assert t.family is hybrid and hybrid.layer_kinds(t.model.config).count("linear") == 3
    ids = np.random.default_rng(0).integers(2, 512, 20).tolist()
    t.reset([0, 2])
    t.forward(torch.tensor(ids[:10]))
    step = [t.forward(torch.tensor([ids[10 + i]]))[0] for i in range(6)]
    t.reset([0, 2])
    t.forward(torch.tensor(ids[:10]))
    torch.testing.assert_close(t.forward(torch.tensor(ids[10:16]))[0], torch.cat(step), rtol=1e-4, atol=1e-5)
    t.crop(12)
    torch.testing.assert_close(t.forward(torch.tensor([ids[12]]))[0], step[2], rtol=1e-4, atol=1e-5)
    hybrid.check_exportable(t.model)


def test_a_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (vision tower + language model, as the Qwen3.5 releases are) loads as
    its text model: the hybrid family, the same logits as the whole model's on text."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash2_trt.targets.adapter import TargetModel

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    mm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                         **_TEXT), vision_config=vision, tie_word_embeddings=False)).eval()
    mm.save_pretrained(str(tmp_path / "mm"))
    t = TargetModel.load(tmp_path / "mm")
    assert t.family is hybrid and t.num_layers == 4
    ids = torch.randint(2, 512, (9,))
    t.reset([0, 2])
    with torch.no_grad():
        want = mm(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(t.forward(ids)[0], want, rtol=1e-5, atol=1e-5)
