"""Nemotron-H targets (transformers' nemotron_h: Mamba-2, MoE and attention layers): the PyTorch target adapter
against transformers itself, its rollback of the Mamba-2 layers' convolution and SSM states to any accepted length,
lossless speculative decoding with drafts accepted on the accepting pair of ``make-tiny --arch nemotron_h
--accepting``, and two planted rollback bugs the suite must catch (the SSM state kept after all k rows; the
convolution state kept after all k rows). The checks it shares with the hybrid family are written once in
tests/helpers.py."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_trt.runtime import decoder as D
from dflash2_trt.runtime.torch.backend import TorchTargetRunner
from dflash2_trt.targets import nemotron_h
from dflash2_trt.tiny import COPY_PERIOD
from helpers import (adapter_lossless_runs, assert_rolled_back, bound_drafter, check_adapter_equals_transformers,
                     check_adapter_rollback, check_rollback_past_the_recorded_rows_is_refused, make_pair,
                     planted_no_conv_rollback, planted_no_ssm_rollback, req)


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


def test_layer_kinds_and_family(random_target):
    t = random_target
    assert t.family is nemotron_h and t.model.config.model_type == "nemotron_h"
    assert nemotron_h.layer_kinds(t.model.config) == ["linear", "mlp", "attention", "linear"]
    kinds = [type(layer).__name__ for layer in nemotron_h.new_cache(t.model).layers]
    assert kinds == ["LinearAttentionLayer", "DummyLayer", "DynamicLayer", "LinearAttentionLayer"]


def test_adapter_equals_transformers_and_verify_rows_equal_steps(random_target):
    """Prompts of 1..300 tokens (beyond MAX_ROLLBACK_ROWS and several scan chunks: transformers' chunked scan) then
    8 one-row calls: logits = transformers' whole-sequence forward; a k-row call's rows = k one-row calls
    (helpers.check_adapter_equals_transformers)."""
    check_adapter_equals_transformers(random_target, (1, 2, 5, 17, 70, 300))


def test_rollback_to_every_accepted_length_equals_a_fresh_run(random_target):
    """A 4-row call after a 1-row prompt and an 8-row one after 20 rows, each rolled back to every accepted length:
    the attention KV, the convolutions' last inputs and the SSM states (6 tensors) and the next logits = a fresh run
    (helpers.check_adapter_rollback)."""
    check_adapter_rollback(random_target, [(1, 4), (20, 8)])


def test_a_rollback_past_the_recorded_rows_is_refused(random_target):
    check_rollback_past_the_recorded_rows_is_refused(random_target)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts of COPY_PERIOD..40 tokens: the copying target has a token to copy from its first new one."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(COPY_PERIOD, 40))).tolist() for _ in range(n)]


_NEW = 12  # tokens generated per prompt


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
    bad, accepted = adapter_lossless_runs(t, d, prompts, refs, _NEW)
    assert bad == 0
    for bs, acc in accepted.items():
        assert_rolled_back(acc, bs, f"at block size {bs}")


@pytest.mark.parametrize("bug", [planted_no_ssm_rollback, planted_no_conv_rollback], ids=["no_ssm_rollback", "no_conv_rollback"])
def test_planted_rollback_bugs_are_caught(acc_pair, acc_refs, bug, monkeypatch):
    """Negative controls: each planted rollback bug makes speculative output differ from the target's own on the
    accepting pair, so the lossless test above would fail on it."""
    t, d = acc_pair
    prompts, refs = acc_refs
    monkeypatch.setattr(nemotron_h, "rollback", bug)
    bad, _ = adapter_lossless_runs(t, d, prompts[:20], refs[:20], _NEW, block_sizes=(8,))
    assert bad > 0
