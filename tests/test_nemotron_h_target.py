"""Nemotron-H targets (transformers' nemotron_h: Mamba-2, MoE and attention layers): the PyTorch target adapter
against transformers itself, its rollback of the Mamba-2 layers' convolution and SSM states to any accepted length,
lossless speculative decoding with drafts accepted on the accepting pair of ``make-tiny --arch nemotron_h
--accepting``, and two planted rollback bugs the suite must catch (the SSM state kept after all k rows; the
convolution state kept after all k rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2_trt import DFlash2Error
from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch.backend import TorchDraftRunner, TorchTargetRunner
from dflash2_trt.targets import nemotron_h
from dflash2_trt.tiny import COPY_PERIOD
from helpers import assert_accepts, bound_drafter, make_pair, req, with_block_size


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    """A random tiny Nemotron-H target (every layer at full strength: every state matters)."""
    from dflash2_trt.targets.adapter import TargetModel

    return TargetModel.load(make_pair(tmp_path_factory, "nemotron_h", arch="nemotron_h") / "target")


@pytest.fixture(scope="module")
def acc_pair(tmp_path_factory):
    """(target, drafter) of ``make-tiny --arch nemotron_h --accepting``."""
    from dflash2_trt.targets.adapter import TargetModel

    d = make_pair(tmp_path_factory, "nemotron_h_acc", accepting=True, arch="nemotron_h")
    t = TargetModel.load(d / "target")
    return t, bound_drafter(d, t)


def _hf_logits(t, ids: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence, no cache: logits [n, V]."""
    with torch.no_grad():
        return t.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def _states(t) -> list[torch.Tensor]:
    """Every tensor of the adapter's cache that the next call reads: the KV of attention layers, the last
    conv_kernel inputs of each Mamba-2 convolution and its SSM state (MoE layers keep nothing)."""
    out = []
    for layer in t.cache.layers:
        if hasattr(layer, "conv_states"):
            k = layer.conv_kernel_size[0]
            out += [layer.conv_states[0][..., -k:], layer.recurrent_states[0]]
        elif layer.keys is not None:
            out += [layer.keys, layer.values]
    return out


def test_layer_kinds_and_family(random_target):
    t = random_target
    assert t.family is nemotron_h and t.model.config.model_type == "nemotron_h"
    assert nemotron_h.layer_kinds(t.model.config) == ["linear", "mlp", "attention", "linear"]
    kinds = [type(layer).__name__ for layer in nemotron_h.new_cache(t.model).layers]
    assert kinds == ["LinearAttentionLayer", "DummyLayer", "DynamicLayer", "LinearAttentionLayer"]


def test_adapter_equals_transformers_and_verify_rows_equal_steps(random_target):
    """Prompts of 1..300 tokens (beyond MAX_ROLLBACK_ROWS and several scan chunks: transformers' chunked scan) then
    8 one-row calls: logits equal transformers' whole-sequence forward (1e-4 relative); every row of a k-row call
    equals k one-row calls (argmax identical; logits within 3e-5 of the largest)."""
    t = random_target
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17, 70, 300):
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
    """After a k-row call (k = 4 after a 1-row prompt, 8 after 20 rows) rolled back to j + 1 rows (every j < k),
    every state the next call reads -- the attention KV, the convolution's last inputs, the SSM state -- equals a
    fresh run of the prompt and the same j + 1 rows as one-row calls (1e-5 relative), and so do the next call's
    logits (1e-4)."""
    t = random_target
    rng = np.random.default_rng(1)
    for n, k in ((1, 4), (20, 8)):
        ids = rng.integers(2, t.vocab_size, n + k + 1).tolist()
        for j in range(k):
            t.reset([0, 2])
            t.forward(torch.tensor(ids[:n]))
            t.forward(torch.tensor(ids[n: n + k]))
            t.crop(n + j + 1)
            assert t.cache_length == n + j + 1
            nemotron_h.before_forward(t.cache, 1)  # settle, as the next call does
            got = [s.clone() for s in _states(t)]
            assert len(got) == 6  # two Mamba-2 layers (conv, SSM) and one attention layer (K, V)
            nxt = t.forward(torch.tensor([ids[n + k]]))[0]
            t.reset([0, 2])
            t.forward(torch.tensor(ids[:n]))
            for i in range(j + 1):
                t.forward(torch.tensor([ids[n + i]]))
            nemotron_h.before_forward(t.cache, 1)
            for a, b in zip(got, _states(t)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
            fresh = t.forward(torch.tensor([ids[n + k]]))[0]
            torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4 * float(fresh.abs().max()))


