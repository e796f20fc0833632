"""Gemma 4 exports in the batched loop: ``make-tiny --arch gemma4 --accepting`` exported at block sizes 2, 4 and 8
(sliding layers in per-slot rings, shared-KV layers), ``generate_batch`` over 40 prompts = the target's
autoregressive output on ONNX Runtime, token for token, with drafts accepted and partial acceptances. (The single
loop, the PyTorch reference and the export itself: tests/test_gemma_target.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_batch_lossless

NEW = 24  # tokens per prompt


@pytest.fixture(scope="module")
def exports(gemma4_exports) -> dict:
    """Block size -> export folder of the accepting Gemma 4 pair (conftest's, shared)."""
    return {bs: gemma4_exports(bs) for bs in (2, 4, 8)}


def test_generate_batch_lossless_at_block_sizes_2_4_8_on_40_prompts(exports):
    """40 prompts of 3-29 tokens: the reference is the target's own greedy decoding on ONNX Runtime (plain steps,
    one prompt at a time); generate_batch at each block size gives it, with drafts accepted and rolled back."""
    import dflash2_trt

    rng = np.random.default_rng(8)
    prompts = [rng.integers(2, 512, int(rng.integers(3, 30))).tolist() for _ in range(40)]
    g = dflash2_trt.load(exports[8], backend="ort")
    try:
        want = [g.generate(p, NEW, chat=False, eos_ids=set(), speculative=False).tokens for p in prompts]
    finally:
        g.close()
    assert_batch_lossless(exports, prompts, want, NEW)
