"""Hybrid Gated DeltaNet targets (transformers' qwen3_5 and qwen3_5_moe, the Qwen3.5 family): the PyTorch target
adapter against transformers itself, its rollback of the linear layers' convolution and recurrent states to any
accepted length, lossless speculative decoding with drafts accepted on the accepting hybrid pairs of
``make-tiny --arch ... --accepting``, the sampling law at T = 1, and two planted rollback bugs the suite must catch
(the linear layers' state kept after all k rows; the convolution state not rolled back). The checks it shares
with the Nemotron-H family are written once in tests/helpers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
from dflash2_trt.targets import hybrid
from helpers import (adapter_lossless_runs, assert_rolled_back, bound_drafter, check_adapter_equals_transformers,
                     check_adapter_rollback, check_rollback_past_the_recorded_rows_is_refused, make_pair,
                     planted_no_conv_rollback, req, two_token_law, two_token_p_value, with_block_size)

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


def test_layer_kinds_and_family(random_target):
    t = random_target
    assert t.family is hybrid and t.model.config.model_type in hybrid.MODEL_TYPES
    assert hybrid.layer_kinds(t.model.config) == ["attention", "linear", "linear", "attention"]


def test_adapter_equals_transformers_and_verify_rows_equal_steps(random_target):
    """Prompts of 1..70 tokens (beyond MAX_ROLLBACK_ROWS: the chunked kernel) then 8 one-row calls: logits =
    transformers' whole-sequence forward; a k-row call's rows = k one-row calls
    (helpers.check_adapter_equals_transformers)."""
    check_adapter_equals_transformers(random_target, (1, 2, 3, 5, 17, 70))


def test_rollback_to_every_accepted_length_equals_a_fresh_run(random_target):
    """Calls of 4 and 8 rows after prompts of 1, 6 and 20 rows, each rolled back to every accepted length: the
    attention KV, the convolutions' last inputs, the recurrent states and the next logits = a fresh run
    (helpers.check_adapter_rollback)."""
    check_adapter_rollback(random_target, [(n, k) for n in (1, 6, 20) for k in (4, 8)])


def test_a_rollback_past_the_recorded_rows_is_refused(random_target):
    check_rollback_past_the_recorded_rows_is_refused(random_target)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


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
    bad, accepted = adapter_lossless_runs(t, d, prompts, refs, 24)
    assert bad == 0
    for bs, acc in accepted.items():
        assert_rolled_back(acc, bs, f"at block size {bs}")


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


@pytest.mark.parametrize("bug", [_no_linear_rollback, planted_no_conv_rollback],
                         ids=["no_state_rollback", "no_conv_rollback"])
def test_planted_rollback_bugs_are_caught(acc_pair, acc_refs, bug, monkeypatch):
    """Negative controls: each planted rollback bug makes speculative output differ from the target's own on the
    accepting pair, so the lossless test above would fail on it."""
    t, d = acc_pair
    prompts, refs = acc_refs
    monkeypatch.setattr(hybrid, "rollback", bug)
    bad, _ = adapter_lossless_runs(t, d, prompts[:20], refs[:20], 24, block_sizes=(8,))
    assert bad > 0


def test_sampling_keeps_the_target_law(acc_pair):
    """T = 1 on the accepting hybrid pair: the joint law of the first two tokens (the second from a verified draft
    chain) is the target's own, chi-square against the exact law from one-row forwards; drafts accepted."""
    t, d = acc_pair

    class _Target(TorchTargetRunner):  # two_token_law's interface: reset(), forward(ids) -> (logits, ...)
        def forward(self, ids, last_logits=False):  # noqa: ANN001, ANN202
            logits, feats = super().forward(ids, last_logits)
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