def test_a_rollback_past_the_recorded_rows_is_refused(random_target):
    t = random_target
    t.reset([0, 2])
    t.forward(torch.arange(2, 2 + nemotron_h.MAX_ROLLBACK_ROWS + 6))  # a long prompt: not recorded
    with pytest.raises(DFlash2Error, match="cannot roll back"):
        t.crop(10)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts of COPY_PERIOD..40 tokens: the copying target has a token to copy from its first new one."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(COPY_PERIOD, 40))).tolist() for _ in range(n)]


_NEW = 12  # tokens generated per prompt


def _lossless_runs(t, d, prompts, refs, block_sizes=(2, 4, 8)):  # noqa: ANN001, ANN202
    """Speculative greedy decoding of every prompt at each block size -> (mismatches, accepted per block size)."""
    bad, accepted = 0, {}
    for bs in block_sizes:
        db = with_block_size(d, bs)
        acc = accepted.setdefault(bs, [])
        for p, want in zip(prompts, refs):
            r = D.speculative_generate(TorchTargetRunner(t, d.config.target_layer_ids), TorchDraftRunner(db), p,
                                       req(_NEW, eos_ids=set()))
            bad += r.tokens != want
            acc += r.accepted
    return bad, accepted


@pytest.fixture(scope="module")
def acc_refs(acc_pair):
    t, _ = acc_pair
    prompts = _prompts(t.vocab_size, 40, 7)
    return prompts, [D.target_generate(TorchTargetRunner(t), p, req(_NEW, eos_ids=set())).tokens for p in prompts]


def test_lossless_greedy_with_drafts_accepted(acc_pair, acc_refs):
    """40 prompts x block sizes 2, 4, 8 on the accepting pair: speculative greedy output = the target's own, token
    for token, with drafts accepted at every block size and partial acceptances (the Mamba-2 states rolled back to a
    length inside the block)."""
    t, d = acc_pair
    prompts, refs = acc_refs
    bad, accepted = _lossless_runs(t, d, prompts, refs)
    assert bad == 0
    for bs, acc in accepted.items():
        assert_accepts(acc, bs - 1, f"block size {bs}")
        assert any((0 < a or bs == 2) and a < bs - 1 for a in acc), f"no rollback at block size {bs}"


def _no_ssm_rollback(cache, length):  # noqa: ANN001, ANN202
    """Planted bug: the attention KV and the convolutions are rolled back, each Mamba-2 layer's SSM state is the one
    after all k rows."""
    remove = int(cache.get_seq_length()) - length
    if remove <= 0:
        return
    last = {i: layer.recurrent_states[0].clone() for i, layer in enumerate(cache.layers)
            if hasattr(layer, "conv_states")}
    cache.crop(-remove)
    for i, state in last.items():
        cache.layers[i].recurrent_states[0] = state


def _no_conv_rollback(cache, length):  # noqa: ANN001, ANN202
    """Planted bug: KV and the SSM states are rolled back, each convolution state is the one after all k rows."""
    remove = int(cache.get_seq_length()) - length
    if remove <= 0:
        return
    last = {i: layer.conv_states[0][..., -layer.conv_kernel_size[0]:].clone()
            for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states")}
    cache.crop(-remove)
    for i, conv in last.items():
        cache.layers[i].conv_states[0] = conv


@pytest.mark.parametrize("bug", [_no_ssm_rollback, _no_conv_rollback], ids=["no_ssm_rollback", "no_conv_rollback"])
def test_planted_rollback_bugs_are_caught(acc_pair, acc_refs, bug, monkeypatch):
    """Negative controls: each planted rollback bug makes speculative output differ from the target's own on the
    accepting pair, so the lossless test above would fail on it."""
    t, d = acc_pair
    prompts, refs = acc_refs
    monkeypatch.setattr(nemotron_h, "rollback", bug)
    bad, _ = _lossless_runs(t, d, prompts[:20], refs[:20], block_sizes=(8,))
    assert bad > 0
